/*
 * kvw_mem_alloc_shared: memfd-backed memory and a process-wide list that remembers
 * which memory file backs which mapping, so the shm transport can hand the file to a
 * sending process.
 */
#include <kvwire/mem.h>

#include "transport/shm/shm_mem.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct shared_alloc {
    uint8_t *addr;
    size_t len;
    int fd;
    struct shared_alloc *next;
} shared_alloc_t;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static shared_alloc_t *g_allocs;

kvw_status_t kvw_mem_alloc_shared(size_t len, void **addr_p)
{
    if (len == 0 || addr_p == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_mem_alloc_shared: len %zu, addr_p %p", len,
                          (void *)addr_p);
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    if (len > SIZE_MAX - pg || len > (size_t)INT64_MAX - pg)
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_mem_alloc_shared: %zu bytes is too large",
                          len);
    size_t rlen = (len + pg - 1) / pg * pg;
    kvw_status_t st;
    shared_alloc_t *a = calloc(1, sizeof(*a));
    if (a == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "kvw_mem_alloc_shared: no memory");
    a->fd = memfd_create("kvwire-shared", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (a->fd < 0) {
        st = kvw__error(KVW_ERR_IO, "kvw_mem_alloc_shared: memfd_create: %m");
        goto err_free;
    }
    if (ftruncate(a->fd, (off_t)rlen) != 0) {
        st = kvw__error(errno == ENOSPC || errno == ENOMEM ? KVW_ERR_NO_MEMORY : KVW_ERR_IO,
                        "kvw_mem_alloc_shared: ftruncate(%zu bytes): %m", rlen);
        goto err_close_fd;
    }
    /* Mappers rely on the file never shrinking (a shrink would turn their writes into
     * SIGBUS); F_SEAL_SEAL keeps anyone from undoing that. */
    if (fcntl(a->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        st = kvw__error(KVW_ERR_IO, "kvw_mem_alloc_shared: sealing the memory file: %m");
        goto err_close_fd;
    }
    void *p = mmap(NULL, rlen, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd, 0);
    if (p == MAP_FAILED) {
        st = kvw__error(errno == ENOMEM ? KVW_ERR_NO_MEMORY : KVW_ERR_IO,
                        "kvw_mem_alloc_shared: mmap(%zu bytes): %m", rlen);
        goto err_close_fd;
    }
    /* Best effort: huge pages where shmem allows them (fewer faults and TLB misses). */
    (void)madvise(p, rlen, MADV_HUGEPAGE);
    a->addr = p;
    a->len = rlen;
    pthread_mutex_lock(&g_mu);
    a->next = g_allocs;
    g_allocs = a;
    pthread_mutex_unlock(&g_mu);
    *addr_p = p;
    return KVW_OK;

err_close_fd:
    close(a->fd);
err_free:
    free(a);
    return st;
}

void kvw_mem_free_shared(void *addr)
{
    if (addr == NULL)
        return;
    pthread_mutex_lock(&g_mu);
    shared_alloc_t **pp = &g_allocs;
    while (*pp && (*pp)->addr != addr)
        pp = &(*pp)->next;
    shared_alloc_t *a = *pp;
    if (a)
        *pp = a->next;
    pthread_mutex_unlock(&g_mu);
    if (a == NULL)
        return;
    munmap(a->addr, a->len);
    close(a->fd);
    free(a);
}

bool kvw__shm_mem_lookup(const void *addr, uint64_t len, int *fd_p, uint64_t *off_p)
{
    uintptr_t p = (uintptr_t)addr;
    bool found = false;
    pthread_mutex_lock(&g_mu);
    for (shared_alloc_t *a = g_allocs; a; a = a->next) {
        uintptr_t base = (uintptr_t)a->addr;
        if (p >= base && p - base <= a->len && len <= a->len - (p - base)) {
            int fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 0);
            if (fd >= 0) {
                *fd_p = fd;
                *off_p = (uint64_t)(p - base);
                found = true;
            }
            break;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return found;
}
