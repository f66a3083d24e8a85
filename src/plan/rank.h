/* Validated description of one rank's KV cache (kvw_rank_h) and its views. */
#ifndef KVW_PLAN_RANK_H
#define KVW_PLAN_RANK_H

#include "plan/plan.h"

/*
 * A component is one addressable plane of a buffer: K, V, latent, state, K scale or
 * V scale. A fused KV buffer has two components (K plane, V plane) in each page.
 */
typedef enum kvw_comp {
    KVW_COMP_K,
    KVW_COMP_V,
    KVW_COMP_LATENT,
    KVW_COMP_STATE,
    KVW_COMP_K_SCALE,
    KVW_COMP_V_SCALE
} kvw_comp_t;

typedef struct kvw_comp_view {
    uint32_t buf;        /* index into the rank's buffer table */
    uint32_t layer;
    kvw_comp_t comp;
    uint32_t state_index; /* order among the layer's state buffers */
    uint32_t pool;
    uint32_t num_heads;   /* local heads (paged); unused for state */
    uint32_t head_bytes;  /* paged only */
    kvw_view_t view;      /* for state: plane_off 0, page_stride = slot bytes */
    uint64_t capacity;    /* pages (or slots) the buffer holds */
} kvw_comp_view_t;

struct kvw_rank {
    kvw_model_t model;
    kvw_layer_desc_t *layers;
    kvw_parallel_t par;
    kvw_buffer_desc_t *bufs;
    uint32_t num_bufs;
    kvw_comp_view_t *views; /* sorted by (layer, comp, state_index) */
    uint32_t num_views;
    uint32_t *layer_view_begin; /* num_layers + 1 offsets into views */
    uint32_t pool_page_size[KVW_NUM_POOLS]; /* 0 if the pool has no buffer */
    uint64_t pool_capacity[KVW_NUM_POOLS];  /* min pages over the pool's buffers */
    uint32_t attn_heads;    /* local KV heads per attention layer */
};

/* Models must match field by field; the message names the first difference. */
kvw_status_t kvw__model_compare(const kvw_model_t *a, const kvw_model_t *b);
const kvw_comp_view_t *kvw__rank_find_view(kvw_rank_h src, const kvw_comp_view_t *dv);

/* kvw_rank_create, with (check_mem) or without the check that every buffer's address is
 * the memory kind and device its description declares (asked of the CUDA module).
 * kvw__rank_create_mapped skips it: for ranks whose addresses are another process's
 * buffers mapped here by a transport, where the owner declared kind and device in its
 * own terms (its device ordinals, for one, need not be this process's). */
kvw_status_t kvw__rank_create_as(const kvw_rank_params_t *params, bool check_mem,
                                 kvw_rank_h *rank_p);
kvw_status_t kvw__rank_create_mapped(const kvw_rank_params_t *params, kvw_rank_h *rank_p);

#endif
