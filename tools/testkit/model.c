/*
 * Model presets. The numbers are the KV-cache shapes of the public model configs, as
 * a serving engine would see them (KV heads before any TP split, head dims in elements):
 *
 *   gpt-oss-120b   36 layers alternating SWA (window 128) and full attention, layer 0
 *                  sliding; 8 KV heads; K and V head dim 64; bf16 (2 bytes).
 *   gpt-oss-20b    24 layers, same alternation, window, heads and dims.
 *   llama-3.1-70b  80 full-attention layers; 8 KV heads; head dim 128; bf16.
 *   deepseek-v3    61 MLA layers; one latent row of 576 elements (kv_lora_rank 512 +
 *                  rope dim 64), replicated on every TP rank; bf16. num_kv_heads is 1;
 *                  k/v head dims are 0 because MLA caches no per-head K or V.
 *   qwen3-next     48 layers: every 4th layer (3, 7, ..., 47) full attention with 2 KV
 *                  heads of dim 256 (bf16); the other 36 are Gated DeltaNet (STATE)
 *                  layers with two state tensors per slot:
 *                    conv state  [q | k | v] with conv kernel 4, so 3 cached positions:
 *                                q: 16 heads x (128 dims x 3 x 2 bytes) = 768 B/head,
 *                                k: 16 heads x 768 B, v: 32 heads x 768 B;
 *                    ssm state   32 value heads x (128 x 128 x 4 bytes, fp32) = 64 KiB/head.
 *                  Each group is sharded over TP with the KV-head ownership rule.
 */
#include "testkit.h"

#include <stdio.h>
#include <string.h>

static const char *const kvt_names[] = {"gpt-oss-120b", "gpt-oss-20b", "llama-3.1-70b",
                                        "deepseek-v3", "qwen3-next", NULL};

const char *const *kvt_model_names(void)
{
    return kvt_names;
}

/* Also sets every field-mask bit: the kit fills every field of the model and its
 * layers. */
void kvt_model_relink(kvt_model_t *model)
{
    model->m.field_mask = KVW_MODEL_FIELDS_ALL;
    model->m.layers = model->layers;
    for (uint32_t l = 0; l < model->m.num_layers && l < KVT_MAX_LAYERS; l++)
        model->layers[l].field_mask = KVW_LAYER_FIELDS_ALL;
}

static void kvt_gpt_oss(kvt_model_t *model, uint32_t num_layers)
{
    model->m.num_layers = num_layers;
    for (uint32_t i = 0; i < num_layers; i++) {
        /* gpt-oss alternates, starting with a sliding-window layer. */
        model->layers[i].kind = (i % 2 == 0) ? KVW_LAYER_SWA : KVW_LAYER_FULL;
        model->layers[i].window = (i % 2 == 0) ? 128 : 0;
    }
    model->m.num_kv_heads = 8;
    model->m.k_head_dim = 64;
    model->m.v_head_dim = 64;
    model->m.elem_size = 2;
}

int kvt_model_preset(const char *name, kvt_model_t *model_p)
{
    kvt_model_t model;
    memset(&model, 0, sizeof(model));
    if (!name)
        return -1;
    snprintf(model.name, sizeof(model.name), "%s", name);

    if (!strcmp(name, "gpt-oss-120b")) {
        kvt_gpt_oss(&model, 36);
    } else if (!strcmp(name, "gpt-oss-20b")) {
        kvt_gpt_oss(&model, 24);
    } else if (!strcmp(name, "llama-3.1-70b")) {
        model.m.num_layers = 80;
        for (uint32_t i = 0; i < 80; i++)
            model.layers[i].kind = KVW_LAYER_FULL;
        model.m.num_kv_heads = 8;
        model.m.k_head_dim = 128;
        model.m.v_head_dim = 128;
        model.m.elem_size = 2;
    } else if (!strcmp(name, "deepseek-v3")) {
        model.m.num_layers = 61;
        for (uint32_t i = 0; i < 61; i++)
            model.layers[i].kind = KVW_LAYER_MLA;
        model.m.num_kv_heads = 1;
        model.m.mla_dim = 512 + 64;
        model.m.elem_size = 2;
    } else if (!strcmp(name, "qwen3-next")) {
        model.m.num_layers = 48;
        for (uint32_t i = 0; i < 48; i++)
            model.layers[i].kind = (i % 4 == 3) ? KVW_LAYER_FULL : KVW_LAYER_STATE;
        model.m.num_kv_heads = 2;
        model.m.k_head_dim = 256;
        model.m.v_head_dim = 256;
        model.m.elem_size = 2;
        model.num_state_bufs = 2;
        /* Conv state: 3 cached positions (kernel 4 - 1) x 128 dims x bf16 per head. */
        model.state[0].num_groups = 3;
        model.state[0].groups[0] = (kvw_state_group_t){KVW_STATE_GROUP_FIELDS_ALL, 16, 128 * 3 * 2};
        model.state[0].groups[1] = (kvw_state_group_t){KVW_STATE_GROUP_FIELDS_ALL, 16, 128 * 3 * 2};
        model.state[0].groups[2] = (kvw_state_group_t){KVW_STATE_GROUP_FIELDS_ALL, 32, 128 * 3 * 2};
        /* Temporal (SSM) state: a 128 x 128 fp32 matrix per value head. */
        model.state[1].num_groups = 1;
        model.state[1].groups[0] = (kvw_state_group_t){KVW_STATE_GROUP_FIELDS_ALL, 32,
                                                       128 * 128 * 4};
    } else {
        return -1;
    }
    kvt_model_relink(&model);
    *model_p = model;
    kvt_model_relink(model_p);
    return 0;
}

int kvt_model_truncate(kvt_model_t *model, uint32_t num_layers)
{
    if (num_layers == 0 || num_layers > model->m.num_layers)
        return -1;
    model->m.num_layers = num_layers;
    kvt_model_relink(model);
    return 0;
}

void kvt_model_set_block_scale(kvt_model_t *model, uint32_t block, uint32_t scale_elem_size)
{
    model->m.elem_size = 1;
    model->m.scale_block = block;
    model->m.scale_elem_size = scale_elem_size;
    kvt_model_relink(model);
}

int kvt_heads_owned(uint32_t tp, uint32_t rank, uint32_t heads, uint32_t *first, uint32_t *count)
{
    if (tp == 0 || heads == 0 || rank >= tp)
        return -1;
    if (tp <= heads) {
        if (heads % tp)
            return -1;
        *first = rank * (heads / tp);
        *count = heads / tp;
    } else {
        if (tp % heads)
            return -1;
        *first = rank / (tp / heads);
        *count = 1;
    }
    return 0;
}

uint32_t kvt_source_rank(uint32_t src_tp, uint32_t dst_tp, uint32_t heads, uint32_t dst_rank,
                         uint32_t head)
{
    /* k: position of dst_rank among the destination ranks that own `head`. When the
     * destination has at most one rank per head, that is 0; otherwise the replicas of
     * head h are ranks [h * rep_D, (h + 1) * rep_D). */
    uint32_t k = dst_tp <= heads ? 0 : dst_rank - head * (dst_tp / heads);
    if (src_tp <= heads)
        return head / (heads / src_tp);
    uint32_t rep = src_tp / heads;
    return head * rep + k % rep;
}

void kvt_pp_range(uint32_t num_layers, uint32_t pp_size, const uint32_t *splits, uint32_t stage,
                  uint32_t *begin, uint32_t *end)
{
    uint32_t b = 0;
    for (uint32_t s = 0; s <= stage; s++) {
        uint32_t n;
        if (splits)
            n = splits[s];
        else
            n = num_layers / pp_size + (s < num_layers % pp_size ? 1 : 0);
        if (s == stage) {
            *begin = b;
            *end = b + n;
        }
        b += n;
    }
}

int kvt_model_load(const char *who, const char *name, uint32_t layers, kvt_model_t *model_p)
{
    if (kvt_model_preset(name, model_p)) {
        fprintf(stderr, "%s: unknown model '%s'; the presets are:", who, name);
        for (const char *const *n = kvt_model_names(); *n; n++)
            fprintf(stderr, " %s", *n);
        fprintf(stderr, "\n");
        return -1;
    }
    if (layers > model_p->m.num_layers) {
        fprintf(stderr, "%s: --layers takes a whole number from 0 to %u (the layers of %s; 0 "
                "keeps them all), not '%u'\n", who, model_p->m.num_layers, name, layers);
        return -1;
    }
    if (layers && layers < model_p->m.num_layers && kvt_model_truncate(model_p, layers)) {
        fprintf(stderr, "%s: cannot keep %u layers\n", who, layers);
        return -1;
    }
    return 0;
}
