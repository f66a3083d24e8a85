/*
 * Writes the seed corpora of the fuzz targets (fuzz/corpus/<target>/): valid inputs
 * built with the library's own encoders, so that the fuzzers start from frames that
 * reach deep into the handlers. Run by `scripts/fuzz.sh --regen`; the output is
 * committed.
 *
 *   gen_corpus OUTDIR
 */
#define KVW_FUZZ_NO_ENTRY 1
#include "fuzz_frame.c"
#include "fuzz_hello.c"
#include "fuzz_plan.c"
#include "fuzz_tcp_rx.c"

#include <errno.h>
#include <sys/stat.h>

static const char *gen_dir;

static void gen_write(const char *target, const char *name, const uint8_t *p, size_t n)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", gen_dir, target);
    mkdir(path, 0755);
    snprintf(path, sizeof(path), "%s/%s/%s", gen_dir, target, name);
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(p, 1, n, f) != n) {
        fprintf(stderr, "gen_corpus: cannot write %s: %s\n", path, strerror(errno));
        exit(1);
    }
    fclose(f);
}

/* A growable byte string built with the library's frame writer (header dropped). */
typedef struct gen_buf {
    uint8_t *p;
    size_t n, cap;
} gen_buf_t;

static void gb_bytes(gen_buf_t *b, const void *p, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
}
static void gb_u8(gen_buf_t *b, uint8_t v) { gb_bytes(b, &v, 1); }
static void gb_u16(gen_buf_t *b, uint16_t v)
{
    uint8_t x[2] = {(uint8_t)v, (uint8_t)(v >> 8)};
    gb_bytes(b, x, 2);
}
static void gb_u32(gen_buf_t *b, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        gb_u8(b, (uint8_t)(v >> (8 * i)));
}
static void gb_u64(gen_buf_t *b, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        gb_u8(b, (uint8_t)(v >> (8 * i)));
}
/* Appends a whole frame (header included) and frees the writer. */
static void gb_frame(gen_buf_t *b, kvw_wbuf_t *w)
{
    if (kvw__wb_finish(w) != KVW_OK)
        exit(1);
    gb_bytes(b, w->p, w->len);
    kvw__wb_free(w);
}
static void gb_payload(gen_buf_t *b, kvw_wbuf_t *w)
{
    if (kvw__wb_finish(w) != KVW_OK)
        exit(1);
    gb_bytes(b, w->p + KVW_WIRE_HDR, w->len - KVW_WIRE_HDR);
    kvw__wb_free(w);
}
static void gb_reset(gen_buf_t *b) { b->n = 0; }

/* ------------------------------------------------------------------ hello */

static void gen_hello_payload(gen_buf_t *b, kvw_rank_h rank, const char *tl, uint32_t nkeys_bad)
{
    kvw_wbuf_t w;
    kvw__wb_init(&w, KVW_MSG_HELLO);
    kvw__wb_u8(&w, 0);
    for (int i = 0; i < 64; i++)
        kvw__wb_u8(&w, (uint8_t)i); /* mac, nonce */
    kvw__wb_u32(&w, 3);
    kvw__wb_u64(&w, 0x1234); /* decode instance id */
    kvw__wb_str(&w, tl);
    kvw__wb_bytes(&w, "127.0.0.1:9", 11);
    kvw__wire_put_rank(&w, rank);
    uint32_t nb = kvw_rank_num_buffers(rank);
    for (uint32_t i = 0; i < nb; i++) {
        uint8_t k[12];
        fzc_key_pack(k, i, kvw_rank_buffer(rank, i)->length + (i == nkeys_bad ? 5 : 0));
        kvw__wb_bytes(&w, k, sizeof(k));
    }
    kvw__wb_u64(&w, 1 << 16);
    uint8_t k[12];
    fzc_key_pack(k, nb, 1 << 16);
    kvw__wb_bytes(&w, k, sizeof(k));
    gb_payload(b, &w);
}

static void gen_hello(void)
{
    fzh_state_t *st = fzh_init();
    fzf_ranks_t *rk = fzf_ranks();
    gen_buf_t b = {0};
    kvw_rank_h ranks[] = {st->decode->h, st->prefill->h, rk->d2[1]->h, rk->p1->h};
    const char *names[] = {"rank-decode-tp1", "rank-prefill-tp2", "rank-decode-tp2r1",
                           "rank-prefill-tp1"};
    for (int i = 0; i < 4; i++) {
        gb_reset(&b);
        gb_u8(&b, 0);
        kvw_wbuf_t w;
        kvw__wb_init(&w, KVW_MSG_HELLO);
        kvw__wire_put_rank(&w, ranks[i]);
        gb_payload(&b, &w);
        gen_write("fuzz_hello", names[i], b.p, b.n);
    }
    gb_reset(&b);
    gb_u8(&b, 1);
    gen_hello_payload(&b, st->decode->h, "tcp", ~0u);
    gen_write("fuzz_hello", "hello-accept", b.p, b.n);
    gb_reset(&b);
    gb_u8(&b, 1);
    gen_hello_payload(&b, rk->d2[0]->h, "tcp", ~0u);
    gen_write("fuzz_hello", "hello-accept-tp2", b.p, b.n);
    gb_reset(&b);
    gb_u8(&b, 1);
    gen_hello_payload(&b, st->decode->h, "shm", ~0u);
    gen_write("fuzz_hello", "hello-wrong-transport", b.p, b.n);
    gb_reset(&b);
    gb_u8(&b, 2);
    gen_hello_payload(&b, st->decode->h, "tcp", ~0u);
    gen_write("fuzz_hello", "hello-secret", b.p, b.n);
    free(b.p);
}

/* ------------------------------------------------------------------ frame */

static void gen_req(gen_buf_t *b, uint8_t peer, const kvt_rank_t *dst, uint64_t room, uint64_t n,
                    uint64_t prefix)
{
    fzc_pages_t pg;
    fzc_pages_simple(dst, n, 2, 3, &pg);
    gb_u8(b, peer);
    kvw_wbuf_t w;
    kvw__wb_init(&w, KVW_MSG_REQ);
    kvw__wb_u64(&w, room);
    kvw__wb_u32(&w, 0);
    kvw__wb_u64(&w, n);
    kvw__wb_u64(&w, prefix);
    kvw__wire_put_pages(&w, &pg.side.full);
    kvw__wire_put_pages(&w, &pg.side.swa);
    kvw__wb_u64(&w, (uint64_t)pg.side.state_slot);
    gb_frame(b, &w);
}

static void gen_room_msg(gen_buf_t *b, uint8_t type, uint64_t room, const char *why)
{
    kvw_wbuf_t w;
    kvw__wb_init(&w, type);
    kvw__wb_u64(&w, room);
    kvw__wb_u32(&w, (uint32_t)(int32_t)KVW_ERR_ABORTED);
    kvw__wb_str(&w, why);
    gb_frame(b, &w);
}

static uint64_t gen_expected(kvw_rank_h src, kvw_rank_h dst, uint64_t n, uint64_t prefix)
{
    kvw_chunk_t c = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = n, .chunk_begin = 0,
                     .chunk_end = n, .prefix_len = prefix,
                     .last_chunk = 1};
    kvw_plan_h plan;
    if (kvw__plan_create_nopages(src, dst, &c, &plan) != KVW_OK)
        exit(1);
    uint64_t bytes = plan->bytes;
    kvw_plan_destroy(plan);
    return bytes;
}

/* A DONE notification as the decode's transport hands it over (item kind 2). */
static void gen_done(gen_buf_t *b, uint64_t room, uint32_t peer, uint64_t cb, uint64_t ce,
                     uint64_t bytes, bool last, bool staged, uint64_t soff, uint64_t slen,
                     uint64_t goff, bool final)
{
    kvw_wbuf_t w;
    kvw__wb_init(&w, KVW_MSG_DONE);
    kvw__wb_u64(&w, room);
    kvw__wb_u32(&w, peer);
    kvw__wb_u64(&w, cb);
    kvw__wb_u64(&w, ce);
    kvw__wb_u64(&w, bytes);
    kvw__wb_u8(&w, last);
    kvw__wb_u8(&w, staged);
    kvw__wb_u64(&w, soff);
    kvw__wb_u64(&w, slen);
    kvw__wb_u64(&w, goff);
    kvw__wb_u8(&w, final);
    kvw__wb_u32(&w, 0); /* no room metadata */
    kvw__wb_u32(&w, 0); /* no digest */
    if (kvw__wb_finish(&w) != KVW_OK)
        exit(1);
    gb_u8(b, 2);
    gb_u16(b, (uint16_t)w.len);
    gb_bytes(b, w.p, w.len);
    kvw__wb_free(&w);
}

static void gen_frame(void)
{
    fzf_ranks_t *rk = fzf_ranks();
    gen_buf_t b = {0};
    kvw_wbuf_t w;

    /* mode 0: a page list and a rank description behind a header. */
    gb_u8(&b, 0);
    gb_u8(&b, 4);
    gb_u8(&b, 8);  /* done */
    gb_u8(&b, 6);  /* get_pages */
    gb_u8(&b, 7);  /* get_rank */
    gb_u8(&b, 8);  /* done */
    kvw__wb_init(&w, KVW_MSG_REQ);
    kvw_pages_t pl = {.pages = (const uint32_t[]){4, 5, 6}, .num_pages = 3, .first_token = 8};
    kvw__wire_put_pages(&w, &pl);
    kvw__wire_put_rank(&w, rk->d1->h);
    gb_frame(&b, &w);
    gen_write("fuzz_frame", "parse-pages-rank", b.p, b.n);
    gb_reset(&b);
    gb_u8(&b, 0);
    gb_u8(&b, 8);
    const uint8_t ops[8] = {0, 1, 2, 3, 0x34, 0x55, 0x14, 8};
    gb_bytes(&b, ops, 8);
    kvw__wb_init(&w, KVW_MSG_ABORT);
    kvw__wb_u8(&w, 1);
    kvw__wb_u16(&w, 2);
    kvw__wb_u32(&w, 3);
    kvw__wb_u64(&w, 4);
    kvw__wb_bytes(&w, "hello", 5);
    kvw__wb_str(&w, "reason");
    kvw__wb_bytes(&w, "x", 1);
    gb_frame(&b, &w);
    gen_write("fuzz_frame", "parse-fields", b.p, b.n);

    /* mode 1: prefill rank, one TP1 decode peer, 40 tokens, whole and chunked. */
    for (int chunked = 0; chunked < 2; chunked++) {
        gb_reset(&b);
        gb_u8(&b, 1);
        gb_u8(&b, (uint8_t)(chunked ? 2 : 0));
        gen_req(&b, 0, rk->d1, 7, 40, chunked ? 0 : 9);
        gb_u8(&b, 0);
        kvw__wb_init(&w, KVW_MSG_HEARTBEAT);
        gb_frame(&b, &w);
        gen_write("fuzz_frame", chunked ? "prefill-req-chunked" : "prefill-req-prefix", b.p, b.n);
    }
    /* Two TP2 decode peers, 48 tokens; then an abort of another room and a grant. */
    gb_reset(&b);
    gb_u8(&b, 1);
    gb_u8(&b, 1 | (3 << 2));
    gen_req(&b, 0, rk->d2[0], 7, 48, 0);
    gen_req(&b, 1, rk->d2[1], 7, 48, 0);
    gb_u8(&b, 1);
    gen_room_msg(&b, KVW_MSG_ABORT, 9, "engine gave up");
    gb_u8(&b, 0);
    kvw__wb_init(&w, KVW_MSG_STAGE_GRANT);
    kvw__wb_u64(&w, 7);
    kvw__wb_u64(&w, 0);
    kvw__wb_u64(&w, 4096);
    gb_frame(&b, &w);
    gen_write("fuzz_frame", "prefill-two-peers", b.p, b.n);
    /* A request that disagrees on the token count. */
    gb_reset(&b);
    gb_u8(&b, 1);
    gb_u8(&b, 0);
    gen_req(&b, 0, rk->d1, 7, 13, 0);
    gen_write("fuzz_frame", "prefill-req-mismatch", b.p, b.n);

    /* mode 2: decode rank; direct DONE from each sender. */
    for (int two = 0; two < 2; two++) {
        gb_reset(&b);
        gb_u8(&b, 2);
        gb_u8(&b, (uint8_t)two); /* 40 tokens, no prefix */
        uint32_t np = two ? 2 : 1;
        for (uint32_t i = 0; i < np; i++) {
            kvw_rank_h src = two ? rk->p2[i]->h : rk->p1->h;
            uint64_t e = gen_expected(src, rk->d1->h, 40, 0);
            gen_done(&b, 7, i, 0, 40, e, true, false, 0, 0, 0, true);
        }
        gen_write("fuzz_frame", two ? "decode-done-two" : "decode-done-one", b.p, b.n);
    }
    /* Staged: ask for space, then a staged DONE for the whole room. */
    gb_reset(&b);
    gb_u8(&b, 2);
    gb_u8(&b, 0);
    uint64_t e = gen_expected(rk->p1->h, rk->d1->h, 40, 0);
    gb_u8(&b, 0);
    kvw__wb_init(&w, KVW_MSG_STAGE_ASK);
    kvw__wb_u64(&w, 7);
    kvw__wb_u64(&w, e);
    gb_frame(&b, &w);
    gen_done(&b, 7, 0, 0, 40, e, true, true, 0, e, 0, true);
    gen_write("fuzz_frame", "decode-staged", b.p, b.n);
    /* Staged in two windows, a mediated write check, a FAILED for the idle room. */
    gb_reset(&b);
    gb_u8(&b, 2);
    gb_u8(&b, 8); /* prefix 5 */
    e = gen_expected(rk->p1->h, rk->d1->h, 40, 5);
    uint64_t half = e / 2;
    gb_u8(&b, 0);
    kvw__wb_init(&w, KVW_MSG_STAGE_ASK);
    kvw__wb_u64(&w, 7);
    kvw__wb_u64(&w, half);
    gb_frame(&b, &w);
    gen_done(&b, 7, 0, 0, 40, half, true, true, 0, half, 0, false);
    gb_u8(&b, 0);
    kvw__wb_init(&w, KVW_MSG_STAGE_ASK);
    kvw__wb_u64(&w, 7);
    kvw__wb_u64(&w, e - half);
    gb_frame(&b, &w);
    gen_done(&b, 7, 0, 0, 40, e - half, true, true, half, e - half, 0, true);
    gb_u8(&b, 3);
    gb_u64(&b, 0);
    gb_u32(&b, 1);
    gb_u64(&b, 3 * 256);
    gb_u64(&b, 64);
    gb_u8(&b, 1);
    gen_room_msg(&b, KVW_MSG_FAILED, 8, "prefill ran out of memory");
    gen_write("fuzz_frame", "decode-staged-two-windows", b.p, b.n);

    /* A staging grant, then mediated write checks inside it and on a decode page. */
    gb_reset(&b);
    gb_u8(&b, 2);
    gb_u8(&b, 0);
    gb_u8(&b, 0);
    kvw__wb_init(&w, KVW_MSG_STAGE_ASK);
    kvw__wb_u64(&w, 7);
    kvw__wb_u64(&w, 4096);
    gb_frame(&b, &w);
    gb_u8(&b, 3);
    gb_u64(&b, 0);
    gb_u32(&b, kvw_rank_num_buffers(rk->d1->h));
    gb_u64(&b, 64);
    gb_u64(&b, 128);
    gb_u8(&b, 3);
    gb_u64(&b, 0);
    gb_u32(&b, 2);
    const kvw_buffer_desc_t *b2 = kvw_rank_buffer(rk->d1->h, 2);
    uint64_t stride2 = (uint64_t)b2->page_size * b2->num_heads * (b2->head_bytes + b2->v_head_bytes);
    gb_u64(&b, 3 * stride2 + 8);
    gb_u64(&b, 100);
    gen_write("fuzz_frame", "decode-staging-write-check", b.p, b.n);

    /* mode 3: register then look up. */
    gb_reset(&b);
    gb_u8(&b, 3);
    kvw__wb_init(&w, KVW_MSG_BS_REGISTER);
    kvw__wb_u32(&w, 0);
    kvw__wb_u32(&w, 1);
    kvw__wb_u32(&w, 0);
    kvw__wb_u32(&w, 1);
    kvw__wb_u32(&w, 2);
    kvw__wb_u32(&w, 1);
    kvw__wb_str(&w, "127.0.0.1:5555");
    kvw__wb_u8(&w, 0); /* no MAC */
    gb_frame(&b, &w);
    kvw__wb_init(&w, KVW_MSG_BS_LOOKUP);
    gb_frame(&b, &w);
    gen_write("fuzz_frame", "bootstrap-register-lookup", b.p, b.n);

    /* mode 4: a table of two entries. */
    gb_reset(&b);
    gb_u8(&b, 4);
    gb_u32(&b, 2);
    for (uint32_t i = 0; i < 2; i++) {
        gb_u32(&b, 0);
        gb_u32(&b, i);
        gb_u32(&b, 0);
        gb_u32(&b, 1);
        gb_u32(&b, 2);
        gb_u32(&b, 1);
        gb_u32(&b, 14);
        gb_bytes(&b, "127.0.0.1:5555", 14);
        gb_u8(&b, 0); /* no MAC */
    }
    gen_write("fuzz_frame", "bootstrap-table", b.p, b.n);
    free(b.p);
}

/* ------------------------------------------------------------------ plan */

static void gen_plan_list(gen_buf_t *b, const kvw_pages_t *pl, uint32_t base)
{
    gb_u8(b, (uint8_t)pl->first_token);
    gb_u8(b, (uint8_t)pl->num_pages);
    for (uint32_t i = 0; i < pl->num_pages; i++)
        gb_u8(b, (uint8_t)((pl->pages[i] + base) % FZC_FULL_PAGES));
}

static void gen_plan(void)
{
    fzp_init();
    gen_buf_t b = {0};
    static const struct {
        uint8_t cfg;
        uint8_t n, cb, ce, prefix, last;
    } cases[] = {
        {0, 40, 0, 40, 0, 1}, {0, 40, 8, 24, 0, 0}, {0, 40, 0, 40, 17, 1}, {1, 33, 0, 33, 0, 1},
        {1, 60, 30, 60, 31, 1}, {2, 25, 0, 25, 3, 1}, {3, 14, 0, 14, 0, 1}, {3, 14, 2, 9, 0, 0},
        {4, 64, 0, 64, 0, 1}, {4, 64, 0, 64, 63, 1},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        fzp_cfg_t *cfg = &fzp_cfgs[cases[i].cfg];
        gb_reset(&b);
        gb_u8(&b, cases[i].cfg);
        gb_u8(&b, cases[i].last ? 4 : 0);
        gb_u8(&b, cases[i].n);
        gb_u8(&b, cases[i].cb);
        gb_u8(&b, cases[i].ce);
        gb_u8(&b, cases[i].prefix);
        fzc_pages_t sp, dp;
        fzc_pages_simple(cfg->src[0], cases[i].n, 1, 0, &sp);
        fzc_pages_simple(cfg->dst, cases[i].n, 2, 0, &dp);
        gen_plan_list(&b, &sp.side.full, 0);
        gen_plan_list(&b, &sp.side.swa, 0);
        gb_u8(&b, 1);
        gen_plan_list(&b, &dp.side.full, 0);
        gen_plan_list(&b, &dp.side.swa, 0);
        gb_u8(&b, 2);
        char name[64];
        snprintf(name, sizeof(name), "%s-%u-%u-%u-%u", cfg->name, cases[i].n, cases[i].cb,
                 cases[i].ce, cases[i].prefix);
        gen_write("fuzz_plan", name, b.p, b.n);
    }
    /* Wide encodings: the same first case with u64 fields. */
    gb_reset(&b);
    gb_u8(&b, 0);
    gb_u8(&b, 1 | 2 | 4);
    gb_u64(&b, 40);
    gb_u64(&b, 0);
    gb_u64(&b, 40);
    gb_u64(&b, 0);
    fzc_pages_t sp, dp;
    fzc_pages_simple(fzp_cfgs[0].src[0], 40, 1, 0, &sp);
    fzc_pages_simple(fzp_cfgs[0].dst, 40, 2, 0, &dp);
    const kvw_pages_t *lists[4] = {&sp.side.full, &sp.side.swa, &dp.side.full, &dp.side.swa};
    for (int l = 0; l < 4; l++) {
        gb_u64(&b, lists[l]->first_token);
        gb_u8(&b, (uint8_t)lists[l]->num_pages);
        for (uint32_t i = 0; i < lists[l]->num_pages; i++)
            gb_u32(&b, lists[l]->pages[i]);
        if (l == 1 || l == 3)
            gb_u64(&b, l == 1 ? 1 : 2);
    }
    gen_write("fuzz_plan", "wide-tp2_to_tp1-40", b.p, b.n);
    free(b.p);
}

/* fuzz_tcp_rx: after the harness's HELLO, PUTs in and out of range, a run of small
 * PUTs, a refused one, a large one (received in place), notifications; and a stream that
 * greets by itself. */
static void gen_tcp_put(gen_buf_t *b, uint64_t room, uint64_t off, uint64_t len)
{
    uint8_t h[KVW_TCP_HDR_LEN];
    kvw_tcp_hdr_encode(h, KVW_TCP_PUT, room, FZT_REGION_ID, off, len);
    gb_bytes(b, h, sizeof(h));
    for (uint64_t i = 0; i < len; i++)
        gb_u8(b, (uint8_t)(i * 7 + room));
}

static void gen_tcp_notify(gen_buf_t *b, const char *msg)
{
    uint8_t h[KVW_TCP_HDR_LEN];
    kvw_tcp_hdr_encode(h, KVW_TCP_NOTIFY, 0, 0, 0, strlen(msg));
    gb_bytes(b, h, sizeof(h));
    gb_bytes(b, msg, strlen(msg));
}

static void gen_tcp_rx(void)
{
    gen_buf_t b = {0};
    gb_u8(&b, 1);
    gb_u8(&b, 3);
    for (int i = 0; i < 24; i++)
        gen_tcp_put(&b, 7, 1024u * (uint64_t)i, 1024);
    gen_tcp_notify(&b, "done");
    gen_write("fuzz_tcp_rx", "run-of-puts", b.p, b.n);
    gb_reset(&b);
    gb_u8(&b, 1);
    gb_u8(&b, 200);
    gen_tcp_put(&b, 7, 100, 300);
    gen_tcp_put(&b, 66, 0, 500);
    gen_tcp_put(&b, 7, 0, 40000);
    gen_tcp_put(&b, 7, 40000, 20);
    gen_tcp_notify(&b, "after");
    gen_tcp_put(&b, 7, 65000, 1000);
    gen_write("fuzz_tcp_rx", "mixed-then-out-of-range", b.p, b.n);
    gb_reset(&b);
    gb_u8(&b, 0);
    gb_u8(&b, 9);
    uint8_t h[KVW_TCP_HDR_LEN];
    kvw_tcp_hdr_encode(h, KVW_TCP_HELLO, 0, 0, 0, 0);
    gb_bytes(&b, h, sizeof(h));
    gen_tcp_put(&b, 7, 0, 64);
    gen_write("fuzz_tcp_rx", "own-hello", b.p, b.n);
    free(b.p);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: gen_corpus OUTDIR\n");
        return 2;
    }
    gen_dir = argv[1];
    mkdir(gen_dir, 0755);
    gen_hello();
    gen_frame();
    gen_plan();
    gen_tcp_rx();
    /* Every seed must run clean through its target. */
    return 0;
}
