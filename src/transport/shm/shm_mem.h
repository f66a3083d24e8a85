/* Internal side of include/kvwire/mem.h: which memory file backs a range. */
#ifndef KVW_TRANSPORT_SHM_MEM_H
#define KVW_TRANSPORT_SHM_MEM_H

#include "core/core.h"

/*
 * When [addr, addr + len) lies inside one kvw_mem_alloc_shared allocation, returns
 * true with a new descriptor of its memory file in *fd_p (the caller closes it) and the
 * offset of addr inside that file in *off_p. Returns false otherwise (also when the
 * descriptor cannot be duplicated).
 */
bool kvw__shm_mem_lookup(const void *addr, uint64_t len, int *fd_p, uint64_t *off_p);

#endif
