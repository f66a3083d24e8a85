/*
 * `kvwire plan`: builds the transfer plans of one request between every (prefill rank,
 * decode rank) pair of two TP groups and prints what they would move: routes, bytes,
 * compact segments, elementary runs before and after coalescing, and the memory each
 * plan holds. Nothing is copied: the ranks are described with placeholder addresses
 * (kvw_plan_create and kvw_plan_stats never touch the buffers), so a 128K-token plan
 * for a large model costs no buffer memory.
 *
 * Pages are drawn at random from pools twice the request's size (a fixed seed, so the
 * output is reproducible); --consecutive uses pages 0, 1, 2, ... instead, which shows
 * the best case for coalescing.
 *
 * Exit status: 0 on success, 1 when the library rejects the configuration, 2 on a
 * usage error.
 */
#include "cmd.h"

#include <kvwire/kvwire.h>

#include "testkit.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define KVW_PLAN_EXIT_REJECTED 1
#define KVW_PLAN_EXIT_USAGE 2

/* Bounds that keep a typo from allocating gigabytes of page lists. */
#define KVW_PLAN_MAX_TOKENS (1ull << 22)
#define KVW_PLAN_MAX_PAGE 65536u
#define KVW_PLAN_MAX_TP 256u

static void kvw_plan_usage(FILE *f)
{
    fprintf(f,
            "usage: kvwire plan --model NAME --src-tp S --dst-tp D [--tokens N]\n"
            "                   [--page-size P] [--dst-page-size P2] [--src-layout nhd|hnd]\n"
            "                   [--dst-layout nhd|hnd] [--prefix N] [--layers N]\n"
            "                   [--kv-heads H] [--consecutive]\n"
            "\n"
            "Builds the plan of one request for every (source, destination) rank pair and\n"
            "prints routes, bytes, segments, runs before and after coalescing, plan memory\n"
            "and build time per pair, then totals. No buffer memory is allocated.\n"
            "\n"
            "  --model NAME        model preset:");
    for (const char *const *n = kvt_model_names(); *n; n++)
        fprintf(f, " %s", *n);
    fprintf(f,
            "\n"
            "  --src-tp S          TP size of the prefill (source) group\n"
            "  --dst-tp D          TP size of the decode (destination) group\n"
            "  --tokens N          request length (default 8192)\n"
            "  --page-size P       tokens per page on the source side (default 64); also\n"
            "                      the destination's unless --dst-page-size is given\n"
            "  --dst-page-size P2  tokens per page on the destination side\n"
            "  --src-layout L      nhd (default) or hnd, likewise --dst-layout\n"
            "  --prefix N          tokens the decode side already holds (default 0)\n"
            "  --layers N          keep only the model's first N layers\n"
            "  --kv-heads H        override the preset's KV head count (e.g. 6 for TP 3)\n"
            "  --consecutive       pages 0, 1, 2, ... instead of random pages\n"
            "  -h, --help          print this help\n"
            "\n"
            "The sliding-window pool uses the same page size as the full pool on each side.\n"
            "Exit status: 0 ok, 1 rejected by the library, 2 usage error.\n");
}

/* Parses a decimal integer in [min, max]; rejects signs, blanks and trailing junk. */
static int kvw_plan_parse_u64(const char *opt, const char *text, uint64_t min, uint64_t max,
                              uint64_t *value_p)
{
    if (text == NULL) {
        fprintf(stderr, "kvwire plan: %s needs a value\n", opt);
        return -1;
    }
    if (!isdigit((unsigned char)text[0])) {
        fprintf(stderr, "kvwire plan: %s: '%s' is not a non-negative integer\n", opt, text);
        return -1;
    }
    char *end;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (*end != '\0') {
        fprintf(stderr, "kvwire plan: %s: '%s' is not a non-negative integer\n", opt, text);
        return -1;
    }
    if (errno == ERANGE || v > max || v < min) {
        fprintf(stderr, "kvwire plan: %s: %s is outside [%llu, %llu]\n", opt, text,
                (unsigned long long)min, (unsigned long long)max);
        return -1;
    }
    *value_p = v;
    return 0;
}

static int kvw_plan_parse_layout(const char *opt, const char *text, kvw_layout_t *layout_p)
{
    if (text && !strcasecmp(text, "nhd")) {
        *layout_p = KVW_LAYOUT_NHD;
        return 0;
    }
    if (text && !strcasecmp(text, "hnd")) {
        *layout_p = KVW_LAYOUT_HND;
        return 0;
    }
    fprintf(stderr, "kvwire plan: %s: '%s' is not nhd or hnd\n", opt, text ? text : "");
    return -1;
}

/* Matches `--name value` and `--name=value` (see cmd_topo.c). */
static int kvw_plan_match(int argc, char **argv, int *i, const char *name, const char **text_p)
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

typedef struct kvw_plan_opts {
    const char *model;
    uint64_t src_tp, dst_tp, tokens, page, dst_page, prefix, layers, kv_heads;
    kvw_layout_t src_layout, dst_layout;
    int consecutive;
} kvw_plan_opts_t;

/*
 * Lets the library judge whether `tp` can split the model's KV heads and every state
 * group, so that the message is the library's own (the test kit would only say
 * "invalid parameter").
 */
static int kvw_plan_check_tp(const kvt_model_t *model, uint32_t tp)
{
    uint32_t first, count;
    int attn = 0;
    for (uint32_t l = 0; l < model->m.num_layers; l++)
        attn |= model->layers[l].kind == KVW_LAYER_FULL || model->layers[l].kind == KVW_LAYER_SWA;
    kvw_status_t st = attn ? kvw_topo_heads(tp, 0, model->m.num_kv_heads, &first, &count)
                           : KVW_OK;
    for (uint32_t b = 0; st == KVW_OK && b < model->num_state_bufs; b++)
        for (uint32_t g = 0; st == KVW_OK && g < model->state[b].num_groups; g++)
            st = kvw_topo_heads(tp, 0, model->state[b].groups[g].total_heads, &first, &count);
    if (st != KVW_OK) {
        fprintf(stderr, "kvwire plan: TP %u rejected: %s: %s\n", tp, kvw_status_string(st),
                kvw_last_error());
        return -1;
    }
    return 0;
}

/* Describes every rank of one TP group (placeholder addresses) and its page lists. */
static int kvw_plan_side(const kvt_model_t *model, const kvw_plan_opts_t *o, uint32_t tp,
                         uint32_t page, kvw_layout_t layout, uint64_t full_begin, kvt_rng_t *rng,
                         kvt_rank_t *ranks, kvt_req_pages_t *pages)
{
    uint32_t window = 0;
    for (uint32_t l = 0; l < model->m.num_layers; l++)
        if (model->layers[l].kind == KVW_LAYER_SWA && model->layers[l].window > window)
            window = model->layers[l].window;
    uint64_t swa_begin = o->tokens > window ? o->tokens - window : 0;
    uint64_t full_pages = (o->tokens + page - 1) / page + 1;
    uint64_t swa_pages = (o->tokens - swa_begin + page - 1) / page + 1;
    for (uint32_t r = 0; r < tp; r++) {
        kvt_rank_spec_t spec;
        memset(&spec, 0, sizeof(spec));
        spec.model = model;
        spec.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = tp,
                                    .tp_rank = r, .pp_size = 1, .pp_rank = 0,
                                    .layer_begin = 0, .layer_end = model->m.num_layers,
                                    .dp_size = 1, .dp_rank = 0};
        spec.layout = layout;
        spec.page_size[KVW_POOL_FULL] = spec.page_size[KVW_POOL_SWA] = page;
        spec.num_pages[KVW_POOL_FULL] = (uint32_t)(2 * full_pages);
        spec.num_pages[KVW_POOL_SWA] = (uint32_t)(2 * swa_pages);
        spec.num_slots = 1;
        spec.describe_only = 1;
        if (r == 0 && kvw_plan_check_tp(model, tp))
            return KVW_PLAN_EXIT_REJECTED;
        kvw_status_t st = kvt_rank_describe(&spec, &ranks[r]);
        if (st != KVW_OK) {
            fprintf(stderr, "kvwire plan: cannot describe rank %u of TP %u: %s\n", r, tp,
                    kvw_status_string(st));
            return KVW_PLAN_EXIT_REJECTED;
        }
        st = kvt_rank_open(&ranks[r]);
        if (st != KVW_OK) {
            fprintf(stderr, "kvwire plan: rank %u of TP %u rejected: %s: %s\n", r, tp,
                    kvw_status_string(st), kvw_last_error());
            return KVW_PLAN_EXIT_REJECTED;
        }
        kvt_req_spec_t rs = {.full_begin = full_begin, .full_end = o->tokens,
                             .swa_begin = swa_begin, .swa_end = o->tokens, .state_slot = 0,
                             .consecutive = o->consecutive};
        if (kvt_req_pages_make(&ranks[r], &rs, rng, &pages[r])) {
            fprintf(stderr, "kvwire plan: out of memory for page lists\n");
            return KVW_PLAN_EXIT_REJECTED;
        }
    }
    return 0;
}

static void kvw_plan_print_size(char *buf, size_t cap, uint64_t bytes)
{
    if (bytes >= (1ull << 30))
        snprintf(buf, cap, "%.2f GiB", bytes / (double)(1ull << 30));
    else if (bytes >= (1ull << 20))
        snprintf(buf, cap, "%.2f MiB", bytes / (double)(1ull << 20));
    else if (bytes >= 1024)
        snprintf(buf, cap, "%.1f KiB", bytes / 1024.0);
    else
        snprintf(buf, cap, "%llu B", (unsigned long long)bytes);
}

static int kvw_plan_run(const kvw_plan_opts_t *o)
{
    kvt_model_t model;
    if (kvt_model_preset(o->model, &model)) {
        fprintf(stderr, "kvwire plan: unknown model '%s'; the presets are:", o->model);
        for (const char *const *n = kvt_model_names(); *n; n++)
            fprintf(stderr, " %s", *n);
        fprintf(stderr, "\n");
        return KVW_PLAN_EXIT_USAGE;
    }
    if (o->kv_heads)
        model.m.num_kv_heads = (uint32_t)o->kv_heads;
    if (o->layers && kvt_model_truncate(&model, (uint32_t)o->layers)) {
        fprintf(stderr, "kvwire plan: --layers %llu: %s has %u layers\n",
                (unsigned long long)o->layers, o->model, model.m.num_layers);
        return KVW_PLAN_EXIT_USAGE;
    }
    uint32_t S = (uint32_t)o->src_tp, D = (uint32_t)o->dst_tp;
    kvt_rank_t *src = calloc(S, sizeof(*src)), *dst = calloc(D, sizeof(*dst));
    kvt_req_pages_t *sp = calloc(S, sizeof(*sp)), *dp = calloc(D, sizeof(*dp));
    int rc = KVW_PLAN_EXIT_REJECTED;
    kvt_rng_t rng = {2026};
    if (!src || !dst || !sp || !dp) {
        fprintf(stderr, "kvwire plan: out of memory\n");
        goto out;
    }
    /* The decode side lists pages from the prefix's first page: it already holds the
     * rest of the prefix's pages. */
    if ((rc = kvw_plan_side(&model, o, S, (uint32_t)o->page, o->src_layout, 0, &rng, src, sp)) ||
        (rc = kvw_plan_side(&model, o, D, (uint32_t)o->dst_page, o->dst_layout, o->prefix, &rng,
                            dst, dp)))
        goto out;

    printf("model %s (%u layers), %llu tokens, prefix %llu\n", o->model, model.m.num_layers,
           (unsigned long long)o->tokens, (unsigned long long)o->prefix);
    printf("source TP %u, page %llu, %s  ->  destination TP %u, page %llu, %s; %s pages\n", S,
           (unsigned long long)o->page, o->src_layout == KVW_LAYOUT_HND ? "HND" : "NHD", D,
           (unsigned long long)o->dst_page, o->dst_layout == KVW_LAYOUT_HND ? "HND" : "NHD",
           o->consecutive ? "consecutive" : "random");
    printf("%4s %4s %6s %14s %9s %12s %12s %10s %9s\n", "src", "dst", "routes", "bytes",
           "segments", "runs raw", "runs merged", "plan mem", "build us");

    kvw_chunk_t ch = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = o->tokens,
                      .chunk_begin = 0, .chunk_end = o->tokens,
                      .prefix_len = o->prefix, .last_chunk = 1};
    kvw_plan_stats_t tot = {.field_mask = KVW_PLAN_STATS_FIELDS_ALL};
    memset(&tot, 0, sizeof(tot));
    uint64_t pairs = 0;
    for (uint32_t d = 0; d < D; d++) {
        for (uint32_t s = 0; s < S; s++) {
            kvw_plan_h plan = NULL;
            uint64_t t0 = kvt_now_ns();
            kvw_status_t st = kvw_plan_create(src[s].h, dst[d].h, &ch, &sp[s].side, &dp[d].side,
                                              &plan);
            uint64_t t1 = kvt_now_ns();
            if (st != KVW_OK) {
                fprintf(stderr, "kvwire plan: source %u -> destination %u rejected: %s: %s\n", s,
                        d, kvw_status_string(st), kvw_last_error());
                rc = KVW_PLAN_EXIT_REJECTED;
                goto out;
            }
            kvw_plan_stats_t ps = {.field_mask = KVW_PLAN_STATS_FIELDS_ALL};
            st = kvw_plan_stats(plan, &ps);
            kvw_plan_destroy(plan);
            if (st != KVW_OK) {
                fprintf(stderr, "kvwire plan: stats: %s: %s\n", kvw_status_string(st),
                        kvw_last_error());
                rc = KVW_PLAN_EXIT_REJECTED;
                goto out;
            }
            if (ps.bytes == 0)
                continue; /* this source serves nothing to this destination */
            char mem[32];
            kvw_plan_print_size(mem, sizeof(mem), ps.plan_bytes);
            printf("%4u %4u %6u %14llu %9llu %12llu %12llu %10s %9.1f\n", s, d, ps.num_routes,
                   (unsigned long long)ps.bytes, (unsigned long long)ps.num_segments,
                   (unsigned long long)ps.runs_raw, (unsigned long long)ps.runs_coalesced, mem,
                   (t1 - t0) / 1e3);
            pairs++;
            tot.num_routes += ps.num_routes;
            tot.bytes += ps.bytes;
            tot.num_segments += ps.num_segments;
            tot.runs_raw += ps.runs_raw;
            tot.runs_coalesced += ps.runs_coalesced;
            tot.plan_bytes += ps.plan_bytes;
        }
    }
    char mem[32], moved[32];
    kvw_plan_print_size(mem, sizeof(mem), tot.plan_bytes);
    kvw_plan_print_size(moved, sizeof(moved), tot.bytes);
    printf("total: %llu pairs with data (of %u), %u routes, %llu bytes (%s), %llu segments, "
           "%llu runs raw, %llu after coalescing (%.1fx fewer; %.0f bytes per run), plans hold "
           "%s\n",
           (unsigned long long)pairs, S * D, tot.num_routes, (unsigned long long)tot.bytes, moved,
           (unsigned long long)tot.num_segments, (unsigned long long)tot.runs_raw,
           (unsigned long long)tot.runs_coalesced,
           tot.runs_coalesced ? (double)tot.runs_raw / tot.runs_coalesced : 0.0,
           tot.runs_coalesced ? (double)tot.bytes / tot.runs_coalesced : 0.0, mem);
    rc = 0;
    if (fflush(stdout) != 0) {
        fprintf(stderr, "kvwire plan: writing the output failed\n");
        rc = KVW_PLAN_EXIT_REJECTED;
    }

out:
    for (uint32_t i = 0; src && sp && i < S; i++) {
        kvt_req_pages_free(&sp[i]);
        kvt_rank_free(&src[i]);
    }
    for (uint32_t i = 0; dst && dp && i < D; i++) {
        kvt_req_pages_free(&dp[i]);
        kvt_rank_free(&dst[i]);
    }
    free(src);
    free(dst);
    free(sp);
    free(dp);
    return rc;
}

static int kvw_plan_cmd(int argc, char **argv)
{
    kvw_plan_opts_t o = {.tokens = 8192, .page = 64, .src_layout = KVW_LAYOUT_NHD,
                         .dst_layout = KVW_LAYOUT_NHD};
    int have_dst_page = 0;

    for (int i = 1; i < argc; i++) {
        const char *text;
        int bad = 0;
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            kvw_plan_usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--consecutive")) {
            o.consecutive = 1;
        } else if (kvw_plan_match(argc, argv, &i, "--model", &text)) {
            o.model = text;
            if (!text) {
                fprintf(stderr, "kvwire plan: --model needs a value\n");
                bad = 1;
            }
        } else if (kvw_plan_match(argc, argv, &i, "--src-tp", &text)) {
            bad = kvw_plan_parse_u64("--src-tp", text, 1, KVW_PLAN_MAX_TP, &o.src_tp);
        } else if (kvw_plan_match(argc, argv, &i, "--dst-tp", &text)) {
            bad = kvw_plan_parse_u64("--dst-tp", text, 1, KVW_PLAN_MAX_TP, &o.dst_tp);
        } else if (kvw_plan_match(argc, argv, &i, "--tokens", &text)) {
            bad = kvw_plan_parse_u64("--tokens", text, 1, KVW_PLAN_MAX_TOKENS, &o.tokens);
        } else if (kvw_plan_match(argc, argv, &i, "--page-size", &text)) {
            bad = kvw_plan_parse_u64("--page-size", text, 1, KVW_PLAN_MAX_PAGE, &o.page);
        } else if (kvw_plan_match(argc, argv, &i, "--dst-page-size", &text)) {
            bad = kvw_plan_parse_u64("--dst-page-size", text, 1, KVW_PLAN_MAX_PAGE, &o.dst_page);
            have_dst_page = 1;
        } else if (kvw_plan_match(argc, argv, &i, "--prefix", &text)) {
            bad = kvw_plan_parse_u64("--prefix", text, 0, KVW_PLAN_MAX_TOKENS, &o.prefix);
        } else if (kvw_plan_match(argc, argv, &i, "--layers", &text)) {
            bad = kvw_plan_parse_u64("--layers", text, 1, KVT_MAX_LAYERS, &o.layers);
        } else if (kvw_plan_match(argc, argv, &i, "--kv-heads", &text)) {
            bad = kvw_plan_parse_u64("--kv-heads", text, 1, 4096, &o.kv_heads);
        } else if (kvw_plan_match(argc, argv, &i, "--src-layout", &text)) {
            bad = kvw_plan_parse_layout("--src-layout", text, &o.src_layout);
        } else if (kvw_plan_match(argc, argv, &i, "--dst-layout", &text)) {
            bad = kvw_plan_parse_layout("--dst-layout", text, &o.dst_layout);
        } else {
            fprintf(stderr, "kvwire plan: unknown argument '%s'\n\n", argv[i]);
            kvw_plan_usage(stderr);
            return KVW_PLAN_EXIT_USAGE;
        }
        if (bad)
            return KVW_PLAN_EXIT_USAGE;
    }
    if (!o.model || !o.src_tp || !o.dst_tp) {
        fprintf(stderr, "kvwire plan: missing %s\n\n",
                !o.model ? "--model" : !o.src_tp ? "--src-tp" : "--dst-tp");
        kvw_plan_usage(stderr);
        return KVW_PLAN_EXIT_USAGE;
    }
    if (!have_dst_page)
        o.dst_page = o.page;
    if (o.prefix >= o.tokens) {
        fprintf(stderr, "kvwire plan: --prefix %llu must be below --tokens %llu\n",
                (unsigned long long)o.prefix, (unsigned long long)o.tokens);
        return KVW_PLAN_EXIT_USAGE;
    }
    return kvw_plan_run(&o);
}

KVW_CMD("plan", kvw_plan_cmd, "summarize the transfer plans of one request between two TP groups")
