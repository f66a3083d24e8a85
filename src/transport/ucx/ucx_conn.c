/*
 * The ucx transport: endpoints, control messages (sending them, tracking their
 * requests), connect and endpoint close. See ucx_int.h.
 */
#include "core/dlist.h"
#include "transport/ucx/ucx_int.h"

static void *uep_close_post(ucx_iface_t *tl, ucp_ep_h uep, bool force)
{
    /* FORCE needs UCP_ERR_HANDLING_MODE_PEER on both sides. */
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = force && tl->peer_mode ? UCP_EP_CLOSE_FLAG_FORCE : 0};
    return ucp_ep_close_nbx(uep, &prm);
}

bool ucx_uep_close_wait(ucx_iface_t *tl, ucp_ep_h uep, bool force)
{
    void *req = uep_close_post(tl, uep, force);
    return ucx_req_wait(tl, req, deadline_in(KVW_MIN(tl->timeout_ms, UCX_CLOSE_MS)), false) !=
           UCS_ERR_TIMED_OUT;
}

void ucx_ep_free(ucx_ep_t *ep)
{
    pthread_rwlock_destroy(&ep->rw);
    free(ep);
}

ucx_ep_t *ucx_ep_new(ucx_iface_t *tl, bool accepted)
{
    ucx_ep_t *ep = calloc(1, sizeof(*ep));
    if (ep == NULL)
        return NULL;
    kvw__tl_ep_init(&ep->hd, "ucx", &tl->closed, accepted);
    ep->tl = tl;
    pthread_rwlock_init(&ep->rw, NULL);
    atomic_init(&ep->failed, 0);
    atomic_init(&ep->closing, false);
    atomic_init(&ep->dirty, false);
    return ep;
}

/* tl->mu held. */
void ucx_ep_link(ucx_iface_t *tl, ucx_ep_t *ep)
{
    KVW_DLIST_PUSH(tl->eps, ep);
    if (ep->hd.accepted)
        tl->num_accepted++;
}

void ucx_ep_unlink(ucx_iface_t *tl, ucx_ep_t *ep)
{
    KVW_DLIST_REMOVE(tl->eps, ep);
    ep->prev = ep->next = NULL;
    if (ep->hd.accepted)
        tl->num_accepted--;
    if (ep->err_pending) {
        ep->err_pending = false;
        tl->num_err_pending--;
    }
}

void ucx_ep_to_closing(ucx_iface_t *tl, ucx_ep_t *ep, bool graceful)
{
    pthread_mutex_lock(&tl->mu);
    if (!atomic_load(&ep->closing)) {
        atomic_store(&ep->closing, true);
        ucx_ep_unlink(tl, ep);
        ep->graceful = graceful;
        ep->next = tl->closing;
        tl->closing = ep;
    }
    pthread_mutex_unlock(&tl->mu);
}

ucx_ep_t *ucx_ep_find(ucx_iface_t *tl, uint64_t id, bool accepted, uint64_t peer_token)
{
    for (ucx_ep_t *ep = tl->eps; ep; ep = ep->next)
        if (ep->id == id)
            return ep->hd.accepted == accepted && ep->hd.peer_token == peer_token ? ep : NULL;
    return NULL;
}

void ucx_ep_fail_locked(ucx_ep_t *ep, kvw_status_t st, bool report, const char *fmt, ...)
{
    int zero = 0;
    if (atomic_compare_exchange_strong(&ep->failed, &zero, (int)st))
        ep->failed_ns = kvw__now_ns();
    if (ep->err_reason[0] == '\0') {
        va_list ap;
        va_start(ap, fmt);
        kvw__tl_format_reason(&ep->hd, ep->err_reason, sizeof(ep->err_reason), fmt, ap);
        va_end(ap);
        ep->err_status = st;
    }
    if (report && ep->established && !ep->reported && !ep->err_pending &&
        !atomic_load(&ep->closing)) {
        ep->err_pending = true;
        ep->tl->num_err_pending++;
    }
}

/* UCX endpoint error handler (connected endpoints): any thread that progresses. */
static void ep_err_cb(void *arg, ucp_ep_h uep, ucs_status_t status)
{
    ucx_ep_t *ep = arg;
    ucx_iface_t *tl = ep->tl;
    (void)uep;
    pthread_mutex_lock(&tl->mu);
    ucx_ep_fail_locked(ep, KVW_ERR_CONN_CLOSED, true, "UCX reported %s (%d)",
                       ucs_status_string(status), (int)status);
    pthread_cond_broadcast(&tl->cv);
    pthread_mutex_unlock(&tl->mu);
    kvw__tl_wake(tl->wake_fd);
}

void *ucx_am_post(ucp_ep_h uep, const uint8_t *hdr, const void *data, size_t len,
                  bool want_reply)
{
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_MEMORY_TYPE,
        .flags = UCP_AM_SEND_FLAG_EAGER | (want_reply ? UCP_AM_SEND_FLAG_REPLY : 0),
        .memory_type = UCS_MEMORY_TYPE_HOST};
    return ucp_am_send_nbx(uep, UCX_AM_ID, hdr, UCX_MSG_HDR, data, len, &prm);
}

static void op_track(ucx_iface_t *tl, ucx_op_t *op, void *req, uint32_t ms);

/* Progress thread or fini: an op's request ended, or its deadline passed (then UCX may
 * still use its header, or call its endpoint's error handler: both live until the
 * worker is destroyed). A finished flush goes on to force-close its endpoint. */
static void op_finish(ucx_iface_t *tl, ucx_op_t *op, bool timed_out)
{
    if (op->close_uep) {
        ucp_ep_h uep = op->close_uep;
        op->close_uep = NULL;
        op_track(tl, op, uep_close_post(tl, uep, true), KVW_MIN(tl->timeout_ms, UCX_CLOSE_MS));
        return;
    }
    if (!timed_out) {
        if (op->free_ep)
            ucx_ep_free(op->free_ep);
        free(op);
        return;
    }
    if (op->free_ep) {
        op->free_ep->next = tl->zombies;
        tl->zombies = op->free_ep;
        op->free_ep = NULL;
    }
    op->next = tl->dead_ops;
    tl->dead_ops = op;
}

/* Tracks a request to completion (under tl->mu: AM callbacks add to the list from any
 * thread); a request that is already done finishes the op at once. */
static void op_track(ucx_iface_t *tl, ucx_op_t *op, void *req, uint32_t ms)
{
    if (req == NULL || UCS_PTR_IS_ERR(req)) {
        op_finish(tl, op, false);
        return;
    }
    op->req = req;
    op->deadline = deadline_in(ms);
    pthread_mutex_lock(&tl->mu);
    op->next = tl->ops;
    tl->ops = op;
    pthread_mutex_unlock(&tl->mu);
}

void ucx_send_msg(ucx_iface_t *tl, ucp_ep_h uep, const msg_hdr_t *h, bool want_reply)
{
    ucx_op_t *op = calloc(1, sizeof(*op));
    if (op == NULL)
        return;
    ucx_hdr_put(op->hdr, h);
    op_track(tl, op, ucx_am_post(uep, op->hdr, NULL, 0, want_reply), tl->timeout_ms);
}

void ucx_close_uep_async(ucx_iface_t *tl, ucp_ep_h uep, ucx_ep_t *free_ep,
                         const msg_hdr_t *bye)
{
    if (bye)
        ucx_send_msg(tl, uep, bye, false);
    ucx_op_t *op = calloc(1, sizeof(*op));
    if (op == NULL) {
        bool done = ucx_uep_close_wait(tl, uep, true);
        if (free_ep && done) {
            ucx_ep_free(free_ep);
        } else if (free_ep) {
            free_ep->next = tl->zombies;
            tl->zombies = free_ep;
        }
        return;
    }
    op->free_ep = free_ep;
    if (bye && tl->peer_mode) {
        ucp_request_param_t prm = {.op_attr_mask = 0};
        op->close_uep = uep;
        op_track(tl, op, ucp_ep_flush_nbx(uep, &prm), KVW_MIN(tl->timeout_ms, UCX_GOODBYE_MS));
    } else {
        op_track(tl, op, uep_close_post(tl, uep, true), KVW_MIN(tl->timeout_ms, UCX_CLOSE_MS));
    }
}

void ucx_poll_ops(ucx_iface_t *tl)
{
    pthread_mutex_lock(&tl->mu);
    ucx_op_t *list = tl->ops;
    tl->ops = NULL;
    pthread_mutex_unlock(&tl->mu);
    if (list == NULL)
        return;
    uint64_t now = kvw__now_ns();
    ucx_op_t *keep = NULL, **tail = &keep;
    while (list) {
        ucx_op_t *op = list;
        list = op->next;
        ucs_status_t s = ucp_request_check_status(op->req);
        if (s == UCS_INPROGRESS && now < op->deadline) {
            *tail = op;
            tail = &op->next;
            continue;
        }
        ucp_request_free(op->req); /* released to UCX if still in flight */
        op->req = NULL;
        op_finish(tl, op, s == UCS_INPROGRESS);
    }
    *tail = NULL;
    if (keep) {
        pthread_mutex_lock(&tl->mu);
        *tail = tl->ops;
        tl->ops = keep;
        pthread_mutex_unlock(&tl->mu);
    }
}

/* Waits for an answer that the AM handler records under tl->mu. The waiting thread
 * progresses the worker itself, so this also works on the progress thread (from a
 * user callback). `done` runs under tl->mu. */

bool ucx_wait_reply(ucx_ep_t *ep, wait_pred_t done, void *arg, uint64_t deadline)
{
    ucx_iface_t *tl = ep->tl;
    for (;;) {
        unsigned n = ucp_worker_progress(tl->worker);
        pthread_mutex_lock(&tl->mu);
        bool ok = done(ep, arg);
        bool stop = ok || atomic_load(&ep->failed) != 0 || atomic_load(&tl->closed) ||
                    kvw__now_ns() >= deadline;
        if (!stop && n == 0)
            ucx_cond_wait_ms(tl, 1);
        pthread_mutex_unlock(&tl->mu);
        if (stop)
            return ok;
    }
}

static bool hello_acked(ucx_ep_t *ep, void *arg)
{
    (void)arg;
    return ep->established;
}

void ucx_ep_fail_sync(ucx_ep_t *ep, kvw_status_t st, bool kill)
{
    ucx_iface_t *tl = ep->tl;
    pthread_mutex_lock(&tl->mu);
    ucx_ep_fail_locked(ep, st, false, "%s", kvw_status_string(st));
    pthread_mutex_unlock(&tl->mu);
    if (!kill)
        return;
    pthread_rwlock_wrlock(&ep->rw);
    ucp_ep_h uep = ep->uep;
    ep->uep = NULL;
    if (uep && !ucx_uep_close_wait(tl, uep, true))
        ep->close_incomplete = true;
    pthread_rwlock_unlock(&ep->rw);
}

kvw_status_t ucx_connect(kvw_tl_h tl_h, const void *addr, size_t len, kvw_tl_ep_h *ep_p)
{
    ucx_iface_t *tl = to_iface(tl_h);
    const uint8_t *a = addr;
    if (tl == NULL || ep_p == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "ucx connect: NULL argument");
    if (atomic_load(&tl->closed))
        return kvw__error(KVW_ERR_SHUTDOWN, "ucx connect: the transport is closed");
    if (a == NULL || len <= UCX_ADDR_HDR || len > UCX_ADDR_HDR + UCX_MAX_PEER_ADDR ||
        kvw__le32_get(a) != UCX_ADDR_MAGIC || a[4] != UCX_VERSION || a[5] || a[6] || a[7])
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "ucx connect: %zu bytes are not a ucx address of version %u", len,
                          UCX_VERSION);
    uint64_t token = kvw__le64_get(a + 8);
    ucx_ep_t *ep = ucx_ep_new(tl, false);
    void *waddr = malloc(len - UCX_ADDR_HDR); /* aligned copy for UCX */
    if (ep == NULL || waddr == NULL) {
        if (ep)
            ucx_ep_free(ep);
        free(waddr);
        return kvw__error(KVW_ERR_NO_MEMORY, "ucx connect: no memory");
    }
    memcpy(waddr, a + UCX_ADDR_HDR, len - UCX_ADDR_HDR);
    kvw_status_t st;
    ep->hd.peer_token = token;
    snprintf(ep->hd.peer, sizeof(ep->hd.peer), "receiver %016llx", (unsigned long long)token);
    pthread_mutex_lock(&tl->mu);
    ep->id = ++tl->next_id;
    ucx_ep_link(tl, ep);
    pthread_mutex_unlock(&tl->mu);

    uint64_t deadline = deadline_in(tl->timeout_ms);
    ucp_ep_params_t p = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        .address = waddr,
        .err_mode = tl->peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE,
    };
    if (tl->peer_mode) {
        p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
        p.err_handler.cb = ep_err_cb;
        p.err_handler.arg = ep;
    }
    uint8_t hdr[UCX_MSG_HDR];
    /* Read-locked like every user of uep: close() may shut the endpoint down. */
    pthread_rwlock_rdlock(&ep->rw);
    ucs_status_t s = ucp_ep_create(tl->worker, &p, &ep->uep);
    free(waddr);
    if (s != UCS_OK) {
        ep->uep = NULL;
        pthread_rwlock_unlock(&ep->rw);
        st = kvw__error(s == UCS_ERR_INVALID_PARAM ? KVW_ERR_INVALID_PARAM : ucx_map_ucs(s),
                        "ucx connect to %s: ucp_ep_create failed: %s", ep->hd.peer,
                        ucs_status_string(s));
        goto err_unlink;
    }
    msg_hdr_t h = {.type = MSG_HELLO, .to = token, .from = tl->token, .b = ep->id,
                   .c = (uint64_t)getpid()};
    ucx_hdr_put(hdr, &h);
    s = ucx_req_wait(tl, ucx_am_post(ep->uep, hdr, NULL, 0, true), deadline, true);
    if (s == UCS_OK)
        ucx_wait_reply(ep, hello_acked, NULL, deadline);
    pthread_rwlock_unlock(&ep->rw);
    pthread_mutex_lock(&tl->mu);
    bool acked = ep->established;
    int failed = atomic_load(&ep->failed);
    if (failed != 0)
        st = kvw__error((kvw_status_t)failed, "ucx connect: %s",
                        ep->err_reason[0] ? ep->err_reason : kvw_status_string(failed));
    pthread_mutex_unlock(&tl->mu);
    if (acked && failed == 0) {
        *ep_p = (kvw_tl_ep_h)(void *)ep;
        return KVW_OK;
    }
    if (failed == 0 && atomic_load(&tl->closed))
        st = kvw__error(KVW_ERR_SHUTDOWN, "ucx connect to %s: the transport was closed",
                        ep->hd.peer);
    else if (failed == 0 && s != UCS_OK && s != UCS_ERR_TIMED_OUT)
        st = kvw__error(ucx_map_ucs(s), "ucx connect to %s: HELLO failed: %s", ep->hd.peer,
                        ucs_status_string(s));
    else if (failed == 0)
        st = kvw__error(KVW_ERR_TIMEOUT, "ucx connect to %s: no answer within %u ms", ep->hd.peer,
                        tl->timeout_ms);
    pthread_rwlock_wrlock(&ep->rw);
    ucp_ep_h uep = ep->uep; /* NULL if close() already shut it down */
    ep->uep = NULL;
    if (uep && !ucx_uep_close_wait(tl, uep, true))
        ep->close_incomplete = true;
    pthread_rwlock_unlock(&ep->rw);
err_unlink:
    /* Only the progress thread (or fini) frees endpoints: it may hold this one. */
    ucx_ep_to_closing(tl, ep, false);
    kvw__tl_wake(tl->wake_fd);
    return st;
}

kvw_status_t ucx_check_alive(ucx_ep_t *ep, const char *what)
{
    if (atomic_load(&ep->failed) == 0 && ep->uep != NULL)
        return KVW_OK;
    pthread_mutex_lock(&ep->tl->mu);
    kvw_status_t st = kvw__error(KVW_ERR_CONN_CLOSED, "ucx %s: the endpoint failed earlier: %s",
                                 what, ep->err_reason[0] ? ep->err_reason : "closed");
    pthread_mutex_unlock(&ep->tl->mu);
    return st;
}

void ucx_ep_close(kvw_tl_ep_h ep_h)
{
    ucx_ep_t *ep = to_ep(ep_h);
    if (ep == NULL)
        return;
    ucx_iface_t *tl = ep->tl;
    pthread_mutex_lock(&tl->mu);
    bool graceful = !ep->reported;
    pthread_mutex_unlock(&tl->mu);
    ucx_ep_to_closing(tl, ep, graceful);
    kvw__tl_wake(tl->wake_fd);
}
