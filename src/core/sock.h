/*
 * Socket I/O in which every wait is bounded: the one set of loops that the protocol's
 * sockets (src/proto: bootstrap, handshake, the peers' control connections) and the
 * socket transports (tcp, shm) share. One time unit: nanoseconds on the kvw__now_ns
 * clock. A wait is bounded by an absolute deadline and by a stall window: no single wait
 * for the socket lasts longer than stall_ns, so a transfer that keeps moving bytes may
 * outlast the window (the transports' rule: they bound a peer that stops, not a long
 * transfer; a window of 0 does not wait at all). KVW_SOCK_NO_DEADLINE leaves only the
 * window, KVW_SOCK_NO_STALL only the deadline (the protocol's rule).
 *
 * `what` names the step in every message; the timeout messages read "timed out WHAT"
 * (deadline) or "WHAT: no progress on fd N within M ms" (window). Statuses: TIMEOUT;
 * CONN_CLOSED when the peer is gone (EOF, reset, broken pipe, unreachable); IO for a
 * failure on this side (poll, a local send or receive error).
 */
#ifndef KVW_CORE_SOCK_H
#define KVW_CORE_SOCK_H

#include "core/core.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#define KVW_SOCK_NO_DEADLINE UINT64_MAX
#define KVW_SOCK_NO_STALL UINT64_MAX
#define KVW_MS_NS(ms) ((uint64_t)(ms) * 1000000ull)

/* Waits until `fd` reports one of `events` (or an error or hang-up, which the caller
 * discovers by using the socket): 1, or 0 once deadline_ns has passed, or -1 (errno
 * set) when poll fails. */
int kvw__sock_poll(int fd, short events, uint64_t deadline_ns);

/* kvw__sock_poll bounded by both limits, as a status: KVW_OK, TIMEOUT or IO. */
kvw_status_t kvw__sock_wait(int fd, short events, uint64_t deadline_ns, uint64_t stall_ns,
                            const char *what);

/*
 * After a non-blocking socket call failed (errno set): true when the caller should try
 * again, after EINTR, or after EAGAIN once fd reported `events` within the limits. Else
 * false, with *st_p the wait's error (TIMEOUT, IO), or KVW_OK and errno untouched for
 * any other failure, which the caller reports itself.
 */
bool kvw__sock_retry(int fd, short events, uint64_t deadline_ns, uint64_t stall_ns,
                     const char *what, kvw_status_t *st_p);

/* The status of a failed send or receive (errno `err`): CONN_CLOSED when the peer is
 * gone, else IO; the message names `what`, the call and fd. */
kvw_status_t kvw__sock_errno_status(int err, int fd, bool tx, const char *what);

/*
 * Sends every byte of iov[0..iovcnt) on a socket (MSG_NOSIGNAL | MSG_DONTWAIT), waiting
 * for room when it is full. Consumes (modifies) iov; iovcnt may exceed IOV_MAX.
 * Errors: CONN_CLOSED, IO, TIMEOUT.
 */
kvw_status_t kvw__sock_send_iov(int fd, struct iovec *iov, size_t iovcnt, uint64_t deadline_ns,
                                uint64_t stall_ns, const char *what);

/* Receives exactly len bytes (MSG_DONTWAIT). Errors: CONN_CLOSED (EOF too), IO,
 * TIMEOUT. */
kvw_status_t kvw__sock_recv_exact(int fd, void *buf, size_t len, uint64_t deadline_ns,
                                  uint64_t stall_ns, const char *what);

/* The protocol's forms: all n bytes by deadline_ns (KVW_SOCK_NO_STALL). */
kvw_status_t kvw__sock_send_all(int fd, const void *p, size_t n, uint64_t deadline_ns);
kvw_status_t kvw__sock_recv_all(int fd, void *p, size_t n, uint64_t deadline_ns);

#endif
