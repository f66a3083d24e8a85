/*
 * The one random source of kvwire: handshake challenges, transport instance tokens and
 * the shm region secrets that gate handing out memory files. It fails closed: when the
 * kernel gives no random bytes (getrandom missing or denied, e.g. by a seccomp filter),
 * the caller gets an error and must not go on; there is no clock- or pid-based
 * fallback, since a guessable secret is worse than a refused operation. Before the
 * kernel's pool is first seeded (early boot) it waits for it.
 *
 * Header only, so that transport modules (libkvwire-ucx.so), which link none of the
 * core, use this same code.
 */
#ifndef KVW_CORE_RAND_H
#define KVW_CORE_RAND_H

#include "core/core.h"

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/random.h>
#include <sys/types.h>

/* Fills buf[0..n) from the kernel's random source. KVW_OK, or KVW_ERR_IO with the
 * reason (buf then holds no usable bytes). */
static inline kvw_status_t kvw__random_bytes(void *buf, size_t n)
{
    uint8_t *p = buf;
    while (n > 0) {
        ssize_t k = getrandom(p, n, 0);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            if (k == 0)
                errno = EIO;
            return kvw__error(KVW_ERR_IO, "no random bytes from the kernel (getrandom: %m)");
        }
        p += k;
        n -= (size_t)k;
    }
    return KVW_OK;
}

#endif
