#ifndef KVW_TOPO_TOPO_H
#define KVW_TOPO_TOPO_H

#include "core/core.h"

/* INCOMPATIBLE (with both numbers in the message) unless H % T == 0 or T % H == 0. */
kvw_status_t kvw__topo_check(uint32_t tp_size, uint32_t num_heads, const char *what);

#endif
