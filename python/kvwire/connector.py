"""kvwire in the connector shape serving engines use for disaggregated prefill/decode.

* KVManager: one per rank (per TP/PP/DP worker process), built once at start-up from
  the engine's KV cache buffers. Wraps a kvwire Rank and Context; on the prefill side
  the first rank of the instance hosts the bootstrap endpoint.
* KVSender: one per request on each prefill rank: init_tokens(num_tokens),
  send(pages, chunk_end=...) per chunk as prefill proceeds, poll() until
  KVPoll.Success or KVPoll.Failed.
* KVReceiver: one per request on each decode rank: init_tokens(num_tokens,
  prefix_len=...), send_metadata(pages, swa_pages=..., ...) once its pages are
  allocated, poll().

This adapter counts tokens. SGLang's backend interface uses the same method names
with other units and argument orders (init(num_pages, aux_index),
send_metadata(kv_indices, aux_index, ...), state indices per state type); that
interface is kvwire.sglang. To keep a call written for one from silently meaning
something else here, this module has no init() and takes everything after the page
list as keywords.

KVPoll uses the numbering engines use (Failed=0 ... Success=4), which differs from
kvwire's own RoomState; kvpoll() maps one to the other.

kvwire moves KV pages and state slots here; per-room metadata ("aux" data: first
output token, logprobs) goes through kvwire.Sender.set_metadata /
Receiver.metadata, which kvwire.sglang uses.
"""
import enum

from . import _order
from .core import (Context, LayerKind, Layout, MemKind, Pool, Rank, RoomState, Side,
                   kv_cache_buffers)

__all__ = ["KVPoll", "KVTransferError", "KVManager", "KVSender", "KVReceiver", "kvpoll",
           "DisaggregationMode"]


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


_STATE_TO_POLL = {
    RoomState.BOOTSTRAPPING: KVPoll.Bootstrapping,
    RoomState.WAITING_FOR_INPUT: KVPoll.WaitingForInput,
    RoomState.TRANSFERRING: KVPoll.Transferring,
    RoomState.SUCCESS: KVPoll.Success,
    RoomState.FAILED: KVPoll.Failed,
}


def kvpoll(state):
    """KVPoll for a kvwire RoomState."""
    return _STATE_TO_POLL[RoomState(state)]


class DisaggregationMode(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class KVTransferError(RuntimeError):
    """A request's KV transfer failed (raised by failure_exception())."""

    def __init__(self, bootstrap_room, failure_reason, status=None):
        super().__init__("room %s: %s" % (bootstrap_room, failure_reason))
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason
        self.status = status


def _side(mode):
    if isinstance(mode, Side):
        return mode
    m = getattr(mode, "value", mode)
    m = str(m).lower()
    if m not in ("prefill", "decode"):
        raise ValueError("mode must be 'prefill' or 'decode', not %r" % (mode,))
    return Side.PREFILL if m == "prefill" else Side.DECODE


class KVManager:
    """One rank's kvwire state: its KV cache description and its transfer context.

    model, parallel: kvwire Model and Parallel of this rank. mode: "prefill" or
    "decode". Buffers come either ready-made (buffers=[Buffer, ...]) or from the
    engine's per-layer caches: kv_caches={global layer: (k, v)} with page_size (and
    swa_page_size for a separate sliding-window pool); tensors, NumPy arrays,
    bytearrays or raw (address, length) Buffers all work.

    bootstrap_addr: "host:port" of the prefill instance's bootstrap endpoint. On the
    prefill side the instance's first rank hosts it (host_bootstrap defaults to
    tp_rank == pp_rank == dp_rank == 0); "host:0" picks a free port, which
    .bootstrap_addr then reports for the other ranks and the decode instance.
    Decode managers need the prefill instance size (prefill_tp, prefill_pp,
    prefill_dp; 0 = what the bootstrap table announces). Remaining keyword arguments
    go to kvwire.Context (transport, listen_host, timeouts in ms).

    Creating a decode manager performs the handshake with every prefill rank it needs;
    any incompatibility raises KvwireError (status ERR_REJECTED) here, before the
    first request."""

    def __init__(self, model, parallel, mode, bootstrap_addr, *, buffers=None,
                 kv_caches=None, page_size=None, swa_page_size=None, layout=Layout.NHD,
                 host_bootstrap=None, **context_kwargs):
        self.mode = _side(mode)
        self.model = model
        self.parallel = parallel.resolved(model.num_layers)
        if buffers is None:
            if kv_caches is None or page_size is None:
                raise ValueError("pass buffers=[...] or kv_caches={layer: (k, v)} with page_size")
            buffers = kv_cache_buffers(model, self.parallel, kv_caches, page_size,
                                       swa_page_size, layout)
        self.rank = Rank(model, self.parallel, buffers)
        if host_bootstrap is None:
            p = self.parallel
            host_bootstrap = (self.mode == Side.PREFILL and p.tp_rank == 0 and p.pp_rank == 0
                              and p.dp_rank == 0)
        try:
            self.context = Context(self.rank, self.mode, bootstrap_addr,
                                   host_bootstrap=bool(host_bootstrap), **context_kwargs)
        except BaseException:
            self.rank.close()
            raise
        self.cuda_device = self._cuda_device()
        self.page_size = self._pool_page_size(Pool.FULL)
        self.swa_page_size = self._pool_page_size(Pool.SWA)
        self.swa_window = model.max_window(self.parallel.layer_begin, self.parallel.layer_end)

    def _cuda_device(self):
        """The GPU holding the KV (its first CUDA buffer's), None for host KV: sends are
        ordered after that device's current stream."""
        return next((b.device for b in self.rank.buffers if b.mem_kind == MemKind.CUDA), None)

    def _pool_page_size(self, pool):
        for b in self.rank.buffers:
            p = b.pool
            if p is None:
                kind = self.model.layers[b.layer].kind
                p = {LayerKind.SWA: Pool.SWA, LayerKind.STATE: Pool.STATE}.get(kind, Pool.FULL)
            if p == pool:
                return b.page_size
        return 0

    @property
    def is_prefill(self):
        return self.mode == Side.PREFILL

    @property
    def bootstrap_addr(self):
        return self.context.bootstrap_addr

    def swa_window_start(self, num_tokens, prefix_len=0):
        """First token of the SWA pool's page list for a request: the window start of
        the widest window, floored to this rank's SWA page size."""
        if not self.swa_window or not self.swa_page_size:
            return 0
        t = max(num_tokens - self.swa_window, 0)
        return t // self.swa_page_size * self.swa_page_size

    def close(self):
        """Fails every open room with "context destroyed" and releases everything."""
        ctx, self.context = getattr(self, "context", None), None
        if ctx is not None:
            ctx.close()
        rank, self.rank = getattr(self, "rank", None), None
        if rank is not None:
            rank.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Request:
    def __init__(self, mgr, bootstrap_room):
        self.mgr = mgr
        self.bootstrap_room = int(bootstrap_room)
        self.num_tokens = None
        self._room = None

    def poll(self):
        """KVPoll of the request on this rank (never blocks)."""
        if self._room is None:
            return KVPoll.Bootstrapping
        return kvpoll(self._room.poll())

    @property
    def failure_reason(self):
        return self._room.failure_reason if self._room is not None else ""

    def failure_exception(self):
        """Raises KVTransferError with kvwire's reason for the failure."""
        if self._room is None:
            raise KVTransferError(self.bootstrap_room, "the request was never started")
        raise KVTransferError(self.bootstrap_room, self._room.failure_reason or
                              "transfer failed", self._room.status)

    def abort(self):
        """Aborts the request here and tells the peers (they stop and acknowledge)."""
        if self._room is not None:
            self._room.abort()

    def metrics(self):
        return self._room.metrics() if self._room is not None else None

    def close(self):
        """Releases the request's handle (a transfer still running is aborted)."""
        if self._room is not None:
            self._room.close()
            self._room = None


class KVSender(_Request):
    """A request's prefill side on one rank.

    The extra constructor arguments (bootstrap_addr, dest_tp_ranks, pp_rank) are
    accepted for the engines' connector signature; kvwire derives routes itself."""

    def __init__(self, mgr, bootstrap_addr=None, bootstrap_room=None, dest_tp_ranks=None,
                 pp_rank=None):
        if not mgr.is_prefill:
            raise ValueError("KVSender needs a prefill KVManager")
        if bootstrap_room is None:
            raise ValueError("bootstrap_room is required")
        super().__init__(mgr, bootstrap_room)
        self._room = mgr.context.sender(self.bootstrap_room)
        self._sent = 0
        self._next_page = 0
        self._written = None

    def init_tokens(self, num_tokens):
        """Announces the request's length in tokens (the prompt that prefill computes)."""
        self.num_tokens = int(num_tokens)
        self._sent = 0
        self._next_page = 0
        self._written = None  # the event the last chunk waits on (kvwire._order)

    def send(self, page_indices, *, chunk_end=None, last=None, first_page=None,
             swa_pages=None, swa_first_token=None, state_slot=None, event=None):
        """Sends the next chunk: tokens [end of the previous chunk, chunk_end).

        page_indices: this rank's full-pool pages holding the chunk, starting with the
        request's page number first_page (default: the page holding the chunk's first
        token, i.e. where the previous chunk stopped; passing the whole list with
        first_page=0 works too). chunk_end defaults to the end of those pages (capped
        at num_tokens); last defaults to chunk_end == num_tokens. The last chunk also
        carries the sliding-window pages (swa_pages, starting at swa_first_token,
        default manager.swa_window_start(num_tokens)) and the state slot
        (state_slot). KV in GPU memory is read only after the work queued so far on
        the caller's current stream (torch.cuda.current_stream): a chunk whose writes
        are still in flight there waits for them on kvwire's event thread, without
        blocking the caller or the stream (kvwire._order). `event` (a torch.cuda.Event
        recorded after the writes) replaces that stream's event, for KV written on
        another stream; host KV is read at once (event, if given, is waited for here)."""
        if self.num_tokens is None:
            raise RuntimeError("KVSender.init_tokens(num_tokens) must come before send()")
        ps = self.mgr.page_size or 1
        pages = page_indices.tolist() if hasattr(page_indices, "tolist") else list(page_indices)
        fp = self._next_page if first_page is None else int(first_page)
        if chunk_end is None:
            chunk_end = self.num_tokens if last else min(self.num_tokens, (fp + len(pages)) * ps)
        chunk_end = int(chunk_end)
        if last is None:
            last = chunk_end >= self.num_tokens
        swa = ()
        swa_first = 0
        if last:
            if swa_pages is not None:
                swa = swa_pages
                swa_first = (self.mgr.swa_window_start(self.num_tokens)
                             if swa_first_token is None else swa_first_token)
        par = self.mgr.parallel
        _order.settle(self._room, self._written, par.layer_begin, par.layer_end)
        self._written = None  # settled, even if queueing this chunk raises below
        self._written = _order.queue_after(
            self._room, _order.chunk_event(event, self.mgr.cuda_device), par.layer_begin,
            par.layer_end,
            (self.num_tokens, self._sent, chunk_end, bool(last), pages, fp * ps, swa, swa_first,
             -1 if state_slot is None else state_slot))
        self._sent = chunk_end
        self._next_page = chunk_end // ps


class KVReceiver(_Request):
    """A request's decode side on one rank."""

    def __init__(self, mgr, bootstrap_addr=None, bootstrap_room=None, data_parallel_rank=None,
                 prefill_dp_rank=None):
        if mgr.is_prefill:
            raise ValueError("KVReceiver needs a decode KVManager")
        if bootstrap_room is None:
            raise ValueError("bootstrap_room is required")
        super().__init__(mgr, bootstrap_room)
        self.prefill_dp_rank = prefill_dp_rank if prefill_dp_rank is not None else \
            (data_parallel_rank or 0)
        self.prefix_len = 0

    def init_tokens(self, num_tokens, *, prefix_len=0, prefill_dp_rank=None):
        """Opens the request on this rank: num_tokens of the prompt, of which the first
        prefix_len are already cached here (they are not sent)."""
        if self._room is not None:
            raise RuntimeError("KVReceiver.init_tokens called twice")
        if prefill_dp_rank is not None:
            self.prefill_dp_rank = int(prefill_dp_rank)
        self.num_tokens = int(num_tokens)
        self.prefix_len = int(prefix_len)
        self._room = self.mgr.context.receiver(self.bootstrap_room, self.prefill_dp_rank)

    def send_metadata(self, page_indices, *, prefix_len=None, swa_pages=None, state_slot=None,
                      swa_first_token=None, first_page=0):
        """Tells the prefill ranks where to write.

        page_indices: this rank's full-pool pages of the request from page first_page
        (default 0: the whole request, cached prefix included). swa_pages: the
        sliding-window pool's pages from swa_first_token (default
        manager.swa_window_start(num_tokens)). state_slot: the request's slot in
        state buffers. prefix_len overrides init_tokens'."""
        if self._room is None:
            raise RuntimeError("KVReceiver.init_tokens(num_tokens) must come before "
                               "send_metadata()")
        if prefix_len is not None:
            self.prefix_len = int(prefix_len)
        ps = self.mgr.page_size or 1
        swa = () if swa_pages is None else swa_pages
        swa_first = 0
        if swa_pages is not None:
            swa_first = (self.mgr.swa_window_start(self.num_tokens, self.prefix_len)
                         if swa_first_token is None else swa_first_token)
        self._room.post(self.num_tokens, self.prefix_len, page_indices, int(first_page) * ps,
                        swa, swa_first, -1 if state_slot is None else state_slot)
