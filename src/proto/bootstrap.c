/*
 * The bootstrap endpoint: prefill ranks register their control address; decode ranks
 * look the table up. One thread, poll() over non-blocking connections that it reads and
 * answers incrementally, so a slow or silent client delays no one else. Bounds:
 *  - a connection must deliver each frame within KVW_BS_FRAME_MS of its accept or of its
 *    previous answer, or it is closed (silent connections go the same way);
 *  - at most KVW_BS_MAX_CONNS connections, KVW_BS_MAX_PER_SOURCE from one address; when
 *    either is reached, a new connection displaces the oldest one that has sent nothing
 *    yet, or is closed when every connection is busy with a frame (honest clients send
 *    their one frame as soon as they connect, so silent ones are the ones that go);
 *  - a full table refuses a new rank with an error answer (KVW_MSG_BS_ERROR), and so
 *    does one source past KVW_BS_MAX_SOURCE_ENTRIES entries;
 *  - while a rank's held registration connection is open, its entry is neither wiped by
 *    a registration of another geometry nor replaced from another source address
 *    (refused, BUSY; the client retries such a refusal until its deadline, since the
 *    rank in the way may be its own previous process).
 * A malformed frame drops only the connection that sent it.
 *
 * Authentication: with a shared secret, a prefill rank first asks the endpoint for a
 * challenge (KVW_MSG_BS_CHALLENGE, a 32-byte nonce held by that connection, good for one
 * registration) and registers on the same connection with
 *   mac = HMAC(secret, "kvwire-bootstrap-entry-1" | nonce | dp tp pp | sizes | address).
 * An endpoint given the secret refuses (KVW_ERR_AUTH, with a reason) a registration without
 * a MAC or with a wrong one; any endpoint refuses a MAC over a nonce it did not give that
 * connection (a replay). The entry keeps nonce and MAC, and a decode with the secret
 * recomputes the MAC of every entry it looks up, so a hostile endpoint cannot point it at
 * another address either. An entry is bound to its rank position and address, not to the
 * endpoint: an endpoint can still serve a genuine entry it saw elsewhere (stale, or of
 * another instance under the same secret); the handshake then decides (the rank at that
 * address must prove the secret and be that rank of that geometry).
 * One-shot registrations (KVW_MSG_BS_REGISTER) expire after KVW_BS_ONESHOT_TTL_MS.
 */
#include "proto/proto.h"

#include "core/config.h"
#include "core/rand.h"
#include "core/sha256.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define KVW_BS_MAX_CONNS 256
#define KVW_BS_MAX_PER_SOURCE 64
#define KVW_BS_MAX_ENTRIES 4096
#define KVW_BS_FRAME_MS 5000
/* Requests are small; a table answer is at most 4096 entries of ~150 bytes. */
#define KVW_BS_MAX_REQUEST 4096

typedef struct kvw_bs_conn {
    int fd;
    uint64_t id;
    bool holds; /* it registered with KVW_MSG_BS_HOLD: its entries live as long as it */
    bool has_nonce; /* a challenge was given and not used yet */
    uint8_t nonce[32];
    struct sockaddr_storage src; /* source address (port ignored) */
    uint64_t accepted_ns, deadline_ns;
    bool heard; /* some byte arrived since accept */
    uint8_t hdr[KVW_WIRE_HDR];
    uint32_t hdr_got;
    uint8_t *payload;
    uint32_t payload_len, payload_got;
    uint8_t *out; /* answer being sent */
    size_t out_len, out_sent;
} kvw_bs_conn_t;

struct kvw_bootstrap {
    int listen_fd;
    int wake[2];
    char addr[128];
    pthread_t thread;
    pthread_mutex_t mu;
    kvw_bs_entry_t *entries;
    uint32_t num_entries;
    char secret[256];       /* "" accepts registrations without a MAC */
    uint64_t ttl_ns;        /* lifetime of one-shot entries (under mu) */
    uint64_t max_source_entries; /* KVW_BS_MAX_SOURCE_ENTRIES */
};

#define KVW_BS_MAC_LABEL "kvwire-bootstrap-entry-1"

static void kvw_bs_le32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

void kvw__bootstrap_entry_mac(const char *secret, const kvw_bs_entry_t *e, uint8_t out[32])
{
    /* The label differs from every handshake label ("kvwire-hello-2", ...): a MAC made
     * here can never stand for one made there. */
    uint8_t f[7 * 4];
    const uint32_t v[6] = {e->dp, e->tp, e->pp, e->dp_size, e->tp_size, e->pp_size};
    size_t alen = strnlen(e->addr, sizeof(e->addr));
    for (int i = 0; i < 6; i++)
        kvw_bs_le32(f + 4 * i, v[i]);
    kvw_bs_le32(f + 24, (uint32_t)alen);
    kvw_hmac_t h;
    kvw__hmac_init(&h, secret, strlen(secret));
    kvw__hmac_update(&h, KVW_BS_MAC_LABEL, strlen(KVW_BS_MAC_LABEL));
    kvw__hmac_update(&h, e->nonce, sizeof(e->nonce));
    kvw__hmac_update(&h, f, sizeof(f));
    kvw__hmac_update(&h, e->addr, alen);
    kvw__hmac_final(&h, out);
}

/* An entry's rank fields, in wire order. */
static const size_t kvw_bs_entry_u32[] = {
    offsetof(kvw_bs_entry_t, dp),      offsetof(kvw_bs_entry_t, tp),
    offsetof(kvw_bs_entry_t, pp),      offsetof(kvw_bs_entry_t, dp_size),
    offsetof(kvw_bs_entry_t, tp_size), offsetof(kvw_bs_entry_t, pp_size)};

/* Fields, address, then a flag and (when set) nonce and MAC. */
void kvw__bootstrap_put_entry(kvw_wbuf_t *w, const kvw_bs_entry_t *e)
{
    kvw__wb_u32_fields(w, e, kvw_bs_entry_u32, KVW_ARRAY_SIZE(kvw_bs_entry_u32));
    kvw__wb_str(w, e->addr);
    kvw__wb_u8(w, e->has_mac);
    for (size_t i = 0; e->has_mac && i < sizeof(e->nonce); i++)
        kvw__wb_u8(w, e->nonce[i]);
    for (size_t i = 0; e->has_mac && i < sizeof(e->mac); i++)
        kvw__wb_u8(w, e->mac[i]);
}

static void kvw_bs_get_entry(kvw_rbuf_t *r, kvw_bs_entry_t *e)
{
    *e = (kvw_bs_entry_t){0};
    kvw__rb_u32_fields(r, e, kvw_bs_entry_u32, KVW_ARRAY_SIZE(kvw_bs_entry_u32));
    kvw__rb_str(r, e->addr, sizeof(e->addr));
    uint8_t flag = kvw__rb_u8(r);
    if (flag > 1)
        r->bad = true;
    e->has_mac = flag == 1;
    for (size_t i = 0; e->has_mac && i < sizeof(e->nonce); i++)
        e->nonce[i] = kvw__rb_u8(r);
    for (size_t i = 0; e->has_mac && i < sizeof(e->mac); i++)
        e->mac[i] = kvw__rb_u8(r);
}

/* Drops one-shot entries whose time is up. Under mu. */
static void kvw_bs_expire_locked(kvw_bootstrap_t *bs, uint64_t now)
{
    uint32_t kept = 0;
    for (uint32_t j = 0; j < bs->num_entries; j++)
        if (bs->entries[j].expires_ns == 0 || bs->entries[j].expires_ns > now)
            bs->entries[kept++] = bs->entries[j];
    bs->num_entries = kept;
}

/* Why a registration must be refused ("" when it may go in): a MAC over a challenge this
 * connection was not given (a replay), or, with a secret, a missing or wrong MAC. The
 * connection's challenge serves one registration whatever the outcome. */
static void kvw_bs_auth_check(kvw_bootstrap_t *bs, kvw_bs_conn_t *c, const kvw_bs_entry_t *e,
                              char *why, size_t cap)
{
    bool fresh = c->has_nonce && !memcmp(e->nonce, c->nonce, sizeof(c->nonce));
    c->has_nonce = false;
    why[0] = '\0';
    const char *fault = NULL;
    uint8_t want[32];
    if (e->has_mac && !fresh)
        fault = "its MAC answers no challenge this endpoint gave this connection (a replayed "
                "registration)";
    else if (bs->secret[0] && !e->has_mac)
        fault = "it carries no MAC and this endpoint requires the shared secret";
    else if (bs->secret[0] && (kvw__bootstrap_entry_mac(bs->secret, e, want),
                               !kvw__ct_equal(want, e->mac, sizeof(want))))
        fault = "its MAC does not match this endpoint's shared secret";
    if (fault)
        snprintf(why, cap, "registration of rank dp%u/tp%u/pp%u at %s refused: %s", e->dp, e->tp,
                 e->pp, e->addr, fault);
}

static bool kvw_bs_same_source(const struct sockaddr_storage *a,
                               const struct sockaddr_storage *b);

static bool kvw_bs_same_geometry(const kvw_bs_entry_t *a, const kvw_bs_entry_t *b)
{
    return a->tp_size == b->tp_size && KVW_MAX(a->pp_size, 1) == KVW_MAX(b->pp_size, 1) &&
           KVW_MAX(a->dp_size, 1) == KVW_MAX(b->dp_size, 1);
}

/* Why a registration may not go into the table ("" when it may; under mu):
 *  - it declares another geometry than an entry whose registration connection is still
 *    open (a live rank's entry is never wiped by a registration of another geometry);
 *  - it takes the position of such a live entry from another source address (a
 *    restarted rank registers again from its own host);
 *  - its source already has KVW_BS_MAX_SOURCE_ENTRIES entries (one source cannot fill
 *    the table). */
static void kvw_bs_admit_check(kvw_bootstrap_t *bs, const kvw_bs_entry_t *e, char *why,
                               size_t cap)
{
    uint64_t same_src = 0;
    why[0] = '\0';
    for (uint32_t j = 0; j < bs->num_entries && !why[0]; j++) {
        const kvw_bs_entry_t *o = &bs->entries[j];
        bool mine = kvw_bs_same_source(&o->src, &e->src);
        bool here = o->dp == e->dp && o->tp == e->tp && o->pp == e->pp;
        same_src += mine && !(here && kvw_bs_same_geometry(o, e));
        if (o->owner && !kvw_bs_same_geometry(o, e))
            snprintf(why, cap, "registration of rank dp%u/tp%u/pp%u (TP %u PP %u DP %u) at %.80s "
                     "refused: live rank dp%u/tp%u/pp%u at %.80s declares TP %u PP %u DP %u and its "
                     "registration is still open", e->dp, e->tp, e->pp, e->tp_size,
                     KVW_MAX(e->pp_size, 1), KVW_MAX(e->dp_size, 1), e->addr, o->dp, o->tp,
                     o->pp, o->addr, o->tp_size, KVW_MAX(o->pp_size, 1), KVW_MAX(o->dp_size, 1));
        else if (o->owner && here && !mine)
            snprintf(why, cap, "registration of rank dp%u/tp%u/pp%u at %.80s refused: that "
                     "rank is live at %.80s (its registration is still open) and registered "
                     "from another address", e->dp, e->tp, e->pp, e->addr, o->addr);
    }
    if (!why[0] && same_src >= bs->max_source_entries &&
        bs->max_source_entries < KVW_BS_MAX_ENTRIES) /* else the table's own bound answers */
        snprintf(why, cap, "registration of rank dp%u/tp%u/pp%u at %.80s refused: its source "
                 "already has %llu entries (KVW_BS_MAX_SOURCE_ENTRIES)", e->dp, e->tp, e->pp,
                 e->addr, (unsigned long long)same_src);
}

/* Handles one frame into an answer *w; returns false to drop the connection. */
static bool kvw_bs_handle(kvw_bootstrap_t *bs, kvw_bs_conn_t *c, kvw_wbuf_t *wp, uint8_t type,
                          const uint8_t *p, uint32_t len)
{
    kvw_rbuf_t r;
    kvw_wbuf_t w;
    kvw__rb_init(&r, p, len);
    if (type == KVW_MSG_BS_CHALLENGE) {
        if (kvw__rb_done(&r, "bootstrap challenge") != KVW_OK ||
            kvw__random_bytes(c->nonce, sizeof(c->nonce)) != 0)
            return false;
        c->has_nonce = true;
        kvw__wb_init(&w, KVW_MSG_BS_CHALLENGE);
        for (size_t i = 0; i < sizeof(c->nonce); i++)
            kvw__wb_u8(&w, c->nonce[i]);
    } else if (type == KVW_MSG_BS_REGISTER || type == KVW_MSG_BS_HOLD) {
        kvw_bs_entry_t e;
        kvw_bs_get_entry(&r, &e);
        if (kvw__rb_done(&r, "bootstrap register") != KVW_OK || e.tp >= e.tp_size ||
            e.dp >= KVW_MAX(e.dp_size, 1) || e.pp >= KVW_MAX(e.pp_size, 1))
            return false;
        char why[400];
        kvw_bs_auth_check(bs, c, &e, why, sizeof(why));
        if (why[0]) {
            kvw__log(KVW_LOG_WARN, "bootstrap %s: registration refused: %s", bs->addr, why);
            kvw__wb_init(&w, KVW_MSG_BS_ERROR);
            kvw__wb_u32(&w, (uint32_t)(int32_t)KVW_ERR_AUTH);
            kvw__wb_str(&w, why);
            goto answer;
        }
        uint64_t now = kvw__now_ns();
        e.owner = type == KVW_MSG_BS_HOLD ? c->id : 0;
        e.src = c->src;
        pthread_mutex_lock(&bs->mu);
        e.expires_ns = type == KVW_MSG_BS_HOLD ? 0 : now + bs->ttl_ns;
        kvw_bs_expire_locked(bs, now);
        kvw_bs_admit_check(bs, &e, why, sizeof(why));
        if (why[0]) {
            pthread_mutex_unlock(&bs->mu);
            kvw__log(KVW_LOG_WARN, "bootstrap: %s", why);
            kvw__wb_init(&w, KVW_MSG_BS_ERROR);
            kvw__wb_u32(&w, (uint32_t)(int32_t)KVW_ERR_BUSY);
            kvw__wb_str(&w, why);
            goto answer;
        }
        /* A registration declaring other instance sizes starts a new instance (a prefill
         * restarted with another geometry): the old entries go, so that no lookup ever
         * mixes ranks of two geometries. */
        uint32_t kept = 0;
        for (uint32_t j = 0; j < bs->num_entries; j++) {
            const kvw_bs_entry_t *o = &bs->entries[j];
            if (o->tp_size == e.tp_size && KVW_MAX(o->pp_size, 1) == KVW_MAX(e.pp_size, 1) &&
                KVW_MAX(o->dp_size, 1) == KVW_MAX(e.dp_size, 1))
                bs->entries[kept++] = *o;
        }
        bs->num_entries = kept;
        uint32_t i;
        for (i = 0; i < bs->num_entries; i++)
            if (bs->entries[i].dp == e.dp && bs->entries[i].tp == e.tp && bs->entries[i].pp == e.pp)
                break;
        bool full = i == bs->num_entries && bs->num_entries >= KVW_BS_MAX_ENTRIES;
        if (!full) {
            bs->entries[i] = e; /* a restarted rank replaces its old entry */
            if (i == bs->num_entries)
                bs->num_entries++;
            if (type == KVW_MSG_BS_HOLD)
                c->holds = true;
        }
        pthread_mutex_unlock(&bs->mu);
        if (full) {
            char why[160];
            snprintf(why, sizeof(why), "the bootstrap table is full (%u entries): rank "
                     "dp%u/tp%u/pp%u was not registered", KVW_BS_MAX_ENTRIES, e.dp, e.tp, e.pp);
            kvw__wb_init(&w, KVW_MSG_BS_ERROR);
            kvw__wb_u32(&w, (uint32_t)(int32_t)KVW_ERR_BUSY);
            kvw__wb_str(&w, why);
        } else {
            kvw__log(KVW_LOG_INFO, "bootstrap %s: prefill rank dp%u/tp%u/pp%u of TP%u/PP%u/DP%u "
                     "registered at %s", bs->addr, e.dp, e.tp, e.pp, e.tp_size,
                     KVW_MAX(e.pp_size, 1), KVW_MAX(e.dp_size, 1), e.addr);
            kvw__wb_init(&w, KVW_MSG_BS_OK);
        }
    } else if (type == KVW_MSG_BS_LOOKUP) {
        if (kvw__rb_done(&r, "bootstrap lookup") != KVW_OK)
            return false;
        kvw__wb_init(&w, KVW_MSG_BS_TABLE);
        pthread_mutex_lock(&bs->mu);
        kvw_bs_expire_locked(bs, kvw__now_ns());
        kvw__wb_u32(&w, bs->num_entries);
        for (uint32_t i = 0; i < bs->num_entries; i++)
            kvw__bootstrap_put_entry(&w, &bs->entries[i]);
        uint32_t n = bs->num_entries;
        pthread_mutex_unlock(&bs->mu);
        char host[64] = "?";
        getnameinfo((const struct sockaddr *)&c->src, sizeof(c->src), host, sizeof(host), NULL,
                    0, NI_NUMERICHOST);
        kvw__log(KVW_LOG_INFO, "bootstrap %s: lookup from %s answered with %u entries", bs->addr,
                 host, n);
    } else {
        return false;
    }
answer:
    if (kvw__wb_finish(&w) != KVW_OK) {
        kvw__wb_free(&w);
        return false;
    }
    *wp = w;
    return true;
}

/* Drops the entries a closing connection held (its rank died or was destroyed). */
static void kvw_bs_release(kvw_bootstrap_t *bs, const kvw_bs_conn_t *c)
{
    if (!c->holds)
        return;
    pthread_mutex_lock(&bs->mu);
    uint32_t kept = 0;
    for (uint32_t j = 0; j < bs->num_entries; j++)
        if (bs->entries[j].owner != c->id)
            bs->entries[kept++] = bs->entries[j];
    uint32_t dropped = bs->num_entries - kept;
    bs->num_entries = kept;
    pthread_mutex_unlock(&bs->mu);
    kvw__log(KVW_LOG_INFO, "bootstrap %s: a prefill rank's connection closed: %u entries "
             "dropped, %u left", bs->addr, dropped, kept);
}

static void kvw_bs_close(kvw_bs_conn_t *c)
{
    close(c->fd);
    free(c->payload);
    free(c->out);
    *c = (kvw_bs_conn_t){.fd = -1};
}

static bool kvw_bs_same_source(const struct sockaddr_storage *a, const struct sockaddr_storage *b)
{
    if (a->ss_family != b->ss_family)
        return false;
    if (a->ss_family == AF_INET)
        return ((const struct sockaddr_in *)a)->sin_addr.s_addr ==
               ((const struct sockaddr_in *)b)->sin_addr.s_addr;
    if (a->ss_family == AF_INET6)
        return !memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr,
                       &((const struct sockaddr_in6 *)b)->sin6_addr, sizeof(struct in6_addr));
    return true;
}

/* Makes room for a connection from `src`: returns false when it must be refused. */
static bool kvw_bs_make_room(kvw_bs_conn_t *conns, int *n_p, const struct sockaddr_storage *src)
{
    int n = *n_p, same = 0;
    int oldest_any = -1, oldest_same = -1;
    for (int i = 0; i < n; i++) {
        if (conns[i].holds)
            continue; /* a registered rank's connection: never displaced, counted apart */
        bool s = kvw_bs_same_source(&conns[i].src, src);
        same += s;
        if (conns[i].heard)
            continue;
        if (oldest_any < 0 || conns[i].accepted_ns < conns[oldest_any].accepted_ns)
            oldest_any = i;
        if (s && (oldest_same < 0 || conns[i].accepted_ns < conns[oldest_same].accepted_ns))
            oldest_same = i;
    }
    int victim = -1;
    if (same >= KVW_BS_MAX_PER_SOURCE) {
        if (oldest_same < 0)
            return false;
        victim = oldest_same;
    } else if (n >= KVW_BS_MAX_CONNS) {
        if (oldest_any < 0)
            return false;
        victim = oldest_any;
    }
    if (victim >= 0) {
        kvw_bs_close(&conns[victim]);
        conns[victim] = conns[--n];
    }
    *n_p = n;
    return true;
}

/* Reads what a connection has; answers a complete frame. Returns false to drop it. */
static bool kvw_bs_read(kvw_bootstrap_t *bs, kvw_bs_conn_t *c)
{
    for (;;) {
        if (c->out)
            return true; /* one request at a time: answer first */
        ssize_t k;
        if (c->hdr_got < KVW_WIRE_HDR)
            k = recv(c->fd, c->hdr + c->hdr_got, KVW_WIRE_HDR - c->hdr_got, MSG_DONTWAIT);
        else if (c->payload_got < c->payload_len)
            k = recv(c->fd, c->payload + c->payload_got, c->payload_len - c->payload_got,
                     MSG_DONTWAIT);
        else
            k = 0; /* a complete frame with an empty payload: handle it below */
        if (k < 0)
            return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
        if (k == 0 && !(c->hdr_got == KVW_WIRE_HDR && c->payload_got == c->payload_len))
            return false; /* closed by the client */
        c->heard = true;
        if (c->hdr_got < KVW_WIRE_HDR) {
            c->hdr_got += (uint32_t)k;
            if (c->hdr_got < KVW_WIRE_HDR)
                continue;
            uint8_t type;
            if (kvw__wire_header(c->hdr, &type, &c->payload_len) != KVW_OK ||
                c->payload_len > KVW_BS_MAX_REQUEST)
                return false;
            c->payload = malloc(c->payload_len ? c->payload_len : 1);
            if (c->payload == NULL)
                return false;
            c->payload_got = 0;
            if (c->payload_len)
                continue;
        } else {
            c->payload_got += (uint32_t)k;
            if (c->payload_got < c->payload_len)
                continue;
        }
        uint8_t type;
        uint32_t len;
        kvw__wire_header(c->hdr, &type, &len);
        kvw_wbuf_t w;
        bool ok = kvw_bs_handle(bs, c, &w, type, c->payload, c->payload_len);
        free(c->payload);
        c->payload = NULL;
        c->hdr_got = 0;
        c->payload_len = c->payload_got = 0;
        if (!ok)
            return false;
        c->out = w.p; /* the answer's buffer now belongs to the connection */
        c->out_len = w.len;
        c->out_sent = 0;
        return true;
    }
}

/* Sends what the socket takes of a pending answer. Returns false to drop it. */
static bool kvw_bs_write(kvw_bs_conn_t *c)
{
    while (c->out && c->out_sent < c->out_len) {
        ssize_t k = send(c->fd, c->out + c->out_sent, c->out_len - c->out_sent,
                         MSG_DONTWAIT | MSG_NOSIGNAL);
        if (k < 0)
            return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
        c->out_sent += (size_t)k;
    }
    if (c->out) {
        free(c->out);
        c->out = NULL;
        /* The next frame gets a fresh deadline; a connection that holds a registration
         * stays open without one (it only waits for its rank to go away). */
        c->deadline_ns = c->holds ? UINT64_MAX : kvw__now_ns() + KVW_BS_FRAME_MS * 1000000ull;
        c->heard = c->holds;
        c->accepted_ns = kvw__now_ns();
    }
    return true;
}

static void *kvw_bs_main(void *arg)
{
    kvw_bootstrap_t *bs = arg;
    kvw__thread_name("kvw-bootstrap");
    struct pollfd pfd[KVW_BS_MAX_CONNS + 2];
    kvw_bs_conn_t *conns = calloc(KVW_BS_MAX_CONNS, sizeof(*conns));
    int n = 0;
    uint64_t pause_until = 0; /* accept paused (out of fds) until then */
    uint64_t next_id = 0;      /* connection ids (entries name the one holding them) */
    if (conns == NULL)
        return NULL;
    for (;;) {
        uint64_t now = kvw__now_ns();
        uint64_t next = now + 1000000000ull;
        if (pause_until > now && pause_until < next)
            next = pause_until;
        pfd[0] = (struct pollfd){.fd = bs->wake[0], .events = POLLIN};
        pfd[1] = (struct pollfd){.fd = pause_until > now ? -1 : bs->listen_fd, .events = POLLIN};
        for (int i = 0; i < n; i++) {
            pfd[2 + i] = (struct pollfd){.fd = conns[i].fd,
                                         .events = conns[i].out ? POLLOUT : POLLIN};
            if (conns[i].deadline_ns < next)
                next = conns[i].deadline_ns;
        }
        int wait_ms = next > now ? (int)((next - now + 999999) / 1000000) : 0;
        if (poll(pfd, (nfds_t)(n + 2), wait_ms) < 0 && errno != EINTR)
            break;
        if (pfd[0].revents)
            break;
        now = kvw__now_ns();
        for (int i = n - 1; i >= 0; i--) {
            kvw_bs_conn_t *c = &conns[i];
            bool keep = true;
            if (pfd[2 + i].revents & POLLOUT)
                keep = kvw_bs_write(c);
            else if (pfd[2 + i].revents)
                keep = kvw_bs_read(bs, c) && kvw_bs_write(c);
            /* A frame (or the reading of its answer) that misses its deadline ends the
             * connection, as does a connection that never says anything. */
            if (keep && c->deadline_ns <= now)
                keep = false;
            if (!keep) {
                kvw_bs_release(bs, c);
                kvw_bs_close(c);
                conns[i] = conns[--n];
            }
        }
        if (pfd[1].revents) {
            for (int k = 0; k < 64; k++) {
                struct sockaddr_storage src;
                socklen_t sl = sizeof(src);
                int fd = accept4(bs->listen_fd, (struct sockaddr *)&src, &sl,
                                 SOCK_CLOEXEC | SOCK_NONBLOCK);
                if (fd < 0) {
                    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
                        errno == ENOMEM)
                        pause_until = kvw__now_ns() + 100000000ull;
                    break;
                }
                if (!kvw_bs_make_room(conns, &n, &src)) {
                    close(fd);
                    continue;
                }
                kvw__sock_nodelay(fd);
                uint64_t t = kvw__now_ns();
                conns[n++] = (kvw_bs_conn_t){.fd = fd, .id = ++next_id, .src = src,
                                             .accepted_ns = t,
                                             .deadline_ns = t + KVW_BS_FRAME_MS * 1000000ull};
            }
        }
    }
    for (int i = 0; i < n; i++)
        kvw_bs_close(&conns[i]);
    free(conns);
    return NULL;
}

kvw_status_t kvw__bootstrap_start(const char *host, uint16_t port, const char *secret,
                                  kvw_bootstrap_t **bs_p)
{
    if (secret && strlen(secret) >= sizeof(((kvw_bootstrap_t *)0)->secret))
        return kvw__error(KVW_ERR_INVALID_PARAM, "the shared secret is longer than 255 bytes");
    kvw_bootstrap_t *bs = calloc(1, sizeof(*bs));
    kvw_status_t st;
    if (bs == NULL || (bs->entries = calloc(KVW_BS_MAX_ENTRIES, sizeof(kvw_bs_entry_t))) == NULL) {
        free(bs);
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory starting the bootstrap endpoint");
    }
    snprintf(bs->secret, sizeof(bs->secret), "%s", secret ? secret : "");
    bs->ttl_ns = KVW_BS_ONESHOT_TTL_MS * 1000000ull;
    if (kvw__config_u64("KVW_BS_MAX_SOURCE_ENTRIES", &bs->max_source_entries) != KVW_OK) {
        free(bs->entries);
        free(bs);
        return KVW_ERR_INVALID_PARAM; /* the message names the variable */
    }
    uint16_t bound;
    if ((st = kvw__tcp_listen(host, port, &bs->listen_fd, &bound)) != KVW_OK)
        goto err_free;
    /* The thread accepts until EAGAIN: the listening socket must not block. */
    int fl = fcntl(bs->listen_fd, F_GETFL);
    if (fl < 0 || fcntl(bs->listen_fd, F_SETFL, fl | O_NONBLOCK) < 0) {
        st = kvw__error(KVW_ERR_IO, "bootstrap: fcntl: %s", strerror(errno));
        goto err_close_listen;
    }
    if (pipe2(bs->wake, O_CLOEXEC) < 0) {
        st = kvw__error(KVW_ERR_IO, "pipe: %s", strerror(errno));
        goto err_close_listen;
    }
    kvw__format_hostport(host, bound, bs->addr, sizeof(bs->addr));
    pthread_mutex_init(&bs->mu, NULL);
    if (pthread_create(&bs->thread, NULL, kvw_bs_main, bs) != 0) {
        st = kvw__error(KVW_ERR_IO, "cannot start the bootstrap thread");
        close(bs->wake[0]);
        close(bs->wake[1]);
        goto err_close_listen;
    }
    *bs_p = bs;
    return KVW_OK;
err_close_listen:
    close(bs->listen_fd);
err_free:
    free(bs->entries);
    free(bs);
    return st;
}

const char *kvw__bootstrap_addr(kvw_bootstrap_t *bs) { return bs->addr; }

void kvw__bootstrap_set_ttl(kvw_bootstrap_t *bs, uint32_t ttl_ms)
{
    pthread_mutex_lock(&bs->mu);
    bs->ttl_ns = (uint64_t)ttl_ms * 1000000ull;
    pthread_mutex_unlock(&bs->mu);
}

kvw_status_t kvw_bootstrap_start(const char *addr, kvw_bootstrap_h *bootstrap_p)
{
    kvw_bootstrap_params_t p = {.field_mask = KVW_BOOTSTRAP_FIELD_ADDR, .addr = addr};
    return kvw_bootstrap_start_ex(&p, bootstrap_p);
}

kvw_status_t kvw_bootstrap_start_ex(const kvw_bootstrap_params_t *params,
                                    kvw_bootstrap_h *bootstrap_p)
{
    char host[128];
    uint16_t port;
    if (params == NULL || bootstrap_p == NULL || !(params->field_mask & KVW_BOOTSTRAP_FIELD_ADDR))
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_bootstrap_start: NULL argument or no "
                          "address");
    kvw_status_t st = kvw__mask_check(&kvw__spec_bootstrap_params, params->field_mask,
                                      "kvw_bootstrap_start_ex: params");
    if (st != KVW_OK)
        return st;
    st = kvw__parse_hostport(params->addr, host, sizeof(host), &port);
    if (st != KVW_OK)
        return st;
    const char *secret = (params->field_mask & KVW_BOOTSTRAP_FIELD_SECRET) ? params->secret : NULL;
    return kvw__bootstrap_start(host, port, secret, bootstrap_p);
}

const char *kvw_bootstrap_address(kvw_bootstrap_h bs)
{
    return bs ? bs->addr : NULL;
}

void kvw_bootstrap_stop(kvw_bootstrap_h bs)
{
    kvw__bootstrap_stop(bs);
}

void kvw__bootstrap_stop(kvw_bootstrap_t *bs)
{
    if (bs == NULL)
        return;
    if (write(bs->wake[1], "x", 1) < 0) {
        /* The thread also exits when the pipe closes. */
    }
    pthread_join(bs->thread, NULL);
    close(bs->wake[0]);
    close(bs->wake[1]);
    close(bs->listen_fd);
    pthread_mutex_destroy(&bs->mu);
    free(bs->entries);
    free(bs);
}

/* One request on an open connection and its answer: `want`, or an error answer whose
 * reason becomes the error (BUSY and AUTH keep their code, others read REJECTED). */
static kvw_status_t kvw_bs_exchange(int fd, const char *bs_addr, kvw_wbuf_t *w,
                                    uint64_t deadline_ns, uint8_t want, uint8_t **payload_p,
                                    uint32_t *len_p)
{
    kvw_status_t st;
    uint8_t type = 0;
    *payload_p = NULL;
    if ((st = kvw__wb_finish(w)) == KVW_OK &&
        (st = kvw__sock_send_all(fd, w->p, w->len, deadline_ns)) == KVW_OK &&
        (st = kvw__sock_recv_frame(fd, deadline_ns, &type, payload_p, len_p)) == KVW_OK &&
        type != want) {
        if (type == KVW_MSG_BS_ERROR) {
            /* The endpoint refused with a reason: pass it on (no retry can cure it). */
            kvw_rbuf_t r;
            char why[400];
            kvw__rb_init(&r, *payload_p, *len_p);
            kvw_status_t code = (kvw_status_t)(int32_t)kvw__rb_u32(&r);
            kvw__rb_str(&r, why, sizeof(why));
            if (r.bad || code >= 0)
                code = KVW_ERR_MALFORMED;
            st = kvw__error(code, "bootstrap %s refused: %s", bs_addr,
                            r.bad ? "(malformed answer)" : why);
            st = st == KVW_ERR_BUSY || st == KVW_ERR_AUTH ? st : KVW_ERR_REJECTED;
        } else {
            st = kvw__error(KVW_ERR_MALFORMED, "bootstrap %s answered frame type %u", bs_addr,
                            type);
        }
        free(*payload_p);
        *payload_p = NULL;
    }
    return st;
}

static kvw_status_t kvw_bs_connect(const char *bs_addr, uint64_t deadline_ns, int *fd_p)
{
    char host[128];
    uint16_t port;
    kvw_status_t st = kvw__parse_hostport(bs_addr, host, sizeof(host), &port);
    if (st != KVW_OK)
        return st;
    return kvw__tcp_connect(host, port, deadline_ns, fd_p);
}

/* One request and its answer on a connection of its own. */
static kvw_status_t kvw_bs_call(const char *bs_addr, kvw_wbuf_t *w, uint64_t deadline_ns,
                                uint8_t want, uint8_t **payload_p, uint32_t *len_p)
{
    int fd;
    kvw_status_t st = kvw_bs_connect(bs_addr, deadline_ns, &fd);
    if (st != KVW_OK)
        return st;
    st = kvw_bs_exchange(fd, bs_addr, w, deadline_ns, want, payload_p, len_p);
    close(fd);
    return st;
}

/* One registration attempt: with a secret, the endpoint's challenge first, then the
 * entry with its MAC over that challenge, on the same connection. keep_fd: on success
 * the connection stays open there (a held registration). */
static kvw_status_t kvw_bs_register_once(const char *bs_addr, kvw_bs_entry_t *e0,
                                         const char *secret, uint64_t deadline_ns, int *keep_fd)
{
    int fd;
    kvw_status_t st = kvw_bs_connect(bs_addr, deadline_ns, &fd);
    if (st != KVW_OK)
        return st;
    kvw_bs_entry_t e = *e0;
    e.has_mac = false;
    kvw_wbuf_t w;
    uint8_t *p = NULL;
    uint32_t len = 0;
    if (secret && secret[0]) {
        kvw__wb_init(&w, KVW_MSG_BS_CHALLENGE);
        st = kvw_bs_exchange(fd, bs_addr, &w, deadline_ns, KVW_MSG_BS_CHALLENGE, &p, &len);
        kvw__wb_free(&w);
        if (st == KVW_OK && len != sizeof(e.nonce))
            st = kvw__error(KVW_ERR_MALFORMED, "bootstrap %s answered a challenge of %u bytes",
                            bs_addr, len);
        if (st == KVW_OK) {
            memcpy(e.nonce, p, sizeof(e.nonce));
            e.has_mac = true;
            kvw__bootstrap_entry_mac(secret, &e, e.mac);
        }
        free(p);
        p = NULL;
    }
    if (st == KVW_OK) {
        kvw__wb_init(&w, keep_fd ? KVW_MSG_BS_HOLD : KVW_MSG_BS_REGISTER);
        kvw__bootstrap_put_entry(&w, &e);
        st = kvw_bs_exchange(fd, bs_addr, &w, deadline_ns, KVW_MSG_BS_OK, &p, &len);
        kvw__wb_free(&w);
        free(p);
    }
    if (st == KVW_OK && keep_fd)
        *keep_fd = fd;
    else
        close(fd);
    if (st == KVW_OK)
        *e0 = e; /* with its nonce and MAC: the registration MACs bind them */
    return st;
}

static kvw_status_t kvw_bs_register(const char *bs_addr, kvw_bs_entry_t *e,
                                     const char *secret, uint64_t deadline_ns, int *keep_fd)
{
    kvw_status_t st;
    do {
        st = kvw_bs_register_once(bs_addr, e, secret, deadline_ns, keep_fd);
        if (st == KVW_OK)
            return KVW_OK;
        /* A live rank in the way (its registration "is still open") may be a previous
         * process of this rank whose connection the endpoint has not seen close yet:
         * retried until the deadline, which then reports the refusal itself. */
        if (st == KVW_ERR_BUSY && strstr(kvw_last_error(), "still open") &&
            kvw__now_ns() + 50000000ull < deadline_ns) {
            usleep(50000);
            continue;
        }
        if (st == KVW_ERR_BUSY || st == KVW_ERR_REJECTED || st == KVW_ERR_AUTH)
            return st; /* refused with a reason (kvw_last_error) */
        /* A malformed address or a host that does not resolve cannot get better: at once.
         * A refused connection can (engines start their ranks before the endpoint). */
        if (st == KVW_ERR_INVALID_PARAM)
            return kvw__error(st, "cannot register with the bootstrap endpoint %s: %s",
                              bs_addr, kvw_last_error());
        usleep(50000); /* the endpoint may not be up yet */
    } while (kvw__now_ns() < deadline_ns);
    return kvw__error(KVW_ERR_TIMEOUT, "cannot register with the bootstrap endpoint %s: %s",
                      bs_addr, kvw_last_error());
}

kvw_status_t kvw__bootstrap_register(const char *bs_addr, kvw_bs_entry_t *e,
                                     const char *secret, uint64_t deadline_ns)
{
    return kvw_bs_register(bs_addr, e, secret, deadline_ns, NULL);
}

kvw_status_t kvw__bootstrap_hold(const char *bs_addr, kvw_bs_entry_t *e,
                                 const char *secret, uint64_t deadline_ns, int *fd_p)
{
    *fd_p = -1;
    return kvw_bs_register(bs_addr, e, secret, deadline_ns, fd_p);
}

/* With a secret, every entry must carry the MAC of its fields under it: a forged one
 * (no MAC, or a wrong one) fails the lookup, naming the rank and the address it gives,
 * before anyone connects there. */
static kvw_status_t kvw_bs_verify_table(const char *bs_addr, const char *secret,
                                        const kvw_bs_entry_t *e, uint32_t n)
{
    if (secret == NULL || !secret[0])
        return KVW_OK;
    for (uint32_t i = 0; i < n; i++) {
        uint8_t want[32];
        if (e[i].has_mac) {
            kvw__bootstrap_entry_mac(secret, &e[i], want);
            if (kvw__ct_equal(want, e[i].mac, sizeof(want)))
                continue;
        }
        return kvw__error(KVW_ERR_AUTH, "bootstrap %s: the entry of prefill rank dp%u/tp%u/pp%u "
                          "(address %s) %s; not connecting to it", bs_addr, e[i].dp, e[i].tp,
                          e[i].pp, e[i].addr,
                          e[i].has_mac ? "carries a MAC that does not match the shared secret: "
                                         "forged, or registered under another secret"
                                       : "carries no MAC: forged, or registered by a rank "
                                         "without the shared secret");
    }
    return KVW_OK;
}

/* Checks a table against what the decode expects. Returns KVW_OK when it is complete,
 * KVW_INPROGRESS (with *why set) while ranks are missing, or an error that no waiting can
 * cure: ranks declaring different instance sizes, or sizes other than the decode expects. */
static kvw_status_t kvw_bs_check_table(const char *bs_addr, const kvw_bs_entry_t *e, uint32_t n,
                                       uint32_t tp, uint32_t pp, uint32_t dp, char *why,
                                       size_t why_cap)
{
    if (n == 0) {
        snprintf(why, why_cap, "no prefill rank registered");
        return KVW_INPROGRESS;
    }
    uint32_t T = e[0].tp_size, P = KVW_MAX(e[0].pp_size, 1), D = KVW_MAX(e[0].dp_size, 1);
    for (uint32_t i = 1; i < n; i++)
        if (e[i].tp_size != T || KVW_MAX(e[i].pp_size, 1) != P || KVW_MAX(e[i].dp_size, 1) != D)
            return kvw__error(KVW_ERR_INCOMPATIBLE,
                              "bootstrap %s: prefill ranks disagree on the instance geometry: "
                              "rank dp%u/tp%u/pp%u declares TP %u PP %u DP %u, rank "
                              "dp%u/tp%u/pp%u declares TP %u PP %u DP %u",
                              bs_addr, e[0].dp, e[0].tp, e[0].pp, T, P, D, e[i].dp, e[i].tp,
                              e[i].pp, e[i].tp_size, KVW_MAX(e[i].pp_size, 1),
                              KVW_MAX(e[i].dp_size, 1));
    if ((tp && tp != T) || (pp && pp != P) || (dp && dp != D))
        return kvw__error(KVW_ERR_INCOMPATIBLE,
                          "bootstrap %s: this decode expects a prefill instance of TP %u PP %u "
                          "DP %u, but its registered ranks declare TP %u PP %u DP %u",
                          bs_addr, tp ? tp : T, pp ? pp : P, dp ? dp : D, T, P, D);
    if (T == 0 || (uint64_t)T * P * D > KVW_BS_MAX_ENTRIES)
        return kvw__error(KVW_ERR_MALFORMED, "bootstrap %s: prefill instance of TP %u PP %u DP "
                          "%u is out of range", bs_addr, T, P, D);
    uint32_t want = T * P * D, have = 0;
    uint8_t *seen = calloc(want, 1);
    if (seen == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory checking the bootstrap table");
    for (uint32_t i = 0; i < n; i++) {
        if (e[i].tp >= T || e[i].pp >= P || e[i].dp >= D) {
            free(seen);
            return kvw__error(KVW_ERR_MALFORMED, "bootstrap %s: entry dp%u/tp%u/pp%u lies "
                              "outside its declared TP %u PP %u DP %u", bs_addr, e[i].dp,
                              e[i].tp, e[i].pp, T, P, D);
        }
        size_t pos = ((size_t)e[i].dp * P + e[i].pp) * T + e[i].tp;
        have += !seen[pos];
        seen[pos] = 1;
    }
    free(seen);
    if (have < want) {
        snprintf(why, why_cap, "%u of %u prefill ranks registered (TP %u PP %u DP %u)", have,
                 want, T, P, D);
        return KVW_INPROGRESS;
    }
    return KVW_OK;
}

/* Whether entry `e` matches the geometry the decode expects (0: any). */
static bool kvw_bs_expected(const kvw_bs_entry_t *e, uint32_t tp, uint32_t pp, uint32_t dp)
{
    return (!tp || e->tp_size == tp) && (!pp || KVW_MAX(e->pp_size, 1) == pp) &&
           (!dp || KVW_MAX(e->dp_size, 1) == dp);
}

/*
 * A table as the decode uses it: an entry that is not this instance's fails only a
 * lookup that needs it. With a secret, entries without a valid MAC are set aside; with
 * expected sizes, so are entries of another geometry. The rest (moved to the front,
 * *n_p of them) must make a complete instance (kvw_bs_check_table). Fails at once
 * (AUTH, naming it) when a set-aside entry holds a position the instance still lacks,
 * or when nothing but such entries is there; with nothing of the expected geometry,
 * the whole table is checked (its error names the geometries). KVW_INPROGRESS while
 * ranks are missing.
 */
static kvw_status_t kvw_bs_sift_table(const char *bs_addr, const char *secret,
                                      kvw_bs_entry_t *e, uint32_t *n_p, uint32_t tp,
                                      uint32_t pp, uint32_t dp, char *why, size_t why_cap)
{
    uint32_t n = *n_p, nv = 0;
    bool check_mac = secret && secret[0];
    for (uint32_t i = 0; i < n; i++) {
        uint8_t want[32];
        bool ok = !check_mac || (e[i].has_mac && (kvw__bootstrap_entry_mac(secret, &e[i], want),
                                                   kvw__ct_equal(want, e[i].mac, 32)));
        ok = ok && kvw_bs_expected(&e[i], tp, pp, dp);
        if (ok) {
            kvw_bs_entry_t t = e[nv];
            e[nv++] = e[i];
            e[i] = t;
        }
    }
    if (nv == 0 && n > 0) {
        /* Nothing usable: the first forged entry, or the geometry mismatch, says why. */
        kvw_status_t st = kvw_bs_verify_table(bs_addr, secret, e, n);
        return st != KVW_OK ? st : kvw_bs_check_table(bs_addr, e, n, tp, pp, dp, why, why_cap);
    }
    kvw_status_t st = kvw_bs_check_table(bs_addr, e, nv, tp, pp, dp, why, why_cap);
    if (st != KVW_INPROGRESS) {
        if (st == KVW_OK && nv < n)
            kvw__log(KVW_LOG_WARN, "bootstrap %s: %u entries that are not this instance's "
                     "(forged or of another geometry) ignored", bs_addr, n - nv);
        *n_p = nv;
        return st;
    }
    /* Incomplete: a forged entry holding a missing position is what this lookup needs. */
    for (uint32_t i = nv; check_mac && i < n; i++) {
        bool held = false;
        for (uint32_t j = 0; j < nv && !held; j++)
            held = e[j].dp == e[i].dp && e[j].tp == e[i].tp && e[j].pp == e[i].pp;
        if (!held && kvw_bs_expected(&e[i], e[0].tp_size, KVW_MAX(e[0].pp_size, 1),
                                     KVW_MAX(e[0].dp_size, 1)) &&
            (st = kvw_bs_verify_table(bs_addr, secret, &e[i], 1)) != KVW_OK)
            return st;
    }
    return KVW_INPROGRESS;
}

kvw_status_t kvw__bootstrap_lookup(const char *bs_addr, uint32_t tp, uint32_t pp, uint32_t dp,
                                   const char *secret, uint64_t deadline_ns,
                                   kvw_bs_entry_t **entries_p, uint32_t *count_p)
{
    return kvw__bootstrap_lookup_ex(bs_addr, tp, pp, dp, secret, deadline_ns, false, NULL,
                                    entries_p, count_p);
}

kvw_status_t kvw__bootstrap_lookup_ex(const char *bs_addr, uint32_t tp, uint32_t pp, uint32_t dp,
                                      const char *secret, uint64_t deadline_ns, bool fail_fast,
                                      const _Atomic bool *cancel, kvw_bs_entry_t **entries_p,
                                      uint32_t *count_p)
{
    char last[256] = "no answer yet";
    char table[256] = ""; /* what the last table that did answer lacked */
    do {
        if (cancel && atomic_load(cancel))
            return kvw__error(KVW_ERR_SHUTDOWN, "bootstrap %s: lookup cancelled", bs_addr);
        kvw_wbuf_t w;
        uint8_t *p = NULL;
        uint32_t len = 0;
        kvw__wb_init(&w, KVW_MSG_BS_LOOKUP);
        kvw_status_t st = kvw_bs_call(bs_addr, &w, deadline_ns, KVW_MSG_BS_TABLE, &p, &len);
        kvw__wb_free(&w);
        /* A malformed address or a host that does not resolve cannot get better. */
        if (st == KVW_ERR_INVALID_PARAM || (fail_fast && st != KVW_OK))
            return kvw__error(st, "bootstrap endpoint %s: %s", bs_addr, kvw_last_error());
        if (st != KVW_OK) {
            snprintf(last, sizeof(last), "%s", kvw_last_error());
            usleep(50000);
            continue;
        }
        kvw_rbuf_t r;
        kvw__rb_init(&r, p, len);
        uint32_t n = kvw__rb_u32(&r);
        kvw_bs_entry_t *e = NULL;
        if (!r.bad && n <= KVW_BS_MAX_ENTRIES)
            e = calloc(n ? n : 1, sizeof(*e));
        for (uint32_t i = 0; e && i < n; i++)
            kvw_bs_get_entry(&r, &e[i]);
        free(p);
        if (e == NULL || kvw__rb_done(&r, "bootstrap table") != KVW_OK) {
            free(e);
            return kvw__error(KVW_ERR_MALFORMED, "bootstrap %s sent a malformed table", bs_addr);
        }
        uint32_t nv = n;
        st = kvw_bs_sift_table(bs_addr, secret, e, &nv, tp, pp, dp, last, sizeof(last));
        if (st == KVW_INPROGRESS)
            snprintf(table, sizeof(table), "%s", last);
        if (st == KVW_OK) {
            *entries_p = e;
            *count_p = nv;
            return KVW_OK;
        }
        free(e);
        if (st != KVW_INPROGRESS)
            return st;
        usleep(50000);
    } while (kvw__now_ns() < deadline_ns);
    /* A last attempt cut off by the deadline does not hide what the table lacked. */
    if (table[0] && strcmp(table, last) != 0)
        return kvw__error(KVW_ERR_TIMEOUT, "bootstrap %s: prefill instance incomplete at the "
                          "timeout (%s; last attempt: %s)", bs_addr, table, last);
    return kvw__error(KVW_ERR_TIMEOUT, "bootstrap %s: prefill instance incomplete at the timeout "
                      "(%s)", bs_addr, last);
}
