/*
 * Decode: the prefill instances a context reads from, each named by its bootstrap
 * address, the threads connecting to them, and the aborts of rooms that ended while
 * their instance was still being connected. Owned by recv.c.
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
    char why[400]; /* why it went down */
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

/* Decode: sends the ABORTs of rooms that ended while instance `inst` (generation `gen`)
 * was being connected, now that it is (connected) or drops them (not). mu held. */
void kvw__late_aborts_flush(struct kvw_ctx *ctx, uint32_t inst, uint32_t gen, bool connected);

/* Decode: the instance for a bootstrap address, added when new (-1: table full or out
 * of memory, message set). mu held. */
int kvw__inst_find_or_add(struct kvw_ctx *ctx, const char *addr);
/* Decode: makes sure instance `i` is connected or being connected (a down instance is
 * connected again); returns its state. mu held. */
int kvw__inst_use(struct kvw_ctx *ctx, uint32_t i);

#endif
