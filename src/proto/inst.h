/*
 * Decode: the prefill instances a context reads from, each named by its bootstrap
 * address, the threads connecting to them, and the aborts of rooms that ended while
 * their instance was still being connected. Owned by inst.c.
 */
#ifndef KVW_PROTO_INST_H
#define KVW_PROTO_INST_H

#include "core/core.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

struct kvw_ctx;

/* Decode side: one prefill instance, named by its bootstrap address. Connected on the
 * first room that names it (or at context creation for the context's own address),
 * cached, and connected again after it went down. */
enum { KVW_INST_CONNECTING = 0, KVW_INST_READY = 1, KVW_INST_DOWN = 2 };
#define KVW_MAX_INSTANCES 1024
typedef struct kvw_inst {
    char addr[128];
    uint32_t gen; /* bumped on every (re)connection; peers and rooms carry it */
    int state;
    bool lost;     /* a rank of this generation died while it was being connected */
    char why[400]; /* why it went down (or was lost) */
} kvw_inst_t;

/* A room that ended while its instance was being connected; its prefill ranks are told
 * (ABORT) once it is. */
typedef struct kvw_late_abort {
    uint32_t inst, gen, dp;
    uint64_t room;
    kvw_status_t status;
    char reason[160];
} kvw_late_abort_t;

/* The context's instance table (ctx->insts; ctx->mu guards it but for `cancel`). */
typedef struct kvw_insts {
    kvw_inst_t *tab;
    uint32_t num, cap;
    uint32_t connecting; /* connecting threads still running */
    _Atomic bool cancel; /* context teardown: connecting threads stop waiting */
    kvw_late_abort_t *late;
    uint32_t num_late, cap_late;
} kvw_insts_t;

struct kvw_peer;

/* Called under mu by an instance's connecting thread once it is done: st is KVW_OK
 * (connected) or why it failed (the rooms waiting for it settle: recv.c). */
typedef void (*kvw_inst_settle_fn)(struct kvw_ctx *ctx, uint32_t inst, kvw_status_t st,
                                   const char *why);

/* Context teardown: frees the table. */
void kvw__insts_fini(struct kvw_ctx *ctx);
/* Sets instance `i`'s generation and state (the context's own instance, connected at
 * creation). mu held. */
void kvw__inst_set(struct kvw_ctx *ctx, uint32_t i, uint32_t gen, int state);
/* Whether instance `i`'s connection of generation `gen` ends connected: KVW_OK, or
 * PEER_DEAD (message set) when one of its ranks died while the others were being
 * registered with. mu held. */
kvw_status_t kvw__inst_connected(struct kvw_ctx *ctx, uint32_t i, uint32_t gen);
/* A rank of a ready instance died: the instance is down (the next room that names it
 * connects again); of one being connected: that connection is lost. mu held. */
void kvw__inst_peer_down(struct kvw_ctx *ctx, const struct kvw_peer *peer, const char *reason);
/* A room posted while its instance (inst, gen) was being connected ended: its prefill
 * ranks of DP rank `dp` hear of it once the instance is connected. mu held. */
void kvw__late_abort_add(struct kvw_ctx *ctx, uint32_t inst, uint32_t gen, uint32_t dp,
                         uint64_t room, kvw_status_t status, const char *reason);

/* Decode: sends the ABORTs of rooms that ended while instance `inst` (generation `gen`)
 * was being connected, now that it is (connected) or drops them (not). mu held. */
void kvw__late_aborts_flush(struct kvw_ctx *ctx, uint32_t inst, uint32_t gen, bool connected);

/* Decode: the instance for a bootstrap address, added when new (-1: table full or out
 * of memory, message set). mu held. */
int kvw__inst_find_or_add(struct kvw_ctx *ctx, const char *addr);
/* Decode: makes sure instance `i` is connected or being connected (a down instance is
 * connected again, on its own thread, which calls `settle` when done); returns its state.
 * mu held. */
int kvw__inst_use(struct kvw_ctx *ctx, uint32_t i, kvw_inst_settle_fn settle);

#endif
