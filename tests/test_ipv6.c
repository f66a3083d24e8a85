/*
 * IPv6 addresses: "[host]:port" parsing (zones included) and bracketed formatting; a
 * standalone bootstrap endpoint and a context's own one on [::1] and on [::]; a prefill
 * and a decode context whose listeners bind ::1 (the decode given "[::1]", brackets and
 * all), moving a room over tcp with every byte and guard byte checked against the
 * reference; the decode reaching the prefill through a bracketed address. Skips (77,
 * saying why) where the machine has no IPv6 loopback.
 */
#include "testkit.h"
#include "inproc.h"

#include "proto/wire.h"

#include <kvwire/xfer.h>

static kvt_model_t model;

static bool have_ipv6_loopback(char *why, size_t cap)
{
    int fd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        snprintf(why, cap, "socket(AF_INET6): %s", strerror(errno));
        return false;
    }
    struct sockaddr_in6 sa = {.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT};
    bool ok = bind(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
    if (!ok)
        snprintf(why, cap, "bind([::1]:0): %s", strerror(errno));
    close(fd);
    return ok;
}

static void parse_ok(const char *s, const char *host, unsigned port)
{
    char h[128] = "";
    uint16_t p = 0;
    kvw_status_t st = kvw__parse_hostport(s, h, sizeof(h), &p);
    CHECK(st == KVW_OK && strcmp(h, host) == 0 && p == port,
          "parse '%s': %s (%s), host '%s' port %u; expected '%s' %u", s, kvw_status_string(st),
          st ? kvw_last_error() : "", h, p, host, port);
}

static void parse_bad(const char *s, const char *why)
{
    char h[128];
    uint16_t p;
    kvw_status_t st = kvw__parse_hostport(s, h, sizeof(h), &p);
    CHECK(st == KVW_ERR_INVALID_PARAM && kvt_contains(kvw_last_error(), why),
          "parse '%s': %s (%s); expected INVALID_PARAM saying '%s'", s, kvw_status_string(st),
          kvw_last_error(), why);
}

static void parsing(void)
{
    parse_ok("[::1]:8998", "::1", 8998);
    parse_ok("[fe80::1%eth0]:65535", "fe80::1%eth0", 65535);
    parse_ok("[::]:0", "::", 0);
    parse_ok("127.0.0.1:5", "127.0.0.1", 5);
    parse_ok("prefill-0.example:80", "prefill-0.example", 80);
    parse_bad("::1:8998", "an IPv6 host needs brackets");
    parse_bad("[::1]", "is not [host]:port");
    parse_bad("[::1]8998", "is not [host]:port");
    parse_bad("[::1:8998", "is not [host]:port");
    parse_bad("[]:8998", "is not host:port");
    parse_bad("[::1]:", "has a bad port");
    parse_bad("[::1]:70000", "has a bad port");
    parse_bad("[::1]:-1", "has a bad port");
    parse_bad(":8998", "is not host:port");
    char out[64];
    kvw__format_hostport("::1", 8998, out, sizeof(out));
    CHECK(strcmp(out, "[::1]:8998") == 0, "format ::1: '%s'", out);
    kvw__format_hostport("fe80::1%eth0", 1, out, sizeof(out));
    CHECK(strcmp(out, "[fe80::1%eth0]:1") == 0, "format fe80::1%%eth0: '%s'", out);
    kvw__format_hostport("10.1.2.3", 7, out, sizeof(out));
    CHECK(strcmp(out, "10.1.2.3:7") == 0, "format 10.1.2.3: '%s'", out);
    /* Link-local with a zone resolves (the loopback interface's name is lo here). */
    int fd = -1;
    kvw_status_t st = kvw__tcp_connect("fe80::1%nonexistent-if9", 1, kvt_now_ns() + 1000000000ull,
                                       &fd);
    CHECK(st == KVW_ERR_INVALID_PARAM && kvt_contains(kvw_last_error(), "cannot resolve host "
                                                      "'fe80::1%nonexistent-if9'"),
          "an unknown zone: %s (%s)", kvw_status_string(st), kvw_last_error());
    if (st == KVW_OK)
        close(fd);
}

/* A listener on `host` (bracketed or not) that a connection to `to` reaches. */
static void listen_connect(const char *host, const char *to)
{
    int lfd = -1, cfd = -1;
    uint16_t port = 0;
    kvw_status_t st = kvw__tcp_listen(host, 0, &lfd, &port);
    CHECK(st == KVW_OK && port != 0, "listen on '%s': %s", host, kvw_last_error());
    if (st != KVW_OK)
        return;
    st = kvw__tcp_connect(to, port, kvt_now_ns() + kvt_tmo_ns(5000000000ull), &cfd);
    CHECK(st == KVW_OK, "listen '%s', connect '%s' port %u: %s", host, to, port,
          kvw_last_error());
    if (st == KVW_OK) {
        int afd = accept(lfd, NULL, NULL);
        CHECK(afd >= 0, "accept: %s", strerror(errno));
        CHECK(write(cfd, "v6", 2) == 2, "write");
        char b[2] = {0};
        CHECK(afd >= 0 && kvt_read_full(afd, b, 2) == 0 && memcmp(b, "v6", 2) == 0,
              "bytes over [%s]", to);
        if (afd >= 0)
            close(afd);
        close(cfd);
    }
    close(lfd);
}

static void bootstraps(void)
{
    const char *addrs[] = {"[::1]:0", "[::]:0"};
    for (int i = 0; i < 2; i++) {
        kvw_bootstrap_h bs = NULL;
        kvw_status_t st = kvw_bootstrap_start(addrs[i], &bs);
        CHECK(st == KVW_OK, "bootstrap on %s: %s", addrs[i], kvw_last_error());
        if (st != KVW_OK)
            continue;
        const char *a = kvw_bootstrap_address(bs);
        const char *want = i == 0 ? "[::1]:" : "[::]:";
        CHECK(a && strncmp(a, want, strlen(want)) == 0 && strlen(a) > strlen(want),
              "bootstrap on %s advertises '%s'", addrs[i], a ? a : "(null)");
        /* Reachable through the bracketed loopback address. */
        char host[64];
        uint16_t port = 0;
        if (a && kvw__parse_hostport(a, host, sizeof(host), &port) == KVW_OK) {
            int fd = -1;
            st = kvw__tcp_connect("::1", port, kvt_now_ns() + kvt_tmo_ns(5000000000ull), &fd);
            CHECK(st == KVW_OK, "connect to the bootstrap on %s: %s", addrs[i], kvw_last_error());
            if (fd >= 0)
                close(fd);
        }
        kvw_bootstrap_stop(bs);
    }
}

/* Prefill on ::1 hosting its bootstrap at [::1]:0, decode listening on "[::1]": a room. */
static void room_over_ipv6(void)
{
    kvt_rank_t src, dst;
    kvw_ctx_h pctx = NULL, dctx = NULL;
    CHECK(ip_rank(&model, 1, 0, 64, 2, &src) == KVW_OK, "%s", kvw_last_error());
    CHECK(ip_rank(&model, 1, 0, 64, 2, &dst) == KVW_OK, "%s", kvw_last_error());
    kvt_rank_fill(&src, 21);
    kvt_rank_fill(&dst, 22);
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, &src, "tcp", "[::1]:0", true);
    p.field_mask |= KVW_CTX_FIELD_LISTEN_HOST;
    p.listen_host = "::1";
    p.peer_timeout_ms = kvt_tmo_ms(10000);
    p.wait_timeout_ms = kvt_tmo_ms(60000);
    kvw_status_t st = kvw_ctx_create(&p, &pctx);
    CHECK(st == KVW_OK, "prefill context on [::1]: %s", kvw_last_error());
    if (st != KVW_OK)
        goto out;
    const char *bs = kvw_ctx_bootstrap_addr(pctx);
    CHECK(bs && strncmp(bs, "[::1]:", 6) == 0, "the prefill's bootstrap is '%s'",
          bs ? bs : "(null)");
    char bsaddr[128];
    ip_params_decode(&p, pctx, &dst, bsaddr, sizeof(bsaddr));
    p.listen_host = "[::1]";
    st = kvw_ctx_create(&p, &dctx);
    CHECK(st == KVW_OK, "decode context registering at %s: %s", bsaddr, kvw_last_error());
    if (st != KVW_OK)
        goto out;
    ip_room_t room = {.id = 3, .tokens = 200, .seed = 9,
                      .deadline_ns = kvt_tmo_ns(60ull * 1000000000ull), .what = "IPv6 room"};
    ip_room_verified(&model, pctx, &src, dctx, &dst, &room);
    /* A room naming its prefill instance by the bracketed address. */
    kvw_receiver_h rcv = NULL;
    st = kvw_receiver_create_from(dctx, 4, bsaddr, 0, &rcv);
    CHECK(st == KVW_OK, "kvw_receiver_create_from(%s): %s", bsaddr, kvw_last_error());
    if (rcv)
        kvw_room_destroy(kvw_receiver_room(rcv));
out:
    kvw_ctx_destroy(dctx);
    kvw_ctx_destroy(pctx);
    kvt_rank_free(&src);
    kvt_rank_free(&dst);
}

int main(void)
{
    parsing();
    char why[160];
    if (!have_ipv6_loopback(why, sizeof(why))) {
        printf("test_ipv6: skipped: no IPv6 loopback here (%s); parsing checked (%d failures)\n",
               why, failures);
        return failures ? 1 : 77;
    }
    if (ip_model("test_ipv6", &model) != 0)
        return 1;
    listen_connect("::1", "::1");
    listen_connect("[::1]", "[::1]");
    listen_connect("::", "::1");
    listen_connect("127.0.0.1", "127.0.0.1");
    bootstraps();
    room_over_ipv6();
    return ip_summary("test_ipv6");
}
