/*
 * Host memory that other processes on the same host can map.
 *
 * Registering memory from kvw_mem_alloc_shared with the shm transport lets a sending
 * process map the same pages and write them with plain memcpy (the fastest same-host
 * path). Any other host memory still works with shm, through process_vm_writev, which
 * is slower and needs ptrace permission over the receiving process.
 */
#ifndef KVWIRE_MEM_H
#define KVWIRE_MEM_H

#include <kvwire/kvwire.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Allocates `len` bytes (rounded up to whole pages) of zeroed, page-aligned,
 * shareable memory backed by an anonymous memory file (memfd), sealed against
 * shrinking so that a process that maps it can never fault on a truncated file. The
 * caller owns the memory and releases it with kvw_mem_free_shared. There is no separate
 * registration call: a rank's buffers (kvw_rank_create) are registered with the transport
 * by kvw_ctx_create and deregistered by kvw_ctx_destroy, so free the memory only after
 * every context whose rank has a buffer in it was destroyed (then kvw_rank_destroy the
 * rank, which only describes the memory). Freeing it earlier leaves the transport, and
 * the peers that mapped it, writing into unmapped pages. Errors: INVALID_PARAM (len 0
 * or addr_p NULL), NO_MEMORY, IO (memfd_create, ftruncate or mmap failed; the message
 * says which).
 */
KVW_API kvw_status_t kvw_mem_alloc_shared(size_t len, void **addr_p);

/* Unmaps memory from kvw_mem_alloc_shared and closes its memory file. `addr` must be
 * the address it returned; NULL and unknown addresses are ignored. Processes that
 * mapped it keep their own mapping until they unmap it. */
KVW_API void kvw_mem_free_shared(void *addr);

#ifdef __cplusplus
}
#endif

#endif
