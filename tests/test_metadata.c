/*
 * Per-room metadata (kvw_sender_set_metadata / kvw_receiver_metadata): the opaque "aux"
 * payload a prefill rank attaches to a room reaches the decode with the KV bytes, under
 * the same fail-closed rules.
 *
 * In one process, prefill TP2 -> decode TP1 (both prefill ranks write the decode rank),
 * over tcp and shm. Cases: metadata from one prefill rank only (6000 bytes, more than a
 * transport notification holds); the same bytes from both ranks; empty metadata; two
 * ranks disagreeing (the room fails, naming it); the API's refusals (after the last
 * chunk, too long, before Success, a buffer too small). Every room's KV bytes and guard
 * bytes are checked against the test kit's reference as well.
 */
#include "testkit.h"
#include "inproc.h"

#include <kvwire/xfer.h>

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>


static kvt_model_t model;

static kvw_status_t make_ctx(kvt_rank_t *r, bool prefill, const char *tl, const char *bs,
                             bool host, kvw_ctx_h *ctx)
{
    kvw_ctx_params_t p =
        ip_params(prefill ? KVW_SIDE_PREFILL : KVW_SIDE_DECODE, r, tl, bs, host);
    p.bootstrap_timeout_ms = kvt_tmo_ms(20000);
    p.wait_timeout_ms = kvt_tmo_ms(20000);
    return kvw_ctx_create(&p, ctx);
}

typedef struct env {
    const char *tl;
    kvt_rank_t src[2], dst;
    kvw_ctx_h pctx[2], dctx;
} env_t;

static void fill_meta(uint8_t *m, size_t n, uint64_t seed)
{
    kvt_rng_t rng = {seed};
    for (size_t i = 0; i < n; i++)
        m[i] = (uint8_t)kvt_rng_next(&rng);
}

/*
 * One room: each prefill rank k attaches meta[k] (len[k] bytes; set[k] false: none),
 * sends everything; the decode must end in `want`. On Success the decode's metadata
 * must equal `expect` (elen bytes) and every KV byte must match the reference.
 */
static void room(env_t *e, uint64_t id, const uint8_t *const meta[2], const size_t len[2],
                 const bool set[2], kvw_room_state_t want, const uint8_t *expect, size_t elen,
                 const char *needle)
{
    kvt_rng_t rng = {id};
    kvt_req_spec_t spec = {.full_begin = 0, .full_end = 40, .swa_begin = 0, .swa_end = 40,
                           .state_slot = -1};
    kvt_req_pages_t sp, dp;
    CHECK(kvt_req_pages_make(&e->src[0], &spec, &rng, &sp) == 0, "source pages");
    CHECK(kvt_req_pages_make(&e->dst, &spec, &rng, &dp) == 0, "destination pages");
    kvt_copy_t expect_kv;
    kvt_copy_make(&e->dst, &expect_kv);
    kvw_receiver_h rcv = NULL;
    kvw_sender_h snd[2] = {NULL, NULL};
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = 40,
                            .pages = dp.side};
    CHECK(kvw_receiver_create(e->dctx, id, 0, &rcv) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_receiver_post(rcv, &post) == KVW_OK, "%s", kvw_last_error());
    size_t got = 99;
    uint8_t small[8];
    CHECK(kvw_receiver_metadata(rcv, small, sizeof(small), &got) == KVW_INPROGRESS && got == 0,
          "[%s] metadata before Success: %s", e->tl, kvw_last_error());
    kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = 40,
                          .chunk_begin = 0, .chunk_end = 40, .last_chunk = 1,
                          .pages = sp.side};
    for (int k = 0; k < 2; k++) {
        CHECK(kvw_sender_create(e->pctx[k], id, &snd[k]) == KVW_OK, "%s", kvw_last_error());
        if (set[k])
            CHECK(kvw_sender_set_metadata(snd[k], meta[k], len[k]) == KVW_OK, "[%s] set: %s",
                  e->tl, kvw_last_error());
        CHECK(kvw_sender_send(snd[k], &c) == KVW_OK, "%s", kvw_last_error());
        /* After the last chunk, metadata can no longer be attached. */
        uint8_t late = 1;
        kvw_status_t st = kvw_sender_set_metadata(snd[k], &late, 1);
        CHECK(st == KVW_ERR_INVALID_PARAM && kvt_contains(kvw_last_error(), "before the last chunk"),
              "[%s] late metadata: %s: %s", e->tl, kvw_status_string(st), kvw_last_error());
    }
    kvw_room_state_t s = kvw_room_wait(kvw_receiver_room(rcv), kvt_tmo_ms(60000));
    CHECK(s == want, "[%s] room %llu ended %s (want %s): %s", e->tl, (unsigned long long)id,
          kvw_room_state_string(s), kvw_room_state_string(want),
          kvw_room_failure(kvw_receiver_room(rcv)));
    if (s == KVW_ROOM_FAILED && needle)
        CHECK(kvt_contains(kvw_room_failure(kvw_receiver_room(rcv)), needle),
              "[%s] reason lacks '%s': %s",
              e->tl, needle, kvw_room_failure(kvw_receiver_room(rcv)));
    if (s == KVW_ROOM_FAILED) {
        kvw_status_t st = kvw_receiver_metadata(rcv, small, sizeof(small), &got);
        CHECK(st == kvw_room_status(kvw_receiver_room(rcv)), "[%s] metadata of a failed room: %s",
              e->tl,
              kvw_status_string(st));
    }
    if (s == KVW_ROOM_SUCCESS) {
        uint8_t *buf = malloc(elen + 16);
        memset(buf, 0xEE, elen + 16);
        CHECK(kvw_receiver_metadata(rcv, buf, elen + 16, &got) == KVW_OK, "%s", kvw_last_error());
        CHECK(got == elen && (elen == 0 || memcmp(buf, expect, elen) == 0),
              "[%s] room %llu: metadata of %zu bytes differs from the %zu sent", e->tl,
              (unsigned long long)id, got, elen);
        for (size_t i = elen; i < elen + 16; i++)
            CHECK(buf[i] == 0xEE, "[%s] metadata wrote past its length", e->tl);
        if (elen) {
            kvw_status_t st = kvw_receiver_metadata(rcv, buf, elen - 1, &got);
            CHECK(st == KVW_ERR_BUFFER_TOO_SMALL && got == elen,
                  "[%s] short buffer: %s, len %zu", e->tl, kvw_status_string(st), got);
        }
        free(buf);
        /* The KV bytes moved with it, exactly. */
        ip_ref(&model, e->src, 2, &sp.side, &e->dst, &dp.side, expect_kv.data, 40, NULL);
        char prefix[32];
        snprintf(prefix, sizeof(prefix), "[%s] ", e->tl);
        ip_verify(&e->dst, &expect_kv, prefix);
    }
    for (int k = 0; k < 2; k++) {
        kvw_room_wait(kvw_sender_room(snd[k]), kvt_tmo_ms(20000));
        kvw_room_destroy(kvw_sender_room(snd[k]));
    }
    kvw_room_destroy(kvw_receiver_room(rcv));
    kvt_copy_free(&expect_kv);
    kvt_req_pages_free(&sp);
    kvt_req_pages_free(&dp);
}

static void run(const char *tl)
{
    env_t e;
    memset(&e, 0, sizeof(e));
    e.tl = tl;
    CHECK(ip_rank(&model, 2, 0, 32, 2, &e.src[0]) == KVW_OK &&
              ip_rank(&model, 2, 1, 32, 2, &e.src[1]) == KVW_OK &&
              ip_rank(&model, 1, 0, 32, 2, &e.dst) == KVW_OK,
          "%s", kvw_last_error());
    kvt_rank_fill(&e.src[0], 31);
    kvt_rank_fill(&e.src[1], 32);
    kvt_rank_fill(&e.dst, 33);
    kvw_status_t st = make_ctx(&e.src[0], true, tl, "127.0.0.1:0", true, &e.pctx[0]);
    if (st == KVW_ERR_UNSUPPORTED) {
        printf("test_metadata: %s unavailable here, skipped: %s\n", tl, kvw_last_error());
        goto out;
    }
    CHECK(st == KVW_OK, "%s", kvw_last_error());
    if (st != KVW_OK)
        goto out;
    char bs[128];
    snprintf(bs, sizeof(bs), "%s", kvw_ctx_bootstrap_addr(e.pctx[0]));
    CHECK(make_ctx(&e.src[1], true, tl, bs, false, &e.pctx[1]) == KVW_OK, "%s", kvw_last_error());
    CHECK(make_ctx(&e.dst, false, tl, bs, false, &e.dctx) == KVW_OK, "%s", kvw_last_error());
    if (failures)
        goto out;

    enum { BIG = 6000 };
    static uint8_t a[BIG], b[BIG];
    fill_meta(a, BIG, 1);
    memcpy(b, a, BIG);
    b[BIG / 2] ^= 0x40; /* one bit apart */
    const uint8_t *m1[2] = {a, NULL}, *m2[2] = {a, a}, *m3[2] = {a, b};
    size_t l1[2] = {BIG, 0}, l2[2] = {BIG, BIG}, l0[2] = {0, 0};
    bool s1[2] = {true, false}, s2[2] = {true, true}, s0[2] = {false, false};
    room(&e, 1, m1, l1, s1, KVW_ROOM_SUCCESS, a, BIG, NULL);   /* one rank attaches */
    room(&e, 2, m2, l2, s2, KVW_ROOM_SUCCESS, a, BIG, NULL);   /* both, equal */
    room(&e, 3, m1, l0, s2, KVW_ROOM_SUCCESS, NULL, 0, NULL);  /* both, empty */
    room(&e, 4, m1, l0, s0, KVW_ROOM_SUCCESS, NULL, 0, NULL);  /* none */
    room(&e, 5, m3, l2, s2, KVW_ROOM_FAILED, NULL, 0, "disagree on the room's metadata");

    /* Too long is refused at once. */
    kvw_sender_h big = NULL;
    CHECK(kvw_sender_create(e.pctx[0], 6, &big) == KVW_OK, "%s", kvw_last_error());
    void *huge = calloc(1, KVW_MAX_ROOM_METADATA + 1);
    st = kvw_sender_set_metadata(big, huge, KVW_MAX_ROOM_METADATA + 1);
    CHECK(st == KVW_ERR_INVALID_PARAM && kvt_contains(kvw_last_error(), "exceeds"),
          "oversized metadata: %s: %s", kvw_status_string(st), kvw_last_error());
    CHECK(kvw_sender_set_metadata(big, huge, KVW_MAX_ROOM_METADATA) == KVW_OK, "%s",
          kvw_last_error());
    free(huge);
    kvw_room_destroy(kvw_sender_room(big));
out:
    kvw_ctx_destroy(e.dctx);
    kvw_ctx_destroy(e.pctx[1]);
    kvw_ctx_destroy(e.pctx[0]);
    kvt_rank_free(&e.src[0]);
    kvt_rank_free(&e.src[1]);
    kvt_rank_free(&e.dst);
}

int main(void)
{
    kvt_model_preset("gpt-oss-120b", &model);
    kvt_model_truncate(&model, 2);
    run("tcp");
    run("shm");
    return ip_summary("test_metadata");
}
