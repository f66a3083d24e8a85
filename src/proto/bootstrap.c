/*
 * The bootstrap endpoint: prefill ranks register their control address; decode ranks
 * look the table up. One thread, poll() over its connections; a malformed frame drops
 * only the connection that sent it.
 */
#include "proto/proto.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define KVW_BS_MAX_CONNS 256
#define KVW_BS_MAX_ENTRIES 4096

struct kvw_bootstrap {
    int listen_fd;
    int wake[2];
    char addr[128];
    pthread_t thread;
    pthread_mutex_t mu;
    kvw_bs_entry_t *entries;
    uint32_t num_entries;
};

static void kvw_bs_put_entry(kvw_wbuf_t *w, const kvw_bs_entry_t *e)
{
    kvw__wb_u32(w, e->dp);
    kvw__wb_u32(w, e->tp);
    kvw__wb_u32(w, e->pp);
    kvw__wb_u32(w, e->dp_size);
    kvw__wb_u32(w, e->tp_size);
    kvw__wb_u32(w, e->pp_size);
    kvw__wb_str(w, e->addr);
}

static void kvw_bs_get_entry(kvw_rbuf_t *r, kvw_bs_entry_t *e)
{
    e->dp = kvw__rb_u32(r);
    e->tp = kvw__rb_u32(r);
    e->pp = kvw__rb_u32(r);
    e->dp_size = kvw__rb_u32(r);
    e->tp_size = kvw__rb_u32(r);
    e->pp_size = kvw__rb_u32(r);
    kvw__rb_str(r, e->addr, sizeof(e->addr));
}

/* Handles one frame; returns false to drop the connection. */
static bool kvw_bs_handle(kvw_bootstrap_t *bs, int fd, uint8_t type, const uint8_t *p, uint32_t len)
{
    kvw_rbuf_t r;
    kvw_wbuf_t w;
    kvw__rb_init(&r, p, len);
    if (type == KVW_MSG_BS_REGISTER) {
        kvw_bs_entry_t e;
        kvw_bs_get_entry(&r, &e);
        if (kvw__rb_done(&r, "bootstrap register") != KVW_OK || e.tp >= e.tp_size ||
            e.dp >= KVW_MAX(e.dp_size, 1) || e.pp >= KVW_MAX(e.pp_size, 1))
            return false;
        pthread_mutex_lock(&bs->mu);
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
        if (i < bs->num_entries || bs->num_entries < KVW_BS_MAX_ENTRIES) {
            bs->entries[i] = e; /* a restarted rank replaces its old entry */
            if (i == bs->num_entries)
                bs->num_entries++;
        }
        pthread_mutex_unlock(&bs->mu);
        kvw__wb_init(&w, KVW_MSG_BS_OK);
    } else if (type == KVW_MSG_BS_LOOKUP) {
        if (kvw__rb_done(&r, "bootstrap lookup") != KVW_OK)
            return false;
        kvw__wb_init(&w, KVW_MSG_BS_TABLE);
        pthread_mutex_lock(&bs->mu);
        kvw__wb_u32(&w, bs->num_entries);
        for (uint32_t i = 0; i < bs->num_entries; i++)
            kvw_bs_put_entry(&w, &bs->entries[i]);
        pthread_mutex_unlock(&bs->mu);
    } else {
        return false;
    }
    bool ok = kvw__wb_finish(&w) == KVW_OK &&
              kvw__sock_send_all(fd, w.p, w.len, kvw__now_ns() + 2000000000ull) == KVW_OK;
    kvw__wb_free(&w);
    return ok;
}

static void *kvw_bs_main(void *arg)
{
    kvw_bootstrap_t *bs = arg;
    struct pollfd pfd[KVW_BS_MAX_CONNS + 2];
    int conns[KVW_BS_MAX_CONNS];
    int n = 0;
    for (;;) {
        pfd[0] = (struct pollfd){.fd = bs->wake[0], .events = POLLIN};
        pfd[1] = (struct pollfd){.fd = bs->listen_fd, .events = POLLIN};
        for (int i = 0; i < n; i++)
            pfd[2 + i] = (struct pollfd){.fd = conns[i], .events = POLLIN};
        if (poll(pfd, (nfds_t)(n + 2), -1) < 0 && errno != EINTR)
            break;
        if (pfd[0].revents)
            break;
        for (int i = n - 1; i >= 0; i--) {
            if (!pfd[2 + i].revents)
                continue;
            uint8_t type, *payload = NULL;
            uint32_t len = 0;
            /* A frame must arrive whole within a second once it starts. */
            bool keep = kvw__sock_recv_frame(conns[i], kvw__now_ns() + 1000000000ull, &type,
                                             &payload, &len) == KVW_OK &&
                        kvw_bs_handle(bs, conns[i], type, payload, len);
            free(payload);
            if (!keep) {
                close(conns[i]);
                conns[i] = conns[--n];
            }
        }
        if (pfd[1].revents) {
            int fd = accept4(bs->listen_fd, NULL, NULL, SOCK_CLOEXEC);
            if (fd >= 0) {
                if (n < KVW_BS_MAX_CONNS)
                    conns[n++] = fd;
                else
                    close(fd);
            }
        }
    }
    for (int i = 0; i < n; i++)
        close(conns[i]);
    return NULL;
}

kvw_status_t kvw__bootstrap_start(const char *host, uint16_t port, kvw_bootstrap_t **bs_p)
{
    kvw_bootstrap_t *bs = calloc(1, sizeof(*bs));
    kvw_status_t st;
    if (bs == NULL || (bs->entries = calloc(KVW_BS_MAX_ENTRIES, sizeof(kvw_bs_entry_t))) == NULL) {
        free(bs);
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory starting the bootstrap endpoint");
    }
    uint16_t bound;
    if ((st = kvw__tcp_listen(host, port, &bs->listen_fd, &bound)) != KVW_OK)
        goto err_free;
    if (pipe2(bs->wake, O_CLOEXEC) < 0) {
        st = kvw__error(KVW_ERR_IO, "pipe: %s", strerror(errno));
        goto err_close_listen;
    }
    snprintf(bs->addr, sizeof(bs->addr), "%s:%u", host, bound);
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

kvw_status_t kvw_bootstrap_start(const char *addr, kvw_bootstrap_h *bootstrap_p)
{
    char host[128];
    uint16_t port;
    if (bootstrap_p == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_bootstrap_start: NULL argument");
    kvw_status_t st = kvw__parse_hostport(addr, host, sizeof(host), &port);
    if (st != KVW_OK)
        return st;
    return kvw__bootstrap_start(host, port, bootstrap_p);
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

static kvw_status_t kvw_bs_call(const char *bs_addr, kvw_wbuf_t *w, uint64_t deadline_ns,
                                uint8_t want, uint8_t **payload_p, uint32_t *len_p)
{
    char host[128];
    uint16_t port;
    int fd;
    kvw_status_t st = kvw__parse_hostport(bs_addr, host, sizeof(host), &port);
    if (st != KVW_OK)
        return st;
    if ((st = kvw__tcp_connect(host, port, deadline_ns, &fd)) != KVW_OK)
        return st;
    uint8_t type = 0;
    if ((st = kvw__wb_finish(w)) == KVW_OK &&
        (st = kvw__sock_send_all(fd, w->p, w->len, deadline_ns)) == KVW_OK &&
        (st = kvw__sock_recv_frame(fd, deadline_ns, &type, payload_p, len_p)) == KVW_OK &&
        type != want) {
        free(*payload_p);
        st = kvw__error(KVW_ERR_MALFORMED, "bootstrap %s answered frame type %u", bs_addr, type);
    }
    close(fd);
    return st;
}

kvw_status_t kvw__bootstrap_register(const char *bs_addr, const kvw_bs_entry_t *e,
                                     uint64_t deadline_ns)
{
    kvw_status_t st;
    do {
        kvw_wbuf_t w;
        uint8_t *p = NULL;
        uint32_t len = 0;
        kvw__wb_init(&w, KVW_MSG_BS_REGISTER);
        kvw_bs_put_entry(&w, e);
        st = kvw_bs_call(bs_addr, &w, deadline_ns, KVW_MSG_BS_OK, &p, &len);
        kvw__wb_free(&w);
        free(p);
        if (st == KVW_OK)
            return KVW_OK;
        usleep(50000); /* the endpoint may not be up yet */
    } while (kvw__now_ns() < deadline_ns);
    return kvw__error(KVW_ERR_TIMEOUT, "cannot register with the bootstrap endpoint %s: %s",
                      bs_addr, kvw_last_error());
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

kvw_status_t kvw__bootstrap_lookup(const char *bs_addr, uint32_t tp, uint32_t pp, uint32_t dp,
                                   uint64_t deadline_ns, kvw_bs_entry_t **entries_p,
                                   uint32_t *count_p)
{
    return kvw__bootstrap_lookup_ex(bs_addr, tp, pp, dp, deadline_ns, false, NULL, entries_p,
                                    count_p);
}

kvw_status_t kvw__bootstrap_lookup_ex(const char *bs_addr, uint32_t tp, uint32_t pp, uint32_t dp,
                                      uint64_t deadline_ns, bool fail_fast,
                                      const _Atomic bool *cancel, kvw_bs_entry_t **entries_p,
                                      uint32_t *count_p)
{
    char last[256] = "no answer yet";
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
        st = kvw_bs_check_table(bs_addr, e, n, tp, pp, dp, last, sizeof(last));
        if (st == KVW_OK) {
            *entries_p = e;
            *count_p = n;
            return KVW_OK;
        }
        free(e);
        if (st != KVW_INPROGRESS)
            return st;
        usleep(50000);
    } while (kvw__now_ns() < deadline_ns);
    return kvw__error(KVW_ERR_TIMEOUT, "bootstrap %s: prefill instance incomplete at the timeout "
                      "(%s)", bs_addr, last);
}
