/*
 * Protocol failure tests, table-driven: the real protocol between a prefill and a decode
 * instance running in SEPARATE PROCESSES, over every transport in {tcp, shm}. Each row
 * of g_rows names what is injected, the side(s) whose room must fail, the status and a
 * substring of the reason expected there, what the victim room may leave in the decode's
 * pages, and what else the injection takes down. One driver (drv_prefill, drv_decode)
 * runs every row the same way: a room done before the injection (I), a concurrent one
 * (C), the victim (V) and a fresh one afterwards (F); see "the failure table" below.
 * Every row also checks every decode byte against the test kit's independent reference,
 * the guard bytes, that I stays Success, and that C and F succeed (or, where the row says
 * the connection or the peer is gone, fail with a reason).
 *
 * The protocol rule each row checks:
 *   prefill killed before sending / mid-transfer   a dead peer fails the rooms that need
 *       it (PEER_DEAD), late bytes never land outside the room, a room posted to a dead
 *       prefill fails at once with a reason (ctrl.c, fail.c, recv.c)
 *   prefill frozen                  a silent peer is declared dead by its heartbeat
 *       timeout, not sooner (ctrl.c)
 *   decode aborts / decode rank 0 aborts mid-transfer   an ABORT fails the room on the
 *       prefill and on the room's other decode ranks promptly; sending on it is refused
 *       (dispatch.c, sender.c)
 *   prefill aborts before any byte / mid-transfer   the decode hears ABORTED; the rest of
 *       the room is refused (room.c, fail.c)
 *   post after a local abort        a failed room cannot be posted (recv.c)
 *   page beyond the pool, list one page short, page listed twice, SWA list off its page
 *       boundary                    grants are checked at post (recv.c kvw_grant)
 *   room posted twice, second receiver / sender, prefix beyond the request, chunk beyond
 *       the request, last chunk short of the end, chunk after the last one, chunk that
 *       changes the token count     the call is refused, the room carries on (recv.c,
 *       sender.c)
 *   prefill sends another token count   both halves must agree on the request (sched.c,
 *       sender.c)
 *   incompatible shapes (element size, KV heads, head dim, layer count, SWA window, layer
 *       kind, transport, 5-D layout, TP 3 with 8 heads)   refused at registration or at
 *       kvw_rank_create, with a reason naming the difference (handshake.c)
 *   a second decode instance claims the room   one owner per room; both claimants fail
 *       (sched.c)
 *   abort from a decode instance that does not own the room   refused; the owner's room
 *       succeeds (dispatch.c)
 *   forged completion on a connection of its own   completions count only on the data
 *       connection their prefill rank bound; the room succeeds with the real bytes only
 *       (land.c)
 *   posted, never sent / posted, no sender / sent, never posted   the wait timeout fires
 *       on a room waiting for its peer, not sooner (room.c)
 *   malformed frames on the bootstrap and control ports   bad magic, version, length,
 *       type, truncated frames, bad registrations: the connection is dropped (a REJECT
 *       naming the layer count for a nonsense rank description), the servers keep
 *       serving (wire.c, bootstrap.c, handshake.c)
 *   stalled connections             silent or half-sent connections do not disturb
 *       healthy peers (ctrl.c, bootstrap.c)
 *   proxy: REQ rewritten to an ungranted page (tcp)   the receiver refuses writes
 *       outside the room's grant (land.c kvw__check_write)
 *   proxy: ABORT lost, destroyed room written (tcp)   nothing lands in a destroyed
 *       room's pages (land.c)
 *   proxy: bad magic, bad version, truncated ABORT, oversized frame in the established
 *       stream   the connection is dropped with a reason, its rooms fail, the next room
 *       connects again (wire.c, dispatch.c)
 * After the rows, scenarios that are not one failing room: a killed decode instance and
 * a new one, two decode instances at once, a decode rank that leaves, chunks slower than
 * the wait timeout.
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

#include "proto/proto.h"

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

/* The peer and wait timeouts are short, for a fast test, yet long enough that a process
 * starting up or a context handshaking on a loaded two-core machine (several tests, or two
 * make check runs, at once) does not trip them: at 500 and 2000 ms, shm cases that start a
 * second decode process failed under such load. */
#define HEARTBEAT_MS 50
#define PEER_BASE_MS 1000
#define WAIT_BASE_MS 4000
#define PEER_TIMEOUT_MS kvt_tmo_ms(PEER_BASE_MS)
#define WAIT_TIMEOUT_MS kvt_tmo_ms(WAIT_BASE_MS)
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
#define WIRE_VER 2 /* the wire version this build speaks (1: before digests rode in DONE) */
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

/* ch_expect of a tag alone, with the channels' usual 15 s. */
static int ch_wait(int fd, const char *tag)
{
    return ch_expect(fd, tag, NULL, kvt_tmo_ms(15000));
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
        s.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL,
                                 .tp_size = tp, .tp_rank = t, .pp_size = 1, .pp_rank = 0,
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
    p->side.full = (kvw_pages_t){.field_mask = KVW_PAGES_FIELDS_ALL,
                                 .pages = p->full, .num_pages = nf, .first_token = 0};
    p->side.swa = (kvw_pages_t){.field_mask = KVW_PAGES_FIELDS_ALL,
                                .pages = p->swa, .num_pages = ns, .first_token = swb};
    p->side.state_slot = -1;
    p->side.field_mask = KVW_SIDE_PAGES_FIELDS_ALL;
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

/* The decode's post of room `rm` on the pages `p` (room_pages(false, ...)). */
static kvw_recv_post_t post_of(const room_t *rm, const rpages_t *p)
{
    return (kvw_recv_post_t){.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = rm->n,
                             .pages = p->side};
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
    kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL,
                          .num_tokens = rm->n, .chunk_begin = b, .chunk_end = e,
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
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL,
                            .num_tokens = rm->n, .prefix_len = 0,
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

/* One rank of a room on the prefill (its sender) or the decode (its receiver). */
static kvw_room_h side_room(const room_t *rm, bool dec, uint32_t k)
{
    return dec ? kvw_receiver_room(rm->r[k]) : kvw_sender_room(rm->s[k]);
}

/* Waits for that rank's half to end (the decode's: or reach Success). */
static kvw_room_state_t side_wait(const room_t *rm, bool dec, uint32_t k, uint64_t timeout_ms)
{
    return dec ? wait_recv(rm->r[k], KVW_ROOM_SUCCESS, timeout_ms) : wait_send(rm->s[k], timeout_ms);
}

/* Expects every rank's half of the room, on the prefill or the decode, to reach `want`
 * within timeout; checks the reason holds `needle` when FAILED (and, on the decode, that
 * a Success has an OK status). */
static bool side_expect(bool dec, inst_t *in, room_t *rm, kvw_room_state_t want,
                        const char *needle, uint64_t timeout_ms, const char *bug)
{
    const char *side = dec ? "decode" : "prefill";
    bool ok = true;
    uint64_t t0 = now_ms();
    for (uint32_t k = 0; k < in->n; k++) {
        uint64_t left = now_ms() - t0 < timeout_ms ? timeout_ms - (now_ms() - t0) : 0;
        kvw_room_state_t s = side_wait(rm, dec, k, left);
        const char *why = kvw_room_failure(side_room(rm, dec, k));
        ok &= check_(s == want, __LINE__, bug,
                     "%s room %llu rank %u: %s after %llu ms (want %s)%s%s", side,
                     (unsigned long long)rm->id, k, kvw_room_state_string(s),
                     (unsigned long long)(now_ms() - t0), kvw_room_state_string(want),
                     why[0] ? ": " : "", why);
        if (s == KVW_ROOM_FAILED && want == KVW_ROOM_FAILED) {
            ok &= CHECK(why[0] != '\0', "%s room %llu failed without a reason", side,
                        (unsigned long long)rm->id);
            if (needle)
                ok &= CHECK(kvt_contains(why, needle), "%s room %llu reason lacks '%s': %s", side,
                            (unsigned long long)rm->id, needle, why);
            if (k == 0)
                say("%s room %llu FAILED after %llu ms: %s", side, (unsigned long long)rm->id,
                    (unsigned long long)(now_ms() - t0), why);
        }
        if (dec && s == KVW_ROOM_SUCCESS && want == KVW_ROOM_SUCCESS)
            ok &= CHECK(kvw_room_status(side_room(rm, dec, k)) == KVW_OK,
                        "success with a non-OK status");
    }
    return ok;
}

static bool p_expect(inst_t *in, room_t *rm, kvw_room_state_t want, const char *needle,
                     uint64_t timeout_ms, const char *bug)
{
    return side_expect(false, in, rm, want, needle, timeout_ms, bug);
}

static bool d_expect(inst_t *in, room_t *rm, kvw_room_state_t want, const char *needle,
                     uint64_t timeout_ms, const char *bug)
{
    return side_expect(true, in, rm, want, needle, timeout_ms, bug);
}

/* ------------------------------------------------------------------ verification */

enum { V_UNTOUCHED = 0, V_OK = 1, V_PARTIAL = 2 };

/* What a room's pages may hold after the decode saw it end: all of it (Success on rank
 * 0) or part. */
static int polled_bytes(const room_t *rm)
{
    return kvw_room_poll(kvw_receiver_room(rm->r[0])) == KVW_ROOM_SUCCESS ? V_OK : V_PARTIAL;
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
            kvw_chunk_t c = {.field_mask = KVW_CHUNK_FIELDS_ALL,
                             .num_tokens = rm->n, .chunk_begin = 0, .chunk_end = rm->n,
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
                    kvw_room_metrics_t mt;
                    memset(&mt, 0, sizeof(mt));
                    mt.field_mask = KVW_ROOM_METRICS_FIELD_BYTES;
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

/* Reads one frame (the magic and version checked). 0, or -1. */
static int read_frame(int fd, uint8_t *type, uint8_t **payload, uint32_t *len)
{
    uint8_t h[12];
    if (kvt_read_full(fd, h, 12) || get_le32(h) != WIRE_MAGIC || h[4] != WIRE_VER)
        return -1;
    *type = h[5];
    *len = get_le32(h + 8);
    if (*len > (1u << 20))
        return -1;
    *payload = malloc(*len ? *len : 1);
    if (kvt_read_full(fd, *payload, *len)) {
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
    put_hdr(h, WIRE_MAGIC, WIRE_VER, T_BS_LOOKUP, 0);
    int n = -1;
    if (kvt_write_full(fd, h, 12) == 0 && read_frame(fd, &type, &p, &len) == 0) {
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

/* The malformed inputs for the bootstrap and the control port, in the order they run:
 * a header (magic, version, type, length) and `extra` zero bytes after it, or only the
 * first `cut` bytes of that header (AT_CUT_*), 40 garbage bytes, or nothing at all. */
enum { AT_BOTH, AT_BS, AT_CTL };     /* the port(s) an input is tried on */
#define AT_LOOKUP 0xffu              /* T_BS_LOOKUP on the bootstrap, T_HELLO on the control port */
#define AT_GARBAGE (-2)              /* cut: 40 garbage bytes instead of a header */
#define AT_NOTHING 0                 /* cut: connect and close */
#define AT_WHOLE (-1)                /* cut: the whole header and its extra bytes */
static const struct attack_def {
    const char *what;
    int port;
    uint32_t magic;
    uint8_t ver, type;
    uint32_t len;   /* the header's length field */
    size_t extra;   /* payload bytes sent after the header */
    int cut;        /* AT_WHOLE, AT_GARBAGE, AT_NOTHING or how many header bytes */
    bool expect_close;
} g_attacks[] = {
    {"garbage bytes", AT_BOTH, 0, 0, 0, 0, 0, AT_GARBAGE, true},
    {"bad magic", AT_BOTH, 0x3257564bu /* KVW2 */, 1, AT_LOOKUP, 0, 0, AT_WHOLE, true},
    {"bad version (the previous one)", AT_BOTH, WIRE_MAGIC, WIRE_VER - 1, AT_LOOKUP, 0, 0, AT_WHOLE, true},
    {"oversized length", AT_BOTH, WIRE_MAGIC, WIRE_VER, AT_LOOKUP, 0x7fffffffu, 0, AT_WHOLE, true},
    {"unknown frame type 0", AT_BOTH, WIRE_MAGIC, WIRE_VER, 0, 0, 0, AT_WHOLE, true},
    {"unknown frame type 200", AT_BOTH, WIRE_MAGIC, WIRE_VER, 200, 0, 0, AT_WHOLE, true},
    {"half a header, then close", AT_BOTH, WIRE_MAGIC, WIRE_VER, AT_LOOKUP, 0, 0, 6, false},
    {"truncated payload, then close", AT_BOTH, WIRE_MAGIC, WIRE_VER, AT_LOOKUP, 64, 10, AT_WHOLE, false},
    {"connect and close", AT_BOTH, 0, 0, 0, 0, 0, AT_NOTHING, false},
    {"lookup with trailing bytes", AT_BS, WIRE_MAGIC, WIRE_VER, T_BS_LOOKUP, 4, 4, AT_WHOLE, true},
    {"truncated register", AT_BS, WIRE_MAGIC, WIRE_VER, T_BS_REGISTER, 8, 8, AT_WHOLE, true},
    {"control frame on the bootstrap", AT_BS, WIRE_MAGIC, WIRE_VER, T_HELLO, 0, 0, AT_WHOLE, true},
    {"request before registration", AT_CTL, WIRE_MAGIC, WIRE_VER, T_REQ, 0, 0, AT_WHOLE, true},
    {"heartbeat before registration", AT_CTL, WIRE_MAGIC, WIRE_VER, T_HEARTBEAT, 0, 0, AT_WHOLE, true},
    {"truncated registration", AT_CTL, WIRE_MAGIC, WIRE_VER, T_HELLO, 3, 3, AT_WHOLE, true},
};

/* Builds the list of malformed inputs for the bootstrap or the control port. */
static int mk_attacks(raw_attack_t *a, bool control)
{
    int n = 0;
    for (size_t i = 0; i < KVW_ARRAY_N(g_attacks); i++) {
        const struct attack_def *d = &g_attacks[i];
        if (d->port == (control ? AT_BS : AT_CTL))
            continue;
        raw_attack_t *x = &a[n++];
        *x = (raw_attack_t){.what = d->what, .expect_close = d->expect_close};
        if (d->cut == AT_GARBAGE) {
            for (int j = 0; j < 40; j++)
                x->bytes[j] = (uint8_t)(j * 37 + 11);
            x->len = 40;
        } else if (d->cut != AT_NOTHING) {
            uint8_t type = d->type != AT_LOOKUP ? d->type : control ? T_HELLO : T_BS_LOOKUP;
            x->len = mk_hdr(x->bytes, d->magic, d->ver, type, d->len) + d->extra;
            if (d->cut != AT_WHOLE)
                x->len = (size_t)d->cut;
        }
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
        put_hdr(b, WIRE_MAGIC, WIRE_VER, T_HELLO, (uint32_t)(o - 12));
        kvt_write_full(fd, b, o);
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
        if (!CHECK(fd >= 0, "%s port %s: cannot connect for '%s'",
                   control ? "control" : "bootstrap", addr, at[i].what))
            continue;
        uint64_t t0 = now_ms();
        if (at[i].len)
            kvt_write_full(fd, at[i].bytes, at[i].len);
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

static int g_px_rewrite = -1; /* page index for the first full page of a REQ ... */
static uint64_t g_px_rewrite_room; /* ... for this room */
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
            int r = kvt_write_full(d->to, d->buf, d->got);
            d->got = 0;
            return r;
        }
        if (d->got < 12 + (size_t)len)
            return 0;
        uint8_t type = d->buf[5];
        bool drop = false;
        if (d2p && type == T_REQ && g_px_rewrite >= 0 && len >= 44 &&
            (get_le32(d->buf + 12) | (uint64_t)get_le32(d->buf + 16) << 32) == g_px_rewrite_room) {
            put_le32(d->buf + 12 + 40, (uint32_t)g_px_rewrite);
            g_px_rewrite = -1;
            g_px_rewritten++;
        }
        if (d2p && type == T_ABORT && g_px_drop_abort) {
            drop = true;
            g_px_dropped++;
        }
        if (!drop && kvt_write_full(d->to, d->buf, 12 + (size_t)len))
            return -1;
        if (d->ninj && kvt_write_full(d->to, d->inj, d->ninj))
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
            p[np++] =
                (struct pollfd){.fd = conns[i].open ? conns[i].d2p.from : -1, .events = POLLIN};
            p[np++] =
                (struct pollfd){.fd = conns[i].open ? conns[i].p2d.from : -1, .events = POLLIN};
        }
        if (poll(p, (nfds_t)np, 100) < 0 && errno != EINTR)
            break;
        if (p[0].revents) {
            if (ch_recv(e->ch[1], &m, 100) != 0)
                break; /* the decode process is done */
            if (!strcmp(m.tag, "rewrite")) {
                unsigned long long room = 0;
                sscanf(m.text, "%d %llu", &g_px_rewrite, &room);
                g_px_rewrite_room = room;
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
                        kvt_write_full(d->to, raw, n);
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
                        put_hdr(out, WIRE_MAGIC, WIRE_VER, T_BS_TABLE, (uint32_t)(o - 12));
                        kvt_write_full(c, out, o);
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

/* ================================================================== the failure table */

/*
 * Every row runs the same way (drv_prefill, drv_decode): the prefill process builds its
 * instance and hosts the bootstrap; the decode process connects (through the proxy for
 * R_PROXY rows). Four rooms, on pages that never overlap:
 *   I  innocent, sent by the prefill before the decode posts it, done before anything is
 *      injected, and still Success at the end;
 *   C  innocent and concurrent: posted and its senders opened before the injection, sent
 *      after the victim room ended;
 *   V  the victim: posted (row->d_post) and sent (row->p_inj) the row's way, with the
 *      row's injection on the decode (row->d_inj) and the prefill (row->p_inj);
 *   F  fresh, posted and sent (in three chunks) once the victim has ended.
 * The victim must end as the row says on the side(s) it names, with the expected status
 * and a reason holding the row's needle (an API call the row says is refused is checked
 * the same way, where it is made). C and F must succeed (S_ROOM), or C fails with the
 * connection while F succeeds (S_CONN), or both fail with a reason (S_PEER: the prefill
 * is gone). Every decode byte is then compared with the test kit's reference: I, C and F
 * exact, V untouched or written only where the room could write, everything else as
 * before, guard bytes intact.
 */

enum { W_ROOM, W_POST, W_SEND, W_CREATE, W_CTX, W_CONN, W_NONE };
enum { S_ROOM, S_CONN, S_PEER };
#define R_PROXY 1u    /* a third process relays the control channel */
#define R_INSTANCE 2u /* the decode names its instance (1): rows with a second instance */
#define R_VICTIM 4u   /* the prefill process ends killed (or frozen, then killed) */

typedef struct drv drv_t;

typedef struct frow {
    const char *name;
    uint32_t ptp, dtp;
    const char *tl;         /* only on this transport (NULL: every one) */
    int where;              /* where the failure shows (W_*) */
    kvw_status_t dst, pst;  /* status the victim gets on the decode / prefill (0: unchecked) */
    const char *needle;     /* in the failure reason (or the refused call's message) */
    int vbytes;             /* what the victim may leave in the decode's pages (V_*) */
    int scope;              /* what else the injection takes down (S_*) */
    uint32_t min_ms;        /* the decode's failure comes no sooner than this (0: no bound) */
    bool (*d_post)(drv_t *x); /* NULL: post V on every decode rank */
    void (*d_inj)(drv_t *x);  /* NULL: nothing */
    void (*p_inj)(drv_t *x);  /* NULL: open V's senders and send it whole */
    unsigned roles;
    int arg;
} frow_t;

struct drv {
    env_t *e;
    const frow_t *row;
    inst_t *in;   /* prefill */
    dctx_t *d;    /* decode */
    room_t *v, *c;
    uint64_t t0;  /* when the decode's clock for the victim starts */
};

static const frow_t *g_row;

/* Row statuses: ANY, the side is not checked (or, where the row expects success, must
 * succeed); ANYF, the side must fail with any status and a reason holding the needle. */
#define ANY KVW_OK
#define NOFAIL KVW_OK
#define ANYF ((kvw_status_t)1)
#define WANT(st) ((st) == ANYF ? KVW_OK : (st))

/* A refused API call: the row's status (`want`) and needle. */
static bool expect_call(drv_t *x, const char *what, kvw_status_t got, kvw_status_t want)
{
    char m[900];
    const char *why = kvw_last_error();
    if (kvt_expect_failure(what, got, WANT(want), why, x->row->needle, m, sizeof(m)) != 0)
        return CHECK(false, "%s", m);
    say("%s: %s: %s", what, kvw_status_string(got), why);
    return true;
}

/* The victim on the decode (or the prefill): every rank that holds a receiver (a
 * sender) must end `ok` (Success) or Failed with `st` (KVW_OK: any status) and a reason
 * holding `needle`. */
static void drv_expect_side(drv_t *x, bool dec, room_t *rm, const char *which, bool ok,
                            kvw_status_t st, const char *needle, uint64_t timeout_ms)
{
    uint64_t t0 = now_ms();
    uint32_t n = dec ? x->d->dec.n : x->in->n;
    for (uint32_t k = 0; k < n; k++) {
        if (dec ? rm->r[k] == NULL : rm->s[k] == NULL)
            continue;
        uint64_t used = now_ms() - t0, left = used < timeout_ms ? timeout_ms - used : 0;
        kvw_room_state_t s = side_wait(rm, dec, k, left);
        kvw_room_h room = side_room(rm, dec, k);
        const char *why = kvw_room_failure(room);
        char what[160], m[900];
        if (dec)
            snprintf(what, sizeof(what), "decode room %s (%llu) rank %u after %llu ms", which,
                     (unsigned long long)rm->id, k, (unsigned long long)(now_ms() - x->t0));
        else
            snprintf(what, sizeof(what), "prefill room %s (%llu) rank %u", which,
                     (unsigned long long)rm->id, k);
        if (ok) {
            CHECK(s == KVW_ROOM_SUCCESS && kvw_room_status(room) == KVW_OK,
                  "%s: %s, expected Success%s%s", what, kvw_room_state_string(s),
                  why[0] ? ": " : "", why);
            continue;
        }
        if (!CHECK(s == KVW_ROOM_FAILED, "%s: %s, expected Failed", what,
                   kvw_room_state_string(s)))
            continue;
        if (kvt_expect_failure(what, kvw_room_status(room), st, why, needle, m, sizeof(m)))
            CHECK(false, "%s", m);
        else if (k == 0)
            say("%s: %s: %s", what, kvw_status_string(kvw_room_status(room)), why);
    }
}

static void drv_expect_d(drv_t *x, room_t *rm, const char *which, bool ok, kvw_status_t st,
                         const char *needle, uint64_t timeout_ms)
{
    drv_expect_side(x, true, rm, which, ok, st, needle, timeout_ms);
}

static void drv_expect_p(drv_t *x, room_t *rm, const char *which, bool ok, kvw_status_t st,
                         const char *needle, uint64_t timeout_ms)
{
    drv_expect_side(x, false, rm, which, ok, st, needle, timeout_ms);
}

/* ---- decode posts of the victim */

/* On every decode rank: a receiver for the victim (aborted at once when `abort`), whose
 * `post` is refused with the row's status and needle; then, when `good` is given, that
 * post goes through. */
static void dp_refused_each(drv_t *x, const char *what, const kvw_recv_post_t *post,
                            bool abort, const kvw_recv_post_t *good)
{
    room_t *v = x->v;
    for (uint32_t k = 0; k < x->d->dec.n; k++) {
        CHECK(kvw_receiver_create(x->d->dec.ctx[k], v->id, 0, &v->r[k]) == KVW_OK, "create: %s",
              kvw_last_error());
        if (abort)
            kvw_room_abort(kvw_receiver_room(v->r[k]));
        expect_call(x, what, kvw_receiver_post(v->r[k], post), x->row->dst);
        if (good)
            CHECK(kvw_receiver_post(v->r[k], good) == KVW_OK, "the right post after a refused "
                  "one: %s", kvw_last_error());
    }
}

/* Pages of the victim edited as the row's arg says, posted on every rank: refused. */
enum { BP_OUT_OF_POOL, BP_SHORT, BP_DUP, BP_SWA_MISALIGNED };

static bool dp_bad_pages(drv_t *x)
{
    room_t *v = x->v;
    rpages_t p;
    room_pages(false, v->slot, v->n, &p);
    switch (x->row->arg) {
    case BP_OUT_OF_POOL: p.full[1] = FULL_PAGES + 3; break;
    case BP_SHORT: p.side.full.num_pages--; break;
    case BP_DUP: p.full[2] = p.full[0]; break;
    default: p.side.swa.first_token += 1; break;
    }
    kvw_recv_post_t post = post_of(v, &p);
    dp_refused_each(x, "kvw_receiver_post", &post, false, NULL);
    return true;
}

/* No receiver at all. */
static bool dp_none(drv_t *x)
{
    (void)x;
    return true;
}

/* Aborted, then posted. */
static bool dp_abort_then_post(drv_t *x)
{
    room_t *v = x->v;
    rpages_t p;
    room_pages(false, v->slot, v->n, &p);
    kvw_recv_post_t post = post_of(v, &p);
    dp_refused_each(x, "post after abort", &post, true, NULL);
    return true;
}

/* Posted twice (the second post is refused, the room carries on). */
static bool dp_twice(drv_t *x)
{
    d_open_post(&x->d->dec, x->v, NULL);
    rpages_t p;
    room_pages(false, x->v->slot, x->v->n, &p);
    kvw_recv_post_t post = post_of(x->v, &p);
    expect_call(x, "second post", kvw_receiver_post(x->v->r[0], &post), x->row->dst);
    return true;
}

/* A second receiver for the room on rank 0 is refused. */
static bool dp_second_receiver(drv_t *x)
{
    d_open_post(&x->d->dec, x->v, NULL);
    kvw_receiver_h dup = NULL;
    expect_call(x, "second receiver", kvw_receiver_create(x->d->dec.ctx[0], x->v->id, 0, &dup),
                x->row->dst);
    CHECK(dup == NULL, "a refused receiver_create returned a handle");
    if (dup)
        kvw_room_destroy(kvw_receiver_room(dup));
    return true;
}

/* A prefix longer than the request is refused; the right post then goes through. */
static bool dp_prefix(drv_t *x)
{
    room_t *v = x->v;
    rpages_t p;
    room_pages(false, v->slot, v->n, &p);
    kvw_recv_post_t good = post_of(v, &p);
    kvw_recv_post_t post = good;
    post.prefix_len = v->n + 1;
    dp_refused_each(x, "post with a prefix beyond the request", &post, false, &good);
    return true;
}

static void px_cmd(env_t *e, const char *tag, const char *text);

/* Proxy: the victim's REQ is rewritten in transit to name a page no room uses (the
 * test's reference still writes the posted pages: d_verify sees any stray byte). */
static bool dp_rewrite(drv_t *x)
{
    char t[64];
    snprintf(t, sizeof(t), "%u %llu", FULL_PAGES - 1, (unsigned long long)x->v->id);
    px_cmd(x->e, "rewrite", t);
    return d_open_post(&x->d->dec, x->v, NULL);
}

/* Proxy: the victim is posted, then destroyed; the ABORT that says so is lost. */
static bool dp_drop_abort(drv_t *x)
{
    px_cmd(x->e, "dropabort", "");
    d_open_post(&x->d->dec, x->v, NULL);
    d_close(&x->d->dec, x->v);
    return true;
}

/* ---- decode injections */

/* The prefill says it sent the victim's first chunk ("chunk1"): every decode rank must
 * see the room transferring. False when the message never came. */
static bool di_first_chunk(drv_t *x)
{
    if (ch_expect(x->e->ch[0], "chunk1", NULL, kvt_tmo_ms(10000)))
        return false;
    for (uint32_t k = 0; k < x->d->dec.n; k++)
        CHECK(wait_recv(x->v->r[k], KVW_ROOM_TRANSFERRING, kvt_tmo_ms(5000)) ==
                  KVW_ROOM_TRANSFERRING,
              "decode rank %u never saw the victim's first chunk: %s", k,
              kvw_room_failure(kvw_receiver_room(x->v->r[k])));
    return true;
}

/* The prefill announces its death (or freeze) just before it happens. */
static void di_wait_dying(drv_t *x)
{
    msg_t m;
    if (x->row->arg == 1) { /* mid-transfer: the first chunk has arrived everywhere */
        if (!di_first_chunk(x))
            return;
        ch_tag(x->e->ch[0], "transferring");
    }
    ch_recv(x->e->ch[0], &m, kvt_tmo_ms(5000));
    x->t0 = now_ms();
}

/* Every decode rank aborts the victim. */
static void di_abort_all(drv_t *x)
{
    for (uint32_t k = 0; k < x->d->dec.n; k++)
        kvw_room_abort(kvw_receiver_room(x->v->r[k]));
    x->t0 = now_ms();
}

/* Decode rank 0 alone aborts the victim in mid-transfer: the others hear of it from the
 * prefill, not through their own wait timeout. */
static void di_abort_rank0_mid(drv_t *x)
{
    if (!di_first_chunk(x))
        return;
    kvw_room_abort(kvw_receiver_room(x->v->r[0]));
    x->t0 = now_ms();
    ch_tag(x->e->ch[0], "aborted");
}

/* The first chunk has arrived on every decode rank (the prefill then aborts). */
static void di_transferring(drv_t *x)
{
    if (!di_first_chunk(x))
        return;
    ch_tag(x->e->ch[0], "transferring");
    x->t0 = now_ms();
}

/* Proxy: bytes injected into the established control stream once both senders wait:
 * arg 2 bad magic decode->prefill, 3 bad version prefill->decode, 4 truncated ABORT
 * decode->prefill, 5 oversized length prefill->decode. */
static size_t mk_hdr(uint8_t *b, uint32_t magic, uint8_t ver, uint8_t type, uint32_t len);

static void di_corrupt(drv_t *x)
{
    if (ch_wait(x->e->ch[0], "senders"))
        return;
    uint8_t f[32];
    size_t n = 0;
    const char *dir = "inject_d2p";
    switch (x->row->arg) {
    case 2: n = mk_hdr(f, 0xdeadbeefu, 1, T_HEARTBEAT, 0); break;
    case 3: n = mk_hdr(f, WIRE_MAGIC, 9, T_HEARTBEAT, 0), dir = "inject_p2d"; break;
    case 4:
        n = mk_hdr(f, WIRE_MAGIC, WIRE_VER, T_ABORT, 3) + 3;
        f[12] = f[13] = f[14] = 7;
        break;
    default: n = mk_hdr(f, WIRE_MAGIC, WIRE_VER, T_HEARTBEAT, 0x7ffffff0u), dir = "inject_p2d"; break;
    }
    char hex[80];
    for (size_t i = 0; i < n; i++)
        snprintf(hex + 2 * i, 3, "%02x", f[i]);
    px_cmd(x->e, dir, hex);
    x->t0 = now_ms();
}

/* Decode instance 2 (another rank of the same shape), connected directly. */
static bool second_instance(drv_t *x, inst_t *b)
{
    uint64_t keep = g_instance;
    g_instance = 2;
    char err[512];
    bool ok = CHECK(inst_build(b, &g_model, g_dtp, false, KVW_LAYOUT_NHD) == KVW_OK,
                    "instance 2: %s", kvw_last_error()) &&
              CHECK(inst_open(b, false, g_tl, x->d->bs, NULL, 0, err, sizeof(err)) == KVW_OK,
                    "instance 2: %s", err);
    g_instance = keep;
    return ok;
}

/* Decode instance 2, connected once the prefill holds instance 1's request ("vseen");
 * false (nothing left to free) when either fails. */
static bool second_after_vseen(drv_t *x, inst_t *b)
{
    if (!second_instance(x, b) || ch_expect(x->e->ch[0], "vseen", NULL, kvt_tmo_ms(10000))) {
        inst_free(b);
        return false;
    }
    return true;
}

/* Decode instance 2 posts the victim's room id too, once the prefill holds instance 1's
 * request: both claimants fail, the second told whose room it is. */
static void di_claim(drv_t *x)
{
    inst_t b;
    if (!second_after_vseen(x, &b))
        return;
    room_t v2 = room_def(x->v->id, 5);
    d_open_post(&b, &v2, NULL);
    x->t0 = now_ms();
    for (uint32_t k = 0; k < b.n; k++) {
        kvw_room_state_t s = wait_recv(v2.r[k], KVW_ROOM_SUCCESS, kvt_tmo_ms(10000));
        const char *why = kvw_room_failure(kvw_receiver_room(v2.r[k]));
        CHECK(s == KVW_ROOM_FAILED && kvt_contains(why, x->row->needle) &&
                  kvt_contains(why, "decode instance 2"),
              "the second claimant: %s: %s", kvw_room_state_string(s), why);
    }
    d_close(&b, &v2);
    inst_free(&b);
}

/* Decode instance 2 sends an ABORT for instance 1's room on its own control channel (a
 * frame any decode rank can send), then posts a room of its own: the prefill handles a
 * connection's frames in order, so once that room is there the abort was handled. */
static void di_foreign_abort(drv_t *x)
{
    inst_t b;
    if (!second_after_vseen(x, &b))
        return;
    struct kvw_ctx *bc = b.ctx[0];
    pthread_mutex_lock(&bc->mu);
    kvw_wbuf_t w;
    kvw__wb_init(&w, KVW_MSG_ABORT);
    kvw__wb_u64(&w, x->v->id);
    kvw__wb_u32(&w, (uint32_t)(int32_t)KVW_ERR_ABORTED);
    kvw__wb_str(&w, "not mine");
    kvw__peer_send(bc, bc->peers.tab[0], &w);
    pthread_mutex_unlock(&bc->mu);
    room_t own = room_def(x->v->id + 500, 5);
    d_open_post(&b, &own, NULL);
    ch_tag(x->e->ch[0], "babort");
    ch_expect(x->e->ch[0], "xseen", NULL, kvt_tmo_ms(10000));
    d_close(&b, &own);
    inst_free(&b);
}

static void hs_try(const char *bs, const kvt_model_t *m, kvw_layout_t layout, const char *tl,
                   drv_t *x, const char *what, const char *needle2);
static void tp3_try(drv_t *x);

/* An incompatible decode instance tries to register (arg picks the difference). */
static void di_handshake(drv_t *x)
{
    kvt_model_t m = g_model;
    kvt_model_relink(&m);
    kvw_layout_t layout = KVW_LAYOUT_NHD;
    const char *tl = g_tl, *what = x->row->name, *needle2 = NULL;
    switch (x->row->arg) {
    case 0: m.m.elem_size = 1; break;
    case 1: m.m.num_kv_heads = 4; break;
    case 2: m.m.k_head_dim = m.m.v_head_dim = 128; break;
    case 3: kvt_model_preset("gpt-oss-120b", &m), kvt_model_truncate(&m, 4); break;
    case 4: m.layers[0].window = 64; break;
    case 5: m.layers[0].kind = KVW_LAYER_FULL, m.layers[0].window = 0; break;
    case 6: tl = strcmp(g_tl, "tcp") ? "tcp" : "shm"; break;
    case 7: layout = KVW_LAYOUT_VECTORIZED_5D, needle2 = "NHD or HND"; break;
    default: tp3_try(x); return;
    }
    hs_try(x->d->bs, &m, layout, tl, x, what, needle2);
}

static void run_attacks(const char *addr, bool control, const char *bs);
static int bs_lookup(const char *bs, char *ctl_addr, size_t cap);
static void stall_connections(drv_t *x);

/* Malformed and truncated frames on the bootstrap and the control port. */
static void di_malformed(drv_t *x)
{
    char ctl[160] = "";
    int n = bs_lookup(x->d->bs, ctl, sizeof(ctl));
    if (!CHECK(n >= 1 && ctl[0], "BS_LOOKUP on %s failed (%d)", x->d->bs, n))
        return;
    run_attacks(x->d->bs, false, x->d->bs);
    run_attacks(ctl, true, x->d->bs);
}

static void di_stall(drv_t *x)
{
    stall_connections(x);
}

static void ignore_notify(void *arg, kvw_tl_ep_h ep, const void *msg, size_t len)
{
    (void)arg, (void)ep, (void)msg, (void)len;
}

/* Completions are counted only on the data connection of the peer that writes the room:
 * a connection of our own to the decode rank's transport (any local process can find a
 * shm socket name, any host can reach a tcp port) sends the victim's completion as its
 * prefill rank would (worker.c), with the right byte count, for every peer id, first bare
 * and then after a BIND with a guessed nonce. The room must not move; the real sender
 * then completes it with the reference bytes. */
static void di_forge(drv_t *x)
{
    struct kvw_ctx *d = x->d->dec.ctx[0];
    pthread_mutex_lock(&d->mu);
    kvw_room_t *r = kvw__room_find(d, x->v->id);
    uint32_t npeers = d->peers.num;
    uint64_t expected = r && r->num_srcs ? r->srcs[0].expected : 0;
    pthread_mutex_unlock(&d->mu);
    CHECK(expected > 0, "the victim expects no bytes");
    uint8_t addr[KVW_TL_MAX_ADDR];
    size_t alen = KVW_TL_MAX_ADDR;
    const kvw_tl_ops_t *ops = kvw__tl_find(g_tl);
    kvw_tl_params_t tp = {.cb = {.on_notify = ignore_notify}, .timeout_ms = kvt_tmo_ms(10000)};
    kvw_tl_h tl = NULL;
    kvw_tl_ep_h ep = NULL;
    if (!CHECK(ops && d->tl_ops->address(d->tl, addr, &alen) == KVW_OK &&
                   ops->init(&tp, &tl) == KVW_OK,
               "forger: %s", kvw_last_error()))
        return;
    if (CHECK(ops->connect(tl, addr, alen, &ep) == KVW_OK, "the forger cannot connect: %s",
              kvw_last_error())) {
        for (int bind = 0; bind < 2; bind++)
            for (uint32_t id = 0; id < npeers; id++) {
                kvw_wbuf_t w;
                if (bind) {
                    kvw__wb_init(&w, KVW_MSG_BIND);
                    kvw__wb_u32(&w, id);
                    for (int i = 0; i < 32; i++)
                        kvw__wb_u8(&w, 0);
                    CHECK(kvw__wb_finish(&w) == KVW_OK && ops->notify(ep, w.p, w.len) == KVW_OK,
                          "forger notify: %s", kvw_last_error());
                    kvw__wb_free(&w);
                }
                kvw__wb_init(&w, KVW_MSG_DONE);
                kvw__wb_u64(&w, x->v->id);
                kvw__wb_u32(&w, id);
                kvw__wb_u64(&w, 0);         /* chunk begin */
                kvw__wb_u64(&w, x->v->n);   /* chunk end */
                kvw__wb_u64(&w, expected);  /* bytes */
                kvw__wb_u8(&w, 1);          /* last chunk */
                kvw__wb_u8(&w, 0);          /* not staged */
                kvw__wb_u64(&w, 0);
                kvw__wb_u64(&w, 0);
                kvw__wb_u64(&w, 0);
                kvw__wb_u8(&w, 1);  /* final */
                kvw__wb_u32(&w, 0); /* no metadata */
                kvw__wb_u32(&w, 0); /* no digest: a well-formed DONE, refused for its sender */
                CHECK(kvw__wb_finish(&w) == KVW_OK && ops->notify(ep, w.p, w.len) == KVW_OK,
                      "forger notify: %s", kvw_last_error());
                kvw__wb_free(&w);
            }
        sleep_ms(100); /* time for the decode to handle them */
        kvw_room_state_t s = kvw_room_poll(kvw_receiver_room(x->v->r[0]));
        CHECK(s == KVW_ROOM_WAITING_FOR_INPUT, "after forged completions the victim is %s: %s",
              kvw_room_state_string(s), kvw_room_failure(kvw_receiver_room(x->v->r[0])));
        ops->ep_close(ep);
    }
    ops->close(tl);
    ops->stop(tl);
    ops->fini(tl);
    ch_tag(x->e->ch[0], "forged");
}

/* ---- prefill injections */

static void pi_none(drv_t *x)
{
    (void)x;
}

/* Senders opened, nothing sent. */
static void pi_open_only(drv_t *x)
{
    p_open(x->in, x->v);
}

/* Sends the first half of the victim, says so ("chunk1") and waits for the decode's
 * answer `then` (within timeout_ms). False when it never came. */
static bool pi_first_half(drv_t *x, const char *then, int timeout_ms)
{
    char err[256];
    CHECK(p_send(x->in, x->v, 0, x->v->n / 2, false, err, sizeof(err)) == KVW_OK, "chunk: %s",
          err);
    ch_tag(x->e->ch[1], "chunk1");
    return ch_expect(x->e->ch[1], then, NULL, timeout_ms) == 0;
}

/* The prefill process dies: arg 0 before sending, 1 after half of the room, 2 frozen. */
static void pi_die(drv_t *x)
{
    p_open(x->in, x->v);
    if (x->row->arg == 1 && !pi_first_half(x, "transferring", kvt_tmo_ms(10000)))
        return;
    ch_tag(x->e->ch[1], "dying");
    if (x->row->arg == 2) {
        raise(SIGSTOP); /* the parent kills it once the decode is done */
        sleep(60);
    }
    raise(SIGKILL);
}

/* The rest of a room that failed may not be sent. */
static void send_refused(drv_t *x, uint64_t from)
{
    wait_send(x->v->s[0], kvt_tmo_ms(10000));
    char err[512] = "";
    kvw_status_t st = p_send(x->in, x->v, from, x->v->n, true, err, sizeof(err));
    char m[900];
    if (kvt_expect_failure("sending on a failed room", st, WANT(x->row->pst), err,
                           "already failed", m, sizeof(m)))
        CHECK(false, "%s", m);
}

/* The real sender, once the forger is done. */
static void pi_after_forge(drv_t *x)
{
    p_open(x->in, x->v);
    if (ch_wait(x->e->ch[1], "forged"))
        return;
    p_send_all(x->in, x->v);
}

/* The decode aborts before any byte: afterwards sending is refused. */
static void pi_after_abort(drv_t *x)
{
    p_open(x->in, x->v);
    send_refused(x, 0);
}

/* Half the room, then decode rank 0 aborts: the rest is refused. */
static void pi_half_then_refused(drv_t *x)
{
    p_open(x->in, x->v);
    if (!pi_first_half(x, "aborted", kvt_tmo_ms(15000))) /* ch_wait's 15 s */
        return;
    send_refused(x, x->v->n / 2);
}

/* The prefill aborts the victim, arg 0 before any byte, 1 after half of it. */
static void pi_abort(drv_t *x)
{
    p_open(x->in, x->v);
    uint64_t from = x->row->arg == 1 ? x->v->n / 2 : 0;
    if (x->row->arg == 1 && !pi_first_half(x, "transferring", kvt_tmo_ms(10000)))
        return;
    for (uint32_t k = 0; k < x->in->n; k++)
        kvw_room_abort(kvw_sender_room(x->v->s[k]));
    send_refused(x, from);
}

/* A chunk the sender must refuse (arg: 0 beyond the request, 1 a last chunk short of
 * the end, 2 a chunk after the last one, 3 a chunk that changes the token count); the
 * room itself then completes with the right chunks. */
static void pi_bad_chunk(drv_t *x)
{
    room_t *v = x->v;
    p_open(x->in, v);
    rpages_t p;
    room_pages(true, v->slot, v->n, &p);
    kvw_send_chunk_t good = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL,
                             .num_tokens = v->n, .chunk_begin = 0, .chunk_end = v->n / 2,
                             .pages = p.side};
    kvw_send_chunk_t bad = good;
    switch (x->row->arg) {
    case 0: bad.chunk_end = v->n + 1; break;
    case 1: bad.last_chunk = 1; break;
    case 2: break;
    default: bad.num_tokens = v->n + 1, bad.chunk_begin = v->n / 2, bad.chunk_end = v->n; break;
    }
    for (uint32_t k = 0; k < x->in->n; k++) {
        if (x->row->arg == 2) {
            kvw_send_chunk_t all = good;
            all.chunk_end = v->n;
            all.last_chunk = 1;
            CHECK(kvw_sender_send(v->s[k], &all) == KVW_OK, "%s", kvw_last_error());
            expect_call(x, "a chunk after the last one", kvw_sender_send(v->s[k], &all),
                        x->row->pst);
            continue;
        }
        if (x->row->arg == 3)
            CHECK(kvw_sender_send(v->s[k], &good) == KVW_OK, "%s", kvw_last_error());
        expect_call(x, "kvw_sender_send", kvw_sender_send(v->s[k], &bad), x->row->pst);
        kvw_send_chunk_t rest = good;
        rest.chunk_begin = x->row->arg == 3 ? v->n / 2 : 0;
        rest.chunk_end = v->n;
        rest.last_chunk = 1;
        CHECK(kvw_sender_send(v->s[k], &rest) == KVW_OK, "the right chunk after a refused one: "
              "%s", kvw_last_error());
    }
}

/* The prefill sends a token count the decode did not post. */
static void pi_tokens(drv_t *x)
{
    room_t *v = x->v;
    p_open(x->in, v);
    p_wait_state(x->in, v, KVW_ROOM_WAITING_FOR_INPUT, kvt_tmo_ms(5000));
    rpages_t p;
    room_pages(true, v->slot, v->n, &p);
    kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL,
                          .num_tokens = v->n + 16, .chunk_begin = 0, .chunk_end = v->n + 16,
                          .last_chunk = 1, .pages = p.side};
    for (uint32_t k = 0; k < x->in->n; k++)
        kvw_sender_send(v->s[k], &c); /* queued or refused: the room fails either way */
}

/* A second sender for the room is refused; the first sends the room. */
static void pi_second_sender(drv_t *x)
{
    p_open(x->in, x->v);
    kvw_sender_h dup = NULL;
    expect_call(x, "second sender", kvw_sender_create(x->in->ctx[0], x->v->id, &dup),
                x->row->pst);
    CHECK(dup == NULL, "a refused sender_create returned a handle");
    if (dup)
        kvw_room_destroy(kvw_sender_room(dup));
    p_send_all(x->in, x->v);
}

/* Proxy corruption: both senders wait for input, then the decode injects. */
static void pi_hold(drv_t *x)
{
    p_open(x->in, x->v);
    p_wait_state(x->in, x->v, KVW_ROOM_WAITING_FOR_INPUT, kvt_tmo_ms(5000));
    p_wait_state(x->in, x->c, KVW_ROOM_WAITING_FOR_INPUT, kvt_tmo_ms(5000));
    ch_tag(x->e->ch[1], "senders");
}

/* The prefill holds the owner's request (then the second claimant posts). */
static void pi_vseen(drv_t *x)
{
    p_open(x->in, x->v);
    p_wait_state(x->in, x->v, KVW_ROOM_WAITING_FOR_INPUT, kvt_tmo_ms(5000));
    ch_tag(x->e->ch[1], "vseen");
}

/* A foreign ABORT arrives before the room is sent: the room must not notice. */
static void pi_foreign_abort(drv_t *x)
{
    pi_vseen(x);
    if (ch_wait(x->e->ch[1], "babort"))
        return;
    room_t own = room_def(x->v->id + 500, 5);
    p_open(x->in, &own);
    p_wait_state(x->in, &own, KVW_ROOM_WAITING_FOR_INPUT, kvt_tmo_ms(5000));
    ch_tag(x->e->ch[1], "xseen");
    p_close(x->in, &own);
    CHECK(kvw_room_poll(kvw_sender_room(x->v->s[0])) == KVW_ROOM_WAITING_FOR_INPUT,
          "an abort from another decode instance changed the room: %s (%s)",
          kvw_room_state_string(kvw_room_poll(kvw_sender_room(x->v->s[0]))),
          kvw_room_failure(kvw_sender_room(x->v->s[0])));
    p_send_all(x->in, x->v);
}
/* ---- incompatible decode instances, stalled connections */

/* One decode instance (TP g_dtp) built from `m` must be refused: by kvw_rank_create (its
 * own description) or by the prefill at registration, with the row's status there. */
static void hs_try(const char *bs, const kvt_model_t *m, kvw_layout_t layout, const char *tl,
                   drv_t *x, const char *what, const char *needle2)
{
    inst_t bad;
    kvw_status_t st = inst_build(&bad, m, g_dtp, false, layout);
    if (st != KVW_OK) {
        char m2[900];
        if (kvt_expect_failure(what, st, KVW_OK, kvw_last_error(), x->row->needle, m2,
                               sizeof(m2)) ||
            (needle2 && !kvt_contains(kvw_last_error(), needle2)))
            CHECK(false, "%s (refused at kvw_rank_create; also needs '%s')", m2,
                  needle2 ? needle2 : "");
        else
            say("%s: kvw_rank_create: %s: %s", what, kvw_status_string(st), kvw_last_error());
        return;
    }
    char err[768];
    uint64_t t0 = now_ms();
    st = inst_open(&bad, false, tl, bs, NULL, 0, err, sizeof(err));
    uint64_t dt = now_ms() - t0;
    char m2[900];
    if (kvt_expect_failure(what, st, WANT(x->row->dst), err, x->row->needle, m2, sizeof(m2)))
        CHECK(false, "%s", m2);
    else if (needle2 && !kvt_contains(err, needle2))
        CHECK(false, "%s: the reason lacks '%s': %s", what, needle2, err);
    else
        say("%s: %s in %llu ms: %s", what, kvw_status_string(st), (unsigned long long)dt, err);
    CHECK(st == KVW_OK || dt < kvt_tmo_ms(3000), "%s: the rejection took %llu ms", what,
          (unsigned long long)dt);
    inst_free(&bad);
}

/* TP 3 cannot split 8 heads: kvw_rank_create refuses with the numbers. (The test kit
 * refuses to lay such a rank out, so describe TP 2 and edit the TP size.) */
static void tp3_try(drv_t *x)
{
    kvt_rank_t r3;
    kvt_rank_spec_t sp = {.model = &g_model, .layout = KVW_LAYOUT_NHD,
                          .page_size = {PAGE, PAGE}, .num_pages = {FULL_PAGES, SWA_PAGES},
                          .num_slots = MAX_SLOTS, .describe_only = 1};
    sp.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL,
                              .tp_size = 2, .pp_size = 1, .layer_end = 2, .dp_size = 1};
    if (!CHECK(kvt_rank_describe(&sp, &r3) == KVW_OK, "describe TP 2"))
        return;
    r3.par.tp_size = 3;
    kvw_status_t st = kvt_rank_open(&r3);
    if (expect_call(x, "decode TP 3 with 8 heads: kvw_rank_create", st, x->row->dst))
        CHECK(kvt_contains(kvw_last_error(), "TP 3"), "the reason lacks 'TP 3': %s",
              kvw_last_error());
    kvt_rank_free(&r3);
}

/* While the decode is connected and its rooms move: 16 silent connections and one with
 * half a header on the prefill's control port, and one with half a header on the
 * bootstrap, for three peer timeouts; a bootstrap lookup meanwhile still works. */
static void stall_connections(drv_t *x)
{
    char ctl[160] = "";
    CHECK(bs_lookup(x->d->bs, ctl, sizeof(ctl)) >= 1, "lookup failed");
    int silent[16];
    for (int i = 0; i < 16; i++)
        silent[i] = raw_connect(ctl, kvt_tmo_ms(3000));
    int s2 = raw_connect(ctl, kvt_tmo_ms(3000));
    uint8_t h[12];
    put_hdr(h, WIRE_MAGIC, WIRE_VER, T_HELLO, 100);
    if (s2 >= 0)
        kvt_write_full(s2, h, 6);
    int s3 = raw_connect(x->d->bs, kvt_tmo_ms(3000));
    if (s3 >= 0)
        kvt_write_full(s3, h, 6);
    sleep_ms(50);
    uint64_t l0 = now_ms();
    char ctl2[160] = "";
    int ent = bs_lookup(x->d->bs, ctl2, sizeof(ctl2));
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
}

/* ---- the driver */

static void drv_rooms(room_t *v, room_t *i, room_t *c, room_t *f)
{
    *v = room_def(200, 0);
    *i = room_def(201, 1);
    *c = room_def(202, 2);
    *f = room_def(203, 3);
}

static int drv_prefill(env_t *e)
{
    const frow_t *row = g_row;
    inst_t in;
    int rc = p_start(e, &in, 0);
    if (rc)
        return rc;
    room_t v, i, c, f;
    drv_rooms(&v, &i, &c, &f);
    drv_t x = {.e = e, .row = row, .in = &in, .v = &v, .c = &c};
    if (ch_expect(e->ch[1], "ready", NULL, kvt_tmo_ms(60000)))
        return 1;
    /* I: sent before the decode posts it. */
    p_open(&in, &i);
    p_send_all(&in, &i);
    ch_tag(e->ch[1], "isent");
    if (ch_expect(e->ch[1], "posted", NULL, kvt_tmo_ms(20000)))
        return 1;
    drv_expect_p(&x, &i, "I", true, KVW_OK, NULL, kvt_tmo_ms(10000));
    p_open(&in, &c);
    if (row->p_inj)
        row->p_inj(&x);
    else {
        p_open(&in, &v);
        p_send_all(&in, &v);
    }
    /* C goes now, while the victim fails; where the injection takes the connection down,
     * once the connection's failure has reached C (then the send is refused). */
    char err[512] = "";
    kvw_status_t st = KVW_OK;
    if (row->scope == S_ROOM) {
        st = p_send(&in, &c, 0, c.n, true, err, sizeof(err));
        CHECK(st == KVW_OK, "send room C: %s: %s", kvw_status_string(st), err);
    }
    /* The victim on the prefill. */
    if (row->vbytes == V_OK)
        drv_expect_p(&x, &v, "V", true, KVW_OK, NULL, WAIT_TIMEOUT_MS + SLACK_MS);
    else if (row->pst != ANY)
        drv_expect_p(&x, &v, "V", false, WANT(row->pst), row->needle, WAIT_TIMEOUT_MS + SLACK_MS);
    if (row->scope == S_ROOM) {
        drv_expect_p(&x, &c, "C", true, KVW_OK, NULL, kvt_tmo_ms(10000));
    } else {
        drv_expect_p(&x, &c, "C", false, KVW_OK, NULL, PEER_TIMEOUT_MS + SLACK_MS);
        CHECK(p_send(&in, &c, 0, c.n, true, err, sizeof(err)) != KVW_OK,
              "sending room C after its connection failed succeeded");
    }
    /* F: once the decode posted it, in three chunks. */
    ch_tag(e->ch[1], "csent");
    if (ch_expect(e->ch[1], "fposted", NULL, kvt_tmo_ms(20000)))
        return 1;
    p_open(&in, &f);
    for (uint64_t k = 0; k < 3; k++) {
        st = p_send(&in, &f, f.n * k / 3, f.n * (k + 1) / 3, k == 2, err, sizeof(err));
        CHECK(st == KVW_OK, "send room F chunk %llu: %s: %s", (unsigned long long)k,
              kvw_status_string(st), err);
    }
    drv_expect_p(&x, &f, "F", true, KVW_OK, NULL, WAIT_TIMEOUT_MS + SLACK_MS);
    ch_tag(e->ch[1], "done");
    room_t *all[4] = {&v, &i, &c, &f};
    for (int j = 0; j < 4; j++)
        p_close(&in, all[j]);
    p_end(e, &in, kvt_tmo_ms(20000));
    return 0;
}

/* F after the prefill is gone: refused at post, or failed within the wait timeout; with
 * a reason either way. */
static void drv_f_refused(drv_t *x, room_t *f)
{
    rpages_t p;
    room_pages(false, f->slot, f->n, &p);
    kvw_recv_post_t post = post_of(f, &p);
    for (uint32_t k = 0; k < x->d->dec.n; k++) {
        if (!CHECK(kvw_receiver_create(x->d->dec.ctx[k], f->id, 0, &f->r[k]) == KVW_OK,
                   "receiver_create after the prefill died: %s", kvw_last_error()))
            continue;
        kvw_status_t st = kvw_receiver_post(f->r[k], &post);
        char m[900];
        if (st != KVW_OK &&
            kvt_expect_failure("posting to a dead prefill", st, KVW_OK, kvw_last_error(), NULL,
                               m, sizeof(m)))
            CHECK(false, "%s", m);
        if (st != KVW_OK && k == 0)
            say("posting to the dead prefill: %s: %s", kvw_status_string(st), kvw_last_error());
    }
    drv_expect_d(x, f, "F", false, KVW_OK, NULL, WAIT_TIMEOUT_MS + SLACK_MS);
}

static int drv_decode(env_t *e)
{
    const frow_t *row = g_row;
    if (row->roles & R_INSTANCE)
        g_instance = 1;
    dctx_t d;
    int rc = (row->roles & R_PROXY) ? mitm_dstart(e, &d) : d_start(e, &d, true);
    if (rc)
        return rc;
    room_t v, i, c, f;
    drv_rooms(&v, &i, &c, &f);
    drv_t x = {.e = e, .row = row, .d = &d, .v = &v, .c = &c};
    ch_tag(e->ch[0], "ready");
    if (ch_expect(e->ch[0], "isent", NULL, kvt_tmo_ms(20000)))
        return 1;
    d_open_post(&d.dec, &i, NULL);
    drv_expect_d(&x, &i, "I", true, KVW_OK, NULL, kvt_tmo_ms(10000));
    d_open_post(&d.dec, &c, NULL);
    if (row->d_post)
        row->d_post(&x);
    else
        d_open_post(&d.dec, &v, NULL);
    x.t0 = now_ms();
    ch_tag(e->ch[0], "posted");
    if (row->d_inj)
        row->d_inj(&x);
    /* The victim on the decode: within the wait timeout where the row waits for it, else
     * within the peer timeout of the injection. */
    uint64_t limit = (row->min_ms >= WAIT_BASE_MS ? WAIT_TIMEOUT_MS : PEER_TIMEOUT_MS) + SLACK_MS;
    if (row->vbytes == V_OK)
        drv_expect_d(&x, &v, "V", true, KVW_OK, NULL, WAIT_TIMEOUT_MS + SLACK_MS);
    else
        drv_expect_d(&x, &v, "V", false, WANT(row->dst), row->dst != ANY ? row->needle : NULL,
                     limit);
    uint64_t dt = now_ms() - x.t0;
    if (row->min_ms && v.r[0])
        CHECK(dt + 150 >= kvt_tmo_ms(row->min_ms), "the victim failed %llu ms after the "
              "injection, before the %u ms the row waits for", (unsigned long long)dt,
              kvt_tmo_ms(row->min_ms));
    /* C, then F. */
    if (row->scope == S_ROOM)
        drv_expect_d(&x, &c, "C", true, KVW_OK, NULL, kvt_tmo_ms(10000));
    else
        drv_expect_d(&x, &c, "C", false, KVW_OK, NULL, WAIT_TIMEOUT_MS + SLACK_MS);
    if (row->scope == S_PEER) {
        drv_f_refused(&x, &f);
    } else {
        if (ch_expect(e->ch[0], "csent", NULL, kvt_tmo_ms(20000)))
            return 1;
        d_open_post(&d.dec, &f, NULL);
        ch_tag(e->ch[0], "fposted");
        drv_expect_d(&x, &f, "F", true, KVW_OK, NULL, WAIT_TIMEOUT_MS + SLACK_MS);
        ch_expect(e->ch[0], "done", NULL, kvt_tmo_ms(20000));
    }
    /* I stays Success; then every byte. */
    for (uint32_t k = 0; k < d.dec.n; k++)
        CHECK(kvw_room_poll(kvw_receiver_room(i.r[k])) == KVW_ROOM_SUCCESS,
              "room I on decode rank %u turned "
              "%s: %s",
              k, kvw_room_state_string(kvw_room_poll(kvw_receiver_room(i.r[k]))),
              kvw_room_failure(kvw_receiver_room(i.r[k])));
    sleep_ms(100); /* late writes for the victim would land now */
    room_t *rp[4] = {&v, &i, &c, &f};
    int out[4] = {row->vbytes, V_OK, row->scope == S_ROOM ? V_OK : V_UNTOUCHED,
                  row->scope == S_PEER ? V_UNTOUCHED : V_OK};
    d_verify(&d.dec, &d.snap, &d.src, rp, out, 4);
    for (int j = 0; j < 4; j++)
        d_close(&d.dec, rp[j]);
    d_end(&d);
    return 0;
}

/* ---- the rows */


/* Each row: name, prefill TP, decode TP, transport, where, decode status, prefill status,
 * needle, victim bytes, scope, minimum delay, decode post, decode injection, prefill
 * injection, roles, argument. */
static const frow_t g_rows[] = {
    /* A peer that dies or freezes mid-room. */
    {"prefill killed before sending", 1, 2, NULL, W_ROOM, KVW_ERR_CONN_CLOSED, ANY,
     "prefill rank dp0/tp0/pp0",
     V_UNTOUCHED, S_PEER, 0, NULL, di_wait_dying, pi_die, R_VICTIM, 0},
    {"prefill killed mid-transfer", 1, 2, NULL, W_ROOM, KVW_ERR_CONN_CLOSED, ANY,
     "prefill rank dp0/tp0/pp0",
     V_PARTIAL, S_PEER, 0, NULL, di_wait_dying, pi_die, R_VICTIM, 1},
    {"prefill frozen (SIGSTOP)", 1, 2, NULL, W_ROOM, KVW_ERR_PEER_DEAD, ANY, "heartbeat",
     V_UNTOUCHED, S_PEER, PEER_BASE_MS, NULL, di_wait_dying, pi_die, R_VICTIM, 2},
    /* Aborts. */
    {"decode aborts before any byte", 1, 2, NULL, W_ROOM, KVW_ERR_ABORTED, KVW_ERR_ABORTED,
     "abort", V_UNTOUCHED, S_ROOM, 0, NULL, di_abort_all, pi_after_abort, 0, 0},
    {"decode rank 0 aborts mid-transfer", 1, 2, NULL, W_ROOM, ANYF, KVW_ERR_ABORTED, "abort",
     V_PARTIAL, S_ROOM, 0, NULL, di_abort_rank0_mid, pi_half_then_refused, 0, 0},
    {"prefill aborts before any byte", 2, 2, NULL, W_ROOM, KVW_ERR_ABORTED, KVW_ERR_ABORTED,
     "abort", V_UNTOUCHED, S_ROOM, 0, NULL, NULL, pi_abort, 0, 0},
    {"prefill aborts mid-transfer", 2, 2, NULL, W_ROOM, KVW_ERR_ABORTED, KVW_ERR_ABORTED,
     "abort", V_PARTIAL, S_ROOM, 0, NULL, di_transferring, pi_abort, 0, 1},
    {"post after a local abort", 1, 2, NULL, W_POST, KVW_ERR_ABORTED, ANY, "abort",
     V_UNTOUCHED, S_ROOM, 0, dp_abort_then_post, NULL, pi_none, 0, 0},
    /* Out-of-range pages and bad page lists (refused at post, nothing sent). */
    {"page index beyond the pool", 1, 2, NULL, W_POST, KVW_ERR_OUT_OF_RANGE, ANY,
     "outside the pool", V_UNTOUCHED, S_ROOM, 0, dp_bad_pages, NULL, pi_none, 0, BP_OUT_OF_POOL},
    {"page list one page short", 1, 2, NULL, W_POST, KVW_ERR_OUT_OF_RANGE, ANY, "does not cover",
     V_UNTOUCHED, S_ROOM, 0, dp_bad_pages, NULL, pi_none, 0, BP_SHORT},
    {"page listed twice", 1, 2, NULL, W_POST, KVW_ERR_INVALID_PARAM, ANY, "listed twice",
     V_UNTOUCHED, S_ROOM, 0, dp_bad_pages, NULL, pi_none, 0, BP_DUP},
    {"SWA list off its page boundary", 1, 2, NULL, W_POST, KVW_ERR_OUT_OF_RANGE, ANY,
     "does not cover", V_UNTOUCHED, S_ROOM, 0, dp_bad_pages, NULL, pi_none, 0,
     BP_SWA_MISALIGNED},
    /* Calls the API refuses without failing the room. */
    {"room posted twice", 1, 2, NULL, W_POST, KVW_ERR_INVALID_PARAM, NOFAIL, "already posted",
     V_OK, S_ROOM, 0, dp_twice, NULL, NULL, 0, 0},
    {"second receiver for a room", 1, 2, NULL, W_CREATE, KVW_ERR_BUSY, NOFAIL,
     "already has a receiver", V_OK, S_ROOM, 0, dp_second_receiver, NULL, NULL, 0, 0},
    {"second sender for a room", 2, 1, NULL, W_CREATE, NOFAIL, KVW_ERR_BUSY,
     "already has a sender", V_OK, S_ROOM, 0, NULL, NULL, pi_second_sender, 0, 0},
    {"prefix beyond the request", 1, 2, NULL, W_POST, KVW_ERR_INVALID_PARAM, NOFAIL,
     "exceeds the request", V_OK, S_ROOM, 0, dp_prefix, NULL, NULL, 0, 0},
    {"chunk beyond the request", 1, 2, NULL, W_SEND, NOFAIL, KVW_ERR_INVALID_PARAM,
     "out of range", V_OK, S_ROOM, 0, NULL, NULL, pi_bad_chunk, 0, 0},
    {"last chunk short of the end", 1, 2, NULL, W_SEND, NOFAIL, KVW_ERR_INVALID_PARAM,
     "cannot be the last one", V_OK, S_ROOM, 0, NULL, NULL, pi_bad_chunk, 0, 1},
    {"chunk after the last one", 1, 2, NULL, W_SEND, NOFAIL, KVW_ERR_INVALID_PARAM,
     "already sent its last chunk", V_OK, S_ROOM, 0, NULL, NULL, pi_bad_chunk, 0, 2},
    {"chunk changes the token count", 1, 2, NULL, W_SEND, NOFAIL, KVW_ERR_INVALID_PARAM,
     "chunk says", V_OK, S_ROOM, 0, NULL, NULL, pi_bad_chunk, 0, 3},
    /* Shapes that disagree. */
    {"prefill sends another token count", 1, 2, NULL, W_ROOM, KVW_ERR_REMOTE_FAILED,
     KVW_ERR_INVALID_PARAM, "decode expects", V_UNTOUCHED, S_ROOM, 0, NULL, NULL, pi_tokens, 0,
     0},
    {"fp8 decode (element size 1)", 1, 2, NULL, W_CTX, KVW_ERR_REJECTED, NOFAIL, "element size",
     V_OK, S_ROOM, 0, NULL, di_handshake, NULL, 0, 0},
    {"decode with 4 KV heads", 1, 2, NULL, W_CTX, KVW_ERR_REJECTED, NOFAIL, "KV head", V_OK,
     S_ROOM, 0, NULL, di_handshake, NULL, 0, 1},
    {"decode with head dim 128", 1, 2, NULL, W_CTX, KVW_ERR_REJECTED, NOFAIL, "head dim", V_OK,
     S_ROOM, 0, NULL, di_handshake, NULL, 0, 2},
    {"decode with 4 layers", 1, 2, NULL, W_CTX, KVW_ERR_REJECTED, NOFAIL, "layer count", V_OK,
     S_ROOM, 0, NULL, di_handshake, NULL, 0, 3},
    {"decode with SWA window 64", 1, 2, NULL, W_CTX, KVW_ERR_REJECTED, NOFAIL, "window", V_OK,
     S_ROOM, 0, NULL, di_handshake, NULL, 0, 4},
    {"decode whose layer 0 is full attention", 1, 2, NULL, W_CTX, KVW_ERR_REJECTED, NOFAIL,
     "layer 0", V_OK, S_ROOM, 0, NULL, di_handshake, NULL, 0, 5},
    {"decode speaking the other transport", 1, 2, NULL, W_CTX, KVW_ERR_REJECTED, NOFAIL,
     "transport", V_OK, S_ROOM, 0, NULL, di_handshake, NULL, 0, 6},
    {"vectorized 5-D decode layout", 1, 2, NULL, W_CTX, KVW_ERR_REJECTED, NOFAIL, "5-D", V_OK,
     S_ROOM, 0, NULL, di_handshake, NULL, 0, 7},
    {"decode TP 3 with 8 KV heads", 1, 2, NULL, W_CTX, KVW_ERR_INCOMPATIBLE, NOFAIL,
     "8 KV heads", V_OK, S_ROOM, 0, NULL, di_handshake, NULL, 0, 8},
    /* Wrong room owner. */
    {"a second decode instance claims the room", 1, 1, NULL, W_ROOM, KVW_ERR_REMOTE_FAILED,
     KVW_ERR_INVALID_PARAM, "but the room belongs to instance 1 group 0", V_UNTOUCHED, S_ROOM, 0,
     NULL, di_claim, pi_vseen, R_INSTANCE, 0},
    {"abort from a decode instance that does not own the room", 1, 1, NULL, W_NONE, NOFAIL,
     NOFAIL, NULL, V_OK, S_ROOM, 0, NULL, di_foreign_abort, pi_foreign_abort, R_INSTANCE, 0},
    {"forged completion on a connection of its own", 1, 1, NULL, W_NONE, NOFAIL, NOFAIL, NULL,
     V_OK, S_ROOM, 0, NULL, di_forge, pi_after_forge, 0, 0},
    /* Timeouts. */
    {"posted, never sent", 1, 2, NULL, W_ROOM, ANYF, ANYF, "timed out",
     V_UNTOUCHED, S_ROOM, WAIT_BASE_MS, NULL, NULL, pi_open_only, 0, 0},
    {"posted, no sender", 1, 2, NULL, W_ROOM, ANYF, ANY, "timed out", V_UNTOUCHED, S_ROOM,
     WAIT_BASE_MS, NULL, NULL, pi_none, 0, 0},
    {"sent, never posted", 1, 2, NULL, W_ROOM, NOFAIL, KVW_ERR_TIMEOUT, "no decode rank posted",
     V_UNTOUCHED, S_ROOM, 0, dp_none, NULL, NULL, 0, 0},
    /* Malformed, truncated and stalled connections. */
    {"malformed frames on the bootstrap and control ports", 1, 1, NULL, W_CONN, NOFAIL, NOFAIL,
     NULL, V_OK, S_ROOM, 0, NULL, di_malformed, NULL, 0, 0},
    {"stalled connections", 1, 1, NULL, W_CONN, NOFAIL, NOFAIL, NULL, V_OK, S_ROOM, 0, NULL,
     di_stall, NULL, 0, 0},
    /* Hostile frames in the established control stream (a proxy in the middle). */
    {"proxy: REQ rewritten to an ungranted page", 1, 1, "tcp", W_ROOM, KVW_ERR_OUT_OF_RANGE, ANY,
     "not granted", V_PARTIAL, S_ROOM, 0, dp_rewrite, NULL, NULL, R_PROXY, 0},
    {"proxy: ABORT lost, destroyed room written", 1, 1, "tcp", W_ROOM, NOFAIL, ANY, NULL,
     V_UNTOUCHED, S_ROOM, 0, dp_drop_abort, NULL, NULL, R_PROXY, 1},
    {"proxy: bad magic decode->prefill", 1, 1, NULL, W_ROOM, ANY, ANYF, "magic", V_UNTOUCHED,
     S_CONN, 0, NULL, di_corrupt, pi_hold, R_PROXY, 2},
    {"proxy: bad version prefill->decode", 1, 1, NULL, W_ROOM, ANYF, ANY, "version", V_UNTOUCHED,
     S_CONN, 0, NULL, di_corrupt, pi_hold, R_PROXY, 3},
    {"proxy: truncated ABORT decode->prefill", 1, 1, NULL, W_ROOM, ANY, ANYF, "truncated",
     V_UNTOUCHED, S_CONN, 0, NULL, di_corrupt, pi_hold, R_PROXY, 4},
    {"proxy: oversized frame prefill->decode", 1, 1, NULL, W_ROOM, ANYF, ANY, "exceeds",
     V_UNTOUCHED, S_CONN, 0, NULL, di_corrupt, pi_hold, R_PROXY, 5},
};

/* ================================================================== scenarios */

/* ---- decode killed; then a new decode instance (variant 0), or two decode
 * instances at once (variant 1) */

/* Tells decode `ch` `tag`, then serves the room it posts: the whole room sent, and
 * Success on the prefill. */
static int ddeath_serve(env_t *e, int ch, const char *tag, inst_t *in, room_t *rm,
                        const char *bug)
{
    ch_tag(e->ch[ch], tag);
    if (ch_wait(e->ch[ch], "posted"))
        return 1;
    p_open(in, rm);
    p_send_all(in, rm);
    p_expect(in, rm, KVW_ROOM_SUCCESS, NULL, WAIT_TIMEOUT_MS + SLACK_MS, bug);
    return 0;
}

static int ddeath_prefill(env_t *e)
{
    inst_t in;
    int rc = p_start(e, &in, 0);
    if (rc)
        return rc;
    room_t r1 = room_def(30, 0), r2 = room_def(31, 1);
    if (g_variant == 0) {
        if (ch_wait(e->ch[1], "posted"))
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
        /* A new decode instance connects to the same prefill; then the same room id as
         * the dead instance's room works again. */
        room_t r3 = room_def(30, 2);
        if (ddeath_serve(e, 2, "go", &in, &r2, NULL) ||
            ddeath_serve(e, 2, "again", &in, &r3, NULL))
            return 1;
        ch_tag(e->ch[2], "done");
        p_close(&in, &r2);
        p_close(&in, &r3);
    } else {
        ch_tag(e->ch[1], "go");
        ch_tag(e->ch[2], "go");
        if (ch_wait(e->ch[1], "posted") ||
            ch_wait(e->ch[2], "posted"))
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

/* A decode instance of these cases: its contexts open (after the prefill's "go" when
 * `go`; as instance `instance` when not 0: instances sharing a prefill each pass their
 * own id), then `rm` is posted and the prefill told so. 0, or the case's exit code. */
static int ddeath_connect(env_t *e, dctx_t *d, bool go, uint64_t instance, const char *who,
                          room_t *rm)
{
    int rc = d_start(e, d, false);
    if (rc)
        return rc;
    if (go && ch_wait(e->ch[0], "go"))
        return 1;
    if (instance)
        g_instance = instance;
    char err[512];
    if (!CHECK(inst_open(&d->dec, false, g_tl, d->bs, NULL, 0, err, sizeof(err)) == KVW_OK,
               "%s: %s", who, err))
        return 1;
    d_open_post(&d->dec, rm, NULL);
    ch_tag(e->ch[0], "posted");
    return 0;
}

/* The decode process killed in variant 0. */
static int ddeath_victim(env_t *e)
{
    dctx_t d;
    room_t rm = room_def(30, 0);
    int rc = ddeath_connect(e, &d, g_variant == 1, g_variant == 1 ? 1 : 0, "decode contexts",
                            &rm);
    if (rc)
        return rc;
    if (g_variant == 0) {
        ch_wait(e->ch[0], "die");
        raise(SIGKILL);
        return 1;
    }
    /* The bytes reach the decode even with the prefill-side bug, so no bug tag here. */
    d_expect(&d.dec, &rm, KVW_ROOM_SUCCESS, NULL, WAIT_TIMEOUT_MS + SLACK_MS, NULL);
    room_t *rp[1] = {&rm};
    int out = polled_bytes(&rm);
    d_verify(&d.dec, &d.snap, &d.src, rp, &out, 1);
    ch_wait(e->ch[0], "done");
    d_close(&d.dec, &rm);
    d_end(&d);
    return 0;
}

/* The second decode instance. */
static int ddeath_second(env_t *e)
{
    dctx_t d;
    room_t rm = room_def(31, 1);
    int rc = ddeath_connect(e, &d, true, g_variant == 1 ? 2 : 0,
                            "second decode instance cannot connect", &rm);
    if (rc)
        return rc;
    /* The bytes reach the decode even with the prefill-side bugs, so no bug tag here. */
    const char *bug = NULL;
    d_expect(&d.dec, &rm, KVW_ROOM_SUCCESS, NULL, WAIT_TIMEOUT_MS + SLACK_MS, bug);
    room_t r3 = room_def(30, 2);
    room_t *rp[2] = {&rm, &r3};
    int out[2] = {polled_bytes(&rm), V_UNTOUCHED};
    if (g_variant == 0) {
        if (ch_wait(e->ch[0], "again"))
            return 1;
        d_open_post(&d.dec, &r3, NULL);
        ch_tag(e->ch[0], "posted");
        d_expect(&d.dec, &r3, KVW_ROOM_SUCCESS, NULL, WAIT_TIMEOUT_MS + SLACK_MS, bug);
        out[1] = polled_bytes(&r3);
    }
    d_verify(&d.dec, &d.snap, &d.src, rp, out, 2);
    ch_wait(e->ch[0], "done");
    d_close(&d.dec, &rm);
    d_close(&d.dec, &r3);
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
    if (ch_wait(e->ch[1], "posted"))
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
    ch_wait(e->ch[0], "done");
    room_t *rp[1] = {&rm};
    int out = polled_bytes(&rm);
    d_verify(&d.dec, &d.snap, &d.src, rp, &out, 1);
    d_close(&d.dec, &rm);
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
    kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL,
                          .num_tokens = rm->n, .chunk_begin = 0, .chunk_end = rm->n,
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
    if (ch_wait(e->ch[1], "posted"))
        return 1;
    p_open(&in, &ra);
    p_wait_state(&in, &ra, KVW_ROOM_WAITING_FOR_INPUT, kvt_tmo_ms(5000));
    CHECK(kvw_sender_create(in.ctx[1], rb.id, &rb.s[1]) == KVW_OK, "sender B rank 1: %s",
          kvw_last_error());
    /* Prefill rank 1 serves decode rank 1, which then leaves. */
    p_send_rank(&in, &ra, 1);
    p_send_rank(&in, &rb, 1);
    room_t *ab[2] = {&ra, &rb};
    for (int j = 0; j < 2; j++)
        CHECK(wait_send(ab[j]->s[1], kvt_tmo_ms(10000)) == KVW_ROOM_SUCCESS, "room %c rank 1: %s",
              'A' + j, kvw_room_failure(kvw_sender_room(ab[j]->s[1])));
    ch_tag(e->ch[1], "sent1");
    if (ch_wait(e->ch[1], "left1"))
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
    for (uint32_t k = 0; k < 2; k++)
        for (int j = 0; j < 2; j++) {
            kvw_room_h r = kvw_sender_room(ab[j]->s[k]);
            CHECK(kvw_room_poll(r) == KVW_ROOM_SUCCESS, "room %c rank %u turned %s: %s",
                  'A' + j, k, kvw_room_state_string(kvw_room_poll(r)), kvw_room_failure(r));
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
    if (ch_wait(e->ch[0], "sent1"))
        return 1;
    room_t *rp[2] = {&ra, &rb};
    for (int j = 0; j < 2; j++)
        CHECK(wait_recv(rp[j]->r[1], KVW_ROOM_SUCCESS, kvt_tmo_ms(10000)) == KVW_ROOM_SUCCESS,
              "room %c rank 1: %s", 'A' + j, kvw_room_failure(kvw_receiver_room(rp[j]->r[1])));
    /* Decode rank 1 leaves: its rooms are done, its context goes away. */
    for (int j = 0; j < 2; j++) {
        kvw_room_destroy(kvw_receiver_room(rp[j]->r[1]));
        rp[j]->r[1] = NULL;
    }
    kvw_ctx_destroy(d.dec.ctx[1]);
    d.dec.ctx[1] = NULL;
    ch_tag(e->ch[0], "left1");
    for (int j = 0; j < 2; j++)
        CHECK(wait_recv(rp[j]->r[0], KVW_ROOM_SUCCESS, WAIT_TIMEOUT_MS + SLACK_MS) ==
                  KVW_ROOM_SUCCESS,
              "room %c rank 0: %s", 'A' + j, kvw_room_failure(kvw_receiver_room(rp[j]->r[0])));
    int out[2] = {V_OK, V_OK};
    if (d_verify(&d.dec, &d.snap, &d.src, rp, out, 2))
        say("2 rooms verified byte-exact on both decode ranks (guards intact)");
    ch_wait(e->ch[0], "done0");
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

/* A row as the processes it runs in. */
static case_def_t row_case(const frow_t *r)
{
    case_def_t c = {.name = r->name, .nroles = 2, .ptp = r->ptp, .dtp = r->dtp,
                    .deadline_s = 40};
    c.roles[0] = (role_t){"prefill", drv_prefill, (r->roles & R_VICTIM) != 0};
    c.roles[1] = (role_t){"decode", drv_decode, false};
    if (r->roles & R_PROXY)
        c.roles[c.nroles++] = (role_t){"proxy", proxy_main, false};
    return c;
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    alarm(kvt_tmo_s(290)); /* CTest gives 300 s (scaled alike); never hang past it */
    if (kvt_model_preset("gpt-oss-120b", &g_model) || kvt_model_truncate(&g_model, 2)) {
        fprintf(stderr, "test_proto_fail: no gpt-oss-120b preset\n");
        return 1;
    }
    g_strict = getenv("KVW_PROTO_FAIL_STRICT") && atoi(getenv("KVW_PROTO_FAIL_STRICT"));
    const char *only = getenv("KVW_PROTO_FAIL_ONLY");
    const char *only_tl = getenv("KVW_PROTO_FAIL_TL");

    /* Scenarios that are not one failing room: several decode instances, a departing
     * rank, chunks slower than the wait timeout. */
    const case_def_t scenarios[] = {
        {"decode killed, new decode instance",
         {P_ROLE(ddeath_prefill), {"decode1", ddeath_victim, true},
          {"decode2", ddeath_second, false}}, 3, 1, 1, 0, 40},
        {"two decode instances at once",
         {P_ROLE(ddeath_prefill), {"decode1", ddeath_victim, false},
          {"decode2", ddeath_second, false}}, 3, 1, 1, 1, 40},
        {"a decode rank leaves, the others finish",
         {P_ROLE(leave_prefill), D_ROLE(leave_decode)}, 2, 2, 2, 0, 40},
        {"chunks slower than the wait timeout",
         {P_ROLE(slowchunk_prefill), D_ROLE(slowchunk_decode)}, 2, 1, 2, 0, 30},
    };
    const char *tls[] = {"tcp", "shm"};
    int pass = 0, fail = 0, skip = 0, xfail = 0;
    for (size_t t = 0; t < KVW_ARRAY_N(tls); t++) {
        g_tl = tls[t];
        if (only_tl && strcmp(only_tl, g_tl))
            continue;
        bool tl_skipped = false, first = true;
        size_t nrows = KVW_ARRAY_N(g_rows), n = nrows + KVW_ARRAY_N(scenarios);
        for (size_t i = 0; i < n && !tl_skipped; i++) {
            case_def_t c;
            if (i < nrows) {
                g_row = &g_rows[i];
                if (g_row->tl && strcmp(g_row->tl, g_tl))
                    continue;
                c = row_case(g_row);
            } else {
                g_row = NULL;
                c = scenarios[i - nrows];
            }
            if (only && !kvt_contains(c.name, only))
                continue;
            int rc = run_case(&c);
            if (rc == 0)
                pass++;
            else if (rc == 77)
                skip++, tl_skipped = first;
            else if (rc == 3)
                xfail++;
            else
                fail++;
            first = false;
        }
    }
    fprintf(stderr, "\ntest_proto_fail: %d passed, %d failed, %d known library bugs (XFAIL), "
            "%d skipped\n", pass, fail, xfail, skip);
    if (fail)
        return 1;
    return pass + xfail ? 0 : 77;
}
