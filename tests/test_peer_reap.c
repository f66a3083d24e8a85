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
#include "inproc.h"

/* AddressSanitizer keeps freed memory in a quarantine (256 MiB by default) whose large
 * chunks stay mapped: the mapping count below would grow with the quarantine, not with
 * a leak. A small quarantine keeps the check meaningful under ASan (environment options,
 * detect_leaks included, still apply on top). */
#if defined(__SANITIZE_ADDRESS__)
const char *__asan_default_options(void);
const char *__asan_default_options(void)
{
    return "quarantine_size_mb=1";
}
#endif


static kvt_model_t model;

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

static kvw_status_t ctx_open(kvt_rank_t *r, bool prefill, const char *tl, const char *bs,
                             kvw_ctx_h *ctx)
{
    kvw_ctx_params_t p =
        ip_params(prefill ? KVW_SIDE_PREFILL : KVW_SIDE_DECODE, r, tl, bs, prefill);
    p.field_mask |= KVW_CTX_FIELD_INSTANCE;
    p.bootstrap_timeout_ms = kvt_tmo_ms(20000);
    p.wait_timeout_ms = kvt_tmo_ms(20000);
    p.instance_id = 0;
    return kvw_ctx_create(&p, ctx);
}

static void one_room(kvw_ctx_h pctx, kvt_rank_t *src, kvw_ctx_h dctx, kvt_rank_t *dst,
                     uint64_t id)
{
    uint32_t pg[2] = {0, 1};
    kvw_side_pages_t pages = {.field_mask = KVW_SIDE_PAGES_FIELDS_ALL,
                              .full = {KVW_PAGES_FIELDS_ALL, pg, 2,
                                       0}, .swa = {KVW_PAGES_FIELDS_ALL, pg, 2,
                                                   0}, .state_slot = -1};
    kvt_copy_t expect;
    kvt_copy_make(dst, &expect);
    kvw_receiver_h rv = NULL;
    kvw_sender_h s = NULL;
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = 20,
                            .pages = pages};
    kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = 20,
                          .chunk_end = 20, .last_chunk = 1, .pages = pages};
    CHECK(kvw_receiver_create(dctx, id, 0, &rv) == KVW_OK && kvw_receiver_post(rv, &post) == KVW_OK,
          "%s", kvw_last_error());
    CHECK(kvw_sender_create(pctx, id, &s) == KVW_OK && kvw_sender_send(s, &c) == KVW_OK, "%s",
          kvw_last_error());
    kvw_room_state_t st = kvw_room_wait(kvw_receiver_room(rv), kvt_tmo_ms(30000));
    CHECK(st == KVW_ROOM_SUCCESS, "room %llu: %s", (unsigned long long)id,
          kvw_room_failure(kvw_receiver_room(rv)));
    CHECK(kvw_room_wait(kvw_sender_room(s), kvt_tmo_ms(30000)) == KVW_ROOM_SUCCESS,
          "sender %llu: %s",
          (unsigned long long)id, kvw_room_failure(kvw_sender_room(s)));
    ip_ref(&model, src, 1, &pages, dst, &pages, expect.data, 20, NULL);
    ip_verify(dst, &expect, "");
    kvt_copy_free(&expect);
    kvw_room_destroy(kvw_sender_room(s));
    kvw_room_destroy(kvw_receiver_room(rv));
}

static void run(const char *tl)
{
    kvt_rank_t src, dst;
    kvw_ctx_h pctx = NULL;
    CHECK(ip_rank(&model, 1, 0, 8, 1, &src) == KVW_OK &&
              ip_rank(&model, 1, 0, 8, 1, &dst) == KVW_OK,
          "%s", kvw_last_error());
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
    int fds0 = ip_count_fds(), maps0 = count_maps();
    enum { ROUNDS = 30 };
    for (int i = 0; i < ROUNDS && !failures; i++) {
        kvt_rank_fill(&dst, 100 + (uint32_t)i);
        CHECK(ctx_open(&dst, false, tl, bs, &dctx) == KVW_OK, "%s", kvw_last_error());
        one_room(pctx, &src, dctx, &dst, 10 + (uint64_t)i);
        kvw_ctx_destroy(dctx);
    }
    /* Released within a few control-thread passes; 20 s (scaled) is far beyond that. */
    int fds = ip_count_fds(), maps = count_maps();
    /* Mappings may grow by a few for reasons of their own (glibc's per-thread malloc
     * arenas, up to 8 per core); a leak per departed peer adds at least one per round. */
    const int map_slack = ROUNDS / 2;
    for (uint32_t i = 0; i < kvt_tmo_ms(20000) / 50 && (fds > fds0 || maps > maps0 + map_slack);
         i++) {
        usleep(50000);
        fds = ip_count_fds(), maps = count_maps();
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
    return ip_summary("test_peer_reap");
}
