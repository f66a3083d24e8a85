/*
 * The KV digest on the GPU (module.h, exec_digest): one block per (segment, head, up to
 * KVWC_DIGEST_TOK tokens), one row per thread, hashed by digest_core.h's XXH3; the
 * block sums its rows and adds the sum to its unit with one atomic add (addition mod
 * 2^64 is what the digest is, so the order of the adds does not matter).
 *
 * Asynchronous (ABI 8): a digest's image goes from a pinned host buffer to a device
 * buffer, both kept by the executor (per slot, and one for a batch of slot -1 digests),
 * and its units come back into the pinned buffer with cudaMemcpyAsync; a batch waits on
 * one event after its last copy back, a digest riding on a step is waited for by the
 * step's reap (copy.cu), which adds it then.
 */
#include "cuda/digest_core.h"
#include "cuda/internal.h"

#include <stdlib.h>
#include <string.h>

typedef struct kvwc_dig_args {
    const kvwc_seg_in_t *segs;
    const kvwc_dig_seg_t *dsegs;
    const uint64_t *blk0;    /* num_segs + 1 */
    const uint64_t *map_off; /* per map, its first page in `pages` */
    const uint32_t *pages;
    unsigned long long *units;
    uint64_t blk_base; /* the launch's first block */
    uint32_t num_segs;
    int dst_side;
    uint64_t secret[KVWC_DIGEST_SECRET_WORDS];
} kvwc_dig_args_t;

__global__ void __launch_bounds__(KVWC_DIGEST_TOK) kvwc_digest_kernel(kvwc_dig_args_t a)
{
    __shared__ uint64_t sec[KVWC_DIGEST_SECRET_WORDS];
    __shared__ uint64_t part[KVWC_DIGEST_TOK / 32];
    __shared__ uint32_t seg;
    uint64_t b = a.blk_base + blockIdx.x;
    if (threadIdx.x < KVWC_DIGEST_SECRET_WORDS)
        sec[threadIdx.x] = a.secret[threadIdx.x];
    if (threadIdx.x == 0)
        seg = kvwc_digest_seg_of(a.blk0, a.num_segs, b);
    __syncthreads();
    const kvwc_seg_in_t *s = &a.segs[seg];
    const kvwc_side_t *sd = a.dst_side ? &s->dst : &s->src;
    uint64_t h = 0;
    uint32_t unit = 0;
    if (!kvwc_digest_row(s, sd, a.pages + a.map_off[sd->map], &a.dsegs[seg], sec, b - a.blk0[seg],
                         threadIdx.x, &h, &unit))
        h = 0;
    for (int o = 16; o > 0; o >>= 1)
        h += __shfl_down_sync(0xffffffffu, h, o);
    if ((threadIdx.x & 31) == 0)
        part[threadIdx.x >> 5] = h;
    __syncthreads();
    if (threadIdx.x == 0) {
        uint64_t sum = 0;
        for (unsigned w = 0; w < KVWC_DIGEST_TOK / 32; w++)
            sum += part[w];
        atomicAdd(&a.units[unit], (unsigned long long)sum);
    }
}

/* The device image: segments, their digest entries, block starts, map offsets, the
 * pages of every map that has any, then the units (zeroed on the device). */
typedef struct kvwc_dig_layout {
    uint64_t segs, dsegs, blk0, map_off, pages, units, size;
    uint64_t num_pages;
} kvwc_dig_layout_t;

static uint64_t kvwc_up8(uint64_t v)
{
    return (v + 7) & ~7ull;
}

static void kvwc_dig_layout(const kvwc_digest_in_t *in, kvwc_dig_layout_t *L)
{
    const kvwc_plan_in_t *p = in->plan;
    L->num_pages = 0;
    for (uint32_t m = 0; m < p->num_maps; m++)
        if (p->maps[m].pages)
            L->num_pages += p->maps[m].num_pages;
    L->segs = 0;
    L->dsegs = kvwc_up8(L->segs + (uint64_t)p->num_segs * sizeof(kvwc_seg_in_t));
    L->blk0 = kvwc_up8(L->dsegs + (uint64_t)p->num_segs * sizeof(kvwc_dig_seg_t));
    L->map_off = L->blk0 + 8ull * (p->num_segs + 1);
    L->pages = L->map_off + 8ull * p->num_maps;
    L->units = kvwc_up8(L->pages + 4ull * L->num_pages);
    L->size = L->units + 8ull * in->num_units;
}

/* The smallest capacity of a digest buffer, and its growth: doubling, or the size. */
#define KVWC_DIG_MIN_CAP (256u << 10)

static uint64_t kvwc_dig_grown(uint64_t cap, uint64_t size)
{
    uint64_t c = size > 2 * cap ? size : 2 * cap;
    return c < KVWC_DIG_MIN_CAP ? KVWC_DIG_MIN_CAP : c;
}

void kvwc_dig_buf_free(kvwc_dig_buf_t *b)
{
    if (b->host)
        cudaFreeHost(b->host);
    if (b->dmem)
        cudaFree(b->dmem);
    b->host = NULL;
    b->dmem = NULL;
    b->cap = 0;
    b->units = NULL;
}

/* Gives an idle buffer exactly `cap` bytes on each side. */
static kvw_status_t kvwc_dig_buf_alloc(kvwc_dig_buf_t *b, uint64_t cap)
{
    kvwc_dig_buf_free(b);
    cudaError_t e;
    if ((e = cudaHostAlloc(&b->host, cap, cudaHostAllocDefault)) != cudaSuccess) {
        b->host = NULL;
        return kvwc_cuda_error(e, "cudaHostAlloc for digest images");
    }
    if ((e = cudaMalloc(&b->dmem, cap)) != cudaSuccess) {
        b->dmem = NULL;
        kvwc_dig_buf_free(b);
        return kvwc_cuda_error(e, "cudaMalloc for digest images");
    }
    b->cap = cap;
    return KVW_OK;
}

kvw_status_t kvwc_dig_buf_init(kvwc_dig_buf_t *b)
{
    return kvwc_dig_buf_alloc(b, kvwc_dig_grown(0, 0));
}

void kvwc_dig_buf_finish(kvwc_dig_buf_t *b, bool ok)
{
    if (b->units && ok) {
        const uint64_t *out = (const uint64_t *)((uint8_t *)b->host + b->units_off);
        for (uint32_t u = 0; u < b->num_units; u++)
            b->units[u] += out[u];
    }
    b->units = NULL;
}

kvw_status_t kvwc_digest_warm(void)
{
    cudaFuncAttributes fa;
    cudaError_t e = cudaFuncGetAttributes(&fa, kvwc_digest_kernel);
    if (e != cudaSuccess)
        return kvwc_cuda_error(e, "cudaFuncGetAttributes (loading the digest kernel)");
    return KVW_OK;
}

/* Makes `b` (idle) hold at least `size` bytes. Growing frees and allocates, which
 * synchronises the device, so every idle buffer of the executor below the new
 * capacity grows with it, once (as copy.cu grows its slots): idle is no digest pending,
 * so nothing in flight reads it. */
static kvw_status_t kvwc_dig_reserve(kvwc_exec_h x, kvwc_dig_buf_t *b, uint64_t size)
{
    if (size <= b->cap)
        return KVW_OK;
    uint64_t cap = kvwc_dig_grown(b->cap, size);
    uint32_t n = 0;
    kvwc_dig_buf_t *all = kvwc_exec_dig_bufs(x, &n);
    for (uint32_t i = 0; i < n; i++) {
        kvw_status_t st;
        if (&all[i] != b && (all[i].units != NULL || all[i].cap >= cap))
            continue;
        if ((st = kvwc_dig_buf_alloc(&all[i], cap)) != KVW_OK)
            return st;
    }
    return KVW_OK;
}

/* One digest, checked and laid out: its image and blocks. */
typedef struct kvwc_dig_job {
    kvwc_dig_layout_t L;
    uint64_t blocks;
    uint64_t off; /* in its buffer */
    kvwc_dig_buf_t *buf;
    cudaEvent_t done; /* the slot's completion event (slot entries) */
} kvwc_dig_job_t;

static kvw_status_t kvwc_dig_check(const kvwc_digest_in_t *in, uint32_t i, kvwc_dig_job_t *j)
{
    const kvwc_plan_in_t *p = in->plan;
    if (p == NULL || in->units == NULL || (p->num_segs && in->dsegs == NULL) ||
        (p->num_maps && p->maps == NULL) || (p->num_segs && p->segs == NULL))
        return kvwc_error(KVW_ERR_INVALID_PARAM, "exec_digest: entry %u: NULL argument", i);
    if (in->slot < -1 || in->slot >= KVWC_EXEC_SLOTS)
        return kvwc_error(KVW_ERR_INVALID_PARAM, "exec_digest: entry %u: slot %d is not -1 nor "
                          "a step slot (0 .. %d)", i, in->slot, KVWC_EXEC_SLOTS - 1);
    uint32_t bad = kvwc_digest_bad_seg(in);
    if (bad < p->num_segs)
        return kvwc_error(KVW_ERR_INVALID_PARAM, "exec_digest: segment %u's %u heads from unit "
                          "%u are past the %u units", bad, p->segs[bad].num_heads,
                          in->dsegs[bad].unit, in->num_units);
    for (uint32_t m = 0; m < p->num_maps; m++)
        if (p->maps[m].num_pages && p->maps[m].pages == NULL)
            return kvwc_error(KVW_ERR_INVALID_PARAM, "exec_digest: entry %u: map %u has %u "
                              "pages and no page list", i, m, p->maps[m].num_pages);
    kvwc_dig_layout(in, &j->L);
    j->blocks = 0;
    for (uint32_t k = 0; k < p->num_segs; k++)
        j->blocks += kvwc_digest_seg_blocks(&p->segs[k]);
    return KVW_OK;
}

/* Writes entry `in`'s image (segments, digest entries, block starts, map offsets, pages)
 * at `img`, as the kernel reads it. */
static void kvwc_dig_fill(const kvwc_digest_in_t *in, const kvwc_dig_layout_t *L, uint8_t *img)
{
    const kvwc_plan_in_t *p = in->plan;
    if (p->num_segs) {
        memcpy(img + L->segs, p->segs, (size_t)p->num_segs * sizeof(kvwc_seg_in_t));
        memcpy(img + L->dsegs, in->dsegs, (size_t)p->num_segs * sizeof(kvwc_dig_seg_t));
    }
    uint64_t *blk0 = (uint64_t *)(img + L->blk0), *map_off = (uint64_t *)(img + L->map_off);
    uint64_t total = 0;
    for (uint32_t i = 0; i < p->num_segs; i++) {
        blk0[i] = total;
        total += kvwc_digest_seg_blocks(&p->segs[i]);
    }
    blk0[p->num_segs] = total;
    uint64_t at = 0;
    for (uint32_t m = 0; m < p->num_maps; m++) {
        map_off[m] = at;
        if (p->maps[m].pages) {
            memcpy(img + L->pages + 4 * at, p->maps[m].pages, 4ull * p->maps[m].num_pages);
            at += p->maps[m].num_pages;
        }
    }
}

/* Enqueues one digest on `s`: the image up, the units zeroed, the kernel, the units back
 * into the pinned buffer. */
static kvw_status_t kvwc_dig_enqueue(const kvwc_digest_in_t *in, const kvwc_dig_job_t *j,
                                     cudaStream_t s)
{
    const kvwc_plan_in_t *p = in->plan;
    uint8_t *h = (uint8_t *)j->buf->host + j->off, *d = (uint8_t *)j->buf->dmem + j->off;
    kvwc_dig_fill(in, &j->L, h);
    const char *what = "cudaMemcpyAsync (the digest's plan)";
    cudaError_t e = cudaMemcpyAsync(d, h, j->L.units, cudaMemcpyHostToDevice, s);
    if (e == cudaSuccess) {
        what = "cudaMemsetAsync (the digest's units)";
        e = cudaMemsetAsync(d + j->L.units, 0, 8ull * in->num_units, s);
    }
    kvwc_dig_args_t a;
    a.segs = (const kvwc_seg_in_t *)(d + j->L.segs);
    a.dsegs = (const kvwc_dig_seg_t *)(d + j->L.dsegs);
    a.blk0 = (const uint64_t *)(d + j->L.blk0);
    a.map_off = (const uint64_t *)(d + j->L.map_off);
    a.pages = (const uint32_t *)(d + j->L.pages);
    a.units = (unsigned long long *)(d + j->L.units);
    a.num_segs = p->num_segs;
    a.dst_side = in->dst_side;
    memcpy(a.secret, in->secret, sizeof(a.secret));
    const uint64_t max_grid = 1u << 30;
    for (uint64_t b = 0; b < j->blocks && e == cudaSuccess; b += max_grid) {
        a.blk_base = b;
        unsigned n = (unsigned)(j->blocks - b < max_grid ? j->blocks - b : max_grid);
        kvwc_digest_kernel<<<n, KVWC_DIGEST_TOK, 0, s>>>(a);
        what = "launching the digest kernel";
        e = cudaGetLastError();
    }
    if (e == cudaSuccess) {
        what = "cudaMemcpyAsync (the digest's units back)";
        e = cudaMemcpyAsync(h + j->L.units, a.units, 8ull * in->num_units,
                            cudaMemcpyDeviceToHost, s);
    }
    return e == cudaSuccess ? KVW_OK : kvwc_cuda_error(e, what);
}

static uint64_t kvwc_up256(uint64_t v)
{
    return (v + 255) & ~255ull;
}

kvw_status_t kvwc_exec_digest(kvwc_exec_h x, const kvwc_digest_in_t *in, uint32_t n)
{
    if (x == NULL || (n && in == NULL))
        return kvwc_error(KVW_ERR_INVALID_PARAM, "exec_digest: NULL argument");
    if (n == 0)
        return KVW_OK;
    kvwc_dig_job_t one, *jobs = n == 1 ? &one : (kvwc_dig_job_t *)calloc(n, sizeof(*jobs));
    if (jobs == NULL)
        return kvwc_error(KVW_ERR_NO_MEMORY, "out of memory for %u digests", n);
    kvw_status_t st = KVW_OK;
    cudaEvent_t batch_done = NULL;
    kvwc_dig_buf_t *batch = kvwc_exec_dig_buf(x, -1, &batch_done);
    uint64_t batch_size = 0;
    uint32_t waited = 0; /* slot -1 entries with blocks to run */
    /* Everything checked before anything is enqueued. */
    for (uint32_t i = 0; st == KVW_OK && i < n; i++) {
        kvwc_dig_job_t *j = &jobs[i];
        if ((st = kvwc_dig_check(&in[i], i, j)) != KVW_OK)
            break;
        j->buf = NULL;
        j->done = NULL;
        if (in[i].slot >= 0) {
            j->buf = kvwc_exec_dig_buf(x, in[i].slot, &j->done);
            if (j->buf == NULL) {
                st = kvwc_error(KVW_ERR_INVALID_PARAM, "exec_digest: slot %d is not in flight "
                                "(a digest rides on a step launched on this executor and not "
                                "reaped yet)", in[i].slot);
            } else if (j->buf->units != NULL) {
                st = kvwc_error(KVW_ERR_INVALID_PARAM, "exec_digest: slot %d already carries "
                                "a digest (one per step)", in[i].slot);
            }
            for (uint32_t k = 0; st == KVW_OK && k < i; k++)
                if (in[k].slot == in[i].slot)
                    st = kvwc_error(KVW_ERR_INVALID_PARAM, "exec_digest: entries %u and %u "
                                    "both ride on slot %d (one digest per step)", k, i,
                                    in[i].slot);
            j->off = 0;
        } else if (j->blocks) {
            j->buf = batch;
            j->off = batch_size;
            batch_size = kvwc_up256(batch_size + j->L.size);
            waited++;
        }
    }
    /* Then room for them all, before any buffer holds an enqueued image. */
    if (st == KVW_OK && waited)
        st = kvwc_dig_reserve(x, batch, batch_size);
    for (uint32_t i = 0; st == KVW_OK && i < n; i++)
        if (in[i].slot >= 0 && jobs[i].blocks)
            st = kvwc_dig_reserve(x, jobs[i].buf, jobs[i].L.size);
    cudaStream_t s = kvwc_exec_stream(x);
    /* The batch first, then its event, then the steps' digests (not waited for). */
    bool batch_out = false, recorded = false;
    for (uint32_t i = 0; st == KVW_OK && i < n; i++)
        if (in[i].slot < 0 && jobs[i].blocks) {
            batch_out = true;
            st = kvwc_dig_enqueue(&in[i], &jobs[i], s);
        }
    cudaError_t e = cudaSuccess;
    if (st == KVW_OK && batch_out) {
        if ((e = cudaEventRecord(batch_done, s)) != cudaSuccess)
            st = kvwc_cuda_error(e, "cudaEventRecord (after the digests)");
        else
            recorded = true;
    }
    for (uint32_t i = 0; st == KVW_OK && i < n; i++) {
        kvwc_dig_job_t *j = &jobs[i];
        if (in[i].slot < 0 || j->blocks == 0)
            continue;
        st = kvwc_dig_enqueue(&in[i], j, s);
        /* The step completes after its digest, even one that failed half enqueued
         * (which adds nothing): the slot's image is not reused before. */
        if ((e = cudaEventRecord(j->done, s)) != cudaSuccess && st == KVW_OK)
            st = kvwc_cuda_error(e, "cudaEventRecord (a step's completion, after its digest)");
        if (st == KVW_OK) {
            j->buf->units = in[i].units;
            j->buf->num_units = in[i].num_units;
            j->buf->units_off = j->L.units;
        }
    }
    if (batch_out) {
        /* One wait for the whole batch; after a failure too, so that the batch buffer is
         * idle when this returns (the stream, when the event could not be recorded). */
        e = recorded ? cudaEventSynchronize(batch_done) : cudaStreamSynchronize(s);
        if (st == KVW_OK && e != cudaSuccess)
            st = kvwc_cuda_error(e, "the digest kernel");
    }
    for (uint32_t i = 0; st == KVW_OK && i < n; i++) {
        if (in[i].slot >= 0 || jobs[i].blocks == 0)
            continue;
        const uint64_t *out =
            (const uint64_t *)((uint8_t *)batch->host + jobs[i].off + jobs[i].L.units);
        for (uint32_t u = 0; u < in[i].num_units; u++)
            in[i].units[u] += out[u];
    }
    if (jobs != &one)
        free(jobs);
    return st;
}
