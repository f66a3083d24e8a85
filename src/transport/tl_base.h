/*
 * What every transport does the same way, done once: the head of an endpoint and of an
 * unpacked remote key, the list of live keys, and the argument checks of put, notify,
 * mem_reg and rkey_unpack (a put is checked against the remote region of its key before
 * any byte moves). The messages name the transport ("tcp put 3 of 8: ...").
 *
 * A transport puts kvw__tl_ep_t first in its endpoint and kvw__tl_rkey_t first in its
 * unpacked key, so that a handle converts to either.
 */
#ifndef KVW_TRANSPORT_TL_BASE_H
#define KVW_TRANSPORT_TL_BASE_H

#include "core/hmap.h"
#include "transport/transport.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>

/* The head of an endpoint. */
typedef struct kvw__tl_ep {
    const char *tl_name;       /* the transport's name: prefix of every message */
    const atomic_bool *closed; /* the instance's "closed" flag (close() was called) */
    bool accepted;             /* accepted endpoints only receive */
    uint64_t peer_token;       /* connected: the receiving instance's token */
    char peer[64];             /* the peer, for messages */
} kvw__tl_ep_t;

/* The head of an unpacked remote key. */
typedef struct kvw__tl_rkey {
    const kvw__tl_ep_t *ep; /* the endpoint it was unpacked on */
    uint64_t region_id, len;
    struct kvw__tl_rkey *prev, *next; /* the instance's list of live keys */
} kvw__tl_rkey_t;

void kvw__tl_ep_init(kvw__tl_ep_t *ep, const char *tl_name, const atomic_bool *closed,
                     bool accepted);

/* The first checks of put and notify: an endpoint that is not NULL, connected (not
 * accepted), on an instance that is not closed. INVALID_PARAM, UNSUPPORTED, SHUTDOWN. */
kvw_status_t kvw__tl_check_sendable(const char *tl_name, const kvw__tl_ep_t *ep,
                                    const char *what);

/* put's checks, after `sendable` (the transport's sendable check, returned when it
 * failed): every write before any moves, a key unpacked on `ep`, a range inside its
 * remote region (OUT_OF_RANGE), a source. INVALID_PARAM, OUT_OF_RANGE. */
kvw_status_t kvw__tl_check_puts(kvw_status_t sendable, const kvw__tl_ep_t *ep,
                                const kvw_tl_put_t *puts, size_t n);

/* notify's, after `sendable` likewise: a notification's size and buffer. INVALID_PARAM. */
kvw_status_t kvw__tl_check_notify(kvw_status_t sendable, const kvw__tl_ep_t *ep, const void *msg,
                                  size_t len);

/* address's arguments: an instance, and a buffer of at least `need` bytes.
 * INVALID_PARAM, BUFFER_TOO_SMALL. */
kvw_status_t kvw__tl_check_address(const char *tl_name, const void *tl, const void *buf,
                                   const size_t *len_p, size_t need);

/* mem_reg's arguments, for transports that register host memory only. INVALID_PARAM,
 * UNSUPPORTED. */
kvw_status_t kvw__tl_check_mem_reg(const char *tl_name, const void *tl, const void *addr,
                                   uint64_t len, kvw_mem_kind_t kind, uint64_t region_id,
                                   const void *mem_p, const void *rkey_buf,
                                   const void *rkey_len_p);

/* rkey_unpack's arguments: a connected endpoint, a key, an output. INVALID_PARAM,
 * UNSUPPORTED. */
kvw_status_t kvw__tl_check_unpack(const char *tl_name, const kvw__tl_ep_t *ep, const void *buf,
                                  const void *rkey_p);

/* A key must come from the receiver behind ep (its token). INVALID_PARAM. */
kvw_status_t kvw__tl_check_key_token(const kvw__tl_ep_t *ep, uint64_t token);

/* Writes the reason an endpoint failed, as on_ep_error reports it, into buf:
 * "<tl> connection from|to <peer>: " and then the formatted text. */
void kvw__tl_format_reason(const kvw__tl_ep_t *ep, char *buf, size_t cap, const char *fmt,
                           va_list ap) KVW_PRINTF(4, 0);

/* Adds a key (its head filled in) to, and removes it from, an instance's list, under mu. */
void kvw__tl_rkey_link(pthread_mutex_t *mu, kvw__tl_rkey_t **head, kvw__tl_rkey_t *rk);
void kvw__tl_rkey_unlink(pthread_mutex_t *mu, kvw__tl_rkey_t **head, kvw__tl_rkey_t *rk);

/* fini: hands every key still on an instance's list to free_fn; the list is empty after. */
void kvw__tl_rkeys_free(kvw__tl_rkey_t **head, void (*free_fn)(kvw__tl_rkey_t *rk));

/*
 * An instance's registered regions: a hash map by region id (core/hmap.h) of nodes that
 * the transport embeds in its region, guarded by the lock the transport names.
 *
 * mem_reg: links node `n` under `id`, unless a region of that id is registered already
 * (INVALID_PARAM "<tl> mem_reg: region id N is already registered"). The lock held.
 */
kvw_status_t kvw__tl_region_link(const char *tl_name, kvw_hmap_t *regions, kvw_hnode_t *n,
                                 uint64_t id);

/* fini: hands every region's node to free_fn and releases the table. */
void kvw__tl_regions_free(kvw_hmap_t *regions, void (*free_fn)(void *arg, kvw_hnode_t *n),
                          void *arg);

/* The head that transport addresses and packed keys share: zeroes `len` bytes, then
 * writes u32 magic | u8 version | u8 kind | u16 zero | u64 token (16 bytes). */
void kvw__tl_pack_head(uint8_t *p, size_t len, uint32_t magic, uint8_t version, uint8_t kind,
                       uint64_t token);

#endif
