/*
 * One scale for every timeout in the tests: the timeouts given to contexts and
 * transports, and every deadline a test waits for. A loaded machine (two cores shared
 * with other builds) or a sanitizer makes everything slower in proportion, so one
 * factor stretches them all and what each test checks stays the same: a test that
 * checks that a timeout fires no sooner than its setting scales both.
 *
 *   KVW_TEST_TIMEOUT_SCALE   a whole number >= 1 (default 1)
 *   sanitized builds         times 3 (built with ASan or TSan, or KVW_SANITIZED=1 as
 *                            `make check` sets it)
 *
 * CTest's own per-test limits are scaled the same way when CMake configures the build
 * (CMakeLists.txt reads KVW_TEST_TIMEOUT_SCALE then); the shell tests source
 * tests/timeout.sh. Include this header from any test; inproc.h includes it.
 */
#ifndef KVW_TESTS_TIMEOUT_H
#define KVW_TESTS_TIMEOUT_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVT_SANITIZED_BUILD 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KVT_SANITIZED_BUILD 1
#endif
#endif
#ifndef KVT_SANITIZED_BUILD
#define KVT_SANITIZED_BUILD 0
#endif

#define KVT_SANITIZED_FACTOR 3

/* The factor. A malformed KVW_TEST_TIMEOUT_SCALE ends the test with a message: a
 * silently ignored knob would only show as a flaky test. */
static inline uint32_t kvt_timeout_scale(void)
{
    uint32_t scale = 1;
    const char *env = getenv("KVW_TEST_TIMEOUT_SCALE");
    if (env != NULL && env[0] != '\0') {
        char *end;
        unsigned long v = strtoul(env, &end, 10);
        if (*end != '\0' || env[0] < '1' || env[0] > '9' || v > 1000) {
            fprintf(stderr, "KVW_TEST_TIMEOUT_SCALE='%s': expected a whole number from 1 to "
                            "1000\n", env);
            exit(2);
        }
        scale = (uint32_t)v;
    }
    const char *san = getenv("KVW_SANITIZED");
    if (KVT_SANITIZED_BUILD || (san != NULL && san[0] != '\0' && san[0] != '0'))
        scale *= KVT_SANITIZED_FACTOR;
    return scale;
}

/* A timeout or deadline in milliseconds, scaled. */
static inline uint32_t kvt_tmo_ms(uint32_t ms)
{
    uint64_t v = (uint64_t)ms * kvt_timeout_scale();
    return v > UINT32_MAX ? UINT32_MAX : (uint32_t)v;
}

/* The same in nanoseconds (deadlines compared with kvt_now_ns / kvw__now_ns). */
static inline uint64_t kvt_tmo_ns(uint64_t ns)
{
    return ns * kvt_timeout_scale();
}

/* The same in seconds. */
static inline unsigned kvt_tmo_s(unsigned s)
{
    return s * kvt_timeout_scale();
}

#endif
