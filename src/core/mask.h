/* Field masks of the structs that cross the API (see kvwire.h, "Field masks"): one
 * table per struct names its bits, and one check refuses unknown bits and missing
 * required fields with a message naming the struct and the bits. */
#ifndef KVW_CORE_MASK_H
#define KVW_CORE_MASK_H

#include <kvwire/kvwire.h>

#include <stddef.h>

/* Where a struct's field lies. */
typedef struct kvw_mask_field {
    size_t off, size;
} kvw_mask_field_t;

typedef struct kvw_mask_spec {
    const char *type;          /* "kvw_send_chunk_t" */
    const char *const *fields; /* field name of bit i, NULL-terminated */
    uint64_t required;         /* bits that must be set */
    /* Where the field of bit i lies, for kvw__mask_copy (NULL: a spec that only checks). */
    const kvw_mask_field_t *layout;
} kvw_mask_spec_t;

/* The bits a spec's table names. */
uint64_t kvw__mask_known(const kvw_mask_spec_t *spec);

/*
 * OK when `mask` has no bit unknown to `spec` and every required bit; else
 * INVALID_PARAM with a message naming `where` (the argument, e.g. "chunk->pages"; NULL:
 * none), the struct, and the unknown bits or the first missing field.
 */
kvw_status_t kvw__mask_check(const kvw_mask_spec_t *spec, uint64_t mask, const char *where);

/*
 * Copies the fields whose bits `mask` sets from `src` to `dst`, two structs of the
 * spec's type (it has a layout); dst's other fields and its field_mask stay as they
 * are. Normalising a caller's struct: dst holds the defaults, mask is the caller's.
 * Filling a caller's query: src holds every answer, mask is what the caller wants.
 */
void kvw__mask_copy(const kvw_mask_spec_t *spec, uint64_t mask, const void *src, void *dst);

/* A query's checks (kvw_plan_stats, kvw_room_metrics): a handle, and an output struct
 * whose field_mask (the first member of every public struct) names the fields wanted,
 * with no bit unknown to `spec`. INVALID_PARAM, naming `fn`. */
kvw_status_t kvw__mask_query_check(const kvw_mask_spec_t *spec, const void *handle,
                                   const void *out, const char *fn);

/* The specs of the public structs. */
extern const kvw_mask_spec_t kvw__spec_layer, kvw__spec_model, kvw__spec_parallel,
    kvw__spec_state_group, kvw__spec_buffer, kvw__spec_rank_params, kvw__spec_pages,
    kvw__spec_side_pages, kvw__spec_chunk, kvw__spec_plan_stats, kvw__spec_send_chunk,
    kvw__spec_recv_post, kvw__spec_room_metrics, kvw__spec_ctx_params,
    kvw__spec_bootstrap_params;

/* Checks a kvw_pages_t / kvw_side_pages_t from the caller and writes the copy with
 * every default filled in and every bit set to *out. */
kvw_status_t kvw__pages_norm(const kvw_pages_t *in, const char *where, kvw_pages_t *out);
kvw_status_t kvw__side_pages_norm(const kvw_side_pages_t *in, const char *where,
                                  kvw_side_pages_t *out);
kvw_status_t kvw__chunk_norm(const kvw_chunk_t *in, const char *where, kvw_chunk_t *out);

/* The same for kvw_send_chunk_t and kvw_recv_post_t (xfer.h). */
struct kvw_send_chunk;
struct kvw_recv_post;
kvw_status_t kvw__send_chunk_norm(const struct kvw_send_chunk *in, const char *where,
                                  struct kvw_send_chunk *out);
kvw_status_t kvw__recv_post_norm(const struct kvw_recv_post *in, const char *where,
                                 struct kvw_recv_post *out);

#endif
