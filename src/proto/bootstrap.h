/*
 * The bootstrap endpoint (bootstrap.c): a table of prefill ranks' control addresses,
 * served to decode ranks, and its client calls. Owned by bootstrap.c alone.
 */
#ifndef KVW_PROTO_BOOTSTRAP_H
#define KVW_PROTO_BOOTSTRAP_H

#include "proto/wire.h"

#include <stdatomic.h>
#include <sys/socket.h>
#include <stdbool.h>
#include <stdint.h>

typedef struct kvw_bs_entry {
    uint32_t dp, tp, pp;
    uint32_t dp_size, tp_size, pp_size;
    char addr[128]; /* control endpoint host:port */
    /* With a shared secret: mac = HMAC(secret, "kvwire-bootstrap-entry-1" | nonce | the
     * fields above), nonce being the endpoint's challenge to the registering connection
     * (kvw__bootstrap_entry_mac). The entry carries both; a decode recomputes the MAC. */
    bool has_mac;
    uint8_t nonce[32], mac[32];
    uint64_t owner;      /* endpoint side: the connection holding the entry (0: none) */
    uint64_t expires_ns; /* endpoint side: one-shot entries expire then (0: held) */
    struct sockaddr_storage src; /* endpoint side: where the registration came from */
} kvw_bs_entry_t;

typedef struct kvw_bootstrap kvw_bootstrap_t;

/* A one-shot registration (KVW_MSG_BS_REGISTER) stays this long; a held one as long as
 * its connection. */
#define KVW_BS_ONESHOT_TTL_MS 60000u

/* secret: NULL or "" accepts registrations without a MAC; otherwise every registration
 * must carry a valid one. */
kvw_status_t kvw__bootstrap_start(const char *host, uint16_t port, const char *secret,
                                  kvw_bootstrap_t **bs_p);
const char *kvw__bootstrap_addr(kvw_bootstrap_t *bs);
void kvw__bootstrap_stop(kvw_bootstrap_t *bs);
/* Tests: the lifetime of one-shot entries registered from now on. */
void kvw__bootstrap_set_ttl(kvw_bootstrap_t *bs, uint32_t ttl_ms);
/* The MAC of an entry (its nonce and fields) under `secret`. */
void kvw__bootstrap_entry_mac(const char *secret, const kvw_bs_entry_t *e, uint8_t out[32]);
/* An entry as it travels in registrations and tables. */
void kvw__bootstrap_put_entry(kvw_wbuf_t *w, const kvw_bs_entry_t *e);
/* With a non-empty secret, a registration first asks the endpoint for a challenge on
 * the same connection and carries the MAC over it; on success *e holds that nonce and
 * MAC (has_mac set). */
kvw_status_t kvw__bootstrap_register(const char *bs_addr, kvw_bs_entry_t *e,
                                     const char *secret, uint64_t deadline_ns);
/* Registers and keeps the connection (*fd_p): the endpoint drops the entry as soon as
 * the connection closes, so a rank that dies or is destroyed leaves no stale entry. */
kvw_status_t kvw__bootstrap_hold(const char *bs_addr, kvw_bs_entry_t *e,
                                 const char *secret, uint64_t deadline_ns, int *fd_p);
/* Waits until the table holds every rank of the instance (sizes from the entries or
 * the expected sizes when non-zero). *entries_p is malloc'd. With a non-empty secret,
 * an entry without a valid MAC fails the lookup at once (AUTH, naming the rank). */
kvw_status_t kvw__bootstrap_lookup(const char *bs_addr, uint32_t tp, uint32_t pp, uint32_t dp,
                                   const char *secret, uint64_t deadline_ns,
                                   kvw_bs_entry_t **entries_p, uint32_t *count_p);
/* The same, for a connection made on demand: an endpoint that cannot be reached (refused,
 * unreachable) fails at once instead of being retried until the deadline, and `cancel`
 * (when non-NULL and set) stops the wait. A bad address always fails at once. */
kvw_status_t kvw__bootstrap_lookup_ex(const char *bs_addr, uint32_t tp, uint32_t pp, uint32_t dp,
                                      const char *secret, uint64_t deadline_ns, bool fail_fast,
                                      const _Atomic bool *cancel, kvw_bs_entry_t **entries_p,
                                      uint32_t *count_p);

#endif
