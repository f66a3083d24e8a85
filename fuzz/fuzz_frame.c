/*
 * fuzz_frame: every decoder of peer-controlled control bytes.
 *
 * Input: one mode byte (mod 5), then:
 *   mode 0  reader program: u8 op count N (<= 32), N op bytes, then a buffer. The 12
 *           first bytes of the buffer go through kvw__wire_header; the rest is read by
 *           the ops: kvw__rb_u8/u16/u32/u64, kvw__rb_bytes, kvw__rb_str,
 *           kvw__wire_get_pages, kvw__wire_get_rank, kvw__rb_done. Oracles: the reader
 *           never points past its buffer; returned spans lie inside it; strings end.
 *   mode 1  prefill rank: u8 config, then frames [u8 peer][12-byte header][payload]
 *           handled by the real kvw__handle_frame of a prefill context built by hand
 *           (one or two decode peers, a sender with queued chunks for room 7). Then the
 *           real worker (kvw__worker_main) executes whatever the frames made runnable
 *           through a stub transport that aborts on any write outside the decode
 *           buffer it targets (the page lists of REQ frames are peer-controlled).
 *   mode 2  decode rank: u8 config, then items [u8 kind]: a control frame from a
 *           prefill peer (kvw__handle_frame), a data-channel notification (the real
 *           kvw__on_notify, which parses DONE and scatters staged data), or a mediated
 *           write check (kvw__check_write: an accepted write must lie inside a
 *           registered region). Room 7 is posted with real guarded buffers; guards are
 *           checked at the end, after the room timeouts ran.
 *   mode 3  bytes sent to a real bootstrap endpoint (kvw__bootstrap_start) on loopback;
 *           it must answer and close a finished connection promptly.
 *   mode 4  a bootstrap table answered by a fake endpoint to kvw__bootstrap_lookup.
 */
#include "fuzz_common.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

/* ------------------------------------------------------------------ mode 0 */

static void fzf_check_reader(const kvw_rbuf_t *r)
{
    if (r->pos > r->len)
        fzc_fail("reader position %zu past its %zu bytes", r->pos, r->len);
}

static void fzf_parsers(fzc_in_t *in)
{
    /* The op bytes are taken as one span of the input, not copied byte by byte into a
     * fixed array: at -O3 GCC 12 vectorized that copy loop into 16-byte stores and could
     * not prove them inside the array (-Wstringop-overflow). An input that ends among
     * the ops now runs fewer ops instead of zero ops on an empty buffer: the same paths. */
    size_t nops;
    uint8_t *ops = fzc_take(in, fzc_u8(in) % 33, &nops);
    size_t n;
    uint8_t *buf = fzc_take(in, fzc_left(in), &n);
    if (n >= KVW_WIRE_HDR) {
        uint8_t type = 0;
        uint32_t len = 0;
        if (kvw__wire_header(buf, &type, &len) == KVW_OK &&
            (type == 0 || type >= KVW_MSG_MAX || len > KVW_WIRE_MAX_PAYLOAD))
            fzc_fail("header accepted type %u length %u", type, len);
    }
    kvw_rbuf_t r;
    kvw__rb_init(&r, buf, n);
    for (size_t i = 0; i < nops; i++) {
        uint8_t op = ops[i];
        switch (op % 9) {
        case 0:
            (void)kvw__rb_u8(&r);
            break;
        case 1:
            (void)kvw__rb_u16(&r);
            break;
        case 2:
            (void)kvw__rb_u32(&r);
            break;
        case 3:
            (void)kvw__rb_u64(&r);
            break;
        case 4: {
            size_t max = (size_t)(op >> 4) * 17, got = 0;
            const uint8_t *p = kvw__rb_bytes(&r, max, &got);
            if (p && (got > max || p < buf || p + got > buf + n))
                fzc_fail("rb_bytes returned %zu bytes outside the frame", got);
            if (p && got)
                fzc_sink += p[got - 1];
            break;
        }
        case 5: {
            char s[40];
            size_t cap = 1 + (op >> 4) * 2;
            memset(s, 'x', sizeof(s));
            kvw__rb_str(&r, s, cap);
            if (memchr(s, '\0', cap) == NULL)
                fzc_fail("rb_str left an unterminated string");
            break;
        }
        case 6: {
            kvw_pages_t pl;
            uint32_t *store = NULL;
            if (kvw__wire_get_pages(&r, &pl, &store, UINT32_MAX) == KVW_OK) {
                if (store == NULL || pl.pages != store)
                    fzc_fail("get_pages returned no storage");
                uint64_t acc = 0;
                for (uint32_t k = 0; k < pl.num_pages; k++)
                    acc += store[k];
                fzc_sink += acc;
                free(store);
            }
            break;
        }
        case 7: {
            kvw_rank_h h = NULL;
            if (kvw__wire_get_rank(&r, &h) == KVW_OK)
                kvw_rank_destroy(h);
            break;
        }
        default:
            (void)kvw__rb_done(&r, "fuzz");
            break;
        }
        fzf_check_reader(&r);
    }
    free(ops);
    free(buf);
}

/* ------------------------------------------------------------------ shared ranks */

typedef struct fzf_ranks {
    kvt_rank_t *p2[2]; /* prefill TP2 ranks 0, 1 (real buffers) */
    kvt_rank_t *p1;    /* prefill TP1 (real buffers) */
    kvt_rank_t *d1;    /* decode TP1 (real buffers, HND, pages 8/4) */
    kvt_rank_t *d2[2]; /* decode TP2 ranks 0, 1 (descriptions only) */
} fzf_ranks_t;

static fzf_ranks_t *fzf_ranks(void)
{
    static fzf_ranks_t r;
    static int done;
    if (!done) {
        for (uint32_t i = 0; i < 2; i++) {
            fzc_rank_cfg_t c = {.tp = 2, .rank = i, .page_full = 4, .page_swa = 4};
            r.p2[i] = fzc_rank_build(&c, 200 + i);
            fzc_rank_cfg_t d = {.tp = 2, .rank = i, .page_full = 4, .page_swa = 4,
                                .describe_only = 1};
            r.d2[i] = fzc_rank_build(&d, 0);
        }
        fzc_rank_cfg_t p1 = {.tp = 1, .page_full = 4, .page_swa = 4};
        r.p1 = fzc_rank_build(&p1, 203);
        fzc_rank_cfg_t d1 = {.tp = 1, .page_full = 8, .page_swa = 4, .layout = KVW_LAYOUT_HND};
        r.d1 = fzc_rank_build(&d1, 204);
        done = 1;
    }
    return &r;
}

static const uint64_t fzf_tokens[4] = {40, 13, 1, 48};

/* Reads one control frame: header from the input, payload as an exact allocation.
 * Returns false at the end of the input. */
static bool fzf_frame(fzc_in_t *in, uint8_t hdr[KVW_WIRE_HDR], uint8_t **payload_p,
                      size_t *len_p, bool *hdr_ok_p, uint8_t *type_p)
{
    if (fzc_left(in) < KVW_WIRE_HDR)
        return false;
    memcpy(hdr, in->p + in->pos, KVW_WIRE_HDR);
    in->pos += KVW_WIRE_HDR;
    uint32_t len = 0;
    *hdr_ok_p = kvw__wire_header(hdr, type_p, &len) == KVW_OK;
    if (!*hdr_ok_p) {
        *payload_p = NULL;
        *len_p = 0;
        return true;
    }
    if (len > fzc_left(in))
        return false; /* truncated: the connection would just wait */
    *payload_p = fzc_take(in, len, len_p);
    return true;
}

/* ------------------------------------------------------------------ mode 1 */

static void fzf_prefill(fzc_in_t *in)
{
    fzf_ranks_t *rk = fzf_ranks();
    uint8_t cfg = fzc_u8(in);
    bool two = cfg & 1, chunked = cfg & 2;
    uint64_t n = fzf_tokens[(cfg >> 2) & 3];
    kvt_rank_t *me = rk->p2[0];
    struct kvw_ctx *ctx = fzc_ctx_new(KVW_SIDE_PREFILL, me->h);
    if (two) {
        fzc_peer_add(ctx, fzc_rank_clone(rk->d2[0]->h));
        fzc_peer_add(ctx, fzc_rank_clone(rk->d2[1]->h));
    } else {
        fzc_peer_add(ctx, fzc_rank_clone(rk->d1->h));
    }
    kvw_sender_h snd = NULL;
    if (kvw_sender_create(ctx, 7, &snd) != KVW_OK)
        fzc_fail("sender: %s", kvw_last_error());
    fzc_pages_t pg;
    fzc_pages_simple(me, n, 1, 0, &pg);
    kvw_send_chunk_t sc = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = n,
                           .chunk_begin = 0, .chunk_end = n, .last_chunk = 1,
                           .pages = pg.side};
    if (chunked && n > 2) {
        sc.chunk_end = n / 2;
        sc.last_chunk = 0;
        if (kvw_sender_send(snd, &sc) != KVW_OK)
            fzc_fail("send: %s", kvw_last_error());
        sc.chunk_begin = n / 2;
        sc.chunk_end = n;
        sc.last_chunk = 1;
    }
    if (kvw_sender_send(snd, &sc) != KVW_OK)
        fzc_fail("send: %s", kvw_last_error());

    uint8_t hdr[KVW_WIRE_HDR];
    for (uint32_t frames = 0; frames < 64 && fzc_left(in) > 0; frames++) {
        kvw_peer_t *peer = ctx->peers.tab[fzc_u8(in) % ctx->peers.num];
        uint8_t *payload = NULL, type = 0;
        size_t len = 0;
        bool ok;
        if (!fzf_frame(in, hdr, &payload, &len, &ok, &type))
            break;
        pthread_mutex_lock(&ctx->mu);
        if (peer->dead)
            ; /* the control thread stops reading a dead peer */
        else if (!ok)
            kvw__peer_dead(ctx, peer, KVW_ERR_MALFORMED, "bad header");
        else
            kvw__handle_frame(ctx, peer, type, payload, (uint32_t)len);
        kvw__run_deferred(ctx); /* as the control thread does on every pass */
        pthread_mutex_unlock(&ctx->mu);
        free(payload);
        fzc_ctx_drain_wake(ctx);
    }
    if (fzc_run_worker(ctx, 5000) != 0)
        fzc_fail("the prefill worker did not go idle within 5 s (hang)");
    FZC_SAY("prefill room 7: %s %s (%llu puts so far)\n",
            kvw_room_state_string(kvw_room_poll(kvw_sender_room(snd))),
            kvw_room_failure(kvw_sender_room(snd)),
            (unsigned long long)fzc_puts);
    pthread_mutex_lock(&ctx->mu);
    kvw__check_timeouts(ctx, kvw__now_ns() + 3600ull * 1000000000ull);
    pthread_mutex_unlock(&ctx->mu);
    kvw_room_destroy(kvw_sender_room(snd));
    kvw_ctx_destroy(ctx);
}

/* ------------------------------------------------------------------ mode 2 */

#define FZF_STAGING (64u << 10)

/* An accepted mediated write must lie inside what the room was granted: a staging span
 * of that room, or pages of the room's posted lists that cover the tokens it moves. */
static void fzf_check_accepted(struct kvw_ctx *ctx, kvt_rank_t *me, const fzc_pages_t *pg,
                               uint64_t n, uint64_t prefix, uint64_t room, uint32_t region,
                               uint64_t off, uint64_t len)
{
    uint32_t nb = kvw_rank_num_buffers(me->h);
    if (region == nb) {
        bool inside = false;
        pthread_mutex_lock(&ctx->mu);
        for (uint32_t i = 0; i < ctx->stage.num_spans; i++) {
            const kvw_stage_span_t *sp = &ctx->stage.spans[i];
            inside |= sp->room == room && off >= sp->off && off + len <= sp->off + sp->len;
        }
        pthread_mutex_unlock(&ctx->mu);
        if (!inside)
            fzc_fail("check_write accepted a staged write [%llu, +%llu) for room %llu outside "
                     "every staging span granted to that room", (unsigned long long)off,
                     (unsigned long long)len, (unsigned long long)room);
        return;
    }
    if (room != 7)
        fzc_fail("check_write accepted a write for room %llu, which posted no pages",
                 (unsigned long long)room);
    const kvw_buffer_desc_t *b = kvw_rank_buffer(me->h, region);
    uint64_t stride, first = 0, tb = 0, ps = 1;
    const uint32_t *list = NULL;
    uint32_t count = 0;
    if (b->pool == KVW_POOL_STATE) {
        stride = b->length / FZC_SLOTS;
    } else {
        stride = (uint64_t)b->page_size * b->num_heads * (b->head_bytes + b->v_head_bytes);
        const kvw_pages_t *pl = b->pool == KVW_POOL_FULL ? &pg->side.full : &pg->side.swa;
        list = pl->pages;
        count = pl->num_pages;
        first = pl->first_token;
        ps = b->page_size;
        tb = b->pool == KVW_POOL_FULL ? prefix : KVW_MAX(prefix, n > 12 ? n - 12 : 0);
    }
    for (uint64_t p = off / stride; p <= (off + len - 1) / stride; p++) {
        bool ok = false;
        if (b->pool == KVW_POOL_STATE) {
            ok = p == (uint64_t)pg->side.state_slot;
        } else {
            for (uint32_t i = 0; i < count && !ok; i++) {
                uint64_t t0 = first + (uint64_t)i * ps, t1 = t0 + ps;
                ok = list[i] == p && t1 > tb && t0 < n;
            }
        }
        if (!ok)
            fzc_fail("check_write accepted a write to buffer %u [%llu, +%llu) of room %llu: "
                     "page %llu was not granted", region, (unsigned long long)off,
                     (unsigned long long)len, (unsigned long long)room, (unsigned long long)p);
    }
}

static void fzf_decode(fzc_in_t *in)
{
    fzf_ranks_t *rk = fzf_ranks();
    uint8_t cfg = fzc_u8(in);
    bool two = cfg & 1;
    uint64_t n = fzf_tokens[(cfg >> 1) & 3];
    uint64_t prefix = (cfg & 8) && n > 5 ? 5 : 0;
    kvt_rank_t *me = rk->d1;
    struct kvw_ctx *ctx = fzc_ctx_new(KVW_SIDE_DECODE, me->h);
    ctx->stage.buf = malloc(FZF_STAGING);
    if (ctx->stage.buf == NULL)
        fzc_fail("harness out of memory");
    memset(ctx->stage.buf, 0x5a, FZF_STAGING);
    ctx->stage.len = FZF_STAGING;
    if (two) {
        fzc_peer_add(ctx, fzc_rank_clone(rk->p2[0]->h));
        fzc_peer_add(ctx, fzc_rank_clone(rk->p2[1]->h));
    } else {
        fzc_peer_add(ctx, fzc_rank_clone(rk->p1->h));
    }
    kvw_receiver_h rcv = NULL, idle = NULL;
    if (kvw_receiver_create(ctx, 7, 0, &rcv) != KVW_OK ||
        kvw_receiver_create(ctx, 8, 0, &idle) != KVW_OK)
        fzc_fail("receiver: %s", kvw_last_error());
    fzc_pages_t pg;
    fzc_pages_simple(me, n, 2, 3, &pg);
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = n,
                            .prefix_len = prefix, .pages = pg.side};
    if (kvw_receiver_post(rcv, &post) != KVW_OK)
        fzc_fail("post: %s", kvw_last_error());
    fzc_ctx_drain_wake(ctx);

    /* A second data connection, bound to peer 0 as its BIND would (writes come from it
     * or from the one the input's own BINDs may bind). */
    static char write_ep;
    pthread_mutex_lock(&ctx->mu);
    ctx->binds.tab = malloc(sizeof(*ctx->binds.tab) * 16);
    if (ctx->binds.tab == NULL)
        fzc_fail("harness out of memory");
    ctx->binds.cap = 16;
    ctx->binds.num = 1;
    ctx->binds.tab[0].ep = (kvw_tl_ep_h)(void *)&write_ep;
    ctx->binds.tab[0].peer = 0;
    memcpy(ctx->binds.tab[0].nonce, ctx->peers.tab[0]->bind_nonce, sizeof(ctx->binds.tab[0].nonce));
    pthread_mutex_unlock(&ctx->mu);

    uint32_t nb = kvw_rank_num_buffers(me->h);
    uint8_t hdr[KVW_WIRE_HDR];
    for (uint32_t items = 0; items < 64 && fzc_left(in) > 0; items++) {
        uint8_t kind = fzc_u8(in);
        if (kind % 4 < 2) {
            kvw_peer_t *peer = ctx->peers.tab[(kind >> 2) % ctx->peers.num];
            uint8_t *payload = NULL, type = 0;
            size_t len = 0;
            bool ok;
            if (!fzf_frame(in, hdr, &payload, &len, &ok, &type))
                break;
            pthread_mutex_lock(&ctx->mu);
            if (peer->dead)
                ;
            else if (!ok)
                kvw__peer_dead(ctx, peer, KVW_ERR_MALFORMED, "bad header");
            else
                kvw__handle_frame(ctx, peer, type, payload, (uint32_t)len);
            kvw__run_deferred(ctx); /* as the control thread does on every pass */
            pthread_mutex_unlock(&ctx->mu);
            free(payload);
        } else if (kind % 4 == 2) {
            size_t len = 0;
            uint8_t *msg = fzc_take(in, fzc_u16(in), &len);
            kvw__on_notify(ctx, (kvw_tl_ep_h)(void *)&fzc_ep_dummy, msg, len);
            free(msg);
        } else {
            uint64_t room = fzc_u64(in);
            bool other_ep = (room >> 2) & 1; /* from the connection the input may bind */
            uint32_t region = fzc_u32(in) % (nb + 1);
            uint64_t off = fzc_u64(in), len = fzc_u64(in);
            switch (room & 3) {
            case 0: room = 7; break;
            case 1: room = 8; break;
            case 2: room = 9; break;
            default: break;
            }
            /* In contract: the transport itself confines a write to its registered region
             * before it asks (tcp refuses anything else). */
            uint64_t cap = region < nb ? kvw_rank_buffer(me->h, region)->length : ctx->stage.len;
            off %= cap + 1;
            len %= cap - off + 1;
            kvw_tl_ep_h wep = other_ep ? (kvw_tl_ep_h)(void *)&fzc_ep_dummy
                                       : (kvw_tl_ep_h)(void *)&write_ep;
            if (kvw__check_write(ctx, wep, room, region, off, len) == KVW_OK && len > 0)
                fzf_check_accepted(ctx, me, &pg, n, prefix, room, region, off, len);
        }
        fzc_ctx_drain_wake(ctx);
    }
    FZC_SAY("decode room 7: %s %s\n", kvw_room_state_string(kvw_room_poll(kvw_receiver_room(rcv))),
            kvw_room_failure(kvw_receiver_room(rcv)));
    pthread_mutex_lock(&ctx->mu);
    kvw__check_timeouts(ctx, kvw__now_ns() + 3600ull * 1000000000ull);
    /* Destroying a room waits (up to the peer timeout) for its prefill ranks to confirm
     * that they stopped writing; nobody answers here. */
    ctx->peer_timeout_ms = 1;
    pthread_mutex_unlock(&ctx->mu);
    kvw_room_destroy(kvw_receiver_room(rcv));
    kvw_room_destroy(kvw_receiver_room(idle));
    kvw_ctx_destroy(ctx);
    fzc_check_guards(me, "decode rank after the frames");
}

/* ------------------------------------------------------------------ mode 3 */

static int fzf_connect(const char *addr)
{
    char host[128];
    uint16_t port;
    int fd = -1;
    if (kvw__parse_hostport(addr, host, sizeof(host), &port) != KVW_OK ||
        kvw__tcp_connect(host, port, kvw__now_ns() + 2000000000ull, &fd) != KVW_OK)
        fzc_fail("cannot reach %s: %s", addr, kvw_last_error());
    return fd;
}

static void fzf_bootstrap_server(fzc_in_t *in)
{
    static kvw_bootstrap_t *bs;
    if (bs == NULL && kvw__bootstrap_start("127.0.0.1", 0, NULL, &bs) != KVW_OK)
        fzc_fail("cannot start a bootstrap endpoint: %s", kvw_last_error());
    int fd = fzf_connect(kvw__bootstrap_addr(bs));
    size_t n = fzc_left(in);
    if (n > 60000)
        n = 60000;
    if (n && kvw__sock_send_all(fd, in->p + in->pos, n, kvw__now_ns() + 2000000000ull) != KVW_OK) {
        /* The endpoint may drop a bad connection before reading everything. */
    }
    shutdown(fd, SHUT_WR);
    uint64_t deadline = kvw__now_ns() + 3000000000ull;
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int left = (int)((deadline - KVW_MIN(deadline, kvw__now_ns())) / 1000000);
        if (left <= 0)
            fzc_fail("the bootstrap endpoint kept a finished connection open for 3 s");
        if (poll(&p, 1, left) <= 0)
            continue;
        char b[4096];
        ssize_t k = recv(fd, b, sizeof(b), 0);
        if (k <= 0)
            break;
    }
    close(fd);
}

/* ------------------------------------------------------------------ mode 4 */

typedef struct fzf_fake {
    pthread_mutex_t mu;
    int listen_fd;
    char addr[64];
    uint8_t *reply;
    size_t reply_len;
} fzf_fake_t;

static fzf_fake_t fzf_fake_bs = {.mu = PTHREAD_MUTEX_INITIALIZER, .listen_fd = -1};

static void *fzf_fake_main(void *arg)
{
    fzf_fake_t *f = arg;
    for (;;) {
        int fd = accept4(f->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0)
            continue;
        uint8_t type, *p = NULL;
        uint32_t len;
        if (kvw__sock_recv_frame(fd, kvw__now_ns() + 2000000000ull, &type, &p, &len) == KVW_OK) {
            pthread_mutex_lock(&f->mu);
            (void)kvw__sock_send_all(fd, f->reply, f->reply_len, kvw__now_ns() + 2000000000ull);
            pthread_mutex_unlock(&f->mu);
            free(p);
        }
        close(fd);
    }
    return NULL;
}

static void fzf_bootstrap_lookup(fzc_in_t *in)
{
    fzf_fake_t *f = &fzf_fake_bs;
    if (f->listen_fd < 0) {
        uint16_t port;
        pthread_t t;
        if (kvw__tcp_listen("127.0.0.1", 0, &f->listen_fd, &port) != KVW_OK ||
            pthread_create(&t, NULL, fzf_fake_main, f) != 0)
            fzc_fail("cannot start the fake bootstrap endpoint");
        pthread_detach(t);
        snprintf(f->addr, sizeof(f->addr), "127.0.0.1:%u", port);
    }
    size_t n = fzc_left(in);
    if (n > 200000)
        n = 200000;
    const uint8_t *p = in->p + in->pos;
    /* An empty table only makes the lookup wait for its deadline: skip it. */
    if (n < 4 || (n == 4 && !p[0] && !p[1] && !p[2] && !p[3]))
        return;
    kvw_wbuf_t w;
    kvw__wb_init(&w, KVW_MSG_BS_TABLE);
    for (size_t i = 0; i < n; i++)
        kvw__wb_u8(&w, p[i]);
    if (kvw__wb_finish(&w) != KVW_OK)
        fzc_fail("harness out of memory");
    pthread_mutex_lock(&f->mu);
    free(f->reply);
    f->reply = w.p;
    f->reply_len = w.len;
    pthread_mutex_unlock(&f->mu);
    kvw_bs_entry_t *e = NULL;
    uint32_t count = 0;
    uint64_t t0 = kvw__now_ns();
    kvw_status_t st =
        kvw__bootstrap_lookup(f->addr, 1, 1, 1, NULL, t0 + 2000000000ull, &e, &count);
    FZC_SAY("lookup: %s, %u entries\n", kvw_status_string(st), count);
    if (st == KVW_OK) {
        for (uint32_t i = 0; i < count; i++)
            if (memchr(e[i].addr, '\0', sizeof(e[i].addr)) == NULL)
                fzc_fail("bootstrap entry %u has an unterminated address", i);
        free(e);
    }
    if (kvw__now_ns() - t0 > 1500000000ull)
        fzc_fail("a one-rank lookup of a %zu-byte table took over 1.5 s", n);
}

/* ------------------------------------------------------------------ entry */

int kvw_fuzz_frame(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    fzc_in_t in = {data, size, 1};
    switch (data[0] % 5) {
    case 0:
        fzf_parsers(&in);
        break;
    case 1:
        fzf_prefill(&in);
        break;
    case 2:
        fzf_decode(&in);
        break;
    case 3:
        fzf_bootstrap_server(&in);
        break;
    default:
        fzf_bootstrap_lookup(&in);
        break;
    }
    return 0;
}

#ifndef KVW_FUZZ_NO_ENTRY
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    return kvw_fuzz_frame(data, size);
}
#endif
