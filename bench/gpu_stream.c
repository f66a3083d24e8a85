/*
 * Layer-wise streaming on the GPU: how much of the KV transfer a simulated prefill hides.
 *
 * A prefill process (GPU 0) runs a simulated forward pass of `layers` layers on its own
 * stream, one calibrated kernel per layer, and a decode process (GPU 1, or GPU 0 when
 * there is one) receives the room (TP1 -> TP1, gpt-oss-120b shape, page 64). Two ways
 * to send the same room, alternated over the repetitions:
 *
 *   streamed: kvw_sender_send_streamed, then after each layer's kernel a CUDA event is
 *             recorded and handed to kvw_sender_layers_ready_event (nothing waits);
 *   after:    the whole forward pass first, then kvw_sender_send.
 *
 * Measured: the tail, from the end of the last layer's kernel (the host sees its event
 * complete) to Success on the decode (CLOCK_MONOTONIC, shared by the two processes);
 * and the transfer time of one full-attention layer, the "after" transfer time scaled
 * by that layer's share of the room's bytes. Target (#14): streamed tail <= 1.2x one
 * layer's transfer.
 *
 * The simulated layer lasts --layer-us (default 5000 us: a gpt-oss-120b layer at 8192
 * tokens is about 2.6 TFLOP, about 5 ms at 500 TFLOPS on an H200): --sim spin (default)
 * is a kernel keeping one block of every multiprocessor busy that long, compute-bound
 * like a layer's GEMMs; --sim memset is device memsets sized from a measured rate,
 * memory bound, which compete with the copies for memory bandwidth far harder than a
 * real layer does.
 *
 * The first streamed room's decode bytes are compared, every byte and guard, with the
 * test kit's reference. One more streamed room, untimed, prints the prefill's step
 * profile of its last layer alone (plan, launch, upload, kernel, wait, notify): where a
 * tail's first microseconds go. Exits 77 without a GPU.
 *
 *   gpu_stream [--transport cuda_ipc|tcp|shm] [--layers N] [--tokens N] [--reps N]
 *              [--layer-us N] [--json FILE]
 */
#include "cuda/module.h"
#include "testkit.h"

#include <kvwire/cuda.h>
#include <kvwire/xfer.h>

#include <errno.h>
#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAXREPS 32

typedef struct cfg {
    char transport[16];
    uint32_t layers, reps;
    uint64_t tokens, layer_us;
    char json[256];
    char sim[16]; /* spin (default) or memset */
} cfg_t;

/* The TP1 rank of this benchmark: NHD, pages of 64 tokens, enough for `tokens`. */
static kvt_rank_spec_t rank_spec(const kvt_model_t *m, uint64_t tokens)
{
    uint32_t pages = (uint32_t)((tokens + 63) / 64 + 1);
    kvt_rank_spec_t s = {.model = m, .layout = KVW_LAYOUT_NHD, .page_size = {64, 64},
                         .num_pages = {pages, pages}, .num_slots = 1};
    s.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = 1, .pp_size = 1,
                             .layer_end = m->m.num_layers,
                             .dp_size = 1};
    return s;
}

/* That rank, filled with `seed`'s pattern, its buffers copied to GPU `device` (the host
 * images stay, holding the initial bytes). */
static int make_rank(const kvt_model_t *m, uint64_t tokens, uint64_t seed, int device,
                     kvt_rank_t *r, uint8_t ****dev_p, char *msg, size_t cap)
{
    kvt_rank_spec_t s = rank_spec(m, tokens);
    if (kvt_rank_build(&s, r) != KVW_OK)
        return snprintf(msg, cap, "%s", kvw_last_error()), -1;
    kvt_rank_fill(r, seed);
    return kvt_gpu_attach(r, 1, device, dev_p, msg, cap);
}

static kvw_ctx_h make_ctx(const cfg_t *c, kvt_rank_t *r, bool prefill, const char *bs)
{
    kvw_ctx_params_t p = {.field_mask = KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK |
                                        KVW_CTX_FIELD_TRANSPORT | KVW_CTX_FIELD_BOOTSTRAP |
                                        KVW_CTX_FIELD_HOST_BOOTSTRAP | KVW_CTX_FIELD_TIMEOUTS,
                          .side = prefill ? KVW_SIDE_PREFILL : KVW_SIDE_DECODE, .rank = r->h,
                          .transport = c->transport, .bootstrap_addr = bs,
                          .host_bootstrap = prefill, .wait_timeout_ms = 60000,
                          .bootstrap_timeout_ms = 60000};
    kvw_ctx_h ctx = NULL;
    if (kvw_ctx_create(&p, &ctx) != KVW_OK) {
        fprintf(stderr, "gpu_stream: %s context: %s\n", prefill ? "prefill" : "decode",
                kvw_last_error());
        return NULL;
    }
    return ctx;
}

static kvt_req_pages_t pages_of(const kvt_rank_t *r, uint64_t tokens, uint64_t seed)
{
    kvt_rng_t rng = {seed};
    kvt_req_spec_t rs = {.full_begin = 0, .full_end = tokens, .swa_begin = 0,
                         .swa_end = tokens, .state_slot = -1};
    kvt_req_pages_t p;
    memset(&p, 0, sizeof(p));
    (void)kvt_req_pages_make(r, &rs, &rng, &p);
    return p;
}

/* ---------------------------------------------------------------- decode process */

static int decode_main(const cfg_t *c, const kvt_model_t *m, int cmd, int res, int device)
{
    char bs[128];
    if (kvt_read_full(cmd, bs, sizeof(bs)))
        return 1;
    kvt_rank_t dst, src;
    uint8_t ***ddev = NULL;
    char msg[512];
    if (make_rank(m, c->tokens, 2, device, &dst, &ddev, msg, sizeof(msg))) {
        fprintf(stderr, "gpu_stream: decode rank: %s\n", msg);
        return 1;
    }
    kvw_ctx_h ctx = make_ctx(c, &dst, false, bs);
    if (ctx == NULL)
        return 1;
    kvt_req_pages_t dp = pages_of(&dst, c->tokens, 11);
    for (;;) {
        uint64_t room;
        if (kvt_read_full(cmd, &room, sizeof(room)) || room == 0)
            break;
        kvw_receiver_h rcv = NULL;
        kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = c->tokens,
                                .pages = dp.side};
        int ok = kvw_receiver_create(ctx, room, 0, &rcv) == KVW_OK &&
                 kvw_receiver_post(rcv, &post) == KVW_OK;
        uint64_t posted = ok;
        kvt_write_full(res, &posted, sizeof(posted));
        kvw_room_state_t st = ok ? kvw_room_wait(kvw_receiver_room(rcv), 120000) : KVW_ROOM_FAILED;
        uint64_t out[4] = {st == KVW_ROOM_SUCCESS ? kvt_now_ns() : 0, 0, 0, 0};
        kvw_room_metrics_t mt = {.field_mask = KVW_ROOM_METRICS_FIELDS_ALL};
        if (rcv)
            kvw_room_metrics(kvw_receiver_room(rcv), &mt);
        out[1] = mt.bytes;
        out[3] = mt.hop_ns[KVW_HOP_DONE_RX];
        if (st != KVW_ROOM_SUCCESS)
            fprintf(stderr, "gpu_stream: room %llu: %s\n", (unsigned long long)room,
                    rcv ? kvw_room_failure(kvw_receiver_room(rcv)) : kvw_last_error());
        /* The first room: every byte and guard against the reference. */
        if (st == KVW_ROOM_SUCCESS && room == 1) {
            /* The expected contents start from the host images' initial bytes; the
             * source is rebuilt here from its seed. */
            kvt_copy_t exp;
            kvt_copy_make(&dst, &exp);
            kvt_rank_spec_t s = rank_spec(m, c->tokens);
            kvt_rank_build(&s, &src);
            kvt_rank_fill(&src, 1);
            kvt_req_pages_t sp = pages_of(&src, c->tokens, 10);
            int pulled = kvt_gpu_pull(&dst, 1, ddev, msg, sizeof(msg));
            uint8_t **sd = calloc(src.num_bufs, sizeof(uint8_t *));
            for (uint32_t b = 0; b < src.num_bufs; b++)
                sd[b] = kvt_rank_data(&src, b);
            kvt_ref_side_t ss = kvt_ref_side(&src, &sp.side, sd);
            kvt_ref_side_t ds = kvt_ref_side(&dst, &dp.side, exp.data);
            kvw_chunk_t whole = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = c->tokens,
                                 .chunk_end = c->tokens,
                                 .last_chunk = 1};
            int bad = pulled != 0 || kvt_ref_transfer(&m->m, &ss, 1, &ds, &whole, NULL, NULL, msg,
                                       sizeof(msg)) != 0 ||
                      kvt_copy_compare(&dst, &exp, "decode", msg, sizeof(msg)) != 0 ||
                      kvt_rank_check_guards(&dst, msg, sizeof(msg)) != 0;
            if (bad)
                fprintf(stderr, "gpu_stream: verification: %s\n", msg);
            out[2] = bad ? 2 : 1;
            free(sd);
            kvt_copy_free(&exp);
            kvt_req_pages_free(&sp);
            kvt_rank_free(&src);
        }
        kvw_room_destroy(kvw_receiver_room(rcv));
        kvt_write_full(res, out, sizeof(out));
    }
    kvw_ctx_destroy(ctx);
    return 0;
}

/* ---------------------------------------------------------------- prefill process */

typedef struct layer_sim {
    void *scratch, *stream;
    uint64_t chunk, n; /* n memsets of `chunk` bytes per layer */
    bool spin;         /* a busy kernel of layer_ns instead */
    uint64_t layer_ns;
} layer_sim_t;

static uint64_t wait_event(void *ev)
{
    while (kvw__cuda_event_query(ev) == KVW_INPROGRESS)
        ;
    return kvt_now_ns();
}

/* Sizes the per-layer memsets from a measured rate. */
static int sim_init(layer_sim_t *s, uint64_t layer_us, char *msg, size_t cap)
{
    s->layer_ns = layer_us * 1000;
    if (s->spin && kvt_cuda_stream_create(&s->stream) != KVW_OK)
        return snprintf(msg, cap, "%s", kvt_cuda_error()), -1;
    if (s->spin)
        return 0;
    s->chunk = 1ull << 30;
    if (kvt_cuda_malloc(s->chunk, &s->scratch) != KVW_OK ||
        kvt_cuda_stream_create(&s->stream) != KVW_OK)
        return snprintf(msg, cap, "%s", kvt_cuda_error()), -1;
    void *ev;
    if (kvw__cuda_event_create(&ev) != KVW_OK)
        return snprintf(msg, cap, "%s", kvw_last_error()), -1;
    kvt_cuda_memset(s->scratch, 1, s->chunk, s->stream);
    kvt_cuda_stream_sync(s->stream);
    uint64_t t0 = kvt_now_ns();
    for (int i = 0; i < 4; i++)
        kvt_cuda_memset(s->scratch, i, s->chunk, s->stream);
    kvw__cuda_event_record(ev, s->stream);
    double ns_per_byte = (double)(wait_event(ev) - t0) / (4.0 * (double)s->chunk);
    kvw__cuda_event_destroy(ev);
    double bytes = (double)layer_us * 1000.0 / ns_per_byte;
    s->n = (uint64_t)(bytes / (double)s->chunk) + 1;
    s->chunk = ((uint64_t)(bytes / (double)s->n) + 255) & ~255ull;
    return 0;
}

static void sim_layer(layer_sim_t *s, int l)
{
    if (s->spin) {
        (void)kvw__cuda_busy(s->stream, s->layer_ns);
        return;
    }
    for (uint64_t i = 0; i < s->n; i++)
        kvt_cuda_memset(s->scratch, l & 0xff, s->chunk, s->stream);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static uint64_t median(uint64_t *v, uint32_t n)
{
    if (n == 0)
        return 0;
    qsort(v, n, sizeof(*v), cmp_u64);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int main(int argc, char **argv)
{
    cfg_t c = {.transport = "cuda_ipc", .layers = 36, .reps = 5, .tokens = 8192,
               .layer_us = 5000, .json = "gpu-stream.json", .sim = "spin"};
    static const struct option opts[] = {
        {"transport", 1, 0, 't'}, {"layers", 1, 0, 'L'}, {"tokens", 1, 0, 'n'},
        {"reps", 1, 0, 'r'},      {"layer-us", 1, 0, 'u'}, {"json", 1, 0, 'j'},
        {"sim", 1, 0, 's'},       {0, 0, 0, 0}};
    int o;
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (o) {
        case 't': snprintf(c.transport, sizeof(c.transport), "%s", optarg); break;
        case 'L': c.layers = (uint32_t)strtoul(optarg, NULL, 10); break;
        case 'n': c.tokens = strtoull(optarg, NULL, 10); break;
        case 'r': c.reps = (uint32_t)strtoul(optarg, NULL, 10); break;
        case 'u': c.layer_us = strtoull(optarg, NULL, 10); break;
        case 'j': snprintf(c.json, sizeof(c.json), "%s", optarg); break;
        case 's': snprintf(c.sim, sizeof(c.sim), "%s", optarg); break;
        default:
            fprintf(stderr, "usage: gpu_stream [--transport T] [--layers N] [--tokens N] "
                            "[--reps N] [--layer-us N] [--json FILE]\n");
            return 2;
        }
    }
    if (!c.reps || c.reps > MAXREPS || !c.layers || !c.tokens)
        return 2;
    if (!kvt_cuda_probe()) {
        printf("gpu_stream: skipped: no GPU (no CUDA device, driver or kvwire CUDA module)\n");
        return 77;
    }
    kvt_model_t m;
    if (kvt_model_preset("gpt-oss-120b", &m) ||
        (c.layers < m.m.num_layers && kvt_model_truncate(&m, c.layers))) {
        fprintf(stderr, "gpu_stream: no gpt-oss-120b preset\n");
        return 1;
    }
    c.layers = m.m.num_layers;
    int to_child[2], to_parent[2];
    if (pipe(to_child) || pipe(to_parent))
        return 1;
    pid_t child = fork();
    if (child == 0) {
        close(to_child[1]);
        close(to_parent[0]);
        int n = 0;
        kvw_cuda_device_count(&n);
        exit(decode_main(&c, &m, to_child[0], to_parent[1], n > 1 ? 1 : 0));
    }
    close(to_child[0]);
    close(to_parent[1]);
    int rc = 1;
    kvt_rank_t src;
    uint8_t ***sdev = NULL;
    layer_sim_t sim = {.spin = strcmp(c.sim, "memset") != 0};
    void **ev = calloc(c.layers, sizeof(void *));
    kvw_ctx_h ctx = NULL;
    char msg[512];
    if (make_rank(&m, c.tokens, 1, 0, &src, &sdev, msg, sizeof(msg)) ||
        sim_init(&sim, c.layer_us, msg, sizeof(msg))) {
        fprintf(stderr, "gpu_stream: prefill GPU set-up: %s\n", msg);
        goto out;
    }
    for (uint32_t l = 0; l < c.layers; l++)
        if (kvw__cuda_event_create(&ev[l]) != KVW_OK)
            goto out;
    if ((ctx = make_ctx(&c, &src, true, "127.0.0.1:0")) == NULL)
        goto out;
    char bs[128] = {0};
    snprintf(bs, sizeof(bs), "%s", kvw_ctx_bootstrap_addr(ctx));
    if (kvt_write_full(to_child[1], bs, sizeof(bs)))
        goto out;
    kvt_req_pages_t sp = pages_of(&src, c.tokens, 10);
    kvw_send_chunk_t ch = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = c.tokens,
                           .chunk_end = c.tokens, .last_chunk = 1,
                           .pages = sp.side};
    /* Per mode (0 streamed, 1 after): tails, transfer times (after only), forward pass. */
    uint64_t tail[2][MAXREPS], xfer[MAXREPS], fwd[2][MAXREPS], bytes = 0;
    int verified = 0;
    uint32_t nrep = 0;
    char hops[400] = "", lastprof[400] = "";
    /* Repetition 0 warms up, 1..reps are timed, and one more streamed room (untimed)
     * profiles the prefill's last layer. */
    for (uint32_t rep = 0; rep <= c.reps + 1; rep++) {
        for (int mode = 0; mode < 2; mode++) {
            bool prof_last = rep == c.reps + 1;
            if (prof_last && (mode == 1 || c.layers < 2))
                continue;
            uint64_t room = 1 + rep * 2 + (uint64_t)mode, posted = 0, res[4];
            if (kvt_write_full(to_child[1], &room, sizeof(room)) || kvt_read_full(to_parent[0], &posted, 8) || !posted)
                goto out;
            kvw_sender_h snd = NULL;
            if (kvw_sender_create(ctx, room, &snd) != KVW_OK)
                goto out;
            uint64_t t0 = kvt_now_ns(), t_end, t_send = 0;
            if (mode == 0 && kvw_sender_send_streamed(snd, &ch) != KVW_OK)
                goto out;
            /* The profiling room: the prefill's step profile of its last layer alone
             * (the steps before it have completed and are zeroed first). */
            for (uint32_t l = 0; l < c.layers; l++) {
                if (prof_last && l == c.layers - 1) {
                    (void)wait_event(ev[l - 1]);
                    usleep(2000);
                    kvw_cuda_profile(NULL, 1);
                }
                sim_layer(&sim, (int)l);
                kvw__cuda_event_record(ev[l], sim.stream);
                if (mode == 0 && kvw_sender_layers_ready_event(snd, l, l + 1, ev[l]) != KVW_OK) {
                    fprintf(stderr, "gpu_stream: layers_ready_event: %s\n", kvw_last_error());
                    goto out;
                }
            }
            t_end = wait_event(ev[c.layers - 1]);
            if (mode == 1) {
                t_send = kvt_now_ns();
                if (kvw_sender_send(snd, &ch) != KVW_OK)
                    goto out;
            }
            kvw_room_state_t st = kvw_room_wait(kvw_sender_room(snd), 120000);
            if (prof_last) {
                kvw_cuda_profile_t p = {.field_mask = KVW_CUDA_PROFILE_FIELDS_ALL};
                usleep(1000); /* the last step's notice is counted after it went out */
                kvw_cuda_profile(&p, 1);
                snprintf(lastprof, sizeof(lastprof), "the last layer's steps on the prefill "
                         "(%llu), us: plan %.1f, launch %.1f, upload %.1f (device), kernel %.1f "
                         "(device), wait %.1f, notify %.1f", (unsigned long long)p.steps,
                         p.plan_ns / 1e3, p.launch_ns / 1e3, p.upload_dev_ns / 1e3,
                         p.kernel_dev_ns / 1e3, p.wait_ns / 1e3, p.notify_ns / 1e3);
            }
            kvw_room_metrics_t pm = {.field_mask = KVW_ROOM_METRICS_FIELDS_ALL};
            kvw_room_metrics(kvw_sender_room(snd), &pm);
            kvw_room_destroy(kvw_sender_room(snd));
            if (kvt_read_full(to_parent[0], res, sizeof(res)) || res[0] == 0 || st != KVW_ROOM_SUCCESS) {
                fprintf(stderr, "gpu_stream: room %llu did not succeed\n",
                        (unsigned long long)room);
                goto out;
            }
            if (room == 1) {
                verified = res[2] == 1;
                if (!verified)
                    goto out;
            }
            bytes = res[1];
            if (rep == 0 || prof_last)
                continue; /* warm-up, profile */
            tail[mode][rep - 1] = res[0] > t_end ? res[0] - t_end : 0;
            /* The last streamed room's hops after the forward pass ended (us). */
            if (mode == 0 && rep == c.reps) {
                double d[4] = {(double)pm.hop_ns[KVW_HOP_SEND], (double)pm.hop_ns[KVW_HOP_BYTES_OUT],
                               (double)res[3], (double)res[0]};
                snprintf(hops, sizeof(hops), "last streamed room, us after the last layer's end: "
                         "last mark applied %+.0f, last bytes out %+.0f, last completion at the "
                         "decode %+.0f, Success %+.0f", (d[0] - (double)t_end) / 1e3,
                         (d[1] - (double)t_end) / 1e3, (d[2] - (double)t_end) / 1e3,
                         (d[3] - (double)t_end) / 1e3);
            }
            fwd[mode][rep - 1] = t_end - t0;
            if (mode == 1)
                xfer[rep - 1] = res[0] - t_send;
        }
        if (rep <= c.reps)
            nrep = rep;
    }
    {
        uint64_t mt0 = median(tail[0], nrep), mt1 = median(tail[1], nrep);
        uint64_t mx = median(xfer, nrep), mf = median(fwd[0], nrep), mf1 = median(fwd[1], nrep);
        /* A full-attention layer's share of the room's bytes (TP1 -> TP1). */
        uint64_t full_layers = 0, swa_layers = 0;
        uint32_t window = 0;
        for (uint32_t l = 0; l < m.m.num_layers; l++) {
            full_layers += m.m.layers[l].kind == KVW_LAYER_FULL;
            swa_layers += m.m.layers[l].kind == KVW_LAYER_SWA;
            if (m.m.layers[l].kind == KVW_LAYER_SWA)
                window = m.m.layers[l].window;
        }
        double per_tok = (double)m.m.num_kv_heads * (m.m.k_head_dim + m.m.v_head_dim) *
                         m.m.elem_size;
        double layer_bytes = per_tok * (double)c.tokens;
        double total = layer_bytes * (double)full_layers +
                       per_tok * (double)(c.tokens < window ? c.tokens : window) *
                           (double)swa_layers;
        double one = (double)mx * layer_bytes / total;
        printf("\ngpu_stream: gpt-oss-120b %u layers, %llu tokens, TP1 -> TP1 over %s, "
               "simulated layer %llu us (%s), medians of %u repetitions\n", c.layers,
               (unsigned long long)c.tokens, c.transport, (unsigned long long)c.layer_us,
               sim.spin ? "a busy kernel on every SM" : "memory-bound memsets", nrep);
        printf("room bytes %llu (model %.0f); one full layer %.0f bytes; forward pass %.2f ms "
               "(streamed) / %.2f ms (after)\n", (unsigned long long)bytes, total, layer_bytes,
               (double)mf / 1e6, (double)mf1 / 1e6);
        printf("%-22s %12s %14s %s\n", "mode", "tail ms", "x one layer", "verified");
        printf("%-22s %12.3f %14.2f %s\n", "streamed (events)", (double)mt0 / 1e6,
               one > 0 ? (double)mt0 / one : 0.0, verified ? "yes: every byte and guard" : "no");
        printf("%-22s %12.3f %14.2f\n", "sent after the pass", (double)mt1 / 1e6,
               one > 0 ? (double)mt1 / one : 0.0);
        printf("%s\n", hops);
        if (lastprof[0])
            printf("%s\n", lastprof);
        printf("one layer's transfer: %.3f ms (the 'after' transfer, %.3f ms, scaled by a "
               "full layer's share of the bytes)\n", one / 1e6, (double)mx / 1e6);
        printf("reproduce: gpu_stream --transport %s --layers %u --tokens %llu --reps %u "
               "--layer-us %llu --sim %s\n", c.transport, c.layers, (unsigned long long)c.tokens,
               c.reps, (unsigned long long)c.layer_us, c.sim);
        FILE *jf = fopen(c.json, "w");
        if (jf) {
            fprintf(jf, "{\"transport\": \"%s\", \"layers\": %u, \"tokens\": %llu, "
                    "\"layer_us\": %llu, \"reps\": %u, \"bytes\": %llu, \"verified\": %s, "
                    "\"tail_streamed_ns\": %llu, \"tail_after_ns\": %llu, "
                    "\"transfer_after_ns\": %llu, \"one_layer_ns\": %.0f, "
                    "\"forward_ns\": %llu}\n", c.transport, c.layers,
                    (unsigned long long)c.tokens, (unsigned long long)c.layer_us, nrep,
                    (unsigned long long)bytes, verified ? "true" : "false",
                    (unsigned long long)mt0, (unsigned long long)mt1, (unsigned long long)mx,
                    one, (unsigned long long)mf);
            fclose(jf);
        }
    }
    rc = 0;
out:
    {
        uint64_t zero = 0;
        kvt_write_full(to_child[1], &zero, sizeof(zero));
    }
    close(to_child[1]);
    int cs = 0;
    waitpid(child, &cs, 0);
    kvw_ctx_destroy(ctx);
    return rc;
}
