/*
 * fuzz_hello: the registration validator.
 *
 * Input: one mode byte, then
 *   mode 0  a rank description as kvw__wire_put_rank writes it. kvw__wire_get_rank
 *           decodes it (and runs kvw_rank_create's validation); when it succeeds:
 *           kvw_rank_check_compatible against fixed valid local ranks in both roles,
 *           kvw__plan_create_nopages between them for a few chunks, and a round trip
 *           (encode the decoded rank, decode it again, encode again: the two encodings
 *           must be identical).
 *   mode 1  the payload of a HELLO frame, fed through a socket pair to the real
 *           kvw__prefill_handshake of a prefill context built by hand (stub transport
 *           named "tcp"; no shared secret).
 *   mode 2  the same with a shared secret configured (authentication paths).
 *
 * Oracles: AddressSanitizer/UBSan/LeakSanitizer, the round trip, and that an accepted
 * registration leaves a peer whose description passed the compatibility check.
 */
#include "fuzz_common.h"

#include <sys/socket.h>

typedef struct fzh_state {
    kvt_rank_t *prefill; /* tp2 rank 0: what a decode rank registers with */
    kvt_rank_t *decode;  /* tp1: what a prefill rank's description is checked against */
} fzh_state_t;

static fzh_state_t *fzh_init(void)
{
    static fzh_state_t st;
    static int done;
    if (!done) {
        fzc_rank_cfg_t p = {.tp = 2, .rank = 0, .page_full = 4, .page_swa = 4};
        fzc_rank_cfg_t d = {.tp = 1, .rank = 0, .page_full = 8, .page_swa = 4,
                            .layout = KVW_LAYOUT_HND};
        st.prefill = fzc_rank_build(&p, 11);
        st.decode = fzc_rank_build(&d, 12);
        done = 1;
    }
    return &st;
}

static void fzh_plans(kvw_rank_h src, kvw_rank_h dst)
{
    static const kvw_chunk_t chunks[] = {
        {.num_tokens = 1, .chunk_begin = 0, .chunk_end = 1, .last_chunk = 1},
        {.num_tokens = 40, .chunk_begin = 0, .chunk_end = 40, .prefix_len = 7, .last_chunk = 1},
        {.num_tokens = 40, .chunk_begin = 8, .chunk_end = 24, .last_chunk = 0},
        {.num_tokens = 100000, .chunk_begin = 0, .chunk_end = 100000, .prefix_len = 99999, .last_chunk = 1},
    };
    for (size_t i = 0; i < sizeof(chunks) / sizeof(chunks[0]); i++) {
        kvw_plan_h plan = NULL;
        if (kvw__plan_create_nopages(src, dst, &chunks[i], &plan) == KVW_OK)
            kvw_plan_destroy(plan);
    }
}

static void fzh_roundtrip(kvw_rank_h rank)
{
    kvw_wbuf_t w1, w2;
    kvw__wb_init(&w1, KVW_MSG_HELLO);
    kvw__wire_put_rank(&w1, rank);
    if (kvw__wb_finish(&w1) != KVW_OK)
        fzc_fail("cannot encode a decoded rank");
    kvw_rbuf_t r;
    kvw__rb_init(&r, w1.p + KVW_WIRE_HDR, w1.len - KVW_WIRE_HDR);
    kvw_rank_h again = NULL;
    if (kvw__wire_get_rank(&r, &again) != KVW_OK)
        fzc_fail("a rank that decoded once does not decode after re-encoding: %s",
                 kvw_last_error());
    if (kvw__rb_done(&r, "round trip") != KVW_OK)
        fzc_fail("re-encoded rank has %zu trailing bytes", r.len - r.pos);
    kvw__wb_init(&w2, KVW_MSG_HELLO);
    kvw__wire_put_rank(&w2, again);
    if (kvw__wb_finish(&w2) != KVW_OK)
        fzc_fail("cannot encode a decoded rank");
    if (w1.len != w2.len || memcmp(w1.p, w2.p, w1.len) != 0)
        fzc_fail("rank encoding is not stable across a round trip (%zu vs %zu bytes)", w1.len,
                 w2.len);
    kvw_rank_destroy(again);
    kvw__wb_free(&w1);
    kvw__wb_free(&w2);
}

static void fzh_rank_only(fzh_state_t *st, const uint8_t *data, size_t size)
{
    /* An exact-size copy: reads past the end are ASan reports. */
    uint8_t *copy = malloc(size ? size : 1);
    if (copy == NULL)
        return;
    if (size)
        memcpy(copy, data, size);
    kvw_rbuf_t r;
    kvw__rb_init(&r, copy, size);
    kvw_rank_h remote = NULL;
    kvw_status_t s = kvw__wire_get_rank(&r, &remote);
    FZC_SAY("rank description: %s %s\n", kvw_status_string(s), s ? kvw_last_error() : "");
    if (s == KVW_OK) {
        (void)kvw__rb_done(&r, "rank");
        /* Prefill side of the handshake: the decode rank's description. */
        if (kvw_rank_check_compatible(st->prefill->h, remote) == KVW_OK)
            fzh_plans(st->prefill->h, remote);
        /* Decode side: the prefill rank's description from ACCEPT. */
        if (kvw_rank_check_compatible(remote, st->decode->h) == KVW_OK)
            fzh_plans(remote, st->decode->h);
        /* Description alone: plans between the remote and itself. */
        if (kvw_rank_check_compatible(remote, remote) == KVW_OK)
            fzh_plans(remote, remote);
        fzh_roundtrip(remote);
        kvw_rank_destroy(remote);
    }
    free(copy);
}

static void fzh_handshake(fzh_state_t *st, const uint8_t *data, size_t size, bool secret)
{
    if (size > 60000)
        size = 60000; /* stays within a socket buffer: nothing reads the other end */
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        fzc_fail("socketpair failed");
    int big = 1 << 20;
    setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &big, sizeof(big));
    setsockopt(sv[0], SOL_SOCKET, SO_RCVBUF, &big, sizeof(big));
    kvw_wbuf_t w;
    kvw__wb_init(&w, KVW_MSG_HELLO);
    for (size_t i = 0; i < size; i++)
        kvw__wb_u8(&w, data[i]);
    if (kvw__wb_finish(&w) != KVW_OK)
        fzc_fail("harness out of memory");
    if (kvw__sock_send_all(sv[1], w.p, w.len, kvw__now_ns() + 1000000000ull) != KVW_OK)
        fzc_fail("cannot queue the fuzzed registration");
    kvw__wb_free(&w);
    shutdown(sv[1], SHUT_WR); /* a short frame ends at EOF instead of a timeout */

    struct kvw_ctx *ctx = fzc_ctx_new(KVW_SIDE_PREFILL, st->prefill->h);
    if (secret) {
        snprintf(ctx->secret, sizeof(ctx->secret), "fuzz-secret");
        ctx->bs_bound = true; /* as if registered with the bootstrap (bs_bind all zero) */
    }
    kvw_peer_t *peer = NULL;
    kvw_status_t s = kvw__prefill_handshake(ctx, sv[0], &peer);
    FZC_SAY("handshake: %s %s\n", kvw_status_string(s), s ? kvw_last_error() : "");
    if (s == KVW_OK) {
        if (peer == NULL || peer->remote == NULL)
            fzc_fail("an accepted registration left no peer description");
        if (kvw_rank_check_compatible(st->prefill->h, peer->remote) != KVW_OK)
            fzc_fail("an accepted registration is incompatible: %s", kvw_last_error());
        if (peer->num_rkeys != kvw_rank_num_buffers(peer->remote))
            fzc_fail("accepted peer has %u keys for %u buffers", peer->num_rkeys,
                     kvw_rank_num_buffers(peer->remote));
        /* The context owns sv[0] now. */
    } else {
        close(sv[0]);
    }
    close(sv[1]);
    kvw_ctx_destroy(ctx);
}

int kvw_fuzz_hello(const uint8_t *data, size_t size)
{
    fzh_state_t *st = fzh_init();
    if (size < 1)
        return 0;
    switch (data[0] % 3) {
    case 0:
        fzh_rank_only(st, data + 1, size - 1);
        break;
    case 1:
        fzh_handshake(st, data + 1, size - 1, false);
        break;
    default:
        fzh_handshake(st, data + 1, size - 1, true);
        break;
    }
    return 0;
}

#ifndef KVW_FUZZ_NO_ENTRY
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    return kvw_fuzz_hello(data, size);
}
#endif
