/*
 * The bootstrap endpoint under hostile clients (raw sockets on loopback):
 *  - a silent connection, and one that stops in the middle of a frame, are closed by
 *    the endpoint (frame deadline, a few seconds; the test waits up to 60 s);
 *  - 300 silent connections and 10 slow senders held open do not stop a registration
 *    and a lookup from succeeding (10 s deadline each, generous on a loaded machine);
 *  - a full table refuses a new rank with an error answer naming the cause, while a
 *    rank already in the table can still re-register;
 *  - the endpoint leaves no fd behind when it stops.
 * (KVW_BS_MAX_SOURCE_ENTRIES is raised to the table's size: every registration here
 * comes from 127.0.0.1.)
 *
 * Exit: 0 pass, 1 fail.
 */
#include "testkit.h"
#include "inproc.h"

#include "proto/proto.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>


#define SILENT 300
#define SLOW 10
#define SEC 1000000000ull

static uint16_t port_of(const char *addr)
{
    const char *c = strrchr(addr, ':');
    return c ? (uint16_t)atoi(c + 1) : 0;
}

static kvw_bs_entry_t entry(uint32_t tp, uint32_t tp_size)
{
    kvw_bs_entry_t e = {.tp = tp, .tp_size = tp_size, .dp_size = 1, .pp_size = 1};
    snprintf(e.addr, sizeof(e.addr), "127.0.0.1:%u", 20000 + tp % 1000);
    return e;
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    /* The table is filled from one source here; the per-source bound (1024 by default)
     * has its own test (test_bootstrap_live). */
    setenv("KVW_BS_MAX_SOURCE_ENTRIES", "4096", 1);
    int fds_before = ip_count_fds();
    kvw_bootstrap_t *bs = NULL;
    CHECK(kvw__bootstrap_start("127.0.0.1", 0, NULL, &bs) == KVW_OK, "%s", kvw_last_error());
    if (bs == NULL)
        return 1;
    char addr[128];
    snprintf(addr, sizeof(addr), "%s", kvw__bootstrap_addr(bs));
    uint16_t port = port_of(addr);

    /* 1. Silent and half-frame connections are closed by the endpoint. */
    int quiet = ip_raw_connect(port), half = ip_raw_connect(port);
    CHECK(quiet >= 0 && half >= 0, "connect: %s", strerror(errno));
    CHECK(send(half, "KVW", 3, MSG_NOSIGNAL) == 3, "send: %s", strerror(errno));
    CHECK(ip_closed_by_peer(quiet, kvt_tmo_ms(60000)), "a silent connection was never closed");
    CHECK(ip_closed_by_peer(half, kvt_tmo_ms(60000)),
          "a connection stuck inside a frame was never closed");
    close(quiet);
    close(half);
    printf("silent and half-frame connections closed\n");

    /* 2. Many silent connections and slow senders: registration and lookup still work. */
    int silent[SILENT], slow[SLOW];
    int opened = 0;
    for (int i = 0; i < SILENT; i++)
        opened += (silent[i] = ip_raw_connect(port)) >= 0;
    for (int i = 0; i < SLOW; i++) {
        slow[i] = ip_raw_connect(port);
        if (slow[i] >= 0 && send(slow[i], "K", 1, MSG_NOSIGNAL) != 1) {
            close(slow[i]);
            slow[i] = -1;
        }
    }
    printf("%d silent connections and %d slow senders open\n", opened, SLOW);
    kvw_bs_entry_t e = entry(0, 1);
    kvw_status_t st = kvw__bootstrap_register(addr, &e, NULL, kvt_now_ns() + kvt_tmo_ns(10 * SEC));
    CHECK(st == KVW_OK, "register beside silent connections: %s: %s", kvw_status_string(st),
          kvw_last_error());
    kvw_bs_entry_t *tab = NULL;
    uint32_t n = 0;
    st = kvw__bootstrap_lookup(addr, 1, 1, 1, NULL, kvt_now_ns() + kvt_tmo_ns(10 * SEC), &tab, &n);
    CHECK(st == KVW_OK && n == 1 && !strcmp(tab[0].addr, e.addr),
          "lookup beside silent connections: %s: %s", kvw_status_string(st), kvw_last_error());
    free(tab);
    for (int i = 0; i < SILENT; i++)
        if (silent[i] >= 0)
            close(silent[i]);
    for (int i = 0; i < SLOW; i++)
        if (slow[i] >= 0)
            close(slow[i]);

    /* 3. A full table refuses a new rank with a reason; known ranks re-register. */
    uint32_t ok = 0;
    for (uint32_t i = 0; i < 4096; i++) {
        e = entry(i, 8192);
        ok += kvw__bootstrap_register(addr, &e, NULL,
                                      kvt_now_ns() + kvt_tmo_ns(10 * SEC)) == KVW_OK;
    }
    CHECK(ok == 4096, "only %u of 4096 registrations succeeded: %s", ok, kvw_last_error());
    e = entry(4096, 8192);
    st = kvw__bootstrap_register(addr, &e, NULL, kvt_now_ns() + kvt_tmo_ns(10 * SEC));
    CHECK(st == KVW_ERR_BUSY, "registration into a full table: %s", kvw_status_string(st));
    CHECK(kvt_contains(kvw_last_error(), "bootstrap table is full (4096 entries): rank "
                                         "dp0/tp4096/pp0 was not registered"),
          "message: %s", kvw_last_error());
    e = entry(7, 8192);
    st = kvw__bootstrap_register(addr, &e, NULL, kvt_now_ns() + kvt_tmo_ns(10 * SEC));
    CHECK(st == KVW_OK, "re-registration into a full table: %s: %s", kvw_status_string(st),
          kvw_last_error());

    kvw__bootstrap_stop(bs);
    int fds_after = ip_count_fds();
    CHECK(fds_after == fds_before, "fds: %d before the endpoint, %d after it stopped",
          fds_before, fds_after);
    return ip_summary("test_bootstrap_limits");
}
