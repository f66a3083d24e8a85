"""kvwire as an SGLang disaggregation transfer backend.

The classes here have the interface of SGLang's disaggregation backends
(``sglang.srt.disaggregation.base.conn``): ``KVArgs``, ``KVManager``, ``KVSender``,
``KVReceiver``, ``KVBootstrapServer`` and ``KVPoll``, with the same constructor
signatures, method names, argument order and units, plus what SGLang's schedulers read
beyond base/conn.py (``prefill_info_table``, ``try_ensure_parallel_info``,
``conclude_state``, ``submit_prefill_recompute``), so that SGLang's prefill.py and
decode.py drive kvwire unchanged; ``register()`` makes ``--disaggregation-transfer-backend
kvwire`` select it (see python/README.md). python/tests/sglang_real runs SGLang's own
scheduler code against it.

Units
-----
SGLang hands a backend page counts and page lists, never the prompt's token count:

* prefill: ``KVSender.init(num_kv_indices, aux_index)``: ``num_kv_indices`` is the
  number of pages of the request (``ceil(tokens / page_size)``); each ``send`` passes
  the pages of one chunk; the chunk that reaches ``num_kv_indices`` pages is the last;
* decode: ``KVReceiver.send_metadata(kv_indices, aux_index, state_indices,
  decode_prefix_len)``: the pages of tokens ``[decode_prefix_len, tokens)``.

kvwire moves whole pages (``pages * page_size`` tokens), as SGLang's other backends do:
every computed token plus the unused tail of the last page, which the request owns on
both sides.

State indices come per state type, in ``KVArgs.state_types`` order. SWA: the SWA-pool
pages of ``[floor_page(L - W), L)`` (W the scheduler's window), moved whole (see
KVManager.swa_side). Mamba/GDN: the request's state slot. The other state types are
refused when the manager is built.

Aux data (first output token, logprobs, hidden states) at ``aux_index`` of the
prefill's aux buffers travels as kvwire per-room metadata and is written into the
decode's aux buffers at its own ``aux_index`` when the room reaches Success (before
``poll`` first returns ``KVPoll.Success``). The payload starts with the aux layout
(buffer count and item lengths); a decode whose layout differs fails the room.

KV and state pools may be host or CUDA memory (see _memory_kind); aux buffers are host
memory.
"""
import ctypes
import enum
import hashlib
import logging
import os
import socket
import struct
import sys

from . import _order
from .connector import KVPoll, kvpoll, _side
from .core import (Buffer, Context, KvwireError, LayerKind, MemKind, Model, Parallel, Pool, Rank,
                   Role, RoomState, Side, Status, BootstrapServer, topo_heads)
try:
    from .memkind import pointer_mem_kind
except ImportError:
    pointer_mem_kind = None

__all__ = ["KVArgs", "KVPoll", "StateType", "KVTransferMetric", "KVTransferError",
           "KVManager", "KVSender", "KVReceiver", "KVBootstrapServer", "model_layers", "register",
           "MAX_AUX_BYTES"]

_log = logging.getLogger(__name__)

# KVW_MAX_ROOM_METADATA (include/kvwire/xfer.h): the largest per-room metadata payload.
MAX_AUX_BYTES = 64 << 10


class StateType(str, enum.Enum):
    """SGLang's state component types (values as SGLang spells them)."""
    MAMBA = "mamba"
    SWA = "swa"
    DSA = "dsa"
    NSA = "nsa"
    MINIMAX_INDEX_K = "minimax_index_k"
    SWA_RING = "swa_ring"
    C128_STATE = "c128_state"


class KVArgs:
    """What an SGLang scheduler fills in before building a KVManager.

    Read here: kv_data_ptrs / kv_data_lens / kv_item_lens (every K buffer of the
    stage's full-attention layers in layer order, then every V buffer; one latent
    buffer per layer for MLA; item = one page, in bytes), aux_data_ptrs / lens /
    item_lens (item = one aux slot), state_types with state_data_ptrs / lens /
    item_lens per type (SWA: the SWA layers' K buffers then V buffers), page_size,
    swa_page_size, engine_rank (the attention-TP rank), kv_head_num,
    total_kv_head_num, pp_rank, system_dp_rank, prefill_start_layer,
    prefill_end_layer, gpu_id, state_dim_per_tensor, state_conv_shard_groups,
    dcp_size, token_position_offset. Pointers are host or CUDA device addresses (on
    gpu_id). model_config (not an SGLang field) may carry the model config the layer
    kinds come from; SGLang's server_args.get_model_config() is used otherwise."""

    def __init__(self, **kw):
        self.engine_rank = 0
        self.kv_data_ptrs, self.kv_data_lens, self.kv_item_lens = [], [], []
        self.aux_data_ptrs, self.aux_data_lens, self.aux_item_lens = [], [], []
        self.state_types = []
        self.state_data_ptrs, self.state_data_lens, self.state_item_lens = [], [], []
        self.kv_head_num = 0
        self.total_kv_head_num = 0
        self.page_size = 1
        self.swa_page_size = None
        self.system_dp_rank = 0
        self.pp_rank = 0
        self.prefill_start_layer = None
        self.prefill_end_layer = None
        self.gpu_id = 0
        self.ib_device = None
        self.model_config = None
        for k, v in kw.items():
            setattr(self, k, v)


class KVTransferMetric:
    """SGLang's per-request transfer metric (seconds, bytes; None when unknown)."""

    def __init__(self, transfer_latency_s=None, alloc_latency_s=None,
                 transfer_total_bytes=None):
        self.transfer_latency_s = transfer_latency_s
        self.alloc_latency_s = alloc_latency_s
        self.transfer_total_bytes = transfer_total_bytes

    def __repr__(self):
        return "KVTransferMetric(%r, %r, %r)" % (self.transfer_latency_s, self.alloc_latency_s,
                                                 self.transfer_total_bytes)


class KVTransferError(RuntimeError):
    """A request's transfer failed. bootstrap_room, bootstrap_addr (the prefill
    instance's bootstrap endpoint), failure_reason (kvwire's reason, naming the
    peer rank and instance), status (a kvwire Status or None) and
    is_from_another_rank (False: kvwire reports each rank's own failure)."""

    def __init__(self, bootstrap_room, failure_reason, bootstrap_addr=None, status=None):
        where = " (prefill instance %s)" % bootstrap_addr if bootstrap_addr else ""
        super().__init__("room %s%s: %s" % (bootstrap_room, where, failure_reason))
        self.bootstrap_room = bootstrap_room
        self.bootstrap_addr = bootstrap_addr
        self.failure_reason = failure_reason
        self.status = status
        self.is_from_another_rank = False


# ---------------------------------------------------------------- model config

def _get(obj, *names):
    """The first attribute (or dict key) of obj among names that is set."""
    for n in names:
        v = obj.get(n) if isinstance(obj, dict) else getattr(obj, n, None)
        if v is not None:
            return v
    return None


def _hf(cfg):
    """The object holding the HF-style fields (SGLang's ModelConfig wraps them)."""
    for n in ("hf_text_config", "hf_config"):
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return cfg


def model_layers(cfg, is_mla_backend=False):
    """Per global layer: ("full"|"swa"|"mla", window) taken from a model config.

    Accepted shapes (first match wins): ``layer_kinds`` (kvwire kinds, e.g.
    ["swa:128", "full", ...]); MLA when is_mla_backend; HF ``layer_types``
    ("full_attention" / "sliding_attention") with ``sliding_window``; SGLang's
    ``swa_attention_layer_ids`` / ``full_attention_layer_ids`` with
    ``sliding_window_size`` or ``sliding_window``; otherwise every layer is full
    attention. The fields are looked up on cfg, then on cfg.hf_text_config /
    cfg.hf_config. Anything else (linear attention, Mamba) raises ValueError."""
    if cfg is None:
        raise ValueError("the kvwire SGLang backend needs the model config (layer kinds and "
                         "sliding windows are not part of KVArgs): pass model_config=")
    hf = _hf(cfg)
    explicit = _get(cfg, "layer_kinds")
    if explicit is not None:
        return Model(list(explicit)).layers
    n = _get(cfg, "num_hidden_layers") or _get(hf, "num_hidden_layers")
    if not n:
        raise ValueError("model config has no num_hidden_layers")
    n = int(n)
    if is_mla_backend:
        return Model(["mla"] * n).layers
    window = (_get(cfg, "sliding_window_size", "sliding_window") or
              _get(hf, "sliding_window_size", "sliding_window") or 0)
    types = _get(cfg, "layer_types") or _get(hf, "layer_types")
    if types is not None:
        types = list(types)
        if len(types) != n:
            raise ValueError("model config: %d layer_types for %d layers" % (len(types), n))
        out = []
        for i, t in enumerate(types):
            if t == "full_attention":
                out.append("full")
            elif t == "sliding_attention":
                if not window:
                    raise ValueError("model config: layer %d is sliding_attention but no "
                                     "sliding_window is given" % i)
                out.append(("swa", int(window)))
            else:
                raise ValueError("model config: layer %d is %r; the kvwire SGLang backend "
                                 "handles full_attention and sliding_attention" % (i, t))
        return Model(out).layers
    swa_ids = _get(cfg, "swa_attention_layer_ids") or _get(hf, "swa_attention_layer_ids")
    if swa_ids:
        if not window:
            raise ValueError("model config lists sliding-window layers but no window")
        swa_ids = set(int(i) for i in swa_ids)
        return Model([("swa", int(window)) if i in swa_ids else "full"
                      for i in range(n)]).layers
    return Model(["full"] * n).layers


# ---------------------------------------------------------------- manager

def _ceil_div(a, b):
    return -(-a // b)


def _ints(indices, what):
    """A list of ints from a list, range, NumPy array or tensor."""
    if indices is None:
        return []
    if hasattr(indices, "tolist"):
        indices = indices.tolist()
    try:
        return [int(i) for i in indices]
    except TypeError:
        raise TypeError("%s must be a sequence of ints, not %r" % (what, type(indices).__name__)) \
            from None


def _env_num(name, default, kind=float):
    """An SGLang environment variable (environ.py), SGLang's default when unset."""
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return kind(v)
    except ValueError:
        raise ValueError("%s=%r is not a number" % (name, v)) from None


def _sglang_timeouts():
    """kvwire Context timeouts (ms) from SGLang's disaggregation environment variables,
    with SGLang's defaults (environ.py): SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT (300 s)
    bounds the wait for the peer's half of a room before its transfer starts (kvwire's
    bootstrap and wait timeouts), SGLANG_DISAGGREGATION_WAITING_TIMEOUT (300 s) the wait
    of a decode for its transfer; a peer silent for SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL
    (5 s) x SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE (2) is dead."""
    boot = _env_num("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300, float)
    wait = _env_num("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300, float)
    hb = _env_num("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", 5.0, float)
    fails = _env_num("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", 2, int)
    ms = lambda s: max(1, min(int(s * 1000), 0xFFFFFFFF))
    # kvwire sends heartbeats more often than it declares a peer dead.
    return dict(bootstrap_timeout_ms=ms(boot), wait_timeout_ms=ms(max(boot, wait)),
                peer_timeout_ms=ms(hb * max(1, fails)),
                heartbeat_ms=ms(min(hb / 4.0, 1.0)))


def _is_local_any(host):
    return host in (None, "", "0.0.0.0", "::", "[::]")


def _strip_brackets(host):
    if host and host.startswith("[") and host.endswith("]"):
        return host[1:-1]
    return host


def _local_ip_own():
    """SGLang's get_local_ip_auto (utils/network.py at 8905cbd) step by step, for a
    process that has not loaded SGLang: SGLANG_HOST_IP / HOST_IP; the first address of
    the interface SGLANG_LOCAL_IP_NIC names (needs netifaces, as in SGLang); the source
    address of a route to a public IPv4, then IPv6 address (no packet is sent); the
    host name's first address unless it is a loopback one."""
    for name in ("SGLANG_HOST_IP", "HOST_IP"):
        v = os.environ.get(name)
        if v:
            return v
    nic = os.environ.get("SGLANG_LOCAL_IP_NIC")
    if nic:
        try:
            import netifaces
            addrs = netifaces.ifaddresses(nic)
            for a in addrs.get(netifaces.AF_INET, ()):
                if a.get("addr") and a["addr"] not in ("127.0.0.1", "0.0.0.0"):
                    return a["addr"]
            for a in addrs.get(netifaces.AF_INET6, ()):
                ip = a.get("addr")
                if ip and not ip.startswith("fe80::") and ip != "::1":
                    return ip.split("%")[0]
        except (ImportError, ValueError, OSError) as e:
            _log.warning("SGLANG_LOCAL_IP_NIC=%s: no address from it (%s)", nic, e)
    for probe in ("8.8.8.8", "2001:4860:4860::8888"):
        try:
            fam, st, proto, _, sa = socket.getaddrinfo(probe, 80, socket.AF_UNSPEC,
                                                       socket.SOCK_DGRAM, 0,
                                                       socket.AI_ADDRCONFIG)[0]
            with socket.socket(fam, st, proto) as sock:
                sock.connect(sa)
                return sock.getsockname()[0]
        except OSError:     # socket.gaierror included
            continue
    try:
        ip = socket.getaddrinfo(socket.gethostname(), None, socket.AF_UNSPEC, 0, 0,
                                socket.AI_ADDRCONFIG)[0][4][0]
        if ip and ip not in ("127.0.0.1", "0.0.0.0", "::1"):
            return ip
    except OSError:
        pass
    return None


def _local_ip():
    """The address this host's ranks listen on, as SGLang's own backends pick it
    (CommonKVManager.local_ip = get_local_ip_auto()): SGLang's get_local_ip_auto where
    SGLang is loaded, else the same steps here (_local_ip_own); 127.0.0.1 when neither
    finds one (SGLang raises there). IPv4 or IPv6, without brackets."""
    ip = None
    net = sys.modules.get("sglang.srt.utils.network")
    if net is None and "sglang" in sys.modules:
        try:
            import sglang.srt.utils.network as net
        except Exception:   # a partial SGLang install: take the same steps here
            net = None
    if net is not None and hasattr(net, "get_local_ip_auto"):
        try:
            ip = net.get_local_ip_auto()
        except Exception as e:
            _log.warning("SGLang's get_local_ip_auto found no address (%s)", e)
    else:
        ip = _local_ip_own()
    return _strip_brackets(ip) if ip else "127.0.0.1"


def _split_host_port(addr):
    """(host, port) of "host:port" or "[IPv6 host]:port" (SGLang's
    NetworkAddress.to_host_port_str spelling), host without brackets."""
    addr = str(addr)
    if addr.startswith("["):
        host, sep, port = addr[1:].partition("]:")
        if not sep:
            raise ValueError("%r: expected [IPv6 address]:port" % addr)
    else:
        host, sep, port = addr.rpartition(":")
        if not sep or ":" in host:
            raise ValueError("%r: expected host:port (an IPv6 host in brackets)" % addr)
    return host, int(port)


def _join_host_port(host, port):
    host = _strip_brackets(str(host))
    return "[%s]:%d" % (host, int(port)) if ":" in host else "%s:%d" % (host, int(port))


def _same_addr(a, b):
    try:
        (ha, pa), (hb, pb) = _split_host_port(a), _split_host_port(b)
        return ha.lower() == hb.lower() and pa == pb
    except ValueError:
        return str(a) == str(b)


def _memory_kind(args):
    """(MemKind, device) of the KV and state pools (the aux buffers are host memory).

    KVWIRE_SGLANG_KV_MEMORY=host|cuda overrides. Otherwise the first KV pointer is asked
    (memkind.pointer_mem_kind, a cudaPointerGetAttributes query, where the library has
    it); otherwise SGLang's convention: its pools live on KVArgs.gpu_id whenever CUDA is
    in use (torch is loaded and sees a GPU), else in host memory."""
    gpu = int(getattr(args, "gpu_id", 0) or 0)
    env = os.environ.get("KVWIRE_SGLANG_KV_MEMORY", "").strip().lower()
    if env:
        if env not in ("host", "cuda"):
            raise ValueError("KVWIRE_SGLANG_KV_MEMORY=%r: use host or cuda" % env)
        return (MemKind.CUDA, gpu) if env == "cuda" else (MemKind.HOST, 0)
    ptrs = list(getattr(args, "kv_data_ptrs", None) or [])
    if pointer_mem_kind is not None and ptrs:
        try:
            kind, dev = pointer_mem_kind(int(ptrs[0]))
        except KvwireError as e:
            # ERR_UNSUPPORTED: CUDA cannot be asked here (no CUDA module or driver);
            # SGLang's convention below decides.
            if e.status != Status.ERR_UNSUPPORTED:
                raise
        else:
            kind = MemKind(kind)
            return kind, (int(dev) if kind == MemKind.CUDA else 0)
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return MemKind.CUDA, gpu
    except Exception:
        pass
    return MemKind.HOST, 0


def _transport(mem_kind):
    """KVWIRE_TRANSPORT (tcp, shm, ucx, cuda_ipc) wins; else tcp, which stages device
    memory through the host and works between hosts. One decode rank serves every
    prefill instance through one context, so it cannot pick cuda_ipc per peer: a
    deployment whose prefill and decode share one host sets KVWIRE_TRANSPORT=cuda_ipc on
    both."""
    t = os.environ.get("KVWIRE_TRANSPORT", "").strip()
    return t or None


def _instance_id(server_args):
    """One decode instance, one id, the same on every rank of it.

    KVWIRE_SGLANG_INSTANCE_ID (an integer) wins. Otherwise SGLang has no instance
    identifier to reuse (its mooncake backend keys decode peers by each rank's own
    ip:port and session); the ranks of one instance are launched together, so the id is
    a 64-bit hash of what they share and two launches do not: the launching process
    (every scheduler process of a node is a child of the same launcher), this host's
    address, the instance's HTTP host:port and dist_init_addr. A multi-node instance
    (nnodes > 1) hashes dist_init_addr and the port only, which its nodes share."""
    env = os.environ.get("KVWIRE_SGLANG_INSTANCE_ID")
    if env:
        return int(env, 0) & 0xFFFFFFFFFFFFFFFF
    nnodes = int(getattr(server_args, "nnodes", 1) or 1)
    parts = [str(getattr(server_args, "dist_init_addr", "") or ""),
             str(getattr(server_args, "port", "") or "")]
    if nnodes <= 1:
        parts += [str(os.getppid()), _local_ip(), str(getattr(server_args, "host", "") or "")]
    digest = hashlib.sha256("\0".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") or 1


class PrefillInfo:
    """What the decode scheduler reads of a prefill instance
    (kv_manager.prefill_info_table[addr]): dp_size and follow_bootstrap_room."""

    def __init__(self, dp_size=1, follow_bootstrap_room=True):
        self.dp_size = int(dp_size)
        self.follow_bootstrap_room = bool(follow_bootstrap_room)

    def __repr__(self):
        return "PrefillInfo(dp_size=%d, follow_bootstrap_room=%s)" % (
            self.dp_size, self.follow_bootstrap_room)


def _prefill_dp_size(addr):
    """The DP size of the prefill instance at addr, for the decode's DP-rank routing.

    kvwire's bootstrap table carries each prefill rank's DP rank, but the C API does not
    expose an instance's geometry before a room connects, so the decode takes it from
    KVWIRE_SGLANG_PREFILL_DP_SIZE: a number for every instance, or
    "host:port=N,host:port=M" per instance (default 1). Requests that carry
    disagg_prefill_dp_rank (set by a router) need none of it."""
    v = os.environ.get("KVWIRE_SGLANG_PREFILL_DP_SIZE", "").strip()
    if not v:
        return 1
    if "=" not in v:
        return int(v)
    for item in v.split(","):
        a, _, n = item.strip().rpartition("=")
        if _same_addr(a, addr):
            return int(n)
    return 1


def _parallel_of(args, server_args, mode):
    """(attention TP size, attention TP rank, DP size, DP rank) as SGLang sets them.

    engine_rank is the global TP rank on prefill (prefill.py: tp_rank) and the
    attention-TP rank on decode (decode.py: tp_rank % attn_tp_size); both reduce to the
    attention-TP rank modulo attn_tp_size = tp_size / dp_size (DP attention) / attn_cp
    (layers/dp_attention.py). The DP rank is KVArgs.system_dp_rank: the attention-DP
    rank with DP attention, the replica index with plain DP (each replica's schedulers
    have their own TP ranks 0..tp-1, so the replicas are kvwire DP groups of one
    instance)."""
    tp = int(getattr(server_args, "tp_size", 1) or 1)
    dp = int(getattr(server_args, "dp_size", 1) or 1)
    dp_attn = bool(getattr(server_args, "enable_dp_attention", False))
    cp = int(getattr(server_args, "attn_cp_size", 1) or 1)
    if cp > 1:
        raise ValueError("attention context parallelism (attn_cp_size=%d) is not supported by "
                         "the kvwire SGLang backend: kvwire splits a request by heads, not by "
                         "token ranges across CP ranks" % cp)
    for where, obj in (("KVArgs", args), ("server_args", server_args)):
        v = int(getattr(obj, "dcp_size", 1) or 1)
        if v > 1:
            raise ValueError("decode context parallelism (%s.dcp_size=%d) is not supported "
                             "by the kvwire SGLang backend" % (where, v))
    if dp_attn:
        if tp % dp:
            raise ValueError("tp_size %d is not a multiple of dp_size %d" % (tp, dp))
        attn_tp = tp // dp
    else:
        attn_tp = tp
    rank = int(args.engine_rank or 0) % attn_tp
    dp_rank = getattr(args, "system_dp_rank", None)
    if dp_rank is None:
        dp_rank = int(args.engine_rank or 0) // attn_tp if dp_attn else 0
    dp_rank = int(dp_rank)
    if dp > 1 and not 0 <= dp_rank < dp:
        raise ValueError("KVArgs.system_dp_rank %d is outside dp_size %d" % (dp_rank, dp))
    return attn_tp, rank, (dp if dp > 1 else 1), (dp_rank if dp > 1 else 0)


def _model_config(args, server_args, model_config):
    cfg = model_config if model_config is not None else getattr(args, "model_config", None)
    if cfg is None:
        cfg = getattr(server_args, "model_config", None)
    if cfg is None and callable(getattr(server_args, "get_model_config", None)):
        try:
            cfg = server_args.get_model_config()
        except Exception:
            cfg = None
    return cfg


class KVManager:
    """One rank's kvwire state, built from SGLang's KVArgs.

    args: KVArgs (SGLang's flat pointer lists). disaggregation_mode: "prefill"/"decode"
    or SGLang's DisaggregationMode. server_args: SGLang's ServerArgs (tp_size, dp_size,
    enable_dp_attention, attn_cp_size, pp_size, host, port, dist_init_addr, nnodes,
    disaggregation_bootstrap_port, load_balance_method). is_mla_backend: one latent
    buffer per layer.

    The model's layer count and, for hybrid sliding-window models, which layers slide
    and the window come from the model config (server_args.get_model_config(), SGLang's
    own accessor; model_config= or KVArgs.model_config override it); without a config
    every layer of the buffers is full attention. Buffers beyond the target model's
    layers (SGLang appends the draft model's KV for speculative decoding) are extra
    layers after the target's. Keyword-only extensions: model_config, instance_id, and
    kvwire.Context arguments (transport, timeouts in ms, secret, listen_host,
    busy_poll_us); SGLang passes none of them.

    Prefill managers register with the bootstrap endpoint when built. Decode managers
    name no prefill instance: every KVReceiver names its own."""

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False, *,
                 model_config=None, instance_id=None, **context_kwargs):
        self.kv_args = args
        self.server_args = server_args
        self.mode = _side(disaggregation_mode)
        self.is_mla_backend = bool(is_mla_backend)
        self.prefill_info_table = {}
        self._recompute_refused = 0
        cfg = _model_config(args, server_args, model_config)
        self.page_size = int(args.page_size)
        if self.page_size <= 0:
            raise ValueError("KVArgs.page_size must be positive")
        self.swa_page_size = int(getattr(args, "swa_page_size", None) or self.page_size)
        off = int(getattr(args, "token_position_offset", 0) or 0)
        if off:
            raise ValueError("KVArgs.token_position_offset=%d is not supported" % off)

        state_types = [StateType(getattr(t, "value", t)) for t in (args.state_types or [])]
        self.state_types = state_types
        supported = (StateType.SWA, StateType.MAMBA)
        for t in state_types:
            if t not in supported:
                raise ValueError(
                    "state type %r is not supported by the kvwire SGLang backend (supported: "
                    "swa, mamba): %s" % (t.value, {
                        StateType.DSA: "DSA indexer pages need per-token index rows kvwire "
                                       "does not describe",
                        StateType.NSA: "NSA indexer pages need per-token index rows kvwire "
                                       "does not describe",
                        StateType.MINIMAX_INDEX_K: "MiniMax index-K rows are not described",
                        StateType.SWA_RING: "ring-addressed SWA rows have no page table",
                        StateType.C128_STATE: "DeepSeek-V4 C128 compressed state is not "
                                              "described"}.get(t, "unknown")))
        if StateType.MAMBA in state_types and self.is_mla_backend:
            raise ValueError("Mamba state with an MLA KV pool is not supported")
        has_swa_pool = StateType.SWA in state_types
        self.mem_kind, self.device = _memory_kind(args)

        attn_tp, tp_rank, dp, dp_rank = _parallel_of(args, server_args, self.mode)
        pp = int(getattr(server_args, "pp_size", 1) or 1)
        if self.mode == Side.DECODE and pp > 1:
            raise ValueError("decode pipeline parallelism (pp_size=%d) is not supported by the "
                             "kvwire SGLang backend (a decode rank receives every layer)" % pp)
        pp_rank = int(getattr(args, "pp_rank", 0) or 0)
        ptrs, lens, items = list(args.kv_data_ptrs), list(args.kv_data_lens), \
            list(args.kv_item_lens)
        if not (len(ptrs) == len(lens) == len(items)):
            raise ValueError("kv_data_ptrs/lens/item_lens have different lengths")
        per_layer = 1 if self.is_mla_backend else 2
        if len(ptrs) % per_layer:
            raise ValueError("%d KV buffers: K then V buffers per layer expected" % len(ptrs))

        # Layer kinds of the target model.
        has_mamba = StateType.MAMBA in state_types
        if has_mamba and pp > 1:
            raise ValueError("Mamba/GDN state with pipeline parallelism is not supported by the "
                             "kvwire SGLang backend")
        if has_mamba and has_swa_pool:
            raise ValueError("Mamba state together with an SWA pool is not supported")
        if cfg is not None and not has_mamba and (
                has_swa_pool or pp > 1 or _get(cfg, "num_hidden_layers") or
                _get(_hf(cfg), "num_hidden_layers")):
            layers = model_layers(cfg, self.is_mla_backend)
        else:
            # Hybrid linear-attention models: KVArgs lists the full-attention layers'
            # buffers only; kvwire numbers them 0.. in order (both sides alike).
            layers = None
        begin = getattr(args, "prefill_start_layer", None) if self.mode == Side.PREFILL else None
        begin = int(begin or 0)
        end = getattr(args, "prefill_end_layer", None) if self.mode == Side.PREFILL else None
        if layers is None:
            if has_swa_pool:
                raise ValueError("a separate SWA pool needs the model config (which layers "
                                 "slide, and the window): server_args.get_model_config()")
            if pp > 1:
                raise ValueError("PP: the model's layer count needs the model config "
                                 "(server_args.get_model_config())")
            n = int(end) - begin if end is not None and not has_mamba else \
                len(ptrs) // per_layer
            if has_mamba:
                begin, end = 0, None
            layers = Model(["mla" if self.is_mla_backend else "full"] * (begin + n)).layers
        n_target = len(layers)
        if end is None:
            end = n_target if (pp == 1 or pp_rank == pp - 1) else None
        if end is None:
            # A middle PP stage without prefill_end_layer: its buffers tell.
            end = begin
            cnt = 0
            while end < n_target and cnt < len(ptrs) // per_layer:
                if not (layers[end].kind == LayerKind.SWA and has_swa_pool):
                    cnt += 1
                end += 1
        end = int(end)
        if not 0 <= begin < end <= n_target:
            raise ValueError("layers [%d, %d) outside the model's %d layers"
                             % (begin, end, n_target))

        self.swa_window_cfg = 0
        kinds = []
        for l in layers:
            if l.kind == LayerKind.SWA and not has_swa_pool:
                kinds.append(("full", 0))
            else:
                kinds.append((l.kind, l.window))
        stage = range(begin, end)
        full_ids = [i for i in stage if kinds[i][0] in (LayerKind.FULL, LayerKind.MLA)]
        swa_ids = [i for i in stage if kinds[i][0] == LayerKind.SWA]
        # Speculative decoding: SGLang appends the draft model's KV buffers (on prefill only
        # on the last PP stage); kvwire sees them as extra layers after the target's.
        n_draft = len(ptrs) // per_layer - len(full_ids)
        if n_draft < 0:
            raise ValueError("%d KV buffers, but layers [%d, %d) of the model have %d "
                             "full-attention layers (%s)"
                             % (len(ptrs), begin, end, len(full_ids),
                                "one latent buffer each" if self.is_mla_backend
                                else "K then V buffers"))
        if n_draft and pp > 1 and end != n_target:
            raise ValueError("%d KV buffers beyond PP stage %d's layers" % (len(ptrs), pp_rank))
        draft_ids = list(range(n_target, n_target + n_draft))
        self.num_draft_layers = n_draft
        self.decode_wants_draft = None
        if self.mode == Side.DECODE:
            layer_end = n_target + n_draft
        else:
            layer_end = end if end < n_target else n_target + n_draft
        kinds = kinds + [("mla" if self.is_mla_backend else "full", 0)] * n_draft

        # SWA: SGLang hands over the pages of [floor_page(L - W), L) without the token
        # count L (W: the scheduler's window, model.get_attention_sliding_window_size(),
        # at most the config's). kvwire moves whole pages: a request of N = pages *
        # page_size tokens (full pool) with the SWA layers' kvwire window rounded up so
        # that the window's pages are always covered (see _swa_side).
        swa_w = 0
        if swa_ids:
            env_w = os.environ.get("KVWIRE_SGLANG_SWA_WINDOW")
            cfg_w = max(kinds[i][1] for i in swa_ids)
            w = int(env_w) if env_w else cfg_w
            ps = self.swa_page_size
            swa_w = ps * _ceil_div(w + self.page_size - 1, ps)
            kinds = [(LayerKind.SWA, swa_w) if k == LayerKind.SWA else (k, wn)
                     for k, wn in kinds]
        self.swa_window = swa_w
        self.parallel = Parallel(attn_tp, tp_rank, pp, pp_rank, begin, layer_end, dp, dp_rank)

        total_heads = int(getattr(args, "total_kv_head_num", 0) or 0) or \
            int(_get(cfg, "num_key_value_heads") or _get(_hf(cfg), "num_key_value_heads") or 0) \
            if cfg is not None else int(getattr(args, "total_kv_head_num", 0) or 0)
        given = int(getattr(args, "kv_head_num", 0) or 0)
        if self.is_mla_backend:
            heads = total_heads = 1
        else:
            if not total_heads and given and attn_tp == 1:
                total_heads = given
            if not total_heads:
                raise ValueError("the number of KV heads is unknown: set "
                                 "KVArgs.total_kv_head_num or num_key_value_heads in the "
                                 "model config")
            _, heads = topo_heads(attn_tp, tp_rank, total_heads)
            if given and given != heads:
                raise ValueError("KVArgs.kv_head_num is %d but attention-TP rank %d of %d owns "
                                 "%d of %d KV heads" % (given, tp_rank, attn_tp, heads,
                                                        total_heads))
        self.num_local_heads = heads

        buffers = []
        head_bytes = {}
        mk, dev = self.mem_kind, self.device

        def add(layer, role, ptr, length, item, ps, pool, nheads=heads, key=None):
            if item % ps:
                raise ValueError("layer %d %s: item length %d is not a multiple of the page "
                                 "size %d" % (layer, role.name, item, ps))
            row = item // ps
            if row % nheads:
                raise ValueError("layer %d %s: %d bytes per token do not split into %d heads"
                                 % (layer, role.name, row, nheads))
            hb = row // nheads
            k = key or role
            if head_bytes.setdefault(k, hb) != hb:
                raise ValueError("layer %d %s: %d bytes per head, other layers have %d"
                                 % (layer, role.name, hb, head_bytes[k]))
            buffers.append(Buffer(layer, role, addr=int(ptr), length=int(length), pool=pool,
                                  page_size=ps, num_heads=nheads, head_bytes=hb,
                                  mem_kind=mk, device=dev))

        ids = full_ids + draft_ids
        n = len(ids)
        if self.is_mla_backend:
            for i, layer in enumerate(ids):
                add(layer, Role.LATENT, ptrs[i], lens[i], items[i], self.page_size, Pool.FULL)
        else:
            # SGLang's layout: the target's K buffers, its V buffers, then the draft's K
            # and V buffers.
            nt = len(full_ids)
            order = [(full_ids[i], i, nt + i) for i in range(nt)]
            base = 2 * nt
            order += [(draft_ids[j], base + j, base + n_draft + j) for j in range(n_draft)]
            for layer, ki, vi in order:
                add(layer, Role.K, ptrs[ki], lens[ki], items[ki], self.page_size, Pool.FULL)
                add(layer, Role.V, ptrs[vi], lens[vi], items[vi], self.page_size, Pool.FULL)
        if has_swa_pool:
            k = state_types.index(StateType.SWA)
            sp, sl, si = (list(args.state_data_ptrs[k]), list(args.state_data_lens[k]),
                          list(args.state_item_lens[k]))
            if len(sp) != 2 * len(swa_ids) or len(sl) != len(sp) or len(si) != len(sp):
                raise ValueError("%d SWA state buffers, but layers [%d, %d) of the model config "
                                 "have %d sliding-window layers (%d expected)"
                                 % (len(sp), begin, end, len(swa_ids), 2 * len(swa_ids)))
            m = len(swa_ids)
            for i, layer in enumerate(swa_ids):
                add(layer, Role.K, sp[i], sl[i], si[i], self.swa_page_size, Pool.SWA)
                add(layer, Role.V, sp[m + i], sl[m + i], si[m + i], self.swa_page_size,
                    Pool.SWA)
        state_layers = []
        if StateType.MAMBA in state_types:
            state_layers = self._mamba_buffers(args, state_types.index(StateType.MAMBA),
                                               buffers, n_target + n_draft, attn_tp, tp_rank)

        if self.is_mla_backend:
            lat = head_bytes.get(Role.LATENT, 0)
            model_kinds = kinds + [("state", 0)] * len(state_layers)
            self.model = Model(model_kinds, num_kv_heads=1, head_dim=0, mla_dim=lat,
                               elem_size=1)
        else:
            kb, vb = head_bytes.get(Role.K, 0), head_bytes.get(Role.V, 0)
            model_kinds = kinds + [("state", 0)] * len(state_layers)
            self.model = Model(model_kinds, num_kv_heads=total_heads, k_head_dim=kb,
                               v_head_dim=vb, elem_size=1)
        if state_layers:
            # State layers follow every KV layer; every stage holding the last layer
            # moves them.
            if self.parallel.layer_end == n_target + n_draft:
                self.parallel.layer_end = len(model_kinds)

        self.aux = list(zip(_ints(args.aux_data_ptrs, "aux_data_ptrs"),
                            _ints(args.aux_data_lens, "aux_data_lens"),
                            _ints(args.aux_item_lens, "aux_item_lens")))
        if not (len(self.aux) == len(args.aux_data_ptrs or []) == len(args.aux_item_lens or [])):
            raise ValueError("aux_data_ptrs/lens/item_lens have different lengths")
        self.aux_bytes = sum(item for _, _, item in self.aux)
        self._aux_header = struct.pack("<%dI" % (len(self.aux) + 1), len(self.aux),
                                       *[item for _, _, item in self.aux])
        if len(self._aux_header) + self.aux_bytes > MAX_AUX_BYTES:
            raise ValueError("aux items take %d bytes per request; kvwire carries at most %d "
                             "per room" % (len(self._aux_header) + self.aux_bytes,
                                           MAX_AUX_BYTES))

        kw = dict(_sglang_timeouts())
        t = _transport(self.mem_kind)
        if t:
            kw["transport"] = t
        lh = os.environ.get("KVWIRE_SGLANG_LISTEN_HOST")
        kw["listen_host"] = _strip_brackets(lh) if lh else _local_ip()
        # End-to-end KV verification (off, every, sample:F), decided by the decode per
        # room; the library checks the value (KVW_VERIFY when unset).
        vf = os.environ.get("KVWIRE_SGLANG_VERIFY", "").strip()
        if vf:
            kw["verify"] = vf
        kw.update(context_kwargs)
        self.rank = Rank(self.model, self.parallel, buffers)
        try:
            if self.mode == Side.PREFILL:
                self.bootstrap_addr = _bootstrap_addr_of(server_args)
                self._check_dp_routing(server_args, dp)
                self.context = Context(self.rank, Side.PREFILL, self.bootstrap_addr,
                                       **kw)
            else:
                self.bootstrap_addr = None
                if instance_id is None:
                    instance_id = _instance_id(server_args)
                self.instance_id = int(instance_id)
                self.context = Context(self.rank, Side.DECODE, None, instance_id=instance_id,
                                       **kw)
        except BaseException:
            self.rank.close()
            raise

    def _check_dp_routing(self, server_args, dp):
        self.follow_bootstrap_room = True
        if dp > 1:
            lbm = getattr(server_args, "load_balance_method", None) or "follow_bootstrap_room"
            self.follow_bootstrap_room = lbm == "follow_bootstrap_room"
            if not self.follow_bootstrap_room:
                _log.warning(
                    "kvwire: prefill DP with load_balance_method=%s: the decode finds a "
                    "request's DP rank only from disagg_prefill_dp_rank (set by the router); "
                    "kvwire has no /query_dp_ranks lookup", lbm)

    def _mamba_buffers(self, args, k, buffers, first_layer, attn_tp, tp_rank):
        """Mamba / GDN state buffers (one slot per request, the request's mamba index).

        SGLang lists one buffer per (state tensor, layer): the conv states of every
        Mamba layer, then the temporal (SSM) states (memory_pool.py MambaPool). A slot
        row is [units][bytes per unit] with units sharded over attention TP:
        state_dim_per_tensor gives this rank's unit count per buffer, and
        state_conv_shard_groups the full sizes of a conv state's [q | k | v] sub-blocks,
        each sharded on its own. Each buffer becomes one kvwire state layer after the KV
        layers, with its groups."""
        sp, sl, si = (list(args.state_data_ptrs[k]), list(args.state_data_lens[k]),
                      list(args.state_item_lens[k]))
        all_dims = getattr(args, "state_dim_per_tensor", None) or []
        all_groups = getattr(args, "state_conv_shard_groups", None) or []
        dims = list(all_dims[k] or []) if k < len(all_dims) else []
        groups = list(all_groups[k] or []) if k < len(all_groups) else []
        if len(dims) != len(sp):
            raise ValueError("Mamba state: %d buffers but %d state_dim_per_tensor entries (the "
                             "sharded unit count of each is needed)" % (len(sp), len(dims)))
        out = []
        for i, (p, ln, it) in enumerate(zip(sp, sl, si)):
            layer = first_layer + i
            local = int(dims[i])
            if local <= 0 or it % local:
                raise ValueError("Mamba state buffer %d: %d bytes per slot do not split into %d "
                                 "units" % (i, it, local))
            unit = it // local
            sub = groups[i] if i < len(groups) else None
            if sub:
                grp = [(int(full), unit) for full in sub]
                if sum(int(f) for f in sub) != local * attn_tp:
                    raise ValueError("Mamba conv state buffer %d: sub-blocks %s do not add up "
                                     "to %d units x TP %d" % (i, list(sub), local, attn_tp))
            else:
                grp = [(local * attn_tp, unit)]
            buffers.append(Buffer(layer, Role.STATE, addr=int(p), length=int(ln),
                                  pool=Pool.STATE, page_size=1, num_heads=local,
                                  head_bytes=unit, groups=grp, mem_kind=self.mem_kind,
                                  device=self.device))
            out.append(layer)
        return out

    @property
    def is_prefill(self):
        return self.mode == Side.PREFILL

    def metrics(self):
        """This rank's kvwire counters (kvwire.Context.metrics(): rooms by state and
        outcome, failures by status, bytes by path, the post-to-Success latency
        histogram, staging use, peers), for an operator's dashboard beside SGLang's own
        per-request KVTransferMetric (get_transfer_metric())."""
        return self.context.metrics()

    def prometheus_text(self, labels=None):
        """metrics() in Prometheus' text format, labelled with this rank's place
        (side, tp_rank, pp_rank, dp_rank) and any extra labels given, ready to be served
        beside SGLang's /metrics."""
        par = self.parallel
        lab = {"side": "prefill" if self.is_prefill else "decode",
               "tp_rank": str(par.tp_rank), "pp_rank": str(par.pp_rank),
               "dp_rank": str(par.dp_rank)}
        lab.update(labels or {})
        return self.context.prometheus_text(lab)

    def register_to_bootstrap(self):
        """Prefill ranks register when the manager is built; kept for the interface."""

    def try_ensure_parallel_info(self, bootstrap_addr):
        """SGLang's decode asks before routing requests of a prefill instance
        (decode.py _ensure_prefill_info); fills prefill_info_table[bootstrap_addr] and
        returns True. kvwire connects to the instance when its first room opens and
        checks its geometry then; the DP size for routing comes from _prefill_dp_size."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        # One short connection attempt: SGLang retries (once a second, 15 times) while
        # the prefill's bootstrap server is not up yet, and aborts the requests after.
        try:
            socket.create_connection(_split_host_port(bootstrap_addr), timeout=0.5).close()
        except (OSError, ValueError):
            return False
        self.prefill_info_table[bootstrap_addr] = PrefillInfo(_prefill_dp_size(bootstrap_addr),
                                                              True)
        return True

    def submit_prefill_recompute(self, kv_receiver, payload=None):
        """SGLang's PD retraction re-bootstrap asks the prefill to recompute a request's
        prefix (decode.py pop_preallocated). kvwire has no request channel to the prefill
        scheduler: the room fails with that reason, so the request is aborted instead of
        waiting."""
        self._recompute_refused += 1
        kv_receiver._fail("re-bootstrap (submit_prefill_recompute) is not supported by the "
                          "kvwire SGLang backend")
        if kv_receiver._room is not None:
            kv_receiver._room.abort()

    def tokens_of(self, num_pages, first_token=0):
        """A request's token count as kvwire moves it: whole pages (SGLang passes page
        lists, never the token count; both sides own the tail of the last page)."""
        return first_token + int(num_pages) * self.page_size

    def swa_side(self, num_tokens, swa_pages, what):
        """(pages, first token) of the SWA pool for kvwire, from SGLang's SWA pages of a
        request of num_tokens (whole pages) tokens.

        SGLang lists the pages of [floor_page(L - W), L); kvwire moves tokens
        [N - window, N) of its (rounded-up) window, which always covers those pages. When
        that range starts one page earlier, the list is prefixed with page 0, which
        SGLang's pools reserve as the dummy page padded tokens write to (no request owns
        it), so the extra tokens land there on decode and are read from there on prefill."""
        ps = self.swa_page_size
        pages = list(swa_pages)
        first = num_tokens - len(pages) * ps
        if first < 0 or first % ps:
            raise ValueError("%s: %d SWA pages do not end a request of %d tokens (pages of %d)"
                             % (what, len(pages), num_tokens, ps))
        need = max(0, num_tokens - self.swa_window)
        if need < first:
            if first - need > ps:
                raise ValueError("%s: %d SWA pages are fewer than kvwire's window of %d tokens "
                                 "needs (more than one page short: is "
                                 "KVWIRE_SGLANG_SWA_WINDOW larger than the scheduler's "
                                 "window?)" % (what, len(pages), self.swa_window))
            pages = [0] + pages
            first -= ps
        return pages, first

    def read_aux(self, aux_index):
        """The request's aux payload: a header (the number of aux buffers and each
        one's item length, uint32 little-endian) then item aux_index of every aux
        buffer, concatenated."""
        out = [self._aux_header]
        for ptr, length, item in self.aux:
            off = int(aux_index) * item
            if aux_index < 0 or off + item > length:
                raise ValueError("aux_index %d outside an aux buffer of %d items"
                                 % (aux_index, length // item if item else 0))
            out.append(ctypes.string_at(ptr + off, item))
        return b"".join(out)

    def write_aux(self, aux_index, data):
        """Writes a read_aux() payload into item aux_index of every aux buffer; the
        prefill's aux layout must be this rank's (else ValueError, nothing written)."""
        hdr = self._aux_header
        if len(data) < 4 or data[:4] != hdr[:4] or data[:len(hdr)] != hdr or \
                len(data) != len(hdr) + self.aux_bytes:
            n = struct.unpack_from("<I", data)[0] if len(data) >= 4 else 0
            theirs = list(struct.unpack_from("<%dI" % n, data, 4)) \
                if len(data) >= 4 * (n + 1) else "unreadable"
            raise ValueError("the prefill's aux items %s (bytes each) differ from this rank's %s"
                             % (theirs, [item for _, _, item in self.aux]))
        pos = len(hdr)
        for ptr, length, item in self.aux:
            off = int(aux_index) * item
            if aux_index < 0 or off + item > length:
                raise ValueError("aux_index %d outside an aux buffer of %d items"
                                 % (aux_index, length // item if item else 0))
            ctypes.memmove(ptr + off, data[pos:pos + item], item)
            pos += item

    def close(self):
        """Fails every open room and releases the context and the rank."""
        ctx, self.context = getattr(self, "context", None), None
        if ctx is not None:
            ctx.close()
        rank, self.rank = getattr(self, "rank", None), None
        if rank is not None:
            rank.close()


def _bootstrap_addr_of(server_args):
    """The prefill instance's bootstrap endpoint as SGLang's ranks reach it
    (CommonKVManager.register_to_bootstrap): a disaggregation_bootstrap_addr attribute
    wins; else dist_init_addr's host where it is set (node 0 runs the bootstrap server),
    else --host, a wildcard one (0.0.0.0, ::) as the loopback address of its family;
    at --disaggregation-bootstrap-port, an IPv6 host in brackets ("[::1]:8998")."""
    addr = getattr(server_args, "disaggregation_bootstrap_addr", None)
    if addr:
        return str(addr)
    port = getattr(server_args, "disaggregation_bootstrap_port", None)
    if port is None:
        raise ValueError("server_args has no disaggregation_bootstrap_port")
    host = getattr(server_args, "host", None)
    dia = getattr(server_args, "dist_init_addr", None)
    if dia:
        try:
            host = _split_host_port(dia)[0]
        except ValueError:      # a bare host
            host = _strip_brackets(str(dia))
    elif _is_local_any(host):
        host = "::1" if host in ("::", "[::]") else "127.0.0.1"
    return _join_host_port(host, int(port))


# ---------------------------------------------------------------- requests

class _Request:
    _kind = None

    def __init__(self, mgr, bootstrap_addr, bootstrap_room):
        if bootstrap_room is None:
            raise ValueError("bootstrap_room is required")
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self._room = None
        self._error = None      # (reason, status) of a failure found here
        self._final = None      # KVPoll kept after clear()
        self._metric = None     # KVTransferMetric kept after clear()
        self.num_tokens = None

    def _fail(self, reason, status=None):
        if self._error is None:
            self._error = (reason, status)

    def _state(self):
        return None if self._room is None else self._room.poll()

    def failure_exception(self):
        """Raises KVTransferError with the reason; the message names the prefill
        instance (bootstrap address) and kvwire's reason names the peer rank."""
        if self._error is not None:
            reason, status = self._error
        elif self._room is not None and self._room.poll() == RoomState.FAILED:
            reason, status = self._room.failure_reason or "transfer failed", self._room.status
        else:
            reason, status = "the request has not failed (%s)" % self.poll().name, None
        raise KVTransferError(self.bootstrap_room, reason, self._instance(), status)

    def _instance(self):
        return self.bootstrap_addr

    def abort(self):
        """Aborts the transfer here and tells the peers; poll() then returns Failed."""
        if self._room is not None:
            self._room.abort()
        self._fail("aborted locally")

    def clear(self):
        """Releases the request's kvwire handle (an unfinished transfer is aborted).
        poll() keeps returning the last state."""
        if self._room is not None:
            self._final = self.poll()
            self._metric = self.get_transfer_metric()
            self._room.close()
            self._room = None

    def get_transfer_metric(self):
        """KVTransferMetric: transfer latency and bytes (kept after clear(), which
        SGLang's prefill calls first)."""
        if self._room is None:
            return self._metric or KVTransferMetric()
        m = self._room.metrics()
        return KVTransferMetric(m.seconds or None, None, m.bytes)


class KVSender(_Request):
    """A request's prefill side on one rank (SGLang's BaseKVSender).

    dest_tp_ranks, pp_rank and req_has_disagg_prefill_dp_rank are accepted for the
    interface; kvwire derives its routes itself."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks=None, pp_rank=None,
                 req_has_disagg_prefill_dp_rank=False):
        if not mgr.is_prefill:
            raise ValueError("KVSender needs a prefill KVManager")
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        par = mgr.parallel
        if par.dp_size > 1 and not req_has_disagg_prefill_dp_rank and \
                mgr.follow_bootstrap_room and self.bootstrap_room % par.dp_size != par.dp_rank:
            # As SGLang's common backend: a request routed by room must land on DP rank
            # room % dp_size, where the decode looks for it.
            self._fail("follow_bootstrap_room conflict: dispatched to DP rank %d, but room %d "
                       "routes to DP rank %d of %d" % (par.dp_rank, self.bootstrap_room,
                                                       self.bootstrap_room % par.dp_size,
                                                       par.dp_size))
            return
        try:
            self._room = mgr.context.sender(self.bootstrap_room)
        except KvwireError as e:        # e.g. the room is already open on this rank
            self._fail(e.message or str(e), e.status)
        self.num_kv_indices = None
        self.aux_index = None
        self._pages_sent = 0
        self._last_sent = False
        self._stream = None  # layers still to be marked of a streamed chunk
        self._written = None  # the event the latest chunk waits on (_written_event)
        self._early_send_wait_event = None  # set by SGLang's prefill.py before a send

    def _instance(self):
        return self.kv_mgr.bootstrap_addr

    def init(self, num_kv_indices, aux_index=None):
        """Starts the request: num_kv_indices pages in all (a page count, as SGLang
        computes it: ceil(len(req.origin_input_ids) / page_size)), its aux slot
        aux_index. kvwire moves whole pages (see KVManager.tokens_of)."""
        num_kv_indices = int(num_kv_indices)
        if num_kv_indices <= 0:
            raise ValueError("num_kv_indices must be a positive page count, got %d"
                             % num_kv_indices)
        self.num_tokens = self.kv_mgr.tokens_of(num_kv_indices)
        self.num_kv_indices = num_kv_indices
        self.aux_index = None if aux_index is None else int(aux_index)
        self._pages_sent = 0

    def pop_decode_prefix_len(self):
        """0: the prefill sends every page; kvwire skips what the decode has cached
        (the decode's decode_prefix_len reaches kvwire through send_metadata)."""
        return 0

    def should_send_kv_chunk(self, num_pages, last_chunk):
        return num_pages > 0 or bool(last_chunk)

    def send(self, kv_indices, state_indices=None, token_position_offset=0, *, streamed=False):
        """Sends the next chunk: kv_indices are this rank's pages following those of
        the previous chunks; the chunk that completes num_kv_indices pages is the
        last, and carries the state (state_indices, one entry per state type) and
        the aux data. A failure of the room shows in poll(); misuse raises.

        streamed (keyword-only, a kvwire extension): the chunk's layers are still being
        computed; layers_ready() marks them as the forward pass proceeds and each group
        leaves at once. The aux data of a streamed last chunk is read when its last
        layer is marked (the output token exists only then)."""
        if self.num_kv_indices is None:
            raise RuntimeError("KVSender.init() must come before send() (room %d)"
                               % self.bootstrap_room)
        if token_position_offset:
            raise ValueError("room %d: token_position_offset=%r is not supported by the kvwire "
                             "SGLang backend" % (self.bootstrap_room, token_position_offset))
        if self._last_sent:
            raise RuntimeError("room %d: the last chunk was already sent" % self.bootstrap_room)
        if self._stream:
            raise RuntimeError("room %d: layers %s of the streamed chunk were never marked "
                               "ready" % (self.bootstrap_room, sorted(self._stream)))
        pages = _ints(kv_indices, "kv_indices")
        ps = self.kv_mgr.page_size
        first = self._pages_sent
        end_page = first + len(pages)
        if end_page > self.num_kv_indices:
            raise ValueError("room %d: %d pages sent in all, init() announced %d"
                             % (self.bootstrap_room, end_page, self.num_kv_indices))
        last = end_page == self.num_kv_indices
        swa, swa_first = (), 0
        slot = -1
        if last:
            swa, swa_first, slot = _state_pages(self.kv_mgr, state_indices, self.num_tokens,
                                                "KVSender.send (room %d)" % self.bootstrap_room)
        elif state_indices is not None and any(s is not None for s in state_indices):
            raise ValueError("room %d: state indices come with the last chunk only"
                             % self.bootstrap_room)
        end_tok = self.num_tokens if last else end_page * ps
        if streamed:
            par = self.kv_mgr.parallel
            self._stream = set(range(par.layer_begin, par.layer_end))
            self._stream_last = last
        if self._room is None:
            self._pages_sent, self._last_sent = end_page, last
            return
        try:
            self._settle_written()
            if last and not streamed and self.kv_mgr.aux and self.aux_index is not None:
                self._room.set_metadata(self.kv_mgr.read_aux(self.aux_index))
            if streamed:
                # A streamed chunk is queued even without pages: its marks name it.
                self._room.send_streamed(self.num_tokens, first * ps, end_tok, last, pages,
                                         first * ps, swa, swa_first, slot)
            elif pages or last:
                # Still being written: queued as a streamed chunk whose every layer waits
                # on the event (kvwire._order).
                par = self.kv_mgr.parallel
                self._written = _order.queue_after(
                    self._room, self._written_event(), par.layer_begin, par.layer_end,
                    (self.num_tokens, first * ps, end_tok, last, pages, first * ps, swa,
                     swa_first, slot))
        except KvwireError as e:
            self._fail(e.message or str(e), e.status)
        self._pages_sent = end_page
        self._last_sent = last

    def _written_event(self):
        """The CUDA event a chunk's reads are ordered after, or None (host pools).

        SGLang hands one over as `_early_send_wait_event` when it sends a cached prefix
        while the previous forward pass may still be writing it (prefill.py,
        maybe_send_cached_prefix_chunk); it is consumed by this send. Otherwise, for CUDA
        pools, an event is recorded on the caller's current stream, so that KV written
        there and not yet synchronized is read only once written. SGLang's scheduler
        synchronizes before it sends, so that event has normally completed already and
        costs one record and one query; an engine that does not would otherwise have
        its last layers read while its kernels still write them."""
        ev, self._early_send_wait_event = self._early_send_wait_event, None
        return _order.chunk_event(
            ev, self.kv_mgr.device if self.kv_mgr.mem_kind == MemKind.CUDA else None)

    def _settle_written(self):
        """Before the next chunk: the previous one, if it waited on an event, must have
        all its layers marked (the library takes the next chunk only then). The event is
        waited for here, which happens only when the engine sends again before the GPU
        wrote the previous chunk, and the layers marked at once rather than at the
        event thread's next poll."""
        ev, self._written = self._written, None
        par = self.kv_mgr.parallel
        _order.settle(self._room, ev, par.layer_begin, par.layer_end)

    def layers_ready(self, layer_begin, layer_end=None, event=None):
        """Marks the global layers [layer_begin, layer_end) (layer_end defaults to
        layer_begin + 1) of the streamed chunk ready (a kvwire extension; any order, a
        layer marked twice is fine). With `event` (a torch.cuda.Event recorded on the
        forward stream after those layers were written) they become ready when it
        completes, and the forward pass never synchronizes. Layers outside this rank's
        pipeline stage, or no streamed chunk, raise ValueError; a failure of the room
        shows in poll()."""
        layer_end = layer_begin + 1 if layer_end is None else layer_end
        par = self.kv_mgr.parallel
        if self._stream is None:
            raise ValueError("room %d: no streamed chunk (send(..., streamed=True))"
                             % self.bootstrap_room)
        if not par.layer_begin <= layer_begin < layer_end <= par.layer_end:
            raise ValueError("room %d: layers [%d, %d) are not a range of this rank's "
                             "pipeline stage, layers [%d, %d)" % (self.bootstrap_room,
                                                                  layer_begin, layer_end,
                                                                  par.layer_begin,
                                                                  par.layer_end))
        rest = self._stream - set(range(layer_begin, layer_end))
        if self._room is None:
            self._stream = rest
            return
        try:
            if not rest and self._stream and self._stream_last and self.kv_mgr.aux and \
                    self.aux_index is not None:
                self._room.set_metadata(self.kv_mgr.read_aux(self.aux_index))
            self._room.layers_ready(layer_begin, layer_end, event=event)
        except KvwireError as e:
            self._fail(e.message or str(e), e.status)
        self._stream = rest

    def poll(self):
        """KVPoll: Bootstrapping until a decode rank posted its pages for the room,
        then WaitingForInput, Transferring, Success or Failed."""
        if self._room is None:
            if self._final is not None:
                return self._final
            return KVPoll.Failed
        st = self._room.poll()
        if self._error is not None or st == RoomState.FAILED:
            return KVPoll.Failed
        return kvpoll(st)


def _state_pages(mgr, state_indices, num_tokens, what):
    """(swa pages, their first token, state slot) from SGLang's per-state-type list."""
    types = mgr.state_types
    if state_indices is None:
        state_indices = [None] * len(types)
    state_indices = list(state_indices)
    if len(state_indices) != len(types):
        raise ValueError("%s: %d state index entries for the %d state types %s"
                         % (what, len(state_indices), len(types), [t.value for t in types]))
    swa, swa_first, slot = (), 0, -1
    for t, idx in zip(types, state_indices):
        if t == StateType.SWA:
            if idx is None:
                raise ValueError("%s: the SWA pages of the request are missing" % what)
            swa, swa_first = mgr.swa_side(num_tokens, _ints(idx, "SWA state indices"), what)
        elif t == StateType.MAMBA:
            if idx is None:
                raise ValueError("%s: the Mamba state slot of the request is missing" % what)
            flat = []
            for v in (idx if isinstance(idx, (list, tuple)) else [idx]):
                v = v.tolist() if hasattr(v, "tolist") else v
                flat += [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]
            if len(flat) != 1:
                raise ValueError("%s: %d Mamba state slots, one expected" % (what, len(flat)))
            slot = flat[0]
    return swa, swa_first, slot


class KVReceiver(_Request):
    """A request's decode side on one rank (SGLang's BaseKVReceiver).

    bootstrap_addr names the prefill instance ("host:port" of its bootstrap
    endpoint), per request."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room=None, prefill_dp_rank=None):
        if mgr.is_prefill:
            raise ValueError("KVReceiver needs a decode KVManager")
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        self.prefill_dp_rank = prefill_dp_rank
        self._initialized = False
        self.aux_index = None
        self._posted = False
        self._aux_done = False

    def init(self, prefill_dp_rank=None):
        """Opens the room, fed by DP group prefill_dp_rank of the prefill instance at
        bootstrap_addr; the first room for an instance connects in the background.
        A malformed or unreachable address fails the room at once (see poll())."""
        if self._error is not None:     # aborted (or failed) before init: stays Failed
            self._initialized = True
            return
        if self._room is not None or self._initialized:
            raise RuntimeError("KVReceiver.init called twice (room %d)" % self.bootstrap_room)
        self._initialized = True
        if prefill_dp_rank is None:
            prefill_dp_rank = self.prefill_dp_rank
        if prefill_dp_rank is None:
            raise ValueError("room %d: the prefill DP rank is unknown" % self.bootstrap_room)
        self.prefill_dp_rank = int(prefill_dp_rank)
        try:
            self._room = self.kv_mgr.context.receiver(self.bootstrap_room, self.prefill_dp_rank,
                                                      self.bootstrap_addr)
        except KvwireError as e:
            self._fail("prefill instance %s: %s" % (self.bootstrap_addr, e.message or e), e.status)

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None,
                      decode_prefix_len=None):
        """Tells the prefill ranks where to write: kv_indices are this rank's pages of
        tokens [decode_prefix_len, tokens) (decode_prefix_len: tokens already cached
        here, a whole number of pages), aux_index this request's aux slot,
        state_indices one entry per state type."""
        if self._room is None and self._error is None:
            raise RuntimeError("KVReceiver.init() must come before send_metadata() (room %d)"
                               % self.bootstrap_room)
        if self._posted:
            raise RuntimeError("send_metadata called twice (room %d)" % self.bootstrap_room)
        prefix = int(decode_prefix_len or 0)
        ps = self.kv_mgr.page_size
        if prefix % ps:
            raise ValueError("decode_prefix_len=%d is not a whole number of %d-token pages"
                             % (prefix, ps))
        pages = _ints(kv_indices, "kv_indices")
        if not pages:
            raise ValueError("room %d: no pages to receive into" % self.bootstrap_room)
        n = self.kv_mgr.tokens_of(len(pages), prefix)
        swa, swa_first, slot = _state_pages(self.kv_mgr, state_indices, n,
                                            "KVReceiver.send_metadata (room %d)"
                                            % self.bootstrap_room)
        self.num_tokens = n
        self.aux_index = None if aux_index is None else int(aux_index)
        if self.kv_mgr.aux and self.aux_index is None:
            raise ValueError("room %d: aux_index is required (this rank has aux buffers)"
                             % self.bootstrap_room)
        if self.aux_index is not None:
            for _, length, item in self.kv_mgr.aux:
                if (self.aux_index + 1) * item > length or self.aux_index < 0:
                    raise ValueError("aux_index %d outside an aux buffer of %d items"
                                     % (self.aux_index, length // item))
        self._posted = True
        if self._room is None:
            return
        try:
            self._room.post(n, prefix, pages, prefix, swa, swa_first, slot)
        except KvwireError as e:
            self._fail(e.message or str(e), e.status)

    @property
    def conclude_state(self):
        """The final KVPoll once the request is over (Success or Failed), else None:
        SGLang's decode polls a queue whose receivers all wait for input only while
        none of them has concluded Failed (decode.py _update_handshake_waiters)."""
        if self._error is not None:
            return KVPoll.Failed
        if self._room is None:
            return self._final if self._final in (KVPoll.Success, KVPoll.Failed) else None
        st = self._room.poll()
        if st == RoomState.FAILED:
            return KVPoll.Failed
        if st == RoomState.SUCCESS and self._aux_done:
            return KVPoll.Success
        return None

    def abort(self):
        """Aborts the request and tells the prefill ranks at once.

        kvwire does that for a receiver room in any state, posted or not, also while its
        instance is still being connected (the prefill ranks of the room's DP group hear
        of it once the connection is up). Before init() there is no room yet (SGLang
        inits once it knows the prefill's DP rank): the room is opened routed as
        SGLang's decode will route it (disagg_prefill_dp_rank, else follow_bootstrap_room
        over the instance's DP size) and aborted, so the prefill's sender fails now
        instead of after its bootstrap timeout. A later init() leaves it Failed."""
        if self._room is None and self._error is None and not self._initialized:
            mgr = self.kv_mgr
            try:
                dp = self.prefill_dp_rank
                if dp is None:
                    info = mgr.prefill_info_table.get(self.bootstrap_addr)
                    n = info.dp_size if info is not None else \
                        _prefill_dp_size(self.bootstrap_addr)
                    dp = self.bootstrap_room % n if n > 1 else 0
                self._room = mgr.context.receiver(self.bootstrap_room, int(dp),
                                                  self.bootstrap_addr)
            except (KvwireError, ValueError):
                # e.g. a malformed address or KVWIRE_SGLANG_PREFILL_DP_SIZE: no one to
                # tell; the request still fails here.
                self._room = None
        super().abort()

    def poll(self):
        """KVPoll: Bootstrapping before init(); WaitingForInput until the transfer
        starts (send_metadata may be called then; kvwire keeps the pages until the
        instance is connected); Transferring; Success once every byte and the aux
        data landed (the aux data is then in this rank's aux buffers); Failed."""
        if self._error is not None:
            return KVPoll.Failed
        if self._room is None:
            return self._final if self._final is not None else KVPoll.Bootstrapping
        st = self._room.poll()
        if st == RoomState.FAILED:
            return KVPoll.Failed
        if st == RoomState.SUCCESS:
            if not self._aux_done:
                try:
                    data = self._room.metadata()
                    if self.kv_mgr.aux:
                        self.kv_mgr.write_aux(self.aux_index, data)
                    elif data:
                        raise ValueError("%d bytes of aux data, this rank has no aux buffers"
                                         % len(data))
                except (KvwireError, ValueError) as e:
                    self._fail("aux data: %s" % e)
                    return KVPoll.Failed
                self._aux_done = True
            return KVPoll.Success
        if st == RoomState.BOOTSTRAPPING:
            return KVPoll.WaitingForInput
        return kvpoll(st)


class KVBootstrapServer:
    """SGLang's bootstrap server shape (host, port) over kvwire.BootstrapServer: the
    prefill ranks of one instance register there and decode ranks look them up.
    port 0 picks one (see .port / .address). It outlives the ranks. secret: the
    ranks' shared secret (the one given to their KVManager)."""

    def __init__(self, host, port, *, secret=None):
        self._server = BootstrapServer(_join_host_port(host or "0.0.0.0", port), secret=secret)
        self.host = host

    @property
    def address(self):
        return self._server.address

    @property
    def port(self):
        return int(self.address.rsplit(":", 1)[1])

    def run(self):
        """The endpoint runs from construction on; kept for the interface."""

    def close(self):
        self._server.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------- registration

_UTILS = "sglang.srt.disaggregation.utils"
_SERVER_ARGS = "sglang.srt.server_args"
_CLASSES = None


def _kv_classes():
    return {"kvargs": KVArgs, "manager": KVManager, "sender": KVSender,
            "receiver": KVReceiver, "bootstrap_server": KVBootstrapServer}


def _patch_utils(mod):
    """Adds TransferBackend.KVWIRE ("kvwire") to SGLang's enum and wraps get_kv_class
    so that it returns this module's classes for it (utils.py at 8905cbd: a closed Enum
    and an if-chain raising for anything else)."""
    tb = mod.TransferBackend
    if "KVWIRE" not in tb._member_map_:
        member = object.__new__(tb)
        member._name_, member._value_ = "KVWIRE", "kvwire"
        try:
            member.__objclass__ = tb
        except AttributeError:
            pass
        if hasattr(member, "_sort_order_"):
            member._sort_order_ = len(tb._member_names_)
        type.__setattr__(tb, "KVWIRE", member)
        tb._member_map_["KVWIRE"] = member
        tb._value2member_map_["kvwire"] = member
        tb._member_names_.append("KVWIRE")
    orig = mod.get_kv_class
    if getattr(orig, "_kvwire", False):
        return
    member = tb._member_map_["KVWIRE"]

    def get_kv_class(transfer_backend, class_type):
        if transfer_backend == member or getattr(transfer_backend, "value", None) == "kvwire":
            return _kv_classes().get(getattr(class_type, "value", class_type))
        return orig(transfer_backend, class_type)
    get_kv_class._kvwire = True
    get_kv_class.__wrapped__ = orig
    get_kv_class.__doc__ = orig.__doc__
    mod.get_kv_class = get_kv_class
    # Modules that bound the name before registration (from ... import get_kv_class).
    for name, m in list(sys.modules.items()):
        if name.startswith("sglang.") and m is not None and \
                getattr(m, "get_kv_class", None) is orig:
            m.get_kv_class = get_kv_class


def _patch_server_args(mod):
    choices = getattr(mod, "DISAGG_TRANSFER_BACKEND_CHOICES", None)
    if isinstance(choices, list) and "kvwire" not in choices:
        add = getattr(mod, "add_disagg_transfer_backend_choices", None)
        if add is not None:
            add(["kvwire"])
        else:
            choices.append("kvwire")


class _Hook:
    """A meta-path finder that patches SGLang's modules as they are first imported."""
    _targets = {_UTILS: _patch_utils, _SERVER_ARGS: _patch_server_args}

    def find_spec(self, name, path=None, target=None):
        if name not in self._targets:
            return None
        import importlib.machinery
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                loader, patch = spec.loader, self._targets[name]
                orig_exec = loader.exec_module

                class _Loader(importlib.abc.Loader):
                    def create_module(self, spec):
                        return loader.create_module(spec)

                    def exec_module(self, module):
                        orig_exec(module)
                        patch(module)
                spec.loader = _Loader()
                return spec
        return None


def register():
    """Makes ``--disaggregation-transfer-backend kvwire`` work in an unmodified SGLang.

    Call it in every SGLang process before the scheduler starts, e.g. from a
    sitecustomize.py on PYTHONPATH (see python/README.md). It extends SGLang's
    DISAGG_TRANSFER_BACKEND_CHOICES (the CLI), TransferBackend (a member KVWIRE =
    "kvwire") and get_kv_class (returning this module's classes for it); modules
    imported later are patched as they load. Idempotent."""
    import importlib.abc  # noqa: F401  (used by _Hook)
    for name, patch in _Hook._targets.items():
        m = sys.modules.get(name)
        if m is not None:
            patch(m)
    if not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())
