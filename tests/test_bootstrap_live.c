/*
 * The bootstrap endpoint keeps live ranks' entries and shares the table between sources
 * (raw registrations from 127.0.0.2 beside a real held one from 127.0.0.1):
 *  - while a rank's held registration connection is open, a registration of another
 *    geometry is refused (BUSY, naming the live rank) and the live entry stays, as does
 *    one for the same position from another address; once the connection closes, the
 *    new geometry registers;
 *  - one source registers at most KVW_BS_MAX_SOURCE_ENTRIES (1024) entries: the next is
 *    refused naming the setting, and another source still registers and looks up;
 *  - a lookup at a hostile endpoint whose table holds a junk entry beside a complete
 *    instance succeeds when the junk is not what it needs (with the secret: no valid
 *    MAC; with expected sizes: another geometry).
 * Before these bounds the other geometry wiped the live entry, and one source filled
 * the table.
 *
 * Exit: 0 pass, 1 fail.
 */
#include "testkit.h"
#include "inproc.h"

#include "core/le.h"
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

#define SEC 1000000000ull

static uint16_t port_of(const char *addr)
{
    const char *c = strrchr(addr, ':');
    return c ? (uint16_t)atoi(c + 1) : 0;
}

static kvw_bs_entry_t entry(uint32_t tp, uint32_t tp_size, uint32_t port)
{
    kvw_bs_entry_t e = {.tp = tp, .tp_size = tp_size, .dp_size = 1, .pp_size = 1};
    snprintf(e.addr, sizeof(e.addr), "127.0.0.1:%u", port);
    return e;
}

/* A one-shot registration from `from` (127.0.0.x) on a connection of its own. Returns
 * the answer's frame type (-1: none); an error answer's reason goes into why. */
static int raw_register(const char *from, uint16_t port, const kvw_bs_entry_t *e, char *why,
                        size_t cap)
{
    why[0] = '\0';
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in me = {.sin_family = AF_INET};
    inet_pton(AF_INET, from, &me.sin_addr);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || bind(fd, (struct sockaddr *)&me, sizeof(me)) != 0 ||
        connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    kvw_wbuf_t w;
    kvw__wb_init(&w, KVW_MSG_BS_REGISTER);
    kvw__bootstrap_put_entry(&w, e);
    uint8_t type = 0, *p = NULL;
    uint32_t len = 0;
    uint64_t deadline = kvt_now_ns() + kvt_tmo_ns(10 * SEC);
    int ret = -1;
    if (kvw__wb_finish(&w) == KVW_OK && kvw__sock_send_all(fd, w.p, w.len, deadline) == KVW_OK &&
        kvw__sock_recv_frame(fd, deadline, &type, &p, &len) == KVW_OK) {
        ret = type;
        if (type == KVW_MSG_BS_ERROR) {
            kvw_rbuf_t r;
            kvw__rb_init(&r, p, len);
            (void)kvw__rb_u32(&r);
            kvw__rb_str(&r, why, cap);
        }
    }
    free(p);
    kvw__wb_free(&w);
    close(fd);
    return ret;
}

/* A hostile endpoint: answers every request on 127.0.0.1 with a fixed table. */
typedef struct fake {
    int lfd;
    uint16_t port;
    kvw_bs_entry_t tab[2];
    uint32_t n;
    pthread_t t;
} fake_t;

static void *fake_main(void *arg)
{
    fake_t *f = arg;
    for (;;) {
        int fd = accept(f->lfd, NULL, NULL);
        if (fd < 0)
            return NULL;
        uint8_t type, *p = NULL;
        uint32_t len;
        uint64_t deadline = kvt_now_ns() + kvt_tmo_ns(5 * SEC);
        if (kvw__sock_recv_frame(fd, deadline, &type, &p, &len) == KVW_OK) {
            kvw_wbuf_t w;
            kvw__wb_init(&w, KVW_MSG_BS_TABLE);
            kvw__wb_u32(&w, f->n);
            for (uint32_t i = 0; i < f->n; i++)
                kvw__bootstrap_put_entry(&w, &f->tab[i]);
            if (kvw__wb_finish(&w) == KVW_OK)
                (void)kvw__sock_send_all(fd, w.p, w.len, deadline);
            kvw__wb_free(&w);
        }
        free(p);
        close(fd);
    }
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    kvw_bootstrap_t *bs = NULL;
    CHECK(kvw__bootstrap_start("127.0.0.1", 0, NULL, &bs) == KVW_OK, "%s", kvw_last_error());
    if (bs == NULL)
        return 1;
    char addr[128], why[400];
    snprintf(addr, sizeof(addr), "%s", kvw__bootstrap_addr(bs));
    uint16_t port = port_of(addr);

    /* 1. A live rank (TP1, held) and registrations that would displace it. */
    kvw_bs_entry_t live = entry(0, 1, 21000);
    int hold = -1;
    kvw_status_t st = kvw__bootstrap_hold(addr, &live, NULL, kvt_now_ns() + kvt_tmo_ns(10 * SEC),
                                          &hold);
    CHECK(st == KVW_OK, "held registration: %s", kvw_last_error());
    kvw_bs_entry_t other = entry(1, 2, 1); /* TP2: another geometry, a junk address */
    int t = raw_register("127.0.0.2", port, &other, why, sizeof(why));
    CHECK(t == KVW_MSG_BS_ERROR &&
              kvt_contains(why, "live rank dp0/tp0/pp0 at 127.0.0.1:21000 declares TP 1 PP 1 "
                                "DP 1 and its registration is still open"),
          "another geometry beside a live rank: answer %d '%s'", t, why);
    kvw_bs_entry_t thief = entry(0, 1, 1); /* the live rank's position, another address */
    t = raw_register("127.0.0.2", port, &thief, why, sizeof(why));
    CHECK(t == KVW_MSG_BS_ERROR && kvt_contains(why, "that rank is live at 127.0.0.1:21000"),
          "the live rank's position from another source: answer %d '%s'", t, why);
    kvw_bs_entry_t *tab = NULL;
    uint32_t n = 0;
    st = kvw__bootstrap_lookup(addr, 1, 1, 1, NULL, kvt_now_ns() + kvt_tmo_ns(10 * SEC), &tab, &n);
    CHECK(st == KVW_OK && n == 1 && !strcmp(tab[0].addr, live.addr),
          "the live entry after the attempts: %s: %u entries, %s", kvw_last_error(), n,
          n ? tab[0].addr : "-");
    free(tab);
    /* Once the live rank is gone, the new geometry registers. */
    if (hold >= 0)
        close(hold);
    uint64_t end = kvt_now_ns() + kvt_tmo_ns(10 * SEC);
    do
        t = raw_register("127.0.0.2", port, &other, why, sizeof(why));
    while (t != KVW_MSG_BS_OK && kvt_now_ns() < end && (usleep(20000), 1));
    CHECK(t == KVW_MSG_BS_OK, "another geometry once the live rank left: %d '%s'", t, why);
    kvw__bootstrap_stop(bs);

    /* 2. One source cannot fill the table. */
    bs = NULL;
    CHECK(kvw__bootstrap_start("127.0.0.1", 0, NULL, &bs) == KVW_OK, "%s", kvw_last_error());
    if (bs == NULL)
        return 1;
    snprintf(addr, sizeof(addr), "%s", kvw__bootstrap_addr(bs));
    port = port_of(addr);
    uint32_t ok = 0;
    for (uint32_t i = 0; i < 1024; i++) {
        kvw_bs_entry_t e = entry(i, 4096, 20000 + i % 1000);
        ok += raw_register("127.0.0.2", port, &e, why, sizeof(why)) == KVW_MSG_BS_OK;
    }
    CHECK(ok == 1024, "%u of 1024 registrations from one source: %s", ok, why);
    kvw_bs_entry_t e = entry(1024, 4096, 21024);
    t = raw_register("127.0.0.2", port, &e, why, sizeof(why));
    CHECK(t == KVW_MSG_BS_ERROR && kvt_contains(why, "its source already has 1024 entries "
                                                     "(KVW_BS_MAX_SOURCE_ENTRIES)"),
          "the 1025th entry of one source: answer %d '%s'", t, why);
    e = entry(1025, 4096, 21025);
    st = kvw__bootstrap_register(addr, &e, NULL, kvt_now_ns() + kvt_tmo_ns(10 * SEC));
    CHECK(st == KVW_OK, "a registration from another source: %s", kvw_last_error());
    kvw__bootstrap_stop(bs);

    /* 3. A junk entry beside a complete instance fails no lookup that does not need it:
     * with the secret it carries no valid MAC, and it declares another geometry (DP 2)
     * than a decode that expects DP 1 looks for. */
    fake_t f = {.n = 2};
    f.tab[0] = entry(0, 1, 21100);
    f.tab[0].has_mac = true;
    memset(f.tab[0].nonce, 3, sizeof(f.tab[0].nonce));
    kvw__bootstrap_entry_mac("alpha", &f.tab[0], f.tab[0].mac);
    f.tab[1] = entry(0, 1, 1);
    f.tab[1].dp = 1;
    f.tab[1].dp_size = 2;
    struct sockaddr_in la = {.sin_family = AF_INET};
    la.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t ll = sizeof(la);
    f.lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(f.lfd >= 0 && bind(f.lfd, (struct sockaddr *)&la, sizeof(la)) == 0 &&
              listen(f.lfd, 16) == 0 &&
              getsockname(f.lfd, (struct sockaddr *)&la, &ll) == 0 &&
              pthread_create(&f.t, NULL, fake_main, &f) == 0,
          "fake endpoint: %m");
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", ntohs(la.sin_port));
    tab = NULL;
    n = 0;
    st = kvw__bootstrap_lookup(addr, 0, 0, 0, "alpha", kvt_now_ns() + kvt_tmo_ns(5 * SEC), &tab,
                               &n);
    CHECK(st == KVW_OK && n == 1 && !strcmp(tab[0].addr, "127.0.0.1:21100"),
          "lookup with the secret beside an unsigned junk entry: %s: %s",
          kvw_status_string(st), kvw_last_error());
    free(tab);
    tab = NULL;
    st = kvw__bootstrap_lookup(addr, 1, 1, 1, NULL, kvt_now_ns() + kvt_tmo_ns(5 * SEC), &tab, &n);
    CHECK(st == KVW_OK && n == 1 && !strcmp(tab[0].addr, "127.0.0.1:21100"),
          "lookup of a DP1 instance beside a DP2 junk entry: %s: %s", kvw_status_string(st),
          kvw_last_error());
    free(tab);
    /* The junk entry still fails the lookup that needs it: a decode of DP 2. */
    tab = NULL;
    st = kvw__bootstrap_lookup(addr, 1, 1, 2, NULL, kvt_now_ns() + kvt_tmo_ns(1 * SEC), &tab, &n);
    CHECK(st != KVW_OK, "a DP2 lookup succeeded with half an instance");
    free(tab);
    shutdown(f.lfd, SHUT_RDWR);
    close(f.lfd);
    pthread_join(f.t, NULL);
    return ip_summary("test_bootstrap_live");
}
