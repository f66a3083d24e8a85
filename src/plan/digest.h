/*
 * The KV digest (issue 27): a 64-bit value per unit of a decode rank's KV (one unit per
 * (layer, component, KV head) of a paged view; per (layer, state buffer, group, head)
 * of a state view), defined on logical KV and never on pages:
 *
 *     D(unit) = sum over the unit's tokens t, mod 2^64, of
 *               XXH3_64bits_withSeed(row(t), head_bytes, seed(layer, comp, g, t))
 *
 * where row(t) is the head_bytes of that head for token t (contiguous in NHD and HND
 * alike: see plan.h) and g the global KV head (MLA: head 0; state: the group and its
 * global head). The seed mixes layer, component, head and token, so a row moved to
 * another token, head, layer or plane hashes differently; the sum makes the value
 * independent of page size, page order, layout, chunking and TP/PP cut, and lets
 * each chunk, layer group and prefill rank contribute its part.
 *
 * Both sides compute it over the same plan (prefill rank, decode rank, chunk): the
 * prefill over its source pages, the decode over its destination pages; the unit index
 * is the decode rank's (kvw__digest_units), which both sides derive from the decode's
 * rank description. kvw__plan_digest reads host memory with the CPU; the CUDA module
 * computes the same function over GPU memory (src/cuda/digest_core.h, driven by
 * src/exec/cuda_loader.c with kvw__digest_seg and kvw__digest_secret).
 */
#ifndef KVW_PLAN_DIGEST_H
#define KVW_PLAN_DIGEST_H

#include "plan/plan.h"

/* Units of rank `dst` (its digest table's length): per view, its local heads (paged)
 * or its groups' local heads (state). */
uint32_t kvw__digest_units(kvw_rank_h dst);

/* The hash of one row (exposed for the unit test). */
uint64_t kvw__digest_row(const void *row, size_t len, uint64_t seed);
/* The seed of (layer, component code, global head, token): see digest.c. */
uint64_t kvw__digest_seed(uint32_t layer, uint32_t comp, uint32_t head, uint64_t token);

/*
 * Adds the digest of `plan`'s segments (those of the layers `take` marks, one byte per
 * layer from layer_begin; NULL: all) to units[0 .. kvw__digest_units(plan->dst)),
 * reading the source side's rows (dst_side false: plan->src's buffers through the
 * plan's source maps) or the destination's (plan->dst's). Both ranks' buffers must be
 * host memory of this process for the side read. INTERNAL if a segment names no view
 * of the destination (a plan this module does not understand).
 */
kvw_status_t kvw__plan_digest(const struct kvw_plan *plan, bool dst_side, const uint8_t *take,
                              uint32_t layer_begin, uint64_t *units, uint32_t num_units);

/* For an executor that walks the plan itself (the GPU's): segment i's first unit, the
 * seed base of its (layer, component) and the global head of its first head; false if
 * it names no unit of the destination. */
bool kvw__digest_seg(const struct kvw_plan *plan, uint32_t i, uint32_t *unit_p,
                     uint64_t *seed_base_p, uint32_t *head0_p);

/* XXH3's default secret (192 bytes) as 24 little-endian words, from libxxhash. */
#define KVW_DIGEST_SECRET_WORDS 24
void kvw__digest_secret(uint64_t words[KVW_DIGEST_SECRET_WORDS]);

/* Where unit `unit` of `plan`'s destination lies, for a failure's reason: "layer L K
 * head H tokens [b, e)" (the tokens of the plan's segment holding it). */
void kvw__digest_locate(const struct kvw_plan *plan, uint32_t unit, char *buf, size_t cap);

#endif
