/* Registration: the HELLO/ACCEPT handshake of a decode rank with a prefill rank, with
 * the shared-secret authentication that binds its transcript and gives the session key;
 * the prefill side on short-lived threads (at most KVW_MAX_HANDSHAKES at once), the
 * decode side's connect (with retries while a restarted rank's old registration is
 * still alive). */
#include "core/rand.h"
#include "core/sha256.h"
#include "proto/proto.h"


#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* The remote rank's description with its buffers at the addresses this process maps
 * them to, or NULL when the transport maps none. */
static kvw_rank_h kvw_mapped_rank(struct kvw_ctx *ctx, kvw_rank_h remote, kvw_tl_rkey_h *rkeys)
{
    uint32_t nb = kvw_rank_num_buffers(remote);
    if (ctx->tl_ops->rkey_ptr == NULL || nb == 0)
        return NULL;
    kvw_buffer_desc_t *bufs = malloc(sizeof(*bufs) * nb);
    kvw_rank_h mapped = NULL;
    if (bufs == NULL)
        return NULL;
    for (uint32_t i = 0; i < nb; i++) {
        bufs[i] = *kvw_rank_buffer(remote, i);
        bufs[i].addr = ctx->tl_ops->rkey_ptr(rkeys[i]);
        if (bufs[i].addr == NULL)
            goto out;
    }
    kvw_rank_params_t rp = {.field_mask = KVW_RANK_FIELD_MODEL | KVW_RANK_FIELD_PARALLEL |
                                          KVW_RANK_FIELD_BUFFERS,
                            .model = kvw_rank_model(remote), .parallel = *kvw_rank_parallel(remote),
                            .buffers = bufs, .num_buffers = nb};
    if (kvw__rank_create_mapped(&rp, &mapped) != KVW_OK)
        mapped = NULL;
out:
    free(bufs);
    return mapped;
}

/* Whether src and dst exchange any bytes (the topology alone decides). */
static bool kvw_pair_needed(kvw_rank_h src, kvw_rank_h dst)
{
    kvw_chunk_t c = {.num_tokens = 1, .chunk_begin = 0, .chunk_end = 1, .last_chunk = 1};
    kvw_plan_h plan;
    if (kvw__plan_create_nopages(src, dst, &c, &plan) != KVW_OK)
        return false;
    bool needed = plan->num_segs > 0;
    kvw_plan_destroy(plan);
    return needed;
}

/*
 * Shared secret: the prefill rank opens every registration with a random challenge;
 * the decode rank answers with HMAC-SHA-256(secret, "kvwire-hello" | challenge) and a
 * challenge of its own, which the prefill rank answers in ACCEPT with
 * HMAC(secret, "kvwire-accept" | that challenge). The secret never crosses the wire.
 */
#define KVW_NONCE 32

/*
 * With a secret, the MACs bind the whole handshake transcript, not only the challenges:
 *   HELLO  mac   = HMAC(secret, "kvwire-hello-3"  | nonce | dnonce | hello body | entry)
 *   ACCEPT proof = HMAC(secret, "kvwire-accept-3" | nonce | dnonce | SHA256(hello body)
 *                                                  | accept body)
 *   session key  = HMAC(secret, "kvwire-session-3" | nonce | dnonce | hello mac)
 * The hello body holds the decode rank's identity, instance, buffer descriptions, keys
 * and data address; the accept body the prefill rank's description. `entry` is
 * kvw__entry_bind of the bootstrap entry the decode connected through (its nonce and
 * address); the prefill rank puts in the entry it holds itself, so an entry that is not
 * its own (stale, or pointing at a relay) fails the handshake. A relay can neither
 * change them (the MAC fails) nor add, drop, reorder or alter a control frame later:
 * every frame after the handshake carries a tag under the session key, with a sequence
 * number per direction (kvw__peer_send, kvw_peer_read).
 *
 * The data plane is part of the session: the prefill rank's data connection opens with
 *   BIND = peer id | HMAC(session key, "kvwire-bind-3" | peer id | dnonce)
 * (without a secret: peer id | dnonce), and only one connection per peer may prove it;
 * every DONE ends in a tag under the session key (kvw__done_encode). A third party that
 * read the decode's data address and nonce in the clear can open a connection but can
 * neither bind it nor complete a room; what it writes into a room's pages makes more
 * bytes land than the plans imply, which fails the room (land.c), never Success.
 */
static void kvw_auth_mac(const struct kvw_ctx *ctx, const char *label, const uint8_t *nonce,
                         const uint8_t *dnonce, const void *a, size_t an, const void *b,
                         size_t bn, uint8_t out[32])
{
    kvw_hmac_t h;
    kvw__hmac_init(&h, ctx->secret, strlen(ctx->secret));
    kvw__hmac_update(&h, label, strlen(label));
    kvw__hmac_update(&h, nonce, KVW_NONCE);
    kvw__hmac_update(&h, dnonce, KVW_NONCE);
    if (an)
        kvw__hmac_update(&h, a, an);
    if (bn)
        kvw__hmac_update(&h, b, bn);
    kvw__hmac_final(&h, out);
}

void kvw__bind_proof(const uint8_t skey[32], uint32_t peer_id, const uint8_t dnonce[32],
                     uint8_t out[32])
{
    uint8_t id[4] = {(uint8_t)peer_id, (uint8_t)(peer_id >> 8), (uint8_t)(peer_id >> 16),
                     (uint8_t)(peer_id >> 24)};
    kvw_hmac_t h;
    kvw__hmac_init(&h, skey, 32);
    kvw__hmac_update(&h, "kvwire-bind-3", strlen("kvwire-bind-3"));
    kvw__hmac_update(&h, id, sizeof(id));
    kvw__hmac_update(&h, dnonce, 32);
    kvw__hmac_final(&h, out);
}

static void kvw_sha256(const void *p, size_t n, uint8_t out[32])
{
    kvw_sha256_t c;
    kvw__sha256_init(&c);
    kvw__sha256_update(&c, p, n);
    kvw__sha256_final(&c, out);
}

static void kvw_wb_raw(kvw_wbuf_t *w, const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        kvw__wb_u8(w, p[i]);
}

static void kvw_rb_raw(kvw_rbuf_t *r, uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = kvw__rb_u8(r);
}

static void kvw_put_hello(struct kvw_ctx *ctx, kvw_wbuf_t *w, uint32_t peer_id,
                          const uint8_t *rkeys, const size_t *rkey_lens, const void *addr,
                          size_t addr_len)
{
    /* rkeys holds num_buffers keys, then the staging area's key (index num_buffers). */
    kvw__wb_u32(w, peer_id);
    kvw__wb_u64(w, ctx->instance_id);
    kvw__wb_str(w, ctx->tl_ops->name);
    kvw__wb_bytes(w, addr, addr_len);
    kvw__wire_put_rank(w, ctx->rank);
    uint32_t nb = kvw_rank_num_buffers(ctx->rank);
    for (uint32_t i = 0; i < nb; i++)
        kvw__wb_bytes(w, rkeys + (size_t)i * KVW_TL_MAX_RKEY, rkey_lens[i]);
    kvw__wb_u64(w, ctx->hello_staging_len);
    if (ctx->hello_staging_len)
        kvw__wb_bytes(w, rkeys + (size_t)nb * KVW_TL_MAX_RKEY, rkey_lens[nb]);
}

/* The prefill side of one registration, as it goes: what the HELLO said and what was
 * set up for it. `reason` is what a refusal tells the decode rank. */
typedef struct kvw_hs {
    uint8_t *p; /* the HELLO frame's payload */
    uint32_t len;
    kvw_rbuf_t r; /* reading it */
    uint64_t deadline;
    uint8_t nonce[KVW_NONCE]; /* our challenge */
    uint8_t has_mac;
    uint8_t mac[32], dnonce[KVW_NONCE];
    uint32_t id_at_remote;
    uint64_t instance;
    uint64_t admitted; /* its order among admitted registrations (ctx->hs.admitted) */
    char tl_name[32];
    const void *addr;
    size_t addr_len;
    uint8_t hello_hash[32];
    uint8_t skey[32]; /* with a secret: the session key */
    kvw_rank_h remote, mapped;
    kvw_tl_ep_h ep;
    kvw_tl_rkey_h *rkeys;
    uint32_t nb;
    bool gpu_tl, must_stage;
    uint64_t staging_len;
    kvw_tl_rkey_h staging_rkey;
    char reason[400];
} kvw_hs_t;

/* Sends the challenge and reads the registration frame (HELLO). */
static kvw_status_t kvw_hs_challenge(struct kvw_ctx *ctx, int fd, kvw_hs_t *h)
{
    uint8_t type;
    kvw_wbuf_t cw;
    if (kvw__random_bytes(h->nonce, sizeof(h->nonce)) != 0)
        return kvw__error(KVW_ERR_IO, "no random bytes for the handshake challenge");
    kvw__wb_init(&cw, KVW_MSG_CHALLENGE);
    kvw_wb_raw(&cw, h->nonce, KVW_NONCE);
    kvw_status_t st = kvw__wb_finish(&cw);
    if (st == KVW_OK)
        st = kvw__sock_send_all(fd, cw.p, cw.len, h->deadline);
    kvw__wb_free(&cw);
    if (st != KVW_OK)
        return st;
    /* Before it is authenticated a registration is bounded (KVW_MAX_HELLO_KB): a
     * larger one is refused unread, before its payload is allocated. */
    st = kvw__sock_recv_frame_max(fd, h->deadline, (uint32_t)ctx->cfg.max_hello, &type, &h->p,
                                  &h->len);
    if (st == KVW_ERR_OUT_OF_RANGE)
        snprintf(h->reason, sizeof(h->reason), "registration refused: %s (KVW_MAX_HELLO_KB=%llu)",
                 kvw_last_error(), (unsigned long long)(ctx->cfg.max_hello >> 10));
    if (st != KVW_OK)
        return st;
    kvw__handshake_heard(ctx, fd);
    if (type != KVW_MSG_HELLO) {
        free(h->p);
        h->p = NULL;
        return kvw__error(KVW_ERR_MALFORMED, "expected a registration, got frame type %u", type);
    }
    return KVW_OK;
}

/* The HELLO's head: the decode's MAC and challenge, its id for us, its instance, its
 * transport and data address. */
static kvw_status_t kvw_hs_read_hello(kvw_hs_t *h)
{
    kvw__rb_init(&h->r, h->p, h->len);
    h->has_mac = kvw__rb_u8(&h->r);
    kvw_rb_raw(&h->r, h->mac, sizeof(h->mac));
    kvw_rb_raw(&h->r, h->dnonce, sizeof(h->dnonce));
    h->id_at_remote = kvw__rb_u32(&h->r);
    h->instance = kvw__rb_u64(&h->r);
    kvw__rb_str(&h->r, h->tl_name, sizeof(h->tl_name));
    h->addr = kvw__rb_bytes(&h->r, KVW_TL_MAX_ADDR, &h->addr_len);
    if (h->r.bad) {
        /* Answer with the reason: a peer speaking another version learns why. */
        snprintf(h->reason, sizeof(h->reason), "the registration frame is truncated (a "
                 "different kvwire version?)");
        return KVW_ERR_MALFORMED;
    }
    return KVW_OK;
}

/* With a shared secret, the HELLO must carry the MAC over our challenge and its body. */
static kvw_status_t kvw_hs_verify_mac(struct kvw_ctx *ctx, kvw_hs_t *h)
{
    /* The body the MAC covers: everything after has_mac, mac and dnonce. */
    const uint8_t *hello_body = h->p + 1 + 32 + KVW_NONCE;
    size_t hello_body_len = h->len - (1 + 32 + KVW_NONCE);
    kvw_sha256(hello_body, hello_body_len, h->hello_hash);
    if (ctx->secret[0]) {
        uint8_t want[32], eb[32];
        /* A decode can reach us between the endpoint's answer to our registration and
         * the moment we stored what it bound: wait for it (until the deadline), woken
         * when it is stored (ctx->cv). */
        pthread_mutex_lock(&ctx->mu);
        for (uint64_t now; !ctx->bs_bound && !ctx->stopping &&
                           (now = kvw__now_ns()) < h->deadline;) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            uint64_t wait = KVW_MIN(h->deadline - now, 50000000ull);
            ts.tv_nsec += (long)(wait % 1000000000ull);
            ts.tv_sec += (time_t)(wait / 1000000000ull) + ts.tv_nsec / 1000000000L;
            ts.tv_nsec %= 1000000000L;
            pthread_cond_timedwait(&ctx->cv, &ctx->mu, &ts);
        }
        memcpy(eb, ctx->bs_bind, sizeof(eb));
        pthread_mutex_unlock(&ctx->mu);
        kvw_auth_mac(ctx, "kvwire-hello-3", h->nonce, h->dnonce, hello_body, hello_body_len, eb,
                     sizeof(eb), want);
        if (!h->has_mac || !kvw__ct_equal(h->mac, want, 32)) {
            snprintf(h->reason, sizeof(h->reason), h->has_mac ? "authentication failed: the "
                     "shared secret does not match, or the decode rank came through a "
                     "bootstrap entry that is not this rank's own (stale or redirected)" :
                     "authentication failed: this prefill rank requires a shared secret and "
                     "the decode rank proved none");
            return KVW_ERR_AUTH;
        }
        kvw_auth_mac(ctx, "kvwire-session-3", h->nonce, h->dnonce, h->mac, sizeof(h->mac), NULL,
                     0, h->skey);
    }
    return KVW_OK;
}

/* Memory kinds: cuda_ipc moves GPU memory to GPU memory. The other transports read and
 * write host memory; GPU memory on either side goes through the decode's host staging
 * area (gathered and scattered on the GPUs), checked once the registration says whether
 * there is one. Anything else is refused here, not at the first request. */
static kvw_status_t kvw_hs_mem_kinds(struct kvw_ctx *ctx, kvw_hs_t *h)
{
    h->gpu_tl = (ctx->tl_ops->caps & KVW_TL_CAP_DEVICE_MEM) != 0;
    bool remote_gpu = false;
    for (uint32_t i = 0; i < h->nb; i++) {
        bool dev = kvw__memops(kvw_rank_buffer(h->remote, i)->mem_kind)->is_device;
        remote_gpu |= dev;
        if (h->gpu_tl && !dev) {
            snprintf(h->reason, sizeof(h->reason), "decode buffer %u is host memory, which "
                     "transport '%s' cannot write (%s needs GPU buffers on both sides)", i,
                     ctx->tl_ops->name, ctx->tl_ops->name);
            return KVW_ERR_UNSUPPORTED;
        }
    }
    for (uint32_t i = 0; h->gpu_tl && i < kvw_rank_num_buffers(ctx->rank); i++) {
        if (!kvw__memops(kvw_rank_buffer(ctx->rank, i)->mem_kind)->is_device) {
            snprintf(h->reason, sizeof(h->reason), "prefill buffer %u is host memory, which "
                     "transport '%s' cannot read (%s needs GPU buffers on both sides)", i,
                     ctx->tl_ops->name, ctx->tl_ops->name);
            return KVW_ERR_UNSUPPORTED;
        }
    }
    h->must_stage = !h->gpu_tl && (ctx->staged_dev || remote_gpu);
    return KVW_OK;
}

/* Whether this prefill rank takes the registration: the decode rank's description, the
 * transport, compatibility, memory kinds and identity. */
static kvw_status_t kvw_hs_admit(struct kvw_ctx *ctx, kvw_hs_t *h)
{
    kvw_status_t st = kvw__wire_get_rank(&h->r, &h->remote);
    if (st != KVW_OK) {
        snprintf(h->reason, sizeof(h->reason), "bad registration: %s", kvw_last_error());
        return st;
    }
    h->nb = kvw_rank_num_buffers(h->remote);
    h->rkeys = calloc(h->nb ? h->nb : 1, sizeof(*h->rkeys));
    if (strcmp(h->tl_name, ctx->tl_ops->name) != 0) {
        snprintf(h->reason, sizeof(h->reason), "transport mismatch: decode uses '%s', this "
                 "prefill rank uses '%s'", h->tl_name, ctx->tl_ops->name);
        return KVW_ERR_INCOMPATIBLE;
    }
    if ((st = kvw_rank_check_compatible(ctx->rank, h->remote)) != KVW_OK) {
        snprintf(h->reason, sizeof(h->reason), "%s", kvw_last_error());
        return st;
    }
    if ((st = kvw_hs_mem_kinds(ctx, h)) != KVW_OK)
        return st;
    /* A registration may not take over an identity (instance and rank) whose peer is
     * still alive: that cut the live one off. A restarted rank whose old connection has
     * not been noticed dead yet retries until it is (BUSY). */
    const kvw_parallel_t *ip = kvw_rank_parallel(h->remote);
    pthread_mutex_lock(&ctx->mu);
    uint32_t live = 0;
    for (uint32_t i = 0; i < kvw__peer_count(ctx); i++)
        live += !kvw__peer_at(ctx, i)->dead;
    /* Registrations admitted and not yet added (their ACCEPT may be out already) count
     * as live: otherwise one arriving meanwhile got past the bound. */
    live += ctx->hs.pending;
    if (live >= ctx->cfg.max_peers) {
        st = KVW_ERR_BUSY;
        snprintf(h->reason, sizeof(h->reason), "this prefill rank already has %u live peers "
                 "(KVW_MAX_PEERS=%llu)", live, (unsigned long long)ctx->cfg.max_peers);
    }
    for (uint32_t i = 0; i < kvw__peer_count(ctx) && st == KVW_OK; i++) {
        const kvw_peer_t *o = kvw__peer_at(ctx, i);
        if (!o->dead && o->instance == h->instance && o->dp == ip->dp_rank &&
            o->tp == ip->tp_rank && o->pp == ip->pp_rank) {
            st = KVW_ERR_BUSY;
            snprintf(h->reason, sizeof(h->reason), "%.200s is already registered here and "
                     "alive (two decode instances need distinct instance ids)", o->desc);
        }
    }
    if (st == KVW_OK) {
        h->admitted = ++ctx->hs.admitted;
        ctx->hs.pending++;
    }
    pthread_mutex_unlock(&ctx->mu);
    return st;
}

/* The data path to the decode rank: its endpoint, bound to this session (BIND), the
 * keys of its buffers and of its staging area, and (cuda_ipc) its buffers mapped here. */
static kvw_status_t kvw_hs_connect_data(struct kvw_ctx *ctx, kvw_hs_t *h)
{
    kvw_status_t st;
    /* GPU handles open in the current device's context: the one holding our buffers. */
    if ((st = ctx->mem->select(ctx->mem_dev)) != KVW_OK) {
        snprintf(h->reason, sizeof(h->reason), "cannot select %s %d: %s", ctx->mem->name,
                 ctx->mem_dev, kvw_last_error());
        return st;
    }
    if ((st = ctx->tl_ops->connect(ctx->tl, h->addr, h->addr_len, &h->ep)) != KVW_OK) {
        snprintf(h->reason, sizeof(h->reason), "cannot open the data path: %s",
                 kvw_last_error());
        return st;
    }
    /* Bind the data connection to this session first: completions that arrive on a
     * connection that never proved it read this registration's challenge are refused. */
    kvw_wbuf_t bw;
    kvw__wb_init(&bw, KVW_MSG_BIND);
    kvw__wb_u32(&bw, h->id_at_remote);
    if (ctx->secret[0]) {
        uint8_t proof[32];
        kvw__bind_proof(h->skey, h->id_at_remote, h->dnonce, proof);
        kvw_wb_raw(&bw, proof, sizeof(proof));
    } else {
        kvw_wb_raw(&bw, h->dnonce, sizeof(h->dnonce));
    }
    if ((st = kvw__wb_finish(&bw)) == KVW_OK)
        st = ctx->tl_ops->notify(h->ep, bw.p, bw.len);
    kvw__wb_free(&bw);
    if (st != KVW_OK) {
        snprintf(h->reason, sizeof(h->reason), "cannot open the data path: %s",
                 kvw_last_error());
        return st;
    }
    for (uint32_t i = 0; i < h->nb; i++) {
        size_t kl = 0;
        const void *k = kvw__rb_bytes(&h->r, KVW_TL_MAX_RKEY, &kl);
        if (k == NULL) {
            snprintf(h->reason, sizeof(h->reason), "registration lacks the key of buffer %u", i);
            return KVW_ERR_MALFORMED;
        }
        /* GPU buffers behind a host transport are written only through staging: they
         * come without a key, and no direct write can name them. */
        if (kl == 0 && !h->gpu_tl &&
            kvw__memops(kvw_rank_buffer(h->remote, i)->mem_kind)->is_device)
            continue;
        if ((st = ctx->tl_ops->rkey_unpack(h->ep, k, kl, &h->rkeys[i])) != KVW_OK) {
            snprintf(h->reason, sizeof(h->reason), "bad remote key for buffer %u: %s", i,
                     kvw_last_error());
            return st;
        }
    }
    h->staging_len = kvw__rb_u64(&h->r);
    if (h->staging_len) {
        size_t kl = 0;
        const void *k = kvw__rb_bytes(&h->r, KVW_TL_MAX_RKEY, &kl);
        if (k == NULL) {
            snprintf(h->reason, sizeof(h->reason), "bad staging key in the registration");
            return KVW_ERR_MALFORMED;
        }
        if ((st = ctx->tl_ops->rkey_unpack(h->ep, k, kl, &h->staging_rkey)) != KVW_OK) {
            snprintf(h->reason, sizeof(h->reason), "bad staging key in the registration: %s",
                     kvw_last_error());
            return st;
        }
    }
    /* A decode's staging area is KVW_STAGING_MB whole MiB: a smaller or larger one
     * declared here could only stall or overrun this rank's windows over it. */
    if (h->staging_len && (h->staging_len < KVW_STAGING_MIN ||
                           h->staging_len > KVW_STAGING_MAX)) {
        snprintf(h->reason, sizeof(h->reason), "the decode rank declares a staging area of "
                 "%llu bytes (accepted: 0, or %u MiB to %llu MiB)",
                 (unsigned long long)h->staging_len, (unsigned)(KVW_STAGING_MIN >> 20),
                 (unsigned long long)(KVW_STAGING_MAX >> 20));
        return KVW_ERR_OUT_OF_RANGE;
    }
    if (h->must_stage && h->staging_len == 0) {
        snprintf(h->reason, sizeof(h->reason), "GPU memory on %s goes through the decode "
                 "rank's staging area over '%s', and the decode rank has none "
                 "(KVW_STAGING_MB=0)", ctx->staged_dev ? "this prefill rank" : "the decode rank",
                 ctx->tl_ops->name);
        return KVW_ERR_UNSUPPORTED;
    }
    if (h->gpu_tl && (h->mapped = kvw_mapped_rank(ctx, h->remote, h->rkeys)) == NULL) {
        snprintf(h->reason, sizeof(h->reason), "cannot map the decode rank's GPU buffers here");
        return KVW_ERR_UNSUPPORTED;
    }
    if (kvw__rb_done(&h->r, "registration") != KVW_OK) {
        snprintf(h->reason, sizeof(h->reason), "%s", kvw_last_error());
        return KVW_ERR_MALFORMED;
    }
    return KVW_OK;
}

/* Answers the registration: ACCEPT (with its proof under the shared secret) or REJECT
 * with the reason, counted as a refusal first. Returns st, or why the answer could not
 * be sent. */
static kvw_status_t kvw_hs_reply(struct kvw_ctx *ctx, int fd, kvw_hs_t *h, kvw_status_t st)
{
    free(h->p);
    h->p = NULL;
    kvw_wbuf_t w;
    kvw__wb_init(&w, st == KVW_OK ? KVW_MSG_ACCEPT : KVW_MSG_REJECT);
    if (st == KVW_OK) {
        uint8_t proof[32] = {0};
        kvw__wb_u8(&w, ctx->secret[0] != 0);
        kvw_wb_raw(&w, proof, sizeof(proof));
        size_t body_at = w.len;
        kvw__wire_put_rank(&w, ctx->rank);
        if (ctx->secret[0] && !w.oom) {
            kvw_auth_mac(ctx, "kvwire-accept-3", h->nonce, h->dnonce, h->hello_hash, 32,
                         w.p + body_at, w.len - body_at, proof);
            memcpy(w.p + body_at - sizeof(proof), proof, sizeof(proof));
        }
    } else {
        kvw__wb_u32(&w, (uint32_t)(int32_t)st);
        kvw__wb_str(&w, h->reason);
    }
    if (st != KVW_OK && h->reason[0]) {
        /* The engine on this side can ask why a decode rank could not register (counted
         * before the refusal goes out, so the refused side never sees it first). */
        pthread_mutex_lock(&ctx->mu);
        ctx->hs.refusals++;
        snprintf(ctx->hs.last_refusal, sizeof(ctx->hs.last_refusal), "decode instance %llu: %s",
                 (unsigned long long)h->instance, h->reason);
        kvw__log(KVW_LOG_WARN, "refused a registration of decode instance %llu: %s",
                 (unsigned long long)h->instance, h->reason);
        pthread_mutex_unlock(&ctx->mu);
    }
    kvw_status_t sst = kvw__wb_finish(&w);
    if (sst == KVW_OK)
        sst = kvw__sock_send_all(fd, w.p, w.len, h->deadline);
    kvw__wb_free(&w);
    if (st == KVW_OK && sst != KVW_OK)
        st = sst;
    return st;
}

/* Gives back what a refused (or unanswered) registration had set up. */
static void kvw_hs_release(struct kvw_ctx *ctx, kvw_hs_t *h)
{
    for (uint32_t i = 0; h->rkeys && i < h->nb; i++)
        if (h->rkeys[i])
            ctx->tl_ops->rkey_release(h->rkeys[i]);
    free(h->rkeys);
    if (h->staging_rkey)
        ctx->tl_ops->rkey_release(h->staging_rkey);
    h->staging_rkey = NULL;
    if (h->ep)
        ctx->tl_ops->ep_close(h->ep);
    kvw_rank_destroy(h->mapped);
    kvw_rank_destroy(h->remote);
}

/* The accepted registration becomes a peer (replacing a registration of the same rank
 * of the same decode instance), which takes over the data path. */
static kvw_status_t kvw_hs_add_peer(struct kvw_ctx *ctx, int fd, kvw_hs_t *h,
                                    kvw_peer_t **peer_p)
{
    pthread_mutex_lock(&ctx->mu);
    ctx->hs.pending--; /* a peer now, or released below */
    const kvw_parallel_t *rpar = kvw_rank_parallel(h->remote);
    /* The same rank of the same decode instance registering again replaces the old
     * registration (a restarted process whose death was not noticed yet). No such peer
     * was alive when this one was admitted, so one alive now registered meanwhile: the
     * one admitted later is the newer. ACCEPT goes out before the peer is added here, so
     * a decode rank can take it, leave and register again while this thread is still on
     * its way: this registration, admitted first, must not replace the newer one. */
    bool stale = false;
    for (uint32_t i = 0; i < kvw__peer_count(ctx); i++) {
        kvw_peer_t *o = kvw__peer_at(ctx, i);
        if (!o->dead && o->instance == h->instance && o->dp == rpar->dp_rank &&
            o->tp == rpar->tp_rank && o->pp == rpar->pp_rank) {
            if (o->admitted > h->admitted)
                stale = true;
            else
                kvw__peer_doom(ctx, o, KVW_ERR_PEER_DEAD,
                               "replaced by a new registration of the same rank (two decode "
                               "instances need distinct instance ids)");
        }
    }
    kvw_peer_t *peer = stale ? NULL : kvw__peer_add(ctx, fd);
    if (peer == NULL) {
        pthread_mutex_unlock(&ctx->mu);
        kvw_hs_release(ctx, h);
        if (stale)
            return kvw__error(KVW_ERR_PEER_DEAD, "a newer registration of the same decode "
                              "rank was accepted meanwhile");
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory adding a peer");
    }
    const kvw_parallel_t *rp = kvw_rank_parallel(h->remote);
    peer->remote = h->remote;
    peer->ep = h->ep;
    peer->rkeys = h->rkeys;
    peer->num_rkeys = h->nb;
    peer->id_at_remote = h->id_at_remote;
    peer->mapped = h->mapped;
    peer->instance = h->instance;
    peer->admitted = h->admitted;
    peer->staging_rkey = h->staging_rkey;
    peer->staging_len = h->staging_len;
    peer->must_stage = h->must_stage;
    if (ctx->secret[0]) {
        peer->authed = true;
        peer->tx_dir = 1; /* prefill -> decode */
        memcpy(peer->skey, h->skey, sizeof(peer->skey));
    }
    peer->dp = rp->dp_rank, peer->tp = rp->tp_rank, peer->pp = rp->pp_rank;
    peer->remote_group_size = rp->tp_size * KVW_MAX(rp->pp_size, 1);
    peer->remote_pp_size = KVW_MAX(rp->pp_size, 1);
    peer->needed = kvw_pair_needed(ctx->rank, h->remote);
    if (h->instance)
        snprintf(peer->desc, sizeof(peer->desc), "decode instance %llu rank dp%u/tp%u/pp%u",
                 (unsigned long long)h->instance, peer->dp, peer->tp, peer->pp);
    else
        snprintf(peer->desc, sizeof(peer->desc), "decode rank dp%u/tp%u/pp%u", peer->dp, peer->tp,
                 peer->pp);
    kvw__metrics_peer_up(ctx);
    pthread_mutex_unlock(&ctx->mu);
    *peer_p = peer;
    return KVW_OK;
}

/* Prefill side of the registration, on a fresh connection (control thread): challenge,
 * HELLO, MAC, admission, data path, answer, peer. */
kvw_status_t kvw__prefill_handshake(struct kvw_ctx *ctx, int fd, kvw_peer_t **peer_p)
{
    kvw_hs_t h;
    memset(&h, 0, sizeof(h));
    h.deadline = kvw__now_ns() + (uint64_t)ctx->peer_timeout_ms * 1000000ull;
    kvw_status_t st = kvw_hs_challenge(ctx, fd, &h);
    if (st != KVW_OK && h.reason[0]) /* refused unread: the decode rank learns why */
        return kvw__error(kvw_hs_reply(ctx, fd, &h, st), "%s", h.reason);
    if (st != KVW_OK)
        return st;
    bool admitted = false;
    if ((st = kvw_hs_read_hello(&h)) == KVW_OK && (st = kvw_hs_verify_mac(ctx, &h)) == KVW_OK &&
        (st = kvw_hs_admit(ctx, &h)) == KVW_OK) {
        admitted = true;
        st = kvw_hs_connect_data(ctx, &h);
    }
    st = kvw_hs_reply(ctx, fd, &h, st);
    if (st != KVW_OK) {
        if (admitted) {
            pthread_mutex_lock(&ctx->mu);
            ctx->hs.pending--;
            pthread_mutex_unlock(&ctx->mu);
        }
        kvw_hs_release(ctx, &h);
        return h.reason[0] ? kvw__error(st, "%s", h.reason) : st;
    }
    return kvw_hs_add_peer(ctx, fd, &h, peer_p);
}

/* A registration that failed: its reserved peer slot becomes a dead peer (no room
 * refers to it) and its socket is closed now. */
static void kvw_decode_unreserve(struct kvw_ctx *ctx, kvw_peer_t *peer)
{
    pthread_mutex_lock(&ctx->mu);
    peer->registering = false;
    peer->dead = true;
    if (peer->fd >= 0)
        close(peer->fd);
    peer->fd = -1;
    pthread_mutex_unlock(&ctx->mu);
}

/* Decode side: connect to one prefill rank of instance `inst` (generation `gen`) and
 * register. The peer slot is reserved before the registration, whose frame carries its
 * id: several instances may be connected at once. */
static kvw_status_t kvw_decode_connect(struct kvw_ctx *ctx, const kvw_bs_entry_t *e,
                                       uint32_t inst, uint32_t gen, uint64_t deadline)
{
    const uint8_t *rkeys = ctx->hello_rkeys;
    const size_t *rkey_lens = ctx->hello_rkey_lens;
    const void *addr = ctx->hello_addr;
    size_t addr_len = ctx->hello_addr_len;
    char host[128];
    uint16_t port;
    int fd = -1;
    uint8_t type, *p = NULL;
    uint32_t len = 0;
    kvw_status_t st = kvw__parse_hostport(e->addr, host, sizeof(host), &port);
    if (st != KVW_OK)
        return st;
    if ((st = kvw__tcp_connect(host, port, deadline, &fd)) != KVW_OK)
        return st;
    uint8_t nonce[KVW_NONCE], dnonce[KVW_NONCE], mac[32] = {0};
    if ((st = kvw__sock_recv_frame_max(fd, deadline, KVW_NONCE, &type, &p, &len)) != KVW_OK ||
        type != KVW_MSG_CHALLENGE || len != KVW_NONCE) {
        free(p);
        close(fd);
        return kvw__error(st ? st : KVW_ERR_MALFORMED, "prefill rank at %s did not open the "
                          "handshake with a challenge", e->addr);
    }
    memcpy(nonce, p, KVW_NONCE);
    free(p);
    p = NULL;
    if (kvw__random_bytes(dnonce, sizeof(dnonce)) != 0) {
        close(fd);
        return kvw__error(KVW_ERR_IO, "no random bytes for the handshake challenge");
    }
    pthread_mutex_lock(&ctx->mu);
    kvw_peer_t *peer = kvw__peer_add(ctx, fd);
    if (peer)
        peer->registering = true, peer->inst = inst, peer->inst_gen = gen;
    pthread_mutex_unlock(&ctx->mu);
    if (peer == NULL) {
        close(fd);
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory adding a peer");
    }
    kvw_wbuf_t w;
    kvw__wb_init(&w, KVW_MSG_HELLO);
    kvw__wb_u8(&w, ctx->secret[0] != 0);
    kvw_wb_raw(&w, mac, sizeof(mac));
    kvw_wb_raw(&w, dnonce, sizeof(dnonce));
    size_t body_at = w.len;
    kvw_put_hello(ctx, &w, peer->id, rkeys, rkey_lens, addr, addr_len);
    uint8_t hello_hash[32];
    if (!w.oom) {
        kvw_sha256(w.p + body_at, w.len - body_at, hello_hash);
        if (ctx->secret[0]) {
            /* The entry this connection came through (a lookup with the secret checked
             * its MAC, so it has a nonce); the prefill rank binds its own. */
            uint8_t eb[32];
            kvw__entry_bind(e->nonce, e->addr, eb);
            kvw_auth_mac(ctx, "kvwire-hello-3", nonce, dnonce, w.p + body_at, w.len - body_at,
                         eb, sizeof(eb), mac);
            memcpy(w.p + KVW_WIRE_HDR + 1, mac, sizeof(mac));
        }
    }
    if ((st = kvw__wb_finish(&w)) == KVW_OK)
        st = kvw__sock_send_all(fd, w.p, w.len, deadline);
    kvw__wb_free(&w);
    if (st == KVW_OK) /* the answer is not authenticated yet either: bounded likewise */
        st = kvw__sock_recv_frame_max(fd, deadline, (uint32_t)ctx->cfg.max_hello, &type, &p,
                                      &len);
    if (st != KVW_OK) {
        kvw_decode_unreserve(ctx, peer);
        return kvw__error(st, "registration with prefill rank dp%u/tp%u/pp%u at %s failed: %s",
                          e->dp, e->tp, e->pp, e->addr, kvw_last_error());
    }
    kvw_rbuf_t r;
    kvw__rb_init(&r, p, len);
    if (type == KVW_MSG_REJECT) {
        kvw_status_t why = (kvw_status_t)(int32_t)kvw__rb_u32(&r);
        char reason[400];
        kvw__rb_str(&r, reason, sizeof(reason));
        free(p);
        kvw_decode_unreserve(ctx, peer);
        return kvw__error(why == KVW_ERR_AUTH || why == KVW_ERR_BUSY ? why : KVW_ERR_REJECTED,
                          "prefill rank dp%u/tp%u/pp%u rejected this decode rank: %s", e->dp,
                          e->tp, e->pp, reason);
    }
    kvw_rank_h remote = NULL;
    uint8_t has_proof = kvw__rb_u8(&r), proof[32];
    kvw_rb_raw(&r, proof, sizeof(proof));
    if (type == KVW_MSG_ACCEPT && !r.bad && ctx->secret[0]) {
        uint8_t want[32];
        kvw_auth_mac(ctx, "kvwire-accept-3", nonce, dnonce, hello_hash, 32, p + 1 + 32,
                     len - (1 + 32), want);
        if (!has_proof || !kvw__ct_equal(proof, want, 32)) {
            free(p);
            kvw_decode_unreserve(ctx, peer);
            return kvw__error(KVW_ERR_AUTH, "prefill rank dp%u/tp%u/pp%u at %s did not prove the "
                              "shared secret", e->dp, e->tp, e->pp, e->addr);
        }
    }
    if (type != KVW_MSG_ACCEPT || (st = kvw__wire_get_rank(&r, &remote)) != KVW_OK ||
        (st = kvw__rb_done(&r, "accept")) != KVW_OK) {
        free(p);
        kvw_decode_unreserve(ctx, peer);
        kvw_rank_destroy(remote);
        return kvw__error(KVW_ERR_MALFORMED, "prefill rank at %s answered the registration with "
                          "a malformed frame (type %u)", e->addr, type);
    }
    free(p);
    /* The rank that answered must be the one the bootstrap table named, with the same
     * instance geometry: a mismatch would route heads to the wrong place. */
    const kvw_parallel_t *rpar = kvw_rank_parallel(remote);
    if (rpar->tp_rank != e->tp || rpar->pp_rank != e->pp || rpar->dp_rank != e->dp ||
        rpar->tp_size != e->tp_size || KVW_MAX(rpar->pp_size, 1) != KVW_MAX(e->pp_size, 1) ||
        KVW_MAX(rpar->dp_size, 1) != KVW_MAX(e->dp_size, 1)) {
        st = kvw__error(KVW_ERR_INCOMPATIBLE,
                        "prefill rank at %s describes itself as dp%u/tp%u/pp%u of TP %u PP %u "
                        "DP %u, but the bootstrap table names it dp%u/tp%u/pp%u of TP %u PP %u "
                        "DP %u", e->addr, rpar->dp_rank, rpar->tp_rank, rpar->pp_rank,
                        rpar->tp_size, KVW_MAX(rpar->pp_size, 1), KVW_MAX(rpar->dp_size, 1),
                        e->dp, e->tp, e->pp, e->tp_size, KVW_MAX(e->pp_size, 1),
                        KVW_MAX(e->dp_size, 1));
        kvw_decode_unreserve(ctx, peer);
        kvw_rank_destroy(remote);
        return st;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    pthread_mutex_lock(&ctx->mu);
    if (ctx->secret[0]) {
        peer->authed = true;
        peer->tx_dir = 2; /* decode -> prefill */
        kvw_auth_mac(ctx, "kvwire-session-3", nonce, dnonce, mac, sizeof(mac), NULL, 0,
                     peer->skey);
    }
    if (!peer->dead)
        kvw__metrics_peer_up(ctx);
    peer->registering = false;
    peer->last_rx_ns = peer->last_tx_ns = kvw__now_ns();
    peer->remote = remote;
    memcpy(peer->bind_nonce, dnonce, sizeof(peer->bind_nonce));
    peer->dp = e->dp, peer->tp = e->tp, peer->pp = e->pp;
    peer->needed = kvw_pair_needed(remote, ctx->rank);
    snprintf(peer->desc, sizeof(peer->desc), "prefill rank dp%u/tp%u/pp%u at %s (instance %.60s)",
             e->dp, e->tp, e->pp, e->addr, kvw__inst_name(ctx, inst));
    pthread_mutex_unlock(&ctx->mu);
    return KVW_OK;
}

/* Registers with one prefill rank; BUSY means this rank's previous registration is not
 * known dead there yet (a restart): back off and try again until the deadline. */
kvw_status_t kvw__decode_connect_retry(struct kvw_ctx *ctx, const kvw_bs_entry_t *e,
                                       uint32_t inst, uint32_t gen, uint64_t deadline)
{
    /* The prefill rank learns of the old connection's end from its own socket (EOF, or
     * its heartbeat timeout): nothing here can wait on that, so a short capped backoff. */
    uint64_t backoff_ms = 10;
    kvw_status_t st;
    while ((st = kvw_decode_connect(ctx, e, inst, gen, deadline)) == KVW_ERR_BUSY &&
           !kvw__insts_cancelled(ctx) &&
           kvw__now_ns() + backoff_ms * 1000000ull < deadline) {
        usleep((useconds_t)(backoff_ms * 1000));
        backoff_ms = KVW_MIN(backoff_ms * 2, 100);
    }
    /* The control thread polls the new peer's socket (and heartbeats it) now, not only
     * once every rank of the instance is registered. */
    if (st == KVW_OK)
        kvw__ctx_wake(ctx);
    return st;
}

/* kvw__decode_connect_all: the registrations with an instance's ranks, up to
 * KVW_PAR_REGISTRATIONS at once. Each registration is a few round trips across three
 * threads of the prefill process (accept, registration, transport), so done one after
 * the other they take the sum of every wake-up latency: on a loaded host, seconds for
 * 48 ranks. Workers take the next entry from a shared index; the first failure stops
 * the others from starting new ones and is what the call reports. */
typedef struct kvw_conn_all {
    struct kvw_ctx *ctx;
    const kvw_bs_entry_t *entries;
    uint32_t n, inst, gen;
    uint64_t deadline;
    pthread_mutex_t mu;
    uint32_t next;
    kvw_status_t st;
    char why[512];
} kvw_conn_all_t;

static void *kvw_conn_all_main(void *arg)
{
    kvw_conn_all_t *a = arg;
    for (;;) {
        pthread_mutex_lock(&a->mu);
        uint32_t i = a->st == KVW_OK ? a->next++ : a->n;
        pthread_mutex_unlock(&a->mu);
        if (i >= a->n)
            return NULL;
        kvw_status_t st = kvw__decode_connect_retry(a->ctx, &a->entries[i], a->inst, a->gen,
                                                    a->deadline);
        if (st != KVW_OK) {
            pthread_mutex_lock(&a->mu);
            if (a->st == KVW_OK) {
                a->st = st;
                snprintf(a->why, sizeof(a->why), "%s", kvw_last_error());
            }
            pthread_mutex_unlock(&a->mu);
        }
    }
}

/* A helper thread of kvw__decode_connect_all (the calling thread, the engine's, keeps
 * its name). */
static void *kvw_conn_helper_main(void *arg)
{
    kvw__thread_name("kvw-connect");
    return kvw_conn_all_main(arg);
}

kvw_status_t kvw__decode_connect_all(struct kvw_ctx *ctx, const kvw_bs_entry_t *entries,
                                     uint32_t n, uint32_t inst, uint32_t gen, uint64_t deadline)
{
    kvw_conn_all_t a = {.ctx = ctx, .entries = entries, .n = n, .inst = inst, .gen = gen,
                        .deadline = deadline, .st = KVW_OK};
    pthread_t t[KVW_PAR_REGISTRATIONS];
    uint32_t nt = 0, want = KVW_MIN(n, KVW_PAR_REGISTRATIONS);
    pthread_mutex_init(&a.mu, NULL);
    /* This thread is one of the workers; the others are helpers (none when a thread
     * cannot be started: the registrations then go one after the other). */
    for (; nt + 1 < want; nt++)
        if (pthread_create(&t[nt], NULL, kvw_conn_helper_main, &a) != 0)
            break;
    kvw_conn_all_main(&a);
    for (uint32_t i = 0; i < nt; i++)
        pthread_join(t[i], NULL);
    pthread_mutex_destroy(&a.mu);
    if (a.st != KVW_OK)
        return kvw__error(a.st, "%s", a.why);
    return KVW_OK;
}

/* Registrations run on their own short-lived threads: a silent or slow connection to
 * the control port must not stop heartbeats and reads for everyone else. */
typedef struct kvw_hs_arg {
    struct kvw_ctx *ctx;
    int fd;
    uint32_t slot;
} kvw_hs_arg_t;

void kvw__handshake_heard(struct kvw_ctx *ctx, int fd)
{
    pthread_mutex_lock(&ctx->mu);
    for (uint32_t i = 0; i < KVW_ARRAY_SIZE(ctx->hs.slot); i++)
        if (ctx->hs.slot[i].fd == fd)
            ctx->hs.slot[i].heard = true;
    pthread_mutex_unlock(&ctx->mu);
}

static void *kvw_handshake_main(void *arg)
{
    kvw_hs_arg_t *a = arg;
    kvw__thread_name("kvw-handshake");
    struct kvw_ctx *ctx = a->ctx;
    kvw_peer_t *peer;
    kvw_status_t st = kvw__prefill_handshake(ctx, a->fd, &peer);
    /* Free the slot before the fd can be closed: the control thread only shuts down
     * fds that are still in a slot, so it never touches a reused descriptor. */
    pthread_mutex_lock(&ctx->mu);
    ctx->hs.slot[a->slot].fd = -1;
    pthread_mutex_unlock(&ctx->mu);
    /* A bad or refused registration only closes this connection. */
    if (st != KVW_OK)
        close(a->fd);
    else
        fcntl(a->fd, F_SETFL, fcntl(a->fd, F_GETFL) | O_NONBLOCK);
    free(a);
    /* Wake the control thread (to poll the new peer's socket) before giving up the
     * handshake count: once it reaches zero, kvw_ctx_destroy closes the wake pipe and
     * frees the context, so this thread must not touch ctx after the unlock below. */
    pthread_mutex_lock(&ctx->mu);
    kvw__ctx_wake(ctx);
    ctx->hs.running--;
    pthread_cond_broadcast(&ctx->cv);
    pthread_mutex_unlock(&ctx->mu);
    return NULL;
}

void kvw__start_handshake(struct kvw_ctx *ctx, int fd)
{
    kvw_hs_arg_t *a = malloc(sizeof(*a));
    pthread_attr_t attr;
    pthread_t t;
    pthread_mutex_lock(&ctx->mu);
    /* At most KVW_MAX_HANDSHAKES live registrations. When they are all taken, the oldest
     * connection that has not sent its registration yet is shut down to make room (it
     * would time out anyway): silent connections cannot lock honest peers out. Threads
     * of displaced connections still hold one of the spare slots until they leave. */
    uint32_t live = 0, free_slot = UINT32_MAX, oldest = UINT32_MAX;
    for (uint32_t i = 0; i < KVW_ARRAY_SIZE(ctx->hs.slot); i++) {
        if (ctx->hs.slot[i].fd < 0) {
            free_slot = free_slot == UINT32_MAX ? i : free_slot;
            continue;
        }
        if (ctx->hs.slot[i].evicted)
            continue;
        live++;
        if (!ctx->hs.slot[i].heard &&
            (oldest == UINT32_MAX || ctx->hs.slot[i].started_ns < ctx->hs.slot[oldest].started_ns))
            oldest = i;
    }
    bool refuse = ctx->stopping || a == NULL || free_slot == UINT32_MAX ||
                  (live >= KVW_MAX_HANDSHAKES && oldest == UINT32_MAX);
    if (!refuse && live >= KVW_MAX_HANDSHAKES) {
        shutdown(ctx->hs.slot[oldest].fd, SHUT_RDWR);
        ctx->hs.slot[oldest].evicted = true;
    }
    if (!refuse) {
        ctx->hs.running++;
        ctx->hs.slot[free_slot].fd = fd;
        ctx->hs.slot[free_slot].started_ns = kvw__now_ns();
        ctx->hs.slot[free_slot].heard = false;
        ctx->hs.slot[free_slot].evicted = false;
    }
    pthread_mutex_unlock(&ctx->mu);
    if (refuse) {
        free(a);
        close(fd);
        return;
    }
    a->ctx = ctx;
    a->fd = fd;
    a->slot = free_slot;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, kvw_handshake_main, a) != 0) {
        pthread_mutex_lock(&ctx->mu);
        ctx->hs.slot[free_slot].fd = -1;
        ctx->hs.running--;
        pthread_mutex_unlock(&ctx->mu);
        free(a);
        close(fd);
    }
    pthread_attr_destroy(&attr);
}

void kvw__hs_init(struct kvw_ctx *ctx)
{
    for (uint32_t i = 0; i < KVW_ARRAY_SIZE(ctx->hs.slot); i++)
        ctx->hs.slot[i].fd = -1;
}

uint32_t kvw__hs_running(const struct kvw_ctx *ctx)
{
    return ctx->hs.running;
}

uint64_t kvw_ctx_refusals(kvw_ctx_h ctx, char *buf, size_t cap)
{
    if (ctx == NULL)
        return 0;
    pthread_mutex_lock(&ctx->mu);
    uint64_t n = ctx->hs.refusals;
    if (buf && cap)
        snprintf(buf, cap, "%s", ctx->hs.last_refusal);
    pthread_mutex_unlock(&ctx->mu);
    return n;
}
