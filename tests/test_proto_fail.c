/*
 * Protocol failure tests: the real protocol between a prefill and a decode instance
 * running in SEPARATE PROCESSES, over every transport in {tcp, shm}, when things go
 * wrong: processes killed or frozen mid-room, aborts from either side, handshake
 * rejections, malformed and truncated frames on the bootstrap and control ports,
 * stalled connections, bad page lists, wait timeouts, and a man-in-the-middle proxy
 * on the control channel that tampers with, drops or corrupts frames.
 *
 * Every case checks that failures are reported (FAILED with a reason, within the
 * configured timeouts) and never look like success, and that the rooms and
 * connections that were not involved still complete with byte-exact results
 * (verified against the test kit's independent reference, guard bytes included).
 *
 * Structure: the parent process only forks and waits. Each case forks its processes
 * (prefill, decode(s), proxy) before any context or thread exists; they talk over
 * SOCK_SEQPACKET socket pairs (one per pair of processes). Every wait has a deadline;
 * each child also arms alarm() as a last resort, and the parent kills a case that
 * runs past its deadline.
 *
 * Env: KVW_PROTO_FAIL_ONLY=substring selects cases; KVW_PROTO_FAIL_TL=tcp|shm selects
 * a transport; KVW_PROTO_FAIL_STRICT=1 turns known library bugs (listed in
 * known_bugs[]) from reported XFAILs into failures.
 *
 * Exit: 0 pass, 1 fail, 77 skip (no transport usable).
 */
#include "testkit.h"
#include "timeout.h"

#include <kvwire/xfer.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

/* ------------------------------------------------------------------ settings */

#define HEARTBEAT_MS 50
#define PEER_TIMEOUT_MS kvt_tmo_ms(500)
#define WAIT_TIMEOUT_MS kvt_tmo_ms(2000)
#define BOOT_TIMEOUT_MS kvt_tmo_ms(5000)
/* Scheduling slack on a loaded two-core machine, sanitizers included. */
#define SLACK_MS kvt_tmo_ms(1500)

#define PAGE 16
#define MAX_SLOTS 8
#define SLOT_FULL 20 /* full-pool pages reserved per slot */
#define SLOT_SWA 10  /* SWA-pool pages reserved per slot */
#define SPARE 4      /* the last pages of each pool are never assigned to a slot */
#define FULL_PAGES (MAX_SLOTS * SLOT_FULL + SPARE)
#define SWA_PAGES (MAX_SLOTS * SLOT_SWA + SPARE)
#define MAXR 4 /* ranks per instance */
#define MAXP 4 /* processes per case */

#define WIRE_MAGIC 0x3157564bu
#define T_HELLO 1
#define T_REJECT 3
#define T_REQ 4
#define T_ABORT 5
#define T_HEARTBEAT 8
#define T_BS_REGISTER 20
#define T_BS_LOOKUP 22
#define T_BS_TABLE 23
#define T_CHALLENGE 30

/* ------------------------------------------------------------------ globals */

/* Set by the parent before each case's fork; children inherit them. */
static const char *g_tl = "tcp";
static const char *g_case = "";
static char g_who[24] = "parent";
static int g_bad;           /* failed checks in this process */
static kvt_model_t g_model; /* gpt-oss-120b cut to 2 layers: SWA (window 128) + full */
static uint32_t g_ptp = 1, g_dtp = 2;
static int g_variant;
static uint64_t g_instance; /* decode instance id (0: leave the field out) */

/* Known library bugs: checks tagged with one of these names are reported as XFAIL
 * (unless KVW_PROTO_FAIL_STRICT=1). An XPASS means the bug is gone: drop the tag. */
static const char *const known_bugs[] = {
    /* Empty today. Bugs this test found and that are fixed: a restarted decode instance
     * was never served (dead peers counted); two decode instances on one prefill never
     * completed (now: KVW_CTX_FIELD_INSTANCE); an ABORT from one decode rank did not
     * reach the room's other decode ranks; a silent connection on the control port
     * stalled the control thread until healthy peers were declared dead; the wait
     * timeout fired on transferring rooms (chunked prefill longer than it). */
    NULL};
static int g_strict;
static int g_xfail; /* XFAIL checks hit in this process */

#define KVW_ARRAY_N(a) (sizeof(a) / sizeof((a)[0]))

__attribute__((format(printf, 1, 2))) static void say(const char *fmt, ...)
{
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    fprintf(stderr, "  [%s %s %s] %s\n", g_tl, g_case, g_who, buf);
}

static bool is_known(const char *bug)
{
    for (int i = 0; bug && known_bugs[i]; i++)
        if (!strcmp(known_bugs[i], bug))
            return true;
    return false;
}

__attribute__((format(printf, 4, 5))) static bool check_(bool ok, int line, const char *bug,
                                                         const char *fmt, ...)
{
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    if (ok) {
        if (bug && is_known(bug))
            say("XPASS (line %d, known bug '%s' did not show): %s", line, bug, buf);
        return true;
    }
    if (bug && is_known(bug) && !g_strict) {
        g_xfail++;
        say("XFAIL (line %d, known bug '%s'): %s", line, bug, buf);
        return false;
    }
    g_bad++;
    say("FAIL (line %d): %s", line, buf);
    return false;
}

/* CHECK(cond, fmt, ...): records a failure with a message; evaluates to cond. */
#define CHECK(c, ...) check_((c), __LINE__, NULL, __VA_ARGS__)
/* BUGCHECK(bug, cond, fmt, ...): a check that a known library bug breaks. */
#define BUGCHECK(bug, c, ...) check_((c), __LINE__, (bug), __VA_ARGS__)

static uint64_t now_ms(void)
{
    return kvt_now_ns() / 1000000u;
}

static void sleep_ms(unsigned ms)
{
    usleep(ms * 1000u);
}

/* ------------------------------------------------------------------ channels */

/* Messages between the processes of a case: a tag and a line of text. */
typedef struct msg {
    char tag[24];
    char text[1000];
} msg_t;

typedef struct env {
    int me;
    int ch[MAXP]; /* ch[j]: socket to process j, -1 for none */
} env_t;

__attribute__((format(printf, 3, 4))) static void ch_send(int fd, const char *tag,
                                                          const char *fmt, ...)
{
    msg_t m;
    memset(&m, 0, sizeof(m));
    snprintf(m.tag, sizeof(m.tag), "%s", tag);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m.text, sizeof(m.text), fmt, ap);
    va_end(ap);
    if (fd >= 0 && send(fd, &m, sizeof(m), MSG_NOSIGNAL) != (ssize_t)sizeof(m))
        say("note: channel send of '%s' failed: %s", tag, strerror(errno));
}

static void ch_tag(int fd, const char *tag)
{
    ch_send(fd, tag, "%s", "");
}

/* 0: got a message; -1: timed out; -2: the other process is gone. */
static int ch_recv(int fd, msg_t *m, int timeout_ms)
{
    uint64_t end = now_ms() + (uint64_t)timeout_ms;
    for (;;) {
        uint64_t now = now_ms();
        if (now >= end)
            return -1;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, (int)(end - now));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        ssize_t k = recv(fd, m, sizeof(*m), 0);
        if (k == (ssize_t)sizeof(*m))
            return 0;
        if (k < 0 && errno == EINTR)
            continue;
        return -2;
    }
}

/* Waits for a message tagged `tag` (others are a failure). 0 or -1. */
static int ch_expect(int fd, const char *tag, msg_t *out, int timeout_ms)
{
    msg_t m;
    int r = ch_recv(fd, &m, timeout_ms);
    if (r == 0 && !strcmp(m.tag, tag)) {
        if (out)
            *out = m;
        return 0;
    }
    if (r == 0)
        CHECK(false, "expected message '%s', got '%s' (%s)", tag, m.tag, m.text);
    else
        CHECK(false, "expected message '%s': %s", tag,
              r == -1 ? "timed out" : "the other process is gone");
    return -1;
}

/* Waits until the other process closes its end (it exited or died). */
static bool ch_wait_gone(int fd, int timeout_ms)
{
    msg_t m;
    for (;;) {
        int r = ch_recv(fd, &m, timeout_ms);
        if (r == -2)
            return true;
        if (r == -1)
            return false;
    }
}

/* ------------------------------------------------------------------ instances */

typedef struct inst {
    uint32_t n;
    kvt_model_t model;
    kvt_rank_t r[MAXR];
    kvw_ctx_h ctx[MAXR];
} inst_t;

static void inst_free(inst_t *in)
{
    for (uint32_t i = 0; i < in->n; i++) {
        if (in->ctx[i])
            kvw_ctx_destroy(in->ctx[i]);
        in->ctx[i] = NULL;
    }
    for (uint32_t i = 0; i < in->n; i++)
        kvt_rank_free(&in->r[i]);
    in->n = 0;
}

/* Builds the ranks of an instance; prefill bytes get a fixed pattern, decode buffers
 * another one (so that stray writes of either show). */
static kvw_status_t inst_build(inst_t *in, const kvt_model_t *m, uint32_t tp, bool prefill,
                               kvw_layout_t layout)
{
    memset(in, 0, sizeof(*in));
    in->model = *m;
    kvt_model_relink(&in->model);
    for (uint32_t t = 0; t < tp; t++) {
        kvt_rank_spec_t s = {.model = &in->model,
                             .layout = layout,
                             .page_size = {PAGE, PAGE},
                             .num_pages = {FULL_PAGES, SWA_PAGES},
                             .num_slots = MAX_SLOTS};
        s.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = tp,
                                 .tp_rank = t, .pp_size = 1, .pp_rank = 0,
                                 .layer_begin = 0, .layer_end = in->model.m.num_layers,
                                 .dp_size = 1, .dp_rank = 0};
        kvw_status_t st = kvt_rank_build(&s, &in->r[t]);
        if (st != KVW_OK) {
            inst_free(in);
            return st;
        }
        in->n = t + 1;
        kvt_rank_fill(&in->r[t], (prefill ? 100 : 900) + t);
    }
    return KVW_OK;
}

static kvw_status_t ctx_open(kvw_ctx_h *ctx, kvw_rank_h rank, bool prefill, const char *tl,
                             const char *bs, bool host_bs)
{
    kvw_ctx_params_t p = {
        .field_mask = KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK | KVW_CTX_FIELD_TRANSPORT |
                      KVW_CTX_FIELD_BOOTSTRAP | KVW_CTX_FIELD_HOST_BOOTSTRAP |
                      KVW_CTX_FIELD_TIMEOUTS | KVW_CTX_FIELD_PREFILL_SIZE,
        .side = prefill ? KVW_SIDE_PREFILL : KVW_SIDE_DECODE,
        .rank = rank,
        .transport = tl,
        .bootstrap_addr = bs,
        .host_bootstrap = host_bs,
        .heartbeat_ms = HEARTBEAT_MS,
        .peer_timeout_ms = PEER_TIMEOUT_MS,
        .bootstrap_timeout_ms = BOOT_TIMEOUT_MS,
        .wait_timeout_ms = WAIT_TIMEOUT_MS,
        .prefill_tp = g_ptp,
        .prefill_pp = 1,
        .prefill_dp = 1};
    if (!prefill && g_instance) {
        p.field_mask |= KVW_CTX_FIELD_INSTANCE;
        p.instance_id = g_instance;
    }
    return kvw_ctx_create(&p, ctx);
}

/* Opens every rank's context. Prefill: rank 0 hosts the bootstrap, its address goes
 * to bs_out. On failure the message is in errbuf. */
static kvw_status_t inst_open(inst_t *in, bool prefill, const char *tl, const char *bs,
                              char *bs_out, size_t bs_cap, char *errbuf, size_t errcap)
{
    char local[160];
    if (prefill) {
        bs = "127.0.0.1:0";
    }
    for (uint32_t i = 0; i < in->n; i++) {
        kvw_status_t st = ctx_open(&in->ctx[i], in->r[i].h, prefill, tl, bs, prefill && i == 0);
        if (st != KVW_OK) {
            snprintf(errbuf, errcap, "%s", kvw_last_error());
            for (uint32_t j = 0; j < i; j++) {
                kvw_ctx_destroy(in->ctx[j]);
                in->ctx[j] = NULL;
            }
            in->ctx[i] = NULL;
            return st;
        }
        if (prefill && i == 0) {
            snprintf(local, sizeof(local), "%s", kvw_ctx_bootstrap_addr(in->ctx[0]));
            if (bs_out)
                snprintf(bs_out, bs_cap, "%s", local);
            bs = local;
        }
    }
    return KVW_OK;
}

/* ------------------------------------------------------------------ rooms and pages */

static uint64_t slot_tokens(int slot)
{
    return 100 + 29 * (uint64_t)slot; /* 100 .. 303: full pages <= 19, SWA pages <= 10 */
}

static uint32_t swa_window(void)
{
    uint32_t w = 0;
    for (uint32_t l = 0; l < g_model.m.num_layers; l++)
        if (g_model.layers[l].kind == KVW_LAYER_SWA && g_model.layers[l].window > w)
            w = g_model.layers[l].window;
    return w;
}

typedef struct rpages {
    uint32_t full[SLOT_FULL + 4], swa[SLOT_SWA + 4];
    kvw_side_pages_t side;
} rpages_t;

static void perm(uint32_t n, uint64_t seed, uint32_t *out)
{
    kvt_rng_t rng = {seed};
    for (uint32_t i = 0; i < n; i++)
        out[i] = i;
    for (uint32_t i = n; i > 1; i--) {
        uint32_t j = (uint32_t)kvt_rng_below(&rng, i);
        uint32_t t = out[i - 1];
        out[i - 1] = out[j];
        out[j] = t;
    }
}

/* Pages of the request in `slot` on one side: slices of a fixed permutation of each
 * pool (so slots never share a page), the spare pages at the end never used. */
static void room_pages(bool prefill, int slot, uint64_t n, rpages_t *p)
{
    static uint32_t pf[2][FULL_PAGES - SPARE], ps[2][SWA_PAGES - SPARE];
    static bool init;
    if (!init) {
        for (int s = 0; s < 2; s++) {
            perm(FULL_PAGES - SPARE, 11 + s, pf[s]);
            perm(SWA_PAGES - SPARE, 23 + s, ps[s]);
        }
        init = true;
    }
    int s = prefill ? 0 : 1;
    memset(p, 0, sizeof(*p));
    uint32_t nf = (uint32_t)((n + PAGE - 1) / PAGE);
    uint64_t w = swa_window();
    uint64_t ws = n > w ? n - w : 0;
    uint64_t swb = ws / PAGE * PAGE;
    uint32_t ns = w ? (uint32_t)((n - swb + PAGE - 1) / PAGE) : 0;
    memcpy(p->full, pf[s] + (size_t)slot * SLOT_FULL, sizeof(uint32_t) * nf);
    memcpy(p->swa, ps[s] + (size_t)slot * SLOT_SWA, sizeof(uint32_t) * ns);
    p->side.full = (kvw_pages_t){KVW_PAGES_FIELDS_ALL, p->full, nf, 0};
    p->side.swa = (kvw_pages_t){KVW_PAGES_FIELDS_ALL, p->swa, ns, swb};
    p->side.field_mask = KVW_SIDE_PAGES_FIELDS_ALL;
    p->side.state_slot = -1;
}

typedef struct room {
    uint64_t id;
    int slot;
    uint64_t n;
    kvw_sender_h s[MAXR];
    kvw_receiver_h r[MAXR];
} room_t;

static room_t room_def(uint64_t id, int slot)
{
    room_t r;
    memset(&r, 0, sizeof(r));
    r.id = id;
    r.slot = slot;
    r.n = slot_tokens(slot);
    return r;
}

static bool terminal(kvw_room_state_t s)
{
    return s == KVW_ROOM_SUCCESS || s == KVW_ROOM_FAILED;
}

/* Prefill: a sender on every rank. */
static bool p_open(inst_t *in, room_t *rm)
{
    bool ok = true;
    for (uint32_t k = 0; k < in->n; k++)
        ok &= CHECK(kvw_sender_create(in->ctx[k], rm->id, &rm->s[k]) == KVW_OK,
                    "sender_create room %llu rank %u: %s", (unsigned long long)rm->id, k,
                    kvw_last_error());
    return ok;
}

/* Prefill: sends tokens [b, e) of the room from every rank. Returns the first error. */
static kvw_status_t p_send(inst_t *in, room_t *rm, uint64_t b, uint64_t e, bool last,
                           char *err, size_t cap)
{
    rpages_t p;
    room_pages(true, rm->slot, rm->n, &p);
    kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = rm->n,
                          .chunk_begin = b, .chunk_end = e,
                          .last_chunk = last, .pages = p.side};
    kvw_status_t first = KVW_OK;
    for (uint32_t k = 0; k < in->n; k++) {
        kvw_status_t st = kvw_sender_send(rm->s[k], &c);
        if (st != KVW_OK && first == KVW_OK) {
            first = st;
            if (err)
                snprintf(err, cap, "%s", kvw_last_error());
        }
    }
    return first;
}

static bool p_send_all(inst_t *in, room_t *rm)
{
    char err[512] = "";
    kvw_status_t st = p_send(in, rm, 0, rm->n, true, err, sizeof(err));
    return CHECK(st == KVW_OK, "send room %llu: %s: %s", (unsigned long long)rm->id,
                 kvw_status_string(st), err);
}

static void p_close(inst_t *in, room_t *rm)
{
    for (uint32_t k = 0; k < in->n; k++) {
        kvw_room_destroy(kvw_sender_room(rm->s[k]));
        rm->s[k] = NULL;
    }
}

/* Decode: a receiver on every rank, posted with the slot's pages (or `override`). */
static bool d_open_post(inst_t *in, room_t *rm, const kvw_side_pages_t *override)
{
    bool ok = true;
    rpages_t p;
    room_pages(false, rm->slot, rm->n, &p);
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = rm->n,
                            .prefix_len = 0,
                            .pages = override ? *override : p.side};
    for (uint32_t k = 0; k < in->n; k++) {
        ok &= CHECK(kvw_receiver_create(in->ctx[k], rm->id, 0, &rm->r[k]) == KVW_OK,
                    "receiver_create room %llu rank %u: %s", (unsigned long long)rm->id, k,
                    kvw_last_error());
        if (rm->r[k])
            ok &= CHECK(kvw_receiver_post(rm->r[k], &post) == KVW_OK,
                        "receiver_post room %llu rank %u: %s", (unsigned long long)rm->id, k,
                        kvw_last_error());
    }
    return ok;
}

static void d_close(inst_t *in, room_t *rm)
{
    for (uint32_t k = 0; k < in->n; k++) {
        kvw_room_destroy(kvw_receiver_room(rm->r[k]));
        rm->r[k] = NULL;
    }
}

/* Polls until the handle is terminal (or `want` is reached) or the deadline passes. */
static kvw_room_state_t wait_recv(kvw_receiver_h h, kvw_room_state_t want, uint64_t timeout_ms)
{
    uint64_t end = now_ms() + timeout_ms;
    kvw_room_state_t s;
    while (!terminal(s = kvw_room_poll(kvw_receiver_room(h))) && s != want && now_ms() < end)
        usleep(500);
    return s;
}

static kvw_room_state_t wait_send(kvw_sender_h h, uint64_t timeout_ms)
{
    uint64_t end = now_ms() + timeout_ms;
    kvw_room_state_t s;
    while (!terminal(s = kvw_room_poll(kvw_sender_room(h))) && now_ms() < end)
        usleep(500);
    return s;
}

/* Waits until every sender of the room has reached at least `state` (e.g. the decode
 * half of the room, its REQ, has arrived: WAITING_FOR_INPUT). */
static bool p_wait_state(inst_t *in, room_t *rm, kvw_room_state_t state, uint64_t timeout_ms)
{
    uint64_t end = now_ms() + timeout_ms;
    for (;;) {
        bool all = true;
        for (uint32_t k = 0; k < in->n; k++)
            all &= kvw_room_poll(kvw_sender_room(rm->s[k])) >= state;
        if (all)
            return true;
        if (now_ms() > end)
            return CHECK(false, "prefill room %llu did not reach %s (state %s: %s)",
                         (unsigned long long)rm->id, kvw_room_state_string(state),
                         kvw_room_state_string(kvw_room_poll(kvw_sender_room(rm->s[0]))),
                         kvw_room_failure(kvw_sender_room(rm->s[0])));
        usleep(500);
    }
}

/* Expects every sender of the room to reach `want` within timeout; checks the reason
 * holds `needle` when FAILED. */
static bool p_expect(inst_t *in, room_t *rm, kvw_room_state_t want, const char *needle,
                     uint64_t timeout_ms, const char *bug)
{
    bool ok = true;
    uint64_t t0 = now_ms();
    for (uint32_t k = 0; k < in->n; k++) {
        uint64_t left = now_ms() - t0 < timeout_ms ? timeout_ms - (now_ms() - t0) : 0;
        kvw_room_state_t s = wait_send(rm->s[k], left);
        const char *why = kvw_room_failure(kvw_sender_room(rm->s[k]));
        ok &= check_(s == want, __LINE__, bug,
                     "prefill room %llu rank %u: %s after %llu ms (want %s)%s%s",
                     (unsigned long long)rm->id, k, kvw_room_state_string(s),
                     (unsigned long long)(now_ms() - t0), kvw_room_state_string(want),
                     why[0] ? ": " : "", why);
        if (s == KVW_ROOM_FAILED && want == KVW_ROOM_FAILED) {
            ok &= CHECK(why[0] != '\0', "prefill room %llu failed without a reason",
                        (unsigned long long)rm->id);
            if (needle)
                ok &= CHECK(kvt_contains(why, needle), "prefill room %llu reason lacks '%s': %s",
                            (unsigned long long)rm->id, needle, why);
            if (k == 0)
                say("prefill room %llu FAILED after %llu ms: %s", (unsigned long long)rm->id,
                    (unsigned long long)(now_ms() - t0), why);
        }
    }
    return ok;
}

static bool d_expect(inst_t *in, room_t *rm, kvw_room_state_t want, const char *needle,
                     uint64_t timeout_ms, const char *bug)
{
    bool ok = true;
    uint64_t t0 = now_ms();
    for (uint32_t k = 0; k < in->n; k++) {
        uint64_t left = now_ms() - t0 < timeout_ms ? timeout_ms - (now_ms() - t0) : 0;
        kvw_room_state_t s = wait_recv(rm->r[k], KVW_ROOM_SUCCESS, left);
        const char *why = kvw_room_failure(kvw_receiver_room(rm->r[k]));
        ok &= check_(s == want, __LINE__, bug,
                     "decode room %llu rank %u: %s after %llu ms (want %s)%s%s",
                     (unsigned long long)rm->id, k, kvw_room_state_string(s),
                     (unsigned long long)(now_ms() - t0), kvw_room_state_string(want),
                     why[0] ? ": " : "", why);
        if (s == KVW_ROOM_FAILED && want == KVW_ROOM_FAILED) {
            ok &= CHECK(why[0] != '\0', "decode room %llu failed without a reason",
                        (unsigned long long)rm->id);
            if (needle)
                ok &= CHECK(kvt_contains(why, needle), "decode room %llu reason lacks '%s': %s",
                            (unsigned long long)rm->id, needle, why);
            if (k == 0)
                say("decode room %llu FAILED after %llu ms: %s", (unsigned long long)rm->id,
                    (unsigned long long)(now_ms() - t0), why);
        }
        if (s == KVW_ROOM_SUCCESS && want == KVW_ROOM_SUCCESS)
            ok &= CHECK(kvw_room_status(kvw_receiver_room(rm->r[k])) == KVW_OK,
                        "success with a non-OK status");
    }
    return ok;
}

/* ------------------------------------------------------------------ verification */

enum { V_UNTOUCHED = 0, V_OK = 1, V_PARTIAL = 2 };

/* A full-pool page whose contents d_verify ignores (-1: none). */
static int64_t g_ignore_full_page = -1;

/* Bytes of one page (or slot) of a buffer of a rank built by inst_build. */
static uint64_t page_bytes(const kvw_buffer_desc_t *b)
{
    return b->length / (b->pool == KVW_POOL_FULL ? FULL_PAGES : b->pool == KVW_POOL_SWA
                                                                    ? SWA_PAGES
                                                                    : MAX_SLOTS);
}

/* Whether any byte of page `page` of pool `pool` differs from the snapshot. */
static bool page_changed(const inst_t *in, const kvt_copy_t *snap, uint32_t k, kvw_pool_t pool,
                         uint32_t page)
{
    const kvt_rank_t *r = &in->r[k];
    for (uint32_t b = 0; b < r->num_bufs; b++) {
        if (r->bufs[b].pool != pool)
            continue;
        uint64_t pb = page_bytes(&r->bufs[b]);
        if (memcmp(kvt_rank_data(r, b) + page * pb, snap[k].data[b] + page * pb, pb))
            return true;
    }
    return false;
}

typedef struct snap {
    kvt_copy_t c[MAXR];
} snap_t;

static void snap_take(const inst_t *in, snap_t *s)
{
    memset(s, 0, sizeof(*s));
    for (uint32_t k = 0; k < in->n; k++)
        kvt_copy_make(&in->r[k], &s->c[k]);
}

static void snap_free(snap_t *s)
{
    for (int k = 0; k < MAXR; k++)
        kvt_copy_free(&s->c[k]);
}

/*
 * Checks every byte of every decode buffer: rooms marked V_OK must hold exactly what
 * the reference says; V_PARTIAL rooms (failed midway) may have changed only bytes the
 * room could legitimately write; everything else must equal the snapshot taken before
 * the rooms; guard bytes must be intact. `src` is the prefill instance rebuilt here
 * (same fill pattern). Also checks each V_OK receiver's byte count.
 */
static bool d_verify(const inst_t *dec, const snap_t *snap, const inst_t *src, room_t *const *rooms,
                     const int *outcome, int nrooms)
{
    bool ok = true;
    for (uint32_t k = 0; k < dec->n && ok; k++) {
        const kvt_rank_t *dr = &dec->r[k];
        kvt_copy_t exp, junk, mask;
        kvt_copy_zeroed(dr, &exp);
        for (uint32_t b = 0; b < dr->num_bufs; b++)
            memcpy(exp.data[b], snap->c[k].data[b], exp.len[b]);
        for (int i = 0; i < nrooms && ok; i++) {
            if (outcome[i] == V_UNTOUCHED)
                continue;
            const room_t *rm = rooms[i];
            rpages_t pp, dp;
            room_pages(true, rm->slot, rm->n, &pp);
            room_pages(false, rm->slot, rm->n, &dp);
            kvt_ref_side_t ss[MAXR];
            uint8_t **sd[MAXR];
            for (uint32_t s = 0; s < src->n; s++) {
                sd[s] = calloc(src->r[s].num_bufs, sizeof(uint8_t *));
                for (uint32_t b = 0; b < src->r[s].num_bufs; b++)
                    sd[s][b] = kvt_rank_data(&src->r[s], b);
                ss[s] = kvt_ref_side(&src->r[s], &pp.side, sd[s]);
            }
            kvw_chunk_t c = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = rm->n,
                             .chunk_begin = 0, .chunk_end = rm->n,
                             .prefix_len = 0, .last_chunk = 1};
            char msg[512];
            uint64_t per_src[MAXR] = {0};
            if (outcome[i] == V_OK) {
                kvt_ref_side_t ds = kvt_ref_side(dr, &dp.side, exp.data);
                ok &= CHECK(kvt_ref_transfer(&src->model.m, ss, src->n, &ds, &c, NULL, per_src,
                                             msg, sizeof(msg)) == 0,
                            "reference: %s", msg);
                uint64_t want = 0;
                for (uint32_t s = 0; s < src->n; s++)
                    want += per_src[s];
                if (rm->r[k]) {
                    kvw_room_metrics_t mt = {.field_mask = KVW_ROOM_METRICS_FIELDS_ALL};
                    kvw_room_metrics(kvw_receiver_room(rm->r[k]), &mt);
                    ok &= CHECK(mt.bytes == want, "room %llu decode rank %u: %llu bytes "
                                "confirmed, the reference moves %llu", (unsigned long long)rm->id,
                                k, (unsigned long long)mt.bytes, (unsigned long long)want);
                }
            } else {
                kvt_copy_make(dr, &junk);
                kvt_copy_zeroed(dr, &mask);
                kvt_ref_side_t ds = kvt_ref_side(dr, &dp.side, junk.data);
                ok &= CHECK(kvt_ref_transfer(&src->model.m, ss, src->n, &ds, &c, mask.data, NULL,
                                             msg, sizeof(msg)) == 0,
                            "reference: %s", msg);
                for (uint32_t b = 0; b < dr->num_bufs; b++) {
                    const uint8_t *actual = kvt_rank_data(dr, b);
                    for (uint64_t x = 0; x < mask.len[b]; x++)
                        if (mask.data[b][x])
                            exp.data[b][x] = actual[x];
                }
                kvt_copy_free(&junk);
                kvt_copy_free(&mask);
            }
            for (uint32_t s = 0; s < src->n; s++)
                free(sd[s]);
        }
        if (g_ignore_full_page >= 0)
            for (uint32_t b = 0; b < dr->num_bufs; b++)
                if (dr->bufs[b].pool == KVW_POOL_FULL) {
                    uint64_t pb = page_bytes(&dr->bufs[b]), o = (uint64_t)g_ignore_full_page * pb;
                    memcpy(exp.data[b] + o, kvt_rank_data(dr, b) + o, pb);
                }
        char msg[512];
        if (ok)
            ok &= CHECK(kvt_copy_compare(dr, &exp, "decode buffers", msg, sizeof(msg)) == 0,
                        "decode rank %u: WRONG BYTES: %s", k, msg);
        ok &= CHECK(kvt_rank_check_guards(dr, msg, sizeof(msg)) == 0,
                    "decode rank %u: guard bytes changed: %s", k, msg);
        kvt_copy_free(&exp);
    }
    return ok;
}

/* ------------------------------------------------------------------ common roles */

typedef struct dctx {
    inst_t dec, src;
    snap_t snap;
    char bs[160];
} dctx_t;

/* Prefill start: builds, opens, tells every other process (except `skip_mask`) the
 * bootstrap address. Returns 0, 77 (transport unusable here) or 1. */
static int p_start(env_t *e, inst_t *in, unsigned skip_mask)
{
    kvw_status_t st = inst_build(in, &g_model, g_ptp, true, KVW_LAYOUT_NHD);
    if (!CHECK(st == KVW_OK, "prefill build: %s", kvw_last_error()))
        return 1;
    char bs[160], err[512];
    st = inst_open(in, true, g_tl, NULL, bs, sizeof(bs), err, sizeof(err));
    if (st == KVW_ERR_UNSUPPORTED) {
        say("transport unavailable: %s", err);
        return 77;
    }
    if (!CHECK(st == KVW_OK, "prefill contexts: %s: %s", kvw_status_string(st), err))
        return 1;
    for (int j = 0; j < MAXP; j++)
        if (j != e->me && e->ch[j] >= 0 && !(skip_mask & (1u << j)))
            ch_send(e->ch[j], "bs", "%s", bs);
    return 0;
}

/* Decode start: waits for the bootstrap address, builds its ranks and the prefill's
 * (for the reference), snapshots, and (if `connect`) opens its contexts. */
static int d_start(env_t *e, dctx_t *d, bool connect)
{
    msg_t m;
    memset(d, 0, sizeof(*d));
    int r = ch_recv(e->ch[0], &m, kvt_tmo_ms(15000));
    if (r == -2)
        return 77; /* the prefill process skipped (or failed; it reports that) */
    if (!CHECK(r == 0 && !strcmp(m.tag, "bs"), "no bootstrap address from the prefill"))
        return 1;
    snprintf(d->bs, sizeof(d->bs), "%.150s", m.text);
    if (!CHECK(inst_build(&d->dec, &g_model, g_dtp, false, KVW_LAYOUT_NHD) == KVW_OK,
               "decode build: %s", kvw_last_error()) ||
        !CHECK(inst_build(&d->src, &g_model, g_ptp, true, KVW_LAYOUT_NHD) == KVW_OK,
               "reference build: %s", kvw_last_error()))
        return 1;
    snap_take(&d->dec, &d->snap);
    if (connect) {
        char err[512];
        kvw_status_t st = inst_open(&d->dec, false, g_tl, d->bs, NULL, 0, err, sizeof(err));
        if (!CHECK(st == KVW_OK, "decode contexts: %s: %s", kvw_status_string(st), err))
            return 1;
    }
    return 0;
}

static void d_end(dctx_t *d)
{
    inst_free(&d->dec);
    inst_free(&d->src);
    snap_free(&d->snap);
}

/* Prefill end: waits for every decode-like process to say bye or go away. */
static void p_end(env_t *e, inst_t *in, int timeout_ms)
{
    for (int j = 0; j < MAXP; j++)
        if (j != e->me && e->ch[j] >= 0)
            ch_wait_gone(e->ch[j], timeout_ms);
    inst_free(in);
}

/* ================================================================== cases */

/* ---- sanity: rooms in both orders (prefill first, decode first), one chunked */

static int sanity_prefill(env_t *e)
{
    inst_t in;
    int rc = p_start(e, &in, 0);
    if (rc)
        return rc;
    room_t rooms[4];
    for (int i = 0; i < 4; i++)
        rooms[i] = room_def(10 + (uint64_t)i, i);
    if (ch_expect(e->ch[1], "ready", NULL, kvt_tmo_ms(15000)))
        return 1;
    /* Rooms 0 and 1 are sent before the decode posts them. */
    for (int i = 0; i < 2; i++) {
        p_open(&in, &rooms[i]);
        p_send_all(&in, &rooms[i]);
    }
    ch_tag(e->ch[1], "sent01");
    if (ch_expect(e->ch[1], "posted", NULL, kvt_tmo_ms(10000)))
        return 1;
    p_open(&in, &rooms[2]);
    p_send_all(&in, &rooms[2]);
    /* Room 3 in three chunks. */
    p_open(&in, &rooms[3]);
    uint64_t n = rooms[3].n;
    char err[256];
    CHECK(p_send(&in, &rooms[3], 0, n / 3, false, err, sizeof(err)) == KVW_OK, "chunk: %s", err);
    CHECK(p_send(&in, &rooms[3], n / 3, 2 * n / 3, false, err, sizeof(err)) == KVW_OK, "chunk: %s",
          err);
    CHECK(p_send(&in, &rooms[3], 2 * n / 3, n, true, err, sizeof(err)) == KVW_OK, "chunk: %s", err);
    for (int i = 0; i < 4; i++)
        p_expect(&in, &rooms[i], KVW_ROOM_SUCCESS, NULL, kvt_tmo_ms(10000), NULL);
    /* A second sender for an open room is refused. */
    kvw_sender_h dup = NULL;
    CHECK(kvw_sender_create(in.ctx[0], rooms[0].id, &dup) == KVW_ERR_BUSY,
          "a second sender for room %llu was not refused with BUSY", (unsigned long long)rooms[0].id);
    if (dup)
        kvw_room_destroy(kvw_sender_room(dup));
    for (int i = 0; i < 4; i++)
        p_close(&in, &rooms[i]);
    p_end(e, &in, kvt_tmo_ms(20000));
    return 0;
}

static int sanity_decode(env_t *e)
{
    dctx_t d;
    int rc = d_start(e, &d, true);
    if (rc)
        return rc;
    room_t rooms[4];
    for (int i = 0; i < 4; i++)
        rooms[i] = room_def(10 + (uint64_t)i, i);
    ch_tag(e->ch[0], "ready");
    if (ch_expect(e->ch[0], "sent01", NULL, kvt_tmo_ms(10000)))
        return 1;
    for (int i = 0; i < 4; i++)
        d_open_post(&d.dec, &rooms[i], NULL);
    ch_tag(e->ch[0], "posted");
    for (int i = 0; i < 4; i++)
        d_expect(&d.dec, &rooms[i], KVW_ROOM_SUCCESS, NULL, kvt_tmo_ms(10000), NULL);
    room_t *rp[4] = {&rooms[0], &rooms[1], &rooms[2], &rooms[3]};
    int out[4] = {V_OK, V_OK, V_OK, V_OK};
    if (d_verify(&d.dec, &d.snap, &d.src, rp, out, 4))
        say("4 rooms verified byte-exact (guards intact)");
    /* A second receiver for an open room is refused. */
    kvw_receiver_h dup = NULL;
    CHECK(kvw_receiver_create(d.dec.ctx[0], rooms[0].id, 0, &dup) == KVW_ERR_BUSY,
          "a second receiver for room %llu was not refused with BUSY",
          (unsigned long long)rooms[0].id);
    if (dup)
        kvw_room_destroy(kvw_receiver_room(dup));
    for (int i = 0; i < 4; i++)
        d_close(&d.dec, &rooms[i]);
    d_end(&d);
    return 0;
}

/* ---- prefill killed (variant 0: before sending; 1: mid-transfer) or frozen (2) */

static int pdeath_prefill(env_t *e)
{
    inst_t in;
    int rc = p_start(e, &in, 0);
    if (rc)
        return rc;
    room_t rm = room_def(20, 3);
    if (ch_expect(e->ch[1], "posted", NULL, kvt_tmo_ms(15000)))
        return 1;
    p_open(&in, &rm);
    if (g_variant == 1) {
        char err[256];
        CHECK(p_send(&in, &rm, 0, rm.n / 2, false, err, sizeof(err)) == KVW_OK, "chunk: %s", err);
        ch_tag(e->ch[1], "chunk1");
        if (ch_expect(e->ch[1], "transferring", NULL, kvt_tmo_ms(10000)))
            return 1;
    } else {
        ch_tag(e->ch[1], "sender");
        if (ch_expect(e->ch[1], "go", NULL, kvt_tmo_ms(10000)))
            return 1;
    }
    if (g_variant == 2) {
        ch_send(e->ch[1], "dying", "freezing");
        raise(SIGSTOP); /* the parent kills it after the decode is done */
        sleep(60);
        return 1;
    }
    ch_tag(e->ch[1], "dying");
    raise(SIGKILL);
    return 1;
}

static int pdeath_decode(env_t *e)
{
    dctx_t d;
    int rc = d_start(e, &d, true);
    if (rc)
        return rc;
    room_t rm = room_def(20, 3);
    d_open_post(&d.dec, &rm, NULL);
    ch_tag(e->ch[0], "posted");
    int outcome = V_UNTOUCHED;
    if (g_variant == 1) {
        if (ch_expect(e->ch[0], "chunk1", NULL, kvt_tmo_ms(10000)))
            return 1;
        for (uint32_t k = 0; k < d.dec.n; k++)
            CHECK(wait_recv(rm.r[k], KVW_ROOM_TRANSFERRING, kvt_tmo_ms(5000)) ==
                      KVW_ROOM_TRANSFERRING,
                  "decode rank %u never saw the first chunk (state %s: %s)", k,
                  kvw_room_state_string(kvw_room_poll(kvw_receiver_room(rm.r[k]))),
                  kvw_room_failure(kvw_receiver_room(rm.r[k])));
        ch_tag(e->ch[0], "transferring");
        outcome = V_PARTIAL;
    } else {
        if (ch_expect(e->ch[0], "sender", NULL, kvt_tmo_ms(10000)))
            return 1;
        ch_tag(e->ch[0], "go");
    }
    /* "dying" arrives just before the signal (or never, if the process is gone). */
    msg_t m;
    ch_recv(e->ch[0], &m, kvt_tmo_ms(5000));
    uint64_t t0 = now_ms();
    const char *needle = g_variant == 2 ? "heartbeat" : NULL;
    d_expect(&d.dec, &rm, KVW_ROOM_FAILED, needle, PEER_TIMEOUT_MS + SLACK_MS, NULL);
    uint64_t dt = now_ms() - t0;
    if (g_variant == 2)
        CHECK(dt + 100 >= PEER_TIMEOUT_MS, "frozen peer declared dead after %llu ms, before "
              "the %u ms peer timeout", (unsigned long long)dt, PEER_TIMEOUT_MS);
    for (uint32_t k = 0; k < d.dec.n; k++) {
        kvw_status_t st = kvw_room_status(kvw_receiver_room(rm.r[k]));
        CHECK(st != KVW_OK && st != KVW_INPROGRESS, "decode rank %u status %s", k,
              kvw_status_string(st));
    }
    /* The room never turns into SUCCESS later. */
    sleep_ms(200);
    for (uint32_t k = 0; k < d.dec.n; k++)
        CHECK(kvw_room_poll(kvw_receiver_room(rm.r[k])) == KVW_ROOM_FAILED, "FAILED is not sticky");
    /* A new room needing the dead prefill rank fails at once, with a reason. */
    room_t r2 = room_def(21, 4);
    rpages_t p;
    room_pages(false, r2.slot, r2.n, &p);
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = r2.n,
                            .pages = p.side};
    for (uint32_t k = 0; k < d.dec.n; k++) {
        if (!CHECK(kvw_receiver_create(d.dec.ctx[k], r2.id, 0, &r2.r[k]) == KVW_OK,
                   "receiver_create after the prefill died: %s", kvw_last_error()))
            continue;
        kvw_status_t st = kvw_receiver_post(r2.r[k], &post);
        if (st == KVW_OK)
            CHECK(wait_recv(r2.r[k], KVW_ROOM_SUCCESS, WAIT_TIMEOUT_MS + SLACK_MS) ==
                      KVW_ROOM_FAILED,
                  "a room posted to a dead prefill did not fail");
        else
            CHECK(kvw_last_error()[0] &&
                  kvw_room_poll(kvw_receiver_room(r2.r[k])) == KVW_ROOM_FAILED,
                  "post to a dead prefill: %s, room %s", kvw_status_string(st),
                  kvw_room_state_string(kvw_room_poll(kvw_receiver_room(r2.r[k]))));
        if (k == 0)
            say("posting to the dead prefill: %s (%s)", kvw_status_string(st),
                kvw_room_failure(kvw_receiver_room(r2.r[k])));
    }
    room_t *rp[1] = {&rm};
    d_verify(&d.dec, &d.snap, &d.src, rp, &outcome, 1);
    d_close(&d.dec, &rm);
    d_close(&d.dec, &r2);
    d_end(&d);
    return 0;
}

/* ---- decode killed; then a new decode instance (variant 0), or two decode
 * instances at once (variant 1) */

static int ddeath_prefill(env_t *e)
{
    inst_t in;
    int rc = p_start(e, &in, 0);
    if (rc)
        return rc;
    room_t r1 = room_def(30, 0), r2 = room_def(31, 1);
    if (g_variant == 0) {
        if (ch_expect(e->ch[1], "posted", NULL, kvt_tmo_ms(15000)))
            return 1;
        p_open(&in, &r1);
        p_wait_state(&in, &r1, KVW_ROOM_WAITING_FOR_INPUT, kvt_tmo_ms(5000)); /* the REQ is here */
        ch_tag(e->ch[1], "die");
        CHECK(ch_wait_gone(e->ch[1], kvt_tmo_ms(5000)), "the first decode process did not go away");
        uint64_t t0 = now_ms();
        p_expect(&in, &r1, KVW_ROOM_FAILED, "decode", PEER_TIMEOUT_MS + SLACK_MS, NULL);
        say("sender failed %llu ms after the decode process died",
            (unsigned long long)(now_ms() - t0));
        char err[256];
        CHECK(p_send(&in, &r1, 0, r1.n, true, err, sizeof(err)) != KVW_OK,
              "sending on a failed room succeeded");
        p_close(&in, &r1); /* frees the room */
        /* A new decode instance connects to the same prefill. */
        ch_tag(e->ch[2], "go");
        if (ch_expect(e->ch[2], "posted", NULL, kvt_tmo_ms(15000)))
            return 1;
        p_open(&in, &r2);
        p_send_all(&in, &r2);
        p_expect(&in, &r2, KVW_ROOM_SUCCESS, NULL, WAIT_TIMEOUT_MS + SLACK_MS, NULL);
        /* The same room id as the dead instance's room works again. */
        room_t r3 = room_def(30, 2);
        ch_tag(e->ch[2], "again");
        if (ch_expect(e->ch[2], "posted", NULL, kvt_tmo_ms(15000)))
            return 1;
        p_open(&in, &r3);
        p_send_all(&in, &r3);
        p_expect(&in, &r3, KVW_ROOM_SUCCESS, NULL, WAIT_TIMEOUT_MS + SLACK_MS, NULL);
        ch_tag(e->ch[2], "done");
        p_close(&in, &r2);
        p_close(&in, &r3);
    } else {
        ch_tag(e->ch[1], "go");
        ch_tag(e->ch[2], "go");
        if (ch_expect(e->ch[1], "posted", NULL, kvt_tmo_ms(15000)) ||
            ch_expect(e->ch[2], "posted", NULL, kvt_tmo_ms(15000)))
            return 1;
        p_open(&in, &r1);
        p_open(&in, &r2);
        p_send_all(&in, &r1);
        p_send_all(&in, &r2);
        p_expect(&in, &r1, KVW_ROOM_SUCCESS, NULL, WAIT_TIMEOUT_MS + SLACK_MS, "multi-decode");
        p_expect(&in, &r2, KVW_ROOM_SUCCESS, NULL, WAIT_TIMEOUT_MS + SLACK_MS, "multi-decode");
        ch_tag(e->ch[1], "done");
        ch_tag(e->ch[2], "done");
        p_close(&in, &r1);
        p_close(&in, &r2);
    }
    p_end(e, &in, kvt_tmo_ms(20000));
    return 0;
}

/* The decode process killed in variant 0. */
static int ddeath_victim(env_t *e)
{
    dctx_t d;
    int rc = d_start(e, &d, false);
    if (rc)
        return rc;
    if (g_variant == 1 && ch_expect(e->ch[0], "go", NULL, kvt_tmo_ms(15000)))
        return 1;
    if (g_variant == 1)
        g_instance = 1; /* instances sharing a prefill each pass their own id */
    char err[512];
    if (!CHECK(inst_open(&d.dec, false, g_tl, d.bs, NULL, 0, err, sizeof(err)) == KVW_OK,
               "decode contexts: %s", err))
        return 1;
    room_t rm = room_def(30, 0);
    d_open_post(&d.dec, &rm, NULL);
    ch_tag(e->ch[0], "posted");
    if (g_variant == 0) {
        ch_expect(e->ch[0], "die", NULL, kvt_tmo_ms(15000));
        raise(SIGKILL);
        return 1;
    }
    /* The bytes reach the decode even with the prefill-side bug, so no bug tag here. */
    d_expect(&d.dec, &rm, KVW_ROOM_SUCCESS, NULL, WAIT_TIMEOUT_MS + SLACK_MS, NULL);
    room_t *rp[1] = {&rm};
    int out = kvw_room_poll(kvw_receiver_room(rm.r[0])) == KVW_ROOM_SUCCESS ? V_OK : V_PARTIAL;
    d_verify(&d.dec, &d.snap, &d.src, rp, &out, 1);
    ch_expect(e->ch[0], "done", NULL, kvt_tmo_ms(15000));
    d_close(&d.dec, &rm);
    d_end(&d);
    return 0;
}

/* The second decode instance. */
static int ddeath_second(env_t *e)
{
    dctx_t d;
    int rc = d_start(e, &d, false);
    if (rc)
        return rc;
    if (ch_expect(e->ch[0], "go", NULL, kvt_tmo_ms(15000)))
        return 1;
    if (g_variant == 1)
        g_instance = 2;
    char err[512];
    if (!CHECK(inst_open(&d.dec, false, g_tl, d.bs, NULL, 0, err, sizeof(err)) == KVW_OK,
               "second decode instance cannot connect: %s", err))
        return 1;
    room_t rm = room_def(31, 1);
    d_open_post(&d.dec, &rm, NULL);
    ch_tag(e->ch[0], "posted");
    /* The bytes reach the decode even with the prefill-side bugs, so no bug tag here. */
    const char *bug = NULL;
    d_expect(&d.dec, &rm, KVW_ROOM_SUCCESS, NULL, WAIT_TIMEOUT_MS + SLACK_MS, bug);
    room_t r3 = room_def(30, 2);
    room_t *rp[2] = {&rm, &r3};
    int out[2] = {kvw_room_poll(kvw_receiver_room(rm.r[0])) == KVW_ROOM_SUCCESS ? V_OK : V_PARTIAL,
                  V_UNTOUCHED};
    if (g_variant == 0) {
        if (ch_expect(e->ch[0], "again", NULL, kvt_tmo_ms(15000)))
            return 1;
        d_open_post(&d.dec, &r3, NULL);
        ch_tag(e->ch[0], "posted");
        d_expect(&d.dec, &r3, KVW_ROOM_SUCCESS, NULL, WAIT_TIMEOUT_MS + SLACK_MS, bug);
        out[1] = kvw_room_poll(kvw_receiver_room(r3.r[0])) == KVW_ROOM_SUCCESS ? V_OK : V_PARTIAL;
    }
    d_verify(&d.dec, &d.snap, &d.src, rp, out, 2);
    ch_expect(e->ch[0], "done", NULL, kvt_tmo_ms(15000));
    d_close(&d.dec, &rm);
    d_close(&d.dec, &r3);
    d_end(&d);
    return 0;
}

/* ---- decode aborts: A before any byte (all decode ranks), C mid-transfer (decode
 * rank 0 only); B is healthy and concurrent */

static int dabort_prefill(env_t *e)
{
    inst_t in;
    int rc = p_start(e, &in, 0);
    if (rc)
        return rc;
    room_t a = room_def(40, 0), b = room_def(41, 1), c = room_def(42, 2);
    if (ch_expect(e->ch[1], "posted", NULL, kvt_tmo_ms(15000)))
        return 1;
    p_open(&in, &a);
    p_open(&in, &b);
    p_open(&in, &c);
    char err[256];
    CHECK(p_send(&in, &c, 0, c.n / 2, false, err, sizeof(err)) == KVW_OK, "chunk: %s", err);
    ch_tag(e->ch[1], "c1");
    if (ch_expect(e->ch[1], "aborted", NULL, kvt_tmo_ms(15000)))
        return 1;
    p_expect(&in, &a, KVW_ROOM_FAILED, "abort", PEER_TIMEOUT_MS + SLACK_MS, NULL);
    p_expect(&in, &c, KVW_ROOM_FAILED, "abort", PEER_TIMEOUT_MS + SLACK_MS, NULL);
    for (uint32_t k = 0; k < in.n; k++) {
        CHECK(kvw_room_status(kvw_sender_room(a.s[k])) == KVW_ERR_ABORTED, "aborted room status %s",
              kvw_status_string(kvw_room_status(kvw_sender_room(a.s[k]))));
    }
    /* Sending on an aborted room is refused; the healthy room goes through. */
    CHECK(p_send(&in, &a, 0, a.n, true, err, sizeof(err)) != KVW_OK,
          "sending on an aborted room succeeded");
    CHECK(p_send(&in, &c, c.n / 2, c.n, true, err, sizeof(err)) != KVW_OK,
          "sending the rest of an aborted room succeeded");
    say("send on the aborted room: %s", err);
    p_send_all(&in, &b);
    p_expect(&in, &b, KVW_ROOM_SUCCESS, NULL, kvt_tmo_ms(10000), NULL);
    ch_tag(e->ch[1], "bsent");
    p_close(&in, &a);
    p_close(&in, &b);
    p_close(&in, &c);
    p_end(e, &in, kvt_tmo_ms(20000));
    return 0;
}

static int dabort_decode(env_t *e)
{
    dctx_t d;
    int rc = d_start(e, &d, true);
    if (rc)
        return rc;
    room_t a = room_def(40, 0), b = room_def(41, 1), c = room_def(42, 2);
    d_open_post(&d.dec, &a, NULL);
    d_open_post(&d.dec, &b, NULL);
    d_open_post(&d.dec, &c, NULL);
    ch_tag(e->ch[0], "posted");
    if (ch_expect(e->ch[0], "c1", NULL, kvt_tmo_ms(10000)))
        return 1;
    for (uint32_t k = 0; k < d.dec.n; k++)
        kvw_room_abort(kvw_receiver_room(a.r[k]));
    for (uint32_t k = 0; k < d.dec.n; k++)
        CHECK(wait_recv(c.r[k], KVW_ROOM_TRANSFERRING, kvt_tmo_ms(5000)) == KVW_ROOM_TRANSFERRING,
              "room C never started on decode rank %u: %s", k,
              kvw_room_failure(kvw_receiver_room(c.r[k])));
    kvw_room_abort(kvw_receiver_room(c.r[0])); /* only decode rank 0 aborts C */
    uint64_t t0 = now_ms();
    ch_tag(e->ch[0], "aborted");
    for (uint32_t k = 0; k < d.dec.n; k++) {
        CHECK(kvw_room_poll(kvw_receiver_room(a.r[k])) == KVW_ROOM_FAILED &&
                  kvw_room_status(kvw_receiver_room(a.r[k])) == KVW_ERR_ABORTED,
              "locally aborted room A is %s / %s",
              kvw_room_state_string(kvw_room_poll(kvw_receiver_room(a.r[k]))),
              kvw_status_string(kvw_room_status(kvw_receiver_room(a.r[k]))));
        CHECK(kvt_contains(kvw_room_failure(kvw_receiver_room(a.r[k])), "abort"),
              "abort reason: %s",
              kvw_room_failure(kvw_receiver_room(a.r[k])));
    }
    /* The other decode ranks of C hear of the failure from the prefill promptly, not
     * through their wait timeout. */
    d_expect(&d.dec, &c, KVW_ROOM_FAILED, NULL, WAIT_TIMEOUT_MS + SLACK_MS, NULL);
    uint64_t dt = now_ms() - t0;
    const char *why1 = d.dec.n > 1 ? kvw_room_failure(kvw_receiver_room(c.r[1])) : "";
    BUGCHECK("abort-propagation", !kvt_contains(why1, "timed out") && dt < WAIT_TIMEOUT_MS,
             "decode rank 1 did not abort room C and learned of decode rank 0's abort only "
             "through its own wait timeout, %llu ms later: %s", (unsigned long long)dt, why1);
    d_expect(&d.dec, &b, KVW_ROOM_SUCCESS, NULL, kvt_tmo_ms(10000), NULL);
    if (ch_expect(e->ch[0], "bsent", NULL, kvt_tmo_ms(15000)))
        return 1;
    sleep_ms(100); /* late writes for A or C would land now */
    room_t *rp[3] = {&a, &b, &c};
    int out[3] = {V_UNTOUCHED, V_OK, V_PARTIAL};
    d_verify(&d.dec, &d.snap, &d.src, rp, out, 3);
    d_close(&d.dec, &a);
    d_close(&d.dec, &b);
    d_close(&d.dec, &c);
    d_end(&d);
    return 0;
}

/* ---- prefill aborts: D before any byte, F mid-transfer; E healthy */

static int pabort_prefill(env_t *e)
{
    inst_t in;
    int rc = p_start(e, &in, 0);
    if (rc)
        return rc;
    room_t dd = room_def(50, 0), ee = room_def(51, 1), ff = room_def(52, 2);
    if (ch_expect(e->ch[1], "posted", NULL, kvt_tmo_ms(15000)))
        return 1;
    p_open(&in, &dd);
    p_open(&in, &ee);
    p_open(&in, &ff);
    char err[256];
    CHECK(p_send(&in, &ff, 0, ff.n / 2, false, err, sizeof(err)) == KVW_OK, "chunk: %s", err);
    ch_tag(e->ch[1], "f1");
    if (ch_expect(e->ch[1], "transferring", NULL, kvt_tmo_ms(10000)))
        return 1;
    for (uint32_t k = 0; k < in.n; k++) {
        kvw_room_abort(kvw_sender_room(dd.s[k]));
        kvw_room_abort(kvw_sender_room(ff.s[k]));
    }
    for (uint32_t k = 0; k < in.n; k++)
        CHECK(kvw_room_poll(kvw_sender_room(dd.s[k])) == KVW_ROOM_FAILED &&
                  kvw_room_status(kvw_sender_room(dd.s[k])) == KVW_ERR_ABORTED &&
                  kvt_contains(kvw_room_failure(kvw_sender_room(dd.s[k])), "abort"),
              "locally aborted sender: %s / %s: %s",
              kvw_room_state_string(kvw_room_poll(kvw_sender_room(dd.s[k]))),
              kvw_status_string(kvw_room_status(kvw_sender_room(dd.s[k]))),
              kvw_room_failure(kvw_sender_room(dd.s[k])));
    CHECK(p_send(&in, &ff, ff.n / 2, ff.n, true, err, sizeof(err)) != KVW_OK,
          "sending on an aborted room succeeded");
    p_send_all(&in, &ee);
    p_expect(&in, &ee, KVW_ROOM_SUCCESS, NULL, kvt_tmo_ms(10000), NULL);
    ch_tag(e->ch[1], "esent");
    p_close(&in, &dd);
    p_close(&in, &ee);
    p_close(&in, &ff);
    p_end(e, &in, kvt_tmo_ms(20000));
    return 0;
}

static int pabort_decode(env_t *e)
{
    dctx_t d;
    int rc = d_start(e, &d, true);
    if (rc)
        return rc;
    room_t dd = room_def(50, 0), ee = room_def(51, 1), ff = room_def(52, 2);
    d_open_post(&d.dec, &dd, NULL);
    d_open_post(&d.dec, &ee, NULL);
    d_open_post(&d.dec, &ff, NULL);
    ch_tag(e->ch[0], "posted");
    if (ch_expect(e->ch[0], "f1", NULL, kvt_tmo_ms(10000)))
        return 1;
    for (uint32_t k = 0; k < d.dec.n; k++)
        CHECK(wait_recv(ff.r[k], KVW_ROOM_TRANSFERRING, kvt_tmo_ms(5000)) == KVW_ROOM_TRANSFERRING,
              "room F never started on decode rank %u", k);
    ch_tag(e->ch[0], "transferring");
    d_expect(&d.dec, &dd, KVW_ROOM_FAILED, "aborted by the prefill", PEER_TIMEOUT_MS + SLACK_MS,
             NULL);
    d_expect(&d.dec, &ff, KVW_ROOM_FAILED, "aborted by the prefill", PEER_TIMEOUT_MS + SLACK_MS,
             NULL);
    for (uint32_t k = 0; k < d.dec.n; k++)
        CHECK(kvw_room_status(kvw_receiver_room(dd.r[k])) == KVW_ERR_ABORTED,
              "room aborted by the prefill has status %s on the decode",
              kvw_status_string(kvw_room_status(kvw_receiver_room(dd.r[k]))));
    d_expect(&d.dec, &ee, KVW_ROOM_SUCCESS, NULL, kvt_tmo_ms(10000), NULL);
    if (ch_expect(e->ch[0], "esent", NULL, kvt_tmo_ms(15000)))
        return 1;
    sleep_ms(100);
    room_t *rp[3] = {&dd, &ee, &ff};
    int out[3] = {V_UNTOUCHED, V_OK, V_PARTIAL};
    d_verify(&d.dec, &d.snap, &d.src, rp, out, 3);
    d_close(&d.dec, &dd);
    d_close(&d.dec, &ee);
    d_close(&d.dec, &ff);
    d_end(&d);
    return 0;
}

/* ---- handshake rejections */

static int hs_prefill(env_t *e)
{
    inst_t in;
    int rc = p_start(e, &in, 0);
    if (rc)
        return rc;
    if (ch_expect(e->ch[1], "posted", NULL, kvt_tmo_ms(60000)))
        return 1;
    room_t rm = room_def(60, 0);
    p_open(&in, &rm);
    p_send_all(&in, &rm);
    p_expect(&in, &rm, KVW_ROOM_SUCCESS, NULL, kvt_tmo_ms(10000), NULL);
    p_close(&in, &rm);
    p_end(e, &in, kvt_tmo_ms(20000));
    return 0;
}

typedef struct hs_variant {
    const char *what;
    const char *needle;  /* expected in kvw_last_error() */
    const char *needle2; /* and this too, if set */
} hs_variant_t;

/* One decode instance (TP g_dtp) built from `m` must be refused with a reason. */
static void hs_try(const char *bs, const kvt_model_t *m, kvw_layout_t layout, const char *tl,
                   const hs_variant_t *v)
{
    inst_t bad;
    kvw_status_t st = inst_build(&bad, m, g_dtp, false, layout);
    if (st != KVW_OK) {
        /* Refused before any connection: the rank description itself. */
        const char *msg = kvw_last_error();
        CHECK(kvt_contains(msg, v->needle) && (!v->needle2 || kvt_contains(msg, v->needle2)),
              "%s: refused at kvw_rank_create (%s) but the message lacks '%s': %s", v->what,
              kvw_status_string(st), v->needle, msg);
        say("%s: kvw_rank_create: %s: %s", v->what, kvw_status_string(st), msg);
        return;
    }
    char err[768];
    uint64_t t0 = now_ms();
    st = inst_open(&bad, false, tl, bs, NULL, 0, err, sizeof(err));
    uint64_t dt = now_ms() - t0;
    CHECK(st == KVW_ERR_REJECTED, "%s: kvw_ctx_create returned %s, not REJECTED: %s", v->what,
          kvw_status_string(st), st == KVW_OK ? "accepted" : err);
    if (st != KVW_OK) {
        CHECK(kvt_contains(err, v->needle) && (!v->needle2 || kvt_contains(err, v->needle2)),
              "%s: the reason lacks '%s': %s", v->what, v->needle, err);
        CHECK(dt < kvt_tmo_ms(3000), "%s: the rejection took %llu ms", v->what,
              (unsigned long long)dt);
        say("%s: %s in %llu ms: %s", v->what, kvw_status_string(st), (unsigned long long)dt, err);
    }
    inst_free(&bad);
}

static int hs_decode(env_t *e)
{
    dctx_t d;
    int rc = d_start(e, &d, false);
    if (rc)
        return rc;
    kvt_model_t m;
    hs_variant_t v;

    m = g_model;
    kvt_model_relink(&m);
    m.m.elem_size = 1;
    v = (hs_variant_t){"fp8 decode (element size 1)", "element size", NULL};
    hs_try(d.bs, &m, KVW_LAYOUT_NHD, g_tl, &v);

    m = g_model;
    kvt_model_relink(&m);
    m.m.num_kv_heads = 4;
    v = (hs_variant_t){"decode with 4 KV heads", "KV head", NULL};
    hs_try(d.bs, &m, KVW_LAYOUT_NHD, g_tl, &v);

    m = g_model;
    kvt_model_relink(&m);
    m.m.k_head_dim = m.m.v_head_dim = 128;
    v = (hs_variant_t){"decode with head dim 128", "head dim", NULL};
    hs_try(d.bs, &m, KVW_LAYOUT_NHD, g_tl, &v);

    kvt_model_preset("gpt-oss-120b", &m);
    kvt_model_truncate(&m, 4);
    v = (hs_variant_t){"decode with 4 layers", "layer count", NULL};
    hs_try(d.bs, &m, KVW_LAYOUT_NHD, g_tl, &v);

    m = g_model;
    kvt_model_relink(&m);
    m.layers[0].window = 64;
    v = (hs_variant_t){"decode with SWA window 64", "window", NULL};
    hs_try(d.bs, &m, KVW_LAYOUT_NHD, g_tl, &v);

    m = g_model;
    kvt_model_relink(&m);
    m.layers[0].kind = KVW_LAYER_FULL;
    m.layers[0].window = 0;
    v = (hs_variant_t){"decode whose layer 0 is full attention", "layer 0", NULL};
    hs_try(d.bs, &m, KVW_LAYOUT_NHD, g_tl, &v);

    v = (hs_variant_t){"decode speaking the other transport", "transport", NULL};
    hs_try(d.bs, &g_model, KVW_LAYOUT_NHD, strcmp(g_tl, "tcp") ? "tcp" : "shm", &v);

    v = (hs_variant_t){"vectorized 5-D decode layout", "5-D", "NHD or HND"};
    hs_try(d.bs, &g_model, KVW_LAYOUT_VECTORIZED_5D, g_tl, &v);

    /* TP 3 cannot split 8 heads: kvw_rank_create refuses with the numbers. (The test
     * kit refuses to lay such a rank out, so describe TP 2 and edit the TP size.) */
    {
        kvt_rank_t r3;
        kvt_rank_spec_t sp = {.model = &g_model, .layout = KVW_LAYOUT_NHD,
                              .page_size = {PAGE, PAGE}, .num_pages = {FULL_PAGES, SWA_PAGES},
                              .num_slots = MAX_SLOTS, .describe_only = 1};
        sp.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = 2,
                                  .pp_size = 1, .layer_end = 2, .dp_size = 1};
        if (CHECK(kvt_rank_describe(&sp, &r3) == KVW_OK, "describe TP 2")) {
            r3.par.tp_size = 3;
            kvw_status_t st = kvt_rank_open(&r3);
            const char *msg = kvw_last_error();
            CHECK(st == KVW_ERR_INCOMPATIBLE && kvt_contains(msg, "8 KV heads") &&
                      kvt_contains(msg, "TP 3"),
                  "decode TP 3 with 8 heads: kvw_rank_create returned %s: %s",
                  kvw_status_string(st), msg);
            say("decode TP 3 with 8 heads: kvw_rank_create: %s: %s", kvw_status_string(st), msg);
            kvt_rank_free(&r3);
        }
    }

    /* After all that, a compatible decode instance connects and moves verified bytes. */
    char err[512];
    kvw_status_t st = inst_open(&d.dec, false, g_tl, d.bs, NULL, 0, err, sizeof(err));
    if (!CHECK(st == KVW_OK, "good decode after the rejections: %s: %s", kvw_status_string(st),
               err))
        return 1;
    room_t rm = room_def(60, 0);
    d_open_post(&d.dec, &rm, NULL);
    ch_tag(e->ch[0], "posted");
    d_expect(&d.dec, &rm, KVW_ROOM_SUCCESS, NULL, kvt_tmo_ms(10000), NULL);
    room_t *rp[1] = {&rm};
    int out = V_OK;
    d_verify(&d.dec, &d.snap, &d.src, rp, &out, 1);
    d_close(&d.dec, &rm);
    d_end(&d);
    return 0;
}

/* ---- raw sockets */

static void put_le32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void put_hdr(uint8_t *h, uint32_t magic, uint8_t ver, uint8_t type, uint32_t len)
{
    put_le32(h, magic);
    h[4] = ver;
    h[5] = type;
    h[6] = h[7] = 0;
    put_le32(h + 8, len);
}

static int parse_addr(const char *s, struct sockaddr_in *sa)
{
    char host[128];
    const char *c = strrchr(s, ':');
    if (!c || (size_t)(c - s) >= sizeof(host))
        return -1;
    memcpy(host, s, (size_t)(c - s));
    host[c - s] = '\0';
    memset(sa, 0, sizeof(*sa));
    sa->sin_family = AF_INET;
    sa->sin_port = htons((uint16_t)atoi(c + 1));
    return inet_pton(AF_INET, host, &sa->sin_addr) == 1 ? 0 : -1;
}

/* Blocking TCP connection with send/receive timeouts. -1 on failure. */
static int raw_connect(const char *addr, int timeout_ms)
{
    struct sockaddr_in sa;
    if (parse_addr(addr, &sa))
        return -1;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int write_full(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n) {
        ssize_t k = send(fd, b, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        b += k;
        n -= (size_t)k;
    }
    return 0;
}

static int read_full(int fd, void *p, size_t n)
{
    uint8_t *b = p;
    while (n) {
        ssize_t k = recv(fd, b, n, 0);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        b += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Reads one frame (the magic and version checked). 0, or -1. */
static int read_frame(int fd, uint8_t *type, uint8_t **payload, uint32_t *len)
{
    uint8_t h[12];
    if (read_full(fd, h, 12) || get_le32(h) != WIRE_MAGIC || h[4] != 1)
        return -1;
    *type = h[5];
    *len = get_le32(h + 8);
    if (*len > (1u << 20))
        return -1;
    *payload = malloc(*len ? *len : 1);
    if (read_full(fd, *payload, *len)) {
        free(*payload);
        return -1;
    }
    return 0;
}

/* After a bad frame: the server must close the connection within timeout_ms. What it
 * sent before closing goes to `out`: "closed", "rejected: <reason>" or the frame types.
 * true if closed. */
static bool expect_dropped(int fd, int timeout_ms, char *out, size_t cap)
{
    uint64_t end = now_ms() + (uint64_t)timeout_ms;
    uint8_t buf[4096];
    size_t got = 0;
    snprintf(out, cap, "still open after %d ms", timeout_ms);
    while (now_ms() < end) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 50) <= 0)
            continue;
        ssize_t k = recv(fd, buf + got, sizeof(buf) - got, MSG_DONTWAIT);
        if (k < 0 && (errno == EAGAIN || errno == EINTR))
            continue;
        if (k > 0) {
            got += (size_t)k;
            if (got < sizeof(buf))
                continue;
        }
        /* Closed (or too much): describe the frames received. */
        snprintf(out, cap, "closed");
        size_t o = 0;
        while (o + 12 <= got) {
            uint32_t len = get_le32(buf + o + 8);
            uint8_t type = buf[o + 5];
            if (o + 12 + len > got)
                break;
            if (type == T_REJECT && len >= 8) {
                uint32_t sl = get_le32(buf + o + 16);
                if (sl > len - 8)
                    sl = len - 8;
                snprintf(out, cap, "rejected: %.*s", (int)sl, (const char *)buf + o + 20);
                break;
            }
            size_t l = strlen(out);
            snprintf(out + l, cap - l, "%s frame type %u", o ? "," : " after", type);
            o += 12 + len;
        }
        return k <= 0;
    }
    return false;
}

/* Asks the bootstrap for its table. Returns the number of entries (the first
 * entry's control address in ctl_addr), or -1. */
static int bs_lookup(const char *bs, char *ctl_addr, size_t cap)
{
    int fd = raw_connect(bs, kvt_tmo_ms(2000));
    if (fd < 0)
        return -1;
    uint8_t h[12], type;
    uint8_t *p = NULL;
    uint32_t len;
    put_hdr(h, WIRE_MAGIC, 1, T_BS_LOOKUP, 0);
    int n = -1;
    if (write_full(fd, h, 12) == 0 && read_frame(fd, &type, &p, &len) == 0) {
        if (type == T_BS_TABLE && len >= 4) {
            n = (int)get_le32(p);
            if (n >= 1 && len >= 4 + 28) {
                uint32_t sl = get_le32(p + 4 + 24);
                if (sl < cap && 4 + 28 + sl <= len) {
                    memcpy(ctl_addr, p + 32, sl);
                    ctl_addr[sl] = '\0';
                }
            }
        }
        free(p);
    }
    close(fd);
    return n;
}

/* Whether the prefill's control port opens with a CHALLENGE frame (-1: not known yet).
 * Newer handshakes do; the HELLO then starts with u8 has_mac, mac[32], nonce[32]. */
static int g_challenge = -1;

/* Connects to a port; on the control port, consumes the CHALLENGE if one comes. */
static int port_connect(const char *addr, bool control)
{
    int fd = raw_connect(addr, kvt_tmo_ms(3000));
    if (fd < 0 || !control)
        return fd;
    if (g_challenge < 0) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        g_challenge = poll(&p, 1, (int)kvt_tmo_ms(500)) > 0;
    }
    if (g_challenge) {
        uint8_t type, *pl = NULL;
        uint32_t len;
        if (read_frame(fd, &type, &pl, &len) || type != T_CHALLENGE) {
            CHECK(false, "the control port did not open with a challenge");
            close(fd);
            return -1;
        }
        free(pl);
    }
    return fd;
}

typedef struct raw_attack {
    const char *what;
    uint8_t bytes[96];
    size_t len;
    int hold_ms; /* keep the connection open this long after sending (0: close at once) */
    bool expect_close; /* the server must drop us */
    const char *reject_needle; /* if set, a REJECT with this text is expected */
} raw_attack_t;

static size_t mk_hdr(uint8_t *b, uint32_t magic, uint8_t ver, uint8_t type, uint32_t len)
{
    put_hdr(b, magic, ver, type, len);
    return 12;
}

/* Builds the list of malformed inputs for the bootstrap or the control port. */
static int mk_attacks(raw_attack_t *a, bool control)
{
    int n = 0;
    raw_attack_t *x;
    uint8_t lookup = control ? T_HELLO : T_BS_LOOKUP;

    x = &a[n++];
    *x = (raw_attack_t){.what = "garbage bytes", .expect_close = true};
    for (int i = 0; i < 40; i++)
        x->bytes[i] = (uint8_t)(i * 37 + 11);
    x->len = 40;

    x = &a[n++];
    *x = (raw_attack_t){.what = "bad magic", .expect_close = true};
    x->len = mk_hdr(x->bytes, 0x3257564bu /* KVW2 */, 1, lookup, 0);

    x = &a[n++];
    *x = (raw_attack_t){.what = "bad version", .expect_close = true};
    x->len = mk_hdr(x->bytes, WIRE_MAGIC, 2, lookup, 0);

    x = &a[n++];
    *x = (raw_attack_t){.what = "oversized length", .expect_close = true};
    x->len = mk_hdr(x->bytes, WIRE_MAGIC, 1, lookup, 0x7fffffffu);

    x = &a[n++];
    *x = (raw_attack_t){.what = "unknown frame type 0", .expect_close = true};
    x->len = mk_hdr(x->bytes, WIRE_MAGIC, 1, 0, 0);

    x = &a[n++];
    *x = (raw_attack_t){.what = "unknown frame type 200", .expect_close = true};
    x->len = mk_hdr(x->bytes, WIRE_MAGIC, 1, 200, 0);

    x = &a[n++];
    *x = (raw_attack_t){.what = "half a header, then close"};
    x->len = mk_hdr(x->bytes, WIRE_MAGIC, 1, lookup, 0) / 2;

    x = &a[n++];
    *x = (raw_attack_t){.what = "truncated payload, then close"};
    x->len = mk_hdr(x->bytes, WIRE_MAGIC, 1, lookup, 64) + 10;

    x = &a[n++];
    *x = (raw_attack_t){.what = "connect and close"};
    x->len = 0;

    if (!control) {
        x = &a[n++];
        *x = (raw_attack_t){.what = "lookup with trailing bytes", .expect_close = true};
        x->len = mk_hdr(x->bytes, WIRE_MAGIC, 1, T_BS_LOOKUP, 4) + 4;

        x = &a[n++];
        *x = (raw_attack_t){.what = "truncated register", .expect_close = true};
        x->len = mk_hdr(x->bytes, WIRE_MAGIC, 1, T_BS_REGISTER, 8) + 8;

        x = &a[n++];
        *x = (raw_attack_t){.what = "control frame on the bootstrap", .expect_close = true};
        x->len = mk_hdr(x->bytes, WIRE_MAGIC, 1, T_HELLO, 0);
    } else {
        x = &a[n++];
        *x = (raw_attack_t){.what = "request before registration", .expect_close = true};
        x->len = mk_hdr(x->bytes, WIRE_MAGIC, 1, T_REQ, 0);

        x = &a[n++];
        *x = (raw_attack_t){.what = "heartbeat before registration", .expect_close = true};
        x->len = mk_hdr(x->bytes, WIRE_MAGIC, 1, T_HEARTBEAT, 0);

        x = &a[n++];
        *x = (raw_attack_t){.what = "truncated registration", .expect_close = true};
        x->len = mk_hdr(x->bytes, WIRE_MAGIC, 1, T_HELLO, 3) + 3;
    }
    return n;
}

/*
 * A registration whose header and envelope are well formed but whose rank description
 * is nonsense (`layers` layers) must get a REJECT that says so. The envelope before
 * the rank description has grown over time (auth fields, an instance id), so the
 * known layouts are tried, newest first; the result says which one got the REJECT.
 */
static void hello_probe(const char *addr, uint32_t layers)
{
    static const struct {
        const char *name;
        size_t auth;  /* u8 has_mac, mac[32], nonce[32] */
        bool instance; /* u64 instance id after the peer id */
    } env[] = {{"auth + instance id", 65, true}, {"auth", 65, false}, {"plain", 0, false}};
    char last[600] = "";
    for (size_t v = 0; v < KVW_ARRAY_N(env); v++) {
        if (env[v].auth && g_challenge == 0)
            continue;
        int fd = port_connect(addr, true);
        if (!CHECK(fd >= 0, "control port %s: cannot connect", addr))
            return;
        uint8_t b[256];
        size_t tl_len = strlen(g_tl), o = 12;
        memset(b, 0, sizeof(b));
        o += env[v].auth;                 /* no MAC, zero nonce */
        put_le32(b + o, 0), o += 4;       /* peer id */
        if (env[v].instance)
            o += 8;                       /* instance id 0 */
        put_le32(b + o, (uint32_t)tl_len), o += 4;
        memcpy(b + o, g_tl, tl_len), o += tl_len;
        put_le32(b + o, 0), o += 4;       /* empty transport address */
        put_le32(b + o, layers), o += 4;  /* the rank description starts: layer count */
        put_hdr(b, WIRE_MAGIC, 1, T_HELLO, (uint32_t)(o - 12));
        write_full(fd, b, o);
        bool closed = expect_dropped(fd, kvt_tmo_ms(3000), last, sizeof(last));
        close(fd);
        CHECK(closed, "control port: a registration with %u layers left the connection open",
              layers);
        if (kvt_contains(last, "rejected") && kvt_contains(last, "layer count")) {
            say("control port, registration with %u layers (%s envelope): %s", layers,
                env[v].name, last);
            return;
        }
    }
    CHECK(false, "control port: a registration with %u layers got no REJECT naming the layer "
          "count under any known envelope; last answer: %s", layers, last);
}

/* Runs the attacks against addr; after each, `alive` checks the server still serves. */
static void run_attacks(const char *addr, bool control, const char *bs)
{
    raw_attack_t at[24];
    if (control && g_challenge < 0) {
        int fd = port_connect(addr, true); /* learns whether a challenge comes */
        if (fd >= 0)
            close(fd);
        say("the control port %s with a challenge", g_challenge > 0 ? "opens" : "does not open");
    }
    int n = mk_attacks(at, control);
    for (int i = 0; i < n; i++) {
        int fd = port_connect(addr, control);
        if (!CHECK(fd >= 0, "%s port %s: cannot connect for '%s'", control ? "control" : "bootstrap",
                   addr, at[i].what))
            continue;
        uint64_t t0 = now_ms();
        if (at[i].len)
            write_full(fd, at[i].bytes, at[i].len);
        if (at[i].expect_close) {
            char out[600];
            bool closed = expect_dropped(fd, kvt_tmo_ms(3000), out, sizeof(out));
            CHECK(closed, "%s port: '%s': the server kept the connection: %s",
                  control ? "control" : "bootstrap", at[i].what, out);
            if (at[i].reject_needle)
                CHECK(kvt_contains(out, at[i].reject_needle),
                      "%s port: '%s': expected a REJECT naming '%s', got: %s",
                      control ? "control" : "bootstrap", at[i].what, at[i].reject_needle, out);
            say("%s port, %s: %s (%llu ms)", control ? "control" : "bootstrap", at[i].what, out,
                (unsigned long long)(now_ms() - t0));
        }
        close(fd);
        /* The bootstrap still answers and still lists the prefill rank. */
        char ctl[160] = "";
        int entries = bs_lookup(bs, ctl, sizeof(ctl));
        CHECK(entries == (int)g_ptp, "after '%s' on the %s port, the bootstrap lookup gave %d "
              "entries", at[i].what, control ? "control" : "bootstrap", entries);
    }
    if (control) {
        hello_probe(addr, 0);
        hello_probe(addr, 0xffffffffu);
    }
}

static int malformed_prefill(env_t *e)
{
    inst_t in;
    int rc = p_start(e, &in, 0);
    if (rc)
        return rc;
    if (ch_expect(e->ch[1], "posted", NULL, kvt_tmo_ms(60000)))
        return 1;
    room_t rm = room_def(70, 1);
    p_open(&in, &rm);
    p_send_all(&in, &rm);
    p_expect(&in, &rm, KVW_ROOM_SUCCESS, NULL, kvt_tmo_ms(10000), NULL);
    p_close(&in, &rm);
    p_end(e, &in, kvt_tmo_ms(20000));
    return 0;
}

static int malformed_decode(env_t *e)
{
    dctx_t d;
    int rc = d_start(e, &d, false);
    if (rc)
        return rc;
    char ctl[160] = "";
    int n = bs_lookup(d.bs, ctl, sizeof(ctl));
    if (!CHECK(n >= 1 && ctl[0], "BS_LOOKUP on %s failed (%d)", d.bs, n))
        return 1;
    say("bootstrap %s lists %d prefill rank(s); rank 0's control port is %s", d.bs, n, ctl);
    run_attacks(d.bs, false, d.bs);
    run_attacks(ctl, true, d.bs);
    /* The servers keep serving: a decode instance connects and moves verified bytes. */
    char err[512];
    kvw_status_t st = inst_open(&d.dec, false, g_tl, d.bs, NULL, 0, err, sizeof(err));
    if (!CHECK(st == KVW_OK, "decode after the malformed frames: %s: %s", kvw_status_string(st),
               err))
        return 1;
    room_t rm = room_def(70, 1);
    d_open_post(&d.dec, &rm, NULL);
    ch_tag(e->ch[0], "posted");
    d_expect(&d.dec, &rm, KVW_ROOM_SUCCESS, NULL, kvt_tmo_ms(10000), NULL);
    room_t *rp[1] = {&rm};
    int out = V_OK;
    d_verify(&d.dec, &d.snap, &d.src, rp, &out, 1);
    d_close(&d.dec, &rm);
    d_end(&d);
    return 0;
}

/* ---- stalled connections: a peer that connects to the prefill's control port (or the
 * bootstrap) and sends nothing, or half a header, must not disturb healthy peers */

static int stall_prefill(env_t *e)
{
    inst_t in;
    int rc = p_start(e, &in, 0);
    if (rc)
        return rc;
    room_t rm = room_def(80, 0);
    if (ch_expect(e->ch[1], "posted", NULL, kvt_tmo_ms(20000)))
        return 1;
    p_open(&in, &rm);
    p_send_all(&in, &rm);
    p_expect(&in, &rm, KVW_ROOM_SUCCESS, NULL, WAIT_TIMEOUT_MS + SLACK_MS, "stall");
    p_close(&in, &rm);
    p_end(e, &in, kvt_tmo_ms(20000));
    return 0;
}

static int stall_decode(env_t *e)
{
    dctx_t d;
    int rc = d_start(e, &d, true);
    if (rc)
        return rc;
    char ctl[160] = "";
    CHECK(bs_lookup(d.bs, ctl, sizeof(ctl)) >= 1, "lookup failed");
    /* Connected and idle; now stalled connections on the control port for three peer
     * timeouts: 16 silent ones and one with half a header. */
    int silent[16];
    for (int i = 0; i < 16; i++)
        silent[i] = raw_connect(ctl, kvt_tmo_ms(3000));
    int s2 = raw_connect(ctl, kvt_tmo_ms(3000));
    uint8_t h[12];
    put_hdr(h, WIRE_MAGIC, 1, T_HELLO, 100);
    if (s2 >= 0)
        write_full(s2, h, 6);
    int s3 = raw_connect(d.bs, kvt_tmo_ms(3000));
    if (s3 >= 0)
        write_full(s3, h, 6);
    /* The bootstrap serves one frame at a time: how long does a lookup wait behind a
     * client that stalls in the middle of a frame? */
    sleep_ms(50);
    uint64_t l0 = now_ms();
    char ctl2[160] = "";
    int ent = bs_lookup(d.bs, ctl2, sizeof(ctl2));
    uint64_t lt = now_ms() - l0;
    CHECK(ent >= 1, "bootstrap lookup during a stalled client failed");
    if (lt > 300)
        say("NOTE: a bootstrap lookup waited %llu ms behind a client stalled mid-frame",
            (unsigned long long)lt);
    uint64_t elapsed = now_ms() - l0 + 50;
    if (elapsed < 3 * PEER_TIMEOUT_MS)
        sleep_ms((unsigned)(3 * PEER_TIMEOUT_MS - elapsed));
    for (int i = 0; i < 16; i++)
        if (silent[i] >= 0)
            close(silent[i]);
    if (s2 >= 0)
        close(s2);
    if (s3 >= 0)
        close(s3);
    room_t rm = room_def(80, 0);
    rpages_t p;
    room_pages(false, rm.slot, rm.n, &p);
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = rm.n,
                            .pages = p.side};
    for (uint32_t k = 0; k < d.dec.n; k++) {
        CHECK(kvw_receiver_create(d.dec.ctx[k], rm.id, 0, &rm.r[k]) == KVW_OK, "create: %s",
              kvw_last_error());
        kvw_status_t st = kvw_receiver_post(rm.r[k], &post);
        BUGCHECK("stall", st == KVW_OK,
                 "after a stalled connection on the prefill's control port, posting fails: "
                 "%s: %s", kvw_status_string(st), kvw_last_error());
    }
    ch_tag(e->ch[0], "posted");
    d_expect(&d.dec, &rm, KVW_ROOM_SUCCESS, NULL, WAIT_TIMEOUT_MS + SLACK_MS, "stall");
    room_t *rp[1] = {&rm};
    int out = kvw_room_poll(kvw_receiver_room(rm.r[0])) == KVW_ROOM_SUCCESS ? V_OK : V_PARTIAL;
    d_verify(&d.dec, &d.snap, &d.src, rp, &out, 1);
    d_close(&d.dec, &rm);
    d_end(&d);
    return 0;
}

/* ---- bad page lists on the decode side */

enum { BP_OUT_OF_POOL, BP_SHORT, BP_DUP, BP_SWA_MISALIGNED, BP_HEALTHY, BP_N };

static int badpages_prefill(env_t *e)
{
    inst_t in;
    int rc = p_start(e, &in, 0);
    if (rc)
        return rc;
    if (ch_expect(e->ch[1], "posted", NULL, kvt_tmo_ms(15000)))
        return 1;
    room_t rm[BP_N];
    for (int i = 0; i < BP_N; i++) {
        rm[i] = room_def(90 + (uint64_t)i, i);
        p_open(&in, &rm[i]);
        p_send_all(&in, &rm[i]);
    }
    for (int i = 0; i < BP_N; i++)
        p_expect(&in, &rm[i], i == BP_HEALTHY ? KVW_ROOM_SUCCESS : KVW_ROOM_FAILED, NULL,
                 WAIT_TIMEOUT_MS + SLACK_MS, NULL);
    for (int i = 0; i < BP_N; i++)
        p_close(&in, &rm[i]);
    p_end(e, &in, kvt_tmo_ms(20000));
    return 0;
}

static int badpages_decode(env_t *e)
{
    dctx_t d;
    int rc = d_start(e, &d, true);
    if (rc)
        return rc;
    room_t rm[BP_N];
    kvw_status_t post_st[BP_N][MAXR];
    char post_err[BP_N][512];
    static const char *const what[BP_N] = {"a page index beyond the pool",
                                          "a page list one page short",
                                          "a page listed twice",
                                          "an SWA list starting off its page boundary",
                                          "healthy"};
    for (int i = 0; i < BP_N; i++) {
        rm[i] = room_def(90 + (uint64_t)i, i);
        rpages_t p;
        room_pages(false, rm[i].slot, rm[i].n, &p);
        switch (i) {
        case BP_OUT_OF_POOL: p.full[1] = FULL_PAGES + 3; break;
        case BP_SHORT: p.side.full.num_pages--; break;
        case BP_DUP: p.full[2] = p.full[0]; break;
        case BP_SWA_MISALIGNED: p.side.swa.first_token += 1; break;
        default: break;
        }
        kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = rm[i].n,
                                .pages = p.side};
        post_err[i][0] = '\0';
        for (uint32_t k = 0; k < d.dec.n; k++) {
            CHECK(kvw_receiver_create(d.dec.ctx[k], rm[i].id, 0, &rm[i].r[k]) == KVW_OK,
                  "create: %s", kvw_last_error());
            post_st[i][k] = kvw_receiver_post(rm[i].r[k], &post);
            if (post_st[i][k] != KVW_OK) {
                snprintf(post_err[i], sizeof(post_err[i]), "%s", kvw_last_error());
                CHECK(post_err[i][0] &&
                      kvw_room_poll(kvw_receiver_room(rm[i].r[k])) == KVW_ROOM_FAILED,
                      "%s: post returned %s, room %s, message '%s'", what[i],
                      kvw_status_string(post_st[i][k]),
                      kvw_room_state_string(kvw_room_poll(kvw_receiver_room(rm[i].r[k]))),
                      post_err[i]);
            }
        }
        if (i == BP_HEALTHY)
            CHECK(post_st[i][0] == KVW_OK, "healthy post: %s", post_err[i]);
    }
    ch_tag(e->ch[0], "posted");
    for (int i = 0; i < BP_N; i++) {
        d_expect(&d.dec, &rm[i], i == BP_HEALTHY ? KVW_ROOM_SUCCESS : KVW_ROOM_FAILED, NULL,
                 WAIT_TIMEOUT_MS + SLACK_MS, NULL);
        if (i != BP_HEALTHY)
            say("%s: post %s%s%s; room: %s", what[i], kvw_status_string(post_st[i][0]),
                post_err[i][0] ? ": " : "", post_err[i],
                kvw_room_failure(kvw_receiver_room(rm[i].r[0])));
    }
    /* An index beyond the pool may be refused when posting or by the prefill's plan;
     * either way the room fails with a reason (checked above). */
    if (post_st[BP_OUT_OF_POOL][0] == KVW_OK)
        say("note: kvw_receiver_post accepted page %u of a %u-page pool; the room failed "
            "only after the round trip to the prefill", FULL_PAGES + 3, FULL_PAGES);
    CHECK(post_st[BP_SHORT][0] == KVW_ERR_OUT_OF_RANGE, "a short page list: post returned %s",
          kvw_status_string(post_st[BP_SHORT][0]));
    /* Nothing of a refused room may land; the healthy one is exact. */
    room_t *rp[BP_N];
    int out[BP_N];
    for (int i = 0; i < BP_N; i++) {
        rp[i] = &rm[i];
        out[i] = i == BP_HEALTHY ? V_OK : V_UNTOUCHED;
    }
    sleep_ms(100);
    d_verify(&d.dec, &d.snap, &d.src, rp, out, BP_N);
    for (int i = 0; i < BP_N; i++)
        d_close(&d.dec, &rm[i]);
    d_end(&d);
    return 0;
}

/* ---- wait timeouts: 1 decode posts, no sender; 2 sender sends, no post; 3 both
 * exist but the prefill never sends; 4 healthy and concurrent */

static int timeout_prefill(env_t *e)
{
    inst_t in;
    int rc = p_start(e, &in, 0);
    if (rc)
        return rc;
    room_t r2 = room_def(102, 1), r3 = room_def(103, 2), r4 = room_def(104, 3);
    if (ch_expect(e->ch[1], "posted", NULL, kvt_tmo_ms(15000)))
        return 1;
    uint64_t t0 = now_ms();
    p_open(&in, &r2);
    p_send_all(&in, &r2);
    p_open(&in, &r3);
    p_open(&in, &r4);
    p_send_all(&in, &r4);
    p_expect(&in, &r4, KVW_ROOM_SUCCESS, NULL, kvt_tmo_ms(10000), NULL);
    p_expect(&in, &r2, KVW_ROOM_FAILED, "timed out", WAIT_TIMEOUT_MS + SLACK_MS, NULL);
    p_expect(&in, &r3, KVW_ROOM_FAILED, "timed out", WAIT_TIMEOUT_MS + SLACK_MS, NULL);
    uint64_t dt = now_ms() - t0;
    CHECK(dt + 150 >= WAIT_TIMEOUT_MS, "prefill rooms timed out after %llu ms, before the %u ms "
          "wait timeout", (unsigned long long)dt, WAIT_TIMEOUT_MS);
    CHECK(kvt_contains(kvw_room_failure(kvw_sender_room(r2.s[0])), "no decode rank posted"),
          "the reason does not say what the room waited for: %s",
          kvw_room_failure(kvw_sender_room(r2.s[0])));
    for (uint32_t k = 0; k < in.n; k++)
        CHECK(kvw_room_status(kvw_sender_room(r2.s[k])) == KVW_ERR_TIMEOUT,
              "timed-out room status %s",
              kvw_status_string(kvw_room_status(kvw_sender_room(r2.s[k]))));
    ch_tag(e->ch[1], "done");
    p_close(&in, &r2);
    p_close(&in, &r3);
    p_close(&in, &r4);
    p_end(e, &in, kvt_tmo_ms(20000));
    return 0;
}

static int timeout_decode(env_t *e)
{
    dctx_t d;
    int rc = d_start(e, &d, true);
    if (rc)
        return rc;
    room_t r1 = room_def(101, 0), r3 = room_def(103, 2), r4 = room_def(104, 3);
    uint64_t t0 = now_ms();
    d_open_post(&d.dec, &r1, NULL);
    d_open_post(&d.dec, &r3, NULL);
    d_open_post(&d.dec, &r4, NULL);
    ch_tag(e->ch[0], "posted");
    d_expect(&d.dec, &r4, KVW_ROOM_SUCCESS, NULL, kvt_tmo_ms(10000), NULL);
    d_expect(&d.dec, &r1, KVW_ROOM_FAILED, "timed out", WAIT_TIMEOUT_MS + SLACK_MS, NULL);
    uint64_t dt = now_ms() - t0;
    CHECK(dt + 150 >= WAIT_TIMEOUT_MS, "decode room timed out after %llu ms, before the %u ms "
          "wait timeout", (unsigned long long)dt, WAIT_TIMEOUT_MS);
    /* Its own timer fires, or another rank's timeout reaches it through the prefill
     * (the reason still says "timed out", checked above). */
    for (uint32_t k = 0; k < d.dec.n; k++) {
        kvw_status_t st = kvw_room_status(kvw_receiver_room(r1.r[k]));
        CHECK(st == KVW_ERR_TIMEOUT || st == KVW_ERR_REMOTE_FAILED || st == KVW_ERR_ABORTED,
              "timed-out room status %s", kvw_status_string(st));
    }
    d_expect(&d.dec, &r3, KVW_ROOM_FAILED, NULL, WAIT_TIMEOUT_MS + SLACK_MS, NULL);
    ch_expect(e->ch[0], "done", NULL, kvt_tmo_ms(15000));
    room_t *rp[3] = {&r1, &r3, &r4};
    int out[3] = {V_UNTOUCHED, V_UNTOUCHED, V_OK};
    d_verify(&d.dec, &d.snap, &d.src, rp, out, 3);
    d_close(&d.dec, &r1);
    d_close(&d.dec, &r3);
    d_close(&d.dec, &r4);
    d_end(&d);
    return 0;
}

/* ---- chunked prefill slower than the wait timeout: the room is not waiting for its
 * peer (both halves exist and bytes flow), so it must not time out */

static int slowchunk_prefill(env_t *e)
{
    inst_t in;
    int rc = p_start(e, &in, 0);
    if (rc)
        return rc;
    room_t rm = room_def(110, 4);
    if (ch_expect(e->ch[1], "posted", NULL, kvt_tmo_ms(15000)))
        return 1;
    p_open(&in, &rm);
    char err[256];
    uint64_t n = rm.n;
    uint64_t gap = WAIT_TIMEOUT_MS * 6 / 10;
    for (int c = 0; c < 3; c++) {
        kvw_status_t st = p_send(&in, &rm, n * (uint64_t)c / 3, n * (uint64_t)(c + 1) / 3, c == 2,
                                 err, sizeof(err));
        check_(st == KVW_OK, __LINE__, c == 2 ? "slow-chunks" : NULL, "chunk %d after %llu ms: %s",
               c, (unsigned long long)(gap * (uint64_t)c), err);
        if (c < 2)
            sleep_ms((unsigned)gap);
    }
    p_expect(&in, &rm, KVW_ROOM_SUCCESS, NULL, kvt_tmo_ms(5000), "slow-chunks");
    ch_tag(e->ch[1], "done");
    p_close(&in, &rm);
    p_end(e, &in, kvt_tmo_ms(20000));
    return 0;
}

static int slowchunk_decode(env_t *e)
{
    dctx_t d;
    int rc = d_start(e, &d, true);
    if (rc)
        return rc;
    room_t rm = room_def(110, 4);
    d_open_post(&d.dec, &rm, NULL);
    ch_tag(e->ch[0], "posted");
    d_expect(&d.dec, &rm, KVW_ROOM_SUCCESS, NULL, 3 * WAIT_TIMEOUT_MS, "slow-chunks");
    ch_expect(e->ch[0], "done", NULL, kvt_tmo_ms(15000));
    room_t *rp[1] = {&rm};
    int out = kvw_room_poll(kvw_receiver_room(rm.r[0])) == KVW_ROOM_SUCCESS ? V_OK : V_PARTIAL;
    d_verify(&d.dec, &d.snap, &d.src, rp, &out, 1);
    d_close(&d.dec, &rm);
    d_end(&d);
    return 0;
}

/* ================================================================== proxy */

/*
 * A man in the middle on the control channel: a fake bootstrap that answers lookups
 * with the real table, control addresses replaced by the proxy's; and a frame-aware
 * relay to the real control port that can rewrite a REQ's first page, drop ABORT
 * frames, or inject raw bytes in either direction at a frame boundary. The data path
 * (transport) is not proxied. Commands come from the decode process (process 1).
 */

typedef struct pxdir {
    int from, to;
    uint8_t *buf;
    size_t got, cap;
    uint8_t inj[600]; /* bytes to inject at the next frame boundary */
    size_t ninj;
} pxdir_t;

typedef struct pxconn {
    pxdir_t d2p, p2d;
    bool open;
} pxconn_t;

static int g_px_rewrite = -1; /* page index for the next REQ's first full page */
static bool g_px_drop_abort;
static int g_px_dropped, g_px_rewritten;

static int listen_any(char *addr, size_t cap)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = 0};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof(sa)) || listen(fd, 16))
        return -1;
    socklen_t sl = sizeof(sa);
    getsockname(fd, (struct sockaddr *)&sa, &sl);
    snprintf(addr, cap, "127.0.0.1:%u", ntohs(sa.sin_port));
    return fd;
}

/* Handles complete frames in one direction; returns -1 when the relay must close. */
static int px_pump(pxdir_t *d, bool d2p)
{
    for (;;) {
        if (d->got < 12)
            return 0;
        uint32_t len = get_le32(d->buf + 8);
        if (get_le32(d->buf) != WIRE_MAGIC || len > (1u << 24)) {
            /* Not our framing (cannot happen between two kvwire peers): pass it on. */
            int r = write_full(d->to, d->buf, d->got);
            d->got = 0;
            return r;
        }
        if (d->got < 12 + (size_t)len)
            return 0;
        uint8_t type = d->buf[5];
        bool drop = false;
        if (d2p && type == T_REQ && g_px_rewrite >= 0 && len >= 44) {
            put_le32(d->buf + 12 + 40, (uint32_t)g_px_rewrite);
            g_px_rewrite = -1;
            g_px_rewritten++;
        }
        if (d2p && type == T_ABORT && g_px_drop_abort) {
            drop = true;
            g_px_dropped++;
        }
        if (!drop && write_full(d->to, d->buf, 12 + (size_t)len))
            return -1;
        if (d->ninj && write_full(d->to, d->inj, d->ninj))
            return -1;
        d->ninj = 0;
        memmove(d->buf, d->buf + 12 + len, d->got - 12 - len);
        d->got -= 12 + (size_t)len;
    }
}

static int px_read(pxdir_t *d, bool d2p)
{
    if (d->cap - d->got < 65536) {
        d->cap = d->cap ? d->cap * 2 : 262144;
        d->buf = realloc(d->buf, d->cap);
    }
    ssize_t k = recv(d->from, d->buf + d->got, d->cap - d->got, MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EINTR))
        return 0;
    if (k <= 0)
        return -1;
    d->got += (size_t)k;
    return px_pump(d, d2p);
}

static size_t unhex(const char *s, uint8_t *out, size_t cap)
{
    size_t n = 0;
    while (s[0] && s[1] && n < cap) {
        unsigned v;
        if (sscanf(s, "%2x", &v) != 1)
            break;
        out[n++] = (uint8_t)v;
        s += 2;
    }
    return n;
}

static int proxy_main(env_t *e)
{
    msg_t m;
    int r = ch_recv(e->ch[0], &m, kvt_tmo_ms(15000));
    if (r == -2)
        return 77;
    if (!CHECK(r == 0 && !strcmp(m.tag, "bs"), "proxy: no bootstrap address"))
        return 1;
    char real_bs[160], real_ctl[160] = "", fake_bs[64], fake_ctl[64];
    snprintf(real_bs, sizeof(real_bs), "%.150s", m.text);
    if (!CHECK(bs_lookup(real_bs, real_ctl, sizeof(real_ctl)) == 1 && real_ctl[0],
               "proxy: lookup on %s", real_bs))
        return 1;
    int lbs = listen_any(fake_bs, sizeof(fake_bs));
    int lctl = listen_any(fake_ctl, sizeof(fake_ctl));
    if (!CHECK(lbs >= 0 && lctl >= 0, "proxy: listen: %s", strerror(errno)))
        return 1;
    ch_send(e->ch[1], "proxy", "%s", fake_bs);
    pxconn_t conns[8];
    int nc = 0;
    memset(conns, 0, sizeof(conns));
    uint64_t end = now_ms() + kvt_tmo_ms(60000);
    while (now_ms() < end) {
        struct pollfd p[3 + 16];
        int np = 0;
        p[np++] = (struct pollfd){.fd = e->ch[1], .events = POLLIN};
        p[np++] = (struct pollfd){.fd = lbs, .events = POLLIN};
        p[np++] = (struct pollfd){.fd = lctl, .events = POLLIN};
        for (int i = 0; i < nc; i++) {
            p[np++] = (struct pollfd){.fd = conns[i].open ? conns[i].d2p.from : -1, .events = POLLIN};
            p[np++] = (struct pollfd){.fd = conns[i].open ? conns[i].p2d.from : -1, .events = POLLIN};
        }
        if (poll(p, (nfds_t)np, 100) < 0 && errno != EINTR)
            break;
        if (p[0].revents) {
            if (ch_recv(e->ch[1], &m, 100) != 0)
                break; /* the decode process is done */
            if (!strcmp(m.tag, "rewrite")) {
                g_px_rewrite = atoi(m.text);
            } else if (!strcmp(m.tag, "dropabort")) {
                g_px_drop_abort = true;
            } else if (!strcmp(m.tag, "inject_d2p") || !strcmp(m.tag, "inject_p2d")) {
                uint8_t raw[600];
                size_t n = unhex(m.text, raw, sizeof(raw));
                bool d2p = !strcmp(m.tag, "inject_d2p");
                for (int i = 0; i < nc; i++) {
                    pxdir_t *d = d2p ? &conns[i].d2p : &conns[i].p2d;
                    if (!conns[i].open)
                        continue;
                    /* Complete frames are forwarded as they arrive, so an empty buffer
                     * is a frame boundary; otherwise inject after the partial frame. */
                    if (d->got == 0) {
                        write_full(d->to, raw, n);
                    } else {
                        memcpy(d->inj, raw, n);
                        d->ninj = n;
                    }
                }
            } else if (!strcmp(m.tag, "stats")) {
                /* answered below */
            }
            ch_send(e->ch[1], "ok", "rewritten %d, dropped %d", g_px_rewritten, g_px_dropped);
        }
        if (p[1].revents) {
            int c = accept4(lbs, NULL, NULL, SOCK_CLOEXEC);
            if (c >= 0) {
                struct timeval tv = {.tv_sec = 2};
                setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
                uint8_t type, *pl = NULL;
                uint32_t len;
                if (read_frame(c, &type, &pl, &len) == 0) {
                    free(pl);
                    /* Answer with a one-entry table pointing at the proxy. */
                    char ctl_addr[160];
                    int n = bs_lookup(real_bs, ctl_addr, sizeof(ctl_addr));
                    if (type == T_BS_LOOKUP && n == 1) {
                        uint8_t out[256];
                        size_t sl = strlen(fake_ctl), o = 12;
                        put_le32(out + o, 1), o += 4;
                        uint32_t ent[6] = {0, 0, 0, 1, 1, 1};
                        for (int i = 0; i < 6; i++)
                            put_le32(out + o, ent[i]), o += 4;
                        put_le32(out + o, (uint32_t)sl), o += 4;
                        memcpy(out + o, fake_ctl, sl), o += sl;
                        out[o++] = 0; /* no MAC (no secret in these cases) */
                        put_hdr(out, WIRE_MAGIC, 1, T_BS_TABLE, (uint32_t)(o - 12));
                        write_full(c, out, o);
                    }
                }
                close(c);
            }
        }
        if (p[2].revents && nc < 8) {
            int c = accept4(lctl, NULL, NULL, SOCK_CLOEXEC);
            int u = c >= 0 ? raw_connect(real_ctl, kvt_tmo_ms(3000)) : -1;
            if (c >= 0 && u >= 0) {
                int one = 1;
                setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
                struct timeval tv = {.tv_sec = 0};
                setsockopt(u, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
                pxconn_t *x = &conns[nc++];
                x->d2p = (pxdir_t){.from = c, .to = u};
                x->p2d = (pxdir_t){.from = u, .to = c};
                x->open = true;
            } else {
                if (c >= 0)
                    close(c);
                if (u >= 0)
                    close(u);
            }
        }
        for (int i = 0; i < nc; i++) {
            if (!conns[i].open)
                continue;
            short rd = p[3 + 2 * i].revents, rp = p[4 + 2 * i].revents;
            int bad = 0;
            if (rd)
                bad |= px_read(&conns[i].d2p, true);
            if (rp && !bad)
                bad |= px_read(&conns[i].p2d, false);
            if (bad) {
                close(conns[i].d2p.from);
                close(conns[i].p2d.from);
                conns[i].open = false;
            }
        }
    }
    for (int i = 0; i < nc; i++) {
        if (conns[i].open) {
            close(conns[i].d2p.from);
            close(conns[i].p2d.from);
        }
        free(conns[i].d2p.buf);
        free(conns[i].p2d.buf);
    }
    close(lbs);
    close(lctl);
    return 0;
}

/* Decode side of the proxy cases: connect through the fake bootstrap. */
static int mitm_dstart(env_t *e, dctx_t *d)
{
    int rc = d_start(e, d, false);
    if (rc)
        return rc;
    msg_t m;
    if (ch_expect(e->ch[2], "proxy", &m, kvt_tmo_ms(15000)))
        return 1;
    char err[512];
    kvw_status_t st = inst_open(&d->dec, false, g_tl, m.text, NULL, 0, err, sizeof(err));
    if (!CHECK(st == KVW_OK, "decode through the proxy: %s: %s", kvw_status_string(st), err))
        return 1;
    return 0;
}

static void px_cmd(env_t *e, const char *tag, const char *text)
{
    ch_send(e->ch[2], tag, "%s", text);
    msg_t m;
    ch_expect(e->ch[2], "ok", &m, kvt_tmo_ms(5000));
}

static int mitm_prefill(env_t *e)
{
    inst_t in;
    int rc = p_start(e, &in, 0);
    if (rc)
        return rc;
    room_t r1 = room_def(120, 0), r2 = room_def(121, 1);
    if (ch_expect(e->ch[1], "posted", NULL, kvt_tmo_ms(15000)))
        return 1;
    p_open(&in, &r1);
    p_open(&in, &r2);
    if (g_variant >= 2) {
        /* Corruption in the established stream: the room on that connection fails
         * with a reason on the prefill too. Inject only once both REQs are here. */
        p_wait_state(&in, &r1, KVW_ROOM_WAITING_FOR_INPUT, kvt_tmo_ms(5000));
        p_wait_state(&in, &r2, KVW_ROOM_WAITING_FOR_INPUT, kvt_tmo_ms(5000));
        ch_tag(e->ch[1], "senders");
        const char *needle = g_variant == 2 ? "magic" : g_variant == 4 ? "truncated" : NULL;
        p_expect(&in, &r1, KVW_ROOM_FAILED, needle, PEER_TIMEOUT_MS + SLACK_MS, NULL);
        p_expect(&in, &r2, KVW_ROOM_FAILED, NULL, PEER_TIMEOUT_MS + SLACK_MS, NULL);
    } else {
        p_send_all(&in, &r1);
        p_send_all(&in, &r2);
        p_expect(&in, &r2, KVW_ROOM_SUCCESS, NULL, kvt_tmo_ms(10000), NULL);
        kvw_room_state_t s = wait_send(r1.s[0], kvt_tmo_ms(10000));
        say("prefill sender of the tampered room: %s %s", kvw_room_state_string(s),
            kvw_room_failure(kvw_sender_room(r1.s[0])));
        ch_tag(e->ch[1], "sent");
    }
    p_close(&in, &r1);
    p_close(&in, &r2);
    p_end(e, &in, kvt_tmo_ms(20000));
    return 0;
}

static int mitm_decode(env_t *e)
{
    dctx_t d;
    int rc = mitm_dstart(e, &d);
    if (rc)
        return rc;
    room_t r1 = room_def(120, 0), r2 = room_def(121, 1);
    int out[2] = {V_PARTIAL, V_OK};
    room_t *rp[2] = {&r1, &r2};
    /* A page that no slot ever uses. */
    uint32_t foreign = FULL_PAGES - 1;
    if (g_variant == 0) {
        char t[32];
        snprintf(t, sizeof(t), "%u", foreign);
        px_cmd(e, "rewrite", t);
        d_open_post(&d.dec, &r1, NULL);
        d_open_post(&d.dec, &r2, NULL);
        ch_tag(e->ch[0], "posted");
        d_expect(&d.dec, &r2, KVW_ROOM_SUCCESS, NULL, kvt_tmo_ms(10000), NULL);
        ch_expect(e->ch[0], "sent", NULL, kvt_tmo_ms(15000));
        kvw_room_state_t s = wait_recv(r1.r[0], KVW_ROOM_SUCCESS, kvt_tmo_ms(3000));
        bool landed = page_changed(&d.dec, d.snap.c, 0, KVW_POOL_FULL, foreign);
        if (!strcmp(g_tl, "tcp")) {
            /* tcp: the receiver refuses every write outside the room's grant. */
            d_expect(&d.dec, &r1, KVW_ROOM_FAILED, "not granted", kvt_tmo_ms(3000), NULL);
            CHECK(!landed, "bytes landed in page %u, which no room was granted", foreign);
            d_verify(&d.dec, &d.snap, &d.src, rp, out, 2);
        } else {
            /* shm: the receiver cannot see writes; the sender confines them to the pages
             * the REQ names. Record what happened; everything else must be exact. */
            say("NOTE: REQ rewritten in transit to page %u: decode room %s%s%s; page %u %s", foreign,
                kvw_room_state_string(s), s == KVW_ROOM_FAILED ? ": " : "",
                kvw_room_failure(kvw_receiver_room(r1.r[0])), foreign,
                landed ? "WRITTEN (shm has no receiver-side check; expected limitation)"
                       : "untouched");
            g_ignore_full_page = foreign;
            d_verify(&d.dec, &d.snap, &d.src, rp, out, 2);
            g_ignore_full_page = -1;
        }
    } else if (g_variant == 1) {
        /* The decode destroys its receiver; the ABORT is lost; the prefill then writes
         * the room. Nothing may land in its pages (tcp refuses writes for rooms it does
         * not know). */
        px_cmd(e, "dropabort", "");
        d_open_post(&d.dec, &r1, NULL);
        d_open_post(&d.dec, &r2, NULL);
        d_close(&d.dec, &r1);
        ch_tag(e->ch[0], "posted");
        d_expect(&d.dec, &r2, KVW_ROOM_SUCCESS, NULL, kvt_tmo_ms(10000), NULL);
        ch_expect(e->ch[0], "sent", NULL, kvt_tmo_ms(15000));
        sleep_ms(200);
        rpages_t p1;
        room_pages(false, r1.slot, r1.n, &p1);
        bool landed = false;
        for (uint32_t i = 0; i < p1.side.full.num_pages; i++)
            landed |= page_changed(&d.dec, d.snap.c, 0, KVW_POOL_FULL, p1.full[i]);
        if (!strcmp(g_tl, "tcp")) {
            int o[2] = {V_UNTOUCHED, V_OK};
            CHECK(!landed, "the prefill wrote into the pages of a destroyed room");
            d_verify(&d.dec, &d.snap, &d.src, rp, o, 2);
        } else {
            if (landed)
                say("NOTE: shm: after kvw_room_destroy, a prefill that has not seen the "
                    "ABORT still writes the destroyed room's pages (one-sided writes, no "
                    "receiver-side check)");
            int o[2] = {V_PARTIAL, V_OK};
            d_verify(&d.dec, &d.snap, &d.src, rp, o, 2);
        }
    } else {
        /* 2: bad magic decode->prefill; 3: bad version prefill->decode; 4: truncated
         * ABORT frame decode->prefill; 5: oversized length prefill->decode. */
        d_open_post(&d.dec, &r1, NULL);
        d_open_post(&d.dec, &r2, NULL);
        ch_tag(e->ch[0], "posted");
        ch_expect(e->ch[0], "senders", NULL, kvt_tmo_ms(15000));
        uint8_t f[32];
        size_t n = 0;
        const char *dir = "inject_d2p";
        switch (g_variant) {
        case 2: n = mk_hdr(f, 0xdeadbeefu, 1, T_HEARTBEAT, 0); break;
        case 3: n = mk_hdr(f, WIRE_MAGIC, 9, T_HEARTBEAT, 0), dir = "inject_p2d"; break;
        case 4:
            n = mk_hdr(f, WIRE_MAGIC, 1, T_ABORT, 3) + 3;
            f[12] = f[13] = f[14] = 7;
            break;
        default: n = mk_hdr(f, WIRE_MAGIC, 1, T_HEARTBEAT, 0x7ffffff0u), dir = "inject_p2d"; break;
        }
        char hex[80];
        for (size_t i = 0; i < n; i++)
            snprintf(hex + 2 * i, 3, "%02x", f[i]);
        px_cmd(e, dir, hex);
        const char *needle = g_variant == 3 ? "version" : g_variant == 5 ? "exceeds" : NULL;
        d_expect(&d.dec, &r1, KVW_ROOM_FAILED, needle, PEER_TIMEOUT_MS + SLACK_MS, NULL);
        d_expect(&d.dec, &r2, KVW_ROOM_FAILED, needle, PEER_TIMEOUT_MS + SLACK_MS, NULL);
        int o[2] = {V_UNTOUCHED, V_UNTOUCHED};
        d_verify(&d.dec, &d.snap, &d.src, rp, o, 2);
    }
    d_close(&d.dec, &r1);
    d_close(&d.dec, &r2);
    d_end(&d);
    return 0;
}

/* ---- a decode rank leaves while the other decode rank of its group is still being
 * served (prefill TP2 -> decode TP2: prefill rank k serves decode rank k only). The
 * rooms of the remaining rank must reach Success on both sides: room A, whose sender
 * was open and waiting for input when the other rank left, and room B, for which
 * prefill rank 0 had no sender yet. Once the last decode rank leaves too, the finished
 * rooms stay Success. Regression: the room's completeness counted only connected decode
 * ranks, so a departed unrelated rank held rooms back, and the peer's death then failed
 * rooms it had already confirmed. */

static kvw_status_t p_send_rank(inst_t *in, room_t *rm, uint32_t k)
{
    rpages_t p;
    room_pages(true, rm->slot, rm->n, &p);
    kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = rm->n,
                          .chunk_begin = 0, .chunk_end = rm->n,
                          .last_chunk = 1, .pages = p.side};
    (void)in;
    kvw_status_t st = kvw_sender_send(rm->s[k], &c);
    CHECK(st == KVW_OK, "send room %llu rank %u: %s", (unsigned long long)rm->id, k,
          kvw_last_error());
    return st;
}

static int leave_prefill(env_t *e)
{
    inst_t in;
    int rc = p_start(e, &in, 0);
    if (rc)
        return rc;
    room_t ra = room_def(60, 0), rb = room_def(61, 1);
    if (ch_expect(e->ch[1], "posted", NULL, kvt_tmo_ms(15000)))
        return 1;
    p_open(&in, &ra);
    p_wait_state(&in, &ra, KVW_ROOM_WAITING_FOR_INPUT, kvt_tmo_ms(5000));
    CHECK(kvw_sender_create(in.ctx[1], rb.id, &rb.s[1]) == KVW_OK, "sender B rank 1: %s",
          kvw_last_error());
    /* Prefill rank 1 serves decode rank 1, which then leaves. */
    p_send_rank(&in, &ra, 1);
    p_send_rank(&in, &rb, 1);
    CHECK(wait_send(ra.s[1], kvt_tmo_ms(10000)) == KVW_ROOM_SUCCESS, "room A rank 1: %s",
          kvw_room_failure(kvw_sender_room(ra.s[1])));
    CHECK(wait_send(rb.s[1], kvt_tmo_ms(10000)) == KVW_ROOM_SUCCESS, "room B rank 1: %s",
          kvw_room_failure(kvw_sender_room(rb.s[1])));
    ch_tag(e->ch[1], "sent1");
    if (ch_expect(e->ch[1], "left1", NULL, kvt_tmo_ms(15000)))
        return 1;
    /* Let prefill rank 0 see the departure first (the case also holds if it has not). */
    sleep_ms(300);
    CHECK(kvw_room_poll(kvw_sender_room(ra.s[0])) == KVW_ROOM_WAITING_FOR_INPUT,
          "room A rank 0 changed state when an unrelated decode rank left: %s (%s)",
          kvw_room_state_string(kvw_room_poll(kvw_sender_room(ra.s[0]))),
          kvw_room_failure(kvw_sender_room(ra.s[0])));
    CHECK(kvw_sender_create(in.ctx[0], rb.id, &rb.s[0]) == KVW_OK, "sender B rank 0: %s",
          kvw_last_error());
    p_send_rank(&in, &ra, 0);
    p_send_rank(&in, &rb, 0);
    p_expect(&in, &ra, KVW_ROOM_SUCCESS, NULL, WAIT_TIMEOUT_MS + SLACK_MS, NULL);
    p_expect(&in, &rb, KVW_ROOM_SUCCESS, NULL, WAIT_TIMEOUT_MS + SLACK_MS, NULL);
    ch_tag(e->ch[1], "done0");
    CHECK(ch_wait_gone(e->ch[1], kvt_tmo_ms(20000)), "the decode process did not go away");
    /* Both decode ranks are gone now: finished rooms stay finished. */
    sleep_ms(300);
    for (uint32_t k = 0; k < 2; k++) {
        CHECK(kvw_room_poll(kvw_sender_room(ra.s[k])) == KVW_ROOM_SUCCESS,
              "room A rank %u turned %s: %s", k,
              kvw_room_state_string(kvw_room_poll(kvw_sender_room(ra.s[k]))),
              kvw_room_failure(kvw_sender_room(ra.s[k])));
        CHECK(kvw_room_poll(kvw_sender_room(rb.s[k])) == KVW_ROOM_SUCCESS,
              "room B rank %u turned %s: %s", k,
              kvw_room_state_string(kvw_room_poll(kvw_sender_room(rb.s[k]))),
              kvw_room_failure(kvw_sender_room(rb.s[k])));
    }
    p_close(&in, &ra);
    p_close(&in, &rb);
    inst_free(&in);
    return 0;
}

static int leave_decode(env_t *e)
{
    dctx_t d;
    int rc = d_start(e, &d, true);
    if (rc)
        return rc;
    room_t ra = room_def(60, 0), rb = room_def(61, 1);
    d_open_post(&d.dec, &ra, NULL);
    d_open_post(&d.dec, &rb, NULL);
    ch_tag(e->ch[0], "posted");
    if (ch_expect(e->ch[0], "sent1", NULL, kvt_tmo_ms(15000)))
        return 1;
    CHECK(wait_recv(ra.r[1], KVW_ROOM_SUCCESS, kvt_tmo_ms(10000)) == KVW_ROOM_SUCCESS,
          "room A rank 1: %s",
          kvw_room_failure(kvw_receiver_room(ra.r[1])));
    CHECK(wait_recv(rb.r[1], KVW_ROOM_SUCCESS, kvt_tmo_ms(10000)) == KVW_ROOM_SUCCESS,
          "room B rank 1: %s",
          kvw_room_failure(kvw_receiver_room(rb.r[1])));
    /* Decode rank 1 leaves: its rooms are done, its context goes away. */
    kvw_room_destroy(kvw_receiver_room(ra.r[1]));
    kvw_room_destroy(kvw_receiver_room(rb.r[1]));
    ra.r[1] = rb.r[1] = NULL;
    kvw_ctx_destroy(d.dec.ctx[1]);
    d.dec.ctx[1] = NULL;
    ch_tag(e->ch[0], "left1");
    CHECK(wait_recv(ra.r[0], KVW_ROOM_SUCCESS, WAIT_TIMEOUT_MS + SLACK_MS) == KVW_ROOM_SUCCESS,
          "room A rank 0: %s", kvw_room_failure(kvw_receiver_room(ra.r[0])));
    CHECK(wait_recv(rb.r[0], KVW_ROOM_SUCCESS, WAIT_TIMEOUT_MS + SLACK_MS) == KVW_ROOM_SUCCESS,
          "room B rank 0: %s", kvw_room_failure(kvw_receiver_room(rb.r[0])));
    room_t *rp[2] = {&ra, &rb};
    int out[2] = {V_OK, V_OK};
    if (d_verify(&d.dec, &d.snap, &d.src, rp, out, 2))
        say("2 rooms verified byte-exact on both decode ranks (guards intact)");
    ch_expect(e->ch[0], "done0", NULL, kvt_tmo_ms(15000));
    d_close(&d.dec, &ra);
    d_close(&d.dec, &rb);
    d_end(&d);
    return 0;
}

/* ================================================================== driver */

typedef struct role {
    const char *who;
    int (*fn)(env_t *e);
    bool victim; /* may end killed by SIGKILL (its own, or the parent's at the end) */
} role_t;

typedef struct case_def {
    const char *name;
    role_t roles[MAXP];
    int nroles;
    uint32_t ptp, dtp;
    int variant;
    int deadline_s;
} case_def_t;

/* Forks the case's processes, waits with a deadline. 0 pass, 1 fail, 77 skip. */
static int run_case(const case_def_t *c)
{
    int sp[MAXP][MAXP][2];
    for (int i = 0; i < c->nroles; i++)
        for (int j = i + 1; j < c->nroles; j++)
            if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp[i][j])) {
                perror("socketpair");
                return 1;
            }
    g_case = c->name;
    g_ptp = c->ptp;
    g_dtp = c->dtp;
    g_variant = c->variant;
    fflush(stdout);
    fflush(stderr);
    pid_t pid[MAXP];
    uint64_t t0 = now_ms();
    for (int i = 0; i < c->nroles; i++) {
        pid[i] = fork();
        if (pid[i] < 0) {
            perror("fork");
            return 1;
        }
        if (pid[i] == 0) {
            snprintf(g_who, sizeof(g_who), "%s", c->roles[i].who);
            alarm(kvt_tmo_s((unsigned)c->deadline_s) + 5);
            env_t e = {.me = i};
            for (int a = 0; a < MAXP; a++)
                e.ch[a] = -1;
            for (int a = 0; a < c->nroles; a++)
                for (int b = a + 1; b < c->nroles; b++) {
                    if (a == i) {
                        e.ch[b] = sp[a][b][0];
                        close(sp[a][b][1]);
                    } else if (b == i) {
                        e.ch[a] = sp[a][b][1];
                        close(sp[a][b][0]);
                    } else {
                        close(sp[a][b][0]);
                        close(sp[a][b][1]);
                    }
                }
            int rc = c->roles[i].fn(&e);
            if (rc == 0 && g_bad)
                rc = 1;
            if (rc == 0 && g_xfail)
                rc = 3; /* passed except for known bugs */
            fflush(stderr);
            /* exit(), not _exit(): LeakSanitizer checks each process at exit. The parent
             * flushed stdio before forking and registered no atexit handlers. */
            exit(rc);
        }
    }
    for (int a = 0; a < c->nroles; a++)
        for (int b = a + 1; b < c->nroles; b++) {
            close(sp[a][b][0]);
            close(sp[a][b][1]);
        }
    int status[MAXP] = {0};
    bool done[MAXP] = {false};
    uint64_t end = t0 + (uint64_t)kvt_tmo_s((unsigned)c->deadline_s) * 1000;
    bool hung = false;
    for (;;) {
        bool others_left = false;
        for (int i = 0; i < c->nroles; i++) {
            if (!done[i] && waitpid(pid[i], &status[i], WNOHANG) == pid[i])
                done[i] = true;
            if (!done[i] && !c->roles[i].victim)
                others_left = true;
        }
        if (!others_left)
            break;
        if (now_ms() > end) {
            hung = true;
            break;
        }
        usleep(5000);
    }
    for (int i = 0; i < c->nroles; i++)
        if (!done[i]) {
            kill(pid[i], SIGKILL);
            waitpid(pid[i], &status[i], 0);
            if (!c->roles[i].victim || hung)
                fprintf(stderr, "  [%s %s] %s did not finish within %u s: killed\n", g_tl,
                        c->name, c->roles[i].who, kvt_tmo_s((unsigned)c->deadline_s));
            if (!hung && c->roles[i].victim)
                status[i] = 0; /* a frozen victim, killed as planned */
            else
                hung = true;
        }
    int result = 0;
    bool skip = false, xfail = false;
    for (int i = 0; i < c->nroles; i++) {
        int st = status[i];
        if (WIFEXITED(st) && WEXITSTATUS(st) == 0)
            continue;
        if (WIFEXITED(st) && WEXITSTATUS(st) == 77) {
            skip = true;
            continue;
        }
        if (WIFEXITED(st) && WEXITSTATUS(st) == 3) {
            xfail = true;
            continue;
        }
        if (c->roles[i].victim && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL)
            continue;
        result = 1;
        if (WIFSIGNALED(st))
            fprintf(stderr, "  [%s %s] %s died of signal %d%s\n", g_tl, c->name, c->roles[i].who,
                    WTERMSIG(st), WTERMSIG(st) == SIGALRM ? " (alarm: it hung)" : "");
        else
            fprintf(stderr, "  [%s %s] %s exited %d\n", g_tl, c->name, c->roles[i].who,
                    WEXITSTATUS(st));
    }
    if (hung)
        result = 1;
    if (result == 0 && skip)
        result = 77;
    if (result == 0 && xfail)
        result = 3;
    fprintf(stderr, "%-5s %-4s %s (%.1f s)\n",
            result == 0 ? "PASS" : result == 77 ? "SKIP" : result == 3 ? "XFAIL" : "FAIL", g_tl,
            c->name, (double)(now_ms() - t0) / 1000.0);
    g_case = "";
    return result;
}

#define P_ROLE(f) {"prefill", f, false}
#define D_ROLE(f) {"decode", f, false}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    alarm(290); /* CTest gives 300 s; never hang past it */
    if (kvt_model_preset("gpt-oss-120b", &g_model) || kvt_model_truncate(&g_model, 2)) {
        fprintf(stderr, "test_proto_fail: no gpt-oss-120b preset\n");
        return 1;
    }
    g_strict = getenv("KVW_PROTO_FAIL_STRICT") && atoi(getenv("KVW_PROTO_FAIL_STRICT"));
    const char *only = getenv("KVW_PROTO_FAIL_ONLY");
    const char *only_tl = getenv("KVW_PROTO_FAIL_TL");

    const case_def_t cases[] = {
        {"sanity TP1->TP2", {P_ROLE(sanity_prefill), D_ROLE(sanity_decode)}, 2, 1, 2, 0, 30},
        {"sanity TP2->TP1", {P_ROLE(sanity_prefill), D_ROLE(sanity_decode)}, 2, 2, 1, 0, 30},
        {"prefill killed before sending",
         {{"prefill", pdeath_prefill, true}, D_ROLE(pdeath_decode)}, 2, 1, 2, 0, 30},
        {"prefill killed mid-transfer",
         {{"prefill", pdeath_prefill, true}, D_ROLE(pdeath_decode)}, 2, 1, 2, 1, 30},
        {"prefill frozen (SIGSTOP)",
         {{"prefill", pdeath_prefill, true}, D_ROLE(pdeath_decode)}, 2, 1, 2, 2, 30},
        {"decode killed, new decode instance",
         {P_ROLE(ddeath_prefill), {"decode1", ddeath_victim, true},
          {"decode2", ddeath_second, false}}, 3, 1, 1, 0, 40},
        {"two decode instances at once",
         {P_ROLE(ddeath_prefill), {"decode1", ddeath_victim, false},
          {"decode2", ddeath_second, false}}, 3, 1, 1, 1, 40},
        {"a decode rank leaves, the others finish",
         {P_ROLE(leave_prefill), D_ROLE(leave_decode)}, 2, 2, 2, 0, 40},
        {"decode aborts", {P_ROLE(dabort_prefill), D_ROLE(dabort_decode)}, 2, 1, 2, 0, 30},
        {"prefill aborts", {P_ROLE(pabort_prefill), D_ROLE(pabort_decode)}, 2, 2, 2, 0, 30},
        {"handshake rejections", {P_ROLE(hs_prefill), D_ROLE(hs_decode)}, 2, 1, 2, 0, 60},
        {"malformed frames", {P_ROLE(malformed_prefill), D_ROLE(malformed_decode)}, 2, 1, 1, 0,
         90},
        {"stalled connections", {P_ROLE(stall_prefill), D_ROLE(stall_decode)}, 2, 1, 1, 0, 30},
        {"bad page lists", {P_ROLE(badpages_prefill), D_ROLE(badpages_decode)}, 2, 1, 2, 0, 30},
        {"wait timeouts", {P_ROLE(timeout_prefill), D_ROLE(timeout_decode)}, 2, 1, 2, 0, 30},
        {"chunks slower than the wait timeout",
         {P_ROLE(slowchunk_prefill), D_ROLE(slowchunk_decode)}, 2, 1, 2, 0, 30},
        {"proxy: REQ rewritten to an ungranted page",
         {P_ROLE(mitm_prefill), D_ROLE(mitm_decode), {"proxy", proxy_main, false}}, 3, 1, 1, 0,
         30},
        {"proxy: ABORT lost, destroyed room written",
         {P_ROLE(mitm_prefill), D_ROLE(mitm_decode), {"proxy", proxy_main, false}}, 3, 1, 1, 1,
         30},
        {"proxy: bad magic decode->prefill",
         {P_ROLE(mitm_prefill), D_ROLE(mitm_decode), {"proxy", proxy_main, false}}, 3, 1, 1, 2,
         30},
        {"proxy: bad version prefill->decode",
         {P_ROLE(mitm_prefill), D_ROLE(mitm_decode), {"proxy", proxy_main, false}}, 3, 1, 1, 3,
         30},
        {"proxy: truncated ABORT decode->prefill",
         {P_ROLE(mitm_prefill), D_ROLE(mitm_decode), {"proxy", proxy_main, false}}, 3, 1, 1, 4,
         30},
        {"proxy: oversized frame prefill->decode",
         {P_ROLE(mitm_prefill), D_ROLE(mitm_decode), {"proxy", proxy_main, false}}, 3, 1, 1, 5,
         30},
    };
    const char *tls[] = {"tcp", "shm"};
    int pass = 0, fail = 0, skip = 0, xfail = 0;
    for (size_t t = 0; t < KVW_ARRAY_N(tls); t++) {
        g_tl = tls[t];
        if (only_tl && strcmp(only_tl, g_tl))
            continue;
        bool tl_skipped = false;
        for (size_t i = 0; i < KVW_ARRAY_N(cases) && !tl_skipped; i++) {
            if (only && !kvt_contains(cases[i].name, only))
                continue;
            int rc = run_case(&cases[i]);
            if (rc == 0)
                pass++;
            else if (rc == 77)
                skip++, tl_skipped = i == 0;
            else if (rc == 3)
                xfail++;
            else
                fail++;
        }
    }
    fprintf(stderr, "\ntest_proto_fail: %d passed, %d failed, %d known library bugs (XFAIL), "
            "%d skipped\n", pass, fail, xfail, skip);
    if (fail)
        return 1;
    return pass + xfail ? 0 : 77;
}
