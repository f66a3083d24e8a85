/* Helpers shared by the transports; see tl_util.h. */
#include "transport/tl_util.h"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <unistd.h>

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
