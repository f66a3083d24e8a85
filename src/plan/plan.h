/*
 * Compact plan representation, shared by the CPU executor, the transports' run
 * expansion and the CUDA kernels. A plan is a list of segments plus one token->page map
 * per pool and side; its size grows with layers x routes and with pages, never with
 * tokens.
 *
 * Addressing: the byte offset, inside a buffer, of head h (local to the buffer) of
 * absolute token t is
 *
 *     i   = (t - map.first_token) / view.page_size      (index into the page list)
 *     off = map.pages[i] * view.page_stride + view.plane_off
 *         + ((t - map.first_token) % view.page_size) * view.token_stride
 *         + h * view.head_stride
 *
 * NHD: token_stride = heads * head_bytes, head_stride = head_bytes.
 * HND: head_stride = page_size * head_bytes, token_stride = head_bytes.
 * State slots are "pages" of one token: page_size 1, pages = [slot], plane_off = the
 * group's offset inside the slot.
 */
#ifndef KVW_PLAN_PLAN_H
#define KVW_PLAN_PLAN_H

#include "core/core.h"

typedef struct kvw_view {
    uint64_t plane_off;    /* offset of this plane (K or V part, state group) in a page */
    uint64_t page_stride;  /* bytes per page or slot */
    uint64_t token_stride; /* bytes between consecutive tokens of one head */
    uint64_t head_stride;  /* bytes between consecutive heads of one token */
    uint32_t page_size;    /* tokens per page (1 for state slots) */
} kvw_view_t;

/* Which page map a segment uses; state segments use KVW_POOL_STATE. */
typedef struct kvw_page_map {
    const uint32_t *pages; /* owned by the plan */
    uint32_t num_pages;
    uint64_t first_token;
} kvw_page_map_t;

typedef struct kvw_seg {
    uint32_t src_buf, dst_buf; /* indices into each rank's buffer table */
    uint32_t pool;             /* kvw_pool_t: selects maps[pool] on both sides */
    uint32_t head_bytes;       /* bytes of one head of one token */
    uint32_t num_heads;        /* heads copied */
    uint32_t src_head, dst_head; /* first head, local to each buffer */
    uint64_t tok_begin, tok_end; /* absolute token range [begin, end) */
    uint32_t layer;              /* global model layer; segments come in layer order */
    kvw_view_t src, dst;
} kvw_seg_t;

struct kvw_plan {
    kvw_rank_h src, dst;
    uint32_t num_segs;
    kvw_seg_t *segs;
    kvw_page_map_t src_maps[KVW_NUM_POOLS];
    kvw_page_map_t dst_maps[KVW_NUM_POOLS];
    uint32_t *page_storage; /* backs every map's pages */
    uint32_t num_routes;
    uint64_t bytes;
    uint64_t alloc_bytes;
};

/*
 * A plan for a staged stream, with the pages of one side only (sp or dp NULL): the
 * staging stream's order depends on the two ranks' geometry alone, never on page
 * indices, so the decode side scatters with its own pages and the far side's map holds
 * no pages (only where they begin). Such a plan can gather from, or scatter to, the side
 * with pages, nothing else. Errors as kvw_plan_create.
 */
kvw_status_t kvw__plan_create_staged(kvw_rank_h src, kvw_rank_h dst, const kvw_chunk_t *chunk,
                                     const kvw_side_pages_t *sp, const kvw_side_pages_t *dp,
                                     kvw_plan_h *plan_p);

/* Bytes a segment moves (what kvw__seg_walk emits for it, in total). */
static inline uint64_t kvw__seg_bytes(const kvw_seg_t *s)
{
    return (s->tok_end - s->tok_begin) * s->num_heads * s->head_bytes;
}

/*
 * Keeps only the segments of layers [layer_begin, layer_begin + n) whose `keep` entry
 * is non-zero (layer streaming: a step moves the layers marked ready since the last
 * one) and recounts the plan's bytes. Page maps are left as they are.
 */
void kvw__plan_keep_layers(struct kvw_plan *plan, const uint8_t *keep, uint32_t layer_begin,
                           uint32_t n);

/* Byte offset of (token t, local head h) for one side of a segment. */
static inline uint64_t kvw__view_offset(const kvw_view_t *v, const kvw_page_map_t *m, uint64_t t,
                                        uint64_t h)
{
    uint64_t rel = t - m->first_token;
    uint64_t page = m->pages[rel / v->page_size];
    return page * v->page_stride + v->plane_off + (rel % v->page_size) * v->token_stride +
           h * v->head_stride;
}

/*
 * Walks one segment as maximal runs: calls emit(arg, src_off, dst_off, len) for each
 * contiguous copy, choosing the loop order that makes runs longest. `raw` (optional)
 * accumulates elementary (token, head) slice counts.
 */
typedef kvw_status_t (*kvw_emit_fn)(void *arg, const kvw_seg_t *seg, uint64_t src_off,
                                    uint64_t dst_off, uint64_t len);
kvw_status_t kvw__seg_walk(const struct kvw_plan *plan, const kvw_seg_t *seg, kvw_emit_fn emit,
                           void *arg);

#endif
