"""SGLang's own disaggregation scheduler code driving kvwire.sglang.

Usage: run.py SGLANG_SRC [scenario ...]   (SGLANG_SRC: an SGLang checkout's python/ dir)

Each scenario starts a bootstrap server process (as SGLang's tokenizer manager does),
one process per prefill rank running SGLang's PrefillBootstrapQueue, send_kv_chunk and
process_disagg_prefill_inflight_queue, and one process per decode rank running SGLang's
DecodePreallocQueue.add / pop_preallocated and DecodeTransferQueue.pop_transferred, all
loaded from SGLANG_SRC unmodified. Each prefill rank fills its KV pools with a pattern
that is a function of (room, layer, role, global head, token position, byte); each decode
rank starts from sentinel bytes and, once SGLang reports the requests transferred,
checks every byte of its pools: the tokens of each request (full pages, SWA window
pages) against the pattern, the tail of each last page against the prefill's unused
bytes, everything else still sentinel (SWA page 0 excepted: SGLang's padding page, see
kvwire.sglang.KVManager.swa_side), plus the aux data SGLang committed to each request.
KVW_SGLANG_DEVICE=cuda (with real torch and a GPU) allocates the pools as CUDA tensors
on GPU 0."""
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import numpy as np  # noqa: E402

DEVICE = os.environ.get("KVW_SGLANG_DEVICE", "cpu")
DEADLINE = float(os.environ.get("KVW_SGLANG_DEADLINE", "60"))
# An aborted request must end on the other side within this bound: SGLang's timeouts
# are 300 s, so only an abort that reached the peer ends it this soon.
ABORT_BOUND = float(os.environ.get("KVW_SGLANG_ABORT_BOUND", "10"))
SLOW_CYCLES = 200_000_000  # torch.cuda._sleep ahead of a slow forward's writes (~100 ms)
S = None  # the loaded SGLang modules


def load(src):
    global S
    import stubs
    import fakes
    stubs.install(src, fakes.misc_modules(src))
    import kvwire.sglang as ks
    ks.register()
    import sglang.srt.disaggregation.utils as U
    import sglang.srt.disaggregation.prefill as P
    import sglang.srt.disaggregation.decode as D
    import sglang.srt.disaggregation.base.conn as B
    S = types.SimpleNamespace(U=U, P=P, D=D, B=B, ks=ks, fakes=fakes)
    return S


def free_port(host="127.0.0.1"):
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ipv6_loopback():
    """None where a TCP socket can listen on ::1 here, else why not."""
    if not socket.has_ipv6:
        return "Python was built without IPv6"
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            s.listen(1)
    except OSError as e:
        return "cannot listen on ::1: %s" % e
    return None


def own_listeners():
    """The addresses ("host:port") of this process's listening TCP sockets, from
    /proc/net/tcp{,6} and the socket inodes of /proc/self/fd."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink("/proc/self/fd/" + fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            col = row.split()
            if col[3] != "0A" or col[9] not in inodes:    # 0A: LISTEN
                continue
            hexaddr, hexport = col[1].split(":")
            raw = bytes.fromhex(hexaddr)
            # The kernel prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            host = socket.inet_ntop(socket.AF_INET6 if v6 else socket.AF_INET, raw)
            out.append(("[%s]:%d" if v6 else "%s:%d") % (host, int(hexport, 16)))
    return sorted(out)


def check_listeners(cfg, who, also=()):
    """With cfg.listen set: this rank listens on that host, and on nothing else but the
    addresses starting with one of `also`."""
    if not cfg.listen:
        return []
    got = own_listeners()
    want = "[%s]:" % cfg.listen if ":" in cfg.listen else cfg.listen + ":"
    bad = [a for a in got if not a.startswith(want) and not a.startswith(tuple(also))]
    if bad or not any(a.startswith(want) for a in got):
        return ["%s listens on %s, expected %s*%s" % (
            who, ", ".join(got) or "nothing", want,
            "".join(" or %s*" % a for a in also))]
    return []


# ---------------------------------------------------------------- reference

def owned_heads(tp, rank, heads):
    """SGLang's KV head ownership: heads split evenly, replicated when tp > heads."""
    if tp <= heads:
        return rank * heads // tp, heads // tp
    return rank // (tp // heads), 1


def pattern(room, layer, role, ghead0, nheads, tokens, hb):
    """Reference bytes [len(tokens), nheads, hb] of a request's KV."""
    t = np.asarray(tokens, dtype=np.int64)[:, None, None]
    h = (ghead0 + np.arange(nheads, dtype=np.int64))[None, :, None]
    b = np.arange(hb, dtype=np.int64)[None, None, :]
    v = (room % 1009) * 11 + layer * 31 + role * 17 + h * 13 + t * 5 + b * 3
    return (v % 200).astype(np.uint8)


def as_np(t):
    if hasattr(t, "detach"):
        return t.detach().cpu().numpy()
    return np.asarray(t)


# ---------------------------------------------------------------- configuration

class Cfg(types.SimpleNamespace):
    """A scenario: model, topologies and requests."""


def server_args(cfg, side, port, tp, dp=1, dp_attn=False, pp=1):
    return types.SimpleNamespace(
        tp_size=tp, dp_size=dp, enable_dp_attention=dp_attn, pp_size=pp, attn_cp_size=1,
        host=cfg.host, port=port, nnodes=1, dist_init_addr=None,
        disaggregation_bootstrap_port=getattr(cfg, "boot_port", 0), disaggregation_ib_device=None,
        disaggregation_transfer_backend="kvwire", disaggregation_mode=side,
        disaggregation_decode_enable_radix_cache=False, optimistic_prefill_attempts=cfg.optimistic,
        load_balance_method="follow_bootstrap_room", kv_cache_dtype="auto",
        get_model_config=lambda: cfg.model_config)


def model_config(cfg):
    hf = types.SimpleNamespace(num_hidden_layers=cfg.layers, num_key_value_heads=cfg.heads)
    if cfg.swa:
        hf.layer_types = ["sliding_attention" if i in cfg.swa else "full_attention"
                          for i in range(cfg.layers)]
        hf.sliding_window = cfg.hf_window
    return types.SimpleNamespace(hf_text_config=hf, num_hidden_layers=cfg.layers,
                                 get_total_num_kv_heads=lambda: cfg.heads)


def make_pools(cfg, tp, rank, fill, pp_range=None):
    import torch
    MHAPool, MLAPool, SWAPool, HybridPool = S.fakes.mem_classes()
    first, nh = owned_heads(tp, rank, cfg.heads) if not cfg.mla else (0, 1)
    lo, hi = pp_range or (0, cfg.layers)
    full_layers = [i for i in range(lo, hi) if i not in cfg.swa]
    swa_layers = [i for i in range(lo, hi) if i in cfg.swa]
    if cfg.mla:
        pool = MLAPool(torch, cfg.ps, cfg.pages, len(full_layers), cfg.hb, fill, DEVICE, lo, hi)
    else:
        pool = MHAPool(torch, cfg.ps, cfg.pages, len(full_layers), nh, cfg.hb, fill, DEVICE,
                       lo, hi)
        if swa_layers:
            swa = MHAPool(torch, cfg.ps, cfg.pages, len(swa_layers), nh, cfg.hb, fill, DEVICE,
                          lo, hi)
            pool = SWAPool(pool, swa)
    kv_pool = pool
    states = []
    if cfg.mamba:
        # GDN-like: conv state with [q | k | v] sub-blocks of 4, 4 and 8 units of 3 bytes,
        # temporal state of 4 heads of 6 bytes, over cfg.mamba layers, MAMBA_SLOTS slots.
        conv_sub, t_heads = (4, 4, 8), 4
        conv_local = sum(c // tp for c in conv_sub)
        th_local = max(1, t_heads // tp)
        conv = tensor_u8((cfg.mamba, MAMBA_SLOTS, conv_local, 3), fill)
        temporal = tensor_u8((cfg.mamba, MAMBA_SLOTS, th_local, 6), fill)
        pool = HybridPool(pool, [conv, temporal], [conv_local, th_local], [list(conv_sub), None])
        for i in range(cfg.mamba):
            states.append((300 + i, conv[i], state_units(conv_sub, tp, rank)))
            states.append((400 + i, temporal[i], state_units((t_heads,), tp, rank)))
    draft = None
    if cfg.draft and hi == cfg.layers:
        draft = (MLAPool(torch, cfg.ps, cfg.pages, cfg.draft, cfg.hb, fill, DEVICE) if cfg.mla
                 else MHAPool(torch, cfg.ps, cfg.pages, cfg.draft, nh, cfg.hb, fill, DEVICE))
    # (layer id for the pattern, role, tensor list index, pool object, is_swa)
    views = []
    full_pool = kv_pool.full_kv_pool if swa_layers else kv_pool
    for j, l in enumerate(full_layers):
        for role, name in ((0, "k"), (1, "v")) if not cfg.mla else ((2, "kv"),):
            views.append((l, role, full_pool.layers.bufs[name][j], False))
    for j, l in enumerate(swa_layers):
        for role, name in ((0, "k"), (1, "v")):
            views.append((l, role, kv_pool.swa_kv_pool.layers.bufs[name][j], True))
    if draft is not None:
        for j in range(cfg.draft):
            for role, name in ((0, "k"), (1, "v")) if not cfg.mla else ((2, "kv"),):
                views.append((100 + j, role, draft.layers.bufs[name][j], False))
    return pool, draft, views + states, first, nh


MAMBA_SLOTS = 70


def tensor_u8(shape, fill):
    import torch
    if DEVICE == "cuda":
        return torch.full(shape, fill, dtype=torch.uint8, device="cuda")
    return torch.full(shape, fill, dtype=torch.uint8)


def state_units(sub, tp, rank):
    """Global unit index of each local unit of a state row: each sub-block sharded on its
    own (SGLang's GDN conv state), side by side."""
    out, base = [], 0
    for full in sub:
        f, c = owned_heads(tp, rank, full)
        out += list(range(base + f, base + f + c))
        base += full
    return np.array(out, dtype=np.int64)


def state_pattern(room, layer, units, ub):
    u = units[:, None]
    b = np.arange(ub, dtype=np.int64)[None, :]
    return (((room % 1009) * 11 + layer * 31 + 4 * 17 + u * 13 + b * 3) % 200).astype(np.uint8)


def mamba_slot(idx):
    return (int(idx) * 7) % (MAMBA_SLOTS - 1) + 1


def scheduler_common(cfg, sa, tp_rank, dp_rank):
    import torch
    sch = types.SimpleNamespace()
    sch.server_args = sa
    sch.model_config = cfg.model_config
    sch.ps = types.SimpleNamespace(dp_rank=dp_rank, gpu_id=0, tp_rank=tp_rank, pp_rank=0)
    sch.attn_cp_cpu_group = sch.attn_tp_cpu_group = None
    sch.output_streamer = types.SimpleNamespace(stream_output=lambda *a, **k: None)
    sch.metrics_reporter = types.SimpleNamespace(enable_metrics=False)
    sch.enable_hicache_storage = False
    sch.tree_cache = None
    sch.sliding_window_size = cfg.sched_window
    sch.enable_overlap = False
    sch.enable_staging = False
    del torch
    return sch


# ---------------------------------------------------------------- prefill rank

def prefill_rank(cfg, inst, tp_rank, dp_rank, pp_rank, out):
    name = "prefill %d.%d.%d.%d" % (inst, dp_rank, pp_rank, tp_rank)
    try:
        out.put((name,) + run_prefill(cfg, inst, tp_rank, dp_rank, pp_rank))
    except BaseException:
        out.put((name, False, traceback.format_exc()))


def run_prefill(cfg, inst, tp_rank, dp_rank, pp_rank=0):
    import torch
    os.environ.update(cfg.env)
    U, P, fk = S.U, S.P, S.fakes
    tp = cfg.ptp
    gtp = tp * cfg.pdp if cfg.pdp_attn else tp
    sa = server_args(cfg, "prefill", 30000 + inst, gtp, cfg.pdp, cfg.pdp_attn, cfg.ppp)
    cut = cfg.layers // 2 + 1
    pp_range = None if cfg.ppp == 1 else ((0, cut), (cut, cfg.layers))[pp_rank]
    if cfg.pdp > 1 and not cfg.pdp_attn:
        sa.tp_size = tp
    pool, draft, views, first, nh = make_pools(cfg, tp, tp_rank, fk.JUNK, pp_range)
    alloc = fk.Allocator(pool, cfg.ps, cfg.pages, seed=1000 + inst * 10 + tp_rank,
                         swa_pages=cfg.pages if cfg.swa else 0)
    rtp = fk.ReqToTokenPool(torch, 64, cfg.max_len + cfg.ps)
    rtp.req_index_to_mamba_index_mapping = torch.tensor(
        [mamba_slot(i) for i in range(66)], dtype=torch.int32)
    md = U.MetadataBuffers(16, hidden_size=8, hidden_states_dtype=torch.float32)
    mda = U.ReqToMetadataIdxAllocator(16)

    class Sched(P.SchedulerDisaggregationPrefillMixin):
        pass
    sch = Sched()
    sch.__dict__.update(vars(scheduler_common(cfg, sa, tp_rank + (dp_rank * tp if cfg.pdp_attn else 0), dp_rank)))
    sch.token_to_kv_pool_allocator = alloc
    sch.req_to_token_pool = rtp
    sch.disagg_metadata_buffers = md
    sch.req_to_metadata_buffer_idx_allocator = mda
    sch.disagg_prefill_inflight_queue = []
    sch.waiting_queue = []
    sch.tp_worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(
        effective_max_total_num_tokens=cfg.pages * cfg.ps))
    engine_rank = tp_rank + (dp_rank * tp if cfg.pdp_attn else 0)
    q = P.PrefillBootstrapQueue(pool, draft, mda, md, engine_rank, gtp, 0, cfg.boot_port, None,
                                cfg.pages * cfg.ps, sch, pp_rank, cfg.ppp,
                                U.TransferBackend.KVWIRE)
    sch.disagg_prefill_bootstrap_queue = q
    mine = [r for r in cfg.requests if r["prefill"] == inst and
            (cfg.pdp == 1 or r["room"] % cfg.pdp == dp_rank)]
    reqs = {}
    for r in mine:
        req = fk.Req(r["rid"], range(r["len"]), r["room"], cfg.host, None)
        reqs[r["rid"]] = req
        q.add(req, nh)
        if r.get("abort") == "prefill-after-add":
            req.disagg_kv_sender.abort()    # e.g. the client went away while bootstrapping
    final = {}
    when = {}
    waiting = []
    t0 = time.monotonic()
    deadline = t0 + DEADLINE
    aborted = set()
    while len(final) < len(mine) and time.monotonic() < deadline:
        for req in q.pop_bootstrapped():
            waiting.append(req)
        for req in list(waiting):
            spec = next(r for r in mine if r["rid"] == req.rid)
            if spec.get("abort") == "prefill-before-send" and req.rid not in aborted:
                req.disagg_kv_sender.abort()
                aborted.add(req.rid)
            forward(cfg, sch, req, views, first, nh, alloc, rtp, spec)
            waiting.remove(req)
            sch.disagg_prefill_inflight_queue.append(req)
        for req in sch.process_disagg_prefill_inflight_queue():
            ok = not isinstance(req.finished_reason, fk.FINISH_ABORT)
            final[req.rid] = "ok" if ok else "failed"
            when[req.rid] = time.monotonic() - t0
        for req in list(reqs.values()):
            if req.rid not in final and isinstance(req.finished_reason, fk.FINISH_ABORT) and \
                    req not in sch.disagg_prefill_inflight_queue and req not in waiting and \
                    req not in q.queue:
                final[req.rid] = "failed"
                when[req.rid] = time.monotonic() - t0
        time.sleep(0.002)
    errs = []
    for r in mine:
        want = r.get("prefill_expect", r["expect"])
        got = final.get(r["rid"], "pending")
        if want != got and not (want == "any" and got in ("ok", "failed")):
            errs.append("room %d (%d tokens): prefill ended %s, expected %s"
                        % (r["room"], r["len"], got, want))
        elif r.get("abort") and got == "failed" and when[r["rid"]] > ABORT_BOUND:
            errs.append("room %d (%s): the prefill failed after %.1f s, not within %.0f s"
                        % (r["room"], r["abort"], when[r["rid"]], ABORT_BOUND))
    # The library's tcp data listener of a prefill context (which only sends) binds
    # 127.0.0.1 whatever listen_host says; its control listener, the address decode
    # ranks reach it at, is on cfg.listen.
    errs += check_listeners(cfg, "prefill rank", ("127.0.0.1:",))
    q.kv_manager.close()
    if os.environ.get("KVW_SGLANG_VERBOSE"):
        for r in mine:
            print("  prefill saw room %d (%s) end %s after %.2f s"
                  % (r["room"], r.get("abort", "-"), final.get(r["rid"]),
                     when.get(r["rid"], -1)), flush=True)
    return (not errs, "\n".join(errs) or "%d requests" % len(mine))


def forward(cfg, sch, req, views, first, nh, alloc, rtp, spec):
    """The prefill forward pass: allocates the request's KV, writes its pattern, and
    sends it chunk by chunk through SGLang's send_kv_chunk.

    On CUDA the writes are kernels on the current stream and the pass does not
    synchronize before sending (an engine that forgot to; SGLang's scheduler
    synchronizes on copy_done first); cfg.slow puts a ~100 ms GPU sleep ahead of them, so
    that a backend reading before they ran reads junk. A request with "cached_prefix"
    (prefill-side radix hit, page-aligned) goes through SGLang's early send of the cached
    prefix (maybe_send_cached_prefix_chunk) before the rest is written; on CUDA the
    prefix is written on a forward stream as SGLang's overlap scheduler does, and SGLang
    hands the backend the event it records there (_early_send_wait_event); the stream is
    synchronized before the rest is sent, as copy_done is."""
    import contextlib
    import torch
    fk = S.fakes
    L = len(req.origin_input_ids)
    pre = spec.get("cached_prefix", 0)
    if req.req_pool_idx is None:
        rtp.alloc([req])
        locs = alloc.alloc_tokens(L)
        fk.assign(rtp.req_to_token, (req.req_pool_idx, slice(0, L)), locs)
        locs = np.asarray(locs)
        cuda = DEVICE == "cuda"
        fs = (torch.cuda.Stream() if pre else torch.cuda.current_stream()) if cuda else None
        on_fs = (lambda: torch.cuda.stream(fs)) if cuda else contextlib.nullcontext
        first_part = kv_writes(cfg, req, views, first, nh, alloc, locs, 0, pre or L)
        rest = kv_writes(cfg, req, views, first, nh, alloc, locs, pre, L) if pre else []
        with on_fs():
            if cuda and cfg.slow:
                torch.cuda._sleep(SLOW_CYCLES)
            write_kv(first_part)
        if pre:
            req.prefix_indices = locs[:pre]
            req.host_hit_length = 0
            sch.enable_overlap, sch.forward_stream = cuda, fs
            sch.maybe_send_cached_prefix_chunk(req)
            sch.enable_overlap = False
            if req.start_send_idx != pre:
                raise AssertionError("room %d: SGLang's early send of the cached prefix did "
                                     "not send tokens [0, %d)" % (req.bootstrap_room, pre))
            with on_fs():
                write_kv(rest)
            if cuda:
                fs.synchronize()
    req.output_ids = [1000 + req.bootstrap_room % 1000]
    req.cached_tokens = req.bootstrap_room % 7
    if cfg.draft:
        req.hidden_states_tensor = torch.tensor(np.arange(8, dtype=np.float32) + req.bootstrap_room % 5)
        req.output_topk_p = torch.tensor(np.ones(2, dtype=np.float32))
        req.output_topk_index = torch.tensor(np.arange(2, dtype=np.int64))
    chunk = spec.get("chunk") or L
    pos = pre
    while pos + chunk < L:
        pos += chunk
        req.set_extend_range(pos - chunk, pos)
        if not req.pending_bootstrap:
            sch.send_kv_chunk(req)
    req.set_extend_range(pos, L)
    if not req.pending_bootstrap:
        sch.send_kv_chunk(req, last_chunk=True)


def kv_writes(cfg, req, views, first, nh, alloc, locs, t0, t1):
    """The writes of the pattern of tokens [t0, t1) of the request into every KV view,
    and of its state (the state slot) along with the last token: (buffer, locations,
    values), the values already where the buffer is (on CUDA, copied to the GPU now, so
    that writing them later is a kernel alone and the host does not wait for it)."""
    out = []
    for v in views:
        if len(v) == 3:       # a state tensor: the request's slot
            if t1 == len(req.origin_input_ids):
                layer, buf, units = v
                out.append((buf, [mamba_slot(req.req_pool_idx)],
                            state_pattern(req.bootstrap_room, layer, units, buf.shape[-1])[None]))
            continue
        if t0 == t1:
            continue
        layer, role, buf, is_swa = v
        lc = locs[t0:t1]
        if is_swa:
            lc = np.asarray(alloc.translate_loc_from_full_to_swa(lc))
        out.append((buf, lc, pattern(req.bootstrap_room, layer, role, first, nh, range(t0, t1),
                                     cfg.hb)))
    return [staged(buf, lc, val) for buf, lc, val in out]


def staged(buf, locs, val):
    """One write (buffer, locations, values) with its locations and values where the
    buffer is (on CUDA, copied to the GPU now)."""
    if DEVICE == "cuda":
        import torch
        return (buf, torch.tensor(np.asarray(locs), dtype=torch.int64, device="cuda"),
                torch.tensor(val, device="cuda"))
    return (buf, np.asarray(locs), val)


def write_kv(writes):
    for buf, lc, val in writes:
        buf[lc] = val


# ---------------------------------------------------------------- decode rank

def decode_rank(cfg, inst, tp_rank, out):
    try:
        out.put(("decode %d.%d" % (inst, tp_rank),) + run_decode(cfg, inst, tp_rank))
    except BaseException:
        out.put(("decode %d.%d" % (inst, tp_rank), False, traceback.format_exc()))



def decode_launcher(cfg, inst, out):
    ctx = mp.get_context("fork")
    ranks = [ctx.Process(target=decode_rank, args=(cfg, inst, r, out))
             for r in range(cfg.dtp * cfg.ddp)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join()


def run_decode(cfg, inst, tp_rank):
    # tp_rank: the global rank; with decode DP (cfg.ddp > 1) rank g * dtp + r is
    # attention-TP rank r of DP group g (DP attention) or of replica g (plain DP).
    import torch
    os.environ.update(cfg.env)
    group, tp_rank = divmod(tp_rank, cfg.dtp)
    U, D, fk = S.U, S.D, S.fakes
    tp = cfg.dtp
    fk.PARALLEL.attn_tp_size = tp
    if cfg.ddp > 1 and cfg.ddp_attn:
        sa = server_args(cfg, "decode", 40000 + inst, tp * cfg.ddp, cfg.ddp, True)
    else:
        sa = server_args(cfg, "decode", 40000 + (inst if not cfg.alike else 0), tp, cfg.ddp)
    pool, draft, views, first, nh = make_pools(cfg, tp, tp_rank, fk.SENTINEL)
    alloc = fk.Allocator(pool, cfg.ps, cfg.pages, seed=2000 + inst * 10 + tp_rank,
                         swa_pages=cfg.pages if cfg.swa else 0)
    md = U.MetadataBuffers(16, hidden_size=8, hidden_states_dtype=torch.float32)
    mda = U.ReqToMetadataIdxAllocator(16)
    rtp = D.DecodeReqToTokenPool(size=32, max_context_len=cfg.max_len + cfg.ps, device="cpu",
                                 enable_memory_saver=False, pre_alloc_size=32)
    rtp.req_index_to_mamba_index_mapping = torch.tensor(
        [mamba_slot(i) for i in range(rtp._alloc_size)], dtype=torch.int32)
    sch = types.SimpleNamespace(**vars(scheduler_common(
        cfg, sa, tp_rank, group if cfg.ddp > 1 else None)))
    sch.spec_algorithm = types.SimpleNamespace(is_none=lambda: not cfg.draft)
    sch.enable_decode_hicache = sch.enable_hisparse = False
    sch.enable_priority_scheduling = False
    sch.running_batch = types.SimpleNamespace(reqs=[])
    sch.waiting_queue = []
    sch.last_batch = None
    sch.tp_worker = types.SimpleNamespace(is_hybrid_swa=bool(cfg.swa), model_runner=types.SimpleNamespace(
        swa_max_total_num_tokens=cfg.pages * cfg.ps))
    tree = fk.TreeCache()
    sa.disaggregation_decode_enable_radix_cache = cfg.radix
    paths = set()
    orig_clear = S.ks.KVReceiver.clear

    def clear(rv):
        # The data path kvwire took (e.g. "tcp", "cuda_ipc"), before SGLang's clear().
        if rv._room is not None and rv.poll() == S.ks.KVPoll.Success:
            paths.add(rv._room.metrics().path)
        orig_clear(rv)
    S.ks.KVReceiver.clear = clear
    tq = D.DecodeTransferQueue(None, mda, tp_rank, md, sch, tree)
    gtp = group * tp + tp_rank if cfg.ddp_attn else tp_rank
    pq = D.DecodePreallocQueue(rtp, alloc, draft, mda, md, sch, tq, tree, None, gtp,
                               tp * cfg.ddp if cfg.ddp_attn else tp, cfg.ddp, 0,
                               None, cfg.pages * cfg.ps, 0, 0, U.TransferBackend.KVWIRE)
    mine = [r for r in cfg.requests if r["decode"] == inst and
            (cfg.ddp == 1 or r["room"] % cfg.ddp == group)]
    cached = {}
    for r in mine:
        if r.get("prefix"):
            # A prefix this decode already holds (an earlier request's pages): its
            # bytes are a marker pattern kvwire must leave alone.
            locs = alloc.alloc_tokens(r["prefix"])
            fk.RADIX[r["rid"]] = locs
            cached[r["rid"]] = locs
            for v in views:
                if len(v) == 4:
                    layer, role, buf, is_swa = v
                    val = pattern(r["room"] + 1, layer, role, first, nh, range(r["prefix"]),
                                  cfg.hb)
                    put(buf, locs, val)
    reqs = {}
    for r in mine:
        req = fk.Req(r["rid"], range(r["len"]), r["room"], cfg.host,
                     cfg.boot_ports[r["prefill"]], dp_rank=r.get("dp_rank"))
        reqs[r["rid"]] = req
        pq.add(req)
        dr = pq.queue[-1]
        if r.get("abort") == "decode-after-add":
            dr.kv_receiver.abort()
        elif r.get("abort") == "decode-after-init":
            rv = dr.kv_receiver
            orig_init = rv.init

            def init_then_abort(*a, _rv=rv, _init=orig_init, **k):
                _init(*a, **k)
                _rv.abort()
            rv.init = init_then_abort
    done, failed, ended = {}, {}, {}
    t0 = time.monotonic()
    deadline = t0 + DEADLINE
    while len(done) + len(failed) < len(mine) and time.monotonic() < deadline:
        pre, fl = pq.pop_preallocated()
        for dr in fl:
            failed[dr.req.rid] = dr.req
        for dr in pre:
            spec = next(r for r in mine if r["rid"] == dr.req.rid)
            if spec.get("abort") == "decode-after-post":
                dr.kv_receiver.abort()
        tq.extend(pre)
        for req in tq.pop_transferred():
            done[req.rid] = req
        for dr in list(tq.queue) + list(pq.queue):
            pass
        for rid, req in reqs.items():
            if rid not in done and rid not in failed and \
                    isinstance(req.finished_reason, fk.FINISH_ABORT) and \
                    all(d.req is not req for d in tq.queue):
                in_pq = any(d.req is req for d in pq.queue)
                if not in_pq:
                    failed[rid] = req
        time.sleep(0.002)
        for rid in failed:
            ended.setdefault(rid, time.monotonic() - t0)
    errs = []
    for r in mine:
        got = "ok" if r["rid"] in done else "failed" if r["rid"] in failed else "pending"
        want = r["expect"]
        if want != got and not (want == "failed-any" and got == "failed"):
            errs.append("room %d (%d tokens): decode ended %s, expected %s"
                        % (r["room"], r["len"], got, want))
        elif r.get("abort") and got == "failed" and ended[r["rid"]] > ABORT_BOUND:
            errs.append("room %d (%s): the decode failed after %.1f s, not within %.0f s"
                        % (r["room"], r["abort"], ended[r["rid"]], ABORT_BOUND))
    # A request the decode aborted after posting its pages may have been written before
    # the abort reached the prefill: its pages hold the reference or their old bytes.
    partial = [reqs[r["rid"]] for r in mine if r.get("abort") == "decode-after-post" and
               r["rid"] in failed and reqs[r["rid"]].req_pool_idx is not None]
    errs += check_bytes(cfg, [reqs[rid] for rid in done], views, first, nh, alloc, rtp, md,
                        cached, partial)
    errs += check_listeners(cfg, "decode rank")
    iid = pq.kv_manager.instance_id
    mem = pq.kv_manager.mem_kind.name
    pq.kv_manager.close()
    return (not errs, "\n".join(errs[:20]) or "%d requests, every byte checked" % len(mine),
            iid, "%s memory, paths %s" % (mem, ",".join(sorted(paths)) or "-"))


def put(buf, locs, val):
    write_kv([staged(buf, locs, val)])


def check_bytes(cfg, done, views, first, nh, alloc, rtp, md, cached=None, partial=()):
    cached = cached or {}
    errs = []
    ps = cfg.ps
    for v in views:
        if len(v) == 3:
            layer, buf, units = v
            arr = as_np(buf)
            expect = np.full(arr.shape, S.fakes.SENTINEL, dtype=np.uint8)
            for req in done:
                expect[mamba_slot(req.req_pool_idx)] = state_pattern(
                    req.bootstrap_room, layer, units, arr.shape[-1])
            bad = np.nonzero((arr != expect).reshape(arr.shape[0], -1).any(axis=1))[0]
            if len(bad):
                errs.append("state layer %d: %d slots differ, first slot %d: %s, expected %s"
                            % (layer, len(bad), bad[0], arr[bad[0]].ravel()[:8].tolist(),
                               expect[bad[0]].ravel()[:8].tolist()))
            continue
        layer, role, buf, is_swa = v
        arr = as_np(buf)
        expect = np.full(arr.shape, S.fakes.SENTINEL, dtype=np.uint8)
        free = np.ones(arr.shape[0], dtype=bool)
        if is_swa:
            # SGLang's padding page: it takes the SWA window's spill-over.
            free[:ps] = False
        alt = None
        for req in list(done) + [None] + list(partial):
            if req is None:     # the rest may also hold the reference
                alt = expect.copy()
                continue
            L = len(req.origin_input_ids)
            N = -(-L // ps) * ps
            locs = np.asarray(rtp.req_to_token[req.req_pool_idx, :L]).astype(np.int64)
            page_locs = np.array([p * ps + i for p in sorted(set((locs // ps).tolist()), key=list(locs // ps).index)
                                  for i in range(ps)], dtype=np.int64)[:N]
            toks = np.arange(N)
            if is_swa:
                w0 = max(0, L - cfg.sched_window) // ps * ps
                sel = toks >= w0
                page_locs = np.asarray(alloc.translate_loc_from_full_to_swa(page_locs)).astype(np.int64)
                page_locs, toks = page_locs[sel], toks[sel]
            ref = pattern(req.bootstrap_room, layer, role, first, nh, toks, cfg.hb)
            ref[toks >= L] = S.fakes.JUNK
            pre = len(cached.get(req.rid, ()))
            if pre and not is_swa:
                ref[toks < pre] = pattern(req.bootstrap_room + 1, layer, role, first, nh,
                                          toks[toks < pre], cfg.hb)
            (expect if alt is None else alt)[page_locs] = ref
            free[page_locs] = True
        diff = (arr != expect).any(axis=(1, 2))
        if alt is not None:
            diff &= (arr != alt).any(axis=(1, 2))
        bad = np.nonzero(diff & free)[0]
        if len(bad):
            errs.append("layer %d role %d%s: %d slots differ from the reference, first slot %d: "
                        "%s, expected %s" % (layer, role, " (SWA pool)" if is_swa else "",
                                             len(bad), bad[0], arr[bad[0]].ravel()[:8].tolist(),
                                             expect[bad[0]].ravel()[:8].tolist()))
    for req in done:
        want = 1000 + req.bootstrap_room % 1000
        if not req.output_ids or req.output_ids[-1] != want:
            errs.append("room %d: output id %r, expected %d" % (req.bootstrap_room,
                                                                req.output_ids[-1:], want))
        if req.cached_tokens != req.bootstrap_room % 7:
            errs.append("room %d: cached_tokens %r" % (req.bootstrap_room, req.cached_tokens))
        if cfg.draft:
            hs = as_np(req.hidden_states_tensor)
            if not np.array_equal(hs, np.arange(8, dtype=np.float32) + req.bootstrap_room % 5):
                errs.append("room %d: hidden states %r" % (req.bootstrap_room, hs.tolist()))
    return errs


def bootstrap_proc(cfg, port, delay, stop):
    time.sleep(delay)
    cls = S.U.get_kv_class(S.U.TransferBackend.KVWIRE, S.U.KVClassType.BOOTSTRAP_SERVER)
    srv = cls(host=cfg.host, port=port)
    stop.wait(DEADLINE + 30)
    srv.close()


# ---------------------------------------------------------------- scenarios

def requests(n_prefill=1, n_decode=1, lens=(1, 7, 16, 17, 45, 130), seed=0, **extra):
    rng = np.random.default_rng(seed)
    out = []
    i = 0
    for p in range(n_prefill):
        for d in range(n_decode):
            for L in lens:
                out.append(dict(rid="r%d" % i, room=int(rng.integers(1, 2 ** 62)), len=L,
                                prefill=p, decode=d, expect="ok", **extra))
                i += 1
    return out


def scenario(name, **kw):
    base = dict(layers=3, heads=4, hb=8, ps=1, pages=600, ptp=1, dtp=1, pdp=1, pdp_attn=False,
                mla=False, swa=(), hf_window=0, sched_window=None, draft=0, optimistic=0,
                n_prefill=1, n_decode=1, alike=False, late=0.0, max_len=260, env={}, ppp=1,
                mamba=0, ddp=1, ddp_attn=False,
                radix=False, host="127.0.0.1", listen=None, slow=False)
    base.update(kw)
    cfg = Cfg(name=name, **base)
    if cfg.mla:
        cfg.heads = 1
    if "requests" not in kw:
        cfg.requests = requests(cfg.n_prefill, cfg.n_decode)
    return cfg


SCENARIOS = [
    scenario("mha_tp1_tp2", ptp=1, dtp=2),
    scenario("mha_tp2_tp1_ps16", ptp=2, dtp=1, ps=16, pages=80),
    scenario("gqa_replicated_tp1_tp4", heads=2, ptp=1, dtp=4),
    scenario("mla_tp1_tp2", mla=True, ptp=1, dtp=2, hb=16),
    scenario("mla_tp2_tp1", mla=True, ptp=2, dtp=1, hb=16, ps=16, pages=80),
    scenario("gptoss_swa_ps1", layers=4, swa=(0, 2), hf_window=128, sched_window=127),
    scenario("gptoss_swa_ps16_tp1_tp2", layers=4, swa=(0, 2), hf_window=128, sched_window=127,
             ps=16, pages=80, dtp=2),
    scenario("chunked_ps16", ps=16, pages=80, requests=requests(chunk=20)),
    scenario("two_prefill_instances", n_prefill=2, ptp=2, dtp=1),
    scenario("two_decode_instances_alike", n_decode=2, alike=True),
    scenario("speculative_draft_kv", draft=1),
    scenario("bootstrap_server_late", late=2.0),
    scenario("dp_attention_prefill", ptp=1, pdp=2, pdp_attn=True, dtp=1,
             env={"KVWIRE_SGLANG_PREFILL_DP_SIZE": "2"}),
    scenario("plain_dp_prefill", ptp=2, pdp=2, pdp_attn=False, dtp=1,
             env={"KVWIRE_SGLANG_PREFILL_DP_SIZE": "2"}),
    scenario("optimistic_prefill", optimistic=2, ps=16, pages=80, requests=requests(chunk=20)),
    scenario("pp2_prefill", layers=5, ppp=2, ptp=2, dtp=1, ps=16, pages=80),
    scenario("pp2_prefill_swa", layers=5, swa=(1, 3), hf_window=128, sched_window=127, ppp=2,
             dtp=2),
    # On CUDA: the forward's writes still run on the GPU when it sends (slow), and the
    # cached prefix sent early while the forward stream writes it (SGLang's default,
    # SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX); on the CPU, plain runs of the same.
    scenario("unsynchronized_forward", layers=5, ppp=2, ptp=2, dtp=1, ps=16, pages=80,
             slow=True),
    scenario("prefill_cached_prefix_early_send", ps=16, pages=80, dtp=2, slow=True,
             requests=[dict(r, cached_prefix=p) for r, p in zip(
                 requests(lens=(40, 64, 33, 17, 100, 9)), (32, 48, 16, 0, 64, 0))]),
    scenario("mamba_gdn_hybrid_tp1_tp2", layers=2, mamba=3, ptp=1, dtp=2, ps=16, pages=80),
    scenario("mamba_gdn_hybrid_tp2_tp1", layers=2, mamba=3, ptp=2, dtp=1),
    scenario("dp_attention_decode", dtp=1, ddp=2, ddp_attn=True, ptp=2),
    scenario("plain_dp_decode", dtp=2, ddp=2, ptp=1),
    scenario("decode_radix_prefix", ps=16, pages=80, radix=True,
             requests=[dict(r, prefix=p) for r, p in zip(
                 requests(lens=(40, 64, 33, 17, 100, 9)), (16, 32, 0, 16, 48, 0))]),
    # SGLang's own timeouts (300 s): an abort that did not reach the other side at once
    # would leave its request pending past the check's deadline.
    scenario("aborts", ps=16, pages=80,
             requests=[dict(r, **a) for r, a in zip(
                 requests(lens=(17, 40, 33, 50, 64, 9, 20, 30)),
                 [{}, dict(abort="decode-after-add", expect="failed"),
                  dict(abort="decode-after-post", expect="failed", prefill_expect="any"),
                  dict(abort="prefill-before-send", expect="failed"), {}, {},
                  dict(abort="decode-after-init", expect="failed"),
                  dict(abort="prefill-after-add", expect="failed")])]),
    # IPv6: the prefill's bootstrap server at [::1], SGLang's "[::1]:port" bootstrap
    # addresses, every rank listening on ::1 (SGLang's SGLANG_HOST_IP), aborts included.
    scenario("ipv6_loopback", ptp=1, dtp=2, host="::1", listen="::1",
             env={"SGLANG_HOST_IP": "::1"},
             requests=[dict(r, **a) for r, a in zip(
                 requests(lens=(17, 40, 33, 130, 1)),
                 [{}, dict(abort="decode-after-add", expect="failed"),
                  dict(abort="prefill-before-send", expect="failed"), {}, {}])]),
]


def run(cfg):
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    if cfg.host == "::1" and ipv6_loopback():
        print("SKIP %s: no IPv6 loopback on this machine (%s)" % (cfg.name, ipv6_loopback()))
        return True
    cfg.boot_ports = [free_port(cfg.host) for _ in range(cfg.n_prefill)]
    cfg.model_config = model_config(cfg)
    stop = ctx.Event()
    procs = []
    for p in range(cfg.n_prefill):
        procs.append(ctx.Process(target=bootstrap_proc, args=(cfg, cfg.boot_ports[p], cfg.late, stop)))
    n = 0
    for p in range(cfg.n_prefill):
        c = Cfg(**vars(cfg))
        c.boot_port = cfg.boot_ports[p]
        for dpr in range(cfg.pdp):
            for ppr in range(cfg.ppp):
                for r in range(cfg.ptp):
                    procs.append(ctx.Process(target=prefill_rank, args=(c, p, r, dpr, ppr, out)))
                    n += 1
    for d in range(cfg.n_decode):
        # One launcher per decode instance, as SGLang's engine process spawns its
        # schedulers: the ranks of one instance share it, two instances do not.
        procs.append(ctx.Process(target=decode_launcher, args=(cfg, d, out)))
        n += cfg.dtp * cfg.ddp
    t0 = time.monotonic()
    for pr in procs:
        pr.start()
    results = []
    for _ in range(n):
        try:
            results.append(out.get(timeout=DEADLINE + 30))
        except Exception:
            results.append(("?", False, "no result (a rank hung or died)"))
    stop.set()
    for pr in procs:
        pr.join(10)
        if pr.is_alive():
            pr.kill()
    ok = all(r[1] for r in results)
    ids = {}
    for r in results:
        if r[0].startswith("decode") and len(r) > 3:
            ids.setdefault(r[0].split()[1].split(".")[0], set()).add(r[3])
    if any(len(v) != 1 for v in ids.values()) or \
            len(set().union(*ids.values()) if ids else ()) != len(ids):
        ok = False
        results.append(("instance ids", False, "decode instance ids %r: one per instance, "
                        "distinct between instances, expected" % ids))
    how = sorted(set(r[4] for r in results if len(r) > 4))
    print("%s %s (%.1f s%s)" % ("PASS" if ok else "FAIL", cfg.name, time.monotonic() - t0,
                                "; decode: " + "; ".join(how) if how else ""))
    for r in results:
        if not r[1]:
            print("   %s: %s" % (r[0], r[2].replace("\n", "\n      ")))
    return ok


def check_register():
    """get_kv_class of SGLang's real utils.py returns kvwire's classes after register()."""
    U, ks = S.U, S.ks
    tb = U.TransferBackend("kvwire")
    want = {U.KVClassType.KVARGS: ks.KVArgs, U.KVClassType.MANAGER: ks.KVManager,
            U.KVClassType.SENDER: ks.KVSender, U.KVClassType.RECEIVER: ks.KVReceiver,
            U.KVClassType.BOOTSTRAP_SERVER: ks.KVBootstrapServer}
    bad = [k for k, v in want.items() if U.get_kv_class(tb, k) is not v]
    bad += [k for k, v in want.items() if S.P.get_kv_class(tb, k) is not v]
    try:
        U.get_kv_class(U.TransferBackend.MOONCAKE, U.KVClassType.KVARGS)
    except Exception:
        pass
    ok = not bad and tb is U.TransferBackend.KVWIRE
    print("%s register (TransferBackend('kvwire') and get_kv_class of SGLang's utils.py)"
          % ("PASS" if ok else "FAIL"))
    return ok


def check_sitecustomize(src):
    """The documented step: a sitecustomize.py that calls kvwire.sglang.register(), in a
    fresh interpreter that then imports SGLang's utils.py."""
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "sitecustomize.py"), "w") as f:
            f.write("import kvwire.sglang\nkvwire.sglang.register()\n")
        code = ("import sys; sys.path.insert(0, %r); import stubs, fakes; "
                "stubs.install(%r, fakes.misc_modules(%r)); "
                "import sglang.srt.disaggregation.utils as U; import kvwire.sglang as ks; "
                "b = U.TransferBackend('kvwire'); "
                "assert U.get_kv_class(b, U.KVClassType.MANAGER) is ks.KVManager; "
                "print(b)" % (HERE, src, src))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [d, os.path.join(HERE, "..", "..")] +
            ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=60)
    ok = r.returncode == 0 and "TransferBackend.KVWIRE" in r.stdout
    print("%s sitecustomize (register() at interpreter start, then SGLang's utils.py)%s"
          % ("PASS" if ok else "FAIL", "" if ok else ": " + (r.stdout + r.stderr)[-3000:]))
    return ok


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    load(sys.argv[1])
    names = sys.argv[2:]
    ok = check_register()
    ok = check_sitecustomize(sys.argv[1]) and ok
    for cfg in SCENARIOS:
        if names and cfg.name not in names:
            continue
        ok = run(cfg) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
