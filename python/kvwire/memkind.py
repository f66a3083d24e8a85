"""What memory an address is: host or CUDA device memory, and on which device.

For adapters that turn an engine's buffer addresses (for instance a tensor's
``data_ptr()``) into kvwire buffer descriptions: ``kvw_rank_create`` refuses a buffer
whose declared memory kind or device differs from what its address is, so an adapter
can ask first instead of guessing::

    from kvwire.memkind import pointer_mem_kind
    kind, device = pointer_mem_kind(tensor.data_ptr())

Wraps ``kvw_cuda_pointer_kind`` (include/kvwire/cuda.h). The library asks the CUDA
driver (cuPointerGetAttributes) through its CUDA module without initialising the CUDA
runtime or creating a context, and never dereferences the address.

When CUDA cannot be asked (libkvwire was built without the CUDA module, the module
cannot be loaded, or no CUDA driver is installed), ``pointer_mem_kind`` RAISES
``kvwire.KvwireError`` with status ``Status.ERR_UNSUPPORTED`` and the library's reason;
it does not guess HOST, since device memory handed in by an engine with its own CUDA
runtime would then be described as host memory. ``cuda_pointer_query_available()``
tells beforehand, without raising.
"""
import ctypes

from . import _native as N
from .core import KvwireError, MemKind, Status, last_error

__all__ = ["pointer_mem_kind", "cuda_pointer_query_available"]

_fn = None


def _query():
    global _fn
    if _fn is None:
        fn = getattr(N.load(), "kvw_cuda_pointer_kind", None)
        if fn is None:
            raise KvwireError(Status.ERR_UNSUPPORTED, "%s has no kvw_cuda_pointer_kind (an "
                              "older build?)" % N.lib_path())
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int),
                       ctypes.POINTER(ctypes.c_int32)]
        _fn = fn
    return _fn


def pointer_mem_kind(addr):
    """Returns (MemKind, device) for the memory at integer address ``addr``.

    (MemKind.CUDA, ordinal) for CUDA device memory (cudaMalloc, caching-allocator
    blocks, IPC-mapped peer memory) and managed memory; (MemKind.HOST, -1) for host
    memory, page-locked or not. Any address inside an allocation will do; it is never
    dereferenced.

    Raises KvwireError(ERR_UNSUPPORTED) when CUDA cannot be asked (see the module
    docstring), and ERR_INVALID_PARAM for an address that is not an int."""
    if isinstance(addr, bool) or not isinstance(addr, int):
        raise KvwireError(Status.ERR_INVALID_PARAM,
                          "pointer_mem_kind: the address must be an int, not %s"
                          % type(addr).__name__)
    if addr < 0 or addr >= 1 << (8 * ctypes.sizeof(ctypes.c_void_p)):
        raise KvwireError(Status.ERR_INVALID_PARAM,
                          "pointer_mem_kind: address %d is outside the address space" % addr)
    kind = ctypes.c_int(-1)
    device = ctypes.c_int32(-1)
    st = _query()(ctypes.c_void_p(addr), ctypes.byref(kind), ctypes.byref(device))
    if st != Status.OK:
        raise KvwireError(st, last_error())
    return MemKind(kind.value), int(device.value)


def cuda_pointer_query_available():
    """True when pointer_mem_kind can answer here (it would not raise ERR_UNSUPPORTED)."""
    try:
        pointer_mem_kind(0)
    except KvwireError as e:
        if e.code == Status.ERR_UNSUPPORTED:
            return False
        raise
    return True
