/* kvwire command-line tool: demos, inspection and benchmarks. */
#include "cmd.h"

#include <kvwire/kvwire.h>

#include <stdio.h>
#include <string.h>

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
    for (kvw_cmd_t *c = kvw_cmds; c; c = c->next)
        fprintf(f, "  %-10s %s\n", c->name, c->help);
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
    fprintf(stderr, "kvwire: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
