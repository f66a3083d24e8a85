/*
 * Fixed-width little-endian fields, the one encoding of every wire format in kvwire:
 * proto's control frames (proto/wire.c) and the transports' frames, messages and
 * address and rkey blobs. Byte by byte, so the host's byte order and alignment never
 * matter; compilers turn each into a single load or store where they can.
 */
#ifndef KVW_CORE_LE_H
#define KVW_CORE_LE_H

#include <stdint.h>

static inline void kvw__le16_put(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static inline void kvw__le32_put(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline void kvw__le64_put(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t kvw__le16_get(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}
static inline uint32_t kvw__le32_get(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}
static inline uint64_t kvw__le64_get(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

#endif
