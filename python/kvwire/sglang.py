"""kvwire as an SGLang disaggregation transfer backend.

The classes here have the interface of SGLang's disaggregation backends
(``sglang.srt.disaggregation.base.conn``): ``KVArgs``, ``KVManager``, ``KVSender``,
``KVReceiver``, ``KVBootstrapServer`` and ``KVPoll``, with the same constructor
signatures, method names, argument order and units, so that SGLang's prefill and
decode schedulers can drive kvwire unchanged. Host memory only (see python/README.md).

Units, and how the token count is found
---------------------------------------
SGLang hands a backend page counts and page lists, never the prompt's token count:

* prefill: ``KVSender.init(num_kv_indices, aux_index)``: ``num_kv_indices`` is the
  number of pages of the request (``ceil(tokens / page_size)``); each ``send``
  passes the pages of one chunk; the chunk that reaches ``num_kv_indices`` pages
  is the last one;
* decode: ``KVReceiver.send_metadata(kv_indices, aux_index, state_indices,
  decode_prefix_len)``: the pages of tokens ``[decode_prefix_len, tokens)``.

kvwire needs exact token counts. Without a hint this backend uses whole pages
(``num_pages * page_size`` tokens): for full-attention, MLA and state layers that
moves every computed token plus the unused tail of the last page, which both sides
own (what SGLang's other backends move too). For sliding-window layers held in a
separate SWA pool that is wrong (the window would start up to a page too late), so
there the exact count is required: pass ``num_tokens=len(req.origin_input_ids)`` to
``KVSender.init`` and to ``KVReceiver.send_metadata`` (keyword-only extensions);
without it they raise ValueError instead of guessing. A given ``num_tokens`` is
checked against the page counts.

State indices come per state type, in ``KVArgs.state_types`` order: the SWA entry is
the request's SWA-pool pages from ``floor(max(0, tokens - window) / page_size) *
page_size`` (SGLang's rule). Mamba and the other state types are refused when the
manager is built.

Aux data (first output token, logprobs, hidden states) at ``aux_index`` of the
prefill's aux buffers travels as kvwire per-room metadata and is written into the
decode's aux buffers at its own ``aux_index`` when the room reaches Success (before
``poll`` first returns ``KVPoll.Success``). The payload starts with the aux layout
(buffer count and item lengths); a decode whose layout differs fails the room.
"""
import ctypes
import enum
import struct
import zlib

from .connector import KVPoll, kvpoll, _side
from .core import (Buffer, Context, KvwireError, LayerKind, Model, Parallel, Pool, Rank, Role,
                   RoomState, Side, BootstrapServer, topo_heads)

__all__ = ["KVArgs", "KVPoll", "StateType", "KVTransferMetric", "KVTransferError",
           "KVManager", "KVSender", "KVReceiver", "KVBootstrapServer", "model_layers",
           "MAX_AUX_BYTES"]

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
    prefill_end_layer. Pointers are host addresses. model_config (not an SGLang
    field) may carry the model config the layer kinds come from."""

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


class KVManager:
    """One rank's kvwire state, built from SGLang's KVArgs.

    args: KVArgs (flat host pointer lists, see KVArgs). disaggregation_mode:
    "prefill"/"decode" or SGLang's DisaggregationMode. server_args: read for
    tp_size, dp_size, enable_dp_attention, pp_size, host and
    disaggregation_bootstrap_port (prefill: where the instance's
    KVBootstrapServer listens; a ``disaggregation_bootstrap_addr`` "host:port"
    attribute wins). is_mla_backend: every layer is MLA (one latent buffer per
    layer).

    Keyword-only extensions: model_config (else args.model_config, else
    server_args.model_config) gives the layer kinds and windows, see
    model_layers(); instance_id (decode: the same on every rank of one decode
    instance; default: a hash of server_args host:port); the remaining keywords go
    to kvwire.Context (transport, timeouts in ms, secret, busy_poll_us).

    Prefill managers register with the bootstrap endpoint when built
    (register_to_bootstrap() is a no-op kept for the interface). Decode managers
    name no prefill instance: every KVReceiver names its own, and one decode
    manager serves any number of prefill instances."""

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False, *,
                 model_config=None, instance_id=None, **context_kwargs):
        self.kv_args = args
        self.server_args = server_args
        self.mode = _side(disaggregation_mode)
        self.is_mla_backend = bool(is_mla_backend)
        cfg = model_config or getattr(args, "model_config", None) or \
            getattr(server_args, "model_config", None)
        layers = model_layers(cfg, self.is_mla_backend)
        self.page_size = int(args.page_size)
        if self.page_size <= 0:
            raise ValueError("KVArgs.page_size must be positive")
        self.swa_page_size = int(getattr(args, "swa_page_size", None) or self.page_size)

        state_types = [StateType(getattr(t, "value", t)) for t in (args.state_types or [])]
        self.state_types = state_types
        for t in state_types:
            if t != StateType.SWA:
                raise ValueError("state type %r is not supported by the kvwire SGLang backend "
                                 "(supported: swa)" % t.value)
        has_swa_pool = StateType.SWA in state_types
        # Without a separate SWA pool the sliding-window layers keep every token in
        # the full pool: they are moved like full-attention layers.
        kinds = []
        for l in layers:
            if l.kind == LayerKind.SWA and not has_swa_pool:
                kinds.append(("full", 0))
            else:
                kinds.append((l.kind, l.window))

        tp = int(getattr(server_args, "tp_size", 1) or 1)
        dp = int(getattr(server_args, "dp_size", 1) or 1)
        dp_attn = bool(getattr(server_args, "enable_dp_attention", False))
        attn_tp = tp // dp if dp_attn else tp
        pp = int(getattr(server_args, "pp_size", 1) or 1)
        dp_rank = int(getattr(args, "system_dp_rank", 0) or 0) if dp_attn else 0
        begin = getattr(args, "prefill_start_layer", None)
        if begin is None:
            if pp > 1 and int(args.pp_rank or 0) > 0:
                raise ValueError("PP stage %d: KVArgs.prefill_start_layer (the stage's first "
                                 "layer) is required" % args.pp_rank)
            begin = 0
        begin = int(begin)
        end = getattr(args, "prefill_end_layer", None)
        if end is not None:
            end = int(end)
        elif pp == 1:
            end = len(layers)
        else:
            # The stage's layers are those its buffers hold, from its first layer on.
            n_full = len(args.kv_data_ptrs) // (1 if self.is_mla_backend else 2)
            n_swa = len(args.state_data_ptrs[state_types.index(StateType.SWA)]) // 2 \
                if has_swa_pool else 0
            end = begin
            while end < len(layers) and (n_full or n_swa):
                if kinds[end][0] == LayerKind.SWA:
                    n_swa -= 1
                else:
                    n_full -= 1
                if n_full < 0 or n_swa < 0:
                    break
                end += 1
        self.parallel = Parallel(attn_tp, int(args.engine_rank), pp, int(args.pp_rank or 0),
                                 begin, end, dp if dp_attn else 1, dp_rank)

        stage = range(begin, end)
        full_ids = [i for i in stage if kinds[i][0] in (LayerKind.FULL, LayerKind.MLA)]
        swa_ids = [i for i in stage if kinds[i][0] == LayerKind.SWA]
        self.swa_window = max([kinds[i][1] for i in swa_ids] or [0])
        self.exact_tokens_required = bool(swa_ids)

        total_heads = int(getattr(args, "total_kv_head_num", 0) or 0) or \
            int(_get(cfg, "num_key_value_heads") or _get(_hf(cfg), "num_key_value_heads") or 0)
        if self.is_mla_backend:
            heads = total_heads = 1
        else:
            if not total_heads:
                raise ValueError("the number of KV heads is unknown: set "
                                 "KVArgs.total_kv_head_num or num_key_value_heads in the "
                                 "model config")
            _, heads = topo_heads(attn_tp, int(args.engine_rank), total_heads)
            given = int(getattr(args, "kv_head_num", 0) or 0)
            if given and given != heads:
                raise ValueError("KVArgs.kv_head_num is %d but attention-TP rank %d of %d owns "
                                 "%d of %d KV heads" % (given, args.engine_rank, attn_tp,
                                                        heads, total_heads))
        self.num_local_heads = heads

        ptrs, lens, items = list(args.kv_data_ptrs), list(args.kv_data_lens), \
            list(args.kv_item_lens)
        if not (len(ptrs) == len(lens) == len(items)):
            raise ValueError("kv_data_ptrs/lens/item_lens have different lengths")
        buffers = []
        head_bytes = {}

        def add(layer, role, ptr, length, item, ps, pool):
            if item % ps:
                raise ValueError("layer %d %s: item length %d is not a multiple of the page "
                                 "size %d" % (layer, role.name, item, ps))
            row = item // ps
            if row % heads:
                raise ValueError("layer %d %s: %d bytes per token do not split into %d heads"
                                 % (layer, role.name, row, heads))
            hb = row // heads
            if head_bytes.setdefault(role, hb) != hb:
                raise ValueError("layer %d %s: %d bytes per head, other layers have %d"
                                 % (layer, role.name, hb, head_bytes[role]))
            buffers.append(Buffer(layer, role, addr=int(ptr), length=int(length), pool=pool,
                                  page_size=ps, num_heads=heads, head_bytes=hb))

        if self.is_mla_backend:
            if len(ptrs) != len(full_ids):
                raise ValueError("MLA: %d KV buffers for the %d layers [%d, %d)"
                                 % (len(ptrs), len(full_ids), begin, end))
            for i, layer in enumerate(full_ids):
                add(layer, Role.LATENT, ptrs[i], lens[i], items[i], self.page_size, Pool.FULL)
        else:
            if len(ptrs) != 2 * len(full_ids):
                raise ValueError("%d KV buffers, but layers [%d, %d) of the model config have "
                                 "%d full-attention layers (K then V buffers: %d expected)"
                                 % (len(ptrs), begin, end, len(full_ids), 2 * len(full_ids)))
            n = len(full_ids)
            for i, layer in enumerate(full_ids):
                add(layer, Role.K, ptrs[i], lens[i], items[i], self.page_size, Pool.FULL)
                add(layer, Role.V, ptrs[n + i], lens[n + i], items[n + i], self.page_size,
                    Pool.FULL)
        if has_swa_pool:
            k = state_types.index(StateType.SWA)
            sp, sl, si = (list(args.state_data_ptrs[k]), list(args.state_data_lens[k]),
                          list(args.state_item_lens[k]))
            if len(sp) != 2 * len(swa_ids) or len(sl) != len(sp) or len(si) != len(sp):
                raise ValueError("%d SWA state buffers, but layers [%d, %d) of the model config "
                                 "have %d sliding-window layers (%d expected)"
                                 % (len(sp), begin, end, len(swa_ids), 2 * len(swa_ids)))
            n = len(swa_ids)
            for i, layer in enumerate(swa_ids):
                add(layer, Role.K, sp[i], sl[i], si[i], self.swa_page_size, Pool.SWA)
                add(layer, Role.V, sp[n + i], sl[n + i], si[n + i], self.swa_page_size,
                    Pool.SWA)

        if self.is_mla_backend:
            lat = head_bytes.get(Role.LATENT, 0)
            self.model = Model(["mla"] * len(kinds), num_kv_heads=1, head_dim=0, mla_dim=lat,
                               elem_size=1)
        else:
            kb, vb = head_bytes.get(Role.K, 0), head_bytes.get(Role.V, 0)
            self.model = Model(kinds, num_kv_heads=total_heads, k_head_dim=kb, v_head_dim=vb,
                               elem_size=1)

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

        self.rank = Rank(self.model, self.parallel, buffers)
        try:
            if self.mode == Side.PREFILL:
                self.bootstrap_addr = _bootstrap_addr_of(server_args)
                self.context = Context(self.rank, Side.PREFILL, self.bootstrap_addr,
                                       **context_kwargs)
            else:
                self.bootstrap_addr = None
                if instance_id is None:
                    key = "%s:%s" % (getattr(server_args, "host", ""),
                                     getattr(server_args, "port", ""))
                    instance_id = zlib.crc32(key.encode())
                self.context = Context(self.rank, Side.DECODE, None, instance_id=instance_id,
                                       **context_kwargs)
        except BaseException:
            self.rank.close()
            raise

    @property
    def is_prefill(self):
        return self.mode == Side.PREFILL

    def register_to_bootstrap(self):
        """Prefill ranks register when the manager is built; kept for the interface."""

    def swa_first_token(self, num_tokens):
        """First token of a request's SWA page list (SGLang's rule: the window start,
        floored to the page size)."""
        t = max(0, num_tokens - self.swa_window)
        return t // self.page_size * self.page_size

    def tokens_for(self, num_pages, num_tokens, first_token, what):
        """The exact token count of a request whose pages from token first_token
        number num_pages; validates the num_tokens hint, or uses whole pages when the
        model allows it (see the module docstring)."""
        if num_tokens is None:
            if self.exact_tokens_required:
                raise ValueError(
                    "%s: this model has sliding-window layers in a separate SWA pool, which "
                    "need the exact token count; page counts cannot give it. Pass "
                    "num_tokens=len(req.origin_input_ids)" % what)
            return first_token + num_pages * self.page_size
        num_tokens = int(num_tokens)
        if num_tokens <= first_token or \
                _ceil_div(num_tokens - first_token, self.page_size) != num_pages:
            raise ValueError("%s: num_tokens=%d does not fit %d pages of %d tokens from token %d"
                             % (what, num_tokens, num_pages, self.page_size, first_token))
        return num_tokens

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
    addr = getattr(server_args, "disaggregation_bootstrap_addr", None)
    if addr:
        return str(addr)
    host = getattr(server_args, "host", None) or "127.0.0.1"
    port = getattr(server_args, "disaggregation_bootstrap_port", None)
    if port is None:
        raise ValueError("server_args has no disaggregation_bootstrap_port")
    return "%s:%d" % (host, int(port))


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
        try:
            self._room = mgr.context.sender(self.bootstrap_room)
        except KvwireError as e:        # e.g. the room is already open on this rank
            self._fail(e.message or str(e), e.status)
        self.num_kv_indices = None
        self.aux_index = None
        self._pages_sent = 0
        self._last_sent = False
        self._stream = None  # layers still to be marked of a streamed chunk

    def _instance(self):
        return self.kv_mgr.bootstrap_addr

    def init(self, num_kv_indices, aux_index=None, *, num_tokens=None):
        """Starts the request: num_kv_indices pages in all (a page count, as SGLang
        computes it: ceil(len(req.origin_input_ids) / page_size)), its aux slot
        aux_index. num_tokens (keyword-only): the exact token count, required when
        the model has a separate SWA pool, otherwise whole pages are moved."""
        num_kv_indices = int(num_kv_indices)
        if num_kv_indices <= 0:
            raise ValueError("num_kv_indices must be a positive page count, got %d"
                             % num_kv_indices)
        self.num_tokens = self.kv_mgr.tokens_for(num_kv_indices, num_tokens, 0,
                                                 "KVSender.init (room %d)" % self.bootstrap_room)
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
            raise ValueError("token_position_offset=%r is not supported" % token_position_offset)
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
        if last:
            swa, swa_first = _state_pages(self.kv_mgr, state_indices, self.num_tokens,
                                          "KVSender.send")
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
            if last and not streamed and self.kv_mgr.aux and self.aux_index is not None:
                self._room.set_metadata(self.kv_mgr.read_aux(self.aux_index))
            if streamed:
                # A streamed chunk is queued even without pages: its marks name it.
                self._room.send_streamed(self.num_tokens, first * ps, end_tok, last, pages,
                                         first * ps, swa, swa_first, -1)
            elif pages or last:
                self._room.send(self.num_tokens, first * ps, end_tok, last, pages, first * ps,
                                swa, swa_first, -1)
        except KvwireError as e:
            self._fail(e.message or str(e), e.status)
        self._pages_sent = end_page
        self._last_sent = last

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
    """(swa pages, their first token) from SGLang's per-state-type list."""
    types = mgr.state_types
    if state_indices is None:
        state_indices = [None] * len(types)
    state_indices = list(state_indices)
    if len(state_indices) != len(types):
        raise ValueError("%s: %d state index entries for the %d state types %s"
                         % (what, len(state_indices), len(types), [t.value for t in types]))
    swa, swa_first = (), 0
    for t, idx in zip(types, state_indices):
        if t == StateType.SWA:
            if idx is None:
                raise ValueError("%s: the SWA pages of the request are missing" % what)
            swa = _ints(idx, "SWA state indices")
            swa_first = mgr.swa_first_token(num_tokens)
            need = _ceil_div(num_tokens - swa_first, mgr.swa_page_size)
            if len(swa) != need:
                raise ValueError("%s: %d SWA pages, tokens [%d, %d) need %d"
                                 % (what, len(swa), swa_first, num_tokens, need))
    return swa, swa_first


class KVReceiver(_Request):
    """A request's decode side on one rank (SGLang's BaseKVReceiver).

    bootstrap_addr names the prefill instance ("host:port" of its bootstrap
    endpoint), per request."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room=None, prefill_dp_rank=None):
        if mgr.is_prefill:
            raise ValueError("KVReceiver needs a decode KVManager")
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        self.prefill_dp_rank = prefill_dp_rank
        self.aux_index = None
        self._posted = False
        self._aux_done = False

    def init(self, prefill_dp_rank=None):
        """Opens the room, fed by DP group prefill_dp_rank of the prefill instance at
        bootstrap_addr; the first room for an instance connects in the background.
        A malformed or unreachable address fails the room at once (see poll())."""
        if self._room is not None or self._error is not None:
            raise RuntimeError("KVReceiver.init called twice (room %d)" % self.bootstrap_room)
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
                      decode_prefix_len=None, *, num_tokens=None):
        """Tells the prefill ranks where to write: kv_indices are this rank's pages of
        tokens [decode_prefix_len, tokens) (decode_prefix_len: tokens already cached
        here, a whole number of pages), aux_index this request's aux slot,
        state_indices one entry per state type. num_tokens (keyword-only): the exact
        token count, see KVSender.init."""
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
        n = self.kv_mgr.tokens_for(len(pages), num_tokens, prefix,
                                   "KVReceiver.send_metadata (room %d)" % self.bootstrap_room)
        swa, swa_first = _state_pages(self.kv_mgr, state_indices, n,
                                      "KVReceiver.send_metadata")
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
            self._room.post(n, prefix, pages, prefix, swa, swa_first, -1)
        except KvwireError as e:
            self._fail(e.message or str(e), e.status)

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
        self._server = BootstrapServer("%s:%d" % (host, int(port)), secret=secret)
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
