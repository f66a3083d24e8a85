/*
 * Cases and helpers shared by the CUDA executor's tests: test_cuda_emu (the kernels'
 * address arithmetic on the CPU, no GPU needed) and kvw_gpu_check (two processes on two
 * GPUs through CUDA IPC). Both build whole source and destination instances with
 * tools/testkit, compute the expected destination with kvw_plan_exec_cpu, and compare
 * their own result with it byte for byte, guards included.
 */
#ifndef KVW_TESTS_GPU_COMMON_H
#define KVW_TESTS_GPU_COMMON_H

#include <kvwire/kvwire.h>

#include "testkit.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gc_side {
    uint32_t tp, pp;
    kvw_layout_t layout;
    uint32_t ps_full, ps_swa;
    int fused;
    int consecutive;      /* pages k, k+1, ... (whole-page runs) instead of random */
    int full_from_prefix; /* the full-pool page list starts at the prefix's page */
} gc_side_t;

typedef struct gc_case {
    const char *name;
    const char *model;
    uint32_t layers;   /* keep the first N layers (0: all) */
    uint32_t kv_heads; /* override the preset's KV heads (0: keep) */
    int mxfp8;
    gc_side_t src, dst;
    uint64_t tokens, prefix;
    uint64_t chunk_begin, chunk_end; /* chunk_end 0: the whole request as its last chunk */
    uint32_t misalign; /* bytes added to every buffer's address (exercises narrow units) */
} gc_case_t;

extern const gc_case_t gc_cases[];
extern const uint32_t gc_num_cases;

/* All ranks of one side (TP x PP), guarded host buffers filled with a per-rank pattern,
 * and random page tables; deterministic in (case, seed), so that two processes that
 * build the same side get the same bytes and pages. */
typedef struct gc_inst {
    uint32_t n;
    kvt_rank_t *r;
    kvt_req_pages_t *pg;
} gc_inst_t;

uint64_t gc_seed(const gc_case_t *c);
int gc_model(const gc_case_t *c, kvt_model_t *m);
kvw_chunk_t gc_chunk(const gc_case_t *c);
int gc_inst_build(gc_inst_t *in, const kvt_model_t *model, const gc_case_t *c, int is_dst,
                  uint64_t seed, char *msg, size_t cap);
void gc_inst_free(gc_inst_t *in);

/* A second handle over a rank's buffer table with other addresses and memory kind. */
kvw_status_t gc_rank_clone(const kvt_rank_t *r, kvw_mem_kind_t kind, int32_t device,
                           uint8_t *const *addrs, kvw_rank_h *h_p);
/* The same without kvw_rank_create's check that each address is the declared kind of
 * memory: for the CPU emulation of the kernels, which declares host memory KVW_MEM_CUDA. */
kvw_status_t gc_rank_clone_unchecked(const kvt_rank_t *r, kvw_mem_kind_t kind, int32_t device,
                                     uint8_t *const *addrs, kvw_rank_h *h_p);

/* Runs every (source, destination) pair's plan with kvw_plan_exec_cpu on copies of the
 * destination: exp[d] = init[d] + everything the plans write. exp must be kvt_copy_make
 * of the destination's initial contents. Also checks against testkit's naive reference
 * (kvt_ref_transfer). Returns 0, or -1 with a message. */
int gc_expected(const kvt_model_t *model, const gc_case_t *c, gc_inst_t *S, gc_inst_t *D,
                kvt_copy_t *exp, uint64_t *bytes_p, char *msg, size_t cap);

/* Packs a plan's source bytes in kvw_plan_expand order (the staging layout) reading
 * the source rank's host buffers. `out` holds the plan's byte count. */
kvw_status_t gc_expand_gather(kvw_plan_h plan, const kvt_rank_t *src, uint8_t *out);

/*
 * Device-arena layout for one side: every buffer of every rank in one allocation, each
 * at a 256-byte boundary plus the case's misalignment, with at least 256 poisoned bytes
 * around each. offs[] (indexed by gc_buf_index) receives the offsets.
 */
uint32_t gc_total_bufs(const gc_inst_t *in);
uint32_t gc_buf_index(const gc_inst_t *in, uint32_t rank, uint32_t buf);
uint64_t gc_arena_layout(const gc_inst_t *in, uint32_t misalign, uint64_t *offs);
/* The poison byte at arena offset i. */
static inline uint8_t gc_poison(uint64_t i)
{
    return (uint8_t)(0x5Au ^ (uint8_t)(i * 29u) ^ (uint8_t)(i >> 8));
}
/* Fills an arena image: poison everywhere, then each buffer's current host contents. */
void gc_arena_image(const gc_inst_t *in, const uint64_t *offs, uint64_t total, uint8_t *img);
/* Checks every poisoned byte of an image. Returns 0, or -1 with a message. */
int gc_arena_check_poison(const gc_inst_t *in, const uint64_t *offs, uint64_t total,
                          const uint8_t *img, char *msg, size_t cap);
/* A kvt_copy_t view of rank `rank`'s buffers inside an image (free with gc_view_free). */
int gc_arena_view(const gc_inst_t *in, uint32_t rank, const uint64_t *offs, uint8_t *img,
                  kvt_copy_t *view);
void gc_view_free(kvt_copy_t *view);

#ifdef __cplusplus
}
#endif

#endif
