/*
 * Tests for head ownership and routes (kvw_topo_heads, kvw_topo_routes).
 *
 * A wrong head index never fails loudly: the decode side just reads garbage. So this
 * test checks the implementation in two independent ways:
 *
 *   1. Literal route tables derived by hand from DESIGN.md section 3 (every worked
 *      example there, plus more cases with replication on either or both sides,
 *      non-power-of-two ratios, MLA and TP 1). These are written out as data on
 *      purpose; none of them is computed by code.
 *   2. An exhaustive sweep over many TP sizes and head counts that checks the
 *      properties the rule guarantees (every destination head written exactly once,
 *      by an owner of that head, at the right offsets; routes merged; replicas used
 *      evenly) with its own small ownership function written from the DESIGN rule.
 *
 * Exit status: 0 when every check passed, 1 otherwise.
 */
#include "check.h"

#include <kvwire/kvwire.h>

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define R(s, d, ss, ds, n) {KVW_ROUTE_FIELDS_ALL, (s), (d), (ss), (ds), (n)}

typedef struct {
    const char *name;
    uint32_t src_tp, dst_tp, heads;
    size_t num_routes;
    kvw_route_t routes[32];
} expected_t;

/*
 * Hand-derived tables. Each row is (src rank, dst rank, src_head_start,
 * dst_head_start, num_heads); starts are offsets inside each rank's own heads.
 * Replicated heads follow the recommended rule: the k-th destination rank (in rank
 * order) that needs head h reads it from source replica k mod rep_S.
 */
static const expected_t kvw_expected[] = {
    /* ---- every worked example of DESIGN.md section 3 ---- */
    /* Source 0 owns heads 0,1; d0,d1 own head 0, d2,d3 own head 1. */
    {"1->4 H=2 (design)", 1, 4, 2, 4,
     {R(0, 0, 0, 0, 1), R(0, 1, 0, 0, 1), R(0, 2, 1, 0, 1), R(0, 3, 1, 0, 1)}},
    {"4->2 H=8 (design)", 4, 2, 8, 4,
     {R(0, 0, 0, 0, 2), R(1, 0, 0, 2, 2), R(2, 1, 0, 0, 2), R(3, 1, 0, 2, 2)}},
    {"2->4 H=8 (design)", 2, 4, 8, 4,
     {R(0, 0, 0, 0, 2), R(0, 1, 2, 0, 2), R(1, 2, 0, 0, 2), R(1, 3, 2, 0, 2)}},
    {"8->2 H=8 (design)", 8, 2, 8, 8,
     {R(0, 0, 0, 0, 1), R(1, 0, 0, 1, 1), R(2, 0, 0, 2, 1), R(3, 0, 0, 3, 1),
      R(4, 1, 0, 0, 1), R(5, 1, 0, 1, 1), R(6, 1, 0, 2, 1), R(7, 1, 0, 3, 1)}},
    /* s0..s3 hold head 0, s4..s7 head 1; d0,d1 need head 0 (k = 0, 1), d2,d3 head 1. */
    {"8->4 H=2 (design)", 8, 4, 2, 4,
     {R(0, 0, 0, 0, 1), R(1, 1, 0, 0, 1), R(4, 2, 0, 0, 1), R(5, 3, 0, 0, 1)}},
    {"3->2 H=6 (design)", 3, 2, 6, 4,
     {R(0, 0, 0, 0, 2), R(1, 0, 0, 2, 1), R(1, 1, 1, 0, 1), R(2, 1, 0, 1, 2)}},
    {"4->4 H=8 (design)", 4, 4, 8, 4,
     {R(0, 0, 0, 0, 2), R(1, 1, 0, 0, 2), R(2, 2, 0, 0, 2), R(3, 3, 0, 0, 2)}},

    /* ---- replication on both sides ---- */
    /* s0,s1 head 0; s2,s3 head 1. d0..d3 head 0 (k 0..3 -> s0,s1,s0,s1),
     * d4..d7 head 1 (-> s2,s3,s2,s3). */
    {"4->8 H=2", 4, 8, 2, 8,
     {R(0, 0, 0, 0, 1), R(1, 1, 0, 0, 1), R(0, 2, 0, 0, 1), R(1, 3, 0, 0, 1),
      R(2, 4, 0, 0, 1), R(3, 5, 0, 0, 1), R(2, 6, 0, 0, 1), R(3, 7, 0, 0, 1)}},
    /* rep_S = 4; each destination owns one head and is its only reader (k = 0). */
    {"16->4 H=4", 16, 4, 4, 4,
     {R(0, 0, 0, 0, 1), R(4, 1, 0, 0, 1), R(8, 2, 0, 0, 1), R(12, 3, 0, 0, 1)}},
    /* rep_S = 4, rep_D = 2: head h is on s4h..s4h+3, read by d2h (k 0), d2h+1 (k 1). */
    {"16->8 H=4", 16, 8, 4, 8,
     {R(0, 0, 0, 0, 1), R(1, 1, 0, 0, 1), R(4, 2, 0, 0, 1), R(5, 3, 0, 0, 1),
      R(8, 4, 0, 0, 1), R(9, 5, 0, 0, 1), R(12, 6, 0, 0, 1), R(13, 7, 0, 0, 1)}},
    /* rep_S = 4 (s0..s3 head 0, s4..s7 head 1), rep_D = 8: k 0..7 cycles the replicas. */
    {"8->16 H=2", 8, 16, 2, 16,
     {R(0, 0, 0, 0, 1), R(1, 1, 0, 0, 1), R(2, 2, 0, 0, 1), R(3, 3, 0, 0, 1),
      R(0, 4, 0, 0, 1), R(1, 5, 0, 0, 1), R(2, 6, 0, 0, 1), R(3, 7, 0, 0, 1),
      R(4, 8, 0, 0, 1), R(5, 9, 0, 0, 1), R(6, 10, 0, 0, 1), R(7, 11, 0, 0, 1),
      R(4, 12, 0, 0, 1), R(5, 13, 0, 0, 1), R(6, 14, 0, 0, 1), R(7, 15, 0, 0, 1)}},
    /* rep_S = 6, rep_D = 3: head 0 on s0..s5 read by d0,d1,d2; head 1 on s6..s11. */
    {"12->6 H=2", 12, 6, 2, 6,
     {R(0, 0, 0, 0, 1), R(1, 1, 0, 0, 1), R(2, 2, 0, 0, 1), R(6, 3, 0, 0, 1),
      R(7, 4, 0, 0, 1), R(8, 5, 0, 0, 1)}},
    /* rep_S = 2, rep_D = 4: three heads, each read by four destinations. */
    {"6->12 H=3", 6, 12, 3, 12,
     {R(0, 0, 0, 0, 1), R(1, 1, 0, 0, 1), R(0, 2, 0, 0, 1), R(1, 3, 0, 0, 1),
      R(2, 4, 0, 0, 1), R(3, 5, 0, 0, 1), R(2, 6, 0, 0, 1), R(3, 7, 0, 0, 1),
      R(4, 8, 0, 0, 1), R(5, 9, 0, 0, 1), R(4, 10, 0, 0, 1), R(5, 11, 0, 0, 1)}},
    /* Source replicated (rep_S = 2), destination not: only replica 0 is needed. */
    {"4->2 H=2", 4, 2, 2, 2, {R(0, 0, 0, 0, 1), R(2, 1, 0, 0, 1)}},
    {"6->3 H=3", 6, 3, 3, 3, {R(0, 0, 0, 0, 1), R(2, 1, 0, 0, 1), R(4, 2, 0, 0, 1)}},
    /* Destination replicated, source not: one source owns each head. */
    {"3->6 H=3", 3, 6, 3, 6,
     {R(0, 0, 0, 0, 1), R(0, 1, 0, 0, 1), R(1, 2, 0, 0, 1), R(1, 3, 0, 0, 1),
      R(2, 4, 0, 0, 1), R(2, 5, 0, 0, 1)}},
    {"2->4 H=2", 2, 4, 2, 4,
     {R(0, 0, 0, 0, 1), R(0, 1, 0, 0, 1), R(1, 2, 0, 0, 1), R(1, 3, 0, 0, 1)}},
    /* s0 owns heads 0,1 and s1 heads 2,3; d2h and d2h+1 own head h. */
    {"2->8 H=4", 2, 8, 4, 8,
     {R(0, 0, 0, 0, 1), R(0, 1, 0, 0, 1), R(0, 2, 1, 0, 1), R(0, 3, 1, 0, 1),
      R(1, 4, 0, 0, 1), R(1, 5, 0, 0, 1), R(1, 6, 1, 0, 1), R(1, 7, 1, 0, 1)}},

    /* ---- non-power-of-two ratios ---- */
    /* s_i owns [2i, 2i+2), d_j owns [3j, 3j+3). */
    {"6->4 H=12", 6, 4, 12, 8,
     {R(0, 0, 0, 0, 2), R(1, 0, 0, 2, 1), R(1, 1, 1, 0, 1), R(2, 1, 0, 1, 2),
      R(3, 2, 0, 0, 2), R(4, 2, 0, 2, 1), R(4, 3, 1, 0, 1), R(5, 3, 0, 1, 2)}},
    /* s0 owns [0,3), s1 [3,6); d_j owns [2j, 2j+2). */
    {"2->3 H=6", 2, 3, 6, 4,
     {R(0, 0, 0, 0, 2), R(0, 1, 2, 0, 1), R(1, 1, 0, 1, 1), R(1, 2, 1, 0, 2)}},
    /* s_i owns [3i, 3i+3), d_j owns [2j, 2j+2). */
    {"4->6 H=12", 4, 6, 12, 8,
     {R(0, 0, 0, 0, 2), R(0, 1, 2, 0, 1), R(1, 1, 0, 1, 1), R(1, 2, 1, 0, 2),
      R(2, 3, 0, 0, 2), R(2, 4, 2, 0, 1), R(3, 4, 0, 1, 1), R(3, 5, 1, 0, 2)}},
    /* s_i owns [2i, 2i+2), d_j owns [3j, 3j+3). */
    {"12->8 H=24", 12, 8, 24, 16,
     {R(0, 0, 0, 0, 2), R(1, 0, 0, 2, 1), R(1, 1, 1, 0, 1), R(2, 1, 0, 1, 2),
      R(3, 2, 0, 0, 2), R(4, 2, 0, 2, 1), R(4, 3, 1, 0, 1), R(5, 3, 0, 1, 2),
      R(6, 4, 0, 0, 2), R(7, 4, 0, 2, 1), R(7, 5, 1, 0, 1), R(8, 5, 0, 1, 2),
      R(9, 6, 0, 0, 2), R(10, 6, 0, 2, 1), R(10, 7, 1, 0, 1), R(11, 7, 0, 1, 2)}},

    /* ---- MLA: one latent head; destination d reads from source d mod S ---- */
    {"MLA 4->2", 4, 2, 1, 2, {R(0, 0, 0, 0, 1), R(1, 1, 0, 0, 1)}},
    {"MLA 2->4", 2, 4, 1, 4,
     {R(0, 0, 0, 0, 1), R(1, 1, 0, 0, 1), R(0, 2, 0, 0, 1), R(1, 3, 0, 0, 1)}},
    {"MLA 1->8", 1, 8, 1, 8,
     {R(0, 0, 0, 0, 1), R(0, 1, 0, 0, 1), R(0, 2, 0, 0, 1), R(0, 3, 0, 0, 1),
      R(0, 4, 0, 0, 1), R(0, 5, 0, 0, 1), R(0, 6, 0, 0, 1), R(0, 7, 0, 0, 1)}},
    {"MLA 8->1", 8, 1, 1, 1, {R(0, 0, 0, 0, 1)}},
    {"MLA 3->4", 3, 4, 1, 4,
     {R(0, 0, 0, 0, 1), R(1, 1, 0, 0, 1), R(2, 2, 0, 0, 1), R(0, 3, 0, 0, 1)}},
    {"MLA 1->1", 1, 1, 1, 1, {R(0, 0, 0, 0, 1)}},

    /* ---- TP 1 on one or both sides ---- */
    {"1->1 H=8", 1, 1, 8, 1, {R(0, 0, 0, 0, 8)}},
    {"1->2 H=8", 1, 2, 8, 2, {R(0, 0, 0, 0, 4), R(0, 1, 4, 0, 4)}},
    {"2->1 H=8", 2, 1, 8, 2, {R(0, 0, 0, 0, 4), R(1, 0, 0, 4, 4)}},
    {"8->1 H=8", 8, 1, 8, 8,
     {R(0, 0, 0, 0, 1), R(1, 0, 0, 1, 1), R(2, 0, 0, 2, 1), R(3, 0, 0, 3, 1),
      R(4, 0, 0, 4, 1), R(5, 0, 0, 5, 1), R(6, 0, 0, 6, 1), R(7, 0, 0, 7, 1)}},
    {"1->8 H=8", 1, 8, 8, 8,
     {R(0, 0, 0, 0, 1), R(0, 1, 1, 0, 1), R(0, 2, 2, 0, 1), R(0, 3, 3, 0, 1),
      R(0, 4, 4, 0, 1), R(0, 5, 5, 0, 1), R(0, 6, 6, 0, 1), R(0, 7, 7, 0, 1)}},
    /* Source 0 owns all 3 heads; d0,d1 own head 0, d2,d3 head 1, d4,d5 head 2. */
    {"1->6 H=3", 1, 6, 3, 6,
     {R(0, 0, 0, 0, 1), R(0, 1, 0, 0, 1), R(0, 2, 1, 0, 1), R(0, 3, 1, 0, 1),
      R(0, 4, 2, 0, 1), R(0, 5, 2, 0, 1)}},
};

static void print_routes(const char *what, const kvw_route_t *r, size_t n)
{
    fprintf(stderr, "  %s (%zu):", what, n);
    for (size_t i = 0; i < n; i++)
        fprintf(stderr, " %u->%u:%u,%u,%u", r[i].src_rank, r[i].dst_rank, r[i].src_head_start,
                r[i].dst_head_start, r[i].num_heads);
    fputc('\n', stderr);
}

static int route_eq(const kvw_route_t *a, const kvw_route_t *b)
{
    return a->src_rank == b->src_rank && a->dst_rank == b->dst_rank &&
           a->src_head_start == b->src_head_start && a->dst_head_start == b->dst_head_start &&
           a->num_heads == b->num_heads;
}

static void test_expected_tables(void)
{
    for (size_t i = 0; i < sizeof(kvw_expected) / sizeof(kvw_expected[0]); i++) {
        const expected_t *e = &kvw_expected[i];
        kvw_route_t got[64];
        size_t count = 12345;
        kvw_status_t st = kvw_topo_routes(e->src_tp, e->dst_tp, e->heads, got, 64, &count);
        CHECK(st == KVW_OK, "%s: status %d (%s)", e->name, st, kvw_last_error());
        if (st != KVW_OK)
            continue;
        int same = count == e->num_routes;
        for (size_t j = 0; same && j < count; j++)
            same = route_eq(&got[j], &e->routes[j]);
        CHECK(same, "%s: route list differs (got %zu routes, expected %zu)", e->name, count,
              e->num_routes);
        if (!same) {
            /* Never read past the buffer, even when the count itself is the bug. */
            print_routes("expected", e->routes, e->num_routes);
            if (count <= 64)
                print_routes("got     ", got, count);
        }
    }
}

/* Hand-checked ownership: {tp, rank, heads, first, count}. */
static void test_heads_values(void)
{
    static const uint32_t cases[][5] = {
        {1, 0, 8, 0, 8},    {2, 1, 8, 4, 4},     {4, 2, 8, 4, 2},     {8, 7, 8, 7, 1},
        {3, 1, 6, 2, 2},    {3, 2, 6, 4, 2},     {6, 5, 12, 10, 2},   {12, 11, 24, 22, 2},
        {64, 63, 128, 126, 2}, {1, 0, 1, 0, 1}, {4, 3, 1, 0, 1},    {64, 63, 1, 0, 1},
        /* Replication: rank r owns head floor(r / (T / H)). */
        {8, 0, 2, 0, 1},    {8, 3, 2, 0, 1},     {8, 4, 2, 1, 1},     {8, 7, 2, 1, 1},
        {16, 15, 4, 3, 1},  {16, 12, 4, 3, 1},   {16, 11, 4, 2, 1},   {6, 5, 3, 2, 1},
        {6, 2, 3, 1, 1},    {12, 7, 2, 1, 1},    {12, 5, 2, 0, 1},    {4, 1, 2, 0, 1},
        {4, 2, 2, 1, 1},    {64, 33, 32, 16, 1}, {32, 31, 16, 15, 1},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        uint32_t first = 999, count = 999;
        kvw_status_t st = kvw_topo_heads(cases[i][0], cases[i][1], cases[i][2], &first, &count);
        CHECK(st == KVW_OK && first == cases[i][3] && count == cases[i][4],
              "heads(tp %u, rank %u, H %u): status %d first %u count %u, expected %u,%u",
              cases[i][0], cases[i][1], cases[i][2], st, first, count, cases[i][3],
              cases[i][4]);
    }
}

/* True when `msg` holds the decimal number `v` with no digit on either side. */
static int mentions_number(const char *msg, unsigned v)
{
    char num[16];
    snprintf(num, sizeof(num), "%u", v);
    size_t len = strlen(num);
    for (const char *p = strstr(msg, num); p; p = strstr(p + 1, num)) {
        int before = p > msg && isdigit((unsigned char)p[-1]);
        int after = isdigit((unsigned char)p[len]);
        if (!before && !after)
            return 1;
    }
    return 0;
}

static void test_errors(void)
{
    kvw_route_t routes[64];
    size_t count;
    uint32_t first, n;
    kvw_status_t st;

    /* 8 heads cannot be split over 3 ranks, on either side; the message must say why
     * with the offending numbers, since that is all an operator sees. */
    const uint32_t bad[][3] = {{3, 2, 8}, {2, 3, 8}, {3, 3, 8}, {3, 1, 8}, {1, 3, 8}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        count = 777;
        st = kvw_topo_routes(bad[i][0], bad[i][1], bad[i][2], routes, 64, &count);
        CHECK(st == KVW_ERR_INCOMPATIBLE, "routes(%u,%u,%u): status %d", bad[i][0], bad[i][1],
              bad[i][2], st);
        CHECK(mentions_number(kvw_last_error(), 8) && mentions_number(kvw_last_error(), 3),
              "routes(%u,%u,%u): message '%s' must name 8 and 3", bad[i][0], bad[i][1],
              bad[i][2], kvw_last_error());
        CHECK(count == 777, "routes(%u,%u,%u): count written on error (%zu)", bad[i][0],
              bad[i][1], bad[i][2], count);
    }
    first = n = 777;
    st = kvw_topo_heads(3, 0, 8, &first, &n);
    CHECK(st == KVW_ERR_INCOMPATIBLE, "heads(3,0,8): status %d", st);
    CHECK(mentions_number(kvw_last_error(), 8) && mentions_number(kvw_last_error(), 3),
          "heads(3,0,8): message '%s' must name 8 and 3", kvw_last_error());
    CHECK(first == 777 && n == 777, "heads(3,0,8): outputs written on error");

    /* Other incompatible pairs, in both directions of the divisibility rule. */
    st = kvw_topo_heads(6, 0, 4, &first, &n);
    CHECK(st == KVW_ERR_INCOMPATIBLE, "heads(6,0,4): status %d", st);
    st = kvw_topo_heads(4, 0, 6, &first, &n);
    CHECK(st == KVW_ERR_INCOMPATIBLE, "heads(4,0,6): status %d", st);
    st = kvw_topo_routes(4, 6, 4, routes, 64, &count);
    CHECK(st == KVW_ERR_INCOMPATIBLE, "routes(4,6,4): status %d", st);
    st = kvw_topo_routes(8, 2, 12, routes, 64, &count);
    CHECK(st == KVW_ERR_INCOMPATIBLE, "routes(8,2,12): status %d", st);

    /* Zero sizes are errors, never an empty success. */
    const uint32_t zero[][3] = {{0, 2, 8}, {2, 0, 8}, {2, 2, 0}, {0, 0, 0}};
    for (size_t i = 0; i < sizeof(zero) / sizeof(zero[0]); i++) {
        count = 777;
        st = kvw_topo_routes(zero[i][0], zero[i][1], zero[i][2], routes, 64, &count);
        CHECK(st < 0 && st != KVW_ERR_BUFFER_TOO_SMALL, "routes(%u,%u,%u): status %d",
              zero[i][0], zero[i][1], zero[i][2], st);
        CHECK(count == 777, "routes(%u,%u,%u): count written on error", zero[i][0],
              zero[i][1], zero[i][2]);
    }
    first = n = 777;
    st = kvw_topo_heads(0, 0, 8, &first, &n);
    CHECK(st < 0, "heads(0,0,8): status %d", st);
    st = kvw_topo_heads(2, 0, 0, &first, &n);
    CHECK(st < 0, "heads(2,0,0): status %d", st);
    CHECK(first == 777 && n == 777, "heads: outputs written on error");

    /* A rank outside the group is a caller bug. */
    st = kvw_topo_heads(4, 4, 8, &first, &n);
    CHECK(st == KVW_ERR_INVALID_PARAM, "heads(4,4,8): status %d", st);
    st = kvw_topo_heads(8, 9, 2, &first, &n);
    CHECK(st == KVW_ERR_INVALID_PARAM, "heads(8,9,2): status %d", st);
    CHECK(first == 777 && n == 777, "heads: outputs written on error");

    /* Capacity too small: the needed count comes back and nothing past the capacity
     * is touched. 4->2 H=8 needs 4 routes; 8->2 H=8 needs 8. */
    for (size_t cap = 0; cap < 4; cap++) {
        kvw_route_t buf[8];
        memset(buf, 0xAB, sizeof(buf));
        count = 777;
        st = kvw_topo_routes(4, 2, 8, buf, cap, &count);
        CHECK(st == KVW_ERR_BUFFER_TOO_SMALL, "routes(4,2,8) cap %zu: status %d", cap, st);
        CHECK(count == 4, "routes(4,2,8) cap %zu: count %zu, expected 4", cap, count);
        unsigned char canary[sizeof(kvw_route_t) * 8];
        memset(canary, 0xAB, sizeof(canary));
        CHECK(!memcmp((unsigned char *)buf + cap * sizeof(kvw_route_t), canary,
                      (8 - cap) * sizeof(kvw_route_t)),
              "routes(4,2,8) cap %zu: wrote past the capacity", cap);
    }
    count = 777;
    st = kvw_topo_routes(8, 2, 8, routes, 7, &count);
    CHECK(st == KVW_ERR_BUFFER_TOO_SMALL && count == 8, "routes(8,2,8) cap 7: %d, %zu", st,
          count);
    count = 777;
    st = kvw_topo_routes(8, 2, 8, routes, 8, &count);
    CHECK(st == KVW_OK && count == 8, "routes(8,2,8) cap 8 (exact): %d, %zu", st, count);
}

/* ---------------------------------------------------------------- sweep */

/*
 * Ownership written directly from DESIGN.md section 3, kept deliberately separate
 * from the implementation so that a shared misunderstanding is less likely.
 * Returns 0 when T and H are incompatible.
 */
static int own_valid(uint32_t t, uint32_t h)
{
    return t > 0 && h > 0 && (t <= h ? h % t == 0 : t % h == 0);
}

static void own_heads(uint32_t t, uint32_t r, uint32_t h, uint32_t *first, uint32_t *count)
{
    if (t <= h) {
        *first = r * (h / t);
        *count = h / t;
    } else {
        *first = r / (t / h);
        *count = 1;
    }
}

static int own_has(uint32_t t, uint32_t r, uint32_t h, uint32_t head)
{
    uint32_t f, c;
    own_heads(t, r, h, &f, &c);
    return head >= f && head < f + c;
}

static void sweep_one(uint32_t s, uint32_t d, uint32_t h)
{
    size_t count = 0;
    kvw_route_t probe[1];
    kvw_status_t st = kvw_topo_routes(s, d, h, probe, 0, &count);
    int valid = own_valid(s, h) && own_valid(d, h);

    if (!valid) {
        size_t c2 = 777;
        kvw_route_t buf[4];
        st = kvw_topo_routes(s, d, h, buf, 4, &c2);
        CHECK(st == KVW_ERR_INCOMPATIBLE, "sweep %u->%u H=%u: expected INCOMPATIBLE, got %d",
              s, d, h, st);
        CHECK(kvw_last_error()[0] != '\0', "sweep %u->%u H=%u: rejected without a message",
              s, d, h);
        return;
    }
    CHECK(st == KVW_ERR_BUFFER_TOO_SMALL && count > 0,
          "sweep %u->%u H=%u: capacity 0 gave status %d count %zu", s, d, h, st, count);
    if (count == 0)
        return;

    kvw_route_t *routes = calloc(count + 1, sizeof(*routes));
    size_t got = 0;
    st = kvw_topo_routes(s, d, h, routes, count, &got);
    CHECK(st == KVW_OK && got == count, "sweep %u->%u H=%u: status %d count %zu vs %zu", s, d,
          h, st, got, count);
    if (st != KVW_OK || got != count) {
        free(routes);
        return;
    }

    /* writes[d * H + head]: how many routes wrote that destination (rank, absolute head).
     * served[r * H + head]: destinations that source rank r served with that head. */
    unsigned *writes = calloc((size_t)d * h, sizeof(unsigned));
    unsigned *served = calloc((size_t)s * h, sizeof(unsigned));
    int bad = 0;
    uint64_t total_heads = 0;

    for (size_t i = 0; i < count && !bad; i++) {
        const kvw_route_t *r = &routes[i];
        if (r->src_rank >= s || r->dst_rank >= d || r->num_heads == 0) {
            CHECK(0, "sweep %u->%u H=%u: route %zu ranks %u->%u n %u out of range", s, d, h,
                  i, r->src_rank, r->dst_rank, r->num_heads);
            bad = 1;
            break;
        }
        uint32_t sf, sc, df, dc;
        own_heads(s, r->src_rank, h, &sf, &sc);
        own_heads(d, r->dst_rank, h, &df, &dc);
        /* Offsets stay inside each rank's own heads (64-bit sums: no wraparound). */
        if ((uint64_t)r->src_head_start + r->num_heads > sc ||
            (uint64_t)r->dst_head_start + r->num_heads > dc) {
            CHECK(0, "sweep %u->%u H=%u: route %zu %u->%u:%u,%u,%u leaves a rank's heads", s,
                  d, h, i, r->src_rank, r->dst_rank, r->src_head_start, r->dst_head_start,
                  r->num_heads);
            bad = 1;
            break;
        }
        /* The source offset and the destination offset must name the same head. */
        CHECK(sf + r->src_head_start == df + r->dst_head_start,
              "sweep %u->%u H=%u: route %zu %u->%u:%u,%u,%u maps head %u to head %u", s, d, h,
              i, r->src_rank, r->dst_rank, r->src_head_start, r->dst_head_start, r->num_heads,
              sf + r->src_head_start, df + r->dst_head_start);
        for (uint32_t k = 0; k < r->num_heads; k++) {
            uint32_t head = df + r->dst_head_start + k;
            CHECK(own_has(s, r->src_rank, h, sf + r->src_head_start + k),
                  "sweep %u->%u H=%u: source %u does not own head %u", s, d, h, r->src_rank,
                  sf + r->src_head_start + k);
            writes[(size_t)r->dst_rank * h + head]++;
            served[(size_t)r->src_rank * h + head]++;
        }
        total_heads += r->num_heads;

        /* Order: by destination rank, then destination head start. */
        if (i > 0) {
            const kvw_route_t *p = &routes[i - 1];
            CHECK(p->dst_rank < r->dst_rank ||
                      (p->dst_rank == r->dst_rank && p->dst_head_start < r->dst_head_start),
                  "sweep %u->%u H=%u: routes %zu and %zu out of order", s, d, h, i - 1, i);
        }
        /* Merging: no other route of the same pair continues this one on both sides. */
        for (size_t j = 0; j < count; j++) {
            const kvw_route_t *q = &routes[j];
            if (j == i || q->src_rank != r->src_rank || q->dst_rank != r->dst_rank)
                continue;
            CHECK(!(r->src_head_start + r->num_heads == q->src_head_start &&
                    r->dst_head_start + r->num_heads == q->dst_head_start),
                  "sweep %u->%u H=%u: routes %zu and %zu (%u->%u) should be one", s, d, h, i,
                  j, r->src_rank, r->dst_rank);
        }
    }

    if (!bad) {
        /* Every head a destination owns is written exactly once; nothing else is. */
        for (uint32_t dr = 0; dr < d; dr++) {
            for (uint32_t head = 0; head < h; head++) {
                unsigned want = own_has(d, dr, h, head) ? 1u : 0u;
                unsigned w = writes[(size_t)dr * h + head];
                CHECK(w == want, "sweep %u->%u H=%u: dst %u head %u written %u times, want %u",
                      s, d, h, dr, head, w, want);
            }
        }
        uint32_t df, dc;
        own_heads(d, 0, h, &df, &dc);
        CHECK(total_heads == (uint64_t)d * dc, "sweep %u->%u H=%u: %llu heads moved, want %llu",
              s, d, h, (unsigned long long)total_heads, (unsigned long long)d * dc);

        /* Replicas share the load: per head, the destinations each owner serves differ
         * by at most one. */
        for (uint32_t head = 0; head < h; head++) {
            unsigned lo = ~0u, hi = 0;
            for (uint32_t sr = 0; sr < s; sr++) {
                if (!own_has(s, sr, h, head))
                    continue;
                unsigned v = served[(size_t)sr * h + head];
                lo = v < lo ? v : lo;
                hi = v > hi ? v : hi;
            }
            CHECK(hi - lo <= 1, "sweep %u->%u H=%u: head %u replicas serve %u..%u destinations",
                  s, d, h, head, lo, hi);
        }

        /* MLA: exactly one route per destination, from source d mod S. */
        if (h == 1) {
            CHECK(count == d, "sweep MLA %u->%u: %zu routes, want %u", s, d, count, d);
            for (size_t i = 0; i < count && count == d; i++)
                CHECK(routes[i].dst_rank == i && routes[i].src_rank == i % s,
                      "sweep MLA %u->%u: route %zu is %u->%u, want %zu->%zu", s, d, i,
                      routes[i].src_rank, routes[i].dst_rank, i % s, i);
        }
    }

    free(served);
    free(writes);
    free(routes);
}

static void test_sweep(void)
{
    static const uint32_t tps[] = {1, 2, 3, 4, 6, 8, 12, 16, 32, 64};
    static const uint32_t heads[] = {1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128};
    const size_t ntp = sizeof(tps) / sizeof(tps[0]);
    const size_t nh = sizeof(heads) / sizeof(heads[0]);
    unsigned valid = 0, invalid = 0;

    for (size_t hi = 0; hi < nh; hi++) {
        uint32_t h = heads[hi];
        /* kvw_topo_heads agrees with the rule for every rank, or rejects the pair. */
        for (size_t ti = 0; ti < ntp; ti++) {
            uint32_t t = tps[ti];
            for (uint32_t r = 0; r < t; r++) {
                uint32_t first = 999, cnt = 999, wf, wc;
                kvw_status_t st = kvw_topo_heads(t, r, h, &first, &cnt);
                if (!own_valid(t, h)) {
                    CHECK(st == KVW_ERR_INCOMPATIBLE, "heads(%u,%u,%u): status %d", t, r, h,
                          st);
                    continue;
                }
                own_heads(t, r, h, &wf, &wc);
                CHECK(st == KVW_OK && first == wf && cnt == wc,
                      "heads(%u,%u,%u): %d %u,%u want %u,%u", t, r, h, st, first, cnt, wf, wc);
            }
        }
        for (size_t si = 0; si < ntp; si++) {
            for (size_t di = 0; di < ntp; di++) {
                sweep_one(tps[si], tps[di], h);
                if (own_valid(tps[si], h) && own_valid(tps[di], h))
                    valid++;
                else
                    invalid++;
            }
        }
    }
    /* Guards the sweep itself: a broken validity helper would silently skip work. */
    CHECK(valid > 500 && invalid > 100, "sweep covered %u valid, %u invalid combos", valid,
          invalid);
}

int main(void)
{
    test_expected_tables();
    test_heads_values();
    test_errors();
    test_sweep();
    if (failures) {
        fprintf(stderr, "test_topo: %d of %d checks FAILED\n", failures, checks);
        return 1;
    }
    printf("test_topo: all %d checks passed\n", checks);
    return 0;
}
