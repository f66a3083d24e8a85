/*
 * `kvwire topo`: prints the head routes between a prefill (source) TP group and a
 * decode (destination) TP group, as computed by kvw_topo_routes. It exists so that an
 * operator can see, before deploying, which rank sends which heads to which rank, and
 * so that scripts can consume the same table as JSON.
 *
 * Exit status: 0 on success, 1 when the library rejects the topology (e.g. 8 KV heads
 * on TP 3), 2 on a usage error.
 */
#include "cmd.h"

#include <kvwire/kvwire.h>

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KVW_TOPO_EXIT_REJECTED 1
#define KVW_TOPO_EXIT_USAGE 2

/*
 * Every route is printed, so a typo such as an extra zero should not make the tool
 * allocate and print millions of lines; real deployments are far below this.
 */
#define KVW_TOPO_MAX_VALUE (1u << 20)

static void kvw_topo_usage(FILE *f)
{
    fprintf(f,
            "usage: kvwire topo --src-tp S --dst-tp D --kv-heads H [--mla] [--json]\n"
            "\n"
            "Prints which source (prefill) rank sends which KV heads to which destination\n"
            "(decode) rank when the two sides use different tensor-parallel sizes.\n"
            "\n"
            "  --src-tp S      TP size of the source (prefill) group, > 0\n"
            "  --dst-tp D      TP size of the destination (decode) group, > 0\n"
            "  --kv-heads H    total KV heads of the model, > 0\n"
            "  --mla           MLA model: one latent row replicated on every rank, so each\n"
            "                  destination reads it whole from one source (--kv-heads is\n"
            "                  then optional and ignored; routes use 1 head)\n"
            "  --json          print one JSON object instead of a table\n"
            "  -h, --help      print this help\n"
            "\n"
            "Head ranges are half-open. 'abs' counts over all KV heads of the model; 'local'\n"
            "is the offset inside that rank's own heads (what the buffers are indexed by).\n"
            "Exit status: 0 ok, 1 topology rejected, 2 usage error.\n");
}

/*
 * Parses a positive decimal integer. strtoul alone would accept leading blanks, a sign
 * ("-1" wraps to a huge value) and trailing junk, so those are checked here.
 */
static int kvw_topo_parse_u32(const char *opt, const char *text, uint32_t *value_p)
{
    if (text == NULL) {
        fprintf(stderr, "kvwire topo: %s needs a value\n", opt);
        return -1;
    }
    if (!isdigit((unsigned char)text[0])) {
        fprintf(stderr, "kvwire topo: %s: '%s' is not a positive integer\n", opt, text);
        return -1;
    }
    char *end;
    errno = 0;
    unsigned long v = strtoul(text, &end, 10);
    if (*end != '\0') {
        fprintf(stderr, "kvwire topo: %s: '%s' is not a positive integer\n", opt, text);
        return -1;
    }
    if (errno == ERANGE || v > KVW_TOPO_MAX_VALUE) {
        fprintf(stderr, "kvwire topo: %s: %s is too large (at most %u)\n", opt, text,
                KVW_TOPO_MAX_VALUE);
        return -1;
    }
    if (v == 0) {
        fprintf(stderr, "kvwire topo: %s must be greater than 0\n", opt);
        return -1;
    }
    *value_p = (uint32_t)v;
    return 0;
}

/*
 * Matches `--name value` and `--name=value`. Returns 1 when argv[*i] is this option
 * (advancing *i past a separate value), 0 otherwise; *text_p is NULL when the value
 * is missing.
 */
static int kvw_topo_match(int argc, char **argv, int *i, const char *name, const char **text_p)
{
    size_t len = strlen(name);
    const char *arg = argv[*i];
    if (strncmp(arg, name, len) != 0)
        return 0;
    if (arg[len] == '=') {
        *text_p = arg + len + 1;
        return 1;
    }
    if (arg[len] != '\0')
        return 0;
    *text_p = *i + 1 < argc ? argv[++*i] : NULL;
    return 1;
}

static void kvw_topo_print_json(uint32_t src_tp, uint32_t dst_tp, uint32_t heads, int mla,
                                const kvw_route_t *routes, size_t count)
{
    printf("{\"src_tp\":%u,\"dst_tp\":%u,\"kv_heads\":%u,\"mla\":%s,\"routes\":[", src_tp,
           dst_tp, heads, mla ? "true" : "false");
    for (size_t i = 0; i < count; i++) {
        const kvw_route_t *r = &routes[i];
        printf("%s{\"src_rank\":%u,\"dst_rank\":%u,\"src_head_start\":%u,"
               "\"dst_head_start\":%u,\"num_heads\":%u}",
               i ? "," : "", r->src_rank, r->dst_rank, r->src_head_start, r->dst_head_start,
               r->num_heads);
    }
    printf("]}\n");
}

static int kvw_topo_print_table(uint32_t src_tp, uint32_t dst_tp, uint32_t heads, int mla,
                                const kvw_route_t *routes, size_t count)
{
    if (mla)
        printf("src TP %u -> dst TP %u, MLA (one latent row per rank): %zu route%s\n", src_tp,
               dst_tp, count, count == 1 ? "" : "s");
    else
        printf("src TP %u -> dst TP %u, %u KV heads: %zu route%s\n", src_tp, dst_tp, heads,
               count, count == 1 ? "" : "s");
    printf("%5s %5s  %-16s %-18s %-18s %5s\n", "src", "dst", "src heads (abs)",
           "src heads (local)", "dst heads (local)", "n");
    for (size_t i = 0; i < count; i++) {
        const kvw_route_t *r = &routes[i];
        uint32_t first, owned;
        /* The absolute range is what people reason about; the library reports offsets,
         * so translate through the source rank's ownership. */
        kvw_status_t st = kvw_topo_heads(src_tp, r->src_rank, heads, &first, &owned);
        if (st != KVW_OK) {
            fprintf(stderr, "kvwire topo: %s: %s\n", kvw_status_string(st), kvw_last_error());
            return KVW_TOPO_EXIT_REJECTED;
        }
        char abs_range[40], src_range[40], dst_range[40];
        uint32_t a = first + r->src_head_start;
        snprintf(abs_range, sizeof(abs_range), "[%u,%u)", a, a + r->num_heads);
        snprintf(src_range, sizeof(src_range), "[%u,%u)", r->src_head_start,
                 r->src_head_start + r->num_heads);
        snprintf(dst_range, sizeof(dst_range), "[%u,%u)", r->dst_head_start,
                 r->dst_head_start + r->num_heads);
        printf("%5u %5u  %-16s %-18s %-18s %5u\n", r->src_rank, r->dst_rank, abs_range,
               src_range, dst_range, r->num_heads);
    }
    return 0;
}

static int kvw_topo_cmd(int argc, char **argv)
{
    uint32_t src_tp = 0, dst_tp = 0, heads = 0;
    int mla = 0, json = 0;

    for (int i = 1; i < argc; i++) {
        const char *text;
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            kvw_topo_usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--mla")) {
            mla = 1;
        } else if (!strcmp(argv[i], "--json")) {
            json = 1;
        } else if (kvw_topo_match(argc, argv, &i, "--src-tp", &text)) {
            if (kvw_topo_parse_u32("--src-tp", text, &src_tp))
                return KVW_TOPO_EXIT_USAGE;
        } else if (kvw_topo_match(argc, argv, &i, "--dst-tp", &text)) {
            if (kvw_topo_parse_u32("--dst-tp", text, &dst_tp))
                return KVW_TOPO_EXIT_USAGE;
        } else if (kvw_topo_match(argc, argv, &i, "--kv-heads", &text)) {
            if (kvw_topo_parse_u32("--kv-heads", text, &heads))
                return KVW_TOPO_EXIT_USAGE;
        } else {
            fprintf(stderr, "kvwire topo: unknown argument '%s'\n\n", argv[i]);
            kvw_topo_usage(stderr);
            return KVW_TOPO_EXIT_USAGE;
        }
    }
    if (src_tp == 0 || dst_tp == 0 || (heads == 0 && !mla)) {
        fprintf(stderr, "kvwire topo: missing %s\n\n",
                src_tp == 0 ? "--src-tp" : dst_tp == 0 ? "--dst-tp" : "--kv-heads");
        kvw_topo_usage(stderr);
        return KVW_TOPO_EXIT_USAGE;
    }
    /* MLA keeps one latent row replicated on every rank: route it as a single head. */
    if (mla)
        heads = 1;

    /* Ask for the count first; the library reports it with BUFFER_TOO_SMALL. */
    kvw_route_t probe[1];
    size_t count = 0;
    kvw_status_t st = kvw_topo_routes(src_tp, dst_tp, heads, probe, 0, &count);
    if (st != KVW_OK && st != KVW_ERR_BUFFER_TOO_SMALL) {
        fprintf(stderr, "kvwire topo: %s: %s\n", kvw_status_string(st), kvw_last_error());
        return KVW_TOPO_EXIT_REJECTED;
    }
    kvw_route_t *routes = calloc(count ? count : 1, sizeof(*routes));
    if (routes == NULL) {
        fprintf(stderr, "kvwire topo: out of memory for %zu routes\n", count);
        return KVW_TOPO_EXIT_REJECTED;
    }
    size_t got = 0;
    st = kvw_topo_routes(src_tp, dst_tp, heads, routes, count, &got);
    if (st != KVW_OK) {
        fprintf(stderr, "kvwire topo: %s: %s\n", kvw_status_string(st), kvw_last_error());
        free(routes);
        return KVW_TOPO_EXIT_REJECTED;
    }

    int rc = 0;
    if (json)
        kvw_topo_print_json(src_tp, dst_tp, heads, mla, routes, got);
    else
        rc = kvw_topo_print_table(src_tp, dst_tp, heads, mla, routes, got);
    free(routes);
    if (rc == 0 && fflush(stdout) != 0) {
        fprintf(stderr, "kvwire topo: writing the output failed\n");
        rc = KVW_TOPO_EXIT_REJECTED;
    }
    return rc;
}

KVW_CMD("topo", kvw_topo_cmd, "print the KV head routes between two TP sizes")
