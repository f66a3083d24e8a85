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
/* The executor's stream (copy.cu), and the digest on it (digest.cu). */
cudaStream_t kvwc_exec_stream(kvwc_exec_h exec);
kvw_status_t kvwc_exec_digest(kvwc_exec_h exec, const kvwc_digest_in_t *in);
kvw_status_t kvwc_exec_reap(kvwc_exec_h exec, int slot, int block, int *done_p,
                            kvwc_step_prof_t *prof);

#endif
