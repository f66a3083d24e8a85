/*
 * kvw_gpu_bench: GPU throughput of the CUDA executor against CUDA's own copy paths,
 * measured in the same run (scripts/gpu-bench.sh).
 *
 * Request: gpt-oss-120b's KV shape as in DESIGN.md section 8 (36 layers x K,V, all full
 * attention here so that every layer moves all 8192 tokens; 8 KV heads, head dim 64,
 * bf16, page 64, NHD, random page order on both sides), source rank on GPU 0,
 * destination rank on GPU 1 (peer access), one (source rank, destination rank) pair:
 *
 *   TP1 -> TP4   one decode rank's slice: 2 of 8 heads, 256-byte runs
 *   TP4 -> TP1   one prefill rank's share: 256-byte runs into 1 KiB rows
 *   TP4 -> TP4   equal TP: whole 16 KiB pages
 *
 * For each: the fused kernel (uploaded plan; and the one-shot call that uploads every
 * time) against cudaMemcpyPeerAsync of the same byte count, one cudaMemcpyAsync per run
 * and cudaMemcpyBatchAsync (timed on a prefix of the runs, they are slow); the gather
 * (GPU 0) and scatter (GPU 1) kernels against a device-to-device copy of the same bytes
 * on the same GPU (both count bytes read + written equally, so the ratio is the same
 * either way); and the staged pipeline gather -> peer copy -> scatter. Medians of
 * several timed runs after warm-up, with CUDA events. The fused result is checked
 * against the staged one byte for byte.
 *
 * Options: --tokens N (8192), --reps N (20), --quick (skip the per-run baselines and
 * the check), --pool ROOMS (2: each buffer holds that many requests' pages, from which
 * the request's pages are drawn; a larger pool spreads the same bytes over more memory,
 * as an engine's pool spanning most of the GPU does).
 * Exit 77 without a GPU.
 */
#include <cuda_runtime.h>

#include <kvwire/cuda.h>
#include <kvwire/kvwire.h>

#include "gpu_common.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                            \
    do {                                                                                 \
        cudaError_t e_ = (x);                                                            \
        if (e_ != cudaSuccess) {                                                         \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x,                   \
                    cudaGetErrorString(e_));                                             \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

#define KV(x)                                                                            \
    do {                                                                                 \
        kvw_status_t s_ = (x);                                                           \
        if (s_ != KVW_OK) {                                                              \
            fprintf(stderr, "%s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #x,              \
                    kvw_status_string(s_), kvw_last_error());                            \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

static int g_reps = 20;
static int g_quick = 0;
static uint32_t g_pool = 2; /* pool size in requests (--pool): the pages are drawn from it */

__global__ void fill_kernel(uint64_t *p, size_t n, uint64_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = (i ^ seed) + 0x9e3779b97f4a7c15ull;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        p[i] = z ^ (z >> 31);
    }
}

/* One rank: its buffer table (testkit, described only), one device arena, pages. */
struct Side {
    kvt_rank_t desc;
    int dev = 0;
    uint8_t *arena = nullptr;
    uint64_t total = 0;
    std::vector<uint64_t> offs;
    kvw_rank_h h = nullptr;
    kvt_req_pages_t pg;
};

static void side_build(Side &sd, const kvt_model_t *model, uint32_t tp, uint32_t rank, int dev,
                       uint64_t seed, uint32_t ntok)
{
    kvt_rank_spec_t spec;
    memset(&spec, 0, sizeof(spec));
    spec.model = model;
    spec.par.field_mask = KVW_PARALLEL_FIELDS_ALL;
    spec.par.tp_size = tp;
    spec.par.tp_rank = rank;
    spec.par.pp_size = 1;
    spec.par.layer_begin = 0;
    spec.par.layer_end = model->m.num_layers;
    spec.par.dp_size = 1;
    spec.layout = KVW_LAYOUT_NHD;
    spec.page_size[KVW_POOL_FULL] = spec.page_size[KVW_POOL_SWA] = 64;
    spec.num_pages[KVW_POOL_FULL] = g_pool * (ntok / 64) + 8; /* pages drawn at random */
    spec.num_pages[KVW_POOL_SWA] = 1;
    spec.num_slots = 1;
    spec.describe_only = 1;
    KV(kvt_rank_describe(&spec, &sd.desc));
    sd.dev = dev;
    sd.offs.resize(sd.desc.num_bufs);
    for (uint32_t b = 0; b < sd.desc.num_bufs; b++) {
        sd.offs[b] = sd.total;
        sd.total += (sd.desc.bufs[b].length + 255) / 256 * 256;
    }
    CK(cudaSetDevice(dev));
    CK(cudaMalloc(&sd.arena, sd.total));
    fill_kernel<<<1024, 256>>>((uint64_t *)sd.arena, sd.total / 8, seed);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<uint8_t *> addrs(sd.desc.num_bufs);
    for (uint32_t b = 0; b < sd.desc.num_bufs; b++)
        addrs[b] = sd.arena + sd.offs[b];
    KV(gc_rank_clone(&sd.desc, KVW_MEM_CUDA, dev, addrs.data(), &sd.h));
    kvt_rng_t rng = {seed * 7919 + 1};
    kvt_req_spec_t rs;
    memset(&rs, 0, sizeof(rs));
    rs.full_begin = 0;
    rs.full_end = ntok;
    rs.state_slot = -1;
    if (kvt_req_pages_make(&sd.desc, &rs, &rng, &sd.pg)) {
        fprintf(stderr, "page tables\n");
        exit(1);
    }
}

static void side_free(Side &sd)
{
    kvw_rank_destroy(sd.h);
    kvt_req_pages_free(&sd.pg);
    kvt_rank_free(&sd.desc);
    CK(cudaSetDevice(sd.dev));
    CK(cudaFree(sd.arena));
}

/* Median milliseconds of f() on stream s (events on the stream's device). */
template <class F> static double median_ms(cudaStream_t s, int warm, int reps, F &&f)
{
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < warm; i++)
        f();
    CK(cudaStreamSynchronize(s));
    std::vector<float> t;
    for (int i = 0; i < reps; i++) {
        CK(cudaEventRecord(a, s));
        f();
        CK(cudaEventRecord(b, s));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

/* Median wall milliseconds of f() followed by a wait on `sync`. */
template <class F> static double median_wall_ms(cudaStream_t sync, int warm, int reps, F &&f)
{
    for (int i = 0; i < warm; i++)
        f();
    CK(cudaStreamSynchronize(sync));
    std::vector<double> t;
    for (int i = 0; i < reps; i++) {
        auto t0 = std::chrono::steady_clock::now();
        f();
        CK(cudaStreamSynchronize(sync));
        auto t1 = std::chrono::steady_clock::now();
        t.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

static double gbps(uint64_t bytes, double ms)
{
    return ms > 0 ? bytes / (ms * 1e6) : 0;
}

struct RunAddr {
    const void *src;
    void *dst;
    size_t len;
};

struct ExpandCtx {
    Side *s, *d;
    std::vector<RunAddr> *runs;
};

static kvw_status_t collect_run(void *arg, const kvw_run_t *r)
{
    ExpandCtx *c = (ExpandCtx *)arg;
    c->runs->push_back({c->s->arena + c->s->offs[r->src_buf] + r->src_off,
                        c->d->arena + c->d->offs[r->dst_buf] + r->dst_off, (size_t)r->len});
    return KVW_OK;
}

struct Result {
    const char *name;
    uint64_t bytes, runs;
    double fused, oneshot, peer, async1, batch, gather, d2d0, scatter, d2d1, staged;
    uint64_t async_runs, batch_runs;
    int verified;
    const char *batch_note;
};

static void run_case(Result &R, const kvt_model_t *model, uint32_t ntok, uint32_t stp,
                     uint32_t srank, uint32_t dtp, uint32_t drank, int dev0, int dev1)
{
    Side S, D;
    side_build(S, model, stp, srank, dev0, 11 + stp * 100 + srank, ntok);
    side_build(D, model, dtp, drank, dev1, 23 + dtp * 100 + drank, ntok);
    kvw_chunk_t ch = {KVW_CHUNK_FIELDS_ALL, ntok, 0, ntok, 0, 1};
    kvw_plan_h plan = nullptr;
    KV(kvw_plan_create(S.h, D.h, &ch, &S.pg.side, &D.pg.side, &plan));
    kvw_plan_stats_t st{};
    st.field_mask = KVW_PLAN_STATS_FIELDS_ALL;
    KV(kvw_plan_stats(plan, &st));
    R.bytes = st.bytes;
    R.runs = st.runs_coalesced;
    const uint64_t n = st.bytes;

    cudaStream_t s0, s1;
    CK(cudaSetDevice(dev1));
    CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    kvw_cuda_plan_h cp1 = nullptr;
    KV(kvw_cuda_plan_upload(plan, KVW_CUDA_SCATTER, &cp1));
    uint8_t *p1, *g1;
    CK(cudaMalloc(&p1, n));
    CK(cudaMalloc(&g1, n));
    CK(cudaSetDevice(dev0));
    CK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
    kvw_cuda_plan_h cp0 = nullptr;
    KV(kvw_cuda_plan_upload(plan, KVW_CUDA_DIRECT | KVW_CUDA_GATHER, &cp0));
    uint8_t *p0, *g0;
    CK(cudaMalloc(&p0, n));
    CK(cudaMalloc(&g0, n));
    fill_kernel<<<1024, 256, 0, s0>>>((uint64_t *)p0, n / 8, 99);
    CK(cudaGetLastError());

    /* Fused kernel, GPU 0 -> GPU 1 through peer pointers. */
    R.fused = gbps(n, median_ms(s0, 3, g_reps, [&] { KV(kvw_cuda_plan_exec(cp0, s0)); }));
    R.oneshot = gbps(n, median_ms(s0, 2, std::max(3, g_reps / 2),
                                  [&] { KV(kvw_plan_exec_cuda(plan, s0)); }));
    R.peer = gbps(n, median_ms(s0, 3, g_reps,
                               [&] { CK(cudaMemcpyPeerAsync(p1, dev1, p0, dev0, n, s0)); }));

    /* Gather on GPU 0, scatter on GPU 1, each against a same-GPU d2d copy. */
    R.gather = gbps(n, median_ms(s0, 3, g_reps, [&] { KV(kvw_cuda_plan_gather(cp0, g0, n, s0)); }));
    R.d2d0 = gbps(n, median_ms(s0, 3, g_reps, [&] {
                      CK(cudaMemcpyAsync(g0, p0, n, cudaMemcpyDeviceToDevice, s0));
                  }));
    CK(cudaSetDevice(dev1));
    R.scatter = gbps(n, median_ms(s1, 3, g_reps, [&] { KV(kvw_cuda_plan_scatter(cp1, g1, n, s1)); }));
    R.d2d1 = gbps(n, median_ms(s1, 3, g_reps, [&] {
                      CK(cudaMemcpyAsync(p1, g1, n, cudaMemcpyDeviceToDevice, s1));
                  }));

    /* Staged pipeline: gather, one bulk peer copy, scatter. */
    cudaEvent_t ev;
    CK(cudaSetDevice(dev0));
    CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    auto staged = [&] {
        CK(cudaSetDevice(dev0));
        KV(kvw_cuda_plan_gather(cp0, g0, n, s0));
        CK(cudaMemcpyPeerAsync(g1, dev1, g0, dev0, n, s0));
        CK(cudaEventRecord(ev, s0));
        CK(cudaSetDevice(dev1));
        CK(cudaStreamWaitEvent(s1, ev, 0));
        KV(kvw_cuda_plan_scatter(cp1, g1, n, s1));
    };
    R.staged = gbps(n, median_wall_ms(s1, 2, std::max(3, g_reps / 2), staged));

    /* The fused result must equal the staged one over the whole destination. */
    R.verified = -1;
    if (!g_quick) {
        std::vector<uint8_t> a(D.total), b(D.total);
        CK(cudaSetDevice(dev1));
        CK(cudaMemset(D.arena, 0xAB, D.total));
        CK(cudaDeviceSynchronize());
        CK(cudaSetDevice(dev0));
        KV(kvw_cuda_plan_exec(cp0, s0));
        CK(cudaStreamSynchronize(s0));
        CK(cudaMemcpy(a.data(), D.arena, D.total, cudaMemcpyDefault));
        CK(cudaSetDevice(dev1));
        CK(cudaMemset(D.arena, 0xAB, D.total));
        CK(cudaDeviceSynchronize());
        staged();
        CK(cudaStreamSynchronize(s1));
        CK(cudaMemcpy(b.data(), D.arena, D.total, cudaMemcpyDefault));
        uint64_t changed = 0;
        for (uint64_t i = 0; i < D.total; i++)
            changed += a[i] != 0xAB;
        R.verified = a == b && changed > n / 2 ? 1 : 0;
    }

    CK(cudaSetDevice(dev0));
    R.async1 = R.batch = 0;
    R.async_runs = R.batch_runs = 0;
    R.batch_note = "";
    if (!g_quick) {
        std::vector<RunAddr> runs;
        ExpandCtx ctx = {&S, &D, &runs};
        KV(kvw_plan_expand(plan, collect_run, &ctx));
        /* One cudaMemcpyAsync per run, on a prefix (a full request takes seconds). */
        size_t k = std::min<size_t>(runs.size(), 20000);
        uint64_t kb = 0;
        for (size_t i = 0; i < k; i++)
            kb += runs[i].len;
        R.async_runs = k;
        R.async1 = gbps(kb, median_ms(s0, 1, 3, [&] {
                            for (size_t i = 0; i < k; i++)
                                CK(cudaMemcpyAsync(runs[i].dst, runs[i].src, runs[i].len,
                                                   cudaMemcpyDefault, s0));
                        }));
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
        size_t kbat = std::min<size_t>(runs.size(), 100000);
        std::vector<void *> dsts(kbat);
        std::vector<const void *> srcs(kbat);
        std::vector<size_t> sizes(kbat);
        uint64_t bb = 0;
        for (size_t i = 0; i < kbat; i++) {
            dsts[i] = runs[i].dst;
            srcs[i] = runs[i].src;
            sizes[i] = runs[i].len;
            bb += runs[i].len;
        }
        cudaMemcpyAttributes attr;
        memset(&attr, 0, sizeof(attr));
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        attr.srcLocHint.type = cudaMemLocationTypeDevice;
        attr.srcLocHint.id = dev0;
        attr.dstLocHint.type = cudaMemLocationTypeDevice;
        attr.dstLocHint.id = dev1;
        size_t idx = 0;
        const size_t chunk = 16384;
        cudaError_t be = cudaSuccess;
        auto batch = [&] {
            for (size_t i = 0; i < kbat && be == cudaSuccess; i += chunk) {
                size_t c = std::min(chunk, kbat - i);
                be = cudaMemcpyBatchAsync(dsts.data() + i, srcs.data() + i, sizes.data() + i, c,
                                          &attr, &idx, 1, s0);
            }
        };
        batch();
        CK(cudaStreamSynchronize(s0));
        if (be == cudaSuccess) {
            R.batch_runs = kbat;
            R.batch = gbps(bb, median_ms(s0, 0, 3, batch));
        } else {
            R.batch_note = cudaGetErrorString(be);
            (void)cudaGetLastError();
        }
#else
        R.batch_note = "cudaMemcpyBatchAsync not in this CUDA runtime";
#endif
    }

    kvw_cuda_plan_destroy(cp0);
    CK(cudaFree(p0));
    CK(cudaFree(g0));
    CK(cudaStreamDestroy(s0));
    CK(cudaEventDestroy(ev));
    CK(cudaSetDevice(dev1));
    kvw_cuda_plan_destroy(cp1);
    CK(cudaFree(p1));
    CK(cudaFree(g1));
    CK(cudaStreamDestroy(s1));
    kvw_plan_destroy(plan);
    side_free(S);
    side_free(D);
}

int main(int argc, char **argv)
{
    uint32_t ntok = 8192;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
            ntok = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            g_reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--quick"))
            g_quick = 1;
        else if (!strcmp(argv[i], "--pool") && i + 1 < argc && atoi(argv[i + 1]) >= 1)
            g_pool = (uint32_t)atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--tokens N] [--reps N] [--quick] [--pool ROOMS]\n",
                    argv[0]);
            return 2;
        }
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    kvw_status_t av = kvw_cuda_available();
    if (av != KVW_OK) {
        printf("skipped: no GPU (%s)\n", kvw_last_error());
        return 77;
    }
    int count = 0;
    CK(cudaGetDeviceCount(&count));
    int dev0 = 0, dev1 = count > 1 ? 1 : 0;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int peer = 0;
    if (dev1 != dev0) {
        CK(cudaDeviceCanAccessPeer(&peer, dev0, dev1));
        if (!peer) {
            printf("skipped: GPU %d cannot access GPU %d as a peer\n", dev0, dev1);
            return 77;
        }
        CK(cudaSetDevice(dev0));
        cudaError_t e = cudaDeviceEnablePeerAccess(dev1, 0);
        if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled)
            CK(e);
        CK(cudaSetDevice(dev1));
        e = cudaDeviceEnablePeerAccess(dev0, 0);
        if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled)
            CK(e);
        (void)cudaGetLastError();
    }
    const char *mod = getenv("KVW_CUDA_MODULE");
    printf("kvw_gpu_bench: %d x %s (%d SMs), GPU %d -> GPU %d%s, CUDA runtime %d, %u tokens, "
           "median of %d%s%s\n", count, prop.name, prop.multiProcessorCount, dev0, dev1,
           dev0 == dev1 ? " (one GPU only)" : "", CUDART_VERSION, ntok, g_reps,
           mod ? ", module " : "", mod ? mod : "");

    kvt_model_t model;
    if (kvt_model_preset("gpt-oss-120b", &model))
        return 1;
    for (uint32_t l = 0; l < model.m.num_layers; l++) {
        model.layers[l].kind = KVW_LAYER_FULL;
        model.layers[l].window = 0;
    }
    kvt_model_relink(&model);

    struct {
        const char *name;
        uint32_t stp, srank, dtp, drank;
    } cases[] = {{"TP1->TP4 (decode rank 0)", 1, 0, 4, 0},
                 {"TP4->TP1 (prefill rank 0)", 4, 0, 1, 0},
                 {"TP4->TP4 equal (rank 0)", 4, 0, 4, 0}};
    const int nc = sizeof(cases) / sizeof(cases[0]);
    Result res[nc];
    for (int i = 0; i < nc; i++) {
        memset(&res[i], 0, sizeof(res[i]));
        res[i].name = cases[i].name;
        run_case(res[i], &model, ntok, cases[i].stp, cases[i].srank, cases[i].dtp,
                 cases[i].drank, dev0, dev1);
    }

    printf("\npool: %u requests' pages per buffer, %u tokens per request, random page order\n",
           g_pool, ntok);
    printf("\nPeer path, GPU %d -> GPU %d (payload GB/s; ratio = fused / cudaMemcpyPeer)\n",
           dev0, dev1);
    printf("%-27s %9s %8s %8s %8s %6s %9s %12s %12s\n", "case", "MB", "runs", "fused", "peer",
           "ratio", "one-shot", "async/run", "batch");
    for (int i = 0; i < nc; i++) {
        const Result &r = res[i];
        char a[32] = "-", b[48] = "-";
        if (r.async_runs)
            snprintf(a, sizeof(a), "%.3f", r.async1);
        if (r.batch_runs)
            snprintf(b, sizeof(b), "%.3f", r.batch);
        else if (r.batch_note[0])
            snprintf(b, sizeof(b), "n/a");
        printf("%-27s %9.1f %8llu %8.1f %8.1f %6.3f %9.1f %12s %12s\n", r.name, r.bytes / 1e6,
               (unsigned long long)r.runs, r.fused, r.peer, r.fused / r.peer, r.oneshot, a, b);
    }
    if (!g_quick)
        printf("(async/run: one cudaMemcpyAsync per run over the first %llu runs; batch: "
               "cudaMemcpyBatchAsync over the first %llu runs%s%s)\n",
               (unsigned long long)res[0].async_runs, (unsigned long long)res[0].batch_runs,
               res[0].batch_note[0] ? ": " : "", res[0].batch_note);
    printf("\nStaged path (payload GB/s; ratio = kernel / same-GPU d2d copy of the same bytes, "
           "equal with read+write counted)\n");
    printf("%-27s %8s %8s %6s %8s %8s %6s %9s %5s\n", "case", "gather", "d2d", "ratio",
           "scatter", "d2d", "ratio", "pipeline", "check");
    for (int i = 0; i < nc; i++) {
        const Result &r = res[i];
        printf("%-27s %8.1f %8.1f %6.3f %8.1f %8.1f %6.3f %9.1f %5s\n", r.name, r.gather, r.d2d0,
               r.gather / r.d2d0, r.scatter, r.d2d1, r.scatter / r.d2d1, r.staged,
               r.verified < 0 ? "-" : r.verified ? "ok" : "FAIL");
    }
    int ok = 1;
    for (int i = 0; i < nc; i++)
        ok &= res[i].verified != 0;
    if (!g_quick)
        printf("%s\n", ok ? "check: fused == gather + peer copy + scatter on every case"
                          : "check: MISMATCH between the fused and the staged result");
    return ok ? 0 : 1;
}
