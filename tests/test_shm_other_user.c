/*
 * On shm, run as root, a process of another user (setuid nobody) must not be able to
 * connect to the decode rank's socket at all (SO_PEERCRED check on accept). (A forged
 * completion from a connection of the same user is a row of test_proto_fail's failure
 * table.)
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



static kvt_model_t model;

static void ignore_notify(void *arg, kvw_tl_ep_h ep, const void *msg, size_t len)
{
    (void)arg, (void)ep, (void)msg, (void)len;
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
        execl("/proc/self/exe", "test_shm_other_user", "--as-other-user", hex, (char *)NULL);
        _exit(3);
    }
    int ws = 0;
    CHECK(pid > 0 && waitpid(pid, &ws, 0) == pid, "fork/wait");
    CHECK(WIFEXITED(ws) && WEXITSTATUS(ws) == 0,
          "a process of uid 65534 %s the decode rank's shm socket (child status %d)",
          WIFEXITED(ws) && WEXITSTATUS(ws) == 1 ? "connected to" : "could not be tested against",
          ws);
}

static void run(void)
{
    kvt_rank_t src = {0}, dst = {0};
    CHECK(ip_rank(&model, 1, 0, 16, 1, &src) == KVW_OK &&
              ip_rank(&model, 1, 0, 16, 1, &dst) == KVW_OK,
          "%s", kvw_last_error());
    kvw_ctx_h pctx = NULL, dctx = NULL;
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, &src, "shm", "127.0.0.1:0", true);
    p.bootstrap_timeout_ms = kvt_tmo_ms(10000);
    CHECK(kvw_ctx_create(&p, &pctx) == KVW_OK, "prefill: %s", kvw_last_error());
    if (pctx == NULL)
        goto out;
    char bs[128];
    ip_params_decode(&p, pctx, &dst, bs, sizeof(bs));
    CHECK(kvw_ctx_create(&p, &dctx) == KVW_OK, "decode: %s", kvw_last_error());
    if (dctx)
        other_user(dctx);
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
    if (ip_model("test_shm_other_user", &model))
        return 1;
    run();
    return ip_summary("test_shm_other_user");
}
