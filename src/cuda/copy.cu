/*
 * Plan execution kernels: the direct copy (source pages -> destination pages, e.g.
 * through CUDA IPC-mapped peer pointers) runs on kvwc_direct_kernel, which needs no token
 * table; one fused kernel template with the table serves the gather (source pages ->
 * contiguous staging) and the scatter (staging -> destination pages).
 * copy_core.h holds the addressing; this file holds the launch machinery and the device
 * copy of a plan.
 */
#include "cuda/copy_core.h"
#include "cuda/internal.h"

#include <stdlib.h>
#include <time.h>

struct kvwc_plan {
    int device;
    void *dmem; /* the laid-out segments and page lists */
    const kvwc_dseg_t *dsegs;
    const uint32_t *job_seg;
    uint32_t num_segs;
    uint64_t num_jobs;
    uint64_t bytes;
    unsigned uses;
    int grid;
    /* Plans uploaded on an executor for staged windows (kvwc_exec_plan_upload): the
     * segments' spans for finding a window's jobs, and the event that completes the
     * upload (a window may run on another executor's stream). */
    kvwc_span_t *spans;
    cudaEvent_t ready;
};

template <int W> struct kvwc_vec;
template <> struct kvwc_vec<16> { typedef uint4 type; };
template <> struct kvwc_vec<8> { typedef uint2 type; };
template <> struct kvwc_vec<4> { typedef uint32_t type; };
template <> struct kvwc_vec<2> { typedef uint16_t type; };
template <> struct kvwc_vec<1> { typedef uint8_t type; };

template <typename V> __device__ __forceinline__ V kvwc_load(const V *p)
{
#if KVWC_LOAD_HINT == 1
    return __ldcs(p);
#elif KVWC_LOAD_HINT == 2
    return __ldg(p);
#else
    return *p;
#endif
}

template <typename V> __device__ __forceinline__ void kvwc_store(V *p, V v)
{
#if KVWC_STORE_HINT == 1
    __stcs(p, v);
#else
    *p = v;
#endif
}

/*
 * One job: token bases into shared memory, then W-byte units, KVWC_UNROLL loads in
 * flight per thread before the first store. The segment is read where it lies (every
 * thread the same words, served by L1); the unit loop only needs the few scalars of
 * kvwc_jobgeo_t, kept in registers.
 */
template <int W, int MODE>
__device__ __forceinline__ void kvwc_run_job(const kvwc_dseg_t *__restrict__ s, uint64_t b0,
                                             uint64_t b1, uint64_t stage, uint64_t lo,
                                             uint64_t hi, kvwc_tokens_t *tt)
{
    typedef typename kvwc_vec<W>::type vec;
    kvwc_jobgeo_t g;
    kvwc_job_geo(s, b0, b1, W, &g);
#pragma unroll 1
    for (uint32_t i = threadIdx.x; i < g.ntok; i += blockDim.x)
        kvwc_token_bases(s, MODE, s->tok_begin + g.t0 + i, tt, i);
    __syncthreads();
    const uint32_t stride = blockDim.x;
#pragma unroll 1
    for (uint32_t u = g.ub + threadIdx.x; u < g.ue; u += KVWC_UNROLL * stride) {
        vec v[KVWC_UNROLL];
        uint64_t dst[KVWC_UNROLL];
        bool go[KVWC_UNROLL];
#pragma unroll
        for (int k = 0; k < KVWC_UNROLL; k++) {
            uint32_t uk = u + k * stride;
            go[k] = false;
            if (uk < g.ue) {
                uint64_t src;
                kvwc_unit_addrs(MODE, W, &g, tt, uk, stage, &src, &dst[k]);
                go[k] = kvwc_unit_in_window(MODE, src, dst[k], stage, lo, hi);
                if (go[k])
                    v[k] = kvwc_load((const vec *)(uintptr_t)src);
            }
        }
#pragma unroll
        for (int k = 0; k < KVWC_UNROLL; k++) {
            if (go[k])
                kvwc_store((vec *)(uintptr_t)dst[k], v[k]);
        }
    }
}

template <int MODE>
__global__ void __launch_bounds__(KVWC_THREADS, KVWC_MIN_BLOCKS)
    kvwc_copy_kernel(const kvwc_dseg_t *__restrict__ segs, const uint32_t *__restrict__ job_seg,
                     uint64_t j0, uint64_t j1, uint64_t stage, uint64_t lo, uint64_t hi,
                     uint32_t wcap)
{
    __shared__ kvwc_tokens_t tt;
    for (uint64_t job = j0 + blockIdx.x; job < j1; job += gridDim.x) {
        const kvwc_dseg_t *s = &segs[job_seg[job]];
        uint64_t b0, b1;
        kvwc_job_range(s, job, &b0, &b1);
        switch (kvwc_unit_width(s->w[MODE], wcap)) {
        case 16: kvwc_run_job<16, MODE>(s, b0, b1, stage, lo, hi, &tt); break;
        case 8: kvwc_run_job<8, MODE>(s, b0, b1, stage, lo, hi, &tt); break;
        case 4: kvwc_run_job<4, MODE>(s, b0, b1, stage, lo, hi, &tt); break;
        case 2: kvwc_run_job<2, MODE>(s, b0, b1, stage, lo, hi, &tt); break;
        default: kvwc_run_job<1, MODE>(s, b0, b1, stage, lo, hi, &tt); break;
        }
        __syncthreads(); /* the next job reuses the token table */
    }
}

/*
 * The direct copy: every thread works out its units' addresses from the segment alone
 * (kvwc_direct_addrs), with no shared table and no barrier. On the fast path (16-byte
 * units, kvwc_direct_affine: the job inside one page per side, a whole number of passes)
 * a thread resolves one address per side and has KVWC_DIRECT_UNROLL loads in flight from
 * it per pass; any other job goes to kvwc_direct_slow. Measured against the table kernel
 * in bench/gpu/NOTES.md ("The direct kernel's fast path").
 */

/* Every unit resolved, KVWC_DIRECT_UNROLL_SLOW at a time. Out of line, so that its
 * registers do not crowd the fast path's (inlined, the five widths spilled 800 bytes). */
template <int W>
__device__ __noinline__ void kvwc_direct_slow(const kvwc_dseg_t *__restrict__ s,
                                              const kvwc_jobgeo_t g)
{
    typedef typename kvwc_vec<W>::type vec;
    const uint32_t stride = blockDim.x;
#pragma unroll 1
    for (uint32_t u = g.ub + threadIdx.x; u < g.ue; u += KVWC_DIRECT_UNROLL_SLOW * stride) {
        vec v[KVWC_DIRECT_UNROLL_SLOW];
        uint64_t dst[KVWC_DIRECT_UNROLL_SLOW];
#pragma unroll
        for (int k = 0; k < KVWC_DIRECT_UNROLL_SLOW; k++) {
            uint32_t uk = u + k * stride;
            if (uk < g.ue) {
                uint64_t src;
                kvwc_direct_addrs(s, W, &g, uk, &src, &dst[k]);
                v[k] = kvwc_load((const vec *)(uintptr_t)src);
            }
        }
#pragma unroll
        for (int k = 0; k < KVWC_DIRECT_UNROLL_SLOW; k++) {
            if (u + k * stride < g.ue)
                kvwc_store((vec *)(uintptr_t)dst[k], v[k]);
        }
    }
}

__global__ void __launch_bounds__(KVWC_DIRECT_THREADS, KVWC_DIRECT_MIN_BLOCKS)
    kvwc_direct_kernel(const kvwc_dseg_t *__restrict__ segs, const uint32_t *__restrict__ job_seg,
                       uint64_t j0, uint64_t j1, uint32_t wcap)
{
    for (uint64_t job = j0 + blockIdx.x; job < j1; job += gridDim.x) {
        uint32_t w;
        kvwc_jobgeo_t g;
        const kvwc_dseg_t *s = kvwc_job_at(segs, job_seg, job, KVWC_MODE_DIRECT, wcap, &w, &g);
        uint64_t ss, sd;
        if (blockDim.x == KVWC_DIRECT_THREADS && kvwc_direct_fast(s, &g, w, &ss, &sd)) {
            /* The fast path: one address per side, then a fixed step per load. */
            uint64_t src, dst;
            kvwc_direct_addrs(s, 16, &g, g.ub + threadIdx.x, &src, &dst);
            uint32_t passes = (g.ue - g.ub) / (KVWC_DIRECT_THREADS * KVWC_DIRECT_UNROLL);
#pragma unroll 1
            for (uint32_t p = 0; p < passes; p++) {
                uint4 v[KVWC_DIRECT_UNROLL];
#pragma unroll
                for (int k = 0; k < KVWC_DIRECT_UNROLL; k++)
                    v[k] = kvwc_load((const uint4 *)(uintptr_t)(src + k * ss));
#pragma unroll
                for (int k = 0; k < KVWC_DIRECT_UNROLL; k++)
                    kvwc_store((uint4 *)(uintptr_t)(dst + k * sd), v[k]);
                src += KVWC_DIRECT_UNROLL * ss;
                dst += KVWC_DIRECT_UNROLL * sd;
            }
            continue;
        }
        switch (w) {
        case 16: kvwc_direct_slow<16>(s, g); break;
        case 8: kvwc_direct_slow<8>(s, g); break;
        case 4: kvwc_direct_slow<4>(s, g); break;
        case 2: kvwc_direct_slow<2>(s, g); break;
        default: kvwc_direct_slow<1>(s, g); break;
        }
    }
}

/* Launches jobs [w->j0, w->j1) of a device plan; `stage` is the staging buffer minus
 * the window's start (see kvwc_window_t). */
static kvw_status_t kvwc_launch_window(const kvwc_plan *p, int mode, uint64_t stage,
                                       const kvwc_window_t *w, void *stream)
{
    if (w->j1 <= w->j0)
        return KVW_OK;
    int dev;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess)
        return kvwc_cuda_error(e, "cudaGetDevice");
    if (dev != p->device)
        return kvwc_error(KVW_ERR_INVALID_PARAM,
                          "the device plan lives on device %d but device %d is current",
                          p->device, dev);
    uint64_t n = w->j1 - w->j0;
    uint64_t grid = n < (uint64_t)p->grid ? n : (uint64_t)p->grid;
    cudaStream_t st = (cudaStream_t)stream;
    switch (mode) {
    case KVWC_MODE_DIRECT:
        if (KVWC_DIRECT_FLAT)
            kvwc_direct_kernel<<<(unsigned)grid, KVWC_DIRECT_THREADS, 0, st>>>(
                p->dsegs, p->job_seg, w->j0, w->j1, w->wcap);
        else
            kvwc_copy_kernel<KVWC_MODE_DIRECT><<<(unsigned)grid, KVWC_THREADS, 0, st>>>(
                p->dsegs, p->job_seg, w->j0, w->j1, stage, w->lo, w->hi, w->wcap);
        break;
    case KVWC_MODE_GATHER:
        kvwc_copy_kernel<KVWC_MODE_GATHER><<<(unsigned)grid, KVWC_THREADS, 0, st>>>(
            p->dsegs, p->job_seg, w->j0, w->j1, stage, w->lo, w->hi, w->wcap);
        break;
    default:
        kvwc_copy_kernel<KVWC_MODE_SCATTER><<<(unsigned)grid, KVWC_THREADS, 0, st>>>(
            p->dsegs, p->job_seg, w->j0, w->j1, stage, w->lo, w->hi, w->wcap);
        break;
    }
    e = cudaGetLastError();
    if (e != cudaSuccess)
        return kvwc_cuda_error(e, "launching the copy kernel");
    return KVW_OK;
}

/* Every job of a device plan (the whole staging stream). */
static kvw_status_t kvwc_launch(const kvwc_plan *p, int mode, uint64_t stage, void *stream)
{
    kvwc_window_t w = {0, p->num_jobs, 0, KVWC_WINDOW_ALL, 16};
    return kvwc_launch_window(p, mode, stage, &w, stream);
}

/* Sizes the device plan; fails for plans the kernels cannot run. */
static kvw_status_t kvwc_layout_of(const kvwc_plan_in_t *in, kvwc_layout_t *L)
{
    const char *why = NULL;
    if (kvwc_blob_layout(in, L, &why) != 0)
        return kvwc_error(KVW_ERR_UNSUPPORTED, "the CUDA executor cannot run this plan: %s", why);
    return KVW_OK;
}

/* Writes the host image of the device plan for device address `dev_base` into `host`
 * (L->size bytes) and points `p` at the device copy-to-be. */
static void kvwc_fill(const kvwc_plan_in_t *in, const kvwc_layout_t *L, uint64_t dev_base,
                      void *host, kvwc_plan *p)
{
    kvwc_blob_fill(in, L, host, dev_base);
    p->dsegs = (const kvwc_dseg_t *)(uintptr_t)dev_base;
    p->job_seg = (const uint32_t *)(uintptr_t)(dev_base + L->jobs_off);
    p->num_segs = L->num_segs;
    p->num_jobs = L->num_jobs;
    p->bytes = in->bytes;
    p->uses = in->uses;
}

/* The same into a new heap buffer. */
static kvw_status_t kvwc_prepare(const kvwc_plan_in_t *in, const kvwc_layout_t *L,
                                 uint64_t dev_base, void **host_p, kvwc_plan *p)
{
    void *host = malloc(L->size ? L->size : 1);
    if (host == NULL)
        return kvwc_error(KVW_ERR_NO_MEMORY, "out of memory laying out a device plan");
    kvwc_fill(in, L, dev_base, host, p);
    *host_p = host;
    return KVW_OK;
}

static kvw_status_t kvwc_plan_device(kvwc_plan *p)
{
    cudaError_t e = cudaGetDevice(&p->device);
    if (e != cudaSuccess)
        return kvwc_cuda_error(e, "cudaGetDevice");
    int sms = 0;
    e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, p->device);
    if (e != cudaSuccess)
        return kvwc_cuda_error(e, "cudaDeviceGetAttribute(multiprocessor count)");
    /* By default every job gets its own block and the hardware scheduler balances
     * them; a fixed grid that loops over jobs is kept for experiments. */
    p->grid = KVWC_BLOCKS_PER_SM ? sms * KVWC_BLOCKS_PER_SM : 0x7fffffff;
    return KVW_OK;
}

kvw_status_t kvwc_plan_upload(const kvwc_plan_in_t *in, kvwc_plan_h *plan_p)
{
    kvwc_layout_t L;
    kvw_status_t st = kvwc_layout_of(in, &L);
    if (st != KVW_OK)
        return st;
    kvwc_plan *p = (kvwc_plan *)calloc(1, sizeof(*p));
    if (p == NULL)
        return kvwc_error(KVW_ERR_NO_MEMORY, "out of memory creating a device plan");
    void *host = NULL;
    cudaError_t e;
    if ((st = kvwc_plan_device(p)) != KVW_OK)
        goto err_free_plan;
    if (L.size && (e = cudaMalloc(&p->dmem, L.size)) != cudaSuccess) {
        st = kvwc_cuda_error(e, "cudaMalloc for a device plan");
        goto err_free_plan;
    }
    if ((st = kvwc_prepare(in, &L, (uint64_t)(uintptr_t)p->dmem, &host, p)) != KVW_OK)
        goto err_free_dev;
    if (L.size && (e = cudaMemcpy(p->dmem, host, L.size, cudaMemcpyHostToDevice)) != cudaSuccess) {
        st = kvwc_cuda_error(e, "cudaMemcpy uploading a device plan");
        goto err_free_host;
    }
    free(host);
    *plan_p = p;
    return KVW_OK;

err_free_host:
    free(host);
err_free_dev:
    cudaFree(p->dmem);
err_free_plan:
    free(p);
    return st;
}

void kvwc_plan_free(kvwc_plan_h p)
{
    if (p == NULL)
        return;
    if (p->dmem)
        cudaFree(p->dmem);
    free(p);
}

kvw_status_t kvwc_plan_exec(kvwc_plan_h p, void *stream)
{
    if (!(p->uses & KVWC_USE_DIRECT))
        return kvwc_error(KVW_ERR_INVALID_PARAM,
                          "the device plan was not uploaded for direct copies");
    return kvwc_launch(p, KVWC_MODE_DIRECT, 0, stream);
}

static kvw_status_t kvwc_check_staging(const kvwc_plan *p, const void *staging, uint64_t size,
                                       unsigned use, const char *what)
{
    if (!(p->uses & use))
        return kvwc_error(KVW_ERR_INVALID_PARAM, "the device plan was not uploaded for %s", what);
    if (p->bytes && staging == NULL)
        return kvwc_error(KVW_ERR_INVALID_PARAM, "%s: NULL staging buffer", what);
    if ((uintptr_t)staging % 16)
        return kvwc_error(KVW_ERR_INVALID_PARAM,
                          "%s: the staging buffer must be 16-byte aligned (got %p)", what,
                          staging);
    if (size < p->bytes)
        return kvwc_error(KVW_ERR_BUFFER_TOO_SMALL,
                          "%s: staging buffer of %llu bytes, the plan moves %llu", what,
                          (unsigned long long)size, (unsigned long long)p->bytes);
    return KVW_OK;
}

kvw_status_t kvwc_plan_gather(kvwc_plan_h p, void *staging, uint64_t size, void *stream)
{
    kvw_status_t st = kvwc_check_staging(p, staging, size, KVWC_USE_GATHER, "gather");
    if (st != KVW_OK)
        return st;
    return kvwc_launch(p, KVWC_MODE_GATHER, (uint64_t)(uintptr_t)staging, stream);
}

kvw_status_t kvwc_plan_scatter(kvwc_plan_h p, const void *staging, uint64_t size, void *stream)
{
    kvw_status_t st = kvwc_check_staging(p, staging, size, KVWC_USE_SCATTER, "scatter");
    if (st != KVW_OK)
        return st;
    return kvwc_launch(p, KVWC_MODE_SCATTER, (uint64_t)(uintptr_t)staging, stream);
}

kvw_status_t kvwc_plan_exec_once(const kvwc_plan_in_t *in, void *stream)
{
    kvwc_layout_t L;
    kvwc_plan p = {};
    kvw_status_t st = kvwc_layout_of(in, &L);
    if (st != KVW_OK || L.num_jobs == 0)
        return st;
    if ((st = kvwc_plan_device(&p)) != KVW_OK)
        return st;
    cudaStream_t s = (cudaStream_t)stream;
    /* Stream-ordered allocation keeps the whole call asynchronous. */
    cudaError_t e = cudaMallocAsync(&p.dmem, L.size, s);
    if (e != cudaSuccess)
        return kvwc_cuda_error(e, "cudaMallocAsync for a device plan");
    void *host = NULL;
    st = kvwc_prepare(in, &L, (uint64_t)(uintptr_t)p.dmem, &host, &p);
    if (st != KVW_OK)
        goto err_free_dev;
    /* From pageable memory the copy is staged before the call returns, so the host
     * image can be freed at once. */
    e = cudaMemcpyAsync(p.dmem, host, L.size, cudaMemcpyHostToDevice, s);
    free(host);
    if (e != cudaSuccess) {
        st = kvwc_cuda_error(e, "cudaMemcpyAsync uploading a device plan");
        goto err_free_dev;
    }
    st = kvwc_launch(&p, KVWC_MODE_DIRECT, 0, stream);
err_free_dev:
    e = cudaFreeAsync(p.dmem, s);
    if (st == KVW_OK && e != cudaSuccess)
        st = kvwc_cuda_error(e, "cudaFreeAsync for a device plan");
    return st;
}

/* ---------------------------------------------------------------- executors */

struct kvwc_slot {
    void *host;        /* pinned: the plan image, copied asynchronously */
    void *dmem;        /* the device plan */
    uint64_t cap;      /* bytes of each */
    cudaEvent_t ev[3]; /* before the upload, before the kernel, after the kernel */
    int busy;          /* launched, not reaped yet */
};

/* A staged window in flight: the plan image (pinned and device) and the device scratch
 * holding the window's bytes between the kernel and the host copy. */
struct kvwc_stage_slot {
    kvwc_slot plan;   /* image, device plan and events */
    void *scratch;    /* device memory for one window */
    uint64_t scap;
};

struct kvwc_exec {
    int device, grid;
    cudaStream_t stream;
    kvwc_slot slot[KVWC_EXEC_SLOTS];
    unsigned next; /* slots are used, and reaped, in turn */
    kvwc_stage_slot stage[KVWC_STAGE_SLOTS];
    /* Digests (digest.cu): one buffer per step slot, riding on its step, and the last
     * for a batch of slot -1 digests, waited for on dig_done. */
    kvwc_dig_buf_t dig[KVWC_EXEC_SLOTS + 1];
    cudaEvent_t dig_done;
};

static uint64_t kvwc_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

cudaStream_t kvwc_exec_stream(kvwc_exec_h x)
{
    return x->stream;
}

kvwc_dig_buf_t *kvwc_exec_dig_buf(kvwc_exec_h x, int slot, cudaEvent_t *done_p)
{
    if (slot == -1) {
        *done_p = x->dig_done;
        return &x->dig[KVWC_EXEC_SLOTS];
    }
    if (slot < 0 || slot >= KVWC_EXEC_SLOTS || !x->slot[slot].busy)
        return NULL;
    *done_p = x->slot[slot].ev[2];
    return &x->dig[slot];
}

kvwc_dig_buf_t *kvwc_exec_dig_bufs(kvwc_exec_h x, uint32_t *n_p)
{
    *n_p = KVWC_EXEC_SLOTS + 1;
    return x->dig;
}

void kvwc_exec_destroy(kvwc_exec_h x)
{
    if (x == NULL)
        return;
    if (x->stream)
        cudaStreamSynchronize(x->stream);
    for (int k = 0; k < KVWC_EXEC_SLOTS + KVWC_STAGE_SLOTS; k++) {
        kvwc_slot *s = k < KVWC_EXEC_SLOTS ? &x->slot[k] : &x->stage[k - KVWC_EXEC_SLOTS].plan;
        for (int i = 0; i < 3; i++)
            if (s->ev[i])
                cudaEventDestroy(s->ev[i]);
        if (s->host)
            cudaFreeHost(s->host);
        if (s->dmem)
            cudaFree(s->dmem);
    }
    for (int k = 0; k < KVWC_STAGE_SLOTS; k++)
        if (x->stage[k].scratch)
            cudaFree(x->stage[k].scratch);
    for (int k = 0; k < KVWC_EXEC_SLOTS + 1; k++)
        kvwc_dig_buf_free(&x->dig[k]); /* a digest still pending adds nothing */
    if (x->dig_done)
        cudaEventDestroy(x->dig_done);
    if (x->stream)
        cudaStreamDestroy(x->stream);
    free(x);
}

/* Gives an idle slot a pinned image and a device plan buffer of exactly `cap` bytes. */
static kvw_status_t kvwc_slot_alloc(kvwc_slot *o, uint64_t cap)
{
    if (o->host)
        cudaFreeHost(o->host);
    if (o->dmem)
        cudaFree(o->dmem);
    o->host = NULL;
    o->dmem = NULL;
    o->cap = 0;
    cudaError_t e;
    if ((e = cudaHostAlloc(&o->host, cap, cudaHostAllocDefault)) != cudaSuccess)
        return kvwc_cuda_error(e, "cudaHostAlloc for plan images");
    if ((e = cudaMalloc(&o->dmem, cap)) != cudaSuccess)
        return kvwc_cuda_error(e, "cudaMalloc for device plans");
    o->cap = cap;
    return KVW_OK;
}

/* The capacity a slot grows to for a plan of `size` bytes: doubling, 1 MiB at least. */
static uint64_t kvwc_grown(uint64_t cap, uint64_t size)
{
    uint64_t c = size > 2 * cap ? size : 2 * cap;
    return c < (1u << 20) ? (1u << 20) : c;
}

kvw_status_t kvwc_exec_create(kvwc_exec_h *exec_p)
{
    kvwc_exec *x = (kvwc_exec *)calloc(1, sizeof(*x));
    if (x == NULL)
        return kvwc_error(KVW_ERR_NO_MEMORY, "out of memory creating a CUDA executor");
    kvwc_plan p = {};
    kvw_status_t st = kvwc_plan_device(&p);
    cudaError_t e = cudaSuccess;
    const char *what = NULL;
    x->device = p.device;
    x->grid = p.grid;
    /* Non-blocking: the legacy default stream would serialise every worker thread's
     * kernels and synchronise with them implicitly. */
    if (st == KVW_OK && (e = cudaStreamCreateWithFlags(&x->stream, cudaStreamNonBlocking)) !=
                            cudaSuccess)
        what = "cudaStreamCreateWithFlags";
    for (int k = 0; st == KVW_OK && what == NULL && k < KVWC_EXEC_SLOTS + KVWC_STAGE_SLOTS; k++)
        for (int i = 0; what == NULL && i < 3; i++) {
            kvwc_slot *s = k < KVWC_EXEC_SLOTS ? &x->slot[k] : &x->stage[k - KVWC_EXEC_SLOTS].plan;
            if ((e = cudaEventCreate(&s->ev[i])) != cudaSuccess)
                what = "cudaEventCreate";
        }
    if (st == KVW_OK && what == NULL &&
        (e = cudaEventCreateWithFlags(&x->dig_done, cudaEventDisableTiming)) != cudaSuccess) {
        x->dig_done = NULL;
        what = "cudaEventCreateWithFlags";
    }
    if (what)
        st = kvwc_cuda_error(e, what);
    /* What a first step would otherwise pay: every slot's pinned image and device plan
     * buffer at the smallest capacity (cudaHostAlloc and cudaMalloc, each synchronising
     * the device), and the kernels loaded (with lazy module loading, a kernel's first
     * launch loads it). An executor is made once per thread and device, so a worker that
     * makes it when it starts takes this out of its first room. */
    for (int k = 0; st == KVW_OK && k < KVWC_EXEC_SLOTS; k++)
        st = kvwc_slot_alloc(&x->slot[k], kvwc_grown(0, 0));
    /* The same for digests: each slot's and the batch's buffers, and the kernel. */
    for (int k = 0; st == KVW_OK && k < KVWC_EXEC_SLOTS + 1; k++)
        st = kvwc_dig_buf_init(&x->dig[k]);
    if (st == KVW_OK)
        st = kvwc_digest_warm();
    if (st == KVW_OK) {
        cudaFuncAttributes fa;
        if ((e = cudaFuncGetAttributes(&fa, kvwc_direct_kernel)) != cudaSuccess ||
            (e = cudaFuncGetAttributes(&fa, kvwc_copy_kernel<KVWC_MODE_DIRECT>)) != cudaSuccess ||
            (e = cudaFuncGetAttributes(&fa, kvwc_copy_kernel<KVWC_MODE_GATHER>)) != cudaSuccess ||
            (e = cudaFuncGetAttributes(&fa, kvwc_copy_kernel<KVWC_MODE_SCATTER>)) != cudaSuccess)
            st = kvwc_cuda_error(e, "cudaFuncGetAttributes (loading the copy kernels)");
    }
    if (st != KVW_OK) {
        kvwc_exec_destroy(x);
        return st;
    }
    *exec_p = x;
    return KVW_OK;
}

/* Lays the plan out into slot s for device plan p and enqueues, on the executor's
 * stream, the slot's first event and the upload of the image. */
static kvw_status_t kvwc_slot_upload(kvwc_exec *x, kvwc_slot *s, const kvwc_plan_in_t *in,
                                     const kvwc_layout_t *L, kvwc_plan *p)
{
    p->device = x->device;
    p->grid = x->grid;
    kvwc_fill(in, L, (uint64_t)(uintptr_t)s->dmem, s->host, p);
    cudaError_t e;
    if ((e = cudaEventRecord(s->ev[0], x->stream)) != cudaSuccess)
        return kvwc_cuda_error(e, "cudaEventRecord");
    if ((e = cudaMemcpyAsync(s->dmem, s->host, L->size, cudaMemcpyHostToDevice, x->stream)) !=
        cudaSuccess)
        return kvwc_cuda_error(e, "cudaMemcpyAsync uploading a device plan");
    return KVW_OK;
}

kvw_status_t kvwc_exec_launch(kvwc_exec_h x, const kvwc_plan_in_t *in, int *slot_p,
                              kvwc_step_prof_t *prof)
{
    uint64_t t0 = kvwc_now_ns();
    *slot_p = -1;
    kvwc_layout_t L;
    kvw_status_t st = kvwc_layout_of(in, &L);
    if (st != KVW_OK || L.num_jobs == 0)
        return st;
    if (!(in->uses & KVWC_USE_DIRECT))
        return kvwc_error(KVW_ERR_INVALID_PARAM, "an executor runs direct copies only");
    int k = (int)(x->next % KVWC_EXEC_SLOTS);
    kvwc_slot *s = &x->slot[k];
    if (s->busy)
        return kvwc_error(KVW_ERR_BUSY, "CUDA executor: slot %d is still in flight (reap "
                          "steps before launching more than %d)", k, KVWC_EXEC_SLOTS);
    cudaError_t e;
    if (L.size > s->cap) {
        /* Grown only for a plan larger than any this slot ran (by doubling), and every
         * idle slot with it: cudaFree and cudaFreeHost synchronise the whole device, so
         * this must happen once, on a first step, not on each slot's first use. An idle
         * slot's last kernel has completed: it was reaped. */
        uint64_t cap = kvwc_grown(s->cap, L.size);
        for (int j = 0; j < KVWC_EXEC_SLOTS; j++)
            if (!x->slot[j].busy && x->slot[j].cap < cap &&
                (st = kvwc_slot_alloc(&x->slot[j], cap)) != KVW_OK)
                return st;
    }
    kvwc_plan p = {};
    if ((st = kvwc_slot_upload(x, s, in, &L, &p)) != KVW_OK)
        return st;
    if ((e = cudaEventRecord(s->ev[1], x->stream)) != cudaSuccess)
        return kvwc_cuda_error(e, "cudaEventRecord");
    if ((st = kvwc_launch(&p, KVWC_MODE_DIRECT, 0, x->stream)) != KVW_OK)
        return st;
    if ((e = cudaEventRecord(s->ev[2], x->stream)) != cudaSuccess)
        return kvwc_cuda_error(e, "cudaEventRecord");
    s->busy = 1;
    x->next++;
    *slot_p = k;
    prof->launch_ns += kvwc_now_ns() - t0;
    return KVW_OK;
}

kvw_status_t kvwc_exec_reap(kvwc_exec_h x, int slot, int block, int *done_p,
                            kvwc_step_prof_t *prof)
{
    *done_p = 0;
    kvwc_slot *s = slot >= 0 && slot < KVWC_EXEC_SLOTS ? &x->slot[slot]
                   : slot >= KVWC_EXEC_SLOTS && slot < KVWC_EXEC_SLOTS + KVWC_STAGE_SLOTS
                       ? &x->stage[slot - KVWC_EXEC_SLOTS].plan
                       : NULL;
    if (s == NULL || !s->busy)
        return kvwc_error(KVW_ERR_INVALID_PARAM, "CUDA executor: slot %d is not in flight",
                          slot);
    cudaError_t e;
    if (block) {
        /* The step's own last event (after its digest, when one rides on it, so the
         * kernel figure below includes the digest): neither the device nor other
         * threads' work. */
        uint64_t t0 = kvwc_now_ns();
        e = cudaEventSynchronize(s->ev[2]);
        prof->wait_ns += kvwc_now_ns() - t0;
    } else {
        e = cudaEventQuery(s->ev[2]);
        if (e == cudaErrorNotReady)
            return KVW_OK;
    }
    s->busy = 0;
    *done_p = 1;
    /* A digest riding on the step (exec_digest) completed with it: added now, or, after
     * an error, dropped. */
    bool dig = slot < KVWC_EXEC_SLOTS && x->dig[slot].units != NULL;
    if (slot < KVWC_EXEC_SLOTS)
        kvwc_dig_buf_finish(&x->dig[slot], e == cudaSuccess);
    if (e != cudaSuccess)
        return kvwc_cuda_error(e, dig ? "the copy kernel or the digest behind it" :
                               "the copy kernel");
    float up = 0, kern = 0;
    if (cudaEventElapsedTime(&up, s->ev[0], s->ev[1]) == cudaSuccess &&
        cudaEventElapsedTime(&kern, s->ev[1], s->ev[2]) == cudaSuccess) {
        prof->upload_ms += up;
        prof->kernel_ms += kern;
    }
    return KVW_OK;
}

/* ---------------------------------------------------------------- staged windows */

kvw_status_t kvwc_exec_plan_upload(kvwc_exec_h x, const kvwc_plan_in_t *in, kvwc_plan_h *plan_p)
{
    kvwc_layout_t L;
    kvw_status_t st = kvwc_layout_of(in, &L);
    if (st != KVW_OK)
        return st;
    kvwc_plan *p = (kvwc_plan *)calloc(1, sizeof(*p));
    kvwc_span_t *spans = (kvwc_span_t *)malloc(sizeof(kvwc_span_t) * ((size_t)L.num_segs + 1));
    void *host = NULL;
    cudaError_t e;
    if (p == NULL || spans == NULL) {
        free(p);
        free(spans);
        return kvwc_error(KVW_ERR_NO_MEMORY, "out of memory creating a device plan");
    }
    p->device = x->device;
    p->grid = x->grid;
    p->spans = spans;
    kvwc_spans_fill(in, spans);
    if ((e = cudaEventCreateWithFlags(&p->ready, cudaEventDisableTiming)) != cudaSuccess) {
        p->ready = NULL;
        st = kvwc_cuda_error(e, "cudaEventCreateWithFlags");
        goto err;
    }
    /* Stream-ordered: neither this allocation nor its release (kvwc_exec_plan_free)
     * synchronises the device, as cudaMalloc and cudaFree would for every chunk. */
    if (L.size && (e = cudaMallocAsync(&p->dmem, L.size, x->stream)) != cudaSuccess) {
        p->dmem = NULL;
        st = kvwc_cuda_error(e, "cudaMallocAsync for a device plan");
        goto err;
    }
    if ((st = kvwc_prepare(in, &L, (uint64_t)(uintptr_t)p->dmem, &host, p)) != KVW_OK)
        goto err;
    /* From pageable memory the copy is staged before the call returns, so the host
     * image can be freed at once. */
    if (L.size && (e = cudaMemcpyAsync(p->dmem, host, L.size, cudaMemcpyHostToDevice,
                                       x->stream)) != cudaSuccess) {
        st = kvwc_cuda_error(e, "cudaMemcpyAsync uploading a device plan");
        goto err;
    }
    free(host);
    host = NULL;
    if ((e = cudaEventRecord(p->ready, x->stream)) != cudaSuccess) {
        st = kvwc_cuda_error(e, "cudaEventRecord");
        goto err;
    }
    *plan_p = p;
    return KVW_OK;

err:
    free(host);
    if (p->dmem)
        cudaFreeAsync(p->dmem, x->stream);
    if (p->ready)
        cudaEventDestroy(p->ready);
    free(spans);
    free(p);
    return st;
}

void kvwc_exec_plan_free(kvwc_exec_h x, kvwc_plan_h p)
{
    if (p == NULL)
        return;
    if (p->dmem) {
        if (x != NULL && x->device == p->device) {
            cudaFreeAsync(p->dmem, x->stream);
        } else {
            /* No executor of the plan's device on this thread: release on the device's
             * legacy stream, leaving the thread's current device as it was. Every window
             * that used the plan was reaped, so nothing reads it any more. */
            int cur = -1;
            bool other = cudaGetDevice(&cur) == cudaSuccess && cur != p->device;
            if (other)
                cudaSetDevice(p->device);
            cudaFreeAsync(p->dmem, 0);
            if (other)
                cudaSetDevice(cur);
        }
    }
    if (p->ready)
        cudaEventDestroy(p->ready);
    free(p->spans);
    free(p);
}

kvw_status_t kvwc_exec_stage(kvwc_exec_h x, kvwc_plan_h p, int scatter, void *host, uint64_t lo,
                             uint64_t hi, int *slot_p, kvwc_step_prof_t *prof)
{
    uint64_t t0 = kvwc_now_ns();
    *slot_p = -1;
    unsigned use = scatter ? KVWC_USE_SCATTER : KVWC_USE_GATHER;
    if (p == NULL || p->spans == NULL)
        return kvwc_error(KVW_ERR_INVALID_PARAM, "staged window: the plan was not uploaded on "
                          "an executor");
    if (!(p->uses & use))
        return kvwc_error(KVW_ERR_INVALID_PARAM, "the plan was not prepared for a %s",
                          scatter ? "scatter" : "gather");
    if (hi <= lo || hi > p->bytes)
        return kvwc_error(KVW_ERR_OUT_OF_RANGE, "staged window [%llu, %llu) outside the plan's "
                          "%llu bytes", (unsigned long long)lo, (unsigned long long)hi,
                          (unsigned long long)p->bytes);
    if (host == NULL)
        return kvwc_error(KVW_ERR_INVALID_PARAM, "staged window: NULL host buffer");
    if (p->device != x->device)
        return kvwc_error(KVW_ERR_INVALID_PARAM, "the device plan lives on device %d, the "
                          "executor on device %d", p->device, x->device);
    int k = -1;
    for (int i = 0; i < KVWC_STAGE_SLOTS && k < 0; i++)
        if (!x->stage[i].plan.busy)
            k = i;
    if (k < 0)
        return kvwc_error(KVW_ERR_BUSY, "CUDA executor: %d staged windows are in flight",
                          KVWC_STAGE_SLOTS);
    kvwc_stage_slot *ss = &x->stage[k];
    kvwc_slot *s = &ss->plan;
    uint64_t len = hi - lo;
    cudaError_t e;
    if (len > ss->scap) {
        uint64_t cap = len > 2 * ss->scap ? len : 2 * ss->scap;
        if (cap < (16u << 20))
            cap = 16u << 20;
        if (ss->scratch)
            cudaFree(ss->scratch);
        ss->scratch = NULL;
        ss->scap = 0;
        if ((e = cudaMalloc(&ss->scratch, cap)) != cudaSuccess)
            return kvwc_cuda_error(e, "cudaMalloc for a staged window");
        ss->scap = cap;
    }
    kvwc_window_t w;
    kvwc_window_at(p->spans, p->num_segs, lo, hi, &w);
    uint64_t stage = (uint64_t)(uintptr_t)ss->scratch - lo;
    if ((e = cudaEventRecord(s->ev[0], x->stream)) != cudaSuccess)
        return kvwc_cuda_error(e, "cudaEventRecord");
    /* The plan may have been uploaded on another executor's stream. */
    if ((e = cudaStreamWaitEvent(x->stream, p->ready, 0)) != cudaSuccess)
        return kvwc_cuda_error(e, "cudaStreamWaitEvent");
    if (scatter && (e = cudaMemcpyAsync(ss->scratch, host, len, cudaMemcpyHostToDevice,
                                        x->stream)) != cudaSuccess)
        return kvwc_cuda_error(e, "cudaMemcpyAsync of a staged window to the device");
    if ((e = cudaEventRecord(s->ev[1], x->stream)) != cudaSuccess)
        return kvwc_cuda_error(e, "cudaEventRecord");
    kvw_status_t st = kvwc_launch_window(p, scatter ? KVWC_MODE_SCATTER : KVWC_MODE_GATHER,
                                         stage, &w, x->stream);
    if (st != KVW_OK)
        return st;
    if (!scatter && (e = cudaMemcpyAsync(host, ss->scratch, len, cudaMemcpyDeviceToHost,
                                         x->stream)) != cudaSuccess)
        return kvwc_cuda_error(e, "cudaMemcpyAsync of a staged window to the host");
    if ((e = cudaEventRecord(s->ev[2], x->stream)) != cudaSuccess)
        return kvwc_cuda_error(e, "cudaEventRecord");
    s->busy = 1;
    *slot_p = KVWC_EXEC_SLOTS + k;
    prof->launch_ns += kvwc_now_ns() - t0;
    return KVW_OK;
}

/* ---------------------------------------------------------------- benchmarks */

__global__ void kvwc_busy_kernel(uint64_t ns)
{
    uint64_t t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}

kvw_status_t kvwc_busy(void *stream, uint64_t ns)
{
    int dev = 0, sms = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess)
        return kvwc_cuda_error(e, "cudaDeviceGetAttribute(multiprocessor count)");
    kvwc_busy_kernel<<<sms, 128, 0, (cudaStream_t)stream>>>(ns);
    e = cudaGetLastError();
    if (e != cudaSuccess)
        return kvwc_cuda_error(e, "launching the busy kernel");
    return KVW_OK;
}
