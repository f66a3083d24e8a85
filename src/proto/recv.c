/* The decode engine's calls on a room (kvw_receiver_create/_from, _post, _metadata):
 * posting the room's pages to its prefill ranks with the pages it may write (grants).
 * The prefill instances a room names are inst.c's; a post made while its instance was
 * being connected goes out once it is (kvw_receiver_settle). */
#include "proto/proto.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void kvw_receiver_settle(struct kvw_ctx *ctx, uint32_t i, kvw_status_t st, const char *why);

kvw_status_t kvw_receiver_metadata(kvw_receiver_h rv, void *buf, size_t cap, size_t *len_p)
{
    if (rv == NULL || len_p == NULL || (buf == NULL && cap))
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_receiver_metadata: NULL argument");
    struct kvw_ctx *ctx = kvw__receiver_room(rv)->ctx;
    kvw_room_t *r = kvw__receiver_room(rv);
    if (ctx)
        pthread_mutex_lock(&ctx->mu);
    kvw_status_t st = KVW_OK;
    *len_p = 0;
    if (r->state == KVW_ROOM_FAILED)
        st = kvw__error(r->status, "room %llu failed: %s", (unsigned long long)r->id, r->reason);
    else if (r->state != KVW_ROOM_SUCCESS)
        st = kvw__error(KVW_INPROGRESS, "room %llu has not reached Success yet",
                        (unsigned long long)r->id);
    else if (r->has_meta) {
        *len_p = r->meta_len;
        if (r->meta_len > cap)
            st = kvw__error(KVW_ERR_BUFFER_TOO_SMALL, "room %llu: metadata of %u bytes, buffer "
                            "of %zu", (unsigned long long)r->id, r->meta_len, cap);
        else if (r->meta_len)
            memcpy(buf, r->meta, r->meta_len);
    }
    if (ctx)
        pthread_mutex_unlock(&ctx->mu);
    return st;
}

static int kvw_u32_cmp(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* Pages of one pool that a room may have written: those covering [tb, te). */
static kvw_status_t kvw_grant(kvw_room_t *r, int pool, const kvw_pages_t *pl, uint32_t ps,
                              uint64_t capacity, uint64_t tb, uint64_t te)
{
    r->num_granted[pool] = 0;
    if (tb >= te || ps == 0)
        return KVW_OK;
    if (pl->first_token > tb || pl->first_token % ps ||
        pl->first_token + (uint64_t)pl->num_pages * ps < te)
        return kvw__error(KVW_ERR_OUT_OF_RANGE,
                          "room %llu: the %s page list (%u pages of %u tokens from token %llu) "
                          "does not cover tokens [%llu, %llu)", (unsigned long long)r->id,
                          pool == KVW_POOL_FULL ? "full-attention" : "sliding-window",
                          pl->num_pages, ps, (unsigned long long)pl->first_token,
                          (unsigned long long)tb, (unsigned long long)te);
    uint64_t i0 = (tb - pl->first_token) / ps, i1 = (te - pl->first_token + ps - 1) / ps;
    r->granted[pool] = malloc(sizeof(uint32_t) * (i1 - i0));
    if (r->granted[pool] == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory granting pages");
    memcpy(r->granted[pool], pl->pages + i0, sizeof(uint32_t) * (i1 - i0));
    qsort(r->granted[pool], i1 - i0, sizeof(uint32_t), kvw_u32_cmp);
    r->num_granted[pool] = (uint32_t)(i1 - i0);
    /* Checked here, at post, so the decode engine hears of its own mistake at once. */
    const char *name = pool == KVW_POOL_FULL ? "full-attention" : "sliding-window";
    for (uint32_t i = 0; i < r->num_granted[pool]; i++) {
        uint32_t pg = r->granted[pool][i];
        if (pg >= capacity)
            return kvw__error(KVW_ERR_OUT_OF_RANGE, "room %llu: %s page %u is outside the pool's "
                              "%llu pages", (unsigned long long)r->id, name, pg,
                              (unsigned long long)capacity);
        if (i && pg == r->granted[pool][i - 1])
            return kvw__error(KVW_ERR_INVALID_PARAM, "room %llu: %s page %u is listed twice",
                              (unsigned long long)r->id, name, pg);
    }
    return KVW_OK;
}

kvw_status_t kvw_receiver_create(kvw_ctx_h ctx, uint64_t room, uint32_t prefill_dp,
                                 kvw_receiver_h *receiver_p)
{
    return kvw_receiver_create_from(ctx, room, NULL, prefill_dp, receiver_p);
}

kvw_status_t kvw_receiver_create_from(kvw_ctx_h ctx, uint64_t room, const char *bootstrap_addr,
                                      uint32_t prefill_dp, kvw_receiver_h *receiver_p)
{
    if (ctx == NULL || receiver_p == NULL || ctx->side != KVW_SIDE_DECODE)
        return kvw__error(KVW_ERR_INVALID_PARAM, "receivers exist on decode contexts only");
    if ((bootstrap_addr == NULL || !bootstrap_addr[0]) && !ctx->bootstrap_addr[0])
        return kvw__error(KVW_ERR_INVALID_PARAM, "room %llu names no prefill instance, and this "
                          "decode context has none of its own (kvw_receiver_create_from)",
                          (unsigned long long)room);
    if (bootstrap_addr == NULL || !bootstrap_addr[0])
        bootstrap_addr = ctx->bootstrap_addr;
    pthread_mutex_lock(&ctx->mu);
    int inst = kvw__inst_find_or_add(ctx, bootstrap_addr);
    if (inst < 0) {
        kvw_status_t st = kvw__error(KVW_ERR_INVALID_PARAM, "%s", kvw_last_error());
        pthread_mutex_unlock(&ctx->mu);
        return st;
    }
    kvw_room_t *r = kvw__room_find(ctx, room);
    if (r) {
        pthread_mutex_unlock(&ctx->mu);
        return kvw__error(KVW_ERR_BUSY, "room %llu already has a receiver on this rank",
                          (unsigned long long)room);
    }
    r = kvw__room_new(ctx, room, false);
    if (r == NULL) {
        pthread_mutex_unlock(&ctx->mu);
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory creating a receiver");
    }
    r->engine_owned = true;
    r->src_dp = prefill_dp;
    /* The first room naming an instance starts connecting to it, without blocking. */
    r->inst = (uint32_t)inst;
    kvw__inst_use(ctx, r->inst, kvw_receiver_settle);
    r->inst_gen = kvw__inst_at(ctx, r->inst)->gen;
    pthread_mutex_unlock(&ctx->mu);
    *receiver_p = (kvw_receiver_h)(void *)r;
    return KVW_OK;
}

kvw_status_t kvw_receiver_post(kvw_receiver_h rv, const kvw_recv_post_t *post)
{
    if (rv == NULL || post == NULL || kvw__receiver_room(rv)->ctx == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_receiver_post: NULL argument or no context");
    struct kvw_ctx *ctx = kvw__receiver_room(rv)->ctx;
    kvw_room_t *r = kvw__receiver_room(rv);
    kvw_recv_post_t norm;
    kvw_status_t nst = kvw__recv_post_norm(post, "kvw_receiver_post: post", &norm);
    if (nst != KVW_OK)
        return nst;
    post = &norm;
    if (post->prefix_len > post->num_tokens)
        return kvw__error(KVW_ERR_INVALID_PARAM, "prefix %llu exceeds the request's %llu tokens",
                          (unsigned long long)post->prefix_len,
                          (unsigned long long)post->num_tokens);
    pthread_mutex_lock(&ctx->mu);
    kvw_status_t st = KVW_OK;
    if (r->state != KVW_ROOM_BOOTSTRAPPING || r->pending) {
        st = r->state == KVW_ROOM_FAILED
                 ? kvw__error(r->status, "room %llu already failed: %s", (unsigned long long)r->id,
                              r->reason)
                 : kvw__error(KVW_ERR_INVALID_PARAM, "room %llu was already posted",
                              (unsigned long long)r->id);
        pthread_mutex_unlock(&ctx->mu);
        return st;
    }
    /* An instance that went down since the room was created is connected again. */
    if (kvw__inst_use(ctx, r->inst, kvw_receiver_settle) == KVW_INST_CONNECTING &&
        r->inst_gen != kvw__inst_at(ctx, r->inst)->gen)
        r->inst_gen = kvw__inst_at(ctx, r->inst)->gen;
    if (kvw__inst_at(ctx, r->inst)->state == KVW_INST_CONNECTING) {
        /* Kept (pages copied) until the connection is up; the room stays Bootstrapping. */
        size_t nf = post->pages.full.num_pages, ns = post->pages.swa.num_pages;
        r->pend_store = malloc(sizeof(uint32_t) * (nf + ns + 1));
        if (r->pend_store == NULL) {
            st = kvw__error(KVW_ERR_NO_MEMORY, "out of memory posting a room");
            kvw__room_fail(ctx, r, st, false, "%s", kvw_last_error());
        } else {
            if (nf)
                memcpy(r->pend_store, post->pages.full.pages, sizeof(uint32_t) * nf);
            if (ns)
                memcpy(r->pend_store + nf, post->pages.swa.pages, sizeof(uint32_t) * ns);
            r->pend = *post;
            r->pend.pages.full.pages = r->pend_store;
            r->pend.pages.swa.pages = r->pend_store + nf;
            r->pending = true;
        }
        pthread_mutex_unlock(&ctx->mu);
        return st;
    }
    if (kvw__inst_at(ctx, r->inst)->state == KVW_INST_DOWN) {
        st = kvw__error(KVW_ERR_PEER_DEAD, "room %llu: prefill instance %s is down: %s",
                        (unsigned long long)r->id, kvw__inst_at(ctx, r->inst)->addr,
                        kvw__inst_at(ctx, r->inst)->why);
        kvw__room_fail(ctx, r, st, false, "%s", kvw_last_error());
        pthread_mutex_unlock(&ctx->mu);
        return st;
    }
    st = kvw__receiver_post_locked(ctx, r, post);
    pthread_mutex_unlock(&ctx->mu);
    return st;
}

/* Whether room `id` is verified: every room, none, or (sampled) the rooms whose mixed
 * id falls below the fraction; the id alone decides, so a room is verified or not
 * whichever decode rank asks, and a repeated run verifies the same rooms. */
static bool kvw_verify_pick(const struct kvw_ctx *ctx, uint64_t id)
{
    if (ctx->cfg.verify == KVW_VERIFY_OFF)
        return false;
    if (ctx->cfg.verify == KVW_VERIFY_EVERY)
        return true;
    uint64_t z = id + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return z % 1000000u < ctx->cfg.verify_ppm;
}

kvw_status_t kvw__receiver_post_locked(struct kvw_ctx *ctx, kvw_room_t *r,
                                       const kvw_recv_post_t *post)
{
    KVW_ASSERT_HELD(&ctx->mu);
    kvw_rank_h me = ctx->rank;
    kvw_status_t st = KVW_OK;
    /* Senders: every prefill rank of the chosen DP group that sends this rank bytes. */
    kvw_chunk_t whole = {.num_tokens = post->num_tokens, .chunk_begin = 0,
                         .chunk_end = post->num_tokens, .prefix_len = post->prefix_len,
                         .last_chunk = 1};
    r->srcs = calloc(kvw__peer_count(ctx) ? kvw__peer_count(ctx) : 1, sizeof(*r->srcs));
    if (r->srcs == NULL) {
        st = kvw__error(KVW_ERR_NO_MEMORY, "out of memory posting a room");
        goto out;
    }
    for (uint32_t i = 0; i < kvw__peer_count(ctx); i++) {
        kvw_peer_t *p = kvw__peer_at(ctx, i);
        if (p->dp != r->src_dp || !p->needed || p->inst != r->inst ||
            p->inst_gen != r->inst_gen || p->registering)
            continue;
        if (p->dead) {
            st = kvw__error(KVW_ERR_PEER_DEAD, "room %llu needs %s, which is gone",
                            (unsigned long long)r->id, p->desc);
            goto out;
        }
        kvw_plan_h plan;
        if ((st = kvw__plan_create_nopages(p->remote, me, &whole, &plan)) != KVW_OK)
            goto out;
        r->srcs[r->num_srcs++] = (kvw_room_src_t){.peer = i, .expected = plan->bytes};
        kvw_plan_destroy(plan);
    }
    if (r->num_srcs == 0) {
        st = kvw__error(KVW_ERR_NOT_FOUND, "no prefill rank of DP group %u sends to this rank",
                        r->src_dp);
        goto out;
    }
    /* Grants: the pages the transfer may write, so stray writes are refused. */
    uint64_t max_window = 0; /* the widest window starts earliest */
    const kvw_model_t *m = kvw_rank_model(me);
    const kvw_parallel_t *par = kvw_rank_parallel(me);
    bool state = false;
    for (uint32_t l = par->layer_begin; l < par->layer_end; l++) {
        if (m->layers[l].kind == KVW_LAYER_SWA)
            max_window = KVW_MAX(max_window, m->layers[l].window);
        state |= m->layers[l].kind == KVW_LAYER_STATE;
    }
    uint64_t n = post->num_tokens;
    if ((st = kvw_grant(r, KVW_POOL_FULL, &post->pages.full, me->pool_page_size[KVW_POOL_FULL],
                        me->pool_capacity[KVW_POOL_FULL], post->prefix_len, n)) != KVW_OK)
        goto out;
    if (max_window) {
        uint64_t ws = n > max_window ? n - max_window : 0;
        if ((st = kvw_grant(r, KVW_POOL_SWA, &post->pages.swa, me->pool_page_size[KVW_POOL_SWA],
                            me->pool_capacity[KVW_POOL_SWA], KVW_MAX(ws, post->prefix_len),
                            n)) != KVW_OK)
            goto out;
    }
    if (state) {
        if (post->pages.state_slot < 0 ||
            (uint64_t)post->pages.state_slot >= me->pool_capacity[KVW_POOL_STATE]) {
            st = kvw__error(KVW_ERR_OUT_OF_RANGE, "room %llu: state slot %lld outside the %llu "
                            "slots", (unsigned long long)r->id, (long long)post->pages.state_slot,
                            (unsigned long long)me->pool_capacity[KVW_POOL_STATE]);
            goto out;
        }
        r->granted[KVW_POOL_STATE] = malloc(sizeof(uint32_t));
        if (r->granted[KVW_POOL_STATE] == NULL) {
            st = kvw__error(KVW_ERR_NO_MEMORY, "out of memory granting pages");
            goto out;
        }
        r->granted[KVW_POOL_STATE][0] = (uint32_t)post->pages.state_slot;
        r->num_granted[KVW_POOL_STATE] = 1;
    }
    r->num_tokens = n;
    r->prefix_len = post->prefix_len;
    r->verify = kvw_verify_pick(ctx, r->id);
    r->post_pages = post->pages;
    r->post_store = malloc(sizeof(uint32_t) *
                           ((size_t)post->pages.full.num_pages + post->pages.swa.num_pages + 1));
    if (r->post_store == NULL) {
        st = kvw__error(KVW_ERR_NO_MEMORY, "out of memory posting a room");
        goto out;
    }
    if (post->pages.full.num_pages)
        memcpy(r->post_store, post->pages.full.pages, sizeof(uint32_t) * post->pages.full.num_pages);
    if (post->pages.swa.num_pages)
        memcpy(r->post_store + post->pages.full.num_pages, post->pages.swa.pages,
               sizeof(uint32_t) * post->pages.swa.num_pages);
    r->post_pages.full.pages = r->post_store;
    r->post_pages.swa.pages = r->post_store + post->pages.full.num_pages;
    kvw__room_hop(r, KVW_HOP_POST, false);
    /* Every prefill rank of the group hears of the room, even one that sends this rank
     * nothing: it learns the room's DP group from it. */
    for (uint32_t i = 0; i < kvw__peer_count(ctx); i++) {
        kvw_peer_t *p = kvw__peer_at(ctx, i);
        if (p->dp != r->src_dp || p->dead || p->inst != r->inst || p->inst_gen != r->inst_gen ||
            p->registering)
            continue;
        kvw_wbuf_t w;
        kvw__wb_init(&w, KVW_MSG_REQ);
        kvw__wb_u64(&w, r->id);
        kvw__wb_u32(&w, par->dp_rank);
        kvw__wb_u64(&w, n);
        kvw__wb_u64(&w, post->prefix_len);
        kvw__wire_put_pages(&w, &post->pages.full);
        kvw__wire_put_pages(&w, &post->pages.swa);
        kvw__wb_u64(&w, (uint64_t)post->pages.state_slot);
        /* Flags, only when one is set (a request without them is the same frame as
         * before): bit 0, verify the room's KV (the prefill sends its digest). */
        if (r->verify)
            kvw__wb_u8(&w, 1);
        kvw__peer_send(ctx, kvw__peer_at(ctx, i), &w);
    }
    r->deadline_ns = kvw__now_ns() + (uint64_t)ctx->wait_timeout_ms * 1000000ull;
    kvw__room_advance(r, KVW_ROOM_WAITING_FOR_INPUT);
out:
    if (st != KVW_OK)
        kvw__room_fail(ctx, r, st, false, "%s", kvw_last_error());
    return st;
}

/* Rooms of instance `i` waiting for its connection: a post made meanwhile goes out now,
 * or, when the connection failed, every such room fails with the reason. mu held; called
 * by the instance's connecting thread (inst.c). */
static void kvw_receiver_settle(struct kvw_ctx *ctx, uint32_t i, kvw_status_t st, const char *why)
{
    for (kvw_room_t *r = kvw__room_first(ctx); r; r = kvw__room_next(ctx, r)) {
        if (r->is_sender || r->inst != i || r->inst_gen != kvw__inst_at(ctx, i)->gen ||
            r->state != KVW_ROOM_BOOTSTRAPPING)
            continue;
        if (st != KVW_OK) {
            kvw__room_fail(ctx, r, st, false, "prefill instance %s: %s", kvw__inst_at(ctx, i)->addr,
                           why);
        } else if (r->pending) {
            r->pending = false;
            kvw__receiver_post_locked(ctx, r, &r->pend);
        }
    }
}
