/* Process helpers shared by the CLI, the benchmarks and the tests (see testkit.h). */
#include "testkit.h"

#include <kvwire/cuda.h>

#include <errno.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <string.h>
#include <unistd.h>

/* Moves len bytes with write(2) or read(2), EINTR retried. */
static int kvt_io_full(int fd, uint8_t *p, size_t len, int out)
{
    while (len) {
        ssize_t n = out ? write(fd, p, len) : read(fd, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n, len -= (size_t)n;
    }
    return 0;
}

int kvt_write_full(int fd, const void *buf, size_t len)
{
    return kvt_io_full(fd, (uint8_t *)(uintptr_t)buf, len, 1);
}

int kvt_read_full(int fd, void *buf, size_t len)
{
    return kvt_io_full(fd, buf, len, 0);
}

int kvt_cuda_probe(void)
{
    return kvt_cuda_probe_why(NULL, 0);
}

int kvt_cuda_probe_why(char *why, size_t cap)
{
    int fds[2] = {-1, -1};
    if (why && cap)
        why[0] = '\0';
    if (why && cap > 1 && pipe(fds) != 0)
        fds[0] = fds[1] = -1;
    pid_t probe = fork();
    if (probe == 0) {
        int ok = kvw_cuda_available() == KVW_OK;
        if (!ok && fds[1] >= 0) {
            const char *m = kvw_last_error();
            (void)kvt_write_full(fds[1], m, strlen(m));
        }
        _exit(ok ? 0 : 3);
    }
    if (fds[1] >= 0)
        close(fds[1]);
    if (fds[0] >= 0) {
        size_t got = 0;
        ssize_t n;
        while (probe > 0 && got + 1 < cap && (n = read(fds[0], why + got, cap - 1 - got)) > 0)
            got += (size_t)n;
        why[got] = '\0';
        close(fds[0]);
    }
    int ps = 0;
    if (probe < 0 || waitpid(probe, &ps, 0) != probe)
        return 0;
    return WIFEXITED(ps) && WEXITSTATUS(ps) == 0;
}
