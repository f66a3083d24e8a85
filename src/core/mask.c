/* Field-mask checks shared by every entry point that takes a public struct. */
#include "core/mask.h"

#include "core/core.h"

#include <kvwire/xfer.h>

#include <stdio.h>
#include <string.h>

uint64_t kvw__mask_known(const kvw_mask_spec_t *spec)
{
    uint64_t known = 0;
    for (unsigned i = 0; i < 64 && spec->fields[i]; i++)
        known |= 1ull << i;
    return known;
}

kvw_status_t kvw__mask_check(const kvw_mask_spec_t *spec, uint64_t mask, const char *where)
{
    const char *sep = where ? ": " : "";
    where = where ? where : "";
    uint64_t unknown = mask & ~kvw__mask_known(spec);
    if (unknown)
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "%s%s%s field_mask 0x%llx has bits 0x%llx unknown to this library "
                          "(kvwire %s): a newer caller on an older library",
                          where, sep, spec->type, (unsigned long long)mask,
                          (unsigned long long)unknown, kvw_version());
    uint64_t missing = spec->required & ~mask;
    if (missing) {
        unsigned bit = (unsigned)__builtin_ctzll(missing);
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "%s%s%s: required field %s (bit 0x%llx) is not set in field_mask "
                          "0x%llx",
                          where, sep, spec->type, spec->fields[bit], 1ull << bit,
                          (unsigned long long)mask);
    }
    return KVW_OK;
}

#define KVW_SPEC(var, type, req, ...)                                                    \
    static const char *const var##_fields[] = {__VA_ARGS__, NULL};                       \
    const kvw_mask_spec_t var = {type, var##_fields, req}

KVW_SPEC(kvw__spec_layer, "kvw_layer_desc_t", KVW_LAYER_FIELD_KIND, "kind", "window");
KVW_SPEC(kvw__spec_model, "kvw_model_t",
         KVW_MODEL_FIELD_NUM_LAYERS | KVW_MODEL_FIELD_LAYERS | KVW_MODEL_FIELD_ELEM_SIZE,
         "num_layers", "layers", "num_kv_heads", "k_head_dim", "v_head_dim", "mla_dim",
         "elem_size", "scale_block", "scale_elem_size");
KVW_SPEC(kvw__spec_parallel, "kvw_parallel_t", 0, "tp_size", "tp_rank", "pp_size", "pp_rank",
         "layer_begin", "layer_end", "dp_size", "dp_rank");
KVW_SPEC(kvw__spec_state_group, "kvw_state_group_t",
         KVW_STATE_GROUP_FIELD_TOTAL_HEADS | KVW_STATE_GROUP_FIELD_HEAD_BYTES, "total_heads",
         "head_bytes");
KVW_SPEC(kvw__spec_buffer, "kvw_buffer_desc_t",
         KVW_BUFFER_FIELD_LAYER | KVW_BUFFER_FIELD_ROLE | KVW_BUFFER_FIELD_LENGTH, "pool",
         "layer", "role", "layout", "page_size", "num_heads", "head_bytes", "v_head_bytes",
         "groups", "addr", "length", "mem_kind", "device");
KVW_SPEC(kvw__spec_rank_params, "kvw_rank_params_t", KVW_RANK_FIELDS_ALL, "model", "parallel",
         "buffers");
KVW_SPEC(kvw__spec_pages, "kvw_pages_t", 0, "pages", "num_pages", "first_token");
KVW_SPEC(kvw__spec_side_pages, "kvw_side_pages_t", 0, "full", "swa", "state_slot");
KVW_SPEC(kvw__spec_chunk, "kvw_chunk_t", KVW_CHUNK_FIELD_NUM_TOKENS, "num_tokens",
         "chunk_begin", "chunk_end", "prefix_len", "last_chunk");
KVW_SPEC(kvw__spec_plan_stats, "kvw_plan_stats_t", 0, "bytes", "num_routes", "num_segments",
         "runs_raw", "runs_coalesced", "plan_bytes");
KVW_SPEC(kvw__spec_send_chunk, "kvw_send_chunk_t",
         KVW_SEND_CHUNK_FIELD_NUM_TOKENS | KVW_SEND_CHUNK_FIELD_PAGES, "num_tokens",
         "chunk_begin", "chunk_end", "last_chunk", "pages");
KVW_SPEC(kvw__spec_recv_post, "kvw_recv_post_t",
         KVW_RECV_POST_FIELD_NUM_TOKENS | KVW_RECV_POST_FIELD_PAGES, "num_tokens", "prefix_len",
         "pages");
KVW_SPEC(kvw__spec_room_metrics, "kvw_room_metrics_t", 0, "bytes", "runs", "start_ns", "end_ns",
         "path", "hop_ns");
KVW_SPEC(kvw__spec_ctx_params, "kvw_ctx_params_t", KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK,
         "side", "rank", "transport", "bootstrap_addr", "host_bootstrap", "listen_host",
         "timeouts", "secret", "prefill_size", "instance_id", "busy_poll_us");
KVW_SPEC(kvw__spec_bootstrap_params, "kvw_bootstrap_params_t", KVW_BOOTSTRAP_FIELD_ADDR, "addr",
         "secret");

kvw_status_t kvw__pages_norm(const kvw_pages_t *in, const char *where, kvw_pages_t *out)
{
    kvw_status_t st = kvw__mask_check(&kvw__spec_pages, in->field_mask, where);
    if (st != KVW_OK)
        return st;
    uint64_t m = in->field_mask;
    out->field_mask = KVW_PAGES_FIELDS_ALL;
    out->pages = (m & KVW_PAGES_FIELD_PAGES) ? in->pages : NULL;
    out->num_pages = (m & KVW_PAGES_FIELD_NUM_PAGES) ? in->num_pages : 0;
    out->first_token = (m & KVW_PAGES_FIELD_FIRST_TOKEN) ? in->first_token : 0;
    return KVW_OK;
}

kvw_status_t kvw__side_pages_norm(const kvw_side_pages_t *in, const char *where,
                                  kvw_side_pages_t *out)
{
    char sub[96];
    kvw_status_t st = kvw__mask_check(&kvw__spec_side_pages, in->field_mask, where);
    if (st != KVW_OK)
        return st;
    uint64_t m = in->field_mask;
    const kvw_pages_t none = {.field_mask = 0};
    snprintf(sub, sizeof(sub), "%s%sfull", where ? where : "", where ? "." : "");
    if ((st = kvw__pages_norm((m & KVW_SIDE_PAGES_FIELD_FULL) ? &in->full : &none, sub,
                              &out->full)) != KVW_OK)
        return st;
    snprintf(sub, sizeof(sub), "%s%sswa", where ? where : "", where ? "." : "");
    if ((st = kvw__pages_norm((m & KVW_SIDE_PAGES_FIELD_SWA) ? &in->swa : &none, sub,
                              &out->swa)) != KVW_OK)
        return st;
    out->state_slot = (m & KVW_SIDE_PAGES_FIELD_STATE_SLOT) ? in->state_slot : -1;
    out->field_mask = KVW_SIDE_PAGES_FIELDS_ALL;
    return KVW_OK;
}

kvw_status_t kvw__chunk_norm(const kvw_chunk_t *in, const char *where, kvw_chunk_t *out)
{
    kvw_status_t st = kvw__mask_check(&kvw__spec_chunk, in->field_mask, where);
    if (st != KVW_OK)
        return st;
    uint64_t m = in->field_mask;
    kvw_chunk_t c = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = in->num_tokens};
    c.chunk_begin = (m & KVW_CHUNK_FIELD_CHUNK_BEGIN) ? in->chunk_begin : 0;
    c.chunk_end = (m & KVW_CHUNK_FIELD_CHUNK_END) ? in->chunk_end : c.num_tokens;
    c.prefix_len = (m & KVW_CHUNK_FIELD_PREFIX_LEN) ? in->prefix_len : 0;
    c.last_chunk = (m & KVW_CHUNK_FIELD_LAST_CHUNK) ? in->last_chunk
                                                    : c.chunk_end == c.num_tokens;
    *out = c;
    return KVW_OK;
}

kvw_status_t kvw__send_chunk_norm(const kvw_send_chunk_t *in, const char *where,
                                  kvw_send_chunk_t *out)
{
    char sub[96];
    kvw_status_t st = kvw__mask_check(&kvw__spec_send_chunk, in->field_mask, where);
    if (st != KVW_OK)
        return st;
    uint64_t m = in->field_mask;
    kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = in->num_tokens};
    c.chunk_begin = (m & KVW_SEND_CHUNK_FIELD_CHUNK_BEGIN) ? in->chunk_begin : 0;
    c.chunk_end = (m & KVW_SEND_CHUNK_FIELD_CHUNK_END) ? in->chunk_end : c.num_tokens;
    c.last_chunk = (m & KVW_SEND_CHUNK_FIELD_LAST_CHUNK) ? in->last_chunk
                                                         : c.chunk_end == c.num_tokens;
    snprintf(sub, sizeof(sub), "%s%spages", where ? where : "", where ? "->" : "");
    if ((st = kvw__side_pages_norm(&in->pages, sub, &c.pages)) != KVW_OK)
        return st;
    *out = c;
    return KVW_OK;
}

kvw_status_t kvw__recv_post_norm(const kvw_recv_post_t *in, const char *where,
                                 kvw_recv_post_t *out)
{
    char sub[96];
    kvw_status_t st = kvw__mask_check(&kvw__spec_recv_post, in->field_mask, where);
    if (st != KVW_OK)
        return st;
    kvw_recv_post_t p = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = in->num_tokens};
    p.prefix_len = (in->field_mask & KVW_RECV_POST_FIELD_PREFIX_LEN) ? in->prefix_len : 0;
    snprintf(sub, sizeof(sub), "%s%spages", where ? where : "", where ? "->" : "");
    if ((st = kvw__side_pages_norm(&in->pages, sub, &p.pages)) != KVW_OK)
        return st;
    *out = p;
    return KVW_OK;
}
