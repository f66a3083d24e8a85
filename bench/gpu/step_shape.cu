// Experiment (bench/gpu/NOTES.md, "The direct kernel's fast path", last table): the
// protocol's per-step copy kernel moves one TP1->TP1 8192-token room of gpt-oss-120b at
// 1.9 TB/s when the pools hold one room and takes 60% longer when they hold eight rooms
// (the room's pages random within each buffer), while a plain kernel copying 4,096 random
// 64 KiB pages of two 16 GiB pools (tlb_cold.cu) shows no such slowdown. Does a plain
// kernel show it when it is given the step's exact shape: 72 separate buffers per side
// (36 layers x K, V; 1024 bytes per token and buffer, 64-token pages of 64 KiB), 128 pages
// of each buffer in one launch, the pools P pages per buffer?
//
// Kernel: one 128-thread block per 16 KiB of a page (move_page.cuh), the block index ->
// (page job, sub-page), jobs buffer-major as the protocol's plan orders them (layer, K/V,
// then the room's pages in list order); a job is {buffer, source page, destination page}.
// Shapes:
//   72x128  every buffer P pages (P = 128, 256, 512, 1024: one, two, four, eight rooms),
//           128 pages copied from each: 9,216 jobs, 604 MB. Page lists "indep" (every
//           buffer its own source and destination list) or "shared" (one list per side for
//           all buffers, as an engine's page table of a request).
//   step    the protocol bench's own step (bench/cli/cmd_bench_gpu.c, tools/testkit):
//           layers alternate sliding window (even, window 128) and full; full buffers
//           P + 1 pages, the room's 128 pages; window buffers 3 x rooms + 1 pages, the
//           room's last 2 pages; every buffer one cudaMalloc with its data 64 bytes in (the
//           test kit's guard); one list per side and pool for all its buffers, the room's
//           slice of one random permutation of the pool. 36 x 128 + 36 x 2 = 4,680 jobs,
//           307 MB (the NOTES' "307 MB step").
// Orders: "random" (pages without repetition, random within the pool), "sorted" (the
// same, sorted), "consec" (consecutive pages: a room's slot i x 128 .. + 127), "first128"
// (pages 0..127 in random order: the page set of the one-room pool in a larger pool, so
// that pool size and page set are told apart).
// Lists: "warm" repeats one list every launch (slot 0 for consec); "fresh" takes a new one
// per launch (72x128: newly drawn; step: the next room's slice of the same permutation, as
// the bench's repetitions cycle through their rooms, so with one room it equals warm).
// Destination: "own" (this process's cudaMalloc), "ipc" (with the argument ipc: the pools
// of a forked parent process, exported with cudaIpcGetMemHandle and opened here with
// cudaIpcOpenMemHandle, as the decode's KV on cuda_ipc; "own" is measured too, same run).
// Baseline: cudaMemcpyAsync device to device of the same bytes, contiguous, own memory,
// before and after the cases (ratio = kernel GB/s / that copy's GB/s: in the lines as they
// come, the first set's median; in the summary, the median of both sets). Every case's first launch is untimed and checked: a few destination pages are
// cleared before it and compared after it with the source's pattern (buffer, page, word).
// CUDA events, median of REPS launches (default 15). Not part of the build:
//
//   nvcc -O2 -arch=sm_90 -std=c++17 -o /tmp/step_shape bench/gpu/step_shape.cu
//   /tmp/step_shape [ipc] [warm|fresh] [reps N]
//
// GPU memory: about 7 GiB per side at P = 1024 (both shapes; each P's pools are freed
// before the next), 15 GiB in all, 22 GiB with ipc. Runtime: seconds (192 cases with ipc,
// 16 launches of at most ~1 ms each, plus set-up).
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "move_page.cuh"

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

static const size_t PAGE = 65536, SUB = 16384, ROOM = 128, NBUF = 72, GUARD = 64;
static const uint32_t POOLS[] = {128, 256, 512, 1024};
static const int NPOOL = 4;
static const uint32_t SWA_ROOM = 2, SWA_SLOT = 3; // window 128 tokens: 2 pages, 3 reserved
static const char *const ORDER[] = {"random", "sorted", "consec", "first128"};

// Source pattern: word w of page p of buffer b (b < 128, p < 2048, w < 16384).
__host__ __device__ __forceinline__ uint32_t pattern(uint32_t b, uint32_t p, uint32_t w)
{
    return b << 25 | p << 14 | w;
}

__global__ void fill(uint32_t *d, uint32_t pages, uint32_t b)
{
    size_t n = (size_t)pages * (PAGE / 4);
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        d[i] = pattern(b, (uint32_t)(i / (PAGE / 4)), (uint32_t)(i % (PAGE / 4)));
}

// One block per 16 KiB: job {buffer, source page, destination page, 0}.
__global__ void stepcopy(char *const *src, char *const *dst, const uint4 *jobs, uint32_t off)
{
    uint4 j = jobs[blockIdx.x / (PAGE / SUB)];
    uint32_t sub = blockIdx.x % (PAGE / SUB);
    const uint4 *s = (const uint4 *)(src[j.x] + off + (size_t)j.y * PAGE + sub * SUB);
    uint4 *d = (uint4 *)(dst[j.x] + off + (size_t)j.z * PAGE + sub * SUB);
    move_page(s, d);
}

// Buffer b's pages in a pool of P (72x128) or in the bench's step for `rooms` rooms.
static uint32_t buf_pages(bool step, uint32_t P, uint32_t b)
{
    if (!step)
        return P;
    uint32_t rooms = P / ROOM;
    return (b / 2) % 2 == 0 ? rooms * SWA_SLOT + 1 : P + 1; // layer b/2: even = window
}

static uint32_t buf_room(bool step, uint32_t b)
{
    return step && (b / 2) % 2 == 0 ? SWA_ROOM : ROOM;
}

// STEP_ROUND=N (bytes, environment): the step's allocations rounded up to a multiple of
// N (2097152: whole 2 MiB pages), the data still GUARD bytes in.
static size_t buf_bytes(bool step, uint32_t P, uint32_t b)
{
    size_t n = buf_pages(step, P, b) * PAGE + (step ? 2 * GUARD : 0);
    const char *r = getenv("STEP_ROUND");
    size_t q = r ? strtoull(r, NULL, 0) : 0;
    return step && q > 1 ? (n + q - 1) / q * q : n;
}

// The buffers of one side for one P: [0] the 72x128 shape, [1] the step.
struct side {
    std::vector<char *> buf[2];
    char **dbase[2] = {NULL, NULL};
    bool imported = false;
};

static void upload_bases(side &s)
{
    for (int k = 0; k < 2; k++) {
        CK(cudaMalloc(&s.dbase[k], NBUF * sizeof(char *)));
        CK(cudaMemcpy(s.dbase[k], s.buf[k].data(), NBUF * sizeof(char *), cudaMemcpyHostToDevice));
    }
}

// Allocates (layer order, as the test kit) and fills with the pattern (src) or a byte.
static void alloc_side(side &s, uint32_t P, bool pat, int byte)
{
    for (int k = 0; k < 2; k++) {
        s.buf[k].resize(NBUF);
        for (uint32_t b = 0; b < NBUF; b++) {
            size_t n = buf_bytes(k, P, b);
            CK(cudaMalloc(&s.buf[k][b], n));
            CK(cudaMemset(s.buf[k][b], byte, n));
            if (pat)
                fill<<<1024, 256>>>((uint32_t *)(s.buf[k][b] + (k ? GUARD : 0)), buf_pages(k, P, b), b);
        }
    }
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
}

static void free_side(side &s)
{
    for (int k = 0; k < 2; k++) {
        for (char *p : s.buf[k])
            CK(s.imported ? cudaIpcCloseMemHandle(p) : cudaFree(p));
        s.buf[k].clear();
        if (s.dbase[k])
            CK(cudaFree(s.dbase[k]));
        s.dbase[k] = NULL;
    }
}

static bool try_read(int fd, void *p, size_t n)
{
    for (size_t g = 0; g < n;) {
        ssize_t r = read(fd, (char *)p + g, n - g);
        if (r <= 0)
            return false;
        g += (size_t)r;
    }
    return true;
}

static void xread(int fd, void *p, size_t n)
{
    if (!try_read(fd, p, n)) {
        fprintf(stderr, "step_shape: pipe closed\n");
        exit(1);
    }
}

static void xwrite(int fd, const void *p, size_t n)
{
    if (write(fd, p, n) != (ssize_t)n) {
        fprintf(stderr, "step_shape: pipe write failed\n");
        exit(1);
    }
}

// The parent of the ipc mode: owns the destination pools. Commands: P (allocate that
// pool's buffers, after freeing the last ones, and send their handles), 0 (quit).
static int owner(int rfd, int wfd, pid_t child)
{
    side s;
    uint32_t P;
    for (;;) {
        if (!try_read(rfd, &P, sizeof(P)))
            P = 0; // the child is gone
        for (int k = 0; k < 2; k++)
            for (char *p : s.buf[k])
                CK(cudaFree(p));
        s.buf[0].clear(), s.buf[1].clear();
        if (P == 0)
            break;
        alloc_side(s, P, false, 2);
        for (int k = 0; k < 2; k++)
            for (char *p : s.buf[k]) {
                cudaIpcMemHandle_t mh;
                CK(cudaIpcGetMemHandle(&mh, p));
                xwrite(wfd, &mh, sizeof(mh));
            }
    }
    int st = 0;
    waitpid(child, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 1;
}

static void import_side(side &s, uint32_t P, int rfd, int wfd)
{
    xwrite(wfd, &P, sizeof(P));
    s.imported = true;
    for (int k = 0; k < 2; k++) {
        s.buf[k].resize(NBUF);
        for (uint32_t b = 0; b < NBUF; b++) {
            cudaIpcMemHandle_t mh;
            xread(rfd, &mh, sizeof(mh));
            CK(cudaIpcOpenMemHandle((void **)&s.buf[k][b], mh, cudaIpcMemLazyEnablePeerAccess));
        }
    }
    upload_bases(s);
}

// n pages of a pool of `pool` in the given order; slot: the room's slot for consec.
static void draw(std::vector<uint32_t> &out, uint32_t pool, uint32_t n, int order, uint32_t slot,
                 std::mt19937 &g)
{
    out.resize(n);
    if (order == 2) {
        for (uint32_t i = 0; i < n; i++)
            out[i] = slot * n + i;
        return;
    }
    std::vector<uint32_t> all(order == 3 ? n : pool);
    for (uint32_t i = 0; i < all.size(); i++)
        all[i] = i;
    for (uint32_t i = 0; i < n; i++) // partial Fisher-Yates
        std::swap(all[i], all[i + g() % (all.size() - i)]);
    std::copy(all.begin(), all.begin() + n, out.begin());
    if (order == 1)
        std::sort(out.begin(), out.end());
}

// The jobs of launches 0 .. reps (launch 0: the checked one; for warm all equal).
static std::vector<uint4> make_jobs(bool step, bool shared, int order, bool fresh, uint32_t P,
                                    int reps, std::mt19937 &g, size_t *njobs)
{
    size_t nj = 0;
    for (uint32_t b = 0; b < NBUF; b++)
        nj += buf_room(step, b);
    *njobs = nj;
    std::vector<uint4> jobs;
    jobs.reserve(nj * (reps + 1));
    uint32_t rooms = P / ROOM;
    // step: one permutation per side and pool, drawn once; launch r takes room r % rooms.
    std::vector<uint32_t> perm[2][2]; // [side][pool: 0 window, 1 full]
    if (step)
        for (int sd = 0; sd < 2; sd++)
            for (int pl = 0; pl < 2; pl++) {
                uint32_t pool = pl ? P + 1 : rooms * SWA_SLOT + 1;
                if (order == 2)
                    draw(perm[sd][pl], pool, pool, 2, 0, g); // the pool in order
                else if (order == 3)
                    perm[sd][pl].clear();
                else
                    draw(perm[sd][pl], pool, pool, 0, 0, g);
            }
    std::vector<uint32_t> ls[NBUF], ld[NBUF];
    for (int r = 0; r <= reps; r++) {
        if (r == 0 || fresh) {
            for (uint32_t b = 0; b < NBUF; b++) {
                uint32_t n = buf_room(step, b);
                if (step) {
                    int pl = n == ROOM;
                    if (order == 3) { // pages 0 .. n-1, random order (the slot-0 set)
                        if (b == 0 || b == 2) {
                            draw(ls[b], n, n, 3, 0, g);
                            draw(ld[b], n, n, 3, 0, g);
                        } else {
                            ls[b] = ls[pl ? 2 : 0], ld[b] = ld[pl ? 2 : 0];
                        }
                        continue;
                    }
                    uint32_t slot = fresh ? (uint32_t)r % rooms : 0;
                    ls[b].assign(perm[0][pl].begin() + slot * n, perm[0][pl].begin() + (slot + 1) * n);
                    ld[b].assign(perm[1][pl].begin() + slot * n, perm[1][pl].begin() + (slot + 1) * n);
                    if (order == 1) {
                        std::sort(ls[b].begin(), ls[b].end());
                        std::sort(ld[b].begin(), ld[b].end());
                    }
                } else if (shared && b > 0) {
                    ls[b] = ls[0], ld[b] = ld[0];
                } else {
                    uint32_t s1 = fresh && order == 2 ? g() % rooms : 0, s2 = fresh && order == 2 ? g() % rooms : 0;
                    draw(ls[b], P, ROOM, order, s1, g);
                    draw(ld[b], P, ROOM, order, s2, g);
                }
            }
        }
        for (uint32_t b = 0; b < NBUF; b++)
            for (size_t i = 0; i < ls[b].size(); i++)
                jobs.push_back(make_uint4(b, ls[b][i], ld[b][i], 0));
    }
    return jobs;
}

struct row {
    std::string name;
    float us[NPOOL];
    double gbs[NPOOL], ratio[NPOOL];
};

static float median(std::vector<float> t)
{
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

int main(int argc, char **argv)
{
    bool ipc = false;
    int only = -1, reps = 15; // only: 0 warm, 1 fresh
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "ipc"))
            ipc = true;
        else if (!strcmp(argv[i], "warm"))
            only = 0;
        else if (!strcmp(argv[i], "fresh"))
            only = 1;
        else if (!strcmp(argv[i], "reps") && i + 1 < argc)
            reps = std::max(1, atoi(argv[++i]));
        else {
            fprintf(stderr, "usage: %s [ipc] [warm|fresh] [reps N]\n", argv[0]);
            return 2;
        }
    }
    int p2c[2] = {-1, -1}, c2p[2] = {-1, -1};
    if (ipc) { // fork before any CUDA call; the parent owns the destination
        if (pipe(p2c) || pipe(c2p))
            return 1;
        pid_t pid = fork();
        if (pid < 0)
            return 1;
        if (pid > 0) {
            close(c2p[1]), close(p2c[0]);
            return owner(c2p[0], p2c[1], pid);
        }
        close(c2p[0]), close(p2c[1]);
    }
    int rfd = p2c[0], wfd = c2p[1];
    CK(cudaSetDevice(0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::mt19937 g(7);
    const size_t bytes_a = NBUF * ROOM * PAGE, bytes_s = (NBUF / 2 * ROOM + NBUF / 2 * SWA_ROOM) * PAGE;
    printf("step_shape: %s, 72 buffers per side, 64 KiB pages, 128 pages per buffer per launch "
           "(72x128: %.0f MB, step: %.0f MB), destination own%s, median of %d\n", prop.name,
           bytes_a / 1e6, bytes_s / 1e6, ipc ? " and another process's (cudaIpcOpenMemHandle)" : "",
           reps);

    // Baseline: contiguous device-to-device copies of both sizes, own memory.
    char *bs, *bd;
    CK(cudaMalloc(&bs, bytes_a));
    CK(cudaMalloc(&bd, bytes_a));
    CK(cudaMemset(bs, 1, bytes_a));
    CK(cudaMemset(bd, 2, bytes_a));
    std::vector<float> base[2]; // [0] 604 MB, [1] 307 MB
    auto baseline = [&](const char *when) {
        for (int k = 0; k < 2; k++) {
            size_t n = k ? bytes_s : bytes_a;
            std::vector<float> t;
            CK(cudaMemcpyAsync(bd, bs, n, cudaMemcpyDeviceToDevice));
            for (int r = 0; r < reps; r++) {
                CK(cudaEventRecord(e0));
                CK(cudaMemcpyAsync(bd, bs, n, cudaMemcpyDeviceToDevice));
                CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1));
                float ms;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                t.push_back(ms);
                base[k].push_back(ms);
            }
            float m = median(t);
            printf("cudaMemcpyAsync D2D %.0f MB, %-6s %8.1f us %6.0f GB/s\n", n / 1e6, when, m * 1e3,
                   n / (m * 1e-3) / 1e9);
        }
    };
    baseline("first");
    fflush(stdout);

    std::vector<row> rows;
    auto row_at = [&](const std::string &name) -> row & {
        for (row &r : rows)
            if (r.name == name)
                return r;
        rows.push_back(row{name, {}, {}, {}});
        for (int i = 0; i < NPOOL; i++)
            rows.back().us[i] = -1;
        return rows.back();
    };
    // Launch 0 checked; launches 1 .. reps timed.
    std::vector<char> h(PAGE);
    uint4 *djobs = NULL;
    size_t djobs_cap = 0;
    printf("%-38s %5s %9s %7s %6s\n", "case", "P", "us", "GB/s", "/D2D");
    for (int pi = 0; pi < NPOOL; pi++) {
        uint32_t P = POOLS[pi];
        side src, own, imp;
        alloc_side(src, P, true, 0);
        upload_bases(src);
        alloc_side(own, P, false, 2);
        upload_bases(own);
        if (ipc)
            import_side(imp, P, rfd, wfd);
        for (int di = 0; di < (ipc ? 2 : 1); di++) {
            side &dst = di ? imp : own;
            for (int step = 0; step < 2; step++)
                for (int shared = step; shared < 2; shared++)
                    for (int order = 0; order < 4; order++)
                        for (int fresh = 0; fresh < 2; fresh++) {
                            if (only >= 0 && fresh != only)
                                continue;
                            size_t nj;
                            std::vector<uint4> jobs = make_jobs(step, shared, order, fresh, P, reps, g, &nj);
                            if (jobs.size() * sizeof(uint4) > djobs_cap) {
                                if (djobs)
                                    CK(cudaFree(djobs));
                                djobs_cap = jobs.size() * sizeof(uint4);
                                CK(cudaMalloc(&djobs, djobs_cap));
                            }
                            CK(cudaMemcpy(djobs, jobs.data(), jobs.size() * sizeof(uint4), cudaMemcpyHostToDevice));
                            uint32_t off = step ? GUARD : 0;
                            unsigned grid = (unsigned)(nj * (PAGE / SUB));
                            // The check: clear some destination pages, launch, compare.
                            size_t pick[8] = {0, nj - 1, nj / 2, 1, 0, 0, 0, 0};
                            for (int i = 4; i < 8; i++)
                                pick[i] = g() % nj;
                            for (size_t j : pick)
                                CK(cudaMemset(dst.buf[step][jobs[j].x] + off + (size_t)jobs[j].z * PAGE, 0xee, PAGE));
                            stepcopy<<<grid, 128>>>(src.dbase[step], dst.dbase[step], djobs, off);
                            CK(cudaGetLastError());
                            CK(cudaDeviceSynchronize());
                            for (size_t j : pick) {
                                uint4 jb = jobs[j];
                                CK(cudaMemcpy(h.data(), dst.buf[step][jb.x] + off + (size_t)jb.z * PAGE, PAGE,
                                              cudaMemcpyDeviceToHost));
                                const uint32_t *w = (const uint32_t *)h.data();
                                for (uint32_t i = 0; i < PAGE / 4; i++)
                                    if (w[i] != pattern(jb.x, jb.y, i)) {
                                        fprintf(stderr, "step_shape: MISMATCH P %u %s %s %s: buffer %u source page %u -> "
                                                "destination page %u, word %u: %08x, expected %08x\n", P,
                                                step ? "step" : "72x128", ORDER[order], di ? "ipc" : "own", jb.x,
                                                jb.y, jb.z, i, w[i], pattern(jb.x, jb.y, i));
                                        exit(1);
                                    }
                            }
                            std::vector<float> t;
                            for (int r = 1; r <= reps; r++) {
                                CK(cudaEventRecord(e0));
                                stepcopy<<<grid, 128>>>(src.dbase[step], dst.dbase[step], djobs + (size_t)r * nj, off);
                                CK(cudaEventRecord(e1));
                                CK(cudaEventSynchronize(e1));
                                CK(cudaGetLastError());
                                float ms;
                                CK(cudaEventElapsedTime(&ms, e0, e1));
                                t.push_back(ms);
                            }
                            float m = median(t);
                            double by = step ? bytes_s : bytes_a, gbs = by / (m * 1e-3) / 1e9;
                            char name[96];
                            snprintf(name, sizeof(name), "%-6s %-6s %-8s %-5s %s", step ? "step" : "72x128",
                                     step ? "shared" : shared ? "shared" : "indep", ORDER[order],
                                     fresh ? "fresh" : "warm", di ? "ipc" : "own");
                            row &rw = row_at(name);
                            rw.us[pi] = m * 1e3;
                            rw.gbs[pi] = gbs;
                            printf("%-38s %5u %9.1f %7.0f %6.2f\n", name, step ? P + 1 : P, m * 1e3, gbs,
                                   gbs / (by / (median(base[step]) * 1e-3) / 1e9));
                            fflush(stdout);
                        }
        }
        free_side(src);
        free_side(own);
        if (ipc)
            free_side(imp);
    }
    if (ipc) {
        uint32_t z = 0;
        xwrite(wfd, &z, sizeof(z));
    }
    baseline("last");
    double bgbs[2];
    for (int k = 0; k < 2; k++)
        bgbs[k] = (k ? bytes_s : bytes_a) / (median(base[k]) * 1e-3) / 1e9;
    printf("\nD2D baseline (median of both sets): 604 MB %.0f GB/s, 307 MB %.0f GB/s\n", bgbs[0], bgbs[1]);
    printf("summary: kernel us, GB/s and / D2D of the same bytes, by pool pages per buffer "
           "(step: P + 1 full, 3 x rooms + 1 window)\n");
    printf("%-34s", "shape  lists  order    list  dst");
    for (int pi = 0; pi < NPOOL; pi++)
        printf(" | P %4u:%4s %5s %4s", POOLS[pi], "us", "GB/s", "/D2D");
    printf("\n");
    for (row &r : rows) {
        printf("%-34s", r.name.c_str());
        bool step = r.name.compare(0, 4, "step") == 0;
        for (int pi = 0; pi < NPOOL; pi++) {
            if (r.us[pi] < 0) {
                printf(" | %20s", "-");
                continue;
            }
            r.ratio[pi] = r.gbs[pi] / bgbs[step];
            printf(" | %10.1f %5.0f %4.2f", r.us[pi], r.gbs[pi], r.ratio[pi]);
        }
        printf("\n");
    }
    return 0;
}
