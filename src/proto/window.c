/* Staged windows: copying one window of a plan's byte stream between a staging buffer
 * and this rank's own buffers, on the CPU for host memory or on the rank's GPU (GPU
 * memory on a host transport); and which GPU a rank's buffers are on. Calls nothing
 * else of proto. */
#include "cuda/module.h"
#include "plan/walk.h"
#include "proto/proto.h"

#include <kvwire/cuda.h>

#include <string.h>

int kvw__rank_cuda_device(kvw_rank_h rank)
{
    for (uint32_t i = 0; i < kvw_rank_num_buffers(rank); i++)
        if (kvw_rank_buffer(rank, i)->mem_kind == KVW_MEM_CUDA)
            return kvw_rank_buffer(rank, i)->device;
    return -1;
}

/* Copies the part of a plan's byte stream inside [wb, we) between the staging buffer and
 * the ranks' buffers: gather reads the source, scatter writes the destination. Both
 * sides walk the same segments in the same order (kvw__seg_walk never coalesces across
 * chunks), so the stream is defined by the two ranks' geometry alone, never by page
 * indices: the decode side can scatter with its own pages only. */
typedef struct kvw_stage_io {
    const struct kvw_plan *plan;
    uint8_t *buf;
    uint64_t pos, wb, we;
    bool gather;
} kvw_stage_io_t;

static kvw_status_t kvw_stage_emit(void *arg, const kvw_seg_t *seg, uint64_t so, uint64_t doff,
                                   uint64_t len)
{
    kvw_stage_io_t *io = arg;
    uint64_t b = KVW_MAX(io->pos, io->wb), e = KVW_MIN(io->pos + len, io->we);
    if (b < e) {
        if (io->gather) {
            const uint8_t *src = kvw_rank_buffer(io->plan->src, seg->src_buf)->addr;
            memcpy(io->buf + (b - io->wb), src + so + (b - io->pos), e - b);
        } else {
            uint8_t *dst = kvw_rank_buffer(io->plan->dst, seg->dst_buf)->addr;
            memcpy(dst + doff + (b - io->pos), io->buf + (b - io->wb), e - b);
        }
    }
    io->pos += len;
    return io->pos >= io->we ? KVW_INPROGRESS : KVW_OK; /* INPROGRESS: window done */
}

kvw_status_t kvw__stage_copy(const struct kvw_plan *plan, bool gather, uint8_t *buf,
                             uint64_t wb, uint64_t we)
{
    kvw_stage_io_t io = {.plan = plan, .buf = buf, .wb = wb, .we = we, .gather = gather};
    for (uint32_t i = 0; i < plan->num_segs; i++) {
        /* Segments wholly before the window only move the position: a window late in
         * the stream (the last layers of a streamed chunk) does not walk every run
         * before it. */
        uint64_t sb = kvw__seg_bytes(&plan->segs[i]);
        if (io.pos + sb <= wb) {
            io.pos += sb;
            continue;
        }
        kvw_status_t st = kvw__seg_walk(plan, &plan->segs[i], kvw_stage_emit, &io);
        if (st == KVW_INPROGRESS)
            return KVW_OK;
        if (st != KVW_OK)
            return st;
    }
    if (io.pos < we)
        return kvw__error(KVW_ERR_OUT_OF_RANGE, "staged window [%llu, %llu) ends past the plan's "
                          "%llu bytes", (unsigned long long)wb, (unsigned long long)we,
                          (unsigned long long)io.pos);
    return KVW_OK;
}

/* Starts one staged window on this rank's GPU (see kvw__cuda_stage_launch): the gather
 * of the plan's source buffers into `buf`, or the scatter of `buf` into its destination
 * buffers. *slot_p: the executor slot to reap. */
kvw_status_t kvw__stage_gpu_launch(struct kvw_ctx *ctx, const struct kvw_plan *plan,
                                   bool gather, uint8_t *buf, uint64_t wb, uint64_t we,
                                   int *slot_p)
{
    kvw_cuda_profile_t prof = {.steps = 1, .bytes = we - wb, .first_start_ns = kvw__now_ns()};
    *slot_p = -1;
    /* Only the segments the window overlaps go to the device (segments lie in stream
     * order): a window of a long chunk's plan flattens and uploads a few segments, not
     * the whole plan, and its offsets become relative to the first one kept. */
    struct kvw_plan sub = *plan;
    uint64_t pos = 0, base = 0, end = 0;
    uint32_t i0 = plan->num_segs, i1 = 0;
    for (uint32_t i = 0; i < plan->num_segs && pos < we; i++) {
        uint64_t b = kvw__seg_bytes(&plan->segs[i]);
        if (pos + b > wb && b) {
            if (i0 == plan->num_segs)
                i0 = i, base = pos;
            i1 = i + 1, end = pos + b;
        }
        pos += b;
    }
    if (i0 == plan->num_segs)
        return kvw__error(KVW_ERR_OUT_OF_RANGE, "staged window [%llu, %llu) lies past the "
                          "plan's %llu bytes", (unsigned long long)wb, (unsigned long long)we,
                          (unsigned long long)pos);
    sub.segs = &plan->segs[i0];
    sub.num_segs = i1 - i0;
    sub.bytes = end - base;
    kvw_status_t st = kvw_cuda_set_device(ctx->cuda_dev);
    if (st == KVW_OK)
        st = kvw__cuda_stage_launch(&sub, !gather, buf, wb - base, we - base, slot_p, &prof);
    kvw__cuda_profile_add(&prof);
    return st;
}

/* Waits for a staged window started by kvw__stage_gpu_launch (nothing when slot < 0). */
kvw_status_t kvw__stage_gpu_wait(int slot)
{
    if (slot < 0)
        return KVW_OK;
    kvw_cuda_profile_t prof = {0};
    int done = 0;
    kvw_status_t st = kvw__cuda_step_reap(slot, 1, &done, &prof);
    prof.last_done_ns = kvw__now_ns();
    kvw__cuda_profile_add(&prof);
    return st;
}

/* Moves one staged window between `buf` and this rank's own buffers: on the CPU for
 * host memory, on the GPU (waiting for it) for GPU memory on a host transport. */
kvw_status_t kvw__stage_move(struct kvw_ctx *ctx, const struct kvw_plan *plan, bool gather,
                             uint8_t *buf, uint64_t wb, uint64_t we)
{
    if (!ctx->staged_cuda)
        return kvw__stage_copy(plan, gather, buf, wb, we);
    int slot = -1;
    kvw_status_t st = kvw__stage_gpu_launch(ctx, plan, gather, buf, wb, we, &slot);
    kvw_status_t st2 = kvw__stage_gpu_wait(slot);
    return st != KVW_OK ? st : st2;
}
