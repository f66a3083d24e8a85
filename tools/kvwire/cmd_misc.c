/* kvwire info and kvwire bootstrap. */
#include "cmd.h"
#include "util.h"

#include <kvwire/cuda.h>
#include <kvwire/xfer.h>

#include <dlfcn.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/*
 * Whether transport `tl` works here: a throw-away prefill context over it, on a rank of
 * one 1-byte head of one layer, hosting a private bootstrap endpoint on 127.0.0.1. The
 * context loads the transport (the ucx module, with libucp), opens its listeners and
 * registers the buffers, as a real one would. Returns true, or false with the library's
 * reason in why.
 */
static bool info_probe_transport(const char *tl, char *why, size_t cap)
{
    static uint8_t k[1], v[1];
    kvw_layer_desc_t layer = {.field_mask = KVW_LAYER_FIELD_KIND, .kind = KVW_LAYER_FULL};
    kvw_model_t model = {.field_mask = KVW_MODEL_FIELD_NUM_LAYERS | KVW_MODEL_FIELD_LAYERS |
                                       KVW_MODEL_FIELD_NUM_KV_HEADS | KVW_MODEL_FIELD_K_HEAD_DIM |
                                       KVW_MODEL_FIELD_V_HEAD_DIM | KVW_MODEL_FIELD_ELEM_SIZE,
                         .num_layers = 1, .layers = &layer, .num_kv_heads = 1,
                         .k_head_dim = 1, .v_head_dim = 1, .elem_size = 1};
    kvw_buffer_desc_t bufs[2];
    for (int i = 0; i < 2; i++)
        bufs[i] = (kvw_buffer_desc_t){
            .field_mask = KVW_BUFFER_FIELD_LAYER | KVW_BUFFER_FIELD_ROLE |
                          KVW_BUFFER_FIELD_PAGE_SIZE | KVW_BUFFER_FIELD_NUM_HEADS |
                          KVW_BUFFER_FIELD_HEAD_BYTES | KVW_BUFFER_FIELD_ADDR |
                          KVW_BUFFER_FIELD_LENGTH,
            .layer = 0, .role = i ? KVW_ROLE_V : KVW_ROLE_K, .page_size = 1, .num_heads = 1,
            .head_bytes = 1, .addr = i ? v : k, .length = 1};
    kvw_rank_params_t rp = {.field_mask = KVW_RANK_FIELD_MODEL | KVW_RANK_FIELD_PARALLEL |
                                          KVW_RANK_FIELD_BUFFERS,
                            .model = &model, .parallel = {.field_mask = 0}, /* TP1, PP1 */
                            .buffers = bufs, .num_buffers = 2};
    kvw_rank_h rank = NULL;
    if (kvw_rank_create(&rp, &rank) != KVW_OK) {
        snprintf(why, cap, "the probe's rank: %s", kvw_last_error());
        return false;
    }
    kvw_ctx_params_t p = {.field_mask = KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK |
                                        KVW_CTX_FIELD_TRANSPORT | KVW_CTX_FIELD_BOOTSTRAP |
                                        KVW_CTX_FIELD_HOST_BOOTSTRAP | KVW_CTX_FIELD_LISTEN_HOST,
                          .side = KVW_SIDE_PREFILL, .rank = rank, .transport = tl,
                          .bootstrap_addr = "127.0.0.1:0", .host_bootstrap = 1,
                          .listen_host = "127.0.0.1"};
    kvw_ctx_h ctx = NULL;
    kvw_status_t st = kvw_ctx_create(&p, &ctx);
    if (st != KVW_OK)
        snprintf(why, cap, "%s", kvw_last_error());
    else
        kvw_ctx_destroy(ctx);
    kvw_rank_destroy(rank);
    return st == KVW_OK;
}

/*
 * Where a transport module the library does not offer should be: the library gives its
 * loader's reason; this adds where it looked (KVW_TL_MODULE_DIR, else the directory of
 * libkvwire.so) and what the dynamic loader says. Appends to why.
 */
#define KVW_CLI_PRINTF(f, a) __attribute__((format(printf, f, a)))

/* Appends to a message, cut at cap. */
static void info_append(char *why, size_t cap, const char *fmt, ...) KVW_CLI_PRINTF(3, 4);
static void info_append(char *why, size_t cap, const char *fmt, ...)
{
    size_t used = strlen(why);
    if (used + 1 >= cap)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why + used, cap - used, fmt, ap);
    va_end(ap);
}

static void info_module_hint(const char *tl, char *why, size_t cap)
{
    char file[64], dir[4096] = "", path[4200];
    snprintf(file, sizeof(file), "libkvwire-%s.so", tl);
    const char *env = getenv("KVW_TL_MODULE_DIR");
    Dl_info di;
    if (env && *env)
        snprintf(dir, sizeof(dir), "%s", env);
    else if (dladdr((void *)kvw_version, &di) && di.dli_fname && strrchr(di.dli_fname, '/'))
        snprintf(dir, sizeof(dir), "%.*s", (int)(strrchr(di.dli_fname, '/') - di.dli_fname),
                 di.dli_fname);
    if (!dir[0])
        return;
    snprintf(path, sizeof(path), "%s/%s", dir, file);
    if (access(path, F_OK) != 0) {
        if (env && *env)
            info_append(why, cap, " (no %s in %s, the directory KVW_TL_MODULE_DIR names)", file,
                        dir);
        else
            info_append(why, cap, " (no %s next to libkvwire.so in %s: this build has no such "
                        "module; the ucx module needs libucx-dev when CMake runs)", file, dir);
        return;
    }
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        const char *e = dlerror();
        info_append(why, cap, " (%s does not load: %s)", path, e ? e : "?");
        return;
    }
    dlclose(h);
    info_append(why, cap, " (%s loads; the library did not take it)", path);
}

/* The CUDA module: whether it loads and sees a GPU; the reason otherwise. */
static bool info_probe_cuda(char *what, size_t cap)
{
    if (kvw_cuda_available() != KVW_OK) {
        snprintf(what, cap, "%s", kvw_last_error());
        return false;
    }
    int n = 0;
    if (kvw_cuda_device_count(&n) != KVW_OK) {
        snprintf(what, cap, "%s", kvw_last_error());
        return false;
    }
    snprintf(what, cap, "%d GPU%s visible", n, n == 1 ? "" : "s");
    return true;
}

static void info_usage(FILE *f)
{
    fprintf(f, "usage: kvwire info\n"
               "Prints the library's version; each transport built into it and whether it is\n"
               "usable on this machine (a throw-away context over it on 127.0.0.1), or why\n"
               "not; whether the CUDA module loads and sees a GPU, or why not; the\n"
               "environment variables the library reads, with their defaults; and UCX's\n"
               "devices (ucx_info -d) when the ucx transport is usable.\n");
}

static int cmd_info(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            info_usage(stdout);
            return 0;
        }
        fprintf(stderr, "info: unknown argument '%s' (kvwire info takes none)\n", argv[i]);
        return 2;
    }
    printf("kvwire %s\n\ntransports (usable here, or why not):\n", kvw_version());
    bool ucx = false;
    char why[1024];
    bool cuda = info_probe_cuda(why, sizeof(why));
    char cuda_why[1024];
    snprintf(cuda_why, sizeof(cuda_why), "%s", why);
    /* Every transport the library knows: the ones it lists (built in, or a module that
     * loaded) and the others it may know, probed by name, so that a module that does not
     * load, or one not built, is reported with the library's reason. */
    const char *names[16];
    size_t nn = 0;
    static const char *const known[] = {"tcp", "shm", "ucx", "cuda_ipc"};
    for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
        names[nn++] = known[i];
    for (const char *const *n = kvw_transport_names(); *n && nn < 16; n++) {
        bool seen = false;
        for (size_t i = 0; i < nn; i++)
            seen |= !strcmp(names[i], *n);
        if (!seen)
            names[nn++] = *n;
    }
    for (size_t ni = 0; ni < nn; ni++) {
        const char *const *n = &names[ni];
        bool ok;
        if (!strcmp(*n, "cuda_ipc")) {
            /* It moves GPU memory only: usable where the CUDA module sees a GPU (a host
             * rank's context would be refused for its memory, not for the transport). */
            ok = cuda;
            snprintf(why, sizeof(why), "%s", ok ? "" : cuda_why);
        } else {
            ok = info_probe_transport(*n, why, sizeof(why));
            if (!ok && strstr(why, "cannot be used"))
                info_module_hint(*n, why, sizeof(why));
        }
        if (!strcmp(*n, "ucx"))
            ucx = ok;
        if (ok)
            printf("  %-9s usable\n", *n);
        else
            printf("  %-9s not usable: %s\n", *n, why);
    }
    printf("\nCUDA module (GPU KV caches, cuda_ipc):\n  %s%s\n", cuda ? "usable: " : "not usable: ",
           cuda_why);
    printf("\nenvironment:\n");
    size_t nv = 0;
    const kvw_config_var_t *v = kvw_config_vars(&nv);
    for (size_t i = 0; i < nv; i++)
        printf("  %-20s default %-36s %s\n", v[i].name, v[i].default_value, v[i].help);
    if (ucx) {
        printf("\nUCX devices and transports on this machine (ucx_info -d):\n");
        fflush(stdout);
        if (system("ucx_info -d 2>/dev/null | grep -E '^#\\s+(Transport|Device):' | paste - - "
                   "| sed 's/#//g;s/  */ /g;s/^/  /' | sort -u") != 0)
            printf("  (ucx_info not available: install ucx-utils)\n");
    }
    return 0;
}

static volatile sig_atomic_t kvw_stop;
static void kvw_on_signal(int sig)
{
    (void)sig;
    kvw_stop = 1;
}

/* kvwire bootstrap's log: the endpoint's registrations, lookups and refusals (the
 * library's log hook), one time-stamped line each. */
static void kvw_bs_log(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    localtime_r(&ts.tv_sec, &tm);
    printf("%02d:%02d:%02d.%03ld %s %s\n", tm.tm_hour, tm.tm_min, tm.tm_sec,
           ts.tv_nsec / 1000000, level <= KVW_LOG_WARN ? "WARN" : "INFO", msg);
    fflush(stdout);
}

static void kvw_bs_usage(FILE *f)
{
    fprintf(f, "usage: kvwire bootstrap [--listen HOST:PORT] [--secret-file PATH] [--quiet]\n"
               "  --listen HOST:PORT  where to listen (default 0.0.0.0:17000; port 0: any)\n"
               "  --secret-file PATH  shared secret (first line, mode 600; also\n"
               "                      KVW_SECRET_FILE): registrations without a valid MAC are\n"
               "                      refused\n"
               "  --quiet             log only refusals, not every registration and lookup\n"
               "Runs the bootstrap endpoint where prefill ranks register and decode ranks look\n"
               "them up, until interrupted, and logs each registration, lookup and refusal on\n"
               "stdout. Prefill ranks use it with kvwire demo --role prefill --bootstrap\n"
               "HOST:PORT --external-bootstrap (or any context without host_bootstrap).\n");
}

static int cmd_bootstrap(int argc, char **argv)
{
    const char *addr = "0.0.0.0:17000";
    char secret[256] = "";
    bool quiet = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--listen") && i + 1 < argc) {
            addr = argv[++i];
            if (cli_opt_hostport("bootstrap", "--listen", addr, 0))
                return 2;
        } else if (!strcmp(argv[i], "--secret-file") && i + 1 < argc) {
            if (kvw_cli_read_secret("bootstrap", argv[++i], secret, sizeof(secret)))
                return 2;
        } else if (!strcmp(argv[i], "--quiet")) {
            quiet = true;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            kvw_bs_usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "bootstrap: %s '%s' (kvwire bootstrap --help lists the options)\n",
                    !strcmp(argv[i], "--listen") || !strcmp(argv[i], "--secret-file")
                        ? "a value is missing after" : "unknown argument", argv[i]);
            return 2;
        }
    }
    const char *sf = getenv("KVW_SECRET_FILE");
    if (!secret[0] && sf && sf[0] && kvw_cli_read_secret("bootstrap", sf, secret, sizeof(secret)))
        return 2;
    kvw_bootstrap_params_t bp = {.field_mask = KVW_BOOTSTRAP_FIELD_ADDR | KVW_BOOTSTRAP_FIELD_SECRET,
                                 .addr = addr, .secret = secret};
    kvw_bootstrap_h bs;
    kvw_set_log_handler(kvw_bs_log, NULL, quiet ? KVW_LOG_WARN : KVW_LOG_INFO);
    if (kvw_bootstrap_start_ex(&bp, &bs) != KVW_OK) {
        fprintf(stderr, "kvwire bootstrap: %s\n", kvw_last_error());
        return 1;
    }
    printf("kvwire bootstrap listening on %s%s\n", kvw_bootstrap_address(bs),
           secret[0] ? " (registrations authenticated)" : "");
    fflush(stdout);
    signal(SIGINT, kvw_on_signal);
    signal(SIGTERM, kvw_on_signal);
    while (!kvw_stop)
        pause();
    kvw_bootstrap_stop(bs);
    kvw_set_log_handler(NULL, NULL, KVW_LOG_ERROR);
    return 0;
}

KVW_CMD("info", cmd_info, "transports and the CUDA module (usable here, or why not), environment")
KVW_CMD("bootstrap", cmd_bootstrap, "run a standalone bootstrap endpoint")
