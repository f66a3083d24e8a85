/* Bounded socket I/O shared by the protocol and the socket transports; see sock.h. */
#include "core/sock.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>

/* The longest single poll: the clock is read again at least this often. */
#define SOCK_POLL_SLICE_MS 1000u

int kvw__sock_poll(int fd, short events, uint64_t deadline_ns)
{
    for (;;) {
        uint64_t now = kvw__now_ns();
        if (now >= deadline_ns)
            return 0;
        uint64_t ms = (deadline_ns - now + 999999ull) / 1000000ull;
        struct pollfd pfd = {.fd = fd, .events = events};
        int r = poll(&pfd, 1, (int)KVW_MIN(ms, (uint64_t)SOCK_POLL_SLICE_MS));
        if (r > 0)
            return 1;
        if (r < 0 && errno != EINTR)
            return -1;
    }
}

kvw_status_t kvw__sock_wait(int fd, short events, uint64_t deadline_ns, uint64_t stall_ns,
                            const char *what)
{
    uint64_t until = deadline_ns;
    bool window = false;
    if (stall_ns != KVW_SOCK_NO_STALL) {
        uint64_t now = kvw__now_ns();
        uint64_t w = stall_ns > UINT64_MAX - now ? UINT64_MAX : now + stall_ns;
        window = w < until;
        until = KVW_MIN(until, w);
    }
    int r = kvw__sock_poll(fd, events, until);
    if (r > 0)
        return KVW_OK;
    if (r < 0)
        return kvw__error(KVW_ERR_IO, "%s: poll(fd %d): %m", what, fd);
    if (window)
        return kvw__error(KVW_ERR_TIMEOUT, "%s: no progress on fd %d within %llu ms", what, fd,
                          (unsigned long long)(stall_ns / 1000000ull));
    return kvw__error(KVW_ERR_TIMEOUT, "timed out %s", what);
}

bool kvw__sock_retry(int fd, short events, uint64_t deadline_ns, uint64_t stall_ns,
                     const char *what, kvw_status_t *st_p)
{
    *st_p = KVW_OK;
    if (errno == EINTR)
        return true;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
        return false;
    *st_p = kvw__sock_wait(fd, events, deadline_ns, stall_ns, what);
    return *st_p == KVW_OK;
}

kvw_status_t kvw__sock_errno_status(int err, int fd, bool tx, const char *what)
{
    errno = err;
    switch (err) {
    case EPIPE:
    case ECONNRESET:
    case ECONNABORTED:
    case ENOTCONN:
    case ESHUTDOWN:
    case ETIMEDOUT:
    case EHOSTUNREACH:
    case ENETUNREACH:
        return kvw__error(KVW_ERR_CONN_CLOSED, "%s: peer closed the connection (fd %d): %m",
                          what, fd);
    default:
        return kvw__error(KVW_ERR_IO, "%s: %s on fd %d: %m", what, tx ? "send" : "recv", fd);
    }
}

kvw_status_t kvw__sock_send_iov(int fd, struct iovec *iov, size_t iovcnt, uint64_t deadline_ns,
                                uint64_t stall_ns, const char *what)
{
    size_t i = 0;
    while (i < iovcnt && iov[i].iov_len == 0)
        i++;
    while (i < iovcnt) {
        struct msghdr msg = {.msg_iov = iov + i,
                             .msg_iovlen = KVW_MIN(iovcnt - i, (size_t)IOV_MAX)};
        ssize_t r = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r < 0) {
            kvw_status_t st;
            if (kvw__sock_retry(fd, POLLOUT, deadline_ns, stall_ns, what, &st))
                continue;
            return st != KVW_OK ? st : kvw__sock_errno_status(errno, fd, true, what);
        }
        size_t left = (size_t)r;
        while (i < iovcnt && left >= iov[i].iov_len) {
            left -= iov[i].iov_len;
            iov[i].iov_len = 0;
            i++;
        }
        if (left > 0) {
            iov[i].iov_base = (char *)iov[i].iov_base + left;
            iov[i].iov_len -= left;
        }
        while (i < iovcnt && iov[i].iov_len == 0)
            i++;
    }
    return KVW_OK;
}

kvw_status_t kvw__sock_recv_exact(int fd, void *buf, size_t len, uint64_t deadline_ns,
                                  uint64_t stall_ns, const char *what)
{
    size_t got = 0;
    while (got < len) {
        ssize_t r = recv(fd, (char *)buf + got, len - got, MSG_DONTWAIT);
        if (r > 0) {
            got += (size_t)r;
            continue;
        }
        if (r == 0)
            return kvw__error(KVW_ERR_CONN_CLOSED,
                              "%s: peer closed the connection after %zu of %zu bytes", what,
                              got, len);
        kvw_status_t st;
        if (kvw__sock_retry(fd, POLLIN, deadline_ns, stall_ns, what, &st))
            continue;
        return st != KVW_OK ? st : kvw__sock_errno_status(errno, fd, false, what);
    }
    return KVW_OK;
}

kvw_status_t kvw__sock_send_all(int fd, const void *p, size_t n, uint64_t deadline_ns)
{
    struct iovec iov = {.iov_base = (void *)(uintptr_t)p, .iov_len = n}; /* only read */
    return kvw__sock_send_iov(fd, &iov, 1, deadline_ns, KVW_SOCK_NO_STALL, "sending to a peer");
}

kvw_status_t kvw__sock_recv_all(int fd, void *p, size_t n, uint64_t deadline_ns)
{
    return kvw__sock_recv_exact(fd, p, n, deadline_ns, KVW_SOCK_NO_STALL,
                                "waiting for a peer's reply");
}
