// Experiment (bench/gpu/NOTES.md, "IPC mappings are not the cost"): does moving 16 KiB
// pages to or from random places cost more when the memory is another process's, opened
// through IPC, than when it is the kernel's own? The parent owns the destination pools
// (one 4 GiB cudaMalloc exported with cudaIpcGetMemHandle, 64 cudaMallocs of 64 MiB each
// exported the same way, one 4 GiB cuMemCreate exported as a POSIX fd); the child imports
// them and times a plain page-copy kernel (one 128-thread block per page, 8 loads of 16 B
// in flight per thread) with sequential, random, sorted-random and small-pool page
// orders, against its own local allocations and a device-to-device cudaMemcpyAsync of
// the same 256 MiB (CUDA events, median of 21). Not part of the build:
//
//   nvcc -O2 -arch=sm_90 -o /tmp/ipc_pages bench/gpu/ipc_pages.cu -lcuda && /tmp/ipc_pages
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <vector>

#include "move_page.cuh" // one block of 128 threads per 16 KiB page

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)
#define DK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s_; cuGetErrorString(r_, &s_); fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_); exit(1); } } while (0)

static const size_t DST = 4ull << 30;   // destination pool
static const size_t PAGE = 16384;
static const size_t NP = 16384;         // pages moved per launch: 256 MiB

// Sequential source pages to destination pages perm[] (write side).
__global__ void pagecopy(const uint4 *src, char *dst, const uint32_t *perm)
{
    size_t p = blockIdx.x;
    const uint4 *s = src + p * (PAGE / 16);
    uint4 *d = (uint4 *)(dst + (size_t)perm[p] * PAGE);
    move_page(s, d);
}

// Source pages perm[] of a pool to sequential local pages (read side).
__global__ void pageread(const char *src, uint4 *dst, const uint32_t *perm)
{
    size_t p = blockIdx.x;
    const uint4 *s = (const uint4 *)(src + (size_t)perm[p] * PAGE);
    uint4 *d = dst + p * (PAGE / 16);
    move_page(s, d);
}

// Like pagecopy, the destination pool made of several allocations of ppb pages each.
__global__ void pagecopy_multi(const uint4 *src, char *const *bases, const uint32_t *perm, uint32_t ppb)
{
    size_t p = blockIdx.x;
    const uint4 *s = src + p * (PAGE / 16);
    uint32_t q = perm[p];
    uint4 *d = (uint4 *)(bases[q / ppb] + (size_t)(q % ppb) * PAGE);
    move_page(s, d);
}

static int send_fd(int sock, int fd, const void *buf, size_t len)
{
    struct msghdr m = {};
    struct iovec iov = {(void *)buf, len};
    char c[CMSG_SPACE(sizeof(int))] = {};
    m.msg_iov = &iov; m.msg_iovlen = 1;
    if (fd >= 0) {
        m.msg_control = c; m.msg_controllen = sizeof(c);
        struct cmsghdr *h = CMSG_FIRSTHDR(&m);
        h->cmsg_level = SOL_SOCKET; h->cmsg_type = SCM_RIGHTS; h->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(h), &fd, sizeof(int));
    }
    return sendmsg(sock, &m, 0) == (ssize_t)len ? 0 : -1;
}

static int recv_fd(int sock, int *fd, void *buf, size_t len)
{
    struct msghdr m = {};
    struct iovec iov = {buf, len};
    char c[CMSG_SPACE(sizeof(int))] = {};
    m.msg_iov = &iov; m.msg_iovlen = 1; m.msg_control = c; m.msg_controllen = sizeof(c);
    if (recvmsg(sock, &m, MSG_WAITALL) != (ssize_t)len) return -1;
    struct cmsghdr *h = CMSG_FIRSTHDR(&m);
    *fd = -1;
    if (h && h->cmsg_type == SCM_RIGHTS) memcpy(fd, CMSG_DATA(h), sizeof(int));
    return 0;
}

#define NB 64
static const size_t BUF = DST / NB;
struct msg { cudaIpcMemHandle_t h; size_t vmm_size; cudaIpcMemHandle_t hb[NB]; };

static float time_it(void (*f)(void *), void *a, int reps)
{
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    f(a); CK(cudaDeviceSynchronize());
    std::vector<float> ms;
    for (int r = 0; r < reps; r++) {
        CK(cudaEventRecord(e0)); f(a); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
        float t; CK(cudaEventElapsedTime(&t, e0, e1)); ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

// write: local src -> pool dst at perm[]; read: pool dst at perm[] -> local src.
struct kargs { const uint4 *src; char *dst; const uint32_t *perm; int read; };
static void run_k(void *p)
{
    kargs *a = (kargs *)p;
    if (a->read) pageread<<<NP, 128>>>((const char *)a->dst, (uint4 *)a->src, a->perm);
    else pagecopy<<<NP, 128>>>(a->src, a->dst, a->perm);
}
struct mkargs { const uint4 *src; char **bases; const uint32_t *perm; };
static void run_mk(void *p) { mkargs *a = (mkargs *)p; pagecopy_multi<<<NP, 128>>>(a->src, a->bases, a->perm, (uint32_t)(BUF / PAGE)); }
struct margs { void *d; const void *s; size_t n; };
static void run_m(void *p) { margs *a = (margs *)p; CK(cudaMemcpyAsync(a->d, a->s, a->n, cudaMemcpyDeviceToDevice)); }

int main(void)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        return 1;
    pid_t pid = fork();
    if (pid) { // owner
        CK(cudaSetDevice(0));
        char *d1; CK(cudaMalloc(&d1, DST));
        CK(cudaMemset(d1, 0, DST));
        msg m = {};
        CK(cudaIpcGetMemHandle(&m.h, d1));
        for (int b = 0; b < NB; b++) { char *x; CK(cudaMalloc(&x, BUF)); CK(cudaMemset(x, 0, BUF)); CK(cudaIpcGetMemHandle(&m.hb[b], x)); }
        // VMM allocation exported as a POSIX fd
        CUmemAllocationProp prop = {};
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = 0;
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        size_t gran = 0;
        DK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
        CUmemGenericAllocationHandle ah;
        DK(cuMemCreate(&ah, DST, &prop, 0));
        int fd = -1;
        DK(cuMemExportToShareableHandle(&fd, ah, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
        m.vmm_size = DST;
        printf("owner: vmm granularity %zu\n", gran);
        fflush(stdout);
        send_fd(sv[0], fd, &m, sizeof(m));
        char c;
        if (read(sv[0], &c, 1) != 1)
            fprintf(stderr, "owner: importer gone\n");
        int st; waitpid(pid, &st, 0);
        return WEXITSTATUS(st);
    }
    // importer
    msg m; int fd;
    if (recv_fd(sv[1], &fd, &m, sizeof(m))) { fprintf(stderr, "recv\n"); return 1; }
    CK(cudaSetDevice(0));
    CK(cudaFree(0));
    char *ipc; CK(cudaIpcOpenMemHandle((void **)&ipc, m.h, cudaIpcMemLazyEnablePeerAccess));
    CUmemGenericAllocationHandle ah;
    DK(cuMemImportFromShareableHandle(&ah, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    CUdeviceptr vp;
    DK(cuMemAddressReserve(&vp, m.vmm_size, 2ull << 20, 0, 0));
    DK(cuMemMap(vp, m.vmm_size, 0, ah, 0));
    CUmemAccessDesc ad = {};
    ad.location.type = CU_MEM_LOCATION_TYPE_DEVICE; ad.location.id = 0;
    ad.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    DK(cuMemSetAccess(vp, m.vmm_size, &ad, 1));
    char *vmm = (char *)vp;
    char *loc; CK(cudaMalloc(&loc, DST));
    uint4 *src; CK(cudaMalloc(&src, NP * PAGE));
    CK(cudaMemset(src, 1, NP * PAGE));
    CK(cudaMemset(loc, 0, DST));
    size_t npool = DST / PAGE;
    std::vector<uint32_t> seq(NP), rnd(NP), srt(NP), all(npool);
    for (size_t i = 0; i < npool; i++) all[i] = (uint32_t)i;
    srand(7);
    for (size_t i = npool - 1; i > 0; i--) std::swap(all[i], all[(size_t)rand() % (i + 1)]);
    for (size_t i = 0; i < NP; i++) { seq[i] = (uint32_t)i; rnd[i] = all[i]; }
    srt = rnd; std::sort(srt.begin(), srt.end());
    // small pool: random within the first 512 MiB (pages 0..32767)
    std::vector<uint32_t> small(NP);
    { std::vector<uint32_t> a(32768); for (size_t i = 0; i < a.size(); i++) a[i] = (uint32_t)i;
      for (size_t i = a.size() - 1; i > 0; i--) std::swap(a[i], a[(size_t)rand() % (i + 1)]);
      for (size_t i = 0; i < NP; i++) small[i] = a[i]; }
    uint32_t *dseq, *drnd, *dsrt, *dsmall;
    CK(cudaMalloc(&dseq, NP * 4)); CK(cudaMalloc(&drnd, NP * 4)); CK(cudaMalloc(&dsrt, NP * 4)); CK(cudaMalloc(&dsmall, NP * 4));
    CK(cudaMemcpy(dseq, seq.data(), NP * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(drnd, rnd.data(), NP * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dsrt, srt.data(), NP * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dsmall, small.data(), NP * 4, cudaMemcpyHostToDevice));
    const int reps = 21;
    double gb = NP * PAGE / 1e9;
    margs mm = {loc, src, NP * PAGE};
    float base = time_it(run_m, &mm, reps);
    printf("D2D memcpy local->local 256 MiB: %.3f ms, %.0f GB/s\n", base, gb / base * 1e3);
    margs mi = {ipc, src, NP * PAGE};
    float t = time_it(run_m, &mi, reps);
    printf("D2D memcpy local->ipc          : %.3f ms, %.0f GB/s (%.2f)\n", t, gb / t * 1e3, base / t);
    struct { const char *n; char *d; } dsts[] = {{"local", loc}, {"ipc(cudaMalloc)", ipc}, {"vmm(posix fd)", vmm}};
    struct { const char *n; uint32_t *p; } orders[] = {{"sequential", dseq}, {"random 4GiB", drnd}, {"sorted-random", dsrt}, {"random 512MiB", dsmall}};
    printf("%-18s %-14s %-8s %9s %8s %6s\n", "dst", "order", "dir", "ms", "GB/s", "/D2D");
    for (int rd = 0; rd < 2; rd++)
        for (auto &d : dsts)
            for (auto &o : orders) {
                kargs a = {src, d.d, o.p, rd};
                float t2 = time_it(run_k, &a, reps);
                CK(cudaGetLastError());
                printf("%-18s %-14s %-8s %9.3f %8.0f %6.2f\n", d.n, o.n, rd ? "read" : "write", t2, gb / t2 * 1e3, base / t2);
            }
    {
        char *hb[NB], *lb[NB];
        for (int b = 0; b < NB; b++) {
            CK(cudaIpcOpenMemHandle((void **)&hb[b], m.hb[b], cudaIpcMemLazyEnablePeerAccess));
            CK(cudaMalloc(&lb[b], BUF));
        }
        char **dh, **dl;
        CK(cudaMalloc(&dh, sizeof(hb))); CK(cudaMalloc(&dl, sizeof(lb)));
        CK(cudaMemcpy(dh, hb, sizeof(hb), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dl, lb, sizeof(lb), cudaMemcpyHostToDevice));
        struct { const char *n; char **b; } md[] = {{"64 local bufs", dl}, {"64 ipc bufs", dh}};
        for (auto &d : md)
            for (auto &o : orders) {
                mkargs a = {src, d.b, o.p};
                float t2 = time_it(run_mk, &a, reps);
                CK(cudaGetLastError());
                printf("%-18s %-14s %-8s %9.3f %8.0f %6.2f\n", d.n, o.n, "write", t2, gb / t2 * 1e3, base / t2);
            }
    }
    // verify a page landed in the owner's memory through both mappings (sanity)
    std::vector<char> h(PAGE);
    CK(cudaMemcpy(h.data(), ipc + (size_t)rnd[5] * PAGE, PAGE, cudaMemcpyDeviceToHost));
    int ok = 1; for (size_t i = 0; i < PAGE; i++) ok &= h[i] == 1;
    CK(cudaMemcpy(h.data(), vmm + (size_t)rnd[5] * PAGE, PAGE, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < PAGE; i++) ok &= h[i] == 1;
    printf("sanity: %s\n", ok ? "ok" : "BAD");
    fflush(stdout);
    CK(cudaIpcCloseMemHandle(ipc));
    if (write(sv[1], "x", 1) != 1)
        return 1;
    return ok ? 0 : 1;
}
