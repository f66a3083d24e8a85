/*
 * The prefill control port under silent connections: 70 raw connections that never send
 * a registration take the handshake slots (64), yet an honest decode rank still
 * registers (the oldest silent connection gives way), and every silent connection is
 * closed by the prefill rank within its handshake timeout (the test waits up to 60 s).
 *
 * Exit: 0 pass, 1 fail.
 */
#include "testkit.h"
#include "inproc.h"

#include <kvwire/xfer.h>

#include "proto/proto.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>


#define SILENT 70

static kvt_model_t model;

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (ip_model("test_handshake_slots", &model))
        return 1;
    kvt_rank_t src = {0}, dst = {0};
    CHECK(ip_rank(&model, 1, 0, 8, 1, &src) == KVW_OK &&
              ip_rank(&model, 1, 0, 8, 1, &dst) == KVW_OK,
          "%s", kvw_last_error());
    if (failures)
        return 1;
    /* A long peer timeout (it bounds each handshake too): the silent connections would
     * hold their slots for the whole test if nothing displaced them. */
    kvw_ctx_h pctx = NULL, dctx = NULL;
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, &src, "tcp", "127.0.0.1:0", true);
    p.bootstrap_timeout_ms = kvt_tmo_ms(10000);
    p.peer_timeout_ms = kvt_tmo_ms(15000);
    p.heartbeat_ms = 200;
    CHECK(kvw_ctx_create(&p, &pctx) == KVW_OK, "prefill: %s", kvw_last_error());
    if (pctx == NULL)
        return 1;
    uint16_t port = ((struct kvw_ctx *)pctx)->listen_port;
    int silent[SILENT], opened = 0;
    for (int i = 0; i < SILENT; i++)
        opened += (silent[i] = ip_raw_connect(port)) >= 0;
    CHECK(opened == SILENT, "only %d of %d silent connections opened", opened, SILENT);
    /* Each silent connection was accepted once it holds the prefill's challenge. */
    for (int i = 0; i < SILENT; i++) {
        struct pollfd pf = {.fd = silent[i], .events = POLLIN};
        if (silent[i] >= 0)
            poll(&pf, 1, (int)kvt_tmo_ms(10000));
    }

    char bs[128];
    ip_params_decode(&p, pctx, &dst, bs, sizeof(bs));
    p.peer_timeout_ms = kvt_tmo_ms(10000);
    kvw_status_t st = kvw_ctx_create(&p, &dctx);
    CHECK(st == KVW_OK, "an honest decode rank could not register beside %d silent "
          "connections: %s: %s", SILENT, kvw_status_string(st), kvw_last_error());

    int closed = 0;
    for (int i = 0; i < SILENT; i++)
        if (silent[i] >= 0) {
            closed += ip_closed_by_peer(silent[i], kvt_tmo_ms(60000));
            close(silent[i]);
        }
    CHECK(closed == opened, "%d of %d silent connections were never closed", opened - closed,
          opened);
    if (dctx)
        kvw_ctx_destroy(dctx);
    kvw_ctx_destroy(pctx);
    kvt_rank_free(&src);
    kvt_rank_free(&dst);
    return ip_summary("test_handshake_slots");
}
