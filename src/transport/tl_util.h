/*
 * Helpers shared by the socket-based transports (tcp, shm): socket I/O loops in which
 * every wait is bounded. Wire fields are encoded with core/le.h (included here).
 */
#ifndef KVW_TRANSPORT_TL_UTIL_H
#define KVW_TRANSPORT_TL_UTIL_H

#include "core/le.h"
#include "core/rand.h"
#include "transport/transport.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

/* The effective timeout of an instance: params->timeout_ms, or the default. */
static inline uint32_t kvw__tl_timeout_ms(const kvw_tl_params_t *params)
{
    return params->timeout_ms ? params->timeout_ms : KVW_TL_DEFAULT_TIMEOUT_MS;
}

/* Waits until `fd` reports one of `events` (or an error/hang-up, which the caller then
 * discovers by using the socket). Returns TIMEOUT after timeout_ms without any event;
 * `what` names the step in the message. */
kvw_status_t kvw__tl_wait_fd(int fd, short events, uint32_t timeout_ms, const char *what);

/*
 * After a non-blocking socket call failed (errno set): true when the caller should try
 * again, after EINTR, or after EAGAIN once fd reported `events` within timeout_ms. Else
 * false, with *st_p the wait's error (TIMEOUT, IO), or KVW_OK and errno untouched for
 * any other failure, which the caller reports itself.
 */
bool kvw__tl_retry(int fd, short events, uint32_t timeout_ms, const char *what,
                   kvw_status_t *st_p);

/*
 * Sends every byte of iov[0..iovcnt) on a non-blocking socket (MSG_NOSIGNAL), waiting
 * for room when the socket is full. Consumes (modifies) iov. Gives up with TIMEOUT when
 * the socket stays full for timeout_ms. Errors: CONN_CLOSED (peer gone), IO, TIMEOUT.
 * iovcnt may exceed IOV_MAX; the loop splits it.
 */
kvw_status_t kvw__tl_send_iov(int fd, struct iovec *iov, size_t iovcnt, uint32_t timeout_ms,
                              const char *what);

/* Receives exactly len bytes from a non-blocking stream socket within timeout_ms of
 * inactivity. Errors: CONN_CLOSED (EOF), IO, TIMEOUT. */
kvw_status_t kvw__tl_recv_exact(int fd, void *buf, size_t len, uint32_t timeout_ms,
                                const char *what);

/* Sets O_NONBLOCK; returns 0 or -1 with errno set. */
int kvw__tl_set_nonblock(int fd);

/* A wake-up channel for a receive thread (an eventfd). */
int kvw__tl_wake_open(void);
void kvw__tl_wake(int wake_fd);
void kvw__tl_wake_drain(int wake_fd);

#endif
