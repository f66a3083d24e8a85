#ifndef KVW_PLAN_WALK_H
#define KVW_PLAN_WALK_H

#include "plan/plan.h"

/* One token run of a segment as outer_n x inner_n chunks of `chunk` bytes. */
typedef struct kvw_box {
    uint64_t chunk;
    uint64_t outer_n, inner_n;
    uint64_t os_s, os_d; /* outer strides, source and destination */
    uint64_t is_s, is_d; /* inner strides */
} kvw_box_t;

void kvw__box_make(const kvw_seg_t *s, uint64_t run_tokens, kvw_box_t *box);

/* Tokens from t that stay inside one page on both sides and inside the segment. */
static inline uint64_t kvw__run_len(const kvw_seg_t *s, const kvw_page_map_t *sm,
                                    const kvw_page_map_t *dm, uint64_t t)
{
    uint64_t rs = s->src.page_size - (t - sm->first_token) % s->src.page_size;
    uint64_t rd = s->dst.page_size - (t - dm->first_token) % s->dst.page_size;
    uint64_t r = s->tok_end - t;
    return KVW_MIN(r, KVW_MIN(rs, rd));
}

#endif
