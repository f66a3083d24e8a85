/*
 * Prefill workers: they take (room, decode rank) jobs and move the bytes, on one of
 * three paths: mapped (cuda_ipc: one kernel writes the decode's buffers, its DONE sent
 * once the kernel completed), direct (one put per run, in batches) or staged (gathered
 * windows, one bulk put each, into space the decode rank granted; the gathering itself
 * is exec/staged.c's). Steps in flight per worker on its executor, and the DONE that
 * ends each step.
 */
#include "cuda/module.h"
#include "plan/digest.h"
#include "plan/walk.h"
#include "proto/proto.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KVW_PUT_BATCH 512

/* Worker: executes one (room, decode rank, chunk) step. Called with mu NOT held;
 * the room is pinned by inflight. */
typedef struct kvw_put_ctx {
    struct kvw_ctx *ctx;
    kvw_peer_t *peer;
    kvw_room_t *room;
    kvw_tl_put_t puts[KVW_PUT_BATCH];
    size_t n;
    uint64_t runs;
} kvw_put_ctx_t;

static kvw_status_t kvw_put_flush(kvw_put_ctx_t *pc)
{
    if (pc->n == 0)
        return KVW_OK;
    kvw_status_t st = pc->ctx->tl_ops->put(pc->peer->ep, pc->room->id, pc->puts, pc->n);
    pc->n = 0;
    return st;
}

static kvw_status_t kvw_put_run(void *arg, const kvw_run_t *run)
{
    kvw_put_ctx_t *pc = arg;
    const kvw_buffer_desc_t *sb = kvw_rank_buffer(pc->ctx->rank, run->src_buf);
    if (run->dst_buf >= pc->peer->num_rkeys || pc->peer->rkeys[run->dst_buf] == NULL)
        return kvw__error(KVW_ERR_INTERNAL, "run names destination buffer %u of %u, which "
                          "this rank holds no key to", run->dst_buf, pc->peer->num_rkeys);
    pc->puts[pc->n++] = (kvw_tl_put_t){.src = (const uint8_t *)sb->addr + run->src_off,
                                       .rkey = pc->peer->rkeys[run->dst_buf],
                                       .dst_off = run->dst_off, .len = run->len};
    pc->runs++;
    if (pc->n == KVW_PUT_BATCH) {
        /* Stop early when the room was aborted meanwhile. */
        pthread_mutex_lock(&pc->ctx->mu);
        bool failed = pc->room->state == KVW_ROOM_FAILED;
        pthread_mutex_unlock(&pc->ctx->mu);
        if (failed)
            return kvw__error(KVW_ERR_ABORTED, "room aborted");
        return kvw_put_flush(pc);
    }
    return KVW_OK;
}

/* Head-slice plans make many small runs; one bulk write per window beats one write per
 * run: on tcp and ucx (a frame or a put per run) and on shm too, unless the decode's KV
 * buffers are shared memory (then each run is one memcpy, and staging would copy twice).
 * Measured on this project's demo: staged 3.4x faster than direct on tcp, 2.7x on shm
 * with malloc'd decode buffers. */
static bool kvw_choose_staged(struct kvw_ctx *ctx, kvw_peer_t *peer, const struct kvw_plan *plan)
{
    if (peer->must_stage)
        return true;
    if (peer->staging_rkey == NULL || plan->num_segs == 0 || ctx->path_mode == KVW_PATH_DIRECT)
        return false;
    if (ctx->path_mode == KVW_PATH_STAGED)
        return true;
    kvw_box_t b;
    const kvw_seg_t *s0 = &plan->segs[0];
    kvw__box_make(s0, KVW_MIN(s0->src.page_size, s0->dst.page_size), &b);
    return b.chunk < (16u << 10);
}

/* One worker step: room r's decode rank di (its peer, a copy of its half of the room),
 * chunk q; `take` (NULL: every layer) names the layers the step moves, one byte per layer
 * of this rank's stage; `final`: the step completes the chunk for this decode rank;
 * meta_len: the metadata bytes sent ahead of the last chunk's final completion. */
typedef struct kvw_step {
    kvw_room_t *r;
    uint32_t di;
    kvw_peer_t *peer;
    const kvw_room_dst_t *d;
    const kvw_qchunk_t *q;
    const uint8_t *take;
    bool final;
    uint32_t meta_len;
    /* A verified room: the step adds the digest of what it sends (its source pages) to
     * digest[0 .. num_units); NULL: not verified. room_digest: the decode rank's sums of
     * the steps before (added to under mu, by this job's steps only). */
    uint64_t *digest;
    uint32_t num_units;
    const uint64_t *room_digest;
} kvw_step_t;

/* What a step did: bytes and runs moved, whether staged, when its completion went out
 * (KVW_HOP_BYTES_OUT; 0: with a GPU step, later), its GPU step's sequence number (0:
 * none). */
typedef struct kvw_step_out {
    uint64_t bytes, runs;
    bool staged;
    uint64_t out_ns;
    uint64_t seq;
    bool digest_sent; /* the room's digest went in the final completion */
    /* A GPU step took the step's digest (kvw_step_t.digest) over: it is added to the
     * room's sums, and the room's digest sent, when the step is reaped. */
    bool digest_deferred;
} kvw_step_out_t;

/* A verified room's last step for a decode rank puts the room's digest in its final
 * completion (one frame, one wake-up of the decode) when it fits in one and the step is
 * small enough to hash before that completion goes out: at most KVW_VERIFY_INLINE_KB
 * (default 256 KiB, about 30 us of hashing here, what a separate DIGEST frame costs the
 * decode; 0: never). A larger step sends its completion first and hashes meanwhile, beside
 * the decode's read pass. GPU steps (bytes 0 here) hash on the stream before their DONE
 * goes out anyway. */
static bool kvw_digest_fits(const struct kvw_ctx *ctx, uint32_t units)
{
    return units <= KVW_DONE_DIGEST_MAX && ctx->cfg.verify_inline;
}

static bool kvw_digest_inline(const struct kvw_ctx *ctx, const kvw_step_t *s, uint64_t bytes)
{
    return s->digest && s->final && s->q->c.last_chunk && kvw_digest_fits(ctx, s->num_units) &&
           bytes <= ctx->cfg.verify_inline;
}

/* The room's digest for a decode rank in its own frame (DIGEST, on the control channel),
 * when its final completion did not carry it (mu held). */
static void kvw_send_digest(struct kvw_ctx *ctx, kvw_peer_t *peer, uint64_t room, uint32_t units,
                            const uint64_t *sums)
{
    kvw_wbuf_t dw;
    kvw__wb_init(&dw, KVW_MSG_DIGEST);
    kvw__wb_u64(&dw, room);
    kvw__wb_u32(&dw, units);
    for (uint32_t u = 0; u < units; u++)
        kvw__wb_u64(&dw, sums[u]);
    kvw__peer_send(ctx, peer, &dw);
}

/* Puts the room's digest (the steps before plus this one's, s->digest) into DONE dm;
 * vals: room for s->num_units values, alive until dm is encoded. */
static void kvw_done_digest(const kvw_step_t *s, kvw_done_msg_t *dm, uint64_t *vals,
                            kvw_step_out_t *out)
{
    for (uint32_t u = 0; u < s->num_units; u++)
        vals[u] = (s->room_digest ? s->room_digest[u] : 0) + s->digest[u];
    dm->digest_n = s->num_units;
    dm->digest = vals;
    out->digest_sent = true;
}

/* The DONE of step s for chunk c, having moved `bytes`, final or not (not staged). */
static kvw_done_msg_t kvw_step_done(const kvw_step_t *s, const kvw_chunk_t *c, uint64_t bytes,
                                    bool final)
{
    return (kvw_done_msg_t){.room = s->r->id, .peer = s->peer->id_at_remote,
                            .chunk_begin = c->chunk_begin, .chunk_end = c->chunk_end,
                            .bytes = bytes, .last_chunk = c->last_chunk != 0, .final = final,
                            .meta_len = final && c->last_chunk ? s->meta_len : 0};
}

/* Hands a chunk's completion to the transport; *out_ns_p: when (KVW_HOP_BYTES_OUT). */
static kvw_status_t kvw_notify_done(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_wbuf_t *w,
                                    uint64_t *out_ns_p)
{
    kvw_status_t st = kvw__wb_finish(w);
    *out_ns_p = kvw__now_ns();
    if (st == KVW_OK)
        st = ctx->tl_ops->notify(peer->ep, w->p, w->len);
    kvw__wb_free(w);
    return st;
}

/* Whether a step moves segment `s`: every segment (take NULL), or those of the layers
 * taken (one byte per layer of the stage starting at layer_begin). */
static bool kvw_seg_taken(const kvw_seg_t *s, const uint8_t *take, uint32_t layer_begin)
{
    return take == NULL || (s->layer >= layer_begin && take[s->layer - layer_begin]);
}

/* The windows of a staged step, in stream order: each run of consecutive segments of
 * the layers taken is one range of the chunk's stream, cut into pieces of at most
 * `piece` bytes. */
typedef struct kvw_win_iter {
    const struct kvw_plan *plan;
    const uint8_t *take;
    uint32_t lb;
    uint64_t piece;
    uint32_t i;          /* next segment to look at */
    uint64_t pos;        /* stream offset of segment i */
    uint64_t next, end;  /* the rest of the current range */
} kvw_win_iter_t;

/* The next window [*b, *e); false when there is none. */
static bool kvw_win_next(kvw_win_iter_t *it, uint64_t *b, uint64_t *e)
{
    const struct kvw_plan *plan = it->plan;
    while (it->next >= it->end) {
        if (it->i >= plan->num_segs)
            return false;
        if (!kvw_seg_taken(&plan->segs[it->i], it->take, it->lb)) {
            it->pos += kvw__seg_bytes(&plan->segs[it->i++]);
            continue;
        }
        it->next = it->pos;
        while (it->i < plan->num_segs && kvw_seg_taken(&plan->segs[it->i], it->take, it->lb))
            it->pos += kvw__seg_bytes(&plan->segs[it->i++]);
        it->end = it->pos;
    }
    *b = it->next;
    *e = it->next + KVW_MIN(it->end - it->next, it->piece);
    it->next = *e;
    return true;
}

/*
 * Sends one staged step: ask for space, gather, one bulk put, notify; repeat. A plain
 * chunk is one byte range, the whole plan's stream; a streamed step moves, for each run
 * of consecutive segments of the layers it takes, that run's range of the stream.
 * Windows are formed per range (per layer group) and never straddle two, and their
 * offsets stay those of the whole chunk's stream: the decode rank scatters a window by
 * its offset in the chunk's plan and needs to know nothing of the layers. Only the last
 * window of a step that completes the chunk is final.
 */
static kvw_status_t kvw_send_staged(struct kvw_ctx *ctx, const kvw_step_t *s,
                                    const struct kvw_plan *plan, const kvw_chunk_t *c,
                                    kvw_step_out_t *out)
{
    kvw_room_t *r = s->r;
    uint32_t di = s->di;
    kvw_peer_t *peer = s->peer;
    const uint8_t *take = s->take;
    uint32_t lb = ctx->rank->par.layer_begin;
    uint64_t total = 0, piece_max = KVW_MIN(peer->staging_len / 4, 16ull << 20);
    for (uint32_t i = 0; i < plan->num_segs; i++)
        if (kvw_seg_taken(&plan->segs[i], take, lb))
            total += kvw__seg_bytes(&plan->segs[i]);
    out->bytes = total;
    /* A small last step hashes first: its final completion carries the room's digest. */
    uint64_t dvals[KVW_DONE_DIGEST_MAX];
    bool dig_inline = kvw_digest_inline(ctx, s, total);
    kvw_status_t st = KVW_OK;
    if (dig_inline && total &&
        (st = ctx->mem->digest(plan, false, take, lb, s->digest, s->num_units)) != KVW_OK)
        return st;
    if (total == 0) {
        /* None of this step's layers holds bytes for this decode rank (SWA layers of an
         * early chunk): only the completion goes, which may be the final one. */
        kvw_wbuf_t w;
        kvw_done_msg_t dm = kvw_step_done(s, c, 0, s->final);
        if (dig_inline)
            kvw_done_digest(s, &dm, dvals, out);
        kvw__done_encode(&w, &dm, peer->authed ? peer->skey : NULL);
        return kvw_notify_done(ctx, peer, &w, &out->out_ns);
    }
    /* The chunk's plan is prepared once for all its windows (on a GPU: uploaded once).
     * Host memory is gathered on the CPU after each grant; on a GPU the gather of window
     * k + 1 runs while window k is on the wire (the decode scatters window k - 1
     * meanwhile). */
    kvw_win_iter_t it = {.plan = plan, .take = take, .lb = lb, .piece = piece_max};
    uint64_t wb = 0, we = 0, nb = 0, ne = 0;
    bool have = kvw_win_next(&it, &wb, &we);
    uint64_t wmax = KVW_MAX(KVW_MIN(total, piece_max), 1);
    kvw_staged_t *sg = NULL;
    st = kvw__staged_open(ctx->mem, ctx->mem_dev, (struct kvw_plan *)plan, false, true, wmax,
                          &sg);
    if (st == KVW_OK && have)
        st = kvw__staged_gather(sg, wb, we);
    uint64_t sent = 0;
    for (uint32_t k = 0; have && st == KVW_OK; k++, wb = nb, we = ne) {
        uint64_t len = we - wb;
        pthread_mutex_lock(&ctx->mu);
        r->dsts[di].grant_off = -1;
        kvw_wbuf_t w;
        kvw__wb_init(&w, KVW_MSG_STAGE_ASK);
        kvw__wb_u64(&w, r->id);
        kvw__wb_u64(&w, len);
        kvw__peer_send(ctx, peer, &w);
        /* Credits: wait until the decode rank grants space (back-pressure). The room's
         * own timeout and peer failure both wake this wait. */
        while (r->dsts[di].grant_off < 0 && r->state != KVW_ROOM_FAILED && !ctx->stopping &&
               !peer->dead)
            pthread_cond_wait(&ctx->cv, &ctx->mu);
        int64_t goff = r->dsts[di].grant_off;
        uint64_t glen = r->dsts[di].grant_len;
        bool failed = r->state == KVW_ROOM_FAILED || ctx->stopping || peer->dead;
        pthread_mutex_unlock(&ctx->mu);
        if (failed) {
            st = kvw__error(KVW_ERR_ABORTED, "the room ended while waiting for staging space");
            break;
        }
        if (glen != len || (uint64_t)goff + len > peer->staging_len) {
            st = kvw__error(KVW_ERR_MALFORMED, "staging grant [%lld, +%llu) does not match "
                            "the %llu bytes asked", (long long)goff, (unsigned long long)glen,
                            (unsigned long long)len);
            break;
        }
        have = kvw_win_next(&it, &nb, &ne);
        const uint8_t *wbuf = NULL;
        st = kvw__staged_take(sg, &wbuf);
        if (st == KVW_OK && have)
            st = kvw__staged_gather(sg, nb, ne);
        if (st != KVW_OK)
            break;
        kvw_tl_put_t put = {.src = wbuf, .rkey = peer->staging_rkey, .dst_off = (uint64_t)goff,
                            .len = len};
        if ((st = ctx->tl_ops->put(peer->ep, r->id, &put, 1)) != KVW_OK)
            break;
        sent += len;
        kvw_wbuf_t dw;
        kvw_done_msg_t dm = kvw_step_done(s, c, len, s->final && sent == total);
        dm.staged = true, dm.soff = wb, dm.slen = len, dm.goff = (uint64_t)goff;
        if (dig_inline && sent == total)
            kvw_done_digest(s, &dm, dvals, out);
        kvw__done_encode(&dw, &dm, peer->authed ? peer->skey : NULL);
        st = kvw_notify_done(ctx, peer, &dw, &out->out_ns);
        out->runs++;
    }
    kvw__staged_close(sg);
    return st;
}

/*
 * GPU steps in flight on one worker: the kernel runs on the worker's own stream while
 * the worker prepares the next job; each step's DONE goes out once its kernel completed,
 * in launch order (so one decode rank's chunks stay in order). A job (room, decode
 * rank) whose steps are still in flight keeps the room pinned (inflight) and its decode
 * rank busy until its last step is reaped.
 */
typedef struct kvw_gpu_step {
    kvw_room_t *r;
    uint32_t di;
    kvw_peer_t *peer;
    int slot;        /* executor slot; -1: nothing launched, the DONE waits its turn */
    bool closes_job; /* releases the (room, decode rank) once reaped */
    uint64_t seq;
    kvw_done_msg_t dm; /* the step's DONE, encoded once the step completed */
    /* A verified room: the step's digest (owned), computed behind the copy on the
     * executor and complete once the step is reaped, when it is added to the decode
     * rank's sums; `last`: the room's last step for it, whose DONE carries the room's
     * digest (or which sends it as DIGEST, when it does not fit). NULL: not verified. */
    uint64_t *part;
    uint32_t num_units;
    bool last;
    /* Launched in one kernel with the step before it (kvw_worker_batch): done when that
     * one is reaped, with its outcome (slot -1 here). */
    bool follows;
} kvw_gpu_step_t;

/* Jobs one launch may cover (KVW_GPU_BATCH at most this), the chunk of at most this
 * many tokens each and this many in all: small rooms' copies, whose kernels are short
 * next to what a launch, its plan's upload and its completion cost. */
#define KVW_GPU_BATCH_MAX 32u
#define KVW_GPU_BATCH_JOB_TOKENS 2048u
#define KVW_GPU_BATCH_TOKENS 16384u
#define KVW_GPU_Q (KVWC_EXEC_SLOTS * KVW_GPU_BATCH_MAX)

typedef struct kvw_gpu_q {
    kvw_gpu_step_t *q; /* cap entries, a ring */
    uint32_t cap, head, n;
    uint32_t launched; /* entries in q with a slot (kernels in flight) */
    uint32_t depth; /* kernels in flight at most: KVW_GPU_INFLIGHT, 1..KVWC_EXEC_SLOTS */
    uint32_t batch; /* jobs per launch at most: KVW_GPU_BATCH, 1..KVW_GPU_BATCH_MAX */
    uint64_t seq, reaped; /* last sequence number given out and reaped */
    kvw_status_t last_st; /* outcome of the last launched step reaped (for `follows`) */
    char last_msg[512];
} kvw_gpu_q_t;

static void kvw_job_release(struct kvw_ctx *ctx, kvw_room_t *r, uint32_t di);
static void kvw_job_take(struct kvw_ctx *ctx, kvw_room_t *r, uint32_t i);

/* A verified step, reaped (its digest complete; mu not held): adds it to the decode
 * rank's sums and, with the room's last step, puts the room's digest into the step's
 * DONE (dvals: room for it) or, when it does not fit, sends it as DIGEST. */
static void kvw_gpu_step_digest(struct kvw_ctx *ctx, kvw_gpu_step_t *e, uint64_t *dvals)
{
    pthread_mutex_lock(&ctx->mu);
    kvw_room_dst_t *d = &e->r->dsts[e->di];
    for (uint32_t u = 0; d->digest && u < e->num_units; u++)
        d->digest[u] += e->part[u];
    if (e->last && d->digest) {
        if (kvw_digest_fits(ctx, e->num_units)) {
            memcpy(dvals, d->digest, 8ull * e->num_units);
            e->dm.digest_n = e->num_units;
            e->dm.digest = dvals;
        } else {
            kvw_send_digest(ctx, e->peer, e->r->id, e->num_units, d->digest);
        }
    }
    pthread_mutex_unlock(&ctx->mu);
}

/* Reaps finished steps in order, sending their DONEs; with `block`, waits for the
 * oldest first. Called without ctx->mu. */
static void kvw_gpu_reap(struct kvw_ctx *ctx, kvw_gpu_q_t *g, bool block)
{
    while (g->n) {
        kvw_gpu_step_t *e = &g->q[g->head];
        kvw_cuda_profile_t prof = {0};
        int done = 1;
        kvw_status_t st = KVW_OK;
        if (e->follows) {
            st = g->last_st;
            if (st != KVW_OK)
                kvw__error(st, "%s", g->last_msg);
        } else if (e->slot >= 0) {
            st = ctx->mem->step_reap(e->slot, block, &done, &prof);
        }
        if (!done)
            return;
        if (e->slot >= 0)
            g->launched--;
        if (!e->follows) {
            g->last_st = st;
            snprintf(g->last_msg, sizeof(g->last_msg), "%s", st == KVW_OK ? "" : kvw_last_error());
        }
        block = false;
        uint64_t t0 = kvw__now_ns();
        uint64_t dvals[KVW_DONE_DIGEST_MAX];
        if (st == KVW_OK && e->part)
            kvw_gpu_step_digest(ctx, e, dvals);
        if (st == KVW_OK) {
            kvw_wbuf_t w;
            kvw__done_encode(&w, &e->dm, e->peer->authed ? e->peer->skey : NULL);
            if ((st = kvw__wb_finish(&w)) == KVW_OK)
                st = ctx->tl_ops->notify(e->peer->ep, w.p, w.len);
            kvw__wb_free(&w);
            prof.last_done_ns = kvw__now_ns();
            prof.notify_ns = prof.last_done_ns - t0;
        }
        char msg[512] = "";
        if (st != KVW_OK)
            snprintf(msg, sizeof(msg), "%s", kvw_last_error());
        ctx->mem->profile_add(&prof);
        free(e->part);
        e->part = NULL;
        kvw_gpu_step_t done_e = *e;
        g->head = (g->head + 1) % g->cap;
        g->n--;
        g->reaped = done_e.seq;
        pthread_mutex_lock(&ctx->mu);
        if (st == KVW_OK)
            done_e.r->hop_ns[KVW_HOP_BYTES_OUT] = t0;
        if (st != KVW_OK) {
            if (done_e.r->state != KVW_ROOM_FAILED)
                kvw__room_fail(ctx, done_e.r, st, true, "sending to %s failed: %s",
                               done_e.peer->desc, msg);
            if (st == KVW_ERR_CONN_CLOSED || st == KVW_ERR_IO)
                kvw__peer_dead(ctx, done_e.peer, st, msg);
        }
        if (done_e.closes_job)
            kvw_job_release(ctx, done_e.r, done_e.di);
        pthread_mutex_unlock(&ctx->mu);
    }
}

/* Waits, reaping the oldest steps, until a launch of `entries` steps fits: fewer than
 * depth kernels in flight and room in the queue (mu not held). */
static void kvw_gpu_make_room(struct kvw_ctx *ctx, kvw_gpu_q_t *g, uint32_t entries)
{
    while (g->n && (g->launched >= g->depth || g->n + entries > g->cap))
        kvw_gpu_reap(ctx, g, true);
}

/* Runs step s (mu not held; the room is pinned by inflight) on the mapped, staged or
 * direct path; *out says what it did (zeroed by the caller). */
static kvw_status_t kvw_worker_step(struct kvw_ctx *ctx, const kvw_step_t *s, kvw_gpu_q_t *g,
                                    kvw_step_out_t *out)
{
    kvw_room_t *r = s->r;
    uint32_t di = s->di;
    kvw_peer_t *peer = s->peer;
    const kvw_room_dst_t *d = s->d;
    const kvw_qchunk_t *q = s->q;
    const uint8_t *take = s->take;
    uint32_t lb = ctx->rank->par.layer_begin, nl = ctx->rank->par.layer_end - lb;
    kvw_chunk_t c = q->c;
    c.prefix_len = d->prefix_len;
    if (c.prefix_len > c.num_tokens)
        return kvw__error(KVW_ERR_INVALID_PARAM, "decode prefix %llu exceeds %llu tokens",
                          (unsigned long long)c.prefix_len, (unsigned long long)c.num_tokens);
    kvw_plan_h plan;
    kvw_status_t st;
    if (peer->mapped) {
        /* The decode buffers are mapped here (CUDA IPC): one fused kernel writes them
         * directly, and the notification goes out only after it completed. */
        uint64_t t0 = kvw__now_ns();
        if ((st = kvw__plan_create(ctx->rank, peer->mapped, &c, &q->pages, &d->pages, &plan)) !=
            KVW_OK)
            return st;
        if (take)
            kvw__plan_keep_layers(plan, take, lb, nl);
        out->bytes = plan->bytes;
        out->runs = plan->num_segs;
        /* Launched on this worker's executor (a GPU stream; host memory is copied before
         * the launch returns) with the DONE queued behind it: kvw_gpu_reap sends it once
         * the bytes have landed, in launch order. */
        kvw_cuda_profile_t prof = {.steps = 1, .bytes = plan->bytes,
                                   .plan_ns = kvw__now_ns() - t0, .first_start_ns = t0};
        kvw_gpu_make_room(ctx, g, 1);
        kvw_gpu_step_t *e = &g->q[(g->head + g->n) % g->cap];
        *e = (kvw_gpu_step_t){.r = r, .di = di, .peer = peer, .slot = -1};
        if ((st = ctx->mem->select(ctx->mem_dev)) == KVW_OK)
            st = ctx->mem->step_launch(plan, &e->slot, &prof);
        /* A verified room: the digest of the source rows (the plan keeps only the
         * layers taken), on this worker's executor behind the copy without waiting
         * (host memory, or nothing launched: computed now). It is complete when the
         * step is reaped, which adds it to the room's sums before the DONE goes out. */
        if (st == KVW_OK && s->digest)
            st = e->slot >= 0 && ctx->mem->step_digest
                     ? ctx->mem->step_digest(plan, e->slot, s->digest, s->num_units)
                     : ctx->mem->digest(plan, false, NULL, lb, s->digest, s->num_units);
        if (st == KVW_OK) {
            e->dm = kvw_step_done(s, &c, plan->bytes, s->final);
            e->part = s->digest;
            e->num_units = s->num_units;
            e->last = s->final && c.last_chunk;
            out->digest_deferred = s->digest != NULL;
        }
        ctx->mem->profile_add(&prof);
        kvw_plan_destroy(plan);
        if (st != KVW_OK) {
            if (e->slot >= 0) {
                /* Launched, but no DONE can follow: let the kernel finish first. */
                kvw_cuda_profile_t p2 = {0};
                int done = 0;
                (void)ctx->mem->step_reap(e->slot, 1, &done, &p2);
            }
            return st;
        }
        e->seq = ++g->seq;
        out->seq = e->seq;
        g->n++;
        g->launched += e->slot >= 0;
        if (e->slot < 0)
            kvw_gpu_reap(ctx, g, false); /* nothing in flight for it: its DONE goes in turn */
        return KVW_OK;
    }
    st = kvw__plan_create(ctx->rank, peer->remote, &c, &q->pages, &d->pages, &plan);
    if (st != KVW_OK)
        return st;
    /* Staged or direct is decided on the whole chunk's plan, so that every step of a
     * streamed chunk takes the same path. A verified room's source rows are read once
     * the step's bytes and completion are out (the source pages stay in place until the
     * room ends), so that the decode's read pass of its pages runs meanwhile: the
     * decode checks when it has both digests. */
    out->staged = plan->bytes > 0 && kvw_choose_staged(ctx, peer, plan);
    if (out->staged) {
        st = kvw_send_staged(ctx, s, plan, &c, out);
        if (st == KVW_OK && s->digest && !out->digest_sent)
            st = ctx->mem->digest(plan, false, take, lb, s->digest, s->num_units);
        kvw_plan_destroy(plan);
        return st;
    }
    if (take)
        kvw__plan_keep_layers(plan, take, lb, nl);
    out->bytes = plan->bytes;
    kvw_put_ctx_t *pc = malloc(sizeof(*pc));
    if (pc == NULL) {
        kvw_plan_destroy(plan);
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory sending");
    }
    pc->ctx = ctx, pc->peer = peer, pc->room = r, pc->n = 0, pc->runs = 0;
    /* A small last step hashes first: its final completion carries the room's digest. */
    uint64_t dvals[KVW_DONE_DIGEST_MAX];
    bool dig_inline = kvw_digest_inline(ctx, s, plan->bytes);
    kvw_done_msg_t dm = kvw_step_done(s, &c, plan->bytes, s->final);
    st = KVW_OK;
    if (dig_inline && (st = ctx->mem->digest(plan, false, NULL, lb, s->digest, s->num_units)) ==
                          KVW_OK)
        kvw_done_digest(s, &dm, dvals, out);
    if (st == KVW_OK)
        st = kvw_plan_expand(plan, kvw_put_run, pc);
    if (st == KVW_OK && ctx->tl_ops->put_notify) {
        /* The last batch of writes and the completion in one call (tcp: one sendmsg). */
        kvw_wbuf_t w;
        kvw__done_encode(&w, &dm, peer->authed ? peer->skey : NULL);
        st = kvw__wb_finish(&w);
        out->out_ns = kvw__now_ns();
        if (st == KVW_OK)
            st = ctx->tl_ops->put_notify(peer->ep, r->id, pc->puts, pc->n, w.p, w.len);
        pc->n = 0;
        kvw__wb_free(&w);
    } else if (st == KVW_OK) {
        st = kvw_put_flush(pc);
        if (st == KVW_OK) {
            kvw_wbuf_t w;
            kvw__done_encode(&w, &dm, peer->authed ? peer->skey : NULL);
            st = kvw_notify_done(ctx, peer, &w, &out->out_ns);
        }
    }
    if (st == KVW_OK && s->digest && !dig_inline) /* the layers taken only: the plan keeps no others */
        st = ctx->mem->digest(plan, false, NULL, lb, s->digest, s->num_units);
    out->runs = pc->runs;
    free(pc);
    kvw_plan_destroy(plan);
    return st;
}

/*
 * Workers take (room, decode rank) jobs: several workers serve the decode ranks of one
 * room in parallel (a TP1 prefill rank feeding four decode ranks gathers for all four
 * at once), while the chunks for one decode rank go out in order, from one worker.
 */
/* A job (room, decode rank) is over: the decode rank may be served again. */
static void kvw_job_release(struct kvw_ctx *ctx, kvw_room_t *r, uint32_t di)
{
    r->dsts[di].busy = false;
    r->inflight--;
    kvw__room_quiesce(ctx, r);
    kvw__sender_update(ctx, r);
    pthread_cond_broadcast(&ctx->cv);
}

/* One job: worker step after worker step to decode rank `i` of room r, until its chunks
 * are sent, the room fails or a streamed chunk has no layer ready (mu held, dropped
 * around each step). The job is released here, or with its last GPU step when that one
 * is reaped. */
static void kvw_worker_job(struct kvw_ctx *ctx, kvw_room_t *r, uint32_t i, kvw_gpu_q_t *gq,
                           bool one_chunk)
{
    uint64_t job_seq = 0; /* this job's last GPU step still to be reaped, if any */
    uint32_t nl = ctx->rank->par.layer_end - ctx->rank->par.layer_begin;
    while (r->dsts[i].next_chunk < r->num_chunks && r->state != KVW_ROOM_FAILED) {
        kvw_room_dst_t *d = &r->dsts[i];
        kvw_peer_t *peer = kvw__peer_at(ctx, d->peer);
        kvw_qchunk_t q = r->chunks[d->next_chunk];
        /* A streamed chunk: take the layers marked ready and not sent to this decode
         * rank yet, as one step; the step completes the chunk when no layer is left.
         * With none ready, the job ends here and kvw_sender_layers_ready queues the
         * room again. */
        uint8_t *take = NULL;
        bool final = true;
        if (q.ready) {
            if (d->sent == NULL && (d->sent = calloc(nl, 1)) == NULL) {
                kvw__room_fail(ctx, r, KVW_ERR_NO_MEMORY, true, "out of memory streaming");
                break;
            }
            if ((take = calloc(nl, 1)) == NULL) {
                kvw__room_fail(ctx, r, KVW_ERR_NO_MEMORY, true, "out of memory streaming");
                break;
            }
            uint32_t taken = 0, done = 0;
            for (uint32_t l = 0; l < nl; l++) {
                done += d->sent[l];
                if (q.ready[l] && !d->sent[l])
                    take[l] = 1, taken++;
            }
            if (taken == 0) {
                free(take);
                break;
            }
            final = done + taken == nl;
        }
        kvw_room_dst_t dcopy = *d;
        /* The room's metadata goes out on the control channel before the last
         * chunk's final completion, which announces its length. */
        uint32_t meta_len = 0;
        if (q.c.last_chunk && final && r->has_meta) {
            meta_len = r->meta_len;
            kvw_wbuf_t mw;
            kvw__wb_init(&mw, KVW_MSG_META);
            kvw__wb_u64(&mw, r->id);
            kvw__wb_bytes(&mw, r->meta, r->meta_len);
            kvw__peer_send(ctx, peer, &mw);
        }
        /* A verified room: this step's digest, added to the room's once it is sent. */
        uint64_t *part = NULL;
        uint32_t units = 0;
        if (d->verify) {
            units = kvw__digest_units(peer->remote);
            if ((d->digest == NULL && (d->digest = calloc(units ? units : 1, 8)) == NULL) ||
                (part = calloc(units ? units : 1, 8)) == NULL) {
                free(take);
                kvw__room_fail(ctx, r, KVW_ERR_NO_MEMORY, true, "out of memory verifying");
                break;
            }
            d->num_units = units;
        }
        /* Read under mu: r->dsts may be reallocated (a decode rank posting) once it is
         * let go; the sums array itself stays put. */
        const uint64_t *room_digest = d->digest;
        pthread_mutex_unlock(&ctx->mu);
        kvw_step_t step = {.r = r, .di = i, .peer = peer, .d = &dcopy, .q = &q, .take = take,
                           .final = final, .meta_len = meta_len, .digest = part,
                           .num_units = units, .room_digest = room_digest};
        kvw_step_out_t so = {0};
        kvw_status_t st = kvw_worker_step(ctx, &step, gq, &so);
        if (so.seq)
            job_seq = so.seq;
        char msg[512];
        snprintf(msg, sizeof(msg), "%s", kvw_last_error());
        pthread_mutex_lock(&ctx->mu);
        d = &r->dsts[i];
        if (so.digest_deferred)
            part = NULL; /* the GPU step's now: added when it is reaped */
        if (st == KVW_OK && part) {
            for (uint32_t u = 0; u < units; u++)
                d->digest[u] += part[u];
            /* The whole room's digest for this decode rank follows its last completion
             * (the decode waits for both before it checks). */
            if (final && q.c.last_chunk && !so.digest_sent)
                kvw_send_digest(ctx, peer, r->id, units, d->digest);
        }
        free(part);
        if (st != KVW_OK) {
            free(take);
            if (r->state != KVW_ROOM_FAILED)
                kvw__room_fail(ctx, r, st, true, "sending to %s failed: %s", peer->desc, msg);
            if (st == KVW_ERR_CONN_CLOSED || st == KVW_ERR_IO)
                kvw__peer_dead(ctx, peer, st, msg);
            break;
        }
        if (take) {
            for (uint32_t l = 0; l < nl; l++)
                d->sent[l] |= take[l];
            free(take);
            if (final)
                memset(d->sent, 0, nl); /* the next chunk starts with none sent */
        }
        r->bytes += so.bytes;
        kvw__metrics_bytes(ctx, so.staged, so.bytes);
        r->runs += so.runs;
        r->path = so.staged ? "staged" : "direct";
        if (so.out_ns) /* GPU steps stamp it when their completion goes out */
            r->hop_ns[KVW_HOP_BYTES_OUT] = so.out_ns;
        kvw__room_touch(ctx, r);
        if (!final)
            continue;
        if (q.c.last_chunk)
            d->last_sent = true;
        d->next_chunk++;
        if (one_chunk)
            break; /* a chunk queued meanwhile goes to the workers (released below) */
    }
    if (job_seq > gq->reaped) {
        /* Its last step is still in flight: released when that one is reaped. */
        for (uint32_t k = 0; k < gq->n; k++)
            if (gq->q[(gq->head + k) % gq->cap].seq == job_seq)
                gq->q[(gq->head + k) % gq->cap].closes_job = true;
    } else {
        kvw_job_release(ctx, r, i);
    }
}

/* Whether decode rank di of room r (mu held) is a job kvw_worker_batch can launch with
 * others: one chunk left for it, not streamed, not verified, of at most
 * KVW_GPU_BATCH_JOB_TOKENS, to a decode rank whose buffers are mapped here (cuda_ipc).
 * *tokens_p: the chunk's tokens. */
static bool kvw_batchable(struct kvw_ctx *ctx, const kvw_room_t *r, uint32_t di,
                          uint64_t *tokens_p)
{
    const kvw_room_dst_t *d = &r->dsts[di];
    if (r->state == KVW_ROOM_FAILED || d->next_chunk + 1 != r->num_chunks || d->verify ||
        d->peer >= kvw__peer_count(ctx))
        return false;
    const kvw_peer_t *peer = kvw__peer_at(ctx, d->peer);
    const kvw_qchunk_t *q = &r->chunks[d->next_chunk];
    *tokens_p = q->c.chunk_end - q->c.chunk_begin;
    return peer->mapped && !peer->dead && q->ready == NULL &&
           *tokens_p <= KVW_GPU_BATCH_JOB_TOKENS;
}

/* A job of a batch: what the step needs, copied under mu. */
typedef struct kvw_bjob {
    kvw_room_t *r;
    uint32_t di;
    kvw_peer_t *peer;
    kvw_room_dst_t d;
    kvw_qchunk_t q;
    uint32_t meta_len;
    kvw_plan_h plan;
    kvw_status_t st;
    char msg[256];
} kvw_bjob_t;

/* Copies job (r, di), taken, into b and sends the room's metadata first when this is
 * its last chunk (mu held; as kvw_worker_job does). */
static void kvw_bjob_init(struct kvw_ctx *ctx, kvw_bjob_t *b, kvw_room_t *r, uint32_t di)
{
    kvw_room_dst_t *d = &r->dsts[di];
    *b = (kvw_bjob_t){.r = r, .di = di, .peer = kvw__peer_at(ctx, d->peer), .d = *d,
                      .q = r->chunks[d->next_chunk]};
    if (b->q.c.last_chunk && r->has_meta) {
        b->meta_len = r->meta_len;
        kvw_wbuf_t mw;
        kvw__wb_init(&mw, KVW_MSG_META);
        kvw__wb_u64(&mw, r->id);
        kvw__wb_bytes(&mw, r->meta, r->meta_len);
        kvw__peer_send(ctx, b->peer, &mw);
    }
}

/*
 * Small rooms on mapped decode buffers (cuda_ipc): job (r, i), taken and batchable, and
 * the jobs at the head of the queue that are too (up to KVW_GPU_BATCH, at most
 * KVW_GPU_BATCH_TOKENS in all), as one kernel: one launch, one plan upload and one
 * completion event for all, where each would cost about as much as its copy. Each job's
 * DONE goes out when the kernel is reaped, in order, and each job is released then
 * (mu held, dropped around the plans and the launch). A job whose plan cannot be made
 * fails its room alone; a launch that fails fails every room in it.
 */
static void kvw_worker_batch(struct kvw_ctx *ctx, kvw_room_t *r0, uint32_t i0, uint64_t tokens,
                             kvw_gpu_q_t *g)
{
    kvw_bjob_t jobs[KVW_GPU_BATCH_MAX];
    uint32_t n = 0;
    kvw_bjob_init(ctx, &jobs[n++], r0, i0);
    while (n < g->batch) {
        kvw_room_t *r = kvw__queue_head(ctx);
        int di = r ? kvw__room_next_dst(ctx, r) : -1;
        uint64_t tk;
        if (di < 0 || !kvw_batchable(ctx, r, (uint32_t)di, &tk) ||
            tokens + tk > KVW_GPU_BATCH_TOKENS)
            break;
        (void)kvw__dequeue_room(ctx); /* r: the head, under mu since it was looked at */
        kvw_job_take(ctx, r, (uint32_t)di);
        kvw_bjob_init(ctx, &jobs[n++], r, (uint32_t)di);
        tokens += tk;
    }
    pthread_mutex_unlock(&ctx->mu);

    uint64_t t0 = kvw__now_ns();
    const struct kvw_plan *plans[KVW_GPU_BATCH_MAX];
    uint32_t m = 0;
    uint64_t bytes = 0;
    for (uint32_t k = 0; k < n; k++) {
        kvw_bjob_t *b = &jobs[k];
        kvw_chunk_t c = b->q.c;
        c.prefix_len = b->d.prefix_len;
        if (c.prefix_len > c.num_tokens)
            b->st = kvw__error(KVW_ERR_INVALID_PARAM, "decode prefix %llu exceeds %llu tokens",
                               (unsigned long long)c.prefix_len,
                               (unsigned long long)c.num_tokens);
        else
            b->st = kvw__plan_create(ctx->rank, b->peer->mapped, &c, &b->q.pages, &b->d.pages,
                                     &b->plan);
        if (b->st != KVW_OK) {
            snprintf(b->msg, sizeof(b->msg), "%s", kvw_last_error());
            b->plan = NULL;
            continue;
        }
        plans[m++] = b->plan;
        bytes += b->plan->bytes;
    }
    kvw_cuda_profile_t prof = {.steps = 1, .bytes = bytes, .plan_ns = kvw__now_ns() - t0,
                               .first_start_ns = t0};
    int slot = -1;
    kvw_status_t st = KVW_OK;
    char msg[256] = "";
    kvw_gpu_make_room(ctx, g, m);
    if (m && (st = ctx->mem->select(ctx->mem_dev)) == KVW_OK)
        st = ctx->mem->step_launch_n(plans, m, &slot, &prof);
    if (st != KVW_OK)
        snprintf(msg, sizeof(msg), "%s", kvw_last_error());
    if (m)
        ctx->mem->profile_add(&prof);
    /* The launched jobs' steps, in order, the first holding the slot. */
    uint32_t queued = 0;
    for (uint32_t k = 0; k < n && st == KVW_OK; k++) {
        kvw_bjob_t *b = &jobs[k];
        if (b->st != KVW_OK)
            continue;
        kvw_step_t step = {.r = b->r, .di = b->di, .peer = b->peer, .d = &b->d, .q = &b->q,
                           .final = true, .meta_len = b->meta_len};
        kvw_gpu_step_t *e = &g->q[(g->head + g->n) % g->cap];
        *e = (kvw_gpu_step_t){.r = b->r, .di = b->di, .peer = b->peer,
                              .slot = queued ? -1 : slot, .follows = queued > 0,
                              .closes_job = true, .seq = ++g->seq,
                              .dm = kvw_step_done(&step, &b->q.c, b->plan->bytes, true)};
        g->n++;
        g->launched += e->slot >= 0;
        queued++;
    }

    pthread_mutex_lock(&ctx->mu);
    for (uint32_t k = 0; k < n; k++) {
        kvw_bjob_t *b = &jobs[k];
        kvw_room_t *r = b->r;
        kvw_room_dst_t *d = &r->dsts[b->di];
        if (b->st == KVW_OK && st != KVW_OK)
            b->st = st, snprintf(b->msg, sizeof(b->msg), "%s", msg);
        if (b->st != KVW_OK) {
            if (r->state != KVW_ROOM_FAILED)
                kvw__room_fail(ctx, r, b->st, true, "sending to %s failed: %s", b->peer->desc,
                               b->msg);
            kvw_job_release(ctx, r, b->di);
        } else {
            r->bytes += b->plan->bytes;
            kvw__metrics_bytes(ctx, false, b->plan->bytes);
            r->runs += b->plan->num_segs;
            r->path = "direct";
            kvw__room_touch(ctx, r);
            if (b->q.c.last_chunk)
                d->last_sent = true;
            d->next_chunk++;
        }
        kvw_plan_destroy(b->plan);
    }
    if (queued && slot < 0) {
        /* Nothing was in flight for them: their DONEs go in turn. */
        pthread_mutex_unlock(&ctx->mu);
        kvw_gpu_reap(ctx, g, false);
        pthread_mutex_lock(&ctx->mu);
    }
}

/* What the control thread serves itself (kvw__ctrl_serve): rooms whose one chunk left for
 * the decode rank is at most this many tokens and bytes, at most this many per pass. A
 * larger room, a staged or GPU path, a streamed chunk: the workers'. The bound on bytes
 * keeps the control thread's writes far below the socket buffers, so that it does not
 * wait on them. */
#define KVW_CTRL_SERVE_TOKENS 256u
#define KVW_CTRL_SERVE_BYTES (64u << 10)
#define KVW_CTRL_SERVE_ROOMS 4u

static bool kvw_ctrl_can_serve(struct kvw_ctx *ctx, const kvw_room_t *r, uint32_t di)
{
    const kvw_room_dst_t *d = &r->dsts[di];
    if (d->next_chunk + 1 != r->num_chunks || d->peer >= kvw__peer_count(ctx))
        return false;
    kvw_peer_t *peer = kvw__peer_at(ctx, d->peer);
    const kvw_qchunk_t *q = &r->chunks[d->next_chunk];
    if (peer->dead || peer->mapped || peer->must_stage || peer->remote == NULL ||
        q->ready != NULL || q->c.chunk_end - q->c.chunk_begin > KVW_CTRL_SERVE_TOKENS ||
        d->prefix_len > q->c.num_tokens)
        return false;
    kvw_chunk_t c = q->c;
    c.prefix_len = d->prefix_len;
    kvw_plan_h plan;
    if (kvw__plan_create_nopages(ctx->rank, peer->remote, &c, &plan) != KVW_OK)
        return false;
    bool ok = plan->bytes <= KVW_CTRL_SERVE_BYTES &&
              !(plan->bytes > 0 && kvw_choose_staged(ctx, peer, plan));
    kvw_plan_destroy(plan);
    return ok;
}

/* Takes decode rank i of room r as a job (mu held): busy, in flight, timed, and the room
 * queued again when another decode rank is left for another thread. */
static void kvw_job_take(struct kvw_ctx *ctx, kvw_room_t *r, uint32_t i)
{
    KVW_ASSERT_HELD(&ctx->mu);
    r->dsts[i].busy = true;
    r->inflight++;
    kvw__room_hop(r, KVW_HOP_WORKER, true);
    if (!r->start_ns)
        r->start_ns = kvw__now_ns();
    if (kvw__room_next_dst(ctx, r) >= 0)
        kvw__queue_room(ctx, r);
}

void kvw__ctrl_serve(struct kvw_ctx *ctx)
{
    KVW_ASSERT_HELD(&ctx->mu);
    /* Host memory only (GPU memory goes through the staged or mapped paths), on a
     * transport whose writes wait on no thread of its own (ucx's may). */
    if (ctx->side != KVW_SIDE_PREFILL || ctx->num_workers == 0 || ctx->staged_dev ||
        ctx->mem_dev >= 0 || !(ctx->tl_ops->caps & KVW_TL_CAP_SYNC_PUT))
        return;
    for (uint32_t k = 0; k < KVW_CTRL_SERVE_ROOMS && !ctx->stopping; k++) {
        kvw_room_t *r = kvw__queue_head(ctx);
        int di = r ? kvw__room_next_dst(ctx, r) : -1;
        if (di < 0 || !kvw_ctrl_can_serve(ctx, r, (uint32_t)di))
            return;
        (void)kvw__dequeue_room(ctx); /* r: the head, under mu since it was looked at */
        /* As a worker takes a job (kvw__worker_main); the job drops mu around its put. */
        uint32_t i = (uint32_t)di;
        kvw_job_take(ctx, r, i);
        kvw_gpu_q_t g;
        kvw_gpu_step_t one;
        memset(&g, 0, sizeof(g));
        g.q = &one, g.cap = 1, g.depth = 1, g.batch = 1;
        kvw_worker_job(ctx, r, i, &g, true);
    }
}

void *kvw__worker_main(void *arg)
{
    struct kvw_ctx *ctx = arg;
    kvw__thread_name("kvw-worker");
    kvw_gpu_q_t g;
    kvw_gpu_step_t small[KVWC_EXEC_SLOTS];
    memset(&g, 0, sizeof(g));
    /* Kernels in flight per worker (default all slots); 1 waits for each kernel before
     * the next launch, as a step that synchronises would. Jobs per launch: KVW_GPU_BATCH
     * (with the ring it needs; one each when it cannot be had). */
    uint64_t depth = ctx->cfg.gpu_inflight, batch = ctx->cfg.gpu_batch; /* checked */
    g.depth = (uint32_t)(depth < 1 ? 1 : depth > KVWC_EXEC_SLOTS ? KVWC_EXEC_SLOTS : depth);
    g.batch = (uint32_t)(batch < 1 ? 1 : batch > KVW_GPU_BATCH_MAX ? KVW_GPU_BATCH_MAX : batch);
    g.q = ctx->mem->step_launch_n && g.batch > 1 ? calloc(KVW_GPU_Q, sizeof(*g.q)) : NULL;
    g.cap = KVW_GPU_Q;
    if (g.q == NULL)
        g.q = small, g.cap = KVWC_EXEC_SLOTS, g.batch = 1;
    /* GPU buffers: this thread's executor now, not on its first room (a failure here
     * comes back, with its message, on the first step that needs the executor). */
    if (ctx->cfg.gpu_warm && ctx->mem->warm && ctx->mem->warm(ctx->mem_dev) != KVW_OK)
        kvw__log(KVW_LOG_DEBUG, "worker: preparing the GPU executor: %s", kvw_last_error());
    pthread_mutex_lock(&ctx->mu);
    for (;;) {
        while (!ctx->stopping && kvw__queue_empty(ctx)) {
            if (g.n) {
                /* Nothing else to do: wait for this worker's oldest kernel. */
                pthread_mutex_unlock(&ctx->mu);
                kvw_gpu_reap(ctx, &g, true);
                pthread_mutex_lock(&ctx->mu);
                continue;
            }
            if (ctx->busy_poll_ns) {
                uint32_t seen = kvw__queue_gen(ctx);
                pthread_mutex_unlock(&ctx->mu);
                kvw__queue_spin(ctx, seen);
                pthread_mutex_lock(&ctx->mu);
                if (ctx->stopping || !kvw__queue_empty(ctx))
                    break;
            }
            kvw__queue_wait(ctx);
        }
        if (ctx->stopping) {
            while (g.n) {
                pthread_mutex_unlock(&ctx->mu);
                kvw_gpu_reap(ctx, &g, true);
                pthread_mutex_lock(&ctx->mu);
            }
            break;
        }
        if (g.n) {
            /* Send the DONEs of kernels that finished meanwhile. */
            pthread_mutex_unlock(&ctx->mu);
            kvw_gpu_reap(ctx, &g, false);
            pthread_mutex_lock(&ctx->mu);
            if (kvw__queue_empty(ctx))
                continue;
        }
        kvw_room_t *r = kvw__dequeue_room(ctx);
        if (r == NULL)
            continue;
        int di = kvw__room_next_dst(ctx, r);
        if (di < 0) {
            kvw__sender_update(ctx, r);
            continue;
        }
        uint32_t i = (uint32_t)di;
        kvw_job_take(ctx, r, i);
        uint64_t tokens;
        if (g.batch > 1 && kvw_batchable(ctx, r, i, &tokens))
            kvw_worker_batch(ctx, r, i, tokens, &g);
        else
            kvw_worker_job(ctx, r, i, &g, false);
    }
    pthread_mutex_unlock(&ctx->mu);
    if (g.q != small)
        free(g.q);
    return NULL;
}
