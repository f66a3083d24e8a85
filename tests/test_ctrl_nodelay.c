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
#include <string.h>
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
    kvt_rank_t rk[3];
    memset(rk, 0, sizeof(rk));
    kvw_ctx_h pctx = NULL, dc[2] = {NULL, NULL};
    if (!ip_prefill_decodes(&model, "tcp", 30000, 2, rk, &pctx, dc))
        return ip_summary("test_ctrl_nodelay");
    kvw_ctx_h a = dc[0], b = dc[1];
    ip_room_t ra = {.id = 1, .tokens = TOKENS, .seed = 4, .deadline_ns = DEADLINE_NS,
                    .what = "decode instance 1's room"};
    ip_room_verified(&model, pctx, &rk[0], a, &rk[1], &ra);
    ip_room_t rb = {.id = 2, .tokens = TOKENS, .seed = 5, .deadline_ns = DEADLINE_NS,
                    .what = "decode instance 2's room"};
    ip_room_verified(&model, pctx, &rk[0], b, &rk[2], &rb);

    uint32_t np = check_peers(pctx, "prefill (accepted sockets)");
    uint32_t na = check_peers(a, "decode instance 1 (connected)");
    uint32_t nb = check_peers(b, "decode instance 2 (connected)");
    CHECK(np == 2 && na == 1 && nb == 1, "control sockets: prefill %u (want 2), decode %u and "
          "%u (want 1 each)", np, na, nb);
    printf("control sockets with TCP_NODELAY: prefill %u, decode %u + %u\n", np, na, nb);

    kvw_ctx_destroy(b);
    kvw_ctx_destroy(a);
    kvw_ctx_destroy(pctx);
    for (int i = 0; i < 3; i++)
        kvt_rank_free(&rk[i]);
    return ip_summary("test_ctrl_nodelay");
}
