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

/* `s` as a JSON string, quotes included ('"', '\\' and control characters escaped). */
void cli_json_str(FILE *f, const char *s);

/*
 * One context per rank of ranks[0 .. n), from the template `tmpl` (all but side, rank,
 * bootstrap address and host_bootstrap, which are set here). Prefill (`prefill`): rank 0
 * hosts the bootstrap endpoint at bs_addr and the others register at the address it
 * got, which is copied into bs_out; with `external_bs` no rank hosts it: every rank
 * registers at bs_addr, an endpoint already running (kvwire bootstrap), copied into
 * bs_out. Decode: every rank registers at bs_addr. While a context waits for its peers
 * (longer than 5 s), a progress line every 5 s names the rank and the address, prefixed
 * with `who` (NULL: no progress lines). Returns the array, or NULL after destroying the contexts already created,
 * with *failed set to the rank that failed, *status_p (if not NULL) to its status and
 * "<status>: <reason>" in why.
 */
kvw_ctx_h *cli_contexts(const char *who, const kvw_ctx_params_t *tmpl, kvt_rank_t *ranks,
                        uint32_t n, bool prefill, bool external_bs, const char *bs_addr,
                        char *bs_out, size_t bs_cap, uint32_t *failed, kvw_status_t *status_p,
                        char *why, size_t why_cap);

/*
 * Command-line values. Each parses `text`, the value of option `opt` (as the user wrote
 * it, e.g. "--requests"), and on a bad value prints one line naming the option, its valid
 * range or choices and the value given, "<who>: --requests takes a whole number from 1 to
 * 100000, not '0'", and returns -1 (0 when the value is good).
 */
int cli_opt_u64(const char *who, const char *opt, const char *text, uint64_t min, uint64_t max,
                uint64_t *out);
int cli_opt_u32(const char *who, const char *opt, const char *text, uint32_t min, uint32_t max,
                uint32_t *out);
/* After the getopt loop: 2 (the exit status of a usage error) when an option was bad or an
 * argument is left over ("<who>: unexpected argument 'x' (<help> lists the options)"),
 * else 0. `help` names the command's help, e.g. "kvwire demo --help". */
int cli_opts_end(const char *who, const char *help, int bad, int optind_, int argc,
                 char **argv);
/* One of `choices` (NULL-terminated), compared without case; *index_p is its position. */
int cli_opt_choice(const char *who, const char *opt, const char *text,
                   const char *const *choices, int *index_p);
/* HOST:PORT: a host of 1 to 127 characters and a port from min_port to 65535. */
int cli_opt_hostport(const char *who, const char *opt, const char *text, uint32_t min_port);

/*
 * Progress of a blocking call: a thread that prints "<who>: <what>, N s of L s" to stderr
 * every `every_s` seconds (L: limit_s; "N s" alone when it is 0) until cli_ticker_stop.
 * Nothing is printed when the call returns within every_s.
 */
typedef struct cli_ticker cli_ticker_t;
cli_ticker_t *cli_ticker_start(const char *who, uint32_t every_s, uint32_t limit_s,
                               const char *what);
void cli_ticker_stop(cli_ticker_t *t);

/* Seconds since `t0_ns` (kvt_now_ns), for progress lines. */
double cli_secs_since(uint64_t t0_ns);

/* Prints what kvw_ctx_metrics says of `ctx` (rank `rank` of side `who`), one block of
 * "metrics:" lines, flushed at once (ctx_metrics.c). */
void cli_print_metrics(FILE *f, const char *who, uint32_t rank, kvw_ctx_h ctx);

#endif
