/*
 * Wire format of kvwire's control messages. Every frame is a 12-byte header (magic,
 * version, type, flags, payload length; little-endian, fixed width) and a payload of
 * at most KVW_WIRE_MAX_PAYLOAD bytes. Readers check every field against the bytes
 * that remain before using it; a short or oversized field marks the reader bad.
 */
#ifndef KVW_PROTO_WIRE_H
#define KVW_PROTO_WIRE_H

#include "core/core.h"
#include "core/sock.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVW_WIRE_MAGIC 0x3157564bu /* "KVW1" */
/* 2: DONE frames carry the digest of a verified room (kvw_done_msg_t.digest_n). */
#define KVW_WIRE_VERSION 2
#define KVW_WIRE_HDR 12
#define KVW_WIRE_MAX_PAYLOAD (64u << 20)
/* Units of one KVW_MSG_DIGEST frame at most (layers x components x local heads of a
 * decode rank: 8 MiB of digest). */
#define KVW_DIGEST_MAX_UNITS (1u << 20)

typedef enum kvw_msg_type {
    KVW_MSG_HELLO = 1,     /* decode -> prefill: registration */
    KVW_MSG_ACCEPT = 2,    /* prefill -> decode */
    KVW_MSG_REJECT = 3,    /* prefill -> decode: reason */
    KVW_MSG_REQ = 4,       /* decode -> prefill: a room's destination pages */
    KVW_MSG_ABORT = 5,     /* either way: room, reason */
    KVW_MSG_ABORT_ACK = 6, /* prefill -> decode */
    KVW_MSG_FAILED = 7,    /* prefill -> decode: room, status, reason */
    KVW_MSG_HEARTBEAT = 8,
    KVW_MSG_DONE = 9,      /* prefill -> decode through the transport, after the data */
    KVW_MSG_STAGE_ASK = 10,   /* prefill -> decode: room, bytes of staging space wanted */
    KVW_MSG_STAGE_GRANT = 11, /* decode -> prefill: room, offset, length granted */
    KVW_MSG_ROOM_DONE = 12,   /* decode -> prefill: every byte of the room from you landed */
    KVW_MSG_BIND = 13,        /* prefill -> decode through the transport, first: binds that
                                 data connection to the control session (peer id, nonce) */
    KVW_MSG_BS_REGISTER = 20, /* prefill rank -> bootstrap */
    KVW_MSG_BS_OK = 21,
    KVW_MSG_BS_LOOKUP = 22,   /* decode -> bootstrap */
    KVW_MSG_BS_TABLE = 23,
    KVW_MSG_BS_ERROR = 24,    /* bootstrap -> client: status, reason (e.g. table full) */
    KVW_MSG_BS_HOLD = 25,     /* prefill rank -> bootstrap: register for as long as this
                                 connection stays open */
    KVW_MSG_BS_CHALLENGE = 26, /* prefill rank -> bootstrap (empty), and the answer: a
                                  32-byte nonce the registration on this connection MACs */
    KVW_MSG_CHALLENGE = 30,   /* prefill -> decode: nonce for the shared secret */
    KVW_MSG_META = 13,        /* prefill -> decode: room, the room's metadata bytes */
    KVW_MSG_DIGEST = 14, /* at most KVW_DIGEST_MAX_UNITS units */      /* prefill -> decode: room, the KV digest of what this rank
                                 sent the decode rank (u32 count, count u64 units) */
    KVW_MSG_MAX = 31
} kvw_msg_type_t;

typedef struct kvw_wbuf {
    uint8_t *p;
    size_t len, cap;
    bool oom;
} kvw_wbuf_t;

typedef struct kvw_rbuf {
    const uint8_t *p;
    size_t len, pos;
    bool bad;
} kvw_rbuf_t;

/* Writer: starts a frame of `type`; kvw__wb_finish fills in the length. */
void kvw__wb_init(kvw_wbuf_t *w, uint8_t type);
void kvw__wb_u8(kvw_wbuf_t *w, uint8_t v);
void kvw__wb_u16(kvw_wbuf_t *w, uint16_t v);
void kvw__wb_u32(kvw_wbuf_t *w, uint32_t v);
void kvw__wb_u64(kvw_wbuf_t *w, uint64_t v);
void kvw__wb_bytes(kvw_wbuf_t *w, const void *p, size_t n); /* u32 length + bytes */
void kvw__wb_str(kvw_wbuf_t *w, const char *s);
kvw_status_t kvw__wb_finish(kvw_wbuf_t *w); /* NO_MEMORY if any append failed */
/* The uint32_t fields of struct `s` at the byte offsets offs[0..n), in that order: one
 * table of offsets serves the writer and the reader, so both keep the same order. */
void kvw__wb_u32_fields(kvw_wbuf_t *w, const void *s, const size_t *offs, size_t n);
void kvw__wb_free(kvw_wbuf_t *w);

/* Header parse: OK, or MALFORMED with a message (bad magic, version, type, length). */
kvw_status_t kvw__wire_header(const uint8_t hdr[KVW_WIRE_HDR], uint8_t *type_p, uint32_t *len_p);

void kvw__rb_init(kvw_rbuf_t *r, const void *p, size_t len);
uint8_t kvw__rb_u8(kvw_rbuf_t *r);
uint16_t kvw__rb_u16(kvw_rbuf_t *r);
uint32_t kvw__rb_u32(kvw_rbuf_t *r);
uint64_t kvw__rb_u64(kvw_rbuf_t *r);
void kvw__rb_u32_fields(kvw_rbuf_t *r, void *s, const size_t *offs, size_t n);
/* Returns a pointer into the frame and its length (<= max), or NULL and marks bad. */
const void *kvw__rb_bytes(kvw_rbuf_t *r, size_t max, size_t *len_p);
/* Copies a string of at most cap-1 bytes into out (NUL-terminated). */
void kvw__rb_str(kvw_rbuf_t *r, char *out, size_t cap);
/* OK if nothing was short and every byte was consumed; else MALFORMED naming `what`. */
kvw_status_t kvw__rb_done(kvw_rbuf_t *r, const char *what);

/* Frames on a socket with a deadline (absolute kvw__now_ns()); the byte loops under
 * them (kvw__sock_send_all, kvw__sock_recv_all) are core/sock.h. Reads one whole frame
 * (header + payload, malloc'd into *payload_p). */
kvw_status_t kvw__sock_recv_frame(int fd, uint64_t deadline_ns, uint8_t *type_p,
                                  uint8_t **payload_p, uint32_t *len_p);
/* The same, refusing (OUT_OF_RANGE, nothing allocated) a payload longer than max_len. */
kvw_status_t kvw__sock_recv_frame_max(int fd, uint64_t deadline_ns, uint32_t max_len,
                                      uint8_t *type_p, uint8_t **payload_p, uint32_t *len_p);

/* "host:port" parsing and TCP helpers. IPv6 hosts are bracketed: "[::1]:8998",
 * "[fe80::1%eth0]:8998"; parsing returns the host without brackets, formatting adds
 * them to a host holding ':'. Listening and connecting take IPv4 and IPv6 hosts
 * (numeric, or names through getaddrinfo, IPv4 addresses first); unbracket strips the
 * brackets of a bare "[host]" in place. */
kvw_status_t kvw__parse_hostport(const char *s, char *host, size_t hcap, uint16_t *port_p);
void kvw__format_hostport(const char *host, unsigned port, char *out, size_t cap);
void kvw__host_unbracket(char *host);
kvw_status_t kvw__tcp_listen(const char *host, uint16_t port, int *fd_p, uint16_t *port_p);
kvw_status_t kvw__tcp_connect(const char *host, uint16_t port, uint64_t deadline_ns, int *fd_p);
/* Turns Nagle's algorithm off on a control or bootstrap socket, connected or accepted
 * (an accepted socket does not get it from the connecting side): a frame written while
 * an earlier one is unacknowledged would otherwise wait for the peer's delayed ACK, up
 * to 40 ms on Linux. Best effort (a socket that is not TCP keeps its behaviour). */
void kvw__sock_nodelay(int fd);

#endif
