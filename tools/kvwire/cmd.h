/* Subcommands of the kvwire CLI register themselves with KVW_CMD(name, fn, help). */
#ifndef KVW_TOOLS_CMD_H
#define KVW_TOOLS_CMD_H

#include <stddef.h>

typedef int (*kvw_cmd_fn)(int argc, char **argv); /* argv[0] is the subcommand name */

typedef struct kvw_cmd {
    const char *name;
    kvw_cmd_fn fn;
    const char *help;
    struct kvw_cmd *next;
} kvw_cmd_t;

void kvw_cmd_register(kvw_cmd_t *cmd);

/* Reads the shared secret from `path` (cmd_demo.c): its first line, at most cap-1 bytes.
 * The file must not be readable by other users (the secret is the whole of the
 * authentication). Prints why to stderr, prefixed with `who`, and returns -1 if not. */
int kvw_cli_read_secret(const char *who, const char *path, char *out, size_t cap);

/* kvwire bench --latency (bench_latency.c). */
int kvw_bench_latency(int argc, char **argv);

/* kvwire bench --stream (bench_stream.c). */
int kvw_bench_stream(int argc, char **argv);

#define KVW_CMD(name_, fn_, help_)                                                       \
    static kvw_cmd_t kvw_cmd_##fn_ = {name_, fn_, help_, 0};                            \
    __attribute__((constructor)) static void kvw_cmd_reg_##fn_(void)                   \
    {                                                                                    \
        kvw_cmd_register(&kvw_cmd_##fn_);                                                \
    }

#endif
