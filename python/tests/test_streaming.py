"""Layer-wise streaming through the binding (Sender.send_streamed, Sender.layers_ready):
prefill TP2 -> decode TP1 in one process. Layers are marked out of order, one twice;
before the last one, the decode must have counted exactly the bytes of the layers marked
and must not have reached Success. Every destination byte is then checked against the
pure-Python reference, guard bytes included. The binding's refusals carry the library's
status and message."""
import os
import time
import unittest

import kvtest_util as U
import kvwire

TRANSPORT = os.environ.get("KVW_PY_TRANSPORT") or None


class TestStreaming(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        U.library_or_skip()

    def test_layers_out_of_order(self):
        model, srcs = U.make_prefill_ranks(2)
        d = U.HostRank(model, 1, 0, page_size=U.FULL_PS, swa_page_size=U.SWA_PS,
                       full_pages=U.FULL_PAGES, swa_pages=U.SWA_PAGES, seed=U.DECODE_SEED)
        req = {"room": 21, "n": 40, "prefix": 0, "chunks": [(0, 40)]}
        spages = [U.prefill_pages([req], r) for r in range(2)]
        dpages = U.decode_pages([req], 0)
        before = d.snapshot()
        ctx_p0 = kvwire.Context(srcs[0].rank, kvwire.Side.PREFILL, "127.0.0.1:0",
                                host_bootstrap=True, transport=TRANSPORT)
        ctx_p1 = kvwire.Context(srcs[1].rank, kvwire.Side.PREFILL, ctx_p0.bootstrap_addr,
                                transport=TRANSPORT)
        ctx_d = kvwire.Context(d.rank, kvwire.Side.DECODE, ctx_p0.bootstrap_addr,
                               transport=TRANSPORT, wait_timeout_ms=60000)
        try:
            full, swa, swa0 = dpages[21]
            rv = ctx_d.receiver(21)
            rv.post(40, 0, full, 0, swa, swa0)
            senders = []
            for r, ctx in enumerate((ctx_p0, ctx_p1)):
                sfull, sswa, sswa0 = spages[r][21]
                s = ctx.sender(21)
                with self.assertRaises(kvwire.KvwireError) as cm:
                    s.layers_ready(0)
                self.assertEqual(cm.exception.status, kvwire.Status.ERR_INVALID_PARAM)
                self.assertIn("has no streamed chunk", cm.exception.message)
                s.send_streamed(40, 0, 40, True, sfull, 0, sswa, sswa0, -1)
                with self.assertRaises(kvwire.KvwireError) as cm:
                    s.layers_ready(3, 9)
                self.assertEqual(cm.exception.status, kvwire.Status.ERR_INVALID_PARAM)
                self.assertIn("layers [3, 9) lie outside this rank's pipeline stage",
                              cm.exception.message)
                senders.append(s)
            # Layers 2, 0 and 3 (layer 0 twice); the decode must then hold exactly those
            # layers' bytes and nothing of layer 1.
            for s in senders:
                s.layers_ready(2)
                s.layers_ready(0)
                s.layers_ready(3, 4)
                s.layers_ready(0)
            expect_partial, want = _reference_for_layers(model, srcs, spages, d, before, dpages,
                                                         req, {0, 2, 3})
            deadline = time.monotonic() + 60
            while rv.metrics().bytes < want and time.monotonic() < deadline and \
                    rv.poll() != kvwire.RoomState.FAILED:
                time.sleep(0.001)
            self.assertEqual(rv.metrics().bytes, want)
            self.assertEqual(rv.poll(), kvwire.RoomState.TRANSFERRING,
                             "before the last layer: " + rv.failure_reason)
            for j, p in enumerate(d.planes):
                self.assertTrue(p.mem == expect_partial[j], "buffer %d before the last layer: %s"
                                % (j, U.first_difference(p.mem, expect_partial[j])))
            for s in senders:
                s.layers_ready(1)
            self.assertEqual(rv.wait(timeout=60), kvwire.RoomState.SUCCESS, rv.failure_reason)
            for s in senders:
                self.assertEqual(s.wait(timeout=60), kvwire.RoomState.SUCCESS)
            expect = [bytearray(x) for x in before]
            U.ref_apply(model, srcs, [x.snapshot() for x in srcs], spages, d, expect, dpages,
                        req)
            for j, p in enumerate(d.planes):
                self.assertTrue(p.mem == expect[j], "buffer %d: %s"
                                % (j, U.first_difference(p.mem, expect[j])))
            self.assertNotEqual([bytes(p.mem) for p in d.planes], [bytes(x) for x in before])
        finally:
            ctx_d.close()
            ctx_p1.close()
            ctx_p0.close()


def _reference_for_layers(model, srcs, spages, d, before, dpages, req, layers):
    """The decode's expected planes once only `layers` arrived (the reference applied to
    a scratch copy, then taken for those layers' planes), and the bytes they hold."""
    scratch = [bytearray(x) for x in before]
    U.ref_apply(model, srcs, [x.snapshot() for x in srcs], spages, d, scratch, dpages, req)
    expect = [bytearray(x) for x in before]
    want = 0
    for j, p in enumerate(d.planes):
        if p.layer not in layers:
            continue
        expect[j] = scratch[j]
        l = model.layers[p.layer]
        t0 = req["prefix"] if l.kind == kvwire.LayerKind.FULL else \
            max(req["n"] - l.window, req["prefix"], 0)
        want += (req["n"] - t0) * p.heads * p.head_bytes
    return expect, want


if __name__ == "__main__":
    unittest.main()
