/*
 * Wire format of the tcp transport. Every field is fixed-width little-endian.
 *
 * Address (what kvw_tl_ops_t.address returns, 32 bytes):
 *   0 u32 magic "KVWA" | 4 u8 version | 5 u8 family (4 or 6) | 6 u16 port
 *   8 u64 token (random per receiving instance) | 16 u8 ip[16] (IPv4 in the first 4)
 *
 * Packed remote key (32 bytes):
 *   0 u32 magic "KVWR" | 4 u8 version | 5 u8 transport (1 = tcp) | 6 u16 zero
 *   8 u64 token of the receiving instance | 16 u64 region id | 24 u64 region length
 *
 * Frame header (40 bytes), followed by `len` payload bytes for PUT and NOTIFY:
 *   0 u32 magic "KVWT" | 4 u8 version | 5 u8 type | 6 u16 flags (zero)
 *   8 u64 room | 16 u64 region id | 24 u64 destination offset | 32 u64 len
 *
 * A connection starts with HELLO (room = the receiver's token, other fields zero);
 * the receiver answers with a 16-byte HELLO_ACK:
 *   0 u32 magic "KVWT" | 4 u8 version | 5 u8 type HELLO_ACK | 6 u16 zero | 8 u64 token
 * and never sends anything else. Then PUT and NOTIFY frames follow in any order; a
 * NOTIFY has room, region and offset zero and len <= KVW_TL_MAX_NOTIFY.
 */
#ifndef KVW_TRANSPORT_TCP_WIRE_H
#define KVW_TRANSPORT_TCP_WIRE_H

#include "transport/tl_util.h"

#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

#define KVW_TCP_VERSION 1
#define KVW_TCP_ADDR_MAGIC 0x4157564bu  /* "KVWA" */
#define KVW_TCP_RKEY_MAGIC 0x5257564bu  /* "KVWR" */
#define KVW_TCP_FRAME_MAGIC 0x5457564bu /* "KVWT" */
#define KVW_TCP_RKEY_KIND 1

#define KVW_TCP_ADDR_LEN 32
#define KVW_TCP_RKEY_LEN 32
#define KVW_TCP_HDR_LEN 40
#define KVW_TCP_ACK_LEN 16

enum {
    KVW_TCP_HELLO = 1,
    KVW_TCP_PUT = 2,
    KVW_TCP_NOTIFY = 3,
    KVW_TCP_HELLO_ACK = 4
};

typedef struct kvw_tcp_hdr {
    uint32_t magic;
    uint8_t version, type;
    uint16_t flags;
    uint64_t room, region, off, len;
} kvw_tcp_hdr_t;

static inline void kvw_tcp_hdr_encode(uint8_t *p, uint8_t type, uint64_t room,
                                      uint64_t region, uint64_t off, uint64_t len)
{
    kvw__le32_put(p, KVW_TCP_FRAME_MAGIC);
    p[4] = KVW_TCP_VERSION;
    p[5] = type;
    kvw__le16_put(p + 6, 0);
    kvw__le64_put(p + 8, room);
    kvw__le64_put(p + 16, region);
    kvw__le64_put(p + 24, off);
    kvw__le64_put(p + 32, len);
}

static inline void kvw_tcp_hdr_decode(const uint8_t *p, kvw_tcp_hdr_t *h)
{
    h->magic = kvw__le32_get(p);
    h->version = p[4];
    h->type = p[5];
    h->flags = kvw__le16_get(p + 6);
    h->room = kvw__le64_get(p + 8);
    h->region = kvw__le64_get(p + 16);
    h->off = kvw__le64_get(p + 24);
    h->len = kvw__le64_get(p + 32);
}

typedef struct kvw_tcp_addr {
    int family; /* AF_INET or AF_INET6 */
    uint16_t port;
    uint64_t token;
    uint8_t ip[16];
} kvw_tcp_addr_t;

static inline void kvw_tcp_addr_encode(uint8_t *p, const kvw_tcp_addr_t *a, int is_v6)
{
    memset(p, 0, KVW_TCP_ADDR_LEN);
    kvw__le32_put(p, KVW_TCP_ADDR_MAGIC);
    p[4] = KVW_TCP_VERSION;
    p[5] = is_v6 ? 6 : 4;
    kvw__le16_put(p + 6, a->port);
    kvw__le64_put(p + 8, a->token);
    memcpy(p + 16, a->ip, is_v6 ? 16 : 4);
}

/* Returns 0, or -1 when the bytes are not a tcp address of this version. family is
 * left as 4 or 6; the caller maps it to AF_INET / AF_INET6. */
static inline int kvw_tcp_addr_decode(const void *buf, size_t len, kvw_tcp_addr_t *a)
{
    const uint8_t *p = (const uint8_t *)buf;
    if (buf == NULL || len != KVW_TCP_ADDR_LEN || kvw__le32_get(p) != KVW_TCP_ADDR_MAGIC ||
        p[4] != KVW_TCP_VERSION || (p[5] != 4 && p[5] != 6))
        return -1;
    a->family = p[5];
    a->port = kvw__le16_get(p + 6);
    a->token = kvw__le64_get(p + 8);
    memcpy(a->ip, p + 16, 16);
    return 0;
}

/* The socket address of decoded address `a`, into *ss; returns its length. */
static inline socklen_t kvw_tcp_addr_sockaddr(const kvw_tcp_addr_t *a, struct sockaddr_storage *ss)
{
    memset(ss, 0, sizeof(*ss));
    if (a->family == 6) {
        struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)(void *)ss;
        in6->sin6_family = AF_INET6;
        in6->sin6_port = htons(a->port);
        memcpy(&in6->sin6_addr, a->ip, 16);
        return (socklen_t)sizeof(*in6);
    }
    struct sockaddr_in *in = (struct sockaddr_in *)(void *)ss;
    in->sin_family = AF_INET;
    in->sin_port = htons(a->port);
    memcpy(&in->sin_addr, a->ip, 4);
    return (socklen_t)sizeof(*in);
}

#endif
