/* Device copies of ranks, for tests and tools that keep KV caches in GPU memory (see
 * testkit.h). */
#include "testkit.h"

#include <stdio.h>
#include <stdlib.h>

int kvt_gpu_attach(kvt_rank_t *ranks, uint32_t n, int device, uint8_t ****dev_p, char *msg,
                   size_t cap)
{
    *dev_p = NULL;
    if (kvt_cuda_set_device(device) != KVW_OK)
        return snprintf(msg, cap, "%s", kvt_cuda_error()), -1;
    uint8_t ***dev = calloc(n, sizeof(*dev));
    if (dev == NULL)
        return snprintf(msg, cap, "out of memory"), -1;
    *dev_p = dev;
    for (uint32_t k = 0; k < n; k++) {
        kvt_rank_t *r = &ranks[k];
        dev[k] = calloc(r->num_bufs, sizeof(uint8_t *));
        if (dev[k] == NULL)
            return snprintf(msg, cap, "out of memory"), -1;
        for (uint32_t i = 0; i < r->num_bufs; i++) {
            uint64_t total = r->alloc_len[i] + 2ull * r->guard;
            void *d;
            /* Allocated in whole 64 KiB, as an engine's allocator hands out (PyTorch's
             * caching allocator: segments of whole 2 MiB): another process that opens an
             * allocation of an odd size through CUDA IPC reads and writes its random
             * pages at 0.6-0.7 of the speed it gets otherwise (bench/gpu/step_shape.cu,
             * bench/gpu/NOTES.md), which the benchmarks would measure instead of kvwire.
             * The padding after the guard is never read. */
            if (kvt_cuda_malloc((total + 65535) & ~65535ull, &d) != KVW_OK)
                return snprintf(msg, cap, "%s", kvt_cuda_error()), -1;
            dev[k][i] = d;
            if (kvt_cuda_memcpy(d, r->mem[i], total, NULL) != KVW_OK)
                return snprintf(msg, cap, "%s", kvt_cuda_error()), -1;
            r->bufs[i].addr = (uint8_t *)d + r->guard;
            r->bufs[i].mem_kind = KVW_MEM_CUDA;
            r->bufs[i].device = device;
        }
        kvw_rank_destroy(r->h);
        r->h = NULL;
        if (kvt_rank_open(r) != KVW_OK)
            return snprintf(msg, cap, "%s", kvw_last_error()), -1;
    }
    return 0;
}

int kvt_gpu_pull(kvt_rank_t *ranks, uint32_t n, uint8_t ***dev, char *msg, size_t cap)
{
    for (uint32_t k = 0; dev && k < n; k++) {
        kvt_rank_t *r = &ranks[k];
        for (uint32_t i = 0; i < r->num_bufs; i++)
            if (kvt_cuda_memcpy(r->mem[i], dev[k][i], r->alloc_len[i] + 2ull * r->guard,
                                NULL) != KVW_OK)
                return snprintf(msg, cap, "%s", kvt_cuda_error()), -1;
    }
    return 0;
}

void kvt_gpu_free(const kvt_rank_t *ranks, uint32_t n, uint8_t ***dev)
{
    for (uint32_t k = 0; dev && k < n; k++) {
        for (uint32_t i = 0; dev[k] && i < ranks[k].num_bufs; i++)
            if (dev[k][i])
                kvt_cuda_free(dev[k][i]);
        free(dev[k]);
    }
    free(dev);
}
