/*
 * kvwire bench --stream: what layer-wise streaming hides. A simulated prefill forward
 * pass makes its layers ready one by one at a fixed interval; the room's KV either
 * leaves layer by layer as they become ready (kvw_sender_send_streamed and
 * kvw_sender_layers_ready) or all at once after the last layer (kvw_sender_send). The
 * figure that matters is the tail: from the last layer ready to Success on the decode.
 *
 * One process, host memory: prefill TP S and decode TP D contexts over one transport.
 * The forward pass sleeps (a GPU computes without the host's CPU); the interval is
 * calibrated so that one layer's compute takes as long as one layer's transfer (the
 * whole room sent at once, divided by its layers), unless --layer-us sets it. Times
 * come from the library's hop stamps (CLOCK_MONOTONIC, one process): the prefill's
 * KVW_HOP_SEND (the last chunk handed over: the last layer marked ready, when
 * streamed) and the decode's KVW_HOP_SUCCESS. Target of the issue: the streamed tail
 * at most 1.2x one layer's transfer time.
 */
#include "cmd.h"
#include "testkit.h"
#include "util.h"

#include <kvwire/xfer.h>

#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define S_MAX_TP 8
#define S_MAX_REPS 100
#define S_MAX(a, b) ((a) > (b) ? (a) : (b))

typedef struct stream_cfg {
    char transport[16];
    char model[48];
    uint32_t layers, ptp, dtp, page, reps;
    uint64_t tokens;
    uint64_t layer_ns; /* 0: calibrated */
    const char *json;
} stream_cfg_t;

typedef struct stream_env {
    stream_cfg_t *cfg;
    kvt_model_t model;
    kvt_rank_t src[S_MAX_TP], dst[S_MAX_TP];
    kvt_req_pages_t sp[S_MAX_TP], dp[S_MAX_TP];
    kvw_ctx_h pctx[S_MAX_TP], dctx[S_MAX_TP];
    uint64_t last_layer_bytes[S_MAX_TP]; /* what each decode rank gets of the last layer */
    uint64_t next_room;
} stream_env_t;

static void s_sleep_until(uint64_t t_ns)
{
    struct timespec ts = {.tv_sec = (time_t)(t_ns / 1000000000ull),
                          .tv_nsec = (long)(t_ns % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) != 0) {
    }
}

static int s_cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static double s_median_us(uint64_t *v, uint32_t n)
{
    qsort(v, n, sizeof(*v), s_cmp);
    return (double)v[n / 2] / 1000.0;
}

/*
 * One room. streamed: queued before the forward pass, each layer marked ready when its
 * compute ends; otherwise sent once the forward pass is over. layer_ns 0: no forward
 * pass at all (calibration). *tail_p: last layer ready (prefill's SEND hop) -> Success
 * on the decode (the latest decode rank).
 */
/* Opens a room on every rank and waits until every prefill rank saw the decode's
 * request, so that what is timed next starts with the room ready to move bytes. */
static int s_open(stream_env_t *e, uint64_t id, kvw_sender_h *snd, kvw_receiver_h *rcv)
{
    stream_cfg_t *c = e->cfg;
    for (uint32_t d = 0; d < c->dtp; d++) {
        kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = c->tokens,
                                .pages = e->dp[d].side};
        if (kvw_receiver_create(e->dctx[d], id, 0, &rcv[d]) != KVW_OK ||
            kvw_receiver_post(rcv[d], &post) != KVW_OK)
            return -1;
    }
    for (uint32_t k = 0; k < c->ptp; k++)
        if (kvw_sender_create(e->pctx[k], id, &snd[k]) != KVW_OK)
            return -1;
    for (uint32_t k = 0; k < c->ptp; k++) {
        uint64_t deadline = kvt_now_ns() + 30000000000ull;
        while (kvw_room_poll(kvw_sender_room(snd[k])) < KVW_ROOM_WAITING_FOR_INPUT &&
               kvt_now_ns() < deadline) {
            struct timespec ts = {0, 100000};
            nanosleep(&ts, NULL);
        }
    }
    return 0;
}

static void s_close(stream_env_t *e, kvw_sender_h *snd, kvw_receiver_h *rcv)
{
    for (uint32_t k = 0; k < e->cfg->ptp; k++)
        if (snd[k])
            kvw_room_destroy(kvw_sender_room(snd[k]));
    for (uint32_t d = 0; d < e->cfg->dtp; d++)
        if (rcv[d])
            kvw_room_destroy(kvw_receiver_room(rcv[d]));
}

/* Hands the whole room (one chunk) to every prefill rank: streamed (its layers marked
 * ready later) or sent at once. Returns 0 or -1. */
static int s_send_all(stream_env_t *e, kvw_sender_h *snd, bool streamed)
{
    kvw_send_chunk_t ch = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = e->cfg->tokens,
                           .chunk_begin = 0,
                           .chunk_end = e->cfg->tokens, .last_chunk = 1};
    for (uint32_t k = 0; k < e->cfg->ptp; k++) {
        ch.pages = e->sp[k].side;
        if ((streamed ? kvw_sender_send_streamed(snd[k], &ch) : kvw_sender_send(snd[k], &ch)) !=
            KVW_OK)
            return -1;
    }
    return 0;
}

static int s_room(stream_env_t *e, bool streamed, uint64_t layer_ns, uint64_t *tail_p)
{
    stream_cfg_t *c = e->cfg;
    uint64_t id = ++e->next_room;
    kvw_sender_h snd[S_MAX_TP] = {0};
    kvw_receiver_h rcv[S_MAX_TP] = {0};
    int rc = -1;
    if (s_open(e, id, snd, rcv) != 0 || (streamed && s_send_all(e, snd, true) != 0))
        goto out;
    uint64_t t0 = kvt_now_ns();
    for (uint32_t l = 0; l < c->layers && layer_ns; l++) {
        s_sleep_until(t0 + (l + 1) * layer_ns); /* layer l's compute */
        for (uint32_t k = 0; streamed && k < c->ptp; k++)
            if (kvw_sender_layers_ready(snd[k], l, l + 1) != KVW_OK)
                goto out;
    }
    if (streamed && layer_ns == 0)
        for (uint32_t k = 0; k < c->ptp; k++)
            if (kvw_sender_layers_ready(snd[k], 0, c->layers) != KVW_OK)
                goto out;
    if (!streamed && s_send_all(e, snd, false) != 0)
        goto out;
    uint64_t ready = 0, success = 0;
    for (uint32_t d = 0; d < c->dtp; d++) {
        if (kvw_room_wait(kvw_receiver_room(rcv[d]), 60000) != KVW_ROOM_SUCCESS) {
            fprintf(stderr, "kvwire bench --stream: room %llu: %s\n", (unsigned long long)id,
                    kvw_room_failure(kvw_receiver_room(rcv[d])));
            goto out;
        }
        kvw_room_metrics_t m = {.field_mask = KVW_ROOM_METRICS_FIELDS_ALL};
        kvw_room_metrics(kvw_receiver_room(rcv[d]), &m);
        success = S_MAX(success, m.hop_ns[KVW_HOP_SUCCESS]);
    }
    for (uint32_t k = 0; k < c->ptp; k++) {
        kvw_room_wait(kvw_sender_room(snd[k]), 60000);
        kvw_room_metrics_t m = {.field_mask = KVW_ROOM_METRICS_FIELDS_ALL};
        kvw_room_metrics(kvw_sender_room(snd[k]), &m);
        ready = S_MAX(ready, m.hop_ns[KVW_HOP_SEND]);
    }
    *tail_p = success > ready ? success - ready : 0;
    rc = 0;
out:
    if (rc)
        fprintf(stderr, "kvwire bench --stream: %s\n", kvw_last_error());
    s_close(e, snd, rcv);
    return rc;
}

/*
 * The last layer's transfer on its own: a streamed room whose last layer is marked
 * first (layers may be marked in any order), from that mark to the decode's completion
 * of its bytes (KVW_HOP_DONE_RX once every decode rank counted them); the other layers
 * are marked afterwards to finish the room.
 */
static int s_last_layer(stream_env_t *e, uint64_t *ns_p)
{
    stream_cfg_t *c = e->cfg;
    uint64_t id = ++e->next_room;
    kvw_sender_h snd[S_MAX_TP] = {0};
    kvw_receiver_h rcv[S_MAX_TP] = {0};
    int rc = -1;
    if (s_open(e, id, snd, rcv) != 0 || s_send_all(e, snd, true) != 0)
        goto out;
    uint64_t t0 = kvt_now_ns(), done = 0;
    for (uint32_t k = 0; k < c->ptp; k++)
        if (kvw_sender_layers_ready(snd[k], c->layers - 1, c->layers) != KVW_OK)
            goto out;
    for (uint32_t d = 0; d < c->dtp; d++) {
        kvw_room_metrics_t m = {.field_mask = KVW_ROOM_METRICS_FIELDS_ALL};
        uint64_t deadline = kvt_now_ns() + 60000000000ull;
        for (;;) {
            kvw_room_metrics(kvw_receiver_room(rcv[d]), &m);
            if (m.bytes >= e->last_layer_bytes[d] || kvt_now_ns() > deadline ||
                kvw_room_poll(kvw_receiver_room(rcv[d])) == KVW_ROOM_FAILED)
                break;
            struct timespec ts = {0, 20000};
            nanosleep(&ts, NULL);
        }
        if (m.bytes != e->last_layer_bytes[d]) {
            fprintf(stderr, "kvwire bench --stream: decode %u counted %llu bytes of the last "
                    "layer, expected %llu\n", d, (unsigned long long)m.bytes,
                    (unsigned long long)e->last_layer_bytes[d]);
            goto out;
        }
        done = S_MAX(done, m.hop_ns[KVW_HOP_DONE_RX]);
    }
    *ns_p = done > t0 ? done - t0 : 0;
    for (uint32_t k = 0; k < c->ptp; k++)
        if (kvw_sender_layers_ready(snd[k], 0, c->layers) != KVW_OK)
            goto out;
    for (uint32_t d = 0; d < c->dtp; d++)
        if (kvw_room_wait(kvw_receiver_room(rcv[d]), 60000) != KVW_ROOM_SUCCESS)
            goto out;
    rc = 0;
out:
    if (rc)
        fprintf(stderr, "kvwire bench --stream: %s\n", kvw_last_error());
    s_close(e, snd, rcv);
    return rc;
}

static kvw_status_t s_rank(stream_env_t *e, uint32_t tp, uint32_t r, kvt_rank_t *out)
{
    stream_cfg_t *c = e->cfg;
    uint32_t pages = (uint32_t)((c->tokens + c->page - 1) / c->page) + 1;
    kvt_rank_spec_t s = {.model = &e->model, .layout = KVW_LAYOUT_NHD,
                         .page_size = {c->page, c->page}, .num_pages = {pages, pages},
                         .num_slots = 1};
    s.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = tp, .tp_rank = r,
                             .pp_size = 1, .layer_begin = 0,
                             .layer_end = e->model.m.num_layers, .dp_size = 1};
    return kvt_rank_build(&s, out);
}

static void s_usage(FILE *f)
{
    fprintf(f,
            "usage: kvwire bench --stream [options]\n"
            "  --transport NAME   shm (default) or tcp\n"
            "  --model NAME       model preset (default gpt-oss-120b)\n"
            "  --layers N         keep the first N layers (default 12; 0 = all)\n"
            "  --tokens N         request length (default 8192)\n"
            "  --prefill-tp S     prefill TP size (default 1)\n"
            "  --decode-tp D      decode TP size (default 1)\n"
            "  --page-size N      tokens per page (default 64)\n"
            "  --reps N           timed rooms per mode (default 5)\n"
            "  --layer-us N       compute time per layer (default: calibrated to one layer's\n"
            "                     transfer time)\n"
            "  --json PATH        also write the results as JSON\n"
            "Reports, medians of the reps: one layer's transfer time (the room sent at once\n"
            "with no compute, divided by its layers), and the tail from the last layer ready\n"
            "to Success on the decode, sent after the forward pass and streamed layer by\n"
            "layer. Exits 0 when the benchmark ran, whatever the figures; 1 on errors; 2 on\n"
            "bad options.\n");
}

int kvw_bench_stream(int argc, char **argv)
{
    stream_cfg_t c = {.transport = "shm", .model = "gpt-oss-120b", .layers = 12, .ptp = 1,
                      .dtp = 1, .page = 64, .reps = 5, .tokens = 8192};
    static const struct option opts[] = {
        {"stream", no_argument, 0, 'S'},       {"transport", required_argument, 0, 't'},
        {"model", required_argument, 0, 'm'},  {"layers", required_argument, 0, 'l'},
        {"tokens", required_argument, 0, 'n'}, {"prefill-tp", required_argument, 0, 'p'},
        {"decode-tp", required_argument, 0, 'd'}, {"page-size", required_argument, 0, 'g'},
        {"reps", required_argument, 0, 'r'},   {"layer-us", required_argument, 0, 'u'},
        {"json", required_argument, 0, 'j'},   {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    optind = 1;
    int bad = 0;
    const char *w = "bench --stream";
    for (int o; !bad && (o = getopt_long(argc, argv, "", opts, NULL)) != -1;) {
        switch (o) {
        case 'S':
            break;
        case 't':
            snprintf(c.transport, sizeof(c.transport), "%s", optarg);
            break;
        case 'm':
            snprintf(c.model, sizeof(c.model), "%s", optarg);
            break;
        case 'l':
            bad = cli_opt_u32(w, "--layers", optarg, 0, KVT_MAX_LAYERS, &c.layers);
            break;
        case 'n':
            bad = cli_opt_u64(w, "--tokens", optarg, 1, 1u << 20, &c.tokens);
            break;
        case 'p':
            bad = cli_opt_u32(w, "--prefill-tp", optarg, 1, S_MAX_TP, &c.ptp);
            break;
        case 'd':
            bad = cli_opt_u32(w, "--decode-tp", optarg, 1, S_MAX_TP, &c.dtp);
            break;
        case 'g':
            bad = cli_opt_u32(w, "--page-size", optarg, 1, 65536, &c.page);
            break;
        case 'r':
            bad = cli_opt_u32(w, "--reps", optarg, 1, S_MAX_REPS, &c.reps);
            break;
        case 'u': {
            uint64_t us = 0;
            bad = cli_opt_u64(w, "--layer-us", optarg, 0, 10000000, &us);
            c.layer_ns = us * 1000ull;
            break;
        }
        case 'j':
            c.json = optarg;
            break;
        case 'h':
            s_usage(stdout);
            return 0;
        default:
            fprintf(stderr, "%s: kvwire bench --stream --help lists the options\n", w);
            return 2;
        }
    }
    if (cli_opts_end(w, "kvwire bench --stream --help", bad, optind, argc, argv))
        return 2;
    static stream_env_t e; /* large; one benchmark per process */
    memset(&e, 0, sizeof(e));
    e.cfg = &c;
    if (kvt_model_load(w, c.model, c.layers, &e.model) != 0)
        return 2;
    c.layers = e.model.m.num_layers;
    int rc = 1;
    kvt_rng_t rng = {1};
    kvt_req_spec_t spec = {.full_begin = 0, .full_end = c.tokens, .swa_begin = 0,
                           .swa_end = c.tokens, .state_slot = 0, .consecutive = 1};
    for (uint32_t k = 0; k < c.ptp; k++) {
        if (s_rank(&e, c.ptp, k, &e.src[k]) != KVW_OK ||
            kvt_req_pages_make(&e.src[k], &spec, &rng, &e.sp[k]) != 0)
            goto out;
        kvt_rank_fill(&e.src[k], 1 + k);
    }
    for (uint32_t d = 0; d < c.dtp; d++) {
        if (s_rank(&e, c.dtp, d, &e.dst[d]) != KVW_OK ||
            kvt_req_pages_make(&e.dst[d], &spec, &rng, &e.dp[d]) != 0)
            goto out;
        kvt_rank_clear(&e.dst[d], 0);
    }
    /* What each decode rank receives of the last layer, from the test kit's reference
     * (narrowed to that layer; it writes the decode's buffers with the bytes the
     * transfer writes there anyway). */
    for (uint32_t d = 0; d < c.dtp; d++) {
        kvt_ref_side_t ss[S_MAX_TP];
        uint8_t **sdata[S_MAX_TP] = {0}, **ddata = calloc(e.dst[d].num_bufs, sizeof(uint8_t *));
        bool ok = ddata != NULL;
        for (uint32_t k = 0; k < c.ptp && ok; k++) {
            ok = (sdata[k] = calloc(e.src[k].num_bufs, sizeof(uint8_t *))) != NULL;
            for (uint32_t b = 0; ok && b < e.src[k].num_bufs; b++)
                sdata[k][b] = kvt_rank_data(&e.src[k], b);
            ss[k] = kvt_ref_side(&e.src[k], &e.sp[k].side, sdata[k]);
        }
        for (uint32_t b = 0; ok && b < e.dst[d].num_bufs; b++)
            ddata[b] = kvt_rank_data(&e.dst[d], b);
        kvw_parallel_t one = e.dst[d].par;
        one.layer_begin = c.layers - 1;
        one.layer_end = c.layers;
        kvt_ref_side_t ds = kvt_ref_side(&e.dst[d], &e.dp[d].side, ddata);
        ds.par = &one;
        uint64_t bytes[S_MAX_TP] = {0};
        kvw_chunk_t whole = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = c.tokens,
                             .chunk_end = c.tokens, .last_chunk = 1};
        char msg[256] = "out of memory";
        ok = ok && kvt_ref_transfer(&e.model.m, ss, c.ptp, &ds, &whole, NULL, bytes, msg,
                                    sizeof(msg)) == 0;
        for (uint32_t k = 0; k < c.ptp; k++) {
            e.last_layer_bytes[d] += bytes[k];
            free(sdata[k]);
        }
        free(ddata);
        if (!ok) {
            fprintf(stderr, "kvwire bench --stream: reference: %s\n", msg);
            goto out;
        }
    }
    for (uint32_t k = 0; k < c.ptp; k++) {
        kvw_ctx_params_t p = {.field_mask = KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK |
                                            KVW_CTX_FIELD_TRANSPORT | KVW_CTX_FIELD_BOOTSTRAP |
                                            KVW_CTX_FIELD_HOST_BOOTSTRAP,
                              .side = KVW_SIDE_PREFILL, .rank = e.src[k].h,
                              .transport = c.transport,
                              .bootstrap_addr = k ? kvw_ctx_bootstrap_addr(e.pctx[0])
                                                  : "127.0.0.1:0",
                              .host_bootstrap = k == 0};
        if (kvw_ctx_create(&p, &e.pctx[k]) != KVW_OK)
            goto out;
    }
    for (uint32_t d = 0; d < c.dtp; d++) {
        kvw_ctx_params_t p = {.field_mask = KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK |
                                            KVW_CTX_FIELD_TRANSPORT | KVW_CTX_FIELD_BOOTSTRAP,
                              .side = KVW_SIDE_DECODE, .rank = e.dst[d].h,
                              .transport = c.transport,
                              .bootstrap_addr = kvw_ctx_bootstrap_addr(e.pctx[0])};
        if (kvw_ctx_create(&p, &e.dctx[d]) != KVW_OK)
            goto out;
    }

    /* One layer's transfer: the whole room at once with no compute (one untimed
     * warm-up first: page faults, connections). */
    uint64_t all[S_MAX_REPS], after[S_MAX_REPS], streamed[S_MAX_REPS], t;
    if (s_room(&e, false, 0, &t) != 0)
        goto out;
    for (uint32_t i = 0; i < c.reps; i++)
        if (s_room(&e, false, 0, &all[i]) != 0)
            goto out;
    uint64_t last[S_MAX_REPS];
    for (uint32_t i = 0; i < c.reps; i++)
        if (s_last_layer(&e, &last[i]) != 0)
            goto out;
    double all_us = s_median_us(all, c.reps), avg_us = all_us / c.layers;
    double layer_us = s_median_us(last, c.reps);
    /* Compute per layer = transfer per layer on average: the forward pass takes as long
     * as sending the whole room, so neither hides behind the other for free. */
    uint64_t layer_ns = c.layer_ns ? c.layer_ns : (uint64_t)(avg_us * 1000.0);
    for (uint32_t i = 0; i < c.reps; i++) {
        if (s_room(&e, false, layer_ns, &after[i]) != 0 ||
            s_room(&e, true, layer_ns, &streamed[i]) != 0)
            goto out;
    }
    double after_us = s_median_us(after, c.reps), stream_us = s_median_us(streamed, c.reps);
    printf("kvwire bench --stream: %s, %s (%u layers), %llu tokens, TP%u -> TP%u, %u reps\n",
           c.transport, c.model, c.layers, (unsigned long long)c.tokens, c.ptp, c.dtp, c.reps);
    printf("  whole room at once        %10.1f us (%.1f us per layer on average)\n", all_us,
           avg_us);
    printf("  last layer on its own     %10.1f us (\"one layer's transfer\" below)\n",
           layer_us);
    printf("  compute per layer         %10.1f us%s\n", (double)layer_ns / 1000.0,
           c.layer_ns ? "" : " (calibrated: the average layer's transfer)");
    printf("  tail, sent after forward  %10.1f us (%.2fx one layer)\n", after_us,
           after_us / layer_us);
    printf("  tail, streamed per layer  %10.1f us (%.2fx one layer; target <= 1.2x)\n",
           stream_us, stream_us / layer_us);
    if (c.json) {
        FILE *f = fopen(c.json, "w");
        if (f == NULL) {
            fprintf(stderr, "kvwire bench --stream: cannot write %s\n", c.json);
            goto out;
        }
        fprintf(f, "{\"transport\": \"%s\", \"model\": \"%s\", \"layers\": %u, \"tokens\": %llu, "
                "\"prefill_tp\": %u, \"decode_tp\": %u, \"reps\": %u, \"layer_transfer_us\": %.1f, "
                "\"room_transfer_us\": %.1f, \"avg_layer_transfer_us\": %.1f, "
                "\"layer_compute_us\": %.1f, "
                "\"tail_after_forward_us\": %.1f, \"tail_streamed_us\": %.1f, "
                "\"tail_streamed_per_layer\": %.3f}\n",
                c.transport, c.model, c.layers, (unsigned long long)c.tokens, c.ptp, c.dtp,
                c.reps, layer_us, all_us, avg_us, (double)layer_ns / 1000.0, after_us, stream_us,
                stream_us / layer_us);
        fclose(f);
    }
    rc = 0;
out:
    if (rc)
        fprintf(stderr, "kvwire bench --stream: failed: %s\n", kvw_last_error());
    for (uint32_t d = 0; d < c.dtp; d++)
        kvw_ctx_destroy(e.dctx[d]);
    for (uint32_t k = c.ptp; k-- > 0;)
        kvw_ctx_destroy(e.pctx[k]);
    for (uint32_t k = 0; k < c.ptp; k++) {
        kvt_req_pages_free(&e.sp[k]);
        kvt_rank_free(&e.src[k]);
    }
    for (uint32_t d = 0; d < c.dtp; d++) {
        kvt_req_pages_free(&e.dp[d]);
        kvt_rank_free(&e.dst[d]);
    }
    return rc;
}
