/*
 * The addressing core of the CUDA copy kernels, written once in C for the device and
 * the host: the kernels in copy.cu run it on the GPU, and tests/gpu/test_cuda_emu.c runs
 * the very same functions on the CPU against kvw_plan_exec_cpu, so that CI without a
 * GPU still checks every index computation the kernels make.
 *
 * Work decomposition. Each segment's bytes are numbered in token-major order (token,
 * then head, then byte); that numbering is cut into jobs of at most KVWC_JOB_BYTES
 * bytes and at most KVWC_MAX_TOK tokens, and a table gives each job its segment, so the
 * number of segments, pages or runs never changes the launch: one launch per plan,
 * blocks proportional to bytes. Every thread moves W-byte units, W the widest power of
 * two up to 16 that every address of the segment is aligned to. In a gather or scatter
 * the block first computes each token's base address on both sides (one page-table
 * lookup per token and side, kept in shared memory; blocks are small, one warp by
 * default, so that many jobs per multiprocessor overlap their lookups with each other's
 * copies). A direct copy has no table: each thread looks up its own units' pages
 * (kvwc_direct_addrs), or, when a job lies inside one page per side, one address per
 * side and a fixed step (kvwc_direct_affine).
 */
#ifndef KVW_CUDA_COPY_CORE_H
#define KVW_CUDA_COPY_CORE_H

#include "cuda/module.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __CUDACC__
#define KVWC_HD __host__ __device__ __forceinline__
#else
#define KVWC_HD static inline
#endif

/*
 * Tunables (overridable with -D for experiments; the defaults are what
 * bench/gpu/NOTES.md measured best). A job is one block's unit of work.
 */
#ifndef KVWC_JOB_BYTES
#define KVWC_JOB_BYTES 16384u
#endif
#ifndef KVWC_MAX_TOK
#define KVWC_MAX_TOK 256u
#endif
#define KVWC_TOK_CAP (KVWC_MAX_TOK + 2u) /* a byte range may straddle two extra tokens */
#ifndef KVWC_THREADS
#define KVWC_THREADS 32
#endif
#ifndef KVWC_UNROLL
#define KVWC_UNROLL 4 /* loads in flight per thread */
#endif
/* The direct kernel (no token table): threads per block, loads in flight per thread on
 * its fast path (one pass of 128 x 8 units of 16 bytes is a job of KVWC_JOB_BYTES)
 * and on its slow path, and resident blocks per multiprocessor the compiler must allow
 * (8 caps it at 64 registers, which the fast path fits without spilling). KVWC_DIRECT_FLAT
 * 0 runs direct copies on the table kernel instead, for comparison. */
#ifndef KVWC_DIRECT_FLAT
#define KVWC_DIRECT_FLAT 1
#endif
#ifndef KVWC_DIRECT_THREADS
#define KVWC_DIRECT_THREADS 128
#endif
#ifndef KVWC_DIRECT_UNROLL
#define KVWC_DIRECT_UNROLL 8 /* fast path (kvwc_direct_affine) */
#endif
#ifndef KVWC_DIRECT_UNROLL_SLOW
#define KVWC_DIRECT_UNROLL_SLOW 4 /* every unit resolved */
#endif
#ifndef KVWC_DIRECT_MIN_BLOCKS
#define KVWC_DIRECT_MIN_BLOCKS 8
#endif
/* Resident blocks per multiprocessor the compiler must allow (caps registers). */
#ifndef KVWC_MIN_BLOCKS
#define KVWC_MIN_BLOCKS 16
#endif
/* Cache hints: loads 0 plain, 1 streaming (ld.cs), 2 read-only path (ld.global.nc);
 * stores 0 plain, 1 streaming (st.cs). */
#ifndef KVWC_LOAD_HINT
#define KVWC_LOAD_HINT 0
#endif
#ifndef KVWC_STORE_HINT
#define KVWC_STORE_HINT 0
#endif
/* Blocks per multiprocessor of a grid that loops over jobs; 0: one block per job. */
#ifndef KVWC_BLOCKS_PER_SM
#define KVWC_BLOCKS_PER_SM 0
#endif

enum { KVWC_MODE_DIRECT = 0, KVWC_MODE_GATHER = 1, KVWC_MODE_SCATTER = 2, KVWC_NUM_MODES = 3 };

typedef struct kvwc_dside {
    uint64_t base;
    uint64_t page_stride, token_stride, head_stride;
    uint64_t first_token;
    const uint32_t *pages; /* device pointer (host pointer in the emulator) */
    uint32_t page_size;
    uint32_t contig; /* head_stride == head_bytes: a token's heads are one run */
} kvwc_dside_t;

typedef struct kvwc_dseg {
    kvwc_dside_t src, dst;
    uint64_t tok_begin, tok_end;
    uint64_t row_bytes;  /* num_heads * head_bytes */
    uint64_t bytes;      /* (tok_end - tok_begin) * row_bytes */
    uint64_t stage_off;  /* where this segment starts in a staging buffer */
    uint64_t job_begin;  /* index of its first job */
    uint64_t job_bytes;  /* bytes per job (the last job may be shorter) */
    uint32_t head_bytes;
    uint32_t w[KVWC_NUM_MODES]; /* unit width per mode */
} kvwc_dseg_t;

/* Per-token bases of one job, in shared memory on the device. */
typedef struct kvwc_tokens {
    uint64_t src[KVWC_TOK_CAP];
    uint64_t dst[KVWC_TOK_CAP];
    uint64_t stage[KVWC_TOK_CAP];    /* offset inside the staging buffer */
    uint64_t stage_hs[KVWC_TOK_CAP]; /* staging distance between heads of this token */
} kvwc_tokens_t;

/* Which sides a mode reads page tables of. */
#define KVWC_MODE_SRC(mode) ((mode) != KVWC_MODE_SCATTER)
#define KVWC_MODE_DST(mode) ((mode) != KVWC_MODE_GATHER)

/* Byte range [*b0, *b1) of the segment that job `job` covers. */
KVWC_HD void kvwc_job_range(const kvwc_dseg_t *s, uint64_t job, uint64_t *b0, uint64_t *b1)
{
    uint64_t b = (job - s->job_begin) * s->job_bytes;
    uint64_t e = b + s->job_bytes;
    *b0 = b;
    *b1 = e < s->bytes ? e : s->bytes;
}

/* Address (relative to page-aligned origin) of token t's first copied head on a side,
 * and the token's index inside its page. */
KVWC_HD uint64_t kvwc_side_token(const kvwc_dside_t *d, uint64_t t, uint64_t *in_page_p)
{
    /* 32-bit arithmetic: the layout rejects maps spanning 2^32 tokens. */
    uint32_t rel = (uint32_t)(t - d->first_token);
    uint32_t idx = rel / d->page_size;
    uint32_t in = rel - idx * d->page_size;
    *in_page_p = in;
    return d->base + (uint64_t)d->pages[idx] * d->page_stride + (uint64_t)in * d->token_stride;
}

/*
 * Staging order. A staging buffer holds a plan's bytes in the order kvw_plan_expand
 * emits them (src/plan/walk.c): each segment is cut into runs of tokens that stay inside
 * one page on both sides, and each run of L tokens is copied either token by token
 * (order A: tokens outer, heads inner) or head by head (order B), whichever gives longer
 * contiguous chunks. This mirrors that choice (kvw__box_make) exactly; the CPU
 * emulation test compares the two on every layout, so a change there fails CI instead
 * of silently shuffling staged bytes.
 */
KVWC_HD int kvwc_run_head_major(const kvwc_dseg_t *s, uint64_t L)
{
    uint64_t hb = s->head_bytes, n = s->row_bytes / s->head_bytes;
    uint64_t ts_s = s->src.token_stride, ts_d = s->dst.token_stride;
    uint64_t hs_s = s->src.head_stride, hs_d = s->dst.head_stride;
    /* A: L tokens outer, n heads inner. */
    int inner_a = n == 1 || (hs_s == hb && hs_d == hb);
    int whole_a = inner_a && (L == 1 || (ts_s == n * hb && ts_d == n * hb));
    uint64_t chunk_a = whole_a ? L * n * hb : inner_a ? n * hb : hb;
    /* B: n heads outer, L tokens inner. */
    int inner_b = L == 1 || (ts_s == hb && ts_d == hb);
    int whole_b = inner_b && (n == 1 || (hs_s == L * hb && hs_d == L * hb));
    uint64_t chunk_b = whole_b ? n * L * hb : inner_b ? L * hb : hb;
    return chunk_b > chunk_a || (whole_b && !whole_a);
}

/* Fills slot i of the token table for absolute token t. */
KVWC_HD void kvwc_token_bases(const kvwc_dseg_t *s, int mode, uint64_t t, kvwc_tokens_t *tt,
                              uint32_t i)
{
    uint64_t in_s = 0, in_d = 0;
    if (KVWC_MODE_SRC(mode))
        tt->src[i] = kvwc_side_token(&s->src, t, &in_s);
    else
        in_s = (uint32_t)(t - s->src.first_token) % s->src.page_size;
    if (KVWC_MODE_DST(mode))
        tt->dst[i] = kvwc_side_token(&s->dst, t, &in_d);
    else
        in_d = (uint32_t)(t - s->dst.first_token) % s->dst.page_size;
    if (mode == KVWC_MODE_DIRECT)
        return;
    /* The run of kvw_plan_expand holding t: tokens inside one page on both sides. */
    uint64_t ps = t - in_s, pd = t - in_d;
    uint64_t bs = ps > pd ? ps : pd;
    uint64_t be_s = ps + s->src.page_size, be_d = pd + s->dst.page_size;
    uint64_t be = be_s < be_d ? be_s : be_d;
    if (bs < s->tok_begin)
        bs = s->tok_begin;
    if (be > s->tok_end)
        be = s->tok_end;
    if (kvwc_run_head_major(s, be - bs)) {
        tt->stage[i] = s->stage_off + (bs - s->tok_begin) * s->row_bytes + (t - bs) * s->head_bytes;
        tt->stage_hs[i] = (be - bs) * s->head_bytes;
    } else {
        tt->stage[i] = s->stage_off + (t - s->tok_begin) * s->row_bytes;
        tt->stage_hs[i] = s->head_bytes;
    }
}

/* Geometry of one job, shared by all its units; small enough to live in registers
 * while the units move. */
typedef struct kvwc_jobgeo {
    uint64_t t0;        /* first token, relative to tok_begin */
    uint64_t src_hs, dst_hs; /* head strides */
    uint32_t ntok;      /* tokens in the table */
    uint32_t ub, ue;    /* units [ub, ue), counted from the start of token t0 */
    uint32_t row_units; /* units per token */
    uint32_t head_units;
    uint32_t src_contig, dst_contig;
} kvwc_jobgeo_t;

KVWC_HD void kvwc_job_geo(const kvwc_dseg_t *s, uint64_t b0, uint64_t b1, uint32_t w,
                          kvwc_jobgeo_t *g)
{
    uint64_t row = s->row_bytes;
    g->t0 = b0 / row;
    g->ntok = (uint32_t)((b1 - 1) / row - g->t0 + 1);
    g->ub = (uint32_t)((b0 - g->t0 * row) / w);
    g->ue = (uint32_t)((b1 - g->t0 * row) / w);
    g->row_units = (uint32_t)(row / w);
    g->head_units = s->head_bytes / w;
    g->src_hs = s->src.head_stride;
    g->dst_hs = s->dst.head_stride;
    g->src_contig = s->src.contig;
    g->dst_contig = s->dst.contig;
}

/* Source and destination byte addresses of unit u of a job (the staging buffer is
 * `stage` in the modes that use one). */
KVWC_HD void kvwc_unit_addrs(int mode, uint32_t w, const kvwc_jobgeo_t *g,
                             const kvwc_tokens_t *tt, uint32_t u, uint64_t stage,
                             uint64_t *src_p, uint64_t *dst_p)
{
    uint32_t tl = u / g->row_units;
    uint32_t c = u - tl * g->row_units;
    uint32_t h = c / g->head_units;
    uint32_t cc = c - h * g->head_units;
    uint64_t lin = (uint64_t)c * w, in_head = (uint64_t)cc * w;
    uint64_t src, dst;
    if (mode == KVWC_MODE_SCATTER)
        src = stage + tt->stage[tl] + h * tt->stage_hs[tl] + in_head;
    else
        src = tt->src[tl] + (g->src_contig ? lin : h * g->src_hs + in_head);
    if (mode == KVWC_MODE_GATHER)
        dst = stage + tt->stage[tl] + h * tt->stage_hs[tl] + in_head;
    else
        dst = tt->dst[tl] + (g->dst_contig ? lin : h * g->dst_hs + in_head);
    *src_p = src;
    *dst_p = dst;
}

/*
 * Direct mode without a token table: the source and destination addresses of unit u of
 * a job, each computed from the segment alone. The gather and scatter keep the table
 * (their staging offsets need a token's run); a direct copy needs only the two page
 * lookups, which neighbouring units share through L1, so no barrier stands between a
 * job's first instructions and its data loads (bench/gpu/NOTES.md, "The direct kernel
 * without a token table").
 */
KVWC_HD void kvwc_direct_addrs(const kvwc_dseg_t *s, uint32_t w, const kvwc_jobgeo_t *g,
                               uint32_t u, uint64_t *src_p, uint64_t *dst_p)
{
    uint32_t tl = u / g->row_units;
    uint32_t c = u - tl * g->row_units;
    uint64_t t = s->tok_begin + g->t0 + tl, in;
    uint64_t src = kvwc_side_token(&s->src, t, &in);
    uint64_t dst = kvwc_side_token(&s->dst, t, &in);
    uint64_t lin = (uint64_t)c * w;
    if (g->src_contig && g->dst_contig) {
        src += lin;
        dst += lin;
    } else {
        uint32_t h = c / g->head_units;
        uint64_t in_head = (uint64_t)(c - h * g->head_units) * w;
        src += g->src_contig ? lin : h * g->src_hs + in_head;
        dst += g->dst_contig ? lin : h * g->dst_hs + in_head;
    }
    *src_p = src;
    *dst_p = dst;
}

/*
 * The direct kernel's fast path. When the job's tokens lie inside one page on each side
 * and a block's stride of `stride` units is a whole number of tokens (row_units divides
 * it), unit u + k * stride lies k fixed steps (*step_s, *step_d bytes) past unit u on
 * each side: a thread then resolves one address per side and issues its loads from a
 * base and an offset, which keeps its registers few and its blocks many (bytes in
 * flight are what a copy over scattered pages runs on: bench/gpu/NOTES.md, "Bytes in
 * flight"). False when that does not hold; the kernel then resolves every unit.
 */
KVWC_HD int kvwc_direct_affine(const kvwc_dseg_t *s, const kvwc_jobgeo_t *g, uint32_t stride,
                               uint64_t *step_s, uint64_t *step_d)
{
    if (g->row_units == 0 || stride % g->row_units)
        return 0;
    uint64_t t = s->tok_begin + g->t0;
    uint32_t in_s = (uint32_t)(t - s->src.first_token) % s->src.page_size;
    uint32_t in_d = (uint32_t)(t - s->dst.first_token) % s->dst.page_size;
    if (in_s + g->ntok > s->src.page_size || in_d + g->ntok > s->dst.page_size)
        return 0;
    uint64_t dt = stride / g->row_units;
    *step_s = dt * s->src.token_stride;
    *step_d = dt * s->dst.token_stride;
    return 1;
}

/* Whether kvwc_direct_kernel takes its fast path for a job of unit width w: 16-byte
 * units, whole passes of KVWC_DIRECT_THREADS x KVWC_DIRECT_UNROLL units, and
 * kvwc_direct_affine (its steps in *step_s, *step_d). */
KVWC_HD int kvwc_direct_fast(const kvwc_dseg_t *s, const kvwc_jobgeo_t *g, uint32_t w,
                             uint64_t *step_s, uint64_t *step_d)
{
    return w == 16 && (g->ue - g->ub) % (KVWC_DIRECT_THREADS * KVWC_DIRECT_UNROLL) == 0 &&
           kvwc_direct_affine(s, g, KVWC_DIRECT_THREADS, step_s, step_d);
}

/*
 * A staged window: a gather or scatter may move only the part [lo, hi) of the plan's
 * staging stream (the prefill gathers, and the decode scatters, one window of a chunk at
 * a time). The kernel is passed stage = buffer - lo, so a unit's stream offset is its
 * staging address minus `stage`, and a unit moves only when that offset lies in the
 * window. Units never straddle an edge: the unit width is capped by wcap, the alignment
 * of both edges (unit offsets are multiples of their width). A whole-plan launch is the
 * window [0, KVWC_WINDOW_ALL) with wcap 16.
 */
#define KVWC_WINDOW_ALL (~0ull)

KVWC_HD int kvwc_unit_in_window(int mode, uint64_t src, uint64_t dst, uint64_t stage,
                                uint64_t lo, uint64_t hi)
{
    if (mode == KVWC_MODE_DIRECT)
        return 1;
    uint64_t off = (mode == KVWC_MODE_GATHER ? dst : src) - stage;
    return off >= lo && off < hi;
}

KVWC_HD uint32_t kvwc_unit_width(uint32_t seg_w, uint32_t wcap)
{
    return seg_w < wcap ? seg_w : wcap;
}

/* Job `job` of a device plan: its segment, its unit width in `mode` (*w_p) and its
 * geometry (*g). */
KVWC_HD const kvwc_dseg_t *kvwc_job_at(const kvwc_dseg_t *segs, const uint32_t *job_seg,
                                       uint64_t job, int mode, uint32_t wcap, uint32_t *w_p,
                                       kvwc_jobgeo_t *g)
{
    const kvwc_dseg_t *s = &segs[job_seg[job]];
    uint64_t b0, b1;
    kvwc_job_range(s, job, &b0, &b1);
    *w_p = kvwc_unit_width(s->w[mode], wcap);
    kvwc_job_geo(s, b0, b1, *w_p, g);
    return s;
}

/*
 * The CPU twin of one launch: moves every byte of jobs [j0, j1) of a laid-out plan with
 * exactly the address computations (and window test) the kernel uses. For tests
 * without a GPU, and for the CPU module that stands in for a GPU in CI.
 */
static inline void kvwc_emulate(const kvwc_dseg_t *segs, const uint32_t *job_seg, uint64_t j0,
                                uint64_t j1, int mode, uint64_t stage, uint64_t lo, uint64_t hi,
                                uint32_t wcap, kvwc_tokens_t *tt)
{
    for (uint64_t job = j0; job < j1; job++) {
        uint32_t w;
        kvwc_jobgeo_t g;
        const kvwc_dseg_t *s = kvwc_job_at(segs, job_seg, job, mode, wcap, &w, &g);
        if (mode == KVWC_MODE_DIRECT) {
            /* As the kernel: the fast path's base-and-step addresses where it applies
             * (checked against the per-unit ones), every unit resolved otherwise. */
            uint64_t ss = 0, sd = 0;
            int affine = kvwc_direct_fast(s, &g, w, &ss, &sd);
            for (uint32_t u = g.ub; u < g.ue; u++) {
                uint64_t src, dst;
                kvwc_direct_addrs(s, w, &g, u, &src, &dst);
                if (affine) {
                    uint32_t k = (u - g.ub) / KVWC_DIRECT_THREADS;
                    uint64_t s0, d0;
                    kvwc_direct_addrs(s, w, &g, u - k * KVWC_DIRECT_THREADS, &s0, &d0);
                    if (s0 + k * ss != src || d0 + k * sd != dst)
                        abort(); /* the fast path would move this unit elsewhere */
                    src = s0 + k * ss;
                    dst = d0 + k * sd;
                }
                memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, w);
            }
            continue;
        }
        for (uint32_t i = 0; i < g.ntok; i++)
            kvwc_token_bases(s, mode, s->tok_begin + g.t0 + i, tt, i);
        for (uint32_t u = g.ub; u < g.ue; u++) {
            uint64_t src, dst;
            kvwc_unit_addrs(mode, w, &g, tt, u, stage, &src, &dst);
            if (kvwc_unit_in_window(mode, src, dst, stage, lo, hi))
                memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, w);
        }
    }
}

/* ---------------------------------------------------------------- host-side layout */

/* Largest power of two up to 16 dividing x (16 for x == 0). */
static inline uint32_t kvwc_align_of(uint64_t x)
{
    uint64_t low = x & (~x + 1);
    return (x == 0 || low >= 16) ? 16u : (uint32_t)low;
}

static inline uint64_t kvwc_side_bits(const kvwc_side_t *s, uint32_t num_heads)
{
    return s->base | s->page_stride | s->token_stride | (num_heads > 1 ? s->head_stride : 0);
}

/*
 * A device plan is one allocation: the laid-out segments, then a table giving each job
 * its segment (one load instead of a search on the kernel's critical path), then every
 * page list. kvwc_blob_layout sizes it (dropping empty segments) and validates what the
 * kernels assume; kvwc_blob_fill writes a host image whose pointers are valid once the
 * image is copied to `dev_base` (the emulator passes the image itself). Returns 0, or -1
 * with a reason in err for a plan the kernels cannot run.
 */
typedef struct kvwc_layout {
    uint64_t jobs_off, pages_off, size;
    uint32_t num_segs;
    uint64_t num_jobs;
} kvwc_layout_t;

static inline uint64_t kvwc_seg_job_bytes(uint64_t row_bytes)
{
    return row_bytes * KVWC_MAX_TOK < KVWC_JOB_BYTES ? row_bytes * KVWC_MAX_TOK : KVWC_JOB_BYTES;
}

/* A segment's bytes and jobs; 0 for an empty segment (no tokens or heads), which the
 * layout drops. */
static inline int kvwc_seg_size(const kvwc_seg_in_t *g, uint64_t *bytes_p, uint64_t *jobs_p)
{
    if (g->tok_end <= g->tok_begin || g->num_heads == 0)
        return 0;
    uint64_t row = (uint64_t)g->num_heads * g->head_bytes;
    uint64_t jb = kvwc_seg_job_bytes(row);
    *bytes_p = (g->tok_end - g->tok_begin) * row;
    *jobs_p = jb ? (*bytes_p + jb - 1) / jb : 0; /* zero head bytes: refused by the layout */
    return 1;
}

static inline int kvwc_blob_layout(const kvwc_plan_in_t *in, kvwc_layout_t *L, const char **err)
{
    if (in->num_maps > KVWC_MAX_MAPS) {
        *err = "too many page maps";
        return -1;
    }
    uint32_t n = 0;
    uint64_t jobs = 0;
    for (uint32_t i = 0; i < in->num_segs; i++) {
        const kvwc_seg_in_t *g = &in->segs[i];
        uint64_t bytes, nj;
        if (!kvwc_seg_size(g, &bytes, &nj))
            continue;
        if (g->head_bytes == 0 || g->src.page_size == 0 || g->dst.page_size == 0 ||
            g->src.map >= in->num_maps || g->dst.map >= in->num_maps) {
            *err = "malformed segment (zero head bytes or page size, or bad page map)";
            return -1;
        }
        uint64_t row = (uint64_t)g->num_heads * g->head_bytes;
        if (row >= (1ull << 31)) {
            *err = "a token row of 2 GiB or more";
            return -1;
        }
        if (g->tok_end - g->src.first_token >= (1ull << 32) ||
            g->tok_end - g->dst.first_token >= (1ull << 32) || g->tok_begin < g->src.first_token ||
            g->tok_begin < g->dst.first_token) {
            *err = "a page map spanning 2^32 tokens or more, or not covering its segment";
            return -1;
        }
        jobs += nj;
        n++;
    }
    L->num_segs = n;
    L->num_jobs = jobs;
    L->jobs_off = (uint64_t)n * sizeof(kvwc_dseg_t);
    L->pages_off = L->jobs_off + jobs * sizeof(uint32_t);
    L->size = L->pages_off;
    for (uint32_t m = 0; m < in->num_maps; m++)
        L->size += (uint64_t)in->maps[m].num_pages * sizeof(uint32_t);
    return 0;
}

static inline void kvwc_blob_fill(const kvwc_plan_in_t *in, const kvwc_layout_t *L, void *blob,
                                  uint64_t dev_base)
{
    kvwc_dseg_t *out = (kvwc_dseg_t *)blob;
    uint32_t *job_seg = (uint32_t *)((uint8_t *)blob + L->jobs_off);
    uint64_t pages_off = L->pages_off;
    uint64_t map_dev[KVWC_MAX_MAPS];
    for (uint32_t m = 0; m < in->num_maps; m++) {
        map_dev[m] = dev_base + pages_off;
        if (in->maps[m].num_pages)
            memcpy((uint8_t *)blob + pages_off, in->maps[m].pages,
                   (size_t)in->maps[m].num_pages * sizeof(uint32_t));
        pages_off += (uint64_t)in->maps[m].num_pages * sizeof(uint32_t);
    }
    uint32_t n = 0;
    uint64_t jobs = 0, stage = 0;
    for (uint32_t i = 0; i < in->num_segs; i++) {
        const kvwc_seg_in_t *g = &in->segs[i];
        uint64_t bytes, nj;
        if (!kvwc_seg_size(g, &bytes, &nj))
            continue;
        kvwc_dseg_t *d = &out[n];
        memset(d, 0, sizeof(*d));
        const kvwc_side_t *sides[2] = {&g->src, &g->dst};
        kvwc_dside_t *dsides[2] = {&d->src, &d->dst};
        for (int k = 0; k < 2; k++) {
            dsides[k]->base = sides[k]->base;
            dsides[k]->page_stride = sides[k]->page_stride;
            dsides[k]->token_stride = sides[k]->token_stride;
            dsides[k]->head_stride = sides[k]->head_stride;
            dsides[k]->first_token = sides[k]->first_token;
            dsides[k]->pages = (const uint32_t *)(uintptr_t)map_dev[sides[k]->map];
            dsides[k]->page_size = sides[k]->page_size;
            dsides[k]->contig = g->num_heads == 1 || sides[k]->head_stride == g->head_bytes;
        }
        d->tok_begin = g->tok_begin;
        d->tok_end = g->tok_end;
        d->head_bytes = g->head_bytes;
        d->row_bytes = (uint64_t)g->num_heads * g->head_bytes;
        d->bytes = bytes;
        d->stage_off = stage;
        uint64_t hb = g->head_bytes;
        uint64_t sb = kvwc_side_bits(&g->src, g->num_heads) | hb;
        uint64_t db = kvwc_side_bits(&g->dst, g->num_heads) | hb;
        uint64_t tb = stage | hb;
        d->w[KVWC_MODE_DIRECT] = kvwc_align_of(sb | db);
        d->w[KVWC_MODE_GATHER] = kvwc_align_of(sb | tb);
        d->w[KVWC_MODE_SCATTER] = kvwc_align_of(tb | db);
        d->job_bytes = kvwc_seg_job_bytes(d->row_bytes);
        d->job_begin = jobs;
        for (uint64_t j = 0; j < nj; j++)
            job_seg[jobs + j] = n;
        jobs += nj;
        stage += d->bytes;
        n++;
    }
}

/* The window a staged launch moves, as kernel arguments: the jobs of the segments that
 * overlap [lo, hi) (segments lie in stream order, each job inside one segment), the unit
 * width cap and the stage base for a buffer holding only the window. Walks the segments
 * as kvwc_blob_fill lays them out. */
typedef struct kvwc_window {
    uint64_t j0, j1;
    uint64_t lo, hi;
    uint32_t wcap;
} kvwc_window_t;

/* The bounds and the unit width cap of a window [lo, hi); its jobs still unset. */
static inline void kvwc_window_bounds(uint64_t lo, uint64_t hi, kvwc_window_t *w)
{
    w->lo = lo;
    w->hi = hi;
    w->wcap = kvwc_align_of(lo);
    if (hi != KVWC_WINDOW_ALL && kvwc_align_of(hi) < w->wcap)
        w->wcap = kvwc_align_of(hi);
}

/* Steps *i to the next segment the layout keeps (empty ones are dropped) and gives its
 * bytes and jobs, *i then past it; 0 when none is left. */
static inline int kvwc_seg_next(const kvwc_plan_in_t *in, uint32_t *i, uint64_t *bytes_p,
                                uint64_t *jobs_p)
{
    while (*i < in->num_segs)
        if (kvwc_seg_size(&in->segs[(*i)++], bytes_p, jobs_p))
            return 1;
    return 0;
}

static inline void kvwc_window_of(const kvwc_plan_in_t *in, uint64_t lo, uint64_t hi,
                                  kvwc_window_t *w)
{
    kvwc_window_bounds(lo, hi, w);
    w->j0 = w->j1 = 0;
    int first = 1;
    uint64_t jobs = 0, stage = 0, bytes, nj;
    for (uint32_t i = 0; kvwc_seg_next(in, &i, &bytes, &nj);) {
        if (stage < hi && stage + bytes > lo) {
            if (first)
                w->j0 = jobs;
            first = 0;
            w->j1 = jobs + nj;
        }
        jobs += nj;
        stage += bytes;
    }
}

/* Where each laid-out segment starts in the staging stream and in the job numbering,
 * num_segs + 1 entries (the last: the totals), as kvwc_blob_fill lays them out: a plan
 * uploaded once for a chunk's staged windows keeps this on the host, and each window
 * finds its jobs by binary search, with no flattened plan at hand. */
typedef struct kvwc_span {
    uint64_t stage, job;
} kvwc_span_t;

static inline uint32_t kvwc_spans_fill(const kvwc_plan_in_t *in, kvwc_span_t *sp)
{
    uint32_t n = 0;
    uint64_t jobs = 0, stage = 0, bytes, nj;
    for (uint32_t i = 0; kvwc_seg_next(in, &i, &bytes, &nj);) {
        sp[n].stage = stage;
        sp[n].job = jobs;
        n++;
        jobs += nj;
        stage += bytes;
    }
    sp[n].stage = stage;
    sp[n].job = jobs;
    return n;
}

/* The same window as kvwc_window_of, from the spans of n laid-out segments. */
static inline void kvwc_window_at(const kvwc_span_t *sp, uint32_t n, uint64_t lo, uint64_t hi,
                                  kvwc_window_t *w)
{
    kvwc_window_bounds(lo, hi, w);
    /* Segments [a, b) overlap the window: a is the first ending past lo, b the first
     * starting at hi or later (segments are never empty, so starts increase). */
    uint32_t a = 0, e = n;
    while (a < e) {
        uint32_t m = a + (e - a) / 2;
        if (sp[m + 1].stage > lo)
            e = m;
        else
            a = m + 1;
    }
    uint32_t b = a;
    e = n;
    while (b < e) {
        uint32_t m = b + (e - b) / 2;
        if (sp[m].stage >= hi)
            e = m;
        else
            b = m + 1;
    }
    w->j0 = a < b ? sp[a].job : 0;
    w->j1 = a < b ? sp[b].job : 0;
}

#endif
