/* CPU executor: copies a plan between host buffers with memcpy, chunk by chunk. */
#include "plan/rank.h"
#include "plan/walk.h"

#include <string.h>

kvw_status_t kvw_plan_exec_cpu(kvw_plan_h plan)
{
    if (plan == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_plan_exec_cpu: NULL plan");
    for (uint32_t i = 0; i < plan->num_segs; i++) {
        const kvw_seg_t *s = &plan->segs[i];
        const kvw_buffer_desc_t *sb = &plan->src->bufs[s->src_buf];
        const kvw_buffer_desc_t *db = &plan->dst->bufs[s->dst_buf];
        if (sb->mem_kind != KVW_MEM_HOST || db->mem_kind != KVW_MEM_HOST || !sb->addr ||
            !db->addr)
            return kvw__error(KVW_ERR_UNSUPPORTED,
                              "the CPU executor needs host buffers with addresses (source "
                              "buffer %u, destination buffer %u)", s->src_buf, s->dst_buf);
    }
    for (uint32_t i = 0; i < plan->num_segs; i++) {
        const kvw_seg_t *s = &plan->segs[i];
        const kvw_page_map_t *sm = &plan->src_maps[s->pool], *dm = &plan->dst_maps[s->pool];
        const uint8_t *src = plan->src->bufs[s->src_buf].addr;
        uint8_t *dst = plan->dst->bufs[s->dst_buf].addr;
        uint64_t t = s->tok_begin;
        kvw_box_t b;
        uint64_t last_L = 0;
        while (t < s->tok_end) {
            uint64_t L = kvw__run_len(s, sm, dm, t);
            if (L != last_L) {
                kvw__box_make(s, L, &b);
                last_L = L;
            }
            const uint8_t *sp = src + kvw__view_offset(&s->src, sm, t, s->src_head);
            uint8_t *dp = dst + kvw__view_offset(&s->dst, dm, t, s->dst_head);
            for (uint64_t o = 0; o < b.outer_n; o++) {
                const uint8_t *so = sp + o * b.os_s;
                uint8_t *d = dp + o * b.os_d;
                for (uint64_t j = 0; j < b.inner_n; j++)
                    memcpy(d + j * b.is_d, so + j * b.is_s, b.chunk);
            }
            t += L;
        }
    }
    return KVW_OK;
}
