#include "core/core.h"
#include <pthread.h>

#include <stdio.h>
#include <string.h>
#include <time.h>

const char *kvw_status_string(kvw_status_t status)
{
    switch (status) {
#define KVW_X_CASE(name, value, text)                                                    \
    case KVW_##name:                                                                     \
        return text;
        KVW_STATUS_TABLE(KVW_X_CASE)
#undef KVW_X_CASE
    }
    return "unknown status";
}

static _Thread_local char kvw_error_buf[512];

kvw_status_t kvw__verror(kvw_status_t status, const char *fmt, va_list ap)
{
    /* Formatted aside first: callers often wrap the previous message, passing
     * kvw_last_error() (this very buffer) as an argument. */
    char tmp[sizeof(kvw_error_buf)];
    vsnprintf(tmp, sizeof(tmp), fmt, ap);
    memcpy(kvw_error_buf, tmp, sizeof(tmp));
    return status;
}

kvw_status_t kvw__error(kvw_status_t status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvw__verror(status, fmt, ap);
    va_end(ap);
    return status;
}

void kvw__clear_error(void)
{
    kvw_error_buf[0] = '\0';
}

const char *kvw_last_error(void)
{
    return kvw_error_buf;
}

uint64_t kvw__now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void kvw__thread_name(const char *fmt, ...)
{
    char name[16]; /* the kernel keeps 15 characters and the NUL */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof(name), fmt, ap);
    va_end(ap);
    (void)pthread_setname_np(pthread_self(), name);
}
