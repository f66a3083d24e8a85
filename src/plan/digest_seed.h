/*
 * The KV digest's seed of (layer, component, global head, token) (plan/digest.h), written
 * once for the host and the device: src/plan/digest.c and the CUDA module's digest
 * (src/cuda/digest_core.h) both include it.
 */
#ifndef KVW_PLAN_DIGEST_SEED_H
#define KVW_PLAN_DIGEST_SEED_H

#include <stdint.h>

#ifdef __CUDACC__
#define KVW_DIGEST_FN __host__ __device__ __forceinline__
#else
#define KVW_DIGEST_FN static inline
#endif

/* splitmix64's finaliser: a bijection on 64-bit words. */
KVW_DIGEST_FN uint64_t kvw_digest_fmix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Tokens are below 2^40 and heads below 2^24 (kvwire's limits), so (head, token) and
 * (layer, comp) pack into one word each without loss. */
KVW_DIGEST_FN uint64_t kvw_digest_seed_base(uint32_t layer, uint32_t comp)
{
    return kvw_digest_fmix(((uint64_t)layer << 32 | comp) + 0x6b767764ull);
}

KVW_DIGEST_FN uint64_t kvw_digest_seed_of(uint64_t base, uint32_t head, uint64_t token)
{
    return kvw_digest_fmix(base ^ ((uint64_t)head << 40 | (token & ((1ull << 40) - 1))));
}

#endif
