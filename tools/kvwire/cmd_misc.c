/* kvwire info and kvwire bootstrap. */
#include "cmd.h"

#include <kvwire/xfer.h>

#include "proto/proto.h"

#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* Environment variables kvwire reads, in one table (name, default, help). */
static const struct {
    const char *name, *def, *help;
} kvw_env_table[] = {
    {"KVW_CUDA_MODULE", "libkvwire_cuda.so next to libkvwire",
     "path of the CUDA module loaded at run time"},
    {"KVW_TL_MODULE_DIR", "next to libkvwire, ../lib, loader path",
     "the only directory searched for transport modules (libkvwire-ucx.so)"},
    {"KVW_UCX_TIMEOUT_MS", "10000", "deadline of every UCX wait (flush, put, notify)"},
    {"KVW_UCX_PUT", "am", "am: writes as active messages the receiver applies; rma: ucp_put"},
    {"KVW_UCX_ERR_MODE", "peer", "peer: detect dead peers (UCX then uses tcp lanes); none"},
    {"KVW_WORKERS", "4", "prefill sender threads per context (decode ranks served in parallel)"},
    {"KVW_GPU_INFLIGHT", "8", "GPU copy kernels in flight per sender thread (1..8; 1 waits for each)"},
    {"KVW_STAGING_MB", "64", "decode staging area for gathered head slices, per rank"},
    {"KVW_PATH", "auto", "direct | staged: force the data path of every plan"},
    {"KVW_BUSY_POLL_US", "0", "spin this long for the next event before sleeping (latency)"},
    {"UCX_TLS", "(UCX default)", "UCX transports to use; set tcp across network namespaces"},
};

static int cmd_info(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    printf("kvwire %s\n\ntransports compiled in:\n", kvw_version());
    for (const char *const *n = kvw__tl_names(); *n; n++)
        printf("  %s\n", *n);
    printf("\nenvironment:\n");
    for (size_t i = 0; i < sizeof(kvw_env_table) / sizeof(kvw_env_table[0]); i++)
        printf("  %-20s default %-36s %s\n", kvw_env_table[i].name, kvw_env_table[i].def,
               kvw_env_table[i].help);
#ifdef KVW_HAVE_UCX
    printf("\nUCX devices and transports on this machine (ucx_info -d):\n");
    fflush(stdout);
    if (system("ucx_info -d 2>/dev/null | grep -E '^#\\s+(Transport|Device):' | paste - - "
               "| sed 's/#//g;s/  */ /g;s/^/  /' | sort -u") != 0)
        printf("  (ucx_info not available: install ucx-utils)\n");
#endif
    return 0;
}

static volatile sig_atomic_t kvw_stop;
static void kvw_on_signal(int sig)
{
    (void)sig;
    kvw_stop = 1;
}

static int cmd_bootstrap(int argc, char **argv)
{
    const char *addr = "0.0.0.0:17000";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--listen") && i + 1 < argc)
            addr = argv[++i];
        else {
            fprintf(stderr, "usage: kvwire bootstrap [--listen host:port]   (default %s)\n"
                            "Runs the bootstrap endpoint where prefill ranks register and decode "
                            "ranks look them up, until interrupted.\n", addr);
            return strcmp(argv[i], "--help") ? 2 : 0;
        }
    }
    kvw_bootstrap_h bs;
    if (kvw_bootstrap_start(addr, &bs) != KVW_OK) {
        fprintf(stderr, "kvwire bootstrap: %s\n", kvw_last_error());
        return 1;
    }
    printf("kvwire bootstrap listening on %s\n", kvw_bootstrap_address(bs));
    fflush(stdout);
    signal(SIGINT, kvw_on_signal);
    signal(SIGTERM, kvw_on_signal);
    while (!kvw_stop)
        pause();
    kvw_bootstrap_stop(bs);
    return 0;
}

KVW_CMD("info", cmd_info, "transports, environment variables and UCX devices")
KVW_CMD("bootstrap", cmd_bootstrap, "run a standalone bootstrap endpoint")
