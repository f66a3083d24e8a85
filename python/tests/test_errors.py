"""Error paths: every failure surfaces as KvwireError with kvwire's status, or as a
FAILED room with a reason; nothing hangs. Prefill and decode contexts share this
process here (the library's threads do the work while ctypes releases the GIL)."""
import inspect
import time
import unittest

import kvtest_util as U
import kvwire
from kvwire import RoomState, Status
from kvwire.connector import (KVManager, KVPoll, KVReceiver, KVSender, KVTransferError,
                              kvpoll)


def _wait_state(room, want, timeout=10):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        s = room.poll()
        if s == want or getattr(s, "terminal", False):
            return s
        time.sleep(0.002)
    return room.poll()


class TestErrorPaths(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        U.library_or_skip()
        cls.model, cls.srcs = U.make_prefill_ranks(1)
        cls.pctx = kvwire.Context(cls.srcs[0].rank, "prefill", "127.0.0.1:0",
                                  host_bootstrap=True, wait_timeout_ms=5000,
                                  peer_timeout_ms=3000)
        cls.addr = cls.pctx.bootstrap_addr
        cls.room = 500

    @classmethod
    def tearDownClass(cls):
        cls.pctx.close()

    def next_room(self):
        type(self).room += 1
        return type(self).room

    def decode_rank(self, model=None, tp=2, rank=0, head_dim=64):
        m = model or U.gptoss_model(U.WINDOW, head_dim=head_dim)
        return U.HostRank(m, tp, rank, page_size=U.FULL_PS, swa_page_size=U.SWA_PS,
                          full_pages=8, swa_pages=4, seed=3)

    def test_bootstrap_addr(self):
        host, port = self.addr.rsplit(":", 1)
        self.assertEqual(host, "127.0.0.1")
        self.assertGreater(int(port), 0)

    def test_bootstrap_server_refused_cleanly(self):
        """A BootstrapServer whose constructor raised is collected without an exception
        of its own (nothing reaches sys.unraisablehook)."""
        import gc
        import sys
        seen = []
        hook, sys.unraisablehook = sys.unraisablehook, seen.append
        try:
            for addr in ("not an address", "127.0.0.1:99999", "::1:8998"):
                with self.assertRaises(kvwire.KvwireError) as cm:
                    kvwire.BootstrapServer(addr)
                self.assertEqual(cm.exception.status, Status.ERR_INVALID_PARAM, addr)
                self.assertTrue(cm.exception.message, addr)
                del cm
                gc.collect()
        finally:
            sys.unraisablehook = hook
        self.assertEqual([(u.exc_type, str(u.exc_value)) for u in seen], [])

    def test_head_dim_mismatch_rejected(self):
        d = self.decode_rank(head_dim=128)
        before, _ = self.pctx.refusals()
        with self.assertRaises(kvwire.KvwireError) as cm:
            kvwire.Context(d.rank, "decode", self.addr, prefill_tp=1, bootstrap_timeout_ms=5000)
        e = cm.exception
        # The prefill rank counted the refusal and can report it.
        n, why = self.pctx.refusals()
        self.assertEqual(n, before + 1)
        self.assertIn("128", why)
        self.assertEqual(e.status, Status.ERR_REJECTED)
        self.assertEqual(e.status_name, "ERR_REJECTED")
        self.assertIn("128", e.message)  # the reason names the differing values
        self.assertIn("64", e.message)
        # The connector reports it the same way, before the first request.
        with self.assertRaises(kvwire.KvwireError) as cm:
            KVManager(d.model, kvwire.Parallel(2, 0), "decode", self.addr, buffers=d.buffers,
                      prefill_tp=1, bootstrap_timeout_ms=5000)
        self.assertEqual(cm.exception.status, Status.ERR_REJECTED)

    def test_send_on_aborted_room(self):
        s = self.pctx.sender(self.next_room())
        self.assertEqual(s.poll(), RoomState.BOOTSTRAPPING)
        s.abort()
        self.assertEqual(_wait_state(s, RoomState.FAILED), RoomState.FAILED)
        self.assertTrue(s.failure_reason)
        self.assertNotEqual(s.status, Status.OK)
        with self.assertRaises(kvwire.KvwireError) as cm:
            s.send(16, full_pages=[0])
        self.assertEqual(cm.exception.status, Status.ERR_ABORTED)
        self.assertEqual(s.poll(), RoomState.FAILED)  # sticky
        s.close()
        with self.assertRaises(ValueError):
            s.poll()

    def test_busy_and_bad_chunks(self):
        room = self.next_room()
        with self.pctx.sender(room) as s:
            with self.assertRaises(kvwire.KvwireError) as cm:
                self.pctx.sender(room)
            self.assertEqual(cm.exception.status, Status.ERR_BUSY)
            with self.assertRaises(kvwire.KvwireError) as cm:
                s.send(10, 0, 20, full_pages=[0, 1])
            self.assertEqual(cm.exception.status, Status.ERR_INVALID_PARAM)
            with self.assertRaises(kvwire.KvwireError) as cm:
                s.send(10, 0, 5, True, full_pages=[0])  # a last chunk must end the request
            self.assertEqual(cm.exception.status, Status.ERR_INVALID_PARAM)
        with self.assertRaises(kvwire.KvwireError) as cm:
            self.pctx.receiver(room)  # receivers live on decode contexts
        self.assertEqual(cm.exception.status, Status.ERR_INVALID_PARAM)

    def test_unknown_transport(self):
        with self.assertRaises(kvwire.KvwireError) as cm:
            kvwire.Context(self.srcs[0].rank, "prefill", "127.0.0.1:0", transport="nope",
                           host_bootstrap=True)
        self.assertEqual(cm.exception.status, Status.ERR_UNSUPPORTED)
        self.assertIn("nope", cm.exception.message)
        self.assertFalse(kvwire.transport_available("nope"))
        self.assertTrue(kvwire.transport_available("tcp"))

    def test_decode_side_errors_and_abort(self):
        d = self.decode_rank()
        with kvwire.Context(d.rank, "decode", self.addr, prefill_tp=1,
                            bootstrap_timeout_ms=5000) as dctx:
            # A page list that does not cover the request fails the room at once.
            rv = dctx.receiver(self.next_room())
            with self.assertRaises(kvwire.KvwireError) as cm:
                rv.post(100, 0, [0, 1], 0, [0, 1], 64)
            self.assertEqual(cm.exception.status, Status.ERR_OUT_OF_RANGE)
            self.assertEqual(rv.poll(), RoomState.FAILED)
            self.assertIn("does not cover", rv.failure_reason)
            with self.assertRaises(kvwire.KvwireError):
                rv.post(100, 0, list(range(7)), 0, [0, 1, 2], 64)  # FAILED is sticky
            rv.close()

            # Decode aborts a posted room; the prefill side learns it and fails too.
            room = self.next_room()
            rv = dctx.receiver(room)
            rv.post(20, 0, [3, 4], 0, [1, 2], 0)
            self.assertEqual(rv.poll(), RoomState.WAITING_FOR_INPUT)
            s = self.pctx.sender(room)
            rv.abort()
            self.assertEqual(_wait_state(rv, RoomState.FAILED), RoomState.FAILED)
            self.assertEqual(_wait_state(s, RoomState.FAILED), RoomState.FAILED)
            self.assertTrue(s.failure_reason)
            with self.assertRaises(kvwire.KvwireError):
                s.send(20, full_pages=[0, 1], swa_pages=[0, 1])
            s.close()

            # Closing a context closes its open rooms.
            rv = dctx.receiver(self.next_room())
        with self.assertRaises(ValueError):
            rv.poll()

    def test_connector_failure(self):
        d = self.decode_rank()
        mgr = KVManager(d.model, kvwire.Parallel(2, 0), "decode", self.addr, buffers=d.buffers,
                        prefill_tp=1, bootstrap_timeout_ms=5000)
        try:
            room = self.next_room()
            rv = KVReceiver(mgr, self.addr, room)
            self.assertEqual(rv.poll(), KVPoll.Bootstrapping)
            with self.assertRaises(RuntimeError):
                rv.send_metadata([0])
            # SGLang-shaped calls (page counts, aux_index in second place) are refused
            # instead of meaning tokens here; kvwire.sglang is that interface.
            self.assertFalse(hasattr(rv, "init"))
            self.assertFalse(hasattr(KVSender, "init"))
            for p in ("chunk_end", "last"):
                self.assertEqual(inspect.signature(KVSender.send).parameters[p].kind,
                                 inspect.Parameter.KEYWORD_ONLY)
            rv.init_tokens(20)
            with self.assertRaises(TypeError):
                rv.send_metadata([3, 4], 5)         # send_metadata(kv_indices, aux_index)
            rv.send_metadata([3, 4], swa_pages=[1, 2])
            self.assertEqual(rv.poll(), KVPoll.WaitingForInput)
            rv.abort()
            t_end = time.monotonic() + 10
            while rv.poll() != KVPoll.Failed and time.monotonic() < t_end:
                time.sleep(0.002)
            self.assertEqual(rv.poll(), KVPoll.Failed)
            with self.assertRaises(KVTransferError) as cm:
                rv.failure_exception()
            self.assertEqual(cm.exception.bootstrap_room, room)
            self.assertTrue(cm.exception.failure_reason)
            with self.assertRaises(ValueError):
                KVSender(mgr, self.addr, room)  # decode managers have no senders
            rv.close()
        finally:
            mgr.close()

    def test_kvpoll_mapping(self):
        self.assertEqual([int(k) for k in KVPoll], [0, 1, 2, 3, 4])
        self.assertEqual(kvpoll(RoomState.BOOTSTRAPPING), KVPoll.Bootstrapping)
        self.assertEqual(kvpoll(RoomState.WAITING_FOR_INPUT), KVPoll.WaitingForInput)
        self.assertEqual(kvpoll(RoomState.TRANSFERRING), KVPoll.Transferring)
        self.assertEqual(kvpoll(RoomState.SUCCESS), KVPoll.Success)
        self.assertEqual(kvpoll(RoomState.FAILED), KVPoll.Failed)
        self.assertEqual(kvpoll(4), KVPoll.Failed)


if __name__ == "__main__":
    unittest.main()
