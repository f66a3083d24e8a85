/* kvwire info and kvwire bootstrap. */
#include "cmd.h"

#include <kvwire/xfer.h>

#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static int cmd_info(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    printf("kvwire %s\n\ntransports compiled in:\n", kvw_version());
    for (const char *const *n = kvw_transport_names(); *n; n++)
        printf("  %s\n", *n);
    printf("\nenvironment:\n");
    size_t nv = 0;
    const kvw_config_var_t *v = kvw_config_vars(&nv);
    for (size_t i = 0; i < nv; i++)
        printf("  %-20s default %-36s %s\n", v[i].name, v[i].default_value, v[i].help);
    bool ucx = false;
    for (const char *const *n = kvw_transport_names(); *n; n++)
        ucx |= !strcmp(*n, "ucx");
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

static int cmd_bootstrap(int argc, char **argv)
{
    const char *addr = "0.0.0.0:17000";
    char secret[256] = "";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--listen") && i + 1 < argc) {
            addr = argv[++i];
        } else if (!strcmp(argv[i], "--secret-file") && i + 1 < argc) {
            if (kvw_cli_read_secret("bootstrap", argv[++i], secret, sizeof(secret)))
                return 2;
        } else {
            fprintf(stderr, "usage: kvwire bootstrap [--listen host:port] [--secret-file PATH]"
                            "   (default %s)\n"
                            "Runs the bootstrap endpoint where prefill ranks register and decode "
                            "ranks look them up, until interrupted. With a shared secret "
                            "(--secret-file or KVW_SECRET_FILE, mode 600), registrations without "
                            "a valid MAC are refused.\n", addr);
            return strcmp(argv[i], "--help") ? 2 : 0;
        }
    }
    const char *sf = getenv("KVW_SECRET_FILE");
    if (!secret[0] && sf && sf[0] && kvw_cli_read_secret("bootstrap", sf, secret, sizeof(secret)))
        return 2;
    kvw_bootstrap_params_t bp = {.field_mask = KVW_BOOTSTRAP_FIELD_ADDR | KVW_BOOTSTRAP_FIELD_SECRET,
                                 .addr = addr, .secret = secret};
    kvw_bootstrap_h bs;
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
    return 0;
}

KVW_CMD("info", cmd_info, "transports, environment variables and UCX devices")
KVW_CMD("bootstrap", cmd_bootstrap, "run a standalone bootstrap endpoint")
