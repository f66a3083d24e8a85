#include "proto/wire.h"

#include "core/le.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static void kvw_wb_put(kvw_wbuf_t *w, const void *p, size_t n)
{
    if (w->oom)
        return;
    if (w->len + n > w->cap) {
        size_t cap = w->cap ? w->cap : 256;
        while (cap < w->len + n)
            cap *= 2;
        uint8_t *np = realloc(w->p, cap);
        if (np == NULL) {
            w->oom = true;
            return;
        }
        w->p = np;
        w->cap = cap;
    }
    memcpy(w->p + w->len, p, n);
    w->len += n;
}

void kvw__wb_u8(kvw_wbuf_t *w, uint8_t v) { kvw_wb_put(w, &v, 1); }
void kvw__wb_u16(kvw_wbuf_t *w, uint16_t v)
{
    uint8_t b[2];
    kvw__le16_put(b, v);
    kvw_wb_put(w, b, 2);
}
void kvw__wb_u32(kvw_wbuf_t *w, uint32_t v)
{
    uint8_t b[4];
    kvw__le32_put(b, v);
    kvw_wb_put(w, b, 4);
}
void kvw__wb_u64(kvw_wbuf_t *w, uint64_t v)
{
    uint8_t b[8];
    kvw__le64_put(b, v);
    kvw_wb_put(w, b, 8);
}
void kvw__wb_u32_fields(kvw_wbuf_t *w, const void *s, const size_t *offs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t v;
        memcpy(&v, (const char *)s + offs[i], sizeof(v));
        kvw__wb_u32(w, v);
    }
}
void kvw__wb_bytes(kvw_wbuf_t *w, const void *p, size_t n)
{
    kvw__wb_u32(w, (uint32_t)n);
    if (n)
        kvw_wb_put(w, p, n);
}
void kvw__wb_str(kvw_wbuf_t *w, const char *s)
{
    kvw__wb_bytes(w, s ? s : "", s ? strlen(s) : 0);
}

void kvw__wb_init(kvw_wbuf_t *w, uint8_t type)
{
    memset(w, 0, sizeof(*w));
    kvw__wb_u32(w, KVW_WIRE_MAGIC);
    kvw__wb_u8(w, KVW_WIRE_VERSION);
    kvw__wb_u8(w, type);
    kvw__wb_u16(w, 0);
    kvw__wb_u32(w, 0);
}

kvw_status_t kvw__wb_finish(kvw_wbuf_t *w)
{
    if (w->oom)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory encoding a frame");
    kvw__le32_put(w->p + 8, (uint32_t)(w->len - KVW_WIRE_HDR));
    return KVW_OK;
}

void kvw__wb_free(kvw_wbuf_t *w)
{
    free(w->p);
    memset(w, 0, sizeof(*w));
}

kvw_status_t kvw__wire_header(const uint8_t h[KVW_WIRE_HDR], uint8_t *type_p, uint32_t *len_p)
{
    uint32_t magic = kvw__le32_get(h);
    if (magic != KVW_WIRE_MAGIC)
        return kvw__error(KVW_ERR_MALFORMED, "bad frame magic 0x%08x (expected 0x%08x)", magic,
                          KVW_WIRE_MAGIC);
    if (h[4] != KVW_WIRE_VERSION)
        return kvw__error(KVW_ERR_MALFORMED, "unsupported protocol version %u (this side speaks %u)",
                          h[4], KVW_WIRE_VERSION);
    if (h[5] == 0 || h[5] >= KVW_MSG_MAX)
        return kvw__error(KVW_ERR_MALFORMED, "unknown frame type %u", h[5]);
    uint32_t len = kvw__le32_get(h + 8);
    if (len > KVW_WIRE_MAX_PAYLOAD)
        return kvw__error(KVW_ERR_MALFORMED, "frame payload of %u bytes exceeds the %u-byte limit",
                          len, KVW_WIRE_MAX_PAYLOAD);
    *type_p = h[5];
    *len_p = len;
    return KVW_OK;
}

void kvw__rb_init(kvw_rbuf_t *r, const void *p, size_t len)
{
    r->p = p;
    r->len = len;
    r->pos = 0;
    r->bad = false;
}

static const uint8_t *kvw_rb_take(kvw_rbuf_t *r, size_t n)
{
    if (r->bad || r->len - r->pos < n) {
        r->bad = true;
        return NULL;
    }
    const uint8_t *p = r->p + r->pos;
    r->pos += n;
    return p;
}

uint8_t kvw__rb_u8(kvw_rbuf_t *r)
{
    const uint8_t *b = kvw_rb_take(r, 1);
    return b ? b[0] : 0;
}
uint16_t kvw__rb_u16(kvw_rbuf_t *r)
{
    const uint8_t *b = kvw_rb_take(r, 2);
    return b ? kvw__le16_get(b) : 0;
}
uint32_t kvw__rb_u32(kvw_rbuf_t *r)
{
    const uint8_t *b = kvw_rb_take(r, 4);
    return b ? kvw__le32_get(b) : 0;
}
uint64_t kvw__rb_u64(kvw_rbuf_t *r)
{
    const uint8_t *b = kvw_rb_take(r, 8);
    return b ? kvw__le64_get(b) : 0;
}
void kvw__rb_u32_fields(kvw_rbuf_t *r, void *s, const size_t *offs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t v = kvw__rb_u32(r);
        memcpy((char *)s + offs[i], &v, sizeof(v));
    }
}
const void *kvw__rb_bytes(kvw_rbuf_t *r, size_t max, size_t *len_p)
{
    uint32_t n = kvw__rb_u32(r);
    if (r->bad || n > max) {
        r->bad = true;
        return NULL;
    }
    const uint8_t *p = kvw_rb_take(r, n);
    if (p)
        *len_p = n;
    return p;
}
void kvw__rb_str(kvw_rbuf_t *r, char *out, size_t cap)
{
    size_t n = 0;
    const char *p = kvw__rb_bytes(r, cap - 1, &n);
    if (p == NULL) {
        out[0] = '\0';
        return;
    }
    memcpy(out, p, n);
    out[n] = '\0';
}
kvw_status_t kvw__rb_done(kvw_rbuf_t *r, const char *what)
{
    if (r->bad)
        return kvw__error(KVW_ERR_MALFORMED, "%s frame is truncated or has an oversized field", what);
    if (r->pos != r->len)
        return kvw__error(KVW_ERR_MALFORMED, "%s frame has %zu trailing bytes", what,
                          r->len - r->pos);
    return KVW_OK;
}

kvw_status_t kvw__sock_recv_frame(int fd, uint64_t deadline_ns, uint8_t *type_p,
                                  uint8_t **payload_p, uint32_t *len_p)
{
    return kvw__sock_recv_frame_max(fd, deadline_ns, KVW_WIRE_MAX_PAYLOAD, type_p, payload_p,
                                    len_p);
}

kvw_status_t kvw__sock_recv_frame_max(int fd, uint64_t deadline_ns, uint32_t max_len,
                                      uint8_t *type_p, uint8_t **payload_p, uint32_t *len_p)
{
    uint8_t hdr[KVW_WIRE_HDR];
    uint8_t type = 0;
    uint32_t len = 0;
    kvw_status_t st = kvw__sock_recv_all(fd, hdr, sizeof(hdr), deadline_ns);
    if (st != KVW_OK)
        return st;
    if ((st = kvw__wire_header(hdr, &type, &len)) != KVW_OK)
        return st;
    if (len > max_len) /* before anything is allocated for it */
        return kvw__error(KVW_ERR_OUT_OF_RANGE, "a %u-byte frame (type %u) is larger than the "
                          "%u bytes accepted here", len, type, max_len);
    uint8_t *p = malloc(len ? len : 1);
    if (p == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory receiving a %u-byte frame", len);
    if ((st = kvw__sock_recv_all(fd, p, len, deadline_ns)) != KVW_OK) {
        free(p);
        return st;
    }
    *type_p = type;
    *payload_p = p;
    *len_p = len;
    return KVW_OK;
}

kvw_status_t kvw__parse_hostport(const char *s, char *host, size_t hcap, uint16_t *port_p)
{
    const char *hb = s, *he = NULL, *colon = NULL;
    if (s && s[0] == '[') {
        /* [IPv6 address, optionally %zone]:port */
        const char *close = strchr(s, ']');
        if (close == NULL || close[1] != ':')
            return kvw__error(KVW_ERR_INVALID_PARAM, "address '%s' is not [host]:port", s);
        hb = s + 1;
        he = close;
        colon = close + 1;
    } else if (s) {
        colon = strrchr(s, ':');
        he = colon;
        if (colon && memchr(s, ':', (size_t)(colon - s)))
            return kvw__error(KVW_ERR_INVALID_PARAM, "address '%s': an IPv6 host needs brackets, "
                              "as in [::1]:port", s);
    }
    if (colon == NULL || he == hb || (size_t)(he - hb) >= hcap)
        return kvw__error(KVW_ERR_INVALID_PARAM, "address '%s' is not host:port", s ? s : "(null)");
    char *end;
    unsigned long port = strtoul(colon + 1, &end, 10);
    if (*end || port > 65535 || end == colon + 1 || colon[1] == '-' || colon[1] == '+')
        return kvw__error(KVW_ERR_INVALID_PARAM, "address '%s' has a bad port", s);
    memcpy(host, hb, (size_t)(he - hb));
    host[he - hb] = '\0';
    *port_p = (uint16_t)port;
    return KVW_OK;
}

void kvw__format_hostport(const char *host, unsigned port, char *out, size_t cap)
{
    snprintf(out, cap, strchr(host, ':') ? "[%s]:%u" : "%s:%u", host, port);
}

void kvw__host_unbracket(char *host)
{
    size_t n = strlen(host);
    if (n >= 2 && host[0] == '[' && host[n - 1] == ']') {
        memmove(host, host + 1, n - 2);
        host[n - 2] = '\0';
    }
}

/*
 * The addresses of host:port (numeric IPv4 or IPv6, with a %zone for link-local ones,
 * or a name), IPv4 ones first so that a name with both keeps meaning what it did when
 * only IPv4 was asked for. `passive`: for listening (an empty host is every address).
 * Up to `cap` of them in out (sockaddr_storage each), the count in *n_p.
 */
static kvw_status_t kvw_resolve(const char *host, uint16_t port, bool passive,
                                struct sockaddr_storage *out, socklen_t *lens, int cap, int *n_p)
{
    char h[128], ps[8];
    snprintf(h, sizeof(h), "%s", host);
    kvw__host_unbracket(h);
    snprintf(ps, sizeof(ps), "%u", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0)};
    struct addrinfo *res = NULL;
    int gai = getaddrinfo(h[0] ? h : NULL, ps, &hints, &res);
    if (gai == EAI_AGAIN) /* a resolver not answering yet: worth another try */
        return kvw__error(KVW_ERR_IO, "cannot resolve host '%s' yet: %s", host,
                          gai_strerror(gai));
    if (gai != 0 || res == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "cannot resolve host '%s': %s", host,
                          gai ? gai_strerror(gai) : "no address");
    int n = 0;
    for (int fam = 0; fam < 2; fam++)
        for (struct addrinfo *ai = res; ai && n < cap; ai = ai->ai_next)
            if (ai->ai_family == (fam ? AF_INET6 : AF_INET) &&
                ai->ai_addrlen <= sizeof(*out)) {
                memcpy(&out[n], ai->ai_addr, ai->ai_addrlen);
                lens[n++] = ai->ai_addrlen;
            }
    freeaddrinfo(res);
    if (n == 0)
        return kvw__error(KVW_ERR_INVALID_PARAM, "cannot resolve host '%s': no IPv4 or IPv6 "
                          "address", host);
    *n_p = n;
    return KVW_OK;
}

#define KVW_MAX_ADDRS 8

kvw_status_t kvw__tcp_listen(const char *host, uint16_t port, int *fd_p, uint16_t *port_p)
{
    struct sockaddr_storage sa[KVW_MAX_ADDRS];
    socklen_t lens[KVW_MAX_ADDRS];
    int n = 0, err = 0;
    kvw_status_t st = kvw_resolve(host, port, true, sa, lens, KVW_MAX_ADDRS, &n);
    if (st != KVW_OK)
        return st;
    for (int i = 0; i < n; i++) {
        int fd = socket(sa[i].ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            err = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (bind(fd, (struct sockaddr *)&sa[i], lens[i]) < 0 || listen(fd, 128) < 0) {
            err = errno;
            close(fd);
            continue;
        }
        struct sockaddr_storage bound;
        socklen_t sl = sizeof(bound);
        getsockname(fd, (struct sockaddr *)&bound, &sl);
        *port_p = ntohs(bound.ss_family == AF_INET6
                            ? ((struct sockaddr_in6 *)&bound)->sin6_port
                            : ((struct sockaddr_in *)&bound)->sin_port);
        *fd_p = fd;
        return KVW_OK;
    }
    char where[160];
    kvw__format_hostport(host, port, where, sizeof(where));
    return kvw__error(KVW_ERR_IO, "cannot listen on %s: %s", where, strerror(err));
}

/* One non-blocking connect to one address, waiting until deadline_ns. */
static kvw_status_t kvw_connect_one(const struct sockaddr_storage *sa, socklen_t len,
                                    const char *where, uint64_t deadline_ns, int *fd_p)
{
    kvw_status_t st;
    int fd = socket(sa->ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return kvw__error(KVW_ERR_IO, "socket: %s", strerror(errno));
    if (connect(fd, (const struct sockaddr *)sa, len) < 0) {
        if (errno != EINPROGRESS) {
            st = kvw__error(KVW_ERR_IO, "cannot connect to %s: %s", where, strerror(errno));
            close(fd);
            return st;
        }
        int w = kvw__sock_poll(fd, POLLOUT, deadline_ns);
        int err = 0;
        socklen_t el = sizeof(err);
        if (w > 0)
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
        if (w <= 0 || err) {
            st = kvw__error(w == 0 ? KVW_ERR_TIMEOUT : KVW_ERR_IO, "cannot connect to %s: %s",
                            where, w == 0 ? "timed out" : strerror(err ? err : errno));
            close(fd);
            return st;
        }
    }
    kvw__sock_nodelay(fd);
    *fd_p = fd;
    return KVW_OK;
}

void kvw__sock_nodelay(int fd)
{
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

kvw_status_t kvw__tcp_connect(const char *host, uint16_t port, uint64_t deadline_ns, int *fd_p)
{
    struct sockaddr_storage sa[KVW_MAX_ADDRS];
    socklen_t lens[KVW_MAX_ADDRS];
    int n = 0;
    kvw_status_t st = kvw_resolve(host, port, false, sa, lens, KVW_MAX_ADDRS, &n);
    if (st != KVW_OK)
        return st;
    char where[160];
    kvw__format_hostport(host, port, where, sizeof(where));
    /* Every address of the name in turn: a refused one (a server on the other family)
     * fails at once; a timeout ends the attempt. */
    for (int i = 0; i < n; i++) {
        st = kvw_connect_one(&sa[i], lens[i], where, deadline_ns, fd_p);
        if (st == KVW_OK || st == KVW_ERR_TIMEOUT)
            return st;
    }
    return st;
}
