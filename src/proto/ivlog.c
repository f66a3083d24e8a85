#include "proto/ivlog.h"

#include <stdlib.h>

kvw_status_t kvw__ivlog_add(kvw_ivlog_t *log, uint64_t region, uint64_t off, uint64_t len)
{
    if (log->n) {
        kvw_iv_t *last = &log->v[log->n - 1];
        if (last->region == region && last->hi == off) {
            last->hi = off + len;
            return KVW_OK;
        }
    }
    if (log->n == log->cap) {
        uint32_t cap = log->cap ? log->cap * 2 : 16;
        if (cap <= log->cap)
            return kvw__error(KVW_ERR_NO_MEMORY, "too many separate writes in one room");
        kvw_iv_t *v = realloc(log->v, sizeof(*v) * cap);
        if (v == NULL)
            return kvw__error(KVW_ERR_NO_MEMORY, "out of memory recording writes");
        log->v = v;
        log->cap = cap;
    }
    log->v[log->n++] = (kvw_iv_t){.region = region, .lo = off, .hi = off + len};
    return KVW_OK;
}

static int kvw_iv_cmp(const void *a, const void *b)
{
    const kvw_iv_t *x = a, *y = b;
    if (x->region != y->region)
        return x->region < y->region ? -1 : 1;
    if (x->lo != y->lo)
        return x->lo < y->lo ? -1 : 1;
    return 0;
}

bool kvw__ivlog_check(kvw_ivlog_t *log, kvw_iv_t *a_p, kvw_iv_t *b_p, uint64_t *bytes_p)
{
    bool ok = true;
    uint64_t bytes = 0;
    if (log->n)
        qsort(log->v, log->n, sizeof(*log->v), kvw_iv_cmp);
    uint32_t m = 0;
    for (uint32_t i = 0; i < log->n; i++) {
        kvw_iv_t cur = log->v[i];
        if (m && log->v[m - 1].region == cur.region && cur.lo <= log->v[m - 1].hi) {
            kvw_iv_t *prev = &log->v[m - 1];
            if (cur.lo < prev->hi && ok) {
                ok = false;
                *a_p = *prev;
                *b_p = cur;
            }
            if (cur.hi > prev->hi) {
                bytes += cur.hi - prev->hi;
                prev->hi = cur.hi;
            }
            continue;
        }
        bytes += cur.hi - cur.lo;
        log->v[m++] = cur;
    }
    log->n = m;
    *bytes_p = bytes;
    return ok;
}

bool kvw__ivlog_take(kvw_ivlog_t *log, uint64_t region, uint64_t lo, uint64_t hi,
                     uint64_t *bytes_p)
{
    /* Move the region's entries to the tail, then check them as a log of their own. */
    uint32_t keep = 0;
    for (uint32_t i = 0; i < log->n; i++)
        if (log->v[i].region != region) {
            kvw_iv_t x = log->v[keep];
            log->v[keep++] = log->v[i];
            log->v[i] = x;
        }
    kvw_ivlog_t sub = {.v = log->v + keep, .n = log->n - keep, .cap = log->n - keep};
    kvw_iv_t a, b;
    bool ok = kvw__ivlog_check(&sub, &a, &b, bytes_p);
    /* Entries outside [lo, hi) cannot exist (check_write admits staged writes only inside
     * the room's spans), but count them as missing coverage rather than trust that. */
    if (sub.n && (sub.v[0].lo < lo || sub.v[sub.n - 1].hi > hi))
        *bytes_p = 0;
    log->n = keep;
    return ok;
}

void kvw__ivlog_free(kvw_ivlog_t *log)
{
    free(log->v);
    *log = (kvw_ivlog_t){0};
}
