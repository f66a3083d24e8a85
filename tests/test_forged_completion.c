/*
 * Completions are accepted only on the data connection of the peer that owns the room.
 * A separate connection to the decode rank's transport (any local process can find a
 * shm socket name; any host can reach a tcp port) sends a completion claiming to be the
 * room's prefill rank, with the right byte count, first bare and then after a BIND with
 * a guessed nonce. The room must not reach Success from that: it succeeds only once the
 * real prefill rank has sent, and then with exactly the reference bytes.
 *
 * On shm, run as root, a process of another user (setuid nobody) must not be able to
 * connect to the decode rank's socket at all (SO_PEERCRED check on accept).
 *
 * Exit: 0 pass, 1 fail.
 */
#include "testkit.h"
#include "inproc.h"

#include <kvwire/xfer.h>

#include "proto/proto.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>


#define TOKENS 64
#define ROOM 9
#define DEADLINE_NS kvt_tmo_ns(30000000000ull)

static kvt_model_t model;

static void ignore_notify(void *arg, kvw_tl_ep_h ep, const void *msg, size_t len)
{
    (void)arg, (void)ep, (void)msg, (void)len;
}

/* A completion frame as a prefill rank sends it (worker.c, kvw_put_done). */
static void forged_done(kvw_wbuf_t *w, uint32_t peer_id, uint64_t bytes)
{
    kvw__wb_init(w, KVW_MSG_DONE);
    kvw__wb_u64(w, ROOM);
    kvw__wb_u32(w, peer_id);
    kvw__wb_u64(w, 0);      /* chunk begin */
    kvw__wb_u64(w, TOKENS); /* chunk end */
    kvw__wb_u64(w, bytes);
    kvw__wb_u8(w, 1); /* last chunk */
    kvw__wb_u8(w, 0); /* not staged */
    kvw__wb_u64(w, 0);
    kvw__wb_u64(w, 0);
    kvw__wb_u64(w, 0);
    kvw__wb_u8(w, 1); /* final */
}

static void forged_bind(kvw_wbuf_t *w, uint32_t peer_id)
{
    kvw__wb_init(w, KVW_MSG_BIND);
    kvw__wb_u32(w, peer_id);
    for (int i = 0; i < 32; i++)
        kvw__wb_u8(w, 0);
}

/* The decode rank's data address (asked in its own process: shm names carry the pid). */
static size_t decode_addr(kvw_ctx_h dctx, uint8_t addr[KVW_TL_MAX_ADDR])
{
    struct kvw_ctx *d = dctx;
    size_t alen = KVW_TL_MAX_ADDR;
    return d->tl_ops->address(d->tl, addr, &alen) == KVW_OK ? alen : 0;
}

/* Connects a transport instance of our own to the decode rank's data address. */
static kvw_status_t forger_connect(const char *tl_name, const uint8_t *addr, size_t alen,
                                   kvw_tl_h *tl_p, kvw_tl_ep_h *ep_p)
{
    const kvw_tl_ops_t *ops = kvw__tl_find(tl_name);
    kvw_tl_params_t tp = {.cb = {.on_notify = ignore_notify}, .timeout_ms = kvt_tmo_ms(10000)};
    kvw_status_t st;
    if (ops == NULL || alen == 0)
        return KVW_ERR_UNSUPPORTED;
    if ((st = ops->init(&tp, tl_p)) != KVW_OK)
        return st;
    if ((st = ops->connect(*tl_p, addr, alen, ep_p)) != KVW_OK) {
        ops->close(*tl_p);
        ops->stop(*tl_p);
        ops->fini(*tl_p);
    }
    return st;
}

static void forger_done(const char *tl_name, kvw_tl_h tl, kvw_tl_ep_h ep)
{
    const kvw_tl_ops_t *ops = kvw__tl_find(tl_name);
    ops->ep_close(ep);
    ops->close(tl);
    ops->stop(tl);
    ops->fini(tl);
}

/* The other-user side of the check below, in a fresh process image (started with
 * --as-other-user HEXADDR): it drops to uid/gid 65534 and tries to connect. Exit 0: the
 * connection was refused; 1: it connected; 3: it could not run. */
static int as_other_user(const char *hex)
{
    uint8_t addr[KVW_TL_MAX_ADDR];
    size_t alen = strlen(hex) / 2;
    if (alen == 0 || alen > sizeof(addr))
        return 3;
    for (size_t i = 0; i < alen; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1)
            return 3;
        addr[i] = (uint8_t)v;
    }
    if (setgid(65534) != 0 || setuid(65534) != 0)
        return 3;
    kvw_tl_h tl;
    kvw_tl_ep_h ep;
    if (forger_connect("shm", addr, alen, &tl, &ep) == KVW_OK) {
        forger_done("shm", tl, ep);
        return 1;
    }
    return 0;
}

/* Another local user must not get a connection to the decode rank's shm socket. The
 * other user runs in a new process image (fork + exec of this test): a forked copy of
 * this multi-threaded process must not allocate or start threads (a lock held by another
 * thread at the fork stays held in the child, and sanitizer runtimes make that likely). */
static void other_user(kvw_ctx_h dctx)
{
    if (geteuid() != 0) {
        printf("  not root: the other-user check on shm is skipped\n");
        return;
    }
    uint8_t addr[KVW_TL_MAX_ADDR];
    size_t alen = decode_addr(dctx, addr);
    CHECK(alen > 0, "no shm address");
    char hex[2 * KVW_TL_MAX_ADDR + 1];
    for (size_t i = 0; i < alen; i++)
        snprintf(hex + 2 * i, 3, "%02x", addr[i]);
    hex[2 * alen] = 0;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        execl("/proc/self/exe", "test_forged_completion", "--as-other-user", hex, (char *)NULL);
        _exit(3);
    }
    int ws = 0;
    CHECK(pid > 0 && waitpid(pid, &ws, 0) == pid, "fork/wait");
    CHECK(WIFEXITED(ws) && WEXITSTATUS(ws) == 0,
          "a process of uid 65534 %s the decode rank's shm socket (child status %d)",
          WIFEXITED(ws) && WEXITSTATUS(ws) == 1 ? "connected to" : "could not be tested against",
          ws);
}

static void run(const char *tl_name)
{
    printf("%s\n", tl_name);
    kvt_rank_t src = {0}, dst = {0};
    CHECK(ip_rank(&model, 1, 0, 16, 1, &src) == KVW_OK &&
              ip_rank(&model, 1, 0, 16, 1, &dst) == KVW_OK,
          "%s", kvw_last_error());
    kvt_rank_fill(&src, 3);
    kvt_rank_fill(&dst, 4);
    kvw_ctx_h pctx = NULL, dctx = NULL;
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, &src, tl_name, "127.0.0.1:0", true);
    p.bootstrap_timeout_ms = kvt_tmo_ms(10000);
    p.wait_timeout_ms = kvt_tmo_ms(20000);
    CHECK(kvw_ctx_create(&p, &pctx) == KVW_OK, "prefill: %s", kvw_last_error());
    if (pctx == NULL)
        goto out;
    char bs[128];
    ip_params_decode(&p, pctx, &dst, bs, sizeof(bs));
    CHECK(kvw_ctx_create(&p, &dctx) == KVW_OK, "decode: %s", kvw_last_error());
    if (dctx == NULL)
        goto out;
    if (!strcmp(tl_name, "shm"))
        other_user(dctx);

    kvt_rng_t rng = {5};
    kvt_req_spec_t rs = {.full_begin = 0, .full_end = TOKENS, .swa_begin = 0,
                         .swa_end = TOKENS, .state_slot = -1};
    kvt_req_pages_t sp, dp;
    CHECK(kvt_req_pages_make(&src, &rs, &rng, &sp) == 0, "source pages");
    CHECK(kvt_req_pages_make(&dst, &rs, &rng, &dp) == 0, "destination pages");
    kvt_copy_t expect;
    kvt_copy_make(&dst, &expect);
    kvw_receiver_h rcv = NULL;
    kvw_sender_h snd = NULL;
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = TOKENS,
                            .prefix_len = 0, .pages = dp.side};
    CHECK(kvw_receiver_create(dctx, ROOM, 0, &rcv) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_receiver_post(rcv, &post) == KVW_OK, "%s", kvw_last_error());

    /* The forgery: the right byte count for every peer id the decode rank has. */
    struct kvw_ctx *d = dctx;
    pthread_mutex_lock(&d->mu);
    kvw_room_t *r = kvw__room_find(d, ROOM);
    uint32_t npeers = d->num_peers;
    uint64_t expected = r && r->num_srcs ? r->srcs[0].expected : 0;
    pthread_mutex_unlock(&d->mu);
    CHECK(expected > 0, "the room expects no bytes");
    kvw_tl_h ftl;
    kvw_tl_ep_h fep;
    uint8_t addr[KVW_TL_MAX_ADDR];
    size_t alen = decode_addr(dctx, addr);
    kvw_status_t st = forger_connect(tl_name, addr, alen, &ftl, &fep);
    CHECK(st == KVW_OK, "the forger (same user) cannot connect: %s", kvw_last_error());
    if (st == KVW_OK) {
        const kvw_tl_ops_t *ops = kvw__tl_find(tl_name);
        for (int bind = 0; bind < 2; bind++)
            for (uint32_t id = 0; id < npeers; id++) {
                kvw_wbuf_t w;
                if (bind)
                    forged_bind(&w, id);
                else
                    forged_done(&w, id, expected);
                CHECK(kvw__wb_finish(&w) == KVW_OK && ops->notify(fep, w.p, w.len) == KVW_OK,
                      "forger notify: %s", kvw_last_error());
                kvw__wb_free(&w);
                if (bind) {
                    forged_done(&w, id, expected);
                    CHECK(kvw__wb_finish(&w) == KVW_OK &&
                              ops->notify(fep, w.p, w.len) == KVW_OK,
                          "forger notify: %s", kvw_last_error());
                    kvw__wb_free(&w);
                }
            }
    }

    /* Only now does the real prefill rank send. Had a forged completion counted, the
     * room would be Success with stale bytes, or Failed for a second completion. */
    CHECK(kvw_sender_create(pctx, ROOM, &snd) == KVW_OK, "%s", kvw_last_error());
    kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = TOKENS,
                          .chunk_begin = 0, .chunk_end = TOKENS,
                          .last_chunk = 1, .pages = sp.side};
    CHECK(kvw_sender_send(snd, &c) == KVW_OK, "%s", kvw_last_error());
    kvw_room_state_t rst = ip_wait_recv(rcv, DEADLINE_NS);
    /* Compare at once: the bytes must already be all there when Success shows. */
    ip_ref(&model, &src, 1, &sp.side, &dst, &dp.side, expect.data, TOKENS, NULL);
    char msg[512];
    CHECK(rst == KVW_ROOM_SUCCESS, "room ended %s: %s", kvw_room_state_string(rst),
          kvw_room_failure(kvw_receiver_room(rcv)));
    CHECK(kvt_copy_compare(&dst, &expect, "decode", msg, sizeof(msg)) == 0,
          "Success with wrong bytes over %s: %s", tl_name, msg);
    CHECK(kvt_rank_check_guards(&dst, msg, sizeof(msg)) == 0, "%s", msg);
    if (st == KVW_OK)
        forger_done(tl_name, ftl, fep);
    kvw_room_destroy(kvw_sender_room(snd));
    kvw_room_destroy(kvw_receiver_room(rcv));
    kvt_copy_free(&expect);
    kvt_req_pages_free(&sp);
    kvt_req_pages_free(&dp);
out:
    if (dctx)
        kvw_ctx_destroy(dctx);
    if (pctx)
        kvw_ctx_destroy(pctx);
    kvt_rank_free(&src);
    kvt_rank_free(&dst);
}

int main(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "--as-other-user"))
        return as_other_user(argv[2]);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (ip_model("test_forged_completion", &model))
        return 1;
    run("shm");
    run("tcp");
    return ip_summary("test_forged_completion");
}
