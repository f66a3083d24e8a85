/* Subcommands of the kvwire CLI register themselves with KVW_CMD(name, fn, help). */
#ifndef KVW_TOOLS_CMD_H
#define KVW_TOOLS_CMD_H

typedef int (*kvw_cmd_fn)(int argc, char **argv); /* argv[0] is the subcommand name */

typedef struct kvw_cmd {
    const char *name;
    kvw_cmd_fn fn;
    const char *help;
    struct kvw_cmd *next;
} kvw_cmd_t;

void kvw_cmd_register(kvw_cmd_t *cmd);

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
