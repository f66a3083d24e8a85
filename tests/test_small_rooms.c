/*
 * Small rooms on the host transports (tcp, shm). A small room that a request makes ready
 * is served by the prefill's control thread itself (kvw__ctrl_serve), larger ones by the
 * workers, and the decode writes a room's confirmation after waking its waiter. Rooms of
 * both kinds, in random order, armed before the decode posts (the control thread's case:
 * the request finds the chunk there) or after; one room id used again as soon as its
 * last room ended on both sides. Every room must reach Success on both sides, every
 * destination byte must match the test kit's reference, the guard bytes around the
 * buffers must be intact, and pages outside the room must keep their bytes.
 *
 * Exit: 0 pass, 1 fail.
 */
#include "testkit.h"
#include "inproc.h"

#include <kvwire/xfer.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ROOMS 40
#define PAGES 64
#define WAIT_MS kvt_tmo_ms(30000) /* generous: a loaded 2-core machine, sanitizers */

static kvt_model_t model;

static kvw_room_state_t wait_end(kvw_room_h room)
{
    return kvw_room_wait(room, WAIT_MS);
}

static void one_tl(const char *tl)
{
    kvt_rank_t src = {0}, dst = {0};
    CHECK(ip_rank(&model, 1, 0, PAGES, 1, &src) == KVW_OK &&
              ip_rank(&model, 1, 0, PAGES, 1, &dst) == KVW_OK,
          "%s: %s", tl, kvw_last_error());
    if (failures)
        return;
    kvt_rank_fill(&src, 11);
    kvt_rank_fill(&dst, 12);
    kvw_ctx_h pctx = NULL, dctx = NULL;
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, &src, tl, "127.0.0.1:0", true);
    p.bootstrap_timeout_ms = kvt_tmo_ms(20000);
    p.wait_timeout_ms = kvt_tmo_ms(30000);
    CHECK(kvw_ctx_create(&p, &pctx) == KVW_OK, "%s prefill: %s", tl, kvw_last_error());
    char bs[128];
    if (pctx) {
        ip_params_decode(&p, pctx, &dst, bs, sizeof(bs));
        CHECK(kvw_ctx_create(&p, &dctx) == KVW_OK, "%s decode: %s", tl, kvw_last_error());
    }
    /* What the decode buffers must hold at the end: their initial bytes, with every
     * room's pages overwritten by the reference in order. */
    kvt_copy_t expect;
    kvt_copy_make(&dst, &expect);
    kvt_rng_t rng = {0x5a11 + (uint64_t)tl[0]};
    for (uint32_t i = 0; i < ROOMS && dctx && failures == 0; i++) {
        /* 1 to 6 tokens (the control thread's) or 300 to 500 (the workers'). */
        bool small = kvt_rng_next(&rng) % 3 != 0;
        uint64_t tokens = small ? 1 + kvt_rng_next(&rng) % 6 : 300 + kvt_rng_next(&rng) % 201;
        bool armed_first = kvt_rng_next(&rng) % 2 == 0;
        uint64_t id = i % 4 == 0 ? 7 : 1000 + i; /* room 7 again and again */
        kvt_req_spec_t rs = {.full_begin = 0, .full_end = tokens, .swa_begin = 0,
                             .swa_end = tokens, .state_slot = -1};
        kvt_req_pages_t sp, dp;
        CHECK(kvt_req_pages_make(&src, &rs, &rng, &sp) == 0, "source pages");
        CHECK(kvt_req_pages_make(&dst, &rs, &rng, &dp) == 0, "destination pages");
        if (failures)
            break;
        kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = tokens,
                              .chunk_begin = 0, .chunk_end = tokens, .last_chunk = 1,
                              .pages = sp.side};
        kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = tokens,
                                .prefix_len = 0, .pages = dp.side};
        kvw_sender_h snd = NULL;
        kvw_receiver_h rcv = NULL;
        if (armed_first) {
            CHECK(kvw_sender_create(pctx, id, &snd) == KVW_OK, "%s", kvw_last_error());
            CHECK(kvw_sender_send(snd, &c) == KVW_OK, "%s", kvw_last_error());
        }
        CHECK(kvw_receiver_create(dctx, id, 0, &rcv) == KVW_OK, "%s", kvw_last_error());
        CHECK(kvw_receiver_post(rcv, &post) == KVW_OK, "%s", kvw_last_error());
        if (!armed_first) {
            CHECK(kvw_sender_create(pctx, id, &snd) == KVW_OK, "%s", kvw_last_error());
            CHECK(kvw_sender_send(snd, &c) == KVW_OK, "%s", kvw_last_error());
        }
        kvw_room_state_t ds = wait_end(kvw_receiver_room(rcv));
        kvw_room_state_t ps = wait_end(kvw_sender_room(snd));
        CHECK(ds == KVW_ROOM_SUCCESS, "%s room %u (id %llu, %llu tokens, %s): decode %s: %s", tl,
              i, (unsigned long long)id, (unsigned long long)tokens,
              armed_first ? "armed first" : "posted first", kvw_room_state_string(ds),
              kvw_room_failure(kvw_receiver_room(rcv)));
        CHECK(ps == KVW_ROOM_SUCCESS, "%s room %u (id %llu, %llu tokens): prefill %s: %s", tl, i,
              (unsigned long long)id, (unsigned long long)tokens, kvw_room_state_string(ps),
              kvw_room_failure(kvw_sender_room(snd)));
        kvw_room_metrics_t m = {.field_mask = KVW_ROOM_METRICS_FIELDS_ALL};
        CHECK(kvw_room_metrics(kvw_receiver_room(rcv), &m) == KVW_OK && m.bytes > 0,
              "%s room %u: %llu bytes confirmed", tl, i, (unsigned long long)m.bytes);
        ip_ref(&model, &src, 1, &sp.side, &dst, &dp.side, expect.data, tokens, NULL);
        char prefix[96];
        snprintf(prefix, sizeof(prefix), "%s room %u (%llu tokens): ", tl, i,
                 (unsigned long long)tokens);
        ip_verify(&dst, &expect, prefix);
        kvw_room_destroy(kvw_sender_room(snd));
        kvw_room_destroy(kvw_receiver_room(rcv));
        kvt_req_pages_free(&sp);
        kvt_req_pages_free(&dp);
    }
    kvt_copy_free(&expect);
    kvw_ctx_destroy(dctx);
    kvw_ctx_destroy(pctx);
    kvt_rank_free(&src);
    kvt_rank_free(&dst);
}

int main(void)
{
    /* One MLA layer: a few tokens are a few KiB in whole-page runs, the direct path. */
    if (kvt_model_preset("deepseek-v3", &model) || kvt_model_truncate(&model, 1)) {
        fprintf(stderr, "test_small_rooms: no deepseek-v3 preset\n");
        return 1;
    }
    one_tl("tcp");
    one_tl("shm");
    return ip_summary("test_small_rooms");
}
