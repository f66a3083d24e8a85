/* Decode: what lands. The transport's callbacks: completions (DONE) counted only on
 * the data connection their prefill rank bound, staged windows scattered out of the
 * staging area, every write checked against the pages and staging spans the room was
 * granted, and page-exact accounting before Success; a prefill rank's metadata. */
#include "proto/proto.h"

#include "core/le.h"
#include "core/sha256.h"
#include "plan/digest.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A room's failure, decided on the way and run once at the end of a walk (the landing of
 * a completion enters fail.c once). */
typedef struct kvw_fail {
    kvw_status_t status; /* KVW_OK: none */
    char why[320];
} kvw_fail_t;

static void kvw_fail_set(kvw_fail_t *f, kvw_status_t status, const char *fmt, ...)
    KVW_PRINTF(3, 4);

static void kvw_fail_set(kvw_fail_t *f, kvw_status_t status, const char *fmt, ...)
{
    if (f->status != KVW_OK)
        return; /* the first reason stays, as kvw__room_fail keeps it */
    f->status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(f->why, sizeof(f->why), fmt, ap);
    va_end(ap);
}

static void kvw_receiver_done(struct kvw_ctx *ctx, kvw_room_t *r);

/* Whether this rank's transport instance sees and checks every write (tcp, ucx on its
 * "am" data path): then the landing log, not a sender's DONE, says what landed. */
static bool kvw_mediated(const struct kvw_ctx *ctx)
{
    return (kvw__tl_caps(ctx->tl_ops, ctx->tl) & KVW_TL_CAP_MEDIATED) != 0;
}

/* Confirmations (ROOM_DONE) that the landing of one completion queues: they join the
 * prefill rank's queue under mu, in order with every other frame to it, but are written
 * only once the room's waiter was woken (kvw_confirms_send). A write on a loopback or
 * Unix socket runs the peer's receive path and wakes its control thread right then,
 * and on a small host that took the core the decode's waiter was about to run on.
 * Collected only on the thread that lands a completion (kvw__on_notify). */
#define KVW_CONFIRMS_MAX 16
static _Thread_local struct {
    bool on;
    uint32_t n;
    kvw_peer_t *peer[KVW_CONFIRMS_MAX]; /* peers live as long as the context */
} kvw_confirms;

/* Confirms room r to prefill rank `peer`. mu held. */
static void kvw_confirm(struct kvw_ctx *ctx, const kvw_room_t *r, uint32_t peer)
{
    KVW_ASSERT_HELD(&ctx->mu);
    kvw_peer_t *p = kvw__peer_at(ctx, peer);
    bool seen = false;
    for (uint32_t i = 0; i < kvw_confirms.n; i++)
        seen |= kvw_confirms.peer[i] == p;
    if (kvw_confirms.on && (seen || kvw_confirms.n < KVW_CONFIRMS_MAX)) {
        kvw__send_room_msg_later(ctx, p, KVW_MSG_ROOM_DONE, r->id, KVW_OK, "");
        if (!seen)
            kvw_confirms.peer[kvw_confirms.n++] = p;
        return;
    }
    kvw__send_room_msg(ctx, p, KVW_MSG_ROOM_DONE, r->id, KVW_OK, "");
}

/* Writes the confirmations queued (mu not held). */
static void kvw_confirms_send(struct kvw_ctx *ctx)
{
    kvw_confirms.on = false;
    for (uint32_t i = 0; i < kvw_confirms.n; i++)
        kvw__peer_flush_after(ctx, kvw_confirms.peer[i]);
    kvw_confirms.n = 0;
}

/* Decode: tells a prefill rank that every byte it owes the room, and the metadata it
 * announced, arrived. On a mediated transport (tcp, ucx am) the confirmation waits for the room-wide check
 * of where the bytes landed instead (kvw_receiver_done): a sender's own count cannot
 * vouch for that. mu held. */
static void kvw_src_confirm(struct kvw_ctx *ctx, const kvw_room_t *r, const kvw_room_src_t *s)
{
    if (s->done && s->got == s->expected && (!s->meta_expected || s->meta_got) &&
        !kvw_mediated(ctx) && !r->verify)
        kvw_confirm(ctx, r, s->peer);
}

/* Decode: a prefill rank's metadata for a room (mu held). Accepted only from a prefill
 * rank that writes the room, once, bounded; several ranks must agree byte for byte. */
void kvw__handle_meta(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_rbuf_t *rb)
{
    KVW_ASSERT_HELD(&ctx->mu);
    uint64_t id = kvw__rb_u64(rb);
    size_t got = 0;
    const void *data = kvw__rb_bytes(rb, KVW_MAX_ROOM_METADATA, &got);
    uint32_t len = (uint32_t)got;
    if (data == NULL || kvw__rb_done(rb, "metadata") != KVW_OK) {
        kvw__peer_dead(ctx, peer, KVW_ERR_MALFORMED, "malformed metadata frame");
        return;
    }
    kvw_room_t *r = kvw__room_find(ctx, id);
    if (r == NULL || r->is_sender || r->state == KVW_ROOM_FAILED || r->state == KVW_ROOM_SUCCESS)
        return; /* a room that ended or was destroyed here meanwhile */
    kvw_room_src_t *s = NULL;
    for (uint32_t i = 0; i < r->num_srcs; i++)
        if (r->srcs[i].peer == peer->id)
            s = &r->srcs[i];
    /* Metadata from a rank that does not write the room (another prefill instance's)
     * is ignored: only the room's own sources can end it. */
    if (s == NULL)
        return;
    if (s->meta_got) {
        kvw__room_fail(ctx, r, KVW_ERR_MALFORMED, true, "room %llu: %s sent metadata twice",
                       (unsigned long long)id, peer->desc);
        return;
    }
    if (r->has_meta && (r->meta_len != len || (len && memcmp(r->meta, data, len)))) {
        kvw__room_fail(ctx, r, KVW_ERR_INCOMPATIBLE, true, "room %llu: prefill ranks disagree "
                       "on the room's metadata (%u bytes from one, %u from %s)",
                       (unsigned long long)id, r->meta_len, len, peer->desc);
        return;
    }
    if (!r->has_meta) {
        r->meta = malloc(len ? len : 1);
        if (r->meta == NULL) {
            kvw__room_fail(ctx, r, KVW_ERR_NO_MEMORY, true, "out of memory for room metadata");
            return;
        }
        if (len)
            memcpy(r->meta, data, len);
        r->meta_len = len;
        r->has_meta = true;
    }
    s->meta_got = true;
    kvw_src_confirm(ctx, r, s);
    kvw_receiver_done(ctx, r);
}

/* Decode: source s's KV digest for verified room r (mu held): once, one value per unit of
 * this rank, n values at `le` (little-endian), from its final completion or its DIGEST
 * frame. false (and *f) if the room cannot take it. */
static bool kvw_src_digest(struct kvw_ctx *ctx, kvw_room_t *r, kvw_room_src_t *s,
                           const kvw_peer_t *peer, uint32_t n, const uint8_t *le, kvw_fail_t *f)
{
    uint32_t want = kvw__digest_units(ctx->rank);
    if (!r->verify || s->digest_got || n != want) {
        kvw_fail_set(f, KVW_ERR_MALFORMED, "room %llu: %s sent %s (%u units, this rank has %u)",
                     (unsigned long long)r->id, peer->desc,
                     !r->verify ? "a digest the room did not ask for"
                     : s->digest_got ? "its digest twice" : "a digest of the wrong size",
                     n, want);
        return false;
    }
    s->digest = malloc((size_t)(n ? n : 1) * 8);
    if (s->digest == NULL) {
        kvw_fail_set(f, KVW_ERR_NO_MEMORY, "room %llu: out of memory for a room's digest",
                     (unsigned long long)r->id);
        return false;
    }
    for (uint32_t u = 0; u < n; u++)
        s->digest[u] = kvw__le64_get(le + 8 * u);
    s->digest_got = true;
    return true;
}

/* Decode: a prefill rank's KV digest for a verified room (mu held), when it did not fit in
 * its final completion: from a source of the room, once. */
void kvw__handle_digest(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_rbuf_t *rb)
{
    KVW_ASSERT_HELD(&ctx->mu);
    uint64_t id = kvw__rb_u64(rb);
    uint32_t n = kvw__rb_u32(rb);
    if (rb->bad || n > KVW_DIGEST_MAX_UNITS || rb->len - rb->pos < (uint64_t)n * 8) {
        kvw__peer_dead(ctx, peer, KVW_ERR_MALFORMED, "malformed digest frame");
        return;
    }
    const uint8_t *vals = rb->p + rb->pos;
    rb->pos += (size_t)n * 8;
    if (kvw__rb_done(rb, "digest") != KVW_OK) {
        kvw__peer_dead(ctx, peer, KVW_ERR_MALFORMED, kvw_last_error());
        return;
    }
    kvw_room_t *r = kvw__room_find(ctx, id);
    if (r == NULL || r->is_sender || r->state == KVW_ROOM_FAILED || r->state == KVW_ROOM_SUCCESS)
        return;
    kvw_room_src_t *s = NULL;
    for (uint32_t i = 0; i < r->num_srcs; i++)
        if (r->srcs[i].peer == peer->id)
            s = &r->srcs[i];
    if (s == NULL)
        return; /* not one of the room's sources: no say in it */
    kvw_fail_t f = {KVW_OK, ""};
    if (!kvw_src_digest(ctx, r, s, peer, n, vals, &f)) {
        kvw__room_fail(ctx, r, f.status, true, "%s", f.why);
        return;
    }
    kvw_receiver_done(ctx, r);
}

/* Decode, a verified room whose every byte landed (mu held): this rank's digest of its
 * destination pages for each source's pair (s->mine); false (and *f) if it cannot be
 * computed. The pair's whole-room plan: the decode's own pages and the source's
 * geometry, the same segments the prefill's chunk plans cut by token. */
static kvw_status_t kvw_pair_plan(struct kvw_ctx *ctx, const kvw_room_t *r,
                                  const kvw_room_src_t *s, kvw_plan_h *plan_p)
{
    kvw_chunk_t whole = {.num_tokens = r->num_tokens, .chunk_begin = 0,
                         .chunk_end = r->num_tokens, .prefix_len = r->prefix_len,
                         .last_chunk = 1};
    return kvw__plan_create_staged(kvw__peer_at(ctx, s->peer)->remote, ctx->rank, &whole, NULL,
                                   &r->post_pages, plan_p);
}

/* This rank's digest of each source's pair (s->mine), read with mu dropped: the room is
 * pinned by inflight meanwhile (kvw_room_destroy waits for it, and another landing event
 * sees r->inflight and leaves the room to this thread), and every source's final
 * completion is in, so a write that still arrives is one too many and fails the room.
 * The plans are built under mu; the values are kept only if the room did not end
 * meanwhile. false (and *f) if they cannot be computed; true with no s->mine set if the
 * room failed meanwhile (the caller sees its state). mu held on entry and on return. */
static bool kvw_verify_compute(struct kvw_ctx *ctx, kvw_room_t *r, kvw_fail_t *f)
{
    uint32_t units = kvw__digest_units(ctx->rank), n = r->num_srcs;
    uint64_t **mine = calloc(n ? n : 1, sizeof(*mine));
    kvw_plan_h *plans = calloc(n ? n : 1, sizeof(*plans));
    kvw_status_t st = mine && plans ? KVW_OK : kvw__error(KVW_ERR_NO_MEMORY, "out of memory");
    uint32_t bad = 0;
    for (uint32_t i = 0; st == KVW_OK && i < n; i++) {
        bad = i;
        if ((mine[i] = calloc(units ? units : 1, 8)) == NULL)
            st = kvw__error(KVW_ERR_NO_MEMORY, "out of memory");
        else
            st = kvw_pair_plan(ctx, r, &r->srcs[i], &plans[i]);
    }
    if (st == KVW_OK) {
        r->inflight++;
        pthread_mutex_unlock(&ctx->mu);
        /* Every source's pair at once (on a GPU: one batch, one wait). */
        st = ctx->mem->digest_n((const struct kvw_plan *const *)plans, n, true, mine, units);
        bad = UINT32_MAX; /* the batch: no one source to name */
        char why[256];
        snprintf(why, sizeof(why), "%s", st == KVW_OK ? "" : kvw_last_error());
        pthread_mutex_lock(&ctx->mu);
        r->inflight--;
        pthread_cond_broadcast(&ctx->cv);
        if (st != KVW_OK)
            (void)kvw__error(st, "%s", why);
    }
    bool kept = st == KVW_OK && r->state != KVW_ROOM_FAILED;
    for (uint32_t i = 0; plans && i < n; i++)
        kvw_plan_destroy(plans[i]);
    for (uint32_t i = 0; mine && i < n; i++) {
        if (kept && r->srcs[i].mine == NULL)
            r->srcs[i].mine = mine[i];
        else
            free(mine[i]);
    }
    free(plans);
    free(mine);
    if (st != KVW_OK) {
        char who[200];
        if (bad < n)
            snprintf(who, sizeof(who), "%.160s", kvw__peer_at(ctx, r->srcs[bad].peer)->desc);
        else
            snprintf(who, sizeof(who), "its %u source%s' pages", n, n == 1 ? "" : "s");
        kvw_fail_set(f, st, "room %llu: verifying %s failed: %s", (unsigned long long)r->id, who,
                     kvw_last_error());
        return false;
    }
    return true;
}

/* Both digests of every pair are there: false (and *f) on the first difference, named by
 * source, layer, component, head and tokens. */
static bool kvw_verify_compare(struct kvw_ctx *ctx, kvw_room_t *r, kvw_fail_t *f)
{
    uint32_t units = kvw__digest_units(ctx->rank);
    for (uint32_t i = 0; i < r->num_srcs; i++) {
        kvw_room_src_t *s = &r->srcs[i];
        for (uint32_t u = 0; u < units; u++) {
            if (s->mine[u] == s->digest[u])
                continue;
            char where[160] = "";
            kvw_plan_h plan = NULL;
            if (kvw_pair_plan(ctx, r, s, &plan) == KVW_OK)
                kvw__digest_locate(plan, u, where, sizeof(where));
            else
                snprintf(where, sizeof(where), "unit %u", u);
            kvw_plan_destroy(plan);
            kvw_fail_set(f, KVW_ERR_BYTE_MISMATCH, "room %llu: KV digest mismatch at %s (from "
                         "%.80s)", (unsigned long long)r->id, where,
                         kvw__peer_at(ctx, s->peer)->desc);
            return false;
        }
    }
    return true;
}

/* Completes a room whose every source is done (mu held); a room whose bytes do not add
 * up is not completed, and *f says why. */
static void kvw_receiver_check(struct kvw_ctx *ctx, kvw_room_t *r, kvw_fail_t *f)
{
    for (uint32_t i = 0; i < r->num_srcs; i++)
        if (!r->srcs[i].done || (r->srcs[i].meta_expected && !r->srcs[i].meta_got))
            return;
    /* A staged window still being scattered (mu dropped meanwhile) has not landed: the
     * room is checked again when it has (every completion ends in this check). */
    if (r->inflight)
        return;
    /* On transports whose receiver sees every write (tcp, ucx am), the bytes that actually landed
     * must match too: a sender's own count cannot vouch for writes lost on the way. */
    if (kvw_mediated(ctx)) {
        uint64_t want = 0;
        for (uint32_t i = 0; i < r->num_srcs; i++)
            want += r->srcs[i].expected;
        /* Page-exact: no byte written twice, and the distinct bytes (direct writes plus
         * staged windows each covered exactly once) are what the plans imply. A byte
         * count alone let one page written twice stand in for one never written. */
        kvw_iv_t a, b;
        uint64_t distinct = 0;
        if (!kvw__ivlog_check(&r->writes, &a, &b, &distinct)) {
            kvw_fail_set(f, KVW_ERR_BYTE_MISMATCH,
                         "room %llu: buffer %llu bytes [%llu, %llu) were written twice "
                         "(overlapping writes [%llu, %llu) and [%llu, %llu))",
                         (unsigned long long)r->id, (unsigned long long)b.region,
                         (unsigned long long)b.lo,
                         (unsigned long long)(b.hi < a.hi ? b.hi : a.hi),
                         (unsigned long long)a.lo, (unsigned long long)a.hi,
                         (unsigned long long)b.lo, (unsigned long long)b.hi);
            return;
        }
        if (distinct + r->staged_exact != want) {
            kvw_fail_set(f, KVW_ERR_BYTE_MISMATCH,
                         "room %llu: %llu distinct bytes landed, the plans expect %llu "
                         "(part of the room's pages was never written)",
                         (unsigned long long)r->id,
                         (unsigned long long)(distinct + r->staged_exact),
                         (unsigned long long)want);
            return;
        }
        if (r->landed != want) {
            kvw_fail_set(f, KVW_ERR_BYTE_MISMATCH,
                         "room %llu: %llu bytes landed, the plans expect %llu",
                         (unsigned long long)r->id, (unsigned long long)r->landed,
                         (unsigned long long)want);
            return;
        }
    }
    /* Fail closed: every sender's byte count must be exactly what the plan implies. */
    for (uint32_t i = 0; i < r->num_srcs; i++)
        if (r->srcs[i].got != r->srcs[i].expected) {
            kvw_fail_set(f, KVW_ERR_BYTE_MISMATCH,
                         "%s delivered %llu bytes, the plan expects %llu",
                         kvw__peer_at(ctx, r->srcs[i].peer)->desc,
                         (unsigned long long)r->srcs[i].got,
                         (unsigned long long)r->srcs[i].expected);
            return;
        }
    /* Strictly after the room's landing is complete (every source's final completion
     * and metadata, no scatter running, and on tcp the landing log checked): this rank's
     * digest of the bytes that are there now, once; then, when every source's digest
     * arrived too, the comparison. */
    if (r->verify) {
        bool computed = true;
        for (uint32_t i = 0; i < r->num_srcs; i++)
            computed &= r->srcs[i].mine != NULL;
        if (!computed && !kvw_verify_compute(ctx, r, f)) {
            kvw__metrics_verify(ctx, false);
            return;
        }
        /* mu was dropped while reading: the room may have failed (its reason given). */
        if (r->state == KVW_ROOM_FAILED)
            return;
        for (uint32_t i = 0; i < r->num_srcs; i++)
            if (!r->srcs[i].digest_got)
                return;
        if (!kvw_verify_compare(ctx, r, f)) {
            kvw__metrics_verify(ctx, false);
            return;
        }
        kvw__metrics_verify(ctx, true);
    } else if (ctx->cfg.verify == KVW_VERIFY_SAMPLE) {
        kvw__metrics_verify_skipped(ctx);
    }
    if (kvw_mediated(ctx) || r->verify)
        for (uint32_t i = 0; i < r->num_srcs; i++)
            kvw_confirm(ctx, r, r->srcs[i].peer);
    kvw__room_advance(r, KVW_ROOM_SUCCESS);
    /* A span the room still holds (asked for and never written) goes back now. */
    kvw__stage_release_room(ctx, r->id);
}

static void kvw_receiver_done(struct kvw_ctx *ctx, kvw_room_t *r)
{
    kvw_fail_t f = {KVW_OK, ""};
    kvw_receiver_check(ctx, r, &f);
    if (f.status != KVW_OK)
        kvw__room_fail(ctx, r, f.status, true, "%s", f.why);
}

/* Scatters one staged window of a room's chunk from the staging area (no mu held; the
 * room is pinned by inflight). *sg_p: the chunk's staged stream, opened here for the
 * chunk's first window: the plan is built (from the decode's own pages and the prefill
 * rank's geometry) and prepared once per chunk, not per window. */
static kvw_status_t kvw_scatter(struct kvw_ctx *ctx, kvw_rank_h src, kvw_room_t *r,
                                const kvw_chunk_t *c, uint64_t soff, uint64_t slen, uint64_t goff,
                                kvw_staged_t **sg_p)
{
    uint8_t *win = NULL;
    if (!kvw__stage_window(ctx, goff, slen, &win))
        return kvw__error(KVW_ERR_OUT_OF_RANGE, "staged window [%llu, +%llu) outside the staging "
                          "area", (unsigned long long)goff, (unsigned long long)slen);
    if (*sg_p == NULL) {
        kvw_plan_h plan;
        kvw_status_t st = kvw__plan_create_staged(src, ctx->rank, c, NULL, &r->post_pages, &plan);
        if (st == KVW_OK)
            st = kvw__staged_open(ctx->mem, ctx->mem_dev, plan, true, false, 0, sg_p);
        if (st != KVW_OK)
            return st;
    }
    return kvw__staged_scatter(*sg_p, win, soff, soff + slen);
}

/* A data connection says which peer it belongs to (KVW_MSG_BIND, its first message).
 * The claim is only recorded here; kvw_bound checks it against the peer's nonce when a
 * completion arrives, since the BIND can overtake the registration that creates the peer. */
static void kvw_on_bind(struct kvw_ctx *ctx, kvw_tl_ep_h ep, kvw_rbuf_t *rb)
{
    kvw_bind_t b = {.ep = ep};
    b.peer = kvw__rb_u32(rb);
    for (size_t i = 0; i < sizeof(b.nonce); i++)
        b.nonce[i] = kvw__rb_u8(rb);
    if (kvw__rb_done(rb, "bind") != KVW_OK)
        return;
    pthread_mutex_lock(&ctx->mu);
    bool known = false;
    for (uint32_t i = 0; i < ctx->binds.num; i++)
        known |= ctx->binds.tab[i].ep == ep;
    if (!known && ctx->binds.num == ctx->binds.cap) {
        uint32_t cap = ctx->binds.cap ? ctx->binds.cap * 2 : 16;
        kvw_bind_t *v = realloc(ctx->binds.tab, sizeof(*v) * cap);
        if (v) {
            ctx->binds.tab = v;
            ctx->binds.cap = cap;
        }
    }
    /* One claim per connection: a second BIND cannot re-point it. */
    if (!known && ctx->binds.num < ctx->binds.cap)
        ctx->binds.tab[ctx->binds.num++] = b;
    pthread_mutex_unlock(&ctx->mu);
}

/* Whether `ep` is the data connection of peer `peer_id` (mu held). Without a secret
 * its BIND carried the peer's nonce; with one, the proof under the session key
 * (kvw__bind_proof), and only the first connection to prove it is that peer's. */
static bool kvw_bound(struct kvw_ctx *ctx, kvw_tl_ep_h ep, uint32_t peer_id)
{
    if (peer_id >= kvw__peer_count(ctx))
        return false;
    kvw_peer_t *p = kvw__peer_at(ctx, peer_id);
    if (p->registering || p->dead)
        return false;
    if (p->authed && p->data_ep != NULL)
        return p->data_ep == ep;
    uint8_t want[32];
    if (p->authed)
        kvw__bind_proof(p->skey, peer_id, p->bind_nonce, want);
    else
        memcpy(want, p->bind_nonce, sizeof(want));
    for (uint32_t i = 0; i < ctx->binds.num; i++) {
        const kvw_bind_t *b = &ctx->binds.tab[i];
        if (b->ep != ep)
            continue;
        if (b->peer != peer_id || !kvw__ct_equal(b->nonce, want, sizeof(want)))
            return false;
        if (p->authed)
            p->data_ep = ep;
        return true;
    }
    return false;
}

/* Decode: whether the staged window [goff, +slen) of a completion may be scattered into
 * room r (mu held); *f says why not. It must be exactly a span the room was granted, and
 * where writes are mediated it must have been written exactly once, all of it: stale
 * staging bytes would otherwise land in the room's pages. */
static bool kvw_staged_window_ok(struct kvw_ctx *ctx, kvw_room_t *r, uint64_t goff,
                                 uint64_t slen, kvw_fail_t *f)
{
    if (!kvw__stage_is_span(ctx, r->id, goff, slen)) {
        kvw_fail_set(f, KVW_ERR_OUT_OF_RANGE,
                     "room %llu: staged data at [%llu, +%llu) was never granted",
                     (unsigned long long)r->id, (unsigned long long)goff,
                     (unsigned long long)slen);
        return false;
    }
    if (kvw_mediated(ctx)) {
        uint64_t got = 0;
        if (!kvw__ivlog_take(&r->writes, KVW_IV_STAGED | goff, goff, goff + slen, &got) ||
            got != slen) {
            kvw_fail_set(f, KVW_ERR_BYTE_MISMATCH, "room %llu: staged window [%llu, +%llu) was %s",
                         (unsigned long long)r->id, (unsigned long long)goff,
                         (unsigned long long)slen,
                         got == slen ? "partly written twice" : "not written exactly once");
            return false;
        }
        r->staged_exact += slen;
    }
    return true;
}

void kvw__on_notify(void *arg, kvw_tl_ep_h ep, const void *msg, size_t len)
{
    struct kvw_ctx *ctx = arg;
    (void)ep;
    if (len < KVW_WIRE_HDR)
        return;
    uint8_t type = 0;
    uint32_t plen;
    if (kvw__wire_header(msg, &type, &plen) != KVW_OK ||
        (type != KVW_MSG_DONE && type != KVW_MSG_BIND) || plen != len - KVW_WIRE_HDR)
        return;
    kvw_rbuf_t rb;
    kvw__rb_init(&rb, (const uint8_t *)msg + KVW_WIRE_HDR, plen);
    if (type == KVW_MSG_BIND) {
        kvw_on_bind(ctx, ep, &rb);
        return;
    }
    kvw_done_msg_t dm;
    if (kvw__done_decode(&rb, &dm) != KVW_OK || dm.meta_len > KVW_MAX_ROOM_METADATA)
        return;
    const uint8_t *payload = (const uint8_t *)msg + KVW_WIRE_HDR;
    uint64_t id = dm.room;
    uint32_t peer_id = dm.peer;
    kvw_chunk_t c = {.chunk_begin = dm.chunk_begin, .chunk_end = dm.chunk_end,
                     .last_chunk = dm.last_chunk};
    uint64_t bytes = dm.bytes;
    bool staged = dm.staged;
    uint64_t soff = dm.soff, slen = dm.slen, goff = dm.goff;
    bool final = dm.final;
    uint32_t meta_len = dm.meta_len;
    pthread_mutex_lock(&ctx->mu);
    kvw_room_t *r = kvw__room_find(ctx, id);
    kvw_room_src_t *s = NULL;
    kvw_staged_t *drop = NULL; /* a staged stream to release once mu is dropped */
    kvw_fail_t f = {KVW_OK, ""}; /* why the room fails, if it does (once, at the end) */
    if (r == NULL || r->is_sender || r->state == KVW_ROOM_FAILED || r->state == KVW_ROOM_SUCCESS)
        goto out;
    /* A completion counts only on the data connection its peer bound (any local process
     * can reach a shm socket, any host a tcp port): anything else is refused, and the
     * room carries on waiting for its real sender. */
    if (!kvw_bound(ctx, ep, peer_id))
        goto out;
    /* With a secret the completion itself carries the session's tag: the data
     * connection alone does not vouch for it. */
    if (kvw__peer_at(ctx, peer_id)->authed &&
        kvw__done_check_tag(payload, plen, kvw__peer_at(ctx, peer_id)->skey) != KVW_OK)
        goto out;
    for (uint32_t i = 0; i < r->num_srcs; i++)
        if (r->srcs[i].peer == peer_id)
            s = &r->srcs[i];
    /* A rank that does not write this room (another prefill instance's) has no say in
     * it: its completion is ignored and the room waits for its own sources. */
    if (s == NULL)
        goto out;
    if (s->done || c.chunk_begin > c.chunk_end || c.chunk_end > r->num_tokens ||
        (c.last_chunk && c.chunk_end != r->num_tokens)) {
        kvw_fail_set(&f, KVW_ERR_MALFORMED,
                     "room %llu: bad completion from peer %u (chunk [%llu, %llu))",
                     (unsigned long long)id, peer_id, (unsigned long long)c.chunk_begin,
                     (unsigned long long)c.chunk_end);
        goto out;
    }
    kvw__room_hop(r, KVW_HOP_DONE_RX, false);
    kvw__room_advance(r, KVW_ROOM_TRANSFERRING);
    kvw__room_touch(ctx, r);
    if (staged) {
        if (!kvw_staged_window_ok(ctx, r, goff, slen, &f))
            goto out;
        c.num_tokens = r->num_tokens;
        c.prefix_len = r->prefix_len;
        kvw_rank_h src = kvw__peer_at(ctx, peer_id)->remote;
        /* The stream of this source's chunk, when it is the one of the window before;
         * taken out while in use (another window of the source meanwhile opens its own). */
        kvw_staged_t *sg = s->scatter;
        s->scatter = NULL;
        if (sg && (s->scatter_begin != c.chunk_begin || s->scatter_end != c.chunk_end ||
                   s->scatter_last != c.last_chunk)) {
            drop = sg;
            sg = NULL;
        }
        r->inflight++;
        pthread_mutex_unlock(&ctx->mu);
        kvw__staged_close(drop);
        drop = NULL;
        kvw_status_t st = kvw_scatter(ctx, src, r, &c, soff, slen, goff, &sg);
        char why[400];
        snprintf(why, sizeof(why), "%s", kvw_last_error());
        pthread_mutex_lock(&ctx->mu);
        r->inflight--;
        pthread_cond_broadcast(&ctx->cv);
        kvw__stage_free(ctx, goff);
        /* Kept for the chunk's next window; the chunk's last window ends its stream. */
        if (st == KVW_OK && !final && s->scatter == NULL && r->state != KVW_ROOM_FAILED) {
            s->scatter = sg;
            s->scatter_begin = c.chunk_begin;
            s->scatter_end = c.chunk_end;
            s->scatter_last = c.last_chunk;
        } else {
            drop = sg;
        }
        if (st != KVW_OK) {
            kvw_fail_set(&f, st, "room %llu: scattering staged data failed: %s",
                         (unsigned long long)id, why);
            goto out;
        }
        if (r->state == KVW_ROOM_FAILED)
            goto out;
        bytes = slen;
        r->path = "staged";
    } else {
        r->path = "direct";
    }
    s->got += bytes;
    r->bytes += bytes;
    kvw__metrics_bytes(ctx, staged, bytes);
    /* A verified room's digest rides in the last chunk's final completion (when it fits
     * in one): nowhere else. */
    if (dm.digest_n && !(final && c.last_chunk)) {
        kvw_fail_set(&f, KVW_ERR_MALFORMED, "room %llu: %s sent a digest in a completion "
                     "that does not end the room", (unsigned long long)id,
                     kvw__peer_at(ctx, peer_id)->desc);
        goto out;
    }
    if (dm.digest_n &&
        !kvw_src_digest(ctx, r, s, kvw__peer_at(ctx, peer_id), dm.digest_n, dm.digest_le, &f))
        goto out;
    if (final) {
        s->done = c.last_chunk;
        if (c.last_chunk)
            s->meta_expected = meta_len;
    }
    /* The room's waiter is woken once mu is let go, not while this thread holds it, and
     * the prefill ranks' confirmations go out after that; a room nobody waits on (many
     * in flight, polled) confirms at once, saving the second round on mu. */
    kvw__room_wake_defer(ctx);
    kvw_confirms.on = r->waiters > 0;
    kvw_confirms.n = 0;
    kvw_src_confirm(ctx, r, s);
    kvw_receiver_check(ctx, r, &f);
out:
    if (f.status != KVW_OK)
        kvw__room_fail(ctx, r, f.status, true, "%s", f.why);
    pthread_mutex_unlock(&ctx->mu);
    kvw__room_wake_after(ctx);
    kvw_confirms_send(ctx);
    kvw__staged_close(drop);
}

static bool kvw_granted(const kvw_room_t *r, int pool, uint32_t page)
{
    const uint32_t *g = r->granted[pool];
    uint32_t lo = 0, hi = r->num_granted[pool];
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (g[mid] == page)
            return true;
        if (g[mid] < page)
            lo = mid + 1;
        else
            hi = mid;
    }
    return false;
}

/* Records an admitted write (mu held). More bytes than the plans imply fail the room at
 * once, which also bounds the record's size by the room's own byte count. */
static kvw_status_t kvw_note_write(struct kvw_ctx *ctx, kvw_room_t *r, uint64_t key,
                                   uint64_t off, uint64_t len)
{
    KVW_ASSERT_HELD(&ctx->mu);
    uint64_t want = 0;
    for (uint32_t i = 0; i < r->num_srcs; i++)
        want += r->srcs[i].expected;
    kvw_status_t st = KVW_OK;
    if (len > want - KVW_MIN(r->landed, want))
        st = kvw__error(KVW_ERR_BYTE_MISMATCH, "room %llu: writes exceed the %llu bytes the "
                        "plans expect", (unsigned long long)r->id, (unsigned long long)want);
    else
        st = kvw__ivlog_add(&r->writes, key, off, len);
    if (st != KVW_OK) {
        kvw__room_fail(ctx, r, st, true, "%s", kvw_last_error());
        return st;
    }
    r->landed += len;
    return KVW_OK;
}

/* Whether data connection `ep` is bound to one of the room's sources (mu held). */
static bool kvw_from_source(struct kvw_ctx *ctx, kvw_tl_ep_h ep, const kvw_room_t *r)
{
    for (uint32_t i = 0; i < r->num_srcs; i++)
        if (kvw_bound(ctx, ep, r->srcs[i].peer))
            return true;
    return false;
}

/* kvw__check_write's answer, mu held. */
static kvw_status_t kvw_check_write(struct kvw_ctx *ctx, kvw_tl_ep_h ep, uint64_t room,
                                    uint64_t region, uint64_t off, uint64_t len)
{
    KVW_ASSERT_HELD(&ctx->mu);
    kvw_status_t st = KVW_OK;
    kvw_room_t *r = kvw__room_find(ctx, room);
    /* Only a connection bound to one of the room's own sources writes it: a write from
     * any other (another prefill instance's, or one that never bound) is refused and
     * leaves the room alone, as its other messages for the room would (counted in
     * ctx->foreign_writes; ucx also names the refusal in the connection's failure). */
    if (r && !r->is_sender && !kvw_from_source(ctx, ep, r)) {
        st = KVW_ERR_REJECTED;
        ctx->foreign_writes++;
        goto out;
    }
    const kvw_buffer_desc_t *b = kvw_rank_buffer(ctx->rank, (uint32_t)region);
    bool staging = region == ctx->rank->num_bufs && kvw__stage_present(ctx);
    if (r == NULL || r->is_sender || r->state == KVW_ROOM_FAILED ||
        r->state == KVW_ROOM_SUCCESS || r->state == KVW_ROOM_BOOTSTRAPPING ||
        (b == NULL && !staging)) {
        st = KVW_ERR_OUT_OF_RANGE;
        if (r && !r->is_sender)
            kvw__room_fail(ctx, r, st, true, "a write arrived for room %llu in state %s",
                           (unsigned long long)room, kvw_room_state_string(r->state));
        goto out;
    }
    if (staging) {
        /* The staging area: only inside a span granted to this room. */
        int64_t span = kvw__stage_span_of(ctx, room, off, len);
        if (span >= 0) {
            st = kvw_note_write(ctx, r, KVW_IV_STAGED | (uint64_t)span, off, len);
            goto out;
        }
        st = KVW_ERR_OUT_OF_RANGE;
        kvw__room_fail(ctx, r, st, true, "room %llu: a staged write to [%llu, +%llu) lies outside "
                       "its staging grant", (unsigned long long)room, (unsigned long long)off,
                       (unsigned long long)len);
        goto out;
    }
    const kvw_comp_view_t *v = NULL;
    for (uint32_t i = 0; i < ctx->rank->num_views; i++)
        if (ctx->rank->views[i].buf == region) {
            v = &ctx->rank->views[i];
            break;
        }
    if (v == NULL || len == 0) {
        st = KVW_ERR_OUT_OF_RANGE;
        goto out;
    }
    uint64_t ps = v->view.page_stride;
    for (uint64_t p = off / ps; p <= (off + len - 1) / ps; p++)
        if (p > UINT32_MAX || !kvw_granted(r, (int)v->pool, (uint32_t)p)) {
            st = KVW_ERR_OUT_OF_RANGE;
            kvw__room_fail(ctx, r, st, true,
                           "room %llu: a write to buffer %llu bytes [%llu, %llu) touches page "
                           "%llu, which this room was not granted", (unsigned long long)room,
                           (unsigned long long)region, (unsigned long long)off,
                           (unsigned long long)(off + len), (unsigned long long)p);
            break;
        }
    if (st == KVW_OK)
        st = kvw_note_write(ctx, r, region, off, len);
out:
    return st;
}

kvw_status_t kvw__check_write(void *arg, kvw_tl_ep_h ep, uint64_t room, uint64_t region,
                              uint64_t off, uint64_t len)
{
    struct kvw_ctx *ctx = arg;
    pthread_mutex_lock(&ctx->mu);
    kvw_status_t st = kvw_check_write(ctx, ep, room, region, off, len);
    pthread_mutex_unlock(&ctx->mu);
    return st;
}

void kvw__check_writes(void *arg, kvw_tl_ep_h ep, const kvw_tl_write_t *w, size_t n,
                       kvw_status_t *st)
{
    struct kvw_ctx *ctx = arg;
    pthread_mutex_lock(&ctx->mu);
    for (size_t i = 0; i < n; i++)
        st[i] = kvw_check_write(ctx, ep, w[i].room, w[i].region_id, w[i].off, w[i].len);
    pthread_mutex_unlock(&ctx->mu);
}

void kvw__on_ep_error(void *arg, kvw_tl_ep_h ep, kvw_status_t status, const char *reason)
{
    /* The control channel of the same peer notices the failure (closed socket or missing
     * heartbeats) and fails its rooms with a name. Here the connection only loses its
     * binding: the transport frees the endpoint after this returns, and its address may
     * be reused by a later connection. */
    struct kvw_ctx *ctx = arg;
    (void)status;
    (void)reason;
    pthread_mutex_lock(&ctx->mu);
    for (uint32_t i = 0; i < ctx->binds.num; i++)
        if (ctx->binds.tab[i].ep == ep) {
            ctx->binds.tab[i] = ctx->binds.tab[--ctx->binds.num];
            break;
        }
    for (uint32_t i = 0; i < kvw__peer_count(ctx); i++)
        if (kvw__peer_at(ctx, i)->data_ep == ep)
            kvw__peer_at(ctx, i)->data_ep = NULL;
    pthread_mutex_unlock(&ctx->mu);
}

void kvw__binds_fini(struct kvw_ctx *ctx)
{
    free(ctx->binds.tab);
    ctx->binds.tab = NULL;
    ctx->binds.num = ctx->binds.cap = 0;
}
