/*
 * Memory kinds checked at rank creation: kvw_rank_create asks the CUDA module what each
 * buffer's address is (device, managed, page-locked or plain host memory, and which
 * device) and refuses a buffer whose declared kind or device differs, naming the buffer,
 * the declaration and what the address is; kvw_cuda_pointer_kind answers the same
 * question for adapters.
 *
 * Runs against the CPU stand-in of the CUDA module (KVW_CUDA_MODULE and
 * KVW_CUDA_EMU_DEVICES=2, set by CMake), which answers for the memory it hands out as
 * "device" memory (and as page-locked host memory) the way the driver would. Cases: a
 * host address declared CUDA, a device address declared host, device memory of device 1
 * declared on device 0, page-locked host memory declared either way; then a rank whose
 * every buffer is device memory of device 1, declared so, accepted and moving a room
 * over tcp to a host decode rank with every byte and guard byte checked. First, in a
 * child without any module: host and CUDA declarations are taken as declared, and the
 * CUDA one is refused where its bytes would move (kvw_ctx_create).
 */
#include "testkit.h"
#include "inproc.h"

#include <kvwire/cuda.h>
#include <sys/wait.h>
#include <unistd.h>

static kvt_model_t model;
static bool emu;   /* the CPU stand-in, not a GPU */
static int ndev;   /* devices the module reports */
/* "Another device": with two devices, memory of device 1 declared on device 0; with
 * one, memory of device 0 declared on device 1. */
static int other_dev, declared_dev;

static kvw_status_t describe(uint32_t num_pages, kvt_rank_t *r)
{
    kvt_rank_spec_t s = {.model = &model, .layout = KVW_LAYOUT_NHD, .page_size = {16, 16},
                         .num_pages = {num_pages, num_pages}, .num_slots = 2};
    s.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = 1, .pp_size = 1,
                             .layer_end = model.m.num_layers, .dp_size = 1};
    memset(r, 0, sizeof(*r));
    return kvt_rank_describe(&s, r);
}

/* "buffer 2 (layer 1 K, SWA pool)": how the refusals name buffer i of r. */
static void buffer_name(const kvt_rank_t *r, uint32_t i, char *out, size_t cap)
{
    const kvw_buffer_desc_t *b = &r->bufs[i];
    snprintf(out, cap, "buffer %u (layer %u %s, %s pool)", i, b->layer,
             b->role == KVW_ROLE_K ? "K" : b->role == KVW_ROLE_V ? "V" : "?",
             b->pool == KVW_POOL_SWA ? "SWA" : b->pool == KVW_POOL_FULL ? "full" : "state");
}

/* Opening r must fail with INVALID_PARAM and a message holding every string of want
 * (NULL-terminated), creating no handle. */
static void expect_refused(kvt_rank_t *r, const char *what, const char *const *want)
{
    kvw_status_t st = kvt_rank_open(r);
    CHECK(st == KVW_ERR_INVALID_PARAM && r->h == NULL, "%s: kvw_rank_create returned %s (%s)",
          what, kvw_status_string(st), kvw_last_error());
    for (const char *const *w = want; *w; w++)
        CHECK(kvt_contains(kvw_last_error(), *w), "%s: the refusal '%s' does not say '%s'", what,
              kvw_last_error(), *w);
    printf("test_mem_kind: %s: refused: %s\n", what, kvw_last_error());
}

static void expect_accepted(kvt_rank_t *r, const char *what)
{
    kvw_status_t st = kvt_rank_open(r);
    CHECK(st == KVW_OK && r->h != NULL, "%s: kvw_rank_create returned %s (%s)", what,
          kvw_status_string(st), kvw_last_error());
}

static void expect_kind(const void *p, kvw_mem_kind_t kind, int32_t device, const char *what)
{
    kvw_mem_kind_t k = (kvw_mem_kind_t)99;
    int32_t d = 99;
    kvw_status_t st = kvw_cuda_pointer_kind(p, &k, &d);
    CHECK(st == KVW_OK && k == kind && d == device,
          "kvw_cuda_pointer_kind(%s): %s (%s), kind %d device %d; expected kind %d device %d",
          what, kvw_status_string(st), st ? kvw_last_error() : "", (int)k, (int)d, (int)kind,
          (int)device);
}

/* Without the module (a child that loads none): buffers are taken as declared. */
static void without_module(void)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        setenv("KVW_CUDA_MODULE", "/nonexistent-kvwire/libkvwire_cuda.so", 1);
        kvt_rank_t r;
        kvw_status_t st = describe(8, &r);
        CHECK(st == KVW_OK, "describe: %s", kvw_last_error());
        expect_accepted(&r, "no module, host buffers declared host");
        kvw_rank_destroy(r.h);
        r.h = NULL;
        for (uint32_t i = 0; i < r.num_bufs; i++)
            r.bufs[i].mem_kind = KVW_MEM_CUDA;
        expect_accepted(&r, "no module, host buffers declared CUDA (nothing can tell)");
        kvw_ctx_h ctx = NULL;
        kvw_ctx_params_t p = ip_params(KVW_SIDE_DECODE, &r, "tcp", NULL, false);
        p.field_mask &= ~(uint64_t)(KVW_CTX_FIELD_BOOTSTRAP | KVW_CTX_FIELD_HOST_BOOTSTRAP);
        st = r.h ? kvw_ctx_create(&p, &ctx) : KVW_ERR_INTERNAL;
        CHECK(st == KVW_ERR_UNSUPPORTED && kvt_contains(kvw_last_error(), "could not be loaded"),
              "no module: a context over a CUDA-declared buffer: %s (%s)",
              kvw_status_string(st), kvw_last_error());
        kvw_ctx_destroy(st == KVW_OK ? ctx : NULL);
        kvw_mem_kind_t k;
        int32_t d;
        st = kvw_cuda_pointer_kind(r.mem[0], &k, &d);
        CHECK(st == KVW_ERR_UNSUPPORTED && kvt_contains(kvw_last_error(), "could not be loaded"),
              "no module: kvw_cuda_pointer_kind: %s (%s)", kvw_status_string(st),
              kvw_last_error());
        kvt_rank_free(&r);
        fflush(NULL);
        _exit(failures ? 1 : 0);
    }
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
              WEXITSTATUS(status) == 0,
          "the child without a CUDA module failed (status 0x%x)", status);
}

static void refusals(void)
{
    char name[96], addr[48];
    kvt_rank_t r;
    CHECK(describe(8, &r) == KVW_OK, "describe: %s", kvw_last_error());
    buffer_name(&r, 2, name, sizeof(name));

    /* A host address declared CUDA. */
    r.bufs[2].mem_kind = KVW_MEM_CUDA;
    r.bufs[2].device = 0;
    snprintf(addr, sizeof(addr), "address %p is", r.bufs[2].addr);
    const char *w1[] = {name, "declared KVW_MEM_CUDA on device 0", addr,
                        "host memory (not registered with CUDA)", NULL};
    expect_refused(&r, "host memory declared CUDA", w1);

    /* Device memory declared host (the pointer is never dereferenced: on a GPU, reading
     * it from the CPU would crash). */
    void *dev0 = NULL, *dev1 = NULL, *pinned = NULL;
    CHECK(kvt_cuda_set_device(0) == KVW_OK, "%s", kvt_cuda_error());
    CHECK(kvt_cuda_malloc(r.alloc_len[2] + 4096, &dev0) == KVW_OK, "%s", kvt_cuda_error());
    r.bufs[2].addr = dev0;
    r.bufs[2].mem_kind = KVW_MEM_HOST;
    snprintf(addr, sizeof(addr), "address %p is", dev0);
    const char *w2[] = {name, "declared KVW_MEM_HOST", addr, "CUDA device memory of device 0",
                        NULL};
    expect_refused(&r, "device memory declared host", w2);

    /* Device memory of one device declared on another, the address inside the
     * allocation. */
    char decl[64], is[64], what[96];
    CHECK(kvt_cuda_set_device(other_dev) == KVW_OK, "%s", kvt_cuda_error());
    CHECK(kvt_cuda_malloc(r.alloc_len[2] + 4096, &dev1) == KVW_OK, "%s", kvt_cuda_error());
    CHECK(kvt_cuda_set_device(0) == KVW_OK, "%s", kvt_cuda_error());
    r.bufs[2].addr = (uint8_t *)dev1 + 4096;
    r.bufs[2].mem_kind = KVW_MEM_CUDA;
    r.bufs[2].device = declared_dev;
    snprintf(addr, sizeof(addr), "address %p is", r.bufs[2].addr);
    snprintf(decl, sizeof(decl), "declared KVW_MEM_CUDA on device %d", declared_dev);
    snprintf(is, sizeof(is), "CUDA device memory of device %d", other_dev);
    snprintf(what, sizeof(what), "device %d memory declared on device %d", other_dev,
             declared_dev);
    const char *w3[] = {name, decl, addr, is, NULL};
    expect_refused(&r, what, w3);
    /* Declared on its own device, that one buffer passes; the next one, a host buffer
     * declared CUDA, is then the refusal. */
    r.bufs[2].device = other_dev;
    r.bufs[3].mem_kind = KVW_MEM_CUDA;
    r.bufs[3].device = other_dev;
    char name3[96];
    buffer_name(&r, 3, name3, sizeof(name3));
    snprintf(decl, sizeof(decl), "declared KVW_MEM_CUDA on device %d", other_dev);
    const char *w4[] = {name3, decl, "host memory (not registered with CUDA)", NULL};
    expect_refused(&r, "second buffer host memory declared CUDA", w4);
    r.bufs[3].mem_kind = KVW_MEM_HOST;
    r.bufs[3].device = 0;
    expect_accepted(&r, "device memory declared on its device beside host buffers");
    kvw_rank_destroy(r.h);
    r.h = NULL;

    /* Page-locked host memory: host memory, whichever way CUDA knows it. */
    CHECK(kvt_cuda_malloc_host(r.alloc_len[2], &pinned) == KVW_OK, "%s", kvt_cuda_error());
    r.bufs[2].addr = pinned;
    r.bufs[2].mem_kind = KVW_MEM_CUDA;
    r.bufs[2].device = 0;
    const char *w5[] = {name, "declared KVW_MEM_CUDA on device 0",
                        "page-locked host memory (registered with CUDA)", NULL};
    expect_refused(&r, "page-locked host memory declared CUDA", w5);
    r.bufs[2].mem_kind = KVW_MEM_HOST;
    expect_accepted(&r, "page-locked host memory declared host");
    kvw_rank_destroy(r.h);
    r.h = NULL;

    /* The public query. */
    expect_kind(dev0, KVW_MEM_CUDA, 0, "device 0 memory");
    expect_kind((uint8_t *)dev1 + 4095, KVW_MEM_CUDA, other_dev, "inside device memory");
    expect_kind(pinned, KVW_MEM_HOST, -1, "page-locked host memory");
    expect_kind(r.mem[0], KVW_MEM_HOST, -1, "malloc'd host memory");
    expect_kind(NULL, KVW_MEM_HOST, -1, "NULL");
    kvw_mem_kind_t k;
    int32_t d;
    kvw_status_t st = kvw_cuda_pointer_kind(dev0, NULL, &d);
    CHECK(st == KVW_ERR_INVALID_PARAM && kvt_contains(kvw_last_error(), "NULL argument"),
          "kvw_cuda_pointer_kind without kind: %s (%s)", kvw_status_string(st), kvw_last_error());
    st = kvw_cuda_pointer_kind(dev0, &k, NULL);
    CHECK(st == KVW_ERR_INVALID_PARAM, "kvw_cuda_pointer_kind without device: %s",
          kvw_status_string(st));
    /* Freed device memory is no longer device memory (on the stand-in; a GPU's
     * allocator may keep the range mapped). */
    CHECK(kvt_cuda_free(dev0) == KVW_OK, "%s", kvt_cuda_error());
    if (emu)
        expect_kind(dev0, KVW_MEM_HOST, -1, "freed device memory");

    CHECK(kvt_cuda_free(dev1) == KVW_OK, "%s", kvt_cuda_error());
    CHECK(kvt_cuda_free_host(pinned) == KVW_OK, "%s", kvt_cuda_error());
    kvt_rank_free(&r);
}

/* Every buffer of the prefill rank in device memory (device 1 where there are two),
 * declared so: accepted,
 * and a room moves over tcp (staged through the device) to a host decode rank, every
 * byte checked against the reference. */
static void transfer(void)
{
    kvt_rank_t src, dst;
    uint8_t ***dev = NULL;
    char msg[512];
    kvw_ctx_h pctx = NULL, dctx = NULL;
    CHECK(describe(64, &src) == KVW_OK && kvt_rank_open(&src) == KVW_OK, "%s",
          kvw_last_error());
    CHECK(describe(64, &dst) == KVW_OK && kvt_rank_open(&dst) == KVW_OK, "%s",
          kvw_last_error());
    kvt_rank_fill(&src, 11);
    kvt_rank_fill(&dst, 12);
    /* kvt_gpu_attach describes the rank again (kvw_rank_create) over the device copies. */
    int rc = kvt_gpu_attach(&src, 1, other_dev, &dev, msg, sizeof(msg));
    CHECK(rc == 0, "device %d copies, declared on device %d: %s", other_dev, other_dev, msg);
    if (rc != 0)
        goto out;
    for (uint32_t i = 0; i < src.num_bufs; i++)
        CHECK(src.bufs[i].mem_kind == KVW_MEM_CUDA && src.bufs[i].device == other_dev,
              "buffer %u is not declared on device %d", i, other_dev);
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, &src, "tcp", "127.0.0.1:0", true);
    p.peer_timeout_ms = kvt_tmo_ms(10000);
    p.wait_timeout_ms = kvt_tmo_ms(60000);
    CHECK(kvw_ctx_create(&p, &pctx) == KVW_OK, "prefill context: %s", kvw_last_error());
    if (pctx == NULL)
        goto out;
    char bs[128];
    ip_params_decode(&p, pctx, &dst, bs, sizeof(bs));
    CHECK(kvw_ctx_create(&p, &dctx) == KVW_OK, "decode context: %s", kvw_last_error());
    if (dctx == NULL)
        goto out;
    ip_room_t room = {.id = 7, .tokens = 300, .seed = 5,
                      .deadline_ns = kvt_tmo_ns(60ull * 1000000000ull),
                      .what = "device -> host room"};
    ip_room_verified(&model, pctx, &src, dctx, &dst, &room);
out:
    kvw_ctx_destroy(dctx);
    kvw_ctx_destroy(pctx);
    kvt_gpu_free(&src, 1, dev);
    kvt_rank_free(&src);
    kvt_rank_free(&dst);
}

int main(void)
{
    if (ip_model("test_mem_kind", &model) != 0)
        return 1;
    /* Before this process loads any module. */
    without_module();
    /* CMake runs it with the CPU stand-in (two emulated devices); pointed at the real
     * module (KVW_CUDA_MODULE), it runs the same cases on a GPU. */
    const char *mod = getenv("KVW_CUDA_MODULE");
    emu = mod && strstr(mod, "cuda_emu");
    if (kvw_cuda_available() != KVW_OK || kvw_cuda_device_count(&ndev) != KVW_OK ||
        ndev < 1) {
        printf("test_mem_kind: skipped: no CUDA module or device: %s\n", kvw_last_error());
        return failures ? 1 : 77;
    }
    other_dev = ndev >= 2 ? 1 : 0;
    declared_dev = ndev >= 2 ? 0 : 1;
    printf("test_mem_kind: %s, %d device(s)\n", emu ? "the CPU stand-in" : "CUDA", ndev);
    setenv("KVW_STAGING_MB", "1", 1);
    refusals();
    transfer();
    return ip_summary("test_mem_kind");
}
