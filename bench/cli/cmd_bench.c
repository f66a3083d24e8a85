/*
 * kvwire bench: throughput of real transfers between a prefill process and a decode
 * process on this host, next to baselines measured in the same run; the control-plane
 * rate (small rooms, many in flight); plan memory and the decode side's memory per
 * in-flight room. Output: a table, the command that reproduces it, JSON and a PNG chart.
 *
 * Nothing here checks bytes: correctness is the demo's and the tests' job. Buffers are
 * pre-faulted once and reused, so that page faults of never-touched memory are not
 * measured (they cost more than the copy itself on these hosts).
 *
 * Per (transport, topology) one prefill and one decode process run, wired as in the
 * demo (bootstrap address over a pipe). The decode process drives: for each request it
 * asks the prefill process to arm the room (sender created, its one chunk sent), then
 * times from its own post to SUCCESS on every decode rank. Right after each request it
 * times the transport's baseline for the same byte count (shm: memcpy; tcp: a plain
 * socket stream from the prefill process), so both see the same load on a shared host.
 * ucx gets ucx_perftest as a reference, run after the pair.
 */
#include "cmd.h"
#include "testkit.h"
#include "util.h"

#include <kvwire/mem.h>
#include <kvwire/xfer.h>


#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <malloc.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define B_MAX_LEN 16      /* request lengths in one sweep */
#define B_MAX_REPS 64     /* timed repetitions per length */
#define B_MAX_TL 4        /* transports */
#define B_MAX_TOPO 2      /* topologies */
#define B_MAX_RATE 20000  /* rooms in the control-plane run */
#define B_MAX_NOTES 16
#define B_MAX_BASE (B_MAX_TL * B_MAX_LEN * B_MAX_TOPO)
/* Every wait of the benchmark's own thread is kvw_room_wait: woken by the room's state
 * change, never a sleep-and-poll loop. Polling with short sleeps took a core of a 2-core
 * host away from the library's threads and made small rooms bimodal (70-270 or
 * 700-1,300 us for one 4 KiB room against 120-150 us in bench --latency). The timeout
 * only bounds one wait; a room that hangs fails at its own timeout. */
#define B_WAIT_MS 1000

#define B_MIN(a, b) ((a) < (b) ? (a) : (b))
#define B_MAX(a, b) ((a) > (b) ? (a) : (b))

/* ------------------------------------------------------------ configuration */

typedef struct bench_cfg {
    char transports[B_MAX_TL][16];
    uint32_t num_tl;
    char model[48];
    uint32_t layers; /* 0: all */
    uint32_t ptp, dtp;
    uint64_t lengths[B_MAX_LEN];
    uint32_t num_lengths;
    uint32_t reps;
    uint32_t page;
    uint32_t rate_rooms, rate_inflight;
    uint32_t mem_rooms;
    int decode_anon; /* decode pools from anonymous memory instead of kvw_mem_alloc_shared */
    int quick;
    int metrics; /* --metrics: each context's kvw_ctx_metrics at the end of its run */
    char json[512], png[512];
    uint32_t timeout_ms;
    uint64_t budget_ns; /* per length and pair: stop repeating after this much time */
} bench_cfg_t;

typedef struct bench_topo {
    uint32_t ptp, dtp;
    char name[32];
    const char *kind; /* "whole pages" or "head slices" */
} bench_topo_t;

/* ------------------------------------------------------------ small helpers */

static uint64_t b_now(void)
{
    return kvt_now_ns();
}

static void b_sleep_ns(long ns)
{
    struct timespec ts = {0, ns};
    nanosleep(&ts, NULL);
}

/* Waits until the room is terminal (woken by its state change); returns that state. */
static kvw_room_state_t b_wait_room(kvw_room_h room)
{
    kvw_room_state_t s;
    while (!cli_room_ended(s = kvw_room_wait(room, B_WAIT_MS))) {
    }
    return s;
}

static uint64_t b_percentile(const uint64_t *v, uint32_t n, double p)
{
    if (n == 0)
        return 0;
    uint64_t *t = malloc(sizeof(uint64_t) * n);
    if (!t)
        return 0;
    memcpy(t, v, sizeof(uint64_t) * n);
    qsort(t, n, sizeof(uint64_t), cli_cmp_u64);
    uint32_t i = (uint32_t)(p * (n - 1) + 0.5);
    uint64_t r = t[B_MIN(i, n - 1)];
    free(t);
    return r;
}

/* Anonymous memory, every page touched (never-touched pages would be measured too). */
static void *b_alloc_touched(size_t len, uint8_t fill)
{
    len = (len + 4095) & ~(size_t)4095;
    void *p = mmap(NULL, len ? len : 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (p == MAP_FAILED)
        return NULL;
    (void)madvise(p, len, MADV_HUGEPAGE);
    memset(p, fill, len);
    return p;
}

static void b_free_touched(void *p, size_t len)
{
    if (p)
        munmap(p, ((len + 4095) & ~(size_t)4095) ? ((len + 4095) & ~(size_t)4095) : 4096);
}

static double b_gbps(uint64_t bytes, uint64_t ns)
{
    return ns ? (double)bytes / (double)ns : 0.0; /* bytes per ns == GB/s */
}

/* CPU time (user + system) of this process (every thread) and of the calling thread
 * alone, and the process's context switches. */
typedef struct b_cpu {
    uint64_t ns, self_ns, csw;
} b_cpu_t;

static b_cpu_t b_cpu_now(void)
{
    struct rusage ru;
    struct timespec ts;
    b_cpu_t c = {0, 0, 0};
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0)
        c.self_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    if (getrusage(RUSAGE_SELF, &ru) == 0) {
        c.ns = (uint64_t)ru.ru_utime.tv_sec * 1000000000ull + (uint64_t)ru.ru_utime.tv_usec * 1000 +
               (uint64_t)ru.ru_stime.tv_sec * 1000000000ull + (uint64_t)ru.ru_stime.tv_usec * 1000;
        c.csw = (uint64_t)ru.ru_nvcsw + (uint64_t)ru.ru_nivcsw;
    }
    return c;
}

static bool b_has_state(const kvt_model_t *m)
{
    for (uint32_t l = 0; l < m->m.num_layers; l++)
        if (m->layers[l].kind == KVW_LAYER_STATE)
            return true;
    return false;
}

/* ------------------------------------------------------------ page lists */

/* Page lists for one request: consecutive pages from `full0` / `swa0`, so that runs of
 * whole pages coalesce when both sides have the same layout. */
typedef struct b_pages {
    kvw_side_pages_t side;
    uint32_t *full, *swa;
    uint32_t cap_full, cap_swa;
} b_pages_t;

static int b_pages_init(b_pages_t *p, uint32_t cap_full, uint32_t cap_swa)
{
    memset(p, 0, sizeof(*p));
    p->full = malloc(sizeof(uint32_t) * (cap_full + 1));
    p->swa = malloc(sizeof(uint32_t) * (cap_swa + 1));
    p->cap_full = cap_full, p->cap_swa = cap_swa;
    return p->full && p->swa ? 0 : -1;
}

static void b_pages_free(b_pages_t *p)
{
    free(p->full);
    free(p->swa);
    memset(p, 0, sizeof(*p));
}

static uint32_t b_full_pages(uint64_t n, uint32_t page)
{
    return (uint32_t)((n + page - 1) / page);
}

static uint32_t b_swa_pages(uint64_t n, uint32_t page, uint64_t window)
{
    if (!window || n == 0)
        return 0;
    uint64_t swb = n > window ? (n - window) / page * page : 0;
    return (uint32_t)((n + page - 1) / page - swb / page);
}

static int b_pages_set(b_pages_t *p, uint64_t n, uint32_t page, uint64_t window, uint32_t full0,
                       uint32_t swa0, int64_t slot)
{
    uint32_t nf = b_full_pages(n, page), ns = b_swa_pages(n, page, window);
    if (nf > p->cap_full || ns > p->cap_swa)
        return -1;
    kvt_pages_consecutive(full0, nf, p->full);
    kvt_pages_consecutive(swa0, ns, p->swa);
    uint64_t swb = window && n > window ? (n - window) / page * page : 0;
    p->side.full = (kvw_pages_t){KVW_PAGES_FIELDS_ALL, p->full, nf, 0};
    p->side.swa = (kvw_pages_t){KVW_PAGES_FIELDS_ALL, p->swa, ns, swb};
    p->side.field_mask = KVW_SIDE_PAGES_FIELDS_ALL;
    p->side.state_slot = slot;
    return 0;
}

/* ------------------------------------------------------------ instances */

typedef struct b_inst {
    uint32_t n;
    kvt_rank_t *ranks;
    void **mem;     /* per rank: one allocation holding all its buffers */
    size_t *mem_len;
    bool *shared;   /* from kvw_mem_alloc_shared */
    kvw_ctx_h *ctx;
    uint32_t full_pages, swa_pages, slots;
} b_inst_t;

typedef struct b_sizes {
    uint32_t full_pages, swa_pages, slots;
} b_sizes_t;

static b_sizes_t b_pool_sizes(const bench_cfg_t *c, const kvt_model_t *m)
{
    uint64_t maxlen = 1;
    for (uint32_t i = 0; i < c->num_lengths; i++)
        maxlen = B_MAX(maxlen, c->lengths[i]);
    uint64_t window = cli_swa_window(m);
    b_sizes_t s;
    s.full_pages = B_MAX(b_full_pages(maxlen, c->page), c->rate_inflight) + 1;
    s.swa_pages = B_MAX(window ? b_swa_pages(maxlen, c->page, window) : 1, c->rate_inflight) + 1;
    s.slots = c->rate_inflight + 1;
    return s;
}

static void b_inst_free(b_inst_t *in)
{
    if (in->ctx)
        for (uint32_t i = 0; i < in->n; i++)
            if (in->ctx[i])
                kvw_ctx_destroy(in->ctx[i]);
    for (uint32_t i = 0; i < in->n && in->ranks; i++) {
        kvt_rank_free(&in->ranks[i]);
        if (in->mem && in->mem[i]) {
            if (in->shared[i])
                kvw_mem_free_shared(in->mem[i]);
            else
                b_free_touched(in->mem[i], in->mem_len[i]);
        }
    }
    free(in->ctx);
    free(in->ranks);
    free(in->mem);
    free(in->mem_len);
    free(in->shared);
    memset(in, 0, sizeof(*in));
}

/*
 * Builds the `tp` ranks of one instance with real, pre-faulted memory: one allocation
 * per rank, buffers at page-aligned offsets inside it. Decode memory comes from
 * kvw_mem_alloc_shared unless `anon` (the shm transport then writes it with memcpy
 * through a shared mapping instead of process_vm_writev).
 */
static int b_inst_build(const bench_cfg_t *c, const kvt_model_t *m, uint32_t tp, bool shared_mem,
                        b_inst_t *in, char *err, size_t errcap)
{
    memset(in, 0, sizeof(*in));
    b_sizes_t sz = b_pool_sizes(c, m);
    in->n = tp;
    in->full_pages = sz.full_pages, in->swa_pages = sz.swa_pages, in->slots = sz.slots;
    in->ranks = calloc(tp, sizeof(*in->ranks));
    in->mem = calloc(tp, sizeof(*in->mem));
    in->mem_len = calloc(tp, sizeof(*in->mem_len));
    in->shared = calloc(tp, sizeof(*in->shared));
    in->ctx = calloc(tp, sizeof(*in->ctx));
    if (!in->ranks || !in->mem || !in->mem_len || !in->shared || !in->ctx) {
        snprintf(err, errcap, "out of memory");
        return -1;
    }
    for (uint32_t t = 0; t < tp; t++) {
        kvt_rank_spec_t s = {.model = m, .layout = KVW_LAYOUT_NHD,
                             .page_size = {c->page, c->page},
                             .num_pages = {sz.full_pages, sz.swa_pages},
                             .num_slots = sz.slots, .describe_only = 1};
        s.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = tp,
                                 .tp_rank = t, .pp_size = 1, .pp_rank = 0,
                                 .layer_begin = 0, .layer_end = m->m.num_layers,
                                 .dp_size = 1, .dp_rank = 0};
        kvt_rank_t *r = &in->ranks[t];
        if (kvt_rank_describe(&s, r) != KVW_OK) {
            snprintf(err, errcap, "cannot describe rank %u of TP%u: %s", t, tp, kvw_last_error());
            return -1;
        }
        size_t total = 0;
        for (uint32_t b = 0; b < r->num_bufs; b++)
            total += (r->bufs[b].length + 4095) & ~(uint64_t)4095;
        void *base = NULL;
        if (shared_mem) {
            if (kvw_mem_alloc_shared(total, &base) != KVW_OK) {
                snprintf(err, errcap, "kvw_mem_alloc_shared(%zu): %s", total, kvw_last_error());
                return -1;
            }
            memset(base, 0, total); /* fault every page in now */
            in->shared[t] = true;
        } else if ((base = b_alloc_touched(total, 0x5a)) == NULL) {
            snprintf(err, errcap, "cannot allocate %zu bytes", total);
            return -1;
        }
        in->mem[t] = base;
        in->mem_len[t] = total;
        size_t off = 0;
        for (uint32_t b = 0; b < r->num_bufs; b++) {
            r->bufs[b].addr = (uint8_t *)base + off;
            off += (r->bufs[b].length + 4095) & ~(uint64_t)4095;
        }
        if (kvt_rank_open(r) != KVW_OK) {
            snprintf(err, errcap, "kvw_rank_create (rank %u of TP%u): %s", t, tp,
                     kvw_last_error());
            return -1;
        }
    }
    return 0;
}

static int b_contexts(const bench_cfg_t *c, const char *transport, b_inst_t *in, bool prefill,
                      uint32_t prefill_tp, const char *bs_addr, char *bs_out, size_t bs_cap,
                      char *err, size_t errcap)
{
    for (uint32_t i = 0; i < in->n; i++) {
        kvw_ctx_params_t p = {
            .field_mask = KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK | KVW_CTX_FIELD_TRANSPORT |
                          KVW_CTX_FIELD_BOOTSTRAP | KVW_CTX_FIELD_HOST_BOOTSTRAP |
                          KVW_CTX_FIELD_TIMEOUTS | KVW_CTX_FIELD_PREFILL_SIZE,
            .side = prefill ? KVW_SIDE_PREFILL : KVW_SIDE_DECODE,
            .rank = in->ranks[i].h,
            .transport = transport,
            .bootstrap_addr = bs_addr,
            .host_bootstrap = prefill && i == 0,
            .wait_timeout_ms = c->timeout_ms,
            .bootstrap_timeout_ms = c->timeout_ms,
            .prefill_tp = prefill_tp,
            .prefill_pp = 1,
            .prefill_dp = 1};
        kvw_status_t st = kvw_ctx_create(&p, &in->ctx[i]);
        if (st != KVW_OK) {
            snprintf(err, errcap, "%s rank %u: kvw_ctx_create(%s): %s: %s",
                     prefill ? "prefill" : "decode", i, transport, kvw_status_string(st),
                     kvw_last_error());
            in->ctx[i] = NULL;
            return -1;
        }
        if (prefill && i == 0) {
            snprintf(bs_out, bs_cap, "%s", kvw_ctx_bootstrap_addr(in->ctx[0]));
            bs_addr = bs_out;
        }
    }
    return 0;
}

/* ------------------------------------------------------------ process protocol */

enum {
    B_OP_ARM = 1,         /* arm room `room` with `tokens` tokens; ack */
    B_OP_RATE = 2,        /* run the control-plane loop; ack, then CPU figures */
    B_OP_QUIT = 3,        /* every room is finished; ack 'q' */
    B_OP_TCP_CONNECT = 4, /* connect the baseline socket to 127.0.0.1:`room`; ack */
    B_OP_TCP_SEND = 5     /* make `tokens` bytes ready; ack; serve one request on the socket */
};

/* decode -> prefill */
typedef struct b_cmd {
    uint32_t op;
    uint32_t inflight;
    uint64_t room;   /* ARM: the room; RATE: the first room */
    uint64_t tokens; /* ARM: request length; RATE: room count */
} b_cmd_t;

typedef struct b_len_result {
    uint64_t tokens;
    uint64_t bytes;   /* payload confirmed by every decode rank, per request */
    uint32_t reps;
    uint64_t ns[B_MAX_REPS];     /* decode: post -> SUCCESS on every rank */
    uint32_t base_reps;
    uint64_t base_ns[B_MAX_REPS]; /* the transport's baseline, same bytes, right after */
    uint64_t skipped_pred_ns;    /* not run: one request was predicted to take this long */
} b_len_result_t;

typedef struct b_mem_result {
    uint64_t tokens;
    uint32_t rooms;
    uint32_t full_pages, swa_pages;
    int64_t rss_delta;  /* bytes */
    int64_t heap_delta; /* bytes in use by malloc (main arena) */
} b_mem_result_t;

/* decode -> parent */
typedef struct b_result {
    int ok;
    char err[512];
    uint32_t num_lengths;
    b_len_result_t len[B_MAX_LEN];
    int rate_done;
    uint32_t rate_rooms, rate_inflight;
    uint64_t rate_ns;
    uint64_t rate_lat_p50, rate_lat_p99;
    b_cpu_t rate_cpu_decode, rate_cpu_prefill;
    uint32_t num_mem;
    b_mem_result_t mem[2];
    uint64_t phase_ns[4]; /* decode process: setup, memory, sweep, control plane */
} b_result_t;

typedef struct b_job {
    const bench_cfg_t *c;
    const kvt_model_t *m;
    const char *transport;
    bench_topo_t topo;
    bool do_rate, do_mem;
} b_job_t;

/* ------------------------------------------------------------ prefill process */

/* Rate loops: nothing to do, so wait until the oldest room in flight (the lowest
 * sequence number among busy slots; rooms of one window finish about in order) ends on
 * every rank. rooms[s * n + k]: slot s, rank k. */
static void b_wait_oldest(kvw_room_h (*room_of)(const void *, size_t), const void *h,
                          const bool *busy, const uint64_t *seq, uint32_t w, uint32_t n)
{
    uint32_t best = w;
    for (uint32_t s = 0; s < w; s++)
        if (busy[s] && (best == w || seq[s] < seq[best]))
            best = s;
    for (uint32_t k = 0; best < w && k < n; k++)
        (void)b_wait_room(room_of(h, (size_t)best * n + k));
}

static kvw_room_h b_sender_room_at(const void *h, size_t i)
{
    return kvw_sender_room(((const kvw_sender_h *)h)[i]);
}

static kvw_room_h b_receiver_room_at(const void *h, size_t i)
{
    return kvw_receiver_room(((const kvw_receiver_h *)h)[i]);
}

static int b_wait_senders(kvw_sender_h *s, uint32_t n, char *err, size_t errcap)
{
    int rc = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (b_wait_room(kvw_sender_room(s[i])) != KVW_ROOM_SUCCESS && rc == 0) {
            snprintf(err, errcap, "prefill room failed: %s",
                     kvw_room_failure(kvw_sender_room(s[i])));
            rc = -1;
        }
    }
    return rc;
}

static int b_arm(b_inst_t *in, uint64_t room, uint64_t n, const b_pages_t *pg, kvw_sender_h *snd,
                 char *err, size_t errcap)
{
    kvw_send_chunk_t sc = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = n,
                           .chunk_begin = 0, .chunk_end = n, .last_chunk = 1,
                           .pages = pg->side};
    for (uint32_t k = 0; k < in->n; k++) {
        snd[k] = NULL;
        if (kvw_sender_create(in->ctx[k], room, &snd[k]) != KVW_OK ||
            kvw_sender_send(snd[k], &sc) != KVW_OK) {
            snprintf(err, errcap, "prefill room %llu: %s", (unsigned long long)room,
                     kvw_last_error());
            return -1;
        }
    }
    return 0;
}

static int b_prefill_rate(const bench_cfg_t *c, const kvt_model_t *m, b_inst_t *in,
                          const b_cmd_t *cmd, char *err, size_t errcap)
{
    uint32_t w = cmd->inflight, n = in->n;
    uint64_t window = cli_swa_window(m);
    kvw_sender_h *snd = calloc((size_t)w * n, sizeof(*snd));
    b_pages_t *pg = calloc(w, sizeof(*pg));
    bool *busy = calloc(w, sizeof(*busy));
    uint64_t *seq = calloc(w, sizeof(*seq));
    int rc = snd && pg && busy && seq ? 0 : -1;
    for (uint32_t s = 0; s < w && rc == 0; s++)
        if (b_pages_init(&pg[s], 1, 1) ||
            b_pages_set(&pg[s], 1, c->page, window, s, s, b_has_state(m) ? (int64_t)s : -1))
            rc = -1;
    uint64_t next = 0, done = 0;
    while (rc == 0 && done < cmd->tokens) {
        bool progress = false;
        for (uint32_t s = 0; s < w && rc == 0; s++) {
            if (busy[s]) {
                bool all = true;
                for (uint32_t k = 0; k < n; k++)
                    all &= cli_room_ended(kvw_room_poll(kvw_sender_room(snd[s * n + k])));
                if (!all)
                    continue;
                for (uint32_t k = 0; k < n; k++) {
                    if (kvw_room_poll(kvw_sender_room(snd[s * n + k])) != KVW_ROOM_SUCCESS &&
                        rc == 0) {
                        snprintf(err, errcap, "prefill rate room failed: %s",
                                 kvw_room_failure(kvw_sender_room(snd[s * n + k])));
                        rc = -1;
                    }
                    kvw_room_destroy(kvw_sender_room(snd[s * n + k]));
                }
                busy[s] = false;
                done++;
                progress = true;
            }
            if (!busy[s] && next < cmd->tokens && rc == 0) {
                if (b_arm(in, cmd->room + next, 1, &pg[s], &snd[s * n], err, errcap))
                    rc = -1;
                busy[s] = true;
                seq[s] = next++;
                progress = true;
            }
        }
        if (!progress && rc == 0)
            b_wait_oldest(b_sender_room_at, snd, busy, seq, w, n);
    }
    for (uint32_t s = 0; s < w && snd && busy; s++)
        if (busy[s])
            for (uint32_t k = 0; k < n; k++)
                kvw_room_destroy(kvw_sender_room(snd[s * n + k]));
    for (uint32_t s = 0; s < w && pg; s++)
        b_pages_free(&pg[s]);
    free(snd);
    free(pg);
    free(busy);
    free(seq);
    return rc;
}

static int b_prefill_main(const b_job_t *j, int bs_fd, int cmd_fd, int ack_fd)
{
    const bench_cfg_t *c = j->c;
    const kvt_model_t *m = j->m;
    char err[512] = "";
    b_inst_t in;
    char bs[160] = "";
    if (b_inst_build(c, m, j->topo.ptp, false, &in, err, sizeof(err)) ||
        b_contexts(c, j->transport, &in, true, j->topo.ptp, "127.0.0.1:0", bs, sizeof(bs), err,
                   sizeof(err))) {
        fprintf(stderr, "bench: prefill: %s\n", err);
        b_inst_free(&in);
        return 1;
    }
    if (kvt_write_full(bs_fd, bs, sizeof(bs)))
        return 1;
    close(bs_fd);
    (void)prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0); /* this thread's sleeps only */
    uint64_t window = cli_swa_window(m);
    b_pages_t pg;
    b_sizes_t sz = b_pool_sizes(c, m);
    int rc = b_pages_init(&pg, sz.full_pages, sz.swa_pages) ? 1 : 0;
    kvw_sender_h *snd = calloc(in.n, sizeof(*snd));
    int tcp_fd = -1;
    uint8_t *tcp_src = NULL;
    uint64_t tcp_cap = 0;
    for (;;) {
        b_cmd_t cmd;
        if (rc || kvt_read_full(cmd_fd, &cmd, sizeof(cmd)))
            break;
        if (cmd.op == B_OP_TCP_CONNECT) {
            struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)cmd.room)};
            sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            tcp_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
            char a = tcp_fd >= 0 && connect(tcp_fd, (struct sockaddr *)&sa, sizeof(sa)) == 0
                         ? 'k' : 'x';
            if (kvt_write_full(ack_fd, &a, 1) || a != 'k')
                rc = 1;
            continue;
        }
        if (cmd.op == B_OP_TCP_SEND) {
            /* A plain stream: 4 MiB writes from a pre-faulted buffer, default options. */
            if (cmd.tokens > tcp_cap) {
                b_free_touched(tcp_src, tcp_cap);
                tcp_src = b_alloc_touched(cmd.tokens, 0x33);
                tcp_cap = tcp_src ? cmd.tokens : 0;
            }
            char a = tcp_src && tcp_fd >= 0 ? 'k' : 'x';
            uint64_t want = 0;
            if (kvt_write_full(ack_fd, &a, 1) || a != 'k' ||
                kvt_read_full(tcp_fd, &want, sizeof(want)) || want > tcp_cap) {
                rc = 1;
                continue;
            }
            for (uint64_t off = 0; off < want && rc == 0;) {
                ssize_t n = write(tcp_fd, tcp_src + off, (size_t)B_MIN(want - off, 4ull << 20));
                if (n < 0 && errno == EINTR)
                    continue;
                if (n <= 0)
                    rc = 1;
                else
                    off += (uint64_t)n;
            }
            continue;
        }
        if (cmd.op == B_OP_QUIT) {
            /* Every room here is finished: the decode side may close its connections. */
            char a = 'q';
            (void)kvt_write_full(ack_fd, &a, 1);
            break;
        }
        if (cmd.op == B_OP_ARM) {
            if (b_pages_set(&pg, cmd.tokens, c->page, window, 0, 0, b_has_state(m) ? 0 : -1)) {
                fprintf(stderr, "bench: prefill pool too small for %llu tokens\n",
                        (unsigned long long)cmd.tokens);
                rc = 1;
                break;
            }
            if (b_arm(&in, cmd.room, cmd.tokens, &pg, snd, err, sizeof(err))) {
                fprintf(stderr, "bench: %s\n", err);
                rc = 1;
            }
            char a = rc ? 'x' : 'k';
            if (kvt_write_full(ack_fd, &a, 1))
                rc = 1;
            if (rc == 0 && b_wait_senders(snd, in.n, err, sizeof(err))) {
                fprintf(stderr, "bench: %s\n", err);
                rc = 1;
            }
            for (uint32_t k = 0; k < in.n; k++) {
                kvw_room_destroy(kvw_sender_room(snd[k]));
                snd[k] = NULL;
            }
        } else if (cmd.op == B_OP_RATE) {
            char a = 'k';
            if (kvt_write_full(ack_fd, &a, 1))
                rc = 1;
            b_cpu_t c0 = b_cpu_now();
            if (rc == 0 && b_prefill_rate(c, m, &in, &cmd, err, sizeof(err))) {
                fprintf(stderr, "bench: %s\n", err);
                rc = 1;
            }
            /* This process's CPU time and context switches over the run, for the report. */
            b_cpu_t c1 = b_cpu_now(), d = {c1.ns - c0.ns, c1.self_ns - c0.self_ns, c1.csw - c0.csw};
            if (kvt_write_full(ack_fd, &d, sizeof(d)))
                rc = 1;
        }
    }
    free(snd);
    if (tcp_fd >= 0)
        close(tcp_fd);
    b_free_touched(tcp_src, tcp_cap);
    b_pages_free(&pg);
    for (uint32_t i = 0; c->metrics && i < in.n; i++)
        cli_print_metrics(stdout, "prefill", i, in.ctx[i]);
    b_inst_free(&in);
    return rc;
}

/* ------------------------------------------------------------ decode process */

static int64_t b_rss_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    long size = 0, rss = 0;
    if (!f)
        return -1;
    int n = fscanf(f, "%ld %ld", &size, &rss);
    fclose(f);
    return n == 2 ? (int64_t)rss * sysconf(_SC_PAGESIZE) : -1;
}

static int64_t b_heap_bytes(void)
{
    struct mallinfo2 mi = mallinfo2();
    return (int64_t)mi.uordblks;
}

/* Waits until every receiver is terminal; returns 0 when all succeeded. */
static int b_wait_receivers(kvw_receiver_h *r, uint32_t n, uint64_t room, char *err, size_t errcap)
{
    for (uint32_t k = 0; k < n; k++)
        (void)b_wait_room(kvw_receiver_room(r[k]));
    for (uint32_t k = 0; k < n; k++)
        if (kvw_room_poll(kvw_receiver_room(r[k])) != KVW_ROOM_SUCCESS) {
            snprintf(err, errcap, "room %llu failed on decode rank %u: %s",
                     (unsigned long long)room, k, kvw_room_failure(kvw_receiver_room(r[k])));
            return -1;
        }
    return 0;
}

/* Decode RSS and heap growth while `rooms` rooms of `tokens` tokens are posted (they
 * are never served: the prefill side has no sender for them), then aborted. */
static int b_decode_mem(const bench_cfg_t *c, const kvt_model_t *m, b_inst_t *in, uint64_t tokens,
                        uint32_t rooms, uint64_t room0, b_mem_result_t *out, char *err,
                        size_t errcap)
{
    uint64_t window = cli_swa_window(m);
    b_pages_t pg;
    if (b_pages_init(&pg, in->full_pages, in->swa_pages) ||
        b_pages_set(&pg, tokens, c->page, window, 0, 0, b_has_state(m) ? 0 : -1)) {
        snprintf(err, errcap, "decode pool too small for %llu tokens", (unsigned long long)tokens);
        b_pages_free(&pg);
        return -1;
    }
    kvw_receiver_h *r = calloc((size_t)rooms * in->n, sizeof(*r));
    if (!r) {
        b_pages_free(&pg);
        snprintf(err, errcap, "out of memory");
        return -1;
    }
    int rc = 0;
    int64_t rss0 = b_rss_bytes(), heap0 = b_heap_bytes();
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = tokens,
                            .prefix_len = 0, .pages = pg.side};
    for (uint32_t i = 0; i < rooms && rc == 0; i++)
        for (uint32_t k = 0; k < in->n && rc == 0; k++)
            if (kvw_receiver_create(in->ctx[k], room0 + i, 0, &r[i * in->n + k]) != KVW_OK ||
                kvw_receiver_post(r[i * in->n + k], &post) != KVW_OK) {
                snprintf(err, errcap, "posting room %llu: %s", (unsigned long long)(room0 + i),
                         kvw_last_error());
                rc = -1;
            }
    /* Let the control thread send the requests (its queue is part of the cost). */
    b_sleep_ns(50 * 1000 * 1000);
    int64_t rss1 = b_rss_bytes(), heap1 = b_heap_bytes();
    for (uint32_t i = 0; i < rooms * in->n; i++)
        if (r[i])
            kvw_room_destroy(kvw_receiver_room(r[i]));
    free(r);
    out->tokens = tokens;
    out->rooms = rooms;
    out->full_pages = pg.side.full.num_pages;
    out->swa_pages = pg.side.swa.num_pages;
    out->rss_delta = rss1 - rss0;
    out->heap_delta = heap1 - heap0;
    b_pages_free(&pg);
    b_sleep_ns(50 * 1000 * 1000); /* aborts reach the prefill side before the next phase */
    return rc;
}

static int b_decode_rate(const bench_cfg_t *c, const kvt_model_t *m, b_inst_t *in, int cmd_fd,
                         int ack_fd, uint64_t room0, b_result_t *res, char *err, size_t errcap)
{
    uint32_t w = c->rate_inflight, n = in->n, total = c->rate_rooms;
    uint64_t window = cli_swa_window(m);
    kvw_receiver_h *rcv = calloc((size_t)w * n, sizeof(*rcv));
    b_pages_t *pg = calloc(w, sizeof(*pg));
    uint64_t *t_post = calloc(w, sizeof(uint64_t)), *lat = calloc(total, sizeof(uint64_t));
    bool *busy = calloc(w, sizeof(*busy));
    uint64_t *seq = calloc(w, sizeof(*seq));
    int rc = rcv && pg && t_post && lat && busy && seq ? 0 : -1;
    for (uint32_t s = 0; s < w && rc == 0; s++)
        if (b_pages_init(&pg[s], 1, 1) ||
            b_pages_set(&pg[s], 1, c->page, window, s, s, b_has_state(m) ? (int64_t)s : -1))
            rc = -1;
    if (rc) {
        snprintf(err, errcap, "rate: setup failed");
    } else {
        b_cmd_t cmd = {.op = B_OP_RATE, .inflight = w, .room = room0, .tokens = total};
        char a;
        if (kvt_write_full(cmd_fd, &cmd, sizeof(cmd)) || kvt_read_full(ack_fd, &a, 1) || a != 'k') {
            snprintf(err, errcap, "rate: the prefill process did not answer");
            rc = -1;
        }
    }
    b_cpu_t c0 = b_cpu_now();
    uint64_t t0 = b_now(), next = 0, done = 0;
    while (rc == 0 && done < total) {
        bool progress = false;
        for (uint32_t s = 0; s < w && rc == 0; s++) {
            if (busy[s]) {
                bool all = true;
                for (uint32_t k = 0; k < n && all; k++)
                    all = cli_room_ended(kvw_room_poll(kvw_receiver_room(rcv[s * n + k])));
                if (!all)
                    continue;
                uint64_t now = b_now();
                for (uint32_t k = 0; k < n; k++) {
                    if (kvw_room_poll(kvw_receiver_room(rcv[s * n + k])) != KVW_ROOM_SUCCESS &&
                        rc == 0) {
                        snprintf(err, errcap, "rate room failed on decode rank %u: %s", k,
                                 kvw_room_failure(kvw_receiver_room(rcv[s * n + k])));
                        rc = -1;
                    }
                    kvw_room_destroy(kvw_receiver_room(rcv[s * n + k]));
                }
                lat[done++] = now - t_post[s];
                busy[s] = false;
                progress = true;
            }
            if (!busy[s] && next < total && rc == 0) {
                kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = 1,
                                        .prefix_len = 0, .pages = pg[s].side};
                t_post[s] = b_now();
                for (uint32_t k = 0; k < n; k++) {
                    rcv[s * n + k] = NULL;
                    if (kvw_receiver_create(in->ctx[k], room0 + next, 0, &rcv[s * n + k]) !=
                            KVW_OK ||
                        kvw_receiver_post(rcv[s * n + k], &post) != KVW_OK) {
                        snprintf(err, errcap, "rate: posting room %llu: %s",
                                 (unsigned long long)(room0 + next), kvw_last_error());
                        rc = -1;
                    }
                }
                busy[s] = true;
                seq[s] = next++;
                progress = true;
            }
        }
        if (!progress && rc == 0)
            b_wait_oldest(b_receiver_room_at, rcv, busy, seq, w, n);
    }
    uint64_t t1 = b_now();
    for (uint32_t s = 0; s < w && busy && rcv; s++)
        if (busy[s])
            for (uint32_t k = 0; k < n; k++)
                kvw_room_destroy(kvw_receiver_room(rcv[s * n + k]));
    b_cpu_t c1 = b_cpu_now(), pc = {0, 0, 0};
    if (rc == 0 && kvt_read_full(ack_fd, &pc, sizeof(pc))) {
        snprintf(err, errcap, "rate: the prefill process did not report");
        rc = -1;
    }
    if (rc == 0) {
        res->rate_cpu_decode = (b_cpu_t){c1.ns - c0.ns, c1.self_ns - c0.self_ns, c1.csw - c0.csw};
        res->rate_cpu_prefill = pc;
        res->rate_done = 1;
        res->rate_rooms = total;
        res->rate_inflight = w;
        res->rate_ns = t1 - t0;
        res->rate_lat_p50 = b_percentile(lat, total, 0.5);
        res->rate_lat_p99 = b_percentile(lat, total, 0.99);
    }
    for (uint32_t s = 0; s < w && pg; s++)
        b_pages_free(&pg[s]);
    free(rcv);
    free(pg);
    free(t_post);
    free(lat);
    free(busy);
    free(seq);
    return rc;
}

/*
 * The transport's own baseline, measured in the decode process right after each kvwire
 * request of the same byte count, so that both see the same load on a shared host:
 *  shm: one memcpy between two pre-faulted buffers (one thread);
 *  tcp: a plain socket stream over 127.0.0.1 from the prefill process (4 MiB writes from
 *       a pre-faulted buffer, default socket options), read into a pre-faulted buffer,
 *       timed from the 8-byte request to the last byte.
 * Buffers grow (and are faulted in) outside the timed part; lengths run in ascending
 * order so that happens once per length.
 */
typedef struct b_base {
    int kind; /* 0 none, 1 memcpy, 2 tcp */
    uint8_t *src, *dst;
    uint64_t cap;
    int fd;
} b_base_t;

static int b_base_open(const char *tl, int cmd_fd, int ack_fd, b_base_t *b, char *err,
                       size_t errcap)
{
    memset(b, 0, sizeof(*b));
    b->fd = -1;
    if (!strcmp(tl, "shm")) {
        b->kind = 1;
        return 0;
    }
    if (strcmp(tl, "tcp"))
        return 0;
    b->kind = 2;
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = 0};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t sl = sizeof(sa);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) || listen(lfd, 1) ||
        getsockname(lfd, (struct sockaddr *)&sa, &sl)) {
        snprintf(err, errcap, "tcp baseline: listen: %s", strerror(errno));
        if (lfd >= 0)
            close(lfd);
        return -1;
    }
    b_cmd_t cmd = {.op = B_OP_TCP_CONNECT, .room = ntohs(sa.sin_port)};
    char a = 0;
    if (kvt_write_full(cmd_fd, &cmd, sizeof(cmd)) || kvt_read_full(ack_fd, &a, 1) || a != 'k' ||
        (b->fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC)) < 0) {
        snprintf(err, errcap, "tcp baseline: the prefill process could not connect");
        close(lfd);
        return -1;
    }
    close(lfd);
    return 0;
}

static void b_base_close(b_base_t *b)
{
    if (b->fd >= 0)
        close(b->fd);
    b_free_touched(b->src, b->cap);
    b_free_touched(b->dst, b->cap);
    memset(b, 0, sizeof(*b));
}

/* One baseline request of `bytes`; *ns_p gets its time. */
static int b_base_rep(b_base_t *b, uint64_t bytes, int cmd_fd, int ack_fd, uint64_t *ns_p,
                      char *err, size_t errcap)
{
    if (bytes > b->cap) {
        b_free_touched(b->src, b->cap);
        b_free_touched(b->dst, b->cap);
        b->src = b->kind == 1 ? b_alloc_touched(bytes, 0x11) : NULL;
        b->dst = b_alloc_touched(bytes, 0x22);
        b->cap = bytes;
        if (!b->dst || (b->kind == 1 && !b->src)) {
            snprintf(err, errcap, "baseline: cannot allocate %llu bytes",
                     (unsigned long long)bytes);
            return -1;
        }
    }
    if (b->kind == 1) {
        uint64_t t0 = b_now();
        memcpy(b->dst, b->src, bytes);
        *ns_p = b_now() - t0;
        __asm__ __volatile__("" ::"r"(b->dst) : "memory");
        return 0;
    }
    b_cmd_t cmd = {.op = B_OP_TCP_SEND, .tokens = bytes};
    char a = 0;
    if (kvt_write_full(cmd_fd, &cmd, sizeof(cmd)) || kvt_read_full(ack_fd, &a, 1) || a != 'k') {
        snprintf(err, errcap, "tcp baseline: the prefill process failed");
        return -1;
    }
    uint64_t t0 = b_now();
    if (kvt_write_full(b->fd, &bytes, sizeof(bytes))) {
        snprintf(err, errcap, "tcp baseline: send: %s", strerror(errno));
        return -1;
    }
    for (uint64_t off = 0; off < bytes;) {
        ssize_t n = read(b->fd, b->dst + off, (size_t)(bytes - off));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            snprintf(err, errcap, "tcp baseline: the stream ended");
            return -1;
        }
        off += (uint64_t)n;
    }
    *ns_p = b_now() - t0;
    return 0;
}

static int b_decode_main(const b_job_t *j, const char *bs, int cmd_fd, int ack_fd, b_result_t *res)
{
    const bench_cfg_t *c = j->c;
    const kvt_model_t *m = j->m;
    b_inst_t in;
    int rc = 0;
    uint64_t tp = b_now();
    if (b_inst_build(c, m, j->topo.dtp, !c->decode_anon, &in, res->err, sizeof(res->err)) ||
        b_contexts(c, j->transport, &in, false, j->topo.ptp, bs, NULL, 0, res->err,
                   sizeof(res->err))) {
        b_inst_free(&in);
        return -1;
    }
    (void)prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0); /* this thread's sleeps only */
    uint64_t window = cli_swa_window(m);
    uint64_t room = 1;
    res->phase_ns[0] = b_now() - tp;
    tp = b_now();

    /* Progress on stderr, one line per phase (the results follow on stdout). */
    const char *tl = j->transport, *tn = j->topo.name;
    /* Memory per in-flight room first, while the heap is fresh. */
    if (j->do_mem && c->mem_rooms) {
        fprintf(stderr, "bench: %s %s: decode memory per room (%u rooms posted, then "
                "destroyed, twice)\n", tl, tn, c->mem_rooms);
        uint64_t lens[2] = {c->lengths[0], c->lengths[0]};
        for (uint32_t i = 0; i < c->num_lengths; i++) {
            lens[0] = B_MIN(lens[0], c->lengths[i]);
            lens[1] = B_MAX(lens[1], c->lengths[i]);
        }
        for (uint32_t i = 0; i < 2 && rc == 0; i++) {
            char what[160];
            snprintf(what, sizeof(what), "%s %s: decode memory per room, %u rooms of %llu "
                     "tokens (%u of 2)", tl, tn, c->mem_rooms, (unsigned long long)lens[i], i + 1);
            cli_ticker_t *tk = cli_ticker_start("bench", 5, 0, what);
            rc = b_decode_mem(c, m, &in, lens[i], c->mem_rooms, 1000000000ull + i * 100000,
                              &res->mem[i], res->err, sizeof(res->err));
            cli_ticker_stop(tk);
            if (rc == 0)
                res->num_mem = i + 1;
        }
    }

    res->phase_ns[1] = b_now() - tp;
    tp = b_now();
    b_pages_t pg;
    memset(&pg, 0, sizeof(pg));
    if (rc == 0 && b_pages_init(&pg, in.full_pages, in.swa_pages)) {
        snprintf(res->err, sizeof(res->err), "out of memory");
        rc = -1;
    }
    kvw_receiver_h *rcv = calloc(in.n, sizeof(*rcv));
    b_base_t base;
    if (b_base_open(j->transport, cmd_fd, ack_fd, &base, res->err, sizeof(res->err)))
        rc = -1;
    /* Lengths run in ascending order; the previous length's rate predicts this one's. */
    double last_gbps = 0;
    uint64_t last_bytes = 0, last_tokens = 0;
    for (uint32_t li = 0; li < c->num_lengths && rc == 0; li++) {
        uint64_t n = c->lengths[li];
        fprintf(stderr, "bench: %s %s: %llu tokens, up to %u reps and %.1f s (length %u of "
                "%u)\n", tl, tn, (unsigned long long)n, c->reps, c->budget_ns / 1e9, li + 1,
                c->num_lengths);
        b_len_result_t *lr = &res->len[li];
        lr->tokens = n;
        res->num_lengths = li + 1;
        if (b_pages_set(&pg, n, c->page, window, 0, 0, b_has_state(m) ? 0 : -1)) {
            snprintf(res->err, sizeof(res->err), "decode pool too small for %llu tokens",
                     (unsigned long long)n);
            rc = -1;
            break;
        }
        double pred_ns = last_gbps > 0 ? (double)last_bytes * n / last_tokens / last_gbps : 0;
        if (pred_ns > 2.0 * (double)c->budget_ns) {
            lr->skipped_pred_ns = (uint64_t)pred_ns;
            continue;
        }
        /* An untimed warm-up request first (the shm sender maps the decode memory on first
         * use; caches), unless one request is predicted to take long enough that such
         * effects do not show. */
        bool warm = pred_ns < 250e6;
        uint64_t t_len = b_now();
        for (int rep = warm ? -1 : 0; rep < (int)c->reps && rc == 0; rep++) {
            /* Slow paths: stop after the time budget, keeping at least one timed rep. */
            if (rep > 0 && b_now() - t_len > c->budget_ns)
                break;
            uint64_t id = room++;
            b_cmd_t cmd = {.op = B_OP_ARM, .room = id, .tokens = n};
            char a = 0;
            if (kvt_write_full(cmd_fd, &cmd, sizeof(cmd)) || kvt_read_full(ack_fd, &a, 1) ||
                a != 'k') {
                snprintf(res->err, sizeof(res->err),
                         "the prefill process failed to arm room %llu (%llu tokens)",
                         (unsigned long long)id, (unsigned long long)n);
                rc = -1;
                break;
            }
            for (uint32_t k = 0; k < in.n && rc == 0; k++)
                if (kvw_receiver_create(in.ctx[k], id, 0, &rcv[k]) != KVW_OK) {
                    snprintf(res->err, sizeof(res->err), "receiver room %llu: %s",
                             (unsigned long long)id, kvw_last_error());
                    rc = -1;
                }
            if (rc) {
                for (uint32_t k = 0; k < in.n; k++) {
                    kvw_room_destroy(kvw_receiver_room(rcv[k]));
                    rcv[k] = NULL;
                }
                break;
            }
            kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = n,
                                    .prefix_len = 0, .pages = pg.side};
            uint64_t t0 = b_now();
            for (uint32_t k = 0; k < in.n && rc == 0; k++)
                if (kvw_receiver_post(rcv[k], &post) != KVW_OK) {
                    snprintf(res->err, sizeof(res->err), "post room %llu: %s",
                             (unsigned long long)id, kvw_last_error());
                    rc = -1;
                }
            if (rc == 0)
                rc = b_wait_receivers(rcv, in.n, id, res->err, sizeof(res->err));
            uint64_t t1 = b_now();
            uint64_t bytes = 0;
            for (uint32_t k = 0; k < in.n; k++) {
                kvw_room_metrics_t mt = {.field_mask = KVW_ROOM_METRICS_FIELDS_ALL};
                kvw_room_metrics(kvw_receiver_room(rcv[k]), &mt);
                bytes += mt.bytes;
                kvw_room_destroy(kvw_receiver_room(rcv[k]));
                rcv[k] = NULL;
            }
            if (rc == 0 && rep >= 0) {
                lr->bytes = bytes;
                lr->ns[rep] = t1 - t0;
                lr->reps = (uint32_t)rep + 1;
            }
            /* The baseline of the same bytes, right after (the warm-up too). */
            uint64_t bns = 0;
            if (rc == 0 && base.kind &&
                (rc = b_base_rep(&base, bytes, cmd_fd, ack_fd, &bns, res->err,
                                 sizeof(res->err))) == 0 &&
                rep >= 0) {
                lr->base_ns[rep] = bns;
                lr->base_reps = (uint32_t)rep + 1;
            }
        }
        if (lr->reps) {
            last_bytes = lr->bytes;
            last_tokens = n;
            last_gbps = b_gbps(lr->bytes, cli_median(lr->ns, lr->reps));
        }
    }
    free(rcv);
    b_base_close(&base);
    res->phase_ns[2] = b_now() - tp;
    tp = b_now();
    if (rc == 0 && j->do_rate && c->rate_rooms)
        fprintf(stderr, "bench: %s %s: control-plane rate, %u one-token rooms, %u in flight\n",
                tl, tn, c->rate_rooms, c->rate_inflight);
    if (rc == 0 && j->do_rate && c->rate_rooms)
        rc = b_decode_rate(c, m, &in, cmd_fd, ack_fd, 2000000000ull, res, res->err,
                           sizeof(res->err));
    res->phase_ns[3] = b_now() - tp;
    /* Closing the decode contexts while a prefill room has not yet seen its own SUCCESS
     * would fail that room there: wait until the prefill process says it is done. */
    b_cmd_t quit = {.op = B_OP_QUIT};
    char qa;
    if (kvt_write_full(cmd_fd, &quit, sizeof(quit)) == 0)
        (void)kvt_read_full(ack_fd, &qa, 1);
    if (pg.full || pg.swa)
        b_pages_free(&pg);
    for (uint32_t i = 0; c->metrics && i < in.n; i++)
        cli_print_metrics(stdout, "decode", i, in.ctx[i]);
    b_inst_free(&in);
    return rc;
}

/* Runs one (transport, topology) pair of processes; fills *res. Returns 0 when both
 * processes ran to the end. */
static int b_run_pair(const b_job_t *j, b_result_t *res)
{
    memset(res, 0, sizeof(*res));
    int bs_pipe[2], cmd_pipe[2], ack_pipe[2], res_pipe[2];
    if (pipe(bs_pipe) || pipe(cmd_pipe) || pipe(ack_pipe) || pipe(res_pipe)) {
        snprintf(res->err, sizeof(res->err), "pipe: %s", strerror(errno));
        return -1;
    }
    fflush(stdout);
    fflush(stderr);
    pid_t pf = fork();
    if (pf < 0) {
        snprintf(res->err, sizeof(res->err), "fork: %s", strerror(errno));
        return -1;
    }
    if (pf == 0) {
        close(bs_pipe[0]);
        close(cmd_pipe[1]);
        close(ack_pipe[0]);
        close(res_pipe[0]);
        close(res_pipe[1]);
        exit(b_prefill_main(j, bs_pipe[1], cmd_pipe[0], ack_pipe[1]));
    }
    close(bs_pipe[1]);
    close(cmd_pipe[0]);
    close(ack_pipe[1]);
    char bs[160] = "";
    int got = kvt_read_full(bs_pipe[0], bs, sizeof(bs));
    close(bs_pipe[0]);
    if (got || !bs[0]) {
        close(cmd_pipe[1]);
        close(ack_pipe[0]);
        close(res_pipe[0]);
        close(res_pipe[1]);
        waitpid(pf, NULL, 0);
        snprintf(res->err, sizeof(res->err), "the prefill process did not start (%s)",
                 j->transport);
        return -1;
    }
    pid_t pd = fork();
    if (pd < 0) {
        snprintf(res->err, sizeof(res->err), "fork: %s", strerror(errno));
        close(cmd_pipe[1]);
        waitpid(pf, NULL, 0);
        return -1;
    }
    if (pd == 0) {
        close(res_pipe[0]);
        b_result_t *r = calloc(1, sizeof(*r));
        int rc = r ? b_decode_main(j, bs, cmd_pipe[1], ack_pipe[0], r) : -1;
        if (r) {
            r->ok = rc == 0;
            if (kvt_write_full(res_pipe[1], r, sizeof(*r)))
                rc = -1;
        }
        close(cmd_pipe[1]);
        exit(rc == 0 ? 0 : 1);
    }
    close(res_pipe[1]);
    close(cmd_pipe[1]);
    close(ack_pipe[0]);
    int rr = kvt_read_full(res_pipe[0], res, sizeof(*res));
    close(res_pipe[0]);
    int sd = 0, sp = 0;
    waitpid(pd, &sd, 0);
    waitpid(pf, &sp, 0);
    if (rr) {
        memset(res, 0, sizeof(*res));
        snprintf(res->err, sizeof(res->err), "the decode process ended without a result");
        return -1;
    }
    if (!(WIFEXITED(sp) && WEXITSTATUS(sp) == 0) && res->ok) {
        res->ok = 0;
        snprintf(res->err, sizeof(res->err), "the prefill process failed (status %d)", sp);
    }
    return res->ok ? 0 : -1;
}

/* ------------------------------------------------------------ baselines */

/* ucx_perftest ucp_put_bw between a server and a client on this host: GB/s, or < 0. */
static double b_ucx_perftest(uint64_t bytes, uint16_t port)
{
    char portstr[16];
    snprintf(portstr, sizeof(portstr), "%u", port);
    fflush(stdout);
    pid_t srv = fork();
    if (srv == 0) {
        int nul = open("/dev/null", O_WRONLY);
        if (nul >= 0) {
            dup2(nul, STDOUT_FILENO);
            dup2(nul, STDERR_FILENO);
        }
        execlp("ucx_perftest", "ucx_perftest", "-p", portstr, (char *)NULL);
        _exit(127);
    }
    if (srv < 0)
        return -1;
    b_sleep_ns(200 * 1000 * 1000); /* the server starts listening */
    uint64_t iters = B_MAX(3, B_MIN(100, (256ull << 20) / B_MAX(bytes, 1)));
    char cmd[256];
    snprintf(cmd, sizeof(cmd),
             "timeout 60 ucx_perftest 127.0.0.1 -p %u -t ucp_put_bw -s %llu -n %llu -w 2 "
             "2>/dev/null",
             port, (unsigned long long)bytes, (unsigned long long)iters);
    FILE *f = popen(cmd, "r");
    double mbs = -1;
    char line[512];
    while (f && fgets(line, sizeof(line), f)) {
        double it, p50, avg, ovh, bwa, bwo;
        if (sscanf(line, "Final: %lf %lf %lf %lf %lf %lf", &it, &p50, &avg, &ovh, &bwa, &bwo) == 6)
            mbs = bwo;
    }
    if (f)
        pclose(f);
    kill(srv, SIGTERM);
    waitpid(srv, NULL, 0);
    return mbs < 0 ? -1 : mbs * 1048576.0 / 1e9; /* ucx_perftest's MB is 2^20 bytes */
}

/* ------------------------------------------------------------ plan memory */

typedef struct b_plan_row {
    char topo[32];
    uint64_t tokens;
    uint32_t full_pages;
    uint64_t bytes, runs, segments, plan_bytes, plan_bytes_random;
} b_plan_row_t;

/* Plan of (prefill rank 0 -> decode rank 0) on describe-only ranks. */
static int b_plan_memory(const bench_cfg_t *c, const kvt_model_t *m, const bench_topo_t *t,
                         b_plan_row_t *rows, char *err, size_t errcap)
{
    kvt_rank_t src, dst;
    b_sizes_t sz = b_pool_sizes(c, m);
    kvt_rank_spec_t s = {.model = m, .layout = KVW_LAYOUT_NHD, .page_size = {c->page, c->page},
                         .num_pages = {sz.full_pages, sz.swa_pages}, .num_slots = sz.slots,
                         .describe_only = 1};
    s.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = t->ptp,
                             .tp_rank = 0, .pp_size = 1,
                             .layer_end = m->m.num_layers, .dp_size = 1};
    if (kvt_rank_build(&s, &src) != KVW_OK) {
        snprintf(err, errcap, "plan memory: prefill rank: %s", kvw_last_error());
        return -1;
    }
    s.par.tp_size = t->dtp;
    if (kvt_rank_build(&s, &dst) != KVW_OK) {
        snprintf(err, errcap, "plan memory: decode rank: %s", kvw_last_error());
        kvt_rank_free(&src);
        return -1;
    }
    uint64_t window = cli_swa_window(m);
    b_pages_t ps, pd;
    int rc = b_pages_init(&ps, sz.full_pages, sz.swa_pages) ||
                     b_pages_init(&pd, sz.full_pages, sz.swa_pages)
                 ? -1
                 : 0;
    kvt_rng_t rng = {12345};
    for (uint32_t i = 0; i < c->num_lengths && rc == 0; i++) {
        uint64_t n = c->lengths[i];
        b_plan_row_t *row = &rows[i];
        memset(row, 0, sizeof(*row));
        snprintf(row->topo, sizeof(row->topo), "%s", t->name);
        row->tokens = n;
        int64_t slot = b_has_state(m) ? 0 : -1;
        b_pages_set(&ps, n, c->page, window, 0, 0, slot);
        b_pages_set(&pd, n, c->page, window, 0, 0, slot);
        row->full_pages = ps.side.full.num_pages;
        kvw_chunk_t ch = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = n, .chunk_begin = 0,
                          .chunk_end = n, .last_chunk = 1};
        kvw_plan_h plan;
        kvw_plan_stats_t st = {.field_mask = KVW_PLAN_STATS_FIELDS_ALL};
        if (kvw_plan_create(src.h, dst.h, &ch, &ps.side, &pd.side, &plan) != KVW_OK ||
            kvw_plan_stats(plan, &st) != KVW_OK) {
            snprintf(err, errcap, "plan memory (%s, %llu tokens): %s", t->name,
                     (unsigned long long)n, kvw_last_error());
            rc = -1;
            break;
        }
        row->bytes = st.bytes;
        row->runs = st.runs_coalesced;
        row->segments = st.num_segments;
        row->plan_bytes = st.plan_bytes;
        kvw_plan_destroy(plan);
        /* The same request through randomly scattered pages (nothing coalesces). */
        kvt_pages_random(&rng, sz.full_pages, pd.side.full.num_pages, pd.full);
        kvt_pages_random(&rng, sz.swa_pages, pd.side.swa.num_pages, pd.swa);
        if (kvw_plan_create(src.h, dst.h, &ch, &ps.side, &pd.side, &plan) == KVW_OK) {
            if (kvw_plan_stats(plan, &st) == KVW_OK)
                row->plan_bytes_random = st.plan_bytes;
            kvw_plan_destroy(plan);
        }
    }
    b_pages_free(&ps);
    b_pages_free(&pd);
    kvt_rank_free(&src);
    kvt_rank_free(&dst);
    return rc;
}

/* ------------------------------------------------------------ report */

typedef struct b_row {
    char transport[16];
    char topo[32];
    const char *kind;
    uint64_t tokens, bytes;
    uint32_t reps;
    double gbps;
    double gbps_reps[B_MAX_REPS];
    const char *baseline; /* name, or NULL */
    double base_gbps;     /* < 0: none */
} b_row_t;

typedef struct b_rate_row {
    char transport[16];
    char topo[32];
    uint32_t rooms, inflight;
    double seconds, rooms_per_s, p50_us, p99_us;
    /* per room: CPU of the library's threads (process minus the bench's own thread, which
     * calls the API and polls) and of the bench's thread; context switches */
    double cpu_us_decode, cpu_us_prefill, main_us_decode, main_us_prefill;
    double csw_decode, csw_prefill;
} b_rate_row_t;

typedef struct b_report {
    b_row_t rows[B_MAX_TL * B_MAX_TOPO * B_MAX_LEN];
    uint32_t num_rows;
    b_rate_row_t rate[B_MAX_TL];
    uint32_t num_rate;
    b_mem_result_t mem[2];
    uint32_t num_mem;
    char mem_transport[16], mem_topo[32];
    uint32_t mem_dtp;
    b_plan_row_t plan[B_MAX_TOPO * B_MAX_LEN];
    uint32_t num_plan;
    char notes[B_MAX_NOTES][320];
    uint32_t num_notes;
    /* baselines per transport and byte count */
    struct {
        char transport[16];
        char topo[32]; /* the topology whose byte count it matches first */
        const char *name;
        uint64_t tokens, bytes;
        double gbps;
    } base[B_MAX_BASE];
    uint32_t num_base;
} b_report_t;

static void b_note(b_report_t *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void b_note(b_report_t *r, const char *fmt, ...)
{
    if (r->num_notes >= B_MAX_NOTES)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->notes[r->num_notes++], sizeof(r->notes[0]), fmt, ap);
    va_end(ap);
}

static int b_write_json(const char *path, const bench_cfg_t *c, const kvt_model_t *m,
                        const char *cmdline, const b_report_t *r)
{
    FILE *f = fopen(path, "w");
    if (!f)
        return -1;
    fprintf(f, "{\n  \"command\": ");
    cli_json_str(f, cmdline);
    fprintf(f, ",\n  \"model\": ");
    cli_json_str(f, c->model);
    fprintf(f, ",\n  \"layers\": %u,\n  \"kv_heads\": %u,\n  \"page_size\": %u,\n"
               "  \"reps\": %u,\n  \"cpus\": %ld,\n  \"decode_memory\": \"%s\",\n",
            m->m.num_layers, m->m.num_kv_heads, c->page, c->reps, sysconf(_SC_NPROCESSORS_ONLN),
            c->decode_anon ? "anonymous" : "kvw_mem_alloc_shared");
    fprintf(f, "  \"throughput\": [\n");
    for (uint32_t i = 0; i < r->num_rows; i++) {
        const b_row_t *w = &r->rows[i];
        fprintf(f, "    {\"transport\": \"%s\", \"topology\": \"%s\", \"kind\": \"%s\", "
                   "\"tokens\": %llu, \"bytes\": %llu, \"reps\": %u, ",
                w->transport, w->topo, w->kind, (unsigned long long)w->tokens,
                (unsigned long long)w->bytes, w->reps);
        if (w->reps)
            fprintf(f, "\"gbps\": %.4f, \"seconds\": %.6f, \"gbps_reps\": [", w->gbps,
                    w->bytes / w->gbps / 1e9);
        else
            fprintf(f, "\"gbps\": null, \"seconds\": null, \"gbps_reps\": [");
        for (uint32_t k = 0; k < w->reps; k++)
            fprintf(f, "%s%.4f", k ? ", " : "", w->gbps_reps[k]);
        fprintf(f, "], \"baseline\": ");
        if (w->reps && w->baseline && w->base_gbps > 0)
            fprintf(f, "\"%s\", \"baseline_gbps\": %.4f, \"ratio\": %.4f}", w->baseline,
                    w->base_gbps, w->gbps / w->base_gbps);
        else
            fprintf(f, "null, \"baseline_gbps\": null, \"ratio\": null}");
        fprintf(f, "%s\n", i + 1 < r->num_rows ? "," : "");
    }
    fprintf(f, "  ],\n  \"baselines\": [\n");
    for (uint32_t i = 0; i < r->num_base; i++)
        fprintf(f, "    {\"transport\": \"%s\", \"name\": \"%s\", \"topology\": \"%s\", "
                   "\"tokens\": %llu, \"bytes\": %llu, \"gbps\": %.4f}%s\n",
                r->base[i].transport, r->base[i].name, r->base[i].topo,
                (unsigned long long)r->base[i].tokens,
                (unsigned long long)r->base[i].bytes, r->base[i].gbps,
                i + 1 < r->num_base ? "," : "");
    fprintf(f, "  ],\n  \"control_plane\": [\n");
    for (uint32_t i = 0; i < r->num_rate; i++)
        fprintf(f, "    {\"transport\": \"%s\", \"topology\": \"%s\", \"rooms\": %u, "
                   "\"in_flight\": %u, \"tokens_per_room\": 1, \"seconds\": %.4f, "
                   "\"rooms_per_s\": %.1f, \"latency_p50_us\": %.1f, \"latency_p99_us\": %.1f, "
                   "\"library_threads_cpu_us_per_room_decode\": %.1f, "
                   "\"library_threads_cpu_us_per_room_prefill\": %.1f, "
                   "\"bench_thread_cpu_us_per_room_decode\": %.1f, "
                   "\"bench_thread_cpu_us_per_room_prefill\": %.1f, "
                   "\"context_switches_per_room_decode\": %.2f, "
                   "\"context_switches_per_room_prefill\": %.2f}%s\n",
                r->rate[i].transport, r->rate[i].topo, r->rate[i].rooms, r->rate[i].inflight,
                r->rate[i].seconds, r->rate[i].rooms_per_s, r->rate[i].p50_us, r->rate[i].p99_us,
                r->rate[i].cpu_us_decode, r->rate[i].cpu_us_prefill, r->rate[i].main_us_decode,
                r->rate[i].main_us_prefill, r->rate[i].csw_decode,
                r->rate[i].csw_prefill, i + 1 < r->num_rate ? "," : "");
    fprintf(f, "  ],\n  \"plan_memory\": [\n");
    for (uint32_t i = 0; i < r->num_plan; i++) {
        const b_plan_row_t *p = &r->plan[i];
        fprintf(f, "    {\"topology\": \"%s\", \"pair\": \"prefill rank 0 -> decode rank 0\", "
                   "\"tokens\": %llu, \"full_pages\": %u, \"payload_bytes\": %llu, "
                   "\"segments\": %llu, \"runs_coalesced\": %llu, \"plan_bytes\": %llu, "
                   "\"plan_bytes_random_pages\": %llu}%s\n",
                p->topo, (unsigned long long)p->tokens, p->full_pages,
                (unsigned long long)p->bytes, (unsigned long long)p->segments,
                (unsigned long long)p->runs, (unsigned long long)p->plan_bytes,
                (unsigned long long)p->plan_bytes_random, i + 1 < r->num_plan ? "," : "");
    }
    fprintf(f, "  ],\n  \"decode_room_memory\": [\n");
    for (uint32_t i = 0; i < r->num_mem; i++) {
        const b_mem_result_t *mm = &r->mem[i];
        fprintf(f, "    {\"transport\": \"%s\", \"topology\": \"%s\", \"decode_ranks\": %u, "
                   "\"tokens\": %llu, \"full_pages\": %u, \"swa_pages\": %u, \"rooms\": %u, "
                   "\"rss_bytes_per_room\": %.1f, \"heap_bytes_per_room\": %.1f}%s\n",
                r->mem_transport, r->mem_topo, r->mem_dtp, (unsigned long long)mm->tokens,
                mm->full_pages, mm->swa_pages, mm->rooms, (double)mm->rss_delta / mm->rooms,
                (double)mm->heap_delta / mm->rooms, i + 1 < r->num_mem ? "," : "");
    }
    fprintf(f, "  ],\n  \"notes\": [");
    for (uint32_t i = 0; i < r->num_notes; i++) {
        fprintf(f, "%s\n    ", i ? "," : "");
        cli_json_str(f, r->notes[i]);
    }
    fprintf(f, "%s]\n}\n", r->num_notes ? "\n  " : "");
    return fclose(f) ? -1 : 0;
}

static bool b_have_gnuplot(void)
{
    return system("command -v gnuplot >/dev/null 2>&1") == 0;
}

/*
 * Throughput vs request length, log-log: one colour per transport; its topologies as
 * solid lines with different points, its baseline dashed in the same colour.
 */
static int b_chart(const char *png, const b_report_t *r, const char *title,
                   const bench_cfg_t *c, const bench_topo_t *topos, uint32_t num_topo)
{
    static const char *const colour[B_MAX_TL] = {"#6a3d9a", "#1f78b4", "#e66101", "#33a02c"};
    static const int point[B_MAX_TOPO] = {7, 5};
    fflush(stdout);
    fflush(stderr);
    FILE *g = popen("gnuplot", "w");
    if (!g)
        return -1;
    fprintf(g, "set terminal pngcairo size 1250,650 font 'sans,10'\n");
    fprintf(g, "set output '%s'\n", png);
    fprintf(g, "set title '%s'\nset termoption noenhanced\n", title);
    fprintf(g, "set logscale x 2\nset logscale y 10\nset xlabel 'request length (tokens)'\n"
               "set ylabel 'GB/s: payload / (decode post -> SUCCESS), median'\n"
               "set key outside right top vertical\nset grid\n");
    /* Data blocks: $s<t>_<k> for transport t, topology k; $b<t> for its baseline. */
    char plot[4096] = "";
    size_t pl = 0;
    for (uint32_t t = 0; t < c->num_tl; t++) {
        for (uint32_t k = 0; k <= num_topo; k++) {
            bool base = k == num_topo;
            uint32_t n = 0;
            const char *bname = NULL;
            fprintf(g, "$s%u_%u << EOD\n", t, k);
            if (!base) {
                for (uint32_t i = 0; i < r->num_rows; i++)
                    if (!strcmp(r->rows[i].transport, c->transports[t]) &&
                        !strcmp(r->rows[i].topo, topos[k].name) && r->rows[i].reps) {
                        fprintf(g, "%llu %.4f\n", (unsigned long long)r->rows[i].tokens,
                                r->rows[i].gbps);
                        n++;
                    }
            } else {
                for (uint32_t i = 0; i < r->num_base; i++)
                    if (!strcmp(r->base[i].transport, c->transports[t]) &&
                        !strcmp(r->base[i].topo, topos[0].name)) {
                        fprintf(g, "%llu %.4f\n", (unsigned long long)r->base[i].tokens,
                                r->base[i].gbps);
                        bname = r->base[i].name;
                        n++;
                    }
            }
            fprintf(g, "EOD\n");
            if (n == 0 || pl >= sizeof(plot) - 256)
                continue;
            if (!base)
                pl += (size_t)snprintf(plot + pl, sizeof(plot) - pl,
                                       "%s$s%u_%u using 1:2 with linespoints lw 2 pt %d ps 1.2 "
                                       "lc rgb '%s' title '%s %s (%s)'",
                                       pl ? ", " : "", t, k, point[k], colour[t],
                                       c->transports[t], topos[k].name, topos[k].kind);
            else
                pl += (size_t)snprintf(plot + pl, sizeof(plot) - pl,
                                       "%s$s%u_%u using 1:2 with linespoints lw 1.5 dt 2 pt 6 "
                                       "lc rgb '%s' title '%s %s: %s'",
                                       pl ? ", " : "", t, k, colour[t], c->transports[t],
                                       strcmp(c->transports[t], "ucx") ? "baseline" : "reference",
                                       bname);
        }
    }
    if (pl)
        fprintf(g, "plot %s\n", plot);
    int st = pclose(g);
    return pl && st == 0 ? 0 : -1;
}

/*
 * The ucx reference for each byte count (shm and tcp baselines run inside the pair):
 * fills gbps[i] (< 0: none) and returns its name, or NULL.
 */
static const char *b_ucx_reference(const uint64_t *bytes, uint32_t n, bool quick,
                                   uint16_t *ucx_port, double *gbps, b_report_t *rep)
{
    if (system("command -v ucx_perftest >/dev/null 2>&1") != 0) {
        b_note(rep, "ucx: ucx_perftest not installed (Debian ucx-utils); no reference");
        return NULL;
    }
    /* ucx_perftest spends seconds setting up buffers of 100 MB. */
    for (uint32_t i = 0; i < n; i++)
        if (!quick || bytes[i] <= (16u << 20))
            gbps[i] = b_ucx_perftest(bytes[i], (*ucx_port)++);
        else
            b_note(rep, "ucx reference of %llu bytes skipped with --quick (ucx_perftest takes "
                        "seconds to set up that much memory)", (unsigned long long)bytes[i]);
    b_note(rep, "ucx reference: ucx_perftest -t ucp_put_bw on localhost (its own, cache-hot "
                "buffers, measured after the pair): a reference, not a like-for-like baseline");
    return "ucx_perftest ucp_put_bw";
}

/* ------------------------------------------------------------ driver */

static void b_usage(FILE *f)
{
    fprintf(f,
            "usage: kvwire bench [options]\n"
            "  --gpu                 KV caches in GPU memory (kvwire bench --gpu --help)\n"
            "  --latency             small-room latency against the raw round trip\n"
            "                        (kvwire bench --latency --help)\n"
            "  --stream              layer-wise streaming against sending after the forward\n"
            "                        pass (kvwire bench --stream --help)\n"
            "  --transport LIST      shm, tcp, ucx, a comma list, or all (default: all compiled in)\n"
            "  --model NAME          model preset (default gpt-oss-120b)\n"
            "  --layers N            keep the first N layers (default 12; 0 = all)\n"
            "  --prefill-tp S        prefill TP size (default 1)\n"
            "  --decode-tp D         decode TP size of the second topology (default 4);\n"
            "                        topologies: TP S -> TP S (whole pages) and TP S -> TP D\n"
            "  --lengths LIST        request lengths in tokens (default 64,256,1024,4096,8192)\n"
            "  --reps N              timed requests per length (default 5), after one untimed\n"
            "                        warm-up request of the longest length\n"
            "  --budget-ms N         stop repeating a length after N ms, keeping at least one\n"
            "                        timed request (default 4000; --quick 1000)\n"
            "  --page-size N         tokens per page on both sides (default 64)\n"
            "  --rate-rooms N        1-token rooms in the control-plane run (default 2000)\n"
            "  --rate-inflight N     rooms in flight in that run (default 64)\n"
            "  --mem-rooms N         rooms posted to measure decode memory per room (default 1000)\n"
            "  --decode-mem KIND     shared (kvw_mem_alloc_shared, default) or anon (malloc-like;\n"
            "                        shm then writes with process_vm_writev)\n"
            "  --json PATH           JSON results (default bench-results.json)\n"
            "  --png PATH            chart (default bench-results.png; needs gnuplot)\n"
            "  --metrics             print each context's metrics (kvw_ctx_metrics) at the end\n"
            "                        of its run (per transport and topology)\n"
            "  --quick               lengths 64,1024,4096, 3 reps, 500 rate rooms, 200 memory\n"
            "                        rooms, 1 s budget (about 20 s on an idle 2-core host)\n"
            "Each request runs alone: decode posts, prefill sends one chunk, decode waits until\n"
            "SUCCESS (kvw_room_wait); GB/s = payload bytes confirmed by the decode ranks / (post -> SUCCESS),\n"
            "median of the reps. After each request, the same bytes through the transport's\n"
            "baseline: shm = one memcpy between pre-faulted buffers, tcp = a plain socket\n"
            "stream over 127.0.0.1 between the two processes (4 MiB writes); ucx: ucx_perftest\n"
            "ucp_put_bw, run afterwards, as a reference. Exits 0 when the benchmark ran,\n"
            "whatever the figures; 1 on errors; 2 on bad options.\n");
}

static int b_parse_lengths(const char *s, bench_cfg_t *c)
{
    c->num_lengths = 0;
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", s);
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        char *end;
        unsigned long long v = strtoull(t, &end, 10);
        if (*end || v == 0 || c->num_lengths >= B_MAX_LEN)
            return -1;
        c->lengths[c->num_lengths++] = v;
    }
    return c->num_lengths ? 0 : -1;
}

static bool b_tl_compiled(const char *name)
{
    for (const char *const *n = kvw_transport_names(); *n; n++)
        if (!strcmp(*n, name))
            return true;
    return false;
}

int kvw_bench_gpu(int argc, char **argv); /* cmd_bench_gpu.c */

static int cmd_bench(int argc, char **argv)
{
    /* KV caches in GPU memory, small-room latency and layer-wise streaming: separate
     * benchmarks with their own options. */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--gpu"))
            return kvw_bench_gpu(argc, argv);
        if (!strcmp(argv[i], "--latency"))
            return kvw_bench_latency(argc, argv);
        if (!strcmp(argv[i], "--stream"))
            return kvw_bench_stream(argc, argv);
    }
    bench_cfg_t c = {.model = "gpt-oss-120b", .layers = 12, .ptp = 1, .dtp = 4,
                     .lengths = {64, 256, 1024, 4096, 8192}, .num_lengths = 5, .reps = 5,
                     .page = 64, .rate_rooms = 2000, .rate_inflight = 64, .mem_rooms = 1000,
                     .json = "bench-results.json", .png = "bench-results.png",
                     .timeout_ms = 30000, .budget_ns = 4000000000ull};
    char tl_arg[128] = "all";
    bool set_lengths = false, set_reps = false, set_rate = false, set_mem = false,
         set_budget = false;
    static const struct option opts[] = {
        {"transport", 1, 0, 't'},   {"model", 1, 0, 'm'},         {"layers", 1, 0, 'L'},
        {"prefill-tp", 1, 0, 'p'},  {"decode-tp", 1, 0, 'd'},     {"lengths", 1, 0, 'l'},
        {"reps", 1, 0, 'r'},        {"page-size", 1, 0, 's'},     {"rate-rooms", 1, 0, 'R'},
        {"rate-inflight", 1, 0, 'I'}, {"mem-rooms", 1, 0, 'M'},   {"decode-mem", 1, 0, 'D'},
        {"json", 1, 0, 'j'},        {"png", 1, 0, 'g'},           {"quick", 0, 0, 'q'},
        {"budget-ms", 1, 0, 'B'},   {"help", 0, 0, 'h'},          {"metrics", 0, 0, 'X'},
        {0, 0, 0, 0}};
    int o, bad = 0;
    uint32_t budget_ms = 0;
    optind = 1;
    while (!bad && (o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (o) {
        case 't': snprintf(tl_arg, sizeof(tl_arg), "%s", optarg); break;
        case 'm': snprintf(c.model, sizeof(c.model), "%s", optarg); break;
        case 'L': bad = cli_opt_u32("bench", "--layers", optarg, 0, KVT_MAX_LAYERS, &c.layers); break;
        case 'p': bad = cli_opt_u32("bench", "--prefill-tp", optarg, 1, 256, &c.ptp); break;
        case 'd': bad = cli_opt_u32("bench", "--decode-tp", optarg, 1, 256, &c.dtp); break;
        case 'l':
            if (b_parse_lengths(optarg, &c)) {
                fprintf(stderr, "bench: bad --lengths '%s' (at most %d positive numbers)\n",
                        optarg, B_MAX_LEN);
                return 2;
            }
            set_lengths = true;
            break;
        case 'r':
            bad = cli_opt_u32("bench", "--reps", optarg, 1, B_MAX_REPS, &c.reps);
            set_reps = true;
            break;
        case 's': bad = cli_opt_u32("bench", "--page-size", optarg, 1, 65536, &c.page); break;
        case 'R':
            bad = cli_opt_u32("bench", "--rate-rooms", optarg, 0, B_MAX_RATE, &c.rate_rooms);
            set_rate = true;
            break;
        case 'I':
            bad = cli_opt_u32("bench", "--rate-inflight", optarg, 1, 1024, &c.rate_inflight);
            break;
        case 'M':
            bad = cli_opt_u32("bench", "--mem-rooms", optarg, 0, 100000, &c.mem_rooms);
            set_mem = true;
            break;
        case 'D': {
            static const char *const kinds[] = {"shared", "anon", NULL};
            int k = 0;
            bad = cli_opt_choice("bench", "--decode-mem", optarg, kinds, &k);
            c.decode_anon = k == 1;
            break;
        }
        case 'j': snprintf(c.json, sizeof(c.json), "%s", optarg); break;
        case 'g': snprintf(c.png, sizeof(c.png), "%s", optarg); break;
        case 'q': c.quick = 1; break;
        case 'X': c.metrics = 1; break;
        case 'B':
            bad = cli_opt_u32("bench", "--budget-ms", optarg, 1, 3600000, &budget_ms);
            c.budget_ns = (uint64_t)budget_ms * 1000000ull, set_budget = true;
            break;
        case 'h': b_usage(stdout); return 0;
        default:
            fprintf(stderr, "bench: kvwire bench --help lists the options\n");
            return 2;
        }
    }
    if (cli_opts_end("bench", "kvwire bench --help", bad, optind, argc, argv))
        return 2;
    if (c.quick) {
        if (!set_lengths) {
            static const uint64_t ql[] = {64, 1024, 4096};
            memcpy(c.lengths, ql, sizeof(ql));
            c.num_lengths = 3;
        }
        if (!set_reps)
            c.reps = 3;
        if (!set_rate)
            c.rate_rooms = 500;
        if (!set_mem)
            c.mem_rooms = 200;
        if (!set_budget)
            c.budget_ns = 1000000000ull;
    }
    qsort(c.lengths, c.num_lengths, sizeof(c.lengths[0]), cli_cmp_u64);
    /* A process that dies early must show up as an error on the pipes, not kill us. */
    signal(SIGPIPE, SIG_IGN);
    if (!c.ptp || !c.dtp || !c.reps || c.reps > B_MAX_REPS || !c.page || !c.rate_inflight ||
        c.rate_rooms > B_MAX_RATE) {
        fprintf(stderr, "bench: need TP sizes > 0, 1..%d reps, a page size, 1+ rooms in flight "
                        "and at most %d rate rooms\n", B_MAX_REPS, B_MAX_RATE);
        return 2;
    }

    /* Transports. */
    const char *const *compiled = kvw_transport_names();
    if (!strcmp(tl_arg, "all")) {
        /* Same-host transports first: shm, tcp, then the others compiled in. */
        static const char *const order[] = {"shm", "tcp", "ucx"};
        for (size_t i = 0; i < 3; i++)
            if (b_tl_compiled(order[i]) && c.num_tl < B_MAX_TL)
                snprintf(c.transports[c.num_tl++], 16, "%s", order[i]);
        for (const char *const *n = compiled; *n && c.num_tl < B_MAX_TL; n++) {
            bool seen = false;
            for (uint32_t k = 0; k < c.num_tl; k++)
                seen |= !strcmp(c.transports[k], *n);
            if (!seen)
                snprintf(c.transports[c.num_tl++], 16, "%s", *n);
        }
    } else {
        char buf[128];
        snprintf(buf, sizeof(buf), "%s", tl_arg);
        for (char *save = NULL, *t = strtok_r(buf, ",", &save); t && c.num_tl < B_MAX_TL;
             t = strtok_r(NULL, ",", &save))
            snprintf(c.transports[c.num_tl++], 16, "%s", t);
    }
    b_report_t *rep = calloc(1, sizeof(*rep));
    if (!rep)
        return 1;
    /* Unknown names are an error; "ucx" without UCX support is skipped with a note. */
    {
        uint32_t k = 0;
        for (uint32_t i = 0; i < c.num_tl; i++) {
            if (b_tl_compiled(c.transports[i])) {
                memmove(c.transports[k++], c.transports[i], 16);
            } else if (!strcmp(c.transports[i], "ucx")) {
                b_note(rep, "ucx: not compiled into this build (kvwire info lists the transports); "
                            "skipped");
            } else {
                fprintf(stderr, "bench: unknown transport '%s' (compiled in:", c.transports[i]);
                for (const char *const *n = compiled; *n; n++)
                    fprintf(stderr, " %s", *n);
                fprintf(stderr, ")\n");
                free(rep);
                return 2;
            }
        }
        c.num_tl = k;
    }
    if (!strcmp(tl_arg, "all") && !b_tl_compiled("ucx"))
        b_note(rep, "ucx: not compiled into this build (kvwire info lists the transports); "
                    "skipped");

    kvt_model_t m;
    if (kvt_model_load("bench", c.model, 0, &m)) {
        free(rep);
        return 2;
    }
    uint32_t full_layers = m.m.num_layers;
    if (kvt_model_load("bench", c.model, c.layers, &m)) {
        free(rep);
        return 2;
    }
    uint32_t f0, n0;
    if (m.m.num_kv_heads && (kvw_topo_heads(c.ptp, 0, m.m.num_kv_heads, &f0, &n0) != KVW_OK ||
                             kvw_topo_heads(c.dtp, 0, m.m.num_kv_heads, &f0, &n0) != KVW_OK)) {
        fprintf(stderr, "bench: %s\n", kvw_last_error());
        free(rep);
        return 2;
    }
    bench_topo_t topos[B_MAX_TOPO];
    uint32_t num_topo = 0;
    topos[num_topo] = (bench_topo_t){c.ptp, c.ptp, "", "whole pages"};
    snprintf(topos[num_topo].name, 32, "TP%u->TP%u", c.ptp, c.ptp);
    num_topo++;
    if (c.dtp != c.ptp) {
        /* What moves per destination rank: a slice of each row's heads, or whole rows
         * copied to several ranks (MLA's one latent head; more ranks than KV heads). */
        const char *kind = m.m.num_kv_heads <= 1 ? "replicated rows"
                           : c.dtp > m.m.num_kv_heads ? "head replicas"
                                                       : "head slices";
        topos[num_topo] = (bench_topo_t){c.ptp, c.dtp, "", kind};
        snprintf(topos[num_topo].name, 32, "TP%u->TP%u", c.ptp, c.dtp);
        num_topo++;
    }

    /* The command that reproduces this run, every option spelled out. */
    char cmdline[2048]; /* room for both 512-byte paths */
    {
        char tls[80] = "", lens[160] = "";
        for (uint32_t i = 0; i < c.num_tl; i++)
            snprintf(tls + strlen(tls), sizeof(tls) - strlen(tls), "%s%s", i ? "," : "",
                     c.transports[i]);
        for (uint32_t i = 0; i < c.num_lengths; i++)
            snprintf(lens + strlen(lens), sizeof(lens) - strlen(lens), "%s%llu", i ? "," : "",
                     (unsigned long long)c.lengths[i]);
        snprintf(cmdline, sizeof(cmdline),
                 "kvwire bench --transport %s --model %s --layers %u --prefill-tp %u "
                 "--decode-tp %u --lengths %s --reps %u --page-size %u --rate-rooms %u "
                 "--rate-inflight %u --mem-rooms %u --budget-ms %llu --decode-mem %s --json %s "
                 "--png %s",
                 c.num_tl ? tls : "none", c.model, m.m.num_layers, c.ptp, c.dtp, lens, c.reps,
                 c.page, c.rate_rooms, c.rate_inflight, c.mem_rooms,
                 (unsigned long long)(c.budget_ns / 1000000),
                 c.decode_anon ? "anon" : "shared", c.json, c.png);
    }
    uint64_t t_start = b_now();
    printf("kvwire bench: %s, %u of %u layers%s, %u KV heads, page %u, NHD, median of up to %u "
           "reps\n",
           c.model, m.m.num_layers, full_layers,
           m.m.num_layers < full_layers ? " (--layers 0 for all)" : "", m.m.num_kv_heads,
           c.page, c.reps);
    fflush(stdout);

    int rc = 0;
    bool failed = false;
    /* Plan memory: describe-only ranks, no transfer. */
    for (uint32_t t = 0; t < num_topo && rc == 0; t++) {
        char err[512];
        if (b_plan_memory(&c, &m, &topos[t], &rep->plan[rep->num_plan], err, sizeof(err))) {
            fprintf(stderr, "bench: %s\n", err);
            rc = 1;
        } else {
            rep->num_plan += c.num_lengths;
        }
    }

    uint16_t ucx_port = (uint16_t)(20000 + getpid() % 20000);

    for (uint32_t ti = 0; ti < c.num_tl && rc == 0; ti++) {
        const char *tl = c.transports[ti];
        /* Baselines by byte count: TP1->TP4 moves the same bytes as TP1->TP1 for GQA, but
         * more for replicated heads (MLA, fewer KV heads than decode ranks). */
        uint64_t base_bytes[B_MAX_LEN * B_MAX_TOPO] = {0};
        double base_gbps[B_MAX_LEN * B_MAX_TOPO];
        uint32_t num_bb = 0;
        const char *base_name = NULL;
        for (uint32_t t = 0; t < num_topo && rc == 0; t++) {
            b_job_t job = {.c = &c, .m = &m, .transport = tl, .topo = topos[t],
                           .do_rate = t == 0, .do_mem = t == 0 && ti == 0};
            fprintf(stderr, "bench: %s %s: starting the prefill and decode processes\n", tl,
                    topos[t].name);
            uint64_t t_pair = b_now();
            b_result_t *res = calloc(1, sizeof(*res));
            if (!res) {
                rc = 1;
                break;
            }
            int pair_rc = b_run_pair(&job, res);
            printf("  %s %s: ", tl, topos[t].name);
            if (pair_rc) {
                if (!strcmp(tl, "ucx") && res->num_lengths == 0) {
                    printf("not available\n");
                    b_note(rep, "ucx: %s; skipped", res->err);
                    free(res);
                    break;
                }
                /* Keep going: the other pairs still say something; exit non-zero. */
                printf("FAILED\n");
                fprintf(stderr, "bench: %s %s: %s\n", tl, topos[t].name, res->err);
                b_note(rep, "ERROR %s %s: %s", tl, topos[t].name, res->err);
                failed = true;
            }
            printf("%.1f s (decode setup %.1f, memory %.1f, sweep %.1f, rate %.1f)",
                   (b_now() - t_pair) / 1e9, res->phase_ns[0] / 1e9, res->phase_ns[1] / 1e9,
                   res->phase_ns[2] / 1e9, res->phase_ns[3] / 1e9);
            fflush(stdout);
            /* shm and tcp: the baseline ran inside the pair, after each request. ucx: a
             * reference run afterwards, once per byte count. */
            bool inpair = !strcmp(tl, "shm") || !strcmp(tl, "tcp");
            if (inpair) {
                base_name = !strcmp(tl, "shm") ? "memcpy 1 thread" : "TCP socket 127.0.0.1";
                for (uint32_t i = 0; i < res->num_lengths; i++) {
                    const b_len_result_t *lr = &res->len[i];
                    if (!lr->base_reps || rep->num_base >= B_MAX_BASE)
                        continue;
                    rep->base[rep->num_base].name = base_name;
                    snprintf(rep->base[rep->num_base].transport, 16, "%s", tl);
                    snprintf(rep->base[rep->num_base].topo, 32, "%s", topos[t].name);
                    rep->base[rep->num_base].tokens = lr->tokens;
                    rep->base[rep->num_base].bytes = lr->bytes;
                    rep->base[rep->num_base].gbps =
                        b_gbps(lr->bytes, cli_median(lr->base_ns, lr->base_reps));
                    rep->num_base++;
                }
            }
            uint32_t todo[B_MAX_LEN], ntodo = 0;
            for (uint32_t i = 0; i < res->num_lengths && !inpair; i++) {
                bool known = !res->len[i].bytes;
                for (uint32_t k = 0; k < num_bb; k++)
                    known |= base_bytes[k] == res->len[i].bytes;
                if (!known)
                    todo[ntodo++] = i;
            }
            if (rc == 0 && ntodo && !strcmp(tl, "ucx")) {
                uint64_t t_base = b_now(), tb[B_MAX_LEN];
                double g[B_MAX_LEN];
                for (uint32_t k = 0; k < ntodo; k++) {
                    tb[k] = res->len[todo[k]].bytes;
                    g[k] = -1;
                }
                const char *bn = b_ucx_reference(tb, ntodo, c.quick, &ucx_port, g, rep);
                base_name = bn ? bn : base_name;
                printf(", ucx_perftest %.1f s", (b_now() - t_base) / 1e9);
                for (uint32_t k = 0; k < ntodo; k++) {
                    base_bytes[num_bb] = tb[k];
                    base_gbps[num_bb++] = bn ? g[k] : -1;
                    if (bn && g[k] > 0 && rep->num_base < B_MAX_BASE) {
                        rep->base[rep->num_base].name = bn;
                        snprintf(rep->base[rep->num_base].transport, 16, "%s", tl);
                        snprintf(rep->base[rep->num_base].topo, 32, "%s", topos[t].name);
                        rep->base[rep->num_base].tokens = res->len[todo[k]].tokens;
                        rep->base[rep->num_base].bytes = tb[k];
                        rep->base[rep->num_base].gbps = g[k];
                        rep->num_base++;
                    }
                }
            }
            printf("\n");
            for (uint32_t i = 0; i < res->num_lengths; i++) {
                const b_len_result_t *lr = &res->len[i];
                b_row_t *w = &rep->rows[rep->num_rows++];
                memset(w, 0, sizeof(*w));
                snprintf(w->transport, sizeof(w->transport), "%s", tl);
                snprintf(w->topo, sizeof(w->topo), "%s", topos[t].name);
                w->kind = topos[t].kind;
                w->tokens = lr->tokens;
                w->bytes = lr->bytes;
                w->reps = lr->reps;
                if (lr->reps == 0 && !lr->skipped_pred_ns) {
                    rep->num_rows--; /* cut short by an error */
                    continue;
                }
                if (lr->reps == 0) {
                    b_note(rep, "%s %s %llu tokens: not run; one request was predicted to take "
                                "%.1f s (more than twice --budget-ms)", tl, topos[t].name,
                           (unsigned long long)lr->tokens, lr->skipped_pred_ns / 1e9);
                    continue;
                }
                w->gbps = b_gbps(lr->bytes, cli_median(lr->ns, lr->reps));
                for (uint32_t k = 0; k < lr->reps; k++)
                    w->gbps_reps[k] = b_gbps(lr->bytes, lr->ns[k]);
                w->baseline = base_name;
                w->base_gbps = -1;
                if (inpair && lr->base_reps)
                    w->base_gbps = b_gbps(lr->bytes, cli_median(lr->base_ns, lr->base_reps));
                /* Same byte count as the reference was measured with. */
                for (uint32_t k = 0; k < num_bb && !inpair; k++)
                    if (base_bytes[k] == lr->bytes && base_gbps[k] > 0)
                        w->base_gbps = base_gbps[k];
            }
            if (res->rate_done) {
                b_rate_row_t *rr = &rep->rate[rep->num_rate++];
                snprintf(rr->transport, sizeof(rr->transport), "%s", tl);
                snprintf(rr->topo, sizeof(rr->topo), "%s", topos[t].name);
                rr->rooms = res->rate_rooms;
                rr->inflight = res->rate_inflight;
                rr->seconds = res->rate_ns / 1e9;
                rr->rooms_per_s = res->rate_ns ? res->rate_rooms / (res->rate_ns / 1e9) : 0;
                rr->p50_us = res->rate_lat_p50 / 1e3;
                rr->p99_us = res->rate_lat_p99 / 1e3;
                const b_cpu_t *cd = &res->rate_cpu_decode, *cp = &res->rate_cpu_prefill;
                rr->main_us_decode = cd->self_ns / 1e3 / res->rate_rooms;
                rr->main_us_prefill = cp->self_ns / 1e3 / res->rate_rooms;
                rr->cpu_us_decode =
                    (cd->ns > cd->self_ns ? cd->ns - cd->self_ns : 0) / 1e3 / res->rate_rooms;
                rr->cpu_us_prefill =
                    (cp->ns > cp->self_ns ? cp->ns - cp->self_ns : 0) / 1e3 / res->rate_rooms;
                rr->csw_decode = (double)res->rate_cpu_decode.csw / res->rate_rooms;
                rr->csw_prefill = (double)res->rate_cpu_prefill.csw / res->rate_rooms;
            }
            if (res->num_mem) {
                rep->num_mem = res->num_mem;
                memcpy(rep->mem, res->mem, sizeof(rep->mem));
                snprintf(rep->mem_transport, sizeof(rep->mem_transport), "%s", tl);
                snprintf(rep->mem_topo, sizeof(rep->mem_topo), "%s", topos[t].name);
                rep->mem_dtp = topos[t].dtp;
            }
            free(res);
        }
    }

    /* ---- human report */
    printf("\nthroughput (one request at a time; time from decode post to SUCCESS on every "
           "decode rank)\n");
    printf("%-5s %-10s %-12s %7s %12s %4s %8s %10s  %-23s %9s %6s\n", "tl", "topology", "data",
           "tokens", "bytes", "reps", "GB/s", "min-max", "baseline", "base GB/s", "ratio");
    for (uint32_t i = 0; i < rep->num_rows; i++) {
        const b_row_t *w = &rep->rows[i];
        double lo = 1e30, hi = 0;
        for (uint32_t k = 0; k < w->reps; k++) {
            lo = w->gbps_reps[k] < lo ? w->gbps_reps[k] : lo;
            hi = w->gbps_reps[k] > hi ? w->gbps_reps[k] : hi;
        }
        char range[32];
        snprintf(range, sizeof(range), "%.2f-%.2f", w->reps ? lo : 0, hi);
        if (w->reps == 0)
            printf("%-5s %-10s %-12s %7llu %12s %4u %8s %10s  (not run: too slow for the time "
                   "budget)\n", w->transport, w->topo, w->kind, (unsigned long long)w->tokens, "-",
                   0, "-", "-");
        else if (w->base_gbps > 0)
            printf("%-5s %-10s %-12s %7llu %12llu %4u %8.2f %10s  %-23s %9.2f %6.2f\n",
                   w->transport, w->topo, w->kind, (unsigned long long)w->tokens,
                   (unsigned long long)w->bytes, w->reps, w->gbps, range, w->baseline,
                   w->base_gbps, w->gbps / w->base_gbps);
        else
            printf("%-5s %-10s %-12s %7llu %12llu %4u %8.2f %10s  %-23s %9s %6s\n",
                   w->transport, w->topo, w->kind, (unsigned long long)w->tokens,
                   (unsigned long long)w->bytes, w->reps, w->gbps, range,
                   w->baseline ? w->baseline : "(none)", "-", "-");
    }
    if (rep->num_rate) {
        printf("\ncontrol plane (1-token rooms, end to end, timed on the decode side)\n"
               "CPU per room, user + system: lib = the library's threads, api = the bench's "
               "thread (API calls and polling); D decode, P prefill\n");
        printf("%-5s %-10s %6s %6s %7s %8s %8s %8s %8s %8s %8s %8s\n", "tl", "topology",
               "rooms", "flight", "seconds", "rooms/s", "p50 us", "p99 us", "lib D us",
               "api D us", "lib P us", "api P us");
        for (uint32_t i = 0; i < rep->num_rate; i++) {
            const b_rate_row_t *rr = &rep->rate[i];
            printf("%-5s %-10s %6u %6u %7.3f %8.0f %8.0f %8.0f %8.1f %8.1f %8.1f %8.1f%s\n",
                   rr->transport, rr->topo, rr->rooms, rr->inflight, rr->seconds,
                   rr->rooms_per_s, rr->p50_us, rr->p99_us, rr->cpu_us_decode,
                   rr->main_us_decode, rr->cpu_us_prefill, rr->main_us_prefill,
                   rr->rooms_per_s >= 20000 ? "" : "  (target 20000/s)");
        }
    }
    if (rep->num_plan) {
        printf("\nplan memory (prefill rank 0 -> decode rank 0, consecutive pages; random pages "
               "in the last column)\n");
        printf("%-10s %7s %6s %12s %9s %9s %11s %11s\n", "topology", "tokens", "pages",
               "payload", "segments", "runs", "plan bytes", "(random)");
        for (uint32_t i = 0; i < rep->num_plan; i++) {
            const b_plan_row_t *p = &rep->plan[i];
            printf("%-10s %7llu %6u %12llu %9llu %9llu %11llu %11llu\n", p->topo,
                   (unsigned long long)p->tokens, p->full_pages, (unsigned long long)p->bytes,
                   (unsigned long long)p->segments, (unsigned long long)p->runs,
                   (unsigned long long)p->plan_bytes, (unsigned long long)p->plan_bytes_random);
        }
    }
    if (rep->num_mem) {
        printf("\ndecode memory per in-flight room (%s %s, %u decode rank%s; rooms posted, never "
               "served)\n", rep->mem_transport, rep->mem_topo, rep->mem_dtp,
               rep->mem_dtp == 1 ? "" : "s");
        printf("%7s %6s %6s %6s %14s %15s\n", "tokens", "pages", "swa", "rooms", "RSS B/room",
               "heap B/room");
        for (uint32_t i = 0; i < rep->num_mem; i++) {
            const b_mem_result_t *mm = &rep->mem[i];
            printf("%7llu %6u %6u %6u %14.0f %15.0f\n", (unsigned long long)mm->tokens,
                   mm->full_pages, mm->swa_pages, mm->rooms, (double)mm->rss_delta / mm->rooms,
                   (double)mm->heap_delta / mm->rooms);
        }
    }
    double secs = (b_now() - t_start) / 1e9;
    char title[256];
    snprintf(title, sizeof(title), "kvwire bench: %s, %u layers, page %u, %ld CPUs", c.model,
             m.m.num_layers, c.page, sysconf(_SC_NPROCESSORS_ONLN));
    if (rep->num_rows) {
        if (!b_have_gnuplot())
            b_note(rep, "gnuplot is not installed (Debian: gnuplot-nox): no chart");
        else if (b_chart(c.png, rep, title, &c, topos, num_topo))
            b_note(rep, "gnuplot failed: no chart written to %s", c.png);
    }
    for (uint32_t i = 0; i < rep->num_notes; i++)
        printf("%snote: %s\n", i ? "" : "\n", rep->notes[i]);
    if (b_write_json(c.json, &c, &m, cmdline, rep)) {
        fprintf(stderr, "bench: cannot write %s: %s\n", c.json, strerror(errno));
        rc = 1;
    }
    printf("\nreproduce: %s\n", cmdline);
    printf("wrote %s%s%s (%.1f s)\n", c.json, rep->num_rows && b_have_gnuplot() ? " and " : "",
           rep->num_rows && b_have_gnuplot() ? c.png : "", secs);
    free(rep);
    return rc ? rc : failed ? 1 : 0;
}

KVW_CMD("bench", cmd_bench, "throughput, control-plane rate and memory of real transfers")
