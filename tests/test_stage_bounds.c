/*
 * Staging requests are bounded per room: only a prefill rank that writes a room may ask
 * for staging space for it, and one window at a time. A decode context is driven
 * directly here (the fuzz harness's thread-less mini context, fuzz/fuzz_common.h), with
 * prefill TP2 -> decode TP1 peers plus a peer of another prefill DP group:
 *   - an honest request is granted (a STAGE_GRANT frame is queued for that peer);
 *   - with the area full, a second request of the same rank waits; a third one before
 *     the second was granted fails the room, naming the rank;
 *   - a request from a rank that does not write the room drops that rank's connection
 *     and leaves the room alone.
 */
#include "../fuzz/fuzz_common.h"
#include "inproc.h"


static kvt_model_t model;

static kvt_rank_t *rank_of(uint32_t tp, uint32_t rank, uint32_t dp_size, uint32_t dp_rank)
{
    kvt_rank_t *r = calloc(1, sizeof(*r));
    kvt_rank_spec_t s = {.model = &model, .layout = KVW_LAYOUT_NHD, .page_size = {16, 16},
                         .num_pages = {8, 8}, .num_slots = 1};
    s.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = tp, .tp_rank = rank,
                             .pp_size = 1,
                             .layer_end = model.m.num_layers, .dp_size = dp_size,
                             .dp_rank = dp_rank};
    if (r == NULL || kvt_rank_build(&s, r) != KVW_OK)
        fzc_fail("rank: %s", kvw_last_error());
    return r;
}

/* The type of the last frame queued for a peer (0: none). */
static uint8_t last_queued(const kvw_peer_t *p)
{
    const kvw_outmsg_t *m = p->out_head;
    while (m && m->next)
        m = m->next;
    return m ? m->w.p[5] : 0;
}

int main(void)
{
    if (kvt_model_preset("gpt-oss-120b", &model) || kvt_model_truncate(&model, 2))
        return 1;
    kvt_rank_t *d = rank_of(1, 0, 1, 0);
    kvt_rank_t *p0 = rank_of(2, 0, 2, 0), *p1 = rank_of(2, 1, 2, 0), *q = rank_of(2, 0, 2, 1);
    struct kvw_ctx *ctx = fzc_ctx_new(KVW_SIDE_DECODE, d->h);
    const uint64_t area = 64 << 10;
    ctx->stage.buf = malloc(area);
    ctx->stage.len = area;
    kvw_peer_t *a = fzc_peer_add(ctx, fzc_rank_clone(p0->h));
    kvw_peer_t *b = fzc_peer_add(ctx, fzc_rank_clone(p1->h));
    kvw_peer_t *other = fzc_peer_add(ctx, fzc_rank_clone(q->h)); /* DP group 1 */
    kvw_receiver_h rv = NULL;
    uint32_t pages[3] = {0, 1, 2}; /* 40 tokens in pages of 16, both pools from token 0 */
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = 40,
                            .pages = {.field_mask = KVW_SIDE_PAGES_FIELDS_ALL,
                                      .full = {KVW_PAGES_FIELDS_ALL, pages, 3,
                                               0}, .swa = {KVW_PAGES_FIELDS_ALL, pages, 3, 0},
                                      .state_slot = -1}};
    CHECK(kvw_receiver_create(ctx, 7, 0, &rv) == KVW_OK && kvw_receiver_post(rv, &post) == KVW_OK,
          "%s", kvw_last_error());
    fzc_ctx_drain_wake(ctx);

    pthread_mutex_lock(&ctx->mu);
    kvw_room_t *room = kvw__room_find(ctx, 7);
    if (room == NULL)
        fzc_fail("room 7 is not there");
    /* Honest: rank a asks for the whole area and gets it. */
    kvw__stage_ask(ctx, a, 7, area);
    CHECK(last_queued(a) == KVW_MSG_STAGE_GRANT, "no grant for an honest request (last frame %u)",
          last_queued(a));
    /* A rank of another DP group does not write room 7: its connection goes, the room
     * stays. */
    kvw__stage_ask(ctx, other, 7, 4096);
    CHECK(other->dead, "a rank that does not write the room asked for staging and stayed");
    CHECK(ctx->stage.num_waits == 0, "its request was queued anyway");
    /* Rank b waits for space (the area is full): one request may wait, not two. */
    kvw__stage_ask(ctx, b, 7, 4096);
    CHECK(ctx->stage.num_waits == 1 && !b->dead, "rank b's first request: %u waiting", ctx->stage.num_waits);
    kvw_room_state_t s = room->state;
    CHECK(s != KVW_ROOM_FAILED, "room failed early: %s", room->reason);
    kvw__stage_ask(ctx, b, 7, 4096);
    CHECK(room->state == KVW_ROOM_FAILED &&
              kvt_contains(room->reason, "again before its previous request was granted") &&
              kvt_contains(room->reason, b->desc),
          "second request before the grant: room %s: %s",
          kvw_room_state_string(room->state), room->reason);
    CHECK(!a->dead && !b->dead, "a room-level refusal dropped a connection");
    ctx->peer_timeout_ms = 1; /* nobody confirms the abort here */
    pthread_mutex_unlock(&ctx->mu);

    kvw_room_destroy(kvw_receiver_room(rv));
    kvw_ctx_destroy(ctx);
    kvt_rank_t *all[] = {d, p0, p1, q};
    for (int i = 0; i < 4; i++) {
        kvt_rank_free(all[i]);
        free(all[i]);
    }
    return ip_summary("test_stage_bounds");
}
