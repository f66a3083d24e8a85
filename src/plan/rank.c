/*
 * Rank descriptions: validation of the model, the parallel configuration and every
 * buffer's geometry, done once when a rank is described so that plans and handshakes
 * can trust it.
 */
#include "core/mask.h"
#include "cuda/module.h"
#include "plan/rank.h"
#include "topo/topo.h"

#include <stdio.h>
#include <string.h>

static const char *kvw_role_name(kvw_role_t r)
{
    static const char *names[] = {"K", "V", "KV", "latent", "state", "K scale", "V scale"};
    return (unsigned)r < KVW_ARRAY_SIZE(names) ? names[r] : "unknown";
}

static const char *kvw_kind_name(kvw_layer_kind_t k)
{
    static const char *names[] = {"none", "full attention", "sliding window", "MLA", "state"};
    return (unsigned)k < KVW_ARRAY_SIZE(names) ? names[k] : "unknown";
}

kvw_status_t kvw__model_compare(const kvw_model_t *a, const kvw_model_t *b)
{
#define KVW_CMP(field, what)                                                             \
    if (a->field != b->field)                                                            \
        return kvw__error(KVW_ERR_INCOMPATIBLE, "model mismatch: %s is %u on the source, %u " \
                          "on the destination", what, (unsigned)a->field, (unsigned)b->field);
    KVW_CMP(num_layers, "layer count");
    KVW_CMP(num_kv_heads, "KV head count");
    KVW_CMP(k_head_dim, "K head dim");
    KVW_CMP(v_head_dim, "V head dim");
    KVW_CMP(mla_dim, "MLA latent dim");
    KVW_CMP(elem_size, "element size (dtype)");
    KVW_CMP(scale_block, "scale block size");
    KVW_CMP(scale_elem_size, "scale element size");
#undef KVW_CMP
    for (uint32_t l = 0; l < a->num_layers; l++) {
        if (a->layers[l].kind != b->layers[l].kind)
            return kvw__error(KVW_ERR_INCOMPATIBLE,
                              "model mismatch: layer %u is %s on the source, %s on the "
                              "destination", l, kvw_kind_name(a->layers[l].kind),
                              kvw_kind_name(b->layers[l].kind));
        if (a->layers[l].kind == KVW_LAYER_SWA && a->layers[l].window != b->layers[l].window)
            return kvw__error(KVW_ERR_INCOMPATIBLE,
                              "model mismatch: layer %u window is %u on the source, %u on "
                              "the destination", l, a->layers[l].window, b->layers[l].window);
    }
    return KVW_OK;
}

static kvw_status_t kvw_model_validate(const kvw_model_t *m)
{
    if (m->num_layers == 0 || m->layers == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "model has no layers");
    if (m->elem_size == 0)
        return kvw__error(KVW_ERR_INVALID_PARAM, "model element size is 0");
    if (m->num_kv_heads > 65536 || m->num_layers > 100000)
        return kvw__error(KVW_ERR_INVALID_PARAM, "%u KV heads / %u layers: above kvwire's limits "
                          "(65536 / 100000)", m->num_kv_heads, m->num_layers);
    bool attn = false, mla = false;
    for (uint32_t l = 0; l < m->num_layers; l++) {
        kvw_layer_kind_t k = m->layers[l].kind;
        if ((unsigned)k > KVW_LAYER_STATE)
            return kvw__error(KVW_ERR_INVALID_PARAM, "layer %u has unknown kind %d", l, (int)k);
        if (k == KVW_LAYER_SWA && m->layers[l].window == 0)
            return kvw__error(KVW_ERR_INVALID_PARAM, "sliding-window layer %u has window 0", l);
        attn |= k == KVW_LAYER_FULL || k == KVW_LAYER_SWA;
        mla |= k == KVW_LAYER_MLA;
    }
    if (attn && (m->num_kv_heads == 0 || m->k_head_dim == 0 || m->v_head_dim == 0))
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "attention layers need KV heads and head dims (heads %u, K dim %u, "
                          "V dim %u)", m->num_kv_heads, m->k_head_dim, m->v_head_dim);
    if (mla && m->mla_dim == 0)
        return kvw__error(KVW_ERR_INVALID_PARAM, "MLA layers need mla_dim > 0");
    if (m->scale_block) {
        if (m->scale_elem_size == 0 || m->k_head_dim % m->scale_block ||
            m->v_head_dim % m->scale_block)
            return kvw__error(KVW_ERR_UNSUPPORTED,
                              "block scales of %u elements do not divide head dims %u/%u (or "
                              "scale element size is 0)", m->scale_block, m->k_head_dim,
                              m->v_head_dim);
    }
    return KVW_OK;
}

/* Bytes per head per token the model implies for a paged role. */
static uint64_t kvw_expected_head_bytes(const kvw_model_t *m, kvw_role_t role, bool v_part)
{
    switch (role) {
    case KVW_ROLE_K: return (uint64_t)m->k_head_dim * m->elem_size;
    case KVW_ROLE_V: return (uint64_t)m->v_head_dim * m->elem_size;
    case KVW_ROLE_KV: return (uint64_t)(v_part ? m->v_head_dim : m->k_head_dim) * m->elem_size;
    case KVW_ROLE_LATENT: return (uint64_t)m->mla_dim * m->elem_size;
    case KVW_ROLE_K_SCALE:
        return m->scale_block ? (uint64_t)m->k_head_dim / m->scale_block * m->scale_elem_size : 0;
    case KVW_ROLE_V_SCALE:
        return m->scale_block ? (uint64_t)m->v_head_dim / m->scale_block * m->scale_elem_size : 0;
    default: return 0;
    }
}

static bool kvw_role_fits_kind(kvw_role_t role, kvw_layer_kind_t kind)
{
    switch (kind) {
    case KVW_LAYER_FULL:
    case KVW_LAYER_SWA:
        return role == KVW_ROLE_K || role == KVW_ROLE_V || role == KVW_ROLE_KV ||
               role == KVW_ROLE_K_SCALE || role == KVW_ROLE_V_SCALE;
    case KVW_LAYER_MLA: return role == KVW_ROLE_LATENT;
    case KVW_LAYER_STATE: return role == KVW_ROLE_STATE;
    default: return false;
    }
}

static kvw_pool_t kvw_kind_pool(kvw_layer_kind_t kind)
{
    return kind == KVW_LAYER_SWA ? KVW_POOL_SWA
                                 : kind == KVW_LAYER_STATE ? KVW_POOL_STATE : KVW_POOL_FULL;
}

static void kvw_paged_view(kvw_view_t *v, kvw_layout_t layout, uint32_t page_size, uint32_t heads,
                           uint32_t hb, uint64_t plane_off, uint64_t page_stride)
{
    v->plane_off = plane_off;
    v->page_stride = page_stride;
    v->page_size = page_size;
    if (layout == KVW_LAYOUT_NHD) {
        v->token_stride = (uint64_t)heads * hb;
        v->head_stride = hb;
    } else {
        v->token_stride = hb;
        v->head_stride = (uint64_t)page_size * hb;
    }
}

static int kvw_view_cmp(const void *pa, const void *pb)
{
    const kvw_comp_view_t *a = pa, *b = pb;
    if (a->layer != b->layer)
        return a->layer < b->layer ? -1 : 1;
    if (a->comp != b->comp)
        return a->comp < b->comp ? -1 : 1;
    if (a->state_index != b->state_index)
        return a->state_index < b->state_index ? -1 : 1;
    return 0;
}

/*
 * Bytes of one state slot of buffer i on this rank: each group's share of units (heads)
 * times its bytes per unit. Refuses a group whose units do not split over the rank's TP
 * size, naming the buffer, layer and group.
 */
static kvw_status_t kvw_state_slot(const struct kvw_rank *r, uint32_t i, uint64_t *slot_p)
{
    const kvw_buffer_desc_t *b = &r->bufs[i];
    if (b->num_groups == 0 || b->num_groups > KVW_MAX_STATE_GROUPS)
        return kvw__error(KVW_ERR_INVALID_PARAM, "state buffer %u: %u groups (1..%d)", i,
                          b->num_groups, KVW_MAX_STATE_GROUPS);
    uint64_t slot = 0;
    for (uint32_t g = 0; g < b->num_groups; g++) {
        uint32_t first, count, heads = b->groups[g].total_heads;
        if (heads == 0 || heads > 65536)
            return kvw__error(KVW_ERR_INVALID_PARAM, "state buffer %u group %u: %u units "
                              "(1..65536)", i, g, heads);
        if (b->groups[g].head_bytes == 0)
            return kvw__error(KVW_ERR_INVALID_PARAM, "state buffer %u group %u: 0 bytes per unit",
                              i, g);
        if (heads % r->par.tp_size != 0 && r->par.tp_size % heads != 0)
            return kvw__error(KVW_ERR_INCOMPATIBLE,
                              "state group %u of buffer %u (layer %u): %u heads cannot be split "
                              "over TP %u (need heads %% TP == 0 or TP %% heads == 0)", g, i,
                              b->layer, heads, r->par.tp_size);
        kvw_topo_heads(r->par.tp_size, r->par.tp_rank, heads, &first, &count);
        slot += (uint64_t)count * b->groups[g].head_bytes;
        if (slot > (1ull << 48))
            return kvw__error(KVW_ERR_INVALID_PARAM, "state buffer %u: a slot of more than "
                              "2^48 bytes", i);
    }
    *slot_p = slot;
    return KVW_OK;
}

/* Validates buffer i and appends its component views. */
static kvw_status_t kvw_rank_add_buffer(struct kvw_rank *r, uint32_t i, uint32_t *state_count)
{
    const kvw_buffer_desc_t *b = &r->bufs[i];
    const kvw_model_t *m = &r->model;
    if (b->layout == KVW_LAYOUT_VECTORIZED_5D)
        return kvw__error(KVW_ERR_UNSUPPORTED,
                          "buffer %u (layer %u %s): the vectorized 5-D layout cannot be "
                          "addressed by head slices; use NHD or HND", i, b->layer,
                          kvw_role_name(b->role));
    if (b->layout != KVW_LAYOUT_NHD && b->layout != KVW_LAYOUT_HND)
        return kvw__error(KVW_ERR_UNSUPPORTED, "buffer %u: unknown layout %d", i, (int)b->layout);
    if (b->layer >= m->num_layers)
        return kvw__error(KVW_ERR_OUT_OF_RANGE, "buffer %u: layer %u outside the model's %u layers",
                          i, b->layer, m->num_layers);
    if (b->layer < r->par.layer_begin || b->layer >= r->par.layer_end)
        return kvw__error(KVW_ERR_OUT_OF_RANGE,
                          "buffer %u: layer %u outside this PP stage's layers [%u, %u)", i,
                          b->layer, r->par.layer_begin, r->par.layer_end);
    kvw_layer_kind_t kind = m->layers[b->layer].kind;
    if (!kvw_role_fits_kind(b->role, kind))
        return kvw__error(KVW_ERR_INCOMPATIBLE, "buffer %u: a %s buffer on %s layer %u", i,
                          kvw_role_name(b->role), kvw_kind_name(kind), b->layer);
    if ((b->role == KVW_ROLE_K_SCALE || b->role == KVW_ROLE_V_SCALE) && m->scale_block == 0)
        return kvw__error(KVW_ERR_INCOMPATIBLE, "buffer %u: a %s buffer, but the model has no "
                          "block scales", i, kvw_role_name(b->role));
    if (b->pool != kvw_kind_pool(kind))
        return kvw__error(KVW_ERR_INCOMPATIBLE,
                          "buffer %u: layer %u (%s) belongs to pool %d, not pool %d", i, b->layer,
                          kvw_kind_name(kind), (int)kvw_kind_pool(kind), (int)b->pool);
    /* A state buffer's groups are checked before its length: a caller that sizes the
     * buffer from this rank's share of each group gets length 0 where a group does not
     * split over TP, and the refusal that helps is the split, not the length. */
    uint64_t slot = 0;
    if (b->role == KVW_ROLE_STATE) {
        kvw_status_t st = kvw_state_slot(r, i, &slot);
        if (st != KVW_OK)
            return st;
    }
    if (b->length == 0)
        return kvw__error(KVW_ERR_INVALID_PARAM, "buffer %u (layer %u %s) has length 0", i,
                          b->layer, kvw_role_name(b->role));

    kvw_comp_view_t *v = &r->views[r->num_views];
    memset(v, 0, sizeof(*v));
    v->buf = i;
    v->layer = b->layer;
    v->pool = b->pool;

    if (b->role == KVW_ROLE_STATE) {
        if (b->length % slot)
            return kvw__error(KVW_ERR_INVALID_PARAM,
                              "state buffer %u (layer %u): length %llu is not a multiple of its "
                              "slot size %llu", i, b->layer, (unsigned long long)b->length,
                              (unsigned long long)slot);
        v->comp = KVW_COMP_STATE;
        v->state_index = state_count[b->layer]++;
        v->view = (kvw_view_t){.plane_off = 0, .page_stride = slot, .token_stride = 0,
                               .head_stride = 0, .page_size = 1};
        v->capacity = b->length / slot;
        r->num_views++;
    } else {
        uint32_t heads_expected = 1;
        if (b->role != KVW_ROLE_LATENT) {
            uint32_t first;
            kvw_status_t st = kvw_topo_heads(r->par.tp_size, r->par.tp_rank, m->num_kv_heads,
                                             &first, &heads_expected);
            if (st != KVW_OK)
                return st;
        }
        if (b->num_heads != heads_expected)
            return kvw__error(KVW_ERR_INCOMPATIBLE,
                              "buffer %u (layer %u %s): holds %u heads, but rank %u of TP %u "
                              "owns %u of the model's %u", i, b->layer, kvw_role_name(b->role),
                              b->num_heads, r->par.tp_rank, r->par.tp_size, heads_expected,
                              b->role == KVW_ROLE_LATENT ? 1 : m->num_kv_heads);
        uint64_t hb = kvw_expected_head_bytes(m, b->role, false);
        uint64_t vhb = b->role == KVW_ROLE_KV ? kvw_expected_head_bytes(m, b->role, true) : 0;
        if (b->head_bytes != hb || (b->role == KVW_ROLE_KV && b->v_head_bytes != vhb))
            return kvw__error(KVW_ERR_INCOMPATIBLE,
                              "buffer %u (layer %u %s): %u bytes per head per token, the model "
                              "implies %llu", i, b->layer, kvw_role_name(b->role),
                              b->head_bytes, (unsigned long long)hb);
        if (b->page_size == 0)
            return kvw__error(KVW_ERR_INVALID_PARAM, "buffer %u: page size 0", i);
        if (r->pool_page_size[b->pool] && r->pool_page_size[b->pool] != b->page_size)
            return kvw__error(KVW_ERR_INCOMPATIBLE,
                              "buffer %u: page size %u differs from %u used by the pool's other "
                              "buffers", i, b->page_size, r->pool_page_size[b->pool]);
        r->pool_page_size[b->pool] = b->page_size;
        uint64_t page_stride;
        if (hb == 0 || !kvw__mul_u64((uint64_t)b->page_size * b->num_heads, hb + vhb, &page_stride) ||
            page_stride > (1ull << 48))
            return kvw__error(KVW_ERR_INVALID_PARAM,
                              "buffer %u (layer %u %s): page size %u x %u heads x %llu bytes is "
                              "not a usable page size", i, b->layer, kvw_role_name(b->role),
                              b->page_size, b->num_heads, (unsigned long long)(hb + vhb));
        if (b->length % page_stride)
            return kvw__error(KVW_ERR_INVALID_PARAM,
                              "buffer %u (layer %u %s): length %llu is not a whole number of "
                              "%llu-byte pages", i, b->layer, kvw_role_name(b->role),
                              (unsigned long long)b->length, (unsigned long long)page_stride);
        v->num_heads = b->num_heads;
        v->capacity = b->length / page_stride;
        v->head_bytes = (uint32_t)hb;
        v->comp = b->role == KVW_ROLE_V         ? KVW_COMP_V
                  : b->role == KVW_ROLE_LATENT  ? KVW_COMP_LATENT
                  : b->role == KVW_ROLE_K_SCALE ? KVW_COMP_K_SCALE
                  : b->role == KVW_ROLE_V_SCALE ? KVW_COMP_V_SCALE
                                                : KVW_COMP_K;
        kvw_paged_view(&v->view, b->layout, b->page_size, b->num_heads, (uint32_t)hb, 0,
                       page_stride);
        r->num_views++;
        if (b->role == KVW_ROLE_KV) {
            kvw_comp_view_t *vv = &r->views[r->num_views++];
            *vv = *v;
            vv->comp = KVW_COMP_V;
            vv->head_bytes = (uint32_t)vhb;
            kvw_paged_view(&vv->view, b->layout, b->page_size, b->num_heads, (uint32_t)vhb,
                           (uint64_t)b->page_size * b->num_heads * hb, page_stride);
        }
    }
    return KVW_OK;
}

/* Every layer this rank holds has exactly the components its kind needs. */
static kvw_status_t kvw_rank_check_layers(struct kvw_rank *r)
{
    const kvw_model_t *m = &r->model;
    for (uint32_t l = r->par.layer_begin; l < r->par.layer_end; l++) {
        uint32_t have[KVW_COMP_V_SCALE + 1] = {0};
        for (uint32_t i = r->layer_view_begin[l]; i < r->layer_view_begin[l + 1]; i++)
            have[r->views[i].comp]++;
        kvw_layer_kind_t kind = m->layers[l].kind;
        for (int c = 0; c <= KVW_COMP_V_SCALE; c++)
            if (have[c] > 1 && c != KVW_COMP_STATE)
                return kvw__error(KVW_ERR_INVALID_PARAM, "layer %u has %u buffers for the same "
                                  "role (component %d)", l, have[c], c);
        if (kind == KVW_LAYER_FULL || kind == KVW_LAYER_SWA) {
            if (!have[KVW_COMP_K] || !have[KVW_COMP_V])
                return kvw__error(KVW_ERR_INVALID_PARAM, "%s layer %u lacks its %s buffer",
                                  kvw_kind_name(kind), l, have[KVW_COMP_K] ? "V" : "K");
            if (m->scale_block && (!have[KVW_COMP_K_SCALE] || !have[KVW_COMP_V_SCALE]))
                return kvw__error(KVW_ERR_INVALID_PARAM,
                                  "layer %u lacks its block-scale buffers (the model has scales "
                                  "every %u elements)", l, m->scale_block);
        } else if (kind == KVW_LAYER_MLA && !have[KVW_COMP_LATENT]) {
            return kvw__error(KVW_ERR_INVALID_PARAM, "MLA layer %u lacks its latent buffer", l);
        } else if (kind == KVW_LAYER_STATE && !have[KVW_COMP_STATE]) {
            return kvw__error(KVW_ERR_INVALID_PARAM, "state layer %u lacks a state buffer", l);
        }
    }
    return KVW_OK;
}

static kvw_status_t kvw_rank_create_norm(const kvw_rank_params_t *params, kvw_rank_h *rank_p)
{
    const uint64_t need = KVW_RANK_FIELD_MODEL | KVW_RANK_FIELD_PARALLEL | KVW_RANK_FIELD_BUFFERS;
    kvw_status_t st;
    if (params == NULL || rank_p == NULL || (params->field_mask & need) != need ||
        params->model == NULL || (params->num_buffers && params->buffers == NULL))
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "rank params need a model, a parallel config and a buffer table");
    st = kvw_model_validate(params->model);
    if (st != KVW_OK)
        return st;
    const kvw_parallel_t *p = &params->parallel;
    if (p->tp_size > 65536 || p->pp_size > 65536 || p->dp_size > 65536)
        return kvw__error(KVW_ERR_INVALID_PARAM, "TP %u / PP %u / DP %u: sizes above 65536 are "
                          "not supported", p->tp_size, p->pp_size, p->dp_size);
    if (p->tp_size == 0 || p->tp_rank >= p->tp_size)
        return kvw__error(KVW_ERR_INVALID_PARAM, "TP rank %u outside TP size %u", p->tp_rank,
                          p->tp_size);
    if ((p->pp_size && p->pp_rank >= p->pp_size) || (p->dp_size && p->dp_rank >= p->dp_size))
        return kvw__error(KVW_ERR_INVALID_PARAM, "PP rank %u / size %u or DP rank %u / size %u "
                          "out of range", p->pp_rank, p->pp_size, p->dp_rank, p->dp_size);
    if (p->layer_begin >= p->layer_end || p->layer_end > params->model->num_layers)
        return kvw__error(KVW_ERR_INVALID_PARAM, "layer range [%u, %u) is empty or exceeds the "
                          "model's %u layers", p->layer_begin, p->layer_end,
                          params->model->num_layers);

    struct kvw_rank *r = calloc(1, sizeof(*r));
    uint32_t *state_count = NULL;
    if (r == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory describing a rank");
    r->model = *params->model;
    r->par = *p;
    r->num_bufs = params->num_buffers;
    r->layers = malloc(sizeof(*r->layers) * r->model.num_layers);
    r->bufs = malloc(sizeof(*r->bufs) * (r->num_bufs ? r->num_bufs : 1));
    r->views = malloc(sizeof(*r->views) * 2 * (r->num_bufs ? r->num_bufs : 1));
    r->layer_view_begin = calloc(r->model.num_layers + 1, sizeof(uint32_t));
    state_count = calloc(r->model.num_layers, sizeof(uint32_t));
    if (!r->layers || !r->bufs || !r->views || !r->layer_view_begin || !state_count) {
        st = kvw__error(KVW_ERR_NO_MEMORY, "out of memory describing a rank");
        goto err_free;
    }
    memcpy(r->layers, params->model->layers, sizeof(*r->layers) * r->model.num_layers);
    r->model.layers = r->layers;
    if (r->num_bufs)
        memcpy(r->bufs, params->buffers, sizeof(*r->bufs) * r->num_bufs);
    if (r->model.num_kv_heads) {
        bool attn = false;
        for (uint32_t l = p->layer_begin; l < p->layer_end; l++)
            attn |= r->layers[l].kind == KVW_LAYER_FULL || r->layers[l].kind == KVW_LAYER_SWA;
        if (attn) {
            uint32_t first;
            st = kvw_topo_heads(p->tp_size, p->tp_rank, r->model.num_kv_heads, &first,
                                &r->attn_heads);
            if (st != KVW_OK)
                goto err_free;
        }
    }
    for (uint32_t i = 0; i < r->num_bufs; i++) {
        st = kvw_rank_add_buffer(r, i, state_count);
        if (st != KVW_OK)
            goto err_free;
    }
    qsort(r->views, r->num_views, sizeof(*r->views), kvw_view_cmp);
    for (uint32_t i = 0; i < r->num_views; i++)
        r->layer_view_begin[r->views[i].layer + 1]++;
    for (uint32_t l = 0; l < r->model.num_layers; l++)
        r->layer_view_begin[l + 1] += r->layer_view_begin[l];
    for (int pool = 0; pool < KVW_NUM_POOLS; pool++)
        r->pool_capacity[pool] = UINT64_MAX;
    for (uint32_t i = 0; i < r->num_views; i++)
        r->pool_capacity[r->views[i].pool] =
            KVW_MIN(r->pool_capacity[r->views[i].pool], r->views[i].capacity);
    for (int pool = 0; pool < KVW_NUM_POOLS; pool++)
        if (r->pool_capacity[pool] == UINT64_MAX)
            r->pool_capacity[pool] = 0;
    st = kvw_rank_check_layers(r);
    if (st != KVW_OK)
        goto err_free;
    free(state_count);
    *rank_p = r;
    return KVW_OK;

err_free:
    free(state_count);
    kvw_rank_destroy(r);
    return st;
}

/* Field masks: the caller's model, layers, parallel config and buffers, checked and
 * copied with every default filled in (the copies have every bit set). */
static kvw_status_t kvw_model_norm(const kvw_model_t *in, kvw_model_t *out)
{
    kvw_status_t st = kvw__mask_check(&kvw__spec_model, in->field_mask, "params->model");
    if (st != KVW_OK)
        return st;
    uint64_t m = in->field_mask;
    *out = (kvw_model_t){
        .field_mask = KVW_MODEL_FIELDS_ALL,
        .num_layers = in->num_layers,
        .layers = in->layers,
        .num_kv_heads = (m & KVW_MODEL_FIELD_NUM_KV_HEADS) ? in->num_kv_heads : 0,
        .k_head_dim = (m & KVW_MODEL_FIELD_K_HEAD_DIM) ? in->k_head_dim : 0,
        .v_head_dim = (m & KVW_MODEL_FIELD_V_HEAD_DIM) ? in->v_head_dim : 0,
        .mla_dim = (m & KVW_MODEL_FIELD_MLA_DIM) ? in->mla_dim : 0,
        .elem_size = in->elem_size,
        .scale_block = (m & KVW_MODEL_FIELD_SCALE_BLOCK) ? in->scale_block : 0,
        .scale_elem_size = (m & KVW_MODEL_FIELD_SCALE_ELEM_SIZE) ? in->scale_elem_size : 0};
    return KVW_OK;
}

static kvw_status_t kvw_layer_norm(const kvw_layer_desc_t *in, uint32_t l, kvw_layer_desc_t *out)
{
    char where[64];
    snprintf(where, sizeof(where), "params->model->layers[%u]", l);
    kvw_status_t st = kvw__mask_check(&kvw__spec_layer, in->field_mask, where);
    if (st != KVW_OK)
        return st;
    if (in->kind == KVW_LAYER_SWA && !(in->field_mask & KVW_LAYER_FIELD_WINDOW))
        return kvw__error(KVW_ERR_INVALID_PARAM, "%s: kvw_layer_desc_t: a sliding-window layer "
                          "requires field window (bit 0x%x), not set in field_mask 0x%llx",
                          where, KVW_LAYER_FIELD_WINDOW, (unsigned long long)in->field_mask);
    *out = (kvw_layer_desc_t){
        .field_mask = KVW_LAYER_FIELDS_ALL,
        .kind = in->kind,
        .window = (in->field_mask & KVW_LAYER_FIELD_WINDOW) ? in->window : 0};
    return KVW_OK;
}

static kvw_status_t kvw_parallel_norm(const kvw_parallel_t *in, uint32_t num_layers,
                                      kvw_parallel_t *out)
{
    kvw_status_t st = kvw__mask_check(&kvw__spec_parallel, in->field_mask, "params->parallel");
    if (st != KVW_OK)
        return st;
    uint64_t m = in->field_mask;
    *out = (kvw_parallel_t){
        .field_mask = KVW_PARALLEL_FIELDS_ALL,
        .tp_size = (m & KVW_PARALLEL_FIELD_TP_SIZE) ? in->tp_size : 1,
        .tp_rank = (m & KVW_PARALLEL_FIELD_TP_RANK) ? in->tp_rank : 0,
        .pp_size = (m & KVW_PARALLEL_FIELD_PP_SIZE) ? in->pp_size : 1,
        .pp_rank = (m & KVW_PARALLEL_FIELD_PP_RANK) ? in->pp_rank : 0,
        .layer_begin = (m & KVW_PARALLEL_FIELD_LAYER_BEGIN) ? in->layer_begin : 0,
        .layer_end = (m & KVW_PARALLEL_FIELD_LAYER_END) ? in->layer_end : num_layers,
        .dp_size = (m & KVW_PARALLEL_FIELD_DP_SIZE) ? in->dp_size : 1,
        .dp_rank = (m & KVW_PARALLEL_FIELD_DP_RANK) ? in->dp_rank : 0};
    return KVW_OK;
}

static kvw_status_t kvw_buffer_norm(const kvw_buffer_desc_t *in, uint32_t i,
                                    kvw_buffer_desc_t *out)
{
    char where[80];
    snprintf(where, sizeof(where), "params->buffers[%u]", i);
    kvw_status_t st = kvw__mask_check(&kvw__spec_buffer, in->field_mask, where);
    if (st != KVW_OK)
        return st;
    uint64_t m = in->field_mask;
    kvw_buffer_desc_t b = {
        .field_mask = KVW_BUFFER_FIELDS_ALL,
        .pool = (m & KVW_BUFFER_FIELD_POOL) ? in->pool : KVW_POOL_FULL,
        .layer = in->layer,
        .role = in->role,
        .layout = (m & KVW_BUFFER_FIELD_LAYOUT) ? in->layout : KVW_LAYOUT_NHD,
        .page_size = (m & KVW_BUFFER_FIELD_PAGE_SIZE) ? in->page_size : 0,
        .num_heads = (m & KVW_BUFFER_FIELD_NUM_HEADS) ? in->num_heads : 0,
        .head_bytes = (m & KVW_BUFFER_FIELD_HEAD_BYTES) ? in->head_bytes : 0,
        .v_head_bytes = (m & KVW_BUFFER_FIELD_V_HEAD_BYTES) ? in->v_head_bytes : 0,
        .addr = (m & KVW_BUFFER_FIELD_ADDR) ? in->addr : NULL,
        .length = in->length,
        .mem_kind = (m & KVW_BUFFER_FIELD_MEM_KIND) ? in->mem_kind : KVW_MEM_HOST,
        .device = (m & KVW_BUFFER_FIELD_DEVICE) ? in->device : 0};
    if (m & KVW_BUFFER_FIELD_GROUPS) {
        if (in->num_groups > KVW_MAX_STATE_GROUPS)
            return kvw__error(KVW_ERR_INVALID_PARAM, "%s: %u state groups, at most %u", where,
                              in->num_groups, KVW_MAX_STATE_GROUPS);
        b.num_groups = in->num_groups;
        for (uint32_t g = 0; g < in->num_groups; g++) {
            char gw[112];
            snprintf(gw, sizeof(gw), "%s.groups[%u]", where, g);
            if ((st = kvw__mask_check(&kvw__spec_state_group, in->groups[g].field_mask, gw)) !=
                KVW_OK)
                return st;
            b.groups[g] = (kvw_state_group_t){.field_mask = KVW_STATE_GROUP_FIELDS_ALL,
                                              .total_heads = in->groups[g].total_heads,
                                              .head_bytes = in->groups[g].head_bytes};
        }
    }
    *out = b;
    return KVW_OK;
}

static const char *kvw_pool_name(kvw_pool_t p)
{
    static const char *names[] = {"full", "SWA", "state"};
    return (unsigned)p < KVW_ARRAY_SIZE(names) ? names[p] : "unknown";
}

static const char *kvw_ptr_kind_name(int kind)
{
    switch (kind) {
    case KVWC_PTR_HOST: return "host memory (not registered with CUDA)";
    case KVWC_PTR_HOST_REGISTERED: return "page-locked host memory (registered with CUDA)";
    case KVWC_PTR_DEVICE: return "CUDA device memory";
    case KVWC_PTR_MANAGED: return "CUDA managed memory";
    default: return "memory of unknown kind";
    }
}

/*
 * Whether each buffer's address is the memory its description declares, asked of the
 * CUDA module (the pointer is never dereferenced). Device memory must be declared
 * KVW_MEM_CUDA on its own device ordinal; host memory, page-locked or not, KVW_MEM_HOST;
 * managed memory is accessible both ways and passes either (on its device when declared
 * KVW_MEM_CUDA). Without the module or a CUDA driver nothing can be asked, and the
 * buffers are taken as declared (a KVW_MEM_CUDA rank is then refused where its bytes
 * would move, kvw_ctx_create or the CUDA executor). Buffers without an address are not
 * checked.
 */
static kvw_status_t kvw_rank_check_mem(const struct kvw_rank *r)
{
    for (uint32_t i = 0; i < r->num_bufs; i++) {
        const kvw_buffer_desc_t *b = &r->bufs[i];
        if (b->addr == NULL)
            continue;
        int kind = KVWC_PTR_HOST, dev = -1;
        if (kvw__cuda_pointer_kind(b->addr, &kind, &dev) != KVW_OK)
            return KVW_OK; /* nothing to ask: no module or no driver (see above) */
        bool cuda = b->mem_kind == KVW_MEM_CUDA;
        bool on_dev = kind == KVWC_PTR_DEVICE || kind == KVWC_PTR_MANAGED;
        bool ok = cuda ? on_dev && dev == b->device : kind != KVWC_PTR_DEVICE;
        if (ok)
            continue;
        char declared[48], actual[96];
        if (cuda)
            snprintf(declared, sizeof(declared), "KVW_MEM_CUDA on device %d", (int)b->device);
        else
            snprintf(declared, sizeof(declared), "KVW_MEM_HOST");
        if (on_dev)
            snprintf(actual, sizeof(actual), "%s of device %d", kvw_ptr_kind_name(kind), dev);
        else
            snprintf(actual, sizeof(actual), "%s", kvw_ptr_kind_name(kind));
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "buffer %u (layer %u %s, %s pool) is declared %s, but its address %p "
                          "is %s", i, b->layer, kvw_role_name(b->role), kvw_pool_name(b->pool),
                          declared, b->addr, actual);
    }
    return KVW_OK;
}

kvw_status_t kvw__rank_create_mapped(const kvw_rank_params_t *params, kvw_rank_h *rank_p)
{
    return kvw__rank_create_as(params, false, rank_p);
}

kvw_status_t kvw_rank_create(const kvw_rank_params_t *params, kvw_rank_h *rank_p)
{
    return kvw__rank_create_as(params, true, rank_p);
}

kvw_status_t kvw__rank_create_as(const kvw_rank_params_t *params, bool check_mem,
                                 kvw_rank_h *rank_p)
{
    if (params == NULL || rank_p == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_rank_create: NULL argument");
    kvw_status_t st = kvw__mask_check(&kvw__spec_rank_params, params->field_mask, "params");
    if (st != KVW_OK)
        return st;
    if (params->model == NULL || (params->num_buffers && params->buffers == NULL))
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "rank params need a model, a parallel config and a buffer table");
    kvw_model_t model;
    if ((st = kvw_model_norm(params->model, &model)) != KVW_OK)
        return st;
    if (model.num_layers == 0 || model.layers == NULL || model.num_layers > 100000)
        return kvw_model_validate(&model); /* refused there, naming the count */
    kvw_rank_params_t np = {.field_mask = KVW_RANK_FIELDS_ALL, .model = &model,
                            .num_buffers = params->num_buffers};
    kvw_layer_desc_t *layers = malloc(sizeof(*layers) * model.num_layers);
    kvw_buffer_desc_t *bufs = malloc(sizeof(*bufs) * (np.num_buffers ? np.num_buffers : 1));
    if (layers == NULL || bufs == NULL) {
        st = kvw__error(KVW_ERR_NO_MEMORY, "out of memory describing a rank");
        goto out;
    }
    for (uint32_t l = 0; l < model.num_layers; l++)
        if ((st = kvw_layer_norm(&params->model->layers[l], l, &layers[l])) != KVW_OK)
            goto out;
    model.layers = layers;
    if ((st = kvw_parallel_norm(&params->parallel, model.num_layers, &np.parallel)) != KVW_OK)
        goto out;
    for (uint32_t i = 0; i < np.num_buffers; i++)
        if ((st = kvw_buffer_norm(&params->buffers[i], i, &bufs[i])) != KVW_OK)
            goto out;
    np.buffers = bufs;
    st = kvw_rank_create_norm(&np, rank_p);
    if (st == KVW_OK && check_mem && (st = kvw_rank_check_mem(*rank_p)) != KVW_OK) {
        kvw_rank_destroy(*rank_p);
        *rank_p = NULL;
    }
out:
    free(layers);
    free(bufs);
    return st;
}

void kvw_rank_destroy(kvw_rank_h r)
{
    if (r == NULL)
        return;
    free(r->layers);
    free(r->bufs);
    free(r->views);
    free(r->layer_view_begin);
    free(r);
}

const kvw_model_t *kvw_rank_model(kvw_rank_h r) { return &r->model; }
const kvw_parallel_t *kvw_rank_parallel(kvw_rank_h r) { return &r->par; }
uint32_t kvw_rank_num_buffers(kvw_rank_h r) { return r->num_bufs; }
const kvw_buffer_desc_t *kvw_rank_buffer(kvw_rank_h r, uint32_t i)
{
    return i < r->num_bufs ? &r->bufs[i] : NULL;
}

/* The view of `src` matching dst view `dv` (same layer, component, state index). */
const kvw_comp_view_t *kvw__rank_find_view(kvw_rank_h src, const kvw_comp_view_t *dv)
{
    for (uint32_t i = src->layer_view_begin[dv->layer]; i < src->layer_view_begin[dv->layer + 1];
         i++) {
        const kvw_comp_view_t *sv = &src->views[i];
        if (sv->comp == dv->comp && sv->state_index == dv->state_index)
            return sv;
    }
    return NULL;
}

kvw_status_t kvw_rank_check_compatible(kvw_rank_h src, kvw_rank_h dst)
{
    if (src == NULL || dst == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "NULL rank");
    kvw_status_t st = kvw__model_compare(&src->model, &dst->model);
    if (st != KVW_OK)
        return st;
    uint32_t lb = KVW_MAX(src->par.layer_begin, dst->par.layer_begin);
    uint32_t le = KVW_MIN(src->par.layer_end, dst->par.layer_end);
    for (uint32_t l = lb; l < le; l++) {
        uint32_t ns = src->layer_view_begin[l + 1] - src->layer_view_begin[l];
        uint32_t nd = dst->layer_view_begin[l + 1] - dst->layer_view_begin[l];
        if (ns != nd)
            return kvw__error(KVW_ERR_INCOMPATIBLE, "layer %u has %u buffer components on the "
                              "source and %u on the destination", l, ns, nd);
        for (uint32_t i = dst->layer_view_begin[l]; i < dst->layer_view_begin[l + 1]; i++) {
            const kvw_comp_view_t *dv = &dst->views[i];
            const kvw_comp_view_t *sv = kvw__rank_find_view(src, dv);
            if (sv == NULL)
                return kvw__error(KVW_ERR_INCOMPATIBLE, "layer %u: the destination's component "
                                  "%d has no source counterpart", l, (int)dv->comp);
            if (dv->comp != KVW_COMP_STATE)
                continue;
            const kvw_buffer_desc_t *sb = &src->bufs[sv->buf], *db = &dst->bufs[dv->buf];
            if (sb->num_groups != db->num_groups)
                return kvw__error(KVW_ERR_INCOMPATIBLE, "layer %u state %u: %u groups on the "
                                  "source, %u on the destination", l, dv->state_index,
                                  sb->num_groups, db->num_groups);
            for (uint32_t g = 0; g < sb->num_groups; g++)
                if (sb->groups[g].total_heads != db->groups[g].total_heads ||
                    sb->groups[g].head_bytes != db->groups[g].head_bytes)
                    return kvw__error(KVW_ERR_INCOMPATIBLE,
                                      "layer %u state %u group %u: %u units of %u bytes on the "
                                      "source, %u units of %u bytes on the destination", l,
                                      dv->state_index, g, sb->groups[g].total_heads,
                                      sb->groups[g].head_bytes, db->groups[g].total_heads,
                                      db->groups[g].head_bytes);
        }
    }
    return KVW_OK;
}
