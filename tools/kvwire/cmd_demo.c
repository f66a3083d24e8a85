/*
 * kvwire demo: one prefill instance and one decode instance as separate processes on
 * this host, exchanging real KV caches with different parallelism; every destination
 * byte (and the guard bytes around every buffer) is checked against the independent
 * reference in the test kit.
 *
 * Both processes derive the same request list and page tables from one seed, so the
 * decode process can rebuild the prefill ranks' bytes and compute what it must hold.
 * Requests run in waves of concurrent rooms; each wave uses disjoint pages.
 */
#include "cmd.h"
#include "testkit.h"
#include "util.h"


#include <kvwire/cuda.h>
#include <kvwire/xfer.h>

#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <stddef.h>
#include <stdbool.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define KVW_ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))
#define KVW_MIN(a, b) ((a) < (b) ? (a) : (b))
#define KVW_MAX(a, b) ((a) > (b) ? (a) : (b))
/* Exit status of a configuration refused before any transfer, with a message naming
 * the reason: distinct from 1 (a run that failed) so that sweeps can tell a clear
 * refusal from a failure. 2 is a usage error. */
#define DEMO_REFUSED 3

typedef struct demo_cfg {
    char model[48];
    uint32_t layers;
    uint32_t ptp, dtp, ppp, dpp;
    char transport[16];
    uint32_t requests, concurrency;
    uint32_t ppage, dpage; /* full-pool page sizes */
    uint32_t swa_page;
    uint32_t max_tokens;
    uint32_t kv_heads; /* 0: the preset's */
    uint64_t seed;
    uint32_t timeout_ms;
    kvw_layout_t playout, dlayout;
    int quiet;
    int metrics; /* --metrics: each context's kvw_ctx_metrics at the end */
    int startup; /* --startup: what starting the contexts cost (demo_startup_*) */
    char role[16];       /* both (default), prefill or decode */
    char bootstrap[128]; /* prefill: where to listen; decode: where to look up */
    bool external_bs;    /* prefill: register at bootstrap (running already), host none */
    char listen_host[64];
    int gpu; /* KV caches in GPU memory: 1 prefill (GPU 0), 2 decode (GPU 1, or 0) */
    char secret[256]; /* shared secret ("" none), from --secret-file or KVW_SECRET_FILE */
    char verify[32];  /* --verify: the decode contexts' KV verification ("" KVW_VERIFY) */
} demo_cfg_t;

typedef struct demo_req {
    uint64_t room;
    uint64_t n, prefix;
    uint32_t nchunks;
    uint64_t bounds[5];
} demo_req_t;

typedef struct demo_pages {
    kvw_side_pages_t side;
    uint32_t *full, *swa;
} demo_pages_t;

/* Per process: the instance's ranks (prefill or decode). */
typedef struct demo_inst {
    uint32_t tp, pp, n;
    kvt_rank_t *ranks;
    uint8_t ***dev; /* per rank, per buffer: guarded device copy (GPU mode) */
    uint32_t full_pages, swa_pages, slots;
} demo_inst_t;

static const uint64_t demo_lengths[] = {1, 63, 64, 65, 127, 128, 129, 200, 513, 1000, 2048};

static void demo_gen(const demo_cfg_t *c, demo_req_t *reqs)
{
    kvt_rng_t rng = {c->seed};
    for (uint32_t i = 0; i < c->requests; i++) {
        demo_req_t *r = &reqs[i];
        memset(r, 0, sizeof(*r));
        r->room = 1000 + i;
        r->n = demo_lengths[i % KVW_ARRAY_SIZE(demo_lengths)];
        if (r->n > c->max_tokens)
            r->n = c->max_tokens;
        /* Every third request reuses a cached decode prefix (not page aligned). */
        r->prefix = (i % 3 == 2 && r->n > 10) ? kvt_rng_below(&rng, r->n - 1) + 1 : 0;
        /* Every fourth long request is chunked in up to three pieces. */
        r->nchunks = (i % 4 == 1 && r->n >= 3) ? 1 + (uint32_t)kvt_rng_below(&rng, 3) : 1;
        r->bounds[0] = 0;
        for (uint32_t k = 1; k < r->nchunks; k++)
            r->bounds[k] = r->n * k / r->nchunks;
        r->bounds[r->nchunks] = r->n;
    }
}

/*
 * Page lists for one wave on one instance: a random permutation of each pool, sliced
 * so that concurrent rooms never share a page. Returns 0 or -1 (pool too small).
 */
static int demo_assign(const demo_cfg_t *c, const kvt_model_t *m, const demo_inst_t *inst,
                       uint32_t ps, const demo_req_t *reqs, uint32_t nreq, uint64_t seed,
                       demo_pages_t *out)
{
    kvt_rng_t rng = {seed};
    uint32_t *pf = malloc(sizeof(uint32_t) * inst->full_pages);
    uint32_t *psw = malloc(sizeof(uint32_t) * KVW_MAX(inst->swa_pages, 1));
    if (!pf || !psw)
        return -1;
    kvt_pages_random(&rng, inst->full_pages, inst->full_pages, pf);
    if (inst->swa_pages)
        kvt_pages_random(&rng, inst->swa_pages, inst->swa_pages, psw);
    uint32_t uf = 0, us = 0;
    uint64_t window = cli_swa_window(m);
    int rc = 0;
    for (uint32_t i = 0; i < nreq && rc == 0; i++) {
        const demo_req_t *r = &reqs[i];
        demo_pages_t *p = &out[i];
        memset(p, 0, sizeof(*p));
        uint32_t nf = cli_pages_needed(0, r->n, ps);
        uint64_t ws = window && r->n > window ? r->n - window : 0;
        uint64_t swb = ws / c->swa_page * c->swa_page;
        uint32_t ns = window ? cli_pages_needed(swb, r->n, c->swa_page) : 0;
        if (uf + nf > inst->full_pages || us + ns > inst->swa_pages) {
            rc = -1;
            break;
        }
        p->full = malloc(sizeof(uint32_t) * (nf + 1));
        p->swa = malloc(sizeof(uint32_t) * (ns + 1));
        memcpy(p->full, pf + uf, sizeof(uint32_t) * nf);
        memcpy(p->swa, psw + us, sizeof(uint32_t) * ns);
        uf += nf, us += ns;
        p->side.full = (kvw_pages_t){KVW_PAGES_FIELDS_ALL, p->full, nf, 0};
        p->side.swa = (kvw_pages_t){KVW_PAGES_FIELDS_ALL, p->swa, ns, swb};
        p->side.field_mask = KVW_SIDE_PAGES_FIELDS_ALL;
        p->side.state_slot = inst->slots ? (int64_t)(i % inst->slots) : -1;
    }
    (void)c;
    free(pf);
    free(psw);
    return rc;
}

static void demo_pages_free(demo_pages_t *p, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        free(p[i].full);
        free(p[i].swa);
    }
}

/*
 * Builds the instance's ranks. describe_only: nothing is allocated, every rank is only
 * described to the library (kvw_rank_create validates it), which is how the driver
 * refuses a configuration before starting any process. Returns 0, DEMO_REFUSED when the
 * library refuses a rank's description, or 1.
 */
static int demo_build(const demo_cfg_t *c, const kvt_model_t *m, bool prefill, demo_inst_t *inst,
                      uint64_t fill_seed, bool describe_only)
{
    inst->tp = prefill ? c->ptp : c->dtp;
    inst->pp = prefill ? c->ppp : c->dpp;
    inst->n = inst->tp * inst->pp;
    uint32_t ps = prefill ? c->ppage : c->dpage;
    uint64_t window = cli_swa_window(m);
    inst->full_pages = c->concurrency * (cli_pages_needed(0, c->max_tokens, ps) + 1) + 7;
    inst->swa_pages =
        window ? c->concurrency * (cli_pages_needed(0, window, c->swa_page) + 2) + 3 : 0;
    inst->slots = c->concurrency;
    inst->ranks = calloc(inst->n, sizeof(kvt_rank_t));
    for (uint32_t p = 0; p < inst->pp; p++)
        for (uint32_t t = 0; t < inst->tp; t++) {
            kvt_rank_spec_t s = {.model = m, .layout = prefill ? c->playout : c->dlayout,
                                 .page_size = {ps, c->swa_page},
                                 .num_pages = {inst->full_pages, KVW_MAX(inst->swa_pages, 1)},
                                 .num_slots = inst->slots, .describe_only = describe_only};
            s.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = inst->tp,
                                     .tp_rank = t, .pp_size = inst->pp,
                                     .pp_rank = p, .dp_size = 1, .dp_rank = 0};
            kvt_pp_range(m->m.num_layers, inst->pp, NULL, p, &s.par.layer_begin, &s.par.layer_end);
            kvt_rank_t *r = &inst->ranks[p * inst->tp + t];
            kvw_status_t st = kvt_rank_describe(&s, r);
            if (st != KVW_OK) {
                fprintf(stderr, "demo: cannot lay out %s rank tp%u/pp%u: %s\n",
                        prefill ? "prefill" : "decode", t, p, kvw_status_string(st));
                return 1;
            }
            st = kvt_rank_open(r);
            if (st != KVW_OK) {
                fprintf(stderr, "demo: %s rank tp%u/pp%u refused: %s\n",
                        prefill ? "prefill" : "decode", t, p, kvw_last_error());
                return st == KVW_ERR_NO_MEMORY ? 1 : DEMO_REFUSED;
            }
            if (!describe_only)
                kvt_rank_fill(r, fill_seed + p * 1000 + t);
        }
    return 0;
}

/*
 * GPU mode: every buffer (with its guard bytes) gets a device copy, and the ranks are
 * described again with the device addresses. The host copies stay for the reference and
 * for checking: demo_gpu_pull brings the device bytes (guards included) back.
 */
static int demo_gpu_attach(demo_inst_t *inst, int device)
{
    char msg[512];
    if (kvt_gpu_attach(inst->ranks, inst->n, device, &inst->dev, msg, sizeof(msg)) == 0)
        return 0;
    fprintf(stderr, "demo: GPU %d: %s\n", device, msg);
    return -1;
}

static int demo_gpu_pull(demo_inst_t *inst)
{
    char msg[512];
    if (kvt_gpu_pull(inst->ranks, inst->n, inst->dev, msg, sizeof(msg)) == 0)
        return 0;
    fprintf(stderr, "demo: copying GPU buffers back: %s\n", msg);
    return -1;
}

static void demo_free_inst(demo_inst_t *inst)
{
    kvt_gpu_free(inst->ranks, inst->n, inst->dev);
    for (uint32_t i = 0; i < inst->n; i++)
        kvt_rank_free(&inst->ranks[i]);
    free(inst->ranks);
}

static int demo_gpu_device(bool prefill)
{
    int n = 0;
    if (kvw_cuda_device_count(&n) != KVW_OK || n < 1)
        return -1;
    return prefill || n < 2 ? 0 : 1;
}

/* The contexts of one instance; NULL on failure, with *refused set when the failure is
 * a refusal of the configuration (the peer's handshake or the bootstrap's geometry), which
 * the demo reports with DEMO_REFUSED. */
static kvw_ctx_h *demo_contexts(const demo_cfg_t *c, demo_inst_t *inst, bool prefill,
                                const char *bs_addr, char *bs_out, size_t bs_cap, bool *refused)
{
    kvw_ctx_params_t p = {
        .field_mask = KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK | KVW_CTX_FIELD_TRANSPORT |
                      KVW_CTX_FIELD_BOOTSTRAP | KVW_CTX_FIELD_HOST_BOOTSTRAP |
                      KVW_CTX_FIELD_TIMEOUTS | KVW_CTX_FIELD_PREFILL_SIZE,
        .transport = c->transport,
        .wait_timeout_ms = c->timeout_ms,
        .bootstrap_timeout_ms = c->timeout_ms,
        .prefill_tp = c->ptp,
        .prefill_pp = c->ppp,
        .prefill_dp = 1};
    if (c->listen_host[0]) {
        p.field_mask |= KVW_CTX_FIELD_LISTEN_HOST;
        p.listen_host = c->listen_host;
    }
    if (c->secret[0]) {
        p.field_mask |= KVW_CTX_FIELD_SECRET;
        p.secret = c->secret;
    }
    if (c->verify[0] && !prefill) {
        p.field_mask |= KVW_CTX_FIELD_VERIFY;
        p.verify = c->verify;
    }
    uint32_t i;
    char why[512];
    kvw_status_t st;
    kvw_ctx_h *ctx = cli_contexts(c->quiet ? NULL : "demo", &p, inst->ranks, inst->n, prefill,
                                  prefill && c->external_bs, bs_addr, bs_out, bs_cap, &i, &st,
                                  why, sizeof(why));
    *refused = ctx == NULL && (st == KVW_ERR_REJECTED || st == KVW_ERR_INCOMPATIBLE ||
                                st == KVW_ERR_AUTH);
    if (ctx == NULL)
        fprintf(stderr, "demo: %s rank %u: %s%s\n", prefill ? "prefill" : "decode", i, why,
                *refused ? " (refused at the handshake: the two instances' configurations or secrets do not match)"
                : prefill && !c->external_bs && strstr(why, "in use")
                    ? " (is an endpoint running there? --external-bootstrap registers at it)"
                    : "");
    return ctx;
}

/*
 * Refuses, before any process starts, a configuration the library would refuse: heads
 * (KV heads, and each linear-attention state group) that do not split over a side's TP
 * size, then anything else kvw_rank_create refuses in either side's rank descriptions.
 * Returns 0, DEMO_REFUSED with a message naming the reason, or 1.
 */
static int demo_validate(const demo_cfg_t *c, const kvt_model_t *m)
{
    const char *side[2] = {"prefill", "decode"};
    const uint32_t tp[2] = {c->ptp, c->dtp};
    /* As in kvw_rank_create: KV heads matter only where attention layers are kept. */
    bool attn = false, state = false;
    for (uint32_t l = 0; l < m->m.num_layers; l++) {
        attn |= m->layers[l].kind == KVW_LAYER_FULL || m->layers[l].kind == KVW_LAYER_SWA;
        state |= m->layers[l].kind == KVW_LAYER_STATE;
    }
    for (int k = 0; k < 2; k++) {
        uint32_t f, n;
        if (attn && kvw_topo_heads(tp[k], 0, m->m.num_kv_heads, &f, &n) != KVW_OK) {
            fprintf(stderr, "demo: %s TP %u: %s\n", side[k], tp[k], kvw_last_error());
            return DEMO_REFUSED;
        }
        /* Each group of a state tensor is sharded over TP on its own (DESIGN.md, state
         * layers), so each must split: qwen3-next's groups of 16 and 32 heads do not
         * split over TP 3 or 6. */
        for (uint32_t b = 0; state && b < m->num_state_bufs; b++)
            for (uint32_t g = 0; g < m->state[b].num_groups; g++) {
                uint32_t h = m->state[b].groups[g].total_heads;
                if (h % tp[k] != 0 && tp[k] % h != 0) {
                    fprintf(stderr, "demo: %s TP %u: linear-attention state %u group %u: %u "
                            "heads cannot be split over TP %u (need heads %% TP == 0 or TP "
                            "%% heads == 0)\n", side[k], tp[k], b, g, h, tp[k]);
                    return DEMO_REFUSED;
                }
            }
    }
    for (int k = 0; k < 2; k++) {
        demo_inst_t inst = {0};
        int rc = demo_build(c, m, k == 0, &inst, 0, true);
        demo_free_inst(&inst);
        if (rc)
            return rc;
    }
    return 0;
}

/* ------------------------------------------------------------ start-up cost */

/* What this process holds, for --startup: open fds, threads, and what its open TCP
 * connections carried (TCP_INFO: bytes and data segments, both directions). Over
 * loopback a frame written at once is one segment, so the segments count the control
 * frames (and, over tcp, the data connections' frames); bootstrap lookups, whose
 * connections are closed by then, and the shm transport's Unix sockets are not in it. */
typedef struct demo_usage {
    uint64_t t_ns, tcp_bytes, tcp_segs;
    uint32_t fds, threads, tcp_conns;
} demo_usage_t;

static void demo_usage_now(demo_usage_t *u)
{
    *u = (demo_usage_t){.t_ns = kvt_now_ns()};
    char line[256];
    FILE *f = fopen("/proc/self/status", "r");
    while (f && fgets(line, sizeof(line), f))
        if (sscanf(line, "Threads: %u", &u->threads) == 1)
            break;
    if (f)
        fclose(f);
    DIR *d = opendir("/proc/self/fd");
    int self = d ? dirfd(d) : -1;
    for (struct dirent *e; d && (e = readdir(d)) != NULL;) {
        if (e->d_name[0] == '.')
            continue;
        int fd = atoi(e->d_name);
        if (fd == self)
            continue;
        u->fds++;
        struct tcp_info ti;
        socklen_t tl = sizeof(ti);
        memset(&ti, 0, sizeof(ti));
        if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &tl) == 0 &&
            tl >= offsetof(struct tcp_info, tcpi_data_segs_out) + sizeof(ti.tcpi_data_segs_out) &&
            ti.tcpi_state == 1 /* TCP_ESTABLISHED */) {
            u->tcp_conns++;
            u->tcp_bytes += ti.tcpi_bytes_acked + ti.tcpi_bytes_received;
            u->tcp_segs += (uint64_t)ti.tcpi_data_segs_in + ti.tcpi_data_segs_out;
        }
    }
    if (d)
        closedir(d);
}

/* One line: how long this side's contexts took to start and what they hold, with the
 * cost per rank pair (`pairs`: the control connections they opened or accepted). */
static void demo_startup_print(const char *side, uint32_t ranks, uint32_t pairs,
                               const demo_usage_t *a, const demo_usage_t *b)
{
    double s = (double)(b->t_ns - a->t_ns) / 1e9;
    if (pairs == 0) {
        printf("demo: start-up: %s: %u ranks, %.3f s; %u tcp connections carried %.1f KiB in "
               "%llu segments; %u fds, %u threads\n", side, ranks, s, b->tcp_conns,
               (double)b->tcp_bytes / 1024.0, (unsigned long long)b->tcp_segs, b->fds,
               b->threads);
    } else {
        printf("demo: start-up: %s: %u ranks, %u rank pairs, %.3f s (%.2f ms per pair); %u "
               "tcp connections carried %.1f KiB in %llu segments (%.0f B, %.1f segments per "
               "pair); %u fds, %u threads\n", side, ranks, pairs, s, s * 1e3 / pairs,
               b->tcp_conns, (double)b->tcp_bytes / 1024.0, (unsigned long long)b->tcp_segs,
               (double)b->tcp_bytes / pairs, (double)b->tcp_segs / pairs, b->fds, b->threads);
    }
    fflush(stdout);
}

/* ------------------------------------------------------------ prefill process */

static int demo_prefill(const demo_cfg_t *c, const kvt_model_t *m, int bs_pipe, int go_fd)
{
    demo_inst_t inst = {0};
    if (demo_build(c, m, true, &inst, c->seed * 7 + 1, false))
        return 1;
    if ((c->gpu & 1) && demo_gpu_attach(&inst, demo_gpu_device(true)))
        return 1;
    char bs[160];
    bool refused;
    demo_usage_t u0, u1;
    demo_usage_now(&u0);
    kvw_ctx_h *ctx = demo_contexts(c, &inst, true, c->bootstrap[0] ? c->bootstrap : "127.0.0.1:0",
                                   bs, sizeof(bs), &refused);
    if (ctx && c->startup) {
        demo_usage_now(&u1);
        demo_startup_print("prefill, up and registered at the bootstrap", inst.n, 0, &u0, &u1);
    }
    if (ctx == NULL) {
        demo_free_inst(&inst);
        return refused ? DEMO_REFUSED : 1;
    }
    if (bs_pipe < 0) {
        printf("demo: prefill instance up (%u ranks), %s %s; waiting for the decode instance "
               "(rooms time out after %u ms)\n", inst.n,
               c->external_bs ? "registered at the bootstrap endpoint" : "bootstrap endpoint at",
               bs, c->timeout_ms);
        fflush(stdout);
    } else {
        if (write(bs_pipe, bs, strlen(bs) + 1) < 0)
            return 1;
        close(bs_pipe);
    }
    /* Requests start once the decode instance is up, as in a serving deployment where
     * decode instances join before traffic is routed to them. Alone, the prefill side
     * relies on its rooms waiting for the decode side's half. */
    char go;
    if (go_fd >= 0 && read(go_fd, &go, 1) != 1) {
        fprintf(stderr, "demo: the decode process never came up\n");
        return 1;
    }
    if (go_fd >= 0 && c->startup) {
        /* From this process's start-up to every decode rank registered here. */
        demo_usage_now(&u1);
        demo_startup_print("prefill, every decode rank registered", inst.n,
                           inst.n * c->dtp * c->dpp, &u0, &u1);
    }
    demo_req_t *reqs = calloc(c->requests, sizeof(*reqs));
    demo_gen(c, reqs);
    int rc = 0;
    for (uint32_t w0 = 0; w0 < c->requests && rc == 0; w0 += c->concurrency) {
        uint32_t nw = KVW_MIN(c->concurrency, c->requests - w0);
        demo_pages_t *pg = calloc(nw, sizeof(*pg));
        if (demo_assign(c, m, &inst, c->ppage, reqs + w0, nw, c->seed * 31 + w0, pg)) {
            fprintf(stderr, "demo: prefill pools too small\n");
            rc = 1;
        }
        kvw_sender_h *snd = calloc((size_t)nw * inst.n, sizeof(*snd));
        for (uint32_t i = 0; i < nw && rc == 0; i++)
            for (uint32_t k = 0; k < inst.n; k++)
                if (kvw_sender_create(ctx[k], reqs[w0 + i].room, &snd[i * inst.n + k]) != KVW_OK) {
                    fprintf(stderr, "demo: sender: %s\n", kvw_last_error());
                    rc = 1;
                }
        /* Chunks go out as "prefill proceeds": chunk k of every room, then k + 1. */
        for (uint32_t ch = 0; ch < 3 && rc == 0; ch++)
            for (uint32_t i = 0; i < nw; i++) {
                const demo_req_t *r = &reqs[w0 + i];
                if (ch >= r->nchunks)
                    continue;
                kvw_send_chunk_t sc = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = r->n,
                                       .chunk_begin = r->bounds[ch],
                                       .chunk_end = r->bounds[ch + 1],
                                       .last_chunk = ch + 1 == r->nchunks, .pages = pg[i].side};
                for (uint32_t k = 0; k < inst.n; k++)
                    if (kvw_sender_send(snd[i * inst.n + k], &sc) != KVW_OK) {
                        fprintf(stderr, "demo: send room %llu: %s\n",
                                (unsigned long long)r->room, kvw_last_error());
                        rc = 1;
                    }
            }
        uint64_t t0 = kvt_now_ns();
        uint32_t next_s = 5;
        for (uint32_t i = 0; i < nw * inst.n && rc == 0; i++) {
            while (!cli_room_ended(kvw_room_poll(kvw_sender_room(snd[i])))) {
                usleep(200);
                if (!c->quiet && cli_secs_since(t0) >= next_s) {
                    fprintf(stderr, "demo: prefill: waiting for the decode instance: %u of %u "
                            "rooms of requests %u-%u ended on the prefill ranks, %u s (a room "
                            "times out after %u ms)\n", i, nw * inst.n, w0, w0 + nw - 1, next_s,
                            c->timeout_ms);
                    next_s += 5;
                }
            }
            if (kvw_room_poll(kvw_sender_room(snd[i])) != KVW_ROOM_SUCCESS) {
                fprintf(stderr, "demo: prefill room failed: %s\n",
                        kvw_room_failure(kvw_sender_room(snd[i])));
                rc = 1;
            }
        }
        for (uint32_t i = 0; i < nw * inst.n; i++)
            kvw_room_destroy(kvw_sender_room(snd[i]));
        free(snd);
        demo_pages_free(pg, nw);
        free(pg);
    }
    for (uint32_t i = 0; c->metrics && i < inst.n; i++)
        cli_print_metrics(stdout, "prefill", i, ctx[i]);
    /* Stay up until the decode side has verified and left. */
    char b;
    if (bs_pipe >= 0 && read(STDIN_FILENO, &b, 1) < 0) {
    }
    for (uint32_t i = 0; i < inst.n; i++)
        kvw_ctx_destroy(ctx[i]);
    free(ctx);
    free(reqs);
    demo_free_inst(&inst);
    return rc;
}

/* ------------------------------------------------------------ decode process */

typedef struct demo_result {
    uint64_t bytes, ns;
    uint32_t rooms_ok, rooms_failed, rooms_verified;
} demo_result_t;

static int demo_decode(const demo_cfg_t *c, const kvt_model_t *m, const char *bs, int go_fd,
                       demo_result_t *res)
{
    demo_inst_t inst = {0}, src = {0};
    if (demo_build(c, m, false, &inst, c->seed * 13 + 5, false))
        return 1;
    if ((c->gpu & 2) && demo_gpu_attach(&inst, demo_gpu_device(false)))
        return 1;
    /* The prefill ranks' bytes, rebuilt here for the reference. */
    if (demo_build(c, m, true, &src, c->seed * 7 + 1, false))
        return 1;
    bool refused;
    demo_usage_t u0, u1;
    demo_usage_now(&u0);
    kvw_ctx_h *ctx = demo_contexts(c, &inst, false, bs, NULL, 0, &refused);
    if (ctx && c->startup) {
        demo_usage_now(&u1);
        demo_startup_print("decode, registered with every prefill rank", inst.n,
                           inst.n * c->ptp * c->ppp, &u0, &u1);
    }
    if (ctx == NULL) {
        demo_free_inst(&inst);
        demo_free_inst(&src);
        return refused ? DEMO_REFUSED : 1;
    }
    if (go_fd >= 0 && write(go_fd, "g", 1) != 1)
        return 1;
    demo_req_t *reqs = calloc(c->requests, sizeof(*reqs));
    demo_gen(c, reqs);
    int rc = 0;
    for (uint32_t w0 = 0; w0 < c->requests && rc == 0; w0 += c->concurrency) {
        uint32_t nw = KVW_MIN(c->concurrency, c->requests - w0);
        demo_pages_t *pg = calloc(nw, sizeof(*pg)), *spg = calloc(nw, sizeof(*spg));
        if (demo_assign(c, m, &inst, c->dpage, reqs + w0, nw, c->seed * 37 + w0, pg) ||
            demo_assign(c, m, &src, c->ppage, reqs + w0, nw, c->seed * 31 + w0, spg)) {
            fprintf(stderr, "demo: decode pools too small\n");
            rc = 1;
            break;
        }
        kvt_copy_t *expect = calloc(inst.n, sizeof(*expect));
        for (uint32_t k = 0; k < inst.n; k++)
            kvt_copy_make(&inst.ranks[k], &expect[k]);
        kvw_receiver_h *rcv = calloc((size_t)nw * inst.n, sizeof(*rcv));
        uint64_t t0 = kvt_now_ns();
        for (uint32_t i = 0; i < nw && rc == 0; i++)
            for (uint32_t k = 0; k < inst.n; k++) {
                kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL,
                                        .num_tokens = reqs[w0 + i].n,
                                        .prefix_len = reqs[w0 + i].prefix, .pages = pg[i].side};
                if (kvw_receiver_create(ctx[k], reqs[w0 + i].room, 0, &rcv[i * inst.n + k]) != KVW_OK ||
                    kvw_receiver_post(rcv[i * inst.n + k], &post) != KVW_OK) {
                    fprintf(stderr, "demo: receiver room %llu: %s\n",
                            (unsigned long long)reqs[w0 + i].room, kvw_last_error());
                    rc = 1;
                }
            }
        uint32_t next_s = 5;
        for (uint32_t i = 0; i < nw * inst.n && rc == 0; i++) {
            while (!cli_room_ended(kvw_room_poll(kvw_receiver_room(rcv[i])))) {
                usleep(100);
                if (!c->quiet && cli_secs_since(t0) >= next_s) {
                    fprintf(stderr, "demo: decode: waiting for the prefill instance: %u of %u "
                            "rooms of requests %u-%u ended on the decode ranks, %u s (a room "
                            "times out after %u ms)\n", i, nw * inst.n, w0, w0 + nw - 1, next_s,
                            c->timeout_ms);
                    next_s += 5;
                }
            }
            kvw_room_metrics_t mt = {.field_mask = KVW_ROOM_METRICS_FIELDS_ALL};
            kvw_room_metrics(kvw_receiver_room(rcv[i]), &mt);
            res->bytes += mt.bytes;
            if (kvw_room_poll(kvw_receiver_room(rcv[i])) == KVW_ROOM_SUCCESS) {
                res->rooms_ok++;
            } else {
                res->rooms_failed++;
                fprintf(stderr, "demo: room %llu failed on decode rank %u: %s\n",
                        (unsigned long long)reqs[w0 + i / inst.n].room, i % inst.n,
                        kvw_room_failure(kvw_receiver_room(rcv[i])));
                rc = 1;
            }
        }
        res->ns += kvt_now_ns() - t0;
        if (rc == 0 && (c->gpu & 2) && demo_gpu_pull(&inst))
            rc = 1;
        /* Verify: the reference applied to the snapshot must equal the buffers. */
        for (uint32_t k = 0; k < inst.n && rc == 0; k++) {
            kvt_ref_side_t *ss = calloc(src.n, sizeof(*ss));
            for (uint32_t i = 0; i < nw && rc == 0; i++) {
                const demo_req_t *r = &reqs[w0 + i];
                for (uint32_t s = 0; s < src.n; s++) {
                    uint8_t **d = calloc(src.ranks[s].num_bufs, sizeof(uint8_t *));
                    for (uint32_t b = 0; b < src.ranks[s].num_bufs; b++)
                        d[b] = kvt_rank_data(&src.ranks[s], b);
                    ss[s] = kvt_ref_side(&src.ranks[s], &spg[i].side, d);
                }
                kvt_ref_side_t ds = kvt_ref_side(&inst.ranks[k], &pg[i].side, expect[k].data);
                char msg[512];
                for (uint32_t ch = 0; ch < r->nchunks && rc == 0; ch++) {
                    kvw_chunk_t chunk = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = r->n,
                                         .chunk_begin = r->bounds[ch],
                                         .chunk_end = r->bounds[ch + 1], .prefix_len = r->prefix,
                                         .last_chunk = ch + 1 == r->nchunks};
                    if (kvt_ref_transfer(&m->m, ss, src.n, &ds, &chunk, NULL, NULL, msg,
                                         sizeof(msg))) {
                        fprintf(stderr, "demo: reference: %s\n", msg);
                        rc = 1;
                    }
                }
                for (uint32_t s = 0; s < src.n; s++)
                    free((void *)ss[s].data);
            }
            free(ss);
            char msg[512];
            if (rc == 0 && kvt_copy_compare(&inst.ranks[k], &expect[k], "decode buffers", msg,
                                            sizeof(msg))) {
                fprintf(stderr, "demo: decode rank %u: WRONG BYTES: %s\n", k, msg);
                rc = 1;
            }
            if (rc == 0 && kvt_rank_check_guards(&inst.ranks[k], msg, sizeof(msg))) {
                fprintf(stderr, "demo: decode rank %u: guard bytes changed: %s\n", k, msg);
                rc = 1;
            }
        }
        if (rc == 0)
            res->rooms_verified += nw;
        for (uint32_t i = 0; i < nw * inst.n; i++)
            kvw_room_destroy(kvw_receiver_room(rcv[i]));
        free(rcv);
        for (uint32_t k = 0; k < inst.n; k++)
            kvt_copy_free(&expect[k]);
        free(expect);
        demo_pages_free(pg, nw);
        demo_pages_free(spg, nw);
        free(pg);
        free(spg);
    }
    for (uint32_t i = 0; c->metrics && i < inst.n; i++)
        cli_print_metrics(stdout, "decode", i, ctx[i]);
    for (uint32_t i = 0; i < inst.n; i++)
        kvw_ctx_destroy(ctx[i]);
    free(ctx);
    free(reqs);
    demo_free_inst(&inst);
    demo_free_inst(&src);
    return rc;
}

/* ------------------------------------------------------------ driver */

int kvw_cli_read_secret(const char *who, const char *path, char *out, size_t cap)
{
    struct stat sb;
    FILE *f = fopen(path, "r");
    if (f == NULL || fstat(fileno(f), &sb) != 0) {
        fprintf(stderr, "%s: cannot read the secret file %s: %s\n", who, path, strerror(errno));
        if (f)
            fclose(f);
        return -1;
    }
    if (sb.st_mode & (S_IRWXG | S_IRWXO)) {
        fprintf(stderr, "%s: the secret file %s is accessible by other users (mode %03o); "
                "chmod 600 it\n", who, path, (unsigned)(sb.st_mode & 0777));
        fclose(f);
        return -1;
    }
    char line[512];
    if (fgets(line, sizeof(line), f) == NULL)
        line[0] = 0;
    fclose(f);
    line[strcspn(line, "\r\n")] = 0;
    if (!line[0] || strlen(line) >= cap) {
        fprintf(stderr, "%s: the secret file %s must hold one line of 1 to %zu bytes\n", who, path,
                cap - 1);
        return -1;
    }
    snprintf(out, cap, "%s", line);
    return 0;
}

/* Ranges of the demo's options (the usage and the checks use the same numbers). */
#define DEMO_MAX_TP 256u
#define DEMO_MAX_REQUESTS 100000u
#define DEMO_MAX_CONCURRENCY 1024u
#define DEMO_MAX_PAGE 65536u
#define DEMO_MAX_TOKENS (1u << 20)
#define DEMO_MAX_HEADS 4096u
#define DEMO_MAX_TIMEOUT_MS 86400000u

static void demo_usage(FILE *f)
{
    char built[128] = "", models[256] = "";
    size_t len = 0;
    for (const char *const *n = kvw_transport_names(); *n && len < sizeof(built); n++)
        len += (size_t)snprintf(built + len, sizeof(built) - len, "%s%s", len ? ", " : "", *n);
    len = 0;
    for (const char *const *n = kvt_model_names(); *n && len < sizeof(models); n++)
        len += (size_t)snprintf(models + len, sizeof(models) - len, "%s%s", len ? " " : "", *n);
    fprintf(f,
            "usage: kvwire demo [options]\n"
            "  --model NAME          model preset (default gpt-oss-120b), one of:\n"
            "                        %s\n"
            "  --layers N            keep the first N layers, 0 to the model's count\n"
            "                        (default 12; 0 = all)\n"
            "  --prefill-tp N        prefill TP size, 1 to %u (default 1)\n"
            "  --decode-tp N         decode TP size, 1 to %u (default 4)\n"
            "  --prefill-pp N        prefill PP size, 1 to the layers kept (default 1)\n"
            "  --decode-pp N         decode PP size, 1 to the layers kept (default 1; more\n"
            "                        stages than layers: refused, exit 3)\n"
            "  --transport NAME      shm (default), tcp or ucx; fault:NAME wraps one of them\n"
            "                        with the fault injection KVW_FAULTS describes (--gpu\n"
            "                        alone: cuda_ipc). Built into this library: %s\n"
            "  --requests N          requests, 1 to %u (default 24)\n"
            "  --concurrency N       rooms in flight per wave, 1 to %u (default 8)\n"
            "  --page-size N         prefill full-pool page size, 1 to %u (default 64)\n"
            "  --decode-page-size N  decode full-pool page size, 1 to %u (default: same)\n"
            "  --max-tokens N        longest request, 1 to %u (default 2048)\n"
            "  --kv-heads N          override the preset's KV head count, 1 to %u (e.g. 6\n"
            "                        for TP 3)\n"
            "  --prefill-layout L    prefill KV layout: NHD (default) or HND (any case)\n"
            "  --decode-layout L     decode KV layout: NHD (default) or HND (any case)\n"
            "  --seed N              seed of requests, pages and bytes (default 1)\n"
            "  --timeout-ms N        per-room timeout and the wait for peers, 1 to %u\n"
            "                        (default 30000)\n"
            "  --gpu[=SIDE]          KV caches in GPU memory (prefill GPU 0, decode GPU 1);\n"
            "                        SIDE: both (default), prefill or decode. Over cuda_ipc\n"
            "                        (the default then) the fused kernel writes the decode\n"
            "                        GPU; over tcp, shm or ucx windows are gathered and\n"
            "                        scattered on the GPUs through host staging\n"
            "  --role R              both (default), or prefill / decode alone (other hosts)\n"
            "  --bootstrap H:P       prefill: the bootstrap endpoint to host (port 0: any);\n"
            "                        decode: the endpoint to look the prefill ranks up at\n"
            "  --external-bootstrap  prefill: --bootstrap names an endpoint that is running\n"
            "                        already (kvwire bootstrap): register there, host none\n"
            "  --listen-host H       address the control and data listeners bind\n"
            "  --secret-file PATH    shared secret (first line; the file must be mode 600)\n"
            "                        authenticating every session; also KVW_SECRET_FILE\n"
            "  --quiet               no progress lines\n"
            "The table counts rooms once per decode rank: 24 requests to 4 decode ranks are\n"
            "96 rooms.\n"
            "  --metrics             print each context's metrics (kvw_ctx_metrics) at the end\n"
            "  --startup             print what starting each side's contexts cost: time, per\n"
            "                        rank pair, socket I/O, fds and threads (docs/SCALING.md)\n"
            "  --verify MODE         decode ranks verify the KV end to end: off, every or\n"
            "                        sample:F (default: KVW_VERIFY, else off); a mismatch\n"
            "                        fails the room, naming layer, component, head, tokens\n"
            "Exit status: 0 only if every destination byte and guard byte verified; 1 a\n"
            "failed run; 2 a usage error; 3 a configuration refused before any transfer,\n"
            "by the demo's own checks or at the handshake (configurations or secrets that\n"
            "do not match); the message names the reason, e.g. heads that do not split\n"
            "over a TP size.\n",
            models, DEMO_MAX_TP, DEMO_MAX_TP, built, DEMO_MAX_REQUESTS, DEMO_MAX_CONCURRENCY,
            DEMO_MAX_PAGE, DEMO_MAX_PAGE, DEMO_MAX_TOKENS, DEMO_MAX_HEADS, DEMO_MAX_TIMEOUT_MS);
}

/* How a child process ended, for the failure line: a signal is named, so that a crash
 * is not mistaken for a failed run. */
static const char *demo_wait_str(int ws, char *buf, size_t cap)
{
    if (WIFEXITED(ws))
        snprintf(buf, cap, "exit %d", WEXITSTATUS(ws));
    else if (WIFSIGNALED(ws))
        snprintf(buf, cap, "killed by signal %d (%s)", WTERMSIG(ws), strsignal(WTERMSIG(ws)));
    else
        snprintf(buf, cap, "wait status 0x%x", (unsigned)ws);
    return buf;
}

static int cmd_demo(int argc, char **argv)
{
    demo_cfg_t c = {.model = "gpt-oss-120b", .layers = 12, .ptp = 1, .dtp = 4, .ppp = 1,
                    .dpp = 1, .transport = "shm", .requests = 24, .concurrency = 8,
                    .ppage = 64, .dpage = 0, .swa_page = 64, .max_tokens = 2048, .seed = 1,
                    .timeout_ms = 30000, .playout = KVW_LAYOUT_NHD, .dlayout = KVW_LAYOUT_NHD};
    static const struct option opts[] = {
        {"model", 1, 0, 'm'},         {"layers", 1, 0, 'L'},      {"prefill-tp", 1, 0, 'p'},
        {"decode-tp", 1, 0, 'd'},     {"prefill-pp", 1, 0, 'P'},  {"decode-pp", 1, 0, 'D'},
        {"transport", 1, 0, 't'},     {"requests", 1, 0, 'r'},    {"concurrency", 1, 0, 'c'},
        {"page-size", 1, 0, 's'},     {"decode-page-size", 1, 0, 'S'},
        {"max-tokens", 1, 0, 'x'},    {"seed", 1, 0, 'e'},        {"timeout-ms", 1, 0, 'T'},
        {"decode-layout", 1, 0, 'l'}, {"prefill-layout", 1, 0, 'y'}, {"kv-heads", 1, 0, 'H'},
        {"gpu", 2, 0, 'G'},           {"role", 1, 0, 'R'},          {"bootstrap", 1, 0, 'B'},
        {"external-bootstrap", 0, 0, 'E'}, {"listen-host", 1, 0, 'I'}, {"quiet", 0, 0, 'q'},
        {"help", 0, 0, 'h'},          {"secret-file", 1, 0, 'K'},   {"metrics", 0, 0, 'M'},
        {"startup", 0, 0, 'U'},       {"verify", 1, 0, 'V'},        {0, 0, 0, 0}};
    static const char *const layouts[] = {"nhd", "hnd", NULL};
    static const char *const roles[] = {"both", "prefill", "decode", NULL};
    static const char *const gpu_sides[] = {"both", "prefill", "decode", NULL};
    int o, bad = 0, idx = 0;
    bool tl_set = false;
    optind = 1;
    while (!bad && (o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (o) {
        case 'm': snprintf(c.model, sizeof(c.model), "%s", optarg); break;
        case 'L': bad = cli_opt_u32("demo", "--layers", optarg, 0, KVT_MAX_LAYERS, &c.layers); break;
        case 'p': bad = cli_opt_u32("demo", "--prefill-tp", optarg, 1, DEMO_MAX_TP, &c.ptp); break;
        case 'd': bad = cli_opt_u32("demo", "--decode-tp", optarg, 1, DEMO_MAX_TP, &c.dtp); break;
        case 'P': bad = cli_opt_u32("demo", "--prefill-pp", optarg, 1, KVT_MAX_LAYERS, &c.ppp); break;
        case 'D': bad = cli_opt_u32("demo", "--decode-pp", optarg, 1, KVT_MAX_LAYERS, &c.dpp); break;
        case 't': {
            /* The transports this library offers (built in, or a module that loaded),
             * cuda_ipc, or fault:NAME (the fault wrapper, kvwire-faults only: the library
             * judges it). */
            bool known = !strcmp(optarg, "cuda_ipc") || !strncmp(optarg, "fault:", 6);
            char list[128] = "";
            size_t len = 0;
            for (const char *const *n = kvw_transport_names(); *n; n++) {
                known |= !strcmp(optarg, *n);
                if (len < sizeof(list))
                    len += (size_t)snprintf(list + len, sizeof(list) - len, "%s, ", *n);
            }
            if (!known || strlen(optarg) >= sizeof(c.transport)) {
                fprintf(stderr, "demo: --transport takes one of the transports of this "
                        "library, %scuda_ipc (with --gpu) or fault:NAME, not '%s' (kvwire "
                        "info says why one is missing)\n", list, optarg);
                bad = 1;
            }
            snprintf(c.transport, sizeof(c.transport), "%s", optarg);
            tl_set = true;
            break;
        }
        case 'r':
            bad = cli_opt_u32("demo", "--requests", optarg, 1, DEMO_MAX_REQUESTS, &c.requests);
            break;
        case 'c':
            bad = cli_opt_u32("demo", "--concurrency", optarg, 1, DEMO_MAX_CONCURRENCY,
                              &c.concurrency);
            break;
        case 's': bad = cli_opt_u32("demo", "--page-size", optarg, 1, DEMO_MAX_PAGE, &c.ppage); break;
        case 'S':
            bad = cli_opt_u32("demo", "--decode-page-size", optarg, 1, DEMO_MAX_PAGE, &c.dpage);
            break;
        case 'x':
            bad = cli_opt_u32("demo", "--max-tokens", optarg, 1, DEMO_MAX_TOKENS, &c.max_tokens);
            break;
        case 'e': bad = cli_opt_u64("demo", "--seed", optarg, 0, UINT64_MAX, &c.seed); break;
        case 'T':
            bad = cli_opt_u32("demo", "--timeout-ms", optarg, 1, DEMO_MAX_TIMEOUT_MS,
                              &c.timeout_ms);
            break;
        case 'l':
        case 'y':
            /* Anything but the two layouts is a usage error, not a silent NHD. */
            bad = cli_opt_choice("demo", o == 'y' ? "--prefill-layout" : "--decode-layout",
                                 optarg, layouts, &idx);
            if (!bad)
                *(o == 'y' ? &c.playout : &c.dlayout) = idx ? KVW_LAYOUT_HND : KVW_LAYOUT_NHD;
            break;
        case 'q': c.quiet = 1; break;
        case 'M': c.metrics = 1; break;
        case 'U': c.startup = 1; break;
        case 'H': bad = cli_opt_u32("demo", "--kv-heads", optarg, 1, DEMO_MAX_HEADS, &c.kv_heads); break;
        case 'G':
            idx = 0;
            bad = optarg && cli_opt_choice("demo", "--gpu=", optarg, gpu_sides, &idx);
            c.gpu = idx == 0 ? 3 : idx == 1 ? 1 : 2;
            break;
        case 'R':
            bad = cli_opt_choice("demo", "--role", optarg, roles, &idx);
            if (!bad)
                snprintf(c.role, sizeof(c.role), "%s", roles[idx]);
            break;
        case 'B':
            bad = cli_opt_hostport("demo", "--bootstrap", optarg, 0);
            snprintf(c.bootstrap, sizeof(c.bootstrap), "%s", optarg);
            break;
        case 'E': c.external_bs = true; break;
        case 'I':
            if (!optarg[0] || strlen(optarg) >= sizeof(c.listen_host)) {
                fprintf(stderr, "demo: --listen-host takes a host name or address of 1 to %zu "
                        "characters, not '%s'\n", sizeof(c.listen_host) - 1, optarg);
                bad = 1;
            }
            snprintf(c.listen_host, sizeof(c.listen_host), "%s", optarg);
            break;
        case 'K':
            if (kvw_cli_read_secret("demo", optarg, c.secret, sizeof(c.secret)))
                return 2;
            break;
        case 'V': {
            /* The shape here (a usage error); the library checks the fraction's digits. */
            char *end = NULL;
            double f = strncmp(optarg, "sample:", 7) == 0 ? strtod(optarg + 7, &end) : -1;
            bool ok = !strcmp(optarg, "off") || !strcmp(optarg, "every") ||
                      (end && end != optarg + 7 && *end == '\0' && f >= 0 && f <= 1);
            if (!ok || strlen(optarg) >= sizeof(c.verify)) {
                fprintf(stderr, "demo: --verify takes off, every or sample:F with F from 0 to "
                        "1, not '%s'\n", optarg);
                bad = 1;
            }
            snprintf(c.verify, sizeof(c.verify), "%s", optarg);
            break;
        }
        case 'h': demo_usage(stdout); return 0;
        default:
            /* getopt named the option already ("unrecognized option", "requires an
             * argument"). */
            fprintf(stderr, "demo: kvwire demo --help lists the options\n");
            return 2;
        }
    }
    if (cli_opts_end("demo", "kvwire demo --help", bad, optind, argc, argv))
        return 2;
    if (!c.secret[0] && getenv("KVW_SECRET_FILE") && getenv("KVW_SECRET_FILE")[0] &&
        kvw_cli_read_secret("demo", getenv("KVW_SECRET_FILE"), c.secret,
                            sizeof(c.secret)))
        return 2;
    if (!c.dpage)
        c.dpage = c.ppage;
    if (c.external_bs && !c.bootstrap[0]) {
        fprintf(stderr, "demo: --external-bootstrap needs --bootstrap HOST:PORT, the address "
                "of the running endpoint\n");
        return 2;
    }
    if (c.external_bs && !strcmp(c.role, "decode")) {
        fprintf(stderr, "demo: --external-bootstrap is for the prefill side (a decode always "
                "looks up at --bootstrap)\n");
        return 2;
    }
    if (c.gpu) {
        if (!kvt_cuda_probe()) {
            fprintf(stderr, "demo: --gpu needs a CUDA GPU and the kvwire CUDA module\n");
            return 77;
        }
        if (!tl_set)
            snprintf(c.transport, sizeof(c.transport), "cuda_ipc");
    }
    kvt_model_t m;
    if (kvt_model_load("demo", c.model, c.layers, &m))
        return 2;
    if (c.kv_heads)
        m.m.num_kv_heads = c.kv_heads;
    /* More PP stages than layers is the library's to refuse (demo_validate: exit 3 with
     * the empty layer range named). */
    int vr = demo_validate(&c, &m);
    if (vr)
        return vr;

    if (!strcmp(c.role, "prefill"))
        return demo_prefill(&c, &m, -1, -1);
    if (!strcmp(c.role, "decode")) {
        if (!c.bootstrap[0]) {
            fprintf(stderr, "demo: --role decode needs --bootstrap host:port\n");
            return 2;
        }
        demo_result_t res = {0};
        int rc = demo_decode(&c, &m, c.bootstrap, -1, &res);
        bool ok = rc == 0 && res.rooms_verified == c.requests;
        if (rc == DEMO_REFUSED) {
            printf("kvwire demo (decode side): refused at the handshake (the reason is "
                   "above); nothing was transferred\n");
            return DEMO_REFUSED;
        }
        printf("kvwire demo (decode side): %u requests, %u rooms ok (one per request and "
               "decode rank), %llu bytes in %.3f s, verified: %s\n", c.requests, res.rooms_ok,
               (unsigned long long)res.bytes, res.ns / 1e9,
               ok ? "yes: every byte and guard" : "NO");
        return ok ? 0 : 1;
    }
    int bs_pipe[2], hold[2], go[2];
    if (pipe(bs_pipe) || pipe(hold) || pipe(go))
        return 1;
    fflush(stdout);
    pid_t pf = fork();
    if (pf == 0) {
        close(bs_pipe[0]);
        close(hold[1]);
        dup2(hold[0], STDIN_FILENO);
        close(go[1]);
        exit(demo_prefill(&c, &m, bs_pipe[1], go[0]));
    }
    close(bs_pipe[1]);
    close(hold[0]);
    close(go[0]);
    char bs[160] = "";
    ssize_t got = read(bs_pipe[0], bs, sizeof(bs) - 1);
    close(bs_pipe[0]);
    if (got <= 0) {
        close(hold[1]);
        int sp = 0;
        char how[96];
        waitpid(pf, &sp, 0);
        fprintf(stderr, "demo: the prefill process did not start (%s)\n",
                demo_wait_str(sp, how, sizeof(how)));
        return WIFEXITED(sp) && WEXITSTATUS(sp) == DEMO_REFUSED ? DEMO_REFUSED : 1;
    }
    int res_pipe[2];
    if (pipe(res_pipe))
        return 1;
    pid_t pd = fork();
    if (pd == 0) {
        close(res_pipe[0]);
        demo_result_t res = {0};
        int rc = demo_decode(&c, &m, bs, go[1], &res);
        if (write(res_pipe[1], &res, sizeof(res)) < 0)
            rc = 1;
        exit(rc);
    }
    close(res_pipe[1]);
    close(go[1]);
    demo_result_t res = {0};
    ssize_t rn = read(res_pipe[0], &res, sizeof(res));
    close(res_pipe[0]);
    int sd = 0, sp = 0;
    waitpid(pd, &sd, 0);
    close(hold[1]); /* releases the prefill process */
    waitpid(pf, &sp, 0);
    bool ok = rn == (ssize_t)sizeof(res) && WIFEXITED(sd) && WEXITSTATUS(sd) == 0 &&
              WIFEXITED(sp) && WEXITSTATUS(sp) == 0 && res.rooms_verified == c.requests;
    double secs = res.ns / 1e9;
    printf("\nkvwire demo: %s (%u layers), prefill TP%u/PP%u -> decode TP%u/PP%u over %s\n",
           c.model, m.m.num_layers, c.ptp, c.ppp, c.dtp, c.dpp, c.transport);
    printf("%-22s %-9s %-9s %-12s %-9s %-8s %s\n", "topology", "requests", "rooms ok",
           "bytes", "time s", "GB/s", "verified");
    char topo[64];
    snprintf(topo, sizeof(topo), "TP%u/PP%u->TP%u/PP%u", c.ptp, c.ppp, c.dtp, c.dpp);
    printf("%-22s %-9u %-9u %-12llu %-9.3f %-8.2f %s\n", topo, c.requests, res.rooms_ok,
           (unsigned long long)res.bytes, secs, secs > 0 ? res.bytes / secs / 1e9 : 0.0,
           ok ? "yes: every byte and guard" : "NO");
    uint32_t dranks = c.dtp * c.dpp;
    printf("(rooms ok: one room per request on each decode rank: %u requests x %u decode "
           "ranks = %u)\n", c.requests, dranks, c.requests * dranks);
    char dhow[96], phow[96];
    /* A refusal at the handshake ends the decode process with DEMO_REFUSED before any
     * transfer: the run is refused, not failed. */
    bool refused = !ok && WIFEXITED(sd) && WEXITSTATUS(sd) == DEMO_REFUSED;
    if (refused)
        fprintf(stderr, "demo: REFUSED: the configuration was refused at the handshake (the "
                "reason is above); nothing was transferred\n");
    else if (!ok)
        fprintf(stderr, "demo: FAILED (decode %s, prefill %s, %u of %u requests verified)\n",
                demo_wait_str(sd, dhow, sizeof(dhow)), demo_wait_str(sp, phow, sizeof(phow)),
                res.rooms_verified, c.requests);
    return ok ? 0 : refused ? DEMO_REFUSED : 1;
}

KVW_CMD("demo", cmd_demo, "prefill and decode processes exchange verified KV caches")
