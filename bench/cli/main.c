/*
 * kvwire-bench: `kvwire bench` as a program of its own, built in the build tree and not
 * installed, so that the installed CLI carries no benchmark or test-kit code.
 * `kvwire-bench [options]` is `kvwire bench [options]`; the build tree's `kvwire bench`
 * runs it as `kvwire-bench bench [options]` (tools/kvwire/main.c), which is the same.
 */
#include "cmd.h"

#include <stdio.h>
#include <string.h>

static kvw_cmd_t *bench_cmd;

/* cmd_bench.c registers the one command (KVW_CMD). */
void kvw_cmd_register(kvw_cmd_t *cmd)
{
    bench_cmd = cmd;
}

int main(int argc, char **argv)
{
    if (!bench_cmd || strcmp(bench_cmd->name, "bench") != 0) {
        fprintf(stderr, "kvwire-bench: no bench command linked in\n");
        return 1;
    }
    if (argc > 1 && !strcmp(argv[1], "bench"))
        argc--, argv++;
    argv[0] = (char *)"bench"; /* a command's argv[0] is its name */
    return bench_cmd->fn(argc, argv);
}
