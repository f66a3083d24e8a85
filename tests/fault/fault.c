/*
 * The fault-injecting transport wrapper (see fault.h for the spec language).
 *
 * Transport tables carry no context pointer, so each wrapped table lives in one of a
 * few static slots, and the table's functions that receive no instance handle (init,
 * rkey_unpack, rkey_release, put, notify, ep_close) are per-slot trampolines. Endpoint
 * handles are the inner transport's own (no wrapping): the inner transport's callbacks
 * then report handles the caller knows. Endpoints this wrapper connected are tracked in
 * the slot's endpoint list with their fault state; any other endpoint is passed through.
 */
#include "fault/fault.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define FAULT_SLOTS 8
#define FAULT_SPEC_MAX 512

typedef struct fault_cfg {
    uint64_t seed;
    double delay, drop_put, trunc_put, dup_put, reorder_put, fail_put, mislay_put;
    double drop_notify, dup_notify, reorder_notify, corrupt_notify, fail_notify, fail_connect;
    uint32_t delay_ms, reorder_ms;
    uint64_t close_after_puts, close_after_notifies;
} fault_cfg_t;

struct fault_tl;

typedef struct fault_ep {
    struct fault_ep *next;
    kvw_tl_ep_h ep; /* the inner handle, which is also the caller's */
    struct fault_tl *tl;
    uint64_t put_calls, notify_calls;
    bool failed;       /* put/notify return CONN_CLOSED from now on */
    bool inner_closed; /* the inner endpoint was closed by a fault */
    uint32_t busy;     /* calls using the inner endpoint now (callers' threads, flusher) */
    uint8_t *held;     /* a notification held back (reorder_notify) */
    size_t held_len;
    uint64_t held_ns;
} fault_ep_t;

typedef struct fault_slot {
    bool used;
    const kvw_tl_ops_t *inner;
    char spec[FAULT_SPEC_MAX];
    fault_cfg_t cfg;
    kvw_tl_ops_t ops;
    pthread_mutex_t mu; /* guards eps and every fault_ep_t of the slot */
    pthread_cond_t cv;  /* busy counters drop */
    fault_ep_t *eps;
    uint64_t instances;
} fault_slot_t;

/* The receiver's callbacks, behind the notify hook (instances the wrapper starts). */
typedef struct fault_cbs {
    kvw_tl_callbacks_t orig;
} fault_cbs_t;

typedef struct fault_tl {
    uint32_t magic;
    fault_cbs_t *cbs; /* NULL: attached, the receiver's callbacks go straight */
    fault_slot_t *slot;
    fault_cfg_t cfg; /* the slot's, or the one given to kvw__tl_fault_attach */
    kvw_tl_h inner;
    pthread_mutex_t rng_mu;
    uint64_t rng;
    pthread_t flusher;
    bool flusher_started;
    bool stopping; /* slot->mu */
} fault_tl_t;

#define FAULT_MAGIC 0x46415554u

static pthread_mutex_t fault_slots_mu = PTHREAD_MUTEX_INITIALIZER;
static fault_slot_t fault_slots[FAULT_SLOTS];
static uint64_t fault_counts[KVW_FAULT_NUM_KINDS];

static const char *const fault_kind_names[] = {
#define KVW_FAULT_X(name, text) text,
    KVW_FAULT_KINDS(KVW_FAULT_X)
#undef KVW_FAULT_X
};

const char *kvw__tl_fault_kind_name(kvw_fault_kind_t kind)
{
    return (unsigned)kind < KVW_FAULT_NUM_KINDS ? fault_kind_names[kind] : "unknown";
}

static void fault_count(kvw_fault_kind_t k, uint64_t n)
{
    __atomic_add_fetch(&fault_counts[k], n, __ATOMIC_RELAXED);
}

void kvw__tl_fault_stats(uint64_t counts[KVW_FAULT_NUM_KINDS])
{
    for (int i = 0; i < KVW_FAULT_NUM_KINDS; i++)
        counts[i] = __atomic_load_n(&fault_counts[i], __ATOMIC_RELAXED);
}

void kvw__tl_fault_stats_reset(void)
{
    for (int i = 0; i < KVW_FAULT_NUM_KINDS; i++)
        __atomic_store_n(&fault_counts[i], 0, __ATOMIC_RELAXED);
}

/* ------------------------------------------------------------------ spec */

static kvw_status_t fault_parse(const char *spec, fault_cfg_t *c)
{
    memset(c, 0, sizeof(*c));
    c->seed = 1;
    c->reorder_ms = 20;
    c->delay = -1;
    bool delay_ms_set = false;
    char buf[FAULT_SPEC_MAX];
    if (spec == NULL)
        spec = "";
    if (strlen(spec) >= sizeof(buf))
        return kvw__error(KVW_ERR_INVALID_PARAM, "fault spec longer than %zu bytes",
                          sizeof(buf) - 1);
    snprintf(buf, sizeof(buf), "%s", spec);
    static const struct {
        const char *key;
        size_t off;
    } probs[] = {
        {"delay", offsetof(fault_cfg_t, delay)},
        {"drop_put", offsetof(fault_cfg_t, drop_put)},
        {"trunc_put", offsetof(fault_cfg_t, trunc_put)},
        {"dup_put", offsetof(fault_cfg_t, dup_put)},
        {"reorder_put", offsetof(fault_cfg_t, reorder_put)},
        {"mislay_put", offsetof(fault_cfg_t, mislay_put)},
        {"fail_put", offsetof(fault_cfg_t, fail_put)},
        {"drop_notify", offsetof(fault_cfg_t, drop_notify)},
        {"dup_notify", offsetof(fault_cfg_t, dup_notify)},
        {"reorder_notify", offsetof(fault_cfg_t, reorder_notify)},
        {"corrupt_notify", offsetof(fault_cfg_t, corrupt_notify)},
        {"fail_notify", offsetof(fault_cfg_t, fail_notify)},
        {"fail_connect", offsetof(fault_cfg_t, fail_connect)},
    };
    char *save = NULL;
    for (char *tok = strtok_r(buf, ", \t", &save); tok; tok = strtok_r(NULL, ", \t", &save)) {
        char *eq = strchr(tok, '=');
        if (eq == NULL || eq == tok || eq[1] == '\0')
            return kvw__error(KVW_ERR_INVALID_PARAM, "fault spec item '%s' is not key=value", tok);
        *eq = '\0';
        const char *key = tok, *val = eq + 1;
        char *end = NULL;
        errno = 0;
        bool done = false;
        for (size_t i = 0; i < sizeof(probs) / sizeof(probs[0]) && !done; i++) {
            if (strcmp(key, probs[i].key) != 0)
                continue;
            double p = strtod(val, &end);
            if (errno || *end || !(p >= 0.0 && p <= 1.0))
                return kvw__error(KVW_ERR_INVALID_PARAM,
                                  "fault spec: %s=%s is not a probability in [0, 1]", key, val);
            *(double *)(void *)((char *)c + probs[i].off) = p;
            done = true;
        }
        if (done)
            continue;
        unsigned long long v = strtoull(val, &end, 0);
        if (errno || *end || val[0] == '-')
            return kvw__error(KVW_ERR_INVALID_PARAM, "fault spec: %s=%s is not a number", key,
                              val);
        if (strcmp(key, "seed") == 0) {
            c->seed = v;
        } else if (strcmp(key, "delay_ms") == 0 || strcmp(key, "reorder_ms") == 0) {
            if (v > 60000)
                return kvw__error(KVW_ERR_INVALID_PARAM, "fault spec: %s=%llu exceeds 60000",
                                  key, v);
            if (key[0] == 'd') {
                c->delay_ms = (uint32_t)v;
                delay_ms_set = true;
            } else {
                c->reorder_ms = (uint32_t)v;
            }
        } else if (strcmp(key, "close_after_puts") == 0) {
            c->close_after_puts = v;
        } else if (strcmp(key, "close_after_notifies") == 0) {
            c->close_after_notifies = v;
        } else {
            return kvw__error(KVW_ERR_INVALID_PARAM, "fault spec: unknown key '%s'", key);
        }
    }
    if (c->delay < 0)
        c->delay = delay_ms_set ? 1.0 : 0.0;
    if (!delay_ms_set)
        c->delay_ms = 5;
    return KVW_OK;
}

/* ------------------------------------------------------------------ helpers */

static _Atomic(kvw_fault_notify_hook_t) fault_notify_hook;

void kvw__tl_fault_set_notify_hook(kvw_fault_notify_hook_t hook)
{
    atomic_store(&fault_notify_hook, hook);
}

static void fault_cb_notify(void *arg, kvw_tl_ep_h ep, const void *msg, size_t len)
{
    fault_cbs_t *c = arg;
    kvw_fault_notify_hook_t hook = atomic_load(&fault_notify_hook);
    if (hook)
        hook(c->orig.arg, msg, len);
    c->orig.on_notify(c->orig.arg, ep, msg, len);
}

static kvw_status_t fault_cb_check_write(void *arg, kvw_tl_ep_h ep, uint64_t room,
                                         uint64_t region, uint64_t off, uint64_t len)
{
    fault_cbs_t *c = arg;
    return c->orig.check_write(c->orig.arg, ep, room, region, off, len);
}

static void fault_cb_check_writes(void *arg, kvw_tl_ep_h ep, const kvw_tl_write_t *w, size_t n,
                                  kvw_status_t *st)
{
    fault_cbs_t *c = arg;
    c->orig.check_writes(c->orig.arg, ep, w, n, st);
}

static void fault_cb_ep_error(void *arg, kvw_tl_ep_h ep, kvw_status_t status, const char *reason)
{
    fault_cbs_t *c = arg;
    c->orig.on_ep_error(c->orig.arg, ep, status, reason);
}

static fault_tl_t *fault_tl(kvw_tl_h h)
{
    fault_tl_t *t = (fault_tl_t *)(void *)h;
    return t && t->magic == FAULT_MAGIC ? t : NULL;
}

static uint64_t fault_rand(fault_tl_t *t)
{
    pthread_mutex_lock(&t->rng_mu);
    t->rng += 0x9e3779b97f4a7c15ull;
    uint64_t z = t->rng;
    pthread_mutex_unlock(&t->rng_mu);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static bool fault_hit(fault_tl_t *t, double p)
{
    if (p <= 0.0)
        return false;
    if (p >= 1.0)
        return true;
    return (double)(fault_rand(t) >> 11) * (1.0 / 9007199254740992.0) < p;
}

static uint64_t fault_below(fault_tl_t *t, uint64_t n)
{
    return n ? fault_rand(t) % n : 0;
}

static void fault_sleep_ms(uint64_t ms)
{
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static void fault_maybe_delay(fault_tl_t *t)
{
    const fault_cfg_t *c = &t->cfg;
    if (c->delay_ms && fault_hit(t, c->delay)) {
        fault_count(KVW_FAULT_DELAY, 1);
        fault_sleep_ms(fault_below(t, (uint64_t)c->delay_ms + 1));
    }
}

/* The tracked endpoint for a handle, or NULL (slot->mu held). */
static fault_ep_t *fault_ep_find(fault_slot_t *s, kvw_tl_ep_h ep)
{
    for (fault_ep_t *e = s->eps; e; e = e->next)
        if (e->ep == ep)
            return e;
    return NULL;
}

/* Closes the inner endpoint as a fault. slot->mu held; the calling thread holds one
 * `busy` reference (fault_ep_enter). Other threads may be inside put or notify on the
 * same endpoint (a context runs several workers): the inner endpoint closes once they
 * are out. A second thread that injects a close meanwhile only marks it failed. */
static void fault_ep_kill(fault_slot_t *s, fault_ep_t *e)
{
    if (e->failed || e->inner_closed) {
        e->failed = true;
        return;
    }
    e->failed = true;
    while (e->busy > 1)
        pthread_cond_wait(&s->cv, &s->mu);
    free(e->held);
    e->held = NULL;
    e->inner_closed = true;
    s->inner->ep_close(e->ep);
}

/* ------------------------------------------------------------------ flusher */

/* Delivers notifications held back longer than reorder_ms. */
static void *fault_flusher_main(void *arg)
{
    fault_tl_t *t = arg;
    fault_slot_t *s = t->slot;
    uint32_t tick = KVW_MAX(1u, KVW_MIN(t->cfg.reorder_ms / 4, 5u));
    pthread_mutex_lock(&s->mu);
    while (!t->stopping) {
        uint64_t now = kvw__now_ns();
        fault_ep_t *due = NULL;
        for (fault_ep_t *e = s->eps; e && !due; e = e->next)
            if (e->tl == t && e->held && !e->inner_closed &&
                now - e->held_ns >= (uint64_t)t->cfg.reorder_ms * 1000000ull)
                due = e;
        if (due == NULL) {
            pthread_mutex_unlock(&s->mu);
            fault_sleep_ms(tick);
            pthread_mutex_lock(&s->mu);
            continue;
        }
        uint8_t *msg = due->held;
        size_t len = due->held_len;
        due->held = NULL;
        if (due->failed) { /* being closed: the held notification is lost with it */
            free(msg);
            continue;
        }
        due->busy++;
        pthread_mutex_unlock(&s->mu);
        kvw_status_t st = s->inner->notify(due->ep, msg, len);
        free(msg);
        pthread_mutex_lock(&s->mu);
        due->busy--;
        if (st != KVW_OK)
            due->failed = true;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static kvw_status_t fault_tl_new(fault_slot_t *s, const fault_cfg_t *cfg, kvw_tl_h inner,
                                 kvw_tl_h *tl_p)
{
    fault_tl_t *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory wrapping a transport");
    t->magic = FAULT_MAGIC;
    t->slot = s;
    t->cfg = *cfg;
    t->inner = inner;
    pthread_mutex_init(&t->rng_mu, NULL);
    pthread_mutex_lock(&s->mu);
    uint64_t n = s->instances++;
    pthread_mutex_unlock(&s->mu);
    t->rng = t->cfg.seed * 0x9e3779b97f4a7c15ull + n * 0xd1b54a32d192ed03ull + 1;
    if (t->cfg.reorder_notify > 0) {
        if (pthread_create(&t->flusher, NULL, fault_flusher_main, t) != 0) {
            pthread_mutex_destroy(&t->rng_mu);
            free(t);
            return kvw__error(KVW_ERR_IO, "cannot start the fault flusher thread");
        }
        t->flusher_started = true;
    }
    *tl_p = (kvw_tl_h)(void *)t;
    return KVW_OK;
}

static void fault_stop_flusher(fault_tl_t *t)
{
    if (!t->flusher_started)
        return;
    pthread_mutex_lock(&t->slot->mu);
    t->stopping = true;
    pthread_mutex_unlock(&t->slot->mu);
    pthread_join(t->flusher, NULL);
    t->flusher_started = false;
}

/* ------------------------------------------------------------------ instance slots */

static kvw_status_t fault_init(fault_slot_t *s, const kvw_tl_params_t *params, kvw_tl_h *tl_p)
{
    kvw_tl_h inner = NULL;
    fault_cbs_t *cbs = calloc(1, sizeof(*cbs));
    if (cbs == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory wrapping a transport");
    cbs->orig = params->cb;
    kvw_tl_params_t p = *params;
    p.cb.arg = cbs;
    p.cb.on_notify = params->cb.on_notify ? fault_cb_notify : NULL;
    p.cb.check_write = params->cb.check_write ? fault_cb_check_write : NULL;
    p.cb.check_writes = params->cb.check_writes ? fault_cb_check_writes : NULL;
    p.cb.on_ep_error = params->cb.on_ep_error ? fault_cb_ep_error : NULL;
    kvw_status_t st = s->inner->init(&p, &inner);
    if (st != KVW_OK) {
        free(cbs);
        return st;
    }
    if ((st = fault_tl_new(s, &s->cfg, inner, tl_p)) != KVW_OK) {
        s->inner->close(inner);
        s->inner->stop(inner);
        s->inner->fini(inner);
        free(cbs);
        return st;
    }
    fault_tl(*tl_p)->cbs = cbs;
    return st;
}

static kvw_status_t fault_address(kvw_tl_h tl, void *buf, size_t *len_p)
{
    fault_tl_t *t = fault_tl(tl);
    if (t == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "fault transport: bad instance");
    return t->slot->inner->address(t->inner, buf, len_p);
}

static kvw_status_t fault_mem_reg(kvw_tl_h tl, void *addr, uint64_t len, kvw_mem_kind_t kind,
                                  uint64_t region_id, kvw_tl_mem_h *mem_p, void *rkey_buf,
                                  size_t *rkey_len_p)
{
    fault_tl_t *t = fault_tl(tl);
    if (t == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "fault transport: bad instance");
    return t->slot->inner->mem_reg(t->inner, addr, len, kind, region_id, mem_p, rkey_buf,
                                   rkey_len_p);
}

static void fault_mem_dereg(kvw_tl_h tl, kvw_tl_mem_h mem)
{
    fault_tl_t *t = fault_tl(tl);
    if (t)
        t->slot->inner->mem_dereg(t->inner, mem);
}

static kvw_status_t fault_connect(kvw_tl_h tl, const void *addr, size_t len, kvw_tl_ep_h *ep_p)
{
    fault_tl_t *t = fault_tl(tl);
    if (t == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "fault transport: bad instance");
    fault_slot_t *s = t->slot;
    if (fault_hit(t, t->cfg.fail_connect)) {
        fault_count(KVW_FAULT_FAIL_CONNECT, 1);
        return kvw__error(KVW_ERR_IO, "fault injected: connect failed");
    }
    fault_ep_t *e = calloc(1, sizeof(*e));
    if (e == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory connecting");
    kvw_tl_ep_h ep = NULL;
    kvw_status_t st = s->inner->connect(t->inner, addr, len, &ep);
    if (st != KVW_OK) {
        free(e);
        return st;
    }
    e->ep = ep;
    e->tl = t;
    pthread_mutex_lock(&s->mu);
    e->next = s->eps;
    s->eps = e;
    pthread_mutex_unlock(&s->mu);
    *ep_p = ep;
    return KVW_OK;
}

static kvw_status_t fault_rkey_unpack(fault_slot_t *s, kvw_tl_ep_h ep, const void *rkey,
                                      size_t len, kvw_tl_rkey_h *rkey_p)
{
    pthread_mutex_lock(&s->mu);
    fault_ep_t *e = fault_ep_find(s, ep);
    bool closed = e && e->inner_closed;
    pthread_mutex_unlock(&s->mu);
    if (closed)
        return kvw__error(KVW_ERR_CONN_CLOSED, "fault injected: the endpoint was closed");
    return s->inner->rkey_unpack(ep, rkey, len, rkey_p);
}

static void fault_rkey_release(fault_slot_t *s, kvw_tl_rkey_h rkey)
{
    s->inner->rkey_release(rkey);
}

/* Returns the tracked endpoint with one more `busy` reference (release it with
 * fault_ep_leave), or NULL for a pass-through one; a failed endpoint gives NULL too,
 * with *st_p = CONN_CLOSED. */
static fault_ep_t *fault_ep_enter(fault_slot_t *s, kvw_tl_ep_h ep, kvw_status_t *st_p)
{
    *st_p = KVW_OK;
    pthread_mutex_lock(&s->mu);
    fault_ep_t *e = fault_ep_find(s, ep);
    if (e && e->failed) {
        *st_p = kvw__error(KVW_ERR_CONN_CLOSED, "fault injected: the endpoint was failed");
        e = NULL;
    } else if (e) {
        e->busy++;
    }
    pthread_mutex_unlock(&s->mu);
    return e;
}

static kvw_status_t fault_ep_leave(fault_slot_t *s, fault_ep_t *e, kvw_status_t st)
{
    pthread_mutex_lock(&s->mu);
    /* A failure other than bad arguments fails the endpoint for good (transport.h). */
    if (st != KVW_OK && st != KVW_ERR_INVALID_PARAM && st != KVW_ERR_OUT_OF_RANGE &&
        st != KVW_ERR_UNSUPPORTED)
        e->failed = true;
    e->busy--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return st;
}

static kvw_status_t fault_fail_ep(fault_slot_t *s, fault_ep_t *e, kvw_fault_kind_t kind,
                                  kvw_status_t st, const char *what)
{
    fault_count(kind, 1);
    pthread_mutex_lock(&s->mu);
    fault_ep_kill(s, e);
    pthread_mutex_unlock(&s->mu);
    return fault_ep_leave(s, e, kvw__error(st, "fault injected: %s", what));
}

static kvw_status_t fault_put(fault_slot_t *s, kvw_tl_ep_h ep, uint64_t room,
                              const kvw_tl_put_t *puts, size_t n)
{
    kvw_status_t st;
    fault_ep_t *e = fault_ep_enter(s, ep, &st);
    if (st != KVW_OK)
        return st;
    if (e == NULL)
        return s->inner->put(ep, room, puts, n);
    fault_tl_t *t = e->tl;
    const fault_cfg_t *c = &t->cfg;
    fault_count(KVW_FAULT_PUT_CALLS, 1);
    fault_maybe_delay(t);
    uint64_t calls = __atomic_add_fetch(&e->put_calls, 1, __ATOMIC_RELAXED);
    if (c->close_after_puts && calls >= c->close_after_puts)
        return fault_fail_ep(s, e, KVW_FAULT_CLOSE_EP, KVW_ERR_CONN_CLOSED,
                             "the endpoint closed after its put calls");
    if (fault_hit(t, c->fail_put))
        return fault_fail_ep(s, e, KVW_FAULT_FAIL_PUT, KVW_ERR_IO, "put failed");
    bool mangle = c->drop_put > 0 || c->trunc_put > 0 || c->reorder_put > 0 || c->mislay_put > 0;
    if (!mangle || n == 0) {
        st = s->inner->put(ep, room, puts, n);
    } else {
        kvw_tl_put_t *v = malloc(sizeof(*v) * n);
        if (v == NULL)
            return fault_ep_leave(s, e, kvw__error(KVW_ERR_NO_MEMORY,
                                                   "out of memory injecting faults"));
        size_t m = 0;
        for (size_t i = 0; i < n; i++) {
            if (fault_hit(t, c->drop_put)) {
                fault_count(KVW_FAULT_DROP_PUT, 1);
                continue;
            }
            v[m] = puts[i];
            if (v[m].len > 0 && fault_hit(t, c->trunc_put)) {
                fault_count(KVW_FAULT_TRUNC_PUT, 1);
                v[m].len = fault_below(t, v[m].len);
            }
            /* Land on an earlier put's destination of the same length: the byte count
             * stays right while one range is written twice and another never. */
            for (size_t j = 0; j < m && v[m].len > 0; j++)
                if (v[j].len == v[m].len &&
                    (v[j].rkey != v[m].rkey || v[j].dst_off != v[m].dst_off)) {
                    if (fault_hit(t, c->mislay_put)) {
                        fault_count(KVW_FAULT_MISLAY_PUT, 1);
                        v[m].rkey = v[j].rkey;
                        v[m].dst_off = v[j].dst_off;
                    }
                    break;
                }
            m++;
        }
        if (m > 1 && fault_hit(t, c->reorder_put)) {
            fault_count(KVW_FAULT_REORDER_PUT, 1);
            for (size_t i = m - 1; i > 0; i--) {
                size_t j = (size_t)fault_below(t, i + 1);
                kvw_tl_put_t x = v[i];
                v[i] = v[j];
                v[j] = x;
            }
        }
        st = m ? s->inner->put(ep, room, v, m) : KVW_OK;
        free(v);
    }
    if (st == KVW_OK && fault_hit(t, c->dup_put)) {
        fault_count(KVW_FAULT_DUP_PUT, 1);
        st = s->inner->put(ep, room, puts, n);
    }
    return fault_ep_leave(s, e, st);
}

static kvw_status_t fault_notify(fault_slot_t *s, kvw_tl_ep_h ep, const void *msg, size_t len)
{
    kvw_status_t st;
    fault_ep_t *e = fault_ep_enter(s, ep, &st);
    if (st != KVW_OK)
        return st;
    if (e == NULL)
        return s->inner->notify(ep, msg, len);
    fault_tl_t *t = e->tl;
    const fault_cfg_t *c = &t->cfg;
    fault_count(KVW_FAULT_NOTIFY_CALLS, 1);
    fault_maybe_delay(t);
    uint64_t calls = __atomic_add_fetch(&e->notify_calls, 1, __ATOMIC_RELAXED);
    if (c->close_after_notifies && calls >= c->close_after_notifies)
        return fault_fail_ep(s, e, KVW_FAULT_CLOSE_EP, KVW_ERR_CONN_CLOSED,
                             "the endpoint closed after its notifications");
    if (fault_hit(t, c->fail_notify))
        return fault_fail_ep(s, e, KVW_FAULT_FAIL_NOTIFY, KVW_ERR_IO, "notify failed");
    if (fault_hit(t, c->drop_notify)) {
        fault_count(KVW_FAULT_DROP_NOTIFY, 1);
        return fault_ep_leave(s, e, KVW_OK);
    }
    uint8_t *copy = NULL;
    if (len && fault_hit(t, c->corrupt_notify)) {
        copy = malloc(len);
        if (copy == NULL)
            return fault_ep_leave(s, e, kvw__error(KVW_ERR_NO_MEMORY,
                                                   "out of memory injecting faults"));
        memcpy(copy, msg, len);
        size_t at = (size_t)fault_below(t, len);
        copy[at] = (uint8_t)(copy[at] ^ (1u + fault_below(t, 255)));
        msg = copy;
        fault_count(KVW_FAULT_CORRUPT_NOTIFY, 1);
    }
    /* A notification held back earlier goes out after this one. */
    pthread_mutex_lock(&s->mu);
    uint8_t *held = e->held;
    size_t held_len = e->held_len;
    e->held = NULL;
    bool hold = held == NULL && fault_hit(t, c->reorder_notify);
    if (hold) {
        e->held = malloc(len ? len : 1);
        if (e->held) {
            if (len)
                memcpy(e->held, msg, len);
            e->held_len = len;
            e->held_ns = kvw__now_ns();
            fault_count(KVW_FAULT_REORDER_NOTIFY, 1);
        }
    }
    bool stored = hold && e->held;
    pthread_mutex_unlock(&s->mu);
    st = stored ? KVW_OK : s->inner->notify(ep, msg, len);
    if (st == KVW_OK && held)
        st = s->inner->notify(ep, held, held_len);
    free(held);
    if (st == KVW_OK && !stored && fault_hit(t, c->dup_notify)) {
        fault_count(KVW_FAULT_DUP_NOTIFY, 1);
        st = s->inner->notify(ep, msg, len);
    }
    free(copy);
    return fault_ep_leave(s, e, st);
}

/* Whether a configuration changes no put and no notification (delays aside). */
static bool fault_cfg_passes(const fault_cfg_t *c)
{
    return c->drop_put == 0 && c->trunc_put == 0 && c->dup_put == 0 && c->reorder_put == 0 &&
           c->fail_put == 0 && c->mislay_put == 0 && c->drop_notify == 0 && c->dup_notify == 0 &&
           c->reorder_notify == 0 && c->corrupt_notify == 0 && c->fail_notify == 0 &&
           c->close_after_puts == 0 && c->close_after_notifies == 0;
}

/* Puts and their notification in one call (transport.h's put_notify; offered when the
 * inner transport has it). An endpoint whose faults change neither goes to the inner
 * put_notify after its delay, so that tests on the wrapper run the transport's own
 * combined path (tcp: one sendmsg); otherwise the call is a fault_put and a fault_notify,
 * each with its faults. */
static kvw_status_t fault_put_notify(fault_slot_t *s, kvw_tl_ep_h ep, uint64_t room,
                                     const kvw_tl_put_t *puts, size_t n, const void *msg,
                                     size_t len)
{
    kvw_status_t st;
    fault_ep_t *e = fault_ep_enter(s, ep, &st);
    if (st != KVW_OK)
        return st;
    if (e == NULL)
        return s->inner->put_notify(ep, room, puts, n, msg, len);
    fault_tl_t *t = e->tl;
    if (fault_cfg_passes(&t->cfg)) {
        fault_count(KVW_FAULT_PUT_NOTIFY_CALLS, 1);
        fault_maybe_delay(t);
        __atomic_add_fetch(&e->put_calls, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&e->notify_calls, 1, __ATOMIC_RELAXED);
        return fault_ep_leave(s, e, s->inner->put_notify(ep, room, puts, n, msg, len));
    }
    (void)fault_ep_leave(s, e, KVW_OK);
    st = fault_put(s, ep, room, puts, n);
    return st == KVW_OK ? fault_notify(s, ep, msg, len) : st;
}

static uint64_t fault_instance_caps(kvw_tl_h tl)
{
    fault_tl_t *t = fault_tl(tl);
    return t ? kvw__tl_caps(t->slot->inner, t->inner) : 0;
}

static void fault_ep_close(fault_slot_t *s, kvw_tl_ep_h ep)
{
    pthread_mutex_lock(&s->mu);
    fault_ep_t **pp = &s->eps;
    while (*pp && (*pp)->ep != ep)
        pp = &(*pp)->next;
    fault_ep_t *e = *pp;
    if (e) {
        while (e->busy)
            pthread_cond_wait(&s->cv, &s->mu);
        *pp = e->next;
    }
    pthread_mutex_unlock(&s->mu);
    if (e == NULL || !e->inner_closed)
        s->inner->ep_close(ep);
    if (e) {
        free(e->held);
        free(e);
    }
}

static void fault_close(kvw_tl_h tl)
{
    fault_tl_t *t = fault_tl(tl);
    if (t)
        t->slot->inner->close(t->inner);
}

static void fault_stop(kvw_tl_h tl)
{
    fault_tl_t *t = fault_tl(tl);
    if (t == NULL)
        return;
    fault_stop_flusher(t);
    t->slot->inner->stop(t->inner);
}

static void fault_fini(kvw_tl_h tl)
{
    fault_tl_t *t = fault_tl(tl);
    if (t == NULL)
        return;
    fault_slot_t *s = t->slot;
    fault_stop_flusher(t);
    /* The inner fini frees its endpoints; forget ours. */
    pthread_mutex_lock(&s->mu);
    for (fault_ep_t **pp = &s->eps; *pp;) {
        fault_ep_t *e = *pp;
        if (e->tl == t) {
            *pp = e->next;
            free(e->held);
            free(e);
        } else {
            pp = &e->next;
        }
    }
    pthread_mutex_unlock(&s->mu);
    s->inner->fini(t->inner);
    t->magic = 0;
    pthread_mutex_destroy(&t->rng_mu);
    free(t->cbs);
    free(t);
}

/* Per-slot trampolines for the slots that get no instance handle. */
#define FAULT_SLOT_FNS(i)                                                                  \
    static kvw_status_t fault_init_##i(const kvw_tl_params_t *p, kvw_tl_h *tl_p)           \
    {                                                                                      \
        return fault_init(&fault_slots[i], p, tl_p);                                       \
    }                                                                                      \
    static kvw_status_t fault_rkey_unpack_##i(kvw_tl_ep_h ep, const void *k, size_t len,   \
                                              kvw_tl_rkey_h *rkey_p)                       \
    {                                                                                      \
        return fault_rkey_unpack(&fault_slots[i], ep, k, len, rkey_p);                     \
    }                                                                                      \
    static void fault_rkey_release_##i(kvw_tl_rkey_h rkey)                                 \
    {                                                                                      \
        fault_rkey_release(&fault_slots[i], rkey);                                         \
    }                                                                                      \
    static kvw_status_t fault_put_##i(kvw_tl_ep_h ep, uint64_t room, const kvw_tl_put_t *p, \
                                      size_t n)                                            \
    {                                                                                      \
        return fault_put(&fault_slots[i], ep, room, p, n);                                 \
    }                                                                                      \
    static kvw_status_t fault_notify_##i(kvw_tl_ep_h ep, const void *m, size_t len)        \
    {                                                                                      \
        return fault_notify(&fault_slots[i], ep, m, len);                                  \
    }                                                                                      \
    static kvw_status_t fault_put_notify_##i(kvw_tl_ep_h ep, uint64_t room,                \
                                             const kvw_tl_put_t *p, size_t n,               \
                                             const void *m, size_t len)                     \
    {                                                                                      \
        return fault_put_notify(&fault_slots[i], ep, room, p, n, m, len);                  \
    }                                                                                      \
    static void fault_ep_close_##i(kvw_tl_ep_h ep)                                         \
    {                                                                                      \
        fault_ep_close(&fault_slots[i], ep);                                               \
    }

FAULT_SLOT_FNS(0)
FAULT_SLOT_FNS(1)
FAULT_SLOT_FNS(2)
FAULT_SLOT_FNS(3)
FAULT_SLOT_FNS(4)
FAULT_SLOT_FNS(5)
FAULT_SLOT_FNS(6)
FAULT_SLOT_FNS(7)

#define FAULT_SLOT_OPS(i)                                                                  \
    {.init = fault_init_##i, .rkey_unpack = fault_rkey_unpack_##i,                         \
     .rkey_release = fault_rkey_release_##i, .put = fault_put_##i,                         \
     .notify = fault_notify_##i, .put_notify = fault_put_notify_##i,                       \
     .ep_close = fault_ep_close_##i}

static const kvw_tl_ops_t fault_slot_ops[FAULT_SLOTS] = {
    FAULT_SLOT_OPS(0), FAULT_SLOT_OPS(1), FAULT_SLOT_OPS(2), FAULT_SLOT_OPS(3),
    FAULT_SLOT_OPS(4), FAULT_SLOT_OPS(5), FAULT_SLOT_OPS(6), FAULT_SLOT_OPS(7),
};

_Static_assert(FAULT_SLOTS == 8, "one FAULT_SLOT_FNS line per slot");

const kvw_tl_ops_t *kvw__tl_fault_wrap(const kvw_tl_ops_t *inner, const char *spec)
{
    if (inner == NULL) {
        kvw__error(KVW_ERR_INVALID_PARAM, "fault transport: no inner transport");
        return NULL;
    }
    if (kvw__tl_fault_is(inner)) {
        kvw__error(KVW_ERR_INVALID_PARAM, "fault transport: cannot wrap a fault transport");
        return NULL;
    }
    fault_cfg_t cfg;
    if (fault_parse(spec, &cfg) != KVW_OK)
        return NULL;
    if (spec == NULL)
        spec = "";
    pthread_mutex_lock(&fault_slots_mu);
    fault_slot_t *s = NULL;
    for (int i = 0; i < FAULT_SLOTS; i++)
        if (fault_slots[i].used && fault_slots[i].inner == inner &&
            strcmp(fault_slots[i].spec, spec) == 0) {
            pthread_mutex_unlock(&fault_slots_mu);
            return &fault_slots[i].ops;
        }
    for (int i = 0; i < FAULT_SLOTS && s == NULL; i++)
        if (!fault_slots[i].used) {
            s = &fault_slots[i];
            s->used = true;
            s->inner = inner;
            snprintf(s->spec, sizeof(s->spec), "%s", spec);
            s->cfg = cfg;
            s->ops = fault_slot_ops[i];
            s->ops.name = inner->name;
            s->ops.address = fault_address;
            s->ops.mem_reg = fault_mem_reg;
            s->ops.mem_dereg = fault_mem_dereg;
            s->ops.connect = fault_connect;
            s->ops.close = fault_close;
            s->ops.stop = fault_stop;
            s->ops.fini = fault_fini;
            s->ops.caps = inner->caps;
            s->ops.instance_caps = inner->instance_caps ? fault_instance_caps : NULL;
            if (inner->put_notify == NULL)
                s->ops.put_notify = NULL;
            pthread_mutex_init(&s->mu, NULL);
            pthread_cond_init(&s->cv, NULL);
        }
    pthread_mutex_unlock(&fault_slots_mu);
    if (s == NULL) {
        kvw__error(KVW_ERR_BUSY, "fault transport: all %d wrapper slots are in use", FAULT_SLOTS);
        return NULL;
    }
    return &s->ops;
}

bool kvw__tl_fault_is(const kvw_tl_ops_t *ops)
{
    for (int i = 0; i < FAULT_SLOTS; i++)
        if (ops == &fault_slots[i].ops)
            return true;
    return false;
}

const kvw_tl_ops_t *kvw__tl_fault_find(const char *name)
{
    if (name == NULL || strncmp(name, "fault:", 6) != 0) {
        kvw__error(KVW_ERR_NOT_FOUND, "'%s' does not name a fault transport (fault:NAME)",
                   name ? name : "(null)");
        return NULL;
    }
    char inner_name[64];
    const char *at = strchr(name + 6, '@');
    size_t n = at ? (size_t)(at - (name + 6)) : strlen(name + 6);
    if (n == 0 || n >= sizeof(inner_name)) {
        kvw__error(KVW_ERR_NOT_FOUND, "'%s' does not name a transport to wrap", name);
        return NULL;
    }
    memcpy(inner_name, name + 6, n);
    inner_name[n] = '\0';
    const kvw_tl_ops_t *inner = kvw__tl_find(inner_name);
    if (inner == NULL)
        return NULL;
    const char *spec = at ? at + 1 : getenv("KVW_FAULTS");
    return kvw__tl_fault_wrap(inner, spec ? spec : "");
}

kvw_status_t kvw__tl_fault_attach(const kvw_tl_ops_t *ops, kvw_tl_h inner, const char *spec,
                                  kvw_tl_h *tl_p)
{
    if (!kvw__tl_fault_is(ops) || inner == NULL || tl_p == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw__tl_fault_attach: bad arguments");
    fault_slot_t *s = (fault_slot_t *)(void *)((const char *)ops - offsetof(fault_slot_t, ops));
    fault_cfg_t cfg = s->cfg;
    if (spec != NULL && fault_parse(spec, &cfg) != KVW_OK)
        return KVW_ERR_INVALID_PARAM;
    return fault_tl_new(s, &cfg, inner, tl_p);
}

void kvw__tl_fault_register(void)
{
    static const kvw_tl_resolver_t resolver = {"fault:", kvw__tl_fault_find};
    kvw__tl_set_resolver(&resolver);
}
