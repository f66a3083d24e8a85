/* kvwire command-line tool: demos and inspection (the benchmarks: kvwire-bench, bench/cli/). */
#include "cmd.h"

#include <kvwire/kvwire.h>

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static kvw_cmd_t *kvw_cmds;

void kvw_cmd_register(kvw_cmd_t *cmd)
{
    /* Keep the list sorted by name so `kvwire help` reads well. */
    kvw_cmd_t **pp = &kvw_cmds;
    while (*pp && strcmp((*pp)->name, cmd->name) < 0)
        pp = &(*pp)->next;
    cmd->next = *pp;
    *pp = cmd;
}

static void usage(FILE *f)
{
    fprintf(f, "kvwire %s — move KV caches from prefill to decode workers\n\n"
               "usage: kvwire <command> [options]   (kvwire <command> --help for details)\n\n",
            kvw_version());
    fprintf(f, "  %-10s %s\n", "bench", "benchmarks: the build tree's kvwire-bench (not installed)");
    for (kvw_cmd_t *c = kvw_cmds; c; c = c->next)
        fprintf(f, "  %-10s %s\n", c->name, c->help);
}

/* `kvwire bench ...`: runs kvwire-bench from the directory of this executable (the build
 * tree), which takes the same arguments; the installed CLI carries no benchmark code. */
static int run_sibling_tool(char **argv)
{
    char self[PATH_MAX], path[PATH_MAX + 16] = "";
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    char *slash = NULL;
    if (n > 0) {
        self[n] = '\0';
        slash = strrchr(self, '/');
    }
    if (slash) {
        *slash = '\0';
        snprintf(path, sizeof path, "%s/kvwire-bench", self);
    }
    if (!path[0] || access(path, X_OK) != 0) {
        fprintf(stderr, "kvwire: kvwire bench is not part of the installed CLI; run "
                        "build/kvwire-bench (built by make build; none next to this kvwire)\n");
        return 2;
    }
    argv[0] = path;
    execv(path, argv);
    fprintf(stderr, "kvwire: cannot run %s: %s\n", path, strerror(errno));
    return 1;
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "help") || !strcmp(argv[1], "--help") ||
        !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (kvw_cmd_t *c = kvw_cmds; c; c = c->next)
        if (!strcmp(c->name, argv[1]))
            return c->fn(argc - 1, argv + 1);
    if (!strcmp(argv[1], "bench"))
        return run_sibling_tool(argv);
    fprintf(stderr, "kvwire: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
