/* Encoding of rank descriptions (model, parallel config, buffers) and page lists in control
 * frames, and the DONE frame of the data path (written by worker.c, read by land.c). */
#include "proto/proto.h"

#include "core/le.h"
#include "core/sha256.h"

#include <stddef.h>
#include <string.h>

/* The uint32_t fields of a model and of a parallel config, in wire order. */
static const size_t kvw_model_u32[] = {
    offsetof(kvw_model_t, num_kv_heads), offsetof(kvw_model_t, k_head_dim),
    offsetof(kvw_model_t, v_head_dim),   offsetof(kvw_model_t, mla_dim),
    offsetof(kvw_model_t, elem_size),    offsetof(kvw_model_t, scale_block),
    offsetof(kvw_model_t, scale_elem_size)};
static const size_t kvw_parallel_u32[] = {
    offsetof(kvw_parallel_t, tp_size),     offsetof(kvw_parallel_t, tp_rank),
    offsetof(kvw_parallel_t, pp_size),     offsetof(kvw_parallel_t, pp_rank),
    offsetof(kvw_parallel_t, layer_begin), offsetof(kvw_parallel_t, layer_end),
    offsetof(kvw_parallel_t, dp_size),     offsetof(kvw_parallel_t, dp_rank)};

void kvw__wire_put_rank(kvw_wbuf_t *w, kvw_rank_h rank)
{
    const kvw_model_t *m = kvw_rank_model(rank);
    const kvw_parallel_t *p = kvw_rank_parallel(rank);
    kvw__wb_u32(w, m->num_layers);
    for (uint32_t l = 0; l < m->num_layers; l++) {
        kvw__wb_u8(w, (uint8_t)m->layers[l].kind);
        kvw__wb_u32(w, m->layers[l].window);
    }
    kvw__wb_u32_fields(w, m, kvw_model_u32, KVW_ARRAY_SIZE(kvw_model_u32));
    kvw__wb_u32_fields(w, p, kvw_parallel_u32, KVW_ARRAY_SIZE(kvw_parallel_u32));
    uint32_t nb = kvw_rank_num_buffers(rank);
    kvw__wb_u32(w, nb);
    for (uint32_t i = 0; i < nb; i++) {
        const kvw_buffer_desc_t *b = kvw_rank_buffer(rank, i);
        kvw__wb_u8(w, (uint8_t)b->pool);
        kvw__wb_u32(w, b->layer);
        kvw__wb_u8(w, (uint8_t)b->role);
        kvw__wb_u8(w, (uint8_t)b->layout);
        kvw__wb_u32(w, b->page_size);
        kvw__wb_u32(w, b->num_heads);
        kvw__wb_u32(w, b->head_bytes);
        kvw__wb_u32(w, b->v_head_bytes);
        kvw__wb_u32(w, b->num_groups);
        for (uint32_t g = 0; g < b->num_groups && g < KVW_MAX_STATE_GROUPS; g++) {
            kvw__wb_u32(w, b->groups[g].total_heads);
            kvw__wb_u32(w, b->groups[g].head_bytes);
        }
        kvw__wb_u64(w, b->length);
        kvw__wb_u8(w, (uint8_t)b->mem_kind);
        kvw__wb_u32(w, (uint32_t)b->device);
    }
}

#define KVW_WIRE_MAX_LAYERS 100000u
#define KVW_WIRE_MAX_BUFFERS 1000000u

kvw_status_t kvw__wire_get_rank(kvw_rbuf_t *r, kvw_rank_h *rank_p)
{
    kvw_model_t m = {0};
    kvw_parallel_t p;
    kvw_layer_desc_t *layers = NULL;
    kvw_buffer_desc_t *bufs = NULL;
    kvw_status_t st;
    m.num_layers = kvw__rb_u32(r);
    if (r->bad || m.num_layers == 0 || m.num_layers > KVW_WIRE_MAX_LAYERS ||
        m.num_layers > (r->len - r->pos) / 5)
        return kvw__error(KVW_ERR_MALFORMED, "rank description: bad layer count %u", m.num_layers);
    layers = calloc(m.num_layers, sizeof(*layers));
    if (layers == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory decoding a rank");
    for (uint32_t l = 0; l < m.num_layers; l++) {
        layers[l].field_mask = KVW_LAYER_FIELDS_ALL;
        layers[l].kind = (kvw_layer_kind_t)kvw__rb_u8(r);
        layers[l].window = kvw__rb_u32(r);
    }
    m.field_mask = KVW_MODEL_FIELDS_ALL;
    m.layers = layers;
    kvw__rb_u32_fields(r, &m, kvw_model_u32, KVW_ARRAY_SIZE(kvw_model_u32));
    p.field_mask = KVW_PARALLEL_FIELDS_ALL;
    kvw__rb_u32_fields(r, &p, kvw_parallel_u32, KVW_ARRAY_SIZE(kvw_parallel_u32));
    uint32_t nb = kvw__rb_u32(r);
    if (r->bad || nb > KVW_WIRE_MAX_BUFFERS || nb > (r->len - r->pos) / 40) {
        st = kvw__error(KVW_ERR_MALFORMED, "rank description: bad buffer count %u", nb);
        goto out;
    }
    bufs = calloc(nb ? nb : 1, sizeof(*bufs));
    if (bufs == NULL) {
        st = kvw__error(KVW_ERR_NO_MEMORY, "out of memory decoding a rank");
        goto out;
    }
    for (uint32_t i = 0; i < nb && !r->bad; i++) {
        kvw_buffer_desc_t *b = &bufs[i];
        b->field_mask = KVW_BUFFER_FIELDS_ALL;
        b->pool = (kvw_pool_t)kvw__rb_u8(r);
        b->layer = kvw__rb_u32(r);
        b->role = (kvw_role_t)kvw__rb_u8(r);
        b->layout = (kvw_layout_t)kvw__rb_u8(r);
        b->page_size = kvw__rb_u32(r);
        b->num_heads = kvw__rb_u32(r);
        b->head_bytes = kvw__rb_u32(r);
        b->v_head_bytes = kvw__rb_u32(r);
        b->num_groups = kvw__rb_u32(r);
        if (b->num_groups > KVW_MAX_STATE_GROUPS) {
            r->bad = true;
            break;
        }
        for (uint32_t g = 0; g < b->num_groups; g++) {
            b->groups[g].field_mask = KVW_STATE_GROUP_FIELDS_ALL;
            b->groups[g].total_heads = kvw__rb_u32(r);
            b->groups[g].head_bytes = kvw__rb_u32(r);
        }
        b->length = kvw__rb_u64(r);
        b->mem_kind = (kvw_mem_kind_t)kvw__rb_u8(r);
        b->device = (int32_t)kvw__rb_u32(r);
        b->addr = NULL; /* remote: never dereferenced here */
    }
    if (r->bad) {
        st = kvw__error(KVW_ERR_MALFORMED, "rank description is truncated or malformed");
        goto out;
    }
    kvw_rank_params_t rp = {.field_mask = KVW_RANK_FIELD_MODEL | KVW_RANK_FIELD_PARALLEL |
                                          KVW_RANK_FIELD_BUFFERS,
                            .model = &m, .parallel = p, .buffers = bufs, .num_buffers = nb};
    st = kvw_rank_create(&rp, rank_p);
out:
    free(layers);
    free(bufs);
    return st;
}

void kvw__wire_put_pages(kvw_wbuf_t *w, const kvw_pages_t *pl)
{
    kvw__wb_u64(w, pl->first_token);
    kvw__wb_u32(w, pl->num_pages);
    for (uint32_t i = 0; i < pl->num_pages; i++)
        kvw__wb_u32(w, pl->pages[i]);
}

kvw_status_t kvw__wire_skip_pages(kvw_rbuf_t *r, kvw_pages_t *pl)
{
    pl->first_token = kvw__rb_u64(r);
    uint32_t n = kvw__rb_u32(r);
    if (r->bad || n > (r->len - r->pos) / 4)
        return kvw__error(KVW_ERR_MALFORMED, "page list: %u pages do not fit the frame", n);
    r->pos += (size_t)n * 4;
    pl->pages = NULL;
    pl->num_pages = 0;
    return KVW_OK;
}

kvw_status_t kvw__wire_get_pages(kvw_rbuf_t *r, kvw_pages_t *pl, uint32_t **store_p,
                                 uint64_t max_pages)
{
    pl->first_token = kvw__rb_u64(r);
    pl->num_pages = kvw__rb_u32(r);
    if (r->bad || pl->num_pages > (r->len - r->pos) / 4)
        return kvw__error(KVW_ERR_MALFORMED, "page list: %u pages do not fit the frame",
                          pl->num_pages);
    /* Refused before anything is copied: a list longer than the pool cannot name distinct
     * pages, and a peer must not make this rank hold megabytes per request. */
    if (pl->num_pages > max_pages)
        return kvw__error(KVW_ERR_OUT_OF_RANGE, "page list of %u pages is longer than the "
                          "pool (%llu pages)", pl->num_pages, (unsigned long long)max_pages);
    uint32_t *s = malloc(sizeof(uint32_t) * (pl->num_pages ? pl->num_pages : 1));
    if (s == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory decoding pages");
    for (uint32_t i = 0; i < pl->num_pages; i++)
        s[i] = kvw__rb_u32(r);
    pl->pages = s;
    *store_p = s;
    return KVW_OK;
}

/* The DONE frame's fields in wire order, with their width in bytes (1: a bool): one
 * table for writer and reader. */
static const struct {
    size_t off;
    uint8_t width;
} kvw_done_fields[] = {
    {offsetof(kvw_done_msg_t, room), 8},        {offsetof(kvw_done_msg_t, peer), 4},
    {offsetof(kvw_done_msg_t, chunk_begin), 8}, {offsetof(kvw_done_msg_t, chunk_end), 8},
    {offsetof(kvw_done_msg_t, bytes), 8},       {offsetof(kvw_done_msg_t, last_chunk), 1},
    {offsetof(kvw_done_msg_t, staged), 1},      {offsetof(kvw_done_msg_t, soff), 8},
    {offsetof(kvw_done_msg_t, slen), 8},        {offsetof(kvw_done_msg_t, goff), 8},
    {offsetof(kvw_done_msg_t, final), 1},       {offsetof(kvw_done_msg_t, meta_len), 4},
    {offsetof(kvw_done_msg_t, digest_n), 4}};
/* The fields (71 bytes), then digest_n values of 8 bytes, then (with a session key) the
 * tag: the largest frame is one notification. */
_Static_assert(KVW_WIRE_HDR + 71 + 8 * KVW_DONE_DIGEST_MAX + KVW_TAG <= KVW_TL_MAX_NOTIFY,
               "a DONE frame with its digest fits in one notification");

/* The tag of a DONE frame's fields under a session key. */
static void kvw_done_tag(const uint8_t *key, const uint8_t *fields, size_t n, uint8_t out[32])
{
    kvw_hmac_t h;
    kvw__hmac_init(&h, key, 32);
    kvw__hmac_update(&h, "kvwire-done-4", strlen("kvwire-done-4"));
    kvw__hmac_update(&h, fields, n);
    kvw__hmac_final(&h, out);
}

void kvw__done_encode(kvw_wbuf_t *w, const kvw_done_msg_t *m, const uint8_t *key)
{
    kvw__wb_init(w, KVW_MSG_DONE);
    for (size_t i = 0; i < KVW_ARRAY_SIZE(kvw_done_fields); i++) {
        const char *f = (const char *)m + kvw_done_fields[i].off;
        if (kvw_done_fields[i].width == 8) {
            uint64_t v;
            memcpy(&v, f, sizeof(v));
            kvw__wb_u64(w, v);
        } else if (kvw_done_fields[i].width == 4) {
            uint32_t v;
            memcpy(&v, f, sizeof(v));
            kvw__wb_u32(w, v);
        } else {
            bool v;
            memcpy(&v, f, sizeof(v));
            kvw__wb_u8(w, (uint8_t)v);
        }
    }
    for (uint32_t u = 0; u < m->digest_n; u++)
        kvw__wb_u64(w, m->digest[u]);
    if (key && !w->oom) {
        uint8_t t[32];
        kvw_done_tag(key, w->p + KVW_WIRE_HDR, w->len - KVW_WIRE_HDR, t);
        for (size_t i = 0; i < KVW_TAG; i++)
            kvw__wb_u8(w, t[i]);
    }
}

/* Bytes of a DONE frame's fields (the tag, when there is one, follows them). */
static size_t kvw_done_fields_len(void)
{
    size_t n = 0;
    for (size_t i = 0; i < KVW_ARRAY_SIZE(kvw_done_fields); i++)
        n += kvw_done_fields[i].width;
    return n;
}

/* Bytes of a DONE frame's payload before its tag: the fields and the digest values
 * (digest_n, the last field, says how many); 0 if the payload is too short to say. */
static size_t kvw_done_body_len(const uint8_t *payload, size_t len)
{
    size_t n = kvw_done_fields_len();
    if (len < n)
        return 0;
    uint32_t digest_n = kvw__le32_get(payload + n - 4);
    return digest_n > KVW_DONE_DIGEST_MAX ? 0 : n + 8 * (size_t)digest_n;
}

kvw_status_t kvw__done_check_tag(const uint8_t *payload, size_t len, const uint8_t *key)
{
    size_t n = kvw_done_body_len(payload, len);
    if (n == 0 || len != n + KVW_TAG)
        return kvw__error(KVW_ERR_AUTH, "a completion without the session's tag");
    uint8_t t[32];
    kvw_done_tag(key, payload, n, t);
    if (!kvw__ct_equal(t, payload + n, KVW_TAG))
        return kvw__error(KVW_ERR_AUTH, "a completion whose session tag is wrong");
    return KVW_OK;
}

void kvw__entry_bind(const uint8_t nonce[32], const char *addr, uint8_t out[32])
{
    kvw_sha256_t c;
    kvw__sha256_init(&c);
    kvw__sha256_update(&c, "kvwire-entry-3", strlen("kvwire-entry-3"));
    kvw__sha256_update(&c, nonce, 32);
    kvw__sha256_update(&c, addr, strlen(addr));
    kvw__sha256_final(&c, out);
}

kvw_status_t kvw__done_decode(kvw_rbuf_t *r, kvw_done_msg_t *m)
{
    memset(m, 0, sizeof(*m));
    for (size_t i = 0; i < KVW_ARRAY_SIZE(kvw_done_fields); i++) {
        char *f = (char *)m + kvw_done_fields[i].off;
        if (kvw_done_fields[i].width == 8) {
            uint64_t v = kvw__rb_u64(r);
            memcpy(f, &v, sizeof(v));
        } else if (kvw_done_fields[i].width == 4) {
            uint32_t v = kvw__rb_u32(r);
            memcpy(f, &v, sizeof(v));
        } else {
            bool v = kvw__rb_u8(r) != 0;
            memcpy(f, &v, sizeof(v));
        }
    }
    if (r->bad)
        return kvw__rb_done(r, "done");
    if (m->digest_n > KVW_DONE_DIGEST_MAX || r->len - r->pos < 8ull * m->digest_n)
        return kvw__error(KVW_ERR_MALFORMED, "done: %u digest values in a %zu-byte frame",
                          m->digest_n, r->len);
    m->digest_le = r->p + r->pos;
    r->pos += 8ull * m->digest_n;
    if (r->len - r->pos == KVW_TAG)
        r->pos += KVW_TAG; /* the tag: kvw__done_check_tag */
    return kvw__rb_done(r, "done");
}
