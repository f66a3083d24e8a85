/*
 * Helpers shared by the transports: the effective timeout, non-blocking sockets and
 * wake-up channels; the socket I/O loops, in which every wait is bounded, are core/sock.h
 * (included here, shared with the protocol). Wire fields are encoded with core/le.h
 * (included here).
 */
#ifndef KVW_TRANSPORT_TL_UTIL_H
#define KVW_TRANSPORT_TL_UTIL_H

#include "core/le.h"
#include "core/rand.h"
#include "core/sock.h"
#include "transport/transport.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

/* The effective timeout of an instance, in ns: params->timeout_ms, or the default. The
 * socket transports use it as the stall window of every blocking step (core/sock.h). */
static inline uint64_t kvw__tl_timeout_ns(const kvw_tl_params_t *params)
{
    return KVW_MS_NS(params->timeout_ms ? params->timeout_ms : KVW_TL_DEFAULT_TIMEOUT_MS);
}

/* Sets O_NONBLOCK; returns 0 or -1 with errno set. */
int kvw__tl_set_nonblock(int fd);

/* A wake-up channel for a receive thread (an eventfd). */
int kvw__tl_wake_open(void);
void kvw__tl_wake(int wake_fd);
void kvw__tl_wake_drain(int wake_fd);

#endif
