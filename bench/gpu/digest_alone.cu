// Experiment (bench/gpu/NOTES.md, "The digest kernel alone"): how fast is the CUDA
// module's KV digest (exec_digest, src/cuda/digest.cu) by itself, against a D2D copy of
// the same bytes in the same run? The shape of `kvwire bench --gpu`'s rooms: 72 buffers
// (36 layers x K,V) of POOL pages of 64 KiB each (one cudaMalloc each), gpt-oss-120b's
// rows (8 KV heads x 128 bytes a token), a room = 8192 tokens on 128 random pages of
// every buffer; the digest of all 8 heads (TP1) or of 2 (one TP4 rank's slice), for one
// room or 8 rooms in one call. Each module named on the command line is loaded in turn
// (KVW_CUDA_MODULE's rule: a path), and every module's units must equal the CPU's
// (digest_core.h's kvwc_xxh3 over a host copy) for two buffers, and each other's for
// all. Wall time of exec_digest (it waits), median of 9. Not part of the build:
//
//   nvcc -O2 -arch=sm_90 -std=c++17 -Iinclude -Isrc -o /tmp/digest_alone \
//       bench/gpu/digest_alone.cu -ldl && /tmp/digest_alone MODULE.so [MODULE2.so ...]
#include <cuda_runtime.h>

#include "cuda/digest_core.h"
#include "cuda/module_load.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <stdio.h>
#include <stdlib.h>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

static const uint32_t NBUF = 72, PAGE_TOK = 64, ROOM_TOK = 8192, ROOM_PAGES = 128, HEADS = 8,
                      POOL = 1025, REPS = 9;
// A row's bytes: DIGEST_ROW in the environment, 128 by default (256: head_dim 128 in
// bf16, XXH3's long path; 100: rows at addresses not 8-byte aligned).
static uint32_t ROW = 128;
static uint64_t PAGE = (uint64_t)PAGE_TOK * HEADS * 128;

static double now_ms()
{
    return std::chrono::duration<double, std::milli>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Room {
    std::vector<uint32_t> pages;
    std::vector<kvwc_seg_in_t> segs;
    std::vector<kvwc_dig_seg_t> dsegs;
    kvwc_map_in_t map;
    kvwc_plan_in_t plan;
    std::vector<uint64_t> units;
};

static void room_build(Room &r, const std::vector<char *> &bufs, std::mt19937 &g, uint32_t nh)
{
    std::vector<uint32_t> all(POOL);
    for (uint32_t i = 0; i < POOL; i++)
        all[i] = i;
    std::shuffle(all.begin(), all.end(), g);
    r.pages.assign(all.begin(), all.begin() + ROOM_PAGES);
    r.segs.resize(NBUF);
    r.dsegs.resize(NBUF);
    for (uint32_t b = 0; b < NBUF; b++) {
        kvwc_seg_in_t &s = r.segs[b];
        memset(&s, 0, sizeof(s));
        s.dst.base = (uint64_t)(uintptr_t)bufs[b];
        s.dst.page_stride = PAGE;
        s.dst.token_stride = HEADS * ROW;
        s.dst.head_stride = ROW;
        s.dst.page_size = PAGE_TOK;
        s.dst.map = 0;
        s.src = s.dst;
        s.tok_begin = 0;
        s.tok_end = ROOM_TOK;
        s.head_bytes = ROW;
        s.num_heads = nh;
        r.dsegs[b].seed_base = kvw_digest_seed_base(b / 2, b % 2);
        r.dsegs[b].unit = b * nh;
        r.dsegs[b].head0 = 0;
    }
    r.map.pages = r.pages.data();
    r.map.num_pages = ROOM_PAGES;
    r.plan = {NBUF, r.segs.data(), 1, &r.map, (uint64_t)NBUF * ROOM_TOK * nh * ROW, 0};
    r.units.assign(NBUF * nh, 0);
}

// The CPU's units of buffer b (host copy `h` of it).
static void cpu_units(const Room &r, const std::vector<uint8_t> &h, uint32_t b, uint32_t nh,
                      const uint64_t *sec, uint64_t *out)
{
    for (uint32_t k = 0; k < nh; k++) {
        uint64_t sum = 0;
        for (uint32_t t = 0; t < ROOM_TOK; t++) {
            const uint8_t *row = h.data() + (uint64_t)r.pages[t / PAGE_TOK] * PAGE +
                                 (t % PAGE_TOK) * HEADS * ROW + k * ROW;
            sum += kvwc_xxh3(row, ROW, sec,
                             kvw_digest_seed_of(r.dsegs[b].seed_base, k, t));
        }
        out[k] = sum;
    }
}

__global__ void fill(uint64_t *p, uint64_t n, uint64_t salt)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        uint64_t z = (i + salt) * 0x9E3779B97F4A7C15ull;
        p[i] = z ^ (z >> 29);
    }
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODULE.so [MODULE2.so ...]\n", argv[0]);
        return 2;
    }
    if (getenv("DIGEST_ROW") != NULL)
        ROW = (uint32_t)strtoul(getenv("DIGEST_ROW"), NULL, 10);
    if (ROW == 0 || ROW > 4096) {
        fprintf(stderr, "digest_alone: DIGEST_ROW must be 1..4096\n");
        return 2;
    }
    PAGE = (uint64_t)PAGE_TOK * HEADS * ROW;
    int nd = 0;
    if (cudaGetDeviceCount(&nd) != cudaSuccess || nd == 0) {
        printf("digest_alone: skipped: no GPU\n");
        return 77;
    }
    CK(cudaSetDevice(0));
    std::vector<char *> bufs(NBUF);
    for (uint32_t b = 0; b < NBUF; b++) {
        CK(cudaMalloc(&bufs[b], POOL * PAGE));
        fill<<<1024, 256>>>((uint64_t *)bufs[b], POOL * PAGE / 8, b * 1000003ull);
    }
    CK(cudaDeviceSynchronize());
    uint64_t sec[KVWC_DIGEST_SECRET_WORDS];
    for (unsigned i = 0; i < KVWC_DIGEST_SECRET_WORDS; i++)
        sec[i] = kvw_digest_seed_of(0x1234, i, i * 77);
    std::vector<uint8_t> h0(POOL * PAGE), h71(POOL * PAGE);
    CK(cudaMemcpy(h0.data(), bufs[0], POOL * PAGE, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h71.data(), bufs[NBUF - 1], POOL * PAGE, cudaMemcpyDeviceToHost));

    printf("digest_alone: 72 buffers of %u pages of 64 KiB, rooms of 8192 tokens on 128 random "
           "pages each, rows of %u bytes; exec_digest wall time (median of %u) against a D2D "
           "copy of the same bytes\n", POOL, ROW, REPS);
    printf("%-44s %-12s %8s %9s %8s %9s %6s %s\n", "module", "case", "MB", "ms", "GB/s", "D2D GB/s",
           "ratio", "units");
    std::vector<std::vector<uint64_t>> ref; // first module's units, per case
    for (int mi = 1; mi < argc; mi++) {
        char msg[1024];
        const kvwc_ops_t *ops = kvwc_module_load(argv[mi], (const void *)&main, msg, sizeof(msg));
        if (ops == NULL) {
            fprintf(stderr, "digest_alone: cannot load %s: %s\n", argv[mi], msg);
            return 1;
        }
        kvwc_exec_h x = NULL;
        if (ops->set_device(0) != KVW_OK || ops->exec_create(&x) != KVW_OK) {
            fprintf(stderr, "digest_alone: %s: %s\n", argv[mi], ops->last_error());
            return 1;
        }
        int ci = 0;
        for (uint32_t nh : {HEADS, 2u})
            for (uint32_t nrooms : {1u, 8u}) {
                std::mt19937 g(42 + nh + 10 * nrooms);
                std::vector<Room> rooms(nrooms);
                for (auto &r : rooms)
                    room_build(r, bufs, g, nh);
                std::vector<kvwc_digest_in_t> in(nrooms);
                for (uint32_t i = 0; i < nrooms; i++) {
                    memset(&in[i], 0, sizeof(in[i]));
                    in[i].plan = &rooms[i].plan;
                    in[i].dsegs = rooms[i].dsegs.data();
                    in[i].dst_side = 1;
                    memcpy(in[i].secret, sec, sizeof(sec));
                    in[i].units = rooms[i].units.data();
                    in[i].num_units = NBUF * nh;
                    in[i].slot = -1;
                }
                uint64_t bytes = (uint64_t)nrooms * NBUF * ROOM_TOK * nh * ROW;
                std::vector<double> t;
                for (unsigned rep = 0; rep < REPS + 1; rep++) {
                    for (auto &r : rooms)
                        std::fill(r.units.begin(), r.units.end(), 0);
                    double a = now_ms();
                    if (ops->exec_digest(x, in.data(), nrooms) != KVW_OK) {
                        fprintf(stderr, "digest_alone: exec_digest: %s\n", ops->last_error());
                        return 1;
                    }
                    if (rep)
                        t.push_back(now_ms() - a);
                }
                std::sort(t.begin(), t.end());
                double ms = t[t.size() / 2];
                // Baseline: a D2D copy of the same byte count, events, median.
                char *c0, *c1;
                CK(cudaMalloc(&c0, bytes));
                CK(cudaMalloc(&c1, bytes));
                cudaEvent_t e0, e1;
                CK(cudaEventCreate(&e0));
                CK(cudaEventCreate(&e1));
                std::vector<float> tc;
                for (unsigned rep = 0; rep < REPS + 1; rep++) {
                    CK(cudaEventRecord(e0));
                    CK(cudaMemcpyAsync(c1, c0, bytes, cudaMemcpyDeviceToDevice));
                    CK(cudaEventRecord(e1));
                    CK(cudaEventSynchronize(e1));
                    float f = 0;
                    CK(cudaEventElapsedTime(&f, e0, e1));
                    if (rep)
                        tc.push_back(f);
                }
                std::sort(tc.begin(), tc.end());
                CK(cudaFree(c0));
                CK(cudaFree(c1));
                CK(cudaEventDestroy(e0));
                CK(cudaEventDestroy(e1));
                // Correctness: buffers 0 and 71 against the CPU, all against module 1.
                std::vector<uint64_t> cu(nh);
                bool ok = true;
                cpu_units(rooms[0], h0, 0, nh, sec, cu.data());
                for (uint32_t k = 0; k < nh; k++)
                    ok &= cu[k] == rooms[0].units[k];
                cpu_units(rooms[0], h71, NBUF - 1, nh, sec, cu.data());
                for (uint32_t k = 0; k < nh; k++)
                    ok &= cu[k] == rooms[0].units[(NBUF - 1) * nh + k];
                std::vector<uint64_t> all;
                for (auto &r : rooms)
                    all.insert(all.end(), r.units.begin(), r.units.end());
                if (mi == 1)
                    ref.push_back(all);
                else
                    ok &= ref[ci] == all;
                char cname[32];
                snprintf(cname, sizeof(cname), "%s %ux", nh == HEADS ? "TP1" : "TP4 slice", nrooms);
                double cgb = bytes / (tc[tc.size() / 2] * 1e6);
                printf("%-44.44s %-12s %8.0f %9.3f %8.0f %9.0f %6.2f %s\n", argv[mi], cname,
                       bytes / 1e6, ms, bytes / (ms * 1e6), cgb, bytes / (ms * 1e6) / cgb,
                       ok ? "match" : "MISMATCH");
                if (!ok)
                    return 1;
                ci++;
            }
        ops->exec_destroy(x);
    }
    return 0;
}
