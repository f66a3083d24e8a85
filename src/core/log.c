/* The log hook (kvw_set_log_handler): one process-wide handler, read under a lock that
 * only logging and setting take. */
#include "core/core.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>

static pthread_mutex_t kvw_log_mu = PTHREAD_MUTEX_INITIALIZER;
static kvw_log_fn kvw_log_handler;
static void *kvw_log_arg;
/* Highest level delivered, -1 with no handler: read without the lock on the fast path. */
static _Atomic int kvw_log_max = -1;

void kvw_set_log_handler(kvw_log_fn fn, void *arg, kvw_log_level_t max_level)
{
    pthread_mutex_lock(&kvw_log_mu);
    kvw_log_handler = fn;
    kvw_log_arg = arg;
    atomic_store(&kvw_log_max, fn ? (int)max_level : -1);
    pthread_mutex_unlock(&kvw_log_mu);
}

void kvw__log(kvw_log_level_t level, const char *fmt, ...)
{
    if ((int)level > atomic_load_explicit(&kvw_log_max, memory_order_relaxed))
        return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&kvw_log_mu);
    if (kvw_log_handler && (int)level <= atomic_load(&kvw_log_max))
        kvw_log_handler(kvw_log_arg, level, msg);
    pthread_mutex_unlock(&kvw_log_mu);
}
