/*
 * The contract between the core library and the CUDA module (libkvwire_cuda.so).
 *
 * The core never links CUDA: src/exec/cuda_loader.c dlopens the module and calls one
 * exported function, KVWC_ENTRY_NAME, which returns a table of operations. Both sides
 * are built from this header in one tree, but a stale module next to a new library is a
 * real deployment mistake, so the table carries an ABI number and its own size and the
 * loader refuses a mismatch with a clear message.
 *
 * The module sees no kvwire internals: the loader flattens a struct kvw_plan into
 * kvwc_plan_in_t (segments with buffer addresses already resolved, plus the page lists),
 * so the module depends on nothing but this header and kvwire.h's status codes.
 *
 * Every operation returns a kvw_status_t; on error, last_error() returns a message for
 * the calling thread. Operations never print.
 */
#ifndef KVW_CUDA_MODULE_H
#define KVW_CUDA_MODULE_H

#include <kvwire/kvwire.h>

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVWC_ABI_VERSION 10
#define KVWC_ENTRY_NAME "kvw_cuda_module_entry"
#define KVWC_MODULE_FILE "libkvwire_cuda.so"

/* What a device plan will be used for; selects which side's addresses must be valid. */
enum {
    KVWC_USE_DIRECT = 1u << 0,  /* source and destination buffers */
    KVWC_USE_GATHER = 1u << 1,  /* source buffers -> staging */
    KVWC_USE_SCATTER = 1u << 2  /* staging -> destination buffers */
};

/* One side of a segment. `base` is the buffer address plus the plane offset plus the
 * first copied head times head_stride (0 when that side's buffers are not addressable
 * here); offsets follow plan.h's addressing formula from there. */
typedef struct kvwc_side {
    uint64_t base;
    uint64_t page_stride, token_stride, head_stride;
    uint64_t first_token; /* the page map's first token */
    uint32_t page_size;
    uint32_t map; /* index into kvwc_plan_in_t.maps */
} kvwc_side_t;

typedef struct kvwc_seg_in {
    kvwc_side_t src, dst;
    uint64_t tok_begin, tok_end;
    uint32_t head_bytes, num_heads;
} kvwc_seg_in_t;

typedef struct kvwc_map_in {
    const uint32_t *pages;
    uint32_t num_pages;
} kvwc_map_in_t;

/* Page maps one plan_in may name (ABI 10; 16 before): a launch of several plans
 * (kvw__cuda_step_launch_n) brings 2 * KVW_NUM_POOLS of them per plan. */
#define KVWC_MAX_MAPS 192

typedef struct kvwc_plan_in {
    uint32_t num_segs;
    const kvwc_seg_in_t *segs;
    uint32_t num_maps;
    const kvwc_map_in_t *maps;
    uint64_t bytes; /* sum of the segments' bytes */
    unsigned uses;  /* KVWC_USE_* */
} kvwc_plan_in_t;

typedef struct kvwc_plan *kvwc_plan_h;

/* A worker thread's executor: its own non-blocking stream and KVWC_EXEC_SLOTS slots,
 * each with a pinned host and a device buffer for plan images (grown to the largest
 * plan it ran, then reused) and events. A step allocates nothing in the steady state,
 * and up to KVWC_EXEC_SLOTS steps can be in flight: the caller prepares the next plan
 * while earlier kernels run, and reaps steps in launch order. */
typedef struct kvwc_exec *kvwc_exec_h;
#define KVWC_EXEC_SLOTS 8
/* Staged windows in flight per executor (a gather of the next window while the current
 * one is on the wire); their slot numbers follow the direct steps' for exec_reap. */
#define KVWC_STAGE_SLOTS 2

/* What one executor step cost: host clock for enqueueing and for a blocking reap, CUDA
 * events on the executor's stream for the upload and the kernel. */
typedef struct kvwc_step_prof {
    uint64_t launch_ns, wait_ns;
    float upload_ms, kernel_ms;
} kvwc_step_prof_t;

#define KVWC_IPC_HANDLE_SIZE 64

/* What memory a pointer is (pointer_kind), as the CUDA driver sees it. */
enum {
    KVWC_PTR_HOST = 0,            /* host memory CUDA does not know (pageable) */
    KVWC_PTR_HOST_REGISTERED = 1, /* host memory page-locked by CUDA (cudaMallocHost,
                                   * cudaHostRegister) */
    KVWC_PTR_DEVICE = 2,          /* device memory (cudaMalloc, IPC-mapped peer memory) */
    KVWC_PTR_MANAGED = 3          /* managed memory (cudaMallocManaged) */
};

/*
 * The KV digest of a plan's rows on one side (src/plan/digest.h defines it; ABI 7, made
 * asynchronous in ABI 8: exec_digest below): per
 * segment of the plan, the unit its first head adds to, the global head of that head and
 * the seed base of its (layer, component). The module adds, for every row (token, head)
 * of every segment, XXH3_64bits_withSeed(row, head_bytes, seed) to units[unit + head]
 * (mod 2^64), reading the side `dst_side` names (its buffers must be device memory of
 * the current device, or mapped into it). `secret`: XXH3's default secret as 24
 * little-endian words.
 */
typedef struct kvwc_dig_seg {
    uint64_t seed_base;
    uint32_t unit, head0;
} kvwc_dig_seg_t;

#define KVWC_DIGEST_SECRET_WORDS 24

typedef struct kvwc_digest_in {
    const kvwc_plan_in_t *plan;
    const kvwc_dig_seg_t *dsegs; /* plan->num_segs of them */
    int dst_side;
    uint64_t secret[KVWC_DIGEST_SECRET_WORDS];
    uint64_t *units; /* host memory; added to (see exec_digest for when) */
    uint32_t num_units;
    /* -1: computed now (exec_digest waits); 0 .. KVWC_EXEC_SLOTS - 1: attached to that
     * executor slot, added to `units` when exec_reap reports the slot done (ABI 8).
     * Always set it: a zero-initialised entry names slot 0. */
    int slot;
} kvwc_digest_in_t;

typedef struct kvwc_ops {
    uint32_t abi;  /* KVWC_ABI_VERSION */
    uint32_t size; /* sizeof(kvwc_ops_t) */
    const char *(*last_error)(void);

    /* OK when the runtime initialises and a device exists; UNSUPPORTED otherwise. */
    kvw_status_t (*available)(void);
    kvw_status_t (*device_count)(int *count_p);
    kvw_status_t (*set_device)(int device);
    kvw_status_t (*get_device)(int *device_p);
    kvw_status_t (*malloc_dev)(uint64_t size, void **ptr_p);
    kvw_status_t (*free_dev)(void *ptr);
    kvw_status_t (*malloc_host)(uint64_t size, void **ptr_p);
    kvw_status_t (*free_host)(void *ptr);
    kvw_status_t (*memcpy_any)(void *dst, const void *src, uint64_t size, void *stream);
    kvw_status_t (*memset_dev)(void *ptr, int value, uint64_t size, void *stream);
    kvw_status_t (*stream_create)(void **stream_p);
    kvw_status_t (*stream_destroy)(void *stream);
    kvw_status_t (*stream_sync)(void *stream);
    kvw_status_t (*device_sync)(void);
    kvw_status_t (*ipc_export)(void *base, void *handle64);
    kvw_status_t (*ipc_open)(const void *handle64, void **ptr_p);
    kvw_status_t (*ipc_close)(void *ptr);
    /* Start and size of the allocation holding ptr (what an IPC handle exports);
     * size_p may be NULL. ABI 9 (before: the start only). */
    kvw_status_t (*mem_base)(void *ptr, void **base_p, uint64_t *size_p);

    kvw_status_t (*plan_upload)(const kvwc_plan_in_t *in, kvwc_plan_h *plan_p);
    void (*plan_free)(kvwc_plan_h plan);
    kvw_status_t (*plan_exec)(kvwc_plan_h plan, void *stream);
    kvw_status_t (*plan_gather)(kvwc_plan_h plan, void *staging, uint64_t size, void *stream);
    kvw_status_t (*plan_scatter)(kvwc_plan_h plan, const void *staging, uint64_t size,
                                 void *stream);
    /* Upload, run the direct copy and release the device copy, all ordered on `stream`. */
    kvw_status_t (*plan_exec_once)(const kvwc_plan_in_t *in, void *stream);
    /* An executor on the current device (see kvwc_exec_h); exec_destroy waits for its
     * stream first. exec_launch uploads the plan into the next slot and runs the direct
     * copy on the executor's stream without waiting; *slot_p is -1 when the plan moves
     * nothing (nothing was launched), BUSY when that slot was not reaped yet.
     * exec_reap checks (or, with `block`, waits for) a launched slot: *done_p 0 while
     * its kernel runs; once done the slot is free again and the status is the
     * kernel's (a digest attached to the slot, exec_digest, is then added). */
    kvw_status_t (*exec_create)(kvwc_exec_h *exec_p);
    void (*exec_destroy)(kvwc_exec_h exec);
    kvw_status_t (*exec_launch)(kvwc_exec_h exec, const kvwc_plan_in_t *in, int *slot_p,
                                kvwc_step_prof_t *prof);
    kvw_status_t (*exec_reap)(kvwc_exec_h exec, int slot, int block, int *done_p,
                              kvwc_step_prof_t *prof);
    /* Staged streams. exec_plan_upload uploads a plan once for the staged windows of
     * its staging stream (one chunk's), ordered on the executor's stream, without
     * synchronising the device (stream-ordered allocation); exec_plan_free releases it
     * once every window that used it was reaped (exec may be NULL: a thread without an
     * executor). exec_stage moves one window [lo, hi) of such a plan's staging stream on
     * the executor's stream without waiting, on any executor of the plan's device: a
     * gather runs the kernel into device scratch, then copies the window to `host`; a
     * scatter copies `host` to device scratch, then runs the kernel. Only the plan's
     * jobs that overlap the window run; nothing of the plan is uploaded again. `host`
     * (hi - lo bytes, pinned or registered for speed) must stay valid until the slot is
     * reaped with exec_reap. BUSY when KVWC_STAGE_SLOTS windows are in flight. */
    kvw_status_t (*exec_plan_upload)(kvwc_exec_h exec, const kvwc_plan_in_t *in,
                                     kvwc_plan_h *plan_p);
    void (*exec_plan_free)(kvwc_exec_h exec, kvwc_plan_h plan);
    kvw_status_t (*exec_stage)(kvwc_exec_h exec, kvwc_plan_h plan, int scatter, void *host,
                               uint64_t lo, uint64_t hi, int *slot_p, kvwc_step_prof_t *prof);
    /* Page-locks (and maps) existing host memory for fast copies, and releases it. */
    kvw_status_t (*host_register)(void *ptr, uint64_t size);
    kvw_status_t (*host_unregister)(void *ptr);
    /* Events (cudaEvent_t as void *): query is OK once complete, INPROGRESS before. */
    kvw_status_t (*event_create)(void **event_p);
    kvw_status_t (*event_record)(void *event, void *stream);
    kvw_status_t (*event_query)(void *event);
    kvw_status_t (*event_destroy)(void *event);
    /* Benchmarks: a kernel on `stream` that keeps one block per multiprocessor busy for
     * `ns` nanoseconds (a compute-bound stand-in for an engine's layer). */
    kvw_status_t (*busy)(void *stream, uint64_t ns);
    /* What `ptr` is (KVWC_PTR_*) and, for device and managed memory, the device ordinal
     * it belongs to (-1 otherwise). Never dereferences ptr, and never initialises the
     * CUDA runtime nor creates a context: a process in which nothing has initialised
     * the driver holds no CUDA memory, so every pointer is KVWC_PTR_HOST there.
     * UNSUPPORTED when no CUDA driver can be asked (none installed). ABI 6. */
    kvw_status_t (*pointer_kind)(const void *ptr, int *kind_p, int *device_p);
    /* The KV digests of n plans' rows (kvwc_digest_in_t), on the executor's stream,
     * without allocating (each slot, and the executor for the slot -1 batch, keeps a
     * pinned host image and a device buffer, grown by doubling for a larger digest).
     * Entries with slot -1 are all enqueued, then waited for once (an event after the
     * last of them, not a stream synchronisation per entry), and their units are added
     * to when it returns OK. An entry with slot k >= 0 rides on step k, launched by
     * exec_launch on this executor and not reaped yet: it is enqueued behind that
     * step's copy, the slot's completion event is recorded again after it, and nothing
     * waits; exec_reap of slot k then reports done once the copy and the digest have
     * both finished and, with status OK, adds the digest to `units` (which the caller
     * keeps valid until then); a slot reaped with an error adds nothing. One digest per
     * step: a second one on a slot that carries one, or on a slot that is not in flight
     * (never launched, reaped, a staged window's), is INVALID_PARAM. Every entry is
     * checked before anything is enqueued, so an error leaves the slots as they were
     * (but for a CUDA error while enqueueing, after which the slot's reap adds
     * nothing). ABI 8 (ABI 7: one entry, always waited for). */
    kvw_status_t (*exec_digest)(kvwc_exec_h exec, const kvwc_digest_in_t *in, uint32_t n);
} kvwc_ops_t;

typedef const kvwc_ops_t *(*kvwc_entry_fn)(void);

/*
 * Core side (src/exec/cuda_loader.c): flattens a plan for the module. `maps` is storage
 * for the page maps (2 * KVW_NUM_POOLS entries); the segment array is allocated and
 * released by kvw__cuda_plan_in_free. Checks that the buffers `uses` needs are
 * KVW_MEM_CUDA with addresses. Errors: INVALID_PARAM, NO_MEMORY.
 */
struct kvw_plan;
struct kvw_cuda_profile;
kvw_status_t kvw__cuda_plan_in_make(const struct kvw_plan *plan, unsigned uses,
                                    kvwc_map_in_t *maps, kvwc_plan_in_t *in_p);
void kvw__cuda_plan_in_free(kvwc_plan_in_t *in);
/* n plans flattened into one, for one launch: each plan's page maps follow the previous
 * plans' (2 * KVW_NUM_POOLS each; at most KVWC_MAX_MAPS in all) and its segments name
 * them there, in plan order. The maps and segments are allocated and released by
 * kvw__cuda_plan_in_free_n. Errors as kvw__cuda_plan_in_make. */
kvw_status_t kvw__cuda_plan_in_make_n(const struct kvw_plan *const *plans, uint32_t n,
                                      unsigned uses, kvwc_plan_in_t *in_p);
void kvw__cuda_plan_in_free_n(kvwc_plan_in_t *in);

/* The protocol's GPU steps, on the calling thread's executor (created on first use;
 * released when the thread exits). step_launch enqueues a plan's direct copy and
 * returns at once (*slot_p -1: nothing to move); step_reap checks, or with `block`
 * waits for, a launched slot, in launch order; *done_p tells whether the bytes have
 * landed (and a digest riding on the step, kvw__cuda_step_digest, was added). Both add
 * their figures to *prof. Errors as kvw_cuda_plan_upload, plus the kernel's. */
/* The KV digest (plan/digest.h) of a plan's rows on the GPU: the read side's buffers
 * must all be GPU memory of one device; adds to units (host memory) like
 * kvw__plan_digest, on the calling thread's executor of that device, and returns when
 * done. UNSUPPORTED for a side mixing host and GPU buffers. */
kvw_status_t kvw__cuda_plan_digest(const struct kvw_plan *plan, bool dst_side, const uint8_t *take,
                                   uint32_t layer_begin, uint64_t *units, uint32_t num_units);
/* The same for n plans on one side (plans[i] adds to units[i]), all of their read sides
 * on one device: enqueued together, waited for once. UNSUPPORTED when the plans' buffers
 * are not all GPU memory of one device. */
kvw_status_t kvw__cuda_plan_digest_n(const struct kvw_plan *const *plans, uint32_t n,
                                     bool dst_side, uint64_t *const *units, uint32_t num_units);
/* The digest of the source rows of every segment of `plan` attached to step `slot`,
 * launched by kvw__cuda_step_launch on the calling thread and not reaped yet: it runs
 * behind the step's copy, and kvw__cuda_step_reap adds it to units (host memory, kept
 * valid by the caller until then) when it reports the step done with OK; nothing is
 * added on an error. The source buffers must be GPU memory of the executor's device.
 * INVALID_PARAM for a slot not in flight or already carrying a digest. */
kvw_status_t kvw__cuda_step_digest(const struct kvw_plan *plan, int slot, uint64_t *units,
                                   uint32_t num_units);
kvw_status_t kvw__cuda_step_launch(const struct kvw_plan *plan, int *slot_p,
                                   struct kvw_cuda_profile *prof);
/* n plans' direct copies as one step (one kernel, one slot; n == 1 is step_launch):
 * the protocol's worker launches the steps of several small rooms at once. */
kvw_status_t kvw__cuda_step_launch_n(const struct kvw_plan *const *plans, uint32_t n,
                                     int *slot_p, struct kvw_cuda_profile *prof);
kvw_status_t kvw__cuda_step_reap(int slot, int block, int *done_p, struct kvw_cuda_profile *prof);

/* Staged streams on the calling thread's executor, on the device current on this
 * thread (src/exec/memops.c serves them to src/exec/staged.c): stream_open flattens and
 * uploads a plan once for gathering its source buffers (scatter false) or scattering
 * into its destination buffers, CUDA here; stream_window enqueues the window [lo, hi)
 * of its staging stream between `host` and those buffers (reap the slot with
 * kvw__cuda_step_reap); stream_close releases the device plan once its windows were
 * reaped. stage_buf returns this thread's pinned host buffer `which` (0 or 1) of at
 * least `size` bytes, kept for the thread's life. */
typedef struct kvw_cuda_stream kvw_cuda_stream_t;
kvw_status_t kvw__cuda_stream_open(const struct kvw_plan *plan, bool scatter,
                                   kvw_cuda_stream_t **s_p);
kvw_status_t kvw__cuda_stream_window(kvw_cuda_stream_t *s, void *host, uint64_t lo, uint64_t hi,
                                     int *slot_p, struct kvw_cuda_profile *prof);
void kvw__cuda_stream_close(kvw_cuda_stream_t *s);
kvw_status_t kvw__cuda_stage_buf(int which, uint64_t size, void **buf_p);

/* Makes `device` the calling thread's current one and creates the thread's executor
 * now (stream, events, slot buffers, kernels loaded), so that its first step pays none
 * of it: a prefill worker calls it when it starts. */
kvw_status_t kvw__cuda_warm(int device);
/* Adds an executor to `device`'s pool of digest executors (for threads without one of
 * their own, shared by the process's threads) now, with the calling thread's current
 * device put back: each decode context that verifies rooms on GPU buffers calls it when
 * it starts. */
kvw_status_t kvw__cuda_digest_warm(int device);
kvw_status_t kvw__cuda_host_register(void *ptr, uint64_t size);
/* Events, for the protocol's layer marks and for tests (engines bring their own). */
kvw_status_t kvw__cuda_event_create(void **event_p);
kvw_status_t kvw__cuda_event_record(void *event, void *stream);
kvw_status_t kvw__cuda_event_query(void *event);
kvw_status_t kvw__cuda_event_destroy(void *event);
kvw_status_t kvw__cuda_busy(void *stream, uint64_t ns);
void kvw__cuda_host_unregister(void *ptr);

/* The runtime calls the library itself makes (device selection for the protocol's
 * workers, cuda_ipc's handles and puts), forwarded to the module. The public header
 * does not offer them: engines bring their own CUDA runtime, and the project's tools
 * and tests load the module themselves (tools/testkit/cuda_mod.c). */
kvw_status_t kvw__cuda_set_device(int device);
kvw_status_t kvw__cuda_memcpy(void *dst, const void *src, uint64_t size, void *stream);
kvw_status_t kvw__cuda_mem_base(void *ptr, void **base_p, uint64_t *size_p);
kvw_status_t kvw__cuda_ipc_export(void *base, uint8_t handle[KVWC_IPC_HANDLE_SIZE]);
kvw_status_t kvw__cuda_ipc_open(const uint8_t handle[KVWC_IPC_HANDLE_SIZE], void **ptr_p);
kvw_status_t kvw__cuda_ipc_close(void *ptr);
/* What a pointer is (KVWC_PTR_*, device ordinal or -1), through the module's
 * pointer_kind; UNSUPPORTED when the module or a CUDA driver is not there. */
kvw_status_t kvw__cuda_pointer_kind(const void *ptr, int *kind_p, int *device_p);

/* Adds one step's figures to the process-wide totals read by kvw_cuda_profile. */
void kvw__cuda_profile_add(const struct kvw_cuda_profile *d);

#ifdef __cplusplus
}
#endif

#endif
