/* SHA-256 and HMAC-SHA-256 (FIPS 180-4, RFC 2104), for the shared-secret handshake. */
#ifndef KVW_CORE_SHA256_H
#define KVW_CORE_SHA256_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvw_sha256 {
    uint32_t h[8];
    uint64_t len;
    uint8_t buf[64];
    size_t fill;
} kvw_sha256_t;

void kvw__sha256_init(kvw_sha256_t *c);
void kvw__sha256_update(kvw_sha256_t *c, const void *p, size_t n);
void kvw__sha256_final(kvw_sha256_t *c, uint8_t out[32]);
void kvw__hmac_sha256(const void *key, size_t klen, const void *msg, size_t mlen, uint8_t out[32]);

/* Incremental HMAC-SHA256, for messages in several parts. */
typedef struct kvw_hmac {
    kvw_sha256_t inner;
    uint8_t opad[64];
} kvw_hmac_t;
void kvw__hmac_init(kvw_hmac_t *h, const void *key, size_t klen);
void kvw__hmac_update(kvw_hmac_t *h, const void *p, size_t n);
void kvw__hmac_final(kvw_hmac_t *h, uint8_t out[32]);
/* Constant-time comparison: 1 if equal. */
int kvw__ct_equal(const uint8_t *a, const uint8_t *b, size_t n);

#endif
