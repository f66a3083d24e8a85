/*
 * The naive reference transfer. It is slow on purpose: one memcpy per (token, head)
 * slice, every address computed from scratch from the buffer description, head
 * ownership and source choice re-derived from DESIGN.md section 3 (kvt_heads_owned,
 * kvt_source_rank). Nothing here calls into the library.
 */
#include "testkit.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

enum kvt_plane_kind { KVT_P_K, KVT_P_V, KVT_P_LATENT, KVT_P_KS, KVT_P_VS };

/* One addressable plane of a buffer: a K, V, latent or scale part of every page. */
typedef struct kvt_plane {
    uint32_t buf;
    const kvw_buffer_desc_t *d;
    uint64_t plane_off;  /* offset of the plane inside a page */
    uint64_t page_bytes; /* bytes of a whole page of the buffer */
    uint32_t hb;         /* bytes per head per token in this plane */
} kvt_plane_t;

static const char *const kvt_plane_names[] = {"K", "V", "latent", "K-scale", "V-scale"};

static int kvt_fail(char *msg, size_t cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (msg && cap)
        vsnprintf(msg, cap, fmt, ap);
    va_end(ap);
    return -1;
}

static int kvt_find_plane(const kvt_ref_side_t *s, uint32_t layer, int kind, kvt_plane_t *p)
{
    for (uint32_t i = 0; i < s->num_bufs; i++) {
        const kvw_buffer_desc_t *d = &s->bufs[i];
        if (d->layer != layer || d->pool == KVW_POOL_STATE)
            continue;
        uint64_t heads_ps = (uint64_t)d->page_size * d->num_heads;
        p->buf = i;
        p->d = d;
        p->plane_off = 0;
        p->page_bytes = heads_ps * d->head_bytes;
        p->hb = d->head_bytes;
        switch (kind) {
        case KVT_P_K:
            if (d->role == KVW_ROLE_K)
                return 0;
            if (d->role == KVW_ROLE_KV) {
                p->page_bytes = heads_ps * (d->head_bytes + d->v_head_bytes);
                return 0;
            }
            break;
        case KVT_P_V:
            if (d->role == KVW_ROLE_V)
                return 0;
            if (d->role == KVW_ROLE_KV) {
                p->page_bytes = heads_ps * (d->head_bytes + d->v_head_bytes);
                p->plane_off = heads_ps * d->head_bytes;
                p->hb = d->v_head_bytes;
                return 0;
            }
            break;
        case KVT_P_LATENT:
            if (d->role == KVW_ROLE_LATENT)
                return 0;
            break;
        case KVT_P_KS:
            if (d->role == KVW_ROLE_K_SCALE)
                return 0;
            break;
        case KVT_P_VS:
            if (d->role == KVW_ROLE_V_SCALE)
                return 0;
            break;
        }
    }
    return -1;
}

/* The `ordinal`-th state buffer of `layer`, or -1. */
static int kvt_find_state(const kvt_ref_side_t *s, uint32_t layer, uint32_t ordinal)
{
    uint32_t seen = 0;
    for (uint32_t i = 0; i < s->num_bufs; i++)
        if (s->bufs[i].layer == layer && s->bufs[i].pool == KVW_POOL_STATE &&
            seen++ == ordinal)
            return (int)i;
    return -1;
}

/* Byte offset of (token t, local head h) of a plane, through the side's page list. */
static int kvt_paged_off(const kvt_plane_t *p, const kvw_pages_t *pg, uint64_t t, uint32_t h,
                         uint64_t *off_p, char *msg, size_t cap)
{
    const kvw_buffer_desc_t *d = p->d;
    if (t < pg->first_token)
        return kvt_fail(msg, cap, "token %llu is before the page list's first token %llu",
                        (unsigned long long)t, (unsigned long long)pg->first_token);
    uint64_t rel = t - pg->first_token;
    uint64_t idx = rel / d->page_size, in = rel % d->page_size;
    if (idx >= pg->num_pages)
        return kvt_fail(msg, cap, "token %llu needs page list entry %llu of %u",
                        (unsigned long long)t, (unsigned long long)idx, pg->num_pages);
    uint64_t off = (uint64_t)pg->pages[idx] * p->page_bytes + p->plane_off;
    if (d->layout == KVW_LAYOUT_HND)
        off += (uint64_t)h * d->page_size * p->hb + in * p->hb;
    else
        off += in * d->num_heads * p->hb + (uint64_t)h * p->hb;
    if (off + p->hb > d->length)
        return kvt_fail(msg, cap, "page %u lies outside buffer (layer %u, %llu bytes)",
                        pg->pages[idx], d->layer, (unsigned long long)d->length);
    *off_p = off;
    return 0;
}

/* Index of the source rank with TP rank `tp_rank` whose layer range holds `layer`. */
static int kvt_pick_src(const kvt_ref_side_t *srcs, uint32_t num_srcs, uint32_t tp_rank,
                        uint32_t layer)
{
    for (uint32_t j = 0; j < num_srcs; j++)
        if (srcs[j].par->tp_rank == tp_rank && srcs[j].par->layer_begin <= layer &&
            layer < srcs[j].par->layer_end)
            return (int)j;
    return -1;
}

static const kvw_pages_t *kvt_pool_pages(const kvw_side_pages_t *sp, kvw_pool_t pool)
{
    return pool == KVW_POOL_SWA ? &sp->swa : &sp->full;
}

static int kvt_ref_paged(const kvw_model_t *model, const kvt_ref_side_t *srcs, uint32_t num_srcs,
                         const kvt_ref_side_t *dst, uint32_t layer, int kind, uint64_t t0,
                         uint64_t t1, uint8_t *const *written, uint64_t *bytes_per_src,
                         char *msg, size_t cap)
{
    uint32_t S = srcs[0].par->tp_size, D = dst->par->tp_size, d = dst->par->tp_rank;
    uint32_t H = kind == KVT_P_LATENT ? 1 : model->num_kv_heads;
    const char *pn = kvt_plane_names[kind];
    kvt_plane_t dp, sp;
    uint32_t dfirst, dcount, sfirst, scount;

    if (kvt_find_plane(dst, layer, kind, &dp))
        return kvt_fail(msg, cap, "destination has no %s buffer for layer %u", pn, layer);
    if (kvt_heads_owned(D, d, H, &dfirst, &dcount))
        return kvt_fail(msg, cap, "destination TP %u cannot split %u heads", D, H);
    if (dp.d->num_heads != dcount)
        return kvt_fail(msg, cap, "destination layer %u %s buffer holds %u heads, rule says %u",
                        layer, pn, dp.d->num_heads, dcount);
    const kvw_pages_t *dpg = kvt_pool_pages(dst->pages, dp.d->pool);

    for (uint32_t h = dfirst; h < dfirst + dcount; h++) {
        uint32_t s_tp = kvt_source_rank(S, D, H, d, h);
        int j = kvt_pick_src(srcs, num_srcs, s_tp, layer);
        if (j < 0)
            return kvt_fail(msg, cap, "no source rank with TP rank %u holds layer %u", s_tp,
                            layer);
        const kvt_ref_side_t *src = &srcs[j];
        if (kvt_find_plane(src, layer, kind, &sp))
            return kvt_fail(msg, cap, "source has no %s buffer for layer %u", pn, layer);
        if (kvt_heads_owned(S, s_tp, H, &sfirst, &scount) || h < sfirst || h >= sfirst + scount)
            return kvt_fail(msg, cap, "source TP rank %u does not own head %u", s_tp, h);
        if (sp.d->num_heads != scount)
            return kvt_fail(msg, cap, "source layer %u %s buffer holds %u heads, rule says %u",
                            layer, pn, sp.d->num_heads, scount);
        if (sp.hb != dp.hb)
            return kvt_fail(msg, cap, "layer %u %s: head bytes differ (%u vs %u)", layer, pn,
                            sp.hb, dp.hb);
        const kvw_pages_t *spg = kvt_pool_pages(src->pages, sp.d->pool);
        for (uint64_t t = t0; t < t1; t++) {
            uint64_t so, doff;
            if (kvt_paged_off(&sp, spg, t, h - sfirst, &so, msg, cap) ||
                kvt_paged_off(&dp, dpg, t, h - dfirst, &doff, msg, cap))
                return -1;
            memcpy(dst->data[dp.buf] + doff, src->data[sp.buf] + so, dp.hb);
            if (written)
                memset(written[dp.buf] + doff, 1, dp.hb);
            if (bytes_per_src)
                bytes_per_src[j] += dp.hb;
        }
    }
    return 0;
}

/* Offset of group g inside a slot and the slot's size, for TP rank `r` of `tp`. */
static int kvt_slot_geom(const kvw_buffer_desc_t *b, uint32_t tp, uint32_t r, uint32_t g,
                         uint64_t *group_off, uint64_t *slot_bytes)
{
    uint64_t off = 0, total = 0;
    for (uint32_t i = 0; i < b->num_groups; i++) {
        uint32_t first, count;
        if (kvt_heads_owned(tp, r, b->groups[i].total_heads, &first, &count))
            return -1;
        if (i == g)
            off = total;
        total += (uint64_t)count * b->groups[i].head_bytes;
    }
    *group_off = off;
    *slot_bytes = total;
    return 0;
}

static int kvt_ref_state(const kvt_ref_side_t *srcs, uint32_t num_srcs, const kvt_ref_side_t *dst,
                         uint32_t layer, uint8_t *const *written, uint64_t *bytes_per_src,
                         char *msg, size_t cap)
{
    uint32_t S = srcs[0].par->tp_size, D = dst->par->tp_size, d = dst->par->tp_rank;
    int64_t dslot = dst->pages->state_slot;
    if (dslot < 0)
        return 0;
    for (uint32_t ord = 0;; ord++) {
        int di = kvt_find_state(dst, layer, ord);
        if (di < 0)
            break;
        const kvw_buffer_desc_t *db = &dst->bufs[di];
        for (uint32_t g = 0; g < db->num_groups; g++) {
            uint32_t G = db->groups[g].total_heads, hb = db->groups[g].head_bytes;
            uint32_t dfirst, dcount, sfirst, scount;
            uint64_t dgoff, dslot_bytes, sgoff, sslot_bytes;
            if (kvt_heads_owned(D, d, G, &dfirst, &dcount) ||
                kvt_slot_geom(db, D, d, g, &dgoff, &dslot_bytes))
                return kvt_fail(msg, cap, "destination TP %u cannot split state group of %u",
                                D, G);
            for (uint32_t u = dfirst; u < dfirst + dcount; u++) {
                uint32_t s_tp = kvt_source_rank(S, D, G, d, u);
                int j = kvt_pick_src(srcs, num_srcs, s_tp, layer);
                if (j < 0)
                    return kvt_fail(msg, cap, "no source rank with TP rank %u holds layer %u",
                                    s_tp, layer);
                const kvt_ref_side_t *src = &srcs[j];
                int si = kvt_find_state(src, layer, ord);
                if (si < 0)
                    return kvt_fail(msg, cap, "source lacks state buffer %u of layer %u", ord,
                                    layer);
                const kvw_buffer_desc_t *sb = &src->bufs[si];
                if (sb->num_groups != db->num_groups ||
                    memcmp(&sb->groups[g], &db->groups[g], sizeof(sb->groups[g])))
                    return kvt_fail(msg, cap, "state groups of layer %u differ", layer);
                if (src->pages->state_slot < 0)
                    return kvt_fail(msg, cap, "source has no state slot");
                if (kvt_heads_owned(S, s_tp, G, &sfirst, &scount) ||
                    kvt_slot_geom(sb, S, s_tp, g, &sgoff, &sslot_bytes))
                    return kvt_fail(msg, cap, "source TP %u cannot split state group", S);
                uint64_t so = (uint64_t)src->pages->state_slot * sslot_bytes + sgoff +
                              (uint64_t)(u - sfirst) * hb;
                uint64_t doff = (uint64_t)dslot * dslot_bytes + dgoff + (uint64_t)(u - dfirst) * hb;
                if (so + hb > sb->length || doff + hb > db->length)
                    return kvt_fail(msg, cap, "state slot outside buffer (layer %u)", layer);
                memcpy(dst->data[di] + doff, src->data[si] + so, hb);
                if (written)
                    memset(written[di] + doff, 1, hb);
                if (bytes_per_src)
                    bytes_per_src[j] += hb;
            }
        }
    }
    return 0;
}

int kvt_ref_transfer(const kvw_model_t *model, const kvt_ref_side_t *srcs, uint32_t num_srcs,
                     const kvt_ref_side_t *dst, const kvw_chunk_t *chunk, uint8_t *const *written,
                     uint64_t *bytes_per_src, char *msg, size_t cap)
{
    if (num_srcs == 0)
        return kvt_fail(msg, cap, "no source ranks");
    for (uint32_t j = 1; j < num_srcs; j++)
        if (srcs[j].par->tp_size != srcs[0].par->tp_size)
            return kvt_fail(msg, cap, "source ranks disagree on TP size");

    for (uint32_t l = dst->par->layer_begin; l < dst->par->layer_end; l++) {
        const kvw_layer_desc_t *ld = &model->layers[l];
        uint64_t t0 = 0, t1 = 0;
        int rc = 0;
        switch (ld->kind) {
        case KVW_LAYER_NONE:
            continue;
        case KVW_LAYER_FULL:
        case KVW_LAYER_MLA:
            /* [max(chunk_begin, prefix_len), chunk_end) */
            t0 = chunk->chunk_begin > chunk->prefix_len ? chunk->chunk_begin : chunk->prefix_len;
            t1 = chunk->chunk_end;
            break;
        case KVW_LAYER_SWA:
            if (!chunk->last_chunk)
                continue;
            /* [max(num_tokens - window, prefix_len, 0), num_tokens) */
            t0 = chunk->num_tokens > ld->window ? chunk->num_tokens - ld->window : 0;
            if (chunk->prefix_len > t0)
                t0 = chunk->prefix_len;
            t1 = chunk->num_tokens;
            break;
        case KVW_LAYER_STATE:
            if (!chunk->last_chunk)
                continue;
            rc = kvt_ref_state(srcs, num_srcs, dst, l, written, bytes_per_src, msg, cap);
            if (rc)
                return rc;
            continue;
        }
        if (t0 >= t1)
            continue;
        if (ld->kind == KVW_LAYER_MLA) {
            rc = kvt_ref_paged(model, srcs, num_srcs, dst, l, KVT_P_LATENT, t0, t1, written,
                               bytes_per_src, msg, cap);
        } else {
            rc = kvt_ref_paged(model, srcs, num_srcs, dst, l, KVT_P_K, t0, t1, written,
                               bytes_per_src, msg, cap);
            if (!rc)
                rc = kvt_ref_paged(model, srcs, num_srcs, dst, l, KVT_P_V, t0, t1, written,
                                   bytes_per_src, msg, cap);
            if (!rc && model->scale_block)
                rc = kvt_ref_paged(model, srcs, num_srcs, dst, l, KVT_P_KS, t0, t1, written,
                                   bytes_per_src, msg, cap);
            if (!rc && model->scale_block)
                rc = kvt_ref_paged(model, srcs, num_srcs, dst, l, KVT_P_VS, t0, t1, written,
                                   bytes_per_src, msg, cap);
        }
        if (rc)
            return rc;
    }
    return 0;
}

kvt_ref_side_t kvt_ref_side(const kvt_rank_t *rank, const kvw_side_pages_t *pages,
                            uint8_t *const *data)
{
    kvt_ref_side_t s;
    s.par = &rank->par;
    s.bufs = rank->bufs;
    s.num_bufs = rank->num_bufs;
    s.pages = pages;
    s.data = data;
    return s;
}
