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
#include "inproc.h"

#define TOKENS 48

static kvt_model_t model;

static void churn(const char *tl, int cycles)
{
    kvt_rank_t src = {0}, dst = {0};
    CHECK(ip_rank(&model, 1, 0, 8, 1, &src) == KVW_OK &&
              ip_rank(&model, 1, 0, 8, 1, &dst) == KVW_OK,
          "%s", kvw_last_error());
    kvt_rank_fill(&src, 1);
    kvt_rank_fill(&dst, 2);
    kvw_ctx_h pctx = NULL, dctx = NULL;
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, &src, tl, "127.0.0.1:0", true);
    p.bootstrap_timeout_ms = kvt_tmo_ms(10000);
    CHECK(kvw_ctx_create(&p, &pctx) == KVW_OK, "prefill: %s", kvw_last_error());
    if (pctx == NULL)
        return;
    char bs[128];
    ip_params_decode(&p, pctx, &dst, bs, sizeof(bs));
    int base = ip_count_fds();
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
    int now = ip_count_fds();
    for (uint64_t t0 = kvt_now_ns(); now > base && kvt_now_ns() - t0 < kvt_tmo_ns(30000000000ull);
         now = ip_count_fds())
        usleep(10000);
    CHECK(now <= base, "%s: %d fds before %d register-and-leave cycles, %d after", tl, base,
          ok, now);
    printf("%s: %d cycles, fds %d -> %d\n", tl, ok, base, now);
    CHECK(kvw_ctx_create(&p, &dctx) == KVW_OK, "decode after the churn: %s", kvw_last_error());
    if (dctx) {
        /* One verified room (proves the prefill context still serves after the churn). */
        ip_room_t room = {.id = 1, .tokens = TOKENS, .seed = 9,
                          .deadline_ns = kvt_tmo_ns(30000000000ull),
                          .what = "room"};
        ip_room_verified(&model, pctx, &src, dctx, &dst, &room);
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
    if (ip_model("test_fd_churn", &model))
        return 1;
    churn("tcp", 300);
    churn("shm", 100);
    return ip_summary("test_fd_churn");
}
