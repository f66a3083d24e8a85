/*
 * Memory kinds: one table of operations per kind (host, CUDA), indexed by
 * kvw_mem_kind_t, so that the protocol and the staged-stream executor call through the
 * table instead of branching on the kind. The host kind runs on the calling thread with
 * the CPU (src/exec/cpu.c); the CUDA kind goes through the CUDA module
 * (src/exec/cuda_loader.c) on the calling thread's executor.
 */
#ifndef KVW_EXEC_MEMOPS_H
#define KVW_EXEC_MEMOPS_H

#include "core/core.h"

#include <kvwire/cuda.h>

struct kvw_plan;

typedef struct kvw_memops {
    const char *name; /* "host", "GPU" */
    /* The CPU cannot address it: remote writes into it go through host staging. */
    bool is_device;
    /* Staged windows run beside the calling thread (a device): a gather is started
     * ahead, into a second buffer, while the previous window is on the wire. */
    bool async_windows;
    /* Whether this kind can be used in this process (the CUDA module loads and sees a
     * device). */
    kvw_status_t (*available)(void);
    /* Makes `device` the calling thread's current one (host: nothing to do). */
    kvw_status_t (*select)(int device);
    /* Page-locks host memory for fast copies to and from this kind, and releases it
     * (host: nothing to do). */
    kvw_status_t (*pin)(void *ptr, uint64_t len);
    void (*unpin)(void *ptr);
    /* A direct copy of a plan whose buffers are this kind on both sides, on the calling
     * thread's executor: *slot_p -1 when nothing is left in flight (done, or nothing to
     * move); reap a slot in launch order (sync: block until it completed). */
    kvw_status_t (*step_launch)(const struct kvw_plan *plan, int *slot_p, kvw_cuda_profile_t *prof);
    kvw_status_t (*step_reap)(int slot, int block, int *done_p, kvw_cuda_profile_t *prof);
    /* n plans' direct copies as one step (CUDA: one kernel in one slot); NULL for the
     * host kind, whose steps complete when launched. */
    kvw_status_t (*step_launch_n)(const struct kvw_plan *const *plans, uint32_t n, int *slot_p,
                                  kvw_cuda_profile_t *prof);
    /* Adds a step's figures to the kind's totals (kvw_cuda_profile; host: none). */
    void (*profile_add)(const kvw_cuda_profile_t *prof);
    /* Staged streams (src/exec/staged.c): a plan's staging byte stream, gathered from
     * the plan's source buffers (gather) or scattered into its destination buffers,
     * which are this kind, one window [lo, hi) at a time. stream_open prepares the plan
     * once (CUDA: flattened and uploaded once); window starts a window between `host`
     * (hi - lo bytes) and the buffers, *slot_p -1 when it completed before returning;
     * window_wait waits for a started one (nothing for slot -1); stream_close releases
     * the stream once its windows were waited for. */
    kvw_status_t (*stream_open)(const struct kvw_plan *plan, bool gather, void **stream_p);
    kvw_status_t (*window)(void *stream, uint8_t *host, uint64_t lo, uint64_t hi, int *slot_p);
    kvw_status_t (*window_wait)(void *stream, int slot);
    void (*stream_close)(void *stream);
    /* The calling thread's host buffer `which` (0 or 1) for windows of up to `size`
     * bytes, kept for the thread's life (CUDA: pinned). */
    kvw_status_t (*window_buf)(int which, uint64_t size, uint8_t **buf_p);
    /* The KV digest of a plan's rows on one side whose buffers are this kind
     * (plan/digest.h, kvw__plan_digest's arguments): host, the CPU; CUDA, a kernel on the
     * buffers' device, on the calling thread's executor there or else one of the pool the
     * process's threads share, waited for. */
    kvw_status_t (*digest)(const struct kvw_plan *plan, bool dst_side, const uint8_t *take,
                           uint32_t layer_begin, uint64_t *units, uint32_t num_units);
    /* The same for n plans on one side, all layers of each, plans[i] adding to units[i]:
     * host, one after the other; CUDA, one batch on an executor of their device, as above (all
     * the plans' buffers on that side GPU memory of one device, else UNSUPPORTED),
     * waited for once. */
    kvw_status_t (*digest_n)(const struct kvw_plan *const *plans, uint32_t n, bool dst_side,
                             uint64_t *const *units, uint32_t num_units);
    /* The digest of the source rows of every segment of `plan` (the step's plan, keeping
     * only the layers taken) riding on step `slot`, which step_launch just returned and
     * which was not reaped yet: it runs behind the step's copy without waiting, and
     * step_reap adds it to units (host memory; the caller keeps it valid until then) when
     * it reports the step done with OK (an error adds nothing). One digest per step.
     * NULL for the host kind: its steps complete when launched (slot -1), so its caller
     * uses digest. */
    kvw_status_t (*step_digest)(const struct kvw_plan *plan, int slot, uint64_t *units,
                                uint32_t num_units);
    /* Prepares the calling thread for steps on `device` (CUDA: its executor, made now
     * instead of on the first step); NULL for the host kind. */
    kvw_status_t (*warm)(int device);
    /* Prepares an executor for digest and digest_n on `device` now, for threads without
     * one of their own, not on a room's first digest (CUDA: one more in the pool the
     * process's threads share, the caller's current device put back); NULL for the host
     * kind. */
    kvw_status_t (*digest_warm)(int device);
} kvw_memops_t;

/* The table of a memory kind (any value other than KVW_MEM_CUDA: host). */
const kvw_memops_t *kvw__memops(kvw_mem_kind_t kind);

/*
 * The kind of a rank's buffers: the first GPU buffer's kind and device, else host (and
 * device -1). With `uniform` (the name of the transport that demands it) every buffer
 * must be of that kind, on that device: a rank mixing kinds would need two executors
 * in one plan. Errors: UNSUPPORTED, naming the buffer.
 */
kvw_status_t kvw__rank_memops(kvw_rank_h rank, const char *uniform, const kvw_memops_t **mem_p,
                              int *device_p);

/* The CPU executor's staged window (cpu.c): copies the part [lo, hi) of a plan's
 * staging stream between `buf` (holding just that part) and the plan's buffers on one
 * side: a gather reads the source buffers, a scatter writes the destination buffers.
 * Only that side's pages and addresses are read, so a plan with the far side's
 * geometry only (kvw__plan_create_staged) serves. Errors: OUT_OF_RANGE (past the
 * plan's bytes), UNSUPPORTED (a buffer without a host address). */
kvw_status_t kvw__cpu_window(const struct kvw_plan *plan, bool gather, uint8_t *buf, uint64_t lo,
                             uint64_t hi);

#endif
