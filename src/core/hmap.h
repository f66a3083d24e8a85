/*
 * An intrusive hash map keyed by a 64-bit id. The element embeds a kvw_hnode_t and the
 * map links those nodes: a map allocates nothing per element, only its bucket array.
 *
 * A zeroed map is a valid empty map (one inline bucket), so a map inside a calloc'd
 * structure needs no init call; kvw__hmap_fini releases the bucket array. Inserting
 * grows the array (doubling, by rehash) once there are more elements than buckets, and
 * shrinks it when far fewer are left, so chains stay short at any size; when the larger
 * array cannot be allocated the map keeps working with the one it has. Removing never
 * rehashes.
 *
 * Keys are not checked for uniqueness: callers look a key up before inserting it. The
 * map takes no lock; each user documents the mutex that guards its map.
 *
 * Iteration visits every element once, in no particular order:
 *   for (kvw_hnode_t *n = kvw__hmap_first(m); n; n = kvw__hmap_next(m, n))
 * The loop may remove the node it stands on (take the next one first when the element
 * is freed as well); any insertion ends the iteration's validity.
 */
#ifndef KVW_CORE_HMAP_H
#define KVW_CORE_HMAP_H

#include <stddef.h>
#include <stdint.h>

/* The element of type `type` whose member `member` is the node `ptr`. */
#define KVW_CONTAINER_OF(ptr, type, member) ((type *)(void *)((char *)(ptr)-offsetof(type, member)))

typedef struct kvw_hnode {
    struct kvw_hnode *next; /* bucket chain */
    uint64_t key;
} kvw_hnode_t;

typedef struct kvw_hmap {
    kvw_hnode_t **buckets; /* NULL: the one inline bucket `first` */
    kvw_hnode_t *first;
    size_t mask;  /* buckets - 1 */
    size_t count; /* elements */
} kvw_hmap_t;

/* Releases the bucket array (not the elements); the map is empty and zeroed after. */
void kvw__hmap_fini(kvw_hmap_t *m);

/* The node with `key`, or NULL (the most recently inserted one when keys repeat). */
kvw_hnode_t *kvw__hmap_find(const kvw_hmap_t *m, uint64_t key);

/* Links node `n` under `key`. Never fails. */
void kvw__hmap_insert(kvw_hmap_t *m, kvw_hnode_t *n, uint64_t key);

/* Unlinks node `n`; returns 0 when it was in the map, -1 when it was not. The node's
 * key and chain link are left as they were (see the iteration rule above). */
int kvw__hmap_remove(kvw_hmap_t *m, kvw_hnode_t *n);

/* Iteration: the first node, and the node after `n` (NULL at the end). */
kvw_hnode_t *kvw__hmap_first(const kvw_hmap_t *m);
kvw_hnode_t *kvw__hmap_next(const kvw_hmap_t *m, const kvw_hnode_t *n);

static inline size_t kvw__hmap_count(const kvw_hmap_t *m)
{
    return m->count;
}

#endif
