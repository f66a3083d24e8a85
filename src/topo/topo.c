/*
 * Head ownership and routes between two TP groups (DESIGN.md section 3).
 *
 * A rank's KV heads follow the column-parallel QKV rule: with T <= H each rank owns
 * H/T consecutive heads; with T > H, rep = T/H consecutive ranks share one head.
 * Every (destination rank, head) is written exactly once; among source replicas of a
 * head the k-th destination rank (in rank order) that needs the head reads it from
 * replica k mod rep_S, which spreads the load evenly.
 */
#include "topo/topo.h"

kvw_status_t kvw__topo_check(uint32_t tp_size, uint32_t num_heads, const char *what)
{
    if (tp_size == 0 || num_heads == 0)
        return kvw__error(KVW_ERR_INVALID_PARAM, "%s: TP size %u and head count %u must be > 0",
                          what, tp_size, num_heads);
    if (num_heads % tp_size != 0 && tp_size % num_heads != 0)
        return kvw__error(KVW_ERR_INCOMPATIBLE,
                          "%s: %u KV heads cannot be split over TP %u (need heads %% TP == 0 "
                          "or TP %% heads == 0)",
                          what, num_heads, tp_size);
    return KVW_OK;
}

kvw_status_t kvw_topo_heads(uint32_t tp_size, uint32_t rank, uint32_t num_heads,
                            uint32_t *first_p, uint32_t *count_p)
{
    kvw_status_t st = kvw__topo_check(tp_size, num_heads, "head ownership");
    if (st != KVW_OK)
        return st;
    if (rank >= tp_size)
        return kvw__error(KVW_ERR_INVALID_PARAM, "rank %u is outside TP size %u", rank, tp_size);
    if (tp_size <= num_heads) {
        uint32_t per = num_heads / tp_size;
        *first_p = rank * per;
        *count_p = per;
    } else {
        *first_p = rank / (tp_size / num_heads);
        *count_p = 1;
    }
    return KVW_OK;
}

/* The source rank that serves head h to the destination rank `d`. */
static uint32_t kvw_topo_source_of(uint32_t src_tp, uint32_t dst_tp, uint32_t num_heads,
                                   uint32_t h, uint32_t d)
{
    if (src_tp <= num_heads)
        return h / (num_heads / src_tp);
    uint32_t rep_s = src_tp / num_heads;
    /* k: index of d among the destination ranks that own head h. */
    uint32_t k = dst_tp > num_heads ? d % (dst_tp / num_heads) : 0;
    return h * rep_s + k % rep_s;
}

/* Routes into destination rank d, appended at routes[*n] (counted past capacity). */
static void kvw_topo_routes_into(uint32_t src_tp, uint32_t dst_tp, uint32_t num_heads, uint32_t d,
                                 kvw_route_t *routes, size_t capacity, size_t *n)
{
    uint32_t dfirst, dcount;
    kvw_topo_heads(dst_tp, d, num_heads, &dfirst, &dcount);
    kvw_route_t cur = {0};
    int open = 0;
    for (uint32_t i = 0; i < dcount; i++) {
        uint32_t h = dfirst + i;
        uint32_t s = kvw_topo_source_of(src_tp, dst_tp, num_heads, h, d);
        uint32_t sfirst, scount;
        kvw_topo_heads(src_tp, s, num_heads, &sfirst, &scount);
        uint32_t soff = h - sfirst;
        if (open && cur.src_rank == s && cur.src_head_start + cur.num_heads == soff) {
            cur.num_heads++;
            continue;
        }
        if (open) {
            if (*n < capacity)
                routes[*n] = cur;
            (*n)++;
        }
        cur = (kvw_route_t){.field_mask = KVW_ROUTE_FIELDS_ALL, .src_rank = s, .dst_rank = d,
                            .src_head_start = soff,
                            .dst_head_start = i, .num_heads = 1};
        open = 1;
    }
    if (open) {
        if (*n < capacity)
            routes[*n] = cur;
        (*n)++;
    }
}

kvw_status_t kvw_topo_routes(uint32_t src_tp, uint32_t dst_tp, uint32_t num_heads,
                             kvw_route_t *routes, size_t capacity, size_t *count_p)
{
    kvw_status_t st = kvw__topo_check(src_tp, num_heads, "source topology");
    if (st != KVW_OK)
        return st;
    st = kvw__topo_check(dst_tp, num_heads, "destination topology");
    if (st != KVW_OK)
        return st;
    if (routes == NULL && capacity != 0)
        return kvw__error(KVW_ERR_INVALID_PARAM, "routes is NULL with capacity %zu", capacity);

    size_t n = 0;
    for (uint32_t d = 0; d < dst_tp; d++)
        kvw_topo_routes_into(src_tp, dst_tp, num_heads, d, routes, capacity, &n);
    *count_p = n;
    if (n > capacity)
        return kvw__error(KVW_ERR_BUFFER_TOO_SMALL, "%zu routes do not fit in capacity %zu", n,
                          capacity);
    return KVW_OK;
}

kvw_status_t kvw__topo_routes_to(uint32_t src_tp, uint32_t dst_tp, uint32_t num_heads,
                                 uint32_t dst_rank, kvw_route_t *routes, size_t capacity,
                                 size_t *count_p)
{
    kvw_status_t st = kvw__topo_check(src_tp, num_heads, "source topology");
    if (st == KVW_OK)
        st = kvw__topo_check(dst_tp, num_heads, "destination topology");
    if (st != KVW_OK)
        return st;
    if (dst_rank >= dst_tp)
        return kvw__error(KVW_ERR_INVALID_PARAM, "rank %u is outside TP size %u", dst_rank, dst_tp);
    size_t n = 0;
    kvw_topo_routes_into(src_tp, dst_tp, num_heads, dst_rank, routes, capacity, &n);
    *count_p = n;
    if (n > capacity)
        return kvw__error(KVW_ERR_BUFFER_TOO_SMALL, "%zu routes do not fit in capacity %zu", n,
                          capacity);
    return KVW_OK;
}
