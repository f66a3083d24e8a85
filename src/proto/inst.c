/*
 * Decode: the prefill instances a context reads from (ctx->insts), each named by its
 * bootstrap address: found or added, connected on their own thread on first use and
 * again after they went down, and the aborts of rooms that ended while their instance
 * was still being connected. This file alone writes ctx->insts.
 */
#include "proto/proto.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void kvw__insts_fini(struct kvw_ctx *ctx)
{
    free(ctx->insts.tab);
    free(ctx->insts.late);
    ctx->insts.tab = NULL, ctx->insts.late = NULL;
    ctx->insts.num = ctx->insts.cap = ctx->insts.num_late = ctx->insts.cap_late = 0;
}

void kvw__inst_set(struct kvw_ctx *ctx, uint32_t i, uint32_t gen, int state)
{
    KVW_ASSERT_HELD(&ctx->mu);
    if (ctx->insts.tab[i].gen != gen)
        ctx->insts.tab[i].lost = false;
    ctx->insts.tab[i].gen = gen;
    ctx->insts.tab[i].state = state;
}

kvw_status_t kvw__inst_connected(struct kvw_ctx *ctx, uint32_t i, uint32_t gen)
{
    KVW_ASSERT_HELD(&ctx->mu);
    kvw_inst_t *in = &ctx->insts.tab[i];
    if (in->gen == gen && in->lost)
        return kvw__error(KVW_ERR_PEER_DEAD, "a rank of prefill instance %s went away while "
                          "it was being connected: %s", in->addr, in->why);
    return KVW_OK;
}

void kvw__inst_peer_down(struct kvw_ctx *ctx, const kvw_peer_t *peer, const char *reason)
{
    KVW_ASSERT_HELD(&ctx->mu);
    if (peer->inst >= ctx->insts.num)
        return;
    kvw_inst_t *in = &ctx->insts.tab[peer->inst];
    if (in->gen == peer->inst_gen && in->state == KVW_INST_READY) {
        in->state = KVW_INST_DOWN;
        snprintf(in->why, sizeof(in->why), "%s: %s", peer->desc, reason);
    } else if (in->gen == peer->inst_gen && in->state == KVW_INST_CONNECTING && !in->lost) {
        /* Its connection completes as a failure (kvw__inst_connected). */
        in->lost = true;
        snprintf(in->why, sizeof(in->why), "%s: %s", peer->desc, reason);
    }
}

void kvw__late_abort_add(struct kvw_ctx *ctx, uint32_t inst, uint32_t gen, uint32_t dp,
                         uint64_t room, kvw_status_t status, const char *reason)
{
    KVW_ASSERT_HELD(&ctx->mu);
    if (ctx->insts.num_late == ctx->insts.cap_late) {
        uint32_t cap = ctx->insts.cap_late ? ctx->insts.cap_late * 2 : 16;
        kvw_late_abort_t *n = cap <= 65536 ? realloc(ctx->insts.late, sizeof(*n) * cap) : NULL;
        if (n)
            ctx->insts.late = n, ctx->insts.cap_late = cap;
    }
    if (ctx->insts.num_late < ctx->insts.cap_late) {
        kvw_late_abort_t *a = &ctx->insts.late[ctx->insts.num_late++];
        *a = (kvw_late_abort_t){.inst = inst, .gen = gen, .dp = dp, .room = room,
                                .status = status};
        snprintf(a->reason, sizeof(a->reason), "%.150s", reason);
    }
}

int kvw__inst_find_or_add(struct kvw_ctx *ctx, const char *addr)
{
    for (uint32_t i = 0; i < ctx->insts.num; i++)
        if (!strcmp(ctx->insts.tab[i].addr, addr))
            return (int)i;
    if (strlen(addr) >= sizeof(ctx->insts.tab[0].addr)) {
        kvw__error(KVW_ERR_INVALID_PARAM, "bootstrap address '%.64s...' is too long", addr);
        return -1;
    }
    if (ctx->insts.num >= KVW_MAX_INSTANCES) {
        kvw__error(KVW_ERR_BUSY, "this decode context already talks to %u prefill instances",
                   KVW_MAX_INSTANCES);
        return -1;
    }
    if (ctx->insts.num == ctx->insts.cap) {
        uint32_t cap = ctx->insts.cap ? ctx->insts.cap * 2 : 8;
        kvw_inst_t *n = realloc(ctx->insts.tab, sizeof(*n) * cap);
        if (n == NULL) {
            kvw__error(KVW_ERR_NO_MEMORY, "out of memory adding a prefill instance");
            return -1;
        }
        ctx->insts.tab = n;
        ctx->insts.cap = cap;
    }
    kvw_inst_t *in = &ctx->insts.tab[ctx->insts.num];
    memset(in, 0, sizeof(*in));
    snprintf(in->addr, sizeof(in->addr), "%s", addr);
    in->state = KVW_INST_DOWN; /* never connected yet */
    snprintf(in->why, sizeof(in->why), "not connected");
    return (int)ctx->insts.num++;
}

typedef struct kvw_conn_arg {
    struct kvw_ctx *ctx;
    uint32_t inst, gen;
    char addr[128];
    kvw_inst_settle_fn settle;
} kvw_conn_arg_t;

/* Connects to one prefill instance on its own thread: the caller of kvw_receiver_*
 * never blocks on a bootstrap lookup or a handshake. */
static void *kvw_inst_connect_main(void *arg)
{
    kvw_conn_arg_t *a = arg;
    kvw__thread_name("kvw-inst");
    struct kvw_ctx *ctx = a->ctx;
    uint64_t deadline = kvw__now_ns() + (uint64_t)ctx->bootstrap_timeout_ms * 1000000ull;
    kvw_bs_entry_t *entries = NULL;
    uint32_t ne = 0;
    kvw_status_t st = kvw__bootstrap_lookup_ex(a->addr, 0, 0, 0, ctx->secret, deadline, true,
                                               &ctx->insts.cancel, &entries, &ne);
    if (st == KVW_OK)
        st = kvw__decode_connect_all(ctx, entries, ne, a->inst, a->gen, deadline);
    free(entries);
    char why[400];
    snprintf(why, sizeof(why), "%s", st == KVW_OK ? "" : kvw_last_error());
    pthread_mutex_lock(&ctx->mu);
    kvw_inst_t *in = &ctx->insts.tab[a->inst];
    if (st == KVW_OK && (st = kvw__inst_connected(ctx, a->inst, a->gen)) != KVW_OK)
        snprintf(why, sizeof(why), "%s", kvw_last_error());
    if (in->gen == a->gen) {
        if (st == KVW_OK) {
            in->state = KVW_INST_READY;
        } else {
            in->state = KVW_INST_DOWN;
            snprintf(in->why, sizeof(in->why), "%s", why);
            /* Ranks of a half-connected instance are not used: drop them. */
            for (uint32_t i = 0; i < kvw__peer_count(ctx); i++)
                if (kvw__peer_at(ctx, i)->inst == a->inst && kvw__peer_at(ctx, i)->inst_gen == a->gen)
                    kvw__peer_doom(ctx, kvw__peer_at(ctx, i), st, "its instance failed to connect");
        }
        a->settle(ctx, a->inst, st, why);
        kvw__late_aborts_flush(ctx, a->inst, a->gen, st == KVW_OK);
    }
    kvw__ctx_wake(ctx); /* poll the new peers' sockets (before the count drops) */
    ctx->insts.connecting--;
    pthread_cond_broadcast(&ctx->cv);
    pthread_mutex_unlock(&ctx->mu);
    free(a);
    return NULL;
}

int kvw__inst_use(struct kvw_ctx *ctx, uint32_t i, kvw_inst_settle_fn settle)
{
    KVW_ASSERT_HELD(&ctx->mu);
    kvw_inst_t *in = &ctx->insts.tab[i];
    if (in->state != KVW_INST_DOWN || ctx->stopping)
        return in->state;
    kvw_conn_arg_t *a = malloc(sizeof(*a));
    pthread_attr_t attr;
    pthread_t t;
    if (a == NULL)
        return KVW_INST_DOWN;
    in->gen++;
    in->state = KVW_INST_CONNECTING;
    in->lost = false;
    /* The ranks of the instance's previous connection that are still alive go: each
     * prefill rank refuses a second registration of this rank while the first is
     * alive (BUSY), so the new one could never complete beside them. The rooms still
     * on them fail with this reason. */
    for (uint32_t k = 0; k < kvw__peer_count(ctx); k++) {
        kvw_peer_t *p = kvw__peer_at(ctx, k);
        if (p->inst == i && p->inst_gen != in->gen && !p->dead && !p->registering)
            kvw__peer_doom(ctx, p, KVW_ERR_PEER_DEAD, "its prefill instance is being "
                           "connected again (another of its ranks went down)");
    }
    *a = (kvw_conn_arg_t){.ctx = ctx, .inst = i, .gen = in->gen, .settle = settle};
    snprintf(a->addr, sizeof(a->addr), "%s", in->addr);
    ctx->insts.connecting++;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, kvw_inst_connect_main, a) != 0) {
        free(a);
        ctx->insts.connecting--;
        in->state = KVW_INST_DOWN;
        snprintf(in->why, sizeof(in->why), "cannot start a connecting thread");
    }
    pthread_attr_destroy(&attr);
    return in->state;
}

void kvw__late_aborts_flush(struct kvw_ctx *ctx, uint32_t inst, uint32_t gen, bool connected)
{
    KVW_ASSERT_HELD(&ctx->mu);
    uint32_t kept = 0;
    for (uint32_t i = 0; i < ctx->insts.num_late; i++) {
        kvw_late_abort_t *a = &ctx->insts.late[i];
        if (a->inst != inst || a->gen != gen) {
            ctx->insts.late[kept++] = *a;
            continue;
        }
        for (uint32_t k = 0; connected && k < kvw__peer_count(ctx); k++) {
            kvw_peer_t *p = kvw__peer_at(ctx, k);
            if (p->inst == inst && p->inst_gen == gen && p->dp == a->dp && !p->dead &&
                !p->registering)
                kvw__send_room_msg(ctx, p, KVW_MSG_ABORT, a->room, a->status, a->reason);
        }
    }
    ctx->insts.num_late = kept;
}
