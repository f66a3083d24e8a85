/*
 * Helpers shared by the in-process tests (a prefill and a decode context in one
 * process, talking over loopback): CHECK and its failure counter (check.h), host ranks
 * of a preset model, context parameters, one room moved and verified against the test
 * kit's reference, and a few raw-socket and fd helpers for the tests that play a
 * hostile peer. Timeouts are scaled by timeout.h (KVW_TEST_TIMEOUT_SCALE): callers pass
 * values already scaled (kvt_tmo_ms / kvt_tmo_ns), helpers scale their own.
 *
 * Header only: every function is static inline, so a test pays only for what it uses.
 * Include it once, after testkit.h, from the test's own .c file.
 */
#ifndef KVW_TESTS_INPROC_H
#define KVW_TESTS_INPROC_H

#include "check.h"
#include "testkit.h"
#include "timeout.h"

#include <kvwire/xfer.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* ---------------------------------------------------------------- checks */

/* The end of main: prints the verdict under the test's name and returns the exit code
 * (0 pass, 1 fail). */
static inline int ip_summary(const char *test)
{
    if (failures) {
        fprintf(stderr, "%s: %d failures\n", test, failures);
        return 1;
    }
    printf("%s: all checks passed\n", test);
    return 0;
}

/* The first two layers of gpt-oss-120b (full and sliding-window attention). Returns 0,
 * or -1 after saying so on stderr. */
static inline int ip_model(const char *test, kvt_model_t *model)
{
    if (kvt_model_preset("gpt-oss-120b", model) || kvt_model_truncate(model, 2)) {
        fprintf(stderr, "%s: no gpt-oss-120b preset\n", test);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- ranks and contexts */

/* A host rank of `model`: TP rank `tp_rank` of `tp_size`, PP1, DP1, every layer, NHD,
 * pages of 16 tokens, `num_pages` pages per pool and `num_slots` state slots. */
static inline kvw_status_t ip_rank(const kvt_model_t *model, uint32_t tp_size, uint32_t tp_rank,
                                   uint32_t num_pages, uint32_t num_slots, kvt_rank_t *r)
{
    kvt_rank_spec_t s = {.model = model, .layout = KVW_LAYOUT_NHD, .page_size = {16, 16},
                         .num_pages = {num_pages, num_pages}, .num_slots = num_slots};
    s.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = tp_size,
                             .tp_rank = tp_rank, .pp_size = 1,
                             .layer_begin = 0, .layer_end = model->m.num_layers, .dp_size = 1};
    return kvt_rank_build(&s, r);
}

/* A TP1 prefill rank and a TP1 decode rank of 8 pages and one state slot each, their
 * buffers filled with two different patterns (1 and 2). */
static inline kvw_status_t ip_rank_pair(const kvt_model_t *model, kvt_rank_t *src, kvt_rank_t *dst)
{
    kvw_status_t st = ip_rank(model, 1, 0, 8, 1, src);
    if (st == KVW_OK)
        st = ip_rank(model, 1, 0, 8, 1, dst);
    if (st != KVW_OK)
        return st;
    kvt_rank_fill(src, 1);
    kvt_rank_fill(dst, 2);
    return KVW_OK;
}

/* Context parameters naming side, rank, transport, bootstrap address, whether to host
 * it, and timeouts (left 0 here: the caller sets the ones it wants). */
static inline kvw_ctx_params_t ip_params(kvw_side_t side, const kvt_rank_t *r, const char *tl,
                                         const char *bs, bool host)
{
    return (kvw_ctx_params_t){.field_mask = KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK |
                                            KVW_CTX_FIELD_TRANSPORT | KVW_CTX_FIELD_BOOTSTRAP |
                                            KVW_CTX_FIELD_HOST_BOOTSTRAP | KVW_CTX_FIELD_TIMEOUTS,
                              .side = side, .rank = r->h, .transport = tl, .bootstrap_addr = bs,
                              .host_bootstrap = host};
}

/* A context of decode instance `instance` (or, `prefill`, a prefill rank hosting its
 * bootstrap on 127.0.0.1:0), on transport `tl`, with `secret` when it is not empty; a
 * decode context names its prefill instance per room. */
static inline kvw_status_t ip_ctx_instance(kvt_rank_t *r, bool prefill, const char *tl,
                                           const char *secret, uint64_t instance,
                                           kvw_ctx_h *ctx)
{
    kvw_ctx_params_t p = ip_params(prefill ? KVW_SIDE_PREFILL : KVW_SIDE_DECODE, r, tl,
                                   "127.0.0.1:0", prefill);
    if (!prefill)
        p.field_mask &= ~(uint64_t)(KVW_CTX_FIELD_BOOTSTRAP | KVW_CTX_FIELD_HOST_BOOTSTRAP);
    if (secret[0]) {
        p.field_mask |= KVW_CTX_FIELD_SECRET;
        p.secret = secret;
    }
    p.field_mask |= KVW_CTX_FIELD_INSTANCE;
    p.instance_id = instance;
    p.bootstrap_timeout_ms = kvt_tmo_ms(10000);
    p.wait_timeout_ms = kvt_tmo_ms(20000);
    return kvw_ctx_create(&p, ctx);
}

/* Turns the parameters of a prefill context that hosts its bootstrap into those of a
 * decode context for rank `dst` registering there: the address is copied into bs. */
static inline void ip_params_decode(kvw_ctx_params_t *p, kvw_ctx_h pctx, const kvt_rank_t *dst,
                                    char *bs, size_t cap)
{
    snprintf(bs, cap, "%s", kvw_ctx_bootstrap_addr(pctx));
    p->side = KVW_SIDE_DECODE;
    p->rank = dst->h;
    p->bootstrap_addr = bs;
    p->host_bootstrap = 0;
}

/* One prefill rank and n decode instances of TP1 over `tl`: ranks[0] the prefill's,
 * ranks[1 .. n] the decode instances' (8 pages, one state slot, filled with seeds 1, 2,
 * ...); the prefill hosts its bootstrap on 127.0.0.1:0, decode instance i (ids from 1)
 * registers there; wait_ms: the contexts' wait timeout (scaled here). false, with the
 * failed checks, when a rank or a context could not be made. */
static inline bool ip_prefill_decodes(const kvt_model_t *model, const char *tl,
                                      uint64_t wait_ms, uint32_t n, kvt_rank_t *ranks,
                                      kvw_ctx_h *pctx, kvw_ctx_h *dctx)
{
    for (uint32_t i = 0; i <= n; i++) {
        CHECK(ip_rank(model, 1, 0, 8, 1, &ranks[i]) == KVW_OK, "rank %u: %s", i,
              kvw_last_error());
        if (ranks[i].h == NULL)
            return false;
        kvt_rank_fill(&ranks[i], i + 1);
    }
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, &ranks[0], tl, "127.0.0.1:0", true);
    p.bootstrap_timeout_ms = kvt_tmo_ms(10000);
    p.wait_timeout_ms = kvt_tmo_ms(wait_ms);
    CHECK(kvw_ctx_create(&p, pctx) == KVW_OK, "prefill: %s", kvw_last_error());
    if (*pctx == NULL)
        return false;
    char bs[128];
    ip_params_decode(&p, *pctx, &ranks[1], bs, sizeof(bs));
    p.field_mask |= KVW_CTX_FIELD_INSTANCE;
    for (uint32_t i = 0; i < n; i++) {
        p.rank = ranks[i + 1].h;
        p.instance_id = i + 1;
        CHECK(kvw_ctx_create(&p, &dctx[i]) == KVW_OK, "decode instance %u: %s", i + 1,
              kvw_last_error());
        if (dctx[i] == NULL)
            return false;
    }
    return true;
}

/* ---------------------------------------------------------------- rooms */

/* Polls a receiver until Success or Failed, at most deadline_ns (scaled by the caller);
 * returns its state. */
static inline kvw_room_state_t ip_wait_recv(kvw_receiver_h rcv, uint64_t deadline_ns)
{
    uint64_t t0 = kvt_now_ns();
    kvw_room_state_t st;
    while ((st = kvw_room_poll(kvw_receiver_room(rcv))) != KVW_ROOM_SUCCESS &&
           st != KVW_ROOM_FAILED &&
           kvt_now_ns() - t0 < deadline_ns)
        usleep(1000);
    return st;
}

/*
 * Adds to `expect` (per destination buffer) what the reference writes for the whole of
 * a `tokens`-token request from the source ranks srcs[0 .. num_srcs) (reading their own
 * buffers at src_pages) to `dst` at dst_pages; per_src as for kvt_ref_transfer.
 */
static inline void ip_ref(const kvt_model_t *model, const kvt_rank_t *srcs, uint32_t num_srcs,
                          const kvw_side_pages_t *src_pages, const kvt_rank_t *dst,
                          const kvw_side_pages_t *dst_pages, uint8_t *const *expect,
                          uint64_t tokens, uint64_t *per_src)
{
    kvt_ref_side_t *ss = calloc(num_srcs, sizeof(*ss));
    uint8_t ***sd = calloc(num_srcs, sizeof(*sd));
    for (uint32_t k = 0; k < num_srcs; k++) {
        sd[k] = calloc(srcs[k].num_bufs, sizeof(uint8_t *));
        for (uint32_t b = 0; b < srcs[k].num_bufs; b++)
            sd[k][b] = kvt_rank_data(&srcs[k], b);
        ss[k] = kvt_ref_side(&srcs[k], src_pages, sd[k]);
    }
    kvt_ref_side_t ds = kvt_ref_side(dst, dst_pages, expect);
    kvw_chunk_t whole = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = tokens,
                         .chunk_end = tokens, .last_chunk = 1};
    char msg[512];
    CHECK(kvt_ref_transfer(&model->m, ss, num_srcs, &ds, &whole, NULL, per_src, msg,
                           sizeof(msg)) == 0,
          "%s", msg);
    for (uint32_t k = 0; k < num_srcs; k++)
        free(sd[k]);
    free(sd);
    free(ss);
}

/* Every byte of dst's buffers equals `expect` and every guard byte is intact; failures
 * are reported as "<prefix><what differs>". */
static inline void ip_verify(const kvt_rank_t *dst, const kvt_copy_t *expect, const char *prefix)
{
    char msg[512];
    CHECK(kvt_copy_compare(dst, expect, "decode", msg, sizeof(msg)) == 0, "%s%s", prefix, msg);
    CHECK(kvt_rank_check_guards(dst, msg, sizeof(msg)) == 0, "%s%s", prefix, msg);
}

/* One room as ip_room_verified moves it. */
typedef struct ip_room {
    uint64_t id;
    uint64_t tokens;      /* the whole request, sent as one last chunk */
    uint64_t seed;        /* random pages on both sides */
    uint64_t deadline_ns; /* for the receiver to end (scaled: kvt_tmo_ns) */
    const char *what;     /* names the room in the end-state check ("room") */
    void (*posted)(uint64_t id); /* optional: after the receiver posted, before the send */
} ip_room_t;

/*
 * One room from prefill rank `src` (TP1) to decode rank `dst`: random pages on both
 * sides, the receiver posts, the sender sends everything as one chunk, the room must
 * end in Success, and every destination byte must match the reference (guards too).
 */
static inline void ip_room_verified(const kvt_model_t *model, kvw_ctx_h pctx,
                                    const kvt_rank_t *src, kvw_ctx_h dctx, const kvt_rank_t *dst,
                                    const ip_room_t *room)
{
    kvt_rng_t rng = {room->seed};
    kvt_req_spec_t rs = {.full_begin = 0, .full_end = room->tokens, .swa_begin = 0,
                         .swa_end = room->tokens, .state_slot = -1};
    kvt_req_pages_t sp, dp;
    CHECK(kvt_req_pages_make(src, &rs, &rng, &sp) == 0, "source pages");
    CHECK(kvt_req_pages_make(dst, &rs, &rng, &dp) == 0, "destination pages");
    kvt_copy_t expect;
    kvt_copy_make(dst, &expect);
    kvw_receiver_h rcv = NULL;
    kvw_sender_h snd = NULL;
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = room->tokens,
                            .prefix_len = 0, .pages = dp.side};
    CHECK(kvw_receiver_create(dctx, room->id, 0, &rcv) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_receiver_post(rcv, &post) == KVW_OK, "%s", kvw_last_error());
    if (room->posted)
        room->posted(room->id);
    CHECK(kvw_sender_create(pctx, room->id, &snd) == KVW_OK, "%s", kvw_last_error());
    kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = room->tokens,
                          .chunk_begin = 0,
                          .chunk_end = room->tokens, .last_chunk = 1, .pages = sp.side};
    CHECK(kvw_sender_send(snd, &c) == KVW_OK, "%s", kvw_last_error());
    kvw_room_state_t st = ip_wait_recv(rcv, room->deadline_ns);
    CHECK(st == KVW_ROOM_SUCCESS, "%s ended %s: %s", room->what, kvw_room_state_string(st),
          kvw_room_failure(kvw_receiver_room(rcv)));
    ip_ref(model, src, 1, &sp.side, dst, &dp.side, expect.data, room->tokens, NULL);
    ip_verify(dst, &expect, "");
    kvw_room_destroy(kvw_sender_room(snd));
    kvw_room_destroy(kvw_receiver_room(rcv));
    kvt_copy_free(&expect);
    kvt_req_pages_free(&sp);
    kvt_req_pages_free(&dp);
}

/* ---------------------------------------------------------------- fds and raw sockets */

/* The process's open fds (not counting the one that lists them), or -1. */
static inline int ip_count_fds(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    if (d == NULL)
        return -1;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        n += e->d_name[0] != '.';
    closedir(d);
    return n - 1; /* the directory's own fd */
}

/* A raw connection to 127.0.0.1:port; -1 on failure. Waits up to 10 s (scaled). */
static inline int ip_raw_connect(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 && errno != EINPROGRESS) {
        close(fd);
        return -1;
    }
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    int err = 0;
    socklen_t el = sizeof(err);
    if (poll(&p, 1, (int)kvt_tmo_ms(10000)) != 1 ||
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0 || err) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Waits until the other end closed `fd` (EOF or reset), up to timeout_ms (scaled by the
 * caller). */
static inline bool ip_closed_by_peer(int fd, int timeout_ms)
{
    uint64_t end = kvt_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        uint64_t now = kvt_now_ns();
        if (now >= end)
            return false;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, (int)((end - now) / 1000000ull) + 1) < 0 && errno != EINTR)
            return false;
        char b[64];
        ssize_t k = recv(fd, b, sizeof(b), MSG_DONTWAIT);
        if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
            return true;
    }
}

#endif
