/*
 * Contexts: one per rank; creating one starts its threads and registers it, destroying
 * one stops them. A control thread owns every control socket (ctrl.c); on prefill ranks
 * worker threads move the bytes (worker.c). One mutex (ctx->mu) guards the peer and
 * room tables; no socket I/O happens while it is held except non-blocking reads on the
 * control thread and the first non-blocking write of a frame (kvw__peer_send).
 */
#include "core/cond.h"
#include "core/config.h"
#include "proto/proto.h"

#include <kvwire/mem.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* Device (GPU) buffers on a host transport (tcp, shm, ucx) move through host staging:
 * the prefill gathers on its device, the decode scatters on its own. That needs the
 * kind's executor here (the CUDA module), and a rank whose buffers are all device memory
 * on one device (a rank mixing kinds would need both paths in one plan). cuda_ipc keeps
 * its own rule (checked at registration). */
static kvw_status_t kvw_check_mem_kinds(struct kvw_ctx *ctx)
{
    bool gpu_tl = (ctx->tl_ops->caps & KVW_TL_CAP_DEVICE_MEM) != 0;
    kvw_status_t st = kvw__rank_memops(ctx->rank, gpu_tl ? NULL : ctx->tl_ops->name, &ctx->mem,
                                       &ctx->mem_dev);
    if (st != KVW_OK || gpu_tl || !ctx->mem->is_device)
        return st;
    if (ctx->mem->available() != KVW_OK)
        return kvw__error(KVW_ERR_UNSUPPORTED, "this rank's buffers are %s memory, which '%s' "
                          "moves through host staging with the CUDA module: %s", ctx->mem->name,
                          ctx->tl_ops->name, kvw_last_error());
    ctx->staged_dev = true;
    return KVW_OK;
}

/* Checks the caller's parameters and the environment (every KVW_* variable, once per
 * context); *has_bs: a bootstrap address is given. */
static kvw_status_t kvw_ctx_params_check(const kvw_ctx_params_t *params, kvw_ctx_h *ctx_p,
                                         bool *has_bs)
{
    const uint64_t need = KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK;
    kvw_status_t st;
    /* A decode context may go without a bootstrap address: its rooms then name their
     * prefill instance (kvw_receiver_create_from). */
    if (params && (st = kvw__mask_check(&kvw__spec_ctx_params, params->field_mask,
                                        "kvw_ctx_create: params")) != KVW_OK)
        return st;
    *has_bs = params && (params->field_mask & KVW_CTX_FIELD_BOOTSTRAP) &&
              params->bootstrap_addr && params->bootstrap_addr[0];
    if (params == NULL || ctx_p == NULL || (params->field_mask & need) != need ||
        params->rank == NULL || (!*has_bs && params->side != KVW_SIDE_DECODE))
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "context params need a side, a rank and (prefill) a bootstrap address");
    uint64_t fm = params->field_mask;
    if ((fm & KVW_CTX_FIELD_SECRET) && params->secret && strlen(params->secret) >= 256)
        return kvw__error(KVW_ERR_INVALID_PARAM, "the shared secret is longer than 255 bytes");
    if ((fm & KVW_CTX_FIELD_VERIFY) && params->verify && params->verify[0]) {
        int mode;
        uint32_t ppm;
        const char *why = kvw__verify_parse(params->verify, &mode, &ppm);
        if (why)
            return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_ctx_create: verify '%.64s' %s",
                              params->verify, why);
    }
    return kvw__config_check();
}

void kvw__ctx_cfg_read(struct kvw_ctx *ctx)
{
    kvw__config_u64("KVW_WORKERS", &ctx->cfg.workers);
    kvw__config_u64("KVW_GPU_INFLIGHT", &ctx->cfg.gpu_inflight);
    kvw__config_u64("KVW_GPU_BATCH", &ctx->cfg.gpu_batch);
    kvw__config_u64("KVW_GPU_WARM", &ctx->cfg.gpu_warm);
    kvw__config_u64("KVW_STAGING_MB", &ctx->cfg.staging_mb);
    kvw__config_u64("KVW_BUSY_POLL_US", &ctx->cfg.busy_poll_us);
    kvw__config_u64("KVW_MAX_PEER_ROOMS", &ctx->cfg.max_peer_rooms);
    kvw__config_u64("KVW_MAX_HELLO_KB", &ctx->cfg.max_hello);
    ctx->cfg.max_hello <<= 10;
    kvw__config_u64("KVW_MAX_PEERS", &ctx->cfg.max_peers);
    kvw__config_u64("KVW_VERIFY_INLINE_KB", &ctx->cfg.verify_inline);
    ctx->cfg.verify_inline <<= 10;
    const char *path;
    kvw__config_str("KVW_PATH", &path);
    ctx->cfg.path_mode = path && !strcmp(path, "direct")   ? KVW_PATH_DIRECT
                         : path && !strcmp(path, "staged") ? KVW_PATH_STAGED
                                                           : KVW_PATH_AUTO;
}

/* The context's settings from the parameters (defaults for what they leave out) and the
 * environment, and its locks. */
static void kvw_ctx_params_resolve(struct kvw_ctx *ctx, const kvw_ctx_params_t *params,
                                   bool has_bs)
{
    uint64_t fm = params->field_mask;
    ctx->side = params->side;
    ctx->rank = params->rank;
    if ((fm & KVW_CTX_FIELD_SECRET) && params->secret)
        snprintf(ctx->secret, sizeof(ctx->secret), "%s", params->secret);
    if (fm & KVW_CTX_FIELD_INSTANCE)
        ctx->instance_id = params->instance_id;
    ctx->listen_fd = -1;
    ctx->bs_fd = -1;
    kvw__hs_init(ctx);
    ctx->wake_fd[0] = ctx->wake_fd[1] = -1;
    snprintf(ctx->listen_host, sizeof(ctx->listen_host), "%s",
             (fm & KVW_CTX_FIELD_LISTEN_HOST) && params->listen_host ? params->listen_host
                                                                      : "127.0.0.1");
    kvw__host_unbracket(ctx->listen_host); /* "[::1]" as well as "::1" */
    snprintf(ctx->bootstrap_addr, sizeof(ctx->bootstrap_addr), "%s",
             has_bs ? params->bootstrap_addr : "");
    bool t = fm & KVW_CTX_FIELD_TIMEOUTS;
    ctx->heartbeat_ms = t && params->heartbeat_ms ? params->heartbeat_ms : 200;
    ctx->peer_timeout_ms = t && params->peer_timeout_ms ? params->peer_timeout_ms : 3000;
    ctx->bootstrap_timeout_ms = t && params->bootstrap_timeout_ms ? params->bootstrap_timeout_ms : 10000;
    ctx->wait_timeout_ms = t && params->wait_timeout_ms ? params->wait_timeout_ms : 30000;
    kvw__ctx_cfg_read(ctx);
    uint64_t busy_us = (fm & KVW_CTX_FIELD_BUSY_POLL) ? params->busy_poll_us
                                                      : ctx->cfg.busy_poll_us;
    ctx->busy_poll_ns = KVW_MIN(busy_us, 1000000ull) * 1000ull; /* at most 1 s */
    ctx->path_mode = ctx->cfg.path_mode;
    const char *verify = NULL;
    if ((fm & KVW_CTX_FIELD_VERIFY) && params->verify && params->verify[0])
        verify = params->verify;
    else
        kvw__config_str("KVW_VERIFY", &verify);
    (void)kvw__verify_parse(verify, &ctx->cfg.verify, &ctx->cfg.verify_ppm); /* checked */
    pthread_mutex_init(&ctx->mu, NULL);
    pthread_cond_init(&ctx->cv, NULL);
    kvw__queue_init(ctx);
    kvw__cond_init_monotonic(&ctx->done_cv);
}

/* The transport: found by name, started with the context's callbacks, and the memory
 * kinds of this rank's buffers checked against it; the control thread's wake-up pipe. */
static kvw_status_t kvw_ctx_tl_open(struct kvw_ctx *ctx, const kvw_ctx_params_t *params)
{
    uint64_t fm = params->field_mask;
    const char *tl_name = (fm & KVW_CTX_FIELD_TRANSPORT) && params->transport ? params->transport
                                                                               : "tcp";
    ctx->tl_ops = kvw__tl_find(tl_name);
    if (ctx->tl_ops == NULL) {
        char why[256]; /* the registry's reason (not built in, module not loaded) */
        snprintf(why, sizeof(why), "%s", kvw_last_error());
        return kvw__error(KVW_ERR_UNSUPPORTED, "transport '%s' cannot be used: %s", tl_name,
                          why);
    }
    if (pipe2(ctx->wake_fd, O_CLOEXEC | O_NONBLOCK) < 0)
        return kvw__error(KVW_ERR_IO, "pipe: %s", strerror(errno));
    /* Both sides bind where the context listens: a prefill's instance is never connected
     * to, but one bound to 127.0.0.1 whatever listen_host says failed without IPv4
     * loopback (an IPv6-only host). */
    kvw_tl_params_t tp = {.listen_host = ctx->listen_host,
                          .listen_port = 0,
                          .cb = {.arg = ctx, .on_notify = kvw__on_notify,
                                 .check_write = kvw__check_write,
                                 .check_writes = kvw__check_writes,
                                 .on_ep_error = kvw__on_ep_error}};
    kvw_status_t st = ctx->tl_ops->init(&tp, &ctx->tl);
    if (st != KVW_OK)
        return st;
    if ((st = kvw_check_mem_kinds(ctx)) != KVW_OK)
        return st;
    /* A decode verifying rooms on GPU buffers: its digest executor now, not on the first
     * room's digest (a failure here comes back, with its message, on that digest). A
     * prefill digests on its workers' own executors. */
    if (ctx->side == KVW_SIDE_DECODE && ctx->cfg.verify != KVW_VERIFY_OFF &&
        ctx->cfg.gpu_warm && ctx->mem->digest_warm && ctx->mem->digest_warm(ctx->mem_dev) != KVW_OK)
        kvw__log(KVW_LOG_DEBUG, "preparing the GPU digest executor: %s", kvw_last_error());
    return KVW_OK;
}

/* Prefill: the bootstrap endpoint when this rank hosts it, the control listener, the
 * workers and the control thread, then this rank's entry in the bootstrap table. */
static kvw_status_t kvw_ctx_prefill_start(struct kvw_ctx *ctx, const kvw_ctx_params_t *params,
                                          uint64_t deadline)
{
    uint64_t fm = params->field_mask;
    kvw_status_t st;
    const kvw_parallel_t *par = kvw_rank_parallel(ctx->rank);
    if (params->host_bootstrap && (fm & KVW_CTX_FIELD_HOST_BOOTSTRAP)) {
        char host[128];
        uint16_t port;
        if ((st = kvw__parse_hostport(params->bootstrap_addr, host, sizeof(host), &port)) != KVW_OK ||
            (st = kvw__bootstrap_start(host, port, ctx->secret, &ctx->bs)) != KVW_OK)
            return st;
        snprintf(ctx->bootstrap_addr, sizeof(ctx->bootstrap_addr), "%s",
                 kvw__bootstrap_addr(ctx->bs));
    }
    if ((st = kvw__tcp_listen(ctx->listen_host, 0, &ctx->listen_fd, &ctx->listen_port)) != KVW_OK)
        return st;
    /* Workers send to different decode ranks in parallel (KVW_WORKERS, default 4). */
    uint64_t nw = KVW_MAX(1, KVW_MIN(ctx->cfg.workers, KVW_ARRAY_SIZE(ctx->workers)));
    for (uint32_t i = 0; i < nw; i++) {
        if (pthread_create(&ctx->workers[i], NULL, kvw__worker_main, ctx) != 0)
            return kvw__error(KVW_ERR_IO, "cannot start worker thread %u", i);
        ctx->num_workers = i + 1;
    }
    if (pthread_create(&ctx->ctrl_thread, NULL, kvw__ctrl_main, ctx) != 0)
        return kvw__error(KVW_ERR_IO, "cannot start the control thread");
    ctx->ctrl_started = true;
    kvw_bs_entry_t e = {.dp = par->dp_rank, .tp = par->tp_rank, .pp = par->pp_rank,
                        .dp_size = KVW_MAX(par->dp_size, 1), .tp_size = par->tp_size,
                        .pp_size = KVW_MAX(par->pp_size, 1)};
    kvw__format_hostport(ctx->listen_host, ctx->listen_port, e.addr, sizeof(e.addr));
    st = kvw__bootstrap_hold(ctx->bootstrap_addr, &e, ctx->secret, deadline, &ctx->bs_fd);
    if (st == KVW_OK && e.has_mac) {
        pthread_mutex_lock(&ctx->mu);
        kvw__entry_bind(e.nonce, e.addr, ctx->bs_bind);
        ctx->bs_bound = true;
        pthread_cond_broadcast(&ctx->cv); /* registrations waiting for it (handshake.c) */
        pthread_mutex_unlock(&ctx->mu);
    }
    return st;
}

/* Decode: registers every buffer and the staging area with the transport, and keeps
 * what a registration sends (the keys, the data address) for every prefill instance
 * connected later. */
static kvw_status_t kvw_ctx_decode_mem_reg(struct kvw_ctx *ctx)
{
    kvw_status_t st = KVW_OK;
    uint32_t nb = kvw_rank_num_buffers(ctx->rank);
    uint8_t *rkeys = calloc(nb + 1, KVW_TL_MAX_RKEY);
    size_t *rkey_lens = calloc(nb + 1, sizeof(size_t));
    ctx->mems = calloc(nb + 1, sizeof(*ctx->mems));
    uint8_t addr[KVW_TL_MAX_ADDR];
    size_t addr_len = sizeof(addr);
    if (!rkeys || !rkey_lens || !ctx->mems) {
        st = kvw__error(KVW_ERR_NO_MEMORY, "out of memory registering buffers");
        goto out;
    }
    for (uint32_t i = 0; i < nb; i++) {
        const kvw_buffer_desc_t *b = kvw_rank_buffer(ctx->rank, i);
        ctx->num_mems = i + 1;
        if (ctx->staged_dev)
            continue; /* no remote writes into device memory: an empty key */
        if ((st = ctx->tl_ops->mem_reg(ctx->tl, b->addr, b->length, b->mem_kind, i,
                                       &ctx->mems[i], rkeys + (size_t)i * KVW_TL_MAX_RKEY,
                                       &rkey_lens[i])) != KVW_OK) {
            ctx->num_mems = i;
            goto out;
        }
    }
    /* The staging area receives gathered head slices in one bulk write each. */
    if ((st = kvw__stage_init(ctx)) != KVW_OK)
        goto out;
    if (ctx->stage.len) {
        if ((st = ctx->tl_ops->mem_reg(ctx->tl, ctx->stage.buf, ctx->stage.len, KVW_MEM_HOST,
                                       nb, &ctx->mems[nb],
                                       rkeys + (size_t)nb * KVW_TL_MAX_RKEY,
                                       &rkey_lens[nb])) != KVW_OK)
            goto out;
        ctx->num_mems = nb + 1;
    }
    if ((st = ctx->tl_ops->address(ctx->tl, addr, &addr_len)) != KVW_OK)
        goto out;
    /* Kept for registrations with prefill instances connected later. */
    ctx->hello_rkeys = rkeys, ctx->hello_rkey_lens = rkey_lens;
    rkeys = NULL, rkey_lens = NULL;
    memcpy(ctx->hello_addr, addr, addr_len);
    ctx->hello_addr_len = addr_len;
    ctx->hello_staging_len = ctx->stage.len;
out:
    free(rkeys);
    free(rkey_lens);
    return st;
}

/* Decode: the context's own prefill instance is connected now, and its geometry checked
 * against what the caller expects: creation fails if it does not fit. */
static kvw_status_t kvw_ctx_decode_own_instance(struct kvw_ctx *ctx,
                                                const kvw_ctx_params_t *params,
                                                uint64_t deadline)
{
    kvw_bs_entry_t *entries = NULL;
    uint32_t ne = 0;
    kvw_status_t st;
    /* The control thread runs already: the instance table is touched under mu. */
    pthread_mutex_lock(&ctx->mu);
    int i0 = kvw__inst_find_or_add(ctx, ctx->bootstrap_addr);
    if (i0 >= 0)
        kvw__inst_set(ctx, (uint32_t)i0, 1, KVW_INST_CONNECTING);
    pthread_mutex_unlock(&ctx->mu);
    if (i0 < 0)
        return KVW_ERR_INVALID_PARAM;
    /* The sizes are read only with their bit (field-mask contract): clear, all three
     * come from the bootstrap. */
    bool sized = params->field_mask & KVW_CTX_FIELD_PREFILL_SIZE;
    if ((st = kvw__bootstrap_lookup(ctx->bootstrap_addr, sized ? params->prefill_tp : 0,
                                    sized ? params->prefill_pp : 0,
                                    sized ? params->prefill_dp : 0, ctx->secret, deadline,
                                    &entries, &ne)) != KVW_OK)
        goto out;
    if ((st = kvw__decode_connect_all(ctx, entries, ne, (uint32_t)i0, 1, deadline)) != KVW_OK)
        goto out;
    pthread_mutex_lock(&ctx->mu);
    if ((st = kvw__inst_connected(ctx, (uint32_t)i0, 1)) == KVW_OK)
        kvw__inst_set(ctx, (uint32_t)i0, 1, KVW_INST_READY);
    pthread_mutex_unlock(&ctx->mu);
out:
    free(entries);
    return st;
}

/* Decode: register every buffer, start the control thread, then register with every
 * prefill rank of the context's own instance (when it names one). The control thread
 * runs first so that each prefill rank hears this rank (heartbeats) from its
 * registration on: a prefill rank declares a peer that stays silent for the peer
 * timeout (3 s) dead, and registering with a large instance on a loaded host can take
 * longer than that. */
static kvw_status_t kvw_ctx_decode_start(struct kvw_ctx *ctx, const kvw_ctx_params_t *params,
                                         bool has_bs, uint64_t deadline)
{
    kvw_status_t st;
    if ((st = kvw_ctx_decode_mem_reg(ctx)) != KVW_OK)
        return st;
    if (pthread_create(&ctx->ctrl_thread, NULL, kvw__ctrl_main, ctx) != 0)
        return kvw__error(KVW_ERR_IO, "cannot start the control thread");
    ctx->ctrl_started = true;
    if (has_bs && (st = kvw_ctx_decode_own_instance(ctx, params, deadline)) != KVW_OK)
        return st;
    return KVW_OK;
}

kvw_status_t kvw_ctx_create(const kvw_ctx_params_t *params, kvw_ctx_h *ctx_p)
{
    bool has_bs = false;
    kvw_status_t st = kvw_ctx_params_check(params, ctx_p, &has_bs);
    if (st != KVW_OK)
        return st;
    struct kvw_ctx *ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory creating a context");
    kvw_ctx_params_resolve(ctx, params, has_bs);
    uint64_t deadline = kvw__now_ns() + (uint64_t)ctx->bootstrap_timeout_ms * 1000000ull;
    if ((st = kvw_ctx_tl_open(ctx, params)) == KVW_OK)
        st = ctx->side == KVW_SIDE_PREFILL ? kvw_ctx_prefill_start(ctx, params, deadline)
                                           : kvw_ctx_decode_start(ctx, params, has_bs, deadline);
    if (st != KVW_OK) {
        /* Keep the first error's message across the teardown. */
        char msg[512];
        snprintf(msg, sizeof(msg), "%s", kvw_last_error());
        kvw_ctx_destroy(ctx);
        return kvw__error(st, "%s", msg);
    }
    *ctx_p = ctx;
    return KVW_OK;
}

const char *kvw_ctx_bootstrap_addr(kvw_ctx_h ctx)
{
    return ctx && ctx->bs ? kvw__bootstrap_addr(ctx->bs) : NULL;
}

void kvw_ctx_destroy(kvw_ctx_h ctx)
{
    if (ctx == NULL)
        return;
    pthread_mutex_lock(&ctx->mu);
    ctx->stopping = true;
    for (kvw_room_t *r = kvw__room_first(ctx); r; r = kvw__room_next(ctx, r))
        kvw__room_fail(ctx, r, KVW_ERR_SHUTDOWN, false, "the context was destroyed");
    pthread_cond_broadcast(&ctx->cv);
    kvw__queue_stop(ctx, true);
    pthread_mutex_unlock(&ctx->mu);
    if (ctx->wake_fd[1] >= 0)
        kvw__ctx_wake(ctx);
    if (ctx->ctrl_started)
        pthread_join(ctx->ctrl_thread, NULL);
    kvw__event_stop(ctx);
    /* Registration and connecting threads end within their timeouts (connecting ones
     * sooner: cancelled); wait for them. */
    atomic_store(&ctx->insts.cancel, true);
    pthread_mutex_lock(&ctx->mu);
    while (kvw__hs_running(ctx) || ctx->insts.connecting)
        pthread_cond_wait(&ctx->cv, &ctx->mu);
    pthread_mutex_unlock(&ctx->mu);
    for (uint32_t i = 0; i < ctx->num_workers; i++)
        pthread_join(ctx->workers[i], NULL);
    /* What failures since the control thread left still have to do (a worker's last
     * step quiescing its room): frames go out as direct writes, if the socket takes them. */
    pthread_mutex_lock(&ctx->mu);
    kvw__run_deferred(ctx);
    pthread_mutex_unlock(&ctx->mu);
    if (ctx->tl) {
        ctx->tl_ops->close(ctx->tl);
        ctx->tl_ops->stop(ctx->tl);
    }
    for (uint32_t i = 0; i < kvw__peer_count(ctx); i++)
        kvw__peer_free(ctx, kvw__peer_at(ctx, i));
    free(ctx->peers.tab);
    for (uint32_t i = 0; i < ctx->num_mems; i++)
        if (ctx->mems[i])
            ctx->tl_ops->mem_dereg(ctx->tl, ctx->mems[i]);
    free(ctx->mems);
    if (ctx->tl)
        ctx->tl_ops->fini(ctx->tl);
    kvw__stage_fini(ctx);
    kvw__insts_fini(ctx);
    kvw__room_effects_fini(ctx);
    free(ctx->hello_rkeys);
    free(ctx->hello_rkey_lens);
    kvw__binds_fini(ctx);
    /* Rooms still owned by handles are freed by their destroy calls; orphans here. */
    kvw__rooms_release(ctx);
    if (ctx->bs_fd >= 0)
        close(ctx->bs_fd); /* the endpoint drops this rank's entry */
    kvw__bootstrap_stop(ctx->bs);
    if (ctx->listen_fd >= 0)
        close(ctx->listen_fd);
    if (ctx->wake_fd[0] >= 0) {
        close(ctx->wake_fd[0]);
        close(ctx->wake_fd[1]);
    }
    pthread_mutex_destroy(&ctx->mu);
    pthread_cond_destroy(&ctx->cv);
    pthread_cond_destroy(&ctx->done_cv);
    kvw__queue_fini(ctx);
    free(ctx);
}
