/*
 * The ucx transport: the data paths (put over DATA messages or RMA, the receiver
 * side of DATA) and notify. See ucx_int.h.
 */
#include "transport/ucx/ucx_int.h"

static void recv_done(void *request, ucs_status_t status, size_t length, void *user_data)
{
    ucx_recv_t *rc = user_data;
    ucx_iface_t *tl = rc->tl;
    (void)length;
    pthread_mutex_lock(&tl->mu);
    ucx_ep_t *ep;
    for (ep = tl->eps; ep && !(ep->hd.accepted && ep->id == rc->acc_id); ep = ep->next)
        ;
    if (rc->discard)
        tl->discard_bytes -= rc->len;
    if (ep) {
        ep->inflight--;
        if (status != UCS_OK)
            ucx_ep_fail_locked(ep, KVW_ERR_CONN_CLOSED, true,
                               "receiving %zu bytes into region %llu failed: %s", rc->len,
                               (unsigned long long)rc->region->id, ucs_status_string(status));
    }
    pthread_mutex_unlock(&tl->mu);
    pthread_mutex_lock(&tl->reg_mu);
    rc->region->inflight--;
    pthread_mutex_unlock(&tl->reg_mu);
    if (status != UCS_OK || ep)
        kvw__tl_wake(tl->wake_fd); /* a deferred report may be due */
    free(rc->discard);
    free(rc);
    if (request)
        ucp_request_free(request);
}

/* The accepted endpoint a DATA message names, if it may still write (tl->mu held). */
static ucx_ep_t *data_ep(ucx_iface_t *tl, const msg_hdr_t *h)
{
    ucx_ep_t *ep = ucx_ep_find(tl, h->a, true, h->from);
    if (ep == NULL || ep->remote_id != h->b || ep->reported || atomic_load(&ep->closing) ||
        atomic_load(&ep->failed) != 0)
        return NULL;
    return ep;
}

/* Ends what ucx_on_data counted for a write that will not be received (refused, or the
 * connection failed meanwhile): the endpoint (looked up again: it may be gone) and the
 * region it held. */
static void data_unref(ucx_iface_t *tl, const msg_hdr_t *h, ucx_region_t *r)
{
    pthread_mutex_lock(&tl->mu);
    ucx_ep_t *ep = ucx_ep_find(tl, h->a, true, h->from);
    if (ep)
        ep->inflight--;
    pthread_mutex_unlock(&tl->mu);
    pthread_mutex_lock(&tl->reg_mu);
    r->inflight--;
    pthread_mutex_unlock(&tl->reg_mu);
}

ucs_status_t ucx_on_data(ucx_iface_t *tl, const msg_hdr_t *h, void *data, size_t len,
                         bool rndv)
{
    bool closed = atomic_load(&tl->closed);
    uint64_t end;
    pthread_mutex_lock(&tl->mu);
    ucx_ep_t *ep = closed ? NULL : data_ep(tl, h);
    if (ep == NULL) {
        pthread_mutex_unlock(&tl->mu);
        return rndv ? UCS_ERR_NOT_CONNECTED : UCS_OK; /* dropped */
    }
    ep->last_rx_ns = kvw__now_ns();
    pthread_mutex_lock(&tl->reg_mu);
    ucx_region_t *r = ucx_region_find(tl, h->c);
    if (r == NULL || !kvw__add_u64(h->d, len, &end) || end > r->len) {
        if (r)
            ucx_ep_fail_locked(ep, KVW_ERR_OUT_OF_RANGE, true,
                               "write of %zu bytes at offset %llu is outside region %llu of %llu "
                               "bytes",
                               len, (unsigned long long)h->d, (unsigned long long)h->c,
                               (unsigned long long)r->len);
        else
            ucx_ep_fail_locked(ep, KVW_ERR_OUT_OF_RANGE, true,
                               "write of %zu bytes into region %llu, which is not registered "
                               "(deregistered?)",
                               len, (unsigned long long)h->c);
        pthread_mutex_unlock(&tl->reg_mu);
        pthread_mutex_unlock(&tl->mu);
        kvw__tl_wake(tl->wake_fd);
        return rndv ? UCS_ERR_REJECTED : UCS_OK;
    }
    /* Held while the receiver's check runs without our locks (it takes the protocol's,
     * which is held around calls into this transport): the region cannot go away
     * (mem_dereg waits for r->inflight), and the endpoint's failure is not reported, nor
     * a later NOTIFY of it delivered, before this write is received or dropped. */
    r->inflight++;
    ep->inflight++;
    pthread_mutex_unlock(&tl->reg_mu);
    pthread_mutex_unlock(&tl->mu);
    kvw_status_t chk = KVW_OK;
    if (len > 0 && tl->cb.check_write)
        chk = tl->cb.check_write(tl->cb.arg, (kvw_tl_ep_h)(void *)ep, h->e, h->c, h->d, len);
    /* A refused write lands nowhere and, as on tcp, leaves the connection up: the
     * protocol has failed the room it was for where that was the room's own sender's
     * (a write arriving after its room ended is an honest race, and the connection
     * carries other rooms). A rendezvous write is received into scratch and freed, up
     * to UCX_DISCARD_MAX at once; beyond that the connection fails. */
    void *discard = NULL;
    pthread_mutex_lock(&tl->mu);
    ep = data_ep(tl, h);
    if (ep && chk != KVW_OK && rndv) {
        if (len <= UCX_DISCARD_MAX - KVW_MIN(tl->discard_bytes, UCX_DISCARD_MAX) &&
            (discard = malloc(len)) != NULL)
            tl->discard_bytes += len;
        else
            ucx_ep_fail_locked(ep, chk, true,
                               "write of %zu bytes at offset %llu of region %llu for room %llu "
                               "was refused by the receiver (%s), with %llu refused bytes "
                               "already being dropped",
                               len, (unsigned long long)h->d, (unsigned long long)h->c,
                               (unsigned long long)h->e, kvw_status_string(chk),
                               (unsigned long long)tl->discard_bytes);
    }
    bool go = ep != NULL && (chk == KVW_OK || discard != NULL);
    pthread_mutex_unlock(&tl->mu);
    if (!go) {
        data_unref(tl, h, r);
        kvw__tl_wake(tl->wake_fd); /* a report, or a held NOTIFY, may be due */
        return rndv ? UCS_ERR_REJECTED : UCS_OK;
    }
    uint8_t *dst = discard ? discard : (uint8_t *)(uintptr_t)r->base + h->d;
    if (!rndv) {
        pthread_mutex_lock(&tl->reg_mu);
        if (len)
            memcpy(dst, data, len);
        pthread_mutex_unlock(&tl->reg_mu);
        data_unref(tl, h, r);
        return UCS_OK;
    }
    ucx_recv_t *rc = malloc(sizeof(*rc));
    if (rc == NULL) {
        free(discard);
        pthread_mutex_lock(&tl->mu);
        if (discard)
            tl->discard_bytes -= len;
        if ((ep = data_ep(tl, h)) != NULL)
            ucx_ep_fail_locked(ep, KVW_ERR_NO_MEMORY, true, "no memory to receive %zu bytes",
                               len);
        pthread_mutex_unlock(&tl->mu);
        data_unref(tl, h, r);
        kvw__tl_wake(tl->wake_fd);
        return UCS_ERR_NO_MEMORY;
    }
    /* The counts taken above now belong to the receive: recv_done ends them. */
    *rc = (ucx_recv_t){.tl = tl, .region = r, .acc_id = h->a, .len = len, .discard = discard};
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_MEMORY_TYPE | UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
        .cb.recv_am = recv_done,
        .user_data = rc,
        .memory_type = UCS_MEMORY_TYPE_HOST};
    void *req = ucp_am_recv_data_nbx(tl->worker, data, dst, len, &prm);
    if (!UCS_PTR_IS_ERR(req))
        return UCS_INPROGRESS; /* recv_done finishes it */
    recv_done(NULL, UCS_PTR_STATUS(req), 0, rc); /* counts down and fails the connection */
    return UCS_PTR_STATUS(req);
}

/* Waits for the oldest requests first (they usually complete in order); the deadline
 * restarts whenever one completes, so a long stream is bounded per step, not in
 * total. Releases every request it was given, even on failure. */
static ucs_status_t wait_all(ucx_iface_t *tl, void **reqs, size_t n)
{
    ucs_status_t first = UCS_OK;
    size_t i = 0;
    uint64_t deadline = deadline_in(tl->timeout_ms);
    atomic_fetch_add(&tl->waiters, 1);
    while (i < n) {
        ucs_status_t s = ucp_request_check_status(reqs[i]);
        if (s != UCS_INPROGRESS) {
            ucp_request_free(reqs[i++]);
            if (s != UCS_OK && first == UCS_OK)
                first = s;
            deadline = deadline_in(tl->timeout_ms);
            continue;
        }
        if (first == UCS_OK && atomic_load(&tl->closed))
            first = UCS_ERR_CANCELED; /* close(): pending calls fail */
        if (first != UCS_OK || kvw__now_ns() >= deadline) {
            /* Give up: the rest go back to UCX (the caller force-closes). */
            while (i < n)
                ucp_request_free(reqs[i++]);
            if (first == UCS_OK)
                first = UCS_ERR_TIMED_OUT;
            break;
        }
        if (ucp_worker_progress(tl->worker) == 0)
            sched_yield();
    }
    atomic_fetch_sub(&tl->waiters, 1);
    return first;
}

/* The highest offset written to one rkey so far in a put() call. */
typedef struct fence_slot {
    const ucx_rkey_t *rk;
    uint64_t hi;
} fence_slot_t;

/* The requests one put() call has in flight, and how far its writes reached per key. */
typedef struct put_batch {
    void *reqs[UCX_INFLIGHT];
    size_t nreq;
    uint64_t inflight; /* bytes of the requests in flight */
    fence_slot_t slots[UCX_FENCE_SLOTS];
    size_t nslots;
} put_batch_t;

/* Whether a write at `off` of rk may overlap an earlier write of the call (or the batch
 * tracks no more keys): the caller orders it first, then clears the slots. */
static bool batch_overlaps(const put_batch_t *b, const ucx_rkey_t *rk, uint64_t off)
{
    size_t k = 0;
    while (k < b->nslots && b->slots[k].rk != rk)
        k++;
    return k < b->nslots ? off < b->slots[k].hi : b->nslots == UCX_FENCE_SLOTS;
}

/* Records a write of [off, off + len) of rk (with a free slot, see batch_overlaps). */
static void batch_note(put_batch_t *b, const ucx_rkey_t *rk, uint64_t off, uint64_t len)
{
    size_t k = 0;
    while (k < b->nslots && b->slots[k].rk != rk)
        k++;
    if (k == b->nslots)
        b->slots[b->nslots++] = (fence_slot_t){.rk = rk, .hi = 0};
    b->slots[k].hi = KVW_MAX(b->slots[k].hi, off + len);
}

/* Waits for (and releases) every request in flight. */
static ucs_status_t batch_wait(ucx_iface_t *tl, put_batch_t *b)
{
    ucs_status_t s = wait_all(tl, b->reqs, b->nreq);
    b->nreq = 0;
    b->inflight = 0;
    return s;
}

/* Adds a request in flight for `len` bytes; waits for all once the batch is full. */
static ucs_status_t batch_add(ucx_iface_t *tl, put_batch_t *b, void *req, uint64_t len)
{
    b->reqs[b->nreq++] = req;
    b->inflight += len;
    if (b->nreq == UCX_INFLIGHT || b->inflight >= UCX_INFLIGHT_BYTES)
        return batch_wait(tl, b);
    return UCS_OK;
}

/* The outcome of a batch of UCX requests as a kvwire status (ep->rw read-locked). */
static kvw_status_t puts_status(ucx_ep_t *ep, ucs_status_t s, bool *kill_p)
{
    ucx_iface_t *tl = ep->tl;
    if (s == UCS_OK)
        return KVW_OK;
    *kill_p = true; /* requests may still reference the caller's buffers */
    if (s == UCS_ERR_CANCELED && atomic_load(&tl->closed))
        return kvw__error(KVW_ERR_SHUTDOWN, "ucx put: the transport was closed");
    if (s == UCS_ERR_TIMED_OUT)
        return kvw__error(KVW_ERR_TIMEOUT,
                          "ucx put to %s: no put completed within %u ms (receiver stalled?)",
                          ep->hd.peer, tl->timeout_ms);
    pthread_mutex_lock(&tl->mu);
    kvw_status_t st = atomic_load(&ep->failed) != 0
                          ? kvw__error(KVW_ERR_CONN_CLOSED, "ucx put: %s", ep->err_reason)
                          : kvw__error(ucx_map_ucs(s), "ucx put to %s: %s", ep->hd.peer,
                                       ucs_status_string(s));
    pthread_mutex_unlock(&tl->mu);
    return st;
}

/*
 * ep->rw read-locked. The default data path: one DATA message per write, which the
 * receiver applies itself (see ucx_on_data). UCX sends small ones eagerly (the receiver
 * copies them) and large ones by rendezvous (received straight into place, with RDMA
 * where the fabric has it). Eager messages are applied in the order they were sent; a
 * rendezvous write has landed when its request completes. So a write that may overlap
 * an earlier one of the call waits for the outstanding requests first.
 */
static kvw_status_t post_am_puts(ucx_ep_t *ep, uint64_t room, const kvw_tl_put_t *puts,
                                 size_t n, bool *kill_p)
{
    ucx_iface_t *tl = ep->tl;
    uint8_t hdrs[UCX_INFLIGHT][UCX_MSG_HDR]; /* live until their request completes */
    put_batch_t b = {.nreq = 0};
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE,
                               .memory_type = UCS_MEMORY_TYPE_HOST};
    ucs_status_t s = UCS_OK;
    for (size_t i = 0; i < n && s == UCS_OK; i++) {
        const ucx_rkey_t *rk = (const ucx_rkey_t *)(const void *)puts[i].rkey;
        if (puts[i].len == 0)
            continue;
        if (batch_overlaps(&b, rk, puts[i].dst_off)) {
            s = batch_wait(tl, &b);
            b.nslots = 0;
            if (s != UCS_OK)
                break;
        }
        batch_note(&b, rk, puts[i].dst_off, puts[i].len);
        msg_hdr_t h = {.type = MSG_DATA, .to = ep->hd.peer_token, .from = tl->token,
                       .a = ep->remote_id, .b = ep->id, .c = rk->hd.region_id,
                       .d = puts[i].dst_off, .e = room};
        ucx_hdr_put(hdrs[b.nreq], &h);
        void *req = ucp_am_send_nbx(ep->uep, UCX_AM_ID, hdrs[b.nreq], UCX_MSG_HDR, puts[i].src,
                                    (size_t)puts[i].len, &prm);
        if (UCS_PTR_IS_ERR(req)) {
            s = UCS_PTR_STATUS(req);
            break;
        }
        if (req == NULL)
            continue; /* done: its header slot is free again */
        s = batch_add(tl, &b, req, puts[i].len);
    }
    ucs_status_t w = batch_wait(tl, &b);
    return puts_status(ep, s != UCS_OK ? s : w, kill_p);
}

/* ep->rw read-locked. The "rma" data path (KVW_UCX_PUT=rma): ucp_put_nbx per write,
 * waiting for local completion. */
static kvw_status_t post_rma_puts(ucx_ep_t *ep, const kvw_tl_put_t *puts, size_t n,
                                  bool *kill_p)
{
    ucx_iface_t *tl = ep->tl;
    put_batch_t b = {.nreq = 0};
    bool posted = false;
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE,
                               .memory_type = UCS_MEMORY_TYPE_HOST};
    ucs_status_t s = UCS_OK;
    if (atomic_exchange(&ep->dirty, false))
        (void)ucp_worker_fence(tl->worker); /* after the writes of earlier calls */
    for (size_t i = 0; i < n && s == UCS_OK; i++) {
        const ucx_rkey_t *rk = (const ucx_rkey_t *)(const void *)puts[i].rkey;
        if (puts[i].len == 0)
            continue;
        /* Order against earlier writes of this call that may overlap. */
        if (posted && batch_overlaps(&b, rk, puts[i].dst_off)) {
            (void)ucp_worker_fence(tl->worker);
            b.nslots = 0;
        }
        batch_note(&b, rk, puts[i].dst_off, puts[i].len);
        void *req = ucp_put_nbx(ep->uep, puts[i].src, (size_t)puts[i].len,
                                rk->base + puts[i].dst_off, rk->urkey, &prm);
        posted = true;
        if (UCS_PTR_IS_ERR(req)) {
            s = UCS_PTR_STATUS(req);
            break;
        }
        if (req != NULL)
            s = batch_add(tl, &b, req, puts[i].len);
    }
    if (posted)
        atomic_store(&ep->dirty, true);
    ucs_status_t w = batch_wait(tl, &b);
    return puts_status(ep, s != UCS_OK ? s : w, kill_p);
}

kvw_status_t ucx_put(kvw_tl_ep_h ep_h, uint64_t room, const kvw_tl_put_t *puts, size_t n)
{
    ucx_ep_t *ep = to_ep(ep_h);
    /* Check everything before moving a byte. */
    kvw_status_t st = kvw__tl_check_puts(kvw__tl_check_sendable("ucx", ep ? &ep->hd : NULL, "put"),
                                         ep ? &ep->hd : NULL, puts, n);
    if (st != KVW_OK)
        return st;
    bool kill = false;
    pthread_rwlock_rdlock(&ep->rw);
    st = ucx_check_alive(ep, "put");
    bool was_alive = st == KVW_OK;
    if (st == KVW_OK)
        st = ep->tl->rma ? post_rma_puts(ep, puts, n, &kill)
                         : post_am_puts(ep, room, puts, n, &kill);
    pthread_rwlock_unlock(&ep->rw);
    if (st != KVW_OK && was_alive)
        ucx_ep_fail_sync(ep, st, kill); /* the contract: a failed put fails the endpoint */
    return st;
}

kvw_status_t ucx_notify(kvw_tl_ep_h ep_h, const void *msg, size_t len)
{
    ucx_ep_t *ep = to_ep(ep_h);
    kvw_status_t st = kvw__tl_check_notify(
        kvw__tl_check_sendable("ucx", ep ? &ep->hd : NULL, "notify"), ep ? &ep->hd : NULL, msg,
        len);
    if (st != KVW_OK)
        return st;
    ucx_iface_t *tl = ep->tl;
    uint8_t hdr[UCX_MSG_HDR];
    bool kill = false;
    pthread_rwlock_rdlock(&ep->rw);
    st = ucx_check_alive(ep, "notify");
    bool was_alive = st == KVW_OK;
    if (st == KVW_OK) {
        /* Every put posted before this call must have landed before the message. */
        ucp_request_param_t prm = {.op_attr_mask = 0};
        ucs_status_t s = ucx_req_wait(tl, ucp_ep_flush_nbx(ep->uep, &prm),
                                      deadline_in(tl->timeout_ms), true);
        const char *step = "flush";
        if (s == UCS_OK) {
            atomic_store(&ep->dirty, false);
            msg_hdr_t h = {.type = MSG_NOTIFY, .to = ep->hd.peer_token, .from = tl->token,
                           .a = ep->remote_id, .b = ep->id};
            ucx_hdr_put(hdr, &h);
            s = ucx_req_wait(tl, ucx_am_post(ep->uep, hdr, msg, len, true),
                             deadline_in(tl->timeout_ms), true);
            step = "send";
        }
        if (s != UCS_OK) {
            kill = true; /* `hdr` and `msg` may still be in use */
            pthread_mutex_lock(&tl->mu);
            if (s == UCS_ERR_CANCELED && atomic_load(&tl->closed))
                st = kvw__error(KVW_ERR_SHUTDOWN, "ucx notify: the transport was closed");
            else if (s == UCS_ERR_TIMED_OUT)
                st = kvw__error(KVW_ERR_TIMEOUT,
                                "ucx notify to %s: %s did not complete within %u ms (receiver "
                                "stalled?)",
                                ep->hd.peer, step, tl->timeout_ms);
            else if (atomic_load(&ep->failed) != 0)
                st = kvw__error(KVW_ERR_CONN_CLOSED, "ucx notify: %s", ep->err_reason);
            else
                st = kvw__error(ucx_map_ucs(s), "ucx notify to %s: %s failed: %s", ep->hd.peer,
                                step, ucs_status_string(s));
            pthread_mutex_unlock(&tl->mu);
        }
    }
    pthread_rwlock_unlock(&ep->rw);
    if (st != KVW_OK && was_alive)
        ucx_ep_fail_sync(ep, st, kill);
    return st;
}
