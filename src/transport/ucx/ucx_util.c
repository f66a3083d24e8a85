/*
 * The ucx transport: leaf helpers every other file calls (the message header, UCX status
 * mapping, bounded waits). Calls none of the others. See ucx_int.h.
 */
#include "transport/ucx/ucx_int.h"

#include <stddef.h>

/* The header's u64 words, in wire order from byte 8: one table for writer and reader. */
static const size_t ucx_hdr_words[] = {
    offsetof(msg_hdr_t, to), offsetof(msg_hdr_t, from), offsetof(msg_hdr_t, a),
    offsetof(msg_hdr_t, b),  offsetof(msg_hdr_t, c),    offsetof(msg_hdr_t, d),
    offsetof(msg_hdr_t, e),  offsetof(msg_hdr_t, f)};

void ucx_hdr_put(uint8_t *p, const msg_hdr_t *h)
{
    kvw__le32_put(p, UCX_MSG_MAGIC);
    p[4] = UCX_VERSION;
    p[5] = h->type;
    kvw__le16_put(p + 6, 0);
    for (size_t i = 0; i < KVW_ARRAY_SIZE(ucx_hdr_words); i++) {
        uint64_t v;
        memcpy(&v, (const char *)h + ucx_hdr_words[i], sizeof(v));
        kvw__le64_put(p + 8 + 8 * i, v);
    }
}

bool ucx_hdr_get(const void *buf, size_t len, msg_hdr_t *h)
{
    const uint8_t *p = buf;
    if (p == NULL || len != UCX_MSG_HDR || kvw__le32_get(p) != UCX_MSG_MAGIC ||
        p[4] != UCX_VERSION || kvw__le16_get(p + 6) != 0)
        return false;
    h->type = p[5];
    for (size_t i = 0; i < KVW_ARRAY_SIZE(ucx_hdr_words); i++) {
        uint64_t v = kvw__le64_get(p + 8 + 8 * i);
        memcpy((char *)h + ucx_hdr_words[i], &v, sizeof(v));
    }
    return true;
}

kvw_status_t ucx_map_ucs(ucs_status_t s)
{
    switch (s) {
    case UCS_OK:
        return KVW_OK;
    case UCS_ERR_NO_MEMORY:
        return KVW_ERR_NO_MEMORY;
    case UCS_ERR_TIMED_OUT:
        return KVW_ERR_TIMEOUT;
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_CANCELED:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NO_DEVICE:
        return KVW_ERR_CONN_CLOSED;
    default:
        return KVW_ERR_IO;
    }
}

void ucx_cond_wait_ms(ucx_iface_t *tl, unsigned ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += (long)ms * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&tl->cv, &tl->mu, &ts);
}

ucs_status_t ucx_req_wait(ucx_iface_t *tl, void *req, uint64_t deadline, bool abortable)
{
    if (req == NULL)
        return UCS_OK;
    if (UCS_PTR_IS_ERR(req))
        return UCS_PTR_STATUS(req);
    ucs_status_t s;
    atomic_fetch_add(&tl->waiters, 1);
    while ((s = ucp_request_check_status(req)) == UCS_INPROGRESS) {
        if (ucp_worker_progress(tl->worker) != 0)
            continue;
        if (abortable && atomic_load(&tl->closed)) {
            s = UCS_ERR_CANCELED;
            break;
        }
        if (kvw__now_ns() >= deadline) {
            s = UCS_ERR_TIMED_OUT;
            break;
        }
        sched_yield();
    }
    atomic_fetch_sub(&tl->waiters, 1);
    ucp_request_free(req); /* still in flight: released when it completes */
    return s;
}
