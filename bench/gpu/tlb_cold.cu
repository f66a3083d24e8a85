// Experiment (bench/gpu/NOTES.md, "Cold translations"): the protocol's step kernels run
// at 1.8 TB/s when they copy pages touched one repetition before and at 1.1 TB/s or less
// when the pages come from a pool eight times larger, even in page order. Is the cost the
// address translation of memory not touched recently, and does resolving the
// translations before the copy help? One process, two pools (source, destination) of
// POOL_GB GiB each, pages of 64 KiB. Each launch copies 4,096 pages (256 MiB) with a
// plain kernel (one 128-thread block per 16 KiB, 8 loads of 16 B in flight per thread).
// Page lists: "warm" repeats one list every repetition; "cold" takes a new list for each
// repetition and, before it, a kernel touches one word in every 2 MiB of a third,
// FLUSH_GB GiB buffer (so that no translation of the pools survives). Orders: random
// pages of the whole pool, or a run of consecutive pages. "touch first": a kernel that
// reads one word of each page of the list (source and destination) runs before the copy,
// timed apart. Baseline: cudaMemcpyAsync of 256 MiB, warm and cold. CUDA events, median
// of 15. Not part of the build:
//
//   nvcc -O2 -arch=sm_90 -o /tmp/tlb_cold bench/gpu/tlb_cold.cu && /tmp/tlb_cold [ALLOC_MB [ipc]]
//
// ALLOC_MB (default: the whole pool in one allocation) cuts each pool into allocations of
// that size, as an engine's per-layer KV buffers are; "ipc": the destination pool belongs
// to a second process and is opened through CUDA IPC.
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <random>
#include <vector>

#include "move_page.cuh"

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

static const size_t POOL_GB = 16, FLUSH_GB = 32;
static const size_t PAGE = 65536, SUB = 16384, NP = 4096, REPS = 15;

// A pool is POOL_GB GiB in allocations of ppa pages each: page i lies in allocation
// i / ppa, at (i % ppa) * PAGE.
__device__ __forceinline__ char *page_at(char *const *bases, uint32_t i, uint32_t ppa)
{
    return bases[i / ppa] + (size_t)(i % ppa) * PAGE;
}

__global__ void pagecopy(char *const *src, char *const *dst, const uint32_t *sp, const uint32_t *dp,
                         uint32_t ppa)
{
    uint32_t p = blockIdx.x / (PAGE / SUB), sub = blockIdx.x % (PAGE / SUB);
    const uint4 *s = (const uint4 *)(page_at(src, sp[p], ppa) + sub * SUB);
    uint4 *d = (uint4 *)(page_at(dst, dp[p], ppa) + sub * SUB);
    move_page(s, d);
}

// One word of every page of both lists: resolves their translations.
__global__ void touch(char *const *src, char *const *dst, const uint32_t *sp, const uint32_t *dp,
                      uint32_t n, uint32_t ppa, unsigned *sink)
{
    uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    unsigned a = *(volatile const unsigned *)page_at(src, sp[i], ppa);
    unsigned b = *(volatile const unsigned *)page_at(dst, dp[i], ppa);
    if ((a ^ b) == 0x9e3779b9u)
        *sink = a;
}

// One word in every 2 MiB of the flush buffer.
__global__ void flush(const char *buf, size_t regions, unsigned *sink)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= regions)
        return;
    unsigned a = *(volatile const unsigned *)(buf + i * (2u << 20));
    if (a == 0x9e3779b9u)
        *sink = a;
}

struct lists {
    std::vector<uint32_t *> s, d; // device page lists, one pair per repetition
};

static lists make_lists(bool cold, bool random, std::mt19937 &g)
{
    lists L;
    uint32_t pool = (uint32_t)((POOL_GB << 30) / PAGE);
    std::vector<uint32_t> hs(NP), hd(NP);
    for (size_t r = 0; r < REPS; r++) {
        if (r == 0 || cold) {
            if (random) {
                std::vector<uint32_t> all(pool);
                for (uint32_t i = 0; i < pool; i++)
                    all[i] = i;
                std::shuffle(all.begin(), all.end(), g);
                std::copy(all.begin(), all.begin() + NP, hs.begin());
                std::shuffle(all.begin(), all.end(), g);
                std::copy(all.begin(), all.begin() + NP, hd.begin());
            } else {
                uint32_t a = g() % (pool - NP), b = g() % (pool - NP);
                for (uint32_t i = 0; i < NP; i++)
                    hs[i] = a + i, hd[i] = b + i;
            }
        }
        uint32_t *ds, *dd;
        CK(cudaMalloc(&ds, NP * 4));
        CK(cudaMalloc(&dd, NP * 4));
        CK(cudaMemcpy(ds, hs.data(), NP * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dd, hd.data(), NP * 4, cudaMemcpyHostToDevice));
        L.s.push_back(ds);
        L.d.push_back(dd);
    }
    return L;
}

static char **make_pool(size_t alloc_mb, int fill, std::vector<char *> &keep)
{
    size_t n = (POOL_GB << 10) / alloc_mb;
    std::vector<char *> h(n);
    for (size_t i = 0; i < n; i++) {
        CK(cudaMalloc(&h[i], alloc_mb << 20));
        CK(cudaMemset(h[i], fill, alloc_mb << 20));
        keep.push_back(h[i]);
    }
    char **d;
    CK(cudaMalloc(&d, n * sizeof(char *)));
    CK(cudaMemcpy(d, h.data(), n * sizeof(char *), cudaMemcpyHostToDevice));
    return d;
}

// The destination pool owned by another process (a parent that keeps it alive while this
// one runs) and opened here with cudaIpcOpenMemHandle, as a decode's KV is on cuda_ipc.
static char **import_pool(size_t alloc_mb, int rfd, std::vector<char *> &keep)
{
    size_t n = (POOL_GB << 10) / alloc_mb;
    std::vector<char *> h(n);
    for (size_t i = 0; i < n; i++) {
        cudaIpcMemHandle_t mh;
        if (read(rfd, &mh, sizeof(mh)) != (ssize_t)sizeof(mh)) {
            fprintf(stderr, "tlb_cold: short read of an IPC handle\n");
            exit(1);
        }
        CK(cudaIpcOpenMemHandle((void **)&h[i], mh, cudaIpcMemLazyEnablePeerAccess));
        keep.push_back(h[i]);
    }
    char **d;
    CK(cudaMalloc(&d, n * sizeof(char *)));
    CK(cudaMemcpy(d, h.data(), n * sizeof(char *), cudaMemcpyHostToDevice));
    return d;
}

int main(int argc, char **argv)
{
    size_t alloc_mb = argc > 1 ? strtoull(argv[1], NULL, 10) : (POOL_GB << 10);
    bool ipc = argc > 2 && !strcmp(argv[2], "ipc");
    uint32_t ppa = (uint32_t)((alloc_mb << 20) / PAGE);
    int p2c[2] = {-1, -1}, c2p[2] = {-1, -1};
    if (ipc) {
        if (pipe(p2c) || pipe(c2p))
            return 1;
        pid_t pid = fork();
        if (pid < 0)
            return 1;
        if (pid > 0) { // the owner of the destination pool
            std::vector<char *> own;
            size_t n = (POOL_GB << 10) / alloc_mb;
            for (size_t i = 0; i < n; i++) {
                char *b;
                CK(cudaMalloc(&b, alloc_mb << 20));
                CK(cudaMemset(b, 2, alloc_mb << 20));
                cudaIpcMemHandle_t mh;
                CK(cudaIpcGetMemHandle(&mh, b));
                if (write(p2c[1], &mh, sizeof(mh)) != (ssize_t)sizeof(mh))
                    return 1;
                own.push_back(b);
            }
            CK(cudaDeviceSynchronize());
            int st = 0;
            waitpid(pid, &st, 0);
            return WIFEXITED(st) ? WEXITSTATUS(st) : 1;
        }
    }
    char *fl;
    unsigned *sink;
    std::vector<char *> keep;
    char **src = make_pool(alloc_mb, 1, keep);
    char **dst = ipc ? import_pool(alloc_mb, p2c[0], keep) : make_pool(alloc_mb, 2, keep);
    CK(cudaMalloc(&fl, FLUSH_GB << 30));
    CK(cudaMalloc(&sink, 4));
    CK(cudaMemset(fl, 3, FLUSH_GB << 30));
    cudaEvent_t e0, e1, e2;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaEventCreate(&e2));
    std::mt19937 g(7);
    size_t regions = (FLUSH_GB << 30) >> 21;
    double bytes = (double)NP * PAGE;
    printf("tlb_cold: %zu x 64 KiB pages (%.0f MiB) per launch, pools of %zu GiB in allocations of "
           "%zu MiB, destination %s, median of %zu\n", NP, bytes / 1048576, POOL_GB, alloc_mb,
           ipc ? "another process's (cudaIpcOpenMemHandle)" : "own", REPS);
    printf("%-40s %10s %10s %10s\n", "case", "copy us", "GB/s", "touch us");
    // Baseline copies: warm (same 256 MiB), cold (a new place each time, after the flush).
    for (int cold = 0; cold < 2; cold++) {
        std::vector<float> t;
        for (size_t r = 0; r < REPS; r++) {
            size_t off = cold && alloc_mb > 512 ? ((size_t)(g() % ((alloc_mb << 20) / PAGE - NP))) * PAGE : 0;
            if (cold)
                flush<<<(unsigned)((regions + 255) / 256), 256>>>(fl, regions, sink);
            CK(cudaEventRecord(e0));
            char *a = keep[cold ? g() % (keep.size() / 2) : 0], *b = keep[keep.size() / 2 + (cold ? g() % (keep.size() / 2) : 0)];
            size_t n = std::min((size_t)bytes, alloc_mb << 20);
            CK(cudaMemcpyAsync(b + off, a + off, n, cudaMemcpyDeviceToDevice));
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            t.push_back(ms);
        }
        std::sort(t.begin(), t.end());
        double n = (double)std::min((size_t)bytes, alloc_mb << 20);
        printf("%-40s %10.1f %10.0f %10s\n", cold ? "cudaMemcpyAsync, cold" : "cudaMemcpyAsync, warm",
               t[REPS / 2] * 1e3, n / (t[REPS / 2] * 1e-3) / 1e9, "-");
    }
    for (int random = 0; random < 2; random++)
        for (int cold = 0; cold < 2; cold++)
            for (int pre = 0; pre < 2; pre++) {
                if (pre && !cold)
                    continue;
                lists L = make_lists(cold, random, g);
                std::vector<float> t, tt;
                for (size_t r = 0; r < REPS; r++) {
                    if (cold)
                        flush<<<(unsigned)((regions + 255) / 256), 256>>>(fl, regions, sink);
                    CK(cudaEventRecord(e0));
                    if (pre)
                        touch<<<NP / 128, 128>>>(src, dst, L.s[r], L.d[r], NP, ppa, sink);
                    CK(cudaEventRecord(e1));
                    pagecopy<<<NP * (PAGE / SUB), 128>>>(src, dst, L.s[r], L.d[r], ppa);
                    CK(cudaEventRecord(e2));
                    CK(cudaEventSynchronize(e2));
                    CK(cudaGetLastError());
                    float a, b;
                    CK(cudaEventElapsedTime(&a, e0, e1));
                    CK(cudaEventElapsedTime(&b, e1, e2));
                    tt.push_back(a);
                    t.push_back(b);
                }
                std::sort(t.begin(), t.end());
                std::sort(tt.begin(), tt.end());
                char name[64];
                snprintf(name, sizeof(name), "%s pages, %s%s", random ? "random" : "consecutive",
                         cold ? "cold" : "warm", pre ? ", touch first" : "");
                char tb[16] = "-";
                if (pre)
                    snprintf(tb, sizeof(tb), "%.1f", tt[REPS / 2] * 1e3);
                printf("%-40s %10.1f %10.0f %10s\n", name, t[REPS / 2] * 1e3,
                       bytes / (t[REPS / 2] * 1e-3) / 1e9, tb);
                for (size_t r = 0; r < REPS; r++) {
                    CK(cudaFree(L.s[r]));
                    CK(cudaFree(L.d[r]));
                }
            }
    return 0;
}
