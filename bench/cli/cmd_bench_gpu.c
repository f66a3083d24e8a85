/*
 * kvwire bench --gpu: the whole protocol with KV caches in GPU memory, next to a plain
 * copy of the same bytes measured in the same run.
 *
 * Per topology a prefill process and a decode process run (GPU 0 -> GPU 1 when there
 * are two GPUs, both on GPU 0 otherwise), joined over cuda_ipc as in serving. The decode
 * process drives: for each repetition it asks the prefill process to arm every room
 * (senders created, each room's one chunk sent), then times from its own first post to
 * SUCCESS of every room on every decode rank. Right after, it times one copy of the same
 * byte count (cudaMemcpyPeer-like GPU 0 -> GPU 1, or device to device on one GPU).
 *
 * The first repetition of every topology is untimed: its destination bytes are copied
 * back and compared, every byte and every guard byte, with the test kit's naive
 * reference (tools/testkit/ref.c) applied to the prefill ranks' bytes rebuilt here from
 * the same seed. The prefill process reports where its time went (kvw_cuda_profile),
 * and each process the CPU time of its threads over the timed repetitions, by thread
 * name (the library names its threads: kvw-ctrl, kvw-worker, kvw-rx-tcp, ...).
 *
 * Output: a table (last), the command that reproduces it, and JSON.
 */
#include "cmd.h"
#include "testkit.h"
#include "util.h"

#include <kvwire/cuda.h>
#include <kvwire/xfer.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define G_MAX_TOPO 16
#define G_MAX_REPS 64
#define G_MIN(a, b) ((a) < (b) ? (a) : (b))
#define G_MAX(a, b) ((a) > (b) ? (a) : (b))

typedef struct g_topo {
    uint32_t ptp, dtp, rooms;
    uint64_t tokens;
} g_topo_t;

typedef struct g_cfg {
    char model[48];
    uint32_t layers; /* 0: all */
    uint32_t page;
    uint32_t reps;   /* timed repetitions per topology (one untimed, verified run first) */
    uint32_t timeout_ms;
    g_topo_t topo[G_MAX_TOPO];
    uint32_t num_topo;
    char json[512];
    int no_verify;
    char transport[16]; /* cuda_ipc (default), or a host transport: staged through host */
    int contiguous;     /* --pages: bit 1 prefill, bit 2 decode pages in pool order */
} g_cfg_t;

/* The topologies: gpt-oss-120b, 36 layers, page 64. */
static const g_topo_t g_default_topo[] = {
    {1, 4, 8, 8192}, {1, 1, 8, 8192}, {4, 1, 8, 8192},
    {2, 2, 4, 32768}, {1, 4, 1, 131072}, {1, 4, 64, 1024},
};

/* CPU time of a process's threads, summed by thread name (/proc/self/task: each thread's
 * comm and schedstat, nanoseconds on a CPU). */
#define G_TCPU_NAMES 16
typedef struct g_tcpu {
    uint32_t n;
    struct {
        char name[16];
        uint32_t threads;
        uint64_t ns;
    } e[G_TCPU_NAMES];
} g_tcpu_t;

static void g_tcpu_snap(g_tcpu_t *s)
{
    memset(s, 0, sizeof(*s));
    DIR *d = opendir("/proc/self/task");
    if (d == NULL)
        return;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.')
            continue;
        char path[96], name[16] = "", buf[96];
        unsigned long long ns = 0;
        snprintf(path, sizeof(path), "/proc/self/task/%.32s/comm", de->d_name);
        FILE *f = fopen(path, "r");
        if (f == NULL)
            continue;
        if (fgets(name, sizeof(name), f) == NULL)
            name[0] = '\0';
        fclose(f);
        name[strcspn(name, "\n")] = '\0';
        snprintf(path, sizeof(path), "/proc/self/task/%.32s/schedstat", de->d_name);
        if ((f = fopen(path, "r")) == NULL)
            continue;
        if (fgets(buf, sizeof(buf), f) == NULL || sscanf(buf, "%llu", &ns) != 1)
            ns = 0;
        fclose(f);
        uint32_t i = 0;
        while (i < s->n && strcmp(s->e[i].name, name) != 0)
            i++;
        if (i == s->n) {
            if (s->n == G_TCPU_NAMES)
                continue;
            snprintf(s->e[s->n++].name, sizeof(s->e[0].name), "%s", name);
        }
        s->e[i].threads++;
        s->e[i].ns += ns;
    }
    closedir(d);
}

/* end - start by name (threads that ended meanwhile count as nothing). */
static void g_tcpu_diff(const g_tcpu_t *start, g_tcpu_t *end)
{
    for (uint32_t i = 0; i < end->n; i++)
        for (uint32_t j = 0; j < start->n; j++)
            if (strcmp(end->e[i].name, start->e[j].name) == 0)
                end->e[i].ns = end->e[i].ns > start->e[j].ns ? end->e[i].ns - start->e[j].ns : 0;
}

typedef struct g_result {
    int ok;
    char err[512];
    int devices;
    uint64_t bytes; /* per repetition, confirmed by every decode rank */
    uint32_t reps;
    uint64_t ns[G_MAX_REPS];
    uint64_t base_ns[G_MAX_REPS];
    int verified;
    uint64_t t0[G_MAX_REPS], t1[G_MAX_REPS]; /* decode: first post, last SUCCESS seen */
    /* The untimed first repetition: the first room of every (prefill, decode) pair
     * since the contexts connected. */
    uint64_t first_ns, first_t0, first_t1;
    /* Prefill process: [0] the first repetition, [k] timed repetition k. */
    kvw_cuda_profile_t prof[G_MAX_REPS + 1];
    /* Each process's threads over the timed repetitions (first one armed to the end). */
    g_tcpu_t cpu_prefill, cpu_decode;
} g_result_t;

enum { G_OP_ARM = 1, G_OP_PROFILE = 2, G_OP_QUIT = 3 };

typedef struct g_cmd {
    uint32_t op;
    uint32_t rep;
} g_cmd_t;

/* Short sleeps between polls: the timed region is a few milliseconds, and 16 cores
 * leave the library's threads room. */
static void g_nap(void)
{
    struct timespec ts = {0, 5000};
    nanosleep(&ts, NULL);
}

/* ------------------------------------------------------------ instances */

typedef struct g_inst {
    uint32_t n;
    kvt_rank_t *ranks;
    uint8_t ***dev; /* per rank, per buffer: guarded device copy */
    uint32_t full_pages, swa_pages;
    kvt_req_pages_t *pg; /* per room */
} g_inst_t;

static uint64_t g_fill_seed(bool prefill, uint32_t rank)
{
    return (prefill ? 0x9e3779b97f4a7c15ull : 0x5851f42d4c957f2dull) + rank;
}

/* The ranks of one side with host buffers (filled), sized for every room at once. */
static int g_build(const g_cfg_t *c, const kvt_model_t *m, const g_topo_t *t, bool prefill,
                   g_inst_t *in, char *err, size_t cap)
{
    uint32_t tp = prefill ? t->ptp : t->dtp;
    uint64_t window = cli_swa_window(m);
    memset(in, 0, sizeof(*in));
    in->n = tp;
    in->full_pages = t->rooms * cli_pages_needed(0, t->tokens, c->page) + 1;
    in->swa_pages = window ? t->rooms * (cli_pages_needed(0, window, c->page) + 1) + 1 : 1;
    in->ranks = calloc(tp, sizeof(*in->ranks));
    if (in->ranks == NULL)
        return snprintf(err, cap, "out of memory"), -1;
    for (uint32_t r = 0; r < tp; r++) {
        kvt_rank_spec_t s = {.model = m, .layout = KVW_LAYOUT_NHD,
                             .page_size = {c->page, c->page},
                             .num_pages = {in->full_pages, in->swa_pages}, .num_slots = 1};
        s.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = tp,
                                 .tp_rank = r, .pp_size = 1, .pp_rank = 0,
                                 .layer_begin = 0, .layer_end = m->m.num_layers,
                                 .dp_size = 1, .dp_rank = 0};
        if (kvt_rank_build(&s, &in->ranks[r]) != KVW_OK) {
            snprintf(err, cap, "cannot build %s rank %u of TP%u: %s",
                     prefill ? "prefill" : "decode", r, tp, kvw_last_error());
            return -1;
        }
        kvt_rank_fill(&in->ranks[r], g_fill_seed(prefill, r));
    }
    return 0;
}

/*
 * Page lists of every room: a random permutation of each pool (--pages contiguous: the
 * pool in order), sliced so that rooms in flight together never share a page.
 * Deterministic in the seed, so the decode process rebuilds the prefill side's lists for
 * the reference.
 */
static int g_assign(const g_cfg_t *c, const kvt_model_t *m, const g_topo_t *t, g_inst_t *in,
                    bool prefill, uint64_t seed)
{
    kvt_rng_t rng = {seed};
    uint64_t window = cli_swa_window(m);
    uint32_t *pf = malloc(sizeof(uint32_t) * in->full_pages);
    uint32_t *ps = malloc(sizeof(uint32_t) * in->swa_pages);
    in->pg = calloc(t->rooms, sizeof(*in->pg));
    int rc = pf && ps && in->pg ? 0 : -1;
    if (rc == 0 && (c->contiguous & (prefill ? 1 : 2))) {
        for (uint32_t k = 0; k < in->full_pages; k++)
            pf[k] = k;
        for (uint32_t k = 0; k < in->swa_pages; k++)
            ps[k] = k;
    } else if (rc == 0) {
        rc = kvt_pages_random(&rng, in->full_pages, in->full_pages, pf) ||
             kvt_pages_random(&rng, in->swa_pages, in->swa_pages, ps);
    }
    uint32_t uf = 0, us = 0;
    for (uint32_t i = 0; i < t->rooms && rc == 0; i++) {
        uint64_t n = t->tokens;
        uint64_t swb = window && n > window ? (n - window) / c->page * c->page : 0;
        uint32_t nf = cli_pages_needed(0, n, c->page);
        uint32_t ns = window ? cli_pages_needed(swb, n, c->page) : 0;
        kvt_req_pages_t *p = &in->pg[i];
        p->full = malloc(sizeof(uint32_t) * (nf + 1));
        p->swa = malloc(sizeof(uint32_t) * (ns + 1));
        if (!p->full || !p->swa || uf + nf > in->full_pages || us + ns > in->swa_pages) {
            rc = -1;
            break;
        }
        memcpy(p->full, pf + uf, sizeof(uint32_t) * nf);
        memcpy(p->swa, ps + us, sizeof(uint32_t) * ns);
        uf += nf, us += ns;
        p->side.full = (kvw_pages_t){KVW_PAGES_FIELDS_ALL, p->full, nf, 0};
        p->side.swa = (kvw_pages_t){KVW_PAGES_FIELDS_ALL, p->swa, ns, swb};
        p->side.field_mask = KVW_SIDE_PAGES_FIELDS_ALL;
        p->side.state_slot = -1;
    }
    free(pf);
    free(ps);
    return rc;
}

/* Device copies of every buffer (guards included); the ranks are re-described with the
 * device addresses. The host copies stay for the reference and the check. */
static int g_attach(g_inst_t *in, int device, char *err, size_t cap)
{
    char msg[384]; /* err has room for it after the prefix */
    if (kvt_gpu_attach(in->ranks, in->n, device, &in->dev, msg, sizeof(msg)) == 0)
        return 0;
    snprintf(err, cap, "GPU %d: %s", device, msg);
    return -1;
}

static void g_free(g_inst_t *in, uint32_t rooms)
{
    kvt_gpu_free(in->ranks, in->n, in->dev);
    for (uint32_t i = 0; in->pg && i < rooms; i++)
        kvt_req_pages_free(&in->pg[i]);
    free(in->pg);
    for (uint32_t i = 0; in->ranks && i < in->n; i++)
        kvt_rank_free(&in->ranks[i]);
    free(in->ranks);
    memset(in, 0, sizeof(*in));
}

static kvw_ctx_h *g_contexts(const g_cfg_t *c, const g_topo_t *t, g_inst_t *in, bool prefill,
                             const char *bs_addr, char *bs_out, size_t bs_cap, char *err,
                             size_t cap)
{
    kvw_ctx_params_t p = {
        .field_mask = KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK | KVW_CTX_FIELD_TRANSPORT |
                      KVW_CTX_FIELD_BOOTSTRAP | KVW_CTX_FIELD_HOST_BOOTSTRAP |
                      KVW_CTX_FIELD_TIMEOUTS | KVW_CTX_FIELD_PREFILL_SIZE,
        .transport = c->transport,
        .wait_timeout_ms = c->timeout_ms,
        .bootstrap_timeout_ms = c->timeout_ms,
        .prefill_tp = t->ptp,
        .prefill_pp = 1,
        .prefill_dp = 1};
    uint32_t i;
    char why[400]; /* leaves room in err (512 bytes) for the rank */
    kvw_ctx_h *ctx = cli_contexts("bench --gpu", &p, in->ranks, in->n, prefill, false, bs_addr,
                                  bs_out, bs_cap, &i, NULL, why, sizeof(why));
    if (ctx == NULL)
        snprintf(err, cap, "%s rank %u: kvw_ctx_create: %s", prefill ? "prefill" : "decode", i,
                 why);
    return ctx;
}

/*
 * The baseline of a host transport: the same bytes as one raw stream between two
 * threads of this process, host memory to host memory: a loopback TCP connection for tcp
 * and ucx (the raw socket stream), a memcpy for shm. Connection set-up is not timed.
 * Returns the nanoseconds, or 0 after writing err.
 */
typedef struct g_stream {
    int fd, go;
    const uint8_t *src;
    uint64_t len;
} g_stream_t;

static void *g_stream_send(void *arg)
{
    g_stream_t *s = arg;
    char b;
    if (kvt_read_full(s->go, &b, 1) == 0)
        (void)kvt_write_full(s->fd, s->src, s->len);
    return NULL;
}

static uint64_t g_host_baseline(const char *tl, uint8_t *dst, const uint8_t *src, uint64_t len,
                                char *err, size_t cap)
{
    if (strcmp(tl, "shm") == 0) {
        uint64_t t0 = kvt_now_ns();
        memcpy(dst, src, len);
        return kvt_now_ns() - t0 + 1;
    }
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), cfd = -1, afd = -1, go[2] = {-1, -1};
    struct sockaddr_in sa = {.sin_family = AF_INET};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t sl = sizeof(sa);
    uint64_t ns = 0;
    pthread_t th;
    bool started = false;
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) || listen(lfd, 1) ||
        getsockname(lfd, (struct sockaddr *)&sa, &sl) || pipe(go) ||
        (cfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) < 0 ||
        connect(cfd, (struct sockaddr *)&sa, sizeof(sa)) || (afd = accept(lfd, NULL, NULL)) < 0) {
        snprintf(err, cap, "baseline socket: %s", strerror(errno));
        goto out;
    }
    g_stream_t st = {.fd = cfd, .go = go[0], .src = src, .len = len};
    if (pthread_create(&th, NULL, g_stream_send, &st) != 0) {
        snprintf(err, cap, "baseline thread");
        goto out;
    }
    started = true;
    uint64_t t0 = kvt_now_ns();
    if (kvt_write_full(go[1], "g", 1) || kvt_read_full(afd, dst, len))
        snprintf(err, cap, "baseline stream: %s", strerror(errno));
    else
        ns = kvt_now_ns() - t0 + 1;
out:
    if (go[1] >= 0)
        close(go[1]); /* a sender still waiting for "go" gives up */
    if (started)
        pthread_join(th, NULL);
    int fds[] = {lfd, cfd, afd, go[0]};
    for (size_t i = 0; i < sizeof(fds) / sizeof(fds[0]); i++)
        if (fds[i] >= 0)
            close(fds[i]);
    return ns;
}

static void g_ctx_free(kvw_ctx_h *ctx, uint32_t n)
{
    for (uint32_t i = 0; ctx && i < n; i++)
        kvw_ctx_destroy(ctx[i]);
    free(ctx);
}

static int g_device(bool prefill, int *count_p)
{
    int n = 0;
    if (kvw_cuda_device_count(&n) != KVW_OK || n < 1)
        return -1;
    if (count_p)
        *count_p = n;
    return prefill || n < 2 ? 0 : 1;
}

static uint64_t g_room_id(const g_topo_t *t, uint32_t rep, uint32_t i)
{
    return 1000 + (uint64_t)rep * t->rooms + i;
}

/* ------------------------------------------------------------ prefill process */

static int g_prefill(const g_cfg_t *c, const kvt_model_t *m, const g_topo_t *t, int bs_fd,
                     int cmd_fd, int ack_fd)
{
    char err[512] = "", bs[160] = "";
    g_inst_t in;
    kvw_ctx_h *ctx = NULL;
    int rc = 0;
    if (g_build(c, m, t, true, &in, err, sizeof(err)) || g_assign(c, m, t, &in, true, 31) ||
        g_attach(&in, g_device(true, NULL), err, sizeof(err)) ||
        (ctx = g_contexts(c, t, &in, true, "127.0.0.1:0", bs, sizeof(bs), err,
                          sizeof(err))) == NULL) {
        fprintf(stderr, "bench --gpu: prefill: %s\n", err[0] ? err : "setup failed");
        rc = 1;
    }
    if (kvt_write_full(bs_fd, bs, sizeof(bs)))
        rc = 1;
    close(bs_fd);
    kvw_sender_h *snd = calloc((size_t)t->rooms * in.n, sizeof(*snd));
    static kvw_cuda_profile_t per[G_MAX_REPS + 1]; /* [rep]: 0 is the first, untimed */
    g_tcpu_t cpu0, cpu1;
    memset(&cpu0, 0, sizeof(cpu0));
    (void)prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0); /* this thread's polls only */
    while (rc == 0) {
        g_cmd_t cmd;
        if (kvt_read_full(cmd_fd, &cmd, sizeof(cmd)))
            break;
        if (cmd.op == G_OP_QUIT) {
            char a = 'q';
            (void)kvt_write_full(ack_fd, &a, 1);
            break;
        }
        /* A repetition's profile is read when the next one starts (or at the end): its
         * last notices are counted right after they went out, which can be after the
         * room reached SUCCESS here. PROFILE names the last repetition. */
        if (cmd.op == G_OP_PROFILE || cmd.rep >= 1) {
            uint32_t k = cmd.op == G_OP_PROFILE ? cmd.rep : cmd.rep - 1;
            kvw_cuda_profile(k <= G_MAX_REPS ? &per[k] : NULL, 1);
        } else {
            kvw_cuda_profile(NULL, 1);
        }
        if (cmd.op == G_OP_PROFILE) {
            g_tcpu_snap(&cpu1);
            g_tcpu_diff(&cpu0, &cpu1);
            if (kvt_write_full(ack_fd, per, sizeof(per)) ||
                kvt_write_full(ack_fd, &cpu1, sizeof(cpu1)))
                rc = 1;
            continue;
        }
        if (cmd.rep == 1)
            g_tcpu_snap(&cpu0); /* the timed repetitions start */
        for (uint32_t i = 0; i < t->rooms && rc == 0; i++) {
            kvw_send_chunk_t sc = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL,
                                   .num_tokens = t->tokens, .chunk_begin = 0,
                                   .chunk_end = t->tokens, .last_chunk = 1,
                                   .pages = in.pg[i].side};
            for (uint32_t k = 0; k < in.n && rc == 0; k++) {
                kvw_sender_h *s = &snd[i * in.n + k];
                if (kvw_sender_create(ctx[k], g_room_id(t, cmd.rep, i), s) != KVW_OK ||
                    kvw_sender_send(*s, &sc) != KVW_OK) {
                    fprintf(stderr, "bench --gpu: prefill room: %s\n", kvw_last_error());
                    rc = 1;
                }
            }
        }
        char a = rc ? 'x' : 'k';
        if (kvt_write_full(ack_fd, &a, 1))
            rc = 1;
        for (uint32_t i = 0; i < t->rooms * in.n; i++) {
            if (snd[i] == NULL)
                continue;
            while (rc == 0 && !cli_room_ended(kvw_room_poll(kvw_sender_room(snd[i]))))
                g_nap();
            if (rc == 0 && kvw_room_poll(kvw_sender_room(snd[i])) != KVW_ROOM_SUCCESS) {
                fprintf(stderr, "bench --gpu: prefill room failed: %s\n",
                        kvw_room_failure(kvw_sender_room(snd[i])));
                rc = 1;
            }
            kvw_room_destroy(kvw_sender_room(snd[i]));
            snd[i] = NULL;
        }
    }
    free(snd);
    g_ctx_free(ctx, in.n);
    g_free(&in, t->rooms);
    return rc;
}

/* ------------------------------------------------------------ decode process */

/* Copies the device buffers back and compares every byte and guard byte with the
 * reference transfer of every room applied to the initial contents. */
static int g_verify(const kvt_model_t *m, const g_topo_t *t, g_inst_t *in, const g_inst_t *src,
                    const kvt_copy_t *init, char *err, size_t cap)
{
    char msg[384];
    if (kvt_gpu_pull(in->ranks, in->n, in->dev, msg, sizeof(msg)))
        return snprintf(err, cap, "copying GPU buffers back: %s", msg), -1;
    kvt_ref_side_t *ss = calloc(src->n, sizeof(*ss));
    uint8_t ***sd = calloc(src->n, sizeof(*sd));
    int rc = ss && sd ? 0 : -1;
    for (uint32_t s = 0; s < src->n && rc == 0; s++) {
        sd[s] = calloc(src->ranks[s].num_bufs, sizeof(uint8_t *));
        if (sd[s] == NULL) {
            rc = -1;
            break;
        }
        for (uint32_t b = 0; b < src->ranks[s].num_bufs; b++)
            sd[s][b] = kvt_rank_data(&src->ranks[s], b);
    }
    for (uint32_t k = 0; k < in->n && rc == 0; k++) {
        kvt_copy_t exp;
        if (kvt_copy_make(&in->ranks[k], &exp) != KVW_OK) {
            rc = -1;
            break;
        }
        /* Expected = the initial contents plus what the reference writes. */
        for (uint32_t b = 0; b < exp.num_bufs; b++)
            memcpy(exp.data[b], init[k].data[b], exp.len[b]);
        for (uint32_t i = 0; i < t->rooms && rc == 0; i++) {
            for (uint32_t s = 0; s < src->n; s++)
                ss[s] = kvt_ref_side(&src->ranks[s], &src->pg[i].side, sd[s]);
            kvt_ref_side_t ds = kvt_ref_side(&in->ranks[k], &in->pg[i].side, exp.data);
            kvw_chunk_t ch = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = t->tokens,
                              .chunk_begin = 0,
                              .chunk_end = t->tokens, .prefix_len = 0, .last_chunk = 1};
            char msg[400];
            if (kvt_ref_transfer(&m->m, ss, src->n, &ds, &ch, NULL, NULL, msg, sizeof(msg))) {
                snprintf(err, cap, "reference: %s", msg);
                rc = -1;
            }
        }
        char msg[400];
        if (rc == 0 && kvt_copy_compare(&in->ranks[k], &exp, "decode buffers", msg,
                                        sizeof(msg))) {
            snprintf(err, cap, "decode rank %u: WRONG BYTES: %s", k, msg);
            rc = -1;
        }
        if (rc == 0 && kvt_rank_check_guards(&in->ranks[k], msg, sizeof(msg))) {
            snprintf(err, cap, "decode rank %u: guard bytes changed: %s", k, msg);
            rc = -1;
        }
        kvt_copy_free(&exp);
    }
    for (uint32_t s = 0; sd && s < src->n; s++)
        free(sd[s]);
    free(sd);
    free(ss);
    if (rc && !err[0])
        snprintf(err, cap, "out of memory verifying");
    return rc;
}

static int g_decode(const g_cfg_t *c, const kvt_model_t *m, const g_topo_t *t, const char *bs,
                    int cmd_fd, int ack_fd, g_result_t *res)
{
    g_inst_t in, src;
    memset(&src, 0, sizeof(src));
    kvt_copy_t *init = NULL;
    kvw_ctx_h *ctx = NULL;
    char *err = res->err;
    size_t cap = sizeof(res->err);
    int dev = g_device(false, &res->devices);
    int rc = 0;
    if (g_build(c, m, t, false, &in, err, cap) || g_assign(c, m, t, &in, false, 37))
        rc = -1;
    /* The prefill ranks' bytes and pages, rebuilt here for the reference. */
    if (rc == 0 && !c->no_verify &&
        (g_build(c, m, t, true, &src, err, cap) || g_assign(c, m, t, &src, true, 31)))
        rc = -1;
    if (rc == 0 && !c->no_verify) {
        init = calloc(in.n, sizeof(*init));
        for (uint32_t k = 0; init && k < in.n && rc == 0; k++)
            if (kvt_copy_make(&in.ranks[k], &init[k]) != KVW_OK)
                rc = -1;
        if (init == NULL || rc)
            rc = -1, snprintf(err, cap, "out of memory");
    }
    if (rc == 0 && g_attach(&in, dev, err, cap))
        rc = -1;
    if (rc == 0 && (ctx = g_contexts(c, t, &in, false, bs, NULL, 0, err, cap)) == NULL)
        rc = -1;
    /* The baseline's buffers: source on the prefill GPU, destination on this one. */
    void *bsrc = NULL, *bdst = NULL, *stream = NULL;
    uint64_t bcap = 0;
    kvw_receiver_h *rcv = calloc((size_t)t->rooms * in.n, sizeof(*rcv));
    uint32_t nrep = G_MIN(c->reps, (uint32_t)G_MAX_REPS);
    /* The default 50 us timer slack would add up to that much to each timed wait. */
    (void)prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    g_tcpu_t cpu0;
    memset(&cpu0, 0, sizeof(cpu0));
    for (uint32_t rep = 0; rep <= nrep && rc == 0; rep++) {
        if (rep == 1)
            g_tcpu_snap(&cpu0);
        g_cmd_t cmd = {.op = G_OP_ARM, .rep = rep};
        char a = 0;
        if (kvt_write_full(cmd_fd, &cmd, sizeof(cmd)) || kvt_read_full(ack_fd, &a, 1) || a != 'k') {
            snprintf(err, cap, "the prefill process failed to arm repetition %u", rep);
            rc = -1;
            break;
        }
        uint64_t t0 = kvt_now_ns();
        for (uint32_t i = 0; i < t->rooms && rc == 0; i++) {
            kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL,
                                    .num_tokens = t->tokens, .prefix_len = 0,
                                    .pages = in.pg[i].side};
            for (uint32_t k = 0; k < in.n && rc == 0; k++) {
                kvw_receiver_h *r = &rcv[i * in.n + k];
                if (kvw_receiver_create(ctx[k], g_room_id(t, rep, i), 0, r) != KVW_OK ||
                    kvw_receiver_post(*r, &post) != KVW_OK) {
                    snprintf(err, cap, "posting room %u: %s", i, kvw_last_error());
                    rc = -1;
                }
            }
        }
        for (uint32_t i = 0; i < t->rooms * in.n && rc == 0; i++)
            while (!cli_room_ended(kvw_room_poll(kvw_receiver_room(rcv[i]))))
                g_nap();
        uint64_t t1 = kvt_now_ns(), bytes = 0;
        if (rep > 0)
            res->t0[rep - 1] = t0, res->t1[rep - 1] = t1;
        else
            res->first_t0 = t0, res->first_t1 = t1, res->first_ns = t1 - t0;
        for (uint32_t i = 0; i < t->rooms * in.n; i++) {
            if (rcv[i] == NULL)
                continue;
            if (rc == 0 && kvw_room_poll(kvw_receiver_room(rcv[i])) != KVW_ROOM_SUCCESS) {
                snprintf(err, cap, "room %u failed on decode rank %u: %s", i / in.n, i % in.n,
                         kvw_room_failure(kvw_receiver_room(rcv[i])));
                rc = -1;
            }
            kvw_room_metrics_t mt = {.field_mask = KVW_ROOM_METRICS_FIELDS_ALL};
            kvw_room_metrics(kvw_receiver_room(rcv[i]), &mt);
            bytes += mt.bytes;
            kvw_room_destroy(kvw_receiver_room(rcv[i]));
            rcv[i] = NULL;
        }
        if (rc)
            break;
        if (rep == 0) {
            res->bytes = bytes;
            if (!c->no_verify) {
                if (g_verify(m, t, &in, &src, init, err, cap)) {
                    rc = -1;
                    break;
                }
                res->verified = 1;
            }
            /* Baseline buffers, sized now that the byte count is known. */
            bcap = G_MAX(bytes, 1);
            if (strcmp(c->transport, "cuda_ipc") != 0) {
                bsrc = malloc(bcap);
                bdst = malloc(bcap);
                if (bsrc == NULL || bdst == NULL) {
                    snprintf(err, cap, "baseline buffers: out of memory");
                    rc = -1;
                    break;
                }
                memset(bsrc, 0x3c, bcap);
                memset(bdst, 0, bcap);
            } else if (kvt_cuda_set_device(0) != KVW_OK || kvt_cuda_malloc(bcap, &bsrc) != KVW_OK ||
                kvt_cuda_memset(bsrc, 0x3c, bcap, NULL) != KVW_OK ||
                kvt_cuda_set_device(dev) != KVW_OK || kvt_cuda_malloc(bcap, &bdst) != KVW_OK ||
                kvt_cuda_stream_create(&stream) != KVW_OK) {
                snprintf(err, cap, "baseline buffers: %s", kvt_cuda_error());
                rc = -1;
                break;
            }
        } else if (bytes != res->bytes) {
            snprintf(err, cap, "repetition %u moved %llu bytes, the first %llu", rep,
                     (unsigned long long)bytes, (unsigned long long)res->bytes);
            rc = -1;
            break;
        }
        /* The same bytes as one copy (peer, or device to device), timed the same way:
         * host clock from the call to completion. A first copy warms up. */
        for (int w = rep == 0 ? 0 : 1; w < 2 && rc == 0; w++) {
            if (strcmp(c->transport, "cuda_ipc") != 0) {
                uint64_t ns = g_host_baseline(c->transport, bdst, bsrc, bytes, err, cap);
                if (ns == 0)
                    rc = -1;
                if (rep > 0)
                    res->base_ns[rep - 1] = ns;
                continue;
            }
            uint64_t b0 = kvt_now_ns();
            if (kvt_cuda_memcpy(bdst, bsrc, bytes, stream) != KVW_OK ||
                kvt_cuda_stream_sync(stream) != KVW_OK) {
                snprintf(err, cap, "baseline copy: %s", kvt_cuda_error());
                rc = -1;
            }
            if (rep > 0)
                res->base_ns[rep - 1] = kvt_now_ns() - b0;
        }
        if (rep > 0) {
            res->ns[rep - 1] = t1 - t0;
            res->reps = rep;
        }
    }
    if (rc == 0) {
        g_tcpu_snap(&res->cpu_decode);
        g_tcpu_diff(&cpu0, &res->cpu_decode);
        g_cmd_t cmd = {.op = G_OP_PROFILE, .rep = res->reps};
        if (kvt_write_full(cmd_fd, &cmd, sizeof(cmd)) ||
            kvt_read_full(ack_fd, res->prof, sizeof(res->prof)) ||
            kvt_read_full(ack_fd, &res->cpu_prefill, sizeof(res->cpu_prefill)))
            rc = -1, snprintf(err, cap, "the prefill process did not report its profile");
    }
    g_cmd_t q = {.op = G_OP_QUIT};
    char a;
    if (kvt_write_full(cmd_fd, &q, sizeof(q)) == 0)
        (void)kvt_read_full(ack_fd, &a, 1);
    if (stream)
        kvt_cuda_stream_destroy(stream);
    if (strcmp(c->transport, "cuda_ipc") != 0) {
        free(bsrc);
        free(bdst);
    } else {
        if (bsrc)
            kvt_cuda_free(bsrc);
        if (bdst)
            kvt_cuda_free(bdst);
    }
    free(rcv);
    g_ctx_free(ctx, in.n);
    for (uint32_t k = 0; init && k < in.n; k++)
        kvt_copy_free(&init[k]);
    free(init);
    g_free(&in, t->rooms);
    g_free(&src, t->rooms);
    res->ok = rc == 0;
    return rc;
}

/* ------------------------------------------------------------ driver */

/* One topology: a prefill and a decode process. */
static int g_run_topo(const g_cfg_t *c, const kvt_model_t *m, const g_topo_t *t, g_result_t *res)
{
    int bs_pipe[2], cmd_pipe[2], ack_pipe[2], res_pipe[2];
    memset(res, 0, sizeof(*res));
    if (pipe(bs_pipe) || pipe(cmd_pipe) || pipe(ack_pipe) || pipe(res_pipe))
        return snprintf(res->err, sizeof(res->err), "pipe: %s", strerror(errno)), -1;
    fflush(stdout);
    fflush(stderr);
    pid_t pf = fork();
    if (pf == 0) {
        close(bs_pipe[0]), close(cmd_pipe[1]), close(ack_pipe[0]), close(res_pipe[0]);
        close(res_pipe[1]);
        exit(g_prefill(c, m, t, bs_pipe[1], cmd_pipe[0], ack_pipe[1]));
    }
    close(bs_pipe[1]), close(cmd_pipe[0]), close(ack_pipe[1]);
    char bs[160] = "";
    if (kvt_read_full(bs_pipe[0], bs, sizeof(bs)) || !bs[0]) {
        snprintf(res->err, sizeof(res->err), "the prefill process did not start");
        close(cmd_pipe[1]), close(ack_pipe[0]), close(res_pipe[0]), close(res_pipe[1]);
        close(bs_pipe[0]);
        waitpid(pf, NULL, 0);
        return -1;
    }
    close(bs_pipe[0]);
    pid_t pd = fork();
    if (pd == 0) {
        close(res_pipe[0]);
        g_result_t r;
        memset(&r, 0, sizeof(r));
        int rc = g_decode(c, m, t, bs, cmd_pipe[1], ack_pipe[0], &r);
        if (kvt_write_full(res_pipe[1], &r, sizeof(r)))
            rc = 1;
        exit(rc ? 1 : 0);
    }
    close(cmd_pipe[1]), close(ack_pipe[0]), close(res_pipe[1]);
    int got = kvt_read_full(res_pipe[0], res, sizeof(*res));
    close(res_pipe[0]);
    int sd = 0, sp = 0;
    waitpid(pd, &sd, 0);
    waitpid(pf, &sp, 0);
    if (got) {
        snprintf(res->err, sizeof(res->err), "the decode process died (status %d)", sd);
        res->ok = 0;
    }
    if (res->ok && !(WIFEXITED(sp) && WEXITSTATUS(sp) == 0)) {
        snprintf(res->err, sizeof(res->err), "the prefill process failed (status %d)", sp);
        res->ok = 0;
    }
    return res->ok ? 0 : -1;
}

static double g_gbps(uint64_t bytes, uint64_t ns)
{
    return ns ? (double)bytes / (double)ns : 0.0;
}

static double g_ms(uint64_t ns)
{
    return (double)ns / 1e6;
}

/* Medians over the timed repetitions of the three wall-clock phases, and the prefill
 * workers' step sums over all of them. */
typedef struct g_split {
    uint64_t in, gpu, out;
    kvw_cuda_profile_t sum;
} g_split_t;

static g_split_t g_split_of(const g_result_t *r, bool first)
{
    g_split_t sp;
    uint64_t a[G_MAX_REPS], b[G_MAX_REPS], c[G_MAX_REPS];
    uint64_t ft0[1] = {r->first_t0}, ft1[1] = {r->first_t1};
    const uint64_t *t0 = first ? ft0 : r->t0, *t1 = first ? ft1 : r->t1;
    uint32_t n = 0, reps = first ? 1 : r->reps;
    memset(&sp, 0, sizeof(sp));
    for (uint32_t k = 0; k < reps; k++) {
        const kvw_cuda_profile_t *p = &r->prof[first ? 0 : k + 1];
        sp.sum.steps += p->steps;
        sp.sum.plan_ns += p->plan_ns;
        sp.sum.launch_ns += p->launch_ns;
        sp.sum.upload_dev_ns += p->upload_dev_ns;
        sp.sum.kernel_dev_ns += p->kernel_dev_ns;
        sp.sum.wait_ns += p->wait_ns;
        sp.sum.notify_ns += p->notify_ns;
        if (p->first_start_ns < t0[k] || p->last_done_ns < p->first_start_ns ||
            t1[k] < p->last_done_ns)
            continue; /* no GPU step in this repetition */
        a[n] = p->first_start_ns - t0[k];
        b[n] = p->last_done_ns - p->first_start_ns;
        c[n] = t1[k] - p->last_done_ns;
        n++;
    }
    sp.in = cli_median(a, n);
    sp.gpu = cli_median(b, n);
    sp.out = cli_median(c, n);
    return sp;
}

static g_split_t g_split(const g_result_t *r)
{
    return g_split_of(r, false);
}

static const char *g_pages_name(int contiguous)
{
    static const char *const names[] = {"random", "prefill-contiguous", "decode-contiguous",
                                        "contiguous"};
    return names[contiguous & 3];
}

/* The speed targets of the cuda_ipc protocol, one line each: the ratio to the same-run
 * copy (random pages: >= 0.75 for rooms of 8K tokens or more, >= 0.6 below; contiguous
 * pages: >= 0.85), and the first room at most 1.5 times the steady-state time. */
static void g_verdicts(const g_cfg_t *c, const g_result_t *res)
{
    printf("targets (%s pages):\n", g_pages_name(c->contiguous));
    for (uint32_t i = 0; i < c->num_topo; i++) {
        const g_topo_t *t = &c->topo[i];
        const g_result_t *r = &res[i];
        if (!r->ok || r->reps == 0)
            continue;
        uint64_t mn = cli_median(r->ns, r->reps), mb = cli_median(r->base_ns, r->reps);
        double ratio = mb && mn ? (double)mb / (double)mn : 0.0;
        double want = c->contiguous == 3 ? 0.85 : t->tokens >= 8192 ? 0.75 : 0.6;
        double first = mn ? (double)r->first_ns / (double)mn : 0.0;
        printf("  TP%u->TP%u %ux%llu: ratio %.3f (target >= %.2f) %s; first room %.2fx steady "
               "(target <= 1.5) %s\n", t->ptp, t->dtp, t->rooms, (unsigned long long)t->tokens,
               ratio, want, ratio >= want ? "PASS" : "MISS", first,
               first <= 1.5 ? "PASS" : "MISS");
    }
}

/* The entries of s in descending CPU time, as indexes into s->e. */
static uint32_t g_tcpu_order(const g_tcpu_t *s, uint32_t *idx)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < s->n; i++) {
        uint32_t j = n++;
        while (j > 0 && s->e[idx[j - 1]].ns < s->e[i].ns) {
            idx[j] = idx[j - 1];
            j--;
        }
        idx[j] = i;
    }
    return n;
}

/* "name ms (threads)" for the busiest names of one process, per repetition. */
static void g_tcpu_print(const char *side, const g_tcpu_t *s, uint32_t reps)
{
    uint32_t idx[G_TCPU_NAMES], n = g_tcpu_order(s, idx), shown = 0;
    printf("  %s:", side);
    for (uint32_t k = 0; k < n && shown < 6; k++) {
        double ms = g_ms(s->e[idx[k]].ns) / (reps ? reps : 1);
        if (ms < 0.005)
            break;
        printf("%s %s %.3f", shown ? "," : "", s->e[idx[k]].name, ms);
        if (s->e[idx[k]].threads > 1)
            printf(" (%u threads)", s->e[idx[k]].threads);
        shown++;
    }
    printf("%s\n", shown ? "" : " -");
}

static void g_tcpu_json(FILE *jf, const g_tcpu_t *s, uint32_t reps)
{
    fprintf(jf, "{");
    for (uint32_t i = 0; i < s->n; i++) {
        fprintf(jf, "%s", i ? ", " : "");
        cli_json_str(jf, s->e[i].name);
        fprintf(jf, ": {\"threads\": %u, \"ms\": %.4f}", s->e[i].threads,
                g_ms(s->e[i].ns) / (reps ? reps : 1));
    }
    fprintf(jf, "}");
}

static void g_usage(FILE *f)
{
    fprintf(f,
            "usage: kvwire bench --gpu [options]\n"
            "  --model NAME      model preset (default gpt-oss-120b)\n"
            "  --layers N        keep the first N layers (default 0 = all)\n"
            "  --page-size N     tokens per page (default 64)\n"
            "  --reps N          timed repetitions per topology (default 5, at most %d)\n"
            "  --topo P:D:R:T    prefill TP, decode TP, rooms, tokens per room (repeatable;\n"
            "                    default: the six topologies of the issue)\n"
            "  --no-verify       skip the byte check of the first repetition\n"
            "  --pages ORDER     random (default: each pool shuffled) or contiguous (each\n"
            "                    room's pages in pool order); prefill-contiguous or\n"
            "                    decode-contiguous: that side in order, the other shuffled\n"
            "  --json FILE       results (default bench-gpu.json)\n"
            "  --transport NAME  cuda_ipc (default: the fused kernel writes the decode GPU,\n"
            "                    against a peer copy), or tcp, ucx, shm: GPU caches through\n"
            "                    host staging, against a raw loopback TCP stream (tcp, ucx)\n"
            "                    or a memcpy (shm) of the same bytes in host memory\n"
            "Prefill on GPU 0, decode on GPU 1 (GPU 0 when only one exists).\n"
            "Exits 77 without a GPU.\n",
            G_MAX_REPS);
}

int kvw_bench_gpu(int argc, char **argv);

int kvw_bench_gpu(int argc, char **argv)
{
    g_cfg_t c = {.model = "gpt-oss-120b", .layers = 0, .page = 64, .reps = 5,
                 .timeout_ms = 60000, .json = "bench-gpu.json", .transport = "cuda_ipc"};
    static const struct option opts[] = {
        {"gpu", 0, 0, 'G'},        {"model", 1, 0, 'm'}, {"layers", 1, 0, 'L'},
        {"page-size", 1, 0, 's'},  {"reps", 1, 0, 'r'},  {"topo", 1, 0, 'T'},
        {"no-verify", 0, 0, 'n'},  {"json", 1, 0, 'j'},  {"help", 0, 0, 'h'},
        {"transport", 1, 0, 't'},  {"pages", 1, 0, 'p'},  {0, 0, 0, 0}};
    int o, bad = 0;
    const char *w = "bench --gpu";
    optind = 1;
    while (!bad && (o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (o) {
        case 'G': break;
        case 'm': snprintf(c.model, sizeof(c.model), "%s", optarg); break;
        case 'L': bad = cli_opt_u32(w, "--layers", optarg, 0, KVT_MAX_LAYERS, &c.layers); break;
        case 's': bad = cli_opt_u32(w, "--page-size", optarg, 1, 65536, &c.page); break;
        case 'r': bad = cli_opt_u32(w, "--reps", optarg, 1, G_MAX_REPS, &c.reps); break;
        case 'T': {
            g_topo_t t;
            unsigned long long tok = 0;
            if (c.num_topo == G_MAX_TOPO ||
                sscanf(optarg, "%u:%u:%u:%llu", &t.ptp, &t.dtp, &t.rooms, &tok) != 4 ||
                !t.ptp || !t.dtp || !t.rooms || !tok) {
                fprintf(stderr, "bench --gpu: bad --topo '%s' (P:D:ROOMS:TOKENS)\n", optarg);
                return 2;
            }
            t.tokens = tok;
            c.topo[c.num_topo++] = t;
            break;
        }
        case 'n': c.no_verify = 1; break;
        case 'p':
            if (!strcmp(optarg, "random") || !strcmp(optarg, "contiguous") ||
                !strcmp(optarg, "prefill-contiguous") || !strcmp(optarg, "decode-contiguous")) {
                c.contiguous = !strcmp(optarg, "contiguous")           ? 3
                               : !strcmp(optarg, "prefill-contiguous") ? 1
                               : !strcmp(optarg, "decode-contiguous")  ? 2
                                                                        : 0;
                break;
            }
            fprintf(stderr, "bench --gpu: bad --pages '%s' (random, contiguous, "
                    "prefill-contiguous or decode-contiguous)\n", optarg);
            return 2;
        case 't': snprintf(c.transport, sizeof(c.transport), "%s", optarg); break;
        case 'j': snprintf(c.json, sizeof(c.json), "%s", optarg); break;
        case 'h': g_usage(stdout); return 0;
        default:
            fprintf(stderr, "%s: kvwire bench --gpu --help lists the options\n", w);
            return 2;
        }
    }
    if (cli_opts_end(w, "kvwire bench --gpu --help", bad, optind, argc, argv))
        return 2;
    if (c.num_topo == 0) {
        c.num_topo = sizeof(g_default_topo) / sizeof(g_default_topo[0]);
        memcpy(c.topo, g_default_topo, sizeof(g_default_topo));
    }
    char why[512];
    if (!kvt_cuda_probe_why(why, sizeof(why))) {
        printf("bench --gpu: skipped: no GPU (no CUDA device, driver or kvwire CUDA module)%s%s\n",
               why[0] ? ": " : "", why);
        return 77;
    }
    kvt_model_t m;
    if (kvt_model_load("bench --gpu", c.model, c.layers, &m))
        return 2;
    g_result_t *res = calloc(c.num_topo, sizeof(*res));
    if (res == NULL)
        return 1;
    int fail = 0;
    for (uint32_t i = 0; i < c.num_topo; i++) {
        const g_topo_t *t = &c.topo[i];
        if (g_run_topo(&c, &m, t, &res[i])) {
            fprintf(stderr, "bench --gpu: TP%u->TP%u %ux%llu: FAILED: %s\n", t->ptp, t->dtp,
                    t->rooms, (unsigned long long)t->tokens, res[i].err);
            fail = 1;
        }
        fflush(stderr);
    }

    FILE *jf = fopen(c.json, "w");
    if (jf) {
        fprintf(jf, "{\"model\": \"%s\", \"layers\": %u, \"page\": %u, \"reps\": %u, "
                "\"transport\": \"%s\", \"pages\": \"%s\", \"topologies\": [", c.model,
                m.m.num_layers, c.page, c.reps, c.transport,
                g_pages_name(c.contiguous));
        for (uint32_t i = 0; i < c.num_topo; i++) {
            const g_topo_t *t = &c.topo[i];
            const g_result_t *r = &res[i];
            g_split_t sp = g_split(r);
            uint64_t mn = cli_median(r->ns, r->reps), mb = cli_median(r->base_ns, r->reps);
            fprintf(jf, "%s\n  {\"prefill_tp\": %u, \"decode_tp\": %u, \"rooms\": %u, "
                    "\"tokens\": %llu, \"ok\": %s, \"verified\": %s, \"devices\": %d, "
                    "\"bytes\": %llu, \"protocol_ns\": [", i ? "," : "", t->ptp, t->dtp,
                    t->rooms, (unsigned long long)t->tokens, r->ok ? "true" : "false",
                    r->verified ? "true" : "false", r->devices, (unsigned long long)r->bytes);
            for (uint32_t k = 0; k < r->reps; k++)
                fprintf(jf, "%s%llu", k ? ", " : "", (unsigned long long)r->ns[k]);
            fprintf(jf, "], \"baseline_ns\": [");
            for (uint32_t k = 0; k < r->reps; k++)
                fprintf(jf, "%s%llu", k ? ", " : "", (unsigned long long)r->base_ns[k]);
            fprintf(jf, "], \"protocol_gbps\": %.2f, \"baseline_gbps\": %.2f, \"ratio\": %.3f, "
                    "\"median_ns\": {\"post_to_first_step\": %llu, \"first_step_to_last_done\": "
                    "%llu, \"last_done_to_success\": %llu}, \"per_rep_sum_ns\": {\"steps\": "
                    "%llu, \"plan\": %llu, \"launch\": %llu, \"upload_dev\": %llu, "
                    "\"kernel_dev\": %llu, \"wait\": %llu, \"notify\": %llu}, "
                    "\"first_room_ns\": %llu, \"first_over_steady\": %.3f, ",
                    g_gbps(r->bytes, mn), g_gbps(r->bytes, mb),
                    mb && mn ? (double)mb / (double)mn : 0.0, (unsigned long long)sp.in,
                    (unsigned long long)sp.gpu, (unsigned long long)sp.out,
                    (unsigned long long)sp.sum.steps, (unsigned long long)sp.sum.plan_ns,
                    (unsigned long long)sp.sum.launch_ns,
                    (unsigned long long)sp.sum.upload_dev_ns,
                    (unsigned long long)sp.sum.kernel_dev_ns, (unsigned long long)sp.sum.wait_ns,
                    (unsigned long long)sp.sum.notify_ns, (unsigned long long)r->first_ns,
                    mn ? (double)r->first_ns / (double)mn : 0.0);
            fprintf(jf, "\"cpu_ms_per_rep\": {\"prefill\": ");
            g_tcpu_json(jf, &r->cpu_prefill, r->reps);
            fprintf(jf, ", \"decode\": ");
            g_tcpu_json(jf, &r->cpu_decode, r->reps);
            fprintf(jf, "}}");
        }
        fprintf(jf, "\n]}\n");
        fclose(jf);
    }

    printf("\nwhere the time goes (ms per repetition). Wall clock, medians: in = decode's first "
           "post to the prefill's first GPU step;\nsteps = first step to the last completion "
           "notice sent; out = that notice to SUCCESS seen on every decode rank.\nPrefill "
           "worker steps, summed over steps (concurrent workers add up): plan = building the "
           "plan; launch = flattening,\nupload and kernel enqueue (host); upload, kernel = CUDA "
           "events on the worker's stream; wait = host blocked on a kernel;\nnotify = sending "
           "completion notices\n");
    printf("%-8s %-11s %6s | %6s %6s %6s | %5s %6s %6s %6s %7s %7s %6s\n", "topology",
           "rooms x tok", "ms", "in", "steps", "out", "steps", "plan", "launch", "upload",
           "kernel", "wait", "notify");
    for (uint32_t i = 0; i < c.num_topo; i++) {
        const g_topo_t *t = &c.topo[i];
        const g_result_t *r = &res[i];
        if (!r->ok || r->reps == 0)
            continue;
        char topo[16], rt[24];
        snprintf(topo, sizeof(topo), "TP%u->TP%u", t->ptp, t->dtp);
        snprintf(rt, sizeof(rt), "%ux%llu", t->rooms, (unsigned long long)t->tokens);
        for (int first = 0; first < 2; first++) {
            /* The second row: the first repetition alone (the first room of every pair). */
            g_split_t sp = g_split_of(r, first);
            double per = first ? 1.0 : (double)r->reps;
            printf("%-8s %-11s %6.3f | %6.3f %6.3f %6.3f | %5.0f %6.3f %6.3f %6.3f %7.3f %7.3f "
                   "%6.3f\n", first ? "  first" : topo, first ? "" : rt,
                   g_ms(first ? r->first_ns : cli_median(r->ns, r->reps)), g_ms(sp.in),
                   g_ms(sp.gpu), g_ms(sp.out), (double)sp.sum.steps / per,
                   g_ms(sp.sum.plan_ns) / per, g_ms(sp.sum.launch_ns) / per,
                   g_ms(sp.sum.upload_dev_ns) / per, g_ms(sp.sum.kernel_dev_ns) / per,
                   g_ms(sp.sum.wait_ns) / per, g_ms(sp.sum.notify_ns) / per);
        }
    }

    printf("\nCPU time of each process's threads by name, ms per timed repetition (from the "
           "first one armed to the last\nSUCCESS, between repetitions included; a thread near "
           "the repetition's wall time above is the bound):\n");
    for (uint32_t i = 0; i < c.num_topo; i++) {
        const g_topo_t *t = &c.topo[i];
        const g_result_t *r = &res[i];
        if (!r->ok || r->reps == 0)
            continue;
        printf("TP%u->TP%u %ux%llu\n", t->ptp, t->dtp, t->rooms, (unsigned long long)t->tokens);
        g_tcpu_print("prefill", &r->cpu_prefill, r->reps);
        g_tcpu_print("decode", &r->cpu_decode, r->reps);
    }

    bool host_tl = strcmp(c.transport, "cuda_ipc") != 0;
    printf("\nkvwire bench --gpu: %s (%u layers, page %u, %s pages), %d GPU(s): prefill GPU 0 "
           "-> decode GPU %d over %s;\npost to SUCCESS on every decode rank against one %s of "
           "the same bytes, medians of %u repetitions;\nfirst = the untimed first repetition "
           "(the first room of every pair after the contexts connected)\n", c.model,
           m.m.num_layers, c.page, g_pages_name(c.contiguous), res[0].devices,
           res[0].devices > 1 ? 1 : 0, c.transport,
           host_tl ? (strcmp(c.transport, "shm") ? "raw loopback TCP stream (host memory)"
                                                 : "memcpy (host memory)")
           : res[0].devices > 1 ? "peer copy (GPU 0 -> GPU 1)" : "device-to-device copy",
           c.reps);
    printf("%-8s %-11s %8s %10s %9s %6s %7s %8s %6s  %s\n", "topology", "rooms x tok", "MB",
           "proto GB/s", "base GB/s", "ratio", "ms", "first ms", "first/", "verified");
    for (uint32_t i = 0; i < c.num_topo; i++) {
        const g_topo_t *t = &c.topo[i];
        const g_result_t *r = &res[i];
        char topo[16], rt[24];
        snprintf(topo, sizeof(topo), "TP%u->TP%u", t->ptp, t->dtp);
        snprintf(rt, sizeof(rt), "%ux%llu", t->rooms, (unsigned long long)t->tokens);
        if (!r->ok || r->reps == 0) {
            printf("%-8s %-11s FAILED: %s\n", topo, rt, r->err);
            continue;
        }
        uint64_t mn = cli_median(r->ns, r->reps), mb = cli_median(r->base_ns, r->reps);
        printf("%-8s %-11s %8.1f %10.1f %9.1f %6.3f %7.3f %8.3f %6.2f  %s\n", topo, rt,
               (double)r->bytes / 1e6, g_gbps(r->bytes, mn), g_gbps(r->bytes, mb),
               mb && mn ? (double)mb / (double)mn : 0.0, g_ms(mn), g_ms(r->first_ns),
               mn ? (double)r->first_ns / (double)mn : 0.0,
               r->verified ? "yes: every byte and guard" : "no");
    }
    if (!host_tl)
        g_verdicts(&c, res);
    printf("reproduce: kvwire bench --gpu --transport %s --pages %s --reps %u (JSON: %s; chart: "
           "scripts/gpu-chart.sh %s)\n", c.transport, g_pages_name(c.contiguous),
           c.reps, c.json, c.json);
    free(res);
    return fail;
}
