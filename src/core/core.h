/* Internal services shared by every layer: errors, allocation helpers, time. */
#ifndef KVW_CORE_CORE_H
#define KVW_CORE_CORE_H

#include <kvwire/kvwire.h>

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#define KVW_ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))
#define KVW_MIN(a, b) ((a) < (b) ? (a) : (b))
#define KVW_MAX(a, b) ((a) > (b) ? (a) : (b))

#if defined(__GNUC__)
#define KVW_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define KVW_PRINTF(f, a)
#endif

/*
 * Records a detailed message for kvw_last_error() in the calling thread and returns
 * `status`, so that error paths read `return kvw__error(KVW_ERR_X, "...", ...);`.
 * Call it once, where the error is first detected; callers that only pass a status
 * up leave the message alone.
 */
kvw_status_t kvw__error(kvw_status_t status, const char *fmt, ...) KVW_PRINTF(2, 3);
kvw_status_t kvw__verror(kvw_status_t status, const char *fmt, va_list ap);
void kvw__clear_error(void);

/* Hands a message to the log handler (kvw_set_log_handler) when one is set for
 * `level`; cheap when none is. */
void kvw__log(kvw_log_level_t level, const char *fmt, ...) KVW_PRINTF(2, 3);

/* Monotonic clock in nanoseconds. */
uint64_t kvw__now_ns(void);

/* Names the calling thread (at most 15 characters show), so that top -H, gdb and
 * profilers tell the library's threads apart. */
void kvw__thread_name(const char *fmt, ...) KVW_PRINTF(1, 2);

/* Overflow-checked helpers: return false on overflow. */
static inline bool kvw__mul_u64(uint64_t a, uint64_t b, uint64_t *r)
{
    return !__builtin_mul_overflow(a, b, r);
}
static inline bool kvw__add_u64(uint64_t a, uint64_t b, uint64_t *r)
{
    return !__builtin_add_overflow(a, b, r);
}

#endif
