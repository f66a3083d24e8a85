/* CPU executor: copies a plan between host buffers with memcpy, chunk by chunk. */
#include "exec/memops.h"
#include "plan/rank.h"
#include "plan/walk.h"

#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/*
 * Copies one chunk. Small chunks (head slices of a few hundred bytes) land in pages the
 * CPU will not read again soon; ordinary stores would first read each destination line
 * (read-for-ownership), doubling the destination's memory traffic, so 16-byte aligned
 * chunks use non-temporal stores instead. Large chunks go to memcpy, which makes the
 * same choice itself.
 */
static inline void kvw_copy_chunk(uint8_t *d, const uint8_t *s, uint64_t len)
{
#if defined(__SSE2__)
    if (len >= 64 && len < (256u << 10) && ((uintptr_t)d & 15) == 0 && (len & 15) == 0) {
        for (uint64_t i = 0; i < len; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
            _mm_stream_si128((__m128i *)(d + i), a);
            _mm_stream_si128((__m128i *)(d + i + 16), b);
            _mm_stream_si128((__m128i *)(d + i + 32), c);
            _mm_stream_si128((__m128i *)(d + i + 48), e);
        }
        if (len & 63) {
            for (uint64_t i = len & ~(uint64_t)63; i < len; i += 16)
                _mm_stream_si128((__m128i *)(d + i), _mm_loadu_si128((const __m128i *)(s + i)));
        }
        return;
    }
#endif
    memcpy(d, s, len);
}

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
        /* Page cursors on both sides, advanced incrementally: no division per run. */
        uint64_t rs = s->tok_begin - sm->first_token, rd = s->tok_begin - dm->first_token;
        uint64_t is = rs / s->src.page_size, js = rs % s->src.page_size;
        uint64_t id = rd / s->dst.page_size, jd = rd % s->dst.page_size;
        const uint64_t hs = s->src_head * s->src.head_stride + s->src.plane_off;
        const uint64_t hd = s->dst_head * s->dst.head_stride + s->dst.plane_off;
        uint64_t t = s->tok_begin;
        kvw_box_t b;
        uint64_t last_L = 0;
        while (t < s->tok_end) {
            uint64_t L = KVW_MIN(s->tok_end - t,
                                 KVW_MIN(s->src.page_size - js, s->dst.page_size - jd));
            if (L != last_L) {
                kvw__box_make(s, L, &b);
                last_L = L;
            }
            const uint8_t *sp = src + sm->pages[is] * s->src.page_stride + hs + js * s->src.token_stride;
            uint8_t *dp = dst + dm->pages[id] * s->dst.page_stride + hd + jd * s->dst.token_stride;
            if (b.outer_n == 1 && b.inner_n == 1) {
                kvw_copy_chunk(dp, sp, b.chunk);
            } else {
                for (uint64_t o = 0; o < b.outer_n; o++) {
                    const uint8_t *so = sp + o * b.os_s;
                    uint8_t *d = dp + o * b.os_d;
                    for (uint64_t j = 0; j < b.inner_n; j++)
                        kvw_copy_chunk(d + j * b.is_d, so + j * b.is_s, b.chunk);
                }
            }
            t += L;
            js += L;
            jd += L;
            if (js == s->src.page_size)
                is++, js = 0;
            if (jd == s->dst.page_size)
                id++, jd = 0;
        }
    }
#if defined(__SSE2__)
    _mm_sfence(); /* non-temporal stores are visible to other threads after this */
#endif
    return KVW_OK;
}

kvw_status_t kvw__cpu_window(const struct kvw_plan *plan, bool gather, uint8_t *buf, uint64_t lo,
                             uint64_t hi)
{
    uint64_t pos = 0;
    for (uint32_t i = 0; i < plan->num_segs && pos < hi; i++) {
        const kvw_seg_t *s = &plan->segs[i];
        uint64_t sb = kvw__seg_bytes(s);
        /* Segments wholly before the window only move the position: a window late in
         * the stream (the last layers of a streamed chunk) walks no run before it. */
        if (pos + sb <= lo) {
            pos += sb;
            continue;
        }
        const kvw_page_map_t *sm = &plan->src_maps[s->pool], *dm = &plan->dst_maps[s->pool];
        const kvw_buffer_desc_t *b = gather ? &plan->src->bufs[s->src_buf]
                                            : &plan->dst->bufs[s->dst_buf];
        const kvw_view_t *v = gather ? &s->src : &s->dst;
        const kvw_page_map_t *m = gather ? sm : dm;
        uint64_t head = gather ? s->src_head : s->dst_head;
        uint64_t row = (uint64_t)s->num_heads * s->head_bytes;
        uint8_t *base = b->addr;
        if (base == NULL)
            return kvw__error(KVW_ERR_UNSUPPORTED, "a staged %s needs the %s buffers' host "
                              "addresses (buffer %u has none)", gather ? "gather" : "scatter",
                              gather ? "source" : "destination",
                              gather ? s->src_buf : s->dst_buf);
        for (uint64_t t = s->tok_begin; t < s->tok_end && pos < hi;) {
            uint64_t L = kvw__run_len(s, sm, dm, t);
            uint64_t rb = L * row;
            if (pos + rb > lo) {
                uint64_t off = kvw__view_offset(v, m, t, head);
                kvw_box_t x;
                kvw__box_make(s, L, &x);
                uint64_t os = gather ? x.os_s : x.os_d, is = gather ? x.is_s : x.is_d;
                uint64_t p = pos;
                for (uint64_t o = 0; o < x.outer_n && p < hi; o++)
                    for (uint64_t j = 0; j < x.inner_n && p < hi; j++, p += x.chunk) {
                        uint64_t cb = KVW_MAX(p, lo), ce = KVW_MIN(p + x.chunk, hi);
                        if (cb >= ce)
                            continue;
                        uint8_t *mem = base + off + o * os + j * is + (cb - p);
                        if (gather)
                            memcpy(buf + (cb - lo), mem, ce - cb);
                        else
                            memcpy(mem, buf + (cb - lo), ce - cb);
                    }
            }
            pos += rb;
            t += L;
        }
    }
    if (pos < hi)
        return kvw__error(KVW_ERR_OUT_OF_RANGE, "staged window [%llu, %llu) ends past the plan's "
                          "%llu bytes", (unsigned long long)lo, (unsigned long long)hi,
                          (unsigned long long)pos);
    return KVW_OK;
}
