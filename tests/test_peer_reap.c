/*
 * A prefill context gives a departed decode rank's resources back (its control socket,
 * its transport endpoint, the mappings of its buffers) once no room refers to it, not
 * when the context is destroyed: under decode churn, fds and mappings stay bounded.
 *
 * In one process, over tcp and shm: a prefill rank (TP1) and 30 decode contexts created
 * one after another, each moving one verified room and then destroyed. Afterwards the
 * process's open fds must come back to what they were before the first decode context,
 * and its memory mappings too (the deadline is generous; what is checked is that the
 * resources are released at all).
 */
#include "testkit.h"

#include <kvwire/xfer.h>

#include <dirent.h>
#include <stdbool.h>
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

static kvt_model_t model;

static int count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    if (d == NULL)
        return -1;
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

static int count_maps(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    int n = 0, c;
    if (f == NULL)
        return -1;
    while ((c = fgetc(f)) != EOF)
        n += c == '\n';
    fclose(f);
    return n;
}

static kvw_status_t make_rank(kvt_rank_t *r)
{
    kvt_rank_spec_t s = {.model = &model, .layout = KVW_LAYOUT_NHD, .page_size = {16, 16},
                         .num_pages = {8, 8}, .num_slots = 1};
    s.par = (kvw_parallel_t){.tp_size = 1, .pp_size = 1, .layer_end = model.m.num_layers,
                             .dp_size = 1};
    return kvt_rank_build(&s, r);
}

static kvw_status_t ctx_open(kvt_rank_t *r, bool prefill, const char *tl, const char *bs,
                             kvw_ctx_h *ctx)
{
    kvw_ctx_params_t p = {.field_mask = KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK |
                                        KVW_CTX_FIELD_TRANSPORT | KVW_CTX_FIELD_BOOTSTRAP |
                                        KVW_CTX_FIELD_HOST_BOOTSTRAP | KVW_CTX_FIELD_TIMEOUTS |
                                        KVW_CTX_FIELD_INSTANCE,
                          .side = prefill ? KVW_SIDE_PREFILL : KVW_SIDE_DECODE,
                          .rank = r->h, .transport = tl, .bootstrap_addr = bs,
                          .host_bootstrap = prefill, .bootstrap_timeout_ms = 20000,
                          .wait_timeout_ms = 20000, .instance_id = 0};
    return kvw_ctx_create(&p, ctx);
}

static void one_room(kvw_ctx_h pctx, kvt_rank_t *src, kvw_ctx_h dctx, kvt_rank_t *dst,
                     uint64_t id)
{
    uint32_t pg[2] = {0, 1};
    kvw_side_pages_t pages = {.full = {pg, 2, 0}, .swa = {pg, 2, 0}, .state_slot = -1};
    kvt_copy_t expect;
    kvt_copy_make(dst, &expect);
    kvw_receiver_h rv = NULL;
    kvw_sender_h s = NULL;
    kvw_recv_post_t post = {.num_tokens = 20, .pages = pages};
    kvw_send_chunk_t c = {.num_tokens = 20, .chunk_end = 20, .last_chunk = 1, .pages = pages};
    CHECK(kvw_receiver_create(dctx, id, 0, &rv) == KVW_OK && kvw_receiver_post(rv, &post) == KVW_OK,
          "%s", kvw_last_error());
    CHECK(kvw_sender_create(pctx, id, &s) == KVW_OK && kvw_sender_send(s, &c) == KVW_OK, "%s",
          kvw_last_error());
    kvw_room_state_t st = kvw_receiver_wait(rv, 30000);
    CHECK(st == KVW_ROOM_SUCCESS, "room %llu: %s", (unsigned long long)id,
          kvw_receiver_failure(rv));
    CHECK(kvw_sender_wait(s, 30000) == KVW_ROOM_SUCCESS, "sender %llu: %s",
          (unsigned long long)id, kvw_sender_failure(s));
    uint8_t **sd = calloc(src->num_bufs, sizeof(uint8_t *));
    for (uint32_t b = 0; b < src->num_bufs; b++)
        sd[b] = kvt_rank_data(src, b);
    kvt_ref_side_t ss = kvt_ref_side(src, &pages, sd);
    kvt_ref_side_t ds = kvt_ref_side(dst, &pages, expect.data);
    kvw_chunk_t whole = {.num_tokens = 20, .chunk_end = 20, .last_chunk = 1};
    char msg[512];
    CHECK(kvt_ref_transfer(&model.m, &ss, 1, &ds, &whole, NULL, NULL, msg, sizeof(msg)) == 0,
          "%s", msg);
    CHECK(kvt_copy_compare(dst, &expect, "decode", msg, sizeof(msg)) == 0, "%s", msg);
    CHECK(kvt_rank_check_guards(dst, msg, sizeof(msg)) == 0, "%s", msg);
    free(sd);
    kvt_copy_free(&expect);
    kvw_sender_destroy(s);
    kvw_receiver_destroy(rv);
}

static void run(const char *tl)
{
    kvt_rank_t src, dst;
    kvw_ctx_h pctx = NULL;
    CHECK(make_rank(&src) == KVW_OK && make_rank(&dst) == KVW_OK, "%s", kvw_last_error());
    kvt_rank_fill(&src, 5);
    kvw_status_t st = ctx_open(&src, true, tl, "127.0.0.1:0", &pctx);
    if (st == KVW_ERR_UNSUPPORTED) {
        printf("test_peer_reap: %s unavailable, skipped\n", tl);
        kvt_rank_free(&src);
        kvt_rank_free(&dst);
        return;
    }
    CHECK(st == KVW_OK, "%s", kvw_last_error());
    char bs[128];
    snprintf(bs, sizeof(bs), "%s", kvw_ctx_bootstrap_addr(pctx));
    /* One decode context first, so that lazily created state (thread stacks, transport
     * buffers) is in the baseline. */
    kvw_ctx_h dctx = NULL;
    CHECK(ctx_open(&dst, false, tl, bs, &dctx) == KVW_OK, "%s", kvw_last_error());
    one_room(pctx, &src, dctx, &dst, 1);
    kvw_ctx_destroy(dctx);
    /* The first departure is released too, usually before the baseline is taken (if
     * not, the baseline is one peer higher: the 30 rounds below still show any leak). */
    usleep(300000);
    int fds0 = count_fds(), maps0 = count_maps();
    enum { ROUNDS = 30 };
    for (int i = 0; i < ROUNDS && !failures; i++) {
        kvt_rank_fill(&dst, 100 + (uint32_t)i);
        CHECK(ctx_open(&dst, false, tl, bs, &dctx) == KVW_OK, "%s", kvw_last_error());
        one_room(pctx, &src, dctx, &dst, 10 + (uint64_t)i);
        kvw_ctx_destroy(dctx);
    }
    /* Released within a few control-thread passes; 20 s is far beyond that. */
    int fds = count_fds(), maps = count_maps();
    /* Mappings may grow by a few for reasons of their own (glibc's per-thread malloc
     * arenas, up to 8 per core); a leak per departed peer adds at least one per round. */
    const int map_slack = ROUNDS / 2;
    for (int i = 0; i < 400 && (fds > fds0 || maps > maps0 + map_slack); i++) {
        usleep(50000);
        fds = count_fds(), maps = count_maps();
    }
    CHECK(fds <= fds0, "[%s] %d fds open after %d decode contexts came and went, %d before", tl,
          fds, ROUNDS, fds0);
#if defined(__SANITIZE_THREAD__)
    /* ThreadSanitizer maps shadow memory as the process goes: mappings prove nothing. */
    maps = maps0;
#endif
    CHECK(maps <= maps0 + map_slack, "[%s] %d mappings after %d decode contexts came and went, %d before",
          tl, maps, ROUNDS, maps0);
    kvw_ctx_destroy(pctx);
    kvt_rank_free(&src);
    kvt_rank_free(&dst);
}

int main(void)
{
    kvt_model_preset("gpt-oss-120b", &model);
    kvt_model_truncate(&model, 2);
    run("tcp");
    run("shm");
    if (failures) {
        fprintf(stderr, "test_peer_reap: %d failures\n", failures);
        return 1;
    }
    printf("test_peer_reap: all checks passed\n");
    return 0;
}
