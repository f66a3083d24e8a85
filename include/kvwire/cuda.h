/*
 * kvwire/cuda.h — GPU execution of plans.
 *
 * What it holds: whether the GPU path works here (kvw_cuda_available,
 * kvw_cuda_device_count), what memory an address is (kvw_cuda_pointer_kind, the check
 * kvw_rank_create makes of every buffer), the device-plan executor (kvw_cuda_plan_*,
 * kvw_plan_exec_cuda) and where the protocol's GPU time goes (kvw_cuda_profile).
 *
 * What it does not hold: wrappers around the CUDA runtime (device selection, memory,
 * copies, streams, IPC handles). An engine brings its own CUDA runtime (directly, or
 * through PyTorch) and passes kvwire device pointers and streams it made itself;
 * libkvwire offering a second, partial runtime API would only invite mixing the two.
 * The project's own tools and tests get such helpers from their test kit
 * (tools/testkit), which loads the same module by the same rule.
 *
 * The core library never links CUDA. The first call of any function here loads the
 * module libkvwire_cuda.so (built from src/cuda when nvcc is present) with dlopen: from
 * the path in the environment variable KVW_CUDA_MODULE if set, else from the directory
 * holding libkvwire (or the executable it is linked into), else through the dynamic
 * loader's search path. Without the module, or without a GPU and driver, every
 * function returns KVW_ERR_UNSUPPORTED and kvw_last_error() says which of the two is
 * missing.
 *
 * Loading the module does not touch the GPU, and neither does kvw_cuda_pointer_kind (so
 * describing host ranks never initialises CUDA); every other call initialises the CUDA
 * runtime. A process that forks must do so before its first such call (CUDA state does
 * not survive fork).
 *
 * Streams are cudaStream_t values passed as void *; NULL is the legacy default stream.
 * Device pointers are plain pointers valid in the calling thread's current device
 * context (cudaSetDevice), including peer memory the caller opened with
 * cudaIpcOpenMemHandle.
 */
#ifndef KVWIRE_CUDA_H
#define KVWIRE_CUDA_H

#include <kvwire/kvwire.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * OK when the module loads, the CUDA runtime initialises and at least one device
 * exists. UNSUPPORTED otherwise: no module, no driver (CUDA error 35), no device (100).
 */
KVW_API kvw_status_t kvw_cuda_available(void);

/* The number of devices the CUDA runtime sees (cudaGetDeviceCount). */
KVW_API kvw_status_t kvw_cuda_device_count(int *count_p);

/*
 * What memory `ptr` is, for describing buffers (kvw_buffer_desc_t.mem_kind and .device):
 * KVW_MEM_CUDA with the CUDA device ordinal for device memory (cudaMalloc, a caching
 * allocator's blocks, peer memory opened with cudaIpcOpenMemHandle) and for managed
 * memory; KVW_MEM_HOST with device -1 for host memory, page-locked (cudaMallocHost,
 * cudaHostRegister) or not. The pointer is never dereferenced; it may point anywhere
 * inside an allocation.
 *
 * Asks the CUDA driver (cuPointerGetAttributes) without initialising the CUDA runtime
 * or creating a context: in a process where nothing has initialised the driver, no
 * pointer can be CUDA memory and every answer is KVW_MEM_HOST.
 *
 * kvw_rank_create makes the same check of every buffer that has an address, and
 * refuses (KVW_ERR_INVALID_PARAM, naming the buffer) one whose declared kind or device
 * differs from the answer. Managed memory passes either declaration.
 *
 * Errors: INVALID_PARAM (NULL kind or device), UNSUPPORTED when the library cannot ask
 * (no CUDA module, or no CUDA driver installed); kvw_last_error() says which. In that
 * case kvw_rank_create accepts buffers as declared.
 */
KVW_API kvw_status_t kvw_cuda_pointer_kind(const void *ptr, kvw_mem_kind_t *kind,
                                           int32_t *device);

/* ---------------------------------------------------------------- plans on the GPU */

typedef struct kvw_cuda_plan *kvw_cuda_plan_h;

/* What a device plan will run: each selects whose buffers must be KVW_MEM_CUDA with
 * addresses valid in the current device context. */
enum {
    KVW_CUDA_DIRECT = 1u << 0,  /* source and destination buffers */
    KVW_CUDA_GATHER = 1u << 1,  /* source buffers only */
    KVW_CUDA_SCATTER = 1u << 2  /* destination buffers only */
};

/*
 * Copies a plan's segments and page lists to the current device, once, so that it can
 * run any number of times with one kernel launch each (the launch size follows the byte
 * count, never the number of segments or runs). Buffer addresses are read now from the
 * plan's rank descriptions; the plan itself may be destroyed afterwards, but the
 * buffers must outlive every launch. Errors: INVALID_PARAM (a buffer that `uses` needs
 * is not KVW_MEM_CUDA or has no address), UNSUPPORTED (no GPU or module), NO_MEMORY.
 */
KVW_API kvw_status_t kvw_cuda_plan_upload(kvw_plan_h plan, unsigned uses,
                                          kvw_cuda_plan_h *cplan_p);
/* Frees the device copy (synchronises with the device, as cudaFree does). */
KVW_API void kvw_cuda_plan_destroy(kvw_cuda_plan_h cplan);
/* Payload bytes of the plan: the size a staging buffer needs. */
KVW_API uint64_t kvw_cuda_plan_bytes(kvw_cuda_plan_h cplan);

/* Copies every byte of the plan from source to destination buffers on `stream`
 * (asynchronously: kernel errors surface at the next synchronisation). */
KVW_API kvw_status_t kvw_cuda_plan_exec(kvw_cuda_plan_h cplan, void *stream);

/*
 * Staged path. Gather packs the plan's source bytes into `staging` (device memory,
 * 16-byte aligned, at least kvw_cuda_plan_bytes bytes); scatter unpacks such a buffer
 * into the destination. The staging layout is the plan order: the concatenation of the
 * runs of kvw_plan_expand, in the order it emits them, so a CPU gather made with
 * kvw_plan_expand and a GPU scatter agree byte for byte. Errors: INVALID_PARAM
 * (misaligned or NULL staging, plan not uploaded for this use), BUFFER_TOO_SMALL.
 */
KVW_API kvw_status_t kvw_cuda_plan_gather(kvw_cuda_plan_h cplan, void *staging, uint64_t size,
                                          void *stream);
KVW_API kvw_status_t kvw_cuda_plan_scatter(kvw_cuda_plan_h cplan, const void *staging,
                                           uint64_t size, void *stream);

/*
 * One-shot direct copy of a plan whose source and destination buffers are KVW_MEM_CUDA
 * device pointers valid in the current device context (local, or peer memory mapped
 * with cudaIpcOpenMemHandle). Uploads the plan, launches, and releases the device copy,
 * all ordered on `stream` without waiting. For a plan that runs more than once, upload
 * it with kvw_cuda_plan_upload instead.
 */
KVW_API kvw_status_t kvw_plan_exec_cuda(kvw_plan_h plan, void *stream);

/* ---------------------------------------------------------------- where the time goes */

/*
 * Process-wide totals over the protocol's GPU steps (a prefill worker writing one
 * decode rank's share of a chunk into mapped peer memory), for benchmarks. Host times
 * come from the monotonic clock, device times from CUDA events on the worker's stream;
 * steps of concurrent workers add up, so totals can exceed the wall time.
 */
enum {
    KVW_CUDA_PROFILE_FIELD_STEPS = 1u << 0,
    KVW_CUDA_PROFILE_FIELD_BYTES = 1u << 1,
    KVW_CUDA_PROFILE_FIELD_PLAN_NS = 1u << 2,
    KVW_CUDA_PROFILE_FIELD_LAUNCH_NS = 1u << 3,
    KVW_CUDA_PROFILE_FIELD_UPLOAD_DEV_NS = 1u << 4,
    KVW_CUDA_PROFILE_FIELD_KERNEL_DEV_NS = 1u << 5,
    KVW_CUDA_PROFILE_FIELD_WAIT_NS = 1u << 6,
    KVW_CUDA_PROFILE_FIELD_NOTIFY_NS = 1u << 7,
    KVW_CUDA_PROFILE_FIELD_FIRST_START_NS = 1u << 8,
    KVW_CUDA_PROFILE_FIELD_LAST_DONE_NS = 1u << 9
};
#define KVW_CUDA_PROFILE_FIELDS_ALL 0x3ffull

/* A report: the library sets field_mask to the fields it filled. */
typedef struct kvw_cuda_profile {
    uint64_t field_mask; /* KVW_CUDA_PROFILE_FIELD_* */
    uint64_t steps, bytes;
    uint64_t plan_ns;       /* host: building and flattening the plan */
    uint64_t launch_ns;     /* host: enqueueing the plan upload and the kernel */
    uint64_t upload_dev_ns; /* device: the plan upload (0 where it is not measured) */
    uint64_t kernel_dev_ns; /* device: the copy kernel (0 where it is not measured) */
    uint64_t wait_ns;       /* host: waiting for the kernel to complete */
    uint64_t notify_ns;     /* host: sending the completion notice */
    /* Monotonic clock (CLOCK_MONOTONIC, comparable across processes of one host): the
     * earliest step start and the latest completion notice sent; 0 when none. */
    uint64_t first_start_ns, last_done_ns;
} kvw_cuda_profile_t;

/* Copies the totals into *out (if not NULL), then zeroes them if `reset`. */
KVW_API void kvw_cuda_profile(kvw_cuda_profile_t *out, int reset);

#ifdef __cplusplus
}
#endif

#endif /* KVWIRE_CUDA_H */
