"""kvwire: move the KV cache of LLM requests from prefill workers to decode workers.

Python bindings (ctypes, standard library only) over libkvwire.so. The library is
found through $KVWIRE_LIB, the package directory, <repo>/build, then the system's
dynamic loader. See kvwire.connector for a token-counting engine adapter and
kvwire.sglang for a backend with SGLang's disaggregation interface.
"""
from ._native import LibraryNotFound, load as load_library, lib_path
from .core import (Status, LayerKind, Pool, Role, Layout, MemKind, Side, RoomState, RankField,
                   CtxField, KvwireError, Layer, Model, Parallel, Buffer, Rank, SidePages,
                   Plan, PlanStats, Run, Context, Sender, Receiver, RoomMetrics, Route,
                   topo_heads, topo_routes, status_string, last_error, kv_cache_buffers,
                   transport_available, BootstrapServer, library_version)
from .core import prometheus_text

# Must equal python/pyproject.toml's version and the library's (include/kvwire/version.h):
# python/tests/test_api.py checks all three.
__version__ = "0.2.0"

__all__ = [
    "LibraryNotFound", "load_library", "lib_path",
    "Status", "LayerKind", "Pool", "Role", "Layout", "MemKind", "Side", "RoomState",
    "RankField", "CtxField", "KvwireError", "Layer", "Model", "Parallel", "Buffer", "Rank",
    "SidePages", "Plan", "PlanStats", "Run", "Context", "Sender", "Receiver", "RoomMetrics",
    "Route", "topo_heads", "topo_routes", "status_string", "last_error", "kv_cache_buffers",
    "transport_available", "BootstrapServer", "library_version",
    "prometheus_text",
]
