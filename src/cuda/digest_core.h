/*
 * The KV digest's row hash and row walk, written once in C for the device and the host
 * (src/plan/digest.h defines the digest): digest.cu runs them on the GPU, the CPU
 * emulation of the module (tests/gpu/cuda_emu_module.c) runs the same functions on the
 * CPU, and tests/test_digest_core.c checks the hash against libxxhash's
 * XXH3_64bits_withSeed on every length class, so that CI without a GPU checks what the
 * kernel computes.
 *
 * The hash is XXH3's 64-bit variant with a seed, written from the xxHash specification
 * (doc/xxhash_spec.md of the xxHash project): the short (0-16 bytes), middle (17-128,
 * 129-240) and long (stripes of 64 bytes, blocks of 1024) paths. Its 192-byte default
 * secret is not written here: the core library takes it from libxxhash
 * (XXH3_generateSecret_fromSeed with seed 0 yields it) and hands it to the module as 24
 * little-endian words (kvwc_digest_in_t.secret). Little-endian hosts and devices only
 * (x86-64, aarch64, NVIDIA GPUs).
 */
#ifndef KVW_CUDA_DIGEST_CORE_H
#define KVW_CUDA_DIGEST_CORE_H

#include "cuda/copy_core.h"
#include "plan/digest_seed.h"

#include <stdint.h>
#include <string.h>

#define KVWC_P32_1 0x9E3779B1u
#define KVWC_P32_2 0x85EBCA77u
#define KVWC_P32_3 0xC2B2AE3Du
#define KVWC_P64_1 0x9E3779B185EBCA87ull
#define KVWC_P64_2 0xC2B2AE3D27D4EB4Full
#define KVWC_P64_3 0x165667B19E3779F9ull
#define KVWC_P64_4 0x85EBCA77C2B2AE63ull
#define KVWC_P64_5 0x27D4EB2F165667C5ull

/* Reads 8 little-endian bytes at any address. On the device, from the aligned words that
 * hold them (never past the word holding the last byte, so never outside the
 * allocation); on the host, memcpy. */
KVWC_HD uint64_t kvwc_rd64(const uint8_t *p)
{
#ifdef __CUDA_ARCH__
    uintptr_t a = (uintptr_t)p;
    unsigned sh = (unsigned)(a & 7u) * 8u;
    const uint64_t *w = (const uint64_t *)(a & ~(uintptr_t)7);
    return sh ? (w[0] >> sh) | (w[1] << (64u - sh)) : w[0];
#else
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
#endif
}

KVWC_HD uint32_t kvwc_rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Byte `off` of the secret held as little-endian words: 8 bytes from any offset. */
KVWC_HD uint64_t kvwc_sec64(const uint64_t *w, unsigned off)
{
    unsigned i = off >> 3, sh = (off & 7u) * 8u;
    return sh ? (w[i] >> sh) | (w[i + 1] << (64u - sh)) : w[i];
}

KVWC_HD uint32_t kvwc_sec32(const uint64_t *w, unsigned off)
{
    return (uint32_t)kvwc_sec64(w, off);
}

KVWC_HD uint64_t kvwc_mulfold(uint64_t a, uint64_t b)
{
#ifdef __CUDA_ARCH__
    return (a * b) ^ __umul64hi(a, b);
#else
    unsigned __int128 p = (unsigned __int128)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
#endif
}

KVWC_HD uint64_t kvwc_rotl64(uint64_t x, unsigned r)
{
    return (x << r) | (x >> (64u - r));
}

KVWC_HD uint64_t kvwc_swap64(uint64_t x)
{
    x = ((x & 0x00ff00ff00ff00ffull) << 8) | ((x >> 8) & 0x00ff00ff00ff00ffull);
    x = ((x & 0x0000ffff0000ffffull) << 16) | ((x >> 16) & 0x0000ffff0000ffffull);
    return (x << 32) | (x >> 32);
}

KVWC_HD uint32_t kvwc_swap32(uint32_t x)
{
    return (x >> 24) | ((x >> 8) & 0xff00u) | ((x << 8) & 0xff0000u) | (x << 24);
}

KVWC_HD uint64_t kvwc_avalanche64(uint64_t h) /* xxHash64's final mix */
{
    h ^= h >> 33;
    h *= KVWC_P64_2;
    h ^= h >> 29;
    h *= KVWC_P64_3;
    return h ^ (h >> 32);
}

KVWC_HD uint64_t kvwc_avalanche3(uint64_t h) /* XXH3's */
{
    h ^= h >> 37;
    h *= 0x165667919E3779F9ull;
    return h ^ (h >> 32);
}

KVWC_HD uint64_t kvwc_rrmxmx(uint64_t h, uint64_t len)
{
    h ^= kvwc_rotl64(h, 49) ^ kvwc_rotl64(h, 24);
    h *= 0x9FB21C651E98DF25ull;
    h ^= (h >> 35) + len;
    h *= 0x9FB21C651E98DF25ull;
    return h ^ (h >> 28);
}

KVWC_HD uint64_t kvwc_mix16(const uint8_t *in, const uint64_t *sec, unsigned off, uint64_t seed)
{
    return kvwc_mulfold(kvwc_rd64(in) ^ (kvwc_sec64(sec, off) + seed),
                        kvwc_rd64(in + 8) ^ (kvwc_sec64(sec, off + 8) - seed));
}

KVWC_HD uint64_t kvwc_xxh3_short(const uint8_t *in, uint64_t len, const uint64_t *sec,
                                 uint64_t seed)
{
    if (len > 8) {
        uint64_t f1 = (kvwc_sec64(sec, 24) ^ kvwc_sec64(sec, 32)) + seed;
        uint64_t f2 = (kvwc_sec64(sec, 40) ^ kvwc_sec64(sec, 48)) - seed;
        uint64_t lo = kvwc_rd64(in) ^ f1, hi = kvwc_rd64(in + len - 8) ^ f2;
        return kvwc_avalanche3(len + kvwc_swap64(lo) + hi + kvwc_mulfold(lo, hi));
    }
    if (len >= 4) {
        seed ^= (uint64_t)kvwc_swap32((uint32_t)seed) << 32;
        uint64_t v = kvwc_rd32(in + len - 4) + ((uint64_t)kvwc_rd32(in) << 32);
        uint64_t flip = (kvwc_sec64(sec, 8) ^ kvwc_sec64(sec, 16)) - seed;
        return kvwc_rrmxmx(v ^ flip, len);
    }
    if (len > 0) {
        uint32_t c = (uint32_t)in[0] << 16 | (uint32_t)in[len >> 1] << 24 |
                     (uint32_t)in[len - 1] | (uint32_t)len << 8;
        uint64_t flip = (uint64_t)(kvwc_sec32(sec, 0) ^ kvwc_sec32(sec, 4)) + seed;
        return kvwc_avalanche64((uint64_t)c ^ flip);
    }
    return kvwc_avalanche64(seed ^ (kvwc_sec64(sec, 56) ^ kvwc_sec64(sec, 64)));
}

KVWC_HD uint64_t kvwc_xxh3_mid(const uint8_t *in, uint64_t len, const uint64_t *sec,
                               uint64_t seed)
{
    uint64_t acc = len * KVWC_P64_1;
    if (len <= 128) {
        if (len > 32) {
            if (len > 64) {
                if (len > 96) {
                    acc += kvwc_mix16(in + 48, sec, 96, seed);
                    acc += kvwc_mix16(in + len - 64, sec, 112, seed);
                }
                acc += kvwc_mix16(in + 32, sec, 64, seed);
                acc += kvwc_mix16(in + len - 48, sec, 80, seed);
            }
            acc += kvwc_mix16(in + 16, sec, 32, seed);
            acc += kvwc_mix16(in + len - 32, sec, 48, seed);
        }
        acc += kvwc_mix16(in, sec, 0, seed);
        acc += kvwc_mix16(in + len - 16, sec, 16, seed);
        return kvwc_avalanche3(acc);
    }
    for (unsigned i = 0; i < 8; i++)
        acc += kvwc_mix16(in + 16 * i, sec, 16 * i, seed);
    acc = kvwc_avalanche3(acc);
    unsigned rounds = (unsigned)(len / 16);
    for (unsigned i = 8; i < rounds; i++)
        acc += kvwc_mix16(in + 16 * i, sec, 16 * (i - 8) + 3, seed);
    acc += kvwc_mix16(in + len - 16, sec, 136 - 17, seed);
    return kvwc_avalanche3(acc);
}

KVWC_HD void kvwc_stripe(uint64_t *acc, const uint8_t *in, const uint64_t *sec, unsigned off)
{
    for (unsigned i = 0; i < 8; i++) {
        uint64_t v = kvwc_rd64(in + 8 * i);
        uint64_t k = v ^ kvwc_sec64(sec, off + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (uint64_t)(uint32_t)k * (k >> 32);
    }
}

/* Inputs over 240 bytes: a secret derived from the seed, 8 accumulators over stripes of
 * 64 bytes, scrambled after each block of 16 stripes. */
KVWC_HD uint64_t kvwc_xxh3_long(const uint8_t *in, uint64_t len, const uint64_t *ksec,
                                uint64_t seed)
{
    uint64_t sec[24];
    for (unsigned i = 0; i < 24; i += 2) {
        sec[i] = ksec[i] + seed;
        sec[i + 1] = ksec[i + 1] - seed;
    }
    uint64_t acc[8] = {KVWC_P32_3, KVWC_P64_1, KVWC_P64_2, KVWC_P64_3,
                       KVWC_P64_4, KVWC_P32_2, KVWC_P64_5, KVWC_P32_1};
    const uint64_t block = 1024; /* 16 stripes: (192 - 64) / 8 */
    uint64_t blocks = (len - 1) / block;
    for (uint64_t b = 0; b < blocks; b++) {
        for (unsigned n = 0; n < 16; n++)
            kvwc_stripe(acc, in + b * block + 64 * n, sec, 8 * n);
        for (unsigned i = 0; i < 8; i++) {
            uint64_t a = acc[i];
            a ^= a >> 47;
            a ^= sec[16 + i];
            acc[i] = a * KVWC_P32_1;
        }
    }
    unsigned stripes = (unsigned)(((len - 1) - block * blocks) / 64);
    for (unsigned n = 0; n < stripes; n++)
        kvwc_stripe(acc, in + blocks * block + 64 * n, sec, 8 * n);
    kvwc_stripe(acc, in + len - 64, sec, 192 - 64 - 7);
    uint64_t r = len * KVWC_P64_1;
    for (unsigned i = 0; i < 4; i++)
        r += kvwc_mulfold(acc[2 * i] ^ kvwc_sec64(sec, 11 + 16 * i),
                          acc[2 * i + 1] ^ kvwc_sec64(sec, 11 + 16 * i + 8));
    return kvwc_avalanche3(r);
}

/* XXH3_64bits_withSeed(in, len, seed), the default secret given as 24 words. */
KVWC_HD uint64_t kvwc_xxh3(const void *p, uint64_t len, const uint64_t *secret, uint64_t seed)
{
    const uint8_t *in = (const uint8_t *)p;
    if (len <= 16)
        return kvwc_xxh3_short(in, len, secret, seed);
    if (len <= 240)
        return kvwc_xxh3_mid(in, len, secret, seed);
    return kvwc_xxh3_long(in, len, secret, seed);
}

/*
 * Work decomposition: a segment's rows are cut into blocks of one head and up to
 * KVWC_DIGEST_TOK consecutive tokens (one token per thread), numbered segment by
 * segment (kvwc_digest_in_t.blk0[i]: the first block of segment i; blk0[num_segs] the
 * total). A block's rows all add to one unit, so a block sums them first and adds one
 * value to the unit.
 */
#ifndef KVWC_DIGEST_TOK
#define KVWC_DIGEST_TOK 128u
#endif

/* The first segment whose heads do not all fall inside the digest's units (num_segs:
 * none), checked before any block runs. */
KVWC_HD uint32_t kvwc_digest_bad_seg(const kvwc_digest_in_t *in)
{
    for (uint32_t i = 0; i < in->plan->num_segs; i++) {
        uint32_t n = in->plan->segs[i].num_heads, u = in->dsegs[i].unit;
        if (n && (u > in->num_units || n > in->num_units - u))
            return i;
    }
    return in->plan->num_segs;
}

/* The segment of block `b` (binary search over blk0). */
KVWC_HD uint32_t kvwc_digest_seg_of(const uint64_t *blk0, uint32_t num_segs, uint64_t b)
{
    uint32_t lo = 0, hi = num_segs; /* blk0[lo] <= b < blk0[hi] */
    while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (blk0[mid] <= b)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* Blocks of a segment: heads times token chunks. */
KVWC_HD uint64_t kvwc_digest_seg_blocks(const kvwc_seg_in_t *s)
{
    uint64_t n = s->tok_end > s->tok_begin ? s->tok_end - s->tok_begin : 0;
    return (uint64_t)s->num_heads * ((n + KVWC_DIGEST_TOK - 1) / KVWC_DIGEST_TOK);
}

/* The hash of row `j` (0 .. KVWC_DIGEST_TOK - 1) of block `b` of segment `s` on side
 * `sd` (pages: that side's page list), and its unit; false when the block has no such
 * row (past the segment's last token). */
KVWC_HD int kvwc_digest_row(const kvwc_seg_in_t *s, const kvwc_side_t *sd, const uint32_t *pages,
                            const kvwc_dig_seg_t *ds, const uint64_t *secret, uint64_t b_in_seg,
                            uint32_t j, uint64_t *hash_p, uint32_t *unit_p)
{
    uint64_t chunks = (s->tok_end - s->tok_begin + KVWC_DIGEST_TOK - 1) / KVWC_DIGEST_TOK;
    uint32_t k = (uint32_t)(b_in_seg / chunks);
    uint64_t t = s->tok_begin + (b_in_seg % chunks) * KVWC_DIGEST_TOK + j;
    *unit_p = ds->unit + k;
    if (t >= s->tok_end)
        return 0;
    uint64_t ps = sd->page_size ? sd->page_size : 1;
    uint64_t rel = t - sd->first_token;
    uint64_t a = sd->base + (uint64_t)pages[rel / ps] * sd->page_stride +
                 (rel % ps) * sd->token_stride + (uint64_t)k * sd->head_stride;
    *hash_p = kvwc_xxh3((const void *)(uintptr_t)a, s->head_bytes, secret,
                        kvw_digest_seed_of(ds->seed_base, ds->head0 + k, t));
    return 1;
}

#endif
