/*
 * kvw_gpu_check: the CUDA executor between two processes on two GPUs, as in
 * disaggregated serving. Run by scripts/gpu-check.sh and registered in CTest.
 *
 * The parent forks before any CUDA call: one probe child checks for GPUs (no GPU or no
 * driver: the program prints "skipped: ..." and exits 77), then a prefill process on
 * GPU 0 and a decode process on GPU 1 (both on GPU 0 when only one exists), joined by a
 * socketpair. For every case of gpu_common.c:
 *
 *   decode   allocates one arena on its GPU holding every destination buffer of every
 *            decode rank, each surrounded by poisoned guard bytes, fills it with the
 *            ranks' initial contents, allocates a staging arena, and sends CUDA IPC
 *            handles for both;
 *   prefill  uploads every source rank's buffers to its GPU, opens the handles, builds
 *            each (source, destination) plan with kvw_plan_create from rank
 *            descriptions whose addresses are its own device pointers and the mapped
 *            peer pointers, runs the fused kernel (kvw_plan_exec_cuda or an uploaded
 *            plan), synchronises and says so;
 *   decode   copies the arena back and compares every byte with kvw_plan_exec_cpu run
 *            on host copies (itself checked against testkit's naive reference), and
 *            every guard byte; then resets the arena;
 *   prefill  gathers each plan into staging on its GPU and copies the staging to the
 *            decode's staging arena (peer copy);
 *   decode   checks the staging bytes against a CPU gather in kvw_plan_expand order,
 *            scatters each plan from it, and compares again, also with the direct
 *            result.
 *
 * Ends with a table (case, bytes, results). Exit 0: all passed; 1: a failure; 77: no
 * GPU. Options: --case SUBSTRING runs matching cases only.
 */
#include <kvwire/cuda.h>
#include <kvwire/kvwire.h>

#include "gpu_common.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

enum { MSG_HANDLES = 1, MSG_DIRECT_DONE, MSG_RESET_DONE, MSG_STAGED_DONE, MSG_CASE_DONE };

typedef struct gmsg {
    uint32_t type;
    int32_t status; /* KVW_OK or the first error */
    uint64_t a, b;
    kvt_cuda_ipc_handle_t h1, h2;
    char text[320];
} gmsg_t;

static const char *case_filter;

static int selected(const gc_case_t *c)
{
    return case_filter == NULL || kvt_contains(c->name, case_filter);
}

static int send_msg(int fd, uint32_t type, kvw_status_t st, const char *text, gmsg_t *m)
{
    m->type = type;
    m->status = st;
    if (text)
        snprintf(m->text, sizeof(m->text), "%s", text);
    const uint8_t *p = (const uint8_t *)m;
    size_t left = sizeof(*m);
    while (left) {
        ssize_t n = write(fd, p, left);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        left -= (size_t)n;
    }
    return 0;
}

static int recv_msg(int fd, uint32_t type, gmsg_t *m)
{
    uint8_t *p = (uint8_t *)m;
    size_t left = sizeof(*m);
    while (left) {
        ssize_t n = read(fd, p, left);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            fprintf(stderr, "gpu-check: the peer process went away\n");
            return -1;
        }
        p += n;
        left -= (size_t)n;
    }
    if (m->type != type) {
        fprintf(stderr, "gpu-check: protocol error: message %u, expected %u\n", m->type, type);
        return -1;
    }
    return 0;
}

/* First error of a step sequence, with its message. */
typedef struct err {
    kvw_status_t st;
    char text[320];
} err_t;

static void fail(err_t *e, kvw_status_t st, const char *fmt, ...)
{
    if (e->st != KVW_OK)
        return;
    e->st = st == KVW_OK ? KVW_ERR_INTERNAL : st;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->text, sizeof(e->text), fmt, ap);
    va_end(ap);
}

/* Runs `call` unless an error is pending; a failure records `what`, the status and
 * `why()`'s message. TRY for the library, TRYC for the test kit's CUDA runtime calls. */
#define TRY_WITH(e, call, what, why)                                                     \
    do {                                                                                 \
        if ((e)->st == KVW_OK) {                                                         \
            kvw_status_t st_ = (call);                                                   \
            if (st_ != KVW_OK)                                                           \
                fail((e), st_, "%s: %s (%s)", what, kvw_status_string(st_), why());      \
        }                                                                                \
    } while (0)
#define TRY(e, call, what) TRY_WITH(e, call, what, kvw_last_error)
#define TRYC(e, call, what) TRY_WITH(e, call, what, kvt_cuda_error)

/* Both processes build the same host instances and layouts for a case. */
typedef struct side_state {
    kvt_model_t model;
    gc_inst_t S, D;
    uint64_t *soffs, *doffs;
    uint64_t stotal, dtotal;
} side_state_t;

static int state_build(side_state_t *ss, const gc_case_t *c, char *msg, size_t cap)
{
    memset(ss, 0, sizeof(*ss));
    if (gc_model(c, &ss->model)) {
        snprintf(msg, cap, "unknown model %s", c->model);
        return -1;
    }
    uint64_t seed = gc_seed(c);
    if (gc_inst_build(&ss->S, &ss->model, c, 0, seed, msg, cap) ||
        gc_inst_build(&ss->D, &ss->model, c, 1, seed + 1, msg, cap))
        return -1;
    ss->soffs = calloc(gc_total_bufs(&ss->S) + 1, sizeof(uint64_t));
    ss->doffs = calloc(gc_total_bufs(&ss->D) + 1, sizeof(uint64_t));
    if (!ss->soffs || !ss->doffs) {
        snprintf(msg, cap, "out of memory");
        return -1;
    }
    ss->stotal = gc_arena_layout(&ss->S, c->misalign, ss->soffs);
    ss->dtotal = gc_arena_layout(&ss->D, c->misalign, ss->doffs);
    return 0;
}

static void state_free(side_state_t *ss)
{
    gc_inst_free(&ss->S);
    gc_inst_free(&ss->D);
    free(ss->soffs);
    free(ss->doffs);
}

/* A rank handle whose buffers live in an arena at `base` (NULL: no addresses). */
static kvw_status_t arena_rank(const gc_inst_t *in, uint32_t r, const uint64_t *offs,
                               uint8_t *base, kvw_mem_kind_t kind, int dev, kvw_rank_h *h_p)
{
    uint8_t **addrs = calloc(in->r[r].num_bufs + 1, sizeof(uint8_t *));
    if (!addrs)
        return KVW_ERR_NO_MEMORY;
    for (uint32_t b = 0; b < in->r[r].num_bufs; b++)
        addrs[b] = base ? base + offs[gc_buf_index(in, r, b)] : NULL;
    kvw_status_t st = gc_rank_clone(&in->r[r], kind, dev, base ? addrs : NULL, h_p);
    free(addrs);
    return st;
}

static uint64_t align256(uint64_t x)
{
    return (x + 255) / 256 * 256;
}

/* ---------------------------------------------------------------- prefill process */

static int run_prefill(int fd, int dev, int peer_dev)
{
    gmsg_t m;
    int rc = 0;
    void *stream = NULL;
    err_t se = {0};
    TRYC(&se, kvt_cuda_set_device(dev), "cudaSetDevice");
    TRYC(&se, kvt_cuda_stream_create(&stream), "stream");
    if (se.st != KVW_OK) {
        fprintf(stderr, "prefill: %s\n", se.text);
        return 1;
    }
    for (uint32_t ci = 0; ci < gc_num_cases; ci++) {
        const gc_case_t *c = &gc_cases[ci];
        if (!selected(c))
            continue;
        side_state_t ss;
        err_t e = {0};
        uint8_t *sarena = NULL, *lstage = NULL, *dmap = NULL, *smap = NULL;
        uint32_t npairs = 0;
        kvw_plan_h *plans = NULL;
        kvw_rank_h *hs = NULL, *hd = NULL;
        if (state_build(&ss, c, e.text, sizeof(e.text)))
            e.st = KVW_ERR_INTERNAL;
        if (recv_msg(fd, MSG_HANDLES, &m))
            return 1;
        if (m.status != KVW_OK) {
            /* The decode side could not set up; it goes straight to CASE_DONE. */
            state_free(&ss);
            if (recv_msg(fd, MSG_CASE_DONE, &m))
                return 1;
            continue;
        }
        uint64_t stage_total = m.b;

        /* Source arena on this GPU, with the ranks' contents. */
        uint8_t *img = malloc(ss.stotal ? ss.stotal : 1);
        if (e.st == KVW_OK && !img)
            fail(&e, KVW_ERR_NO_MEMORY, "out of memory");
        TRYC(&e, kvt_cuda_malloc(ss.stotal, (void **)&sarena), "source arena");
        if (e.st == KVW_OK)
            gc_arena_image(&ss.S, ss.soffs, ss.stotal, img);
        TRYC(&e, kvt_cuda_memcpy(sarena, img, ss.stotal, NULL), "source upload");
        TRYC(&e, kvt_cuda_ipc_open(&m.h1, (void **)&dmap), "ipc_open(destination)");
        TRYC(&e, kvt_cuda_ipc_open(&m.h2, (void **)&smap), "ipc_open(staging)");

        /* Plans from descriptions whose addresses are device pointers of both GPUs. */
        npairs = ss.S.n * ss.D.n;
        plans = calloc(npairs, sizeof(*plans));
        hs = calloc(ss.S.n, sizeof(*hs));
        hd = calloc(ss.D.n, sizeof(*hd));
        if (e.st == KVW_OK && (!plans || !hs || !hd))
            fail(&e, KVW_ERR_NO_MEMORY, "out of memory");
        for (uint32_t s = 0; s < ss.S.n && e.st == KVW_OK; s++)
            TRY(&e, arena_rank(&ss.S, s, ss.soffs, sarena, KVW_MEM_CUDA, dev, &hs[s]),
                "source rank");
        for (uint32_t d = 0; d < ss.D.n && e.st == KVW_OK; d++)
            TRY(&e, arena_rank(&ss.D, d, ss.doffs, dmap, KVW_MEM_CUDA, peer_dev, &hd[d]),
                "destination rank");
        kvw_chunk_t ch = gc_chunk(c);
        for (uint32_t d = 0; d < ss.D.n && e.st == KVW_OK; d++)
            for (uint32_t s = 0; s < ss.S.n && e.st == KVW_OK; s++)
                TRY(&e, kvw_plan_create(hs[s], hd[d], &ch, &ss.S.pg[s].side, &ss.D.pg[d].side,
                                        &plans[d * ss.S.n + s]),
                    "kvw_plan_create");

        /* Direct: odd cases through the one-shot call, even ones through uploads. */
        for (uint32_t i = 0; i < npairs && e.st == KVW_OK; i++) {
            if (ci % 2) {
                TRY(&e, kvw_plan_exec_cuda(plans[i], stream), "kvw_plan_exec_cuda");
            } else {
                kvw_cuda_plan_h cp = NULL;
                TRY(&e, kvw_cuda_plan_upload(plans[i], KVW_CUDA_DIRECT, &cp),
                    "kvw_cuda_plan_upload");
                TRY(&e, kvw_cuda_plan_exec(cp, stream), "kvw_cuda_plan_exec");
                TRYC(&e, kvt_cuda_stream_sync(stream), "synchronise after the fused kernel");
                kvw_cuda_plan_destroy(cp);
            }
        }
        TRYC(&e, kvt_cuda_stream_sync(stream), "synchronise after the fused kernel");
        if (send_msg(fd, MSG_DIRECT_DONE, e.st, e.text, &m) || recv_msg(fd, MSG_RESET_DONE, &m))
            return 1;

        /* Staged: gather on this GPU, one bulk peer copy, the decode side scatters. */
        TRYC(&e, kvt_cuda_malloc(stage_total ? stage_total : 256, (void **)&lstage),
            "local staging");
        uint64_t off = 0;
        for (uint32_t i = 0; i < npairs && e.st == KVW_OK; i++) {
            kvw_cuda_plan_h cp = NULL;
            TRY(&e, kvw_cuda_plan_upload(plans[i], KVW_CUDA_GATHER, &cp), "upload (gather)");
            uint64_t n = kvw_cuda_plan_bytes(cp);
            TRY(&e, kvw_cuda_plan_gather(cp, lstage + off, off <= stage_total ? stage_total - off : 0,
                                         stream),
                "kvw_cuda_plan_gather");
            TRYC(&e, kvt_cuda_stream_sync(stream), "synchronise after gather");
            kvw_cuda_plan_destroy(cp);
            off += align256(n);
        }
        if (e.st == KVW_OK && off > stage_total)
            fail(&e, KVW_ERR_INTERNAL, "staging needs %llu bytes, decode granted %llu",
                 (unsigned long long)off, (unsigned long long)stage_total);
        if (off)
            TRYC(&e, kvt_cuda_memcpy(smap, lstage, off, stream), "peer copy of the staging");
        TRYC(&e, kvt_cuda_stream_sync(stream), "synchronise after the peer copy");
        /* The sources must be untouched. */
        uint8_t *back = malloc(ss.stotal ? ss.stotal : 1);
        if (e.st == KVW_OK && back == NULL)
            fail(&e, KVW_ERR_NO_MEMORY, "out of memory");
        TRYC(&e, kvt_cuda_memcpy(back, sarena, ss.stotal, NULL), "source readback");
        if (e.st == KVW_OK && memcmp(back, img, ss.stotal) != 0)
            fail(&e, KVW_ERR_INTERNAL, "the source arena changed");
        free(back);
        free(img);
        if (dmap)
            TRYC(&e, kvt_cuda_ipc_close(dmap), "ipc_close");
        if (smap)
            TRYC(&e, kvt_cuda_ipc_close(smap), "ipc_close");
        if (send_msg(fd, MSG_STAGED_DONE, e.st, e.text, &m) || recv_msg(fd, MSG_CASE_DONE, &m))
            return 1;

        for (uint32_t i = 0; plans && i < npairs; i++)
            kvw_plan_destroy(plans[i]);
        for (uint32_t s = 0; hs && s < ss.S.n; s++)
            kvw_rank_destroy(hs[s]);
        for (uint32_t d = 0; hd && d < ss.D.n; d++)
            kvw_rank_destroy(hd[d]);
        free(plans);
        free(hs);
        free(hd);
        if (sarena)
            kvt_cuda_free(sarena);
        if (lstage)
            kvt_cuda_free(lstage);
        state_free(&ss);
        if (e.st != KVW_OK) {
            fprintf(stderr, "prefill [%s]: %s\n", c->name, e.text);
            rc = 1;
        }
    }
    kvt_cuda_stream_destroy(stream);
    return rc;
}

/* ---------------------------------------------------------------- decode process */

typedef struct row {
    const char *name;
    uint32_t nsrc, ndst;
    uint64_t bytes;
    const char *direct, *staged;
} row_t;

/* Compares the destination arena image with the expected contents. */
static int check_image(side_state_t *ss, uint8_t *img, kvt_copy_t *exp, const char *what,
                       char *msg, size_t cap)
{
    if (gc_arena_check_poison(&ss->D, ss->doffs, ss->dtotal, img, msg, cap))
        return -1;
    for (uint32_t d = 0; d < ss->D.n; d++) {
        kvt_copy_t view;
        if (gc_arena_view(&ss->D, d, ss->doffs, img, &view)) {
            snprintf(msg, cap, "out of memory");
            return -1;
        }
        char w[96];
        snprintf(w, sizeof(w), "%s, decode rank %u", what, d);
        int bad = kvt_copy_compare2(&ss->D.r[d], &view, &exp[d], w, msg, cap);
        gc_view_free(&view);
        if (bad)
            return -1;
    }
    return 0;
}

static int run_decode(int fd, int dev, row_t *rows, uint32_t *nrows_p)
{
    gmsg_t m;
    int rc = 0;
    uint32_t nrows = 0;
    void *stream = NULL;
    err_t se = {0};
    TRYC(&se, kvt_cuda_set_device(dev), "cudaSetDevice");
    TRYC(&se, kvt_cuda_stream_create(&stream), "stream");
    if (se.st != KVW_OK) {
        fprintf(stderr, "decode: %s\n", se.text);
        return 1;
    }
    for (uint32_t ci = 0; ci < gc_num_cases; ci++) {
        const gc_case_t *c = &gc_cases[ci];
        if (!selected(c))
            continue;
        row_t *row = &rows[nrows++];
        *row = (row_t){.name = c->name, .direct = "FAIL", .staged = "FAIL"};
        side_state_t ss;
        err_t e = {0};
        kvt_copy_t *exp = NULL;
        uint8_t *darena = NULL, *dstage = NULL, *init = NULL, *img = NULL, *direct_img = NULL;
        kvw_plan_h *plans = NULL;
        kvw_rank_h *hs = NULL, *hd = NULL;
        uint64_t *stage_off = NULL, stage_total = 0;
        uint32_t npairs = 0;
        kvw_chunk_t ch = gc_chunk(c);

        if (state_build(&ss, c, e.text, sizeof(e.text)))
            e.st = KVW_ERR_INTERNAL;
        row->nsrc = ss.S.n;
        row->ndst = ss.D.n;
        if (e.st == KVW_OK) {
            exp = calloc(ss.D.n, sizeof(*exp));
            for (uint32_t d = 0; exp && d < ss.D.n; d++)
                if (kvt_copy_make(&ss.D.r[d], &exp[d]) != KVW_OK)
                    fail(&e, KVW_ERR_NO_MEMORY, "out of memory");
            if (!exp)
                fail(&e, KVW_ERR_NO_MEMORY, "out of memory");
        }
        if (e.st == KVW_OK &&
            gc_expected(&ss.model, c, &ss.S, &ss.D, exp, &row->bytes, e.text, sizeof(e.text)))
            e.st = KVW_ERR_INTERNAL;

        /* Plans for the scatter: destinations in this GPU's arena, sources described
         * without addresses (they live in the other process). */
        npairs = ss.S.n * ss.D.n;
        plans = calloc(npairs + 1, sizeof(*plans));
        hs = calloc(ss.S.n + 1, sizeof(*hs));
        hd = calloc(ss.D.n + 1, sizeof(*hd));
        stage_off = calloc(npairs + 1, sizeof(*stage_off));
        init = malloc(ss.dtotal ? ss.dtotal : 1);
        img = malloc(ss.dtotal ? ss.dtotal : 1);
        direct_img = malloc(ss.dtotal ? ss.dtotal : 1);
        if (e.st == KVW_OK && (!plans || !hs || !hd || !stage_off || !init || !img ||
                               !direct_img))
            fail(&e, KVW_ERR_NO_MEMORY, "out of memory");
        TRYC(&e, kvt_cuda_malloc(ss.dtotal, (void **)&darena), "destination arena");
        for (uint32_t s = 0; s < ss.S.n && e.st == KVW_OK; s++)
            TRY(&e, arena_rank(&ss.S, s, ss.soffs, NULL, KVW_MEM_CUDA, 0, &hs[s]),
                "source description");
        for (uint32_t d = 0; d < ss.D.n && e.st == KVW_OK; d++)
            TRY(&e, arena_rank(&ss.D, d, ss.doffs, darena, KVW_MEM_CUDA, dev, &hd[d]),
                "destination rank");
        for (uint32_t d = 0; d < ss.D.n && e.st == KVW_OK; d++)
            for (uint32_t s = 0; s < ss.S.n && e.st == KVW_OK; s++) {
                uint32_t i = d * ss.S.n + s;
                TRY(&e, kvw_plan_create(hs[s], hd[d], &ch, &ss.S.pg[s].side, &ss.D.pg[d].side,
                                        &plans[i]),
                    "kvw_plan_create");
                kvw_plan_stats_t st = {.field_mask = KVW_PLAN_STATS_FIELDS_ALL};
                TRY(&e, kvw_plan_stats(plans[i], &st), "kvw_plan_stats");
                stage_off[i] = stage_total;
                stage_total += align256(st.bytes);
            }
        TRYC(&e, kvt_cuda_malloc(stage_total ? stage_total : 256, (void **)&dstage), "staging");
        if (e.st == KVW_OK)
            gc_arena_image(&ss.D, ss.doffs, ss.dtotal, init);
        TRYC(&e, kvt_cuda_memcpy(darena, init, ss.dtotal, NULL), "destination upload");
        TRYC(&e, kvt_cuda_memset(dstage, 0xEE, stage_total ? stage_total : 256, NULL),
            "staging poison");
        m.a = ss.dtotal;
        m.b = stage_total;
        TRYC(&e, kvt_cuda_ipc_export(darena, &m.h1), "ipc_export(destination)");
        TRYC(&e, kvt_cuda_ipc_export(dstage, &m.h2), "ipc_export(staging)");
        if (send_msg(fd, MSG_HANDLES, e.st, e.text, &m))
            return 1;

        if (e.st == KVW_OK) {
            /* Direct. */
            if (recv_msg(fd, MSG_DIRECT_DONE, &m))
                return 1;
            if (m.status != KVW_OK)
                fail(&e, m.status, "prefill: %s", m.text);
            TRYC(&e, kvt_cuda_memcpy(img, darena, ss.dtotal, NULL), "destination readback");
            char cmsg[320];
            if (e.st == KVW_OK) {
                if (check_image(&ss, img, exp, "fused kernel", cmsg, sizeof(cmsg)) == 0)
                    row->direct = "PASS";
                else
                    fail(&e, KVW_ERR_INTERNAL, "%s", cmsg);
            }
            if (direct_img)
                memcpy(direct_img, img, ss.dtotal);
            err_t e2 = {0};
            TRYC(&e2, kvt_cuda_memcpy(darena, init, ss.dtotal, NULL), "destination reset");
            if (send_msg(fd, MSG_RESET_DONE, e2.st, e2.text, &m))
                return 1;

            /* Staged. */
            if (recv_msg(fd, MSG_STAGED_DONE, &m))
                return 1;
            err_t es = {0};
            if (m.status != KVW_OK)
                fail(&es, m.status, "prefill: %s", m.text);
            if (e2.st != KVW_OK)
                es = e2;
            for (uint32_t d = 0; d < ss.D.n && es.st == KVW_OK; d++)
                for (uint32_t s = 0; s < ss.S.n && es.st == KVW_OK; s++) {
                    uint32_t i = d * ss.S.n + s;
                    kvw_cuda_plan_h cp = NULL;
                    TRY(&es, kvw_cuda_plan_upload(plans[i], KVW_CUDA_SCATTER, &cp),
                        "upload (scatter)");
                    uint64_t n = kvw_cuda_plan_bytes(cp);
                    uint8_t *got = malloc(n + 1), *want = malloc(n + 1);
                    if (es.st == KVW_OK && (!got || !want))
                        fail(&es, KVW_ERR_NO_MEMORY, "out of memory");
                    TRYC(&es, kvt_cuda_memcpy(got, dstage + stage_off[i], n, NULL),
                        "staging readback");
                    TRY(&es, gc_expand_gather(plans[i], &ss.S.r[s], want), "CPU gather");
                    if (es.st == KVW_OK && memcmp(got, want, n) != 0) {
                        uint64_t k = 0;
                        while (got[k] == want[k])
                            k++;
                        fail(&es, KVW_ERR_INTERNAL, "staging of pair src %u -> dst %u differs "
                             "from the kvw_plan_expand order at byte %llu of %llu", s, d,
                             (unsigned long long)k, (unsigned long long)n);
                    }
                    free(got);
                    free(want);
                    TRY(&es, kvw_cuda_plan_scatter(cp, dstage + stage_off[i], n, stream),
                        "kvw_cuda_plan_scatter");
                    TRYC(&es, kvt_cuda_stream_sync(stream), "synchronise after scatter");
                    kvw_cuda_plan_destroy(cp);
                }
            TRYC(&es, kvt_cuda_memcpy(img, darena, ss.dtotal, NULL), "destination readback");
            if (es.st == KVW_OK) {
                if (check_image(&ss, img, exp, "gather+scatter", cmsg, sizeof(cmsg)))
                    fail(&es, KVW_ERR_INTERNAL, "%s", cmsg);
                else if (strcmp(row->direct, "PASS") == 0 &&
                         memcmp(img, direct_img, ss.dtotal) != 0)
                    fail(&es, KVW_ERR_INTERNAL, "gather+scatter differs from the direct copy");
                else
                    row->staged = "PASS";
            }
            if (es.st != KVW_OK)
                fail(&e, es.st, "%s", es.text);
        }
        if (send_msg(fd, MSG_CASE_DONE, KVW_OK, NULL, &m))
            return 1;

        for (uint32_t i = 0; plans && i < npairs; i++)
            kvw_plan_destroy(plans[i]);
        for (uint32_t s = 0; hs && s < ss.S.n; s++)
            kvw_rank_destroy(hs[s]);
        for (uint32_t d = 0; hd && d < ss.D.n; d++)
            kvw_rank_destroy(hd[d]);
        free(plans);
        free(hs);
        free(hd);
        free(stage_off);
        free(init);
        free(img);
        free(direct_img);
        if (darena)
            kvt_cuda_free(darena);
        if (dstage)
            kvt_cuda_free(dstage);
        for (uint32_t d = 0; exp && d < ss.D.n; d++)
            kvt_copy_free(&exp[d]);
        free(exp);
        state_free(&ss);
        if (e.st != KVW_OK) {
            fprintf(stderr, "decode [%s]: %s\n", c->name, e.text);
            rc = 1;
        }
    }
    kvt_cuda_stream_destroy(stream);
    *nrows_p = nrows;
    return rc;
}

/* ---------------------------------------------------------------- parent */

/* Runs in a child, so that the parent never initialises CUDA before forking. */
static int probe(int *count_p, char *msg, size_t cap)
{
    int p[2];
    if (pipe(p))
        return -1;
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        close(p[0]);
        char buf[400];
        int count = 0;
        kvw_status_t st = kvw_cuda_available();
        if (st == KVW_OK)
            st = kvw_cuda_device_count(&count);
        snprintf(buf, sizeof(buf), "%d %s", st == KVW_OK ? count : -1,
                 st == KVW_OK ? "" : kvw_last_error());
        ssize_t n = write(p[1], buf, strlen(buf) + 1);
        _exit(n > 0 ? 0 : 1);
    }
    close(p[1]);
    char buf[400] = {0};
    size_t got = 0;
    ssize_t n;
    while (got < sizeof(buf) - 1 && (n = read(p[0], buf + got, sizeof(buf) - 1 - got)) > 0)
        got += (size_t)n;
    close(p[0]);
    waitpid(pid, NULL, 0);
    char *rest = NULL;
    *count_p = (int)strtol(buf, &rest, 10);
    snprintf(msg, cap, "%s", rest && *rest ? rest + 1 : "the probe process failed");
    return 0;
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--case") && i + 1 < argc) {
            case_filter = argv[++i];
        } else {
            fprintf(stderr, "usage: %s [--case SUBSTRING]\n", argv[0]);
            return 2;
        }
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    int count = 0;
    char msg[400];
    if (probe(&count, msg, sizeof(msg)) || count <= 0) {
        printf("skipped: no GPU (%s)\n", count <= 0 ? msg : "probe failed");
        return 77;
    }
    int ddev = count >= 2 ? 1 : 0;
    printf("gpu-check: %d GPU(s); prefill process on GPU 0, decode process on GPU %d%s\n", count,
           ddev, count >= 2 ? "" : " (only one GPU: both processes share it)");

    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) {
        perror("socketpair");
        return 1;
    }
    int out[2];
    if (pipe(out)) {
        perror("pipe");
        return 1;
    }
    pid_t pre = fork();
    if (pre == 0) {
        close(sv[1]);
        close(out[0]);
        close(out[1]);
        _exit(run_prefill(sv[0], 0, ddev));
    }
    pid_t dec = fork();
    if (dec == 0) {
        close(sv[0]);
        close(out[0]);
        row_t rows[64];
        uint32_t nrows = 0;
        int rc = run_decode(sv[1], ddev, rows, &nrows);
        /* The table goes to the parent, which prints it after both children end. */
        FILE *f = fdopen(out[1], "w");
        for (uint32_t i = 0; f && i < nrows; i++)
            fprintf(f, "%-36s %5u -> %-3u %11llu  %-6s %-6s\n", rows[i].name, rows[i].nsrc,
                    rows[i].ndst, (unsigned long long)rows[i].bytes, rows[i].direct,
                    rows[i].staged);
        if (f)
            fclose(f);
        _exit(rc);
    }
    close(sv[0]);
    close(sv[1]);
    close(out[1]);
    char table[16384];
    size_t tl = 0;
    ssize_t n;
    while (tl < sizeof(table) - 1 && (n = read(out[0], table + tl, sizeof(table) - 1 - tl)) > 0)
        tl += (size_t)n;
    table[tl] = '\0';
    close(out[0]);
    int st_pre = 0, st_dec = 0;
    waitpid(pre, &st_pre, 0);
    waitpid(dec, &st_dec, 0);
    int ok = WIFEXITED(st_pre) && WEXITSTATUS(st_pre) == 0 && WIFEXITED(st_dec) &&
             WEXITSTATUS(st_dec) == 0;
    printf("\n%-36s %14s %11s  %-6s %-6s\n", "case", "ranks", "bytes", "fused", "staged");
    fputs(table, stdout);
    if (!ok)
        printf("gpu-check: FAILED (prefill exit %d, decode exit %d)\n",
               WIFEXITED(st_pre) ? WEXITSTATUS(st_pre) : -1,
               WIFEXITED(st_dec) ? WEXITSTATUS(st_dec) : -1);
    else
        printf("gpu-check: all cases passed\n");
    return ok ? 0 : 1;
}
