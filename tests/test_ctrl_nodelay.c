/*
 * Control channels send without Nagle's algorithm on both ends. A decode rank connects
 * to the prefill rank's listener; the prefill's end is the accepted socket, which does
 * not get TCP_NODELAY from the connecting side. With Nagle on it, a frame the prefill
 * writes while an earlier one is unacknowledged (four 4.6 KB DIGEST frames of a TP4 ->
 * TP1 room, a STAGE_ASK behind a confirmation) waits for the decode's delayed ACK: on
 * one H200, verified TP4 -> TP1 rooms waited 35-40 ms for their DIGEST frames that way.
 *
 * A prefill context and two decode contexts (tcp, real bootstrap and handshakes) move
 * one honest room each, checked byte for byte; then every control socket of the three
 * contexts, connected and accepted, must have TCP_NODELAY set.
 *
 * Exit: 0 pass, 1 fail.
 */
#include "testkit.h"
#include "inproc.h"

#include <kvwire/xfer.h>

#include "proto/proto.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <sys/socket.h>

#define TOKENS 48
#define DEADLINE_NS kvt_tmo_ns(30000000000ull)

static kvt_model_t model;

/* Checks TCP_NODELAY on every live peer's control socket of ctx; returns how many. */
static uint32_t check_peers(struct kvw_ctx *ctx, const char *who)
{
    uint32_t n = 0;
    pthread_mutex_lock(&ctx->mu);
    for (uint32_t i = 0; i < kvw__peer_count(ctx); i++) {
        kvw_peer_t *p = kvw__peer_at(ctx, i);
        if (p->dead || p->fd < 0)
            continue;
        int v = 0;
        socklen_t len = sizeof(v);
        int rc = getsockopt(p->fd, IPPROTO_TCP, TCP_NODELAY, &v, &len);
        CHECK(rc == 0 && v != 0, "%s: the control socket of peer %u (%s) has TCP_NODELAY %s",
              who, i, p->desc, rc == 0 ? "off" : "unreadable");
        n++;
    }
    pthread_mutex_unlock(&ctx->mu);
    return n;
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (ip_model("test_ctrl_nodelay", &model))
        return 1;
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
    p.wait_timeout_ms = kvt_tmo_ms(30000);
    CHECK(kvw_ctx_create(&p, &pctx) == KVW_OK, "prefill: %s", kvw_last_error());
    if (pctx == NULL)
        return 1;
    char bs[128];
    ip_params_decode(&p, pctx, &da, bs, sizeof(bs));
    p.field_mask |= KVW_CTX_FIELD_INSTANCE;
    p.instance_id = 1;
    CHECK(kvw_ctx_create(&p, &a) == KVW_OK, "decode instance 1: %s", kvw_last_error());
    p.rank = db.h;
    p.instance_id = 2;
    CHECK(kvw_ctx_create(&p, &b) == KVW_OK, "decode instance 2: %s", kvw_last_error());
    if (a == NULL || b == NULL)
        return 1;
    ip_room_t ra = {.id = 1, .tokens = TOKENS, .seed = 4, .deadline_ns = DEADLINE_NS,
                    .what = "decode instance 1's room"};
    ip_room_verified(&model, pctx, &src, a, &da, &ra);
    ip_room_t rb = {.id = 2, .tokens = TOKENS, .seed = 5, .deadline_ns = DEADLINE_NS,
                    .what = "decode instance 2's room"};
    ip_room_verified(&model, pctx, &src, b, &db, &rb);

    uint32_t np = check_peers(pctx, "prefill (accepted sockets)");
    uint32_t na = check_peers(a, "decode instance 1 (connected)");
    uint32_t nb = check_peers(b, "decode instance 2 (connected)");
    CHECK(np == 2 && na == 1 && nb == 1, "control sockets: prefill %u (want 2), decode %u and "
          "%u (want 1 each)", np, na, nb);
    printf("control sockets with TCP_NODELAY: prefill %u, decode %u + %u\n", np, na, nb);

    kvw_ctx_destroy(b);
    kvw_ctx_destroy(a);
    kvw_ctx_destroy(pctx);
    kvt_rank_free(&src);
    kvt_rank_free(&da);
    kvt_rank_free(&db);
    return ip_summary("test_ctrl_nodelay");
}
