/*
 * Helpers shared by the CLI's subcommands (bench, bench --gpu, demo): medians, a few
 * questions about a model's layers, and contexts for a set of ranks.
 */
#ifndef KVW_TOOLS_UTIL_H
#define KVW_TOOLS_UTIL_H

#include "testkit.h"

#include <kvwire/xfer.h>

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* qsort comparator for uint64_t. */
int cli_cmp_u64(const void *a, const void *b);

/* Median of n values (the mean of the middle two for even n; 0 for none). */
uint64_t cli_median(const uint64_t *v, uint32_t n);

/* Whether a room has ended (Success or Failed). */
bool cli_room_ended(kvw_room_state_t s);

/* The largest sliding window of the model's SWA layers (0: none). */
uint64_t cli_swa_window(const kvt_model_t *m);

/* Pages of `ps` tokens that hold tokens [b, e) (0 when b >= e). */
uint32_t cli_pages_needed(uint64_t b, uint64_t e, uint32_t ps);

/*
 * One context per rank of ranks[0 .. n), from the template `tmpl` (all but side, rank,
 * bootstrap address and host_bootstrap, which are set here). Prefill (`prefill`): rank 0
 * hosts the bootstrap endpoint at bs_addr and the others register at the address it
 * got, which is copied into bs_out; decode: every rank registers at bs_addr. Returns
 * the array, or NULL after destroying the contexts already created, with *failed set to
 * the rank that failed and "<status>: <reason>" in why.
 */
kvw_ctx_h *cli_contexts(const kvw_ctx_params_t *tmpl, kvt_rank_t *ranks, uint32_t n,
                        bool prefill, const char *bs_addr, char *bs_out, size_t bs_cap,
                        uint32_t *failed, char *why, size_t why_cap);

/* Prints what kvw_ctx_metrics says of `ctx` (rank `rank` of side `who`), one block of
 * "metrics:" lines, flushed at once (ctx_metrics.c). */
void cli_print_metrics(FILE *f, const char *who, uint32_t rank, kvw_ctx_h ctx);

#endif
