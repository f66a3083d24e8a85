"""Orders a chunk's reads after the engine's GPU writes (kvwire.sglang, kvwire.connector).

kvwire's CUDA streams never wait for the engine's: a chunk whose KV the forward pass
wrote with kernels still queued on the engine's stream would be read too early (the last
layers first), which no byte check can tell from garbage. Each send of a chunk held in
GPU memory therefore records an event on the caller's current stream, after those
writes. Complete (the engine synchronized, as SGLang's scheduler does), the chunk goes as
a plain send; still pending, it goes as a streamed chunk whose every layer waits on the
event (kvw_sender_layers_ready_event), so that neither the caller nor the engine's
stream waits. The next chunk of the room settles the previous one first: the library
takes a room's next chunk only once every layer of its streamed chunk was marked.
"""

__all__ = ["chunk_event", "current_stream_event", "queue_after", "settle"]


def chunk_event(event, cuda_device):
    """The event a chunk's reads wait for. KV on GPU `cuda_device`: `event` (the caller's,
    recorded after writes on another stream) or else one recorded now on the current
    stream. Host KV (cuda_device None): none; a given event is waited for here (host
    memory written by a GPU)."""
    if cuda_device is None:
        if event is not None:
            event.synchronize()
        return None
    return event if event is not None else current_stream_event(cuda_device)


def current_stream_event(device):
    """A torch.cuda.Event recorded now on the current stream of `device`; None where
    torch is not importable (then nothing can have queued GPU writes through it)."""
    try:
        import torch
    except ImportError:
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


def queue_after(room, event, layer_begin, layer_end, args):
    """Queues the chunk send(*args) on `room` (a kvwire.Sender) ordered after `event`
    (None: nothing to wait for): at once when it completed, else as a streamed chunk
    whose layers [layer_begin, layer_end) become ready with the event. Returns the
    event the chunk waits on, or None."""
    if event is None or event.query():
        room.send(*args)
        return None
    room.send_streamed(*args)
    room.layers_ready(layer_begin, layer_end, event=event)
    return event


def settle(room, event, layer_begin, layer_end):
    """Before a room's next chunk: waits for the event the previous chunk waits on (what
    queue_after returned; None: nothing) and marks its layers at once, rather than at the
    library's event thread's next poll."""
    if event is None:
        return
    event.synchronize()
    room.layers_ready(layer_begin, layer_end)
