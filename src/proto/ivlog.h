/*
 * Which bytes of which regions a room's mediated writes covered (tcp receiver). Writes
 * are appended as they are admitted (adjacent ones merge, so a large put split into
 * frames costs one entry) and checked once, when the room completes: sorting then finds
 * any byte written twice. Together with "distinct bytes == bytes the plans imply" this
 * makes completion page-exact: a duplicated page plus a missing one no longer add up.
 */
#ifndef KVW_PROTO_IVLOG_H
#define KVW_PROTO_IVLOG_H

#include "core/core.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct kvw_iv {
    uint64_t region, lo, hi; /* [lo, hi) of region */
} kvw_iv_t;

/* Region keys with this bit name a staging span (by its offset), not a buffer. */
#define KVW_IV_STAGED (UINT64_C(1) << 63)

typedef struct kvw_ivlog {
    kvw_iv_t *v;
    uint32_t n, cap;
} kvw_ivlog_t;

/* Records [off, off + len) of region (len > 0). NO_MEMORY when the log cannot grow. */
kvw_status_t kvw__ivlog_add(kvw_ivlog_t *log, uint64_t region, uint64_t off, uint64_t len);

/* Sorts and coalesces the log. Returns false when two writes overlap and stores the first
 * such pair in *a_p, *b_p. The distinct byte count goes to *bytes_p either way (with
 * overlapping bytes counted once). */
bool kvw__ivlog_check(kvw_ivlog_t *log, kvw_iv_t *a_p, kvw_iv_t *b_p, uint64_t *bytes_p);

/* Removes every entry of `region` from the log and checks that they cover [lo, hi)
 * exactly once (a staged window before it is scattered). Returns false on an overlap;
 * *bytes_p gets the distinct bytes covered (hi - lo when the window is whole). */
bool kvw__ivlog_take(kvw_ivlog_t *log, uint64_t region, uint64_t lo, uint64_t hi,
                     uint64_t *bytes_p);

void kvw__ivlog_free(kvw_ivlog_t *log);

#endif
