/* Socket helpers shared by the tcp and shm transports; see tl_util.h. */
#include "transport/tl_util.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

kvw_status_t kvw__tl_wait_fd(int fd, short events, uint32_t timeout_ms, const char *what)
{
    uint64_t deadline = kvw__now_ns() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        uint64_t now = kvw__now_ns();
        if (now >= deadline)
            return kvw__error(KVW_ERR_TIMEOUT, "%s: no progress on fd %d within %u ms", what,
                              fd, timeout_ms);
        int ms = (int)KVW_MIN((deadline - now + 999999ull) / 1000000ull, (uint64_t)INT_MAX);
        struct pollfd pfd = {.fd = fd, .events = events};
        int r = poll(&pfd, 1, ms);
        if (r > 0)
            return KVW_OK;
        if (r < 0 && errno != EINTR)
            return kvw__error(KVW_ERR_IO, "%s: poll(fd %d): %m", what, fd);
    }
}

bool kvw__tl_retry(int fd, short events, uint32_t timeout_ms, const char *what,
                   kvw_status_t *st_p)
{
    *st_p = KVW_OK;
    if (errno == EINTR)
        return true;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
        return false;
    *st_p = kvw__tl_wait_fd(fd, events, timeout_ms, what);
    return *st_p == KVW_OK;
}

static kvw_status_t send_errno_status(int err, int fd, const char *what)
{
    errno = err;
    if (err == EPIPE || err == ECONNRESET || err == ENOTCONN || err == ESHUTDOWN)
        return kvw__error(KVW_ERR_CONN_CLOSED, "%s: peer closed the connection (fd %d): %m",
                          what, fd);
    return kvw__error(KVW_ERR_IO, "%s: send on fd %d: %m", what, fd);
}

kvw_status_t kvw__tl_send_iov(int fd, struct iovec *iov, size_t iovcnt, uint32_t timeout_ms,
                              const char *what)
{
    size_t i = 0;
    while (i < iovcnt && iov[i].iov_len == 0)
        i++;
    while (i < iovcnt) {
        struct msghdr msg = {.msg_iov = iov + i,
                             .msg_iovlen = KVW_MIN(iovcnt - i, (size_t)IOV_MAX)};
        ssize_t r = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (r < 0) {
            kvw_status_t st;
            if (kvw__tl_retry(fd, POLLOUT, timeout_ms, what, &st))
                continue;
            return st != KVW_OK ? st : send_errno_status(errno, fd, what);
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

kvw_status_t kvw__tl_recv_exact(int fd, void *buf, size_t len, uint32_t timeout_ms,
                                const char *what)
{
    size_t got = 0;
    while (got < len) {
        ssize_t r = recv(fd, (char *)buf + got, len - got, 0);
        if (r > 0) {
            got += (size_t)r;
            continue;
        }
        if (r == 0)
            return kvw__error(KVW_ERR_CONN_CLOSED,
                              "%s: peer closed the connection after %zu of %zu bytes", what,
                              got, len);
        kvw_status_t st;
        if (kvw__tl_retry(fd, POLLIN, timeout_ms, what, &st))
            continue;
        if (st != KVW_OK)
            return st;
        if (errno == ECONNRESET)
            return kvw__error(KVW_ERR_CONN_CLOSED, "%s: connection reset: %m", what);
        return kvw__error(KVW_ERR_IO, "%s: recv on fd %d: %m", what, fd);
    }
    return KVW_OK;
}

int kvw__tl_set_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0)
        return -1;
    return fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

int kvw__tl_wake_open(void)
{
    return eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
}

void kvw__tl_wake(int wake_fd)
{
    uint64_t one = 1;
    /* A full counter already means "wake up"; nothing else can fail usefully here. */
    ssize_t r = write(wake_fd, &one, sizeof(one));
    (void)r;
}

void kvw__tl_wake_drain(int wake_fd)
{
    uint64_t v;
    ssize_t r = read(wake_fd, &v, sizeof(v));
    (void)r;
}
