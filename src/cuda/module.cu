/*
 * libkvwire_cuda.so: the CUDA runtime side of kvwire. Exports one symbol,
 * KVWC_ENTRY_NAME, returning the operations table of cuda/module.h; everything else is
 * hidden. Only the core library's loader (src/exec/cuda_loader.c) calls it.
 */
#include "cuda/internal.h"

#include <cuda.h>
#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static thread_local char kvwc_msg[512];

kvw_status_t kvwc_error(kvw_status_t st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(kvwc_msg, sizeof(kvwc_msg), fmt, ap);
    va_end(ap);
    return st;
}

const char *kvwc_last_error(void)
{
    return kvwc_msg;
}

kvw_status_t kvwc_cuda_error(cudaError_t e, const char *what)
{
    kvw_status_t st;
    switch (e) {
    case cudaErrorInsufficientDriver:
    case cudaErrorNoDevice:
    case cudaErrorStubLibrary:
        return kvwc_error(KVW_ERR_UNSUPPORTED, "no usable CUDA GPU: %s returned %d (%s)", what,
                          (int)e, cudaGetErrorString(e));
    case cudaErrorMemoryAllocation: st = KVW_ERR_NO_MEMORY; break;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle: st = KVW_ERR_INVALID_PARAM; break;
    case cudaErrorNotSupported: st = KVW_ERR_UNSUPPORTED; break;
    default: st = KVW_ERR_INTERNAL; break;
    }
    return kvwc_error(st, "%s failed: CUDA error %d (%s: %s)", what, (int)e, cudaGetErrorName(e),
                      cudaGetErrorString(e));
}

#define KVWC_CALL(expr, what)                                                            \
    do {                                                                                 \
        cudaError_t kvwc_e_ = (expr);                                                    \
        if (kvwc_e_ != cudaSuccess)                                                      \
            return kvwc_cuda_error(kvwc_e_, what);                                       \
    } while (0)

static kvw_status_t kvwc_available(void)
{
    int n = 0;
    KVWC_CALL(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
    if (n == 0)
        return kvwc_error(KVW_ERR_UNSUPPORTED, "no usable CUDA GPU: no device found");
    return KVW_OK;
}

static kvw_status_t kvwc_device_count(int *count_p)
{
    int n = 0;
    KVWC_CALL(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
    *count_p = n;
    return KVW_OK;
}

static kvw_status_t kvwc_set_device(int device)
{
    KVWC_CALL(cudaSetDevice(device), "cudaSetDevice");
    return KVW_OK;
}

static kvw_status_t kvwc_get_device(int *device_p)
{
    int d;
    KVWC_CALL(cudaGetDevice(&d), "cudaGetDevice");
    *device_p = d;
    return KVW_OK;
}

static kvw_status_t kvwc_malloc_dev(uint64_t size, void **ptr_p)
{
    void *p = NULL;
    KVWC_CALL(cudaMalloc(&p, size), "cudaMalloc");
    *ptr_p = p;
    return KVW_OK;
}

static kvw_status_t kvwc_free_dev(void *ptr)
{
    KVWC_CALL(cudaFree(ptr), "cudaFree");
    return KVW_OK;
}

static kvw_status_t kvwc_malloc_host(uint64_t size, void **ptr_p)
{
    void *p = NULL;
    KVWC_CALL(cudaMallocHost(&p, size), "cudaMallocHost");
    *ptr_p = p;
    return KVW_OK;
}

static kvw_status_t kvwc_free_host(void *ptr)
{
    KVWC_CALL(cudaFreeHost(ptr), "cudaFreeHost");
    return KVW_OK;
}

static kvw_status_t kvwc_memcpy_any(void *dst, const void *src, uint64_t size, void *stream)
{
    if (stream == NULL) {
        KVWC_CALL(cudaMemcpy(dst, src, size, cudaMemcpyDefault), "cudaMemcpy");
    } else {
        KVWC_CALL(cudaMemcpyAsync(dst, src, size, cudaMemcpyDefault, (cudaStream_t)stream),
                  "cudaMemcpyAsync");
    }
    return KVW_OK;
}

static kvw_status_t kvwc_memset_dev(void *ptr, int value, uint64_t size, void *stream)
{
    if (stream == NULL) {
        KVWC_CALL(cudaMemset(ptr, value, size), "cudaMemset");
    } else {
        KVWC_CALL(cudaMemsetAsync(ptr, value, size, (cudaStream_t)stream), "cudaMemsetAsync");
    }
    return KVW_OK;
}

static kvw_status_t kvwc_stream_create(void **stream_p)
{
    cudaStream_t s;
    KVWC_CALL(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    *stream_p = (void *)s;
    return KVW_OK;
}

static kvw_status_t kvwc_stream_destroy(void *stream)
{
    KVWC_CALL(cudaStreamDestroy((cudaStream_t)stream), "cudaStreamDestroy");
    return KVW_OK;
}

static kvw_status_t kvwc_stream_sync(void *stream)
{
    KVWC_CALL(cudaStreamSynchronize((cudaStream_t)stream), "cudaStreamSynchronize");
    return KVW_OK;
}

static kvw_status_t kvwc_device_sync(void)
{
    KVWC_CALL(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    return KVW_OK;
}

static_assert(sizeof(cudaIpcMemHandle_t) == KVWC_IPC_HANDLE_SIZE, "IPC handle size changed");

static kvw_status_t kvwc_ipc_export(void *base, void *handle64)
{
    cudaIpcMemHandle_t h;
    KVWC_CALL(cudaIpcGetMemHandle(&h, base), "cudaIpcGetMemHandle");
    memcpy(handle64, &h, sizeof(h));
    return KVW_OK;
}

/* The driver API's cuMemGetAddressRange, looked up in the driver the runtime already
 * loaded: an IPC handle exports a whole allocation, and buffers (e.g. tensors from a
 * caching allocator) often start inside one. */
typedef int (*kvwc_getrange_fn)(unsigned long long *base, size_t *size, unsigned long long ptr);

static kvw_status_t kvwc_mem_base(void *ptr, void **base_p, uint64_t *size_p)
{
    static kvwc_getrange_fn fn;
    if (fn == NULL) {
        void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (lib == NULL)
            lib = dlopen("libcuda.so.1", RTLD_NOW);
        if (lib != NULL)
            fn = (kvwc_getrange_fn)dlsym(lib, "cuMemGetAddressRange_v2");
        if (fn == NULL)
            return kvwc_error(KVW_ERR_UNSUPPORTED, "cannot find cuMemGetAddressRange_v2 in "
                             "libcuda.so.1");
    }
    /* The driver needs a current context: make the runtime create the primary one. */
    cudaFree(0);
    unsigned long long base = 0;
    size_t size = 0;
    int rc = fn(&base, &size, (unsigned long long)(uintptr_t)ptr);
    if (rc != 0)
        return kvwc_error(KVW_ERR_INVALID_PARAM, "cuMemGetAddressRange(%p) failed with driver "
                         "error %d: not device memory?", ptr, rc);
    *base_p = (void *)(uintptr_t)base;
    if (size_p)
        *size_p = size;
    return KVW_OK;
}

static kvw_status_t kvwc_ipc_open(const void *handle64, void **ptr_p)
{
    cudaIpcMemHandle_t h;
    memcpy(&h, handle64, sizeof(h));
    void *p = NULL;
    KVWC_CALL(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess),
              "cudaIpcOpenMemHandle");
    *ptr_p = p;
    return KVW_OK;
}

static kvw_status_t kvwc_ipc_close(void *ptr)
{
    KVWC_CALL(cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle");
    return KVW_OK;
}

static kvw_status_t kvwc_host_register(void *ptr, uint64_t size)
{
    KVWC_CALL(cudaHostRegister(ptr, size, cudaHostRegisterPortable), "cudaHostRegister");
    return KVW_OK;
}

static kvw_status_t kvwc_host_unregister(void *ptr)
{
    KVWC_CALL(cudaHostUnregister(ptr), "cudaHostUnregister");
    return KVW_OK;
}

static kvw_status_t kvwc_event_create(void **ev)
{
    cudaEvent_t e;
    KVWC_CALL(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    *ev = (void *)e;
    return KVW_OK;
}

static kvw_status_t kvwc_event_record(void *ev, void *stream)
{
    KVWC_CALL(cudaEventRecord((cudaEvent_t)ev, (cudaStream_t)stream), "cudaEventRecord");
    return KVW_OK;
}

static kvw_status_t kvwc_event_query(void *ev)
{
    cudaError_t e = cudaEventQuery((cudaEvent_t)ev);
    if (e == cudaErrorNotReady)
        return KVW_INPROGRESS;
    KVWC_CALL(e, "cudaEventQuery");
    return KVW_OK;
}

static kvw_status_t kvwc_event_destroy(void *ev)
{
    KVWC_CALL(cudaEventDestroy((cudaEvent_t)ev), "cudaEventDestroy");
    return KVW_OK;
}

/*
 * What a pointer is, through the driver's cuPointerGetAttributes rather than the
 * runtime's cudaPointerGetAttributes: the runtime call initialises the runtime and
 * creates a context on the current device (memory on the GPU, and a process that can no
 * longer fork safely), which a rank description of host buffers must not cause. The
 * driver is the one libcudart (or PyTorch's) loaded: a process in which
 * libcuda.so.1 is not loaded, or not initialised, has allocated, registered and mapped
 * nothing through CUDA, so its pointers are plain host memory. The module does not link
 * the driver (it must load where none is installed); the symbol comes from dlsym.
 */
typedef CUresult (*kvwc_ptr_attrs_fn)(unsigned, CUpointer_attribute *, void **, CUdeviceptr);

static kvw_status_t kvwc_pointer_kind(const void *ptr, int *kind_p, int *device_p)
{
    *kind_p = KVWC_PTR_HOST;
    *device_p = -1;
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (drv == NULL) {
        /* Not loaded here: installed (nothing was allocated through it yet), or not. */
        void *probe = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
        if (probe == NULL)
            return kvwc_error(KVW_ERR_UNSUPPORTED, "no CUDA driver: libcuda.so.1 cannot be "
                              "loaded (%s)", dlerror());
        dlclose(probe);
        return KVW_OK;
    }
    kvwc_ptr_attrs_fn get = (kvwc_ptr_attrs_fn)dlsym(drv, "cuPointerGetAttributes");
    if (get == NULL) {
        dlclose(drv);
        return kvwc_error(KVW_ERR_UNSUPPORTED, "the CUDA driver has no cuPointerGetAttributes");
    }
    unsigned int type = 0;
    int ordinal = -1;
    unsigned int managed = 0; /* the driver writes a bool-sized value here */
    CUpointer_attribute attrs[3] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                    CU_POINTER_ATTRIBUTE_IS_MANAGED};
    void *data[3] = {&type, &ordinal, &managed};
    CUresult r = get(3, attrs, data, (CUdeviceptr)(uintptr_t)ptr);
    dlclose(drv);
    switch (r) {
    case CUDA_SUCCESS: break;
    /* Not initialised (so nothing allocated through it), or a pointer no context knows. */
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_DEINITIALIZED:
    case CUDA_ERROR_INVALID_CONTEXT:
    case CUDA_ERROR_INVALID_VALUE: return KVW_OK;
    default:
        return kvwc_error(KVW_ERR_INTERNAL, "cuPointerGetAttributes(%p) failed: CUDA driver "
                          "error %d", ptr, (int)r);
    }
    if (managed & 0xff) {
        *kind_p = KVWC_PTR_MANAGED;
        *device_p = ordinal;
    } else if (type == CU_MEMORYTYPE_DEVICE) {
        *kind_p = KVWC_PTR_DEVICE;
        *device_p = ordinal;
    } else if (type == CU_MEMORYTYPE_HOST) {
        *kind_p = KVWC_PTR_HOST_REGISTERED;
    }
    return KVW_OK;
}

static const kvwc_ops_t kvwc_ops = {
    .abi = KVWC_ABI_VERSION,
    .size = sizeof(kvwc_ops_t),
    .last_error = kvwc_last_error,
    .available = kvwc_available,
    .device_count = kvwc_device_count,
    .set_device = kvwc_set_device,
    .get_device = kvwc_get_device,
    .malloc_dev = kvwc_malloc_dev,
    .free_dev = kvwc_free_dev,
    .malloc_host = kvwc_malloc_host,
    .free_host = kvwc_free_host,
    .memcpy_any = kvwc_memcpy_any,
    .memset_dev = kvwc_memset_dev,
    .stream_create = kvwc_stream_create,
    .stream_destroy = kvwc_stream_destroy,
    .stream_sync = kvwc_stream_sync,
    .device_sync = kvwc_device_sync,
    .ipc_export = kvwc_ipc_export,
    .ipc_open = kvwc_ipc_open,
    .ipc_close = kvwc_ipc_close,
    .mem_base = kvwc_mem_base,
    .plan_upload = kvwc_plan_upload,
    .plan_free = kvwc_plan_free,
    .plan_exec = kvwc_plan_exec,
    .plan_gather = kvwc_plan_gather,
    .plan_scatter = kvwc_plan_scatter,
    .plan_exec_once = kvwc_plan_exec_once,
    .exec_create = kvwc_exec_create,
    .exec_destroy = kvwc_exec_destroy,
    .exec_launch = kvwc_exec_launch,
    .exec_reap = kvwc_exec_reap,
    .exec_plan_upload = kvwc_exec_plan_upload,
    .exec_plan_free = kvwc_exec_plan_free,
    .exec_stage = kvwc_exec_stage,
    .host_register = kvwc_host_register,
    .host_unregister = kvwc_host_unregister,
    .event_create = kvwc_event_create,
    .event_record = kvwc_event_record,
    .event_query = kvwc_event_query,
    .event_destroy = kvwc_event_destroy,
    .busy = kvwc_busy,
    .pointer_kind = kvwc_pointer_kind,
    .exec_digest = kvwc_exec_digest,
};

extern "C" __attribute__((visibility("default"))) const kvwc_ops_t *kvw_cuda_module_entry(void)
{
    return &kvwc_ops;
}
