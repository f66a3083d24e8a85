/* CUDA runtime helpers for tools and tests (see testkit.h): the module the library
 * loads, loaded again here by the same rule (src/cuda/module_load.h), and its
 * operations table called directly. Built against the public API only, so that the
 * installed CLI can use it. */
#include "testkit.h"

#include "cuda/module_load.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

_Static_assert(KVT_CUDA_IPC_HANDLE_SIZE == KVWC_IPC_HANDLE_SIZE, "IPC handle sizes must agree");

static pthread_once_t kvt_cuda_once = PTHREAD_ONCE_INIT;
static const kvwc_ops_t *kvt_cuda_ops;
static char kvt_cuda_load_msg[1024];
static __thread char kvt_cuda_msg[1024];

static void kvt_cuda_load(void)
{
    /* The library's anchor is its own code; from outside, the text kvw_version()
     * returns lies in the same object: libkvwire.so, or the executable a static
     * libkvwire was linked into. (A function's address would not do: in a program
     * built without PIE it is the program's own PLT entry.) */
    kvt_cuda_ops = kvwc_module_load(getenv("KVW_CUDA_MODULE"), kvw_version(), kvt_cuda_load_msg,
                                    sizeof(kvt_cuda_load_msg));
}

const char *kvt_cuda_error(void)
{
    return kvt_cuda_msg;
}

static kvw_status_t kvt_cuda_fail(kvw_status_t st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(kvt_cuda_msg, sizeof(kvt_cuda_msg), fmt, ap);
    va_end(ap);
    return st;
}

static kvw_status_t kvt_cuda_get(const kvwc_ops_t **ops_p)
{
    pthread_once(&kvt_cuda_once, kvt_cuda_load);
    if (kvt_cuda_ops == NULL)
        return kvt_cuda_fail(KVW_ERR_UNSUPPORTED, "the CUDA module %s could not be loaded (%s)",
                             KVWC_MODULE_FILE, kvt_cuda_load_msg);
    *ops_p = kvt_cuda_ops;
    return KVW_OK;
}

/* Calls one operation of the module; a failure leaves the module's message in
 * kvt_cuda_error(), prefixed with the operation's name. */
#define KVT_CUDA_CALL(name, call)                                                        \
    const kvwc_ops_t *ops = NULL;                                                        \
    kvw_status_t st_ = kvt_cuda_get(&ops);                                               \
    if (st_ == KVW_OK && (st_ = ops->call) != KVW_OK)                                    \
        kvt_cuda_fail(st_, "%s: %s", name, ops->last_error());                           \
    return st_

kvw_status_t kvt_cuda_set_device(int device)
{
    KVT_CUDA_CALL("set_device", set_device(device));
}

kvw_status_t kvt_cuda_malloc(uint64_t size, void **ptr_p)
{
    KVT_CUDA_CALL("malloc", malloc_dev(size, ptr_p));
}

kvw_status_t kvt_cuda_free(void *ptr)
{
    KVT_CUDA_CALL("free", free_dev(ptr));
}

kvw_status_t kvt_cuda_malloc_host(uint64_t size, void **ptr_p)
{
    KVT_CUDA_CALL("malloc_host", malloc_host(size, ptr_p));
}

kvw_status_t kvt_cuda_free_host(void *ptr)
{
    KVT_CUDA_CALL("free_host", free_host(ptr));
}

kvw_status_t kvt_cuda_memcpy(void *dst, const void *src, uint64_t size, void *stream)
{
    KVT_CUDA_CALL("memcpy", memcpy_any(dst, src, size, stream));
}

kvw_status_t kvt_cuda_memset(void *ptr, int value, uint64_t size, void *stream)
{
    KVT_CUDA_CALL("memset", memset_dev(ptr, value, size, stream));
}

kvw_status_t kvt_cuda_stream_create(void **stream_p)
{
    KVT_CUDA_CALL("stream_create", stream_create(stream_p));
}

kvw_status_t kvt_cuda_stream_destroy(void *stream)
{
    KVT_CUDA_CALL("stream_destroy", stream_destroy(stream));
}

kvw_status_t kvt_cuda_stream_sync(void *stream)
{
    KVT_CUDA_CALL("stream_sync", stream_sync(stream));
}

kvw_status_t kvt_cuda_ipc_export(void *base, kvt_cuda_ipc_handle_t *handle_p)
{
    KVT_CUDA_CALL("ipc_export", ipc_export(base, handle_p->bytes));
}

kvw_status_t kvt_cuda_ipc_open(const kvt_cuda_ipc_handle_t *handle, void **ptr_p)
{
    KVT_CUDA_CALL("ipc_open", ipc_open(handle->bytes, ptr_p));
}

kvw_status_t kvt_cuda_ipc_close(void *ptr)
{
    KVT_CUDA_CALL("ipc_close", ipc_close(ptr));
}
