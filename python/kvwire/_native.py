"""Loading libkvwire and the ctypes mirrors of its public structs.

Every structure here mirrors include/kvwire/kvwire.h and include/kvwire/xfer.h field
by field, in order, with the same C types. C enums are ints. The unit tests compile
a small C program (when a C compiler is present) and compare every size and offset.
"""
import ctypes
import ctypes.util
import os
import threading

__all__ = [
    "load", "lib_path", "LibraryNotFound",
    "KVW_MAX_STATE_GROUPS", "KVW_NUM_POOLS",
    "kvw_layer_desc_t", "kvw_model_t", "kvw_parallel_t", "kvw_state_group_t",
    "kvw_buffer_desc_t", "kvw_rank_params_t", "kvw_route_t", "kvw_pages_t",
    "kvw_side_pages_t", "kvw_chunk_t", "kvw_plan_stats_t", "kvw_run_t",
    "kvw_ctx_params_t", "kvw_send_chunk_t", "kvw_recv_post_t", "kvw_room_metrics_t",
    "kvw_bootstrap_params_t", "KVW_BOOTSTRAP_FIELD_ADDR", "KVW_BOOTSTRAP_FIELD_SECRET",
    "STRUCTS", "KVW_RANK_FIELDS_ALL", "KVW_CTX_FIELDS_ALL",
    "KVW_LAYER_FIELDS_ALL", "KVW_MODEL_FIELDS_ALL", "KVW_PARALLEL_FIELDS_ALL",
    "KVW_STATE_GROUP_FIELDS_ALL", "KVW_BUFFER_FIELDS_ALL", "KVW_ROUTE_FIELDS_ALL",
    "KVW_PAGES_FIELDS_ALL", "KVW_SIDE_PAGES_FIELDS_ALL", "KVW_CHUNK_FIELDS_ALL",
    "KVW_PLAN_STATS_FIELDS_ALL", "KVW_RUN_FIELDS_ALL", "KVW_SEND_CHUNK_FIELDS_ALL",
    "KVW_RECV_POST_FIELDS_ALL", "KVW_ROOM_METRICS_FIELDS_ALL",
    "kvw_ctx_metrics_t", "KVW_CTX_METRICS_FIELDS_ALL", "KVW_CTX_METRICS_STATUS_SLOTS",
    "KVW_CTX_METRICS_LATENCY_BUCKETS", "KVW_CTX_METRICS_ACTIVE_STATES",
]

KVW_MAX_STATE_GROUPS = 8
KVW_NUM_POOLS = 3

# Every struct that crosses the API starts with a field mask (kvwire.h, "Field masks"):
# the binding fills every field of the structs it passes in and asks for every field of
# the ones the library fills, so it sets each mask to every bit it knows.
KVW_LAYER_FIELDS_ALL = 0x3
KVW_MODEL_FIELDS_ALL = 0x1ff
KVW_PARALLEL_FIELDS_ALL = 0xff
KVW_STATE_GROUP_FIELDS_ALL = 0x3
KVW_BUFFER_FIELDS_ALL = 0x1fff
KVW_ROUTE_FIELDS_ALL = 0x1f
KVW_PAGES_FIELDS_ALL = 0x7
KVW_SIDE_PAGES_FIELDS_ALL = 0x7
KVW_CHUNK_FIELDS_ALL = 0x1f
KVW_PLAN_STATS_FIELDS_ALL = 0x3f
KVW_RUN_FIELDS_ALL = 0x1f
KVW_SEND_CHUNK_FIELDS_ALL = 0x1f
KVW_RECV_POST_FIELDS_ALL = 0x7
KVW_ROOM_METRICS_FIELDS_ALL = 0x3f
KVW_CTX_METRICS_FIELDS_ALL = 0x3ffff
KVW_CTX_METRICS_STATUS_SLOTS = 64
KVW_CTX_METRICS_LATENCY_BUCKETS = 32
KVW_CTX_METRICS_ACTIVE_STATES = 3
KVW_RANK_FIELDS_ALL = 0x7
KVW_CTX_FIELDS_ALL = 0xfff

c_enum = ctypes.c_int  # every kvwire enum is passed and stored as a C int


# ---------------------------------------------------------------- kvwire.h

class kvw_layer_desc_t(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("kind", c_enum),
        ("window", ctypes.c_uint32),
    ]


class kvw_model_t(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("num_layers", ctypes.c_uint32),
        ("layers", ctypes.POINTER(kvw_layer_desc_t)),
        ("num_kv_heads", ctypes.c_uint32),
        ("k_head_dim", ctypes.c_uint32),
        ("v_head_dim", ctypes.c_uint32),
        ("mla_dim", ctypes.c_uint32),
        ("elem_size", ctypes.c_uint32),
        ("scale_block", ctypes.c_uint32),
        ("scale_elem_size", ctypes.c_uint32),
    ]


class kvw_parallel_t(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("tp_size", ctypes.c_uint32),
        ("tp_rank", ctypes.c_uint32),
        ("pp_size", ctypes.c_uint32),
        ("pp_rank", ctypes.c_uint32),
        ("layer_begin", ctypes.c_uint32),
        ("layer_end", ctypes.c_uint32),
        ("dp_size", ctypes.c_uint32),
        ("dp_rank", ctypes.c_uint32),
    ]


class kvw_state_group_t(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("total_heads", ctypes.c_uint32),
        ("head_bytes", ctypes.c_uint32),
    ]


class kvw_buffer_desc_t(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("pool", c_enum),
        ("layer", ctypes.c_uint32),
        ("role", c_enum),
        ("layout", c_enum),
        ("page_size", ctypes.c_uint32),
        ("num_heads", ctypes.c_uint32),
        ("head_bytes", ctypes.c_uint32),
        ("v_head_bytes", ctypes.c_uint32),
        ("num_groups", ctypes.c_uint32),
        ("groups", kvw_state_group_t * KVW_MAX_STATE_GROUPS),
        ("addr", ctypes.c_void_p),
        ("length", ctypes.c_uint64),
        ("mem_kind", c_enum),
        ("device", ctypes.c_int32),
    ]


class kvw_rank_params_t(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("model", ctypes.POINTER(kvw_model_t)),
        ("parallel", kvw_parallel_t),
        ("buffers", ctypes.POINTER(kvw_buffer_desc_t)),
        ("num_buffers", ctypes.c_uint32),
    ]


class kvw_route_t(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("src_rank", ctypes.c_uint32),
        ("dst_rank", ctypes.c_uint32),
        ("src_head_start", ctypes.c_uint32),
        ("dst_head_start", ctypes.c_uint32),
        ("num_heads", ctypes.c_uint32),
    ]


class kvw_pages_t(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("pages", ctypes.POINTER(ctypes.c_uint32)),
        ("num_pages", ctypes.c_uint32),
        ("first_token", ctypes.c_uint64),
    ]


class kvw_side_pages_t(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("full", kvw_pages_t),
        ("swa", kvw_pages_t),
        ("state_slot", ctypes.c_int64),
    ]


class kvw_chunk_t(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("num_tokens", ctypes.c_uint64),
        ("chunk_begin", ctypes.c_uint64),
        ("chunk_end", ctypes.c_uint64),
        ("prefix_len", ctypes.c_uint64),
        ("last_chunk", ctypes.c_int),
    ]


class kvw_plan_stats_t(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("num_routes", ctypes.c_uint32),
        ("num_segments", ctypes.c_uint64),
        ("runs_raw", ctypes.c_uint64),
        ("runs_coalesced", ctypes.c_uint64),
        ("plan_bytes", ctypes.c_uint64),
    ]


class kvw_run_t(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("src_buf", ctypes.c_uint32),
        ("dst_buf", ctypes.c_uint32),
        ("src_off", ctypes.c_uint64),
        ("dst_off", ctypes.c_uint64),
        ("len", ctypes.c_uint64),
    ]


# ---------------------------------------------------------------- xfer.h

class kvw_ctx_params_t(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("side", c_enum),
        ("rank", ctypes.c_void_p),
        ("transport", ctypes.c_char_p),
        ("bootstrap_addr", ctypes.c_char_p),
        ("host_bootstrap", ctypes.c_int),
        ("listen_host", ctypes.c_char_p),
        ("heartbeat_ms", ctypes.c_uint32),
        ("peer_timeout_ms", ctypes.c_uint32),
        ("bootstrap_timeout_ms", ctypes.c_uint32),
        ("wait_timeout_ms", ctypes.c_uint32),
        ("secret", ctypes.c_char_p),
        ("prefill_tp", ctypes.c_uint32),
        ("prefill_pp", ctypes.c_uint32),
        ("prefill_dp", ctypes.c_uint32),
        ("instance_id", ctypes.c_uint64),
        ("busy_poll_us", ctypes.c_uint32),
        ("verify", ctypes.c_char_p),
    ]


class kvw_bootstrap_params_t(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("addr", ctypes.c_char_p),
        ("secret", ctypes.c_char_p),
    ]


KVW_BOOTSTRAP_FIELD_ADDR = 1 << 0
KVW_BOOTSTRAP_FIELD_SECRET = 1 << 1


class kvw_send_chunk_t(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("num_tokens", ctypes.c_uint64),
        ("chunk_begin", ctypes.c_uint64),
        ("chunk_end", ctypes.c_uint64),
        ("last_chunk", ctypes.c_int),
        ("pages", kvw_side_pages_t),
    ]


class kvw_recv_post_t(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("num_tokens", ctypes.c_uint64),
        ("prefix_len", ctypes.c_uint64),
        ("pages", kvw_side_pages_t),
    ]


class kvw_room_metrics_t(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("runs", ctypes.c_uint64),
        ("start_ns", ctypes.c_uint64),
        ("end_ns", ctypes.c_uint64),
        ("path", ctypes.c_char_p),
        ("hop_ns", ctypes.c_uint64 * 8),  # kvw_hop_t: KVW_HOP_COUNT stamps
    ]


class kvw_ctx_metrics_t(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("side", c_enum),
        ("transport", ctypes.c_char_p),
        ("rooms_in_state", ctypes.c_uint64 * KVW_CTX_METRICS_ACTIVE_STATES),
        ("rooms_succeeded", ctypes.c_uint64),
        ("rooms_failed", ctypes.c_uint64),
        ("rooms_failed_by_status", ctypes.c_uint64 * KVW_CTX_METRICS_STATUS_SLOTS),
        ("bytes_direct", ctypes.c_uint64),
        ("bytes_staged", ctypes.c_uint64),
        ("latency_us_buckets", ctypes.c_uint64 * KVW_CTX_METRICS_LATENCY_BUCKETS),
        ("latency_us_sum", ctypes.c_uint64),
        ("staging_capacity", ctypes.c_uint64),
        ("staging_in_use", ctypes.c_uint64),
        ("staging_high_water", ctypes.c_uint64),
        ("peers_connected", ctypes.c_uint64),
        ("peers_died", ctypes.c_uint64),
        ("rooms_verified", ctypes.c_uint64),
        ("rooms_verify_skipped", ctypes.c_uint64),
        ("rooms_verify_failed", ctypes.c_uint64),
    ]


# C type name -> mirror, for the layout tests.
STRUCTS = {
    "kvw_layer_desc_t": kvw_layer_desc_t,
    "kvw_model_t": kvw_model_t,
    "kvw_parallel_t": kvw_parallel_t,
    "kvw_state_group_t": kvw_state_group_t,
    "kvw_buffer_desc_t": kvw_buffer_desc_t,
    "kvw_rank_params_t": kvw_rank_params_t,
    "kvw_route_t": kvw_route_t,
    "kvw_pages_t": kvw_pages_t,
    "kvw_side_pages_t": kvw_side_pages_t,
    "kvw_chunk_t": kvw_chunk_t,
    "kvw_plan_stats_t": kvw_plan_stats_t,
    "kvw_run_t": kvw_run_t,
    "kvw_ctx_params_t": kvw_ctx_params_t,
    "kvw_bootstrap_params_t": kvw_bootstrap_params_t,
    "kvw_send_chunk_t": kvw_send_chunk_t,
    "kvw_recv_post_t": kvw_recv_post_t,
    "kvw_room_metrics_t": kvw_room_metrics_t,
    "kvw_ctx_metrics_t": kvw_ctx_metrics_t,
}

# ---------------------------------------------------------------- prototypes

_c = ctypes
_st = c_enum
_h = ctypes.c_void_p
_u32, _u64, _sz = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_size_t
_P = ctypes.POINTER

kvw_run_cb_t = ctypes.CFUNCTYPE(_st, ctypes.c_void_p, _P(kvw_run_t))

# name: (restype, argtypes). Functions a library build lacks are left out, not fatal.
_PROTOTYPES = {
    "kvw_status_string": (ctypes.c_char_p, [_st]),
    "kvw_last_error": (ctypes.c_char_p, []),
    "kvw_version": (ctypes.c_char_p, []),
    "kvw_version_number": (ctypes.c_uint32, []),
    "kvw_rank_create": (_st, [_P(kvw_rank_params_t), _P(_h)]),
    "kvw_rank_destroy": (None, [_h]),
    "kvw_rank_model": (_P(kvw_model_t), [_h]),
    "kvw_rank_parallel": (_P(kvw_parallel_t), [_h]),
    "kvw_rank_num_buffers": (_u32, [_h]),
    "kvw_rank_buffer": (_P(kvw_buffer_desc_t), [_h, _u32]),
    "kvw_rank_check_compatible": (_st, [_h, _h]),
    "kvw_topo_heads": (_st, [_u32, _u32, _u32, _P(_u32), _P(_u32)]),
    "kvw_topo_routes": (_st, [_u32, _u32, _u32, _P(kvw_route_t), _sz, _P(_sz)]),
    "kvw_plan_create": (_st, [_h, _h, _P(kvw_chunk_t), _P(kvw_side_pages_t),
                              _P(kvw_side_pages_t), _P(_h)]),
    "kvw_plan_destroy": (None, [_h]),
    "kvw_plan_stats": (_st, [_h, _P(kvw_plan_stats_t)]),
    "kvw_plan_expand": (_st, [_h, kvw_run_cb_t, ctypes.c_void_p]),
    "kvw_plan_exec_cpu": (_st, [_h]),
    "kvw_room_state_string": (ctypes.c_char_p, [c_enum]),
    "kvw_ctx_create": (_st, [_P(kvw_ctx_params_t), _P(_h)]),
    "kvw_ctx_destroy": (None, [_h]),
    "kvw_ctx_bootstrap_addr": (ctypes.c_char_p, [_h]),
    "kvw_sender_create": (_st, [_h, _u64, _P(_h)]),
    "kvw_sender_send": (_st, [_h, _P(kvw_send_chunk_t)]),
    "kvw_sender_send_streamed": (_st, [_h, _P(kvw_send_chunk_t)]),
    "kvw_sender_layers_ready": (_st, [_h, _u32, _u32]),
    "kvw_sender_layers_ready_event": (_st, [_h, _u32, _u32, _h]),
    "kvw_sender_set_metadata": (_st, [_h, ctypes.c_void_p, ctypes.c_size_t]),
    "kvw_receiver_metadata": (_st, [_h, ctypes.c_void_p, ctypes.c_size_t,
                                    _P(ctypes.c_size_t)]),
    "kvw_receiver_create": (_st, [_h, _u64, _u32, _P(_h)]),
    "kvw_receiver_create_from": (_st, [_h, _u64, ctypes.c_char_p, _u32, _P(_h)]),
    "kvw_bootstrap_start": (_st, [ctypes.c_char_p, _P(_h)]),
    "kvw_bootstrap_start_ex": (_st, [_P(kvw_bootstrap_params_t), _P(_h)]),
    "kvw_ctx_refusals": (_u64, [_h, ctypes.c_char_p, ctypes.c_size_t]),
    "kvw_bootstrap_address": (ctypes.c_char_p, [_h]),
    "kvw_bootstrap_stop": (None, [_h]),
    "kvw_receiver_post": (_st, [_h, _P(kvw_recv_post_t)]),
    "kvw_sender_room": (_h, [_h]),
    "kvw_receiver_room": (_h, [_h]),
    "kvw_room_id": (_u64, [_h]),
    "kvw_room_side": (c_enum, [_h]),
    "kvw_room_poll": (c_enum, [_h]),
    "kvw_room_wait": (c_enum, [_h, ctypes.c_uint32]),
    "kvw_room_failure": (ctypes.c_char_p, [_h]),
    "kvw_room_status": (_st, [_h]),
    "kvw_room_metrics": (_st, [_h, _P(kvw_room_metrics_t)]),
    "kvw_ctx_metrics": (_st, [_h, _P(kvw_ctx_metrics_t)]),
    "kvw_room_abort": (None, [_h]),
    "kvw_room_destroy": (None, [_h]),
    # kvwire/cuda.h (present when the library was built with its CUDA loader)
    "kvw_cuda_available": (_st, []),
    "kvw_cuda_device_count": (_st, [_P(ctypes.c_int)]),
}

_REQUIRED = [n for n in _PROTOTYPES if not n.startswith("kvw_cuda_")]


class LibraryNotFound(OSError):
    """libkvwire.so could not be found or loaded."""


_lock = threading.Lock()
_lib = None
_lib_path = None


def _candidates():
    """Where to look, in order, and whether the first is an explicit choice.

    $KVWIRE_LIB (an override: a wrong path is an error); the package directory, where
    the wheel puts libkvwire.so and the modules it loads from its own directory
    (libkvwire-ucx.so, libkvwire_cuda.so; python/build_backend/kvwire_backend.py); the
    source tree's build/ (`make build`, for a package used in place); then the
    dynamic loader (load())."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = os.environ.get("KVWIRE_LIB")
    if env:
        # An explicit choice is final: a wrong path is an error, never a silent fallback.
        return [env], True
    cands = [os.path.join(here, "libkvwire.so")]
    # python/kvwire/ -> repository root -> build/
    repo = os.path.dirname(os.path.dirname(here))
    cands.append(os.path.join(repo, "build", "libkvwire.so"))
    return cands, False


def _load_one(path):
    # ctypes.CDLL releases the GIL around every call, so kvwire's blocking calls
    # (context creation waits for the bootstrap) never stall other Python threads.
    return ctypes.CDLL(path)


def load():
    """Returns the loaded libkvwire (loading it on first use).

    Search order: $KVWIRE_LIB, the package directory, <repo>/build, then the
    system's dynamic loader (ldconfig paths, LD_LIBRARY_PATH)."""
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        cands, explicit = _candidates()
        tried = []
        lib = None
        for path in cands:
            if not explicit and not os.path.exists(path):
                tried.append("%s (absent)" % path)
                continue
            try:
                lib = _load_one(path)
                _lib_path = path
                break
            except OSError as e:
                tried.append("%s (%s)" % (path, e))
                if explicit:
                    raise LibraryNotFound("KVWIRE_LIB=%s cannot be loaded: %s" % (path, e))
        if lib is None:
            names = [ctypes.util.find_library("kvwire"), "libkvwire.so"]
            for name in names:
                if not name:
                    continue
                try:
                    lib = _load_one(name)
                    _lib_path = name
                    break
                except OSError as e:
                    tried.append("%s (%s)" % (name, e))
        if lib is None:
            raise LibraryNotFound(
                "libkvwire.so not found: install the package with `pip install ./python` "
                "(the wheel builds and carries the library), or set KVWIRE_LIB to the path of "
                "a libkvwire.so. Tried: " + "; ".join(tried))
        for name, (restype, argtypes) in _PROTOTYPES.items():
            fn = getattr(lib, name, None)
            if fn is None:
                if name in _REQUIRED:
                    raise LibraryNotFound("%s lacks the function %s (an older or foreign "
                                          "build?)" % (_lib_path, name))
                continue
            fn.restype = restype
            fn.argtypes = argtypes
        _lib = lib
        return lib


def lib_path():
    """Path (or loader name) of the loaded library."""
    load()
    return _lib_path


def has_function(name):
    return getattr(load(), name, None) is not None
