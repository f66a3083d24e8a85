/*
 * The memory kinds' operations tables (memops.h): host memory on the CPU, GPU memory
 * through the CUDA module on the calling thread's executor.
 */
#include "cuda/module.h"
#include "exec/memops.h"
#include "plan/digest.h"
#include "plan/rank.h"

#include <pthread.h>
#include <stdlib.h>

/* ---------------------------------------------------------------- host */

static kvw_status_t host_ok(void)
{
    return KVW_OK;
}

static kvw_status_t host_select(int device)
{
    (void)device;
    return KVW_OK;
}

static kvw_status_t host_pin(void *ptr, uint64_t len)
{
    (void)ptr, (void)len;
    return KVW_OK;
}

static void host_unpin(void *ptr)
{
    (void)ptr;
}

static kvw_status_t host_step_launch(const struct kvw_plan *plan, int *slot_p,
                                     kvw_cuda_profile_t *prof)
{
    (void)prof;
    *slot_p = -1;
    return kvw_plan_exec_cpu((kvw_plan_h)plan);
}

static kvw_status_t host_step_reap(int slot, int block, int *done_p, kvw_cuda_profile_t *prof)
{
    (void)block, (void)prof;
    *done_p = 1;
    if (slot >= 0)
        return kvw__error(KVW_ERR_INTERNAL, "host step %d: host steps complete when launched",
                          slot);
    return KVW_OK;
}

static void host_profile_add(const kvw_cuda_profile_t *prof)
{
    (void)prof;
}

typedef struct host_stream {
    const struct kvw_plan *plan;
    bool gather;
} host_stream_t;

static kvw_status_t host_stream_open(const struct kvw_plan *plan, bool gather, void **stream_p)
{
    host_stream_t *s = malloc(sizeof(*s));
    if (s == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory opening a staged stream");
    s->plan = plan;
    s->gather = gather;
    *stream_p = s;
    return KVW_OK;
}

static kvw_status_t host_window(void *stream, uint8_t *host, uint64_t lo, uint64_t hi,
                                int *slot_p)
{
    host_stream_t *s = stream;
    *slot_p = -1;
    return kvw__cpu_window(s->plan, s->gather, host, lo, hi);
}

static kvw_status_t host_window_wait(void *stream, int slot)
{
    (void)stream;
    return slot < 0 ? KVW_OK
                    : kvw__error(KVW_ERR_INTERNAL, "host window %d: host windows complete "
                                 "when started", slot);
}

static void host_stream_close(void *stream)
{
    free(stream);
}

/* A thread's host buffers for windows: kept for its life (grown when a larger window
 * comes), so a step neither allocates nor faults in up to 16 MiB of fresh pages.
 * Released when the thread exits. */
static pthread_key_t host_buf_key;
static pthread_once_t host_buf_once = PTHREAD_ONCE_INIT;

typedef struct host_bufs {
    uint8_t *p[2];
    uint64_t cap[2];
} host_bufs_t;

static void host_bufs_free(void *arg)
{
    host_bufs_t *b = arg;
    free(b->p[0]);
    free(b->p[1]);
    free(b);
}

static void host_bufs_init(void)
{
    (void)pthread_key_create(&host_buf_key, host_bufs_free);
}

static kvw_status_t host_window_buf(int which, uint64_t size, uint8_t **buf_p)
{
    if (which < 0 || which > 1)
        return kvw__error(KVW_ERR_INVALID_PARAM, "staging buffer %d of 2", which);
    pthread_once(&host_buf_once, host_bufs_init);
    host_bufs_t *b = pthread_getspecific(host_buf_key);
    if (b == NULL) {
        if ((b = calloc(1, sizeof(*b))) == NULL)
            return kvw__error(KVW_ERR_NO_MEMORY, "out of memory for staging");
        if (pthread_setspecific(host_buf_key, b) != 0) {
            free(b);
            return kvw__error(KVW_ERR_NO_MEMORY, "out of memory for staging");
        }
    }
    if (size > b->cap[which]) {
        free(b->p[which]);
        b->cap[which] = 0;
        if ((b->p[which] = malloc(size)) == NULL)
            return kvw__error(KVW_ERR_NO_MEMORY, "out of memory for staging");
        b->cap[which] = size;
    }
    *buf_p = b->p[which];
    return KVW_OK;
}

static kvw_status_t host_digest_n(const struct kvw_plan *const *plans, uint32_t n, bool dst_side,
                                  uint64_t *const *units, uint32_t num_units)
{
    kvw_status_t st = KVW_OK;
    for (uint32_t i = 0; st == KVW_OK && i < n; i++)
        st = kvw__plan_digest(plans[i], dst_side, NULL, 0, units[i], num_units);
    return st;
}

static const kvw_memops_t kvw_memops_host = {
    .name = "host",
    .is_device = false,
    .async_windows = false,
    .available = host_ok,
    .select = host_select,
    .pin = host_pin,
    .unpin = host_unpin,
    .step_launch = host_step_launch,
    .step_reap = host_step_reap,
    .profile_add = host_profile_add,
    .stream_open = host_stream_open,
    .window = host_window,
    .window_wait = host_window_wait,
    .stream_close = host_stream_close,
    .window_buf = host_window_buf,
    .digest = kvw__plan_digest,
    .digest_n = host_digest_n,
    .step_digest = NULL,
};

/* ---------------------------------------------------------------- CUDA */

static kvw_status_t cuda_step_reap(int slot, int block, int *done_p, kvw_cuda_profile_t *prof)
{
    return kvw__cuda_step_reap(slot, block, done_p, prof);
}

static kvw_status_t cuda_stream_open(const struct kvw_plan *plan, bool gather, void **stream_p)
{
    kvw_cuda_stream_t *s = NULL;
    kvw_status_t st = kvw__cuda_stream_open(plan, !gather, &s);
    if (st == KVW_OK)
        *stream_p = s;
    return st;
}

static kvw_status_t cuda_window(void *stream, uint8_t *host, uint64_t lo, uint64_t hi,
                                int *slot_p)
{
    kvw_cuda_profile_t prof = {.steps = 1, .bytes = hi - lo, .first_start_ns = kvw__now_ns()};
    kvw_status_t st = kvw__cuda_stream_window(stream, host, lo, hi, slot_p, &prof);
    kvw__cuda_profile_add(&prof);
    return st;
}

static kvw_status_t cuda_window_wait(void *stream, int slot)
{
    (void)stream;
    if (slot < 0)
        return KVW_OK;
    kvw_cuda_profile_t prof = {0};
    int done = 0;
    kvw_status_t st = kvw__cuda_step_reap(slot, 1, &done, &prof);
    prof.last_done_ns = kvw__now_ns();
    kvw__cuda_profile_add(&prof);
    return st;
}

static void cuda_stream_close(void *stream)
{
    kvw__cuda_stream_close(stream);
}

static kvw_status_t cuda_window_buf(int which, uint64_t size, uint8_t **buf_p)
{
    return kvw__cuda_stage_buf(which, size, (void **)buf_p);
}

static void cuda_unpin(void *ptr)
{
    kvw__cuda_host_unregister(ptr);
}

static const kvw_memops_t kvw_memops_cuda = {
    .name = "GPU",
    .is_device = true,
    .async_windows = true,
    .available = kvw_cuda_available,
    .select = kvw__cuda_set_device,
    .pin = kvw__cuda_host_register,
    .unpin = cuda_unpin,
    .step_launch = kvw__cuda_step_launch,
    .step_launch_n = kvw__cuda_step_launch_n,
    .step_reap = cuda_step_reap,
    .profile_add = kvw__cuda_profile_add,
    .stream_open = cuda_stream_open,
    .window = cuda_window,
    .window_wait = cuda_window_wait,
    .stream_close = cuda_stream_close,
    .window_buf = cuda_window_buf,
    .digest = kvw__cuda_plan_digest,
    .digest_n = kvw__cuda_plan_digest_n,
    .step_digest = kvw__cuda_step_digest,
    .warm = kvw__cuda_warm,
    .digest_warm = kvw__cuda_digest_warm,
};

/* ---------------------------------------------------------------- lookup */

static const kvw_memops_t *const kvw_memops_table[] = {
    [KVW_MEM_HOST] = &kvw_memops_host,
    [KVW_MEM_CUDA] = &kvw_memops_cuda,
};

const kvw_memops_t *kvw__memops(kvw_mem_kind_t kind)
{
    if ((unsigned)kind < KVW_ARRAY_SIZE(kvw_memops_table) && kvw_memops_table[kind])
        return kvw_memops_table[kind];
    return &kvw_memops_host;
}

kvw_status_t kvw__rank_memops(kvw_rank_h rank, const char *uniform, const kvw_memops_t **mem_p,
                              int *device_p)
{
    uint32_t n = kvw_rank_num_buffers(rank);
    const kvw_buffer_desc_t *dev = NULL;
    for (uint32_t i = 0; i < n && dev == NULL; i++)
        if (kvw__memops(kvw_rank_buffer(rank, i)->mem_kind)->is_device)
            dev = kvw_rank_buffer(rank, i);
    const kvw_memops_t *mem = dev ? kvw__memops(dev->mem_kind) : &kvw_memops_host;
    for (uint32_t i = 0; dev && uniform && i < n; i++) {
        const kvw_buffer_desc_t *b = kvw_rank_buffer(rank, i);
        const kvw_memops_t *bm = kvw__memops(b->mem_kind);
        if (bm != mem || b->device != dev->device)
            return kvw__error(KVW_ERR_UNSUPPORTED, "buffer %u is %s memory%s, but another "
                              "buffer of this rank is on %s %d: over '%s' a rank's buffers "
                              "must all be %s memory of one device, or all host memory", i,
                              bm->name, bm == mem ? " of another device" : "", mem->name,
                              dev->device, uniform, mem->name);
    }
    *mem_p = mem;
    *device_p = dev ? dev->device : -1;
    return KVW_OK;
}
