"""Pythonic wrappers over libkvwire: models, ranks, contexts, senders, receivers."""
import array
import ctypes
import enum
import time
import weakref
from collections import namedtuple

from . import _native as N

__all__ = [
    "Status", "LayerKind", "Pool", "Role", "Layout", "MemKind", "Side", "RoomState",
    "RankField", "CtxField", "KvwireError", "Layer", "Model", "Parallel", "Buffer", "Rank",
    "SidePages", "Plan", "PlanStats", "Run", "Context", "Sender", "Receiver", "RoomMetrics",
    "Route", "topo_heads", "topo_routes", "status_string", "last_error", "kv_cache_buffers",
    "transport_available", "BootstrapServer",
]


# ---------------------------------------------------------------- enums

class Status(enum.IntEnum):
    """kvw_status_t: OK is 0, INPROGRESS 1, errors negative."""
    OK = 0
    INPROGRESS = 1
    ERR_INVALID_PARAM = -1
    ERR_NO_MEMORY = -2
    ERR_UNSUPPORTED = -3
    ERR_INCOMPATIBLE = -4
    ERR_OUT_OF_RANGE = -5
    ERR_BUFFER_TOO_SMALL = -6
    ERR_NOT_FOUND = -7
    ERR_BUSY = -8
    ERR_TIMEOUT = -20
    ERR_ABORTED = -21
    ERR_REMOTE_FAILED = -22
    ERR_BYTE_MISMATCH = -23
    ERR_MALFORMED = -40
    ERR_IO = -41
    ERR_CONN_CLOSED = -42
    ERR_REJECTED = -43
    ERR_AUTH = -44
    ERR_PEER_DEAD = -45
    ERR_INTERNAL = -60
    ERR_SHUTDOWN = -61


class LayerKind(enum.IntEnum):
    NONE = 0
    FULL = 1
    SWA = 2
    MLA = 3
    STATE = 4


class Pool(enum.IntEnum):
    FULL = 0
    SWA = 1
    STATE = 2


class Role(enum.IntEnum):
    K = 0
    V = 1
    KV = 2
    LATENT = 3
    STATE = 4
    K_SCALE = 5
    V_SCALE = 6


class Layout(enum.IntEnum):
    NHD = 0
    HND = 1
    VECTORIZED_5D = 2


class MemKind(enum.IntEnum):
    HOST = 0
    CUDA = 1


class Side(enum.IntEnum):
    PREFILL = 0
    DECODE = 1


class RankField(enum.IntFlag):
    MODEL = 1 << 0
    PARALLEL = 1 << 1
    BUFFERS = 1 << 2


class CtxField(enum.IntFlag):
    SIDE = 1 << 0
    RANK = 1 << 1
    TRANSPORT = 1 << 2
    BOOTSTRAP = 1 << 3
    HOST_BOOTSTRAP = 1 << 4
    LISTEN_HOST = 1 << 5
    TIMEOUTS = 1 << 6
    SECRET = 1 << 7
    PREFILL_SIZE = 1 << 8
    INSTANCE = 1 << 9
    BUSY_POLL = 1 << 10
    VERIFY = 1 << 11


class RoomState(enum.IntEnum):
    """kvw_room_state_t (monotonic; FAILED is sticky)."""
    BOOTSTRAPPING = 0
    WAITING_FOR_INPUT = 1
    TRANSFERRING = 2
    SUCCESS = 3
    FAILED = 4

    @property
    def terminal(self):
        return self in (RoomState.SUCCESS, RoomState.FAILED)


def _enum(cls, value, what):
    """Accepts an enum member, its int value or its name (any case)."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            return cls[value.strip().upper().replace("-", "_")]
        except KeyError:
            raise ValueError("unknown %s %r (one of %s)" % (
                what, value, ", ".join(m.name.lower() for m in cls))) from None
    return cls(int(value))


# ---------------------------------------------------------------- errors

def status_string(status):
    """kvw_status_string: short fixed text for a status."""
    s = N.load().kvw_status_string(int(status))
    return s.decode() if s else "unknown status"


def library_version():
    """kvw_version: "MAJOR.MINOR.PATCH" of the loaded libkvwire (kvwire.__version__ is
    the package's; the two are released together and must agree)."""
    return N.load().kvw_version().decode()


def last_error():
    """kvw_last_error of the calling thread."""
    s = N.load().kvw_last_error()
    return s.decode(errors="replace") if s else ""


class KvwireError(RuntimeError):
    """A kvwire call failed.

    status: Status member (or int for a code this binding does not know);
    code: the int; status_name: e.g. "ERR_REJECTED"; status_text: kvw_status_string;
    message: kvw_last_error() at the time of the failure."""

    def __init__(self, status, message=""):
        code = int(status)
        try:
            self.status = Status(code)
            self.status_name = self.status.name
        except ValueError:
            self.status = code
            self.status_name = "STATUS_%d" % code
        self.code = code
        try:
            self.status_text = status_string(code)
        except OSError:
            self.status_text = ""
        self.message = message
        text = "%s (%d, %s)" % (self.status_name, code, self.status_text)
        super().__init__(text + (": " + message if message else ""))


def _check(status, what=None):
    if status == Status.OK:
        return
    msg = last_error()
    if what and not msg:
        msg = what
    raise KvwireError(status, msg)


# ---------------------------------------------------------------- model and parallel config

Layer = namedtuple("Layer", ["kind", "window"])
Layer.__new__.__defaults__ = (0,)


def _layer(item, window=0):
    if isinstance(item, Layer):
        return Layer(_enum(LayerKind, item.kind, "layer kind"), int(item.window))
    if isinstance(item, (tuple, list)):
        kind = item[0]
        w = item[1] if len(item) > 1 else window
        return Layer(_enum(LayerKind, kind, "layer kind"), int(w))
    if isinstance(item, str) and ":" in item:  # "swa:128"
        kind, w = item.split(":", 1)
        return Layer(_enum(LayerKind, kind, "layer kind"), int(w))
    return Layer(_enum(LayerKind, item, "layer kind"), int(window or 0))


class Model:
    """What both sides must agree on (kvw_model_t).

    layers: one entry per global layer: a LayerKind (or "full", "swa", "mla",
    "state", "none"), a (kind, window) tuple, "swa:128", or a Layer. windows: an
    optional per-layer window list instead. Head dims and mla_dim are in elements,
    elem_size in bytes (2 for bf16)."""

    def __init__(self, layers, num_kv_heads=0, head_dim=None, *, k_head_dim=None,
                 v_head_dim=None, elem_size=2, mla_dim=0, scale_block=0, scale_elem_size=0,
                 windows=None):
        layers = list(layers)
        if windows is not None:
            windows = list(windows)
            if len(windows) != len(layers):
                raise ValueError("%d windows for %d layers" % (len(windows), len(layers)))
            self.layers = [_layer(l, w) for l, w in zip(layers, windows)]
        else:
            self.layers = [_layer(l) for l in layers]
        if k_head_dim is None:
            k_head_dim = head_dim if head_dim is not None else 0
        if v_head_dim is None:
            v_head_dim = k_head_dim
        self.num_kv_heads = int(num_kv_heads)
        self.k_head_dim = int(k_head_dim)
        self.v_head_dim = int(v_head_dim)
        self.elem_size = int(elem_size)
        self.mla_dim = int(mla_dim)
        self.scale_block = int(scale_block)
        self.scale_elem_size = int(scale_elem_size)

    @property
    def num_layers(self):
        return len(self.layers)

    @property
    def kinds(self):
        return [l.kind for l in self.layers]

    @property
    def windows(self):
        return [l.window for l in self.layers]

    def max_window(self, layer_begin=0, layer_end=None):
        """Largest sliding window among the SWA layers of [begin, end), 0 if none."""
        ls = self.layers[layer_begin:layer_end]
        return max([l.window for l in ls if l.kind == LayerKind.SWA] or [0])

    def head_bytes(self, role):
        """Bytes per head per token the model implies for a buffer role."""
        role = _enum(Role, role, "role")
        if role in (Role.K, Role.KV):
            return self.k_head_dim * self.elem_size
        if role == Role.V:
            return self.v_head_dim * self.elem_size
        if role == Role.LATENT:
            return self.mla_dim * self.elem_size
        if role in (Role.K_SCALE, Role.V_SCALE) and self.scale_block:
            dim = self.k_head_dim if role == Role.K_SCALE else self.v_head_dim
            return dim // self.scale_block * self.scale_elem_size
        return 0

    def to_c(self):
        """(kvw_model_t, layer array); keep both alive while the C side reads them."""
        arr = (N.kvw_layer_desc_t * max(1, len(self.layers)))()
        for i, l in enumerate(self.layers):
            arr[i].field_mask = N.KVW_LAYER_FIELDS_ALL
            arr[i].kind = int(l.kind)
            arr[i].window = int(l.window)
        m = N.kvw_model_t(
            field_mask=N.KVW_MODEL_FIELDS_ALL, num_layers=len(self.layers),
            layers=ctypes.cast(arr, ctypes.POINTER(N.kvw_layer_desc_t)),
            num_kv_heads=self.num_kv_heads, k_head_dim=self.k_head_dim,
            v_head_dim=self.v_head_dim, mla_dim=self.mla_dim, elem_size=self.elem_size,
            scale_block=self.scale_block, scale_elem_size=self.scale_elem_size)
        return m, arr

    def __repr__(self):
        return ("Model(%d layers, %d KV heads, head dims %d/%d, elem %d B%s)" % (
            self.num_layers, self.num_kv_heads, self.k_head_dim, self.v_head_dim,
            self.elem_size, ", mla_dim %d" % self.mla_dim if self.mla_dim else ""))


class Parallel:
    """A rank's place in its instance (kvw_parallel_t). layer_end None: the model's end."""

    def __init__(self, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, layer_begin=0,
                 layer_end=None, dp_size=1, dp_rank=0):
        self.tp_size, self.tp_rank = int(tp_size), int(tp_rank)
        self.pp_size, self.pp_rank = int(pp_size), int(pp_rank)
        self.layer_begin = int(layer_begin)
        self.layer_end = None if layer_end is None else int(layer_end)
        self.dp_size, self.dp_rank = int(dp_size), int(dp_rank)

    def resolved(self, num_layers):
        p = Parallel(**self.__dict__)
        if p.layer_end is None:
            p.layer_end = num_layers
        return p

    def to_c(self, num_layers):
        p = self.resolved(num_layers)
        return N.kvw_parallel_t(field_mask=N.KVW_PARALLEL_FIELDS_ALL, tp_size=p.tp_size, tp_rank=p.tp_rank, pp_size=p.pp_size,
                                pp_rank=p.pp_rank, layer_begin=p.layer_begin,
                                layer_end=p.layer_end, dp_size=p.dp_size, dp_rank=p.dp_rank)

    def __repr__(self):
        return "Parallel(%s)" % ", ".join("%s=%r" % kv for kv in self.__dict__.items())


# ---------------------------------------------------------------- buffers

def _memory_of(obj):
    """(addr, nbytes, mem_kind, device, keepalive) of a memory-holding object."""
    # PyTorch tensors (and anything shaped like them).
    if hasattr(obj, "data_ptr") and hasattr(obj, "numel") and hasattr(obj, "element_size"):
        if hasattr(obj, "is_contiguous") and not obj.is_contiguous():
            raise ValueError("a non-contiguous tensor cannot be described as one buffer")
        nbytes = int(obj.numel()) * int(obj.element_size())
        cuda = bool(getattr(obj, "is_cuda", False))
        dev = 0
        if cuda:
            d = getattr(obj, "device", None)
            dev = getattr(d, "index", None)
            if dev is None:
                dev = obj.get_device() if hasattr(obj, "get_device") else 0
        return int(obj.data_ptr()), nbytes, MemKind.CUDA if cuda else MemKind.HOST, int(dev), obj
    # CUDA array interface (CuPy, Numba).
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        if cai.get("strides") is not None:
            raise ValueError("a strided CUDA array cannot be described as one buffer")
        n = 1
        for s in cai["shape"]:
            n *= int(s)
        itemsize = int(cai["typestr"][2:])
        dev = getattr(getattr(obj, "device", None), "id", 0)
        return int(cai["data"][0]), n * itemsize, MemKind.CUDA, int(dev or 0), obj
    # The buffer protocol: bytearray, NumPy arrays, memoryview, mmap, array.array.
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError("cannot describe %r as memory: pass an address and a length, a "
                        "tensor with data_ptr(), or an object with the buffer protocol"
                        % type(obj).__name__) from None
    if mv.readonly:
        raise ValueError("kvwire needs writable memory (got a read-only %s)"
                         % type(obj).__name__)
    if not mv.c_contiguous:
        raise ValueError("kvwire needs contiguous memory")
    if mv.nbytes == 0:
        raise ValueError("empty buffer")
    cbuf = (ctypes.c_ubyte * mv.nbytes).from_buffer(mv)
    return ctypes.addressof(cbuf), mv.nbytes, MemKind.HOST, 0, (obj, mv, cbuf)


class Buffer:
    """One registered memory region (kvw_buffer_desc_t) and the object that owns it.

    memory: an int address (then length is required), a PyTorch tensor (data_ptr(),
    numel() * element_size(); CUDA memory when is_cuda), an object with
    __cuda_array_interface__, or any writable contiguous object with the buffer
    protocol (bytearray, NumPy array, memoryview). offset/length describe a part of it.
    pool None: derived from the layer's kind when the Rank is built."""

    def __init__(self, layer, role, memory=None, *, addr=None, length=None, offset=0,
                 pool=None, layout=Layout.NHD, page_size=0, num_heads=0, head_bytes=0,
                 v_head_bytes=0, groups=(), mem_kind=None, device=None):
        self.layer = int(layer)
        self.role = _enum(Role, role, "role")
        self.pool = None if pool is None else _enum(Pool, pool, "pool")
        self.layout = _enum(Layout, layout, "layout")
        self.page_size = int(page_size)
        self.num_heads = int(num_heads)
        self.head_bytes = int(head_bytes)
        self.v_head_bytes = int(v_head_bytes)
        self.groups = [(int(t), int(b)) for t, b in groups]
        if len(self.groups) > N.KVW_MAX_STATE_GROUPS:
            raise ValueError("at most %d state groups" % N.KVW_MAX_STATE_GROUPS)
        if memory is None and addr is None:
            raise ValueError("a buffer needs memory (an object) or an address")
        if memory is not None and addr is not None:
            raise ValueError("pass either memory or addr, not both")
        if memory is None or isinstance(memory, int):
            base = int(addr if memory is None else memory)
            if length is None:
                raise ValueError("a raw address needs a length")
            self.addr = base + int(offset)
            self.length = int(length)
            kind, dev, self.owner = MemKind.HOST, 0, None
        else:
            base, nbytes, kind, dev, self.owner = _memory_of(memory)
            offset = int(offset)
            if length is None:
                length = nbytes - offset
            if offset < 0 or length < 0 or offset + length > nbytes:
                raise ValueError("range [%d, %d) outside the object's %d bytes"
                                 % (offset, offset + length, nbytes))
            self.addr = base + offset
            self.length = int(length)
        self.mem_kind = _enum(MemKind, mem_kind, "memory kind") if mem_kind is not None else kind
        self.device = int(device) if device is not None else dev

    @classmethod
    def from_address(cls, addr, length, layer, role, **kw):
        return cls(layer, role, addr=addr, length=length, **kw)

    @classmethod
    def from_object(cls, obj, layer, role, **kw):
        return cls(layer, role, obj, **kw)

    def fill_c(self, d, model=None):
        pool = self.pool
        if pool is None:
            if model is None or not 0 <= self.layer < model.num_layers:
                raise ValueError("buffer of layer %d: no pool given and the model cannot "
                                 "tell it" % self.layer)
            kind = model.layers[self.layer].kind
            pool = {LayerKind.SWA: Pool.SWA, LayerKind.STATE: Pool.STATE}.get(kind, Pool.FULL)
        d.field_mask = N.KVW_BUFFER_FIELDS_ALL
        d.pool = int(pool)
        d.layer = self.layer
        d.role = int(self.role)
        d.layout = int(self.layout)
        d.page_size = self.page_size
        d.num_heads = self.num_heads
        d.head_bytes = self.head_bytes
        d.v_head_bytes = self.v_head_bytes
        d.num_groups = len(self.groups)
        for i, (t, b) in enumerate(self.groups):
            d.groups[i].field_mask = N.KVW_STATE_GROUP_FIELDS_ALL
            d.groups[i].total_heads = t
            d.groups[i].head_bytes = b
        d.addr = self.addr
        d.length = self.length
        d.mem_kind = int(self.mem_kind)
        d.device = self.device

    def __repr__(self):
        return ("Buffer(layer=%d, role=%s, pool=%s, %s, page_size=%d, heads=%d, head_bytes=%d, "
                "addr=0x%x, length=%d, %s%s)" % (
                    self.layer, self.role.name, self.pool.name if self.pool is not None else "auto",
                    self.layout.name, self.page_size, self.num_heads, self.head_bytes, self.addr,
                    self.length, self.mem_kind.name,
                    ":%d" % self.device if self.mem_kind == MemKind.CUDA else ""))


def kv_cache_buffers(model, parallel, caches, page_size, swa_page_size=None,
                     layout=Layout.NHD):
    """Buffers for a rank's per-layer KV caches.

    caches: {global layer: (k, v)} for full/SWA layers (or a fused KV object, one per
    layer, with role KV: each page is [K part][V part]) and {layer: latent} for MLA
    layers; each value is anything Buffer accepts as memory. Heads come from the
    ownership rule, bytes per head from the model."""
    par = parallel.resolved(model.num_layers)
    heads = 0
    if model.num_kv_heads:
        _, heads = topo_heads(par.tp_size, par.tp_rank, model.num_kv_heads)
    swa_page_size = page_size if swa_page_size is None else swa_page_size
    out = []
    for layer in sorted(caches):
        kind = model.layers[layer].kind
        mem = caches[layer]
        if kind in (LayerKind.FULL, LayerKind.SWA):
            ps = page_size if kind == LayerKind.FULL else swa_page_size
            if isinstance(mem, (tuple, list)):
                k, v = mem
                out.append(Buffer(layer, Role.K, k, layout=layout, page_size=ps, num_heads=heads,
                                  head_bytes=model.head_bytes(Role.K)))
                out.append(Buffer(layer, Role.V, v, layout=layout, page_size=ps, num_heads=heads,
                                  head_bytes=model.head_bytes(Role.V)))
            else:
                out.append(Buffer(layer, Role.KV, mem, layout=layout, page_size=ps,
                                  num_heads=heads, head_bytes=model.head_bytes(Role.K),
                                  v_head_bytes=model.head_bytes(Role.V)))
        elif kind == LayerKind.MLA:
            out.append(Buffer(layer, Role.LATENT, mem, layout=layout, page_size=page_size,
                              num_heads=1, head_bytes=model.head_bytes(Role.LATENT)))
        else:
            raise ValueError("layer %d is %s: describe its buffers with Buffer(...)"
                             % (layer, kind.name))
    return out


# ---------------------------------------------------------------- rank

class Rank:
    """A rank's KV cache description (kvw_rank_create). Keeps the model, the buffers
    and the Python objects owning their memory alive until close()."""

    def __init__(self, model, parallel, buffers):
        lib = N.load()
        self.model = model
        self.parallel = parallel.resolved(model.num_layers)
        self.buffers = list(buffers)
        self._model_c, self._layers_c = model.to_c()
        arr = (N.kvw_buffer_desc_t * max(1, len(self.buffers)))()
        for i, b in enumerate(self.buffers):
            b.fill_c(arr[i], model)
        self._bufs_c = arr
        params = N.kvw_rank_params_t(
            field_mask=int(RankField.MODEL | RankField.PARALLEL | RankField.BUFFERS),
            model=ctypes.pointer(self._model_c),
            parallel=self.parallel.to_c(model.num_layers),
            buffers=ctypes.cast(arr, ctypes.POINTER(N.kvw_buffer_desc_t)),
            num_buffers=len(self.buffers))
        h = ctypes.c_void_p()
        self._h = None
        self._users = weakref.WeakSet()
        _check(lib.kvw_rank_create(ctypes.byref(params), ctypes.byref(h)))
        self._h = h.value

    @property
    def handle(self):
        if self._h is None:
            raise ValueError("rank is closed")
        return self._h

    @property
    def num_buffers(self):
        return N.load().kvw_rank_num_buffers(self.handle)

    def buffer_desc(self, index):
        """The library's copy of buffer `index` (a kvw_buffer_desc_t)."""
        p = N.load().kvw_rank_buffer(self.handle, index)
        if not p:
            raise IndexError(index)
        d = N.kvw_buffer_desc_t()
        ctypes.pointer(d)[0] = p[0]
        return d

    def check_compatible(self, dst):
        """kvw_rank_check_compatible(self as source, dst); raises KvwireError."""
        _check(N.load().kvw_rank_check_compatible(self.handle, dst.handle))

    def close(self):
        if self._h is None:
            return
        if len(self._users):
            raise ValueError("rank is still used by %d open context(s) or plan(s)"
                             % len(self._users))
        N.load().kvw_rank_destroy(self._h)
        self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if self._h is not None and not len(self._users):
                self.close()
        except Exception:
            pass


# ---------------------------------------------------------------- page lists

def _u32_array(pages):
    """A ctypes uint32 array of the page indices (lists, ranges, NumPy/torch arrays)."""
    if pages is None:
        return None, 0
    if hasattr(pages, "tolist") and not isinstance(pages, array.array):
        pages = pages.tolist()
    if isinstance(pages, array.array) and pages.typecode in ("I", "L") and pages.itemsize == 4:
        a = pages
    else:
        try:
            a = array.array("I", pages)
        except OverflowError:
            raise ValueError("page indices must be 0 .. 2**32-1") from None
    n = len(a)
    if n == 0:
        return None, 0
    return (ctypes.c_uint32 * n).from_buffer_copy(a), n


class SidePages:
    """A request's pages on one side (kvw_side_pages_t)."""

    def __init__(self, full_pages=(), full_first_token=0, swa_pages=(), swa_first_token=0,
                 state_slot=-1):
        self.full_pages = full_pages
        self.full_first_token = int(full_first_token)
        self.swa_pages = swa_pages
        self.swa_first_token = int(swa_first_token)
        self.state_slot = -1 if state_slot is None else int(state_slot)

    def fill_c(self, sp):
        """Fills a kvw_side_pages_t; returns the arrays to keep alive for the call."""
        fa, fn = _u32_array(self.full_pages)
        sa, sn = _u32_array(self.swa_pages)
        P = ctypes.POINTER(ctypes.c_uint32)
        sp.field_mask = N.KVW_SIDE_PAGES_FIELDS_ALL
        sp.full.field_mask = sp.swa.field_mask = N.KVW_PAGES_FIELDS_ALL
        sp.full.pages = ctypes.cast(fa, P) if fa is not None else P()
        sp.full.num_pages = fn
        sp.full.first_token = self.full_first_token
        sp.swa.pages = ctypes.cast(sa, P) if sa is not None else P()
        sp.swa.num_pages = sn
        sp.swa.first_token = self.swa_first_token
        sp.state_slot = self.state_slot
        return (fa, sa)


# ---------------------------------------------------------------- plans

PlanStats = namedtuple("PlanStats", ["bytes", "num_routes", "num_segments", "runs_raw",
                                     "runs_coalesced", "plan_bytes"])
Run = namedtuple("Run", ["src_buf", "dst_buf", "src_off", "dst_off", "len"])


class Plan:
    """The compact plan of one chunk between two local ranks (kvw_plan_create)."""

    def __init__(self, src, dst, num_tokens, src_pages, dst_pages, *, chunk_begin=0,
                 chunk_end=None, prefix_len=0, last_chunk=True):
        lib = N.load()
        self.src, self.dst = src, dst
        chunk = N.kvw_chunk_t(field_mask=N.KVW_CHUNK_FIELDS_ALL, num_tokens=num_tokens, chunk_begin=chunk_begin,
                              chunk_end=num_tokens if chunk_end is None else chunk_end,
                              prefix_len=prefix_len, last_chunk=1 if last_chunk else 0)
        sp, dp = N.kvw_side_pages_t(), N.kvw_side_pages_t()
        keep = (src_pages.fill_c(sp), dst_pages.fill_c(dp))
        h = ctypes.c_void_p()
        self._h = None
        _check(lib.kvw_plan_create(src.handle, dst.handle, ctypes.byref(chunk), ctypes.byref(sp),
                                   ctypes.byref(dp), ctypes.byref(h)))
        del keep
        self._h = h.value
        src._users.add(self)
        dst._users.add(self)

    def stats(self):
        s = N.kvw_plan_stats_t(field_mask=N.KVW_PLAN_STATS_FIELDS_ALL)
        _check(N.load().kvw_plan_stats(self._handle(), ctypes.byref(s)))
        return PlanStats(s.bytes, s.num_routes, s.num_segments, s.runs_raw, s.runs_coalesced,
                         s.plan_bytes)

    def runs(self):
        """Every coalesced run, in order (a list of Run)."""
        out = []

        def cb(_arg, run):
            r = run[0]
            out.append(Run(r.src_buf, r.dst_buf, r.src_off, r.dst_off, r.len))
            return 0
        _check(N.load().kvw_plan_expand(self._handle(), N.kvw_run_cb_t(cb), None))
        return out

    def exec_cpu(self):
        """Copies the plan's bytes between the two ranks' host buffers."""
        _check(N.load().kvw_plan_exec_cpu(self._handle()))

    def _handle(self):
        if self._h is None:
            raise ValueError("plan is closed")
        return self._h

    def close(self):
        if self._h is not None:
            N.load().kvw_plan_destroy(self._h)
            self._h = None
            self.src._users.discard(self)
            self.dst._users.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------- topology

Route = namedtuple("Route", ["src_rank", "dst_rank", "src_head_start", "dst_head_start",
                             "num_heads"])


def topo_heads(tp_size, rank, num_heads):
    """(first, count): the KV heads rank `rank` of TP `tp_size` owns."""
    f, c = ctypes.c_uint32(), ctypes.c_uint32()
    _check(N.load().kvw_topo_heads(tp_size, rank, num_heads, ctypes.byref(f), ctypes.byref(c)))
    return f.value, c.value


def topo_routes(src_tp, dst_tp, heads):
    """Every route from a source TP group to a destination TP group, ordered by
    destination rank then destination head (list of Route). For MLA pass heads=1."""
    lib = N.load()
    n = ctypes.c_size_t()
    st = lib.kvw_topo_routes(src_tp, dst_tp, heads, None, 0, ctypes.byref(n))
    if st not in (Status.OK, Status.ERR_BUFFER_TOO_SMALL):
        _check(st)
    cap = max(1, n.value)
    arr = (N.kvw_route_t * cap)()
    _check(lib.kvw_topo_routes(src_tp, dst_tp, heads, arr, cap, ctypes.byref(n)))
    return [Route(r.src_rank, r.dst_rank, r.src_head_start, r.dst_head_start, r.num_heads)
            for r in arr[:n.value]]


# ---------------------------------------------------------------- contexts and rooms

HOPS = ("post", "req_rx", "send", "worker", "bytes_out", "done_rx", "ack_rx", "success")


class RoomMetrics(namedtuple("RoomMetrics", ["bytes", "runs", "start_ns", "end_ns", "path",
                                             "hops"])):
    """kvw_room_metrics_t: payload bytes, coalesced runs (prefill), monotonic start/end,
    and `hops`: {hop name: CLOCK_MONOTONIC ns} for the hops this side reached (kvw_hop_t)."""

    @property
    def seconds(self):
        if self.start_ns and self.end_ns >= self.start_ns:
            return (self.end_ns - self.start_ns) / 1e9
        return 0.0


def _enc(s):
    return None if s is None else (s.encode() if isinstance(s, str) else bytes(s))


class Context:
    """One rank's transfer context (kvw_ctx_create): a manager per rank.

    side: Side.PREFILL / Side.DECODE (or "prefill" / "decode"). bootstrap_addr:
    "host:port" of the prefill instance's bootstrap endpoint; a prefill context with
    host_bootstrap=True runs it ("127.0.0.1:0" picks a port; see .bootstrap_addr).
    Decode contexts wait for the prefill ranks at the bootstrap (prefill_tp/pp/dp: the
    instance size; 0 means the size the bootstrap table announces) and register with
    each prefill rank they need; a prefill rank's refusal raises KvwireError with
    status ERR_REJECTED and the reason. instance_id (decode): the same value on every
    rank of one decode instance, distinct per decode instance sharing a prefill
    instance (library default 0). Timeouts in ms; 0 keeps the library default.
    busy_poll_us: spin that long for the next event before sleeping (latency-critical
    deployments; costs a core per spinning thread); None keeps KVW_BUSY_POLL_US / 0.
    verify (decode): end-to-end KV verification, "off", "every" or "sample:F" (a
    fraction of rooms, by room id); a verified room succeeds only if its digests match,
    and fails on both sides otherwise (README "Verified rooms"). None keeps KVW_VERIFY /
    "off". Host and GPU (CUDA) buffers alike."""

    def __init__(self, rank, side, bootstrap_addr, *, transport=None, host_bootstrap=False,
                 listen_host=None, heartbeat_ms=0, peer_timeout_ms=0, bootstrap_timeout_ms=0,
                 wait_timeout_ms=0, secret=None, prefill_tp=0, prefill_pp=0, prefill_dp=0,
                 instance_id=None, busy_poll_us=None, verify=None):
        lib = N.load()
        self.rank = rank
        self.side = _enum(Side, side, "side")
        self.transport = transport
        self._given_addr = bootstrap_addr
        self._h = None
        self._rooms = weakref.WeakSet()
        mask = CtxField.SIDE | CtxField.RANK
        if bootstrap_addr:
            mask |= CtxField.BOOTSTRAP
        self._keep = [_enc(transport), _enc(bootstrap_addr), _enc(listen_host), _enc(secret),
                      _enc(verify)]
        p = N.kvw_ctx_params_t(side=int(self.side), rank=rank.handle,
                               bootstrap_addr=self._keep[1])
        if transport is not None:
            mask |= CtxField.TRANSPORT
            p.transport = self._keep[0]
        if host_bootstrap:
            mask |= CtxField.HOST_BOOTSTRAP
            p.host_bootstrap = 1
        if listen_host is not None:
            mask |= CtxField.LISTEN_HOST
            p.listen_host = self._keep[2]
        if heartbeat_ms or peer_timeout_ms or bootstrap_timeout_ms or wait_timeout_ms:
            mask |= CtxField.TIMEOUTS
            p.heartbeat_ms, p.peer_timeout_ms = int(heartbeat_ms), int(peer_timeout_ms)
            p.bootstrap_timeout_ms = int(bootstrap_timeout_ms)
            p.wait_timeout_ms = int(wait_timeout_ms)
        if secret is not None:
            mask |= CtxField.SECRET
            p.secret = self._keep[3]
        if prefill_tp or prefill_pp or prefill_dp:
            mask |= CtxField.PREFILL_SIZE
            p.prefill_tp, p.prefill_pp = int(prefill_tp), int(prefill_pp)
            p.prefill_dp = int(prefill_dp)
        if instance_id is not None:
            mask |= CtxField.INSTANCE
            p.instance_id = int(instance_id)
        if busy_poll_us is not None:
            mask |= CtxField.BUSY_POLL
            p.busy_poll_us = int(busy_poll_us)
        if verify is not None:
            mask |= CtxField.VERIFY
            p.verify = self._keep[4]
        p.field_mask = int(mask)
        h = ctypes.c_void_p()
        _check(lib.kvw_ctx_create(ctypes.byref(p), ctypes.byref(h)))
        self._h = h.value
        rank._users.add(self)

    @property
    def handle(self):
        if self._h is None:
            raise ValueError("context is closed")
        return self._h

    @property
    def bootstrap_addr(self):
        """The bootstrap endpoint this context hosts, else the one it was given."""
        if self._h is not None:
            a = N.load().kvw_ctx_bootstrap_addr(self._h)
            if a:
                return a.decode()
        return self._given_addr

    def sender(self, room):
        """Opens the sender of `room` on this (prefill) rank. Keep the handle: dropping
        it destroys the room, aborting it if it has not finished."""
        return Sender(self, room)

    def refusals(self):
        """(count, last reason): decode registrations this prefill context refused."""
        buf = ctypes.create_string_buffer(512)
        n = N.load().kvw_ctx_refusals(self.handle, buf, len(buf))
        return int(n), buf.value.decode(errors="replace")

    def receiver(self, room, prefill_dp_rank=0, bootstrap_addr=None):
        """Opens the receiver of `room` on this (decode) rank, fed by the prefill DP
        group `prefill_dp_rank` of the prefill instance whose bootstrap endpoint is
        `bootstrap_addr` (None: the context's own). The first room naming an instance
        connects to it in the background (kvw_receiver_create_from). Keep the handle
        (see sender())."""
        return Receiver(self, room, prefill_dp_rank, bootstrap_addr)

    def metrics(self):
        """kvw_ctx_metrics: what this context did since it was created, as a dict.

        side, transport; rooms_in_flight {state name: rooms not finished}; rooms_finished
        {"success", "failed"}; failures {status name ("ERR_ABORTED", ...): failed rooms,
        every error status listed, "other": statuses outside the table}; bytes {"direct",
        "staged"} (payload: sent on prefill, landed on decode); latency_us {"buckets":
        [(upper bound in us, rooms)] (bucket i: below 2^i us and at least 2^(i-1), the
        last bound inf), "sum", "count", "p50", "p90", "p99" (the upper bound of the bucket
        holding that percentile; None without rooms)}, post to Success; staging
        {"capacity", "in_use", "high_water"} (decode); peers {"connected", "died"}.
        Lock-free in the library: cheap at any rate. See prometheus_text()."""
        m = N.kvw_ctx_metrics_t(field_mask=N.KVW_CTX_METRICS_FIELDS_ALL)
        _check(N.load().kvw_ctx_metrics(self.handle, ctypes.byref(m)), "kvw_ctx_metrics")
        return _metrics_dict(m)

    def prometheus_text(self, labels=None):
        """This context's metrics in Prometheus' text exposition format (see
        prometheus_text(); labels: extra labels for every sample, e.g. {"rank": "0"})."""
        return prometheus_text([(self.metrics(), labels or {})])

    def close(self):
        """Closes every open sender/receiver of this context, then the context."""
        if self._h is None:
            return
        for r in list(self._rooms):
            r.close()
        N.load().kvw_ctx_destroy(self._h)
        self._h = None
        self.rank._users.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _Room:
    _kind = None  # "sender" / "receiver"

    def __init__(self, ctx, room):
        self.context = ctx
        self.room = int(room)
        self._h = None

    def _handle(self):
        if self._h is None:
            raise ValueError("%s of room %d is closed" % (self._kind, self.room))
        return self._h

    def _fn(self, what):
        """kvw_room_<what>, the calls both sides share on the room handle."""
        return getattr(N.load(), "kvw_room_%s" % what)

    def _room(self):
        """The room handle of this sender or receiver (kvw_sender_room / kvw_receiver_room)."""
        return getattr(N.load(), "kvw_%s_room" % self._kind)(self._handle())

    def poll(self):
        """The room's state (never blocks)."""
        return RoomState(self._fn("poll")(self._room()))

    @property
    def state(self):
        return self.poll()

    @property
    def failure_reason(self):
        """Why the room failed ("" unless FAILED)."""
        s = self._fn("failure")(self._room())
        return s.decode(errors="replace") if s else ""

    @property
    def status(self):
        """The room's status (Status.OK unless it failed)."""
        v = self._fn("status")(self._room())
        try:
            return Status(v)
        except ValueError:
            return v

    def metrics(self):
        m = N.kvw_room_metrics_t(field_mask=N.KVW_ROOM_METRICS_FIELDS_ALL)
        _check(self._fn("metrics")(self._room(), ctypes.byref(m)))
        hops = {name: m.hop_ns[i] for i, name in enumerate(HOPS) if m.hop_ns[i]}
        return RoomMetrics(m.bytes, m.runs, m.start_ns, m.end_ns,
                           m.path.decode() if m.path else "", hops)

    def abort(self):
        """Aborts the room locally and tells the peers."""
        self._fn("abort")(self._room())

    def wait(self, timeout=None):
        """Blocks until the room is terminal (woken by the state change, kvw_room_wait);
        returns the final RoomState. Raises TimeoutError after `timeout` seconds (the
        room stays open)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            # Slices of at most 1 s keep Ctrl-C responsive.
            s = RoomState(self._fn("wait")(self._room(), int(min(left, 1.0) * 1000) or 1))
            if s.terminal:
                return s
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("%s of room %d still %s after %.1f s"
                                   % (self._kind, self.room, s.name, timeout))

    def close(self):
        """Destroys the handle (a room that is not terminal is aborted first)."""
        if self._h is not None:
            self._fn("destroy")(self._room())
            self._h = None
            self.context._rooms.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        st = self.poll().name if self._h is not None else "closed"
        return "%s(room=%d, %s)" % (type(self).__name__, self.room, st)


class Sender(_Room):
    """The prefill side of one room on one rank (kvw_sender_create)."""
    _kind = "sender"

    def __init__(self, ctx, room):
        super().__init__(ctx, room)
        h = ctypes.c_void_p()
        _check(N.load().kvw_sender_create(ctx.handle, self.room, ctypes.byref(h)))
        self._h = h.value
        self._events = []  # events of layers_ready(event=...), alive with the room
        ctx._rooms.add(self)

    def send(self, num_tokens, begin=0, end=None, last=None, full_pages=(), full_first_token=0,
             swa_pages=(), swa_first_token=0, state_slot=-1):
        """Queues one chunk: tokens [begin, end) of a num_tokens request, held in this
        rank's pages (page i of a list holds tokens first_token + i*page_size ...).
        end defaults to num_tokens; last defaults to end == num_tokens. The last chunk
        also carries the SWA window (swa_pages) and the state slot. The KV bytes must
        stay in place until the room leaves TRANSFERRING. Raises KvwireError (e.g. on
        a failed or aborted room)."""
        self._queue(N.load().kvw_sender_send, num_tokens, begin, end, last, full_pages,
                    full_first_token, swa_pages, swa_first_token, state_slot)

    def send_streamed(self, num_tokens, begin=0, end=None, last=None, full_pages=(),
                      full_first_token=0, swa_pages=(), swa_first_token=0, state_slot=-1):
        """Queues one chunk like send(), but none of its layers is ready yet: the
        forward pass marks them with layers_ready() as it proceeds, and each group of
        layers leaves as soon as it is marked (kvw_sender_send_streamed). The next
        chunk may be queued only once every layer of this one was marked."""
        self._queue(N.load().kvw_sender_send_streamed, num_tokens, begin, end, last,
                    full_pages, full_first_token, swa_pages, swa_first_token, state_slot)

    def layers_ready(self, begin, end=None, event=None):
        """Marks the global layers [begin, end) (end defaults to begin + 1) of the room's
        latest streamed chunk ready. Any order; marking a layer again does nothing.
        With `event` (a torch.cuda.Event recorded on the forward stream after those
        layers' KV was written, or a raw cudaEvent_t as an int) the layers become ready
        when the event completes: the call returns at once and nothing synchronizes
        (kvw_sender_layers_ready_event); the event must live until the room ends.
        Raises KvwireError: ERR_INVALID_PARAM for an empty range, layers outside this
        rank's pipeline stage, no streamed chunk or an unrecorded torch event; the
        room's status once it failed (kvw_sender_layers_ready)."""
        end = begin + 1 if end is None else end
        if event is None:
            _check(N.load().kvw_sender_layers_ready(self._handle(), begin, end))
            return
        handle = getattr(event, "cuda_event", event)
        if not isinstance(handle, int) or handle == 0:
            raise KvwireError(Status.ERR_INVALID_PARAM,
                              "layers_ready: the event has no CUDA event yet (record it first)")
        self._events.append(event)  # kept alive until the room is closed
        _check(N.load().kvw_sender_layers_ready_event(self._handle(), begin, end, handle))

    def _queue(self, fn, num_tokens, begin, end, last, full_pages, full_first_token,
               swa_pages, swa_first_token, state_slot):
        end = num_tokens if end is None else end
        last = (end == num_tokens) if last is None else bool(last)
        c = N.kvw_send_chunk_t(field_mask=N.KVW_SEND_CHUNK_FIELDS_ALL, num_tokens=num_tokens, chunk_begin=begin, chunk_end=end,
                               last_chunk=1 if last else 0)
        keep = SidePages(full_pages, full_first_token, swa_pages, swa_first_token,
                         state_slot).fill_c(c.pages)
        st = fn(self._handle(), ctypes.byref(c))
        del keep
        _check(st)

    def set_metadata(self, data):
        """Attaches an opaque payload (bytes, at most 64 KiB: the first output token,
        logprobs, hidden states...) that every decode rank this rank writes receives
        with the KV bytes. Call before the last chunk (kvw_sender_set_metadata)."""
        data = bytes(data)
        buf = ctypes.create_string_buffer(data, len(data)) if data else None
        _check(N.load().kvw_sender_set_metadata(self._handle(), buf, len(data)))


class Receiver(_Room):
    """The decode side of one room on one rank (kvw_receiver_create)."""
    _kind = "receiver"

    def __init__(self, ctx, room, prefill_dp_rank=0, bootstrap_addr=None):
        super().__init__(ctx, room)
        self.prefill_dp_rank = int(prefill_dp_rank)
        self.bootstrap_addr = bootstrap_addr
        h = ctypes.c_void_p()
        _check(N.load().kvw_receiver_create_from(ctx.handle, self.room, _enc(bootstrap_addr),
                                                 self.prefill_dp_rank, ctypes.byref(h)))
        self._h = h.value
        ctx._rooms.add(self)

    def post(self, num_tokens, prefix_len=0, full_pages=(), full_first_token=0, swa_pages=(),
             swa_first_token=0, state_slot=-1):
        """Tells the prefill ranks where to write: this rank's pages for tokens
        [prefix_len, num_tokens) of the full pool, the SWA window's pages and the
        state slot. Raises KvwireError (the room is then FAILED)."""
        p = N.kvw_recv_post_t(field_mask=N.KVW_RECV_POST_FIELDS_ALL, num_tokens=num_tokens,
                              prefix_len=prefix_len)
        keep = SidePages(full_pages, full_first_token, swa_pages, swa_first_token,
                         state_slot).fill_c(p.pages)
        st = N.load().kvw_receiver_post(self._handle(), ctypes.byref(p))
        del keep
        _check(st)

    def metadata(self):
        """The room's metadata (bytes; b"" when the prefill attached none), once the
        room reached SUCCESS. Raises KvwireError before that, or if the room failed."""
        n = ctypes.c_size_t(0)
        lib = N.load()
        st = lib.kvw_receiver_metadata(self._handle(), None, 0, ctypes.byref(n))
        if st == Status.ERR_BUFFER_TOO_SMALL:
            buf = ctypes.create_string_buffer(n.value)
            _check(lib.kvw_receiver_metadata(self._handle(), buf, n.value, ctypes.byref(n)))
            return buf.raw[:n.value]
        _check(st)
        return b""


class BootstrapServer:
    """A standalone bootstrap endpoint (kvw_bootstrap_start): prefill ranks register
    there (Context(..., bootstrap_addr=server.address), host_bootstrap=False), decode
    ranks look their instance up. It outlives the ranks (a restarted rank registers
    again). addr: "host:port", port 0 picks one; .address tells which. secret: the
    ranks' shared secret; with it, registrations without a valid MAC are refused."""

    def __init__(self, addr="127.0.0.1:0", *, secret=None):
        self._h = None      # set first: __del__ runs after a constructor that raised
        lib = N.load()
        h = ctypes.c_void_p()
        keep = [_enc(addr), _enc(secret)]
        p = N.kvw_bootstrap_params_t(field_mask=N.KVW_BOOTSTRAP_FIELD_ADDR, addr=keep[0])
        if secret is not None:
            p.field_mask |= N.KVW_BOOTSTRAP_FIELD_SECRET
            p.secret = keep[1]
        _check(lib.kvw_bootstrap_start_ex(ctypes.byref(p), ctypes.byref(h)))
        self._h = h.value

    @property
    def address(self):
        if self._h is None:
            raise ValueError("bootstrap endpoint is stopped")
        return N.load().kvw_bootstrap_address(self._h).decode()

    def close(self):
        if self._h is not None:
            N.load().kvw_bootstrap_stop(self._h)
            self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------- probes

def transport_available(name):
    """Whether this libkvwire build has transport `name` (e.g. "cuda_ipc").

    There is no listing call in the C API, so this opens a throw-away prefill context
    on a one-byte host rank with that transport and a private bootstrap endpoint."""
    model = Model([LayerKind.FULL], num_kv_heads=1, head_dim=1, elem_size=1)
    k, v = bytearray(1), bytearray(1)
    bufs = [Buffer(0, Role.K, k, page_size=1, num_heads=1, head_bytes=1),
            Buffer(0, Role.V, v, page_size=1, num_heads=1, head_bytes=1)]
    rank = Rank(model, Parallel(), bufs)
    try:
        ctx = Context(rank, Side.PREFILL, "127.0.0.1:0", transport=name, host_bootstrap=True,
                      bootstrap_timeout_ms=3000)
    except KvwireError as e:
        if e.status in (Status.ERR_UNSUPPORTED, Status.ERR_NOT_FOUND) and \
                "transport" in e.message:
            return False
        raise
    finally:
        if "ctx" not in locals():
            rank._users.clear()
            rank.close()
    ctx.close()
    rank.close()
    return True


# ---------------------------------------------------------------- context metrics

__all__ += ["prometheus_text"]

_ACTIVE_STATES = ("bootstrapping", "waiting_for_input", "transferring")


def _latency_bound_us(i):
    """Upper bound of latency bucket i (kvw_ctx_metrics_t): 2^i us, the last unbounded."""
    return float("inf") if i == N.KVW_CTX_METRICS_LATENCY_BUCKETS - 1 else float(1 << i)


def _metrics_dict(m):
    failures = {st.name: int(m.rooms_failed_by_status[-int(st)])
                for st in Status if int(st) < 0 and -int(st) < N.KVW_CTX_METRICS_STATUS_SLOTS}
    known = {-int(st) for st in Status if int(st) < 0}
    failures["other"] = int(m.rooms_failed_by_status[0]) + sum(
        int(m.rooms_failed_by_status[i]) for i in range(1, N.KVW_CTX_METRICS_STATUS_SLOTS)
        if i not in known)
    buckets = [(_latency_bound_us(i), int(m.latency_us_buckets[i]))
               for i in range(N.KVW_CTX_METRICS_LATENCY_BUCKETS)]
    count = sum(c for _, c in buckets)

    def pct(q):
        if count == 0:
            return None
        run = 0
        for bound, c in buckets:
            run += c
            if run >= q * count:
                return bound
        return buckets[-1][0]

    return {
        "side": Side(m.side).name.lower(),
        "transport": (m.transport or b"").decode(),
        "rooms_in_flight": {name: int(m.rooms_in_state[i])
                            for i, name in enumerate(_ACTIVE_STATES)},
        "rooms_finished": {"success": int(m.rooms_succeeded), "failed": int(m.rooms_failed)},
        "failures": failures,
        "bytes": {"direct": int(m.bytes_direct), "staged": int(m.bytes_staged)},
        "latency_us": {"buckets": buckets, "sum": int(m.latency_us_sum), "count": count,
                       "p50": pct(0.50), "p90": pct(0.90), "p99": pct(0.99)},
        "staging": {"capacity": int(m.staging_capacity), "in_use": int(m.staging_in_use),
                    "high_water": int(m.staging_high_water)},
        "peers": {"connected": int(m.peers_connected), "died": int(m.peers_died)},
        "verify": {"verified": int(m.rooms_verified), "skipped": int(m.rooms_verify_skipped),
                   "failed": int(m.rooms_verify_failed)},
    }


def _prom_escape(v):
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _prom_labels(labels):
    if not labels:
        return ""
    return "{" + ",".join('%s="%s"' % (k, _prom_escape(v)) for k, v in labels.items()) + "}"


def _prom_float(x):
    return "+Inf" if x == float("inf") else repr(float(x))


def prometheus_text(metrics, labels=None):
    """Renders Context.metrics() dicts in Prometheus' text exposition format (0.0.4).

    metrics: one dict, or a list of dicts or of (dict, labels) pairs (one per context of
    the process: give each distinct labels, e.g. {"rank": "0"}). Every sample carries
    side and transport labels, then `labels`. Families (the kvwire_ prefix):
    rooms_in_flight{state} gauge, rooms_finished_total{outcome} and
    room_failures_total{status} counters, bytes_total{path} counter,
    room_latency_seconds histogram (post to Success, power-of-two buckets from 1 us),
    staging_{capacity,in_use,high_water}_bytes gauges, peers_connected gauge,
    peers_died_total counter, rooms_verify_total{outcome} counter (verified, skipped,
    failed). Returns the text, newline-terminated."""
    if isinstance(metrics, dict):
        metrics = [metrics]
    items = [(m, dict(labels or {})) if isinstance(m, dict) else (m[0], dict(m[1] or {}))
             for m in metrics]
    fams = []  # (name, type, help, [(labels, value)])

    def fam(name, typ, text, samples):
        fams.append(("kvwire_" + name, typ, text, samples))

    def base(m, extra):
        lab = {"side": m["side"], "transport": m["transport"]}
        lab.update(extra)
        return lab

    def each(key_fn):
        out = []
        for m, extra in items:
            for more, value in key_fn(m):
                lab = base(m, extra)
                lab.update(more)
                out.append((lab, value))
        return out

    fam("rooms_in_flight", "gauge", "Rooms not finished, by state.",
        each(lambda m: [({"state": k}, v) for k, v in m["rooms_in_flight"].items()]))
    fam("rooms_finished_total", "counter", "Rooms finished, by outcome.",
        each(lambda m: [({"outcome": k}, v) for k, v in m["rooms_finished"].items()]))
    fam("room_failures_total", "counter", "Failed rooms, by the status they failed with.",
        each(lambda m: [({"status": k}, v) for k, v in m["failures"].items()]))
    fam("bytes_total", "counter",
        "Payload bytes moved (prefill: sent; decode: landed), by path.",
        each(lambda m: [({"path": k}, v) for k, v in m["bytes"].items()]))
    fam("staging_capacity_bytes", "gauge", "Size of the decode staging area.",
        each(lambda m: [({}, m["staging"]["capacity"])]))
    fam("staging_in_use_bytes", "gauge", "Staging bytes granted to rooms now.",
        each(lambda m: [({}, m["staging"]["in_use"])]))
    fam("staging_high_water_bytes", "gauge", "Most staging bytes granted at once.",
        each(lambda m: [({}, m["staging"]["high_water"])]))
    fam("peers_connected", "gauge", "Peers registered and alive.",
        each(lambda m: [({}, m["peers"]["connected"])]))
    fam("peers_died_total", "counter", "Peers declared dead.",
        each(lambda m: [({}, m["peers"]["died"])]))
    fam("rooms_verify_total", "counter",
        "Decode rooms by KV verification outcome (skipped: left out by sampling).",
        each(lambda m: [({"outcome": k}, v) for k, v in m.get("verify", {}).items()]))
    lines = []
    for name, typ, text, samples in fams:
        lines.append("# HELP %s %s" % (name, text))
        lines.append("# TYPE %s %s" % (name, typ))
        for lab, value in samples:
            lines.append("%s%s %d" % (name, _prom_labels(lab), value))
    name = "kvwire_room_latency_seconds"
    lines.append("# HELP %s Room latency from its post to Success." % name)
    lines.append("# TYPE %s histogram" % name)
    for m, extra in items:
        lat = m["latency_us"]
        run = 0
        for bound_us, c in lat["buckets"]:
            run += c
            lab = base(m, extra)
            lab["le"] = _prom_float(bound_us / 1e6)
            lines.append("%s_bucket%s %d" % (name, _prom_labels(lab), run))
        lab = _prom_labels(base(m, extra))
        lines.append("%s_sum%s %s" % (name, lab, repr(lat["sum"] / 1e6)))
        lines.append("%s_count%s %d" % (name, lab, lat["count"]))
    return "\n".join(lines) + "\n"
