/*
 * Peers are bounded on a prefill rank (KVW_MAX_PEERS, set to 1 here) and so are control
 * frames per type:
 *  - a second decode instance's registration is refused with BUSY naming the setting,
 *    while the first instance's room succeeds with every byte checked;
 *  - a registered peer announcing a 1 MiB heartbeat (heartbeats carry at most a tag) is
 *    dropped at once, before anything is allocated for it; once it is gone, the second
 *    instance registers and moves a room.
 *
 * Exit: 0 pass, 1 fail.
 */
#include "testkit.h"
#include "inproc.h"

#include <kvwire/xfer.h>

#include "core/le.h"
#include "proto/proto.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define TOKENS 48
#define DEADLINE_NS kvt_tmo_ns(30000000000ull)

static kvt_model_t model;

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (ip_model("test_peer_bounds", &model))
        return 1;
    setenv("KVW_MAX_PEERS", "1", 1);
    kvt_rank_t src = {0}, da = {0}, db = {0};
    CHECK(ip_rank(&model, 1, 0, 8, 1, &src) == KVW_OK &&
              ip_rank(&model, 1, 0, 8, 1, &da) == KVW_OK &&
              ip_rank(&model, 1, 0, 8, 1, &db) == KVW_OK,
          "%s", kvw_last_error());
    if (failures)
        return 1;
    kvt_rank_fill(&src, 1);
    kvt_rank_fill(&da, 2);
    kvt_rank_fill(&db, 3);
    kvw_ctx_h pctx = NULL, a = NULL, b = NULL;
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, &src, "tcp", "127.0.0.1:0", true);
    p.bootstrap_timeout_ms = kvt_tmo_ms(10000);
    p.wait_timeout_ms = kvt_tmo_ms(20000);
    CHECK(kvw_ctx_create(&p, &pctx) == KVW_OK, "prefill: %s", kvw_last_error());
    if (pctx == NULL)
        return 1;
    char bs[128];
    ip_params_decode(&p, pctx, &da, bs, sizeof(bs));
    p.field_mask |= KVW_CTX_FIELD_INSTANCE;
    p.instance_id = 1;
    CHECK(kvw_ctx_create(&p, &a) == KVW_OK, "decode instance 1: %s", kvw_last_error());
    if (a == NULL)
        return 1;

    /* The second peer is one too many. */
    kvw_ctx_params_t q = p;
    q.rank = db.h;
    q.instance_id = 2;
    q.bootstrap_timeout_ms = kvt_tmo_ms(3000);
    kvw_status_t st = kvw_ctx_create(&q, &b);
    char msg[900];
    CHECK(kvt_expect_failure("a registration past KVW_MAX_PEERS", st, KVW_ERR_BUSY,
                             kvw_last_error(), "this prefill rank already has 1 live peers "
                             "(KVW_MAX_PEERS=1)", msg, sizeof(msg)) == 0,
          "%s", msg);
    if (b)
        kvw_ctx_destroy(b);
    b = NULL;
    ip_room_t room = {.id = 8, .tokens = TOKENS, .seed = 9, .deadline_ns = DEADLINE_NS,
                      .what = "instance 1's room"};
    ip_room_verified(&model, pctx, &src, a, &da, &room);

    /* Instance 1 announces a 1 MiB heartbeat on its control connection. */
    struct kvw_ctx *d = a, *pc = pctx;
    uint8_t hdr[KVW_WIRE_HDR] = {0};
    kvw__le32_put(hdr, KVW_WIRE_MAGIC);
    hdr[4] = KVW_WIRE_VERSION;
    hdr[5] = KVW_MSG_HEARTBEAT;
    kvw__le32_put(hdr + 8, 1u << 20);
    pthread_mutex_lock(&d->mu);
    ssize_t k = send(d->peers.tab[0]->fd, hdr, sizeof(hdr), MSG_NOSIGNAL);
    pthread_mutex_unlock(&d->mu);
    CHECK(k == (ssize_t)sizeof(hdr), "header not sent");
    uint64_t end = kvt_now_ns() + kvt_tmo_ns(3000000000ull);
    bool dead = false;
    while (!dead && kvt_now_ns() < end) {
        pthread_mutex_lock(&pc->mu);
        dead = pc->peers.num > 0 && pc->peers.tab[0]->dead;
        pthread_mutex_unlock(&pc->mu);
        if (!dead)
            usleep(10000);
    }
    CHECK(dead, "the peer announcing a 1 MiB heartbeat is still there");
    kvw_ctx_destroy(a);
    a = NULL;

    /* With instance 1 gone there is room for instance 2. */
    q.bootstrap_timeout_ms = kvt_tmo_ms(10000);
    CHECK(kvw_ctx_create(&q, &b) == KVW_OK, "decode instance 2 once instance 1 left: %s",
          kvw_last_error());
    if (b) {
        room.id = 9;
        room.what = "instance 2's room";
        ip_room_verified(&model, pctx, &src, b, &db, &room);
        kvw_ctx_destroy(b);
    }
    kvw_ctx_destroy(pctx);
    kvt_rank_free(&src);
    kvt_rank_free(&da);
    kvt_rank_free(&db);
    return ip_summary("test_peer_bounds");
}
