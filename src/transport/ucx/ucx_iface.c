/*
 * The ucx transport: context and worker, the progress thread (events, failures,
 * heartbeats, closing endpoints), init and teardown, and the ops table. See ucx_int.h.
 */
#include "core/cond.h"
#include "transport/ucx/ucx_int.h"

/* Progress thread: delivers on_ep_error once, unless the owner closed the endpoint or
 * the instance is closing. Accepted endpoints are released afterwards. */
static void report(ucx_iface_t *tl, ucx_ep_t *ep, kvw_status_t st, const char *reason)
{
    pthread_mutex_lock(&tl->mu);
    bool go = !ep->reported && !atomic_load(&ep->closing) && !atomic_load(&tl->closed);
    ep->reported = true;
    if (ep->err_pending) {
        ep->err_pending = false;
        tl->num_err_pending--;
    }
    pthread_mutex_unlock(&tl->mu);
    if (go && tl->cb.on_ep_error)
        tl->cb.on_ep_error(tl->cb.arg, (kvw_tl_ep_h)(void *)ep, st, reason);
    if (ep->hd.accepted)
        ucx_ep_to_closing(tl, ep, false);
}

/* Whether `ev` is held back: a NOTIFY waits while its connection still receives
 * earlier writes by rendezvous (a sender that notifies without flushing), and every later
 * message of a connection waits behind one of its own held before it. tl->mu held. */
static bool event_held(const ucx_ep_t *ep, const ucx_event_t *ev, const ucx_event_t *held)
{
    for (const ucx_event_t *h = held; h; h = h->next)
        if (h->acc_id == ev->acc_id)
            return true;
    return ep->inflight > 0;
}

/* Progress thread: delivers the queued NOTIFY and BYE messages in arrival order. A
 * NOTIFY says that every write its sender posted before it has landed; so it is
 * delivered only once that connection's writes ahead of it have all been received (or
 * the connection failed, and then nothing more of it is delivered). */
static void dispatch_events(ucx_iface_t *tl)
{
    pthread_mutex_lock(&tl->mu);
    ucx_event_t *ev = tl->ev_head;
    tl->ev_head = tl->ev_tail = NULL;
    atomic_store(&tl->ev_new, false);
    pthread_mutex_unlock(&tl->mu);
    ucx_event_t *held = NULL, *held_last = NULL;
    while (ev) {
        ucx_event_t *next = ev->next;
        pthread_mutex_lock(&tl->mu);
        ucx_ep_t *ep;
        for (ep = tl->eps; ep && !(ep->hd.accepted && ep->id == ev->acc_id); ep = ep->next)
            ;
        /* Nothing is delivered from a connection that failed, even before its
         * failure is reported. */
        if (ep && (ep->reported || atomic_load(&ep->closing) || atomic_load(&ep->failed)))
            ep = NULL;
        bool deliver = false;
        if (ep && event_held(ep, ev, held)) {
            ev->next = NULL;
            if (held_last)
                held_last->next = ev;
            else
                held = ev;
            held_last = ev;
            pthread_mutex_unlock(&tl->mu);
            ev = next;
            continue;
        }
        if (ep && ev->type == MSG_BYE)
            ucx_ep_fail_locked(ep, KVW_ERR_CONN_CLOSED, true, "the sender closed the connection");
        else if (ep && ev->oversized)
            ucx_ep_fail_locked(ep, KVW_ERR_MALFORMED, true, "notification of %zu bytes (limit %u)",
                               ev->len, KVW_TL_MAX_NOTIFY);
        else
            deliver = ep != NULL;
        pthread_mutex_unlock(&tl->mu);
        if (deliver && !atomic_load(&tl->closed))
            tl->cb.on_notify(tl->cb.arg, (kvw_tl_ep_h)(void *)ep,
                             ev->len ? ev->data : (const void *)"", ev->len);
        free(ev);
        ev = next;
    }
    /* Held messages go back in front of whatever arrived meanwhile (order kept). */
    pthread_mutex_lock(&tl->mu);
    tl->ev_held = held != NULL;
    if (held) {
        held_last->next = tl->ev_head;
        if (tl->ev_head == NULL)
            tl->ev_tail = held_last;
        tl->ev_head = held;
    }
    pthread_mutex_unlock(&tl->mu);
}

/*
 * Progress thread: reports pending failures. An accepted connection is reported only
 * once its rendezvous receives have ended (failed or landed), so that nothing of it
 * lands after on_ep_error; a receive that neither lands nor fails within the timeout
 * (a sender that stopped mid-transfer) no longer holds the report back, and the reason
 * says so.
 */
static void dispatch_errors(ucx_iface_t *tl)
{
    uint64_t now = kvw__now_ns(), limit = (uint64_t)tl->timeout_ms * 1000000ull;
    tl->err_deferred = false;
    for (;;) {
        char reason[sizeof(((ucx_ep_t *)NULL)->err_reason) + 64];
        kvw_status_t st = KVW_ERR_CONN_CLOSED;
        pthread_mutex_lock(&tl->mu);
        ucx_ep_t *ep = NULL;
        if (tl->num_err_pending > 0) {
            for (ep = tl->eps; ep; ep = ep->next) {
                if (!ep->err_pending)
                    continue;
                if (ep->hd.accepted && ep->inflight > 0 && now - ep->failed_ns < limit) {
                    tl->err_deferred = true;
                    continue;
                }
                break;
            }
        }
        if (ep) {
            if (ep->hd.accepted && ep->inflight > 0)
                snprintf(reason, sizeof(reason), "%s (%u receives still in flight)",
                         ep->err_reason, ep->inflight);
            else
                snprintf(reason, sizeof(reason), "%s", ep->err_reason);
            st = ep->err_status;
            ep->err_pending = false;
            tl->num_err_pending--;
        }
        pthread_mutex_unlock(&tl->mu);
        if (ep == NULL)
            return;
        report(tl, ep, st, reason);
    }
}

/* Progress thread: closes (and eventually frees) what ep_close and teardown handed
 * over. A graceful close says BYE and lets UCX flush it before the endpoint goes. */
static void reap_closing(ucx_iface_t *tl)
{
    pthread_mutex_lock(&tl->mu);
    ucx_ep_t *list = tl->closing;
    tl->closing = NULL;
    pthread_mutex_unlock(&tl->mu);
    while (list) {
        ucx_ep_t *ep = list;
        list = ep->next;
        pthread_rwlock_wrlock(&ep->rw); /* a put that is timing out may still hold it */
        ucp_ep_h uep = ep->uep;
        ep->uep = NULL;
        pthread_rwlock_unlock(&ep->rw);
        if (uep == NULL) {
            if (ep->close_incomplete) {
                ep->next = tl->zombies;
                tl->zombies = ep;
            } else {
                ucx_ep_free(ep);
            }
            continue;
        }
        bool alive = atomic_load(&ep->failed) == 0;
        msg_hdr_t bye = {.type = MSG_BYE, .to = ep->hd.peer_token, .from = tl->token,
                         .a = ep->remote_id, .b = ep->id};
        ucx_close_uep_async(tl, uep, ep, alive && ep->graceful ? &bye : NULL);
    }
}

/* Progress thread: the endpoints of the instance, for work outside tl->mu (only this
 * thread frees endpoints, so the pointers stay valid meanwhile). Returns the count. */
static size_t snapshot(ucx_iface_t *tl, bool accepted)
{
    pthread_mutex_lock(&tl->mu);
    size_t n = 0;
    for (ucx_ep_t *ep = tl->eps; ep; ep = ep->next)
        n += ep->hd.accepted == accepted;
    if (n > tl->snap_cap) {
        ucx_ep_t **v = realloc(tl->snap, n * sizeof(*v));
        if (v) {
            tl->snap = v;
            tl->snap_cap = n;
        }
    }
    size_t k = 0;
    for (ucx_ep_t *ep = tl->eps; ep && k < tl->snap_cap; ep = ep->next)
        if (ep->hd.accepted == accepted)
            tl->snap[k++] = ep;
    pthread_mutex_unlock(&tl->mu);
    return k;
}

/* Progress thread: pings every live connection, and fails accepted connections whose
 * sender went quiet. A stall of this thread itself (a slow callback, a stopped
 * process) must not count as the senders' silence. */
static void heartbeat(ucx_iface_t *tl, uint64_t now)
{
    if (now - tl->last_hb_ns < (uint64_t)UCX_HB_MS * 1000000ull)
        return;
    tl->last_hb_ns = now;
    size_t n = snapshot(tl, false);
    for (size_t i = 0; i < n; i++) {
        ucx_ep_t *ep = tl->snap[i];
        if (pthread_rwlock_tryrdlock(&ep->rw) != 0)
            continue; /* being closed */
        pthread_mutex_lock(&tl->mu);
        bool go = ep->established && !atomic_load(&ep->closing);
        pthread_mutex_unlock(&tl->mu);
        if (go && ep->uep && atomic_load(&ep->failed) == 0) {
            msg_hdr_t h = {.type = MSG_PING, .to = ep->hd.peer_token, .from = tl->token,
                           .a = ep->remote_id, .b = ep->id};
            ucx_send_msg(tl, ep->uep, &h, true);
        }
        pthread_rwlock_unlock(&ep->rw);
    }
    bool stalled = now - tl->last_loop_ns > (uint64_t)UCX_HB_MS * 1000000ull;
    pthread_mutex_lock(&tl->mu);
    for (ucx_ep_t *ep = tl->eps; ep; ep = ep->next) {
        if (!ep->hd.accepted || ep->reported || atomic_load(&ep->closing))
            continue;
        if (stalled)
            ep->last_rx_ns = now;
        else if (now - ep->last_rx_ns > (uint64_t)UCX_HB_DEAD_MS * 1000000ull)
            ucx_ep_fail_locked(ep, KVW_ERR_CONN_CLOSED, true,
                               "no message or heartbeat from the sender for %u ms (process gone "
                               "or stopped?)",
                               UCX_HB_DEAD_MS);
    }
    pthread_mutex_unlock(&tl->mu);
}

/* Progress thread, once, when the instance closes: suppresses further callbacks,
 * releases accepted connections, and says BYE on connected ones. Those stay the
 * owner's (ep_close/fini free them, after the worker: their close is not tracked). */
static void shutdown_connected(ucx_iface_t *tl, ucx_ep_t *ep)
{
    pthread_rwlock_wrlock(&ep->rw);
    ucp_ep_h uep = ep->uep;
    ep->uep = NULL;
    int zero = 0;
    bool alive = atomic_compare_exchange_strong(&ep->failed, &zero, (int)KVW_ERR_SHUTDOWN);
    if (uep)
        ep->close_incomplete = true;
    pthread_rwlock_unlock(&ep->rw);
    if (uep == NULL)
        return;
    msg_hdr_t bye = {.type = MSG_BYE, .to = ep->hd.peer_token, .from = tl->token,
                     .a = ep->remote_id, .b = ep->id};
    ucx_close_uep_async(tl, uep, NULL, alive ? &bye : NULL);
}

static void begin_shutdown(ucx_iface_t *tl)
{
    pthread_mutex_lock(&tl->mu);
    for (ucx_ep_t *ep = tl->eps; ep; ep = ep->next) {
        ep->reported = true;
        if (ep->err_pending) {
            ep->err_pending = false;
            tl->num_err_pending--;
        }
    }
    pthread_mutex_unlock(&tl->mu);
    size_t n = snapshot(tl, true);
    for (size_t i = 0; i < n; i++)
        ucx_ep_to_closing(tl, tl->snap[i], false);
    n = snapshot(tl, false);
    for (size_t i = 0; i < n; i++)
        shutdown_connected(tl, tl->snap[i]);
    reap_closing(tl);
}

static void *progress_thread(void *arg)
{
    ucx_iface_t *tl = arg;
    (void)pthread_setname_np(pthread_self(), "kvw-ucx");
    uint64_t shutdown_deadline = 0;
    tl->last_loop_ns = tl->last_hb_ns = kvw__now_ns();
    for (;;) {
        /* While a user thread waits on a request it progresses the worker itself;
         * progressing here as well would only fight over the worker's lock. Whatever
         * its progress hands over wakes this thread through wake_fd. */
        bool backoff = atomic_load(&tl->waiters) > 0;
        unsigned busy = 0;
        /* Stop as soon as a NOTIFY or BYE was queued: it is delivered before the worker
         * handles anything that arrived after it (a BIND before the writes it allows). */
        while (!backoff && busy < 64 && !atomic_load(&tl->ev_new) &&
               ucp_worker_progress(tl->worker) != 0)
            busy++;
        bool closed = atomic_load(&tl->closed);
        if (closed && shutdown_deadline == 0) {
            begin_shutdown(tl);
            shutdown_deadline = deadline_in(KVW_MIN(tl->timeout_ms, UCX_GOODBYE_MS));
        }
        dispatch_events(tl); /* after close: only frees them */
        if (!closed) {
            dispatch_errors(tl);
            uint64_t now = kvw__now_ns();
            heartbeat(tl, now);
            tl->last_loop_ns = now;
        }
        reap_closing(tl);
        ucx_poll_ops(tl);
        pthread_mutex_lock(&tl->mu);
        bool ops = tl->ops != NULL;
        bool pending = (tl->ev_head != NULL && !tl->ev_held) || tl->closing != NULL ||
                       (tl->num_err_pending > 0 && !closed && !tl->err_deferred);
        pthread_mutex_unlock(&tl->mu);
        if (closed && (!ops || kvw__now_ns() >= shutdown_deadline))
            break;
        if (busy == 64 || pending)
            continue;
        int ms = ops || closed || tl->err_deferred || tl->ev_held || backoff ? 1 : UCX_POLL_MS;
        struct pollfd pfd[2] = {{.fd = tl->wake_fd, .events = POLLIN},
                                {.fd = tl->efd, .events = POLLIN}};
        nfds_t nfds = 1;
        if (tl->efd >= 0 && !backoff) {
            ucs_status_t s = ucp_worker_arm(tl->worker);
            if (s == UCS_ERR_BUSY)
                continue;
            if (s == UCS_OK)
                nfds = 2;
            else
                ms = 1; /* no wake-up support: poll often */
        } else {
            ms = 1;
        }
        if (poll(pfd, nfds, ms) > 0 && pfd[0].revents)
            kvw__tl_wake_drain(tl->wake_fd);
    }
    return NULL;
}

static uint32_t timeout_from(const kvw_tl_params_t *params)
{
    if (params->timeout_ms)
        return params->timeout_ms;
    const char *env = getenv("KVW_UCX_TIMEOUT_MS");
    if (env && *env) {
        char *end;
        unsigned long v = strtoul(env, &end, 10);
        if (*end == '\0' && v > 0 && v <= UINT32_MAX)
            return (uint32_t)v;
    }
    return UCX_DEFAULT_TIMEOUT_MS;
}

/* Creates the context and worker; `v2` asks for UCX's compact address format. */
static kvw_status_t ucx_open(ucx_iface_t *tl, bool v2)
{
    ucp_config_t *cfg;
    ucs_status_t s = ucp_config_read(NULL, NULL, &cfg);
    if (s != UCS_OK)
        return kvw__error(KVW_ERR_UNSUPPORTED, "ucx init: cannot read the UCX configuration: %s",
                          ucs_status_string(s));
    if (v2)
        (void)ucp_config_modify(cfg, "ADDRESS_VERSION", "v2");
    ucp_params_t p = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                      UCP_PARAM_FIELD_NAME,
        /* One-sided access only on the "rma" path: with "am" no peer can reach this
         * process's memory except through DATA messages, which the receiver checks. */
        .features = (tl->rma ? UCP_FEATURE_RMA : 0) | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
        .mt_workers_shared = 0,
        .name = "kvwire",
    };
    s = ucp_init(&p, cfg, &tl->ctx);
    ucp_config_release(cfg);
    if (s != UCS_OK)
        return kvw__error(KVW_ERR_UNSUPPORTED, "ucx init: ucp_init failed: %s (UCX_TLS=%s)",
                          ucs_status_string(s), getenv("UCX_TLS") ? getenv("UCX_TLS") : "");
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_MULTI};
    s = ucp_worker_create(tl->ctx, &wp, &tl->worker);
    if (s != UCS_OK) {
        ucp_cleanup(tl->ctx);
        return kvw__error(KVW_ERR_UNSUPPORTED, "ucx init: ucp_worker_create failed: %s",
                          ucs_status_string(s));
    }
    ucp_worker_attr_t wa = {.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE |
                                          UCP_WORKER_ATTR_FIELD_ADDRESS};
    s = ucp_worker_query(tl->worker, &wa);
    kvw_status_t st = KVW_OK;
    if (s != UCS_OK)
        st = kvw__error(KVW_ERR_IO, "ucx init: ucp_worker_query failed: %s",
                        ucs_status_string(s));
    else if (wa.thread_mode != UCS_THREAD_MODE_MULTI)
        st = kvw__error(KVW_ERR_UNSUPPORTED,
                        "ucx init: this UCX was built without multi-thread support");
    if (st != KVW_OK) {
        if (s == UCS_OK)
            ucp_worker_release_address(tl->worker, wa.address);
        ucp_worker_destroy(tl->worker);
        ucp_cleanup(tl->ctx);
        return st;
    }
    tl->waddr = wa.address;
    tl->waddr_len = wa.address_length;
    return KVW_OK;
}

static void ucx_shut(ucx_iface_t *tl)
{
    ucp_worker_release_address(tl->worker, tl->waddr);
    ucp_worker_destroy(tl->worker);
    ucp_cleanup(tl->ctx);
    tl->waddr = NULL;
    tl->worker = NULL;
    tl->ctx = NULL;
}

static kvw_status_t ucx_init(const kvw_tl_params_t *params, kvw_tl_h *tl_p)
{
    if (params == NULL || tl_p == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "ucx init: params or tl_p is NULL");
    if (params->cb.on_notify == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "ucx init: callbacks.on_notify is required");
    const char *mode = getenv("KVW_UCX_ERR_MODE");
    if (mode && *mode && strcmp(mode, "peer") != 0 && strcmp(mode, "none") != 0)
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "ucx init: KVW_UCX_ERR_MODE='%s' (expected 'peer' or 'none')", mode);
    const char *put = getenv("KVW_UCX_PUT");
    if (put && *put && strcmp(put, "am") != 0 && strcmp(put, "rma") != 0)
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "ucx init: KVW_UCX_PUT='%s' (expected 'am' or 'rma')", put);
    ucx_iface_t *tl = calloc(1, sizeof(*tl));
    if (tl == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "ucx init: no memory");
    kvw_status_t st;
    tl->cb = params->cb;
    tl->timeout_ms = timeout_from(params);
    tl->peer_mode = !(mode && strcmp(mode, "none") == 0);
    tl->rma = put && strcmp(put, "rma") == 0;
    tl->efd = -1;
    atomic_init(&tl->closed, false);
    atomic_init(&tl->waiters, 0);
    atomic_init(&tl->ev_new, false);
    pthread_mutex_init(&tl->mu, NULL);
    pthread_mutex_init(&tl->reg_mu, NULL);
    kvw__cond_init_monotonic(&tl->cv);
    do {
        if ((st = kvw__random_bytes(&tl->token, sizeof(tl->token))) != KVW_OK)
            goto err_free;
    } while (tl->token == 0);

    tl->wake_fd = kvw__tl_wake_open();
    if (tl->wake_fd < 0) {
        st = kvw__error(KVW_ERR_IO, "ucx init: eventfd: %m");
        goto err_free;
    }
    st = ucx_open(tl, false);
    if (st != KVW_OK)
        goto err_close_wake;
    if (UCX_ADDR_HDR + tl->waddr_len > KVW_TL_MAX_ADDR && getenv("UCX_ADDRESS_VERSION") == NULL) {
        /* Many devices make long addresses; UCX's v2 format is more compact. */
        ucx_shut(tl);
        st = ucx_open(tl, true);
        if (st != KVW_OK)
            goto err_close_wake;
    }
    if (UCX_ADDR_HDR + tl->waddr_len > KVW_TL_MAX_ADDR) {
        st = kvw__error(KVW_ERR_UNSUPPORTED,
                        "ucx init: the UCX worker address takes %zu bytes, more than the %u "
                        "a transport address may have (KVW_TL_MAX_ADDR); limit the devices "
                        "with UCX_NET_DEVICES or UCX_TLS",
                        UCX_ADDR_HDR + tl->waddr_len, KVW_TL_MAX_ADDR);
        goto err_shut;
    }
    ucp_am_handler_param_t ap = {.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                                               UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                                               UCP_AM_HANDLER_PARAM_FIELD_CB |
                                               UCP_AM_HANDLER_PARAM_FIELD_ARG,
                                 .id = UCX_AM_ID,
                                 .flags = UCP_AM_FLAG_WHOLE_MSG,
                                 .cb = ucx_am_cb,
                                 .arg = tl};
    ucs_status_t s = ucp_worker_set_am_recv_handler(tl->worker, &ap);
    if (s != UCS_OK) {
        st = kvw__error(KVW_ERR_IO, "ucx init: cannot set the active message handler: %s",
                        ucs_status_string(s));
        goto err_shut;
    }
    if (ucp_worker_get_efd(tl->worker, &tl->efd) != UCS_OK)
        tl->efd = -1; /* the thread then polls every millisecond */
    int err = pthread_create(&tl->thread, NULL, progress_thread, tl);
    if (err != 0) {
        errno = err;
        st = kvw__error(KVW_ERR_INTERNAL, "ucx init: cannot start the progress thread: %m");
        goto err_shut;
    }
    tl->thread_started = true;
    *tl_p = (kvw_tl_h)(void *)tl;
    return KVW_OK;

err_shut:
    ucx_shut(tl);
err_close_wake:
    close(tl->wake_fd);
err_free:
    pthread_mutex_destroy(&tl->mu);
    pthread_mutex_destroy(&tl->reg_mu);
    pthread_cond_destroy(&tl->cv);
    free(tl);
    return st;
}

static kvw_status_t ucx_address(kvw_tl_h tl_h, void *buf, size_t *len_p)
{
    ucx_iface_t *tl = to_iface(tl_h);
    size_t need = tl ? UCX_ADDR_HDR + tl->waddr_len : 0;
    kvw_status_t st = kvw__tl_check_address("ucx", tl, buf, len_p, need);
    if (st != KVW_OK)
        return st;
    uint8_t *p = buf;
    kvw__tl_pack_head(p, UCX_ADDR_HDR, UCX_ADDR_MAGIC, UCX_VERSION, 0, tl->token);
    memcpy(p + UCX_ADDR_HDR, tl->waddr, tl->waddr_len);
    *len_p = need;
    return KVW_OK;
}

static void ucx_close(kvw_tl_h tl_h)
{
    ucx_iface_t *tl = to_iface(tl_h);
    if (tl == NULL)
        return;
    atomic_store(&tl->closed, true);
    kvw__tl_wake(tl->wake_fd);
}

static void ucx_stop(kvw_tl_h tl_h)
{
    ucx_iface_t *tl = to_iface(tl_h);
    if (tl == NULL)
        return;
    ucx_close(tl_h);
    if (tl->thread_started) {
        pthread_join(tl->thread, NULL);
        tl->thread_started = false;
    }
}

/* fini: closes an endpoint's UCX endpoint (if any) and frees it, or keeps it until the
 * worker is gone when UCX may still call its error handler. */
static void fini_ep(ucx_iface_t *tl, ucx_ep_t *ep)
{
    if (ep->uep) {
        if (!ucx_uep_close_wait(tl, ep->uep, true))
            ep->close_incomplete = true;
        ep->uep = NULL;
    }
    if (ep->close_incomplete) {
        ep->next = tl->zombies;
        tl->zombies = ep;
    } else {
        ucx_ep_free(ep);
    }
}

/* fini, after the worker: a registration, in the table or deregistered too late. */
static void region_free(void *arg, kvw_hnode_t *n)
{
    ucx_iface_t *tl = arg;
    ucx_region_t *r = KVW_CONTAINER_OF(n, ucx_region_t, node);
    if (r->memh)
        ucp_mem_unmap(tl->ctx, r->memh);
    free(r);
}

static void ucx_fini(kvw_tl_h tl_h)
{
    ucx_iface_t *tl = to_iface(tl_h);
    if (tl == NULL)
        return;
    ucx_stop(tl_h);
    kvw__tl_rkeys_free(&tl->rkeys, ucx_rkey_free);
    /* Let the closes and goodbyes the thread started finish, briefly. */
    uint64_t deadline = deadline_in(KVW_MIN(tl->timeout_ms, UCX_CLOSE_MS));
    while (tl->ops && kvw__now_ns() < deadline) {
        if (ucp_worker_progress(tl->worker) == 0)
            sched_yield();
        ucx_poll_ops(tl);
    }
    while (tl->closing) {
        ucx_ep_t *ep = tl->closing;
        tl->closing = ep->next;
        fini_ep(tl, ep);
    }
    while (tl->eps) {
        ucx_ep_t *ep = tl->eps;
        tl->eps = ep->next;
        fini_ep(tl, ep);
    }
    /* Anything still in flight goes back to UCX; the worker's end releases it. A flush
     * still running turns into a forced close now: UCX must not find requests on an
     * endpoint when the worker goes. */
    while (tl->ops) {
        ucx_op_t *op = tl->ops;
        tl->ops = op->next;
        ucp_request_free(op->req);
        if (op->close_uep && !ucx_uep_close_wait(tl, op->close_uep, true) && op->free_ep) {
            op->free_ep->next = tl->zombies;
            tl->zombies = op->free_ep;
            op->free_ep = NULL;
        }
        op->close_uep = NULL;
        if (op->free_ep) {
            op->free_ep->next = tl->zombies;
            tl->zombies = op->free_ep;
        }
        op->next = tl->dead_ops;
        tl->dead_ops = op;
    }
    /* Destroying the worker may still complete receives (recv_done touches their
     * regions), so the registrations go after it, before the context. */
    ucp_worker_release_address(tl->worker, tl->waddr);
    ucp_worker_destroy(tl->worker);
    kvw__tl_regions_free(&tl->regions, region_free, tl);
    while (tl->dead_regions) {
        ucx_region_t *r = tl->dead_regions;
        tl->dead_regions = r->dead_next;
        region_free(tl, &r->node);
    }
    ucp_cleanup(tl->ctx);
    /* Nothing in UCX refers to these any more. */
    while (tl->ev_head) {
        ucx_event_t *ev = tl->ev_head;
        tl->ev_head = ev->next;
        free(ev);
    }
    while (tl->dead_ops) {
        ucx_op_t *op = tl->dead_ops;
        tl->dead_ops = op->next;
        free(op);
    }
    while (tl->zombies) {
        ucx_ep_t *ep = tl->zombies;
        tl->zombies = ep->next;
        ucx_ep_free(ep);
    }
    free(tl->snap);
    close(tl->wake_fd);
    pthread_mutex_destroy(&tl->mu);
    pthread_mutex_destroy(&tl->reg_mu);
    pthread_cond_destroy(&tl->cv);
    free(tl);
}

/* The "am" path mediates every write (check_write, the receiver's own bounds check);
 * "rma" writes are one-sided and the receiver sees none of them. */
static uint64_t ucx_instance_caps(kvw_tl_h tl_h)
{
    return to_iface(tl_h)->rma ? 0 : KVW_TL_CAP_MEDIATED;
}

const kvw_tl_ops_t kvw_tl_ucx_ops = {
    .name = "ucx",
    KVW_TL_OPS_SLOTS(ucx),
    KVW_TL_OPS_THREAD_SLOTS(ucx),
    .caps = 0, /* what every instance has; see ucx_instance_caps */
    .instance_caps = ucx_instance_caps,
};
