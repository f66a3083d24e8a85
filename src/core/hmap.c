/* The intrusive u64 hash map; see hmap.h. */
#include "core/hmap.h"

#include <stdlib.h>

#define HMAP_MIN_GROW 16   /* the first array after the inline bucket */
#define HMAP_MIN_SHRINK 64 /* arrays this small are never shrunk */

static kvw_hnode_t **hmap_table(const kvw_hmap_t *m)
{
    return m->buckets ? m->buckets : (kvw_hnode_t **)&m->first;
}

static size_t hmap_bucket(const kvw_hmap_t *m, uint64_t key)
{
    /* The finalizer of MurmurHash3: every bit of the key reaches the low bits. */
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdull;
    key ^= key >> 33;
    key *= 0xc4ceb9fe1a85ec53ull;
    key ^= key >> 33;
    return (size_t)key & m->mask;
}

/* Moves every node into a new array of `nb` buckets (a power of two > 1). Keeps the old
 * array when the new one cannot be allocated. */
static void hmap_rehash(kvw_hmap_t *m, size_t nb)
{
    kvw_hnode_t **nt = calloc(nb, sizeof(*nt));
    if (nt == NULL)
        return;
    kvw_hnode_t **ot = hmap_table(m);
    size_t on = m->mask + 1;
    kvw_hmap_t nm = {.buckets = nt, .mask = nb - 1, .count = m->count};
    for (size_t b = 0; b < on; b++) {
        while (ot[b]) {
            kvw_hnode_t *n = ot[b];
            ot[b] = n->next;
            size_t i = hmap_bucket(&nm, n->key);
            n->next = nt[i];
            nt[i] = n;
        }
    }
    free(m->buckets);
    *m = nm;
}

void kvw__hmap_fini(kvw_hmap_t *m)
{
    free(m->buckets);
    *m = (kvw_hmap_t){0};
}

kvw_hnode_t *kvw__hmap_find(const kvw_hmap_t *m, uint64_t key)
{
    for (kvw_hnode_t *n = hmap_table(m)[hmap_bucket(m, key)]; n; n = n->next)
        if (n->key == key)
            return n;
    return NULL;
}

void kvw__hmap_insert(kvw_hmap_t *m, kvw_hnode_t *n, uint64_t key)
{
    size_t nb = m->mask + 1;
    if (m->count + 1 > nb)
        hmap_rehash(m, nb * 2 < HMAP_MIN_GROW ? HMAP_MIN_GROW : nb * 2);
    else if (nb >= HMAP_MIN_SHRINK && (m->count + 1) * 8 < nb)
        hmap_rehash(m, nb / 2);
    kvw_hnode_t **t = hmap_table(m);
    size_t b = hmap_bucket(m, key);
    n->key = key;
    n->next = t[b];
    t[b] = n;
    m->count++;
}

int kvw__hmap_remove(kvw_hmap_t *m, kvw_hnode_t *n)
{
    for (kvw_hnode_t **pp = &hmap_table(m)[hmap_bucket(m, n->key)]; *pp; pp = &(*pp)->next)
        if (*pp == n) {
            *pp = n->next;
            m->count--;
            return 0;
        }
    return -1;
}

static kvw_hnode_t *hmap_scan(const kvw_hmap_t *m, size_t b)
{
    kvw_hnode_t **t = hmap_table(m);
    for (; b <= m->mask; b++)
        if (t[b])
            return t[b];
    return NULL;
}

kvw_hnode_t *kvw__hmap_first(const kvw_hmap_t *m)
{
    return hmap_scan(m, 0);
}

kvw_hnode_t *kvw__hmap_next(const kvw_hmap_t *m, const kvw_hnode_t *n)
{
    return n->next ? n->next : hmap_scan(m, hmap_bucket(m, n->key) + 1);
}
