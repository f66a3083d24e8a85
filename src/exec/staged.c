/* Staged streams (staged.h): the window discipline over a memory kind's executor. */
#include "exec/staged.h"

#include <kvwire/kvwire.h>

#include <stdlib.h>

struct kvw_staged {
    const kvw_memops_t *mem;
    int device;
    bool gather;
    void *stream;      /* the kind's stream over the plan */
    struct kvw_plan *owned;
    uint8_t *buf[2];   /* gather: the windows' host buffers (one on the host) */
    int slot[2];       /* the window started into buf[k], -1 when none is in flight */
    uint64_t lo, hi;   /* the window started and not taken */
    bool pending;
    int next;          /* the buffer of the next window started */
};

kvw_status_t kvw__staged_open(const kvw_memops_t *mem, int device, struct kvw_plan *plan,
                              bool own_plan, bool gather, uint64_t wmax, kvw_staged_t **s_p)
{
    kvw_staged_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        if (own_plan)
            kvw_plan_destroy(plan);
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory opening a staged stream");
    }
    s->owned = own_plan ? plan : NULL;
    s->mem = mem;
    s->device = device;
    s->gather = gather;
    s->slot[0] = s->slot[1] = -1;
    kvw_status_t st = mem->select(device);
    if (st == KVW_OK)
        st = mem->stream_open(plan, gather, &s->stream);
    for (int k = 0; st == KVW_OK && gather && k < (mem->async_windows ? 2 : 1); k++)
        st = mem->window_buf(k, wmax, &s->buf[k]);
    if (st != KVW_OK) {
        kvw__staged_close(s);
        return st;
    }
    *s_p = s;
    return KVW_OK;
}

kvw_status_t kvw__staged_gather(kvw_staged_t *s, uint64_t lo, uint64_t hi)
{
    if (!s->gather || s->pending)
        return kvw__error(KVW_ERR_INTERNAL, "staged stream: %s", s->gather
                          ? "a gathered window was not taken before the next one"
                          : "a scattering stream cannot gather");
    s->lo = lo, s->hi = hi;
    s->pending = true;
    if (!s->mem->async_windows)
        return KVW_OK; /* gathered when taken, into the one buffer */
    int k = s->next;
    kvw_status_t st = s->mem->select(s->device);
    if (st == KVW_OK)
        st = s->mem->window(s->stream, s->buf[k], lo, hi, &s->slot[k]);
    return st;
}

kvw_status_t kvw__staged_take(kvw_staged_t *s, const uint8_t **buf_p)
{
    if (!s->pending)
        return kvw__error(KVW_ERR_INTERNAL, "staged stream: no gathered window to take");
    int k = s->next;
    s->pending = false;
    kvw_status_t st;
    if (s->mem->async_windows) {
        st = s->mem->window_wait(s->stream, s->slot[k]);
        s->slot[k] = -1;
        s->next = 1 - k; /* this buffer is on the wire until the next take */
    } else {
        int slot = -1;
        st = s->mem->window(s->stream, s->buf[k], s->lo, s->hi, &slot);
        kvw_status_t st2 = s->mem->window_wait(s->stream, slot);
        if (st == KVW_OK)
            st = st2;
    }
    *buf_p = s->buf[k];
    return st;
}

kvw_status_t kvw__staged_scatter(kvw_staged_t *s, const uint8_t *buf, uint64_t lo, uint64_t hi)
{
    if (s->gather)
        return kvw__error(KVW_ERR_INTERNAL, "staged stream: a gathering stream cannot scatter");
    int slot = -1;
    kvw_status_t st = s->mem->select(s->device);
    if (st == KVW_OK)
        st = s->mem->window(s->stream, (uint8_t *)buf, lo, hi, &slot);
    kvw_status_t st2 = s->mem->window_wait(s->stream, slot);
    return st != KVW_OK ? st : st2;
}

void kvw__staged_close(kvw_staged_t *s)
{
    if (s == NULL)
        return;
    /* A gather still running on an error path must finish before its buffer (and the
     * plan it reads) is released. */
    for (int k = 0; k < 2; k++)
        if (s->slot[k] >= 0)
            (void)s->mem->window_wait(s->stream, s->slot[k]);
    if (s->stream)
        s->mem->stream_close(s->stream);
    kvw_plan_destroy(s->owned);
    free(s);
}
