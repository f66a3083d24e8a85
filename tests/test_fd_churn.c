/*
 * Register-and-leave churn against one long-lived prefill context: 300 decode contexts
 * (tcp; 100 more over shm) register and are destroyed one after another. Once the
 * prefill rank has noticed each departure it must hold no fd, endpoint or mapping for
 * it: the process's fd count does not exceed what it was before the churn (the test waits up
 * to 30 s for the last departures to be noticed), and a room still moves verified bytes
 * afterwards.
 *
 * Exit: 0 pass, 1 fail.
 */
#include "testkit.h"

#include <kvwire/xfer.h>

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int failures;
#define CHECK(c, ...)                                                                    \
    do {                                                                                 \
        if (!(c)) {                                                                      \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #c);       \
            fprintf(stderr, __VA_ARGS__);                                                \
            fprintf(stderr, "\n");                                                       \
            failures++;                                                                  \
        }                                                                                \
    } while (0)

#define TOKENS 48

static kvt_model_t model;

static int count_fds(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    if (d == NULL)
        return -1;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        n += e->d_name[0] != '.';
    closedir(d);
    return n - 1; /* the directory's own fd */
}

static kvw_status_t make_rank(kvt_rank_t *r)
{
    kvt_rank_spec_t s = {.model = &model, .layout = KVW_LAYOUT_NHD, .page_size = {16, 16},
                         .num_pages = {8, 8}, .num_slots = 1};
    s.par = (kvw_parallel_t){.tp_size = 1, .tp_rank = 0, .pp_size = 1, .layer_begin = 0,
                             .layer_end = model.m.num_layers, .dp_size = 1};
    return kvt_rank_build(&s, r);
}

/* One verified room (proves the prefill context still serves after the churn). */
static void one_room(kvw_ctx_h pctx, kvt_rank_t *src, kvw_ctx_h dctx, kvt_rank_t *dst)
{
    kvt_rng_t rng = {9};
    kvt_req_spec_t rs = {.full_begin = 0, .full_end = TOKENS, .swa_begin = 0,
                         .swa_end = TOKENS, .state_slot = -1};
    kvt_req_pages_t sp, dp;
    CHECK(kvt_req_pages_make(src, &rs, &rng, &sp) == 0, "source pages");
    CHECK(kvt_req_pages_make(dst, &rs, &rng, &dp) == 0, "destination pages");
    kvt_copy_t expect;
    kvt_copy_make(dst, &expect);
    kvw_receiver_h rcv = NULL;
    kvw_sender_h snd = NULL;
    kvw_recv_post_t post = {.num_tokens = TOKENS, .prefix_len = 0, .pages = dp.side};
    CHECK(kvw_receiver_create(dctx, 1, 0, &rcv) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_receiver_post(rcv, &post) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_sender_create(pctx, 1, &snd) == KVW_OK, "%s", kvw_last_error());
    kvw_send_chunk_t c = {.num_tokens = TOKENS, .chunk_begin = 0, .chunk_end = TOKENS,
                          .last_chunk = 1, .pages = sp.side};
    CHECK(kvw_sender_send(snd, &c) == KVW_OK, "%s", kvw_last_error());
    uint64_t t0 = kvt_now_ns();
    kvw_room_state_t st;
    while ((st = kvw_receiver_poll(rcv)) != KVW_ROOM_SUCCESS && st != KVW_ROOM_FAILED &&
           kvt_now_ns() - t0 < 30000000000ull)
        usleep(1000);
    CHECK(st == KVW_ROOM_SUCCESS, "room ended %s: %s", kvw_room_state_string(st),
          kvw_receiver_failure(rcv));
    uint8_t **sdata = calloc(src->num_bufs, sizeof(uint8_t *));
    for (uint32_t b = 0; b < src->num_bufs; b++)
        sdata[b] = kvt_rank_data(src, b);
    kvt_ref_side_t ss = kvt_ref_side(src, &sp.side, sdata);
    kvt_ref_side_t ds = kvt_ref_side(dst, &dp.side, expect.data);
    kvw_chunk_t chunk = {.num_tokens = TOKENS, .chunk_end = TOKENS, .last_chunk = 1};
    char msg[512];
    CHECK(kvt_ref_transfer(&model.m, &ss, 1, &ds, &chunk, NULL, NULL, msg, sizeof(msg)) == 0,
          "%s", msg);
    CHECK(kvt_copy_compare(dst, &expect, "decode", msg, sizeof(msg)) == 0, "%s", msg);
    CHECK(kvt_rank_check_guards(dst, msg, sizeof(msg)) == 0, "%s", msg);
    free(sdata);
    kvw_sender_destroy(snd);
    kvw_receiver_destroy(rcv);
    kvt_copy_free(&expect);
    kvt_req_pages_free(&sp);
    kvt_req_pages_free(&dp);
}

static void churn(const char *tl, int cycles)
{
    kvt_rank_t src = {0}, dst = {0};
    CHECK(make_rank(&src) == KVW_OK && make_rank(&dst) == KVW_OK, "%s", kvw_last_error());
    kvt_rank_fill(&src, 1);
    kvt_rank_fill(&dst, 2);
    kvw_ctx_h pctx = NULL, dctx = NULL;
    kvw_ctx_params_t p = {.field_mask = KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK |
                                        KVW_CTX_FIELD_TRANSPORT | KVW_CTX_FIELD_BOOTSTRAP |
                                        KVW_CTX_FIELD_HOST_BOOTSTRAP | KVW_CTX_FIELD_TIMEOUTS,
                          .side = KVW_SIDE_PREFILL, .rank = src.h, .transport = tl,
                          .bootstrap_addr = "127.0.0.1:0", .host_bootstrap = 1,
                          .bootstrap_timeout_ms = 10000};
    CHECK(kvw_ctx_create(&p, &pctx) == KVW_OK, "prefill: %s", kvw_last_error());
    if (pctx == NULL)
        return;
    char bs[128];
    snprintf(bs, sizeof(bs), "%s", kvw_ctx_bootstrap_addr(pctx));
    p.side = KVW_SIDE_DECODE;
    p.rank = dst.h;
    p.bootstrap_addr = bs;
    p.host_bootstrap = 0;
    int base = count_fds();
    int ok = 0;
    for (int i = 0; i < cycles; i++) {
        if (kvw_ctx_create(&p, &dctx) != KVW_OK) {
            CHECK(0, "cycle %d: %s", i, kvw_last_error());
            break;
        }
        kvw_ctx_destroy(dctx);
        ok++;
    }
    /* The prefill rank notices each departure asynchronously (closed socket). */
    int now = count_fds();
    for (uint64_t t0 = kvt_now_ns(); now > base && kvt_now_ns() - t0 < 30000000000ull;
         now = count_fds())
        usleep(10000);
    CHECK(now <= base, "%s: %d fds before %d register-and-leave cycles, %d after", tl, base,
          ok, now);
    printf("%s: %d cycles, fds %d -> %d\n", tl, ok, base, now);
    CHECK(kvw_ctx_create(&p, &dctx) == KVW_OK, "decode after the churn: %s", kvw_last_error());
    if (dctx) {
        one_room(pctx, &src, dctx, &dst);
        kvw_ctx_destroy(dctx);
    }
    kvw_ctx_destroy(pctx);
    kvt_rank_free(&src);
    kvt_rank_free(&dst);
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    setenv("KVW_STAGING_MB", "1", 0);
    if (kvt_model_preset("gpt-oss-120b", &model) || kvt_model_truncate(&model, 2)) {
        fprintf(stderr, "test_fd_churn: no gpt-oss-120b preset\n");
        return 1;
    }
    churn("tcp", 300);
    churn("shm", 100);
    if (failures) {
        fprintf(stderr, "test_fd_churn: %d failures\n", failures);
        return 1;
    }
    printf("test_fd_churn: all checks passed\n");
    return 0;
}
