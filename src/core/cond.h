/* Condition variables whose timed waits take CLOCK_MONOTONIC deadlines (header only: the
 * UCX transport module uses it without linking the core). */
#ifndef KVW_CORE_COND_H
#define KVW_CORE_COND_H

#include <pthread.h>
#include <time.h>

static inline int kvw__cond_init_monotonic(pthread_cond_t *cv)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int rc = pthread_cond_init(cv, &ca);
    pthread_condattr_destroy(&ca);
    return rc;
}

#endif
