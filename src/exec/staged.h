/*
 * Staged streams, as the protocol drives them: a chunk's plan is prepared once (for a
 * GPU, flattened and uploaded once) and its staging byte stream then moves one window
 * [lo, hi) at a time between a host buffer and this rank's buffers, on the memory
 * kind's executor (memops.h). The protocol decides which windows, and when (credits,
 * DONE); this keeps the buffers and the executor's slots.
 *
 * Prefill (gather): kvw__staged_gather starts a window, kvw__staged_take completes the
 * oldest started one and hands out the buffer that holds it, valid until the next take
 * (or close). At most one window is started and not taken. On a device the gather of
 * window k + 1 runs while window k is on the wire (two buffers); on the host a window
 * is gathered when taken (one buffer).
 *
 * Decode (scatter): kvw__staged_scatter moves one window from a buffer into the plan's
 * destination buffers and waits for it.
 *
 * A stream is used by one thread at a time; the plan must outlive it.
 */
#ifndef KVW_EXEC_STAGED_H
#define KVW_EXEC_STAGED_H

#include "exec/memops.h"

typedef struct kvw_staged kvw_staged_t;

/* Opens a stream over `plan`, whose source (gather) or destination (scatter) buffers
 * are `mem`'s kind on `device`; a gathering stream gets buffers for windows of up to
 * `wmax` bytes. With `own_plan` the stream takes the plan: close destroys it (and so
 * does a failed open). Errors: the kind's (NO_MEMORY, the CUDA module's). */
kvw_status_t kvw__staged_open(const kvw_memops_t *mem, int device, struct kvw_plan *plan,
                              bool own_plan, bool gather, uint64_t wmax, kvw_staged_t **s_p);
kvw_status_t kvw__staged_gather(kvw_staged_t *s, uint64_t lo, uint64_t hi);
kvw_status_t kvw__staged_take(kvw_staged_t *s, const uint8_t **buf_p);
kvw_status_t kvw__staged_scatter(kvw_staged_t *s, const uint8_t *buf, uint64_t lo, uint64_t hi);
/* Waits for a window still in flight (an error path), then releases the stream (and
 * the plan it owns). NULL: nothing. */
void kvw__staged_close(kvw_staged_t *s);

#endif
