/*
 * One conformance suite for every compiled transport (kvw__tl_names()).
 *
 * Cross-process cases (run first, while this process has no threads, so fork is
 * safe): the receiver and the sender are separate children and the parent only
 * orchestrates.
 *   xproc_integrity   random puts, verified byte for byte, notification after data
 *   xproc_peer_killed a sender is SIGKILLed mid-stream: on_ep_error, and the receiver
 *                     keeps serving a new sender
 *   xproc_recv_gone   the receiver is SIGKILLed: the sender's put/notify fail (no hang)
 *   xproc_recv_stall  the receiver is SIGSTOPped: the sender's calls fail with TIMEOUT
 * In-process cases:
 *   integrity, multi_ep, threads (concurrent put on one endpoint), bounds and
 *   parameter errors, check_write (refusal on transports that mediate writes; never
 *   consulted on the others), dereg, ep_close, receiver_close, leak-free fini.
 *
 * Zero-length puts are part of the random mix: the contract makes them valid (offset
 * <= region length) and they must change nothing.
 *
 * Regions have guard bytes on both sides; for shm, some regions live in memory from
 * kvw_mem_alloc_shared (memfd path, one of them not page-aligned, with its guards on
 * the same pages) and one in malloc'd memory (process_vm_writev path).
 *
 * "The notification arrives after the data" is checked by snapshotting every region
 * inside on_notify itself, and comparing the snapshot with the expected bytes.
 * Every wait has a timeout; each child process also has an alarm.
 * Exit 0 on success, 1 on the first failure, with a message naming the case.
 */
#include "timeout.h"
#include "transport/transport.h"

#include <kvwire/mem.h>

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const kvw_tl_ops_t *T;
static const char *g_case = "-";

/* "transport/case", for the failures. */
static const char *case_label(void)
{
    static _Thread_local char label[128];
    snprintf(label, sizeof label, "%s/%s", T ? T->name : "-", g_case);
    return label;
}

/* A failed check ends the case (check.h). */
#define CHECK_END                                                                          \
    do {                                                                                   \
        rc = 1;                                                                            \
        goto out;                                                                          \
    } while (0)
#define CHECK_CASE case_label()
#include "check.h"

/* ---------------------------------------------------------------- utilities */

static uint64_t rnd(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void fill_bytes(uint8_t *p, size_t n, uint64_t seed)
{
    uint64_t s = seed;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v = rnd(&s);
        memcpy(p + i, &v, 8);
    }
    if (i < n) {
        uint64_t v = rnd(&s);
        memcpy(p + i, &v, n - i);
    }
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

/* ---------------------------------------------------------------- regions */

#define GUARD 4096
#define NREG 3

typedef struct region {
    uint8_t *base; /* allocation, guards included */
    size_t total;
    uint8_t *data; /* registered range */
    uint64_t len;
    uint64_t id;
    size_t pre; /* bytes before data */
    bool shared;
    kvw_tl_mem_h mem;
    uint8_t rkey[KVW_TL_MAX_RKEY];
    size_t rkey_len;
    uint8_t *shadow; /* expected contents of data */
} region_t;

static const uint64_t region_lens[NREG] = {(1u << 20) + 77, 256u << 10, (3u << 20) + 4096};

static uint8_t guard_byte(size_t i)
{
    return (uint8_t)(0xa5 ^ (i * 7));
}

static int region_alloc(region_t *r, uint64_t id, uint64_t len, bool shared, size_t misalign,
                        uint64_t seed)
{
    memset(r, 0, sizeof(*r));
    r->id = id;
    r->len = len;
    r->shared = shared;
    r->pre = GUARD + misalign;
    r->total = r->pre + len + GUARD;
    if (shared) {
        void *p;
        if (kvw_mem_alloc_shared(r->total, &p) != KVW_OK) {
            fprintf(stderr, "kvw_mem_alloc_shared: %s\n", kvw_last_error());
            return -1;
        }
        r->base = p;
    } else {
        r->base = malloc(r->total);
    }
    r->shadow = malloc(len);
    if (!r->base || !r->shadow)
        return -1;
    for (size_t i = 0; i < r->total; i++)
        r->base[i] = guard_byte(i);
    r->data = r->base + r->pre;
    fill_bytes(r->data, len, seed ^ (id * 0x1234567));
    memcpy(r->shadow, r->data, len);
    return 0;
}

static void region_reset(region_t *r, uint64_t seed)
{
    fill_bytes(r->data, r->len, seed ^ (r->id * 0x1234567));
    memcpy(r->shadow, r->data, r->len);
}

static void region_free(region_t *r)
{
    if (r->shared)
        kvw_mem_free_shared(r->base);
    else
        free(r->base);
    free(r->shadow);
    memset(r, 0, sizeof(*r));
}

/* Compares one region image (guards included) with the expected bytes. */
static int check_image(const region_t *r, const uint8_t *img, char *why, size_t cap)
{
    for (size_t i = 0; i < r->pre; i++)
        if (img[i] != guard_byte(i)) {
            snprintf(why, cap, "region %llu: guard byte %zu before the region was overwritten",
                     (unsigned long long)r->id, r->pre - i);
            return -1;
        }
    for (size_t i = r->pre + r->len; i < r->total; i++)
        if (img[i] != guard_byte(i)) {
            snprintf(why, cap, "region %llu: guard byte %zu after the region was overwritten",
                     (unsigned long long)r->id, i - r->pre - r->len);
            return -1;
        }
    if (memcmp(img + r->pre, r->shadow, r->len) != 0) {
        size_t i = 0;
        while (img[r->pre + i] == r->shadow[i])
            i++;
        size_t j = i;
        while (j < r->len && img[r->pre + j] != r->shadow[j])
            j++;
        snprintf(why, cap, "region %llu: byte %zu is 0x%02x, expected 0x%02x (%zu bytes differ)",
                 (unsigned long long)r->id, i, img[r->pre + i], r->shadow[i], j - i);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- receive side */

typedef struct note {
    kvw_tl_ep_h ep;
    size_t len;
    uint8_t *data;
    uint8_t *snap; /* images of every region at on_notify time, or NULL */
} note_t;

typedef struct ep_err {
    kvw_tl_ep_h ep;
    kvw_status_t status;
    char reason[512];
} ep_err_t;

typedef struct wcheck {
    uint64_t room, region, off, len;
    kvw_tl_ep_h ep; /* the accepted endpoint the write came on */
} wcheck_t;

typedef struct rx_state {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    note_t *notes;
    size_t num_notes, cap_notes;
    ep_err_t errs[64];
    size_t num_errs;
    wcheck_t checks[256];
    size_t num_checks;
    bool refuse_on;
    uint64_t refuse_room;
    const region_t *snap_regs; /* snapshot these in on_notify when set */
    size_t snap_n;
} rx_state_t;

static void rx_init(rx_state_t *s)
{
    memset(s, 0, sizeof(*s));
    pthread_mutex_init(&s->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->cv, &ca);
    pthread_condattr_destroy(&ca);
}

static void rx_clear_notes(rx_state_t *s)
{
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < s->num_notes; i++) {
        free(s->notes[i].data);
        free(s->notes[i].snap);
    }
    s->num_notes = 0;
    pthread_mutex_unlock(&s->mu);
}

static void rx_fini(rx_state_t *s)
{
    rx_clear_notes(s);
    free(s->notes);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
}

static void cb_notify(void *arg, kvw_tl_ep_h ep, const void *msg, size_t len)
{
    rx_state_t *s = arg;
    pthread_mutex_lock(&s->mu);
    uint8_t *snap = NULL;
    if (s->snap_regs) {
        size_t total = 0;
        for (size_t i = 0; i < s->snap_n; i++)
            total += s->snap_regs[i].total;
        snap = malloc(total);
        if (snap) {
            size_t off = 0;
            for (size_t i = 0; i < s->snap_n; i++) {
                memcpy(snap + off, s->snap_regs[i].base, s->snap_regs[i].total);
                off += s->snap_regs[i].total;
            }
        }
    }
    if (s->num_notes == s->cap_notes) {
        size_t nc = s->cap_notes ? 2 * s->cap_notes : 64;
        note_t *nn = realloc(s->notes, nc * sizeof(*nn));
        if (nn == NULL) {
            free(snap);
            pthread_mutex_unlock(&s->mu);
            return;
        }
        s->notes = nn;
        s->cap_notes = nc;
    }
    note_t *n = &s->notes[s->num_notes];
    n->ep = ep;
    n->len = len;
    n->data = malloc(len ? len : 1);
    if (n->data && len)
        memcpy(n->data, msg, len);
    n->snap = snap;
    s->num_notes++;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void cb_ep_error(void *arg, kvw_tl_ep_h ep, kvw_status_t status, const char *reason)
{
    rx_state_t *s = arg;
    pthread_mutex_lock(&s->mu);
    if (s->num_errs < KVW_ARRAY_SIZE(s->errs)) {
        ep_err_t *e = &s->errs[s->num_errs++];
        e->ep = ep;
        e->status = status;
        snprintf(e->reason, sizeof(e->reason), "%s", reason ? reason : "(null)");
    }
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static kvw_status_t cb_check_write(void *arg, kvw_tl_ep_h ep, uint64_t room, uint64_t region,
                                   uint64_t off, uint64_t len)
{
    rx_state_t *s = arg;
    pthread_mutex_lock(&s->mu);
    if (s->num_checks < KVW_ARRAY_SIZE(s->checks))
        s->checks[s->num_checks] = (wcheck_t){room, region, off, len, ep};
    s->num_checks++;
    bool refuse = s->refuse_on && room == s->refuse_room;
    pthread_mutex_unlock(&s->mu);
    return refuse ? KVW_ERR_REJECTED : KVW_OK;
}

/* Waits until at least `n` notifications (or errors) were recorded. */
static bool wait_count(rx_state_t *s, const size_t *counter, size_t n, unsigned timeout_ms)
{
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    dl.tv_sec += timeout_ms / 1000;
    dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&s->mu);
    while (*counter < n) {
        if (pthread_cond_timedwait(&s->cv, &s->mu, &dl) == ETIMEDOUT)
            break;
    }
    bool ok = *counter >= n;
    pthread_mutex_unlock(&s->mu);
    return ok;
}

static bool wait_notes(rx_state_t *s, size_t n, unsigned timeout_ms)
{
    return wait_count(s, &s->num_notes, n, timeout_ms);
}
static bool wait_errs(rx_state_t *s, size_t n, unsigned timeout_ms)
{
    return wait_count(s, &s->num_errs, n, timeout_ms);
}

static size_t count_of(rx_state_t *s, const size_t *counter)
{
    pthread_mutex_lock(&s->mu);
    size_t n = *counter;
    pthread_mutex_unlock(&s->mu);
    return n;
}

typedef struct receiver {
    kvw_tl_h tl;
    rx_state_t st;
    region_t regs[NREG];
    uint8_t addr[KVW_TL_MAX_ADDR];
    size_t addr_len;
    uint64_t seed;
} receiver_t;

static kvw_tl_params_t make_params(rx_state_t *s, uint32_t timeout_ms)
{
    kvw_tl_params_t p = {.listen_host = NULL, .listen_port = 0, .timeout_ms = timeout_ms};
    p.cb.arg = s;
    p.cb.on_notify = cb_notify;
    p.cb.on_ep_error = cb_ep_error;
    p.cb.check_write = cb_check_write;
    return p;
}

/* Regions: 0 shared and page-aligned, 1 malloc'd, 2 shared and misaligned (its guards
 * share pages with it). */
static int receiver_open(receiver_t *r, uint64_t seed, uint32_t timeout_ms)
{
    int rc = 0;
    memset(r, 0, sizeof(*r));
    rx_init(&r->st);
    r->seed = seed;
    kvw_tl_params_t p = make_params(&r->st, timeout_ms);
    CHECK_OK(T->init(&p, &r->tl));
    r->addr_len = sizeof(r->addr);
    CHECK_OK(T->address(r->tl, r->addr, &r->addr_len));
    for (int i = 0; i < NREG; i++) {
        CHECK(region_alloc(&r->regs[i], 100 + (uint64_t)i, region_lens[i], i != 1,
                           i == 2 ? 123 : 0, seed) == 0,
              "region allocation");
        r->regs[i].rkey_len = sizeof(r->regs[i].rkey);
        CHECK_OK(T->mem_reg(r->tl, r->regs[i].data, r->regs[i].len, KVW_MEM_HOST, r->regs[i].id,
                            &r->regs[i].mem, r->regs[i].rkey, &r->regs[i].rkey_len));
        CHECK(r->regs[i].rkey_len > 0 && r->regs[i].rkey_len <= KVW_TL_MAX_RKEY, "rkey len %zu",
              r->regs[i].rkey_len);
    }
out:
    return rc;
}

static void receiver_close(receiver_t *r)
{
    if (r->tl) {
        T->close(r->tl);
        T->stop(r->tl);
        for (int i = 0; i < NREG; i++)
            if (r->regs[i].mem)
                T->mem_dereg(r->tl, r->regs[i].mem);
        T->fini(r->tl);
        r->tl = NULL;
    }
    for (int i = 0; i < NREG; i++)
        if (r->regs[i].base)
            region_free(&r->regs[i]);
    rx_fini(&r->st);
}

/* ---------------------------------------------------------------- rounds */

typedef struct wput {
    unsigned reg;
    uint64_t off, len, dseed;
} wput_t;

#define MAX_ROUND_PUTS 48
#define NOTE_MAGIC 0x45544f4eu

/* The writes of one round, derived from (seed, round) only, so both processes agree.
 * `mask` selects the regions this round may write. */
static size_t gen_round(uint64_t seed, unsigned round, unsigned mask, wput_t *out)
{
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + round * 0x632be59bd9b4e019ull + 1;
    unsigned regs[NREG], nr = 0;
    for (unsigned i = 0; i < NREG; i++)
        if (mask & (1u << i))
            regs[nr++] = i;
    size_t n = 1 + rnd(&s) % MAX_ROUND_PUTS;
    for (size_t i = 0; i < n; i++) {
        unsigned reg = regs[rnd(&s) % nr];
        uint64_t L = region_lens[reg], len;
        unsigned k = (unsigned)(rnd(&s) % 100);
        if (k < 6)
            len = 0;
        else if (k < 60)
            len = 1 + rnd(&s) % 4096;
        else if (k < 88)
            len = 1 + rnd(&s) % 65536;
        else
            len = 1 + rnd(&s) % (1u << 20);
        len = KVW_MIN(len, L);
        uint64_t off;
        unsigned edge = (unsigned)(rnd(&s) % 10);
        if (edge == 0)
            off = 0;
        else if (edge == 1)
            off = L - len; /* flush with the end (off == L when len == 0) */
        else
            off = rnd(&s) % (L - len + 1);
        out[i] = (wput_t){reg, off, len, rnd(&s)};
    }
    return n;
}

static size_t note_len_of(unsigned round)
{
    static const size_t lens[] = {16, 17, 100, 1000, KVW_TL_MAX_NOTIFY, 64};
    return lens[round % KVW_ARRAY_SIZE(lens)];
}

static void make_note(uint8_t *buf, uint64_t seed, unsigned round, size_t len)
{
    fill_bytes(buf, len, seed + round);
    uint32_t m = NOTE_MAGIC;
    memcpy(buf, &m, 4);
    memcpy(buf + 4, &round, 4);
    memcpy(buf + 8, &seed, 8);
}

/* Sender side of one round: the writes in random batches, then one notification. */
static int send_round(kvw_tl_ep_h ep, kvw_tl_rkey_h *rkeys, uint64_t seed, unsigned round,
                      unsigned mask, uint64_t room)
{
    int rc = 0;
    wput_t w[MAX_ROUND_PUTS];
    kvw_tl_put_t puts[MAX_ROUND_PUTS];
    size_t n = gen_round(seed, round, mask, w);
    size_t total = 0;
    for (size_t i = 0; i < n; i++)
        total += (size_t)w[i].len;
    uint8_t *arena = malloc(total ? total : 1);
    uint8_t note[KVW_TL_MAX_NOTIFY];
    CHECK(arena, "no memory");
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        fill_bytes(arena + off, (size_t)w[i].len, w[i].dseed);
        puts[i] = (kvw_tl_put_t){.src = w[i].len ? arena + off : NULL,
                                 .rkey = rkeys[w[i].reg],
                                 .dst_off = w[i].off,
                                 .len = w[i].len};
        off += (size_t)w[i].len;
    }
    uint64_t bs = seed ^ (round * 31ull);
    size_t nl = note_len_of(round);
    make_note(note, seed, round, nl);
    /* Odd rounds hand the last batch and the notification over in one call where the
     * transport has one (put_notify): the notification must still follow every write. */
    bool joint = T->put_notify != NULL && (round & 1u);
    for (size_t i = 0; i < n;) {
        size_t b = 1 + rnd(&bs) % (n - i);
        if (joint && i + b == n)
            CHECK_OK(T->put_notify(ep, room, puts + i, b, note, nl));
        else
            CHECK_OK(T->put(ep, room, puts + i, b));
        i += b;
    }
    if (joint && n == 0)
        CHECK_OK(T->put_notify(ep, room, NULL, 0, note, nl));
    else if (!joint)
        CHECK_OK(T->notify(ep, note, nl));
out:
    free(arena);
    return rc;
}

/* Receiver side: applies a round to the shadows. */
static void apply_round(receiver_t *r, uint64_t seed, unsigned round, unsigned mask)
{
    wput_t w[MAX_ROUND_PUTS];
    size_t n = gen_round(seed, round, mask, w);
    for (size_t i = 0; i < n; i++)
        fill_bytes(r->regs[w[i].reg].shadow + w[i].off, (size_t)w[i].len, w[i].dseed);
}

/* Checks notification `idx` is round `round` of `seed` and that its snapshot (taken in
 * on_notify) matches the shadows of the regions in `mask`. */
static int verify_note(receiver_t *r, size_t idx, uint64_t seed, unsigned round, unsigned mask)
{
    int rc = 0;
    char why[256];
    uint8_t expect[KVW_TL_MAX_NOTIFY];
    pthread_mutex_lock(&r->st.mu);
    note_t n = r->st.notes[idx];
    pthread_mutex_unlock(&r->st.mu);
    size_t nl = note_len_of(round);
    make_note(expect, seed, round, nl);
    CHECK(n.len == nl && memcmp(n.data, expect, nl) == 0,
          "notification %zu: %zu bytes, expected round %u with %zu bytes", idx, n.len, round, nl);
    CHECK(n.snap != NULL, "no snapshot taken");
    size_t off = 0;
    for (int i = 0; i < NREG; i++) {
        if (mask & (1u << i))
            CHECK(check_image(&r->regs[i], n.snap + off, why, sizeof(why)) == 0,
                  "round %u, at notification time: %s", round, why);
        off += r->regs[i].total;
    }
out:
    return rc;
}

/* Checks the live regions (not a snapshot) against the shadows. */
static int verify_live(receiver_t *r)
{
    int rc = 0;
    char why[256];
    for (int i = 0; i < NREG; i++)
        CHECK(check_image(&r->regs[i], r->regs[i].base, why, sizeof(why)) == 0, "%s", why);
out:
    return rc;
}

/* ---------------------------------------------------------------- sender side */

typedef struct sender {
    kvw_tl_h tl;
    rx_state_t st; /* the sender's own callbacks (on_ep_error for connected eps) */
    kvw_tl_ep_h ep;
    kvw_tl_rkey_h rkeys[NREG];
} sender_t;

/* Everything a sender needs from a receiver, as one flat message. */
typedef struct setup {
    uint8_t addr[KVW_TL_MAX_ADDR];
    uint32_t addr_len;
    uint8_t rkey[NREG][KVW_TL_MAX_RKEY];
    uint32_t rkey_len[NREG];
    uint64_t seed;
} setup_t;

static void setup_from(const receiver_t *r, setup_t *s)
{
    memset(s, 0, sizeof(*s));
    memcpy(s->addr, r->addr, r->addr_len);
    s->addr_len = (uint32_t)r->addr_len;
    for (int i = 0; i < NREG; i++) {
        memcpy(s->rkey[i], r->regs[i].rkey, r->regs[i].rkey_len);
        s->rkey_len[i] = (uint32_t)r->regs[i].rkey_len;
    }
    s->seed = r->seed;
}

static int sender_open(sender_t *snd, const setup_t *su, uint32_t timeout_ms)
{
    int rc = 0;
    memset(snd, 0, sizeof(*snd));
    rx_init(&snd->st);
    kvw_tl_params_t p = make_params(&snd->st, timeout_ms);
    CHECK_OK(T->init(&p, &snd->tl));
    CHECK_OK(T->connect(snd->tl, su->addr, su->addr_len, &snd->ep));
    for (int i = 0; i < NREG; i++)
        CHECK_OK(T->rkey_unpack(snd->ep, su->rkey[i], su->rkey_len[i], &snd->rkeys[i]));
out:
    return rc;
}

static void sender_close(sender_t *snd)
{
    for (int i = 0; i < NREG; i++)
        if (snd->rkeys[i])
            T->rkey_release(snd->rkeys[i]);
    if (snd->ep)
        T->ep_close(snd->ep);
    if (snd->tl) {
        T->close(snd->tl);
        T->stop(snd->tl);
        T->fini(snd->tl);
    }
    rx_fini(&snd->st);
    memset(snd, 0, sizeof(*snd));
}

/* ---------------------------------------------------------------- processes */

/* Control messages between the parent and its children (SOCK_SEQPACKET pairs). */
typedef struct ctl_msg {
    uint32_t type;
    int32_t status;
    uint64_t value;
    setup_t setup;
} ctl_msg_t;

enum { CTL_SETUP = 1, CTL_ACK, CTL_READY, CTL_STARTED, CTL_KILLED, CTL_EPERR, CTL_DONE, CTL_GO };

static int ctl_send(int fd, uint32_t type, int32_t status, uint64_t value, const setup_t *su)
{
    ctl_msg_t m;
    memset(&m, 0, sizeof(m));
    m.type = type;
    m.status = status;
    m.value = value;
    if (su)
        m.setup = *su;
    return send(fd, &m, sizeof(m), MSG_NOSIGNAL) == (ssize_t)sizeof(m) ? 0 : -1;
}

/* Receives one message of the given type within timeout_ms; -1 otherwise. */
static int ctl_recv(int fd, uint32_t type, ctl_msg_t *m, unsigned timeout_ms)
{
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    uint64_t deadline = now_ms() + timeout_ms;
    for (;;) {
        uint64_t now = now_ms();
        if (now >= deadline)
            return -1;
        int r = poll(&pfd, 1, (int)(deadline - now));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        ssize_t n = recv(fd, m, sizeof(*m), 0);
        if (n != (ssize_t)sizeof(*m))
            return -1;
        return m->type == type ? 0 : -1;
    }
}

typedef int (*child_fn)(int ctl, void *arg);

static pid_t spawn(child_fn fn, int ctl, int other_end, void *arg)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        if (other_end >= 0)
            close(other_end);
        alarm(90); /* nothing in a child may outlive this */
        int rc = fn(ctl, arg);
        fflush(NULL);
        _exit(rc);
    }
    return pid;
}

/* Waits for a child; kills it after timeout_ms. Returns its exit code, or -1 when it
 * was killed by a signal or timed out. */
static int reap_child(pid_t pid, unsigned timeout_ms, const char *who)
{
    uint64_t deadline = now_ms() + timeout_ms;
    int status;
    for (;;) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid)
            break;
        if (r < 0 && errno != EINTR)
            return -1;
        if (now_ms() >= deadline) {
            fprintf(stderr, "  %s (pid %d) did not finish within %u ms: killing it\n", who,
                    (int)pid, timeout_ms);
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            return -1;
        }
        sleep_ms(5);
    }
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    fprintf(stderr, "  %s (pid %d) died from signal %d\n", who, (int)pid, WTERMSIG(status));
    return -1;
}

/* ---- xproc_integrity */

#define XROUNDS 12

static int child_receiver_rounds(int ctl, void *arg)
{
    (void)arg;
    int rc = 0;
    receiver_t r;
    if (receiver_open(&r, 0x5eed0001, 0) != 0)
        return 1;
    r.st.snap_regs = r.regs;
    r.st.snap_n = NREG;
    setup_t su;
    setup_from(&r, &su);
    CHECK(ctl_send(ctl, CTL_SETUP, 0, 0, &su) == 0, "ctl send");
    for (unsigned k = 0; k < XROUNDS; k++) {
        CHECK(wait_notes(&r.st, k + 1, kvt_tmo_ms(20000)),
              "notification of round %u did not arrive", k);
        apply_round(&r, su.seed, k, 7);
        if (verify_note(&r, k, su.seed, k, 7) != 0)
            FAILF("round %u", k);
        /* Checked before the ack: after the last one the sender may close. */
        CHECK(count_of(&r.st, &r.st.num_errs) == 0, "unexpected on_ep_error: %s",
              r.st.errs[0].reason);
        CHECK(ctl_send(ctl, CTL_ACK, 0, k, NULL) == 0, "ctl send");
    }
    ctl_msg_t m;
    CHECK(ctl_recv(ctl, CTL_DONE, &m, kvt_tmo_ms(20000)) == 0, "sender did not finish");
out:
    receiver_close(&r);
    return rc;
}

static int child_sender_rounds(int ctl, void *arg)
{
    (void)arg;
    int rc = 0;
    sender_t s;
    ctl_msg_t m;
    if (ctl_recv(ctl, CTL_SETUP, &m, kvt_tmo_ms(20000)) != 0) {
        fprintf(stderr, "FAIL [%s/%s]: no setup from the receiver\n", T->name, g_case);
        return 1;
    }
    if (sender_open(&s, &m.setup, 0) != 0)
        FAILF("sender_open");
    for (unsigned k = 0; k < XROUNDS; k++) {
        if (send_round(s.ep, s.rkeys, m.setup.seed, k, 7, 1000 + k) != 0)
            FAILF("round %u", k);
        ctl_msg_t a;
        CHECK(ctl_recv(ctl, CTL_ACK, &a, kvt_tmo_ms(20000)) == 0 && a.value == k,
              "no ack for round %u", k);
    }
    CHECK(ctl_send(ctl, CTL_DONE, 0, 0, NULL) == 0, "ctl send");
out:
    sender_close(&s);
    return rc;
}

static int xproc_integrity(void)
{
    int rc = 0, sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) == 0, "socketpair: %s", strerror(errno));
    pid_t rp = spawn(child_receiver_rounds, sv[0], sv[1], NULL);
    pid_t sp = spawn(child_sender_rounds, sv[1], sv[0], NULL);
    close(sv[0]);
    close(sv[1]);
    int rrc = reap_child(rp, kvt_tmo_ms(60000), "receiver");
    int src = reap_child(sp, kvt_tmo_ms(60000), "sender");
    CHECK(rrc == 0 && src == 0, "receiver exited %d, sender exited %d", rrc, src);
out:
    return rc;
}

/* ---- xproc_peer_killed */

static setup_t g_setup; /* what the parent learned from the receiver child */

/* Sender 1: announces itself, then streams puts until it is killed. */
static int child_sender_stream(int ctl, void *arg)
{
    (void)ctl;
    (void)arg;
    int rc = 0;
    sender_t s;
    uint8_t *buf = NULL;
    if (sender_open(&s, &g_setup, 0) != 0)
        FAILF("sender_open");
    CHECK_OK(T->notify(s.ep, "started", 7));
    buf = malloc(1u << 20);
    CHECK(buf, "no memory");
    memset(buf, 0x5a, 1u << 20);
    uint64_t end = now_ms() + kvt_tmo_ms(60000);
    for (uint64_t i = 0; now_ms() < end; i++) {
        kvw_tl_put_t p = {.src = buf,
                          .rkey = s.rkeys[i % NREG],
                          .dst_off = 0,
                          .len = KVW_MIN(region_lens[i % NREG], (uint64_t)(1u << 20))};
        kvw_status_t st = T->put(s.ep, 1, &p, 1);
        if (st != KVW_OK)
            break;
    }
out:
    free(buf);
    sender_close(&s);
    return rc ? rc : 1; /* it was supposed to be killed */
}

/* Sender 2: one verified round after the first sender died. */
static int child_sender_one_round(int ctl, void *arg)
{
    (void)arg;
    int rc = 0;
    sender_t s;
    if (sender_open(&s, &g_setup, 0) != 0)
        FAILF("sender_open");
    if (send_round(s.ep, s.rkeys, g_setup.seed + 1, 0, 7, 77) != 0)
        FAILF("round");
    ctl_msg_t m;
    CHECK(ctl_recv(ctl, CTL_ACK, &m, kvt_tmo_ms(20000)) == 0, "no ack from the receiver");
out:
    sender_close(&s);
    return rc;
}

static int child_receiver_killed_peer(int ctl, void *arg)
{
    (void)arg;
    int rc = 0;
    receiver_t r;
    ctl_msg_t m;
    if (receiver_open(&r, 0x5eed0002, 0) != 0)
        return 1;
    setup_t su;
    setup_from(&r, &su);
    CHECK(ctl_send(ctl, CTL_SETUP, 0, 0, &su) == 0, "ctl send");
    CHECK(wait_notes(&r.st, 1, kvt_tmo_ms(20000)), "the streaming sender never announced itself");
    pthread_mutex_lock(&r.st.mu);
    kvw_tl_ep_h victim = r.st.notes[0].ep;
    pthread_mutex_unlock(&r.st.mu);
    CHECK(ctl_send(ctl, CTL_STARTED, 0, 0, NULL) == 0, "ctl send");
    CHECK(ctl_recv(ctl, CTL_KILLED, &m, kvt_tmo_ms(20000)) == 0, "parent did not kill the sender");
    CHECK(wait_errs(&r.st, 1, kvt_tmo_ms(10000)),
          "no on_ep_error within 10 s after SIGKILL of the sender");
    pthread_mutex_lock(&r.st.mu);
    ep_err_t e = r.st.errs[0];
    pthread_mutex_unlock(&r.st.mu);
    CHECK(e.ep == victim, "on_ep_error for another endpoint");
    CHECK(e.status == KVW_ERR_CONN_CLOSED || e.status == KVW_ERR_MALFORMED,
          "status %s (%s)", kvw_status_string(e.status), e.reason);
    CHECK(strlen(e.reason) > 10, "reason '%s'", e.reason);
    fprintf(stderr, "  [%s] on_ep_error after SIGKILL: %s: %s\n", T->name,
            kvw_status_string(e.status), e.reason);
    /* The dead sender scribbled over the regions; start from a known state. */
    for (int i = 0; i < NREG; i++)
        region_reset(&r.regs[i], r.seed + 99);
    rx_clear_notes(&r.st);
    pthread_mutex_lock(&r.st.mu);
    r.st.snap_regs = r.regs;
    r.st.snap_n = NREG;
    pthread_mutex_unlock(&r.st.mu);
    CHECK(ctl_send(ctl, CTL_EPERR, e.status, 0, NULL) == 0, "ctl send");
    CHECK(wait_notes(&r.st, 1, kvt_tmo_ms(20000)), "the second sender's round did not arrive");
    apply_round(&r, su.seed + 1, 0, 7);
    if (verify_note(&r, 0, su.seed + 1, 0, 7) != 0)
        FAILF("second sender");
    CHECK(ctl_send(ctl, CTL_ACK, 0, 0, NULL) == 0, "ctl send");
    CHECK(ctl_recv(ctl, CTL_DONE, &m, kvt_tmo_ms(20000)) == 0, "parent did not finish");
out:
    receiver_close(&r);
    return rc;
}

static int xproc_peer_killed(void)
{
    int rc = 0, rv[2] = {-1, -1}, sv[2] = {-1, -1};
    pid_t rp = -1, s1 = -1, s2 = -1;
    ctl_msg_t m;
    CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, rv) == 0, "socketpair");
    rp = spawn(child_receiver_killed_peer, rv[1], rv[0], NULL);
    close(rv[1]);
    rv[1] = -1;
    CHECK(ctl_recv(rv[0], CTL_SETUP, &m, kvt_tmo_ms(20000)) == 0, "no setup from the receiver");
    g_setup = m.setup;
    s1 = spawn(child_sender_stream, -1, rv[0], NULL);
    CHECK(ctl_recv(rv[0], CTL_STARTED, &m, kvt_tmo_ms(20000)) == 0,
          "the receiver never saw sender 1");
    sleep_ms(100); /* let the stream run */
    kill(s1, SIGKILL);
    reap_child(s1, kvt_tmo_ms(5000), "sender 1");
    s1 = -1;
    CHECK(ctl_send(rv[0], CTL_KILLED, 0, 0, NULL) == 0, "ctl send");
    CHECK(ctl_recv(rv[0], CTL_EPERR, &m, kvt_tmo_ms(20000)) == 0,
          "the receiver did not report the error");
    CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) == 0, "socketpair");
    s2 = spawn(child_sender_one_round, sv[1], sv[0], NULL);
    close(sv[1]);
    sv[1] = -1;
    /* Relay the receiver's ack to sender 2. */
    CHECK(ctl_recv(rv[0], CTL_ACK, &m, kvt_tmo_ms(30000)) == 0,
          "the receiver did not verify sender 2");
    CHECK(ctl_send(sv[0], CTL_ACK, 0, 0, NULL) == 0, "ctl send");
    int c2 = reap_child(s2, kvt_tmo_ms(30000), "sender 2");
    s2 = -1;
    CHECK(c2 == 0, "sender 2 exited %d", c2);
    CHECK(ctl_send(rv[0], CTL_DONE, 0, 0, NULL) == 0, "ctl send");
    int cr = reap_child(rp, kvt_tmo_ms(30000), "receiver");
    rp = -1;
    CHECK(cr == 0, "receiver exited %d", cr);
out:
    if (s1 > 0) {
        kill(s1, SIGKILL);
        reap_child(s1, kvt_tmo_ms(5000), "sender 1");
    }
    if (s2 > 0)
        reap_child(s2, kvt_tmo_ms(5000), "sender 2");
    if (rp > 0)
        reap_child(rp, kvt_tmo_ms(10000), "receiver");
    for (int i = 0; i < 2; i++) {
        if (rv[i] >= 0)
            close(rv[i]);
        if (sv[i] >= 0)
            close(sv[i]);
    }
    return rc;
}

/* ---- xproc_recv_gone and xproc_recv_stall */

static int child_receiver_idle(int ctl, void *arg)
{
    (void)arg;
    int rc = 0;
    receiver_t r;
    ctl_msg_t m;
    if (receiver_open(&r, 0x5eed0003, 0) != 0)
        return 1;
    setup_t su;
    setup_from(&r, &su);
    CHECK(ctl_send(ctl, CTL_SETUP, 0, 0, &su) == 0, "ctl send");
    /* Serve until the parent says DONE (or kills us, which is the point). */
    CHECK(ctl_recv(ctl, CTL_DONE, &m, kvt_tmo_ms(80000)) == 0, "parent went away");
out:
    receiver_close(&r);
    return rc;
}

typedef struct gone_arg {
    uint32_t timeout_ms;
    kvw_status_t want; /* the status the failing call must return (OK: any error) */
} gone_arg_t;

/* Connects, proves the path works, says READY, waits for GO, then sends until a call
 * fails; the call must fail (not hang) with the expected status. */
static int child_sender_until_error(int ctl, void *arg)
{
    const gone_arg_t *ga = arg;
    int rc = 0;
    sender_t s;
    ctl_msg_t m;
    uint8_t *buf = malloc(1u << 20);
    CHECK(buf, "no memory");
    memset(buf, 0x3c, 1u << 20);
    if (sender_open(&s, &g_setup, ga->timeout_ms) != 0)
        FAILF("sender_open");
    kvw_tl_put_t p = {.src = buf, .rkey = s.rkeys[0], .dst_off = 0, .len = 1u << 20};
    CHECK_OK(T->put(s.ep, 1, &p, 1));
    CHECK_OK(T->notify(s.ep, "ok", 2));
    CHECK(ctl_send(ctl, CTL_READY, 0, 0, NULL) == 0, "ctl send");
    CHECK(ctl_recv(ctl, CTL_GO, &m, kvt_tmo_ms(20000)) == 0, "no GO");
    kvw_status_t st = KVW_OK;
    uint64_t t0 = now_ms(), slowest = 0;
    while (st == KVW_OK && now_ms() - t0 < kvt_tmo_ms(30000)) {
        uint64_t c0 = now_ms();
        st = T->put(s.ep, 1, &p, 1);
        if (st == KVW_OK)
            st = T->notify(s.ep, "x", 1);
        slowest = KVW_MAX(slowest, now_ms() - c0);
    }
    CHECK(st != KVW_OK, "puts kept succeeding for 30 s");
    fprintf(stderr, "  [%s] sender's call failed after %llu ms (slowest call %llu ms): %s: %s\n",
            T->name, (unsigned long long)(now_ms() - t0), (unsigned long long)slowest,
            kvw_status_string(st), kvw_last_error());
    if (ga->want != KVW_OK)
        CHECK(st == ga->want, "got %s, want %s", kvw_status_string(st),
              kvw_status_string(ga->want));
    else
        CHECK(st == KVW_ERR_CONN_CLOSED || st == KVW_ERR_IO, "got %s", kvw_status_string(st));
    CHECK(slowest < (uint64_t)ga->timeout_ms + kvt_tmo_ms(3000), "a call blocked for %llu ms",
          (unsigned long long)slowest);
    /* Once failed, the endpoint stays failed. */
    CHECK(T->put(s.ep, 1, &p, 1) != KVW_OK, "put succeeded after a failure");
out:
    free(buf);
    sender_close(&s);
    return rc;
}

static int xproc_receiver_trouble(bool stall)
{
    int rc = 0, rv[2] = {-1, -1}, sv[2] = {-1, -1};
    pid_t rp = -1, sp = -1;
    ctl_msg_t m;
    gone_arg_t ga = {.timeout_ms = kvt_tmo_ms(stall ? 700 : 3000),
                     .want = stall ? KVW_ERR_TIMEOUT : KVW_OK};
    CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, rv) == 0, "socketpair");
    CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) == 0, "socketpair");
    rp = spawn(child_receiver_idle, rv[1], rv[0], NULL);
    close(rv[1]);
    rv[1] = -1;
    CHECK(ctl_recv(rv[0], CTL_SETUP, &m, kvt_tmo_ms(20000)) == 0, "no setup from the receiver");
    g_setup = m.setup;
    sp = spawn(child_sender_until_error, sv[1], sv[0], &ga);
    close(sv[1]);
    sv[1] = -1;
    CHECK(ctl_recv(sv[0], CTL_READY, &m, kvt_tmo_ms(20000)) == 0, "the sender did not get ready");
    if (stall) {
        kill(rp, SIGSTOP);
    } else {
        kill(rp, SIGKILL);
        reap_child(rp, kvt_tmo_ms(5000), "receiver");
        rp = -1;
    }
    CHECK(ctl_send(sv[0], CTL_GO, 0, 0, NULL) == 0, "ctl send");
    int cs = reap_child(sp, kvt_tmo_ms(45000), "sender");
    sp = -1;
    CHECK(cs == 0, "sender exited %d", cs);
out:
    if (sp > 0)
        reap_child(sp, kvt_tmo_ms(5000), "sender");
    if (rp > 0) {
        kill(rp, SIGKILL);
        reap_child(rp, kvt_tmo_ms(5000), "receiver");
    }
    for (int i = 0; i < 2; i++) {
        if (rv[i] >= 0)
            close(rv[i]);
        if (sv[i] >= 0)
            close(sv[i]);
    }
    return rc;
}

static int xproc_recv_gone(void)
{
    return xproc_receiver_trouble(false);
}
static int xproc_recv_stall(void)
{
    return xproc_receiver_trouble(true);
}

/* ---------------------------------------------------------------- in-process cases */

static int inproc_integrity(void)
{
    int rc = 0;
    receiver_t r;
    sender_t s;
    setup_t su;
    memset(&s, 0, sizeof(s));
    if (receiver_open(&r, 0x5eed0010, 0) != 0)
        FAILF("receiver_open");
    r.st.snap_regs = r.regs;
    r.st.snap_n = NREG;
    setup_from(&r, &su);
    if (sender_open(&s, &su, 0) != 0)
        FAILF("sender_open");
    for (unsigned k = 0; k < 40; k++) {
        if (send_round(s.ep, s.rkeys, su.seed, k, 7, k) != 0)
            FAILF("round %u", k);
        CHECK(wait_notes(&r.st, k + 1, kvt_tmo_ms(20000)), "round %u: no notification", k);
        apply_round(&r, su.seed, k, 7);
        if (verify_note(&r, k, su.seed, k, 7) != 0)
            FAILF("round %u", k);
    }
    if (verify_live(&r) != 0)
        FAILF("final state");
    CHECK(count_of(&r.st, &r.st.num_errs) == 0, "unexpected on_ep_error: %s",
          r.st.errs[0].reason);
    CHECK(count_of(&s.st, &s.st.num_errs) == 0, "unexpected sender on_ep_error: %s",
          s.st.errs[0].reason);
out:
    sender_close(&s);
    receiver_close(&r);
    return rc;
}

/* Two endpoints (from two sender instances) into one receiver, on disjoint regions;
 * each endpoint's notifications follow its own writes. */
static int inproc_multi_ep(void)
{
    int rc = 0;
    receiver_t r;
    sender_t a, b;
    setup_t su;
    memset(&a, 0, sizeof(a));
    memset(&b, 0, sizeof(b));
    if (receiver_open(&r, 0x5eed0011, 0) != 0)
        FAILF("receiver_open");
    r.st.snap_regs = r.regs;
    r.st.snap_n = NREG;
    setup_from(&r, &su);
    if (sender_open(&a, &su, 0) != 0 || sender_open(&b, &su, 0) != 0)
        FAILF("sender_open");
    const unsigned ma = 1 | 4, mb = 2;
    for (unsigned k = 0; k < 12; k++) {
        if (send_round(a.ep, a.rkeys, su.seed, k, ma, 1) != 0 ||
            send_round(b.ep, b.rkeys, su.seed + 7, k, mb, 2) != 0)
            FAILF("round %u", k);
        CHECK(wait_notes(&r.st, 2 * (k + 1), kvt_tmo_ms(20000)), "round %u: notifications missing",
              k);
        apply_round(&r, su.seed, k, ma);
        apply_round(&r, su.seed + 7, k, mb);
        for (size_t i = 2 * k; i < 2 * k + 2; i++) {
            pthread_mutex_lock(&r.st.mu);
            const uint8_t *d = r.st.notes[i].data;
            size_t len = r.st.notes[i].len;
            pthread_mutex_unlock(&r.st.mu);
            uint64_t seed;
            CHECK(len >= 16, "short notification");
            memcpy(&seed, d + 8, 8);
            bool from_a = seed == su.seed;
            if (verify_note(&r, i, from_a ? su.seed : su.seed + 7, k, from_a ? ma : mb) != 0)
                FAILF("round %u, endpoint %c", k, from_a ? 'a' : 'b');
        }
    }
    pthread_mutex_lock(&r.st.mu);
    kvw_tl_ep_h e0 = r.st.notes[0].ep, e1 = r.st.notes[1].ep;
    pthread_mutex_unlock(&r.st.mu);
    CHECK(e0 != e1, "two connections reported as one endpoint");
out:
    sender_close(&a);
    sender_close(&b);
    receiver_close(&r);
    return rc;
}

/* Several threads put on one endpoint at once (each into its own slice); a notify
 * after they all returned must see every byte. */
#define NTHREADS 4

typedef struct thr_arg {
    kvw_tl_ep_h ep;
    kvw_tl_rkey_h rkey;
    uint64_t base, span;
    unsigned idx;
    kvw_status_t st;
    char err[256];
} thr_arg_t;

static void *put_thread(void *p)
{
    thr_arg_t *a = p;
    uint8_t buf[3000];
    uint64_t s = 1000 + a->idx;
    a->st = KVW_OK;
    for (uint64_t off = 0; off < a->span && a->st == KVW_OK;) {
        uint64_t want = 1 + rnd(&s) % sizeof(buf); /* KVW_MIN evaluates twice */
        uint64_t len = KVW_MIN(want, a->span - off);
        fill_bytes(buf, (size_t)len, (a->base + off) * 7 + 1);
        kvw_tl_put_t put = {.src = buf, .rkey = a->rkey, .dst_off = a->base + off, .len = len};
        a->st = T->put(a->ep, a->idx, &put, 1);
        if (a->st != KVW_OK)
            snprintf(a->err, sizeof(a->err), "%s", kvw_last_error());
        off += len;
    }
    return NULL;
}

static int inproc_threads(void)
{
    int rc = 0;
    receiver_t r;
    sender_t s;
    setup_t su;
    memset(&s, 0, sizeof(s));
    if (receiver_open(&r, 0x5eed0012, 0) != 0)
        FAILF("receiver_open");
    setup_from(&r, &su);
    if (sender_open(&s, &su, 0) != 0)
        FAILF("sender_open");
    pthread_t th[NTHREADS];
    thr_arg_t ta[NTHREADS];
    uint64_t span = region_lens[2] / NTHREADS;
    for (unsigned i = 0; i < NTHREADS; i++) {
        ta[i] = (thr_arg_t){.ep = s.ep, .rkey = s.rkeys[2], .base = i * span, .span = span, .idx = i};
        CHECK(pthread_create(&th[i], NULL, put_thread, &ta[i]) == 0, "pthread_create");
    }
    for (unsigned i = 0; i < NTHREADS; i++)
        pthread_join(th[i], NULL);
    for (unsigned i = 0; i < NTHREADS; i++)
        CHECK(ta[i].st == KVW_OK, "thread %u: %s: %s", i, kvw_status_string(ta[i].st), ta[i].err);
    CHECK_OK(T->notify(s.ep, "done", 4));
    CHECK(wait_notes(&r.st, 1, kvt_tmo_ms(20000)), "no notification");
    /* Same bytes as the threads wrote, computed the same way. */
    for (unsigned i = 0; i < NTHREADS; i++) {
        uint64_t ss = 1000 + i, base = i * span;
        for (uint64_t off = 0; off < span;) {
            uint64_t want = 1 + rnd(&ss) % 3000;
            uint64_t len = KVW_MIN(want, span - off);
            fill_bytes(r.regs[2].shadow + base + off, (size_t)len, (base + off) * 7 + 1);
            off += len;
        }
    }
    if (verify_live(&r) != 0)
        FAILF("after concurrent puts");
out:
    sender_close(&s);
    receiver_close(&r);
    return rc;
}

/* Bounds and argument checks on the sending side; none of them may move a byte. */
static int inproc_bounds(void)
{
    int rc = 0;
    receiver_t r, other;
    sender_t s;
    setup_t su;
    memset(&s, 0, sizeof(s));
    memset(&other, 0, sizeof(other));
    if (receiver_open(&r, 0x5eed0013, 0) != 0 || receiver_open(&other, 0x5eed0014, 0) != 0)
        FAILF("receiver_open");
    setup_from(&r, &su);
    if (sender_open(&s, &su, 0) != 0)
        FAILF("sender_open");
    uint8_t buf[64] = {0};
    uint64_t L = region_lens[1];
    kvw_tl_rkey_h rk = s.rkeys[1];
    struct {
        uint64_t off, len;
        kvw_status_t want;
    } cases[] = {
        {L, 0, KVW_OK},                           /* empty, flush with the end */
        {0, 0, KVW_OK},
        {L + 1, 0, KVW_ERR_OUT_OF_RANGE},         /* empty, past the end */
        {L - 10, 11, KVW_ERR_OUT_OF_RANGE},       /* one byte past the end */
        {L, 1, KVW_ERR_OUT_OF_RANGE},
        {UINT64_MAX - 5, 10, KVW_ERR_OUT_OF_RANGE}, /* off + len wraps */
        {5, UINT64_MAX - 2, KVW_ERR_OUT_OF_RANGE},
        {UINT64_MAX, UINT64_MAX, KVW_ERR_OUT_OF_RANGE},
    };
    for (size_t i = 0; i < KVW_ARRAY_SIZE(cases); i++) {
        kvw_tl_put_t p = {.src = buf, .rkey = rk, .dst_off = cases[i].off, .len = cases[i].len};
        kvw_status_t st = T->put(s.ep, 1, &p, 1);
        CHECK(st == cases[i].want, "case %zu (off %llu, len %llu): got %s (%s), want %s", i,
              (unsigned long long)cases[i].off, (unsigned long long)cases[i].len,
              kvw_status_string(st), kvw_last_error(), kvw_status_string(cases[i].want));
        if (st != KVW_OK)
            CHECK(strlen(kvw_last_error()) > 0, "no error message");
    }
    /* A batch with one bad put moves nothing, not even the good ones before it. */
    uint8_t ones[64];
    memset(ones, 0xee, sizeof(ones));
    kvw_tl_put_t batch[3] = {{.src = ones, .rkey = rk, .dst_off = 0, .len = 64},
                             {.src = ones, .rkey = s.rkeys[0], .dst_off = 128, .len = 64},
                             {.src = ones, .rkey = rk, .dst_off = L - 63, .len = 64}};
    CHECK_ST(T->put(s.ep, 1, batch, 3), KVW_ERR_OUT_OF_RANGE);
    /* Bad arguments. */
    kvw_tl_put_t nsrc = {.src = NULL, .rkey = rk, .dst_off = 0, .len = 8};
    CHECK_ST(T->put(s.ep, 1, &nsrc, 1), KVW_ERR_INVALID_PARAM);
    kvw_tl_put_t nrk = {.src = buf, .rkey = NULL, .dst_off = 0, .len = 8};
    CHECK_ST(T->put(s.ep, 1, &nrk, 1), KVW_ERR_INVALID_PARAM);
    CHECK_OK(T->put(s.ep, 1, NULL, 0));
    uint8_t big[KVW_TL_MAX_NOTIFY + 1];
    memset(big, 0, sizeof(big));
    CHECK_ST(T->notify(s.ep, big, sizeof(big)), KVW_ERR_INVALID_PARAM);
    CHECK_OK(T->notify(s.ep, NULL, 0));
    if (T->put_notify) {
        /* Writes and notification in one call: a bad write sends neither the good ones
         * nor the notification; a notification too long sends no write. */
        CHECK_ST(T->put_notify(s.ep, 1, batch, 3, "bad", 3), KVW_ERR_OUT_OF_RANGE);
        kvw_tl_put_t good = {.src = ones, .rkey = rk, .dst_off = 0, .len = 64};
        CHECK_ST(T->put_notify(s.ep, 1, &good, 1, big, sizeof(big)), KVW_ERR_INVALID_PARAM);
        CHECK_ST(T->put_notify(s.ep, 1, &nsrc, 1, "bad", 3), KVW_ERR_INVALID_PARAM);
        CHECK(strlen(kvw_last_error()) > 0, "no error message");
    }
    /* Keys: garbage, truncated, and a key of another receiver. */
    kvw_tl_rkey_h bad = NULL;
    uint8_t junk[32];
    memset(junk, 0x42, sizeof(junk));
    CHECK_ST(T->rkey_unpack(s.ep, junk, sizeof(junk), &bad), KVW_ERR_INVALID_PARAM);
    CHECK_ST(T->rkey_unpack(s.ep, r.regs[0].rkey, r.regs[0].rkey_len - 1, &bad),
             KVW_ERR_INVALID_PARAM);
    CHECK_ST(T->rkey_unpack(s.ep, other.regs[0].rkey, other.regs[0].rkey_len, &bad),
             KVW_ERR_INVALID_PARAM);
    CHECK(bad == NULL, "rkey_p written on failure");
    /* An rkey unpacked on another endpoint is refused. */
    {
        kvw_tl_ep_h ep2 = NULL;
        kvw_tl_rkey_h rk2 = NULL;
        CHECK_OK(T->connect(s.tl, su.addr, su.addr_len, &ep2));
        CHECK_OK(T->rkey_unpack(ep2, su.rkey[1], su.rkey_len[1], &rk2));
        kvw_tl_put_t p = {.src = buf, .rkey = rk2, .dst_off = 0, .len = 8};
        kvw_status_t st = T->put(s.ep, 1, &p, 1);
        T->rkey_release(rk2);
        T->ep_close(ep2);
        CHECK(st == KVW_ERR_INVALID_PARAM, "got %s", kvw_status_string(st));
    }
    /* Addresses: garbage, and a receiver that is gone. */
    kvw_tl_ep_h ep = NULL;
    CHECK_ST(T->connect(s.tl, junk, sizeof(junk), &ep), KVW_ERR_INVALID_PARAM);
    {
        uint8_t addr[KVW_TL_MAX_ADDR];
        size_t alen = sizeof(addr);
        memcpy(addr, other.addr, other.addr_len);
        alen = other.addr_len;
        receiver_close(&other);
        uint64_t t0 = now_ms();
        kvw_status_t st = T->connect(s.tl, addr, alen, &ep);
        CHECK(st == KVW_ERR_CONN_CLOSED || st == KVW_ERR_REJECTED || st == KVW_ERR_IO,
              "connect to a closed receiver: %s", kvw_status_string(st));
        CHECK(now_ms() - t0 < kvt_tmo_ms(5000), "connect to a closed receiver took %llu ms",
              (unsigned long long)(now_ms() - t0));
    }
    /* Memory kinds the host transports cannot register. */
    {
        kvw_tl_mem_h m = NULL;
        uint8_t rkb[KVW_TL_MAX_RKEY];
        size_t rkl = sizeof(rkb);
        CHECK_ST(T->mem_reg(r.tl, buf, sizeof(buf), KVW_MEM_CUDA, 900, &m, rkb, &rkl),
                 KVW_ERR_UNSUPPORTED);
        CHECK_ST(T->mem_reg(r.tl, buf, sizeof(buf), KVW_MEM_HOST, r.regs[0].id, &m, rkb, &rkl),
                 KVW_ERR_INVALID_PARAM); /* duplicate region id */
    }
    /* Nothing above may have changed a byte or broken the connection. */
    CHECK_OK(T->notify(s.ep, "end", 3));
    CHECK(wait_notes(&r.st, 2, kvt_tmo_ms(20000)), "notifications missing");
    if (verify_live(&r) != 0)
        FAILF("rejected puts changed memory");
    /* "end" is the last of the stream: a refused call's notification would be here. */
    pthread_mutex_lock(&r.st.mu);
    size_t nn = r.st.num_notes;
    bool end_last = nn == 2 && r.st.notes[1].len == 3 && memcmp(r.st.notes[1].data, "end", 3) == 0;
    pthread_mutex_unlock(&r.st.mu);
    CHECK(end_last, "%zu notifications, the last not \"end\": a refused call notified", nn);
    {
        /* The second endpoint above was closed, which the receiver may report; the
         * main endpoint must not have failed. */
        pthread_mutex_lock(&r.st.mu);
        kvw_tl_ep_h main_ep = r.st.notes[0].ep;
        for (size_t i = 0; i < r.st.num_errs; i++)
            if (r.st.errs[i].ep == main_ep) {
                pthread_mutex_unlock(&r.st.mu);
                FAILF("the main endpoint failed: %s", r.st.errs[i].reason);
            }
        pthread_mutex_unlock(&r.st.mu);
    }
    /* Accepted endpoints only receive. */
    {
        pthread_mutex_lock(&r.st.mu);
        kvw_tl_ep_h acc = r.st.notes[0].ep;
        pthread_mutex_unlock(&r.st.mu);
        kvw_tl_put_t p = {.src = buf, .rkey = s.rkeys[0], .dst_off = 0, .len = 8};
        CHECK_ST(T->put(acc, 1, &p, 1), KVW_ERR_UNSUPPORTED);
        CHECK_ST(T->notify(acc, "x", 1), KVW_ERR_UNSUPPORTED);
    }
out:
    sender_close(&s);
    receiver_close(&r);
    if (other.tl)
        receiver_close(&other);
    return rc;
}

/* check_write: on a mediating transport a refused write never lands and the connection
 * stays (tcp discards the payload; ucx drops an eager write and receives a rendezvous one
 * into scratch): the writes after it land, the notification after them comes, and the
 * next round goes through. Elsewhere it is never consulted (the sender confines
 * writes). */
static int inproc_check_write(void)
{
    int rc = 0;
    receiver_t r;
    sender_t s;
    setup_t su;
    memset(&s, 0, sizeof(s));
    if (receiver_open(&r, 0x5eed0015, 0) != 0)
        FAILF("receiver_open");
    setup_from(&r, &su);
    if (sender_open(&s, &su, 0) != 0)
        FAILF("sender_open");
    bool mediated = (kvw__tl_caps(T, r.tl) & KVW_TL_CAP_MEDIATED) != 0;
    pthread_mutex_lock(&r.st.mu);
    r.st.refuse_on = true;
    r.st.refuse_room = 7;
    pthread_mutex_unlock(&r.st.mu);
    static uint8_t a[40000], b[5000];
    memset(a, 0xab, sizeof(a));
    memset(b, 0xcd, sizeof(b));
    kvw_tl_put_t refused[2] = {{.src = a, .rkey = s.rkeys[0], .dst_off = 100, .len = sizeof(a)},
                               {.src = b, .rkey = s.rkeys[1], .dst_off = 0, .len = sizeof(b)}};
    kvw_tl_put_t allowed = {.src = b, .rkey = s.rkeys[0], .dst_off = 300000, .len = sizeof(b)};
    CHECK_OK(T->put(s.ep, 7, refused, 2));
    CHECK_OK(T->put(s.ep, 8, &allowed, 1));
    CHECK_OK(T->notify(s.ep, "n1", 2));
    CHECK(wait_notes(&r.st, 1, kvt_tmo_ms(20000)), "no notification after refused writes");
    memcpy(r.regs[0].shadow + 300000, b, sizeof(b));
    if (!mediated) {
        memcpy(r.regs[0].shadow + 100, a, sizeof(a));
        memcpy(r.regs[1].shadow, b, sizeof(b));
    }
    if (verify_live(&r) != 0)
        FAILF(mediated ? "a refused write landed" : "writes did not land");
    pthread_mutex_lock(&r.st.mu);
    size_t nc = r.st.num_checks;
    wcheck_t c[3];
    memcpy(c, r.st.checks, sizeof(c));
    pthread_mutex_unlock(&r.st.mu);
    if (mediated) {
        CHECK(nc == 3, "check_write called %zu times, expected 3", nc);
        CHECK(c[0].room == 7 && c[0].region == r.regs[0].id && c[0].off == 100 &&
                  c[0].len == sizeof(a) && c[0].ep != NULL,
              "check_write saw (%llu, %llu, %llu, %llu)", (unsigned long long)c[0].room,
              (unsigned long long)c[0].region, (unsigned long long)c[0].off,
              (unsigned long long)c[0].len);
        CHECK(c[1].room == 7 && c[1].region == r.regs[1].id && c[1].off == 0 &&
                  c[1].ep == c[0].ep, "second check");
        CHECK(c[2].room == 8 && c[2].region == r.regs[0].id && c[2].off == 300000 &&
                  c[2].len == sizeof(b) && c[2].ep == c[0].ep,
              "third check");
    } else {
        CHECK(nc == 0, "check_write called %zu times on a non-mediating transport", nc);
    }
    /* The connection survived: another round goes through. */
    pthread_mutex_lock(&r.st.mu);
    r.st.refuse_on = false;
    r.st.snap_regs = r.regs;
    r.st.snap_n = NREG;
    pthread_mutex_unlock(&r.st.mu);
    if (send_round(s.ep, s.rkeys, su.seed, 3, 7, 9) != 0)
        FAILF("round after refusal");
    CHECK(wait_notes(&r.st, 2, kvt_tmo_ms(20000)), "no notification");
    apply_round(&r, su.seed, 3, 7);
    if (verify_note(&r, 1, su.seed, 3, 7) != 0)
        FAILF("round after refusal");
    CHECK(count_of(&r.st, &r.st.num_errs) == 0, "unexpected on_ep_error: %s", r.st.errs[0].reason);
out:
    sender_close(&s);
    receiver_close(&r);
    return rc;
}

/* Deregistration: tcp drops a connection that writes into a region no longer
 * registered; shm stops handing out the region's memory. */
static int inproc_dereg(void)
{
    int rc = 0;
    receiver_t r;
    sender_t s;
    setup_t su;
    memset(&s, 0, sizeof(s));
    if (receiver_open(&r, 0x5eed0016, 0) != 0)
        FAILF("receiver_open");
    setup_from(&r, &su);
    if (sender_open(&s, &su, 0) != 0)
        FAILF("sender_open");
    T->mem_dereg(r.tl, r.regs[0].mem);
    r.regs[0].mem = NULL;
    uint8_t buf[256];
    memset(buf, 0x77, sizeof(buf));
    if (kvw__tl_caps(T, r.tl) & KVW_TL_CAP_MEDIATED) {
        kvw_tl_put_t p = {.src = buf, .rkey = s.rkeys[0], .dst_off = 0, .len = sizeof(buf)};
        CHECK_OK(T->put(s.ep, 1, &p, 1)); /* the sender cannot know yet */
        CHECK(wait_errs(&r.st, 1, kvt_tmo_ms(10000)),
              "no on_ep_error for a put into a deregistered region");
        CHECK(r.st.errs[0].status == KVW_ERR_OUT_OF_RANGE, "status %s: %s",
              kvw_status_string(r.st.errs[0].status), r.st.errs[0].reason);
        if (verify_live(&r) != 0)
            FAILF("a put into a deregistered region landed");
        /* The sender learns it: its connection fails. */
        CHECK(wait_errs(&s.st, 1, kvt_tmo_ms(10000)), "the sender's endpoint did not fail");
        CHECK_ST(T->put(s.ep, 1, &p, 1), KVW_ERR_CONN_CLOSED);
    } else {
        /* A fresh endpoint can no longer fetch the region (memfd path). */
        kvw_tl_ep_h ep2 = NULL;
        kvw_tl_rkey_h rk = NULL;
        CHECK_OK(T->connect(s.tl, su.addr, su.addr_len, &ep2));
        kvw_status_t st = T->rkey_unpack(ep2, su.rkey[0], su.rkey_len[0], &rk);
        T->ep_close(ep2);
        CHECK(st == KVW_ERR_NOT_FOUND, "rkey_unpack of a deregistered region: %s",
              kvw_status_string(st));
    }
out:
    sender_close(&s);
    receiver_close(&r);
    return rc;
}

/* ep_close on the sending side: the receiver sees the connection end (on_ep_error,
 * CONN_CLOSED) and the sender's own callbacks stay silent. */
static int inproc_ep_close(void)
{
    int rc = 0;
    receiver_t r;
    sender_t s;
    setup_t su;
    memset(&s, 0, sizeof(s));
    if (receiver_open(&r, 0x5eed0017, 0) != 0)
        FAILF("receiver_open");
    setup_from(&r, &su);
    if (sender_open(&s, &su, 0) != 0)
        FAILF("sender_open");
    CHECK_OK(T->notify(s.ep, "hi", 2));
    CHECK(wait_notes(&r.st, 1, kvt_tmo_ms(20000)), "no notification");
    for (int i = 0; i < NREG; i++) {
        T->rkey_release(s.rkeys[i]);
        s.rkeys[i] = NULL;
    }
    T->ep_close(s.ep);
    s.ep = NULL;
    CHECK(wait_errs(&r.st, 1, kvt_tmo_ms(10000)),
          "the receiver did not notice the closed connection");
    CHECK(r.st.errs[0].status == KVW_ERR_CONN_CLOSED && r.st.errs[0].ep == r.st.notes[0].ep,
          "status %s: %s", kvw_status_string(r.st.errs[0].status), r.st.errs[0].reason);
    sleep_ms(300);
    CHECK(count_of(&s.st, &s.st.num_errs) == 0, "on_ep_error for a closed endpoint: %s",
          s.st.errs[0].reason);
    CHECK(count_of(&r.st, &r.st.num_errs) == 1, "more than one on_ep_error");
out:
    sender_close(&s);
    receiver_close(&r);
    return rc;
}

/* The receiver shuts down while a sender is connected: the sender's endpoint reports
 * on_ep_error and its calls fail with CONN_CLOSED. */
static int inproc_receiver_close(void)
{
    int rc = 0;
    receiver_t r;
    sender_t s;
    setup_t su;
    memset(&s, 0, sizeof(s));
    if (receiver_open(&r, 0x5eed0018, 0) != 0)
        FAILF("receiver_open");
    setup_from(&r, &su);
    if (sender_open(&s, &su, kvt_tmo_ms(2000)) != 0)
        FAILF("sender_open");
    receiver_close(&r);
    CHECK(wait_errs(&s.st, 1, kvt_tmo_ms(10000)),
          "the sender's endpoint did not report the receiver's end");
    CHECK(s.st.errs[0].ep == s.ep && s.st.errs[0].status == KVW_ERR_CONN_CLOSED, "status %s: %s",
          kvw_status_string(s.st.errs[0].status), s.st.errs[0].reason);
    uint8_t buf[64] = {0};
    kvw_tl_put_t p = {.src = buf, .rkey = s.rkeys[0], .dst_off = 0, .len = sizeof(buf)};
    CHECK_ST(T->put(s.ep, 1, &p, 1), KVW_ERR_CONN_CLOSED);
    CHECK_ST(T->notify(s.ep, "x", 1), KVW_ERR_CONN_CLOSED);
out:
    sender_close(&s);
    return rc;
}

/* rkey_ptr (optional slot): where a transport hands out a pointer, bytes written
 * through it before a notify are in place when the notification arrives, inside the
 * region only. shm: memfd-backed regions have one, malloc'd (cma) ones do not. */
static int inproc_rkey_ptr(void)
{
    int rc = 0;
    receiver_t r;
    sender_t s;
    setup_t su;
    memset(&s, 0, sizeof(s));
    memset(&r, 0, sizeof(r));
    if (T->rkey_ptr == NULL) {
        fprintf(stderr, "  [%s] rkey_ptr: slot not provided, nothing to check\n", T->name);
        return 0;
    }
    if (receiver_open(&r, 0x5eed001a, 0) != 0)
        FAILF("receiver_open");
    r.st.snap_regs = r.regs;
    r.st.snap_n = NREG;
    setup_from(&r, &su);
    if (sender_open(&s, &su, 0) != 0)
        FAILF("sender_open");
    unsigned mapped = 0;
    for (int i = 0; i < NREG; i++) {
        uint8_t *p = T->rkey_ptr(s.rkeys[i]);
        if (strcmp(T->name, "shm") == 0)
            CHECK((p != NULL) == r.regs[i].shared, "region %d: rkey_ptr %p", i, (void *)p);
        if (p == NULL)
            continue;
        mapped++;
        uint64_t L = r.regs[i].len;
        fill_bytes(p, 1000, 11 + (uint64_t)i); /* first and last bytes of the region */
        fill_bytes(p + L - 1000, 1000, 12 + (uint64_t)i);
        fill_bytes(r.regs[i].shadow, 1000, 11 + (uint64_t)i);
        fill_bytes(r.regs[i].shadow + L - 1000, 1000, 12 + (uint64_t)i);
    }
    CHECK_OK(T->notify(s.ep, "mapped", 6));
    CHECK(wait_notes(&r.st, 1, kvt_tmo_ms(20000)), "no notification");
    pthread_mutex_lock(&r.st.mu);
    const uint8_t *snap = r.st.notes[0].snap;
    pthread_mutex_unlock(&r.st.mu);
    char why[256];
    size_t off = 0;
    for (int i = 0; i < NREG; i++) {
        CHECK(check_image(&r.regs[i], snap + off, why, sizeof(why)) == 0, "%s", why);
        off += r.regs[i].total;
    }
    fprintf(stderr, "  [%s] rkey_ptr mapped %u of %d regions\n", T->name, mapped, NREG);
out:
    sender_close(&s);
    if (r.tl)
        receiver_close(&r);
    return rc;
}

/* fini without closing anything first must still free everything (ASan checks). */
static int inproc_fini_leaks(void)
{
    int rc = 0;
    receiver_t r;
    sender_t s;
    setup_t su;
    memset(&s, 0, sizeof(s));
    if (receiver_open(&r, 0x5eed0019, 0) != 0)
        FAILF("receiver_open");
    setup_from(&r, &su);
    if (sender_open(&s, &su, 0) != 0)
        FAILF("sender_open");
    if (send_round(s.ep, s.rkeys, su.seed, 0, 7, 1) != 0)
        FAILF("round");
    CHECK(wait_notes(&r.st, 1, kvt_tmo_ms(20000)), "no notification");
    /* Sender: fini with an open endpoint and unreleased rkeys. */
    T->fini(s.tl);
    memset(&s, 0, sizeof(s));
    /* Receiver: fini with registrations and an accepted endpoint. */
    T->fini(r.tl);
    r.tl = NULL;
out:
    if (s.tl)
        sender_close(&s);
    receiver_close(&r);
    return rc;
}

/* ---------------------------------------------------------------- main */

typedef struct test_case {
    const char *name;
    int (*fn)(void);
} test_case_t;

static const test_case_t xproc_cases[] = {
    {"xproc_integrity", xproc_integrity},
    {"xproc_peer_killed", xproc_peer_killed},
    {"xproc_recv_gone", xproc_recv_gone},
    {"xproc_recv_stall", xproc_recv_stall},
};

static const test_case_t inproc_cases[] = {
    {"integrity", inproc_integrity},   {"multi_ep", inproc_multi_ep},
    {"threads", inproc_threads},       {"bounds", inproc_bounds},
    {"check_write", inproc_check_write}, {"dereg", inproc_dereg},
    {"ep_close", inproc_ep_close},     {"receiver_close", inproc_receiver_close},
    {"rkey_ptr", inproc_rkey_ptr},     {"fini_leaks", inproc_fini_leaks},
};

int main(int argc, char **argv)
{
    const char *only = argc > 1 ? argv[1] : getenv("KVW_TL_ONLY"); /* one transport */
    const char *const *names = kvw__tl_names();
    int failures = 0, ran = 0;
    signal(SIGPIPE, SIG_IGN); /* for the tests' own control sockets */
    /* Cross-process cases first, while no thread exists in this process. */
    for (int pass = 0; pass < 2; pass++) {
        const test_case_t *cases = pass == 0 ? xproc_cases : inproc_cases;
        size_t n = pass == 0 ? KVW_ARRAY_SIZE(xproc_cases) : KVW_ARRAY_SIZE(inproc_cases);
        for (size_t t = 0; names[t]; t++) {
            if (only && strcmp(only, names[t]) != 0)
                continue;
            T = kvw__tl_find(names[t]);
            if (T == NULL) {
                fprintf(stderr, "FAIL: kvw__tl_find(\"%s\"): %s\n", names[t], kvw_last_error());
                return 1;
            }
            for (size_t i = 0; i < n; i++) {
                g_case = cases[i].name;
                const char *only_case = getenv("KVW_TL_CASE"); /* one case, for debugging */
                if (only_case && strcmp(only_case, g_case) != 0)
                    continue;
                uint64_t t0 = now_ms();
                int r = cases[i].fn();
                fprintf(stderr, "%s %s/%s (%llu ms)\n", r == 0 ? "ok  " : "FAIL", T->name,
                        g_case, (unsigned long long)(now_ms() - t0));
                failures += r != 0;
                ran++;
            }
        }
    }
    if (kvw__tl_find("no-such-transport") != NULL) {
        fprintf(stderr, "FAIL: kvw__tl_find found a transport that does not exist\n");
        failures++;
    }
    if (ran == 0) {
        fprintf(stderr, "no transport matched '%s'\n", only ? only : "");
        return 77;
    }
    fprintf(stderr, "%d of %d cases failed\n", failures, ran);
    return failures ? 1 : 0;
}
