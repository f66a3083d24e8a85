/*
 * fuzz_plan: plan validation against real host buffers.
 *
 * Input (see fzp_read_pages for the page lists):
 *   u8  configuration: which source instance and destination rank (below)
 *   u8  flags: bit 0 wide chunk fields (u64, else u8), bit 1 wide page lists (u64 first
 *       token, u32 indices; else u8), bit 2 last chunk
 *   chunk: num_tokens, chunk_begin, chunk_end, prefix_len
 *   source page lists (full, swa, state slot), then destination page lists
 *
 * For every rank of the source instance kvw_plan_create runs with the same chunk and
 * page lists (they share one geometry). When every plan is accepted, each is executed
 * with kvw_plan_exec_cpu into the destination rank's guarded buffers, expanded with
 * kvw_plan_expand (every run must lie inside both buffers) and its statistics checked
 * against the expansion. Then the destination bytes are compared with the test kit's
 * naive reference applied to the same inputs (differential check), and the guard
 * bytes around every buffer are checked. AddressSanitizer catches any out-of-bounds
 * access that validation let through.
 */
#include "fuzz_common.h"

#define FZP_MAX_SRC 2
#define FZP_MAX_PAGES 64

typedef struct fzp_cfg {
    const char *name;
    uint32_t num_src;
    kvt_rank_t *src[FZP_MAX_SRC];
    kvt_rank_t *dst;
} fzp_cfg_t;

#define FZP_NUM_CFG 5
static fzp_cfg_t fzp_cfgs[FZP_NUM_CFG];
static uint64_t fzp_ref_rejects;

static void fzp_init(void)
{
    static int done;
    if (done)
        return;
    done = 1;
    /* 0: TP2 (NHD, pages 4/4) -> TP1 (HND, pages 8/4). */
    fzc_rank_cfg_t s2a = {.tp = 2, .rank = 0, .page_full = 4, .page_swa = 4};
    fzc_rank_cfg_t s2b = {.tp = 2, .rank = 1, .page_full = 4, .page_swa = 4};
    fzc_rank_cfg_t d1 = {.tp = 1, .page_full = 8, .page_swa = 4, .layout = KVW_LAYOUT_HND};
    kvt_rank_t *a = fzc_rank_build(&s2a, 101), *b = fzc_rank_build(&s2b, 102);
    fzp_cfgs[0] = (fzp_cfg_t){"tp2_to_tp1", 2, {a, b}, fzc_rank_build(&d1, 103)};
    /* 1: TP1 (pages 4/4) -> TP2 rank 1 (fused KV). */
    fzc_rank_cfg_t s1 = {.tp = 1, .page_full = 4, .page_swa = 4};
    fzc_rank_cfg_t d2 = {.tp = 2, .rank = 1, .page_full = 4, .page_swa = 4, .fused = 1};
    fzp_cfgs[1] = (fzp_cfg_t){"tp1_to_tp2r1", 1, {fzc_rank_build(&s1, 104)}, fzc_rank_build(&d2, 105)};
    /* 2: TP1 (HND fused, pages 2/4) -> TP1 (NHD, pages 4/2). */
    fzc_rank_cfg_t s1h = {.tp = 1, .page_full = 2, .page_swa = 4, .layout = KVW_LAYOUT_HND,
                          .fused = 1};
    fzc_rank_cfg_t d1n = {.tp = 1, .page_full = 4, .page_swa = 2};
    fzp_cfgs[2] = (fzp_cfg_t){"tp1_to_tp1", 1, {fzc_rank_build(&s1h, 106)}, fzc_rank_build(&d1n, 107)};
    /* 3: TP2 -> TP4 rank 3 (pages 1/1). */
    fzc_rank_cfg_t d4 = {.tp = 4, .rank = 3, .page_full = 1, .page_swa = 1};
    fzp_cfgs[3] = (fzp_cfg_t){"tp2_to_tp4r3", 2, {a, b}, fzc_rank_build(&d4, 108)};
    /* 4: TP2 -> TP2 rank 0 (HND, pages 8/8). */
    fzc_rank_cfg_t d2h = {.tp = 2, .rank = 0, .page_full = 8, .page_swa = 8,
                          .layout = KVW_LAYOUT_HND};
    fzp_cfgs[4] = (fzp_cfg_t){"tp2_to_tp2r0", 2, {a, b}, fzc_rank_build(&d2h, 109)};
}

typedef struct fzp_side {
    kvw_side_pages_t side;
    uint32_t full[FZP_MAX_PAGES], swa[FZP_MAX_PAGES];
} fzp_side_t;

static void fzp_read_list(fzc_in_t *in, bool wide, kvw_pages_t *pl, uint32_t *store)
{
    pl->field_mask = KVW_PAGES_FIELDS_ALL;
    pl->first_token = wide ? fzc_u64(in) : fzc_u8(in);
    pl->num_pages = fzc_u8(in) % (FZP_MAX_PAGES + 1);
    for (uint32_t i = 0; i < pl->num_pages; i++)
        store[i] = wide ? fzc_u32(in) : fzc_u8(in);
    pl->pages = store;
}

static void fzp_read_pages(fzc_in_t *in, bool wide, fzp_side_t *s)
{
    memset(s, 0, sizeof(*s));
    fzp_read_list(in, wide, &s->side.full, s->full);
    fzp_read_list(in, wide, &s->side.swa, s->swa);
    s->side.field_mask = KVW_SIDE_PAGES_FIELDS_ALL;
    s->side.state_slot = wide ? (int64_t)fzc_u64(in) : (int64_t)(int8_t)fzc_u8(in);
}

typedef struct fzp_walk {
    kvw_rank_h src, dst;
    uint64_t runs, bytes;
} fzp_walk_t;

static kvw_status_t fzp_run_cb(void *arg, const kvw_run_t *run)
{
    fzp_walk_t *w = arg;
    if (run->src_buf >= kvw_rank_num_buffers(w->src) || run->dst_buf >= kvw_rank_num_buffers(w->dst))
        fzc_fail("run names buffers %u -> %u", run->src_buf, run->dst_buf);
    uint64_t sl = kvw_rank_buffer(w->src, run->src_buf)->length;
    uint64_t dl = kvw_rank_buffer(w->dst, run->dst_buf)->length;
    if (run->len == 0 || run->src_off > sl || run->len > sl - run->src_off ||
        run->dst_off > dl || run->len > dl - run->dst_off)
        fzc_fail("run [%llu, +%llu) -> [%llu, +%llu) outside buffers of %llu and %llu bytes",
                 (unsigned long long)run->src_off, (unsigned long long)run->len,
                 (unsigned long long)run->dst_off, (unsigned long long)run->len,
                 (unsigned long long)sl, (unsigned long long)dl);
    w->runs++;
    w->bytes += run->len;
    return KVW_OK;
}

int kvw_fuzz_plan(const uint8_t *data, size_t size)
{
    fzp_init();
    fzc_in_t in = {data, size, 0};
    if (size < 2)
        return 0;
    fzp_cfg_t *cfg = &fzp_cfgs[fzc_u8(&in) % FZP_NUM_CFG];
    uint8_t flags = fzc_u8(&in);
    bool wide_chunk = flags & 1, wide_pages = flags & 2;
    kvw_chunk_t chunk = {.field_mask = KVW_CHUNK_FIELDS_ALL};
    chunk.num_tokens = wide_chunk ? fzc_u64(&in) : fzc_u8(&in);
    chunk.chunk_begin = wide_chunk ? fzc_u64(&in) : fzc_u8(&in);
    chunk.chunk_end = wide_chunk ? fzc_u64(&in) : fzc_u8(&in);
    chunk.prefix_len = wide_chunk ? fzc_u64(&in) : fzc_u8(&in);
    chunk.last_chunk = (flags & 4) != 0;
    fzp_side_t sp, dp;
    fzp_read_pages(&in, wide_pages, &sp);
    fzp_read_pages(&in, wide_pages, &dp);

    kvw_plan_h plans[FZP_MAX_SRC] = {0};
    uint32_t ok = 0;
    for (uint32_t i = 0; i < cfg->num_src; i++)
        if (kvw_plan_create(cfg->src[i]->h, cfg->dst->h, &chunk, &sp.side, &dp.side, &plans[i]) ==
            KVW_OK)
            ok++;
        else
            FZC_SAY("%s: plan from source %u: %s\n", cfg->name, i, kvw_last_error());
    if (ok == cfg->num_src) {
        kvt_rank_t *dst = cfg->dst;
        kvt_rank_clear(dst, 0);
        for (uint32_t i = 0; i < cfg->num_src; i++) {
            kvw_plan_stats_t stats = {.field_mask = KVW_PLAN_STATS_FIELDS_ALL};
            if (kvw_plan_stats(plans[i], &stats) != KVW_OK)
                fzc_fail("stats of a valid plan failed: %s", kvw_last_error());
            if (kvw_plan_exec_cpu(plans[i]) != KVW_OK)
                fzc_fail("exec of a valid plan failed: %s", kvw_last_error());
            fzp_walk_t w = {.src = cfg->src[i]->h, .dst = dst->h};
            if (kvw_plan_expand(plans[i], fzp_run_cb, &w) != KVW_OK)
                fzc_fail("expand of a valid plan failed: %s", kvw_last_error());
            if (w.bytes != stats.bytes || w.runs != stats.runs_coalesced)
                fzc_fail("%s: plan stats say %llu bytes in %llu runs, expansion gives %llu in %llu",
                         cfg->name, (unsigned long long)stats.bytes,
                         (unsigned long long)stats.runs_coalesced, (unsigned long long)w.bytes,
                         (unsigned long long)w.runs);
        }
        fzc_check_guards(dst, "destination after exec");
        /* Differential check against the naive reference. */
        kvt_copy_t expect;
        if (kvt_copy_zeroed(dst, &expect) != KVW_OK)
            fzc_fail("harness out of memory");
        kvt_ref_side_t srcs[FZP_MAX_SRC];
        uint8_t *sdata[FZP_MAX_SRC][64];
        for (uint32_t i = 0; i < cfg->num_src; i++) {
            for (uint32_t b = 0; b < cfg->src[i]->num_bufs && b < 64; b++)
                sdata[i][b] = kvt_rank_data(cfg->src[i], b);
            srcs[i] = kvt_ref_side(cfg->src[i], &sp.side, sdata[i]);
        }
        kvt_ref_side_t ds = kvt_ref_side(dst, &dp.side, expect.data);
        char msg[512];
        if (kvt_ref_transfer(&cfg->src[0]->model.m, srcs, cfg->num_src, &ds, &chunk, NULL, NULL,
                             msg, sizeof(msg)) == 0) {
            if (kvt_copy_compare(dst, &expect, "plan vs reference", msg, sizeof(msg)))
                fzc_fail("%s: chunk [%llu, %llu) of %llu tokens, prefix %llu, last %d: %s",
                         cfg->name, (unsigned long long)chunk.chunk_begin,
                         (unsigned long long)chunk.chunk_end,
                         (unsigned long long)chunk.num_tokens,
                         (unsigned long long)chunk.prefix_len, chunk.last_chunk, msg);
            FZC_SAY("%s: %u plans executed, bytes match the reference\n", cfg->name, ok);
        } else if (fzp_ref_rejects++ < 5) {
            fprintf(stderr, "fuzz_plan note: %s: the reference refuses a chunk the plans "
                    "accepted: %s\n", cfg->name, msg);
        }
        kvt_copy_free(&expect);
    }
    for (uint32_t i = 0; i < cfg->num_src; i++)
        kvw_plan_destroy(plans[i]);
    return 0;
}

#ifndef KVW_FUZZ_NO_ENTRY
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    return kvw_fuzz_plan(data, size);
}
#endif
