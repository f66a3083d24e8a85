/* Shared by the CUDA module's translation units; never seen by the core library. */
#ifndef KVW_CUDA_INTERNAL_H
#define KVW_CUDA_INTERNAL_H

#include "cuda/module.h"

#include <cuda_runtime.h>

#if defined(__GNUC__)
#define KVWC_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define KVWC_PRINTF(f, a)
#endif

/* Records a message for last_error() in the calling thread and returns `st`. */
kvw_status_t kvwc_error(kvw_status_t st, const char *fmt, ...) KVWC_PRINTF(2, 3);

/* Maps a CUDA runtime error to a status, naming the call that failed. "No driver" (35),
 * "no device" (100) and "stub library" (34) become UNSUPPORTED. */
kvw_status_t kvwc_cuda_error(cudaError_t e, const char *what);

const char *kvwc_last_error(void);

kvw_status_t kvwc_plan_upload(const kvwc_plan_in_t *in, kvwc_plan_h *plan_p);
void kvwc_plan_free(kvwc_plan_h plan);
kvw_status_t kvwc_plan_exec(kvwc_plan_h plan, void *stream);
kvw_status_t kvwc_plan_gather(kvwc_plan_h plan, void *staging, uint64_t size, void *stream);
kvw_status_t kvwc_plan_scatter(kvwc_plan_h plan, const void *staging, uint64_t size,
                               void *stream);
kvw_status_t kvwc_plan_exec_once(const kvwc_plan_in_t *in, void *stream);
kvw_status_t kvwc_exec_create(kvwc_exec_h *exec_p);
void kvwc_exec_destroy(kvwc_exec_h exec);
kvw_status_t kvwc_exec_launch(kvwc_exec_h exec, const kvwc_plan_in_t *in, int *slot_p,
                              kvwc_step_prof_t *prof);
kvw_status_t kvwc_exec_plan_upload(kvwc_exec_h x, const kvwc_plan_in_t *in, kvwc_plan_h *plan_p);
void kvwc_exec_plan_free(kvwc_exec_h x, kvwc_plan_h plan);
kvw_status_t kvwc_exec_stage(kvwc_exec_h x, kvwc_plan_h plan, int scatter, void *host,
                             uint64_t lo, uint64_t hi, int *slot_p, kvwc_step_prof_t *prof);
kvw_status_t kvwc_busy(void *stream, uint64_t ns);
/*
 * Digest buffers (digest.cu), one per executor slot and one for the executor's batch of
 * slot -1 digests: a pinned host image and a device buffer of `cap` bytes each, made at
 * exec_create and grown by doubling (kvwc_dig_reserve) only when a digest needs more, so
 * that the steady state neither allocates nor frees (cudaMalloc, cudaHostAlloc and
 * their frees synchronise the device). A slot's buffer holds one digest's image at a
 * time, the units coming back at `host + units_off`; `units` is the caller's array it
 * is added to when the slot is reaped (NULL: nothing pending).
 */
typedef struct kvwc_dig_buf {
    void *host; /* pinned */
    void *dmem;
    uint64_t cap;
    uint64_t *units; /* pending: added to at the slot's reap */
    uint32_t num_units;
    uint64_t units_off;
} kvwc_dig_buf_t;

/* Allocates a buffer's pinned and device halves at the default capacity. */
kvw_status_t kvwc_dig_buf_init(kvwc_dig_buf_t *b);
void kvwc_dig_buf_free(kvwc_dig_buf_t *b);
/* At a slot's reap (done): adds a pending digest to its units when `ok`, and forgets it. */
void kvwc_dig_buf_finish(kvwc_dig_buf_t *b, bool ok);
/* Loads the digest kernel (lazy module loading would otherwise load it, with a context
 * synchronisation, on its first launch). */
kvw_status_t kvwc_digest_warm(void);

/* The executor's stream (copy.cu), and the digest on it (digest.cu). */
cudaStream_t kvwc_exec_stream(kvwc_exec_h exec);
/* Slot `slot`'s digest buffer and completion event when the slot is a direct step in
 * flight (NULL otherwise); slot -1: the executor's batch buffer and its event. */
kvwc_dig_buf_t *kvwc_exec_dig_buf(kvwc_exec_h exec, int slot, cudaEvent_t *done_p);
/* Every slot's digest buffer and the batch buffer, for growing the idle ones together. */
kvwc_dig_buf_t *kvwc_exec_dig_bufs(kvwc_exec_h exec, uint32_t *n_p);
kvw_status_t kvwc_exec_digest(kvwc_exec_h exec, const kvwc_digest_in_t *in, uint32_t n);
kvw_status_t kvwc_exec_reap(kvwc_exec_h exec, int slot, int block, int *done_p,
                            kvwc_step_prof_t *prof);

#endif
