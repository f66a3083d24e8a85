/*
 * The intrusive u64 hash map (src/core/hmap.c), against a sorted array of the keys that
 * should be present:
 *   zeroed     a zeroed map is empty: find, first and remove see nothing
 *   random     100k random operations (insert, remove, find) on 20k elements whose
 *              keys collide on purpose (equal low bits, equal high bits, 0 and ~0);
 *              after every 5k, iteration visits exactly the present elements once each
 *   growth     200k inserted keys: the array grows to at least one bucket per element
 *              and no chain exceeds 12 nodes; it shrinks again when they are removed
 *   removing   iteration that removes (and frees) every other element as it goes, and
 *              one that removes the node it stands on before stepping on, visit every
 *              element once and leave exactly the others
 *
 * Exit: 0 pass, 1 fail.
 */
#include "inproc.h"

#include "core/hmap.h"

#include <inttypes.h>

typedef struct elem {
    uint64_t payload;
    kvw_hnode_t node;
    bool in;        /* what the reference says */
    unsigned seen;  /* visits in the current iteration */
} elem_t;

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* The reference: sorted keys of the present elements. */
static size_t ref_keys(const elem_t *e, const uint64_t *keys, size_t n, uint64_t *out)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (e[i].in)
            out[k++] = keys[i];
    qsort(out, k, sizeof(*out), cmp_u64);
    return k;
}

static size_t max_chain(const kvw_hmap_t *m)
{
    size_t worst = 0;
    for (size_t b = 0; m->buckets && b <= m->mask; b++) {
        size_t len = 0;
        for (kvw_hnode_t *n = m->buckets[b]; n; n = n->next)
            len++;
        worst = len > worst ? len : worst;
    }
    return worst;
}

/* Iterates the map; checks it visits exactly the reference's elements once each. */
static void check_iteration(const char *when, kvw_hmap_t *m, elem_t *e, const uint64_t *keys,
                            size_t n, uint64_t *scratch_a, uint64_t *scratch_b)
{
    for (size_t i = 0; i < n; i++)
        e[i].seen = 0;
    size_t got = 0;
    for (kvw_hnode_t *x = kvw__hmap_first(m); x; x = kvw__hmap_next(m, x)) {
        elem_t *el = KVW_CONTAINER_OF(x, elem_t, node);
        if (el < e || el >= e + n) {
            CHECK(0, "%s: iteration returned a foreign node", when);
            return;
        }
        el->seen++;
        if (got < n)
            scratch_a[got] = x->key;
        got++;
    }
    size_t want = ref_keys(e, keys, n, scratch_b);
    CHECK(got == want && kvw__hmap_count(m) == want, "%s: visited %zu, count %zu, expected %zu",
          when, got, kvw__hmap_count(m), want);
    if (got != want)
        return;
    qsort(scratch_a, got, sizeof(*scratch_a), cmp_u64);
    CHECK(memcmp(scratch_a, scratch_b, got * sizeof(*scratch_a)) == 0,
          "%s: visited keys differ from the reference", when);
    for (size_t i = 0; i < n; i++)
        CHECK(e[i].seen == (e[i].in ? 1u : 0u), "%s: element %zu (key %016" PRIx64
              ", present %d) visited %u times", when, i, keys[i], e[i].in, e[i].seen);
}

static void check_zeroed(void)
{
    kvw_hmap_t m = {0};
    elem_t x = {0};
    CHECK(kvw__hmap_find(&m, 0) == NULL && kvw__hmap_find(&m, 42) == NULL, "zeroed map finds");
    CHECK(kvw__hmap_first(&m) == NULL, "zeroed map iterates");
    x.node.key = 7;
    CHECK(kvw__hmap_remove(&m, &x.node) == -1, "zeroed map removes");
    kvw__hmap_insert(&m, &x.node, 7);
    CHECK(kvw__hmap_find(&m, 7) == &x.node && kvw__hmap_count(&m) == 1, "one element");
    CHECK(kvw__hmap_first(&m) == &x.node && kvw__hmap_next(&m, &x.node) == NULL,
          "one element iterates");
    CHECK(kvw__hmap_remove(&m, &x.node) == 0 && kvw__hmap_remove(&m, &x.node) == -1,
          "remove twice");
    CHECK(kvw__hmap_find(&m, 7) == NULL && kvw__hmap_count(&m) == 0, "empty again");
    kvw__hmap_fini(&m);
}

/* Keys that collide: the same low 32 bits, the same high 32 bits, multiples of 2^32,
 * both ends of the range, and random ones. All distinct. */
static void make_keys(uint64_t *keys, size_t n, kvt_rng_t *rng)
{
    for (size_t i = 0; i < n; i++) {
        switch (i % 5) {
        case 0:
            keys[i] = ((uint64_t)i << 32) | 0x1234u;
            break;
        case 1:
            keys[i] = 0xabcdull << 32 | (uint64_t)i;
            break;
        case 2:
            keys[i] = (uint64_t)i << 40;
            break;
        default:
            keys[i] = kvt_rng_next(rng) | 1ull << 63;
            break;
        }
    }
    keys[0] = 0;
    keys[1] = UINT64_MAX;
    qsort(keys, n, sizeof(*keys), cmp_u64);
    for (size_t i = 1; i < n; i++)
        if (keys[i] == keys[i - 1]) /* a random key met another: make it unique */
            keys[i] = keys[i - 1] + 1;
    /* Shuffle, so that element order says nothing about key order. */
    for (size_t i = n - 1; i > 0; i--) {
        size_t j = (size_t)kvt_rng_below(rng, i + 1);
        uint64_t t = keys[i];
        keys[i] = keys[j];
        keys[j] = t;
    }
}

static void check_random(kvt_rng_t *rng)
{
    enum { N = 20000, OPS = 100000 };
    uint64_t *keys = malloc(N * sizeof(*keys)), *sa = malloc(N * sizeof(*sa)),
             *sb = malloc(N * sizeof(*sb));
    elem_t *e = calloc(N, sizeof(*e));
    if (!keys || !sa || !sb || !e) {
        CHECK(0, "no memory");
        goto out;
    }
    make_keys(keys, N, rng);
    kvw_hmap_t m = {0};
    for (int op = 1; op <= OPS; op++) {
        size_t i = (size_t)kvt_rng_below(rng, N);
        switch (kvt_rng_below(rng, 3)) {
        case 0: /* insert, when absent (callers look up first) */
            CHECK((kvw__hmap_find(&m, keys[i]) != NULL) == e[i].in, "op %d: find before insert",
                  op);
            if (!e[i].in) {
                kvw__hmap_insert(&m, &e[i].node, keys[i]);
                e[i].in = true;
            }
            break;
        case 1:
            CHECK(kvw__hmap_remove(&m, &e[i].node) == (e[i].in ? 0 : -1),
                  "op %d: remove of element %zu (present %d)", op, i, e[i].in);
            e[i].in = false;
            break;
        default: {
            kvw_hnode_t *f = kvw__hmap_find(&m, keys[i]);
            CHECK(f == (e[i].in ? &e[i].node : NULL), "op %d: find key %016" PRIx64 " gave %p",
                  op, keys[i], (void *)f);
            break;
        }
        }
        if (op % 5000 == 0) {
            char when[32];
            snprintf(when, sizeof(when), "after op %d", op);
            check_iteration(when, &m, e, keys, N, sa, sb);
        }
    }
    /* Keys of no element are never found. */
    memcpy(sb, keys, N * sizeof(*keys));
    qsort(sb, N, sizeof(*sb), cmp_u64);
    for (int k = 0; k < 1000; k++) {
        uint64_t key = kvt_rng_next(rng);
        if (bsearch(&key, sb, N, sizeof(*sb), cmp_u64) == NULL)
            CHECK(kvw__hmap_find(&m, key) == NULL, "key %016" PRIx64 " found, never inserted",
                  key);
    }
    kvw__hmap_fini(&m);
out:
    free(keys);
    free(sa);
    free(sb);
    free(e);
}

static void check_growth(kvt_rng_t *rng)
{
    enum { N = 200000 };
    uint64_t *keys = malloc(N * sizeof(*keys)), *sa = malloc(N * sizeof(*sa)),
             *sb = malloc(N * sizeof(*sb));
    elem_t *e = calloc(N, sizeof(*e));
    if (!keys || !sa || !sb || !e) {
        CHECK(0, "no memory");
        goto out;
    }
    make_keys(keys, N, rng);
    kvw_hmap_t m = {0};
    for (size_t i = 0; i < N; i++) {
        kvw__hmap_insert(&m, &e[i].node, keys[i]);
        e[i].in = true;
    }
    size_t chain = max_chain(&m);
    CHECK(m.mask + 1 >= N && chain <= 12, "%d elements: %zu buckets, longest chain %zu", N,
          m.mask + 1, chain);
    for (size_t i = 0; i < N; i++)
        CHECK(kvw__hmap_find(&m, keys[i]) == &e[i].node, "key %zu lost after growth", i);
    check_iteration("grown", &m, e, keys, N, sa, sb);
    /* Remove all but 100, then insert again: the array shrinks back. */
    for (size_t i = 100; i < N; i++) {
        CHECK(kvw__hmap_remove(&m, &e[i].node) == 0, "remove %zu", i);
        e[i].in = false;
    }
    for (size_t i = 100; i < 200; i++) {
        kvw__hmap_insert(&m, &e[i].node, keys[i]);
        e[i].in = true;
    }
    CHECK(m.mask + 1 <= 1024, "200 elements left in %zu buckets", m.mask + 1);
    check_iteration("shrunk", &m, e, keys, N, sa, sb);
    kvw__hmap_fini(&m);
    CHECK(m.buckets == NULL && kvw__hmap_count(&m) == 0 && kvw__hmap_first(&m) == NULL,
          "fini leaves an empty map");
out:
    free(keys);
    free(sa);
    free(sb);
    free(e);
}

/* Elements allocated one by one, so that ASan sees a use after a free. */
typedef struct room {
    kvw_hnode_t node;
    size_t idx;
} room_t;

static void check_removing(kvt_rng_t *rng)
{
    enum { N = 5000 };
    uint64_t *keys = malloc(N * sizeof(*keys)), *sa = malloc(N * sizeof(*sa)),
             *sb = malloc(N * sizeof(*sb));
    elem_t *e = calloc(N, sizeof(*e));
    room_t **rooms = calloc(N, sizeof(*rooms));
    if (!keys || !sa || !sb || !e || !rooms) {
        CHECK(0, "no memory");
        goto out;
    }
    make_keys(keys, N, rng);

    /* 1. Remove and free every element with an odd index, taking the next node first. */
    kvw_hmap_t m = {0};
    for (size_t i = 0; i < N; i++) {
        rooms[i] = calloc(1, sizeof(room_t));
        if (rooms[i] == NULL) {
            CHECK(0, "no memory");
            goto out;
        }
        rooms[i]->idx = i;
        kvw__hmap_insert(&m, &rooms[i]->node, keys[i]);
    }
    size_t visits = 0;
    for (kvw_hnode_t *x = kvw__hmap_first(&m), *nx; x; x = nx) {
        nx = kvw__hmap_next(&m, x);
        room_t *r = KVW_CONTAINER_OF(x, room_t, node);
        visits++;
        if (r->idx % 2) {
            CHECK(kvw__hmap_remove(&m, x) == 0, "remove while iterating");
            rooms[r->idx] = NULL;
            free(r);
        }
    }
    CHECK(visits == N, "removing iteration visited %zu of %d", visits, N);
    for (size_t i = 0; i < N; i++) {
        kvw_hnode_t *f = kvw__hmap_find(&m, keys[i]);
        CHECK(i % 2 ? f == NULL : f == &rooms[i]->node, "after removing iteration: key %zu", i);
    }
    CHECK(kvw__hmap_count(&m) == N / 2, "count %zu", kvw__hmap_count(&m));
    for (kvw_hnode_t *x = kvw__hmap_first(&m), *nx; x; x = nx) {
        nx = kvw__hmap_next(&m, x);
        free(KVW_CONTAINER_OF(x, room_t, node));
    }
    kvw__hmap_fini(&m);

    /* 2. Remove the node it stands on, then step from it (the node stays valid). */
    for (size_t i = 0; i < N; i++) {
        kvw__hmap_insert(&m, &e[i].node, keys[i]);
        e[i].in = true;
    }
    for (size_t i = 0; i < N; i++)
        e[i].seen = 0;
    for (kvw_hnode_t *x = kvw__hmap_first(&m); x; x = kvw__hmap_next(&m, x)) {
        elem_t *el = KVW_CONTAINER_OF(x, elem_t, node);
        el->seen++;
        if (kvt_rng_below(rng, 3) == 0) {
            CHECK(kvw__hmap_remove(&m, x) == 0, "remove the current node");
            el->in = false;
        }
    }
    for (size_t i = 0; i < N; i++)
        CHECK(e[i].seen == 1, "element %zu visited %u times while removing", i, e[i].seen);
    check_iteration("after removing the current nodes", &m, e, keys, N, sa, sb);
    kvw__hmap_fini(&m);
out:
    free(keys);
    free(sa);
    free(sb);
    free(e);
    free(rooms);
}

int main(void)
{
    kvt_rng_t rng = {.state = 0x5eed1234abcdull};
    check_zeroed();
    check_random(&rng);
    check_growth(&rng);
    check_removing(&rng);
    return ip_summary("test_hmap");
}
