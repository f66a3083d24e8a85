/*
 * GPU KV caches over host transports (tcp, shm, ucx): the prefill gathers each staged
 * window on its GPU into pinned host memory, the window crosses the transport into the
 * decode's host staging area, and the decode scatters it on its GPU. Every combination
 * of memory kinds: GPU -> GPU, GPU -> host, host -> GPU, and host -> host as the control.
 *
 * Without a GPU it runs against the CPU stand-in of the CUDA module
 * (libkvwire_cuda_emu.so, through KVW_CUDA_MODULE, set by CMake): "GPU memory" is then
 * host memory and every kernel is the kernels' own address arithmetic run on the CPU,
 * so the protocol's side of it (no keys to GPU buffers, the forced staged path, the
 * windows and their pipelining, page-exact accounting) is checked everywhere. With
 * KVW_CUDA_MODULE pointing at the real module on a GPU machine, the same test moves
 * real device memory (scripts/gpu-check.sh runs it so).
 *
 * A small staging area (KVW_STAGING_MB=1: 256 KiB windows) cuts each room into many
 * windows. TP1 -> TP2 (head slices, several windows per layer) and TP2 -> TP1. Every
 * destination byte is compared with the test kit's reference, and every guard byte
 * around every buffer is checked.
 */
#include "testkit.h"
#include "inproc.h"

#include "cuda/module.h"

#include <kvwire/cuda.h>
#include <sys/wait.h>
#include <unistd.h>

static kvt_model_t model;

/* A rank of `model` whose buffers are GPU memory (dev set, the test kit's device copies)
 * or host memory. The host image keeps the device's bytes as of the last grank_pull. */
typedef struct grank {
    kvt_rank_t r;
    uint8_t ***dev; /* NULL: host memory */
} grank_t;

static kvw_status_t grank_make(uint32_t tp, uint32_t rank, bool gpu, uint64_t seed, grank_t *g)
{
    memset(g, 0, sizeof(*g));
    kvt_rank_spec_t s = {.model = &model, .layout = KVW_LAYOUT_NHD, .page_size = {16, 16},
                         .num_pages = {64, 64}, .num_slots = 2};
    s.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = tp, .tp_rank = rank,
                             .pp_size = 1, .layer_begin = 0,
                             .layer_end = model.m.num_layers, .dp_size = 1};
    kvw_status_t st = kvt_rank_build(&s, &g->r);
    if (st != KVW_OK)
        return st;
    kvt_rank_fill(&g->r, seed);
    char msg[512];
    if (gpu && kvt_gpu_attach(&g->r, 1, 0, &g->dev, msg, sizeof(msg)) != 0) {
        CHECK(0, "GPU copies of rank %u of %u: %s", rank, tp, msg);
        return KVW_ERR_INTERNAL;
    }
    return KVW_OK;
}

/* Copies the device bytes, guards included, back into the host image. */
static void grank_pull(grank_t *g)
{
    char msg[512];
    if (g->dev)
        CHECK(kvt_gpu_pull(&g->r, 1, g->dev, msg, sizeof(msg)) == 0, "%s", msg);
}

static void grank_free(grank_t *g)
{
    kvt_gpu_free(&g->r, 1, g->dev);
    kvt_rank_free(&g->r);
}

static kvw_status_t make_ctx_wait(const grank_t *g, kvw_side_t side, const char *tl,
                                  const char *bs, bool host, uint32_t wait_ms, kvw_ctx_h *ctx)
{
    kvw_ctx_params_t p = ip_params(side, &g->r, tl, bs, host);
    p.peer_timeout_ms = kvt_tmo_ms(10000);
    p.wait_timeout_ms = kvt_tmo_ms(wait_ms); /* given unscaled */
    return kvw_ctx_create(&p, ctx);
}

static kvw_status_t make_ctx(const grank_t *g, kvw_side_t side, const char *tl, const char *bs,
                             bool host, kvw_ctx_h *ctx)
{
    return make_ctx_wait(g, side, tl, bs, host, 60000, ctx);
}

/* One configuration: S prefill ranks (GPU or host) to D decode ranks, `rooms` rooms of
 * `tokens` tokens each. */
static void run(const char *tl, uint32_t S, bool src_gpu, uint32_t D, bool dst_gpu,
                uint64_t tokens)
{
    char what[160];
    snprintf(what, sizeof(what), "%s TP%u %s -> TP%u %s, %llu tokens", tl, S,
             src_gpu ? "GPU" : "host", D, dst_gpu ? "GPU" : "host", (unsigned long long)tokens);
    grank_t src[2], dst[2];
    kvw_ctx_h pctx[2] = {NULL, NULL}, dctx[2] = {NULL, NULL};
    memset(src, 0, sizeof(src));
    memset(dst, 0, sizeof(dst));
    kvw_status_t st = KVW_OK;
    for (uint32_t i = 0; i < S && st == KVW_OK; i++)
        st = grank_make(S, i, src_gpu, 100 + i, &src[i]);
    for (uint32_t i = 0; i < D && st == KVW_OK; i++)
        st = grank_make(D, i, dst_gpu, 200 + i, &dst[i]);
    CHECK(st == KVW_OK, "%s: ranks: %s", what, kvw_last_error());
    if (st != KVW_OK)
        goto out;
    st = make_ctx(&src[0], KVW_SIDE_PREFILL, tl, "127.0.0.1:0", true, &pctx[0]);
    if (st == KVW_ERR_UNSUPPORTED && strcmp(tl, "ucx") == 0) {
        printf("test_gpu_staged: %s: ucx unavailable here, skipped: %s\n", what,
               kvw_last_error());
        goto out;
    }
    CHECK(st == KVW_OK, "%s: prefill context: %s", what, kvw_last_error());
    if (st != KVW_OK)
        goto out;
    char bs[128];
    snprintf(bs, sizeof(bs), "%s", kvw_ctx_bootstrap_addr(pctx[0]));
    for (uint32_t i = 1; i < S; i++)
        CHECK(make_ctx(&src[i], KVW_SIDE_PREFILL, tl, bs, false, &pctx[i]) == KVW_OK,
              "%s: prefill context %u: %s", what, i, kvw_last_error());
    for (uint32_t i = 0; i < D; i++)
        CHECK(make_ctx(&dst[i], KVW_SIDE_DECODE, tl, bs, false, &dctx[i]) == KVW_OK,
              "%s: decode context %u: %s", what, i, kvw_last_error());
    if (failures)
        goto out;

    for (uint64_t room = 1; room <= 3; room++) {
        kvt_rng_t rng = {room * 7 + S * 3 + D};
        kvt_req_spec_t rs = {.full_begin = 0, .full_end = tokens, .swa_begin = 0,
                             .swa_end = tokens, .state_slot = -1};
        kvt_req_pages_t sp, dp;
        CHECK(kvt_req_pages_make(&src[0].r, &rs, &rng, &sp) == 0, "source pages");
        CHECK(kvt_req_pages_make(&dst[0].r, &rs, &rng, &dp) == 0, "destination pages");
        /* Expected decode contents: what each decode rank holds before the room, plus
         * what the reference writes (so a stray write anywhere shows). */
        kvt_copy_t expect[2];
        for (uint32_t i = 0; i < D; i++)
            kvt_copy_make(&dst[i].r, &expect[i]);
        kvw_receiver_h rcv[2] = {NULL, NULL};
        kvw_sender_h snd[2] = {NULL, NULL};
        kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = tokens,
                                .prefix_len = 0, .pages = dp.side};
        for (uint32_t i = 0; i < D; i++) {
            CHECK(kvw_receiver_create(dctx[i], room, 0, &rcv[i]) == KVW_OK, "%s",
                  kvw_last_error());
            CHECK(kvw_receiver_post(rcv[i], &post) == KVW_OK, "%s", kvw_last_error());
        }
        kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = tokens,
                              .chunk_begin = 0, .chunk_end = tokens,
                              .last_chunk = 1, .pages = sp.side};
        for (uint32_t i = 0; i < S; i++) {
            CHECK(kvw_sender_create(pctx[i], room, &snd[i]) == KVW_OK, "%s", kvw_last_error());
            CHECK(kvw_sender_send(snd[i], &c) == KVW_OK, "%s", kvw_last_error());
        }
        for (uint32_t i = 0; i < D; i++) {
            kvw_room_state_t rs_ = ip_wait_recv(rcv[i], kvt_tmo_ns(120ull * 1000000000ull));
            CHECK(rs_ == KVW_ROOM_SUCCESS, "%s: room %llu, decode rank %u ended %s: %s", what,
                  (unsigned long long)room, i, kvw_room_state_string(rs_),
                  kvw_room_failure(kvw_receiver_room(rcv[i])));
            kvw_room_metrics_t m = {.field_mask = KVW_ROOM_METRICS_FIELDS_ALL};
            kvw_room_metrics(kvw_receiver_room(rcv[i]), &m);
            if (src_gpu || dst_gpu)
                CHECK(m.path && strcmp(m.path, "staged") == 0, "%s: room %llu took the %s path",
                      what, (unsigned long long)room, m.path ? m.path : "(none)");
        }
        /* The reference reads the sources' host images: identical to their device copies,
         * which nothing writes. */
        kvt_rank_t srcs[2];
        for (uint32_t i = 0; i < S; i++)
            srcs[i] = src[i].r;
        for (uint32_t i = 0; i < D; i++) {
            grank_pull(&dst[i]);
            ip_ref(&model, srcs, S, &sp.side, &dst[i].r, &dp.side, expect[i].data, tokens,
                   NULL);
            char prefix[200];
            snprintf(prefix, sizeof(prefix), "%s: room %llu, decode rank %u: ", what,
                     (unsigned long long)room, i);
            ip_verify(&dst[i].r, &expect[i], prefix);
            kvt_copy_free(&expect[i]);
        }
        for (uint32_t i = 0; i < S; i++)
            kvw_room_destroy(kvw_sender_room(snd[i]));
        for (uint32_t i = 0; i < D; i++)
            kvw_room_destroy(kvw_receiver_room(rcv[i]));
        kvt_req_pages_free(&sp);
        kvt_req_pages_free(&dp);
    }
out:
    for (uint32_t i = 0; i < 2; i++) {
        kvw_ctx_destroy(dctx[i]);
        kvw_ctx_destroy(pctx[i]);
    }
    for (uint32_t i = 0; i < 2; i++) {
        grank_free(&src[i]);
        grank_free(&dst[i]);
    }
}

/*
 * Layer marks on CUDA events (kvw_sender_layers_ready_event), GPU -> GPU over `tl`: the
 * layers wait for their events (recorded out of order), an event already complete marks
 * at once, a room aborted with an event pending ends cleanly, and an event that never
 * completes fails the room at its timeout with the layers and the event named. The CPU
 * stand-in completes an event when it is recorded; the real module when the engine's
 * stream reaches it.
 */
static void events(const char *tl)
{
    grank_t src, dst;
    kvw_ctx_h pctx = NULL, dctx = NULL, pshort = NULL, dshort = NULL;
    CHECK(grank_make(1, 0, true, 300, &src) == KVW_OK && grank_make(1, 0, true, 301, &dst) ==
              KVW_OK, "%s", kvw_last_error());
    CHECK(make_ctx(&src, KVW_SIDE_PREFILL, tl, "127.0.0.1:0", true, &pctx) == KVW_OK, "%s",
          kvw_last_error());
    char bs[128];
    snprintf(bs, sizeof(bs), "%s", pctx ? kvw_ctx_bootstrap_addr(pctx) : "");
    CHECK(make_ctx(&dst, KVW_SIDE_DECODE, tl, bs, false, &dctx) == KVW_OK, "%s",
          kvw_last_error());
    if (failures)
        goto out;
    const uint64_t tokens = 300;
    kvt_rng_t rng = {77};
    kvt_req_spec_t rs = {.full_begin = 0, .full_end = tokens, .swa_begin = 0, .swa_end = tokens,
                         .state_slot = -1};
    kvt_req_pages_t sp, dp;
    CHECK(kvt_req_pages_make(&src.r, &rs, &rng, &sp) == 0 &&
              kvt_req_pages_make(&dst.r, &rs, &rng, &dp) == 0, "pages");
    kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = tokens,
                          .chunk_end = tokens, .last_chunk = 1,
                          .pages = sp.side};
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = tokens,
                            .pages = dp.side};
    void *ev[4] = {NULL, NULL, NULL, NULL};
    for (int i = 0; i < 4; i++)
        CHECK(kvw__cuda_event_create(&ev[i]) == KVW_OK, "%s", kvw_last_error());

    /* Room 1: both layers on pending events, recorded in reverse order. */
    kvt_copy_t expect;
    kvt_copy_make(&dst.r, &expect);
    kvw_receiver_h rcv = NULL;
    kvw_sender_h snd = NULL;
    CHECK(kvw_receiver_create(dctx, 1, 0, &rcv) == KVW_OK && kvw_receiver_post(rcv, &post) ==
              KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_sender_create(pctx, 1, &snd) == KVW_OK && kvw_sender_send_streamed(snd, &c) ==
              KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_sender_layers_ready_event(snd, 0, 1, ev[0]) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_sender_layers_ready_event(snd, 1, 2, ev[1]) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_sender_layers_ready_event(snd, 0, 3, ev[1]) == KVW_ERR_INVALID_PARAM,
          "a layer outside the stage was accepted");
    usleep(200000);
    kvw_room_state_t st = kvw_room_poll(kvw_receiver_room(rcv));
    CHECK(st != KVW_ROOM_SUCCESS && st != KVW_ROOM_FAILED,
          "%s: the room ended (%s) before its events completed", tl, kvw_room_state_string(st));
    CHECK(kvw__cuda_event_record(ev[1], NULL) == KVW_OK, "%s", kvw_last_error());
    usleep(100000);
    CHECK(kvw_room_poll(kvw_receiver_room(rcv)) != KVW_ROOM_SUCCESS,
          "%s: Success with layer 0 unmarked", tl);
    CHECK(kvw__cuda_event_record(ev[0], NULL) == KVW_OK, "%s", kvw_last_error());
    st = ip_wait_recv(rcv, kvt_tmo_ns(60ull * 1000000000ull));
    CHECK(st == KVW_ROOM_SUCCESS, "%s: events room ended %s: %s", tl, kvw_room_state_string(st),
          kvw_room_failure(kvw_receiver_room(rcv)));
    grank_pull(&dst);
    ip_ref(&model, &src.r, 1, &sp.side, &dst.r, &dp.side, expect.data, tokens, NULL);
    ip_verify(&dst.r, &expect, "events room: ");
    kvt_copy_free(&expect);
    kvw_room_destroy(kvw_sender_room(snd));
    kvw_room_destroy(kvw_receiver_room(rcv));

    /* Room 2: an event already complete marks at once; the other layer plainly. */
    CHECK(kvw_receiver_create(dctx, 2, 0, &rcv) == KVW_OK && kvw_receiver_post(rcv, &post) ==
              KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_sender_create(pctx, 2, &snd) == KVW_OK && kvw_sender_send_streamed(snd, &c) ==
              KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_sender_layers_ready_event(snd, 1, 2, ev[0]) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_sender_layers_ready(snd, 0, 1) == KVW_OK, "%s", kvw_last_error());
    st = ip_wait_recv(rcv, kvt_tmo_ns(60ull * 1000000000ull));
    CHECK(st == KVW_ROOM_SUCCESS, "%s: room 2 ended %s: %s", tl, kvw_room_state_string(st),
          kvw_room_failure(kvw_receiver_room(rcv)));
    kvw_room_destroy(kvw_sender_room(snd));
    kvw_room_destroy(kvw_receiver_room(rcv));

    /* Room 3: aborted while its event is pending; recording it later changes nothing. */
    CHECK(kvw_receiver_create(dctx, 3, 0, &rcv) == KVW_OK && kvw_receiver_post(rcv, &post) ==
              KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_sender_create(pctx, 3, &snd) == KVW_OK && kvw_sender_send_streamed(snd, &c) ==
              KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_sender_layers_ready_event(snd, 0, 2, ev[2]) == KVW_OK, "%s", kvw_last_error());
    kvw_room_abort(kvw_sender_room(snd));
    CHECK(kvw__cuda_event_record(ev[2], NULL) == KVW_OK, "%s", kvw_last_error());
    usleep(100000);
    CHECK(kvw_room_poll(kvw_sender_room(snd)) == KVW_ROOM_FAILED, "%s: aborted room is %s", tl,
          kvw_room_state_string(kvw_room_poll(kvw_sender_room(snd))));
    st = ip_wait_recv(rcv, kvt_tmo_ns(60ull * 1000000000ull));
    CHECK(st == KVW_ROOM_FAILED, "%s: decode of the aborted room ended %s", tl,
          kvw_room_state_string(st));
    kvw_room_destroy(kvw_sender_room(snd));
    kvw_room_destroy(kvw_receiver_room(rcv));

    /* Room 4, own contexts with a 1.5 s wait: an event that never completes. */
    CHECK(make_ctx_wait(&src, KVW_SIDE_PREFILL, tl, "127.0.0.1:0", true, 1500, &pshort) ==
              KVW_OK, "%s", kvw_last_error());
    snprintf(bs, sizeof(bs), "%s", pshort ? kvw_ctx_bootstrap_addr(pshort) : "");
    CHECK(make_ctx(&dst, KVW_SIDE_DECODE, tl, bs, false, &dshort) == KVW_OK, "%s",
          kvw_last_error());
    if (pshort && dshort) {
        CHECK(kvw_receiver_create(dshort, 4, 0, &rcv) == KVW_OK &&
                  kvw_receiver_post(rcv, &post) == KVW_OK, "%s", kvw_last_error());
        CHECK(kvw_sender_create(pshort, 4, &snd) == KVW_OK &&
                  kvw_sender_send_streamed(snd, &c) == KVW_OK, "%s", kvw_last_error());
        CHECK(kvw_sender_layers_ready(snd, 0, 1) == KVW_OK, "%s", kvw_last_error());
        CHECK(kvw_sender_layers_ready_event(snd, 1, 2, ev[3]) == KVW_OK, "%s",
              kvw_last_error());
        st = kvw_room_wait(kvw_sender_room(snd), kvt_tmo_ms(30000));
        CHECK(kvw_room_poll(kvw_sender_room(snd)) == KVW_ROOM_FAILED &&
                  kvt_contains(kvw_room_failure(kvw_sender_room(snd)), "timed out") &&
                  kvt_contains(kvw_room_failure(kvw_sender_room(snd)), "waits for layer 1") &&
                  kvt_contains(kvw_room_failure(kvw_sender_room(snd)), "CUDA event"),
              "%s: never-complete event: %s: %s", tl,
              kvw_room_state_string(kvw_room_poll(kvw_sender_room(snd))),
              kvw_room_failure(kvw_sender_room(snd)));
        kvw_room_destroy(kvw_sender_room(snd));
        kvw_room_destroy(kvw_receiver_room(rcv));
    }
    kvt_req_pages_free(&sp);
    kvt_req_pages_free(&dp);
    kvw_ctx_destroy(dshort);
    kvw_ctx_destroy(pshort);
    kvw_ctx_destroy(dctx);
    kvw_ctx_destroy(pctx);
    for (int i = 0; i < 4; i++)
        if (ev[i])
            kvw__cuda_event_destroy(ev[i]);
    pctx = dctx = NULL;
out:
    kvw_ctx_destroy(dctx);
    kvw_ctx_destroy(pctx);
    grank_free(&src);
    grank_free(&dst);
}

/* Refusals: a decode without a staging area cannot take GPU buffers over tcp, and a
 * rank mixing GPU and host buffers is refused with the buffer named. */
static void refusals(void)
{
    grank_t g;
    CHECK(grank_make(1, 0, true, 1, &g) == KVW_OK, "%s", kvw_last_error());
    setenv("KVW_STAGING_MB", "0", 1);
    kvw_ctx_h ctx = NULL;
    kvw_ctx_params_t p = ip_params(KVW_SIDE_DECODE, &g.r, "tcp", NULL, false);
    p.field_mask &= ~(uint64_t)(KVW_CTX_FIELD_BOOTSTRAP | KVW_CTX_FIELD_HOST_BOOTSTRAP);
    kvw_status_t st = kvw_ctx_create(&p, &ctx);
    CHECK(st == KVW_ERR_INVALID_PARAM && kvt_contains(kvw_last_error(), "KVW_STAGING_MB=0"),
          "decode with GPU buffers and no staging: %s: %s", kvw_status_string(st),
          kvw_last_error());
    kvw_ctx_destroy(st == KVW_OK ? ctx : NULL);
    setenv("KVW_STAGING_MB", "1", 1);
    grank_free(&g);

    /* Buffer 1 on the host, the rest on the GPU. */
    grank_t m;
    memset(&m, 0, sizeof(m));
    kvt_rank_spec_t s = {.model = &model, .layout = KVW_LAYOUT_NHD, .page_size = {16, 16},
                         .num_pages = {8, 8}, .num_slots = 2};
    s.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = 1, .pp_size = 1,
                             .layer_end = model.m.num_layers,
                             .dp_size = 1};
    CHECK(kvt_rank_describe(&s, &m.r) == KVW_OK, "%s", kvw_last_error());
    /* Buffer 0 in (emulated) device memory: rank creation checks the kind of every
     * address it is given. */
    void *dev0 = NULL;
    CHECK(kvt_cuda_malloc(m.r.alloc_len[0], &dev0) == KVW_OK, "malloc: %s", kvt_cuda_error());
    m.r.bufs[0].addr = dev0;
    m.r.bufs[0].mem_kind = KVW_MEM_CUDA;
    m.r.bufs[0].device = 0;
    CHECK(kvt_rank_open(&m.r) == KVW_OK, "%s", kvw_last_error());
    p = ip_params(KVW_SIDE_DECODE, &m.r, "tcp", NULL, false);
    p.field_mask &= ~(uint64_t)(KVW_CTX_FIELD_BOOTSTRAP | KVW_CTX_FIELD_HOST_BOOTSTRAP);
    st = kvw_ctx_create(&p, &ctx);
    CHECK(st == KVW_ERR_UNSUPPORTED && kvt_contains(kvw_last_error(), "buffer 1 is host memory"),
          "mixed memory kinds: %s: %s", kvw_status_string(st), kvw_last_error());
    kvw_ctx_destroy(st == KVW_OK ? ctx : NULL);
    kvt_rank_free(&m.r);
    if (dev0)
        kvt_cuda_free(dev0);
}

/*
 * KV verification on GPU buffers: contexts on GPU buffers take the setting (the parameter
 * and KVW_VERIFY alike), and a GPU prefill rank's room to a host decode rank that
 * verifies it succeeds and is counted verified: the prefill's digest came from the CUDA
 * module (here the CPU stand-in, running the kernel's code) and matched the decode's,
 * computed by the CPU. (test_verify_gpu_* fault such rooms.)
 */
static void verify_gpu(const char *tl)
{
    grank_t g, h;
    CHECK(grank_make(1, 0, true, 5, &g) == KVW_OK && grank_make(1, 0, false, 6, &h) == KVW_OK,
          "%s", kvw_last_error());
    kvw_ctx_params_t p = ip_params(KVW_SIDE_DECODE, &g.r, tl, NULL, false);
    p.field_mask &= ~(uint64_t)(KVW_CTX_FIELD_BOOTSTRAP | KVW_CTX_FIELD_HOST_BOOTSTRAP);
    p.field_mask |= KVW_CTX_FIELD_VERIFY;
    p.verify = "every";
    kvw_ctx_h ctx = NULL;
    kvw_status_t st = kvw_ctx_create(&p, &ctx);
    CHECK(st == KVW_OK && ctx != NULL, "%s: GPU decode with verify: %s: %s", tl,
          kvw_status_string(st), kvw_last_error());
    kvw_ctx_destroy(st == KVW_OK ? ctx : NULL);
    ctx = NULL;
    setenv("KVW_VERIFY", "sample:0.5", 1);
    kvw_ctx_params_t pp = ip_params(KVW_SIDE_PREFILL, &g.r, tl, "127.0.0.1:0", true);
    st = kvw_ctx_create(&pp, &ctx);
    CHECK(st == KVW_OK && ctx != NULL, "%s: GPU prefill with KVW_VERIFY: %s: %s", tl,
          kvw_status_string(st), kvw_last_error());
    kvw_ctx_destroy(st == KVW_OK ? ctx : NULL);
    ctx = NULL;
    unsetenv("KVW_VERIFY");

    /* A GPU prefill (verification off) and a host decode that verifies half its rooms. */
    kvw_ctx_h pctx = NULL, dctx = NULL;
    st = make_ctx(&g, KVW_SIDE_PREFILL, tl, "127.0.0.1:0", true, &pctx);
    if (st == KVW_ERR_UNSUPPORTED && strcmp(tl, "ucx") == 0)
        goto out;
    CHECK(st == KVW_OK, "%s: prefill: %s", tl, kvw_last_error());
    if (st != KVW_OK)
        goto out;
    char bs[128];
    snprintf(bs, sizeof(bs), "%s", kvw_ctx_bootstrap_addr(pctx));
    kvw_ctx_params_t dp = ip_params(KVW_SIDE_DECODE, &h.r, tl, bs, false);
    dp.peer_timeout_ms = kvt_tmo_ms(10000);
    dp.wait_timeout_ms = kvt_tmo_ms(60000);
    dp.field_mask |= KVW_CTX_FIELD_VERIFY;
    dp.verify = "every";
    CHECK(kvw_ctx_create(&dp, &dctx) == KVW_OK, "%s: host decode with verify: %s", tl,
          kvw_last_error());
    if (dctx == NULL)
        goto out;
    kvt_rng_t rng = {77};
    kvt_req_spec_t rs = {.full_begin = 0, .full_end = 100, .swa_begin = 0, .swa_end = 100,
                         .state_slot = -1};
    kvt_req_pages_t sp, dpg;
    CHECK(kvt_req_pages_make(&g.r, &rs, &rng, &sp) == 0 &&
              kvt_req_pages_make(&h.r, &rs, &rng, &dpg) == 0, "pages");
    kvw_receiver_h rcv = NULL;
    kvw_sender_h snd = NULL;
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = 100,
                            .pages = dpg.side};
    CHECK(kvw_receiver_create(dctx, 900, 0, &rcv) == KVW_OK &&
              kvw_receiver_post(rcv, &post) == KVW_OK, "%s", kvw_last_error());
    kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = 100,
                          .chunk_end = 100, .last_chunk = 1, .pages = sp.side};
    CHECK(kvw_sender_create(pctx, 900, &snd) == KVW_OK && kvw_sender_send(snd, &c) == KVW_OK,
          "%s", kvw_last_error());
    kvw_room_state_t ds = rcv ? ip_wait_recv(rcv, kvt_tmo_ns(120ull * 1000000000ull))
                              : KVW_ROOM_FAILED;
    kvw_room_state_t ps = snd ? kvw_room_wait(kvw_sender_room(snd), kvt_tmo_ms(120000))
                              : KVW_ROOM_FAILED;
    const char *dwhy = rcv ? kvw_room_failure(kvw_receiver_room(rcv)) : "";
    const char *pwhy = snd ? kvw_room_failure(kvw_sender_room(snd)) : "";
    CHECK(ds == KVW_ROOM_SUCCESS, "%s: verified room from a GPU prefill: decode ended %s: %s",
          tl, kvw_room_state_string(ds), dwhy);
    CHECK(ps == KVW_ROOM_SUCCESS, "%s: verified room from a GPU prefill: prefill ended %s: %s",
          tl, kvw_room_state_string(ps), pwhy);
    kvw_ctx_metrics_t m = {.field_mask = KVW_CTX_METRICS_FIELD_ROOMS_VERIFIED};
    CHECK(kvw_ctx_metrics(dctx, &m) == KVW_OK && m.rooms_verified == 1,
          "%s: %llu rooms counted verified", tl, (unsigned long long)m.rooms_verified);
    if (snd)
        kvw_room_destroy(kvw_sender_room(snd));
    if (rcv)
        kvw_room_destroy(kvw_receiver_room(rcv));
    kvt_req_pages_free(&sp);
    kvt_req_pages_free(&dpg);
out:
    kvw_ctx_destroy(dctx);
    kvw_ctx_destroy(pctx);
    grank_free(&g);
    grank_free(&h);
}

/*
 * The test kit's CUDA helpers (tools/testkit/cuda_mod.c) load the module by the
 * library's rule: a module the library refuses, they refuse with the same reason. Runs
 * in a child that has loaded nothing yet: KVW_CUDA_MODULE `module`, and the stand-in's
 * table claiming ABI `abi` when not NULL.
 */
static void kit_refusal(const char *module, const char *abi, const char *reason)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        setenv("KVW_CUDA_MODULE", module, 1);
        if (abi)
            setenv("KVW_CUDA_EMU_ABI", abi, 1);
        void *p = NULL;
        kvw_status_t st = kvt_cuda_malloc(64, &p);
        int bad = st != KVW_ERR_UNSUPPORTED || !kvt_contains(kvt_cuda_error(), reason);
        if (bad)
            fprintf(stderr, "test kit: %s: %s\n", kvw_status_string(st), kvt_cuda_error());
        st = kvw_cuda_available();
        if (st != KVW_ERR_UNSUPPORTED || !kvt_contains(kvw_last_error(), reason)) {
            fprintf(stderr, "library: %s: %s\n", kvw_status_string(st), kvw_last_error());
            bad = 1;
        }
        _exit(bad);
    }
    int ws = 0;
    CHECK(pid > 0 && waitpid(pid, &ws, 0) == pid && WIFEXITED(ws) && WEXITSTATUS(ws) == 0,
          "module %s, ABI %s: the test kit and the library did not both refuse it with \"%s\"",
          module, abi ? abi : "as built", reason);
}

/* The test kit's CUDA helpers on the module this test runs with: device memory set,
 * copied both ways and compared byte for byte; refusals carry the module's reason. */
static void kit(bool emu)
{
    uint8_t host[256], back[256], want[256];
    for (int i = 0; i < 256; i++)
        host[i] = (uint8_t)(i * 7 + 1);
    memcpy(want, host, sizeof(want));
    memset(want + 16, 0xa5, 32);
    memset(back, 0, sizeof(back));
    void *d = NULL, *stream = NULL;
    CHECK(kvt_cuda_set_device(0) == KVW_OK, "set_device: %s", kvt_cuda_error());
    CHECK(kvt_cuda_malloc(sizeof(host), &d) == KVW_OK, "malloc: %s", kvt_cuda_error());
    CHECK(kvt_cuda_stream_create(&stream) == KVW_OK, "stream: %s", kvt_cuda_error());
    if (d && stream) {
        CHECK(kvt_cuda_memcpy(d, host, sizeof(host), NULL) == KVW_OK &&
                  kvt_cuda_memset((uint8_t *)d + 16, 0xa5, 32, stream) == KVW_OK &&
                  kvt_cuda_stream_sync(stream) == KVW_OK &&
                  kvt_cuda_memcpy(back, d, sizeof(back), stream) == KVW_OK &&
                  kvt_cuda_stream_sync(stream) == KVW_OK,
              "copies: %s", kvt_cuda_error());
        CHECK(memcmp(back, want, sizeof(want)) == 0, "device bytes differ from the reference");
    }
    kvw_status_t st = kvt_cuda_set_device(-1);
    CHECK(st != KVW_OK && kvt_contains(kvt_cuda_error(), "set_device: "),
          "set_device(-1): %s: %s", kvw_status_string(st), kvt_cuda_error());
    if (emu && d) {
        kvt_cuda_ipc_handle_t h;
        st = kvt_cuda_ipc_export(d, &h);
        CHECK(st == KVW_ERR_UNSUPPORTED &&
                  strcmp(kvt_cuda_error(), "ipc_export: the emulated device has no IPC "
                                          "(KVW_CUDA_EMU_IPC=1 gives it some)") == 0,
              "ipc_export on the stand-in: %s: %s", kvw_status_string(st), kvt_cuda_error());
    }
    CHECK(kvt_cuda_set_device(0) == KVW_OK, "set_device: %s", kvt_cuda_error());
    if (stream)
        CHECK(kvt_cuda_stream_destroy(stream) == KVW_OK, "%s", kvt_cuda_error());
    if (d)
        CHECK(kvt_cuda_free(d) == KVW_OK, "%s", kvt_cuda_error());
}

int main(void)
{
    /* Before this process loads the module: the refusals, each in a child. */
    const char *mod = getenv("KVW_CUDA_MODULE");
    bool emu = mod && strstr(mod, "cuda_emu");
    kit_refusal("/nonexistent-kvwire/libkvwire_cuda.so", NULL,
                "/nonexistent-kvwire/libkvwire_cuda.so: cannot open shared object file");
    if (emu)
        kit_refusal(mod, "9999", "the CUDA module was built for ABI 9999 (table of");
    if (kvw_cuda_available() != KVW_OK) {
        printf("test_gpu_staged: skipped: no CUDA module or device: %s\n", kvw_last_error());
        return 77;
    }
    if (ip_model("test_gpu_staged", &model) != 0)
        return 1;
    setenv("KVW_STAGING_MB", "1", 1);
    const char *tls[] = {"tcp", "shm", "ucx"};
    for (size_t t = 0; t < 3; t++) {
        run(tls[t], 1, true, 1, true, 700);
        run(tls[t], 1, true, 2, true, 531);
        run(tls[t], 2, true, 1, true, 300);
        run(tls[t], 1, true, 2, false, 531);
        run(tls[t], 2, false, 1, true, 300);
    }
    run("tcp", 1, false, 1, false, 700);
    /* A created, never recorded event is pending on the CPU stand-in; CUDA counts it
     * complete, and holding one back on a GPU needs a blocked stream. */
    if (emu) {
        events("tcp");
        events("shm");
    } else {
        printf("test_gpu_staged: event cases run on the CPU stand-in only\n");
    }
    refusals();
    verify_gpu("tcp");
    verify_gpu("shm");
    kit(emu);
    return ip_summary("test_gpu_staged");
}
