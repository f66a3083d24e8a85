/*
 * The KV digest function (src/plan/digest.c) against an independent re-computation.
 *
 * Logical KV is a function of (layer, component, global head, token, byte). Ranks of
 * several layouts and page sizes are filled with it through this file's own addressing
 * (kvwire.h's NHD and HND written out again, random page lists), and the digest the
 * library computes over a plan's destination (or source) pages must equal, unit for
 * unit, a naive sum written here from the definition: for every unit (layer, component,
 * head) in the decode rank's order, the sum mod 2^64 over the tokens that move of
 * XXH3_64bits_withSeed(row, head_bytes, seed), with the seed's mixing written out again.
 * Hence NHD and HND, pages of 1, 16 and 64 tokens, both sides of a plan, chunkings and
 * TP splits all give the same values. Models: gpt-oss cut to two layers (sliding window
 * and full attention, 8 KV heads) and deepseek-v3 cut to two (MLA).
 *
 * Exit: 0 pass, 1 fail.
 */
#include "testkit.h"
#include "check.h"

#include "plan/digest.h"
#include "plan/rank.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOKENS 150
#define WINDOW 128

static uint64_t fmix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The seed, from digest.h's definition. */
static uint64_t seed_of(uint32_t layer, uint32_t comp, uint32_t head, uint64_t t)
{
    uint64_t a = fmix((((uint64_t)layer << 32) | comp) + 0x6b767764ull);
    return fmix(a ^ (((uint64_t)head << 40) | t));
}

/* Byte i of the row of (layer, component, global head, token). */
static uint8_t logical(uint32_t l, uint32_t comp, uint32_t g, uint64_t t, uint32_t i)
{
    uint64_t z = kvt_mix64(l * 1000003ull + comp * 7919ull + g * 104729ull + t * 15485863ull +
                           i / 8);
    return (uint8_t)(z >> (8 * (i % 8)));
}

static uint32_t comp_of(kvw_role_t role)
{
    return role == KVW_ROLE_K ? 0 : role == KVW_ROLE_V ? 1 : 2; /* kvw_comp_t */
}

static uint64_t row_off(const kvw_buffer_desc_t *b, const kvw_pages_t *pl, uint64_t t, uint32_t h)
{
    uint64_t ps = b->page_size, H = b->num_heads, hb = b->head_bytes;
    uint64_t page = pl->pages[(t - pl->first_token) / ps], x = (t - pl->first_token) % ps;
    return b->layout == KVW_LAYOUT_HND ? page * ps * H * hb + h * ps * hb + x * hb
                                       : page * ps * H * hb + x * H * hb + h * hb;
}

static void token_range(const kvt_model_t *m, uint32_t l, uint64_t *b, uint64_t *e)
{
    *b = 0, *e = TOKENS;
    if (m->layers[l].kind == KVW_LAYER_SWA)
        *b = TOKENS > WINDOW ? TOKENS - WINDOW : 0;
}

static uint32_t total_heads(const kvt_model_t *m, uint32_t l)
{
    return m->layers[l].kind == KVW_LAYER_MLA ? 1 : m->m.num_kv_heads;
}

/* Writes the logical rows of every token that moves into rank r's pages. */
static void fill_logical(const kvt_model_t *m, kvt_rank_t *r, const kvw_side_pages_t *sp)
{
    for (uint32_t bi = 0; bi < r->num_bufs; bi++) {
        const kvw_buffer_desc_t *b = &r->bufs[bi];
        uint32_t first = 0, count = 0;
        kvt_heads_owned(r->par.tp_size, r->par.tp_rank, total_heads(m, b->layer), &first, &count);
        const kvw_pages_t *pl = b->pool == KVW_POOL_SWA ? &sp->swa : &sp->full;
        uint64_t tb, te;
        token_range(m, b->layer, &tb, &te);
        uint8_t *d = kvt_rank_data(r, bi);
        for (uint64_t t = tb; t < te; t++)
            for (uint32_t h = 0; h < b->num_heads; h++)
                for (uint32_t i = 0; i < b->head_bytes; i++)
                    d[row_off(b, pl, t, h) + i] = logical(b->layer, comp_of(b->role), first + h,
                                                          t, i);
    }
}

/* The naive digest of decode rank r (all heads it holds), in its unit order: layers,
 * then K, V (or the latent), then local heads. `heads_from` [g0, g1): only the global
 * heads a given source sends (all: 0, UINT32_MAX). */
static uint32_t naive(const kvt_model_t *m, const kvt_rank_t *r, uint32_t g0, uint32_t g1,
                      uint64_t *out)
{
    uint32_t u = 0;
    uint8_t row[4096];
    for (uint32_t l = 0; l < m->m.num_layers; l++)
        for (uint32_t comp = 0; comp < 3; comp++)
            for (uint32_t bi = 0; bi < r->num_bufs; bi++) {
                const kvw_buffer_desc_t *b = &r->bufs[bi];
                if (b->layer != l || comp_of(b->role) != comp)
                    continue;
                uint32_t first = 0, count = 0;
                kvt_heads_owned(r->par.tp_size, r->par.tp_rank, total_heads(m, l), &first,
                                &count);
                uint64_t tb, te;
                token_range(m, l, &tb, &te);
                for (uint32_t h = 0; h < b->num_heads; h++, u++) {
                    uint64_t sum = 0;
                    uint32_t g = first + h;
                    for (uint64_t t = tb; t < te && g >= g0 && g < g1; t++) {
                        for (uint32_t i = 0; i < b->head_bytes; i++)
                            row[i] = logical(l, comp, g, t, i);
                        sum += XXH3_64bits_withSeed(row, b->head_bytes, seed_of(l, comp, g, t));
                    }
                    out[u] = sum;
                }
            }
    return u;
}

typedef struct side {
    kvt_rank_t r;
    kvt_req_pages_t pg;
} side_t;

static int side_make(const kvt_model_t *m, uint32_t tp, uint32_t rank, kvw_layout_t layout,
                     uint32_t ps, uint64_t seed, side_t *s)
{
    uint32_t pages = (TOKENS + ps - 1) / ps + 5;
    kvt_rank_spec_t rs = {.model = m, .layout = layout, .page_size = {ps, ps},
                          .num_pages = {pages, pages}, .num_slots = 1};
    rs.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = tp,
                              .tp_rank = rank, .pp_size = 1, .layer_begin = 0,
                              .layer_end = m->m.num_layers, .dp_size = 1};
    if (kvt_rank_build(&rs, &s->r) != KVW_OK)
        return -1;
    kvt_model_relink(&s->r.model);
    kvt_rank_fill(&s->r, seed); /* bytes outside the rows must not matter */
    kvt_rng_t rng = {seed};
    kvt_req_spec_t q = {.full_begin = 0, .full_end = TOKENS, .swa_begin = 0, .swa_end = TOKENS,
                        .state_slot = -1};
    if (kvt_req_pages_make(&s->r, &q, &rng, &s->pg))
        return -1;
    fill_logical(m, &s->r, &s->pg.side);
    return 0;
}

static void side_free(side_t *s)
{
    kvt_req_pages_free(&s->pg);
    kvt_rank_free(&s->r);
}

/* The library's digest of plan (src -> dst, chunk) on one side, added to out. */
static void lib_digest(const side_t *src, const side_t *dst, const kvw_chunk_t *c, bool dst_side,
                       uint64_t *out, uint32_t n)
{
    kvw_plan_h plan = NULL;
    CHECK(kvw_plan_create(src->r.h, dst->r.h, c, &src->pg.side, &dst->pg.side, &plan) == KVW_OK,
          "plan: %s", kvw_last_error());
    if (plan == NULL)
        return;
    CHECK(kvw__plan_digest(plan, dst_side, NULL, 0, out, n) == KVW_OK, "digest: %s",
          kvw_last_error());
    kvw_plan_destroy(plan);
}

static void compare(const char *what, const uint64_t *got, const uint64_t *want, uint32_t n)
{
    for (uint32_t u = 0; u < n; u++)
        if (got[u] != want[u]) {
            CHECK(0, "%s: unit %u: %016llx, the naive sum is %016llx", what, u,
                  (unsigned long long)got[u], (unsigned long long)want[u]);
            return;
        }
}

/* kdim, vdim: head dims in place of the preset's (0: the preset's), for rows of other
 * lengths (the digest instantiates 64-, 128- and 256-byte rows with a constant length). */
static void run_model(const char *preset, uint32_t layers, uint32_t kdim, uint32_t vdim)
{
    kvt_model_t m;
    if (kvt_model_preset(preset, &m) || kvt_model_truncate(&m, layers)) {
        CHECK(0, "no preset %s", preset);
        return;
    }
    if (kdim)
        m.m.k_head_dim = kdim;
    if (vdim)
        m.m.v_head_dim = vdim;
    for (uint32_t l = 0; l < m.m.num_layers; l++)
        if (m.layers[l].kind == KVW_LAYER_SWA)
            m.layers[l].window = WINDOW;
    kvt_model_relink(&m);
    kvw_chunk_t whole = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = TOKENS,
                         .chunk_end = TOKENS, .last_chunk = 1};
    side_t src;
    CHECK(side_make(&m, 1, 0, KVW_LAYOUT_NHD, 16, 11, &src) == 0, "source: %s", kvw_last_error());
    uint64_t want[1024], got[1024];
    static const uint32_t sizes[] = {1, 16, 64};
    for (int lay = 0; lay < 2; lay++)
        for (size_t si = 0; si < 3; si++) {
            side_t dst;
            char what[128];
            snprintf(what, sizeof(what), "%s (head dims %u/%u) %s pages of %u", preset,
                     m.m.k_head_dim, m.m.v_head_dim, lay ? "HND" : "NHD", sizes[si]);
            if (side_make(&m, 1, 0, lay ? KVW_LAYOUT_HND : KVW_LAYOUT_NHD, sizes[si],
                          100 + si * 2 + (uint64_t)lay, &dst)) {
                CHECK(0, "%s: %s", what, kvw_last_error());
                continue;
            }
            uint32_t n = kvw__digest_units(dst.r.h);
            CHECK(n == naive(&m, &dst.r, 0, UINT32_MAX, want) && n <= 1024,
                  "%s: %u units, the naive count differs", what, n);
            /* Destination pages, source pages: the naive sum. */
            memset(got, 0, sizeof(got));
            lib_digest(&src, &dst, &whole, true, got, n);
            compare(what, got, want, n);
            memset(got, 0, sizeof(got));
            lib_digest(&src, &dst, &whole, false, got, n);
            compare(what, got, want, n);
            /* Two chunks add up to the whole. */
            memset(got, 0, sizeof(got));
            kvw_chunk_t c1 = whole, c2 = whole;
            c1.chunk_end = 67, c1.last_chunk = 0;
            c2.chunk_begin = 67;
            lib_digest(&src, &dst, &c1, true, got, n);
            lib_digest(&src, &dst, &c2, true, got, n);
            compare(what, got, want, n);
            /* A TP2 prefill: its two ranks' parts (each over its own source pages) add
             * up, and each covers exactly its heads. */
            if (m.m.num_kv_heads % 2 == 0 && m.layers[m.m.num_layers - 1].kind != KVW_LAYER_MLA) {
                side_t p[2];
                memset(got, 0, sizeof(got));
                for (uint32_t j = 0; j < 2; j++) {
                    CHECK(side_make(&m, 2, j, j ? KVW_LAYOUT_HND : KVW_LAYOUT_NHD, 16, 40 + j,
                                    &p[j]) == 0, "%s: TP2 source: %s", what, kvw_last_error());
                    uint64_t part[1024] = {0}, pw[1024];
                    lib_digest(&p[j], &dst, &whole, false, part, n);
                    uint32_t hh = m.m.num_kv_heads / 2;
                    naive(&m, &dst.r, j * hh, (j + 1) * hh, pw);
                    compare("TP2 part", part, pw, n);
                    for (uint32_t u = 0; u < n; u++)
                        got[u] += part[u];
                }
                compare("TP2 sum", got, want, n);
                side_free(&p[0]);
                side_free(&p[1]);
            }
            /* One byte of one row changes one unit. */
            uint32_t bi = dst.r.num_bufs - 1;
            const kvw_buffer_desc_t *b = &dst.r.bufs[bi];
            kvt_rank_data(&dst.r, bi)[row_off(b, &dst.pg.side.full, 3, 0) + 1] ^= 1;
            memset(got, 0, sizeof(got));
            lib_digest(&src, &dst, &whole, true, got, n);
            uint32_t diffs = 0;
            for (uint32_t u = 0; u < n; u++)
                diffs += got[u] != want[u];
            CHECK(diffs == 1 && got[n - b->num_heads] != want[n - b->num_heads],
                  "%s: one changed byte changed %u units", what, diffs);
            side_free(&dst);
        }
    side_free(&src);
}

int main(void)
{
    /* Seeds depend on every part. */
    CHECK(kvw__digest_seed(1, 0, 0, 0) != kvw__digest_seed(0, 0, 0, 1) &&
              kvw__digest_seed(0, 1, 0, 0) != kvw__digest_seed(0, 0, 1, 0) &&
              kvw__digest_seed(3, 1, 2, 77) == seed_of(3, 1, 2, 77),
          "seed mixing");
    run_model("gpt-oss-120b", 2, 0, 0);  /* 128-byte rows */
    run_model("gpt-oss-120b", 2, 32, 128); /* K 64-byte rows, V 256-byte rows */
    run_model("gpt-oss-120b", 2, 48, 20);  /* 96- and 40-byte rows */
    run_model("deepseek-v3", 2, 0, 0);
    if (failures) {
        fprintf(stderr, "test_digest: %d failures\n", failures);
        return 1;
    }
    printf("test_digest: all checks passed\n");
    return 0;
}
