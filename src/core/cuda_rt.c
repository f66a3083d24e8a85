/*
 * The CUDA module as the whole library reaches it: libkvwire_cuda.so loaded on first use
 * (dlopen, so the core never links CUDA; the rule and the ABI check are
 * src/cuda/module_load.h's), its operations table, and the runtime calls that need no
 * plan (src/cuda/module.h declares them: devices, copies, IPC handles, pointer kinds).
 * Below plans and executors, so that a rank's buffer check (src/plan/rank.c) and the
 * executor (src/exec/cuda_loader.c) both call down into it.
 */
#include "core/cuda_rt.h"

#include "core/config.h"
#include "core/hmap.h"
#include "cuda/module_load.h"

#include <kvwire/cuda.h>

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

static pthread_once_t kvw_cuda_once = PTHREAD_ONCE_INIT;
static const kvwc_ops_t *kvw_cuda_ops;
static char kvw_cuda_load_msg[1024];

static void kvw_cuda_load(void)
{
    const char *env; /* any text; "" when unset */
    kvw__config_str("KVW_CUDA_MODULE", &env);
    /* Next to the object that holds this code: libkvwire.so, or the executable a static
     * libkvwire was linked into. */
    kvw_cuda_ops = kvwc_module_load(env, (const void *)kvw_cuda_load, kvw_cuda_load_msg,
                                    sizeof(kvw_cuda_load_msg));
}

kvw_status_t kvw__cuda_get(const kvwc_ops_t **ops_p)
{
    pthread_once(&kvw_cuda_once, kvw_cuda_load);
    if (kvw_cuda_ops == NULL)
        return kvw__error(KVW_ERR_UNSUPPORTED,
                          "CUDA support is not available: the module %s could not be loaded "
                          "(%s); build with nvcc present, or set KVW_CUDA_MODULE to its path",
                          KVWC_MODULE_FILE, kvw_cuda_load_msg);
    *ops_p = kvw_cuda_ops;
    return KVW_OK;
}

/* Passes a module status up, copying its message into this thread's error. */
kvw_status_t kvw__cuda_ret(const kvwc_ops_t *ops, kvw_status_t st)
{
    if (st != KVW_OK)
        return kvw__error(st, "%s", ops->last_error());
    return KVW_OK;
}

kvw_status_t kvw_cuda_available(void)
{
    KVW_CUDA_FORWARD(available());
}

kvw_status_t kvw_cuda_device_count(int *count_p)
{
    if (count_p == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_cuda_device_count: NULL argument");
    KVW_CUDA_FORWARD(device_count(count_p));
}

/* ---------------------------------------------------------------- runtime calls */

kvw_status_t kvw__cuda_set_device(int device)
{
    KVW_CUDA_FORWARD(set_device(device));
}

kvw_status_t kvw__cuda_memcpy(void *dst, const void *src, uint64_t size, void *stream)
{
    KVW_CUDA_FORWARD(memcpy_any(dst, src, size, stream));
}

kvw_status_t kvw__cuda_mem_base(void *ptr, void **base_p, uint64_t *size_p)
{
    KVW_CUDA_FORWARD(mem_base(ptr, base_p, size_p));
}

kvw_status_t kvw__cuda_ipc_export(void *base, uint8_t handle[KVWC_IPC_HANDLE_SIZE])
{
    KVW_CUDA_FORWARD(ipc_export(base, handle));
}

/*
 * Opened IPC handles, once per (handle, device) in the process, counted: every prefill
 * rank of a process maps the same decode buffers, often at the same moment (decode
 * ranks register with several prefill ranks at once), and the CUDA runtime refuses a
 * handle that is already mapped in the process (cudaErrorAlreadyMapped). Each open
 * of a mapped handle takes a reference; the last close unmaps it.
 */
typedef struct kvw_ipc_map {
    kvw_hnode_t by_handle, by_ptr;
    uint8_t handle[KVWC_IPC_HANDLE_SIZE];
    int device;
    void *ptr;
    uint64_t refs;
} kvw_ipc_map_t;

static pthread_mutex_t kvw_ipc_mu = PTHREAD_MUTEX_INITIALIZER;
static kvw_hmap_t kvw_ipc_by_handle, kvw_ipc_by_ptr; /* kvw_ipc_mu */

static uint64_t kvw_ipc_key(const uint8_t *handle, int device)
{
    uint64_t h = 0xcbf29ce484222325ull ^ (uint64_t)(uint32_t)device;
    for (size_t i = 0; i < KVWC_IPC_HANDLE_SIZE; i++)
        h = (h ^ handle[i]) * 0x100000001b3ull;
    return h;
}

kvw_status_t kvw__cuda_ipc_open(const uint8_t handle[KVWC_IPC_HANDLE_SIZE], void **ptr_p)
{
    const kvwc_ops_t *ops = NULL;
    int dev = -1;
    kvw_status_t st = kvw__cuda_get(&ops);
    if (st == KVW_OK)
        st = kvw__cuda_ret(ops, ops->get_device(&dev));
    if (st != KVW_OK)
        return st;
    uint64_t key = kvw_ipc_key(handle, dev);
    pthread_mutex_lock(&kvw_ipc_mu);
    kvw_hnode_t *n = kvw__hmap_find(&kvw_ipc_by_handle, key);
    kvw_ipc_map_t *m = n ? KVW_CONTAINER_OF(n, kvw_ipc_map_t, by_handle) : NULL;
    if (m && m->device == dev && memcmp(m->handle, handle, KVWC_IPC_HANDLE_SIZE) == 0) {
        m->refs++;
        *ptr_p = m->ptr;
        pthread_mutex_unlock(&kvw_ipc_mu);
        return KVW_OK;
    }
    if (m) {
        /* Another handle with the same key: not cached, opened as it is. */
        pthread_mutex_unlock(&kvw_ipc_mu);
        return kvw__cuda_ret(ops, ops->ipc_open(handle, ptr_p));
    }
    m = calloc(1, sizeof(*m));
    if (m == NULL) {
        pthread_mutex_unlock(&kvw_ipc_mu);
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory mapping a CUDA IPC handle");
    }
    /* Opened under the lock: a second open of the same handle waits for this one. */
    st = kvw__cuda_ret(ops, ops->ipc_open(handle, &m->ptr));
    if (st != KVW_OK) {
        pthread_mutex_unlock(&kvw_ipc_mu);
        free(m);
        return st;
    }
    memcpy(m->handle, handle, KVWC_IPC_HANDLE_SIZE);
    m->device = dev;
    m->refs = 1;
    kvw__hmap_insert(&kvw_ipc_by_handle, &m->by_handle, key);
    kvw__hmap_insert(&kvw_ipc_by_ptr, &m->by_ptr, (uint64_t)(uintptr_t)m->ptr);
    *ptr_p = m->ptr;
    pthread_mutex_unlock(&kvw_ipc_mu);
    return KVW_OK;
}

kvw_status_t kvw__cuda_ipc_close(void *ptr)
{
    pthread_mutex_lock(&kvw_ipc_mu);
    kvw_hnode_t *n = kvw__hmap_find(&kvw_ipc_by_ptr, (uint64_t)(uintptr_t)ptr);
    kvw_ipc_map_t *m = n ? KVW_CONTAINER_OF(n, kvw_ipc_map_t, by_ptr) : NULL;
    if (m && --m->refs > 0) {
        pthread_mutex_unlock(&kvw_ipc_mu);
        return KVW_OK;
    }
    if (m) {
        kvw__hmap_remove(&kvw_ipc_by_handle, &m->by_handle);
        kvw__hmap_remove(&kvw_ipc_by_ptr, &m->by_ptr);
        free(m);
    }
    pthread_mutex_unlock(&kvw_ipc_mu);
    /* The last reference, or a mapping opened outside the cache. */
    KVW_CUDA_FORWARD(ipc_close(ptr));
}

kvw_status_t kvw__cuda_pointer_kind(const void *ptr, int *kind_p, int *device_p)
{
    KVW_CUDA_FORWARD(pointer_kind(ptr, kind_p, device_p));
}

kvw_status_t kvw_cuda_pointer_kind(const void *ptr, kvw_mem_kind_t *kind_p, int32_t *device_p)
{
    if (kind_p == NULL || device_p == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_cuda_pointer_kind: NULL argument");
    int kind = KVWC_PTR_HOST, dev = -1;
    kvw_status_t st = kvw__cuda_pointer_kind(ptr, &kind, &dev);
    if (st != KVW_OK)
        return st;
    bool cuda = kind == KVWC_PTR_DEVICE || kind == KVWC_PTR_MANAGED;
    *kind_p = cuda ? KVW_MEM_CUDA : KVW_MEM_HOST;
    *device_p = cuda ? dev : -1;
    return KVW_OK;
}
