/* Process helpers shared by the CLI, the benchmarks and the tests (see testkit.h). */
#include "testkit.h"

#include <kvwire/cuda.h>

#include <errno.h>
#include <stdlib.h>
#include <sys/wait.h>
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
    pid_t probe = fork();
    if (probe == 0)
        _exit(kvw_cuda_available() == KVW_OK ? 0 : 3);
    int ps = 0;
    if (probe < 0 || waitpid(probe, &ps, 0) != probe)
        return 0;
    return WIFEXITED(ps) && WEXITSTATUS(ps) == 0;
}
