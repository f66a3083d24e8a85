/*
 * The DONE frame's codec (src/proto/codec.c), against the layout written out here by hand
 * (docs/DESIGN.md, "Protocol"): header (magic "KVW1", version 2, type 9, two zero bytes,
 * payload length), then room u64, peer u32, chunk begin and end u64, bytes u64, last chunk
 * u8, staged u8, stream offset, length and staging offset u64, final u8, metadata length
 * u32, digest count u32, the digest values u64 each, all little-endian, and with a session
 * key a 16-byte tag: HMAC-SHA256(key, "kvwire-done-4" | everything after the header up to
 * the tag), truncated.
 *   layout     a frame with three digest values and one without, byte for byte
 *   roundtrip  decoding gives back every field and the values as they lie in the frame
 *   tag        the tag checks; a flipped bit in a digest value, in a field or in the tag,
 *              or a frame cut short, does not
 *   malformed  a count past KVW_DONE_DIGEST_MAX, values cut short, a trailing byte:
 *              MALFORMED with a message, never a read past the frame
 *   bound      the largest frame (KVW_DONE_DIGEST_MAX values and a tag) fits in one
 *              notification of every transport (KVW_TL_MAX_NOTIFY)
 *
 * Exit: 0 pass, 1 fail.
 */
#include "check.h"

#include "core/sha256.h"
#include "proto/proto.h"
#include "transport/transport.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static size_t put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
    return 8;
}

static size_t put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
    return 4;
}

/* The frame as the layout above says, into out; its length. */
static size_t by_hand(uint8_t *out, const kvw_done_msg_t *m, const uint8_t *key)
{
    size_t o = 12;
    o += put64(out + o, m->room);
    o += put32(out + o, m->peer);
    o += put64(out + o, m->chunk_begin);
    o += put64(out + o, m->chunk_end);
    o += put64(out + o, m->bytes);
    out[o++] = m->last_chunk;
    out[o++] = m->staged;
    o += put64(out + o, m->soff);
    o += put64(out + o, m->slen);
    o += put64(out + o, m->goff);
    out[o++] = m->final;
    o += put32(out + o, m->meta_len);
    o += put32(out + o, m->digest_n);
    for (uint32_t u = 0; u < m->digest_n; u++)
        o += put64(out + o, m->digest[u]);
    if (key) {
        kvw_hmac_t h;
        uint8_t t[32];
        kvw__hmac_init(&h, key, 32);
        kvw__hmac_update(&h, "kvwire-done-4", 13);
        kvw__hmac_update(&h, out + 12, o - 12);
        kvw__hmac_final(&h, t);
        memcpy(out + o, t, 16);
        o += 16;
    }
    out[0] = 'K', out[1] = 'V', out[2] = 'W', out[3] = '1';
    out[4] = 2, out[5] = 9, out[6] = 0, out[7] = 0;
    put32(out + 8, (uint32_t)(o - 12));
    return o;
}

static kvw_status_t decode(const uint8_t *p, size_t len, kvw_done_msg_t *m)
{
    kvw_rbuf_t rb;
    kvw__rb_init(&rb, p + 12, len - 12);
    return kvw__done_decode(&rb, m);
}

static void one(const char *what, uint32_t n, const uint8_t *key)
{
    uint64_t vals[4] = {0x0123456789abcdefull, 0, ~0ull, 42};
    kvw_done_msg_t m = {.room = 0x1122334455667788ull, .peer = 7, .chunk_begin = 128,
                        .chunk_end = 200, .bytes = 4608, .last_chunk = true, .staged = false,
                        .soff = 1, .slen = 2, .goff = 3, .final = true, .meta_len = 33,
                        .digest_n = n, .digest = vals};
    uint8_t want[512];
    size_t wlen = by_hand(want, &m, key);
    kvw_wbuf_t w;
    kvw__done_encode(&w, &m, key);
    CHECK(kvw__wb_finish(&w) == KVW_OK, "%s: finish: %s", what, kvw_last_error());
    size_t d = 0;
    while (d < w.len && d < wlen && w.p[d] == want[d])
        d++;
    CHECK(w.len == wlen && d == wlen,
          "%s: encoded %zu bytes, the layout says %zu (first difference at %zu)", what, w.len,
          wlen, d);
    kvw_done_msg_t g;
    CHECK(decode(want, wlen, &g) == KVW_OK, "%s: decode: %s", what, kvw_last_error());
    CHECK(g.room == m.room && g.peer == m.peer && g.chunk_begin == m.chunk_begin &&
              g.chunk_end == m.chunk_end && g.bytes == m.bytes && g.last_chunk && !g.staged &&
              g.soff == 1 && g.slen == 2 && g.goff == 3 && g.final && g.meta_len == 33 &&
              g.digest_n == n,
          "%s: decoded fields differ", what);
    for (uint32_t u = 0; u < n; u++) {
        uint64_t v = 0;
        for (int b = 0; b < 8; b++)
            v |= (uint64_t)g.digest_le[8 * u + b] << (8 * b);
        CHECK(v == vals[u], "%s: digest value %u decoded as %llx", what, u,
              (unsigned long long)v);
    }
    if (key) {
        const uint8_t *pl = want + 12;
        size_t plen = wlen - 12;
        CHECK(kvw__done_check_tag(pl, plen, key) == KVW_OK, "%s: tag refused: %s", what,
              kvw_last_error());
        /* A bit flipped in each byte of the payload in turn (fields, values, tag). */
        int passed = 0;
        for (size_t i = 0; i < plen; i++) {
            uint8_t c[512];
            memcpy(c, pl, plen);
            c[i] ^= 0x10;
            passed += kvw__done_check_tag(c, plen, key) == KVW_OK;
        }
        CHECK(passed == 0, "%s: %d altered frames passed the tag check", what, passed);
        CHECK(kvw__done_check_tag(pl, plen - 1, key) == KVW_ERR_AUTH &&
                  kvw__done_check_tag(pl, plen - 16, key) == KVW_ERR_AUTH,
              "%s: a frame cut short passed the tag check", what);
    }
    kvw__wb_free(&w);
}

static void malformed(void)
{
    uint64_t vals[4] = {1, 2, 3, 4};
    kvw_done_msg_t m = {.room = 5, .final = true, .last_chunk = true, .digest_n = 4,
                        .digest = vals};
    uint8_t f[512];
    size_t len = by_hand(f, &m, NULL);
    kvw_done_msg_t g;
    /* Values cut short: 4 announced, 3 and a half there. */
    CHECK(decode(f, len - 4, &g) == KVW_ERR_MALFORMED && strstr(kvw_last_error(), "digest"),
          "values cut short: %s", kvw_last_error());
    /* A trailing byte that is no tag. */
    f[len] = 0;
    CHECK(decode(f, len + 1, &g) == KVW_ERR_MALFORMED, "a trailing byte was accepted");
    /* A count past the bound, with the bytes to back it absent. */
    put32(f + 12 + 67, KVW_DONE_DIGEST_MAX + 1);
    CHECK(decode(f, len, &g) == KVW_ERR_MALFORMED, "a count past the bound was accepted");
    put32(f + 12 + 67, 0xffffffffu);
    CHECK(decode(f, len, &g) == KVW_ERR_MALFORMED, "count 2^32-1 was accepted");
    CHECK(kvw__done_check_tag(f + 12, len - 12, (const uint8_t[32]){0}) == KVW_ERR_AUTH,
          "the tag check took a frame whose count is past the bound");
    /* The fields alone cut short. */
    CHECK(decode(f, 12 + 60, &g) == KVW_ERR_MALFORMED, "truncated fields were accepted");
}

int main(void)
{
    uint8_t key[32];
    for (int i = 0; i < 32; i++)
        key[i] = (uint8_t)(i * 7 + 1);
    one("no digest", 0, NULL);
    one("three values", 3, NULL);
    one("no digest, tagged", 0, key);
    one("four values, tagged", 4, key);
    malformed();
    /* The largest frame fits in one notification. */
    uint64_t *big = calloc(KVW_DONE_DIGEST_MAX, 8);
    kvw_done_msg_t m = {.final = true, .last_chunk = true, .digest_n = KVW_DONE_DIGEST_MAX,
                        .digest = big};
    kvw_wbuf_t w;
    kvw__done_encode(&w, &m, key);
    CHECK(big && kvw__wb_finish(&w) == KVW_OK && w.len <= KVW_TL_MAX_NOTIFY,
          "the largest DONE frame is %zu bytes, a notification at most %u", w.len,
          KVW_TL_MAX_NOTIFY);
    kvw__wb_free(&w);
    free(big);
    if (failures) {
        fprintf(stderr, "test_done_codec: %d failures\n", failures);
        return 1;
    }
    printf("test_done_codec: all checks passed\n");
    return 0;
}
