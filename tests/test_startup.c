/*
 * Start-up of a decode rank against a prefill instance of several ranks.
 *
 * 1. A decode rank is heard while it registers. Prefill instance of TP 2: rank 0 a
 *    real context with a short peer timeout (P), rank 1 a listener of this test that
 *    accepts the decode's registration connection and says nothing for 3 P before it
 *    closes it. The decode rank registers with rank 0 and then waits on rank 1, inside
 *    kvw_ctx_create, for all that time. Rank 0 must still count it alive (connected,
 *    none died) after 3 P: the decode rank answers heartbeats from its registration on.
 *    (Before, its control thread started only once every rank had answered, and
 *    rank 0 declared a silent decode rank dead after P: on a loaded host, a large
 *    instance made creation take longer than the peer timeout.) The creation then
 *    fails, naming rank 1.
 *
 * 2. An instance connected again past its live ranks. Prefill TP 2 of two real
 *    contexts, decode TP1. Prefill rank 1 drops its decode peer: the decode sees the
 *    instance go down. The next room connects the instance again, and every prefill
 *    rank refuses a second registration of a decode rank whose first one is alive:
 *    the decode must drop its previous connection to rank 0 for the new one to
 *    register. The room must succeed with every byte verified (before, rank 0 answered
 *    BUSY until the timeout and the room failed).
 *
 * No timing is asserted: the waits only give a failure the time to happen.
 * Exit: 0 pass, 1 fail.
 */
#include "testkit.h"
#include "inproc.h"

#include <kvwire/xfer.h>

#include "proto/proto.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static kvt_model_t model;

static void metrics(kvw_ctx_h ctx, uint64_t *up, uint64_t *died)
{
    kvw_ctx_metrics_t m = {.field_mask = KVW_CTX_METRICS_FIELD_PEERS_CONNECTED |
                                         KVW_CTX_METRICS_FIELD_PEERS_DIED};
    CHECK(kvw_ctx_metrics(ctx, &m) == KVW_OK, "%s", kvw_last_error());
    *up = m.peers_connected;
    *died = m.peers_died;
}

/* ------------------------------------------------------------ 1: heard while registering */

typedef struct silent_rank {
    int listen_fd;
    kvw_ctx_h rank0;
    uint32_t hold_ms;
    bool accepted;
    uint64_t up, died; /* rank 0's peers after the hold */
} silent_rank_t;

static void *silent_main(void *arg)
{
    silent_rank_t *s = arg;
    struct pollfd pf = {.fd = s->listen_fd, .events = POLLIN};
    if (poll(&pf, 1, (int)kvt_tmo_ms(30000)) != 1)
        return NULL;
    int fd = accept(s->listen_fd, NULL, NULL);
    if (fd < 0)
        return NULL;
    s->accepted = true;
    usleep(s->hold_ms * 1000u);
    metrics(s->rank0, &s->up, &s->died);
    close(fd); /* the decode's registration with this rank fails now */
    return NULL;
}

static void heard_while_registering(void)
{
    kvt_rank_t src = {0}, dst = {0};
    CHECK(ip_rank(&model, 2, 0, 8, 1, &src) == KVW_OK &&
              ip_rank(&model, 1, 0, 8, 1, &dst) == KVW_OK,
          "%s", kvw_last_error());
    kvw_ctx_h pctx = NULL, dctx = NULL;
    uint32_t peer_ms = kvt_tmo_ms(1000);
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, &src, "tcp", "127.0.0.1:0", true);
    p.bootstrap_timeout_ms = kvt_tmo_ms(20000);
    p.peer_timeout_ms = peer_ms;
    p.heartbeat_ms = 50;
    CHECK(kvw_ctx_create(&p, &pctx) == KVW_OK, "prefill rank 0: %s", kvw_last_error());
    silent_rank_t s = {.listen_fd = -1, .rank0 = pctx, .hold_ms = 3 * peer_ms};
    uint16_t port = 0;
    char bs[128];
    if (pctx) {
        CHECK(kvw__tcp_listen("127.0.0.1", 0, &s.listen_fd, &port) == KVW_OK, "%s",
              kvw_last_error());
        snprintf(bs, sizeof(bs), "%s", kvw_ctx_bootstrap_addr(pctx));
    }
    if (s.listen_fd >= 0) {
        /* Rank 1 of the instance, by its entry: the address of the silent listener. */
        kvw_bs_entry_t e = {.dp = 0, .tp = 1, .pp = 0, .dp_size = 1, .tp_size = 2, .pp_size = 1};
        snprintf(e.addr, sizeof(e.addr), "127.0.0.1:%u", port);
        CHECK(kvw__bootstrap_register(bs, &e, "", kvw__now_ns() + kvt_tmo_ns(10000000000ull)) ==
                  KVW_OK,
              "%s", kvw_last_error());
    }
    pthread_t t;
    bool started = s.listen_fd >= 0 && pthread_create(&t, NULL, silent_main, &s) == 0;
    CHECK(s.listen_fd < 0 || started, "cannot start the silent rank's thread");
    if (started) {
        ip_params_decode(&p, pctx, &dst, bs, sizeof(bs));
        p.peer_timeout_ms = kvt_tmo_ms(20000);
        kvw_status_t st = kvw_ctx_create(&p, &dctx);
        char why[512];
        snprintf(why, sizeof(why), "%s", kvw_last_error());
        pthread_join(t, NULL);
        CHECK(s.accepted, "the decode rank never connected to the silent rank 1");
        CHECK(s.up == 1 && s.died == 0, "prefill rank 0 counts %llu live and %llu dead decode "
              "peers after the decode rank spent %u ms registering with another rank (peer "
              "timeout %u ms): want 1 live, none dead", (unsigned long long)s.up,
              (unsigned long long)s.died, s.hold_ms, peer_ms);
        CHECK(st != KVW_OK, "the decode context was created without rank 1's registration");
        char want[64];
        snprintf(want, sizeof(want), "127.0.0.1:%u", port);
        CHECK(st == KVW_OK || (strstr(why, want) && strstr(why, "challenge")),
              "the failure does not name the silent rank (%s): %s", want, why);
    }
    if (dctx)
        kvw_ctx_destroy(dctx);
    if (s.listen_fd >= 0)
        close(s.listen_fd);
    if (pctx)
        kvw_ctx_destroy(pctx);
    kvt_rank_free(&src);
    kvt_rank_free(&dst);
}

/* ------------------------------------------------------------ 2: connected again */

static bool inst_down(kvw_ctx_h dctx)
{
    struct kvw_ctx *c = (struct kvw_ctx *)dctx;
    pthread_mutex_lock(&c->mu);
    bool down = c->insts.num > 0 && c->insts.tab[0].state == KVW_INST_DOWN;
    pthread_mutex_unlock(&c->mu);
    return down;
}

static void connected_again(void)
{
    int failures0 = failures;
    kvt_rank_t src[2], dst;
    memset(src, 0, sizeof(src));
    memset(&dst, 0, sizeof(dst));
    CHECK(ip_rank(&model, 2, 0, 8, 1, &src[0]) == KVW_OK &&
              ip_rank(&model, 2, 1, 8, 1, &src[1]) == KVW_OK &&
              ip_rank(&model, 1, 0, 8, 1, &dst) == KVW_OK,
          "%s", kvw_last_error());
    kvt_rank_fill(&src[0], 11);
    kvt_rank_fill(&src[1], 12);
    kvw_ctx_h pctx[2] = {NULL, NULL}, dctx = NULL;
    char bs[128];
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, &src[0], "tcp", "127.0.0.1:0", true);
    p.bootstrap_timeout_ms = kvt_tmo_ms(10000);
    p.wait_timeout_ms = kvt_tmo_ms(20000);
    CHECK(kvw_ctx_create(&p, &pctx[0]) == KVW_OK, "prefill rank 0: %s", kvw_last_error());
    if (pctx[0]) {
        snprintf(bs, sizeof(bs), "%s", kvw_ctx_bootstrap_addr(pctx[0]));
        p.rank = src[1].h;
        p.bootstrap_addr = bs;
        p.host_bootstrap = 0;
        CHECK(kvw_ctx_create(&p, &pctx[1]) == KVW_OK, "prefill rank 1: %s", kvw_last_error());
    }
    if (pctx[1]) {
        ip_params_decode(&p, pctx[0], &dst, bs, sizeof(bs));
        CHECK(kvw_ctx_create(&p, &dctx) == KVW_OK, "decode: %s", kvw_last_error());
    }
    if (dctx) {
        /* A prefill rank adds its peer after it sent ACCEPT: wait for both. */
        uint64_t up = 0, died = 0, t0 = kvt_now_ns();
        for (int k = 0; k < 2; k++)
            do {
                metrics(pctx[k], &up, &died);
            } while (up != 1 && kvt_now_ns() - t0 < kvt_tmo_ns(20000000000ull) &&
                     usleep(2000) == 0);
        CHECK(up == 1, "prefill rank 1 counts %llu decode peers", (unsigned long long)up);
        /* Prefill rank 1 drops the decode rank (as on a heartbeat timeout). */
        struct kvw_ctx *c1 = (struct kvw_ctx *)pctx[1];
        pthread_mutex_lock(&c1->mu);
        for (uint32_t i = 0; i < kvw__peer_count(c1); i++)
            kvw__peer_doom(c1, kvw__peer_at(c1, i), KVW_ERR_PEER_DEAD, "dropped by the test");
        pthread_mutex_unlock(&c1->mu);
        t0 = kvt_now_ns();
        while (!inst_down(dctx) && kvt_now_ns() - t0 < kvt_tmo_ns(20000000000ull))
            usleep(2000);
        CHECK(inst_down(dctx), "the decode never saw its instance go down");
    }
    if (dctx && failures == failures0) {
        /* One room over both prefill ranks: the instance is connected again for it. */
        kvt_rng_t rng = {77};
        kvt_req_spec_t rs = {.full_begin = 0, .full_end = 40, .swa_begin = 0, .swa_end = 40,
                             .state_slot = -1};
        kvt_req_pages_t sp, dp;
        CHECK(kvt_req_pages_make(&src[0], &rs, &rng, &sp) == 0, "source pages");
        CHECK(kvt_req_pages_make(&dst, &rs, &rng, &dp) == 0, "destination pages");
        kvt_copy_t expect;
        kvt_copy_make(&dst, &expect);
        kvw_receiver_h rcv = NULL;
        kvw_sender_h snd[2] = {NULL, NULL};
        kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = 40,
                                .pages = dp.side};
        CHECK(kvw_receiver_create(dctx, 5, 0, &rcv) == KVW_OK &&
                  kvw_receiver_post(rcv, &post) == KVW_OK,
              "%s", kvw_last_error());
        kvw_send_chunk_t ch = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = 40,
                               .chunk_end = 40, .last_chunk = 1, .pages = sp.side};
        for (int k = 0; k < 2; k++)
            CHECK(kvw_sender_create(pctx[k], 5, &snd[k]) == KVW_OK &&
                      kvw_sender_send(snd[k], &ch) == KVW_OK,
                  "prefill rank %d: %s", k, kvw_last_error());
        kvw_room_state_t st = rcv ? ip_wait_recv(rcv, kvt_tmo_ns(30000000000ull))
                                  : KVW_ROOM_FAILED;
        CHECK(st == KVW_ROOM_SUCCESS, "the room after the instance went down ended %s: %s",
              kvw_room_state_string(st), rcv ? kvw_room_failure(kvw_receiver_room(rcv)) : "");
        if (st == KVW_ROOM_SUCCESS) {
            ip_ref(&model, src, 2, &sp.side, &dst, &dp.side, expect.data, 40, NULL);
            ip_verify(&dst, &expect, "");
        }
        /* Each prefill rank holds one live registration of the decode rank, the
         * second; the first went on both. */
        for (int k = 0; k < 2; k++) {
            uint64_t up, died;
            metrics(pctx[k], &up, &died);
            CHECK(up == 1 && died == 1, "prefill rank %d: %llu live, %llu dead decode peers "
                  "(want 1 and 1)", k, (unsigned long long)up, (unsigned long long)died);
        }
        for (int k = 0; k < 2; k++)
            if (snd[k])
                kvw_room_destroy(kvw_sender_room(snd[k]));
        if (rcv)
            kvw_room_destroy(kvw_receiver_room(rcv));
        kvt_copy_free(&expect);
        kvt_req_pages_free(&sp);
        kvt_req_pages_free(&dp);
    }
    if (dctx)
        kvw_ctx_destroy(dctx);
    for (int k = 1; k >= 0; k--)
        if (pctx[k])
            kvw_ctx_destroy(pctx[k]);
    kvt_rank_free(&src[0]);
    kvt_rank_free(&src[1]);
    kvt_rank_free(&dst);
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (ip_model("test_startup", &model))
        return 1;
    heard_while_registering();
    connected_again();
    return ip_summary("test_startup");
}
