"""Stand-ins for what SGLang's scheduler modules import but the check does not exercise.

Only torch (a NumPy-backed stand-in, installed when real torch is absent), GPUs,
process groups and the SGLang modules that prefill.py / decode.py import for other
features (schedule batches, allocators, radix caches, kernels) are replaced. The
modules under test are loaded from the SGLang source tree unmodified:
disaggregation/{base,common}/conn.py, utils.py, prefill.py, decode.py,
decode_hicache_mixin.py, environ.py and utils/network.py."""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

import numpy as np

REAL = {
    "sglang.srt.disaggregation.base", "sglang.srt.disaggregation.base.conn",
    "sglang.srt.disaggregation.common", "sglang.srt.disaggregation.common.conn",
    "sglang.srt.disaggregation.utils", "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.decode", "sglang.srt.disaggregation.decode_hicache_mixin",
    "sglang.srt.environ", "sglang.srt.utils.network",
}


# ---------------------------------------------------------------- torch

class Tensor(np.ndarray):
    """A NumPy array with the torch methods SGLang's scheduler code calls."""

    def __new__(cls, a):
        return np.asarray(a).view(cls)

    def __getitem__(self, key):
        r = super().__getitem__(key)
        # torch returns a 0-d tensor where NumPy returns a scalar.
        return r if isinstance(r, np.ndarray) else np.asarray(r).view(Tensor)

    def data_ptr(self):
        return self.__array_interface__["data"][0]

    def cpu(self):
        return self

    def numpy(self):
        return np.asarray(self)

    def clone(self):
        return self.copy()

    def to(self, *a, dtype=None, device=None, **k):
        for x in a:
            if isinstance(x, type) or isinstance(x, np.dtype):
                dtype = x
        return self.astype(dtype) if dtype is not None else self

    def size(self, i=None):
        return self.shape if i is None else self.shape[i]

    def copy_(self, src):
        self[...] = np.asarray(src)
        return self

    def fill_(self, v):
        self[...] = v
        return self

    def zero_(self):
        self[...] = 0
        return self

    def element_size(self):
        return self.itemsize

    def numel(self):
        return self.size_all()

    def size_all(self):
        return int(np.prod(self.shape))

    @property
    def is_cuda(self):
        return False

    @property
    def device(self):
        return "cpu"


def _t(a, dtype=None):
    return Tensor(np.asarray(a, dtype=dtype))


def _shape(shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        return tuple(shape[0])
    return tuple(shape)


def make_torch():
    t = types.ModuleType("torch")
    t.__path__ = []
    t.Tensor = Tensor
    for name, dt in (("uint8", np.uint8), ("int8", np.int8), ("int16", np.int16),
                     ("int32", np.int32), ("int64", np.int64), ("uint64", np.uint64),
                     ("float16", np.float16), ("bfloat16", np.uint16), ("float32", np.float32),
                     ("float64", np.float64), ("bool", np.bool_), ("long", np.int64)):
        setattr(t, name, dt)
    t.dtype = type
    t.zeros = lambda *s, dtype=np.float32, device=None, **k: _t(np.zeros(_shape(s), dtype))
    t.empty = lambda *s, dtype=np.float32, device=None, **k: _t(np.zeros(_shape(s), dtype))
    t.ones = lambda *s, dtype=np.float32, device=None, **k: _t(np.ones(_shape(s), dtype))
    t.full = lambda s, v, dtype=None, device=None, **k: _t(np.full(s, v, dtype))
    t.tensor = lambda a, dtype=None, device=None, **k: _t(a, dtype)
    t.as_tensor = t.tensor
    t.arange = lambda *a, dtype=None, device=None, **k: _t(np.arange(*a), dtype)
    t.cat = lambda xs, dim=0: _t(np.concatenate([np.asarray(x) for x in xs], axis=dim))
    t.all = lambda x: _t(np.all(x))
    t.from_numpy = lambda a: Tensor(a)

    class no_grad:
        def __call__(self, f):
            return f

        def __enter__(self):
            return self

        def __exit__(self, *e):
            return False
    t.no_grad = no_grad
    t.inference_mode = no_grad
    cuda = types.ModuleType("torch.cuda")
    cuda.is_available = lambda: False
    cuda.Event = type("Event", (), {"__init__": lambda self, *a, **k: None,
                                    "record": lambda self, *a: None,
                                    "synchronize": lambda self: None})
    cuda.MemPool = type("MemPool", (), {})
    cuda.Stream = type("Stream", (), {})

    class _null:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *e):
            return False
    cuda.use_mem_pool = _null
    t.cuda = cuda
    dist = types.ModuleType("torch.distributed")

    class ReduceOp:
        MIN, MAX, SUM = "min", "max", "sum"
    dist.ReduceOp = ReduceOp
    dist.ProcessGroup = type("ProcessGroup", (), {})
    # One rank per process group in the check: a reduction over one member.
    dist.all_reduce = lambda tensor, op=None, group=None, **k: None
    dist.barrier = lambda *a, **k: None
    dist.is_initialized = lambda: False
    t.distributed = dist
    t.device = lambda *a, **k: "cpu"
    return {"torch": t, "torch.cuda": cuda, "torch.distributed": dist}


# ---------------------------------------------------------------- auto stubs

class _Anything:
    """An imported name the check does not exercise: callable, usable as a decorator or
    a context manager, subclassable."""

    def __init__(self, *a, **k):
        pass

    def __call__(self, f=None, *a, **k):
        return f if callable(f) else self

    def __enter__(self):
        return self

    def __exit__(self, *e):
        return False

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    @classmethod
    def create(cls, *a, **k):
        return cls()

    def region(self, *a, **k):
        return self


class StubModule(types.ModuleType):
    def __init__(self, name, path=None):
        super().__init__(name)
        self.__path__ = [path] if path else []
        self._classes = {}

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        c = self._classes.get(name)
        if c is None:
            c = type(name, (_Anything,), {"__module__": self.__name__})
            self._classes[name] = c
        return c


class Finder(importlib.abc.MetaPathFinder):
    """Loads REAL sglang modules from the source tree; every other sglang module (and the
    third-party networking modules common/conn.py imports) is a StubModule unless
    explicitly provided in sys.modules."""

    def __init__(self, src):
        self.src = src

    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top not in ("sglang", "requests", "zmq", "aiohttp", "psutil"):
            return None
        rel = os.path.join(self.src, *name.split("."))
        if name in REAL:
            if os.path.isdir(rel):
                return importlib.util.spec_from_file_location(
                    name, os.path.join(rel, "__init__.py"), submodule_search_locations=[rel])
            return importlib.util.spec_from_file_location(name, rel + ".py")
        return importlib.machinery.ModuleSpec(name, _StubLoader(rel if os.path.isdir(rel)
                                                                else None), is_package=True)


class _StubLoader(importlib.abc.Loader):
    def __init__(self, path):
        self.path = path

    def create_module(self, spec):
        return StubModule(spec.name, self.path)

    def exec_module(self, module):
        pass


def install(src, fakes):
    """Installs torch (unless real torch is importable and KVW_SGLANG_DEVICE asks for
    it), the explicit fakes ({module name: module}) and the finder."""
    want_real = os.environ.get("KVW_SGLANG_DEVICE", "cpu") == "cuda"
    if not want_real or importlib.util.find_spec("torch") is None:
        sys.modules.update(make_torch())
    else:
        # Real torch, no process group: every rank is its own group of one, so SGLang's
        # poll reductions reduce over one member.
        import torch.distributed as dist
        dist.all_reduce = lambda tensor, op=None, group=None, **k: None
        dist.barrier = lambda *a, **k: None
    sys.modules.update(fakes)
    # After kvwire.sglang's import hook, when register() ran first (a sitecustomize):
    # the hook patches what the finders below it find.
    at = 0
    while at < len(sys.meta_path) and type(sys.meta_path[at]).__name__ == "_Hook":
        at += 1
    sys.meta_path.insert(at, Finder(src))
