/*
 * cuda_ipc: GPUs of one host. The decode side exports each GPU buffer as a CUDA IPC
 * handle inside its remote key; the prefill side opens the handles (mapping the decode
 * buffers into its own device context) and the protocol runs the fused copy kernel
 * straight into them (see rkey_ptr). Notifications, host memory (the staging area) and
 * the connection itself ride on the tcp transport, which this one wraps slot by slot.
 *
 * Writes into GPU memory are one-sided: the receiver cannot mediate them, so, as for
 * shm, the sending library confines them (plans only address the decode's own pages of
 * the room, inside registered regions).
 */
#include "cuda/module.h"
#include "transport/tl_util.h"

#include <kvwire/cuda.h>

#include <string.h>

extern const kvw_tl_ops_t kvw_tl_tcp_ops;
#define TCP (&kvw_tl_tcp_ops)

enum { CIPC_HOST = 0, CIPC_CUDA = 1 };

typedef struct cipc_mem {
    int kind;
    kvw_tl_mem_h inner; /* host memory: tcp's registration */
} cipc_mem_t;

typedef struct cipc_rkey {
    int kind;
    kvw_tl_rkey_h inner; /* host: tcp's key */
    void *base;          /* cuda: the opened allocation */
    uint8_t *ptr;        /* cuda: base + offset, valid in this process */
    uint64_t len;
} cipc_rkey_t;

/* Packed key: kind u8, region u64, len u64, offset u64, handle, then tcp's key. */
#define CIPC_HDR (1 + 8 + 8 + 8 + KVWC_IPC_HANDLE_SIZE)

/* An allocation whose size is not a multiple of 64 KiB is written by the process that
 * opens it through CUDA IPC at 0.6-0.73x on random pages (bench/gpu/step_shape.cu,
 * bench/gpu/NOTES.md): said once per registered buffer, as a warning, since the bytes
 * are right and only the speed suffers. */
#define CIPC_ALLOC_ALIGN (64ull << 10)

static void cipc_check_size(const void *addr, const void *base, uint64_t size)
{
    if (size == 0 || size % CIPC_ALLOC_ALIGN == 0)
        return;
    kvw__log(KVW_LOG_WARN, "cuda_ipc: the GPU buffer at %p lies in an allocation of %llu bytes "
             "(at %p), not a whole number of 64 KiB: a peer that opens it through CUDA IPC "
             "moves random pages at about 0.6-0.7x the speed; allocate KV buffers in whole "
             "64 KiB or 2 MiB (as PyTorch's caching allocator does)", addr,
             (unsigned long long)size, base);
}

static kvw_status_t cipc_mem_reg(kvw_tl_h tl, void *addr, uint64_t len, kvw_mem_kind_t kind,
                                 uint64_t region_id, kvw_tl_mem_h *mem_p, void *rkey_buf,
                                 size_t *rkey_len_p)
{
    cipc_mem_t *m = calloc(1, sizeof(*m));
    uint8_t *k = rkey_buf;
    kvw_status_t st;
    if (m == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "cuda_ipc: out of memory registering");
    memset(k, 0, CIPC_HDR);
    k[0] = kind == KVW_MEM_CUDA ? CIPC_CUDA : CIPC_HOST;
    kvw__le64_put(k + 1, region_id);
    kvw__le64_put(k + 9, len);
    size_t inner_len = KVW_TL_MAX_RKEY - CIPC_HDR;
    if (kind == KVW_MEM_CUDA) {
        void *base = NULL;
        uint64_t size = 0;
        if ((st = kvw__cuda_mem_base(addr, &base, &size)) != KVW_OK) {
            free(m);
            return st;
        }
        cipc_check_size(addr, base, size);
        if ((st = kvw__cuda_ipc_export(base, k + 25)) != KVW_OK) {
            free(m);
            return st;
        }
        kvw__le64_put(k + 17, (uint64_t)((uint8_t *)addr - (uint8_t *)base));
        inner_len = 0;
        m->kind = CIPC_CUDA;
    } else {
        /* Host memory (the staging area) goes through tcp, mediated as usual. */
        if ((st = TCP->mem_reg(tl, addr, len, kind, region_id, &m->inner, k + CIPC_HDR,
                               &inner_len)) != KVW_OK) {
            free(m);
            return st;
        }
        m->kind = CIPC_HOST;
    }
    *rkey_len_p = CIPC_HDR + inner_len;
    *mem_p = (kvw_tl_mem_h)(void *)m;
    return KVW_OK;
}

static void cipc_mem_dereg(kvw_tl_h tl, kvw_tl_mem_h mem)
{
    cipc_mem_t *m = (cipc_mem_t *)(void *)mem;
    if (m == NULL)
        return;
    if (m->kind == CIPC_HOST)
        TCP->mem_dereg(tl, m->inner);
    free(m);
}

static kvw_status_t cipc_rkey_unpack(kvw_tl_ep_h ep, const void *rkey, size_t len,
                                     kvw_tl_rkey_h *rkey_p)
{
    const uint8_t *k = rkey;
    if (len < CIPC_HDR || k[0] > CIPC_CUDA)
        return kvw__error(KVW_ERR_MALFORMED, "cuda_ipc: a remote key of %zu bytes is malformed",
                          len);
    cipc_rkey_t *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "cuda_ipc: out of memory");
    r->kind = k[0];
    r->len = kvw__le64_get(k + 9);
    kvw_status_t st;
    if (r->kind == CIPC_CUDA) {
        if ((st = kvw__cuda_ipc_open(k + 25, &r->base)) != KVW_OK) {
            free(r);
            return kvw__error(st, "cuda_ipc: cannot map the peer's GPU buffer: %s",
                              kvw_last_error());
        }
        r->ptr = (uint8_t *)r->base + kvw__le64_get(k + 17);
    } else if ((st = TCP->rkey_unpack(ep, k + CIPC_HDR, len - CIPC_HDR, &r->inner)) != KVW_OK) {
        free(r);
        return st;
    }
    *rkey_p = (kvw_tl_rkey_h)(void *)r;
    return KVW_OK;
}

static void cipc_rkey_release(kvw_tl_rkey_h rkey)
{
    cipc_rkey_t *r = (cipc_rkey_t *)(void *)rkey;
    if (r == NULL)
        return;
    if (r->kind == CIPC_CUDA)
        kvw__cuda_ipc_close(r->base);
    else
        TCP->rkey_release(r->inner);
    free(r);
}

static void *cipc_rkey_ptr(kvw_tl_rkey_h rkey)
{
    cipc_rkey_t *r = (cipc_rkey_t *)(void *)rkey;
    return r && r->kind == CIPC_CUDA ? r->ptr : NULL;
}

static kvw_status_t cipc_put(kvw_tl_ep_h ep, uint64_t room, const kvw_tl_put_t *puts, size_t n)
{
    /* Host regions go through tcp; GPU regions take a copy into the mapped pointer
     * (the protocol normally runs the fused kernel instead of putting runs). */
    for (size_t i = 0; i < n; i++) {
        cipc_rkey_t *r = (cipc_rkey_t *)(void *)puts[i].rkey;
        kvw_status_t st;
        if (puts[i].dst_off > r->len || puts[i].len > r->len - puts[i].dst_off)
            return kvw__error(KVW_ERR_OUT_OF_RANGE, "cuda_ipc: put [%llu, +%llu) outside a "
                              "%llu-byte region", (unsigned long long)puts[i].dst_off,
                              (unsigned long long)puts[i].len, (unsigned long long)r->len);
        if (r->kind == CIPC_CUDA) {
            st = kvw__cuda_memcpy(r->ptr + puts[i].dst_off, puts[i].src, puts[i].len, NULL);
        } else {
            kvw_tl_put_t p = puts[i];
            p.rkey = r->inner;
            st = TCP->put(ep, room, &p, 1);
        }
        if (st != KVW_OK)
            return st;
    }
    return KVW_OK;
}

static kvw_status_t cipc_init(const kvw_tl_params_t *params, kvw_tl_h *tl_p)
{
    /* Fail early, with the reason, where there is no GPU. */
    kvw_status_t st = kvw_cuda_available();
    if (st != KVW_OK)
        return kvw__error(st, "cuda_ipc: %s", kvw_last_error());
    return TCP->init(params, tl_p);
}

static kvw_status_t cipc_address(kvw_tl_h tl, void *buf, size_t *len_p)
{
    return TCP->address(tl, buf, len_p);
}
static kvw_status_t cipc_connect(kvw_tl_h tl, const void *addr, size_t len, kvw_tl_ep_h *ep_p)
{
    return TCP->connect(tl, addr, len, ep_p);
}
static kvw_status_t cipc_notify(kvw_tl_ep_h ep, const void *msg, size_t len)
{
    return TCP->notify(ep, msg, len);
}
static void cipc_ep_close(kvw_tl_ep_h ep)
{
    TCP->ep_close(ep);
}
static void cipc_close(kvw_tl_h tl)
{
    TCP->close(tl);
}
static void cipc_stop(kvw_tl_h tl)
{
    TCP->stop(tl);
}
static void cipc_fini(kvw_tl_h tl)
{
    TCP->fini(tl);
}

const kvw_tl_ops_t kvw_tl_cuda_ipc_ops = {
    .name = "cuda_ipc",
    KVW_TL_OPS_SLOTS(cipc),
    KVW_TL_OPS_THREAD_SLOTS(cipc),
    .caps = KVW_TL_CAP_DEVICE_MEM,
    .rkey_ptr = cipc_rkey_ptr,
};
