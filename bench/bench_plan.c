/*
 * Plan and CPU-executor benchmark for one 128K-token gpt-oss-120b request.
 *
 *   1. Plan build: kvw_plan_create for every (source, destination) pair of TP1->TP4
 *      and TP4->TP1, page sizes 64 and 1, on the full 36-layer model. Ranks are
 *      described with placeholder addresses (plans never touch buffers). Reported:
 *      median and 90th percentile per pair, the plan's own memory account
 *      (plan_bytes) and what malloc actually handed out (mallinfo2 delta).
 *   2. Expansion: kvw_plan_expand into coalesced runs with a counting callback.
 *   3. CPU executor: kvw_plan_exec_cpu against memcpy of the same bytes between the
 *      same (pre-faulted, reused) buffers, measured in the same run, interleaved rep by
 *      rep. Two shapes: equal TP1->TP1 whole pages (random pages, so runs are single
 *      pages), and head slices TP1->TP4 / TP4->TP1 (each destination rank owns 2 of
 *      the 8 KV heads: 2 x 64 dims x 2 bytes = 256-byte slices per token).
 *
 * The executor part needs real buffers: with all 36 layers that is 4.5 GiB per side,
 * so by default it keeps the first 4 layers (2 full attention, 2 sliding window;
 * 0.5 GiB per side, three sides) and says so. That is still far larger than any cache. Throughput per byte does not depend on the layer count;
 * --exec-layers 36 runs the full model where memory allows.
 *
 * usage: bench_plan [--tokens N] [--reps N] [--exec-layers N] [--build-iters N]
 */
#include <kvwire/kvwire.h>

#include "testkit.h"

#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define WINDOW_SLACK_PAGES 5

typedef struct side {
    uint32_t tp;
    uint32_t page;
    kvt_rank_t *r;
    kvt_req_pages_t *pg;
} side_t;

static uint64_t tokens = 128 * 1024;
static int reps = 7;
static uint32_t exec_layers = 4;
static int build_iters = 200;

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static uint64_t pct(uint64_t *v, size_t n, int p)
{
    qsort(v, n, sizeof(*v), cmp_u64);
    size_t i = (n - 1) * (size_t)p / 100;
    return v[i];
}

static void die(const char *what)
{
    fprintf(stderr, "bench_plan: %s: %s\n", what, kvw_last_error());
    exit(1);
}

/* Pool sizes: the request's pages plus a little slack, so that buffers hold what the
 * request needs and random pages still scatter. */
static uint32_t full_pool(uint32_t page)
{
    uint32_t need = (uint32_t)((tokens + 63) / 64) + 16; /* in 64-token pages */
    return need * (64 / page);
}

static uint32_t swa_pool(uint32_t page)
{
    return (128 / 64 + WINDOW_SLACK_PAGES) * (64 / page);
}

/*
 * Describes the ranks of one TP group. With `alias` set, the ranks use alias's memory
 * (same buffers, other page size: lengths match because pools hold the same tokens);
 * with `alloc` the buffers are allocated; otherwise addresses are placeholders.
 */
static void side_make(side_t *s, const kvt_model_t *m, uint32_t tp, uint32_t page, int alloc,
                      const side_t *alias, kvt_rng_t *rng)
{
    s->tp = tp;
    s->page = page;
    s->r = calloc(tp, sizeof(*s->r));
    s->pg = calloc(tp, sizeof(*s->pg));
    if (!s->r || !s->pg)
        die("out of memory");
    for (uint32_t r = 0; r < tp; r++) {
        kvt_rank_spec_t spec = {.model = m,
                                .par = {.tp_size = tp, .tp_rank = r, .pp_size = 1,
                                        .layer_end = m->m.num_layers, .dp_size = 1},
                                .layout = KVW_LAYOUT_NHD,
                                .page_size = {page, page},
                                .num_pages = {full_pool(page), swa_pool(page)},
                                .describe_only = !alloc};
        if (kvt_rank_describe(&spec, &s->r[r]) != KVW_OK)
            die("describe rank");
        if (alias)
            for (uint32_t b = 0; b < s->r[r].num_bufs; b++) {
                if (alias->r[r].bufs[b].length != s->r[r].bufs[b].length)
                    die("alias lengths differ");
                s->r[r].bufs[b].addr = alias->r[r].bufs[b].addr;
            }
        if (kvt_rank_open(&s->r[r]) != KVW_OK)
            die("kvw_rank_create");
        kvt_req_spec_t rs = {.full_begin = 0, .full_end = tokens,
                             .swa_begin = tokens > 128 ? tokens - 128 : 0, .swa_end = tokens,
                             .state_slot = -1};
        if (kvt_req_pages_make(&s->r[r], &rs, rng, &s->pg[r]))
            die("page lists");
    }
}

static void side_free(side_t *s)
{
    for (uint32_t r = 0; r < s->tp; r++) {
        kvt_req_pages_free(&s->pg[r]);
        kvt_rank_free(&s->r[r]);
    }
    free(s->r);
    free(s->pg);
    memset(s, 0, sizeof(*s));
}

static kvw_chunk_t whole_request(void)
{
    kvw_chunk_t ch = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = tokens, .chunk_begin = 0,
                      .chunk_end = tokens,
                      .prefix_len = 0, .last_chunk = 1};
    return ch;
}

static uint64_t heap_in_use(void)
{
    struct mallinfo2 mi = mallinfo2();
    return mi.uordblks + mi.hblkhd;
}

static kvw_status_t count_cb(void *arg, const kvw_run_t *r)
{
    (void)r;
    (*(uint64_t *)arg)++;
    return KVW_OK;
}

/* ---------------------------------------------------------------- plan build + expand */

static void bench_build(const kvt_model_t *m, uint32_t stp, uint32_t dtp, uint32_t page)
{
    kvt_rng_t rng = {stp * 100 + dtp * 10 + page};
    side_t S, D;
    side_make(&S, m, stp, page, 0, NULL, &rng);
    side_make(&D, m, dtp, page, 0, NULL, &rng);
    kvw_chunk_t ch = whole_request();

    int iters = page == 1 ? build_iters / 4 : build_iters;
    size_t max = (size_t)iters * stp * dtp;
    uint64_t *t = calloc(max, sizeof(*t));
    uint64_t *ex = calloc((size_t)stp * dtp * 3, sizeof(*ex));
    if (!t || !ex)
        die("out of memory");
    size_t n = 0, nex = 0;
    uint64_t plan_bytes = 0, heap = 0, segs = 0, runs = 0, pairs = 0;
    for (uint32_t d = 0; d < dtp; d++)
        for (uint32_t s = 0; s < stp; s++) {
            kvw_plan_h plan;
            kvw_plan_stats_t st = {.field_mask = KVW_PLAN_STATS_FIELDS_ALL};
            /* Skip pairs that exchange nothing (none here, but stay general). */
            uint64_t h0 = heap_in_use();
            if (kvw_plan_create(S.r[s].h, D.r[d].h, &ch, &S.pg[s].side, &D.pg[d].side, &plan))
                die("kvw_plan_create");
            uint64_t h1 = heap_in_use();
            if (kvw_plan_stats(plan, &st))
                die("kvw_plan_stats");
            if (st.bytes == 0) {
                kvw_plan_destroy(plan);
                continue;
            }
            pairs++;
            plan_bytes = st.plan_bytes > plan_bytes ? st.plan_bytes : plan_bytes;
            heap = h1 - h0 > heap ? h1 - h0 : heap;
            segs = st.num_segments;
            runs = st.runs_coalesced;
            /* Expansion: a few walks per pair. */
            for (int k = 0; k < 3; k++) {
                uint64_t cnt = 0, t0 = kvt_now_ns();
                if (kvw_plan_expand(plan, count_cb, &cnt))
                    die("kvw_plan_expand");
                ex[nex++] = kvt_now_ns() - t0;
                if (cnt != st.runs_coalesced)
                    die("expand and stats disagree on the run count");
            }
            kvw_plan_destroy(plan);
            for (int i = 0; i < iters; i++) {
                uint64_t t0 = kvt_now_ns();
                kvw_status_t rc =
                    kvw_plan_create(S.r[s].h, D.r[d].h, &ch, &S.pg[s].side, &D.pg[d].side, &plan);
                uint64_t t1 = kvt_now_ns();
                if (rc)
                    die("kvw_plan_create");
                kvw_plan_destroy(plan);
                t[n++] = t1 - t0;
            }
        }
    uint64_t med = pct(t, n, 50), p90 = pct(t, n, 90), exm = pct(ex, nex, 50);
    printf("| TP%u->TP%u | %5u | %5llu | %8.1f | %8.1f | %8.1f KiB | %8.1f KiB | %6llu | %9llu "
           "| %8.2f | %6.1f | %s |\n",
           stp, dtp, page, (unsigned long long)pairs, med / 1e3, p90 / 1e3, plan_bytes / 1024.0,
           heap / 1024.0, (unsigned long long)segs, (unsigned long long)runs, exm / 1e6,
           runs ? (double)exm / runs : 0.0, med <= 50000 ? "yes" : "no");
    free(t);
    free(ex);
    side_free(&S);
    side_free(&D);
}

/* ---------------------------------------------------------------- executor */

typedef struct exec_case {
    const char *name;
    side_t *src, *dst;
} exec_case_t;

/* One expanded run with resolved addresses, for the run-replay baseline. */
typedef struct flat_run {
    const uint8_t *s;
    uint8_t *d;
    uint64_t len;
} flat_run_t;

typedef struct run_list {
    flat_run_t *v;
    size_t n, cap;
    const kvt_rank_t *src, *dst;
} run_list_t;

static kvw_status_t list_cb(void *arg, const kvw_run_t *r)
{
    run_list_t *l = arg;
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 4096;
        flat_run_t *v = realloc(l->v, cap * sizeof(*v));
        if (!v)
            return KVW_ERR_NO_MEMORY;
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = (flat_run_t){(const uint8_t *)l->src->bufs[r->src_buf].addr + r->src_off,
                                (uint8_t *)l->dst->bufs[r->dst_buf].addr + r->dst_off, r->len};
    return KVW_OK;
}

typedef struct pair_bytes {
    uint32_t nsb, ndb;
    uint64_t *b; /* [src_buf * ndb + dst_buf] */
} pair_bytes_t;

static kvw_status_t sum_cb(void *arg, const kvw_run_t *r)
{
    pair_bytes_t *p = arg;
    p->b[(size_t)r->src_buf * p->ndb + r->dst_buf] += r->len;
    return KVW_OK;
}

static void bench_exec(const exec_case_t *c)
{
    side_t *S = c->src, *D = c->dst;
    kvw_chunk_t ch = whole_request();
    uint32_t np = S->tp * D->tp, n = 0;
    kvw_plan_h *plans = calloc(np, sizeof(*plans));
    pair_bytes_t *pb = calloc(np, sizeof(*pb));
    uint32_t *ps = calloc(np, sizeof(*ps)), *pd = calloc(np, sizeof(*pd));
    uint64_t *te = calloc((size_t)reps, sizeof(*te)), *tm = calloc((size_t)reps, sizeof(*tm));
    uint64_t *tr = calloc((size_t)reps, sizeof(*tr));
    run_list_t rl = {0};
    if (!plans || !pb || !ps || !pd || !te || !tm || !tr)
        die("out of memory");
    uint64_t bytes = 0, runs = 0;
    for (uint32_t d = 0; d < D->tp; d++)
        for (uint32_t s = 0; s < S->tp; s++) {
            kvw_plan_stats_t st = {.field_mask = KVW_PLAN_STATS_FIELDS_ALL};
            if (kvw_plan_create(S->r[s].h, D->r[d].h, &ch, &S->pg[s].side, &D->pg[d].side,
                                &plans[n]))
                die("kvw_plan_create");
            if (kvw_plan_stats(plans[n], &st))
                die("kvw_plan_stats");
            if (st.bytes == 0) {
                kvw_plan_destroy(plans[n]);
                continue;
            }
            /* The memcpy baseline copies, per buffer pair, as many bytes as the plan
             * moves between them, as one block between the same two buffers. */
            pb[n].nsb = S->r[s].num_bufs;
            pb[n].ndb = D->r[d].num_bufs;
            pb[n].b = calloc((size_t)pb[n].nsb * pb[n].ndb, sizeof(uint64_t));
            if (!pb[n].b || kvw_plan_expand(plans[n], sum_cb, &pb[n]))
                die("expand");
            rl.src = &S->r[s];
            rl.dst = &D->r[d];
            if (kvw_plan_expand(plans[n], list_cb, &rl))
                die("expand");
            ps[n] = s;
            pd[n] = d;
            bytes += st.bytes;
            runs += st.runs_coalesced;
            n++;
        }

    for (int r = -1; r < reps; r++) { /* r = -1: warm-up */
        uint64_t t0 = kvt_now_ns();
        for (uint32_t i = 0; i < n; i++)
            if (kvw_plan_exec_cpu(plans[i]))
                die("kvw_plan_exec_cpu");
        uint64_t t1 = kvt_now_ns();
        for (uint32_t i = 0; i < n; i++)
            for (uint32_t a = 0; a < pb[i].nsb; a++)
                for (uint32_t b = 0; b < pb[i].ndb; b++) {
                    uint64_t len = pb[i].b[(size_t)a * pb[i].ndb + b];
                    if (len)
                        memcpy(D->r[pd[i]].bufs[b].addr, S->r[ps[i]].bufs[a].addr, len);
                }
        uint64_t t2 = kvt_now_ns();
        for (size_t i = 0; i < rl.n; i++)
            memcpy(rl.v[i].d, rl.v[i].s, rl.v[i].len);
        uint64_t t3 = kvt_now_ns();
        if (r >= 0) {
            te[r] = t1 - t0;
            tm[r] = t2 - t1;
            tr[r] = t3 - t2;
        }
    }
    uint64_t me = pct(te, (size_t)reps, 50), mm = pct(tm, (size_t)reps, 50);
    uint64_t mr = pct(tr, (size_t)reps, 50);
    double ge = bytes / (double)me, gm = bytes / (double)mm, gr = bytes / (double)mr;
    printf("| %-32s | %4u | %6.1f MiB | %8llu | %6.0f | %6.2f | %6.2f | %5.2f | %6.2f | %5.2f "
           "|\n",
           c->name, S->page, bytes / 1048576.0, (unsigned long long)runs,
           runs ? (double)bytes / runs : 0.0, ge, gm, ge / gm, gr, ge / gr);
    free(rl.v);
    free(tr);
    for (uint32_t i = 0; i < n; i++) {
        kvw_plan_destroy(plans[i]);
        free(pb[i].b);
    }
    free(plans);
    free(pb);
    free(ps);
    free(pd);
    free(te);
    free(tm);
}

static void usage(void)
{
    fprintf(stderr, "usage: bench_plan [--tokens N] [--reps N>=5] [--exec-layers N] "
                    "[--build-iters N]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc)
            usage();
        long v = strtol(argv[i + 1], NULL, 10);
        if (!strcmp(argv[i], "--tokens") && v >= 256)
            tokens = (uint64_t)v / 64 * 64;
        else if (!strcmp(argv[i], "--reps") && v >= 5)
            reps = (int)v;
        else if (!strcmp(argv[i], "--exec-layers") && v >= 2 && v <= 36)
            exec_layers = (uint32_t)v;
        else if (!strcmp(argv[i], "--build-iters") && v >= 4)
            build_iters = (int)v;
        else
            usage();
        i++;
    }
    printf("command:");
    for (int i = 0; i < argc; i++)
        printf(" %s", argv[i]);
    printf("\nhost: %ld CPUs online; model gpt-oss-120b (36 layers: 18 SWA window 128 + 18 "
           "full, 8 KV heads x 64 dims bf16), %llu tokens, NHD, random pages\n\n",
           sysconf(_SC_NPROCESSORS_ONLN), (unsigned long long)tokens);

    kvt_model_t m;
    if (kvt_model_preset("gpt-oss-120b", &m))
        die("preset");

    uint64_t t_start = kvt_now_ns();
    printf("Plan build per (src, dst) pair, full model, %d builds per pair (page 1: %d). "
           "Target: median <= 50 us.\n"
           "expand = kvw_plan_expand walking every coalesced run with a counting callback.\n\n",
           build_iters, build_iters / 4);
    printf("| config | page | pairs | median us | p90 us | plan_bytes | malloc'd | segs | "
           "runs/pair | expand ms | ns/run | <=50us |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    bench_build(&m, 1, 4, 64);
    bench_build(&m, 4, 1, 64);
    bench_build(&m, 1, 4, 1);
    bench_build(&m, 4, 1, 1);

    /* Executor: real buffers. */
    kvt_model_t em = m;
    kvt_model_relink(&em);
    kvt_model_truncate(&em, exec_layers);
    uint32_t full_layers = 0;
    for (uint32_t l = 0; l < exec_layers; l++)
        full_layers += em.layers[l].kind == KVW_LAYER_FULL;
    printf("\nCPU executor vs memcpy of the same bytes between the same buffers (median of %d "
           "interleaved reps after a warm-up; buffers pre-faulted and reused).\n",
           reps);
    if (exec_layers < 36)
        printf("Scaled down: the first %u of 36 layers (%u full attention), so that three "
               "TP1-sized sides fit in memory and the run stays short; bytes per run and "
               "throughput do not depend on the layer count.\n",
               exec_layers, full_layers);
    printf("memcpy = one memcpy per buffer pair of the bytes the plan moves between them "
           "(contiguous); replay = memcpy of every expanded run from a precomputed list "
           "(the same scattered accesses as the executor, without its walking).\n");
    printf("\n| case | page | bytes | runs | B/run | exec GB/s | memcpy GB/s | exec/memcpy | "
           "replay GB/s | exec/replay |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|\n");

    kvt_rng_t rng = {7};
    side_t A, B, C, A1, B1, C1;
    side_make(&A, &em, 1, 64, 1, NULL, &rng);
    side_make(&B, &em, 1, 64, 1, NULL, &rng);
    side_make(&C, &em, 4, 64, 1, NULL, &rng);
    /* Pre-fault every page once. */
    kvt_rank_fill(&A.r[0], 1);
    kvt_rank_clear(&B.r[0], 0);
    for (uint32_t r = 0; r < 4; r++)
        kvt_rank_clear(&C.r[r], 0);
    side_make(&A1, &em, 1, 1, 0, &A, &rng);
    side_make(&B1, &em, 1, 1, 0, &B, &rng);
    side_make(&C1, &em, 4, 1, 0, &C, &rng);

    exec_case_t cases[] = {
        {"whole pages, equal TP1->TP1", &A, &B},
        {"head slices 256 B, TP1->TP4", &A, &C},
        {"head slices 256 B, TP4->TP1", &C, &B},
        {"whole pages (1 token), TP1->TP1", &A1, &B1},
        {"head slices 256 B, TP1->TP4", &A1, &C1},
        {"head slices 256 B, TP4->TP1", &C1, &B1},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        bench_exec(&cases[i]);

    side_free(&A1);
    side_free(&B1);
    side_free(&C1);
    side_free(&A);
    side_free(&B);
    side_free(&C);
    printf("\ntotal time %.1f s\n", (kvt_now_ns() - t_start) / 1e9);
    return 0;
}
