"""kvwire.connector.KVSender.send with KV in GPU memory: each chunk is read only after the
work queued on the caller's current stream (or after the event the caller passes), and
the next chunk settles the previous one first (kvwire._order).

The room, torch and its events are stand-ins that record what the sender asks of them,
so this runs without a GPU; on one, python/tests/test_torch_gpu.py's unsynchronized
connector send checks the bytes."""
import sys
import types
import unittest
from unittest import mock

import kvwire
from kvwire.connector import KVSender
from order_standins import Event, Room, fake_torch


def sender(cuda_device, ps=16, tokens=64):
    mgr = types.SimpleNamespace(page_size=ps, cuda_device=cuda_device, is_prefill=True,
                                parallel=types.SimpleNamespace(layer_begin=2, layer_end=5),
                                swa_window_start=lambda n: 0)
    s = object.__new__(KVSender)
    s.mgr, s.bootstrap_room = mgr, 9
    s._room = Room()
    s._written = None
    s.init_tokens(tokens)
    return s


class TestConnectorOrder(unittest.TestCase):
    def test_current_stream_complete(self):
        # The engine synchronized: the event recorded on its current stream is complete
        # and the chunk is a plain send.
        s = sender(cuda_device=1)
        made = []
        with mock.patch.dict(sys.modules, {"torch": fake_torch(made, True)}):
            s.send([0, 1, 2, 3])
        self.assertEqual(len(made), 1)
        self.assertEqual(made[0].recorded_on, ("stream", 1))
        self.assertEqual(s._room.calls, [("send", 0, 64, True)])
        self.assertIsNone(s._written)

    def test_current_stream_pending_then_next_chunk(self):
        # Writes still queued: the chunk goes streamed, every layer of the stage waiting
        # on the event; the next chunk first waits for it and marks the layers.
        s = sender(cuda_device=0)
        made = []
        with mock.patch.dict(sys.modules, {"torch": fake_torch(made, False)}):
            s.send([0, 1], chunk_end=32)
            self.assertEqual(s._room.calls,
                             [("send_streamed", 0, 32, False), ("layers_ready", 2, 5, made[0])])
            self.assertIs(s._written, made[0])
            log = made[0].log
            s.send([2, 3])
        self.assertEqual(log, [("synchronize", made[0])])
        self.assertEqual(s._room.calls[2], ("layers_ready", 2, 5, None))
        # The second chunk's own event (pending too) orders it in turn.
        self.assertEqual(s._room.calls[3:], [("send_streamed", 32, 64, True),
                                             ("layers_ready", 2, 5, made[1])])

    def test_caller_event(self):
        # KV written on another stream: the caller's event replaces the current
        # stream's (no event of our own is made).
        s = sender(cuda_device=0)
        made = []
        ev = Event(done=False)
        with mock.patch.dict(sys.modules, {"torch": fake_torch(made, True)}):
            s.send([0, 1, 2, 3], event=ev)
        self.assertEqual(made, [])
        self.assertEqual(s._room.calls, [("send_streamed", 0, 64, True),
                                         ("layers_ready", 2, 5, ev)])

    def test_host_kv(self):
        # Host KV: no event of our own, a given one is waited for here, a plain send.
        s = sender(cuda_device=None)
        ev = Event(done=False)
        made = []
        with mock.patch.dict(sys.modules, {"torch": fake_torch(made, False)}):
            s.send([0, 1, 2, 3], event=ev)
        self.assertEqual(made, [])
        self.assertEqual(ev.log, [("synchronize", ev)])
        self.assertEqual(s._room.calls, [("send", 0, 64, True)])

    def test_manager_finds_the_gpu(self):
        # KVManager.cuda_device: the device of the first CUDA buffer, None for host KV.
        # Checked on Buffer objects as the manager reads them (no context made).
        mgr = object.__new__(kvwire.connector.KVManager)
        host = types.SimpleNamespace(mem_kind=kvwire.MemKind.HOST, device=-1)
        gpu = types.SimpleNamespace(mem_kind=kvwire.MemKind.CUDA, device=3)
        for bufs, want in (([host, host], None), ([host, gpu], 3)):
            mgr.rank = types.SimpleNamespace(buffers=bufs)
            self.assertEqual(kvwire.connector.KVManager._cuda_device(mgr), want)


if __name__ == "__main__":
    unittest.main()
