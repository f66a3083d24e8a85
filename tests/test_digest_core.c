/*
 * The GPU's row hash (src/cuda/digest_core.h, XXH3-64 with a seed written for the device
 * and the host) against libxxhash's XXH3_64bits_withSeed, on the CPU: every length from
 * 0 to 2304 bytes (each of XXH3's paths: 0, 1-3, 4-8, 9-16, 17-128, 129-240 and the long
 * one, across its 1024-byte blocks and partial stripes), then longer rows up to a state
 * row of 64 KiB, each at every start offset 0-7 (unaligned rows) and with several seeds
 * (0, 1, the top bit set, all ones, random). Also: the secret the core hands the module
 * against XXH3's own secret derivation (a hash with that secret equals the default one).
 * (The seeds are one function for both, plan/digest_seed.h; test_digest checks it
 * against the mixing written out again.)
 * A mismatch prints the length, offset and seed.
 */
#include "testkit.h"
#include "check.h"

#include "cuda/digest_core.h"
#include "plan/digest.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint64_t next(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static int mismatches;

static void one(const uint8_t *p, uint64_t len, const uint64_t *sec, uint64_t seed, uint64_t off)
{
    uint64_t want = XXH3_64bits_withSeed(p, len, seed);
    uint64_t got = kvwc_xxh3(p, len, sec, seed);
    if (want != got && mismatches++ < 20)
        CHECK(0, "length %llu at offset %llu, seed 0x%016llx: XXH3 0x%016llx, digest_core "
              "0x%016llx", (unsigned long long)len, (unsigned long long)off,
              (unsigned long long)seed, (unsigned long long)want, (unsigned long long)got);
    else if (want != got)
        failures++;
}

int main(void)
{
    uint64_t sec[KVW_DIGEST_SECRET_WORDS];
    kvw__digest_secret(sec);
    /* The words are XXH3's default secret: hashing with them as a custom secret gives
     * the default hash (lengths over 240 read the secret whole). */
    uint8_t sb[8 * KVW_DIGEST_SECRET_WORDS];
    for (unsigned i = 0; i < sizeof(sb); i++)
        sb[i] = (uint8_t)(sec[i / 8] >> (8 * (i % 8)));
    uint8_t probe[1000];
    for (unsigned i = 0; i < sizeof(probe); i++)
        probe[i] = (uint8_t)next();
    CHECK(XXH3_64bits_withSecret(probe, sizeof(probe), sb, sizeof(sb)) ==
              XXH3_64bits(probe, sizeof(probe)),
          "kvw__digest_secret is not XXH3's default secret");

    const uint64_t max = 65536 + 71;
    uint8_t *buf = malloc(max + 16);
    CHECK(buf != NULL, "out of memory");
    if (buf == NULL)
        return 1;
    for (uint64_t i = 0; i < max + 16; i++)
        buf[i] = (uint8_t)next();
    const uint64_t seeds[] = {0, 1, 0x8000000000000000ull, 0xffffffffffffffffull};
    uint64_t checked = 0;
    for (uint64_t len = 0; len <= 2304; len++)
        for (uint64_t off = 0; off < 8; off++) {
            for (unsigned k = 0; k < 4; k++, checked++)
                one(buf + off, len, sec, seeds[k], off);
            one(buf + off, len, sec, next(), off), checked++;
        }
    const uint64_t longer[] = {3071, 3072, 3073, 4096, 4159, 8191, 16384 + 63, 32768, 65536,
                               max};
    for (unsigned i = 0; i < sizeof(longer) / sizeof(longer[0]); i++)
        for (uint64_t off = 0; off < 8; off += 3) {
            one(buf + off, longer[i], sec, next(), off), checked++;
            one(buf + off, longer[i], sec, 0, off), checked++;
        }
    free(buf);

    printf("test_digest_core: %llu hashes compared with XXH3_64bits_withSeed, %d differ\n",
           (unsigned long long)checked, mismatches);
    if (failures) {
        fprintf(stderr, "test_digest_core: %d failures\n", failures);
        return 1;
    }
    printf("test_digest_core: all checks passed\n");
    return 0;
}
