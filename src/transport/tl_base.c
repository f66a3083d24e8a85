/* What every transport does the same way; see tl_base.h. */
#include "transport/tl_base.h"

#include "core/dlist.h"
#include "core/le.h"

#include <stdio.h>
#include <string.h>

void kvw__tl_ep_init(kvw__tl_ep_t *ep, const char *tl_name, const atomic_bool *closed,
                     bool accepted)
{
    ep->tl_name = tl_name;
    ep->closed = closed;
    ep->accepted = accepted;
}

kvw_status_t kvw__tl_check_sendable(const char *tl_name, const kvw__tl_ep_t *ep,
                                    const char *what)
{
    if (ep == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "%s %s: endpoint is NULL", tl_name, what);
    if (ep->accepted)
        return kvw__error(KVW_ERR_UNSUPPORTED, "%s %s: accepted endpoints only receive",
                          tl_name, what);
    if (atomic_load(ep->closed))
        return kvw__error(KVW_ERR_SHUTDOWN, "%s %s: the transport is closed", tl_name, what);
    return KVW_OK;
}

kvw_status_t kvw__tl_check_puts(kvw_status_t sendable, const kvw__tl_ep_t *ep,
                                const kvw_tl_put_t *puts, size_t n)
{
    if (sendable != KVW_OK)
        return sendable;
    const char *tl = ep->tl_name;
    if (n > 0 && puts == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "%s put: puts is NULL", tl);
    for (size_t i = 0; i < n; i++) {
        const kvw__tl_rkey_t *rk = (const kvw__tl_rkey_t *)(const void *)puts[i].rkey;
        if (rk == NULL || rk->ep != ep)
            return kvw__error(KVW_ERR_INVALID_PARAM,
                              "%s put %zu of %zu: the rkey is NULL or was unpacked on another "
                              "endpoint",
                              tl, i, n);
        if (puts[i].dst_off > rk->len || puts[i].len > rk->len - puts[i].dst_off)
            return kvw__error(KVW_ERR_OUT_OF_RANGE,
                              "%s put %zu of %zu: offset %llu + %llu bytes is outside remote "
                              "region %llu of %llu bytes",
                              tl, i, n, (unsigned long long)puts[i].dst_off,
                              (unsigned long long)puts[i].len, (unsigned long long)rk->region_id,
                              (unsigned long long)rk->len);
        if (puts[i].src == NULL && puts[i].len > 0)
            return kvw__error(KVW_ERR_INVALID_PARAM, "%s put %zu of %zu: src is NULL", tl, i, n);
    }
    return KVW_OK;
}

kvw_status_t kvw__tl_check_notify(kvw_status_t sendable, const kvw__tl_ep_t *ep, const void *msg,
                                  size_t len)
{
    if (sendable != KVW_OK)
        return sendable;
    if (len > KVW_TL_MAX_NOTIFY || (msg == NULL && len > 0))
        return kvw__error(KVW_ERR_INVALID_PARAM, "%s notify: %zu bytes (limit %u), msg %p",
                          ep->tl_name, len, KVW_TL_MAX_NOTIFY, msg);
    return KVW_OK;
}

kvw_status_t kvw__tl_check_address(const char *tl_name, const void *tl, const void *buf,
                                   const size_t *len_p, size_t need)
{
    if (tl == NULL || buf == NULL || len_p == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "%s address: NULL argument", tl_name);
    if (*len_p < need)
        return kvw__error(KVW_ERR_BUFFER_TOO_SMALL, "%s address: needs %zu bytes, buffer has %zu",
                          tl_name, need, *len_p);
    return KVW_OK;
}

kvw_status_t kvw__tl_check_mem_reg(const char *tl_name, const void *tl, const void *addr,
                                   uint64_t len, kvw_mem_kind_t kind, uint64_t region_id,
                                   const void *mem_p, const void *rkey_buf,
                                   const void *rkey_len_p)
{
    uint64_t end;
    if (tl == NULL || mem_p == NULL || rkey_buf == NULL || rkey_len_p == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "%s mem_reg: NULL argument", tl_name);
    if (kind != KVW_MEM_HOST)
        return kvw__error(KVW_ERR_UNSUPPORTED,
                          "%s mem_reg: region %llu: only host memory can be registered "
                          "(memory kind %d)",
                          tl_name, (unsigned long long)region_id, (int)kind);
    if ((addr == NULL && len > 0) || !kvw__add_u64((uint64_t)(uintptr_t)addr, len, &end))
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "%s mem_reg: region %llu: bad range %p + %llu bytes", tl_name,
                          (unsigned long long)region_id, addr, (unsigned long long)len);
    return KVW_OK;
}

kvw_status_t kvw__tl_check_unpack(const char *tl_name, const kvw__tl_ep_t *ep, const void *buf,
                                  const void *rkey_p)
{
    if (ep == NULL || buf == NULL || rkey_p == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "%s rkey_unpack: NULL argument", tl_name);
    if (ep->accepted)
        return kvw__error(KVW_ERR_UNSUPPORTED, "%s rkey_unpack: accepted endpoints only receive",
                          ep->tl_name);
    return KVW_OK;
}

kvw_status_t kvw__tl_check_key_token(const kvw__tl_ep_t *ep, uint64_t token)
{
    if (token != ep->peer_token)
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "%s rkey_unpack: the key was packed by receiver %016llx, but this "
                          "endpoint leads to receiver %016llx",
                          ep->tl_name, (unsigned long long)token,
                          (unsigned long long)ep->peer_token);
    return KVW_OK;
}

void kvw__tl_format_reason(const kvw__tl_ep_t *ep, char *buf, size_t cap, const char *fmt,
                           va_list ap)
{
    int n = snprintf(buf, cap, "%s %s %s: ", ep->tl_name,
                     ep->accepted ? "connection from" : "connection to", ep->peer);
    if (n > 0 && (size_t)n < cap)
        vsnprintf(buf + n, cap - (size_t)n, fmt, ap);
}

void kvw__tl_rkey_link(pthread_mutex_t *mu, kvw__tl_rkey_t **head, kvw__tl_rkey_t *rk)
{
    pthread_mutex_lock(mu);
    KVW_DLIST_PUSH(*head, rk);
    pthread_mutex_unlock(mu);
}

void kvw__tl_rkey_unlink(pthread_mutex_t *mu, kvw__tl_rkey_t **head, kvw__tl_rkey_t *rk)
{
    pthread_mutex_lock(mu);
    KVW_DLIST_REMOVE(*head, rk);
    pthread_mutex_unlock(mu);
}

void kvw__tl_rkeys_free(kvw__tl_rkey_t **head, void (*free_fn)(kvw__tl_rkey_t *rk))
{
    while (*head) {
        kvw__tl_rkey_t *rk = *head;
        *head = rk->next;
        free_fn(rk);
    }
}

kvw_status_t kvw__tl_region_link(const char *tl_name, kvw_hmap_t *regions, kvw_hnode_t *n,
                                 uint64_t id)
{
    if (kvw__hmap_find(regions, id))
        return kvw__error(KVW_ERR_INVALID_PARAM, "%s mem_reg: region id %llu is already registered",
                          tl_name, (unsigned long long)id);
    kvw__hmap_insert(regions, n, id);
    return KVW_OK;
}

void kvw__tl_regions_free(kvw_hmap_t *regions, void (*free_fn)(void *arg, kvw_hnode_t *n),
                          void *arg)
{
    for (kvw_hnode_t *n = kvw__hmap_first(regions), *next; n; n = next) {
        next = kvw__hmap_next(regions, n);
        free_fn(arg, n);
    }
    kvw__hmap_fini(regions);
}

void kvw__tl_pack_head(uint8_t *p, size_t len, uint32_t magic, uint8_t version, uint8_t kind,
                       uint64_t token)
{
    memset(p, 0, len);
    kvw__le32_put(p, magic);
    p[4] = version;
    p[5] = kind;
    kvw__le16_put(p + 6, 0);
    kvw__le64_put(p + 8, token);
}
