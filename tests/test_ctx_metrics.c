/*
 * kvw_ctx_metrics: the counters of a prefill and a decode context after real rooms.
 *
 * Three cases, each with fresh contexts in one process: tcp with every plan direct
 * (KVW_PATH=direct), tcp with every plan staged (KVW_PATH=staged), shm with the path
 * chosen per plan. Each moves three rooms of different sizes (every byte checked against
 * the test kit's reference) and aborts a fourth from the decode, then checks exact values
 * on both sides: rooms by state and by outcome, failures by status, bytes by path equal to
 * what the reference says the rooms move, the latency histogram holding every successful
 * room in the bucket its own hop stamps give, staging capacity, use and high water, peers
 * connected, and a peer's death once the decode context is gone.
 *
 * The field mask: unknown bits and NULL arguments are refused naming the call and the
 * struct, and a partial request writes only the fields asked for.
 */
#include "testkit.h"
#include "inproc.h"

#include <kvwire/xfer.h>

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define UNKNOWN_BIT (1ull << 40)
#define NUM_ROOMS 3

static kvt_model_t model;

typedef struct tcase {
    const char *tl;
    const char *path; /* KVW_PATH */
} tcase_t;

typedef struct env {
    kvt_rank_t src, dst;
    kvw_ctx_h pctx, dctx;
} env_t;

/* What the rooms of one case did, from the reference and the rooms' own stamps. */
typedef struct expect {
    uint64_t bytes_direct, bytes_staged;
    uint64_t lat_us[2][NUM_ROOMS]; /* [prefill, decode] post to Success, from hop stamps */
} expect_t;

static kvw_ctx_metrics_t get(kvw_ctx_h ctx)
{
    kvw_ctx_metrics_t m;
    memset(&m, 0, sizeof(m));
    m.field_mask = KVW_CTX_METRICS_FIELDS_ALL;
    kvw_status_t st = kvw_ctx_metrics(ctx, &m);
    CHECK(st == KVW_OK, "kvw_ctx_metrics: %s: %s", kvw_status_string(st), kvw_last_error());
    return m;
}

static uint64_t sum(const uint64_t *v, unsigned n)
{
    uint64_t s = 0;
    for (unsigned i = 0; i < n; i++)
        s += v[i];
    return s;
}

/* The bucket of a latency as xfer.h defines it (below 2^i us, at least 2^(i-1)). */
static unsigned bucket_of(uint64_t us)
{
    unsigned i = 0;
    while (i + 1 < KVW_CTX_METRICS_LATENCY_BUCKETS && us >= (1ull << i))
        i++;
    return i;
}

/* The histogram holds each room in the bucket of its latency from the hop stamps, give
 * or take 2 us (the library takes its own clock reading, a few instructions apart):
 * checked on the cumulative counts, which only such a shift can change. */
static void check_histogram(const char *side, const uint64_t *h, const uint64_t *lat)
{
    uint64_t cum = 0;
    for (unsigned i = 0; i < KVW_CTX_METRICS_LATENCY_BUCKETS; i++) {
        cum += h[i];
        uint64_t lo = 0, hi = 0; /* rooms surely below bound i, and possibly below it */
        for (unsigned k = 0; k < NUM_ROOMS; k++) {
            lo += bucket_of(lat[k] + 2) <= i;
            hi += bucket_of(lat[k] > 2 ? lat[k] - 2 : 0) <= i;
        }
        CHECK(cum >= lo && cum <= hi, "%s: latency buckets 0..%u hold %llu rooms, the hop "
              "stamps say %llu..%llu", side, i, (unsigned long long)cum,
              (unsigned long long)lo, (unsigned long long)hi);
    }
}

/* Waits up to 10 s (scaled) until `cond(ctx)` holds. */
static bool wait_for(kvw_ctx_h ctx, bool (*cond)(const kvw_ctx_metrics_t *))
{
    uint64_t end = kvt_now_ns() + kvt_tmo_ns(10000000000ull);
    for (;;) {
        kvw_ctx_metrics_t m = get(ctx);
        if (cond(&m))
            return true;
        if (kvt_now_ns() > end)
            return false;
        usleep(2000);
    }
}

static bool no_rooms_open(const kvw_ctx_metrics_t *m)
{
    return sum(m->rooms_in_state, KVW_CTX_METRICS_ACTIVE_STATES) == 0;
}

static bool staging_idle(const kvw_ctx_metrics_t *m)
{
    return m->staging_in_use == 0 && no_rooms_open(m);
}

static bool peer_gone(const kvw_ctx_metrics_t *m)
{
    return m->peers_died == 1 && m->peers_connected == 0;
}

/* One room of `tokens` tokens, verified; adds its bytes and latencies to *x. */
static void one_room(env_t *e, const tcase_t *tc, uint64_t id, uint64_t tokens, unsigned k,
                     expect_t *x)
{
    kvt_rng_t rng = {id * 7 + 1};
    kvt_req_spec_t rs = {.full_begin = 0, .full_end = tokens, .swa_begin = 0,
                         .swa_end = tokens, .state_slot = -1};
    kvt_req_pages_t sp, dp;
    CHECK(kvt_req_pages_make(&e->src, &rs, &rng, &sp) == 0, "source pages");
    CHECK(kvt_req_pages_make(&e->dst, &rs, &rng, &dp) == 0, "destination pages");
    kvt_copy_t expect;
    kvt_copy_make(&e->dst, &expect);
    kvw_receiver_h rcv = NULL;
    kvw_sender_h snd = NULL;
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = tokens,
                            .pages = dp.side};
    CHECK(kvw_receiver_create(e->dctx, id, 0, &rcv) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_receiver_post(rcv, &post) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_sender_create(e->pctx, id, &snd) == KVW_OK, "%s", kvw_last_error());
    kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = tokens,
                          .chunk_end = tokens, .last_chunk = 1, .pages = sp.side};
    CHECK(kvw_sender_send(snd, &c) == KVW_OK, "%s", kvw_last_error());
    kvw_room_h rr = kvw_receiver_room(rcv), sr = kvw_sender_room(snd);
    kvw_room_state_t ds = kvw_room_wait(rr, kvt_tmo_ms(30000));
    kvw_room_state_t ps = kvw_room_wait(sr, kvt_tmo_ms(30000));
    CHECK(ds == KVW_ROOM_SUCCESS && ps == KVW_ROOM_SUCCESS, "%s/%s room %llu ended %s / %s: %s",
          tc->tl, tc->path, (unsigned long long)id, kvw_room_state_string(ds),
          kvw_room_state_string(ps), kvw_room_failure(rr));
    uint64_t per_src = 0;
    ip_ref(&model, &e->src, 1, &sp.side, &e->dst, &dp.side, expect.data, tokens, &per_src);
    ip_verify(&e->dst, &expect, "metrics room: ");
    CHECK(per_src > 0, "the reference moves no bytes");

    kvw_room_metrics_t dm = {.field_mask = KVW_ROOM_METRICS_FIELDS_ALL};
    kvw_room_metrics_t pm = {.field_mask = KVW_ROOM_METRICS_FIELDS_ALL};
    CHECK(kvw_room_metrics(rr, &dm) == KVW_OK && kvw_room_metrics(sr, &pm) == KVW_OK, "%s",
          kvw_last_error());
    /* The path: forced by KVW_PATH, else what the room says it took. */
    bool staged = !strcmp(tc->path, "staged") ||
                  (!strcmp(tc->path, "auto") && !strcmp(dm.path, "staged"));
    if (strcmp(tc->path, "auto"))
        CHECK(!strcmp(dm.path, tc->path) && !strcmp(pm.path, tc->path),
              "KVW_PATH=%s, but the room took %s / %s", tc->path, pm.path, dm.path);
    *(staged ? &x->bytes_staged : &x->bytes_direct) += per_src;
    x->lat_us[0][k] = (pm.hop_ns[KVW_HOP_SUCCESS] - pm.hop_ns[KVW_HOP_REQ_RX]) / 1000u;
    x->lat_us[1][k] = (dm.hop_ns[KVW_HOP_SUCCESS] - dm.hop_ns[KVW_HOP_POST]) / 1000u;
    CHECK(pm.hop_ns[KVW_HOP_REQ_RX] && dm.hop_ns[KVW_HOP_POST], "hop stamps missing");
    kvw_room_destroy(sr);
    kvw_room_destroy(rr);
    kvt_copy_free(&expect);
    kvt_req_pages_free(&sp);
    kvt_req_pages_free(&dp);
}

/* A room the decode aborts after its post: both sides count it failed, by its status. */
static void aborted_room(env_t *e, uint64_t id, kvw_status_t *pstatus)
{
    kvt_rng_t rng = {id};
    kvt_req_spec_t rs = {.full_begin = 0, .full_end = 40, .swa_begin = 0, .swa_end = 40,
                         .state_slot = -1};
    kvt_req_pages_t dp;
    CHECK(kvt_req_pages_make(&e->dst, &rs, &rng, &dp) == 0, "destination pages");
    kvw_receiver_h rcv = NULL;
    kvw_sender_h snd = NULL;
    CHECK(kvw_receiver_create(e->dctx, id, 0, &rcv) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_sender_create(e->pctx, id, &snd) == KVW_OK, "%s", kvw_last_error());
    kvw_room_h rr = kvw_receiver_room(rcv), sr = kvw_sender_room(snd);
    /* Open, not finished: counted in its state on the decode side. */
    kvw_ctx_metrics_t m = get(e->dctx);
    kvw_room_state_t s = kvw_room_poll(rr);
    CHECK((unsigned)s < KVW_CTX_METRICS_ACTIVE_STATES && m.rooms_in_state[s] == 1 &&
              sum(m.rooms_in_state, KVW_CTX_METRICS_ACTIVE_STATES) == 1,
          "an open room in state %s: in_state %llu/%llu/%llu", kvw_room_state_string(s),
          (unsigned long long)m.rooms_in_state[0], (unsigned long long)m.rooms_in_state[1],
          (unsigned long long)m.rooms_in_state[2]);
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = 40,
                            .pages = dp.side};
    CHECK(kvw_receiver_post(rcv, &post) == KVW_OK, "post: %s", kvw_last_error());
    kvw_room_abort(rr);
    CHECK(kvw_room_status(rr) == KVW_ERR_ABORTED, "decode after its abort: %s",
          kvw_status_string(kvw_room_status(rr)));
    kvw_room_state_t ps = kvw_room_wait(sr, kvt_tmo_ms(30000));
    CHECK(ps == KVW_ROOM_FAILED, "prefill after the decode's abort: %s",
          kvw_room_state_string(ps));
    *pstatus = kvw_room_status(sr);
    kvw_room_destroy(sr);
    kvw_room_destroy(rr);
    kvt_req_pages_free(&dp);
}

static void check_side(const char *side, const tcase_t *tc, const kvw_ctx_metrics_t *m,
                       kvw_side_t want_side, const expect_t *x, const uint64_t *lat,
                       kvw_status_t fail_status)
{
    CHECK(m->side == want_side, "%s: side %d", side, (int)m->side);
    CHECK(m->transport && !strcmp(m->transport, tc->tl), "%s: transport %s, want %s", side,
          m->transport ? m->transport : "(null)", tc->tl);
    CHECK(m->rooms_succeeded == NUM_ROOMS && m->rooms_failed == 1,
          "%s %s/%s: rooms succeeded %llu failed %llu, want %d and 1", side, tc->tl, tc->path,
          (unsigned long long)m->rooms_succeeded, (unsigned long long)m->rooms_failed,
          NUM_ROOMS);
    unsigned slot = (unsigned)-(int)fail_status;
    CHECK(slot > 0 && slot < KVW_CTX_METRICS_STATUS_SLOTS && m->rooms_failed_by_status[slot] == 1 &&
              sum(m->rooms_failed_by_status, KVW_CTX_METRICS_STATUS_SLOTS) == 1,
          "%s: failures by status: slot %u (%s) holds %llu of %llu", side, slot,
          kvw_status_string(fail_status),
          (unsigned long long)(slot < KVW_CTX_METRICS_STATUS_SLOTS ? m->rooms_failed_by_status[slot] : 0),
          (unsigned long long)sum(m->rooms_failed_by_status, KVW_CTX_METRICS_STATUS_SLOTS));
    CHECK(m->bytes_direct == x->bytes_direct && m->bytes_staged == x->bytes_staged,
          "%s %s/%s: bytes direct %llu staged %llu, the reference says %llu and %llu", side,
          tc->tl, tc->path, (unsigned long long)m->bytes_direct,
          (unsigned long long)m->bytes_staged, (unsigned long long)x->bytes_direct,
          (unsigned long long)x->bytes_staged);
    CHECK(sum(m->latency_us_buckets, KVW_CTX_METRICS_LATENCY_BUCKETS) == NUM_ROOMS,
          "%s: the latency histogram holds %llu rooms, want %d", side,
          (unsigned long long)sum(m->latency_us_buckets, KVW_CTX_METRICS_LATENCY_BUCKETS),
          NUM_ROOMS);
    check_histogram(side, m->latency_us_buckets, lat);
    uint64_t want_sum = sum(lat, NUM_ROOMS);
    /* The counter and the hop stamps read the clock at nearby, not identical, moments:
     * 2 us a room of rounding, plus 1% (under TSan on a loaded host the two readings
     * drifted 66 us apart over the rooms). */
    uint64_t slack = 2 * NUM_ROOMS + want_sum / 100;
    CHECK(m->latency_us_sum + slack >= want_sum && m->latency_us_sum <= want_sum + slack,
          "%s: latency sum %llu us, the hop stamps say %llu", side,
          (unsigned long long)m->latency_us_sum, (unsigned long long)want_sum);
    CHECK(m->peers_connected == 1 && m->peers_died == 0, "%s: peers connected %llu died %llu",
          side, (unsigned long long)m->peers_connected, (unsigned long long)m->peers_died);
}

static void run_case(env_t *e, const tcase_t *tc)
{
    setenv("KVW_PATH", tc->path, 1);
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, &e->src, tc->tl, "127.0.0.1:0", true);
    p.bootstrap_timeout_ms = kvt_tmo_ms(20000);
    p.wait_timeout_ms = kvt_tmo_ms(20000);
    e->pctx = e->dctx = NULL;
    kvw_status_t st = kvw_ctx_create(&p, &e->pctx);
    CHECK(st == KVW_OK, "%s prefill context: %s", tc->tl, kvw_last_error());
    char bs[128];
    if (st == KVW_OK) {
        ip_params_decode(&p, e->pctx, &e->dst, bs, sizeof(bs));
        st = kvw_ctx_create(&p, &e->dctx);
        CHECK(st == KVW_OK, "%s decode context: %s", tc->tl, kvw_last_error());
    }
    unsetenv("KVW_PATH");
    if (st != KVW_OK) {
        kvw_ctx_destroy(e->pctx);
        return;
    }
    /* Before any room: nothing counted, the peers connected (the prefill side may see
     * its peer a moment after the decode's create returned). */
    kvw_ctx_metrics_t d0 = get(e->dctx);
    CHECK(d0.rooms_succeeded == 0 && d0.rooms_failed == 0 && d0.bytes_direct == 0 &&
              d0.bytes_staged == 0 && no_rooms_open(&d0) && d0.peers_connected == 1 &&
              d0.staging_in_use == 0 && d0.staging_high_water == 0,
          "a fresh decode context counts something");

    expect_t x;
    memset(&x, 0, sizeof(x));
    static const uint64_t tokens[NUM_ROOMS] = {40, 100, 17};
    for (unsigned k = 0; k < NUM_ROOMS; k++)
        one_room(e, tc, 100 + k, tokens[k], k, &x);
    kvw_status_t pfail = KVW_OK;
    aborted_room(e, 200, &pfail);

    /* The aborted room's staging and effects are run by the control threads. */
    CHECK(wait_for(e->dctx, staging_idle) && wait_for(e->pctx, no_rooms_open),
          "rooms still counted open, or staging in use, after every room ended");
    kvw_ctx_metrics_t pm = get(e->pctx), dm = get(e->dctx);
    check_side("prefill", tc, &pm, KVW_SIDE_PREFILL, &x, x.lat_us[0], pfail);
    check_side("decode", tc, &dm, KVW_SIDE_DECODE, &x, x.lat_us[1], KVW_ERR_ABORTED);
    CHECK(pm.staging_capacity == 0 && pm.staging_high_water == 0,
          "prefill staging: capacity %llu high water %llu",
          (unsigned long long)pm.staging_capacity, (unsigned long long)pm.staging_high_water);
    CHECK(dm.staging_capacity == 64ull << 20, "decode staging capacity %llu (KVW_STAGING_MB 64)",
          (unsigned long long)dm.staging_capacity);
    CHECK(dm.staging_in_use == 0, "decode staging still in use: %llu",
          (unsigned long long)dm.staging_in_use);
    if (x.bytes_staged)
        CHECK(dm.staging_high_water > 0 && dm.staging_high_water <= dm.staging_capacity,
              "%s staged: staging high water %llu", tc->tl,
              (unsigned long long)dm.staging_high_water);
    else
        CHECK(dm.staging_high_water == 0, "%s direct: staging high water %llu", tc->tl,
              (unsigned long long)dm.staging_high_water);

    /* The decode context goes: the prefill context counts its peer dead. */
    kvw_ctx_destroy(e->dctx);
    e->dctx = NULL;
    CHECK(wait_for(e->pctx, peer_gone), "prefill: the destroyed decode rank not counted dead");
    kvw_ctx_destroy(e->pctx);
    e->pctx = NULL;
}

static void test_masks(env_t *e)
{
    kvw_ctx_metrics_t m;
    memset(&m, 0xCD, sizeof(m));
    m.field_mask = KVW_CTX_METRICS_FIELD_BYTES_DIRECT | KVW_CTX_METRICS_FIELD_PEERS_CONNECTED |
                   KVW_CTX_METRICS_FIELD_TRANSPORT;
    uint64_t asked = m.field_mask;
    CHECK(kvw_ctx_metrics(e->dctx, &m) == KVW_OK, "%s", kvw_last_error());
    const uint64_t cd = 0xCDCDCDCDCDCDCDCDull;
    CHECK(m.field_mask == asked && m.bytes_direct == 0 && m.peers_connected == 1 &&
              !strcmp(m.transport, "tcp"),
          "asked fields: mask 0x%llx bytes %llu peers %llu", (unsigned long long)m.field_mask,
          (unsigned long long)m.bytes_direct, (unsigned long long)m.peers_connected);
    CHECK(m.bytes_staged == cd && m.rooms_succeeded == cd && m.rooms_failed == cd &&
              m.rooms_in_state[0] == cd && m.rooms_failed_by_status[21] == cd &&
              m.latency_us_buckets[0] == cd && m.latency_us_sum == cd &&
              m.staging_capacity == cd && m.staging_in_use == cd &&
              m.staging_high_water == cd && m.peers_died == cd,
          "kvw_ctx_metrics wrote fields it was not asked for");
    kvw_ctx_metrics_t none;
    memset(&none, 0xCD, sizeof(none));
    none.field_mask = 0;
    CHECK(kvw_ctx_metrics(e->dctx, &none) == KVW_OK && none.bytes_direct == cd &&
              none.peers_died == cd,
          "an empty request wrote something");

    m.field_mask = KVW_CTX_METRICS_FIELDS_ALL | UNKNOWN_BIT;
    m.bytes_direct = 77;
    kvw_status_t st = kvw_ctx_metrics(e->dctx, &m);
    const char *msg = kvw_last_error();
    CHECK(st == KVW_ERR_INVALID_PARAM && kvt_contains(msg, "kvw_ctx_metrics") &&
              kvt_contains(msg, "kvw_ctx_metrics_t") && kvt_contains(msg, "0x10000000000") &&
              m.bytes_direct == 77,
          "unknown bit: %s: %s", kvw_status_string(st), msg);
    m.field_mask = KVW_CTX_METRICS_FIELDS_ALL << 1 & ~KVW_CTX_METRICS_FIELDS_ALL;
    CHECK(kvw_ctx_metrics(e->dctx, &m) == KVW_ERR_INVALID_PARAM,
          "the first bit past KVW_CTX_METRICS_FIELDS_ALL was accepted");
    m.field_mask = KVW_CTX_METRICS_FIELDS_ALL;
    st = kvw_ctx_metrics(NULL, &m);
    CHECK(st == KVW_ERR_INVALID_PARAM && kvt_contains(kvw_last_error(), "kvw_ctx_metrics") &&
              kvt_contains(kvw_last_error(), "NULL"),
          "NULL context: %s: %s", kvw_status_string(st), kvw_last_error());
    st = kvw_ctx_metrics(e->dctx, NULL);
    CHECK(st == KVW_ERR_INVALID_PARAM, "NULL output: %s", kvw_status_string(st));
}

int main(void)
{
    env_t e;
    memset(&e, 0, sizeof(e));
    if (ip_model("test_ctx_metrics", &model))
        return 1;
    CHECK(ip_rank(&model, 1, 0, 32, 2, &e.src) == KVW_OK &&
              ip_rank(&model, 1, 0, 32, 2, &e.dst) == KVW_OK,
          "%s", kvw_last_error());
    if (failures)
        return ip_summary("test_ctx_metrics");
    kvt_rank_fill(&e.src, 41);
    kvt_rank_fill(&e.dst, 42);

    /* The field mask, on a pair of fresh tcp contexts. */
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, &e.src, "tcp", "127.0.0.1:0", true);
    p.bootstrap_timeout_ms = kvt_tmo_ms(20000);
    char bs[128];
    CHECK(kvw_ctx_create(&p, &e.pctx) == KVW_OK, "%s", kvw_last_error());
    if (e.pctx) {
        ip_params_decode(&p, e.pctx, &e.dst, bs, sizeof(bs));
        CHECK(kvw_ctx_create(&p, &e.dctx) == KVW_OK, "%s", kvw_last_error());
        if (e.dctx)
            test_masks(&e);
    }
    kvw_ctx_destroy(e.dctx);
    kvw_ctx_destroy(e.pctx);

    static const tcase_t cases[] = {{"tcp", "direct"}, {"tcp", "staged"}, {"shm", "auto"}};
    for (unsigned i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        run_case(&e, &cases[i]);
    kvt_rank_free(&e.src);
    kvt_rank_free(&e.dst);
    return ip_summary("test_ctx_metrics");
}
