/*
 * Contexts: one per rank. A control thread owns every control socket (accepts, reads
 * frames, sends queued frames, heartbeats, timeouts); on prefill ranks a worker thread
 * moves the bytes. One mutex (ctx->mu) guards the peer and room tables; no socket I/O
 * happens while it is held except non-blocking reads on the control thread.
 */
#include "proto/proto.h"

#include <kvwire/mem.h>

#include "core/config.h"
#include "core/rand.h"
#include "core/sha256.h"
#include "cuda/module.h"

#include <kvwire/cuda.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

const char *kvw_room_state_string(kvw_room_state_t s)
{
    static const char *n[] = {"Bootstrapping", "WaitingForInput", "Transferring", "Success",
                              "Failed"};
    return (unsigned)s < KVW_ARRAY_SIZE(n) ? n[s] : "unknown";
}

static void kvw_frame_tag(const kvw_peer_t *peer, uint8_t dir, uint64_t seq, uint8_t type,
                          const uint8_t *payload, size_t n, uint8_t out[32]);

void kvw__ctx_wake(struct kvw_ctx *ctx)
{
    if (write(ctx->wake_fd[1], "w", 1) < 0) {
        /* A full pipe already guarantees a wake-up. */
    }
}

/*
 * Queues a frame for a peer (mu held). When nothing is queued or being written for
 * that peer, the frame is first written right here with one non-blocking send: the
 * hop through the control thread (a wake-up and a context switch on each side of every
 * request and confirmation) is the largest part of a small room's latency. Whatever
 * the socket does not take at once is queued, and the control thread writes the rest,
 * in order: frames of one peer never interleave, because a direct write happens only
 * when the queue is empty and the control thread is not inside a write (tx_busy), both
 * checked under mu.
 */
void kvw__peer_send(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_wbuf_t *w)
{
    if (peer->authed && !peer->dead && !w->oom) {
        uint8_t tag[32];
        kvw_frame_tag(peer, peer->tx_dir, peer->tx_seq++, w->p[5], w->p + KVW_WIRE_HDR,
                      w->len - KVW_WIRE_HDR, tag);
        for (int i = 0; i < KVW_TAG; i++)
            kvw__wb_u8(w, tag[i]);
    }
    if (peer->dead || kvw__wb_finish(w) != KVW_OK) {
        kvw__wb_free(w);
        return;
    }
    size_t off = 0;
    if (peer->out_head == NULL && !peer->tx_busy && peer->fd >= 0) {
        while (off < w->len) {
            ssize_t k = send(peer->fd, w->p + off, w->len - off, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (k > 0) {
                off += (size_t)k;
                continue;
            }
            if (k < 0 && errno == EINTR)
                continue;
            /* EAGAIN: the rest waits for the control thread; a real error shows there
             * too (the next write fails and declares the peer dead). */
            break;
        }
        if (off == w->len) {
            peer->last_tx_ns = kvw__now_ns();
            kvw__wb_free(w);
            return;
        }
    }
    kvw_outmsg_t *m = malloc(sizeof(*m));
    bool full = peer->out_bytes + (w->len - off) > KVW_MAX_OUT_BYTES;
    if (m == NULL || full) {
        char why[160];
        snprintf(why, sizeof(why), full ? "stopped reading: more than %u MiB of frames queued"
                                        : "out of memory queueing a frame",
                 KVW_MAX_OUT_BYTES >> 20);
        free(m);
        kvw__wb_free(w);
        kvw__peer_dead(ctx, peer, full ? KVW_ERR_PEER_DEAD : KVW_ERR_NO_MEMORY, why);
        return;
    }
    m->w = *w;
    m->off = off;
    m->next = NULL;
    peer->out_bytes += w->len - off;
    if (peer->out_tail)
        peer->out_tail->next = m;
    else
        peer->out_head = m;
    peer->out_tail = m;
    kvw__ctx_wake(ctx);
}

static void kvw_peer_drop_out(kvw_peer_t *peer)
{
    while (peer->out_head) {
        kvw_outmsg_t *m = peer->out_head;
        peer->out_head = m->next;
        kvw__wb_free(&m->w);
        free(m);
    }
    peer->out_tail = NULL;
    peer->out_bytes = 0;
}

/* Marks a peer dead and fails every room that involves it. mu held. */
void kvw__peer_dead(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_status_t status,
                    const char *reason)
{
    if (peer->dead)
        return;
    peer->dead = true;
    kvw__log(KVW_LOG_WARN, "peer %s is gone (%s): %s", peer->desc, kvw_status_string(status),
             reason ? reason : "");
    if (peer->fd >= 0) {
        shutdown(peer->fd, SHUT_RDWR);
    }
    /* Decode: a prefill instance with a dead rank is down; the next room that names it
     * connects again (a restarted instance). */
    if (ctx->side == KVW_SIDE_DECODE && peer->inst < ctx->num_insts) {
        kvw_inst_t *in = &ctx->insts[peer->inst];
        if (in->gen == peer->inst_gen && in->state == KVW_INST_READY) {
            in->state = KVW_INST_DOWN;
            snprintf(in->why, sizeof(in->why), "%s: %s", peer->desc, reason);
        }
    }
    kvw_peer_drop_out(peer);
    for (int b = 0; b < KVW_ROOM_BUCKETS; b++)
        for (kvw_room_t *r = ctx->rooms[b]; r; r = r->next) {
            bool involved = false;
            /* A decode rank that already confirmed its bytes is no longer waited on. */
            for (uint32_t i = 0; i < r->num_dsts; i++)
                involved |= r->dsts[i].peer == peer->id && !r->dsts[i].acked;
            for (uint32_t i = 0; i < r->num_srcs; i++)
                involved |= r->srcs[i].peer == peer->id && !r->srcs[i].done;
            if (involved)
                kvw__room_fail(ctx, r, status, false, "%s: %s", peer->desc, reason);
        }
}

static kvw_peer_t *kvw_peer_add(struct kvw_ctx *ctx, int fd)
{
    if (ctx->num_peers == ctx->cap_peers) {
        uint32_t cap = ctx->cap_peers ? ctx->cap_peers * 2 : 16;
        kvw_peer_t **n = realloc(ctx->peers, sizeof(*n) * cap);
        if (n == NULL)
            return NULL;
        ctx->peers = n;
        ctx->cap_peers = cap;
    }
    kvw_peer_t *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return NULL;
    p->id = ctx->num_peers;
    p->fd = fd;
    p->last_rx_ns = p->last_tx_ns = kvw__now_ns();
    ctx->peers[ctx->num_peers++] = p;
    return p;
}

/* A dead peer's resources, detached under mu and released after it (closing a
 * transport endpoint may wait for its flush). */
typedef struct kvw_peer_res {
    struct kvw_peer_res *next;
    int fd;
    kvw_tl_rkey_h *rkeys;
    uint32_t num_rkeys;
    kvw_tl_rkey_h staging_rkey;
    kvw_tl_ep_h ep;
    kvw_rank_h remote, mapped;
    uint8_t *payload;
} kvw_peer_res_t;

/* Whether a dead peer can give up its resources: no room still names it (as a decode
 * rank it writes or a prefill rank it reads from), no staging request of its waits,
 * nothing of it is being written. mu held. */
static bool kvw_peer_reapable(struct kvw_ctx *ctx, const kvw_peer_t *p)
{
    if (!p->dead || p->reaped || p->registering || p->tx_busy)
        return false;
    for (uint32_t i = 0; i < ctx->num_waits; i++)
        if (ctx->waits[i].peer == p->id)
            return false;
    for (int b = 0; b < KVW_ROOM_BUCKETS; b++)
        for (const kvw_room_t *r = ctx->rooms[b]; r; r = r->next) {
            for (uint32_t i = 0; i < r->num_dsts; i++)
                if (r->dsts[i].peer == p->id)
                    return false;
            for (uint32_t i = 0; i < r->num_srcs; i++)
                if (r->srcs[i].peer == p->id)
                    return false;
        }
    return true;
}

/* Detaches the resources of every dead peer nothing refers to any more (mu held);
 * the caller releases the list with kvw_peer_res_release after unlocking. The peer's
 * small record stays (its id indexes the peer table). */
static kvw_peer_res_t *kvw_peers_reap(struct kvw_ctx *ctx)
{
    kvw_peer_res_t *list = NULL;
    for (uint32_t i = 0; i < ctx->num_peers; i++) {
        kvw_peer_t *p = ctx->peers[i];
        if (!kvw_peer_reapable(ctx, p))
            continue;
        kvw_peer_res_t *res = calloc(1, sizeof(*res));
        if (res == NULL)
            break;
        kvw_peer_drop_out(p);
        *res = (kvw_peer_res_t){.next = list, .fd = p->fd, .rkeys = p->rkeys,
                                .num_rkeys = p->num_rkeys, .staging_rkey = p->staging_rkey,
                                .ep = p->ep, .remote = p->remote, .mapped = p->mapped,
                                .payload = p->payload};
        p->fd = -1, p->rkeys = NULL, p->num_rkeys = 0, p->staging_rkey = NULL, p->ep = NULL;
        p->remote = p->mapped = NULL, p->payload = NULL;
        p->reaped = true;
        list = res;
    }
    return list;
}

static void kvw_peer_res_release(struct kvw_ctx *ctx, kvw_peer_res_t *list)
{
    while (list) {
        kvw_peer_res_t *res = list;
        list = res->next;
        if (res->fd >= 0)
            close(res->fd);
        for (uint32_t i = 0; i < res->num_rkeys; i++)
            if (res->rkeys[i])
                ctx->tl_ops->rkey_release(res->rkeys[i]);
        free(res->rkeys);
        if (res->staging_rkey)
            ctx->tl_ops->rkey_release(res->staging_rkey);
        if (res->ep)
            ctx->tl_ops->ep_close(res->ep);
        kvw_rank_destroy(res->remote);
        kvw_rank_destroy(res->mapped);
        free(res->payload);
        free(res);
    }
}

static void kvw_peer_free(struct kvw_ctx *ctx, kvw_peer_t *p)
{
    kvw_peer_drop_out(p);
    if (p->fd >= 0)
        close(p->fd);
    for (uint32_t i = 0; i < p->num_rkeys; i++)
        if (p->rkeys[i])
            ctx->tl_ops->rkey_release(p->rkeys[i]);
    free(p->rkeys);
    if (p->staging_rkey)
        ctx->tl_ops->rkey_release(p->staging_rkey);
    if (p->ep)
        ctx->tl_ops->ep_close(p->ep);
    kvw_rank_destroy(p->remote);
    kvw_rank_destroy(p->mapped);
    free(p->payload);
    free(p);
}

int kvw__rank_cuda_device(kvw_rank_h rank)
{
    for (uint32_t i = 0; i < kvw_rank_num_buffers(rank); i++)
        if (kvw_rank_buffer(rank, i)->mem_kind == KVW_MEM_CUDA)
            return kvw_rank_buffer(rank, i)->device;
    return -1;
}

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
    if (kvw_rank_create(&rp, &mapped) != KVW_OK)
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

/* ------------------------------------------------------------ handshake */

/*
 * Shared secret: the prefill rank opens every registration with a random challenge;
 * the decode rank answers with HMAC-SHA-256(secret, "kvwire-hello" | challenge) and a
 * challenge of its own, which the prefill rank answers in ACCEPT with
 * HMAC(secret, "kvwire-accept" | that challenge). The secret never crosses the wire.
 */
#define KVW_NONCE 32

/*
 * With a secret, the MACs bind the whole handshake transcript, not only the challenges:
 *   HELLO  mac   = HMAC(secret, "kvwire-hello-2"  | nonce | dnonce | hello body)
 *   ACCEPT proof = HMAC(secret, "kvwire-accept-2" | nonce | dnonce | SHA256(hello body)
 *                                                  | accept body)
 *   session key  = HMAC(secret, "kvwire-session-2" | nonce | dnonce | hello mac)
 * The hello body holds the decode rank's identity, instance, buffer descriptions, keys
 * and data address; the accept body the prefill rank's description. A relay can
 * neither change them (the MAC fails) nor add, drop, reorder or alter a control frame
 * later: every frame after the handshake carries a tag under the session key, with a
 * sequence number per direction (kvw__peer_send, kvw_peer_read).
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

static void kvw_sha256(const void *p, size_t n, uint8_t out[32])
{
    kvw_sha256_t c;
    kvw__sha256_init(&c);
    kvw__sha256_update(&c, p, n);
    kvw__sha256_final(&c, out);
}

/* Tag of one control frame under a peer's session key: direction, sequence number,
 * frame type and payload. */
static void kvw_frame_tag(const kvw_peer_t *peer, uint8_t dir, uint64_t seq, uint8_t type,
                          const uint8_t *payload, size_t n, uint8_t out[32])
{
    uint8_t head[10];
    head[0] = dir;
    head[1] = type;
    for (int i = 0; i < 8; i++)
        head[2 + i] = (uint8_t)(seq >> (8 * i));
    kvw_hmac_t h;
    kvw__hmac_init(&h, peer->skey, sizeof(peer->skey));
    kvw__hmac_update(&h, head, sizeof(head));
    if (n)
        kvw__hmac_update(&h, payload, n);
    kvw__hmac_final(&h, out);
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
    kvw__wb_u64(w, ctx->staging_len);
    if (ctx->staging_len)
        kvw__wb_bytes(w, rkeys + (size_t)nb * KVW_TL_MAX_RKEY, rkey_lens[nb]);
}

/* Prefill side of the registration, on a fresh connection (control thread). */
kvw_status_t kvw__prefill_handshake(struct kvw_ctx *ctx, int fd, kvw_peer_t **peer_p)
{
    uint8_t type, *p = NULL;
    uint32_t len = 0;
    kvw_rank_h remote = NULL;
    kvw_tl_ep_h ep = NULL;
    kvw_tl_rkey_h *rkeys = NULL;
    uint32_t nb = 0;
    kvw_rank_h mapped = NULL;
    char reason[400] = "";
    uint64_t deadline = kvw__now_ns() + (uint64_t)ctx->peer_timeout_ms * 1000000ull;
    uint8_t nonce[KVW_NONCE];
    kvw_wbuf_t cw;
    if (kvw__random_bytes(nonce, sizeof(nonce)) != 0)
        return kvw__error(KVW_ERR_IO, "no random bytes for the handshake challenge");
    kvw__wb_init(&cw, KVW_MSG_CHALLENGE);
    kvw_wb_raw(&cw, nonce, KVW_NONCE);
    kvw_status_t st = kvw__wb_finish(&cw);
    if (st == KVW_OK)
        st = kvw__sock_send_all(fd, cw.p, cw.len, deadline);
    kvw__wb_free(&cw);
    if (st != KVW_OK)
        return st;
    st = kvw__sock_recv_frame(fd, deadline, &type, &p, &len);
    if (st != KVW_OK)
        return st;
    kvw__handshake_heard(ctx, fd);
    if (type != KVW_MSG_HELLO) {
        free(p);
        return kvw__error(KVW_ERR_MALFORMED, "expected a registration, got frame type %u", type);
    }
    kvw_rbuf_t r;
    kvw__rb_init(&r, p, len);
    uint8_t has_mac = kvw__rb_u8(&r);
    uint8_t mac[32], dnonce[KVW_NONCE];
    kvw_rb_raw(&r, mac, sizeof(mac));
    kvw_rb_raw(&r, dnonce, sizeof(dnonce));
    uint32_t id_at_remote = kvw__rb_u32(&r);
    uint64_t instance = kvw__rb_u64(&r);
    char tl_name[32];
    kvw__rb_str(&r, tl_name, sizeof(tl_name));
    size_t addr_len = 0;
    const void *addr = kvw__rb_bytes(&r, KVW_TL_MAX_ADDR, &addr_len);
    if (r.bad) {
        /* Answer with the reason: a peer speaking another version learns why. */
        st = KVW_ERR_MALFORMED;
        snprintf(reason, sizeof(reason), "the registration frame is truncated (a different "
                 "kvwire version?)");
        goto reply;
    }
    /* The body the MAC covers: everything after has_mac, mac and dnonce. */
    const uint8_t *hello_body = p + 1 + 32 + KVW_NONCE;
    size_t hello_body_len = len - (1 + 32 + KVW_NONCE);
    uint8_t hello_hash[32];
    kvw_sha256(hello_body, hello_body_len, hello_hash);
    if (ctx->secret[0]) {
        uint8_t want[32];
        kvw_auth_mac(ctx, "kvwire-hello-2", nonce, dnonce, hello_body, hello_body_len, NULL, 0,
                     want);
        if (!has_mac || !kvw__ct_equal(mac, want, 32)) {
            st = KVW_ERR_AUTH;
            snprintf(reason, sizeof(reason), has_mac ? "authentication failed: the shared secret "
                     "does not match" : "authentication failed: this prefill rank requires a "
                     "shared secret and the decode rank proved none");
            goto reply;
        }
    }
    st = kvw__wire_get_rank(&r, &remote);
    if (st != KVW_OK) {
        snprintf(reason, sizeof(reason), "bad registration: %s", kvw_last_error());
        goto reply;
    }
    nb = kvw_rank_num_buffers(remote);
    rkeys = calloc(nb ? nb : 1, sizeof(*rkeys));
    if (strcmp(tl_name, ctx->tl_ops->name) != 0) {
        st = KVW_ERR_INCOMPATIBLE;
        snprintf(reason, sizeof(reason), "transport mismatch: decode uses '%s', this prefill rank "
                 "uses '%s'", tl_name, ctx->tl_ops->name);
        goto reply;
    }
    if ((st = kvw_rank_check_compatible(ctx->rank, remote)) != KVW_OK) {
        snprintf(reason, sizeof(reason), "%s", kvw_last_error());
        goto reply;
    }
    /* Memory kinds: cuda_ipc moves GPU memory to GPU memory. The other transports read
     * and write host memory; GPU memory on either side goes through the decode's host
     * staging area (gathered and scattered on the GPUs), checked once the registration
     * says whether there is one. Anything else is refused here, not at the first
     * request. */
    bool gpu_tl = strcmp(ctx->tl_ops->name, "cuda_ipc") == 0;
    int local_dev = kvw__rank_cuda_device(ctx->rank);
    bool remote_gpu = false;
    for (uint32_t i = 0; i < nb; i++) {
        kvw_mem_kind_t k = kvw_rank_buffer(remote, i)->mem_kind;
        remote_gpu |= k == KVW_MEM_CUDA;
        if (gpu_tl && k != KVW_MEM_CUDA) {
            st = KVW_ERR_UNSUPPORTED;
            snprintf(reason, sizeof(reason), "decode buffer %u is host memory, which transport "
                     "'cuda_ipc' cannot write (cuda_ipc needs GPU buffers on both sides)", i);
            goto reply;
        }
    }
    for (uint32_t i = 0; gpu_tl && i < kvw_rank_num_buffers(ctx->rank); i++) {
        if (kvw_rank_buffer(ctx->rank, i)->mem_kind != KVW_MEM_CUDA) {
            st = KVW_ERR_UNSUPPORTED;
            snprintf(reason, sizeof(reason), "prefill buffer %u is host memory, which transport "
                     "'cuda_ipc' cannot read (cuda_ipc needs GPU buffers on both sides)", i);
            goto reply;
        }
    }
    bool must_stage = !gpu_tl && (ctx->staged_cuda || remote_gpu);
    /* A registration may not take over an identity (instance and rank) whose peer is
     * still alive: that cut the live one off. A restarted rank whose old connection has
     * not been noticed dead yet retries until it is (BUSY). */
    {
        const kvw_parallel_t *ip = kvw_rank_parallel(remote);
        pthread_mutex_lock(&ctx->mu);
        for (uint32_t i = 0; i < ctx->num_peers && st == KVW_OK; i++) {
            const kvw_peer_t *o = ctx->peers[i];
            if (!o->dead && o->instance == instance && o->dp == ip->dp_rank &&
                o->tp == ip->tp_rank && o->pp == ip->pp_rank) {
                st = KVW_ERR_BUSY;
                snprintf(reason, sizeof(reason), "%.200s is already registered here and alive "
                         "(two decode instances need distinct instance ids)", o->desc);
            }
        }
        pthread_mutex_unlock(&ctx->mu);
        if (st != KVW_OK)
            goto reply;
    }
    /* GPU handles open in the current device's context: the one holding our buffers. */
    if (local_dev >= 0 && (st = kvw_cuda_set_device(local_dev)) != KVW_OK) {
        snprintf(reason, sizeof(reason), "cannot select GPU %d: %s", local_dev, kvw_last_error());
        goto reply;
    }
    if ((st = ctx->tl_ops->connect(ctx->tl, addr, addr_len, &ep)) != KVW_OK) {
        snprintf(reason, sizeof(reason), "cannot open the data path: %s", kvw_last_error());
        goto reply;
    }
    /* Bind the data connection to this session first: completions that arrive on a
     * connection that never proved it read this registration's challenge are refused. */
    {
        kvw_wbuf_t bw;
        kvw__wb_init(&bw, KVW_MSG_BIND);
        kvw__wb_u32(&bw, id_at_remote);
        kvw_wb_raw(&bw, dnonce, sizeof(dnonce));
        if ((st = kvw__wb_finish(&bw)) == KVW_OK)
            st = ctx->tl_ops->notify(ep, bw.p, bw.len);
        kvw__wb_free(&bw);
        if (st != KVW_OK) {
            snprintf(reason, sizeof(reason), "cannot open the data path: %s", kvw_last_error());
            goto reply;
        }
    }
    for (uint32_t i = 0; i < nb; i++) {
        size_t kl = 0;
        const void *k = kvw__rb_bytes(&r, KVW_TL_MAX_RKEY, &kl);
        if (k == NULL) {
            st = KVW_ERR_MALFORMED;
            snprintf(reason, sizeof(reason), "registration lacks the key of buffer %u", i);
            goto reply;
        }
        /* GPU buffers behind a host transport are written only through staging: they
         * come without a key, and no direct write can name them. */
        if (kl == 0 && !gpu_tl && kvw_rank_buffer(remote, i)->mem_kind == KVW_MEM_CUDA)
            continue;
        if ((st = ctx->tl_ops->rkey_unpack(ep, k, kl, &rkeys[i])) != KVW_OK) {
            snprintf(reason, sizeof(reason), "bad remote key for buffer %u: %s", i,
                     kvw_last_error());
            goto reply;
        }
    }
    uint64_t staging_len = kvw__rb_u64(&r);
    kvw_tl_rkey_h staging_rkey = NULL;
    if (staging_len) {
        size_t kl = 0;
        const void *k = kvw__rb_bytes(&r, KVW_TL_MAX_RKEY, &kl);
        if (k == NULL || ctx->tl_ops->rkey_unpack(ep, k, kl, &staging_rkey) != KVW_OK) {
            st = KVW_ERR_MALFORMED;
            snprintf(reason, sizeof(reason), "bad staging key in the registration");
            goto reply;
        }
    }
    if (must_stage && staging_len == 0) {
        st = KVW_ERR_UNSUPPORTED;
        snprintf(reason, sizeof(reason), "GPU memory on %s goes through the decode rank's "
                 "staging area over '%s', and the decode rank has none (KVW_STAGING_MB=0)",
                 ctx->staged_cuda ? "this prefill rank" : "the decode rank", ctx->tl_ops->name);
        goto reply;
    }
    if (st == KVW_OK && gpu_tl && (mapped = kvw_mapped_rank(ctx, remote, rkeys)) == NULL) {
        st = KVW_ERR_UNSUPPORTED;
        snprintf(reason, sizeof(reason), "cannot map the decode rank's GPU buffers here");
        goto reply;
    }
    if (kvw__rb_done(&r, "registration") != KVW_OK) {
        if (staging_rkey)
            ctx->tl_ops->rkey_release(staging_rkey);
        staging_rkey = NULL;
        st = KVW_ERR_MALFORMED;
        snprintf(reason, sizeof(reason), "%s", kvw_last_error());
    }
reply:
    free(p);
    kvw_wbuf_t w;
    kvw__wb_init(&w, st == KVW_OK ? KVW_MSG_ACCEPT : KVW_MSG_REJECT);
    if (st == KVW_OK) {
        uint8_t proof[32] = {0};
        kvw__wb_u8(&w, ctx->secret[0] != 0);
        kvw_wb_raw(&w, proof, sizeof(proof));
        size_t body_at = w.len;
        kvw__wire_put_rank(&w, ctx->rank);
        if (ctx->secret[0] && !w.oom) {
            kvw_auth_mac(ctx, "kvwire-accept-2", nonce, dnonce, hello_hash, 32, w.p + body_at,
                         w.len - body_at, proof);
            memcpy(w.p + body_at - sizeof(proof), proof, sizeof(proof));
        }
    }
    else {
        kvw__wb_u32(&w, (uint32_t)(int32_t)st);
        kvw__wb_str(&w, reason);
    }
    if (st != KVW_OK && reason[0]) {
        /* The engine on this side can ask why a decode rank could not register (counted
         * before the refusal goes out, so the refused side never sees it first). */
        pthread_mutex_lock(&ctx->mu);
        ctx->refusals++;
        snprintf(ctx->last_refusal, sizeof(ctx->last_refusal), "decode instance %llu: %s",
                 (unsigned long long)instance, reason);
        kvw__log(KVW_LOG_WARN, "refused a registration of decode instance %llu: %s",
                 (unsigned long long)instance, reason);
        pthread_mutex_unlock(&ctx->mu);
    }
    kvw_status_t sst = kvw__wb_finish(&w);
    if (sst == KVW_OK)
        sst = kvw__sock_send_all(fd, w.p, w.len, deadline);
    kvw__wb_free(&w);
    if (st == KVW_OK && sst != KVW_OK)
        st = sst;
    if (st != KVW_OK) {
        for (uint32_t i = 0; rkeys && i < nb; i++)
            if (rkeys[i])
                ctx->tl_ops->rkey_release(rkeys[i]);
        free(rkeys);
        if (ep)
            ctx->tl_ops->ep_close(ep);
        kvw_rank_destroy(mapped);
        kvw_rank_destroy(remote);
        return reason[0] ? kvw__error(st, "%s", reason) : st;
    }
    pthread_mutex_lock(&ctx->mu);
    const kvw_parallel_t *rpar = kvw_rank_parallel(remote);
    /* The same rank of the same decode instance registering again replaces the old
     * registration (a restarted process whose death was not noticed yet). */
    for (uint32_t i = 0; i < ctx->num_peers; i++) {
        kvw_peer_t *o = ctx->peers[i];
        if (!o->dead && o->instance == instance && o->dp == rpar->dp_rank &&
            o->tp == rpar->tp_rank && o->pp == rpar->pp_rank)
            kvw__peer_dead(ctx, o, KVW_ERR_PEER_DEAD,
                           "replaced by a new registration of the same rank (two decode "
                           "instances need distinct instance ids)");
    }
    kvw_peer_t *peer = kvw_peer_add(ctx, fd);
    if (peer == NULL) {
        pthread_mutex_unlock(&ctx->mu);
        if (staging_rkey)
            ctx->tl_ops->rkey_release(staging_rkey);
        for (uint32_t i = 0; i < nb; i++)
            ctx->tl_ops->rkey_release(rkeys[i]);
        free(rkeys);
        ctx->tl_ops->ep_close(ep);
        kvw_rank_destroy(mapped);
        kvw_rank_destroy(remote);
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory adding a peer");
    }
    const kvw_parallel_t *rp = kvw_rank_parallel(remote);
    peer->remote = remote;
    peer->ep = ep;
    peer->rkeys = rkeys;
    peer->num_rkeys = nb;
    peer->id_at_remote = id_at_remote;
    peer->mapped = mapped;
    peer->instance = instance;
    peer->staging_rkey = staging_rkey;
    peer->staging_len = staging_len;
    peer->must_stage = must_stage;
    if (ctx->secret[0]) {
        peer->authed = true;
        peer->tx_dir = 1; /* prefill -> decode */
        kvw_auth_mac(ctx, "kvwire-session-2", nonce, dnonce, mac, sizeof(mac), NULL, 0,
                     peer->skey);
    }
    peer->dp = rp->dp_rank, peer->tp = rp->tp_rank, peer->pp = rp->pp_rank;
    peer->remote_group_size = rp->tp_size * KVW_MAX(rp->pp_size, 1);
    peer->remote_pp_size = KVW_MAX(rp->pp_size, 1);
    peer->needed = kvw_pair_needed(ctx->rank, remote);
    if (instance)
        snprintf(peer->desc, sizeof(peer->desc), "decode instance %llu rank dp%u/tp%u/pp%u",
                 (unsigned long long)instance, peer->dp, peer->tp, peer->pp);
    else
        snprintf(peer->desc, sizeof(peer->desc), "decode rank dp%u/tp%u/pp%u", peer->dp, peer->tp,
                 peer->pp);
    pthread_mutex_unlock(&ctx->mu);
    *peer_p = peer;
    return KVW_OK;
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
    if ((st = kvw__sock_recv_frame(fd, deadline, &type, &p, &len)) != KVW_OK ||
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
    kvw_peer_t *peer = kvw_peer_add(ctx, fd);
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
            kvw_auth_mac(ctx, "kvwire-hello-2", nonce, dnonce, w.p + body_at, w.len - body_at,
                         NULL, 0, mac);
            memcpy(w.p + KVW_WIRE_HDR + 1, mac, sizeof(mac));
        }
    }
    if ((st = kvw__wb_finish(&w)) == KVW_OK)
        st = kvw__sock_send_all(fd, w.p, w.len, deadline);
    kvw__wb_free(&w);
    if (st == KVW_OK)
        st = kvw__sock_recv_frame(fd, deadline, &type, &p, &len);
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
        kvw_auth_mac(ctx, "kvwire-accept-2", nonce, dnonce, hello_hash, 32, p + 1 + 32,
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
        kvw_auth_mac(ctx, "kvwire-session-2", nonce, dnonce, mac, sizeof(mac), NULL, 0,
                     peer->skey);
    }
    peer->registering = false;
    peer->last_rx_ns = peer->last_tx_ns = kvw__now_ns();
    peer->remote = remote;
    memcpy(peer->bind_nonce, dnonce, sizeof(peer->bind_nonce));
    peer->dp = e->dp, peer->tp = e->tp, peer->pp = e->pp;
    peer->needed = kvw_pair_needed(remote, ctx->rank);
    snprintf(peer->desc, sizeof(peer->desc), "prefill rank dp%u/tp%u/pp%u at %s (instance %.60s)",
             e->dp, e->tp, e->pp, e->addr, inst < ctx->num_insts ? ctx->insts[inst].addr : "?");
    pthread_mutex_unlock(&ctx->mu);
    return KVW_OK;
}

/* Registers with one prefill rank; BUSY means this rank's previous registration is not
 * known dead there yet (a restart): back off and try again until the deadline. */
static kvw_status_t kvw_decode_connect_retry(struct kvw_ctx *ctx, const kvw_bs_entry_t *e,
                                             uint32_t inst, uint32_t gen, uint64_t deadline)
{
    uint64_t backoff_ms = 20;
    kvw_status_t st;
    while ((st = kvw_decode_connect(ctx, e, inst, gen, deadline)) == KVW_ERR_BUSY &&
           !atomic_load(&ctx->cancel_connects) &&
           kvw__now_ns() + backoff_ms * 1000000ull < deadline) {
        usleep((useconds_t)(backoff_ms * 1000));
        backoff_ms = KVW_MIN(backoff_ms * 2, 500);
    }
    return st;
}

/* ------------------------------------------------------------ prefill instances (decode) */

int kvw__inst_find_or_add(struct kvw_ctx *ctx, const char *addr)
{
    for (uint32_t i = 0; i < ctx->num_insts; i++)
        if (!strcmp(ctx->insts[i].addr, addr))
            return (int)i;
    if (strlen(addr) >= sizeof(ctx->insts[0].addr)) {
        kvw__error(KVW_ERR_INVALID_PARAM, "bootstrap address '%.64s...' is too long", addr);
        return -1;
    }
    if (ctx->num_insts >= KVW_MAX_INSTANCES) {
        kvw__error(KVW_ERR_BUSY, "this decode context already talks to %u prefill instances",
                   KVW_MAX_INSTANCES);
        return -1;
    }
    if (ctx->num_insts == ctx->cap_insts) {
        uint32_t cap = ctx->cap_insts ? ctx->cap_insts * 2 : 8;
        kvw_inst_t *n = realloc(ctx->insts, sizeof(*n) * cap);
        if (n == NULL) {
            kvw__error(KVW_ERR_NO_MEMORY, "out of memory adding a prefill instance");
            return -1;
        }
        ctx->insts = n;
        ctx->cap_insts = cap;
    }
    kvw_inst_t *in = &ctx->insts[ctx->num_insts];
    memset(in, 0, sizeof(*in));
    snprintf(in->addr, sizeof(in->addr), "%s", addr);
    in->state = KVW_INST_DOWN; /* never connected yet */
    snprintf(in->why, sizeof(in->why), "not connected");
    return (int)ctx->num_insts++;
}

typedef struct kvw_conn_arg {
    struct kvw_ctx *ctx;
    uint32_t inst, gen;
    char addr[128];
} kvw_conn_arg_t;

/* Rooms of instance `i` waiting for its connection: a post made meanwhile goes out now,
 * or, when the connection failed, every such room fails with the reason. mu held. */
static void kvw_inst_settle(struct kvw_ctx *ctx, uint32_t i, kvw_status_t st, const char *why)
{
    for (int b = 0; b < KVW_ROOM_BUCKETS; b++)
        for (kvw_room_t *r = ctx->rooms[b]; r; r = r->next) {
            if (r->is_sender || r->inst != i || r->inst_gen != ctx->insts[i].gen ||
                r->state != KVW_ROOM_BOOTSTRAPPING)
                continue;
            if (st != KVW_OK) {
                kvw__room_fail(ctx, r, st, false, "prefill instance %s: %s", ctx->insts[i].addr,
                               why);
            } else if (r->pending) {
                r->pending = false;
                kvw__receiver_post_locked(ctx, r, &r->pend);
            }
        }
}

/* Connects to one prefill instance on its own thread: the caller of kvw_receiver_*
 * never blocks on a bootstrap lookup or a handshake. */
static void *kvw_inst_connect_main(void *arg)
{
    kvw_conn_arg_t *a = arg;
    struct kvw_ctx *ctx = a->ctx;
    uint64_t deadline = kvw__now_ns() + (uint64_t)ctx->bootstrap_timeout_ms * 1000000ull;
    kvw_bs_entry_t *entries = NULL;
    uint32_t ne = 0;
    kvw_status_t st = kvw__bootstrap_lookup_ex(a->addr, 0, 0, 0, ctx->secret, deadline, true,
                                               &ctx->cancel_connects, &entries, &ne);
    for (uint32_t i = 0; st == KVW_OK && i < ne; i++)
        st = kvw_decode_connect_retry(ctx, &entries[i], a->inst, a->gen, deadline);
    free(entries);
    char why[400];
    snprintf(why, sizeof(why), "%s", st == KVW_OK ? "" : kvw_last_error());
    pthread_mutex_lock(&ctx->mu);
    kvw_inst_t *in = &ctx->insts[a->inst];
    if (in->gen == a->gen) {
        if (st == KVW_OK) {
            in->state = KVW_INST_READY;
        } else {
            in->state = KVW_INST_DOWN;
            snprintf(in->why, sizeof(in->why), "%s", why);
            /* Ranks of a half-connected instance are not used: drop them. */
            for (uint32_t i = 0; i < ctx->num_peers; i++)
                if (ctx->peers[i]->inst == a->inst && ctx->peers[i]->inst_gen == a->gen)
                    kvw__peer_dead(ctx, ctx->peers[i], st, "its instance failed to connect");
        }
        kvw_inst_settle(ctx, a->inst, st, why);
        kvw__late_aborts_flush(ctx, a->inst, a->gen, st == KVW_OK);
    }
    kvw__ctx_wake(ctx); /* poll the new peers' sockets (before the count drops) */
    ctx->connecting--;
    pthread_cond_broadcast(&ctx->cv);
    pthread_mutex_unlock(&ctx->mu);
    free(a);
    return NULL;
}

int kvw__inst_use(struct kvw_ctx *ctx, uint32_t i)
{
    kvw_inst_t *in = &ctx->insts[i];
    if (in->state != KVW_INST_DOWN || ctx->stopping)
        return in->state;
    kvw_conn_arg_t *a = malloc(sizeof(*a));
    pthread_attr_t attr;
    pthread_t t;
    if (a == NULL)
        return KVW_INST_DOWN;
    in->gen++;
    in->state = KVW_INST_CONNECTING;
    *a = (kvw_conn_arg_t){.ctx = ctx, .inst = i, .gen = in->gen};
    snprintf(a->addr, sizeof(a->addr), "%s", in->addr);
    ctx->connecting++;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, kvw_inst_connect_main, a) != 0) {
        free(a);
        ctx->connecting--;
        in->state = KVW_INST_DOWN;
        snprintf(in->why, sizeof(in->why), "cannot start a connecting thread");
    }
    pthread_attr_destroy(&attr);
    return in->state;
}

/* ------------------------------------------------------------ control thread */

/* Reads what is available on a peer's socket; handles complete frames. mu held. */
static void kvw_peer_read(struct kvw_ctx *ctx, kvw_peer_t *peer)
{
    for (;;) {
        ssize_t k;
        if (peer->hdr_got < KVW_WIRE_HDR) {
            k = recv(peer->fd, peer->hdr + peer->hdr_got, KVW_WIRE_HDR - peer->hdr_got,
                     MSG_DONTWAIT);
        } else {
            k = recv(peer->fd, peer->payload + peer->payload_got,
                     peer->payload_len - peer->payload_got, MSG_DONTWAIT);
            if (peer->payload_len == 0)
                k = 0, errno = 0;
        }
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
            return;
        if (k < 0 || (k == 0 && !(peer->hdr_got == KVW_WIRE_HDR && peer->payload_len == 0))) {
            kvw__peer_dead(ctx, peer, KVW_ERR_CONN_CLOSED,
                           k == 0 ? "closed the connection" : strerror(errno));
            return;
        }
        peer->last_rx_ns = kvw__now_ns();
        if (peer->hdr_got < KVW_WIRE_HDR) {
            peer->hdr_got += (uint32_t)k;
            if (peer->hdr_got < KVW_WIRE_HDR)
                continue;
            uint8_t type = 0;
            uint32_t len = 0;
            if (kvw__wire_header(peer->hdr, &type, &len) != KVW_OK) {
                kvw__peer_dead(ctx, peer, KVW_ERR_MALFORMED, kvw_last_error());
                return;
            }
            peer->payload = malloc(len ? len : 1);
            if (peer->payload == NULL) {
                kvw__peer_dead(ctx, peer, KVW_ERR_NO_MEMORY, "out of memory reading a frame");
                return;
            }
            peer->payload_len = len;
            peer->payload_got = 0;
        } else {
            peer->payload_got += (uint32_t)k;
        }
        if (peer->payload_got == peer->payload_len) {
            uint8_t *payload = peer->payload;
            uint32_t plen = peer->payload_len;
            peer->payload = NULL;
            peer->hdr_got = 0;
            if (peer->authed) {
                /* A frame without the right tag for this direction and position was not
                 * sent by the peer that authenticated: drop the connection. */
                uint8_t want[32];
                bool ok = plen >= KVW_TAG;
                if (ok) {
                    plen -= KVW_TAG;
                    kvw_frame_tag(peer, peer->tx_dir == 1 ? 2 : 1, peer->rx_seq++, peer->hdr[5],
                                  payload, plen, want);
                    ok = kvw__ct_equal(payload + plen, want, KVW_TAG);
                }
                if (!ok) {
                    free(payload);
                    kvw__peer_dead(ctx, peer, KVW_ERR_AUTH, "a control frame failed its "
                                   "session authentication (forged, altered or replayed)");
                    return;
                }
            }
            kvw__handle_frame(ctx, peer, peer->hdr[5], payload, plen);
            free(payload);
            if (peer->dead)
                return;
        }
    }
}

/* Sends queued frames; called without mu, takes it only to pop. */
/*
 * Writes a peer's queued frames without blocking: what the socket does not take stays at
 * the head of the queue (m->off) and the control thread polls for POLLOUT. A peer that
 * stops reading therefore never holds the control thread; it is declared dead once its
 * queue made no progress for the peer timeout (see the control loop) or grew past
 * KVW_MAX_OUT_BYTES (kvw__peer_send). `blocking`: at shutdown, finish within the peer
 * timeout instead (the peer must not learn of a completion or an abort only from the
 * closed connection).
 */
static void kvw_peer_flush(struct kvw_ctx *ctx, kvw_peer_t *peer, bool blocking)
{
    for (;;) {
        /* The head frame leaves the queue while it is written outside mu (a peer's death
         * meanwhile frees the queue, not this frame); tx_busy keeps direct sends out. */
        pthread_mutex_lock(&ctx->mu);
        kvw_outmsg_t *m = peer->dead || peer->fd < 0 ? NULL : peer->out_head;
        if (m) {
            peer->out_head = m->next;
            if (peer->out_head == NULL)
                peer->out_tail = NULL;
            peer->tx_busy = true;
        }
        pthread_mutex_unlock(&ctx->mu);
        if (m == NULL)
            return;
        size_t left = m->w.len - m->off;
        kvw_status_t st = KVW_OK;
        ssize_t k = 0;
        if (blocking) {
            st = kvw__sock_send_all(peer->fd, m->w.p + m->off, left,
                                    kvw__now_ns() + (uint64_t)ctx->peer_timeout_ms * 1000000ull);
            k = st == KVW_OK ? (ssize_t)left : 0;
        } else {
            do
                k = send(peer->fd, m->w.p + m->off, left, MSG_DONTWAIT | MSG_NOSIGNAL);
            while (k < 0 && errno == EINTR);
            if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
                st = kvw__error(KVW_ERR_CONN_CLOSED, "send: %s", strerror(errno));
        }
        pthread_mutex_lock(&ctx->mu);
        peer->tx_busy = false;
        bool keep = false;
        if (st != KVW_OK) {
            kvw__peer_dead(ctx, peer, st, kvw_last_error());
        } else {
            if (k > 0) {
                m->off += (size_t)k;
                peer->out_bytes -= KVW_MIN((uint64_t)k, peer->out_bytes);
                peer->tx_stall_ns = 0;
                peer->last_tx_ns = kvw__now_ns();
            } else if (peer->tx_stall_ns == 0) {
                peer->tx_stall_ns = kvw__now_ns(); /* the socket is full: wait for POLLOUT */
            }
            if (m->off < m->w.len && !peer->dead) {
                /* Back at the head, ahead of whatever was queued meanwhile. */
                m->next = peer->out_head;
                peer->out_head = m;
                if (peer->out_tail == NULL)
                    peer->out_tail = m;
                keep = true;
            }
        }
        bool again = st == KVW_OK && !keep;
        pthread_mutex_unlock(&ctx->mu);
        if (!keep) {
            kvw__wb_free(&m->w);
            free(m);
        }
        if (!again)
            return;
    }
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
    for (uint32_t i = 0; i < KVW_ARRAY_SIZE(ctx->hs); i++)
        if (ctx->hs[i].fd == fd)
            ctx->hs[i].heard = true;
    pthread_mutex_unlock(&ctx->mu);
}

static void *kvw_handshake_main(void *arg)
{
    kvw_hs_arg_t *a = arg;
    struct kvw_ctx *ctx = a->ctx;
    kvw_peer_t *peer;
    kvw_status_t st = kvw__prefill_handshake(ctx, a->fd, &peer);
    /* Free the slot before the fd can be closed: the control thread only shuts down
     * fds that are still in a slot, so it never touches a reused descriptor. */
    pthread_mutex_lock(&ctx->mu);
    ctx->hs[a->slot].fd = -1;
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
    ctx->handshakes--;
    pthread_cond_broadcast(&ctx->cv);
    pthread_mutex_unlock(&ctx->mu);
    return NULL;
}

static void kvw_start_handshake(struct kvw_ctx *ctx, int fd)
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
    for (uint32_t i = 0; i < KVW_ARRAY_SIZE(ctx->hs); i++) {
        if (ctx->hs[i].fd < 0) {
            free_slot = free_slot == UINT32_MAX ? i : free_slot;
            continue;
        }
        if (ctx->hs[i].evicted)
            continue;
        live++;
        if (!ctx->hs[i].heard &&
            (oldest == UINT32_MAX || ctx->hs[i].started_ns < ctx->hs[oldest].started_ns))
            oldest = i;
    }
    bool refuse = ctx->stopping || a == NULL || free_slot == UINT32_MAX ||
                  (live >= KVW_MAX_HANDSHAKES && oldest == UINT32_MAX);
    if (!refuse && live >= KVW_MAX_HANDSHAKES) {
        shutdown(ctx->hs[oldest].fd, SHUT_RDWR);
        ctx->hs[oldest].evicted = true;
    }
    if (!refuse) {
        ctx->handshakes++;
        ctx->hs[free_slot].fd = fd;
        ctx->hs[free_slot].started_ns = kvw__now_ns();
        ctx->hs[free_slot].heard = false;
        ctx->hs[free_slot].evicted = false;
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
        ctx->hs[free_slot].fd = -1;
        ctx->handshakes--;
        pthread_mutex_unlock(&ctx->mu);
        free(a);
        close(fd);
    }
    pthread_attr_destroy(&attr);
}

static void *kvw_ctrl_main(void *arg)
{
    struct kvw_ctx *ctx = arg;
    struct pollfd *pfd = NULL;
    uint32_t *pidx = NULL;
    kvw_peer_t **flush = NULL;
    uint32_t cap = 0;
    uint64_t last_timeout_scan = 0, last_reap = 0;
    for (;;) {
        pthread_mutex_lock(&ctx->mu);
        if (ctx->stopping) {
            /* Send what is queued (a room's completion, an abort) before leaving: the
             * peer must not learn of it only through the closed connection. */
            pthread_mutex_unlock(&ctx->mu);
            for (uint32_t i = 0;; i++) {
                pthread_mutex_lock(&ctx->mu);
                kvw_peer_t *p = i < ctx->num_peers ? ctx->peers[i] : NULL;
                pthread_mutex_unlock(&ctx->mu);
                if (p == NULL)
                    break;
                kvw_peer_flush(ctx, p, true);
            }
            break;
        }
        uint32_t need = ctx->num_peers + 2;
        if (need > cap) {
            cap = need * 2;
            pfd = realloc(pfd, sizeof(*pfd) * cap);
            pidx = realloc(pidx, sizeof(*pidx) * cap);
            flush = realloc(flush, sizeof(*flush) * cap);
            if (pfd == NULL || pidx == NULL || flush == NULL) {
                pthread_mutex_unlock(&ctx->mu);
                break; /* cannot happen in practice; rooms then time out */
            }
        }
        nfds_t n = 0;
        pfd[n++] = (struct pollfd){.fd = ctx->wake_fd[0], .events = POLLIN};
        if (ctx->listen_fd >= 0)
            pfd[n++] = (struct pollfd){.fd = ctx->listen_fd, .events = POLLIN};
        uint32_t first_peer = (uint32_t)n;
        for (uint32_t i = 0; i < ctx->num_peers; i++) {
            if (ctx->peers[i]->dead || ctx->peers[i]->registering)
                continue;
            pidx[n] = i;
            pfd[n++] = (struct pollfd){.fd = ctx->peers[i]->fd,
                                       .events = POLLIN | (ctx->peers[i]->out_head ? POLLOUT : 0)};
        }
        pthread_mutex_unlock(&ctx->mu);

        int timeout = (int)KVW_MAX(ctx->heartbeat_ms / 2, 10);
        int ready = 0;
        if (ctx->busy_poll_ns) {
            /* Busy polling: look without sleeping until something arrives or the spin
             * time is over, then sleep as usual. */
            uint64_t end = kvw__now_ns() + ctx->busy_poll_ns;
            while ((ready = poll(pfd, n, 0)) == 0 && kvw__now_ns() < end) {
            }
        }
        if (ready == 0 && poll(pfd, n, timeout) < 0 && errno != EINTR)
            break;
        if (pfd[0].revents) {
            char buf[64];
            while (read(ctx->wake_fd[0], buf, sizeof(buf)) > 0) {
            }
        }
        if (ctx->listen_fd >= 0 && pfd[1].revents) {
            int fd = accept4(ctx->listen_fd, NULL, NULL, SOCK_CLOEXEC);
            if (fd >= 0)
                kvw_start_handshake(ctx, fd);
        }
        pthread_mutex_lock(&ctx->mu);
        for (nfds_t i = first_peer; i < n; i++)
            if (pfd[i].revents && !ctx->peers[pidx[i]]->dead)
                kvw_peer_read(ctx, ctx->peers[pidx[i]]);
        uint64_t now = kvw__now_ns();
        for (uint32_t i = 0; i < ctx->num_peers; i++) {
            kvw_peer_t *p = ctx->peers[i];
            if (p->dead || p->registering)
                continue;
            if (p->tx_stall_ns && now - p->tx_stall_ns > (uint64_t)ctx->peer_timeout_ms * 1000000ull) {
                char why[128];
                snprintf(why, sizeof(why), "stopped reading: %llu bytes of frames waited %u ms",
                         (unsigned long long)p->out_bytes, ctx->peer_timeout_ms);
                kvw__peer_dead(ctx, p, KVW_ERR_PEER_DEAD, why);
                continue;
            }
            if (now - p->last_rx_ns > (uint64_t)ctx->peer_timeout_ms * 1000000ull) {
                char why[96];
                snprintf(why, sizeof(why), "no heartbeat for %u ms", ctx->peer_timeout_ms);
                kvw__peer_dead(ctx, p, KVW_ERR_PEER_DEAD, why);
                continue;
            }
            if (now - p->last_tx_ns > (uint64_t)ctx->heartbeat_ms * 1000000ull &&
                p->out_head == NULL) {
                kvw_wbuf_t w;
                kvw__wb_init(&w, KVW_MSG_HEARTBEAT);
                kvw__peer_send(ctx, p, &w);
            }
        }
        /* Timeouts have millisecond granularity; scanning every room on every event
         * would cost more than the events themselves at high request rates. */
        kvw_peer_res_t *reaped = NULL;
        if (now - last_timeout_scan > 10000000ull) {
            kvw__check_timeouts(ctx, now);
            last_timeout_scan = now;
            /* Dead peers give their sockets, mappings and endpoints back as soon as
             * no room refers to them: under decode churn a prefill context must not
             * keep every departed peer's resources until it is destroyed. */
            if (now - last_reap > 100000000ull) {
                reaped = kvw_peers_reap(ctx);
                last_reap = now;
            }
        }
        /* Peers with queued frames, copied under the lock: registration threads may
         * grow the peer table meanwhile. Peers are never freed before the context. */
        uint32_t nf = 0;
        for (uint32_t i = 0; i < ctx->num_peers && nf < cap; i++)
            if (ctx->peers[i]->out_head && !ctx->peers[i]->dead)
                flush[nf++] = ctx->peers[i];
        pthread_mutex_unlock(&ctx->mu);
        kvw_peer_res_release(ctx, reaped);
        for (uint32_t i = 0; i < nf; i++)
            kvw_peer_flush(ctx, flush[i], false);
    }
    free(pfd);
    free(pidx);
    free(flush);
    return NULL;
}

/* ------------------------------------------------------------ create / destroy */

/* GPU buffers on a host transport (tcp, shm, ucx) move through host staging: the prefill
 * gathers on its GPU, the decode scatters on its own. That needs the CUDA module here,
 * and a rank whose buffers are all GPU memory on one device (a rank mixing kinds would
 * need both paths in one plan). cuda_ipc keeps its own rule (checked at registration). */
static kvw_status_t kvw_check_mem_kinds(struct kvw_ctx *ctx)
{
    ctx->cuda_dev = kvw__rank_cuda_device(ctx->rank);
    if (ctx->cuda_dev < 0 || strcmp(ctx->tl_ops->name, "cuda_ipc") == 0)
        return KVW_OK;
    for (uint32_t i = 0; i < kvw_rank_num_buffers(ctx->rank); i++) {
        const kvw_buffer_desc_t *b = kvw_rank_buffer(ctx->rank, i);
        if (b->mem_kind != KVW_MEM_CUDA || b->device != ctx->cuda_dev)
            return kvw__error(KVW_ERR_UNSUPPORTED, "buffer %u is %s memory%s, but buffer 0 of "
                              "this rank is on GPU %d: over '%s' a rank's buffers must all be "
                              "GPU memory of one device, or all host memory", i,
                              b->mem_kind == KVW_MEM_CUDA ? "GPU" : "host",
                              b->mem_kind == KVW_MEM_CUDA ? " of another device" : "",
                              ctx->cuda_dev, ctx->tl_ops->name);
    }
    if (kvw_cuda_available() != KVW_OK)
        return kvw__error(KVW_ERR_UNSUPPORTED, "this rank's buffers are GPU memory, which '%s' "
                          "moves through host staging with the CUDA module: %s",
                          ctx->tl_ops->name, kvw_last_error());
    ctx->staged_cuda = true;
    return KVW_OK;
}

kvw_status_t kvw_ctx_create(const kvw_ctx_params_t *params, kvw_ctx_h *ctx_p)
{
    const uint64_t need = KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK;
    kvw_status_t st;
    /* A decode context may go without a bootstrap address: its rooms then name their
     * prefill instance (kvw_receiver_create_from). */
    bool has_bs = params && (params->field_mask & KVW_CTX_FIELD_BOOTSTRAP) &&
                  params->bootstrap_addr && params->bootstrap_addr[0];
    if (params == NULL || ctx_p == NULL || (params->field_mask & need) != need ||
        params->rank == NULL || (!has_bs && params->side != KVW_SIDE_DECODE))
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "context params need a side, a rank and (prefill) a bootstrap address");
    uint64_t fm = params->field_mask;
    if ((fm & KVW_CTX_FIELD_SECRET) && params->secret && strlen(params->secret) >= 256)
        return kvw__error(KVW_ERR_INVALID_PARAM, "the shared secret is longer than 255 bytes");
    if ((st = kvw__config_check()) != KVW_OK) /* every KVW_* variable, once per context */
        return st;
    struct kvw_ctx *ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory creating a context");
    ctx->side = params->side;
    ctx->rank = params->rank;
    if ((fm & KVW_CTX_FIELD_SECRET) && params->secret)
        snprintf(ctx->secret, sizeof(ctx->secret), "%s", params->secret);
    if (fm & KVW_CTX_FIELD_INSTANCE)
        ctx->instance_id = params->instance_id;
    ctx->listen_fd = -1;
    ctx->bs_fd = -1;
    for (uint32_t i = 0; i < KVW_ARRAY_SIZE(ctx->hs); i++)
        ctx->hs[i].fd = -1;
    ctx->wake_fd[0] = ctx->wake_fd[1] = -1;
    snprintf(ctx->listen_host, sizeof(ctx->listen_host), "%s",
             (fm & KVW_CTX_FIELD_LISTEN_HOST) && params->listen_host ? params->listen_host
                                                                      : "127.0.0.1");
    snprintf(ctx->bootstrap_addr, sizeof(ctx->bootstrap_addr), "%s",
             has_bs ? params->bootstrap_addr : "");
    bool t = fm & KVW_CTX_FIELD_TIMEOUTS;
    ctx->heartbeat_ms = t && params->heartbeat_ms ? params->heartbeat_ms : 200;
    ctx->peer_timeout_ms = t && params->peer_timeout_ms ? params->peer_timeout_ms : 3000;
    ctx->bootstrap_timeout_ms = t && params->bootstrap_timeout_ms ? params->bootstrap_timeout_ms : 10000;
    ctx->wait_timeout_ms = t && params->wait_timeout_ms ? params->wait_timeout_ms : 30000;
    uint64_t bp; /* the getters cannot fail after kvw__config_check */
    kvw__config_u64("KVW_BUSY_POLL_US", &bp);
    uint64_t busy_us = (fm & KVW_CTX_FIELD_BUSY_POLL) ? params->busy_poll_us : bp;
    ctx->busy_poll_ns = KVW_MIN(busy_us, 1000000ull) * 1000ull; /* at most 1 s */
    const char *path;
    kvw__config_str("KVW_PATH", &path);
    ctx->path_mode = path && !strcmp(path, "direct")   ? KVW_PATH_DIRECT
                     : path && !strcmp(path, "staged") ? KVW_PATH_STAGED
                                                       : KVW_PATH_AUTO;
    pthread_mutex_init(&ctx->mu, NULL);
    pthread_cond_init(&ctx->cv, NULL);
    {
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_cond_init(&ctx->done_cv, &ca);
        pthread_condattr_destroy(&ca);
    }
    uint64_t deadline = kvw__now_ns() + (uint64_t)ctx->bootstrap_timeout_ms * 1000000ull;

    const char *tl_name = (fm & KVW_CTX_FIELD_TRANSPORT) && params->transport ? params->transport
                                                                               : "tcp";
    ctx->tl_ops = kvw__tl_find(tl_name);
    if (ctx->tl_ops == NULL) {
        st = kvw__error(KVW_ERR_UNSUPPORTED, "unknown transport '%s'", tl_name);
        goto err;
    }
    if (pipe2(ctx->wake_fd, O_CLOEXEC | O_NONBLOCK) < 0) {
        st = kvw__error(KVW_ERR_IO, "pipe: %s", strerror(errno));
        goto err;
    }
    kvw_tl_params_t tp = {.listen_host = ctx->side == KVW_SIDE_DECODE ? ctx->listen_host : NULL,
                          .listen_port = 0,
                          .cb = {.arg = ctx, .on_notify = kvw__on_notify,
                                 .check_write = kvw__check_write,
                                 .on_ep_error = kvw__on_ep_error}};
    if ((st = ctx->tl_ops->init(&tp, &ctx->tl)) != KVW_OK)
        goto err;
    if ((st = kvw_check_mem_kinds(ctx)) != KVW_OK)
        goto err;

    if (ctx->side == KVW_SIDE_PREFILL) {
        const kvw_parallel_t *par = kvw_rank_parallel(ctx->rank);
        if (params->host_bootstrap && (fm & KVW_CTX_FIELD_HOST_BOOTSTRAP)) {
            char host[128];
            uint16_t port;
            if ((st = kvw__parse_hostport(params->bootstrap_addr, host, sizeof(host), &port)) != KVW_OK ||
                (st = kvw__bootstrap_start(host, port, ctx->secret, &ctx->bs)) != KVW_OK)
                goto err;
            snprintf(ctx->bootstrap_addr, sizeof(ctx->bootstrap_addr), "%s",
                     kvw__bootstrap_addr(ctx->bs));
        }
        if ((st = kvw__tcp_listen(ctx->listen_host, 0, &ctx->listen_fd, &ctx->listen_port)) != KVW_OK)
            goto err;
        /* Workers send to different decode ranks in parallel (KVW_WORKERS, default 4). */
        uint64_t nw;
        kvw__config_u64("KVW_WORKERS", &nw);
        nw = KVW_MAX(1, KVW_MIN(nw, KVW_ARRAY_SIZE(ctx->workers)));
        for (uint32_t i = 0; i < nw; i++) {
            if (pthread_create(&ctx->workers[i], NULL, kvw__worker_main, ctx) != 0) {
                st = kvw__error(KVW_ERR_IO, "cannot start worker thread %u", i);
                goto err;
            }
            ctx->num_workers = i + 1;
        }
        if (pthread_create(&ctx->ctrl_thread, NULL, kvw_ctrl_main, ctx) != 0) {
            st = kvw__error(KVW_ERR_IO, "cannot start the control thread");
            goto err;
        }
        ctx->ctrl_started = true;
        kvw_bs_entry_t e = {.dp = par->dp_rank, .tp = par->tp_rank, .pp = par->pp_rank,
                            .dp_size = KVW_MAX(par->dp_size, 1), .tp_size = par->tp_size,
                            .pp_size = KVW_MAX(par->pp_size, 1)};
        snprintf(e.addr, sizeof(e.addr), "%s:%u", ctx->listen_host, ctx->listen_port);
        if ((st = kvw__bootstrap_hold(ctx->bootstrap_addr, &e, ctx->secret, deadline,
                                       &ctx->bs_fd)) != KVW_OK)
            goto err;
    } else {
        /* Register every buffer, then register with every prefill rank. */
        uint32_t nb = kvw_rank_num_buffers(ctx->rank);
        uint8_t *rkeys = calloc(nb + 1, KVW_TL_MAX_RKEY);
        size_t *rkey_lens = calloc(nb + 1, sizeof(size_t));
        ctx->mems = calloc(nb + 1, sizeof(*ctx->mems));
        uint8_t addr[KVW_TL_MAX_ADDR];
        size_t addr_len = sizeof(addr);
        kvw_bs_entry_t *entries = NULL;
        uint32_t ne = 0;
        if (!rkeys || !rkey_lens || !ctx->mems) {
            st = kvw__error(KVW_ERR_NO_MEMORY, "out of memory registering buffers");
            goto err_decode;
        }
        for (uint32_t i = 0; i < nb; i++) {
            const kvw_buffer_desc_t *b = kvw_rank_buffer(ctx->rank, i);
            ctx->num_mems = i + 1;
            if (ctx->staged_cuda)
                continue; /* no remote writes into GPU memory: an empty key */
            if ((st = ctx->tl_ops->mem_reg(ctx->tl, b->addr, b->length, b->mem_kind, i,
                                           &ctx->mems[i], rkeys + (size_t)i * KVW_TL_MAX_RKEY,
                                           &rkey_lens[i])) != KVW_OK) {
                ctx->num_mems = i;
                goto err_decode;
            }
        }
        /* The staging area receives gathered head slices in one bulk write each. */
        uint64_t smb;
        kvw__config_u64("KVW_STAGING_MB", &smb);
        ctx->staging_len = smb << 20;
        if (ctx->staged_cuda && ctx->staging_len == 0) {
            st = kvw__error(KVW_ERR_INVALID_PARAM, "this rank's buffers are GPU memory, which "
                            "'%s' writes through the staging area, but KVW_STAGING_MB=0 "
                            "leaves none", ctx->tl_ops->name);
            goto err_decode;
        }
        if (ctx->staging_len) {
            void *sa = NULL;
            if (kvw_mem_alloc_shared(ctx->staging_len, &sa) == KVW_OK) {
                ctx->staging_shared = true;
            } else if (posix_memalign(&sa, 4096, ctx->staging_len) != 0) {
                st = kvw__error(KVW_ERR_NO_MEMORY, "cannot allocate %llu bytes of staging",
                                (unsigned long long)ctx->staging_len);
                goto err_decode;
            }
            ctx->staging = sa;
            /* Page-locked for the copies of staged windows to the GPU; without it they
             * still work, through the driver's own bounce buffers. */
            if (ctx->staged_cuda)
                ctx->staging_pinned =
                    kvw__cuda_host_register(ctx->staging, ctx->staging_len) == KVW_OK;
            if ((st = ctx->tl_ops->mem_reg(ctx->tl, ctx->staging, ctx->staging_len, KVW_MEM_HOST,
                                           nb, &ctx->mems[nb],
                                           rkeys + (size_t)nb * KVW_TL_MAX_RKEY,
                                           &rkey_lens[nb])) != KVW_OK)
                goto err_decode;
            ctx->num_mems = nb + 1;
        }
        if ((st = ctx->tl_ops->address(ctx->tl, addr, &addr_len)) != KVW_OK)
            goto err_decode;
        /* Kept for registrations with prefill instances connected later. */
        ctx->hello_rkeys = rkeys, ctx->hello_rkey_lens = rkey_lens;
        rkeys = NULL, rkey_lens = NULL;
        memcpy(ctx->hello_addr, addr, addr_len);
        ctx->hello_addr_len = addr_len;
        if (has_bs) {
            /* The context's own prefill instance is connected now, and its geometry
             * checked against what the caller expects: creation fails if it does not
             * fit. */
            int i0 = kvw__inst_find_or_add(ctx, ctx->bootstrap_addr);
            if (i0 < 0) {
                st = KVW_ERR_INVALID_PARAM;
                goto err_decode;
            }
            ctx->insts[i0].gen = 1;
            ctx->insts[i0].state = KVW_INST_CONNECTING;
            if ((st = kvw__bootstrap_lookup(ctx->bootstrap_addr, params->prefill_tp,
                                            params->prefill_pp, params->prefill_dp,
                                            ctx->secret, deadline, &entries, &ne)) != KVW_OK)
                goto err_decode;
            for (uint32_t i = 0; i < ne; i++)
                if ((st = kvw_decode_connect_retry(ctx, &entries[i], (uint32_t)i0, 1,
                                                   deadline)) != KVW_OK)
                    goto err_decode;
            ctx->insts[i0].state = KVW_INST_READY;
        }
        if (pthread_create(&ctx->ctrl_thread, NULL, kvw_ctrl_main, ctx) != 0)
            st = kvw__error(KVW_ERR_IO, "cannot start the control thread");
        else
            ctx->ctrl_started = true;
    err_decode:
        free(rkeys);
        free(rkey_lens);
        free(entries);
        if (st != KVW_OK)
            goto err;
    }
    *ctx_p = ctx;
    return KVW_OK;
err:
    {
        /* Keep the first error's message across the teardown. */
        char msg[512];
        snprintf(msg, sizeof(msg), "%s", kvw_last_error());
        kvw_ctx_destroy(ctx);
        return kvw__error(st, "%s", msg);
    }
}

uint64_t kvw_ctx_refusals(kvw_ctx_h ctx, char *buf, size_t cap)
{
    if (ctx == NULL)
        return 0;
    pthread_mutex_lock(&ctx->mu);
    uint64_t n = ctx->refusals;
    if (buf && cap)
        snprintf(buf, cap, "%s", ctx->last_refusal);
    pthread_mutex_unlock(&ctx->mu);
    return n;
}

const char *kvw_ctx_bootstrap_addr(kvw_ctx_h ctx)
{
    return ctx && ctx->bs ? kvw__bootstrap_addr(ctx->bs) : NULL;
}

void kvw_ctx_destroy(kvw_ctx_h ctx)
{
    if (ctx == NULL)
        return;
    pthread_mutex_lock(&ctx->mu);
    ctx->stopping = true;
    for (int b = 0; b < KVW_ROOM_BUCKETS; b++)
        for (kvw_room_t *r = ctx->rooms[b]; r; r = r->next)
            kvw__room_fail(ctx, r, KVW_ERR_SHUTDOWN, false, "the context was destroyed");
    pthread_cond_broadcast(&ctx->cv);
    pthread_mutex_unlock(&ctx->mu);
    if (ctx->wake_fd[1] >= 0)
        kvw__ctx_wake(ctx);
    if (ctx->ctrl_started)
        pthread_join(ctx->ctrl_thread, NULL);
    kvw__event_stop(ctx);
    /* Registration and connecting threads end within their timeouts (connecting ones
     * sooner: cancelled); wait for them. */
    atomic_store(&ctx->cancel_connects, true);
    pthread_mutex_lock(&ctx->mu);
    while (ctx->handshakes || ctx->connecting)
        pthread_cond_wait(&ctx->cv, &ctx->mu);
    pthread_mutex_unlock(&ctx->mu);
    for (uint32_t i = 0; i < ctx->num_workers; i++)
        pthread_join(ctx->workers[i], NULL);
    if (ctx->tl) {
        ctx->tl_ops->close(ctx->tl);
        ctx->tl_ops->stop(ctx->tl);
    }
    for (uint32_t i = 0; i < ctx->num_peers; i++)
        kvw_peer_free(ctx, ctx->peers[i]);
    free(ctx->peers);
    for (uint32_t i = 0; i < ctx->num_mems; i++)
        if (ctx->mems[i])
            ctx->tl_ops->mem_dereg(ctx->tl, ctx->mems[i]);
    free(ctx->mems);
    if (ctx->tl)
        ctx->tl_ops->fini(ctx->tl);
    if (ctx->staging) {
        if (ctx->staging_pinned)
            kvw__cuda_host_unregister(ctx->staging);
        if (ctx->staging_shared)
            kvw_mem_free_shared(ctx->staging);
        else
            free(ctx->staging);
    }
    free(ctx->spans);
    free(ctx->waits);
    free(ctx->insts);
    free(ctx->late);
    free(ctx->hello_rkeys);
    free(ctx->hello_rkey_lens);
    free(ctx->binds);
    /* Rooms still owned by handles are freed by their destroy calls; orphans here. */
    for (int b = 0; b < KVW_ROOM_BUCKETS; b++) {
        kvw_room_t *r = ctx->rooms[b];
        while (r) {
            kvw_room_t *next = r->next;
            if (!r->engine_owned)
                kvw__room_free(r);
            else
                r->ctx = NULL;
            r = next;
        }
    }
    if (ctx->bs_fd >= 0)
        close(ctx->bs_fd); /* the endpoint drops this rank's entry */
    kvw__bootstrap_stop(ctx->bs);
    if (ctx->listen_fd >= 0)
        close(ctx->listen_fd);
    if (ctx->wake_fd[0] >= 0) {
        close(ctx->wake_fd[0]);
        close(ctx->wake_fd[1]);
    }
    pthread_mutex_destroy(&ctx->mu);
    pthread_cond_destroy(&ctx->cv);
    pthread_cond_destroy(&ctx->done_cv);
    free(ctx);
}
