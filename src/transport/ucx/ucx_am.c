/*
 * The ucx transport: the active-message dispatcher (ucx_am_cb) and its handlers: the
 * sender's answers (HELLO_ACK, RKEY_REP, CLOSED), the receiver's HELLO and sender
 * messages (NOTIFY, BYE, RKEY_REQ, PING), DATA handed to ucx_put.c. It sits above the
 * endpoints, regions and data paths it calls. See ucx_int.h.
 */
#include "transport/ucx/ucx_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Sender side: answers from the receiver, handled right here (no UCX calls). */
static void on_reply(ucx_iface_t *tl, const msg_hdr_t *h)
{
    pthread_mutex_lock(&tl->mu);
    if (h->type == MSG_RKEY_REP) {
        for (ucx_wait_t *w = tl->waits; w; w = w->next) {
            if (w->id == h->b && w->ep_id == h->a) {
                w->done = true;
                w->status = (int32_t)(uint32_t)h->c;
                break;
            }
        }
    } else {
        ucx_ep_t *ep = ucx_ep_find(tl, h->a, false, h->from);
        if (ep && h->type == MSG_HELLO_ACK && !ep->established) {
            ep->remote_id = h->b;
            ep->established = true;
        } else if (ep && h->type == MSG_CLOSED) {
            ucx_ep_fail_locked(ep, KVW_ERR_CONN_CLOSED, true,
                               "the receiver closed the connection");
        }
    }
    pthread_cond_broadcast(&tl->cv);
    pthread_mutex_unlock(&tl->mu);
    if (h->type == MSG_CLOSED)
        kvw__tl_wake(tl->wake_fd);
}

/* Receiver side: a message answered on the sender's reply endpoint. */
static void reply(ucx_iface_t *tl, ucp_ep_h reply_ep, uint8_t type, const msg_hdr_t *req,
                  uint64_t b, uint64_t c)
{
    if (reply_ep == NULL)
        return;
    msg_hdr_t h = {.type = type, .to = req->from, .from = tl->token, .a = req->b, .b = b,
                   .c = c};
    ucx_send_msg(tl, reply_ep, &h, false);
}

static void on_hello(ucx_iface_t *tl, const msg_hdr_t *h, ucp_ep_h reply_ep)
{
    if (reply_ep == NULL)
        return; /* cannot answer: the sender's connect times out */
    if (atomic_load(&tl->closed)) {
        reply(tl, reply_ep, MSG_CLOSED, h, 0, 0);
        return;
    }
    ucx_ep_t *ep = ucx_ep_new(tl, true);
    if (ep == NULL)
        return;
    ep->hd.peer_token = h->from;
    ep->remote_id = h->b;
    ep->established = true;
    ep->last_rx_ns = kvw__now_ns();
    snprintf(ep->hd.peer, sizeof(ep->hd.peer), "pid %llu (sender %016llx)",
             (unsigned long long)h->c, (unsigned long long)h->from);
    pthread_mutex_lock(&tl->mu);
    bool full = tl->num_accepted >= UCX_MAX_ACCEPTED;
    if (!full) {
        ep->id = ++tl->next_id;
        ucx_ep_link(tl, ep);
    }
    uint64_t id = ep->id;
    pthread_mutex_unlock(&tl->mu);
    if (full) {
        ucx_ep_free(ep);
        return;
    }
    reply(tl, reply_ep, MSG_HELLO_ACK, h, id, 0);
}

static void on_sender_msg(ucx_iface_t *tl, const msg_hdr_t *h, const void *data, size_t len,
                          ucp_ep_h reply_ep)
{
    bool closed = atomic_load(&tl->closed);
    pthread_mutex_lock(&tl->mu);
    ucx_ep_t *ep = closed ? NULL : ucx_ep_find(tl, h->a, true, h->from);
    bool alive = ep && ep->remote_id == h->b && !ep->reported && !atomic_load(&ep->closing) &&
                 atomic_load(&ep->failed) == 0;
    if (alive)
        ep->last_rx_ns = kvw__now_ns();
    pthread_mutex_unlock(&tl->mu);
    if (!alive) {
        if (h->type != MSG_BYE)
            reply(tl, reply_ep, MSG_CLOSED, h, 0, 0);
        return;
    }
    if (h->type == MSG_PING)
        return;
    if (h->type == MSG_RKEY_REQ) {
        int32_t status = KVW_ERR_NOT_FOUND;
        pthread_mutex_lock(&tl->reg_mu);
        ucx_region_t *r = ucx_region_find(tl, h->d);
        if (r)
            status = r->base == h->e && r->len == h->f ? KVW_OK : KVW_ERR_REJECTED;
        pthread_mutex_unlock(&tl->reg_mu);
        reply(tl, reply_ep, MSG_RKEY_REP, h, h->c, (uint64_t)(uint32_t)status);
        return;
    }
    /* NOTIFY and BYE go to the progress thread, in arrival order. */
    bool oversized = len > (h->type == MSG_NOTIFY ? KVW_TL_MAX_NOTIFY : 0);
    size_t keep = oversized ? 0 : len;
    ucx_event_t *ev = malloc(sizeof(*ev) + keep);
    pthread_mutex_lock(&tl->mu);
    if (ev == NULL) {
        /* Cannot queue it: the connection is no longer whole. */
        ep = ucx_ep_find(tl, h->a, true, h->from);
        if (ep)
            ucx_ep_fail_locked(ep, KVW_ERR_NO_MEMORY, true,
                               "no memory to queue a message of %zu bytes", len);
    } else {
        ev->next = NULL;
        ev->type = h->type;
        ev->acc_id = h->a;
        ev->oversized = oversized;
        ev->len = len;
        if (keep)
            memcpy(ev->data, data, keep);
        if (tl->ev_tail)
            tl->ev_tail->next = ev;
        else
            tl->ev_head = ev;
        tl->ev_tail = ev;
        atomic_store(&tl->ev_new, true);
    }
    pthread_mutex_unlock(&tl->mu);
    kvw__tl_wake(tl->wake_fd);
}

ucs_status_t ucx_am_cb(void *arg, const void *header, size_t header_length, void *data,
                       size_t length, const ucp_am_recv_param_t *param)
{
    ucx_iface_t *tl = arg;
    msg_hdr_t h;
    bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    if (!ucx_hdr_get(header, header_length, &h) || h.to != tl->token)
        return rndv ? UCS_ERR_REJECTED : UCS_OK; /* not from a kvwire peer of ours */
    if (h.type == MSG_DATA)
        return ucx_on_data(tl, &h, data, length, rndv);
    if (rndv)
        return UCS_ERR_REJECTED; /* control messages are always eager */
    ucp_ep_h reply_ep =
        (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : NULL;
    switch (h.type) {
    case MSG_HELLO_ACK:
    case MSG_RKEY_REP:
    case MSG_CLOSED:
        if (length == 0)
            on_reply(tl, &h);
        break;
    case MSG_HELLO:
        if (length == 0)
            on_hello(tl, &h, reply_ep);
        break;
    case MSG_NOTIFY:
    case MSG_BYE:
    case MSG_RKEY_REQ:
    case MSG_PING:
        on_sender_msg(tl, &h, data, length, reply_ep);
        break;
    default:
        break;
    }
    return UCS_OK;
}
