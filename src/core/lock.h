/*
 * Lock discipline as code. KVW_ASSERT_HELD(&mu) states that the calling thread holds
 * `mu`; a debug build (NDEBUG not defined) checks it and aborts with the place when it
 * does not. The check reads the owner field glibc keeps in every mutex (the kernel thread
 * id of the holder, set by pthread_mutex_lock and the condition waits, cleared on unlock);
 * release builds and other C libraries compile it to nothing.
 */
#ifndef KVW_CORE_LOCK_H
#define KVW_CORE_LOCK_H

#include "core/core.h"

#include <pthread.h>

#if !defined(NDEBUG) && defined(__GLIBC__)
#include <stdlib.h>
#include <unistd.h>

static inline void kvw__assert_held(pthread_mutex_t *mu, const char *what, const char *file,
                                    int line)
{
    if (mu->__data.__owner != gettid()) {
        kvw__log(KVW_LOG_ERROR, "%s:%d: %s is not held by this thread", file, line, what);
        abort();
    }
}
#define KVW_ASSERT_HELD(mu) kvw__assert_held((mu), #mu, __FILE__, __LINE__)
#else
#define KVW_ASSERT_HELD(mu) ((void)(mu))
#endif

#endif
