/*
 * The CUDA executor as the core library sees it: plans and the per-thread executors of
 * include/kvwire/cuda.h and the library's internal kvw__cuda_* calls, on top of the
 * module's operations table (loaded by src/core/cuda_rt.c). It flattens plans for the
 * module: segments with buffer addresses resolved, plus the page lists.
 */
#include "core/config.h"
#include "core/core.h"
#include "core/cuda_rt.h"
#include "cuda/module.h"
#include "plan/digest.h"
#include "plan/plan.h"

#include <kvwire/cuda.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

_Static_assert((unsigned)KVW_CUDA_DIRECT == (unsigned)KVWC_USE_DIRECT &&
                   (unsigned)KVW_CUDA_GATHER == (unsigned)KVWC_USE_GATHER &&
                   (unsigned)KVW_CUDA_SCATTER == (unsigned)KVWC_USE_SCATTER,
               "public and module use flags must agree");

/* ---------------------------------------------------------------- plans */

/* Checks that a segment's buffer on one side can be addressed from the GPU. */
static kvw_status_t kvw_cuda_check_buf(const kvw_buffer_desc_t *b, const char *side, uint32_t i)
{
    if (b->mem_kind != KVW_MEM_CUDA || b->addr == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "the CUDA executor needs %s buffer %u (layer %u) to be KVW_MEM_CUDA "
                          "with a device address (it is %s, address %p)", side, i, b->layer,
                          b->mem_kind == KVW_MEM_CUDA ? "KVW_MEM_CUDA" : "KVW_MEM_HOST", b->addr);
    return KVW_OK;
}

static void kvw_cuda_side(kvwc_side_t *o, const kvw_view_t *v, const kvw_page_map_t *m,
                          const kvw_buffer_desc_t *b, bool addressed, uint32_t head,
                          uint32_t map)
{
    o->base = addressed ? (uint64_t)(uintptr_t)b->addr + v->plane_off + head * v->head_stride : 0;
    o->page_stride = v->page_stride;
    o->token_stride = v->token_stride;
    o->head_stride = v->head_stride;
    o->first_token = m->first_token;
    o->page_size = v->page_size;
    o->map = map;
}

kvw_status_t kvw__cuda_plan_in_make(const struct kvw_plan *plan, unsigned uses,
                                    kvwc_map_in_t *maps, kvwc_plan_in_t *in_p)
{
    bool need_src = uses & (KVWC_USE_DIRECT | KVWC_USE_GATHER);
    bool need_dst = uses & (KVWC_USE_DIRECT | KVWC_USE_SCATTER);
    if (plan == NULL || maps == NULL || in_p == NULL || uses == 0 ||
        (uses & ~(unsigned)(KVWC_USE_DIRECT | KVWC_USE_GATHER | KVWC_USE_SCATTER)))
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "CUDA plan: NULL argument or bad uses mask 0x%x", uses);
    kvwc_seg_in_t *segs = calloc(plan->num_segs ? plan->num_segs : 1, sizeof(*segs));
    if (segs == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory flattening a plan for the GPU");
    for (uint32_t p = 0; p < KVW_NUM_POOLS; p++) {
        maps[p] = (kvwc_map_in_t){plan->src_maps[p].pages, plan->src_maps[p].num_pages};
        maps[KVW_NUM_POOLS + p] =
            (kvwc_map_in_t){plan->dst_maps[p].pages, plan->dst_maps[p].num_pages};
    }
    for (uint32_t i = 0; i < plan->num_segs; i++) {
        const kvw_seg_t *s = &plan->segs[i];
        const kvw_buffer_desc_t *sb = kvw_rank_buffer(plan->src, s->src_buf);
        const kvw_buffer_desc_t *db = kvw_rank_buffer(plan->dst, s->dst_buf);
        kvw_status_t st = KVW_OK;
        if (sb == NULL || db == NULL)
            st = kvw__error(KVW_ERR_INVALID_PARAM, "CUDA plan: segment %u names buffer %u/%u "
                            "that its rank does not have", i, s->src_buf, s->dst_buf);
        if (st == KVW_OK && need_src)
            st = kvw_cuda_check_buf(sb, "source", s->src_buf);
        if (st == KVW_OK && need_dst)
            st = kvw_cuda_check_buf(db, "destination", s->dst_buf);
        if (st != KVW_OK) {
            free(segs);
            return st;
        }
        kvwc_seg_in_t *o = &segs[i];
        kvw_cuda_side(&o->src, &s->src, &plan->src_maps[s->pool], sb, need_src, s->src_head,
                      s->pool);
        kvw_cuda_side(&o->dst, &s->dst, &plan->dst_maps[s->pool], db, need_dst, s->dst_head,
                      KVW_NUM_POOLS + s->pool);
        o->tok_begin = s->tok_begin;
        o->tok_end = s->tok_end;
        o->head_bytes = s->head_bytes;
        o->num_heads = s->num_heads;
    }
    *in_p = (kvwc_plan_in_t){.num_segs = plan->num_segs, .segs = segs,
                             .num_maps = 2 * KVW_NUM_POOLS, .maps = maps,
                             .bytes = plan->bytes, .uses = uses};
    return KVW_OK;
}

void kvw__cuda_plan_in_free(kvwc_plan_in_t *in)
{
    if (in == NULL)
        return;
    free((void *)in->segs);
    in->segs = NULL;
}

kvw_status_t kvw__cuda_plan_in_make_n(const struct kvw_plan *const *plans, uint32_t n,
                                      unsigned uses, kvwc_plan_in_t *in_p)
{
    if (plans == NULL || in_p == NULL || n == 0 || n > KVWC_MAX_MAPS / (2 * KVW_NUM_POOLS))
        return kvw__error(KVW_ERR_INVALID_PARAM, "CUDA plans: NULL argument or %u plans in "
                          "one launch (1 to %u)", n, KVWC_MAX_MAPS / (2 * KVW_NUM_POOLS));
    uint64_t nsegs = 0;
    for (uint32_t k = 0; k < n; k++) {
        if (plans[k] == NULL)
            return kvw__error(KVW_ERR_INVALID_PARAM, "CUDA plans: plan %u is NULL", k);
        nsegs += plans[k]->num_segs;
    }
    if (nsegs > UINT32_MAX)
        return kvw__error(KVW_ERR_INVALID_PARAM, "CUDA plans: %llu segments in one launch",
                          (unsigned long long)nsegs);
    kvwc_map_in_t *maps = calloc(2 * KVW_NUM_POOLS * (size_t)n, sizeof(*maps));
    kvwc_seg_in_t *segs = calloc(nsegs ? nsegs : 1, sizeof(*segs));
    if (maps == NULL || segs == NULL) {
        free(maps);
        free(segs);
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory flattening plans for the GPU");
    }
    uint64_t bytes = 0;
    uint32_t at = 0;
    for (uint32_t k = 0; k < n; k++) {
        /* Each plan's maps after the previous plans', its segments naming them there. */
        kvwc_map_in_t *m = maps + 2 * KVW_NUM_POOLS * (size_t)k;
        kvwc_plan_in_t one;
        kvw_status_t st = kvw__cuda_plan_in_make(plans[k], uses, m, &one);
        if (st != KVW_OK) {
            free(maps);
            free(segs);
            return st;
        }
        for (uint32_t i = 0; i < one.num_segs; i++) {
            segs[at] = one.segs[i];
            segs[at].src.map += 2 * KVW_NUM_POOLS * k;
            segs[at].dst.map += 2 * KVW_NUM_POOLS * k;
            at++;
        }
        bytes += one.bytes;
        kvw__cuda_plan_in_free(&one);
    }
    *in_p = (kvwc_plan_in_t){.num_segs = at, .segs = segs, .num_maps = 2 * KVW_NUM_POOLS * n,
                             .maps = maps, .bytes = bytes, .uses = uses};
    return KVW_OK;
}

void kvw__cuda_plan_in_free_n(kvwc_plan_in_t *in)
{
    if (in == NULL)
        return;
    free((void *)in->maps);
    in->maps = NULL;
    kvw__cuda_plan_in_free(in);
}

struct kvw_cuda_plan {
    const kvwc_ops_t *ops;
    kvwc_plan_h mod;
    uint64_t bytes;
};

kvw_status_t kvw_cuda_plan_upload(kvw_plan_h plan, unsigned uses, kvw_cuda_plan_h *cplan_p)
{
    const kvwc_ops_t *ops = NULL;
    kvw_status_t st = kvw__cuda_get(&ops);
    if (st != KVW_OK)
        return st;
    if (cplan_p == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_cuda_plan_upload: NULL argument");
    kvwc_map_in_t maps[2 * KVW_NUM_POOLS];
    kvwc_plan_in_t in;
    if ((st = kvw__cuda_plan_in_make(plan, uses, maps, &in)) != KVW_OK)
        return st;
    struct kvw_cuda_plan *cp = calloc(1, sizeof(*cp));
    if (cp == NULL) {
        st = kvw__error(KVW_ERR_NO_MEMORY, "out of memory creating a CUDA plan");
        goto out;
    }
    st = kvw__cuda_ret(ops, ops->plan_upload(&in, &cp->mod));
    if (st != KVW_OK) {
        free(cp);
        goto out;
    }
    cp->ops = ops;
    cp->bytes = plan->bytes;
    *cplan_p = cp;
out:
    kvw__cuda_plan_in_free(&in);
    return st;
}

void kvw_cuda_plan_destroy(kvw_cuda_plan_h cplan)
{
    if (cplan == NULL)
        return;
    cplan->ops->plan_free(cplan->mod);
    free(cplan);
}

uint64_t kvw_cuda_plan_bytes(kvw_cuda_plan_h cplan)
{
    return cplan ? cplan->bytes : 0;
}

kvw_status_t kvw_cuda_plan_exec(kvw_cuda_plan_h cplan, void *stream)
{
    if (cplan == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_cuda_plan_exec: NULL plan");
    return kvw__cuda_ret(cplan->ops, cplan->ops->plan_exec(cplan->mod, stream));
}

kvw_status_t kvw_cuda_plan_gather(kvw_cuda_plan_h cplan, void *staging, uint64_t size,
                                  void *stream)
{
    if (cplan == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_cuda_plan_gather: NULL plan");
    return kvw__cuda_ret(cplan->ops, cplan->ops->plan_gather(cplan->mod, staging, size, stream));
}

kvw_status_t kvw_cuda_plan_scatter(kvw_cuda_plan_h cplan, const void *staging, uint64_t size,
                                   void *stream)
{
    if (cplan == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_cuda_plan_scatter: NULL plan");
    return kvw__cuda_ret(cplan->ops, cplan->ops->plan_scatter(cplan->mod, staging, size, stream));
}

kvw_status_t kvw_plan_exec_cuda(kvw_plan_h plan, void *stream)
{
    const kvwc_ops_t *ops = NULL;
    kvw_status_t st = kvw__cuda_get(&ops);
    if (st != KVW_OK)
        return st;
    kvwc_map_in_t maps[2 * KVW_NUM_POOLS];
    kvwc_plan_in_t in;
    if ((st = kvw__cuda_plan_in_make(plan, KVWC_USE_DIRECT, maps, &in)) != KVW_OK)
        return st;
    st = kvw__cuda_ret(ops, ops->plan_exec_once(&in, stream));
    kvw__cuda_plan_in_free(&in);
    return st;
}

/* ---------------------------------------------------------------- per-thread executors */

typedef struct kvw_texec {
    const kvwc_ops_t *ops;
    kvwc_exec_h ex;
    int device;
    uint32_t inflight; /* launched, not reaped */
    void *pinned[2];   /* staged windows' host buffers (kvw__cuda_stage_buf) */
    uint64_t pinned_cap[2];
} kvw_texec_t;

static pthread_key_t kvw_texec_key;
static pthread_once_t kvw_texec_once = PTHREAD_ONCE_INIT;
static int kvw_texec_key_ok;

/* At thread exit: the executor waits for its stream, then releases everything. */
static void kvw_texec_free(void *p)
{
    kvw_texec_t *t = p;
    if (t) {
        t->ops->exec_destroy(t->ex);
        for (int i = 0; i < 2; i++)
            if (t->pinned[i])
                t->ops->free_host(t->pinned[i]);
        free(t);
    }
}

static void kvw_texec_init(void)
{
    kvw_texec_key_ok = pthread_key_create(&kvw_texec_key, kvw_texec_free) == 0;
}

static kvw_status_t kvw_texec_get(const kvwc_ops_t *ops, kvw_texec_t **t_p)
{
    pthread_once(&kvw_texec_once, kvw_texec_init);
    if (!kvw_texec_key_ok)
        return kvw__error(KVW_ERR_INTERNAL, "cannot create the CUDA executors' thread key");
    int dev = -1;
    kvw_status_t st = kvw__cuda_ret(ops, ops->get_device(&dev));
    if (st != KVW_OK)
        return st;
    kvw_texec_t *t = pthread_getspecific(kvw_texec_key);
    if (t && t->device == dev) {
        *t_p = t;
        return KVW_OK;
    }
    if (t && t->inflight)
        return kvw__error(KVW_ERR_INTERNAL, "CUDA executor: device %d is current, but %u steps "
                          "are still in flight on device %d", dev, t->inflight, t->device);
    if (t) {
        /* Another device is current now: executors are tied to theirs. */
        t->ops->exec_destroy(t->ex);
    } else if ((t = calloc(1, sizeof(*t))) == NULL) {
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory creating a CUDA executor");
    }
    t->ops = ops;
    t->device = dev;
    if ((st = kvw__cuda_ret(ops, ops->exec_create(&t->ex))) != KVW_OK) {
        free(t);
        pthread_setspecific(kvw_texec_key, NULL);
        return st;
    }
    pthread_setspecific(kvw_texec_key, t);
    *t_p = t;
    return KVW_OK;
}

kvw_status_t kvw__cuda_warm(int device)
{
    const kvwc_ops_t *ops = NULL;
    kvw_texec_t *t = NULL;
    kvw_status_t st = kvw__cuda_get(&ops);
    if (st == KVW_OK)
        st = kvw__cuda_ret(ops, ops->set_device(device));
    if (st == KVW_OK)
        st = kvw_texec_get(ops, &t);
    return st;
}

static void kvw_prof_add_step(kvw_cuda_profile_t *prof, const kvwc_step_prof_t *sp)
{
    prof->launch_ns += sp->launch_ns;
    prof->wait_ns += sp->wait_ns;
    prof->upload_dev_ns += (uint64_t)(sp->upload_ms * 1e6);
    prof->kernel_dev_ns += (uint64_t)(sp->kernel_ms * 1e6);
}

/* What both kinds of step start with: the module, this thread's executor and the plan
 * flattened for `uses`; *t0_p when preparing began. */
static kvw_status_t kvw_step_prepare(const struct kvw_plan *plan, unsigned uses,
                                     const kvwc_ops_t **ops_p, kvw_texec_t **t_p,
                                     kvwc_map_in_t *maps, kvwc_plan_in_t *in, uint64_t *t0_p)
{
    kvw_status_t st = kvw__cuda_get(ops_p);
    if (st == KVW_OK)
        st = kvw_texec_get(*ops_p, t_p);
    if (st != KVW_OK)
        return st;
    *t0_p = kvw__now_ns();
    return kvw__cuda_plan_in_make(plan, uses, maps, in);
}

/* Records a launched step's figures and in-flight count, and releases the flattening. */
static kvw_status_t kvw_step_launched(kvw_texec_t *t, kvwc_plan_in_t *in, kvw_status_t st,
                                      int slot, const kvwc_step_prof_t *sp,
                                      kvw_cuda_profile_t *prof)
{
    kvw__cuda_plan_in_free(in);
    kvw_prof_add_step(prof, sp);
    if (st == KVW_OK && slot >= 0)
        t->inflight++;
    return st;
}

kvw_status_t kvw__cuda_step_launch(const struct kvw_plan *plan, int *slot_p,
                                   kvw_cuda_profile_t *prof)
{
    const kvwc_ops_t *ops = NULL;
    kvw_texec_t *t = NULL;
    kvwc_map_in_t maps[2 * KVW_NUM_POOLS];
    kvwc_plan_in_t in;
    uint64_t t0 = 0;
    *slot_p = -1;
    kvw_status_t st = kvw_step_prepare(plan, KVWC_USE_DIRECT, &ops, &t, maps, &in, &t0);
    if (st != KVW_OK)
        return st;
    kvwc_step_prof_t sp = {.launch_ns = kvw__now_ns() - t0};
    st = ops->exec_launch(t->ex, &in, slot_p, &sp);
    return kvw_step_launched(t, &in, kvw__cuda_ret(ops, st), *slot_p, &sp, prof);
}

kvw_status_t kvw__cuda_step_launch_n(const struct kvw_plan *const *plans, uint32_t n,
                                     int *slot_p, kvw_cuda_profile_t *prof)
{
    if (n == 1 && plans != NULL)
        return kvw__cuda_step_launch(plans[0], slot_p, prof);
    const kvwc_ops_t *ops = NULL;
    kvw_texec_t *t = NULL;
    kvwc_plan_in_t in;
    *slot_p = -1;
    kvw_status_t st = kvw__cuda_get(&ops);
    if (st == KVW_OK)
        st = kvw_texec_get(ops, &t);
    if (st != KVW_OK)
        return st;
    uint64_t t0 = kvw__now_ns();
    if ((st = kvw__cuda_plan_in_make_n(plans, n, KVWC_USE_DIRECT, &in)) != KVW_OK)
        return st;
    kvwc_step_prof_t sp = {.launch_ns = 0};
    st = kvw__cuda_ret(ops, ops->exec_launch(t->ex, &in, slot_p, &sp));
    sp.launch_ns = kvw__now_ns() - t0;
    free((void *)in.maps);
    in.maps = NULL;
    return kvw_step_launched(t, &in, st, *slot_p, &sp, prof);
}

/* The side of a plan the digest reads: every segment's buffer there must be GPU memory
 * (the device of the first: the calling thread's current device is set to it for the
 * call, and put back after). */
static kvw_status_t kvw_digest_device(const struct kvw_plan *plan, bool dst_side, int *dev_p)
{
    kvw_rank_h side = dst_side ? plan->dst : plan->src;
    *dev_p = -1;
    for (uint32_t i = 0; i < plan->num_segs; i++) {
        const kvw_seg_t *s = &plan->segs[i];
        const kvw_buffer_desc_t *b = kvw_rank_buffer(side, dst_side ? s->dst_buf : s->src_buf);
        if (b == NULL || b->mem_kind != KVW_MEM_CUDA || (*dev_p >= 0 && b->device != *dev_p))
            return kvw__error(KVW_ERR_UNSUPPORTED, "KV verification on the GPU needs all of a "
                              "rank's buffers in the memory of one GPU (layer %u's %s buffer "
                              "is %s)", s->layer, dst_side ? "destination" : "source",
                              b == NULL ? "missing" : b->mem_kind != KVW_MEM_CUDA
                              ? "host memory" : "on another GPU");
        *dev_p = b->device;
    }
    return KVW_OK;
}

/* One plan's digest flattened for the module: its segments with rows to read (those of
 * the layers `take` marks), their digest entries and XXH3's secret. `din` points into
 * `p`, which must stay where it is until the module was called. */
typedef struct kvw_dig_prep {
    kvwc_map_in_t maps[2 * KVW_NUM_POOLS];
    kvwc_plan_in_t in;
    kvwc_dig_seg_t *ds;
    bool made;
} kvw_dig_prep_t;

static void kvw_dig_prep_free(kvw_dig_prep_t *p)
{
    free(p->ds);
    p->ds = NULL;
    if (p->made)
        kvw__cuda_plan_in_free(&p->in);
    p->made = false;
}

static kvw_status_t kvw_dig_prepare(const struct kvw_plan *plan, bool dst_side,
                                    const uint8_t *take, uint32_t layer_begin, uint64_t *units,
                                    uint32_t num_units, int slot, kvw_dig_prep_t *p,
                                    kvwc_digest_in_t *din)
{
    p->ds = NULL;
    p->made = false;
    kvw_status_t st = kvw__cuda_plan_in_make(plan, dst_side ? KVWC_USE_SCATTER : KVWC_USE_GATHER,
                                             p->maps, &p->in);
    if (st != KVW_OK)
        return st;
    p->made = true;
    if ((p->ds = calloc(plan->num_segs ? plan->num_segs : 1, sizeof(*p->ds))) == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory for a digest on the GPU");
    kvwc_seg_in_t *segs = (kvwc_seg_in_t *)p->in.segs;
    uint32_t n = 0;
    for (uint32_t i = 0; i < plan->num_segs; i++) {
        const kvw_seg_t *s = &plan->segs[i];
        if ((take && (s->layer < layer_begin || !take[s->layer - layer_begin])) ||
            s->tok_begin >= s->tok_end || s->num_heads == 0)
            continue;
        if (!kvw__digest_seg(plan, i, &p->ds[n].unit, &p->ds[n].seed_base, &p->ds[n].head0) ||
            p->ds[n].unit + s->num_heads > num_units)
            return kvw__error(KVW_ERR_INTERNAL, "digest: segment %u (layer %u) names no unit "
                              "of the destination", i, s->layer);
        segs[n++] = segs[i];
    }
    p->in.num_segs = n;
    *din = (kvwc_digest_in_t){.plan = &p->in, .dsegs = p->ds, .dst_side = dst_side,
                              .units = units, .num_units = num_units, .slot = slot};
    kvw__digest_secret(din->secret);
    return KVW_OK;
}

/* The executors of digests waited for (kvw__cuda_plan_digest, _n) on threads without
 * one of their own on the device. A prefill worker has its own (made when it starts) and
 * digests on it. A decode rank's read pass, once its room landed, runs on a transport's
 * progress thread or the control thread, which launch no steps: an executor of its own
 * would be made on its first room (9-26 ms on an H200: a stream, events, buffers, the
 * kernels loaded). Those threads share a pool per device instead: each verifying decode
 * context on GPU buffers adds one when it starts (kvw__cuda_digest_warm), so that its
 * rooms' digests run beside other contexts' as on threads of their own; a batch takes a
 * free one, a new one where all are busy (up to KVW_DEXEC_MAX), and holds it for the
 * batch's length, which it waits for anyway. Kept for the process's life. */
#define KVW_DEXEC_DEVICES 64
#define KVW_DEXEC_MAX 16
typedef struct kvw_dexec {
    pthread_mutex_t mu; /* held by the batch running on it */
    kvwc_exec_h ex;
} kvw_dexec_t;
typedef struct kvw_dexec_pool {
    pthread_mutex_t mu; /* guards n and the making of executors */
    uint32_t n;
    kvw_dexec_t ex[KVW_DEXEC_MAX];
} kvw_dexec_pool_t;
static kvw_dexec_pool_t kvw_dexec[KVW_DEXEC_DEVICES];
static pthread_once_t kvw_dexec_once = PTHREAD_ONCE_INIT;

static void kvw_dexec_init(void)
{
    for (int i = 0; i < KVW_DEXEC_DEVICES; i++) {
        pthread_mutex_init(&kvw_dexec[i].mu, NULL);
        for (int k = 0; k < KVW_DEXEC_MAX; k++)
            pthread_mutex_init(&kvw_dexec[i].ex[k].mu, NULL);
    }
}

static kvw_status_t kvw_dexec_pool(int dev, kvw_dexec_pool_t **p_p)
{
    if (dev < 0 || dev >= KVW_DEXEC_DEVICES)
        return kvw__error(KVW_ERR_UNSUPPORTED, "KV verification on the GPU: device %d is "
                          "past the %d devices kvwire's digest executors cover", dev,
                          KVW_DEXEC_DEVICES);
    pthread_once(&kvw_dexec_once, kvw_dexec_init);
    *p_p = &kvw_dexec[dev];
    return KVW_OK;
}

/* Adds an executor to the pool (p->mu held, dev current); with `take`, returned locked. */
static kvw_status_t kvw_dexec_add(const kvwc_ops_t *ops, kvw_dexec_pool_t *p, bool take,
                                  kvw_dexec_t **d_p)
{
    kvw_dexec_t *d = &p->ex[p->n];
    kvw_status_t st = kvw__cuda_ret(ops, ops->exec_create(&d->ex));
    if (st != KVW_OK) {
        d->ex = NULL;
        return st;
    }
    if (take)
        pthread_mutex_lock(&d->mu);
    p->n++;
    *d_p = d;
    return KVW_OK;
}

/* Locks an executor of device `dev`'s pool (dev current): a free one, else a new one,
 * else waits for one. */
static kvw_status_t kvw_dexec_lock(const kvwc_ops_t *ops, int dev, kvw_dexec_t **d_p)
{
    kvw_dexec_pool_t *p = NULL;
    kvw_status_t st = kvw_dexec_pool(dev, &p);
    if (st != KVW_OK)
        return st;
    pthread_mutex_lock(&p->mu);
    uint32_t n = p->n;
    for (uint32_t i = 0; i < n; i++)
        if (pthread_mutex_trylock(&p->ex[i].mu) == 0) {
            pthread_mutex_unlock(&p->mu);
            *d_p = &p->ex[i];
            return KVW_OK;
        }
    if (n < KVW_DEXEC_MAX) {
        st = kvw_dexec_add(ops, p, true, d_p);
        pthread_mutex_unlock(&p->mu);
        return st;
    }
    pthread_mutex_unlock(&p->mu);
    kvw_dexec_t *d = &p->ex[(uint32_t)((uintptr_t)d_p >> 4) % n];
    pthread_mutex_lock(&d->mu);
    *d_p = d;
    return KVW_OK;
}

kvw_status_t kvw__cuda_digest_warm(int device)
{
    const kvwc_ops_t *ops = NULL;
    kvw_dexec_pool_t *p = NULL;
    kvw_dexec_t *d = NULL;
    int prev = -1;
    kvw_status_t st = kvw__cuda_get(&ops);
    if (st == KVW_OK)
        st = kvw_dexec_pool(device, &p);
    if (st == KVW_OK)
        st = kvw__cuda_ret(ops, ops->get_device(&prev));
    if (st == KVW_OK && prev != device)
        st = kvw__cuda_ret(ops, ops->set_device(device));
    if (st == KVW_OK) {
        pthread_mutex_lock(&p->mu);
        if (p->n < KVW_DEXEC_MAX)
            st = kvw_dexec_add(ops, p, false, &d);
        pthread_mutex_unlock(&p->mu);
    }
    if (prev >= 0 && prev != device)
        (void)ops->set_device(prev);
    return st;
}

/* n plans' digests on one side, one batch on the calling thread's executor of their
 * device where it has one, else on one of the device's shared pool (the device made
 * current for the call, then put back), waited for once. */
static kvw_status_t kvw_cuda_digest_batch(const struct kvw_plan *const *plans, uint32_t n,
                                          bool dst_side, const uint8_t *take,
                                          uint32_t layer_begin, uint64_t *const *units,
                                          uint32_t num_units)
{
    const kvwc_ops_t *ops = NULL;
    kvw_dexec_t *d = NULL;
    int dev = -1, prev = -1;
    uint32_t m = 0; /* plans with segments */
    if (n && (plans == NULL || units == NULL))
        return kvw__error(KVW_ERR_INVALID_PARAM, "digest on the GPU: NULL argument");
    for (uint32_t i = 0; i < n; i++) {
        int d = -1;
        kvw_status_t st = kvw_digest_device(plans[i], dst_side, &d);
        if (st != KVW_OK)
            return st;
        if (d >= 0 && dev >= 0 && d != dev)
            return kvw__error(KVW_ERR_UNSUPPORTED, "KV verification on the GPU: one batch of "
                              "digests reads one GPU, but plan %u's %s buffers are on GPU %d "
                              "and an earlier plan's on GPU %d", i,
                              dst_side ? "destination" : "source", d, dev);
        if (d >= 0) {
            dev = d;
            m++;
        }
    }
    if (dev < 0)
        return KVW_OK; /* no segments: nothing to add */
    kvw_status_t st = kvw__cuda_get(&ops);
    if (st == KVW_OK)
        st = kvw__cuda_ret(ops, ops->get_device(&prev));
    if (st == KVW_OK)
        st = kvw__cuda_ret(ops, ops->set_device(dev));
    if (st != KVW_OK)
        return st;
    kvw_dig_prep_t one_p, *prep = m == 1 ? &one_p : calloc(m, sizeof(*prep));
    kvwc_digest_in_t one_d, *din = m == 1 ? &one_d : calloc(m, sizeof(*din));
    uint32_t made = 0;
    if (prep == NULL || din == NULL)
        st = kvw__error(KVW_ERR_NO_MEMORY, "out of memory for %u digests on the GPU", n);
    for (uint32_t i = 0; st == KVW_OK && i < n; i++) {
        if (plans[i]->num_segs == 0)
            continue;
        st = kvw_dig_prepare(plans[i], dst_side, take, layer_begin, units[i], num_units, -1,
                             &prep[made], &din[made]);
        made++;
    }
    pthread_once(&kvw_texec_once, kvw_texec_init);
    kvw_texec_t *t = kvw_texec_key_ok ? pthread_getspecific(kvw_texec_key) : NULL;
    if (st == KVW_OK && t && t->device == dev) {
        st = kvw__cuda_ret(ops, ops->exec_digest(t->ex, din, made));
    } else if (st == KVW_OK && (st = kvw_dexec_lock(ops, dev, &d)) == KVW_OK) {
        st = kvw__cuda_ret(ops, ops->exec_digest(d->ex, din, made));
        pthread_mutex_unlock(&d->mu);
    }
    for (uint32_t i = 0; prep && i < made; i++)
        kvw_dig_prep_free(&prep[i]);
    if (prep != &one_p)
        free(prep);
    if (din != &one_d)
        free(din);
    if (prev >= 0 && prev != dev)
        (void)ops->set_device(prev);
    return st;
}

kvw_status_t kvw__cuda_plan_digest(const struct kvw_plan *plan, bool dst_side, const uint8_t *take,
                                   uint32_t layer_begin, uint64_t *units, uint32_t num_units)
{
    return kvw_cuda_digest_batch(&plan, 1, dst_side, take, layer_begin, &units, num_units);
}

kvw_status_t kvw__cuda_plan_digest_n(const struct kvw_plan *const *plans, uint32_t n,
                                     bool dst_side, uint64_t *const *units, uint32_t num_units)
{
    return kvw_cuda_digest_batch(plans, n, dst_side, NULL, 0, units, num_units);
}

kvw_status_t kvw__cuda_step_digest(const struct kvw_plan *plan, int slot, uint64_t *units,
                                   uint32_t num_units)
{
    pthread_once(&kvw_texec_once, kvw_texec_init);
    kvw_texec_t *t = kvw_texec_key_ok ? pthread_getspecific(kvw_texec_key) : NULL;
    if (t == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "CUDA executor: a step digest on slot %d, but "
                          "no step was launched on this thread", slot);
    int dev = -1, prev = -1;
    kvw_status_t st = kvw_digest_device(plan, false, &dev);
    if (st != KVW_OK || dev < 0)
        return st; /* no segments: nothing to add */
    if (dev != t->device)
        return kvw__error(KVW_ERR_UNSUPPORTED, "KV verification on the GPU: the step's source "
                          "buffers are on GPU %d, this thread's executor on GPU %d", dev,
                          t->device);
    const kvwc_ops_t *ops = t->ops;
    if ((st = kvw__cuda_ret(ops, ops->get_device(&prev))) != KVW_OK)
        return st;
    if (prev != dev && (st = kvw__cuda_ret(ops, ops->set_device(dev))) != KVW_OK)
        return st;
    kvw_dig_prep_t prep;
    kvwc_digest_in_t din;
    st = kvw_dig_prepare(plan, false, NULL, 0, units, num_units, slot, &prep, &din);
    if (st == KVW_OK)
        st = kvw__cuda_ret(ops, ops->exec_digest(t->ex, &din, 1));
    kvw_dig_prep_free(&prep);
    if (prev >= 0 && prev != dev)
        (void)ops->set_device(prev);
    return st;
}

kvw_status_t kvw__cuda_step_reap(int slot, int block, int *done_p, kvw_cuda_profile_t *prof)
{
    pthread_once(&kvw_texec_once, kvw_texec_init);
    kvw_texec_t *t = kvw_texec_key_ok ? pthread_getspecific(kvw_texec_key) : NULL;
    *done_p = 0;
    if (t == NULL)
        return kvw__error(KVW_ERR_INTERNAL, "CUDA executor: no step was launched on this thread");
    kvwc_step_prof_t sp = {0};
    kvw_status_t st = kvw__cuda_ret(t->ops, t->ops->exec_reap(t->ex, slot, block, done_p, &sp));
    kvw_prof_add_step(prof, &sp);
    if (*done_p)
        t->inflight--;
    return st;
}

struct kvw_cuda_stream {
    const kvwc_ops_t *ops;
    kvwc_plan_h mod;
    int device;
    bool scatter;
};

kvw_status_t kvw__cuda_stream_open(const struct kvw_plan *plan, bool scatter,
                                   kvw_cuda_stream_t **s_p)
{
    const kvwc_ops_t *ops = NULL;
    kvw_texec_t *t = NULL;
    kvwc_map_in_t maps[2 * KVW_NUM_POOLS];
    kvwc_plan_in_t in;
    uint64_t t0 = 0;
    kvw_status_t st = kvw_step_prepare(plan, scatter ? KVWC_USE_SCATTER : KVWC_USE_GATHER, &ops,
                                       &t, maps, &in, &t0);
    if (st != KVW_OK)
        return st;
    kvw_cuda_stream_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        kvw__cuda_plan_in_free(&in);
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory opening a staged stream");
    }
    st = kvw__cuda_ret(ops, ops->exec_plan_upload(t->ex, &in, &s->mod));
    kvw__cuda_plan_in_free(&in);
    if (st != KVW_OK) {
        free(s);
        return st;
    }
    s->ops = ops;
    s->device = t->device;
    s->scatter = scatter;
    *s_p = s;
    return KVW_OK;
}

kvw_status_t kvw__cuda_stream_window(kvw_cuda_stream_t *s, void *host, uint64_t lo, uint64_t hi,
                                     int *slot_p, kvw_cuda_profile_t *prof)
{
    kvw_texec_t *t = NULL;
    *slot_p = -1;
    kvw_status_t st = kvw_texec_get(s->ops, &t);
    if (st != KVW_OK)
        return st;
    kvwc_step_prof_t sp = {0};
    st = kvw__cuda_ret(s->ops, s->ops->exec_stage(t->ex, s->mod, s->scatter, host, lo, hi,
                                                  slot_p, &sp));
    kvw_prof_add_step(prof, &sp);
    if (st == KVW_OK && *slot_p >= 0)
        t->inflight++;
    return st;
}

void kvw__cuda_stream_close(kvw_cuda_stream_t *s)
{
    if (s == NULL)
        return;
    pthread_once(&kvw_texec_once, kvw_texec_init);
    kvw_texec_t *t = kvw_texec_key_ok ? pthread_getspecific(kvw_texec_key) : NULL;
    s->ops->exec_plan_free(t && t->device == s->device ? t->ex : NULL, s->mod);
    free(s);
}

kvw_status_t kvw__cuda_stage_buf(int which, uint64_t size, void **buf_p)
{
    const kvwc_ops_t *ops = NULL;
    kvw_texec_t *t = NULL;
    kvw_status_t st = kvw__cuda_get(&ops);
    if (st == KVW_OK)
        st = kvw_texec_get(ops, &t);
    if (st != KVW_OK)
        return st;
    if (which < 0 || which > 1)
        return kvw__error(KVW_ERR_INVALID_PARAM, "staging buffer %d of 2", which);
    if (size > t->pinned_cap[which]) {
        if (t->pinned[which])
            ops->free_host(t->pinned[which]);
        t->pinned[which] = NULL;
        t->pinned_cap[which] = 0;
        uint64_t cap = KVW_MAX(size, 16ull << 20);
        if ((st = kvw__cuda_ret(ops, ops->malloc_host(cap, &t->pinned[which]))) != KVW_OK)
            return st;
        t->pinned_cap[which] = cap;
    }
    *buf_p = t->pinned[which];
    return KVW_OK;
}

kvw_status_t kvw__cuda_host_register(void *ptr, uint64_t size)
{
    KVW_CUDA_FORWARD(host_register(ptr, size));
}

void kvw__cuda_host_unregister(void *ptr)
{
    const kvwc_ops_t *ops = NULL;
    if (kvw__cuda_get(&ops) == KVW_OK)
        (void)ops->host_unregister(ptr);
}

kvw_status_t kvw__cuda_event_create(void **event_p)
{
    KVW_CUDA_FORWARD(event_create(event_p));
}

kvw_status_t kvw__cuda_event_record(void *event, void *stream)
{
    KVW_CUDA_FORWARD(event_record(event, stream));
}

kvw_status_t kvw__cuda_event_query(void *event)
{
    const kvwc_ops_t *ops = NULL;
    kvw_status_t st = kvw__cuda_get(&ops);
    if (st != KVW_OK)
        return st;
    st = ops->event_query(event);
    return st == KVW_INPROGRESS ? st : kvw__cuda_ret(ops, st);
}

kvw_status_t kvw__cuda_event_destroy(void *event)
{
    KVW_CUDA_FORWARD(event_destroy(event));
}

kvw_status_t kvw__cuda_busy(void *stream, uint64_t ns)
{
    KVW_CUDA_FORWARD(busy(stream, ns));
}

/* ---------------------------------------------------------------- profile */

/* Relaxed atomics: workers add their steps concurrently; a reader only needs totals.
 * The last two slots are the earliest start (a minimum) and the latest notice (a
 * maximum). */
static _Atomic uint64_t kvw_prof[10];

void kvw__cuda_profile_add(const kvw_cuda_profile_t *d)
{
    const uint64_t v[8] = {d->steps, d->bytes, d->plan_ns, d->launch_ns, d->upload_dev_ns,
                           d->kernel_dev_ns, d->wait_ns, d->notify_ns};
    for (int i = 0; i < 8; i++)
        if (v[i])
            atomic_fetch_add_explicit(&kvw_prof[i], v[i], memory_order_relaxed);
    if (d->first_start_ns) {
        uint64_t cur = atomic_load_explicit(&kvw_prof[8], memory_order_relaxed);
        while ((cur == 0 || d->first_start_ns < cur) &&
               !atomic_compare_exchange_weak_explicit(&kvw_prof[8], &cur, d->first_start_ns,
                                                      memory_order_relaxed,
                                                      memory_order_relaxed)) {
        }
    }
    if (d->last_done_ns) {
        uint64_t cur = atomic_load_explicit(&kvw_prof[9], memory_order_relaxed);
        while (d->last_done_ns > cur &&
               !atomic_compare_exchange_weak_explicit(&kvw_prof[9], &cur, d->last_done_ns,
                                                      memory_order_relaxed,
                                                      memory_order_relaxed)) {
        }
    }
}

void kvw_cuda_profile(kvw_cuda_profile_t *out, int reset)
{
    uint64_t v[10];
    for (int i = 0; i < 10; i++)
        v[i] = reset ? atomic_exchange_explicit(&kvw_prof[i], 0, memory_order_relaxed)
                     : atomic_load_explicit(&kvw_prof[i], memory_order_relaxed);
    if (out)
        *out = (kvw_cuda_profile_t){.field_mask = KVW_CUDA_PROFILE_FIELDS_ALL,
                                    .steps = v[0], .bytes = v[1], .plan_ns = v[2],
                                    .launch_ns = v[3], .upload_dev_ns = v[4],
                                    .kernel_dev_ns = v[5], .wait_ns = v[6], .notify_ns = v[7],
                                    .first_start_ns = v[8], .last_done_ns = v[9]};
}
