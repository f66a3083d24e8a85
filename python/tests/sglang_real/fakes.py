"""Thin fakes of the SGLang objects prefill.py / decode.py receive (requests, KV pools
laid out as SGLang's memory_pool.py lays them out, allocators, the scheduler's
attributes). Written for this check from SGLang's documented behaviour; none of
SGLang's code is copied."""
import os
import types

import numpy as np

from stubs import StubModule, _Anything

P = int(os.environ.get("KVW_SGLANG_PAD", "0"))


def module(name, **attrs):
    m = StubModule(name)
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


# ---------------------------------------------------------------- schedule_batch

class FINISH_ABORT:
    def __init__(self, message=None, status_code=None, err_type=None):
        self.message, self.status_code = message, status_code


class FINISH_LENGTH:
    def __init__(self, length=0):
        self.length = length


class ReqKvInfo:
    def __init__(self, kv_allocated_len=0, swa_evicted_seqlen=0):
        self.kv_allocated_len, self.swa_evicted_seqlen = kv_allocated_len, swa_evicted_seqlen


class Range:
    def __init__(self, start=0, end=0):
        self.start, self.end = start, end


class Req:
    """The fields of SGLang's Req that the disaggregation queues read or write."""

    def __init__(self, rid, input_ids, room, host, port, dp_rank=None, max_new_tokens=4):
        self.rid = rid
        self.origin_input_ids = list(input_ids)
        self.output_ids = []
        self.bootstrap_room = room
        self.bootstrap_host = host
        self.bootstrap_port = port
        self.disagg_prefill_dp_rank = dp_rank
        self.sampling_params = types.SimpleNamespace(max_new_tokens=max_new_tokens)
        self.time_stats = _Anything()
        self.time_stats.compute_and_observe_kv_transfer_metrics = lambda m: None
        self.finished_reason = None
        self.to_finish = None
        self.finished_output = False
        self.return_logprob = False
        self.return_sampling_mask = False
        self.logprob = types.SimpleNamespace()
        self.metadata_buffer_index = -1
        self.req_pool_idx = None
        self.kv = None
        self.mamba_pool_idx = None
        self.prefill_attempt_count = 0
        self.is_retracted = False
        self.pending_bootstrap = False
        self.start_send_idx = 0
        self.tmp_end_idx = -1
        self.extend_range = Range()
        self.cached_tokens = self.cached_tokens_device = 0
        self.cached_tokens_host = self.cached_tokens_storage = 0
        self.multimodal_inputs = None
        self.hidden_states_tensor = None
        self.output_dsa_topk_indices = None
        self.priority = None
        self.seqlen = len(self.origin_input_ids)
        self.inflight_middle_chunks = 0
        self.kv_committed_len = 0
        self.is_chunked = 0
        self.host_hit_length = 0
        self.last_node = None
        self.disagg_kv_sender = None

    def set_extend_range(self, start, end):
        self.extend_range = Range(start, end)


def schedule_batch_module():
    return module("sglang.srt.managers.schedule_batch", FINISH_ABORT=FINISH_ABORT,
                  FINISH_LENGTH=FINISH_LENGTH, ReqKvInfo=ReqKvInfo, Req=Req)


# ---------------------------------------------------------------- mem_cache.common

def kv_to_page_indices(kv_indices, page_size):
    a = np.asarray(kv_indices)
    return (a[::page_size] // page_size).astype(np.int64)


def kv_to_page_num(n, page_size):
    return -(-int(n) // int(page_size))


def page_align_floor(n, page_size):
    return int(n) // int(page_size) * int(page_size)


def mem_cache_common_module():
    return module("sglang.srt.mem_cache.common", kv_to_page_indices=kv_to_page_indices,
                  kv_to_page_num=kv_to_page_num, page_align_floor=page_align_floor,
                  release_kv_cache=lambda *a, **k: None,
                  maybe_cache_unfinished_req=lambda *a, **k: None)


def get_num_new_pages(seq_lens, prefix_lens, page_size):
    s, p = int(np.asarray(seq_lens)[0]), int(np.asarray(prefix_lens)[0])
    return -(-s // page_size) - -(-p // page_size)


PARALLEL = types.SimpleNamespace(attn_tp_size=1, attn_cp_size=1, attn_dp_size=1)

# Decode radix cache: {rid: device locs of the request's cached prefix}, set by the check.
RADIX = {}


def match_prefix_for_req(tree_cache, req, ids, cow_mamba=False, include_req=False):
    import torch
    locs = RADIX.get(req.rid)
    if locs is None:
        locs = np.zeros(0, dtype=np.int64)
    return types.SimpleNamespace(device_indices=torch.tensor(locs, dtype=torch.int64),
                                 host_hit_length=0, last_device_node=None,
                                 last_host_node=None)


class TreeCache:
    """A decode radix cache holding fixed prefixes (RADIX) that nothing evicts."""

    def supports_mamba(self):
        return False

    def inc_lock_ref(self, node):
        return 0

    def dec_lock_ref(self, node):
        return 0

    def evictable_size(self):
        return 0

    def protected_size(self):
        return 0

    def evict(self, params):
        return types.SimpleNamespace(num_tokens_evicted=0)


def misc_modules(src):
    utils_dir = os.path.join(src, "sglang", "srt", "utils")
    u = StubModule("sglang.srt.utils", utils_dir)
    u.is_hip = lambda: False
    u.is_npu = lambda: False
    u.get_bool_env_var = lambda name, default="false": \
        os.environ.get(name, default).lower() in ("1", "true")
    u.get_num_new_pages = get_num_new_pages
    rc = module("sglang.srt.runtime_context", get_parallel=lambda: PARALLEL,
                get_server_args=lambda: None, get_flags=lambda: _Anything())
    msa = module("sglang.srt.utils.torch_memory_saver_adapter",
                 TorchMemorySaverAdapter=_Anything)
    sp = module("sglang.srt.managers.schedule_policy", match_prefix_for_req=match_prefix_for_req)
    return {"sglang.srt.utils": u, "sglang.srt.runtime_context": rc,
            "sglang.srt.utils.torch_memory_saver_adapter": msa,
            "sglang.srt.managers.schedule_policy": sp,
            "sglang.srt.managers.schedule_batch": schedule_batch_module(),
            "sglang.srt.mem_cache.common": mem_cache_common_module()}


# ---------------------------------------------------------------- pools

JUNK, SENTINEL = 0xAA, 0xEE


def tensor_zeros(torch, shape, fill, device):
    if device == "cuda":
        return torch.full(shape, fill, dtype=torch.uint8, device="cuda")
    return torch.full(shape, fill, dtype=torch.uint8)


class Layered:
    """SGLang's per-layer paged buffers: one [size + page_size, heads, head_bytes]
    uint8 tensor per layer and role (slot 0 .. page_size-1: the padding page)."""

    def __init__(self, torch, n_layers, slots, heads, hb, fill, device, roles=("k", "v")):
        self.bufs = {r: [tensor_zeros(torch, (slots, heads, hb), fill, device)
                         for _ in range(n_layers)] for r in roles}
        self.roles = roles


def mem_classes():
    import sglang.srt.mem_cache.memory_pool as mp
    import sglang.srt.mem_cache.base_swa_memory_pool as bs
    import sglang.srt.mem_cache.swa_memory_pool as sw

    class MHAPool:
        _unified_kv = False

        def __init__(self, torch, page_size, pages, layers, heads, hb, fill, device,
                     start_layer=0, end_layer=None):
            self.page_size, self.head_num = page_size, heads
            self.size = pages * page_size
            self.start_layer = start_layer
            self.end_layer = end_layer
            self.layers = Layered(torch, layers, (pages + 1) * page_size, heads, hb, fill,
                                  device)
            self.k_buffer, self.v_buffer = self.layers.bufs["k"], self.layers.bufs["v"]

        def get_contiguous_buf_infos(self):
            bufs = self.k_buffer + self.v_buffer
            return ([b.data_ptr() for b in bufs], [b.nbytes for b in bufs],
                    [b[0].nbytes * self.page_size for b in bufs])

    class MLAPool(mp.MLATokenToKVPool):
        _unified_kv = False

        def __getattr__(self, name):
            raise AttributeError(name)

        def __init__(self, torch, page_size, pages, layers, lat, fill, device,
                     start_layer=0, end_layer=None):
            self.page_size, self.head_num = page_size, 1
            self.start_layer, self.end_layer = start_layer, end_layer
            self.layers = Layered(torch, layers, (pages + 1) * page_size, 1, lat, fill, device,
                                  roles=("kv",))
            self.kv_buffer = self.layers.bufs["kv"]

        def get_contiguous_buf_infos(self):
            bufs = self.kv_buffer
            return ([b.data_ptr() for b in bufs], [b.nbytes for b in bufs],
                    [b[0].nbytes * self.page_size for b in bufs])

    class SWAPool(bs.BaseSWAKVPool, sw.SWAKVPool):
        _unified_kv = False

        def __getattr__(self, name):
            raise AttributeError(name)

        def __init__(self, full, swa):
            self.full_kv_pool, self.swa_kv_pool = full, swa
            self.page_size, self.head_num = full.page_size, full.head_num
            self.start_layer, self.end_layer = full.start_layer, full.end_layer

        def get_contiguous_buf_infos(self):
            return self.full_kv_pool.get_contiguous_buf_infos()

        def get_state_buf_infos(self):
            return self.swa_kv_pool.get_contiguous_buf_infos()

    class HybridPool(mp.HybridLinearKVPool):
        """SGLang's hybrid linear-attention pool: a full-attention pool plus Mamba state
        tensors [layers, slots, units, bytes per unit] (conv states, then temporal)."""
        _unified_kv = False

        def __getattr__(self, name):
            raise AttributeError(name)

        def __init__(self, full, states, dims, groups):
            self.full_kv_pool = full
            self.page_size, self.head_num = full.page_size, full.head_num
            self.start_layer, self.end_layer = full.start_layer, full.end_layer
            self.states, self.dims, self.groups = states, dims, groups

        def get_contiguous_buf_infos(self):
            return self.full_kv_pool.get_contiguous_buf_infos()

        def get_state_buf_infos(self):
            ts = [t[i] for t in self.states for i in range(t.shape[0])]
            return ([t.data_ptr() for t in ts], [t.nbytes for t in ts], [t[0].nbytes for t in ts])

        def get_state_dim_per_tensor(self):
            return [d for t, d in zip(self.states, self.dims) for _ in range(t.shape[0])]

        def get_state_conv_shard_groups(self):
            return [g for t, g in zip(self.states, self.groups) for _ in range(t.shape[0])]

    return MHAPool, MLAPool, SWAPool, HybridPool


class Allocator:
    """A page allocator over pages 1..n (page 0 is SGLang's padding page), handing pages
    out in a seeded random order; an SWA pool gets a page for each full page."""

    def __init__(self, pool, page_size, pages, seed, swa_pages=0, device="cpu"):
        rng = np.random.default_rng(seed)
        self.pool, self.page_size, self.device = pool, page_size, device
        self.free = list(rng.permutation(np.arange(1, pages + 1)))
        self.swa_free = list(rng.permutation(np.arange(1, swa_pages + 1))) if swa_pages else []
        self.full_to_swa = {}
        self.size_swa = swa_pages * page_size

    def get_kvcache(self):
        return self.pool

    def available_size(self):
        return len(self.free) * self.page_size

    def full_available_size(self):
        return self.available_size()

    def _pages(self, n):
        out = [int(self.free.pop()) for _ in range(n)]
        if self.swa_free:
            for p in out:
                self.full_to_swa[p] = int(self.swa_free.pop())
        return out

    def alloc_tokens(self, n):
        ps = self.page_size
        pages = self._pages(-(-n // ps))
        locs = np.array([p * ps + i for p in pages for i in range(ps)], dtype=np.int64)[:n]
        return locs

    def alloc(self, n):
        import torch
        return torch.tensor(self.alloc_tokens(n), dtype=torch.int64)

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                     extend_num_tokens):
        import torch
        return torch.tensor(self.alloc_tokens(int(extend_num_tokens)), dtype=torch.int64)

    def translate_loc_from_full_to_swa(self, locs):
        import torch
        ps = self.page_size
        a = np.asarray(locs).astype(np.int64)
        out = np.array([self.full_to_swa[int(x) // ps] * ps + int(x) % ps for x in a],
                       dtype=np.int64)
        return torch.tensor(out, dtype=torch.int64)


class ReqToTokenPool:
    def __init__(self, torch, rows, ctx):
        self.req_to_token = torch.zeros((rows + 1, ctx), dtype=torch.int32)
        self.free_slots = list(range(1, rows + 1))

    def available_size(self):
        return len(self.free_slots)

    def alloc(self, reqs):
        out = []
        for r in reqs:
            if r.req_pool_idx is None:
                r.req_pool_idx = self.free_slots.pop(0)
            out.append(r.req_pool_idx)
        return out

    def write(self, idx, values):
        assign(self.req_to_token, idx, values)


def assign(t, idx, values):
    """t[idx] = values for a NumPy-backed or a real torch tensor."""
    if hasattr(t, "detach"):
        import torch
        t[idx] = torch.as_tensor(np.asarray(values)).to(t.dtype)
    else:
        t[idx] = np.asarray(values)
