/*
 * A CPU stand-in for the CUDA module (libkvwire_cuda.so), for tests on machines without
 * a GPU: it exports the same entry point and operations table, "device memory" is host
 * memory, and every kernel launch runs the kernels' own address arithmetic on the CPU
 * (kvwc_emulate in src/cuda/copy_core.h), synchronously. Loaded through KVW_CUDA_MODULE,
 * it lets the protocol's GPU paths (staged windows gathered and scattered on the
 * "device", the executor's slots and their reaping order) run in CI with every byte
 * checked. Never installed.
 *
 * What it checks of its caller as a real device would: a slot launched twice without a
 * reap, a reap of a slot not in flight, a digest riding on a slot not in flight or on
 * one that carries a digest already, and a window outside its plan are errors; a
 * staged plan released while a window that uses it is still in flight aborts (on a
 * device, the kernel would read freed memory).
 *
 * With KVW_CUDA_EMU_IPC=1 it has IPC as well: "device memory" is then a shared mapping
 * of a memfd, an IPC handle names the owner's pid and descriptor, and opening it maps
 * the same pages through /proc/PID/fd (another process of the same user, or this one), so
 * that the cuda_ipc transport and the protocol's mapped path (the prefill's kernels
 * writing the decode's buffers) run between processes without a GPU.
 *
 * It also answers pointer_kind as the driver would for the memory it handed out: what
 * malloc_dev returned is device memory of the device current then, what malloc_host
 * returned or host_register registered is registered host memory, anything else is
 * plain host memory (a table of live allocations, any address inside one counts).
 */
#include "cuda/copy_core.h"
#include "cuda/digest_core.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static __thread char emu_msg[512];
static __thread int emu_device;

static kvw_status_t emu_error(kvw_status_t st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(emu_msg, sizeof(emu_msg), fmt, ap);
    va_end(ap);
    return st;
}

static const char *emu_last_error(void)
{
    return emu_msg;
}

static int emu_devices(void)
{
    const char *e = getenv("KVW_CUDA_EMU_DEVICES");
    int n = e ? atoi(e) : 1;
    return n > 0 ? n : 1;
}

static kvw_status_t emu_available(void)
{
    return KVW_OK;
}

static kvw_status_t emu_device_count(int *n)
{
    *n = emu_devices();
    return KVW_OK;
}

static kvw_status_t emu_set_device(int d)
{
    if (d < 0 || d >= emu_devices())
        return emu_error(KVW_ERR_INVALID_PARAM, "emulated device %d of %d", d, emu_devices());
    emu_device = d;
    return KVW_OK;
}

static kvw_status_t emu_get_device(int *d)
{
    *d = emu_device;
    return KVW_OK;
}

/* Live allocations and registrations, for pointer_kind. */
typedef struct emu_region {
    uintptr_t base;
    uint64_t size;
    int kind; /* KVWC_PTR_DEVICE or KVWC_PTR_HOST_REGISTERED */
    int device;
    int fd;      /* KVW_CUDA_EMU_IPC device memory: its memfd (owner), else -1 */
    int opened;  /* an IPC mapping of another allocation (ipc_open) */
    uint64_t map_len;
} emu_region_t;

static pthread_mutex_t emu_regions_mu = PTHREAD_MUTEX_INITIALIZER;
static emu_region_t *emu_regions;
static size_t emu_num_regions, emu_cap_regions;

static int emu_region_add_ex(const void *p, uint64_t size, int kind, int fd, int opened,
                             uint64_t map_len)
{
    pthread_mutex_lock(&emu_regions_mu);
    if (emu_num_regions == emu_cap_regions) {
        size_t cap = emu_cap_regions ? 2 * emu_cap_regions : 64;
        emu_region_t *n = realloc(emu_regions, cap * sizeof(*n));
        if (n == NULL) {
            pthread_mutex_unlock(&emu_regions_mu);
            return -1;
        }
        emu_regions = n;
        emu_cap_regions = cap;
    }
    emu_regions[emu_num_regions++] =
        (emu_region_t){(uintptr_t)p, size ? size : 1, kind, emu_device, fd, opened, map_len};
    pthread_mutex_unlock(&emu_regions_mu);
    return 0;
}

static int emu_region_add(const void *p, uint64_t size, int kind)
{
    return emu_region_add_ex(p, size, kind, -1, 0, 0);
}

/* Which regions emu_region_find takes. */
enum { EMU_ANY = -1, EMU_OWN = 0, EMU_OPENED = 1 };

/* The region starting at p into *out; -1 when there is none. With `take`, it is removed
 * when its kind matches `want` (EMU_ANY, EMU_OWN: not an IPC mapping, EMU_OPENED: one),
 * and 1 says it does not match (then it stays). */
static int emu_region_find(const void *p, int want, int take, emu_region_t *out)
{
    int found = -1;
    pthread_mutex_lock(&emu_regions_mu);
    for (size_t i = 0; i < emu_num_regions; i++)
        if (emu_regions[i].base == (uintptr_t)p) {
            *out = emu_regions[i];
            found = want != EMU_ANY && out->opened != want ? 1 : 0;
            if (take && found == 0)
                emu_regions[i] = emu_regions[--emu_num_regions];
            break;
        }
    pthread_mutex_unlock(&emu_regions_mu);
    return found;
}

static int emu_ipc_on(void)
{
    const char *e = getenv("KVW_CUDA_EMU_IPC");
    return e && !strcmp(e, "1");
}

static uint64_t emu_map_len(uint64_t size)
{
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
    return size ? (size + pg - 1) / pg * pg : pg;
}

/* Device memory that IPC can share: a memfd mapped here. */
static kvw_status_t emu_alloc_shared(uint64_t size, void **p)
{
    uint64_t len = emu_map_len(size);
    int fd = memfd_create("kvw-emu-dev", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)len) != 0) {
        if (fd >= 0)
            close(fd);
        return emu_error(KVW_ERR_NO_MEMORY, "emulated shared allocation of %llu bytes failed",
                         (unsigned long long)size);
    }
    void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        close(fd);
        return emu_error(KVW_ERR_NO_MEMORY, "emulated shared mapping of %llu bytes failed",
                         (unsigned long long)size);
    }
    if (emu_region_add_ex(m, size, KVWC_PTR_DEVICE, fd, 0, len) != 0) {
        munmap(m, len);
        close(fd);
        return emu_error(KVW_ERR_NO_MEMORY, "out of memory recording an allocation");
    }
    *p = m;
    return KVW_OK;
}

/* Forgets the region starting at p; -1 when there is none. */
static int emu_region_del(const void *p)
{
    emu_region_t gone;
    return emu_region_find(p, EMU_ANY, 1, &gone);
}

static kvw_status_t emu_alloc(uint64_t size, void **p, int kind)
{
    if (posix_memalign(p, 256, size ? size : 1) != 0)
        return emu_error(KVW_ERR_NO_MEMORY, "emulated allocation of %llu bytes failed",
                         (unsigned long long)size);
    if (emu_region_add(*p, size, kind) != 0) {
        free(*p);
        return emu_error(KVW_ERR_NO_MEMORY, "out of memory recording an allocation");
    }
    return KVW_OK;
}

static kvw_status_t emu_malloc(uint64_t size, void **p)
{
    return emu_ipc_on() ? emu_alloc_shared(size, p) : emu_alloc(size, p, KVWC_PTR_DEVICE);
}

static kvw_status_t emu_malloc_host(uint64_t size, void **p)
{
    return emu_alloc(size, p, KVWC_PTR_HOST_REGISTERED);
}

static kvw_status_t emu_free(void *p)
{
    if (p == NULL)
        return KVW_OK;
    emu_region_t r = {.fd = -1};
    int found = emu_region_find(p, EMU_OWN, 1, &r);
    if (found < 0)
        return emu_error(KVW_ERR_INVALID_PARAM, "emulated free of %p, which was not allocated "
                         "here", p);
    if (found > 0)
        return emu_error(KVW_ERR_INVALID_PARAM, "emulated free of %p, an IPC mapping (close "
                         "it instead)", p);
    if (r.fd >= 0) {
        munmap(p, r.map_len);
        close(r.fd);
    } else {
        free(p);
    }
    return KVW_OK;
}

static kvw_status_t emu_pointer_kind(const void *p, int *kind_p, int *device_p)
{
    *kind_p = KVWC_PTR_HOST;
    *device_p = -1;
    pthread_mutex_lock(&emu_regions_mu);
    for (size_t i = 0; i < emu_num_regions; i++) {
        const emu_region_t *r = &emu_regions[i];
        if ((uintptr_t)p >= r->base && (uintptr_t)p - r->base < r->size) {
            *kind_p = r->kind;
            *device_p = r->kind == KVWC_PTR_DEVICE ? r->device : -1;
            break;
        }
    }
    pthread_mutex_unlock(&emu_regions_mu);
    return KVW_OK;
}

static kvw_status_t emu_memcpy(void *dst, const void *src, uint64_t size, void *stream)
{
    (void)stream;
    memmove(dst, src, size);
    return KVW_OK;
}

static kvw_status_t emu_memset(void *p, int v, uint64_t size, void *stream)
{
    (void)stream;
    memset(p, v, size);
    return KVW_OK;
}

static kvw_status_t emu_stream_create(void **s)
{
    *s = malloc(1);
    return *s ? KVW_OK : emu_error(KVW_ERR_NO_MEMORY, "out of memory");
}

static kvw_status_t emu_ok_ptr(void *p)
{
    free(p);
    return KVW_OK;
}

static kvw_status_t emu_sync(void *s)
{
    (void)s;
    return KVW_OK;
}

static kvw_status_t emu_device_sync(void)
{
    return KVW_OK;
}

/* An IPC handle (KVWC_IPC_HANDLE_SIZE bytes): magic, owner pid, its memfd, size. */
#define EMU_IPC_MAGIC 0x4350494d45575653ull /* "SVWEMIPC" */

static kvw_status_t emu_ipc_export(void *base, void *h)
{
    if (!emu_ipc_on())
        return emu_error(KVW_ERR_UNSUPPORTED, "the emulated device has no IPC "
                         "(KVW_CUDA_EMU_IPC=1 gives it some)");
    emu_region_t r = {.fd = -1};
    if (emu_region_find(base, EMU_ANY, 0, &r) != 0 || r.fd < 0)
        return emu_error(KVW_ERR_INVALID_PARAM, "emulated IPC export of %p: not the start of "
                         "an allocation of this process's emulated device", base);
    uint64_t w[4] = {EMU_IPC_MAGIC, (uint64_t)getpid(), (uint64_t)r.fd, r.size};
    memset(h, 0, KVWC_IPC_HANDLE_SIZE);
    memcpy(h, w, sizeof(w));
    return KVW_OK;
}

static kvw_status_t emu_ipc_open(const void *h, void **p)
{
    uint64_t w[4];
    memcpy(w, h, sizeof(w));
    if (!emu_ipc_on() || w[0] != EMU_IPC_MAGIC || w[1] == 0 || w[1] > 0x7fffffff ||
        w[2] > 0x7fffffff)
        return emu_error(KVW_ERR_INVALID_PARAM, "emulated IPC: not a handle of the emulated "
                         "device (or KVW_CUDA_EMU_IPC is not 1 here)");
    char path[64];
    snprintf(path, sizeof(path), "/proc/%llu/fd/%llu", (unsigned long long)w[1],
             (unsigned long long)w[2]);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return emu_error(KVW_ERR_INVALID_PARAM, "emulated IPC: cannot open %s", path);
    uint64_t len = emu_map_len(w[3]);
    void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return emu_error(KVW_ERR_NO_MEMORY, "emulated IPC: cannot map %s", path);
    if (emu_region_add_ex(m, w[3], KVWC_PTR_DEVICE, -1, 1, len) != 0) {
        munmap(m, len);
        return emu_error(KVW_ERR_NO_MEMORY, "out of memory recording an IPC mapping");
    }
    *p = m;
    return KVW_OK;
}

static kvw_status_t emu_ipc_close(void *p)
{
    emu_region_t r = {.fd = -1};
    int found = emu_region_find(p, EMU_OPENED, 1, &r);
    if (found < 0)
        return emu_error(KVW_ERR_INVALID_PARAM, "emulated IPC close of %p: not opened", p);
    if (found > 0)
        return emu_error(KVW_ERR_INVALID_PARAM, "emulated IPC close of %p: an allocation of "
                         "this process, not an IPC mapping", p);
    munmap(p, r.map_len);
    return KVW_OK;
}

/* The emulated allocation holding p (p itself and no size outside one). */
static kvw_status_t emu_mem_base(void *p, void **base, uint64_t *size_p)
{
    *base = p;
    if (size_p)
        *size_p = 0;
    pthread_mutex_lock(&emu_regions_mu);
    for (size_t i = 0; i < emu_num_regions; i++) {
        const emu_region_t *r = &emu_regions[i];
        if ((uintptr_t)p >= r->base && (uintptr_t)p - r->base < r->size) {
            *base = (void *)r->base;
            if (size_p)
                *size_p = r->size;
            break;
        }
    }
    pthread_mutex_unlock(&emu_regions_mu);
    return KVW_OK;
}

/* ---------------------------------------------------------------- plans */

struct kvwc_plan {
    void *blob;
    const uint32_t *job_seg;
    uint64_t num_jobs, bytes;
    unsigned uses;
    uint32_t num_segs;    /* laid out */
    kvwc_span_t *spans;   /* staged plans (exec_plan_upload) only */
    int windows;          /* staged windows in flight that use it */
};

static kvw_status_t emu_lay_out(const kvwc_plan_in_t *in, struct kvwc_plan *p)
{
    kvwc_layout_t L;
    const char *why = NULL;
    if (kvwc_blob_layout(in, &L, &why) != 0)
        return emu_error(KVW_ERR_UNSUPPORTED, "the CUDA executor cannot run this plan: %s", why);
    p->blob = malloc(L.size ? L.size : 1);
    if (p->blob == NULL)
        return emu_error(KVW_ERR_NO_MEMORY, "out of memory laying out a plan");
    kvwc_blob_fill(in, &L, p->blob, (uint64_t)(uintptr_t)p->blob);
    p->job_seg = (const uint32_t *)((uint8_t *)p->blob + L.jobs_off);
    p->num_jobs = L.num_jobs;
    p->num_segs = L.num_segs;
    p->bytes = in->bytes;
    p->uses = in->uses;
    return KVW_OK;
}

static void emu_run(const struct kvwc_plan *p, int mode, uint64_t stage, const kvwc_window_t *w)
{
    static __thread kvwc_tokens_t tt;
    kvwc_emulate((const kvwc_dseg_t *)p->blob, p->job_seg, w->j0, w->j1, mode, stage, w->lo,
                 w->hi, w->wcap, &tt);
}

static void emu_run_all(const struct kvwc_plan *p, int mode, uint64_t stage)
{
    kvwc_window_t w = {0, p->num_jobs, 0, KVWC_WINDOW_ALL, 16};
    emu_run(p, mode, stage, &w);
}

static kvw_status_t emu_plan_upload(const kvwc_plan_in_t *in, kvwc_plan_h *out)
{
    struct kvwc_plan *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return emu_error(KVW_ERR_NO_MEMORY, "out of memory");
    kvw_status_t st = emu_lay_out(in, p);
    if (st != KVW_OK) {
        free(p);
        return st;
    }
    *out = p;
    return KVW_OK;
}

static void emu_plan_free(kvwc_plan_h p)
{
    if (p) {
        free(p->blob);
        free(p);
    }
}

static kvw_status_t emu_plan_exec(kvwc_plan_h p, void *stream)
{
    (void)stream;
    if (!(p->uses & KVWC_USE_DIRECT))
        return emu_error(KVW_ERR_INVALID_PARAM, "the plan was not uploaded for direct copies");
    emu_run_all(p, KVWC_MODE_DIRECT, 0);
    return KVW_OK;
}

static kvw_status_t emu_plan_stage(kvwc_plan_h p, const void *staging, uint64_t size, int mode)
{
    unsigned use = mode == KVWC_MODE_GATHER ? KVWC_USE_GATHER : KVWC_USE_SCATTER;
    if (!(p->uses & use) || size < p->bytes || (p->bytes && staging == NULL))
        return emu_error(KVW_ERR_INVALID_PARAM, "bad staged call");
    emu_run_all(p, mode, (uint64_t)(uintptr_t)staging);
    return KVW_OK;
}

static kvw_status_t emu_plan_gather(kvwc_plan_h p, void *staging, uint64_t size, void *stream)
{
    (void)stream;
    return emu_plan_stage(p, staging, size, KVWC_MODE_GATHER);
}

static kvw_status_t emu_plan_scatter(kvwc_plan_h p, const void *staging, uint64_t size,
                                     void *stream)
{
    (void)stream;
    return emu_plan_stage(p, staging, size, KVWC_MODE_SCATTER);
}

static kvw_status_t emu_plan_exec_once(const kvwc_plan_in_t *in, void *stream)
{
    kvwc_plan_h p = NULL;
    kvw_status_t st = emu_plan_upload(in, &p);
    if (st == KVW_OK)
        st = emu_plan_exec(p, stream);
    emu_plan_free(p);
    return st;
}

/* ---------------------------------------------------------------- executors */

struct kvwc_exec {
    int busy[KVWC_EXEC_SLOTS + KVWC_STAGE_SLOTS];
    kvwc_plan_h plan[KVWC_STAGE_SLOTS]; /* what each staged window in flight reads */
    unsigned next;
    /* A digest riding on each step slot (exec_digest): its sums, computed when it was
     * enqueued, and the caller's units they are added to when the slot is reaped. */
    uint64_t *dig_sum[KVWC_EXEC_SLOTS];
    uint64_t *dig_units[KVWC_EXEC_SLOTS];
    uint32_t dig_n[KVWC_EXEC_SLOTS];
};

static kvw_status_t emu_exec_create(kvwc_exec_h *x)
{
    *x = calloc(1, sizeof(**x));
    return *x ? KVW_OK : emu_error(KVW_ERR_NO_MEMORY, "out of memory");
}

static void emu_exec_destroy(kvwc_exec_h x)
{
    if (x == NULL)
        return;
    for (int k = 0; k < KVWC_EXEC_SLOTS; k++)
        free(x->dig_sum[k]); /* pending: added to nothing, as on a device */
    free(x);
}

static kvw_status_t emu_exec_launch(kvwc_exec_h x, const kvwc_plan_in_t *in, int *slot_p,
                                    kvwc_step_prof_t *prof)
{
    (void)prof;
    *slot_p = -1;
    if (!(in->uses & KVWC_USE_DIRECT))
        return emu_error(KVW_ERR_INVALID_PARAM, "an executor runs direct copies only");
    int k = (int)(x->next % KVWC_EXEC_SLOTS);
    if (x->busy[k])
        return emu_error(KVW_ERR_BUSY, "emulated executor: slot %d is still in flight", k);
    struct kvwc_plan p;
    kvw_status_t st = emu_lay_out(in, &p);
    if (st != KVW_OK)
        return st;
    if (p.num_jobs) {
        emu_run_all(&p, KVWC_MODE_DIRECT, 0);
        x->busy[k] = 1;
        x->next++;
        *slot_p = k;
    }
    free(p.blob);
    return KVW_OK;
}

static kvw_status_t emu_exec_plan_upload(kvwc_exec_h x, const kvwc_plan_in_t *in,
                                         kvwc_plan_h *out)
{
    (void)x;
    kvwc_plan_h p = NULL;
    kvw_status_t st = emu_plan_upload(in, &p);
    if (st != KVW_OK)
        return st;
    p->spans = malloc(sizeof(kvwc_span_t) * ((size_t)p->num_segs + 1));
    if (p->spans == NULL) {
        emu_plan_free(p);
        return emu_error(KVW_ERR_NO_MEMORY, "out of memory");
    }
    kvwc_spans_fill(in, p->spans);
    *out = p;
    return KVW_OK;
}

static void emu_exec_plan_free(kvwc_exec_h x, kvwc_plan_h p)
{
    (void)x;
    if (p == NULL)
        return;
    if (__atomic_load_n(&p->windows, __ATOMIC_ACQUIRE) != 0) {
        fprintf(stderr, "emulated CUDA module: a staged plan was released with %d windows "
                "in flight\n", p->windows);
        abort();
    }
    free(p->spans);
    emu_plan_free(p);
}

static kvw_status_t emu_exec_stage(kvwc_exec_h x, kvwc_plan_h p, int scatter, void *host,
                                   uint64_t lo, uint64_t hi, int *slot_p,
                                   kvwc_step_prof_t *prof)
{
    (void)prof;
    *slot_p = -1;
    unsigned use = scatter ? KVWC_USE_SCATTER : KVWC_USE_GATHER;
    if (p == NULL || p->spans == NULL)
        return emu_error(KVW_ERR_INVALID_PARAM, "staged window: the plan was not uploaded on "
                         "an executor");
    if (!(p->uses & use))
        return emu_error(KVW_ERR_INVALID_PARAM, "the plan was not prepared for a %s",
                         scatter ? "scatter" : "gather");
    if (hi <= lo || hi > p->bytes || host == NULL)
        return emu_error(KVW_ERR_OUT_OF_RANGE, "staged window [%llu, %llu) outside the plan's "
                         "%llu bytes", (unsigned long long)lo, (unsigned long long)hi,
                         (unsigned long long)p->bytes);
    int k = -1;
    for (int i = 0; i < KVWC_STAGE_SLOTS && k < 0; i++)
        if (!x->busy[KVWC_EXEC_SLOTS + i])
            k = KVWC_EXEC_SLOTS + i;
    if (k < 0)
        return emu_error(KVW_ERR_BUSY, "emulated executor: %d staged windows are in flight",
                         KVWC_STAGE_SLOTS);
    /* As on the device: the window goes through scratch memory of its own size. */
    uint8_t *scratch = malloc(hi - lo);
    if (scratch == NULL)
        return emu_error(KVW_ERR_NO_MEMORY, "out of memory");
    if (scatter)
        memcpy(scratch, host, hi - lo);
    else
        memset(scratch, 0xa5, hi - lo); /* bytes the gather fails to write show */
    kvwc_window_t w;
    kvwc_window_at(p->spans, p->num_segs, lo, hi, &w);
    emu_run(p, scatter ? KVWC_MODE_SCATTER : KVWC_MODE_GATHER,
            (uint64_t)(uintptr_t)scratch - lo, &w);
    if (!scatter)
        memcpy(host, scratch, hi - lo);
    free(scratch);
    x->busy[k] = 1;
    x->plan[k - KVWC_EXEC_SLOTS] = p;
    __atomic_add_fetch(&p->windows, 1, __ATOMIC_ACQ_REL);
    *slot_p = k;
    return KVW_OK;
}

static kvw_status_t emu_exec_reap(kvwc_exec_h x, int slot, int block, int *done_p,
                                  kvwc_step_prof_t *prof)
{
    (void)block, (void)prof;
    *done_p = 0;
    if (slot < 0 || slot >= KVWC_EXEC_SLOTS + KVWC_STAGE_SLOTS || !x->busy[slot])
        return emu_error(KVW_ERR_INVALID_PARAM, "emulated executor: slot %d is not in flight",
                         slot);
    x->busy[slot] = 0;
    if (slot < KVWC_EXEC_SLOTS && x->dig_units[slot]) {
        /* The step's digest completed with it (the reap's status is OK here). */
        for (uint32_t u = 0; u < x->dig_n[slot]; u++)
            x->dig_units[slot][u] += x->dig_sum[slot][u];
        free(x->dig_sum[slot]);
        x->dig_sum[slot] = NULL;
        x->dig_units[slot] = NULL;
    }
    if (slot >= KVWC_EXEC_SLOTS) {
        __atomic_sub_fetch(&x->plan[slot - KVWC_EXEC_SLOTS]->windows, 1, __ATOMIC_ACQ_REL);
        x->plan[slot - KVWC_EXEC_SLOTS] = NULL;
    }
    *done_p = 1;
    return KVW_OK;
}

static kvw_status_t emu_host_register(void *p, uint64_t size)
{
    if (emu_region_add(p, size, KVWC_PTR_HOST_REGISTERED) != 0)
        return emu_error(KVW_ERR_NO_MEMORY, "out of memory registering host memory");
    return KVW_OK;
}

static kvw_status_t emu_host_unregister(void *p)
{
    if (emu_region_del(p) != 0)
        return emu_error(KVW_ERR_INVALID_PARAM, "emulated host_unregister of %p, which is not "
                         "registered", p);
    return KVW_OK;
}

/* An emulated event completes when it is recorded (as if the engine's stream had
 * nothing before it): created and not recorded, it stays pending, which is how tests
 * hold layers back and let an event never fire. */
static kvw_status_t emu_event_create(void **ev)
{
    *ev = calloc(1, sizeof(int));
    return *ev ? KVW_OK : emu_error(KVW_ERR_NO_MEMORY, "out of memory");
}

static kvw_status_t emu_event_record(void *ev, void *stream)
{
    (void)stream;
    __atomic_store_n((int *)ev, 1, __ATOMIC_RELEASE);
    return KVW_OK;
}

static kvw_status_t emu_event_query(void *ev)
{
    return __atomic_load_n((int *)ev, __ATOMIC_ACQUIRE) ? KVW_OK : KVW_INPROGRESS;
}

static kvw_status_t emu_busy(void *stream, uint64_t ns)
{
    (void)stream, (void)ns;
    return KVW_OK;
}

/* The digest as the kernel computes it (digest.cu): block by block over digest_core.h's
 * decomposition, each block's rows summed, then added to its unit. A segment whose rows
 * start outside memory this stand-in handed out as device memory is an error, as an
 * illegal address would be on a device. Entries with slot -1 are added to their units
 * at once; an entry riding on step slot k is computed now (the step's copy ran when it
 * was launched) into the slot's own sums, which emu_exec_reap adds to its units when it
 * reaps the slot, as the module does. Every entry is checked before any is computed. */
static kvw_status_t emu_digest_check(kvwc_exec_h x, const kvwc_digest_in_t *in, uint32_t i,
                                     const kvwc_digest_in_t *all)
{
    const kvwc_plan_in_t *p = in->plan;
    if (p == NULL || in->units == NULL || (p->num_segs && in->dsegs == NULL))
        return emu_error(KVW_ERR_INVALID_PARAM, "exec_digest: entry %u: NULL argument", i);
    if (in->slot < -1 || in->slot >= KVWC_EXEC_SLOTS)
        return emu_error(KVW_ERR_INVALID_PARAM, "exec_digest: entry %u: slot %d is not -1 nor "
                         "a step slot (0 .. %d)", i, in->slot, KVWC_EXEC_SLOTS - 1);
    uint32_t bad = kvwc_digest_bad_seg(in);
    if (bad < p->num_segs)
        return emu_error(KVW_ERR_INVALID_PARAM, "exec_digest: segment %u's %u heads from unit "
                         "%u are past the %u units", bad, p->segs[bad].num_heads,
                         in->dsegs[bad].unit, in->num_units);
    for (uint32_t k = 0; k < p->num_segs; k++) {
        const kvwc_seg_in_t *s = &p->segs[k];
        const kvwc_side_t *sd = in->dst_side ? &s->dst : &s->src;
        int kind = 0, dev = -1;
        uint64_t b = kvwc_digest_seg_blocks(s);
        if (b && (emu_pointer_kind((const void *)(uintptr_t)sd->base, &kind, &dev) != KVW_OK ||
                  kind != KVWC_PTR_DEVICE))
            return emu_error(KVW_ERR_INTERNAL, "exec_digest: segment %u's rows (%p) are not "
                             "device memory (an illegal address on a device)", k,
                             (void *)(uintptr_t)sd->base);
    }
    if (in->slot >= 0) {
        if (!x->busy[in->slot])
            return emu_error(KVW_ERR_INVALID_PARAM, "exec_digest: slot %d is not in flight (a "
                             "digest rides on a step launched on this executor and not reaped "
                             "yet)", in->slot);
        if (x->dig_units[in->slot])
            return emu_error(KVW_ERR_INVALID_PARAM, "exec_digest: slot %d already carries a "
                             "digest (one per step)", in->slot);
        for (uint32_t k = 0; k < i; k++)
            if (all[k].slot == in->slot)
                return emu_error(KVW_ERR_INVALID_PARAM, "exec_digest: entries %u and %u both "
                                 "ride on slot %d (one digest per step)", k, i, in->slot);
    }
    return KVW_OK;
}

static void emu_digest_sum(const kvwc_digest_in_t *in, uint64_t *units)
{
    const kvwc_plan_in_t *p = in->plan;
    for (uint32_t i = 0; i < p->num_segs; i++) {
        const kvwc_seg_in_t *s = &p->segs[i];
        const kvwc_side_t *sd = in->dst_side ? &s->dst : &s->src;
        const kvwc_dig_seg_t *ds = &in->dsegs[i];
        uint64_t blocks = kvwc_digest_seg_blocks(s);
        const uint32_t *pages = p->maps[sd->map].pages;
        for (uint64_t b = 0; b < blocks; b++) {
            uint64_t sum = 0, h = 0;
            uint32_t unit = 0;
            for (uint32_t j = 0; j < KVWC_DIGEST_TOK; j++)
                if (kvwc_digest_row(s, sd, pages, ds, in->secret, b, j, &h, &unit))
                    sum += h;
            units[unit] += sum;
        }
    }
}

static kvw_status_t emu_exec_digest(kvwc_exec_h x, const kvwc_digest_in_t *in, uint32_t n)
{
    if (x == NULL || (n && in == NULL))
        return emu_error(KVW_ERR_INVALID_PARAM, "exec_digest: NULL argument");
    for (uint32_t i = 0; i < n; i++) {
        kvw_status_t st = emu_digest_check(x, &in[i], i, in);
        if (st != KVW_OK)
            return st;
    }
    for (uint32_t i = 0; i < n; i++) {
        uint64_t blocks = 0;
        for (uint32_t k = 0; k < in[i].plan->num_segs; k++)
            blocks += kvwc_digest_seg_blocks(&in[i].plan->segs[k]);
        if (in[i].slot >= 0 && blocks == 0)
            continue; /* nothing to run: nothing rides on the step */
        if (in[i].slot < 0) {
            emu_digest_sum(&in[i], in[i].units);
            continue;
        }
        uint64_t *sum = calloc(in[i].num_units ? in[i].num_units : 1, 8);
        if (sum == NULL)
            return emu_error(KVW_ERR_NO_MEMORY, "out of memory for a step's digest");
        emu_digest_sum(&in[i], sum);
        x->dig_sum[in[i].slot] = sum;
        x->dig_units[in[i].slot] = in[i].units;
        x->dig_n[in[i].slot] = in[i].num_units;
    }
    return KVW_OK;
}

static const kvwc_ops_t emu_ops = {
    .abi = KVWC_ABI_VERSION,
    .size = sizeof(kvwc_ops_t),
    .last_error = emu_last_error,
    .available = emu_available,
    .device_count = emu_device_count,
    .set_device = emu_set_device,
    .get_device = emu_get_device,
    .malloc_dev = emu_malloc,
    .free_dev = emu_free,
    .malloc_host = emu_malloc_host,
    .free_host = emu_free,
    .memcpy_any = emu_memcpy,
    .memset_dev = emu_memset,
    .stream_create = emu_stream_create,
    .stream_destroy = emu_ok_ptr,
    .stream_sync = emu_sync,
    .device_sync = emu_device_sync,
    .ipc_export = emu_ipc_export,
    .ipc_open = emu_ipc_open,
    .ipc_close = emu_ipc_close,
    .mem_base = emu_mem_base,
    .plan_upload = emu_plan_upload,
    .plan_free = emu_plan_free,
    .plan_exec = emu_plan_exec,
    .plan_gather = emu_plan_gather,
    .plan_scatter = emu_plan_scatter,
    .plan_exec_once = emu_plan_exec_once,
    .exec_create = emu_exec_create,
    .exec_destroy = emu_exec_destroy,
    .exec_launch = emu_exec_launch,
    .exec_reap = emu_exec_reap,
    .exec_plan_upload = emu_exec_plan_upload,
    .exec_plan_free = emu_exec_plan_free,
    .exec_stage = emu_exec_stage,
    .host_register = emu_host_register,
    .host_unregister = emu_host_unregister,
    .event_create = emu_event_create,
    .event_record = emu_event_record,
    .event_query = emu_event_query,
    .event_destroy = emu_ok_ptr,
    .busy = emu_busy,
    .pointer_kind = emu_pointer_kind,
    .exec_digest = emu_exec_digest,
};

/* KVW_CUDA_EMU_ABI, for tests: the table claims that ABI number instead, so that a
 * test sees the loaders refuse a module built for another ABI. */
__attribute__((visibility("default"))) const kvwc_ops_t *kvw_cuda_module_entry(void)
{
    static kvwc_ops_t other;
    const char *abi = getenv("KVW_CUDA_EMU_ABI");
    if (abi == NULL || *abi == '\0')
        return &emu_ops;
    other = emu_ops;
    other.abi = (uint32_t)strtoul(abi, NULL, 10);
    return &other;
}
