/*
 * The ucx transport: registered regions and remote keys (mem_reg, rkey_unpack and the
 * receiver check behind it). See ucx_int.h.
 */
#include "transport/ucx/ucx_int.h"

ucx_region_t *ucx_region_find(ucx_iface_t *tl, uint64_t id)
{
    kvw_hnode_t *n = kvw__hmap_find(&tl->regions, id);
    return n ? KVW_CONTAINER_OF(n, ucx_region_t, node) : NULL;
}

kvw_status_t ucx_mem_reg(kvw_tl_h tl_h, void *addr, uint64_t len, kvw_mem_kind_t kind,
                         uint64_t region_id, kvw_tl_mem_h *mem_p, void *rkey_buf,
                         size_t *rkey_len_p)
{
    ucx_iface_t *tl = to_iface(tl_h);
    kvw_status_t st = kvw__tl_check_mem_reg("ucx", tl, addr, len, kind, region_id, mem_p,
                                            rkey_buf, rkey_len_p);
    if (st != KVW_OK)
        return st;
    pthread_mutex_lock(&tl->reg_mu);
    bool dup = ucx_region_find(tl, region_id) != NULL;
    pthread_mutex_unlock(&tl->reg_mu);
    if (dup)
        return kvw__error(KVW_ERR_INVALID_PARAM, "ucx mem_reg: region id %llu is already registered",
                          (unsigned long long)region_id);
    ucx_region_t *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "ucx mem_reg: no memory");
    r->id = region_id;
    r->base = (uint64_t)(uintptr_t)addr;
    r->len = len;
    void *packed = NULL;
    size_t plen = 0;
    /* Mapped for one-sided access, with a UCX key for peers, only on the "rma" path; on
     * "am" the key carries none, so a peer can only name the region in DATA messages,
     * which this receiver checks (rendezvous receives register what they need). */
    if (len > 0 && tl->rma) {
        ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                                                 UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                                                 UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
                                   .address = addr,
                                   .length = (size_t)len,
                                   .memory_type = UCS_MEMORY_TYPE_HOST};
        ucs_status_t s = ucp_mem_map(tl->ctx, &mp, &r->memh);
        if (s != UCS_OK) {
            st = kvw__error(s == UCS_ERR_NO_MEMORY ? KVW_ERR_NO_MEMORY : KVW_ERR_IO,
                            "ucx mem_reg: region %llu: ucp_mem_map of %p + %llu failed: %s",
                            (unsigned long long)region_id, addr, (unsigned long long)len,
                            ucs_status_string(s));
            goto err_free;
        }
        s = ucp_rkey_pack(tl->ctx, r->memh, &packed, &plen);
        if (s != UCS_OK) {
            st = kvw__error(KVW_ERR_IO, "ucx mem_reg: region %llu: ucp_rkey_pack failed: %s",
                            (unsigned long long)region_id, ucs_status_string(s));
            goto err_unmap;
        }
        if (UCX_RKEY_HDR + plen > KVW_TL_MAX_RKEY) {
            st = kvw__error(KVW_ERR_UNSUPPORTED,
                            "ucx mem_reg: region %llu: the packed UCX key takes %zu bytes, more "
                            "than the %u a remote key may have (KVW_TL_MAX_RKEY)",
                            (unsigned long long)region_id, UCX_RKEY_HDR + plen,
                            KVW_TL_MAX_RKEY);
            goto err_release;
        }
    }
    pthread_mutex_lock(&tl->reg_mu);
    st = kvw__tl_region_link("ucx", &tl->regions, &r->node, region_id); /* or: concurrently */
    pthread_mutex_unlock(&tl->reg_mu);
    if (st != KVW_OK)
        goto err_release;

    uint8_t *p = rkey_buf;
    kvw__tl_pack_head(p, UCX_RKEY_HDR, UCX_RKEY_MAGIC, UCX_VERSION, 0, tl->token);
    kvw__le64_put(p + 16, region_id);
    kvw__le64_put(p + 24, r->base);
    kvw__le64_put(p + 32, len);
    kvw__le32_put(p + 40, (uint32_t)plen);
    if (plen)
        memcpy(p + UCX_RKEY_HDR, packed, plen);
    if (packed)
        ucp_rkey_buffer_release(packed);
    *rkey_len_p = UCX_RKEY_HDR + plen;
    *mem_p = (kvw_tl_mem_h)(void *)r;
    return KVW_OK;

err_release:
    if (packed)
        ucp_rkey_buffer_release(packed);
err_unmap:
    if (r->memh)
        ucp_mem_unmap(tl->ctx, r->memh);
err_free:
    free(r);
    return st;
}

void ucx_mem_dereg(kvw_tl_h tl_h, kvw_tl_mem_h mem)
{
    ucx_iface_t *tl = to_iface(tl_h);
    ucx_region_t *r = (ucx_region_t *)(void *)mem;
    if (tl == NULL || r == NULL)
        return;
    pthread_mutex_lock(&tl->reg_mu);
    bool found = kvw__hmap_remove(&tl->regions, &r->node) == 0;
    pthread_mutex_unlock(&tl->reg_mu);
    if (!found)
        return;
    /* No new write can start; wait for the rendezvous receives already writing. */
    uint64_t deadline = deadline_in(tl->timeout_ms);
    for (;;) {
        pthread_mutex_lock(&tl->reg_mu);
        unsigned busy = r->inflight;
        pthread_mutex_unlock(&tl->reg_mu);
        if (busy == 0)
            break;
        if (kvw__now_ns() >= deadline) {
            /* Keep the registration until fini rather than let UCX write into memory
             * that is no longer mapped for it. */
            pthread_mutex_lock(&tl->reg_mu);
            r->dead_next = tl->dead_regions;
            tl->dead_regions = r;
            pthread_mutex_unlock(&tl->reg_mu);
            return;
        }
        if (ucp_worker_progress(tl->worker) == 0)
            sched_yield();
    }
    if (r->memh)
        ucp_mem_unmap(tl->ctx, r->memh);
    free(r);
}

static bool rkey_answered(ucx_ep_t *ep, void *arg)
{
    (void)ep;
    return ((ucx_wait_t *)arg)->done;
}

static void wait_link(ucx_iface_t *tl, ucx_wait_t *w, bool link)
{
    pthread_mutex_lock(&tl->mu);
    if (link) {
        w->id = ++tl->next_id;
        w->next = tl->waits;
        tl->waits = w;
    } else {
        for (ucx_wait_t **pp = &tl->waits; *pp; pp = &(*pp)->next)
            if (*pp == w) {
                *pp = w->next;
                break;
            }
    }
    pthread_mutex_unlock(&tl->mu);
}

/* ep->rw read-locked. Asks the receiver whether the region is still registered as
 * the key says; sets *kill_p when the request may still use this stack frame. */
static kvw_status_t rkey_check(ucx_ep_t *ep, uint64_t region, uint64_t base, uint64_t rlen,
                               bool *kill_p)
{
    ucx_iface_t *tl = ep->tl;
    ucx_wait_t w = {.ep_id = ep->id};
    wait_link(tl, &w, true);
    uint8_t hdr[UCX_MSG_HDR];
    msg_hdr_t h = {.type = MSG_RKEY_REQ, .to = ep->hd.peer_token, .from = tl->token,
                   .a = ep->remote_id, .b = ep->id, .c = w.id, .d = region, .e = base,
                   .f = rlen};
    ucx_hdr_put(hdr, &h);
    uint64_t deadline = deadline_in(tl->timeout_ms);
    ucs_status_t s = ucx_req_wait(tl, ucx_am_post(ep->uep, hdr, NULL, 0, true), deadline, true);
    bool answered = s == UCS_OK && ucx_wait_reply(ep, rkey_answered, &w, deadline);
    wait_link(tl, &w, false);
    if (s == UCS_ERR_TIMED_OUT || s == UCS_ERR_CANCELED) {
        *kill_p = true; /* the request may still read `hdr` */
        if (atomic_load(&tl->closed))
            return kvw__error(KVW_ERR_SHUTDOWN, "ucx rkey_unpack: the transport was closed");
        if (s == UCS_ERR_TIMED_OUT)
            return kvw__error(KVW_ERR_TIMEOUT,
                              "ucx rkey_unpack: region %llu: request not sent within %u ms",
                              (unsigned long long)region, tl->timeout_ms);
    }
    if (s != UCS_OK)
        return kvw__error(ucx_map_ucs(s), "ucx rkey_unpack: region %llu: request failed: %s",
                          (unsigned long long)region, ucs_status_string(s));
    if (!answered) {
        pthread_mutex_lock(&tl->mu);
        kvw_status_t st =
            atomic_load(&ep->failed) != 0
                ? kvw__error(KVW_ERR_CONN_CLOSED, "ucx rkey_unpack: region %llu: %s",
                             (unsigned long long)region, ep->err_reason)
                : kvw__error(KVW_ERR_TIMEOUT,
                             "ucx rkey_unpack: region %llu: no answer from %s within %u ms",
                             (unsigned long long)region, ep->hd.peer, tl->timeout_ms);
        pthread_mutex_unlock(&tl->mu);
        return st;
    }
    if (w.status == KVW_ERR_NOT_FOUND)
        return kvw__error(KVW_ERR_NOT_FOUND,
                          "ucx rkey_unpack: region %llu is not registered at %s (deregistered?)",
                          (unsigned long long)region, ep->hd.peer);
    if (w.status != KVW_OK)
        return kvw__error(KVW_ERR_REJECTED,
                          "ucx rkey_unpack: %s registers region %llu at another address or "
                          "length than the key says (0x%llx + %llu)",
                          ep->hd.peer, (unsigned long long)region, (unsigned long long)base,
                          (unsigned long long)rlen);
    return KVW_OK;
}

kvw_status_t ucx_rkey_unpack(kvw_tl_ep_h ep_h, const void *buf, size_t len,
                             kvw_tl_rkey_h *rkey_p)
{
    ucx_ep_t *ep = to_ep(ep_h);
    const uint8_t *p = buf;
    kvw_status_t st = kvw__tl_check_unpack("ucx", ep ? &ep->hd : NULL, buf, rkey_p);
    if (st != KVW_OK)
        return st;
    if (len < UCX_RKEY_HDR || kvw__le32_get(p) != UCX_RKEY_MAGIC || p[4] != UCX_VERSION ||
        p[5] || p[6] || p[7] || kvw__le32_get(p + 44) != 0 ||
        len != UCX_RKEY_HDR + (size_t)kvw__le32_get(p + 40))
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "ucx rkey_unpack: %zu bytes are not a ucx remote key of version %u",
                          len, UCX_VERSION);
    if ((st = kvw__tl_check_key_token(&ep->hd, kvw__le64_get(p + 8))) != KVW_OK)
        return st;
    uint64_t region = kvw__le64_get(p + 16), base = kvw__le64_get(p + 24),
             rlen = kvw__le64_get(p + 32), end;
    size_t ulen = len - UCX_RKEY_HDR;
    if (!kvw__add_u64(base, rlen, &end) || (rlen == 0 && ulen > 0))
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "ucx rkey_unpack: region %llu: inconsistent key (base 0x%llx, %llu "
                          "bytes, %zu key bytes)",
                          (unsigned long long)region, (unsigned long long)base,
                          (unsigned long long)rlen, ulen);
    ucx_iface_t *tl = ep->tl;
    if (tl->rma && rlen > 0 && ulen == 0)
        return kvw__error(KVW_ERR_INCOMPATIBLE,
                          "ucx rkey_unpack: region %llu of %s takes writes only as checked "
                          "DATA messages (that receiver runs KVW_UCX_PUT=am), but this side "
                          "writes one-sided (KVW_UCX_PUT=rma); set the same data path on both",
                          (unsigned long long)region, ep->hd.peer);
    if (!tl->rma)
        ulen = 0; /* the "am" path never uses a UCX key (nor has RMA to unpack it) */
    if (atomic_load(&tl->closed))
        return kvw__error(KVW_ERR_SHUTDOWN, "ucx rkey_unpack: the transport is closed");
    ucx_rkey_t *rk = calloc(1, sizeof(*rk));
    void *copy = ulen ? malloc(ulen) : NULL; /* aligned copy for UCX */
    if (rk == NULL || (ulen && copy == NULL)) {
        free(rk);
        free(copy);
        return kvw__error(KVW_ERR_NO_MEMORY, "ucx rkey_unpack: no memory");
    }
    rk->tl = tl;
    rk->hd.ep = &ep->hd;
    rk->hd.region_id = region;
    rk->base = base;
    rk->hd.len = rlen;

    bool kill = false;
    pthread_rwlock_rdlock(&ep->rw);
    st = ucx_check_alive(ep, "rkey_unpack");
    if (st == KVW_OK)
        st = rkey_check(ep, region, base, rlen, &kill);
    if (st == KVW_OK && ulen > 0) {
        memcpy(copy, p + UCX_RKEY_HDR, ulen);
        ucs_status_t s = ucp_ep_rkey_unpack(ep->uep, copy, &rk->urkey);
        if (s != UCS_OK)
            st = kvw__error(KVW_ERR_INVALID_PARAM,
                            "ucx rkey_unpack: region %llu: UCX cannot unpack the key: %s",
                            (unsigned long long)region, ucs_status_string(s));
    }
    pthread_rwlock_unlock(&ep->rw);
    free(copy);
    if (kill)
        ucx_ep_fail_sync(ep, KVW_ERR_TIMEOUT, true);
    if (st != KVW_OK) {
        free(rk);
        return st;
    }
    kvw__tl_rkey_link(&tl->mu, &tl->rkeys, &rk->hd);
    *rkey_p = (kvw_tl_rkey_h)(void *)rk;
    return KVW_OK;
}

void ucx_rkey_free(kvw__tl_rkey_t *hd)
{
    ucx_rkey_t *rk = (ucx_rkey_t *)(void *)hd;
    if (rk->urkey)
        ucp_rkey_destroy(rk->urkey);
    free(rk);
}

void ucx_rkey_release(kvw_tl_rkey_h rkey)
{
    ucx_rkey_t *rk = (ucx_rkey_t *)(void *)rkey;
    if (rk == NULL)
        return;
    kvw__tl_rkey_unlink(&rk->tl->mu, &rk->tl->rkeys, &rk->hd);
    ucx_rkey_free(&rk->hd);
}
