#ifndef KVW_TOPO_TOPO_H
#define KVW_TOPO_TOPO_H

#include "core/core.h"

/* INCOMPATIBLE (with both numbers in the message) unless H % T == 0 or T % H == 0. */
kvw_status_t kvw__topo_check(uint32_t tp_size, uint32_t num_heads, const char *what);

/* The routes into one destination rank only (what a rank pair's plan needs), in the
 * order kvw_topo_routes gives them. */
kvw_status_t kvw__topo_routes_to(uint32_t src_tp, uint32_t dst_tp, uint32_t num_heads,
                                 uint32_t dst_rank, kvw_route_t *routes, size_t capacity,
                                 size_t *count_p);

#endif
