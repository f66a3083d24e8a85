// The experiments' plain copy of one 16 KiB piece (bench/gpu/ipc_pages.cu, tlb_cold.cu):
// one block of 128 threads, each loading 8 x 16 B, then storing them.
#pragma once
#include <cuda_runtime.h>

__device__ __forceinline__ void move_page(const uint4 *s, uint4 *d)
{
    uint4 v[8];
#pragma unroll
    for (int k = 0; k < 8; k++)
        v[k] = s[threadIdx.x + k * 128];
#pragma unroll
    for (int k = 0; k < 8; k++)
        d[threadIdx.x + k * 128] = v[k];
}
