/*
 * The KV digest on the GPU (module.h, exec_digest): one block per (segment, head, up to
 * KVWC_DIGEST_TOK tokens), one row per thread, hashed by digest_core.h's XXH3; the
 * block sums its rows and adds the sum to its unit with one atomic add (addition mod
 * 2^64 is what the digest is, so the order of the adds does not matter).
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

kvw_status_t kvwc_exec_digest(kvwc_exec_h x, const kvwc_digest_in_t *in)
{
    const kvwc_plan_in_t *p = in ? in->plan : NULL;
    if (x == NULL || p == NULL || in->units == NULL || (p->num_segs && in->dsegs == NULL))
        return kvwc_error(KVW_ERR_INVALID_PARAM, "exec_digest: NULL argument");
    kvwc_dig_layout_t L;
    kvwc_dig_layout(in, &L);
    uint8_t *img = (uint8_t *)calloc(1, L.units ? L.units : 1);
    if (img == NULL)
        return kvwc_error(KVW_ERR_NO_MEMORY, "out of memory for a digest's plan image");
    memcpy(img + L.segs, p->segs, (size_t)p->num_segs * sizeof(kvwc_seg_in_t));
    memcpy(img + L.dsegs, in->dsegs, (size_t)p->num_segs * sizeof(kvwc_dig_seg_t));
    uint64_t *blk0 = (uint64_t *)(img + L.blk0), *map_off = (uint64_t *)(img + L.map_off);
    uint32_t bad = kvwc_digest_bad_seg(in);
    if (bad < p->num_segs) {
        free(img);
        return kvwc_error(KVW_ERR_INVALID_PARAM, "exec_digest: segment %u's %u heads from unit "
                          "%u are past the %u units", bad, p->segs[bad].num_heads,
                          in->dsegs[bad].unit, in->num_units);
    }
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
            memcpy(img + L.pages + 4 * at, p->maps[m].pages, 4ull * p->maps[m].num_pages);
            at += p->maps[m].num_pages;
        }
    }
    if (total == 0) {
        free(img);
        return KVW_OK;
    }
    uint64_t *out = (uint64_t *)malloc(8ull * (in->num_units ? in->num_units : 1));
    if (out == NULL) {
        free(img);
        return kvwc_error(KVW_ERR_NO_MEMORY, "out of memory for a digest's units");
    }
    cudaStream_t s = kvwc_exec_stream(x);
    void *dmem = NULL;
    const char *what = "cudaMallocAsync for a digest";
    cudaError_t e = cudaMallocAsync(&dmem, L.size, s);
    uint8_t *d = (uint8_t *)dmem;
    if (e == cudaSuccess) {
        what = "cudaMemcpyAsync (the digest's plan)";
        e = cudaMemcpyAsync(d, img, L.units, cudaMemcpyHostToDevice, s);
    }
    if (e == cudaSuccess) {
        what = "cudaMemsetAsync (the digest's units)";
        e = cudaMemsetAsync(d + L.units, 0, 8ull * in->num_units, s);
    }
    kvwc_dig_args_t a;
    a.segs = (const kvwc_seg_in_t *)(d + L.segs);
    a.dsegs = (const kvwc_dig_seg_t *)(d + L.dsegs);
    a.blk0 = (const uint64_t *)(d + L.blk0);
    a.map_off = (const uint64_t *)(d + L.map_off);
    a.pages = (const uint32_t *)(d + L.pages);
    a.units = (unsigned long long *)(d + L.units);
    a.num_segs = p->num_segs;
    a.dst_side = in->dst_side;
    memcpy(a.secret, in->secret, sizeof(a.secret));
    const uint64_t max_grid = 1u << 30;
    for (uint64_t b = 0; b < total && e == cudaSuccess; b += max_grid) {
        a.blk_base = b;
        unsigned n = (unsigned)(total - b < max_grid ? total - b : max_grid);
        kvwc_digest_kernel<<<n, KVWC_DIGEST_TOK, 0, s>>>(a);
        what = "launching the digest kernel";
        e = cudaGetLastError();
    }
    if (e == cudaSuccess) {
        what = "cudaMemcpyAsync (the digest's units back)";
        e = cudaMemcpyAsync(out, a.units, 8ull * in->num_units, cudaMemcpyDeviceToHost, s);
    }
    if (dmem)
        (void)cudaFreeAsync(dmem, s);
    cudaError_t e2 = cudaStreamSynchronize(s);
    if (e == cudaSuccess && e2 != cudaSuccess) {
        e = e2;
        what = "the digest kernel";
    }
    free(img);
    if (e != cudaSuccess) {
        free(out);
        return kvwc_cuda_error(e, what);
    }
    for (uint32_t u = 0; u < in->num_units; u++)
        in->units[u] += out[u];
    free(out);
    return KVW_OK;
}
