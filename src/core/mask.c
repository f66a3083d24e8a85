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

void kvw__mask_copy(const kvw_mask_spec_t *spec, uint64_t mask, const void *src, void *dst)
{
    for (unsigned i = 0; i < 64 && spec->fields[i]; i++)
        if (mask & (1ull << i))
            memcpy((char *)dst + spec->layout[i].off, (const char *)src + spec->layout[i].off,
                   spec->layout[i].size);
}

kvw_status_t kvw__mask_query_check(const kvw_mask_spec_t *spec, const void *handle,
                                   const void *out, const char *fn)
{
    if (handle == NULL || out == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "%s: NULL argument", fn);
    return kvw__mask_check(spec, *(const uint64_t *)out, fn);
}

#define KVW_SPEC(var, type, req, ...)                                                    \
    static const char *const var##_fields[] = {__VA_ARGS__, NULL};                       \
    const kvw_mask_spec_t var = {type, var##_fields, req, NULL}

/* A spec with a layout, from a list of the struct's fields in bit order:
 * LIST(X, T) expands X(T, field) for each. */
#define KVW_FIELD_NAME(T, f) #f,
#define KVW_FIELD_PLACE(T, f) {offsetof(T, f), sizeof(((T *)0)->f)},
#define KVW_SPEC_LAID_OUT(var, T, req, LIST)                                             \
    static const char *const var##_fields[] = {LIST(KVW_FIELD_NAME, T) NULL};            \
    static const kvw_mask_field_t var##_layout[] = {LIST(KVW_FIELD_PLACE, T)};          \
    const kvw_mask_spec_t var = {#T, var##_fields, req, var##_layout}

#define KVW_PAGES_LIST(X, T) X(T, pages) X(T, num_pages) X(T, first_token)
#define KVW_CHUNK_LIST(X, T)                                                             \
    X(T, num_tokens) X(T, chunk_begin) X(T, chunk_end) X(T, prefix_len) X(T, last_chunk)
#define KVW_PLAN_STATS_LIST(X, T)                                                        \
    X(T, bytes) X(T, num_routes) X(T, num_segments) X(T, runs_raw) X(T, runs_coalesced)   \
    X(T, plan_bytes)
#define KVW_SEND_CHUNK_LIST(X, T)                                                        \
    X(T, num_tokens) X(T, chunk_begin) X(T, chunk_end) X(T, last_chunk) X(T, pages)
#define KVW_RECV_POST_LIST(X, T) X(T, num_tokens) X(T, prefix_len) X(T, pages)
#define KVW_ROOM_METRICS_LIST(X, T)                                                      \
    X(T, bytes) X(T, runs) X(T, start_ns) X(T, end_ns) X(T, path) X(T, hop_ns)

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
KVW_SPEC_LAID_OUT(kvw__spec_pages, kvw_pages_t, 0, KVW_PAGES_LIST);
KVW_SPEC(kvw__spec_side_pages, "kvw_side_pages_t", 0, "full", "swa", "state_slot");
KVW_SPEC_LAID_OUT(kvw__spec_chunk, kvw_chunk_t, KVW_CHUNK_FIELD_NUM_TOKENS, KVW_CHUNK_LIST);
KVW_SPEC_LAID_OUT(kvw__spec_plan_stats, kvw_plan_stats_t, 0, KVW_PLAN_STATS_LIST);
KVW_SPEC_LAID_OUT(kvw__spec_send_chunk, kvw_send_chunk_t,
                  KVW_SEND_CHUNK_FIELD_NUM_TOKENS | KVW_SEND_CHUNK_FIELD_PAGES,
                  KVW_SEND_CHUNK_LIST);
KVW_SPEC_LAID_OUT(kvw__spec_recv_post, kvw_recv_post_t,
                  KVW_RECV_POST_FIELD_NUM_TOKENS | KVW_RECV_POST_FIELD_PAGES, KVW_RECV_POST_LIST);
KVW_SPEC_LAID_OUT(kvw__spec_room_metrics, kvw_room_metrics_t, 0, KVW_ROOM_METRICS_LIST);
KVW_SPEC(kvw__spec_ctx_params, "kvw_ctx_params_t", KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK,
         "side", "rank", "transport", "bootstrap_addr", "host_bootstrap", "listen_host",
         "timeouts", "secret", "prefill_size", "instance_id", "busy_poll_us", "verify");
KVW_SPEC(kvw__spec_bootstrap_params, "kvw_bootstrap_params_t", KVW_BOOTSTRAP_FIELD_ADDR, "addr",
         "secret");

kvw_status_t kvw__pages_norm(const kvw_pages_t *in, const char *where, kvw_pages_t *out)
{
    kvw_status_t st = kvw__mask_check(&kvw__spec_pages, in->field_mask, where);
    if (st != KVW_OK)
        return st;
    *out = (kvw_pages_t){.field_mask = KVW_PAGES_FIELDS_ALL};
    kvw__mask_copy(&kvw__spec_pages, in->field_mask, in, out);
    return KVW_OK;
}

/* "<where><sep><member>", naming a member struct in messages. */
static void kvw_member_where(char *buf, size_t cap, const char *where, const char *sep,
                             const char *member)
{
    snprintf(buf, cap, "%s%s%s", where ? where : "", where ? sep : "", member);
}

kvw_status_t kvw__side_pages_norm(const kvw_side_pages_t *in, const char *where,
                                  kvw_side_pages_t *out)
{
    kvw_status_t st = kvw__mask_check(&kvw__spec_side_pages, in->field_mask, where);
    if (st != KVW_OK)
        return st;
    uint64_t m = in->field_mask;
    /* The two page lists, named by the spec (bits 0 and 1); an unset one has no pages. */
    const kvw_pages_t none = {.field_mask = 0};
    const kvw_pages_t *const lists[2] = {&in->full, &in->swa};
    kvw_pages_t *const outs[2] = {&out->full, &out->swa};
    for (unsigned k = 0; k < 2; k++) {
        char sub[96];
        kvw_member_where(sub, sizeof(sub), where, ".", kvw__spec_side_pages.fields[k]);
        if ((st = kvw__pages_norm((m & (1ull << k)) ? lists[k] : &none, sub, outs[k])) !=
            KVW_OK)
            return st;
    }
    out->state_slot = (m & KVW_SIDE_PAGES_FIELD_STATE_SLOT) ? in->state_slot : -1;
    out->field_mask = KVW_SIDE_PAGES_FIELDS_ALL;
    return KVW_OK;
}

kvw_status_t kvw__chunk_norm(const kvw_chunk_t *in, const char *where, kvw_chunk_t *out)
{
    kvw_status_t st = kvw__mask_check(&kvw__spec_chunk, in->field_mask, where);
    if (st != KVW_OK)
        return st;
    /* chunk_end defaults to num_tokens (a required field), last_chunk to reaching it. */
    *out = (kvw_chunk_t){.field_mask = KVW_CHUNK_FIELDS_ALL, .chunk_end = in->num_tokens};
    kvw__mask_copy(&kvw__spec_chunk, in->field_mask, in, out);
    if (!(in->field_mask & KVW_CHUNK_FIELD_LAST_CHUNK))
        out->last_chunk = out->chunk_end == out->num_tokens;
    return KVW_OK;
}

/* The side page lists of a send chunk or a receive post ("<where>->pages"). */
static kvw_status_t kvw_member_pages_norm(const kvw_side_pages_t *in, const char *where,
                                          kvw_side_pages_t *out)
{
    char sub[96];
    kvw_member_where(sub, sizeof(sub), where, "->", "pages");
    return kvw__side_pages_norm(in, sub, out);
}

kvw_status_t kvw__send_chunk_norm(const kvw_send_chunk_t *in, const char *where,
                                  kvw_send_chunk_t *out)
{
    kvw_status_t st = kvw__mask_check(&kvw__spec_send_chunk, in->field_mask, where);
    if (st != KVW_OK)
        return st;
    /* As a kvw_chunk_t's: chunk_end defaults to num_tokens, last_chunk to reaching it. */
    kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .chunk_end = in->num_tokens};
    kvw__mask_copy(&kvw__spec_send_chunk, in->field_mask, in, &c);
    if (!(in->field_mask & KVW_SEND_CHUNK_FIELD_LAST_CHUNK))
        c.last_chunk = c.chunk_end == c.num_tokens;
    if ((st = kvw_member_pages_norm(&in->pages, where, &c.pages)) != KVW_OK)
        return st;
    *out = c;
    return KVW_OK;
}

kvw_status_t kvw__recv_post_norm(const kvw_recv_post_t *in, const char *where,
                                 kvw_recv_post_t *out)
{
    kvw_status_t st = kvw__mask_check(&kvw__spec_recv_post, in->field_mask, where);
    if (st != KVW_OK)
        return st;
    kvw_recv_post_t p = {.field_mask = KVW_RECV_POST_FIELDS_ALL};
    kvw__mask_copy(&kvw__spec_recv_post, in->field_mask, in, &p);
    if ((st = kvw_member_pages_norm(&in->pages, where, &p.pages)) != KVW_OK)
        return st;
    *out = p;
    return KVW_OK;
}
