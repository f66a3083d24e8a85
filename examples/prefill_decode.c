/*
 * kvwire in two processes: a prefill instance of TP 2 sends the KV cache of a few
 * requests to a decode instance of TP 1, which checks every byte it received.
 *
 * The model: 2 full-attention layers, 4 KV heads of 64 bf16 elements (128 bytes per
 * head and token), pages of 16 tokens, NHD layout ([page][token][head][bytes]). Prefill
 * TP rank r holds heads 2r and 2r+1; the decode rank holds all four, so each decode
 * page receives a slice from each prefill rank.
 *
 * The prefill process runs both TP ranks (two contexts); rank 0 hosts the bootstrap
 * endpoint and tells the decode process its address over a pipe. Uses the public API
 * only (kvwire/kvwire.h, kvwire/xfer.h). Built by the project (CMakeLists.txt), or
 *   cc prefill_decode.c $(pkg-config --cflags --libs kvwire) -o prefill_decode
 * Exit status 0 when every byte arrived as expected.
 */
#include <kvwire/kvwire.h>
#include <kvwire/xfer.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

enum { LAYERS = 2, HEADS = 4, HEAD_BYTES = 128, PAGE = 16, PAGES = 64, REQUESTS = 3 };

/* Every struct starts with a field mask: the fields it names are read, the others take
 * their documented defaults (here: no MLA, no block scales, no sliding window). */
static const kvw_layer_desc_t layer_kinds[LAYERS] = {
    {.field_mask = KVW_LAYER_FIELD_KIND, .kind = KVW_LAYER_FULL},
    {.field_mask = KVW_LAYER_FIELD_KIND, .kind = KVW_LAYER_FULL}};
static const kvw_model_t model = {
    .field_mask = KVW_MODEL_FIELD_NUM_LAYERS | KVW_MODEL_FIELD_LAYERS |
                  KVW_MODEL_FIELD_NUM_KV_HEADS | KVW_MODEL_FIELD_K_HEAD_DIM |
                  KVW_MODEL_FIELD_V_HEAD_DIM | KVW_MODEL_FIELD_ELEM_SIZE,
    .num_layers = LAYERS, .layers = layer_kinds, .num_kv_heads = HEADS, .k_head_dim = 64,
    .v_head_dim = 64, .elem_size = 2};

/* The byte a prefill engine computed for (layer, role, global head, token, offset). */
static uint8_t kv_byte(uint32_t layer, uint32_t role, uint32_t head, uint64_t token, uint32_t i)
{
    return (uint8_t)(layer * 131 + role * 71 + head * 29 + token * 7 + i);
}

/* Request r: its length, and its pages on each side (different pages on purpose). */
static uint64_t req_tokens(int r)
{
    return 100 + 37 * (uint64_t)r;
}
static uint32_t req_page(int r, uint32_t i, int decode)
{
    return (uint32_t)((decode ? 40 : 3) + r * 16 + i) % PAGES;
}

typedef struct rank {
    kvw_buffer_desc_t bufs[LAYERS * 2];
    uint8_t *mem[LAYERS * 2];
    kvw_rank_h h;
} rank_t;

/* After every context using the rank is destroyed. */
static void rank_free(rank_t *r)
{
    kvw_rank_destroy(r->h);
    for (int b = 0; b < LAYERS * 2; b++)
        free(r->mem[b]);
}

/* A rank of TP `tp`, rank `tp_rank`: K and V buffers per layer, each PAGES pages. */
static int rank_make(uint32_t tp, uint32_t tp_rank, rank_t *r)
{
    uint32_t heads = HEADS / tp;
    memset(r, 0, sizeof(*r));
    for (uint32_t l = 0; l < LAYERS; l++)
        for (uint32_t role = 0; role < 2; role++) {
            kvw_buffer_desc_t *b = &r->bufs[l * 2 + role];
            b->field_mask = KVW_BUFFER_FIELDS_ALL;
            b->pool = KVW_POOL_FULL;
            b->layer = l;
            b->role = role ? KVW_ROLE_V : KVW_ROLE_K;
            b->layout = KVW_LAYOUT_NHD;
            b->page_size = PAGE;
            b->num_heads = heads;
            b->head_bytes = HEAD_BYTES;
            b->length = (uint64_t)PAGES * PAGE * heads * HEAD_BYTES;
            b->mem_kind = KVW_MEM_HOST;
            r->mem[l * 2 + role] = calloc(1, b->length);
            b->addr = r->mem[l * 2 + role];
            if (b->addr == NULL)
                return -1;
        }
    kvw_rank_params_t p = {.field_mask = KVW_RANK_FIELD_MODEL | KVW_RANK_FIELD_PARALLEL |
                                         KVW_RANK_FIELD_BUFFERS,
                           .model = &model, .buffers = r->bufs, .num_buffers = LAYERS * 2};
    /* PP, DP and the layer range keep their defaults: one stage, one group, every layer. */
    p.parallel = (kvw_parallel_t){
        .field_mask = KVW_PARALLEL_FIELD_TP_SIZE | KVW_PARALLEL_FIELD_TP_RANK,
        .tp_size = tp, .tp_rank = tp_rank};
    if (kvw_rank_create(&p, &r->h) != KVW_OK) {
        fprintf(stderr, "kvw_rank_create: %s\n", kvw_last_error());
        return -1;
    }
    return 0;
}

/* Address of (page, token in page, local head) in buffer b of rank r (NHD). */
static uint8_t *at(rank_t *r, int b, uint32_t page, uint32_t t, uint32_t h)
{
    uint32_t heads = r->bufs[b].num_heads;
    return r->mem[b] + (((uint64_t)page * PAGE + t) * heads + h) * HEAD_BYTES;
}

static int prefill(int addr_fd, int go_fd)
{
    rank_t ranks[2];
    kvw_ctx_h ctx[2] = {NULL, NULL};
    uint32_t pages[REQUESTS][PAGES];
    for (uint32_t k = 0; k < 2; k++) {
        if (rank_make(2, k, &ranks[k]))
            return 1;
        /* What the forward pass would have written: every head this rank holds. */
        for (int q = 0; q < REQUESTS; q++)
            for (uint64_t tok = 0; tok < req_tokens(q); tok++)
                for (int b = 0; b < LAYERS * 2; b++)
                    for (uint32_t h = 0; h < 2; h++) {
                        uint8_t *p = at(&ranks[k], b, req_page(q, (uint32_t)(tok / PAGE), 0),
                                        (uint32_t)(tok % PAGE), h);
                        for (uint32_t i = 0; i < HEAD_BYTES; i++)
                            p[i] = kv_byte((uint32_t)b / 2, (uint32_t)b % 2, 2 * k + h, tok, i);
                    }
        kvw_ctx_params_t cp = {.field_mask = KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK |
                                             KVW_CTX_FIELD_TRANSPORT | KVW_CTX_FIELD_BOOTSTRAP |
                                             KVW_CTX_FIELD_HOST_BOOTSTRAP,
                               .side = KVW_SIDE_PREFILL, .rank = ranks[k].h, .transport = "tcp",
                               .bootstrap_addr = k == 0 ? "127.0.0.1:0"
                                                        : kvw_ctx_bootstrap_addr(ctx[0]),
                               .host_bootstrap = k == 0};
        if (kvw_ctx_create(&cp, &ctx[k]) != KVW_OK) {
            fprintf(stderr, "prefill rank %u: %s\n", k, kvw_last_error());
            return 1;
        }
    }
    char addr[128] = {0};
    snprintf(addr, sizeof(addr), "%s", kvw_ctx_bootstrap_addr(ctx[0]));
    if (write(addr_fd, addr, sizeof(addr)) != (ssize_t)sizeof(addr))
        return 1;
    char go;
    if (read(go_fd, &go, 1) != 1) /* the decode posted its rooms */
        return 1;
    int rc = 0;
    for (int q = 0; q < REQUESTS; q++) {
        uint32_t np = (uint32_t)((req_tokens(q) + PAGE - 1) / PAGE);
        for (uint32_t i = 0; i < np; i++)
            pages[q][i] = req_page(q, i, 0);
        /* The whole request in one chunk: the chunk range and last_chunk are left to their
         * defaults ([0, num_tokens), last), and so is the state slot (none). */
        kvw_send_chunk_t c = {
            .field_mask = KVW_SEND_CHUNK_FIELD_NUM_TOKENS | KVW_SEND_CHUNK_FIELD_PAGES,
            .num_tokens = req_tokens(q),
            .pages = {.field_mask = KVW_SIDE_PAGES_FIELD_FULL,
                      .full = {.field_mask = KVW_PAGES_FIELD_PAGES | KVW_PAGES_FIELD_NUM_PAGES,
                               .pages = pages[q], .num_pages = np}}};
        /* Each TP rank sends its heads; the room completes with both. */
        kvw_sender_h s[2] = {NULL, NULL};
        for (uint32_t k = 0; k < 2; k++)
            if (kvw_sender_create(ctx[k], (uint64_t)q + 1, &s[k]) != KVW_OK ||
                kvw_sender_send(s[k], &c) != KVW_OK) {
                fprintf(stderr, "prefill rank %u, room %d: %s\n", k, q + 1, kvw_last_error());
                rc = 1;
            }
        for (uint32_t k = 0; k < 2; k++) {
            if (s[k] && kvw_room_wait(kvw_sender_room(s[k]), 30000) != KVW_ROOM_SUCCESS) {
                fprintf(stderr, "prefill rank %u, room %d: %s\n", k, q + 1,
                        kvw_room_failure(kvw_sender_room(s[k])));
                rc = 1;
            }
            kvw_room_destroy(kvw_sender_room(s[k]));
        }
    }
    for (uint32_t k = 0; k < 2; k++) {
        kvw_ctx_destroy(ctx[k]);
        rank_free(&ranks[k]);
    }
    return rc;
}

static int decode(int addr_fd, int go_fd)
{
    char addr[128];
    if (read(addr_fd, addr, sizeof(addr)) != (ssize_t)sizeof(addr))
        return 1;
    rank_t r;
    if (rank_make(1, 0, &r))
        return 1;
    kvw_ctx_params_t cp = {.field_mask = KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK |
                                         KVW_CTX_FIELD_TRANSPORT | KVW_CTX_FIELD_BOOTSTRAP |
                                         KVW_CTX_FIELD_PREFILL_SIZE,
                           .side = KVW_SIDE_DECODE, .rank = r.h, .transport = "tcp",
                           .bootstrap_addr = addr, .prefill_tp = 2, .prefill_pp = 1,
                           .prefill_dp = 1};
    kvw_ctx_h ctx = NULL;
    if (kvw_ctx_create(&cp, &ctx) != KVW_OK) {
        fprintf(stderr, "decode: %s\n", kvw_last_error());
        return 1;
    }
    kvw_receiver_h rv[REQUESTS];
    uint32_t pages[REQUESTS][PAGES];
    for (int q = 0; q < REQUESTS; q++) {
        uint32_t np = (uint32_t)((req_tokens(q) + PAGE - 1) / PAGE);
        for (uint32_t i = 0; i < np; i++)
            pages[q][i] = req_page(q, i, 1);
        kvw_recv_post_t post = {
            .field_mask = KVW_RECV_POST_FIELD_NUM_TOKENS | KVW_RECV_POST_FIELD_PAGES,
            .num_tokens = req_tokens(q),
            .pages = {.field_mask = KVW_SIDE_PAGES_FIELD_FULL,
                      .full = {.field_mask = KVW_PAGES_FIELD_PAGES | KVW_PAGES_FIELD_NUM_PAGES,
                               .pages = pages[q], .num_pages = np}}};
        if (kvw_receiver_create(ctx, (uint64_t)q + 1, 0, &rv[q]) != KVW_OK ||
            kvw_receiver_post(rv[q], &post) != KVW_OK) {
            fprintf(stderr, "decode room %d: %s\n", q + 1, kvw_last_error());
            return 1;
        }
    }
    if (write(go_fd, "g", 1) != 1)
        return 1;
    int rc = 0;
    uint64_t checked = 0;
    for (int q = 0; q < REQUESTS; q++) {
        if (kvw_room_wait(kvw_receiver_room(rv[q]), 30000) != KVW_ROOM_SUCCESS) {
            fprintf(stderr, "decode room %d: %s\n", q + 1,
                    kvw_room_failure(kvw_receiver_room(rv[q])));
            rc = 1;
            continue;
        }
        for (uint64_t tok = 0; tok < req_tokens(q); tok++)
            for (int b = 0; b < LAYERS * 2; b++)
                for (uint32_t h = 0; h < HEADS; h++) {
                    const uint8_t *p = at(&r, b, req_page(q, (uint32_t)(tok / PAGE), 1),
                                          (uint32_t)(tok % PAGE), h);
                    for (uint32_t i = 0; i < HEAD_BYTES; i++, checked++)
                        if (p[i] != kv_byte((uint32_t)b / 2, (uint32_t)b % 2, h, tok, i)) {
                            fprintf(stderr, "room %d: layer %d %c head %u token %llu byte %u "
                                    "differs\n", q + 1, b / 2, b % 2 ? 'V' : 'K', h,
                                    (unsigned long long)tok, i);
                            return 1;
                        }
                }
        kvw_room_destroy(kvw_receiver_room(rv[q]));
    }
    kvw_ctx_destroy(ctx);
    rank_free(&r);
    if (rc == 0)
        printf("prefill_decode: %d requests, TP2 -> TP1 over tcp, %llu bytes checked\n",
               REQUESTS, (unsigned long long)checked);
    return rc;
}

int main(void)
{
    int a[2], g[2];
    if (pipe(a) || pipe(g))
        return 1;
    pid_t child = fork();
    if (child == 0)
        _exit(prefill(a[1], g[0]));
    int rc = decode(a[0], g[1]);
    int st = 0;
    waitpid(child, &st, 0);
    return rc || !WIFEXITED(st) || WEXITSTATUS(st) ? 1 : 0;
}
