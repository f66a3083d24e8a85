"""One decode context, two prefill instances: instance A hosts its bootstrap endpoint,
instance B registers with a standalone kvwire.BootstrapServer. The decode context names
no instance of its own; each receiver names the instance it reads from. Every
destination byte is checked against the pure-Python reference, guard bytes included,
and so is the per-room metadata."""
import os
import unittest

import kvtest_util as U
import kvwire

TRANSPORT = os.environ.get("KVW_PY_TRANSPORT") or None


class TestMultiInstance(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        U.library_or_skip()

    def test_two_instances_one_decode(self):
        model = U.gptoss_model(U.WINDOW)

        def host_rank(seed):
            return U.HostRank(model, 1, 0, page_size=U.FULL_PS, swa_page_size=U.SWA_PS,
                              full_pages=U.FULL_PAGES, swa_pages=U.SWA_PAGES, seed=seed)

        a, b, d = host_rank(101), host_rank(202), host_rank(U.DECODE_SEED)
        reqs = U.make_requests()
        owner = {r["room"]: ("A" if i % 2 == 0 else "B") for i, r in enumerate(reqs)}
        spages = U.prefill_pages(reqs, 0)
        dpages = U.decode_pages(reqs, 0)
        before = d.snapshot()
        with kvwire.BootstrapServer() as server:
            ctx_a = kvwire.Context(a.rank, kvwire.Side.PREFILL, "127.0.0.1:0",
                                   host_bootstrap=True, transport=TRANSPORT)
            ctx_b = kvwire.Context(b.rank, kvwire.Side.PREFILL, server.address,
                                   transport=TRANSPORT)
            ctx_d = kvwire.Context(d.rank, kvwire.Side.DECODE, None, transport=TRANSPORT,
                                   wait_timeout_ms=20000)
            addr = {"A": ctx_a.bootstrap_addr, "B": server.address}
            ctx = {"A": ctx_a, "B": ctx_b}
            try:
                receivers = {}
                for r in reqs:
                    full, swa, swa0 = dpages[r["room"]]
                    rv = ctx_d.receiver(r["room"], 0, addr[owner[r["room"]]])
                    rv.post(r["n"], r["prefix"], full, 0, swa, swa0)
                    receivers[r["room"]] = rv
                senders = []
                for r in reqs:
                    full, swa, swa0 = spages[r["room"]]
                    s = ctx[owner[r["room"]]].sender(r["room"])
                    s.set_metadata(U.room_metadata(r["room"]) + owner[r["room"]].encode())
                    for (beg, end) in r["chunks"]:
                        last = end == r["n"]
                        fp = beg // U.FULL_PS
                        s.send(r["n"], beg, end, last, full[fp:U._pages_needed(0, end, U.FULL_PS)],
                               fp * U.FULL_PS, swa if last else (), swa0 if last else 0, -1)
                    senders.append(s)
                for room, rv in receivers.items():
                    st = rv.wait(timeout=30)
                    self.assertEqual(st, kvwire.RoomState.SUCCESS,
                                     "room %d from %s: %s" % (room, owner[room],
                                                              rv.failure_reason))
                    self.assertEqual(rv.metadata(),
                                     U.room_metadata(room) + owner[room].encode())
                for s in senders:
                    self.assertEqual(s.wait(timeout=30), kvwire.RoomState.SUCCESS)
                expect = [bytearray(x) for x in before]
                srcs = {"A": a, "B": b}
                for r in reqs:
                    src = srcs[owner[r["room"]]]
                    U.ref_apply(model, [src], [src.snapshot()], [spages], d, expect, dpages, r)
                for j, p in enumerate(d.planes):
                    self.assertTrue(p.mem == expect[j], "buffer %d: %s"
                                    % (j, U.first_difference(p.mem, expect[j])))
                # The data must have changed somewhere, or the check above proves nothing.
                self.assertNotEqual([bytes(p.mem) for p in d.planes], [bytes(x) for x in before])
                # A room naming an unreachable instance fails with the address named.
                # Its connection may have failed already when the post comes (an
                # unreachable address fails at once): the post then raises the room's
                # failure, which names the address too.
                rv = ctx_d.receiver(99, 0, "127.0.0.1:1")
                try:
                    rv.post(1, 0, [U.FULL_PAGES - 1], 0, [U.SWA_PAGES - 1], 0)
                except kvwire.KvwireError as e:
                    self.assertIn("127.0.0.1:1", e.message)
                self.assertEqual(rv.wait(timeout=30), kvwire.RoomState.FAILED)
                self.assertIn("127.0.0.1:1", rv.failure_reason)
            finally:
                ctx_d.close()
                ctx_b.close()
                ctx_a.close()

    def test_bootstrap_server_secret(self):
        """A BootstrapServer with a secret refuses a prefill rank without it, naming the
        cause, and takes one with it."""
        model = U.gptoss_model(U.WINDOW)
        r = U.HostRank(model, 1, 0, page_size=U.FULL_PS, swa_page_size=U.SWA_PS,
                       full_pages=U.FULL_PAGES, swa_pages=U.SWA_PAGES, seed=7)
        with kvwire.BootstrapServer(secret="alpha") as server:
            with self.assertRaises(kvwire.KvwireError) as cm:
                kvwire.Context(r.rank, kvwire.Side.PREFILL, server.address,
                               transport=TRANSPORT, bootstrap_timeout_ms=3000)
            self.assertEqual(cm.exception.status, kvwire.Status.ERR_AUTH)
            self.assertIn("requires the shared secret", cm.exception.message)
            ctx = kvwire.Context(r.rank, kvwire.Side.PREFILL, server.address,
                                 transport=TRANSPORT, secret="alpha")
            ctx.close()


if __name__ == "__main__":
    unittest.main()
