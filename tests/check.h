/*
 * The tests' CHECK macros and failure counters, in one place.
 *
 * CHECK(cond, fmt, ...) counts a check and, when cond is false, a failure; it says where
 * ("file:line: [case] CHECK(cond) failed: message", the case being cur_case when set) and
 * goes on, so that one run reports every broken case. main ends on `failures`.
 *
 * A test whose checks end the case instead defines CHECK_END before including this
 * header: the statement a failed check runs after saying so (`return 1`, or
 * `rc = 1; goto out`). Its messages read "FAIL [case] file:line: (cond) message", the case
 * being CHECK_CASE (an expression giving a string; default cur_case). FAILF(fmt, ...)
 * fails the case outright; CHECK_OK(expr) and CHECK_ST(expr, want) check a kvw_status_t
 * (with kvw_last_error() in the message).
 */
#ifndef KVW_TESTS_CHECK_H
#define KVW_TESTS_CHECK_H

#include <kvwire/kvwire.h>

#include <stdio.h>

/* Checks run and failed in this program; the case being run ("": none). */
static int failures __attribute__((unused));
static int checks __attribute__((unused));
static const char *cur_case __attribute__((unused)) = "";

#ifndef CHECK_CASE
#define CHECK_CASE cur_case
#endif

#ifndef CHECK_END

#define CHECK(cond, ...)                                                                 \
    do {                                                                                 \
        checks++;                                                                        \
        if (!(cond)) {                                                                   \
            failures++;                                                                  \
            fprintf(stderr, "%s:%d: %s%s%sCHECK(%s) failed: ", __FILE__, __LINE__,       \
                    cur_case[0] ? "[" : "", cur_case, cur_case[0] ? "] " : "", #cond);   \
            fprintf(stderr, __VA_ARGS__);                                                \
            fputc('\n', stderr);                                                         \
        }                                                                                \
    } while (0)

#else

#define FAILF(...)                                                                       \
    do {                                                                                 \
        failures++;                                                                      \
        fprintf(stderr, "FAIL [%s] %s:%d: ", CHECK_CASE, __FILE__, __LINE__);            \
        fprintf(stderr, __VA_ARGS__);                                                    \
        fputc('\n', stderr);                                                             \
        CHECK_END;                                                                       \
    } while (0)
#define CHECK(cond, ...)                                                                 \
    do {                                                                                 \
        checks++;                                                                        \
        if (!(cond)) {                                                                   \
            failures++;                                                                  \
            fprintf(stderr, "FAIL [%s] %s:%d: (%s) ", CHECK_CASE, __FILE__, __LINE__,    \
                    #cond);                                                              \
            fprintf(stderr, __VA_ARGS__);                                                \
            fputc('\n', stderr);                                                         \
            CHECK_END;                                                                   \
        }                                                                                \
    } while (0)

#endif

#define CHECK_OK(expr)                                                                   \
    do {                                                                                 \
        kvw_status_t st_ = (expr);                                                       \
        CHECK(st_ == KVW_OK, "%s: %s: %s", #expr, kvw_status_string(st_),                \
              kvw_last_error());                                                         \
    } while (0)
#define CHECK_ST(expr, want)                                                             \
    do {                                                                                 \
        kvw_status_t st_ = (expr);                                                       \
        CHECK(st_ == (want), "%s: got %s (%s), want %s", #expr, kvw_status_string(st_),  \
              kvw_last_error(), kvw_status_string(want));                                \
    } while (0)

#endif
