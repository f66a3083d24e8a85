/*
 * The asynchronous KV digest on GPU buffers (module ABI 8), through the memory kinds'
 * table (src/exec/memops.h) as the protocol calls it: a digest riding on a launched
 * step (step_digest) and a batch of digests waited for once (digest_n).
 *
 * Every rank exists twice with the same bytes: a host rank, and a rank whose buffers
 * were copied to the "device" (the test kit's kvt_gpu_attach). The reference is the
 * CPU's digest (kvw__plan_digest) of the host ranks' plans, with the copy run by the CPU
 * (kvw_plan_exec_cpu) for the destination side; the values under test come from the
 * CUDA module's digest of the device ranks' plans. Checked:
 *   - a digest attached to a step adds nothing before the step is reaped, and adds
 *     exactly the reference (to units holding other values: added, not stored) once the
 *     reap reports the step done;
 *   - a second digest on the same step, a digest on a reaped step, on a slot out of
 *     range, and on a thread that launched nothing are refused with INVALID_PARAM and a
 *     message saying why;
 *   - the slot, reused by the next launches after its reap, does not add again, and
 *     carries a new digest of its own;
 *   - three steps in flight with a digest each (the prefill's pipeline), reaped in
 *     order, each add their own plan's digest;
 *   - digest_n over three plans equals three single digests and the reference, on
 *     both sides; the host kind's digest_n too, and it has no step_digest;
 *   - plans on two devices: a batch of them, and a step digest of another device's
 *     buffers, are refused (UNSUPPORTED), adding nothing; device 1's batch alone adds
 *     its digest (two devices or more: the stand-in is given two by CMake);
 *   - with the CPU stand-in: a module claiming the previous ABI (7) is refused.
 *
 * Without a GPU it runs on the CPU stand-in (KVW_CUDA_MODULE, set by CMake); with
 * KVW_CUDA_MODULE pointing at libkvwire_cuda.so on a GPU machine it runs the real kernels
 * (scripts/gpu-check.sh runs it so). Exit: 0 pass, 1 fail, 77 no CUDA module.
 */
#include "testkit.h"
#include "check.h"

#include "cuda/module.h"
#include "exec/memops.h"
#include "plan/digest.h"
#include "plan/plan.h"

#include <kvwire/cuda.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define TOKENS 300
#define NPLANS 3
#define MAXU 1024

static kvt_model_t model, bigmodel;

/* The big case: page size 1 and BIG_TOKENS tokens, so that a digest's image (its page
 * lists above all) outgrows the module's digest buffers (256 KiB at first), which grow. */
#define BIG_TOKENS 70000

/* One plan twice: between host ranks (the reference) and between device ranks. */
typedef struct pair {
    kvt_rank_t hs, hd;   /* host source and destination */
    kvt_rank_t gs, gd;   /* the same bytes, buffers on the device */
    uint8_t ***gsdev, ***gddev;
    const kvt_model_t *m;
    uint64_t tokens;
    kvt_req_pages_t sp, dp;
    kvw_plan_h hplan, gplan;
    uint32_t n;           /* units */
    uint64_t want[MAXU];  /* the reference digest (either side, after the copy) */
} pair_t;

static kvw_status_t rank_make(const pair_t *p, uint64_t seed, kvt_rank_t *r)
{
    uint32_t ps = p->tokens > TOKENS ? 1 : 16, np = (uint32_t)(p->tokens / ps + 20);
    kvt_rank_spec_t s = {.model = p->m, .layout = KVW_LAYOUT_NHD, .page_size = {ps, ps},
                         .num_pages = {np, np}, .num_slots = 1};
    s.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = 1, .tp_rank = 0,
                             .pp_size = 1, .layer_begin = 0, .layer_end = p->m->m.num_layers,
                             .dp_size = 1};
    kvw_status_t st = kvt_rank_build(&s, r);
    if (st == KVW_OK)
        kvt_rank_fill(r, seed);
    return st;
}

static int pair_make(const kvt_model_t *m, uint64_t tokens, uint32_t i, int dev, pair_t *p)
{
    memset(p, 0, sizeof(*p));
    p->m = m;
    p->tokens = tokens;
    char msg[512];
    uint64_t s0 = 1000 + 10 * i, d0 = 2000 + 10 * i;
    if (rank_make(p, s0, &p->hs) != KVW_OK || rank_make(p, d0, &p->hd) != KVW_OK ||
        rank_make(p, s0, &p->gs) != KVW_OK || rank_make(p, d0, &p->gd) != KVW_OK) {
        CHECK(0, "plan %u: ranks: %s", i, kvw_last_error());
        return -1;
    }
    if (kvt_gpu_attach(&p->gs, 1, dev, &p->gsdev, msg, sizeof(msg)) != 0 ||
        kvt_gpu_attach(&p->gd, 1, dev, &p->gddev, msg, sizeof(msg)) != 0) {
        CHECK(0, "plan %u: device copies: %s", i, msg);
        return -1;
    }
    kvt_rng_t rng = {77 + i};
    kvt_req_spec_t rs = {.full_begin = 0, .full_end = tokens, .swa_begin = 0,
                         .swa_end = tokens, .state_slot = -1};
    if (kvt_req_pages_make(&p->hs, &rs, &rng, &p->sp) || kvt_req_pages_make(&p->hd, &rs, &rng,
                                                                              &p->dp)) {
        CHECK(0, "plan %u: pages", i);
        return -1;
    }
    kvw_chunk_t c = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = tokens,
                     .chunk_end = tokens, .last_chunk = 1};
    if (kvw_plan_create(p->hs.h, p->hd.h, &c, &p->sp.side, &p->dp.side, &p->hplan) != KVW_OK ||
        kvw_plan_create(p->gs.h, p->gd.h, &c, &p->sp.side, &p->dp.side, &p->gplan) != KVW_OK) {
        CHECK(0, "plan %u: %s", i, kvw_last_error());
        return -1;
    }
    p->n = kvw__digest_units(p->hd.h);
    if (p->n == 0 || p->n > MAXU || kvw__digest_units(p->gd.h) != p->n) {
        CHECK(0, "plan %u: %u units", i, p->n);
        return -1;
    }
    /* The reference: the source rows, then the destination's after the CPU's copy, the
     * same (the copy is checked by the GPU side's destination digest below). */
    uint64_t dst[MAXU] = {0};
    CHECK(kvw__plan_digest(p->hplan, false, NULL, 0, p->want, p->n) == KVW_OK, "%s",
          kvw_last_error());
    CHECK(kvw_plan_exec_cpu(p->hplan) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw__plan_digest(p->hplan, true, NULL, 0, dst, p->n) == KVW_OK, "%s",
          kvw_last_error());
    CHECK(memcmp(dst, p->want, 8ull * p->n) == 0, "plan %u: the host digests of the two "
          "sides differ", i);
    uint32_t nonzero = 0;
    for (uint32_t u = 0; u < p->n; u++)
        nonzero += p->want[u] != 0;
    CHECK(nonzero == p->n, "plan %u: %u of %u reference units are 0", i, nonzero, p->n);
    return 0;
}

static void pair_free(pair_t *p)
{
    kvw_plan_destroy(p->hplan);
    kvw_plan_destroy(p->gplan);
    kvt_req_pages_free(&p->sp);
    kvt_req_pages_free(&p->dp);
    kvt_gpu_free(&p->gs, 1, p->gsdev);
    kvt_gpu_free(&p->gd, 1, p->gddev);
    kvt_rank_free(&p->hs);
    kvt_rank_free(&p->hd);
    kvt_rank_free(&p->gs);
    kvt_rank_free(&p->gd);
}

/* units == base + want (mod 2^64), unit for unit; the first unit that is not. */
static void expect_sum(const char *what, const uint64_t *units, const uint64_t *base,
                       const uint64_t *want, uint32_t n)
{
    for (uint32_t u = 0; u < n; u++)
        if (units[u] != (base ? base[u] : 0) + want[u]) {
            CHECK(0, "%s: unit %u is %016llx, expected %016llx", what, u,
                  (unsigned long long)units[u],
                  (unsigned long long)((base ? base[u] : 0) + want[u]));
            return;
        }
}

static void expect_refused(const char *what, kvw_status_t st, const char *needle)
{
    CHECK(st == KVW_ERR_INVALID_PARAM && strstr(kvw_last_error(), needle) != NULL,
          "%s: %s: \"%s\" (wanted INVALID_PARAM saying \"%s\")", what, kvw_status_string(st),
          kvw_last_error(), needle);
}

/* Reaps `slot`, blocking; it must report done with OK. */
static void reap(const kvw_memops_t *mem, int slot, const char *what)
{
    kvw_cuda_profile_t prof = {0};
    int done = 0;
    kvw_status_t st = mem->step_reap(slot, 1, &done, &prof);
    CHECK(st == KVW_OK && done, "%s: reap of slot %d: %s, done %d: %s", what, slot,
          kvw_status_string(st), done, kvw_last_error());
}

static int launch(const kvw_memops_t *mem, const pair_t *p, const char *what)
{
    kvw_cuda_profile_t prof = {0};
    int slot = -1;
    kvw_status_t st = mem->step_launch(p->gplan, &slot, &prof);
    CHECK(st == KVW_OK && slot >= 0 && slot < KVWC_EXEC_SLOTS, "%s: launch: %s, slot %d: %s",
          what, kvw_status_string(st), slot, kvw_last_error());
    return st == KVW_OK ? slot : -1;
}

/* A digest riding on one step: nothing before the reap, the reference after; refusals;
 * the slot reused. */
static void step_digest(const kvw_memops_t *mem, pair_t *p)
{
    static uint64_t units[MAXU], base[MAXU], again[MAXU];
    for (uint32_t u = 0; u < p->n; u++)
        base[u] = units[u] = kvt_mix64(u + 5); /* added to, not written over */
    int slot = launch(mem, p, "step digest");
    if (slot < 0)
        return;
    kvw_status_t st = mem->step_digest(p->gplan, slot, units, p->n);
    CHECK(st == KVW_OK, "step_digest on slot %d: %s: %s", slot, kvw_status_string(st),
          kvw_last_error());
    CHECK(memcmp(units, base, 8ull * p->n) == 0,
          "step_digest changed the units before the step was reaped");
    memset(again, 0, sizeof(again));
    expect_refused("a second digest on one step", mem->step_digest(p->gplan, slot, again, p->n),
                   "already carries a digest");
    expect_refused("a digest on slot -2", mem->step_digest(p->gplan, -2, again, p->n),
                   "slot -2 is not -1 nor a step slot");
    expect_refused("a digest on slot 8", mem->step_digest(p->gplan, KVWC_EXEC_SLOTS, again,
                                                          p->n), "is not -1 nor a step slot");
    int idle = (slot + 1) % KVWC_EXEC_SLOTS;
    char needle[64];
    snprintf(needle, sizeof(needle), "slot %d is not in flight", idle);
    expect_refused("a digest on a slot never launched", mem->step_digest(p->gplan, idle, again,
                                                                         p->n), needle);
    CHECK(memcmp(units, base, 8ull * p->n) == 0, "the refusals changed the units");
    reap(mem, slot, "step digest");
    expect_sum("step digest after its reap", units, base, p->want, p->n);
    snprintf(needle, sizeof(needle), "slot %d is not in flight", slot);
    expect_refused("a digest on a reaped step", mem->step_digest(p->gplan, slot, again, p->n),
                   needle);
    for (uint32_t u = 0; u < p->n; u++)
        CHECK(again[u] == 0, "a refused digest added to unit %u", u);

    /* The slot comes round again: the old digest is not added twice, and the new one on
     * it goes to its own units. */
    memcpy(base, units, 8ull * p->n);
    int reused = -1;
    for (int k = 0; k < KVWC_EXEC_SLOTS; k++) {
        int s = launch(mem, p, "slot reuse");
        if (s < 0)
            return;
        if (s == slot) {
            reused = s;
            CHECK(mem->step_digest(p->gplan, s, again, p->n) == KVW_OK, "digest on the reused "
                  "slot %d: %s", s, kvw_last_error());
        }
        reap(mem, s, "slot reuse");
    }
    CHECK(reused == slot, "slot %d never came round again in %d launches", slot,
          KVWC_EXEC_SLOTS);
    CHECK(memcmp(units, base, 8ull * p->n) == 0,
          "the first digest's units changed when its slot was reused");
    expect_sum("the reused slot's own digest", again, NULL, p->want, p->n);
}

/* The prefill's pipeline: NPLANS steps in flight, a digest each, reaped in order. */
static void pipeline(const kvw_memops_t *mem, pair_t *p)
{
    static uint64_t units[NPLANS][MAXU];
    int slot[NPLANS];
    memset(units, 0, sizeof(units));
    for (int i = 0; i < NPLANS; i++) {
        slot[i] = launch(mem, &p[i], "pipeline");
        if (slot[i] >= 0)
            CHECK(mem->step_digest(p[i].gplan, slot[i], units[i], p[i].n) == KVW_OK,
                  "pipeline: digest on slot %d: %s", slot[i], kvw_last_error());
    }
    for (int i = 0; i < NPLANS; i++)
        for (uint32_t u = 0; u < p[i].n; u++)
            if (units[i][u]) {
                CHECK(0, "pipeline: plan %d's units changed before any reap", i);
                break;
            }
    for (int i = 0; i < NPLANS; i++) {
        if (slot[i] < 0)
            continue;
        reap(mem, slot[i], "pipeline");
        char what[64];
        snprintf(what, sizeof(what), "pipeline: plan %d after its reap", i);
        expect_sum(what, units[i], NULL, p[i].want, p[i].n);
        for (int j = i + 1; j < NPLANS; j++)
            for (uint32_t u = 0; u < p[j].n; u++)
                if (units[j][u]) {
                    CHECK(0, "pipeline: plan %d's units changed at plan %d's reap", j, i);
                    break;
                }
    }
}

/* A batch of digests equals single ones and the reference, on either side. */
static void batch(const kvw_memops_t *mem, pair_t *p, bool gpu)
{
    static uint64_t one[NPLANS][MAXU], many[NPLANS][MAXU];
    const struct kvw_plan *plans[NPLANS];
    uint64_t *units[NPLANS];
    for (int side = 0; side < 2; side++) {
        memset(one, 0, sizeof(one));
        for (int i = 0; i < NPLANS; i++) {
            plans[i] = gpu ? p[i].gplan : p[i].hplan;
            units[i] = many[i];
            for (uint32_t u = 0; u < MAXU; u++)
                many[i][u] = kvt_mix64(u * 3 + (uint64_t)i);
            CHECK(mem->digest(plans[i], side, NULL, 0, one[i], p[i].n) == KVW_OK,
                  "%s digest of plan %d: %s", mem->name, i, kvw_last_error());
        }
        kvw_status_t st = mem->digest_n(plans, NPLANS, side, units, p[0].n);
        CHECK(st == KVW_OK, "%s digest_n: %s: %s", mem->name, kvw_status_string(st),
              kvw_last_error());
        for (int i = 0; i < NPLANS; i++) {
            uint64_t base[MAXU];
            for (uint32_t u = 0; u < MAXU; u++)
                base[u] = kvt_mix64(u * 3 + (uint64_t)i);
            char what[96];
            snprintf(what, sizeof(what), "%s digest_n, %s side, plan %d", mem->name,
                     side ? "destination" : "source", i);
            expect_sum(what, many[i], base, one[i], p[i].n);
            expect_sum(what, one[i], NULL, p[i].want, p[i].n);
            CHECK(many[i][p[i].n] == base[p[i].n], "%s: a unit past the last was written",
                  what);
        }
    }
}

/* Digests larger than the module's buffers: a step's, then a batch of two (each grows
 * the buffers on a GPU; the stand-in has none to grow). */
static void big(const kvw_memops_t *mem, pair_t *b)
{
    static uint64_t units[MAXU], two[2][MAXU];
    uint64_t pages = 0;
    for (uint32_t k = 0; k < KVW_NUM_POOLS; k++)
        pages += b->gplan->src_maps[k].num_pages + b->gplan->dst_maps[k].num_pages;
    CHECK(4 * pages > (256u << 10), "the big plan's page lists (%llu pages) fit the module's "
          "first digest buffers", (unsigned long long)pages);
    int slot = launch(mem, b, "big step");
    if (slot < 0)
        return;
    memset(units, 0, sizeof(units));
    CHECK(mem->step_digest(b->gplan, slot, units, b->n) == KVW_OK, "big step digest: %s",
          kvw_last_error());
    reap(mem, slot, "big step");
    expect_sum("big step digest", units, NULL, b->want, b->n);
    memset(two, 0, sizeof(two));
    const struct kvw_plan *plans[2] = {b->gplan, b->gplan};
    uint64_t *u2[2] = {two[0], two[1]};
    CHECK(mem->digest_n(plans, 2, true, u2, b->n) == KVW_OK, "big digest_n: %s",
          kvw_last_error());
    expect_sum("big digest_n, first", two[0], NULL, b->want, b->n);
    expect_sum("big digest_n, second", two[1], NULL, b->want, b->n);
}

/* Plans on two devices: a batch reads one, a step's digest reads the executor's. */
static void two_devices(const kvw_memops_t *mem, pair_t *p0)
{
    int count = 0;
    if (kvw_cuda_device_count(&count) != KVW_OK || count < 2) {
        printf("test_cuda_digest_async: one device: the two-device refusals skipped\n");
        return;
    }
    static pair_t q;
    static uint64_t u[2][MAXU];
    /* Attaching makes device 1 current (the test kit and the library share the runtime). */
    int ok = pair_make(&model, TOKENS, 9, 1, &q) == 0;
    CHECK(mem->select(0) == KVW_OK, "%s", kvw_last_error());
    if (ok) {
        memset(u, 0, sizeof(u));
        const struct kvw_plan *plans[2] = {p0->gplan, q.gplan};
        uint64_t *units[2] = {u[0], u[1]};
        kvw_status_t st = mem->digest_n(plans, 2, false, units, p0->n);
        CHECK(st == KVW_ERR_UNSUPPORTED && strstr(kvw_last_error(), "one batch of digests reads "
                                                  "one GPU") != NULL,
              "digest_n over two devices: %s: %s", kvw_status_string(st), kvw_last_error());
        int slot = launch(mem, p0, "two devices");
        if (slot >= 0) {
            st = mem->step_digest(q.gplan, slot, u[0], p0->n);
            CHECK(st == KVW_ERR_UNSUPPORTED && strstr(kvw_last_error(), "executor on GPU 0"),
                  "a step digest of device 1's buffers on device 0's step: %s: %s",
                  kvw_status_string(st), kvw_last_error());
            reap(mem, slot, "two devices");
        }
        for (uint32_t k = 0; k < p0->n; k++)
            if (u[0][k] || u[1][k]) {
                CHECK(0, "a refused digest added to unit %u", k);
                break;
            }
        /* Each device's alone. */
        CHECK(mem->digest_n(&plans[1], 1, false, &units[1], q.n) == KVW_OK, "digest_n on "
              "device 1: %s", kvw_last_error());
        expect_sum("digest_n on device 1", u[1], NULL, q.want, q.n);
    }
    pair_free(&q);
}

/* The previous module ABI is refused, in a child that has loaded nothing. */
static void old_abi(const char *module)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        setenv("KVW_CUDA_MODULE", module, 1);
        setenv("KVW_CUDA_EMU_ABI", "7", 1);
        kvw_status_t st = kvw_cuda_available();
        int bad = st != KVW_ERR_UNSUPPORTED ||
                  strstr(kvw_last_error(), "built for ABI 7") == NULL;
        if (bad)
            fprintf(stderr, "ABI 7 module: %s: %s\n", kvw_status_string(st), kvw_last_error());
        _exit(bad);
    }
    int ws = 0;
    CHECK(pid > 0 && waitpid(pid, &ws, 0) == pid && WIFEXITED(ws) && WEXITSTATUS(ws) == 0,
          "a module built for ABI 7 was not refused");
}

int main(void)
{
    const char *mod = getenv("KVW_CUDA_MODULE");
    bool emu = mod && strstr(mod, "cuda_emu");
    if (emu)
        old_abi(mod);
    if (kvw_cuda_available() != KVW_OK) {
        printf("test_cuda_digest_async: skipped: no CUDA module or device: %s\n",
               kvw_last_error());
        return 77;
    }
    if (kvt_model_preset("gpt-oss-120b", &model) || kvt_model_truncate(&model, 2)) {
        fprintf(stderr, "no model preset\n");
        return 1;
    }
    kvt_model_relink(&model);
    /* One layer of one KV head with 16-byte rows: small buffers, long page lists. */
    if (kvt_model_preset("llama-3.1-70b", &bigmodel) || kvt_model_truncate(&bigmodel, 1)) {
        fprintf(stderr, "no model preset\n");
        return 1;
    }
    bigmodel.m.num_kv_heads = 1;
    bigmodel.m.k_head_dim = bigmodel.m.v_head_dim = 8;
    kvt_model_relink(&bigmodel);
    static pair_t p[NPLANS], b;
    int ok = 1;
    for (uint32_t i = 0; i < NPLANS && ok; i++)
        ok = pair_make(&model, TOKENS, i, 0, &p[i]) == 0;
    if (ok)
        ok = pair_make(&bigmodel, BIG_TOKENS, 7, 0, &b) == 0;
    const kvw_memops_t *mem = kvw__memops(KVW_MEM_CUDA), *host = kvw__memops(KVW_MEM_HOST);
    CHECK(host->step_digest == NULL && host->digest_n != NULL && mem->step_digest != NULL &&
              mem->digest_n != NULL, "the memops tables' digest slots");
    if (ok) {
        /* No step on this thread yet. */
        static uint64_t none[MAXU];
        expect_refused("a step digest before any launch",
                       mem->step_digest(p[0].gplan, 0, none, p[0].n), "no step was launched");
        CHECK(mem->select(0) == KVW_OK, "%s", kvw_last_error());
        step_digest(mem, &p[0]);
        pipeline(mem, p);
        batch(mem, p, true);
        batch(host, p, false);
        big(mem, &b);
        two_devices(mem, &p[0]);
    }
    for (uint32_t i = 0; i < NPLANS; i++)
        pair_free(&p[i]);
    pair_free(&b);
    if (failures) {
        fprintf(stderr, "test_cuda_digest_async: %d of %d checks failed\n", failures, checks);
        return 1;
    }
    printf("test_cuda_digest_async: %d checks passed%s\n", checks,
           emu ? " (CPU stand-in)" : "");
    return 0;
}
