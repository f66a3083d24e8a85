/*
 * The CUDA kernels' address arithmetic, run on the CPU.
 *
 * src/cuda/copy_core.h holds every index computation the copy kernels make (segment
 * lookup, job ranges, per-token page lookups, unit addresses, the staging order); the
 * kernels and kvwc_emulate() call the same functions. For every case of gpu_common.c
 * this test lays the plans out exactly as the module uploads them (through the core's
 * own flattening, kvw__cuda_plan_in_make), then:
 *
 *   - direct: runs the emulated kernel from source to destination arenas and compares
 *     every destination byte with kvw_plan_exec_cpu (itself checked against testkit's
 *     naive reference), and every guard byte around every buffer;
 *   - staged: gathers each plan into a staging buffer, compares it byte for byte with a
 *     CPU gather in kvw_plan_expand order (the documented staging layout), scatters it
 *     and compares the destination again.
 *
 * It needs no GPU and runs wherever the CUDA module is built. Exit 0 when every check
 * passed, 1 otherwise.
 */
#include <kvwire/cuda.h>
#include <kvwire/kvwire.h>

#include "cuda/copy_core.h"
#include "gpu_common.h"
#include "../check.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A plan laid out as the module would upload it, in host memory. */
typedef struct emu_plan {
    void *blob;
    const uint32_t *job_seg;
    uint32_t num_segs;
    uint64_t num_jobs;
    uint64_t bytes;
    uint32_t widths[17]; /* segments x modes, by unit width */
} emu_plan_t;

/* Direct-mode jobs of every case's plans: [0] the kernel's slow path, [1] its fast path. */
static uint64_t direct_jobs[2];

static int emu_prepare_in(const kvwc_plan_in_t *in, emu_plan_t *e);

static int emu_prepare(kvw_plan_h plan, emu_plan_t *e)
{
    kvwc_map_in_t maps[2 * KVW_NUM_POOLS];
    kvwc_plan_in_t in;
    memset(e, 0, sizeof(*e));
    kvw_status_t st = kvw__cuda_plan_in_make(plan, KVW_CUDA_DIRECT | KVW_CUDA_GATHER |
                                                       KVW_CUDA_SCATTER, maps, &in);
    CHECK(st == KVW_OK, "kvw__cuda_plan_in_make: %s (%s)", kvw_status_string(st),
          kvw_last_error());
    if (st != KVW_OK)
        return -1;
    int rc = emu_prepare_in(&in, e);
    kvw__cuda_plan_in_free(&in);
    return rc;
}

/* Several plans flattened as one launch of the protocol's worker lays them out
 * (kvw__cuda_plan_in_make_n: each plan's page maps after the previous ones'). */
static int emu_prepare_n(const struct kvw_plan *const *plans, uint32_t n, emu_plan_t *e)
{
    kvwc_plan_in_t in;
    memset(e, 0, sizeof(*e));
    kvw_status_t st = kvw__cuda_plan_in_make_n(plans, n, KVW_CUDA_DIRECT, &in);
    CHECK(st == KVW_OK, "kvw__cuda_plan_in_make_n(%u plans): %s (%s)", n,
          kvw_status_string(st), kvw_last_error());
    if (st != KVW_OK)
        return -1;
    CHECK(in.num_maps == 2 * KVW_NUM_POOLS * n, "%u plans flattened with %u page maps", n,
          in.num_maps);
    int rc = emu_prepare_in(&in, e);
    kvw__cuda_plan_in_free_n(&in);
    return rc;
}

static int emu_prepare_in(const kvwc_plan_in_t *inp, emu_plan_t *e)
{
    const kvwc_plan_in_t in = *inp;
    kvwc_layout_t L;
    const char *why = NULL;
    int rc = kvwc_blob_layout(&in, &L, &why);
    CHECK(rc == 0, "layout: %s", why);
    e->blob = rc == 0 ? malloc(L.size ? L.size : 1) : NULL;
    if (rc == 0 && e->blob) {
        kvwc_blob_fill(&in, &L, e->blob, (uint64_t)(uintptr_t)e->blob);
        e->num_segs = L.num_segs;
        e->num_jobs = L.num_jobs;
        e->job_seg = (const uint32_t *)((uint8_t *)e->blob + L.jobs_off);
    } else {
        rc = -1;
    }
    e->bytes = in.bytes;
    if (rc == 0) {
        const kvwc_dseg_t *segs = e->blob;
        uint64_t sum = 0;
        for (uint32_t i = 0; i < e->num_segs; i++) {
            for (int m = 0; m < KVWC_NUM_MODES; m++)
                e->widths[segs[i].w[m]]++;
            sum += segs[i].bytes;
            CHECK(i == 0 || segs[i].job_begin > segs[i - 1].job_begin,
                  "empty job range for segment %u", i);
        }
        for (uint64_t j = 0; j < e->num_jobs; j++) {
            const kvwc_dseg_t *sg = &segs[e->job_seg[j]];
            CHECK(j >= sg->job_begin && (j - sg->job_begin) * sg->job_bytes < sg->bytes,
                  "job %llu maps to segment %u, which does not hold it", (unsigned long long)j,
                  e->job_seg[j]);
        }
        CHECK(sum == e->bytes, "laid-out segments hold %llu bytes, the plan %llu",
              (unsigned long long)sum, (unsigned long long)e->bytes);
        /* Which path of the direct kernel each job takes (as kvwc_direct_kernel decides). */
        for (uint64_t j = 0; j < e->num_jobs; j++) {
            uint32_t w;
            kvwc_jobgeo_t g;
            uint64_t ss, sd;
            const kvwc_dseg_t *sg = kvwc_job_at(segs, e->job_seg, j, KVWC_MODE_DIRECT, 16, &w, &g);
            direct_jobs[kvwc_direct_fast(sg, &g, w, &ss, &sd) ? 1 : 0]++;
        }
    }
    return rc;
}

static void emu_run(emu_plan_t *e, int mode, uint8_t *stage)
{
    static kvwc_tokens_t tt;
    kvwc_emulate(e->blob, e->job_seg, 0, e->num_jobs, mode, (uint64_t)(uintptr_t)stage, 0,
                 KVWC_WINDOW_ALL, 16, &tt);
}

/* The window [lo, hi) of the staging stream, as a staged window moves it: `buf` holds
 * only the window's bytes, and only the jobs of the segments overlapping it run. */
static void emu_run_window(kvw_plan_h plan, emu_plan_t *e, int mode, uint8_t *buf, uint64_t lo,
                           uint64_t hi)
{
    static kvwc_tokens_t tt;
    kvwc_map_in_t maps[2 * KVW_NUM_POOLS];
    kvwc_plan_in_t in;
    if (kvw__cuda_plan_in_make(plan, KVW_CUDA_DIRECT | KVW_CUDA_GATHER | KVW_CUDA_SCATTER, maps,
                               &in) != KVW_OK) {
        CHECK(0, "kvw__cuda_plan_in_make: %s", kvw_last_error());
        return;
    }
    kvwc_window_t w, wa;
    kvwc_window_of(&in, lo, hi, &w);
    /* A plan uploaded once for its windows finds them from its spans (binary search):
     * the very same jobs and unit width. */
    kvwc_span_t *sp = malloc(sizeof(*sp) * ((size_t)in.num_segs + 1));
    CHECK(sp != NULL, "out of memory");
    if (sp) {
        uint32_t n = kvwc_spans_fill(&in, sp);
        kvwc_window_at(sp, n, lo, hi, &wa);
        CHECK(wa.j0 == w.j0 && wa.j1 == w.j1 && wa.wcap == w.wcap && wa.lo == w.lo &&
                  wa.hi == w.hi,
              "window [%llu, %llu): spans give jobs [%llu, %llu) cap %u, the segment walk "
              "[%llu, %llu) cap %u", (unsigned long long)lo, (unsigned long long)hi,
              (unsigned long long)wa.j0, (unsigned long long)wa.j1, wa.wcap,
              (unsigned long long)w.j0, (unsigned long long)w.j1, w.wcap);
        free(sp);
    }
    kvw__cuda_plan_in_free(&in);
    kvwc_emulate(e->blob, e->job_seg, w.j0, w.j1, mode, (uint64_t)(uintptr_t)buf - lo, w.lo,
                 w.hi, w.wcap, &tt);
}

/* Source and destination arenas in host memory, laid out like the GPU check's. */
typedef struct arena {
    uint64_t *offs;
    uint64_t total;
    uint8_t *img, *init;
    kvw_rank_h *h;
} arena_t;

static int arena_make(arena_t *a, const gc_inst_t *in, uint32_t misalign)
{
    memset(a, 0, sizeof(*a));
    a->offs = calloc(gc_total_bufs(in) + 1, sizeof(uint64_t));
    a->h = calloc(in->n, sizeof(kvw_rank_h));
    if (!a->offs || !a->h)
        return -1;
    a->total = gc_arena_layout(in, misalign, a->offs);
    a->img = malloc(a->total);
    a->init = malloc(a->total);
    if (!a->img || !a->init)
        return -1;
    gc_arena_image(in, a->offs, a->total, a->init);
    memcpy(a->img, a->init, a->total);
    for (uint32_t r = 0; r < in->n; r++) {
        uint8_t **addrs = calloc(in->r[r].num_bufs + 1, sizeof(uint8_t *));
        if (!addrs)
            return -1;
        for (uint32_t b = 0; b < in->r[r].num_bufs; b++)
            addrs[b] = a->img + a->offs[gc_buf_index(in, r, b)];
        /* CUDA memory kind over host memory: the emulator dereferences the addresses on
         * the CPU, and the flattening insists on KVW_MEM_CUDA (so the check of each
         * address's kind, which would refuse it wherever CUDA can be asked, is skipped). */
        kvw_status_t st = gc_rank_clone_unchecked(&in->r[r], KVW_MEM_CUDA, 0, addrs, &a->h[r]);
        free(addrs);
        CHECK(st == KVW_OK, "rank clone: %s (%s)", kvw_status_string(st), kvw_last_error());
        if (st != KVW_OK)
            return -1;
    }
    return 0;
}

static void arena_free(arena_t *a, const gc_inst_t *in)
{
    if (a->h)
        for (uint32_t r = 0; r < in->n; r++)
            kvw_rank_destroy(a->h[r]);
    free(a->h);
    free(a->offs);
    free(a->img);
    free(a->init);
}

static void compare_dst(const gc_inst_t *D, arena_t *da, kvt_copy_t *exp, const char *what)
{
    char msg[512];
    CHECK(gc_arena_check_poison(D, da->offs, da->total, da->img, msg, sizeof(msg)) == 0,
          "%s: %s", what, msg);
    for (uint32_t d = 0; d < D->n; d++) {
        kvt_copy_t view;
        if (gc_arena_view(D, d, da->offs, da->img, &view)) {
            CHECK(0, "out of memory");
            return;
        }
        char w[96];
        snprintf(w, sizeof(w), "%s, dst rank %u", what, d);
        CHECK(kvt_copy_compare2(&D->r[d], &view, &exp[d], w, msg, sizeof(msg)) == 0, "%s", msg);
        gc_view_free(&view);
    }
}

static void run_case(const gc_case_t *c)
{
    kvt_model_t model;
    gc_inst_t S, D;
    arena_t sa, da;
    char msg[512];
    uint64_t bytes = 0, staged = 0;
    uint32_t widths[17] = {0};
    kvw_chunk_t ch = gc_chunk(c);
    kvt_copy_t *exp = NULL;
    cur_case = c->name;
    memset(&S, 0, sizeof(S));
    memset(&D, 0, sizeof(D));
    memset(&sa, 0, sizeof(sa));
    memset(&da, 0, sizeof(da));

    if (gc_model(c, &model)) {
        CHECK(0, "unknown model %s", c->model);
        return;
    }
    uint64_t seed = gc_seed(c);
    if (gc_inst_build(&S, &model, c, 0, seed, msg, sizeof(msg)) ||
        gc_inst_build(&D, &model, c, 1, seed + 1, msg, sizeof(msg))) {
        CHECK(0, "%s", msg);
        goto out;
    }
    exp = calloc(D.n, sizeof(*exp));
    if (!exp)
        goto out;
    for (uint32_t d = 0; d < D.n; d++)
        if (kvt_copy_make(&D.r[d], &exp[d]) != KVW_OK)
            goto out;
    if (gc_expected(&model, c, &S, &D, exp, &bytes, msg, sizeof(msg))) {
        CHECK(0, "%s", msg);
        goto out;
    }
    if (arena_make(&sa, &S, c->misalign) || arena_make(&da, &D, c->misalign)) {
        CHECK(0, "arenas");
        goto out;
    }

    /* Direct. */
    for (uint32_t d = 0; d < D.n; d++)
        for (uint32_t s = 0; s < S.n; s++) {
            kvw_plan_h plan = NULL;
            kvw_status_t st = kvw_plan_create(sa.h[s], da.h[d], &ch, &S.pg[s].side,
                                              &D.pg[d].side, &plan);
            CHECK(st == KVW_OK, "src %u dst %u: kvw_plan_create: %s (%s)", s, d,
                  kvw_status_string(st), kvw_last_error());
            if (st != KVW_OK)
                continue;
            emu_plan_t e;
            if (emu_prepare(plan, &e) == 0) {
                emu_run(&e, KVWC_MODE_DIRECT, NULL);
                for (int w = 0; w <= 16; w++)
                    widths[w] += e.widths[w];
            }
            free(e.blob);
            kvw_plan_destroy(plan);
        }
    compare_dst(&D, &da, exp, "direct");

    /* Direct, the plans of every (source, destination) pair launched together, up to
     * the most one launch takes (the protocol's worker launches small rooms' steps so):
     * every destination byte again, each exactly where its own plan puts it. */
    memcpy(da.img, da.init, da.total);
    {
        enum { MAXN = KVWC_MAX_MAPS / (2 * KVW_NUM_POOLS) };
        const struct kvw_plan *group[MAXN];
        uint32_t ng = 0, pairs = S.n * D.n, launched = 0;
        uint64_t nbytes = 0;
        for (uint32_t k = 0; k < pairs; k++) {
            uint32_t d = k / S.n, s = k % S.n;
            kvw_plan_h plan = NULL;
            if (kvw_plan_create(sa.h[s], da.h[d], &ch, &S.pg[s].side, &D.pg[d].side, &plan) !=
                KVW_OK)
                continue;
            group[ng++] = plan;
            if (ng < MAXN && k + 1 < pairs)
                continue;
            emu_plan_t e;
            if (emu_prepare_n(group, ng, &e) == 0) {
                emu_run(&e, KVWC_MODE_DIRECT, NULL);
                nbytes += e.bytes;
                launched++;
            }
            free(e.blob);
            for (uint32_t j = 0; j < ng; j++)
                kvw_plan_destroy((kvw_plan_h)group[j]);
            ng = 0;
        }
        CHECK(nbytes == bytes, "plans launched together moved %llu bytes, the plans %llu",
              (unsigned long long)nbytes, (unsigned long long)bytes);
        CHECK(launched == (pairs + MAXN - 1) / MAXN, "%u launches for %u plans", launched,
              pairs);
    }
    compare_dst(&D, &da, exp, "direct, plans launched together");

    /* Staged: gather, check the staging order, scatter. */
    memcpy(da.img, da.init, da.total);
    for (uint32_t d = 0; d < D.n; d++)
        for (uint32_t s = 0; s < S.n; s++) {
            kvw_plan_h plan = NULL;
            kvw_status_t st = kvw_plan_create(sa.h[s], da.h[d], &ch, &S.pg[s].side,
                                              &D.pg[d].side, &plan);
            if (st != KVW_OK)
                continue;
            emu_plan_t e;
            if (emu_prepare(plan, &e) == 0) {
                uint64_t n = (e.bytes + 15) / 16 * 16 + 16;
                uint8_t *stage = aligned_alloc(16, n), *ref = malloc(n);
                if (stage && ref) {
                    memset(stage, 0xEE, n);
                    memset(ref, 0xEE, n);
                    emu_run(&e, KVWC_MODE_GATHER, stage);
                    st = gc_expand_gather(plan, &S.r[s], ref);
                    CHECK(st == KVW_OK, "kvw_plan_expand: %s", kvw_status_string(st));
                    uint64_t bad = n;
                    for (uint64_t i = 0; i < n && bad == n; i++)
                        if (stage[i] != ref[i])
                            bad = i;
                    CHECK(bad == n,
                          "src %u dst %u: staging differs from kvw_plan_expand order at byte "
                          "%llu of %llu (0x%02x, expected 0x%02x)", s, d,
                          (unsigned long long)bad, (unsigned long long)e.bytes,
                          bad < n ? stage[bad] : 0, bad < n ? ref[bad] : 0);
                    /* The same stream in windows of uneven sizes (edges at any byte),
                     * each gathered into a buffer of its own and compared, then
                     * scattered window by window: every destination byte exactly once. */
                    uint8_t *win = malloc(e.bytes + 1);
                    uint64_t seed = e.bytes * 2654435761u + s * 31 + d;
                    for (uint64_t lo = 0, hi; win && lo < e.bytes; lo = hi) {
                        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
                        uint64_t span = 1 + (seed >> 33) % (e.bytes / 3 + 1);
                        if ((seed >> 20) & 1)
                            span = (span + 4095) & ~4095ull; /* aligned edges too */
                        hi = lo + span < e.bytes ? lo + span : e.bytes;
                        memset(win, 0xC3, hi - lo + 1);
                        emu_run_window(plan, &e, KVWC_MODE_GATHER, win, lo, hi);
                        CHECK(memcmp(win, ref + lo, hi - lo) == 0 && win[hi - lo] == 0xC3,
                              "src %u dst %u: window [%llu, %llu) gathers other bytes than "
                              "the stream holds there, or writes past its end", s, d,
                              (unsigned long long)lo, (unsigned long long)hi);
                        emu_run_window(plan, &e, KVWC_MODE_SCATTER, win, lo, hi);
                    }
                    CHECK(win != NULL, "out of memory");
                    free(win);
                    staged += e.bytes;
                } else {
                    CHECK(0, "out of memory");
                }
                free(stage);
                free(ref);
            }
            free(e.blob);
            kvw_plan_destroy(plan);
        }
    compare_dst(&D, &da, exp, "gather+scatter");
    CHECK(memcmp(sa.img, sa.init, sa.total) == 0, "the source arena changed");
    CHECK(staged == bytes, "staged %llu bytes, the plans %llu", (unsigned long long)staged,
          (unsigned long long)bytes);
    printf("  %-36s %2u -> %-2u %10llu bytes  widths (segments x modes) 16:%u 8:%u 4:%u "
           "2:%u 1:%u\n", c->name, S.n, D.n, (unsigned long long)bytes, widths[16], widths[8],
           widths[4], widths[2], widths[1]);
out:
    if (exp)
        for (uint32_t d = 0; d < D.n; d++)
            kvt_copy_free(&exp[d]);
    free(exp);
    arena_free(&sa, &S);
    arena_free(&da, &D);
    gc_inst_free(&S);
    gc_inst_free(&D);
}

/* The flattening refuses buffers the GPU cannot address, with a message. */
static void check_host_refused(void)
{
    cur_case = "host buffers refused";
    const gc_case_t *c = &gc_cases[0];
    kvt_model_t model;
    gc_inst_t S, D;
    char msg[256];
    if (gc_model(c, &model) || gc_inst_build(&S, &model, c, 0, 1, msg, sizeof(msg)))
        return;
    if (gc_inst_build(&D, &model, c, 1, 2, msg, sizeof(msg))) {
        gc_inst_free(&S);
        return;
    }
    kvw_chunk_t ch = gc_chunk(c);
    kvw_plan_h plan = NULL;
    kvw_status_t st = kvw_plan_create(S.r[0].h, D.r[0].h, &ch, &S.pg[0].side, &D.pg[0].side,
                                      &plan);
    CHECK(st == KVW_OK, "kvw_plan_create: %s", kvw_last_error());
    if (st == KVW_OK) {
        kvwc_map_in_t maps[2 * KVW_NUM_POOLS];
        kvwc_plan_in_t in;
        st = kvw__cuda_plan_in_make(plan, KVW_CUDA_DIRECT, maps, &in);
        CHECK(st == KVW_ERR_INVALID_PARAM && kvt_contains(kvw_last_error(), "KVW_MEM_CUDA"),
              "host buffers: got %s (%s)", kvw_status_string(st), kvw_last_error());
        if (st == KVW_OK)
            kvw__cuda_plan_in_free(&in);
        kvw_plan_destroy(plan);
    }
    gc_inst_free(&S);
    gc_inst_free(&D);
}

/*
 * The direct kernel's addressing on a hand-built segment, every expected value derived
 * here from the layout rather than by the code under test. Two heads of 128 bytes (a
 * 256-byte row, 16 units of 16 bytes) move from heads 2-3 of an 8-head source (token
 * stride 1024, pages of 16 tokens, page stride 16 KiB, pages 3, 0, 7) into a 2-head
 * destination (token stride 256, pages of 32 tokens, page stride 8 KiB, pages 1, 4);
 * tokens [0, 48).
 */
static void check_direct_addressing(void)
{
    cur_case = "direct addressing by hand";
    static const uint32_t sp[3] = {3, 0, 7}, dp[2] = {1, 4};
    const uint64_t SB = 0x100000, DB = 0x900000;
    kvwc_dseg_t s;
    memset(&s, 0, sizeof(s));
    s.src = (kvwc_dside_t){.base = SB + 256, .page_stride = 16384, .token_stride = 1024,
                           .head_stride = 128, .first_token = 0, .pages = sp, .page_size = 16,
                           .contig = 1};
    s.dst = (kvwc_dside_t){.base = DB, .page_stride = 8192, .token_stride = 256,
                           .head_stride = 128, .first_token = 0, .pages = dp, .page_size = 32,
                           .contig = 1};
    s.tok_begin = 0;
    s.tok_end = 48;
    s.row_bytes = 256;
    s.bytes = 48 * 256;
    s.head_bytes = 128;
    kvwc_jobgeo_t g;
    uint64_t ss = 0, sd = 0, src = 0, dst = 0;
    /* Tokens [0, 16): source page 3, destination page 1, both from their first token. A
     * 128-unit stride is 8 tokens: steps of 8 x 1024 and 8 x 256 bytes. */
    kvwc_job_geo(&s, 0, 4096, 16, &g);
    CHECK(g.row_units == 16 && g.ub == 0 && g.ue == 256, "geometry: %u units per row, [%u, %u)",
          g.row_units, g.ub, g.ue);
    CHECK(kvwc_direct_affine(&s, &g, 128, &ss, &sd) && ss == 8192 && sd == 2048,
          "tokens [0, 16): fast path with steps %llu / %llu", (unsigned long long)ss,
          (unsigned long long)sd);
    kvwc_direct_addrs(&s, 16, &g, 0, &src, &dst);
    CHECK(src == SB + 256 + 3 * 16384 && dst == DB + 1 * 8192, "unit 0 at %#llx -> %#llx",
          (unsigned long long)src, (unsigned long long)dst);
    kvwc_direct_addrs(&s, 16, &g, 17, &src, &dst); /* token 1, 16 bytes into the row */
    CHECK(src == SB + 256 + 3 * 16384 + 1024 + 16 && dst == DB + 8192 + 256 + 16,
          "unit 17 at %#llx -> %#llx", (unsigned long long)src, (unsigned long long)dst);
    kvwc_direct_addrs(&s, 16, &g, 133, &src, &dst); /* token 8, 80 bytes in: unit 5 + a step */
    CHECK(src == SB + 256 + 3 * 16384 + 5 * 16 + 8192 && dst == DB + 8192 + 5 * 16 + 2048,
          "unit 133 at %#llx -> %#llx", (unsigned long long)src, (unsigned long long)dst);
    /* Tokens [16, 32): source page 0 (its second entry), the destination's page 1 still. */
    kvwc_job_geo(&s, 4096, 8192, 16, &g);
    CHECK(kvwc_direct_affine(&s, &g, 128, &ss, &sd), "tokens [16, 32): fast path");
    kvwc_direct_addrs(&s, 16, &g, 0, &src, &dst);
    CHECK(src == SB + 256 + 0 * 16384 && dst == DB + 8192 + 16 * 256,
          "token 16 at %#llx -> %#llx", (unsigned long long)src, (unsigned long long)dst);
    /* Tokens [15, 31) cross the source's page boundary at 16; [24, 40) cross both at 32. */
    kvwc_job_geo(&s, 15 * 256, 31 * 256, 16, &g);
    CHECK(!kvwc_direct_affine(&s, &g, 128, &ss, &sd), "tokens [15, 31): no fast path");
    kvwc_direct_addrs(&s, 16, &g, 16, &src, &dst); /* token 16 */
    CHECK(src == SB + 256 + 0 * 16384 && dst == DB + 8192 + 16 * 256,
          "token 16 (slow path) at %#llx -> %#llx", (unsigned long long)src,
          (unsigned long long)dst);
    kvwc_job_geo(&s, 24 * 256, 40 * 256, 16, &g);
    CHECK(!kvwc_direct_affine(&s, &g, 128, &ss, &sd), "tokens [24, 40): no fast path");
    kvwc_direct_addrs(&s, 16, &g, 8 * 16, &src, &dst); /* token 32: pages 7 and 4 */
    CHECK(src == SB + 256 + 7 * 16384 && dst == DB + 4 * 8192, "token 32 at %#llx -> %#llx",
          (unsigned long long)src, (unsigned long long)dst);
    /* The kernel's own test: a whole job of 16 KiB (64 tokens, 1024 units, one pass of
     * 128 threads x 8) inside one page per side takes the fast path; half of one does not. */
    s.src.page_size = 64;
    s.dst.page_size = 64;
    s.tok_end = 64;
    s.bytes = 64 * 256;
    kvwc_job_geo(&s, 0, 16384, 16, &g);
    CHECK(kvwc_direct_fast(&s, &g, 16, &ss, &sd) && !kvwc_direct_fast(&s, &g, 8, &ss, &sd),
          "a whole job in one page: the fast path for 16-byte units only");
    kvwc_job_geo(&s, 0, 8192, 16, &g);
    CHECK(!kvwc_direct_fast(&s, &g, 16, &ss, &sd), "half a job (512 units): no fast path");
    /* A 96-byte row (6 units) does not divide a 128-unit stride. */
    s.row_bytes = 96;
    s.head_bytes = 48;
    s.bytes = 48 * 96;
    kvwc_job_geo(&s, 0, 960, 16, &g);
    CHECK(g.row_units == 6 && !kvwc_direct_affine(&s, &g, 128, &ss, &sd),
          "96-byte rows: %u units, no fast path", g.row_units);
}

int main(void)
{
    printf("CUDA kernel address arithmetic on the CPU (%u cases)\n", gc_num_cases);
    for (uint32_t i = 0; i < gc_num_cases; i++)
        run_case(&gc_cases[i]);
    check_host_refused();
    check_direct_addressing();
    cur_case = "direct kernel paths";
    printf("direct-mode jobs of the cases: %llu on the kernel's fast path, %llu on its slow "
           "path\n", (unsigned long long)direct_jobs[1], (unsigned long long)direct_jobs[0]);
    CHECK(direct_jobs[0] > 0 && direct_jobs[1] > 0, "the cases must cover both paths of the "
          "direct kernel (fast %llu, slow %llu)", (unsigned long long)direct_jobs[1],
          (unsigned long long)direct_jobs[0]);
    kvw_status_t st = kvw_cuda_available();
    printf("kvw_cuda_available: %s%s%s\n", kvw_status_string(st), st ? ": " : "",
           st ? kvw_last_error() : "");
    printf("%d checks, %d failures\n", checks, failures);
    return failures ? 1 : 0;
}
