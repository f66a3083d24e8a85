"""End to end: a prefill instance in a child process and a decode instance in this
process exchange KV caches over kvwire with unequal TP; every destination byte is
checked against the pure-Python reference, and the guard bytes around every
destination buffer must be untouched."""
import multiprocessing
import os
import time
import unittest

import kvtest_util as U
import kvwire

TRANSPORT = os.environ.get("KVW_PY_TRANSPORT") or None  # the library default (tcp)
STEP_TIMEOUT = 30


class _Prefill:
    """The child process running kvtest_util.prefill_worker."""

    def __init__(self, tp, api):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=U.prefill_worker,
                                args=(child, {"tp": tp, "api": api, "transport": TRANSPORT}),
                                daemon=True)
        self.proc.start()
        child.close()

    def recv(self, what):
        if not self.conn.poll(STEP_TIMEOUT):
            raise AssertionError("the prefill process sent no %s within %d s" % (what,
                                                                                  STEP_TIMEOUT))
        kind, val = self.conn.recv()
        if kind == "error":
            raise AssertionError("the prefill process failed:\n" + val)
        if kind != what:
            raise AssertionError("expected %s from the prefill process, got %s" % (what, kind))
        return val

    def send(self, msg):
        try:
            self.conn.send(msg)
        except (BrokenPipeError, OSError):
            pass

    def finish(self):
        self.send("exit")
        self.proc.join(STEP_TIMEOUT)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        self.conn.close()
        return self.proc.exitcode


class TestEndToEnd(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        U.library_or_skip()

    def run_transfer(self, ptp, dtp, api):
        model, _ = U.make_prefill_ranks(ptp)
        reqs = U.make_requests()
        pre = _Prefill(ptp, api)
        opened = []
        try:
            addr = pre.recv("addr")
            dsts = [U.HostRank(model, dtp, r, page_size=U.FULL_PS, swa_page_size=U.SWA_PS,
                               full_pages=U.FULL_PAGES, swa_pages=U.SWA_PAGES,
                               seed=U.DECODE_SEED, describe=api == "core")
                    for r in range(dtp)]
            before = [d.snapshot() for d in dsts]
            rooms = []  # (room, decode tp rank, handle)
            for d in dsts:
                pages = U.decode_pages(reqs, d.tp_rank)
                if api == "core":
                    ctx = kvwire.Context(d.rank, kvwire.Side.DECODE, addr, transport=TRANSPORT,
                                         prefill_tp=ptp, wait_timeout_ms=20000,
                                         bootstrap_timeout_ms=10000)
                    opened.append(ctx)
                    for r in reqs:
                        full, swa, swa0 = pages[r["room"]]
                        rv = ctx.receiver(r["room"])
                        rv.post(r["n"], r["prefix"], full, 0, swa, swa0)
                        rooms.append((r["room"], d.tp_rank, rv))
                else:
                    from kvwire.connector import KVManager, KVReceiver
                    mgr = KVManager(model, kvwire.Parallel(dtp, d.tp_rank), "decode", addr,
                                    buffers=d.buffers, transport=TRANSPORT, prefill_tp=ptp,
                                    wait_timeout_ms=20000, bootstrap_timeout_ms=10000)
                    opened.append(mgr)
                    for r in reqs:
                        full, swa, swa0 = pages[r["room"]]
                        rv = KVReceiver(mgr, addr, r["room"])
                        rv.init_tokens(r["n"], prefix_len=r["prefix"])
                        rv.send_metadata(full, swa_pages=swa)  # SWA start: the default
                        self.assertEqual(swa0, mgr.swa_window_start(r["n"]))
                        rooms.append((r["room"], d.tp_rank, rv))
            pre.send("go")
            t0 = time.monotonic()
            for room, tpr, rv in rooms:
                while True:
                    st = rv.poll()  # RoomState (core) or KVPoll (connector)
                    if st.name.upper() in ("SUCCESS", "FAILED"):
                        break
                    if time.monotonic() - t0 > STEP_TIMEOUT:
                        self.fail("room %d on decode rank %d still %s" % (room, tpr, st.name))
                    time.sleep(0.001)
                self.assertEqual(st.name.upper(), "SUCCESS",
                              "room %d on decode rank %d: %s" % (room, tpr, rv.failure_reason))
            if api == "core":
                for room, tpr, rv in rooms:
                    self.assertEqual(rv.metadata(), U.room_metadata(room),
                                     "room %d on decode rank %d: metadata" % (room, tpr))
            results = pre.recv("results")
            for room, tpr, state, reason, nbytes in results:
                self.assertEqual(state.upper(), "SUCCESS",
                              "prefill rank %d room %d: %s" % (tpr, room, reason))
            # Bytes: prefill metrics count what was sent, decode's what was confirmed.
            sent = sum(r[4] for r in results)
            got = sum(rv.metrics().bytes for _, _, rv in rooms)
            self.assertEqual(sent, got)

            # Every destination byte against the reference; guards included.
            _, srcs = U.make_prefill_ranks(ptp)
            src_data = [s.snapshot() for s in srcs]
            spages = [U.prefill_pages(reqs, s.tp_rank) for s in srcs]
            expect_bytes = 0
            for d, b in zip(dsts, before):
                dpages = U.decode_pages(reqs, d.tp_rank)
                expect = [bytearray(x) for x in b]
                for r in reqs:
                    U.ref_apply(model, srcs, src_data, spages, d, expect, dpages, r)
                for j, p in enumerate(d.planes):
                    diff = sum(1 for x, y in zip(b[j], expect[j]) if x != y)
                    expect_bytes += diff
                    self.assertTrue(p.mem[:U.GUARD] == b[j][:U.GUARD] and
                                    p.mem[-U.GUARD:] == b[j][-U.GUARD:],
                                    "decode rank %d buffer %d: guard bytes changed"
                                    % (d.tp_rank, j))
                    self.assertTrue(p.mem == expect[j],
                                    "decode rank %d buffer %d (layer %d %s): %s"
                                    % (d.tp_rank, j, p.layer, p.role.name,
                                       U.first_difference(p.mem, expect[j])))
            # The check means something: most of the moved bytes differ from before.
            self.assertGreater(expect_bytes, 0.9 * got)
            for _, _, rv in rooms:
                rv.close()
        finally:
            for o in opened:
                o.close()
            code = pre.finish()
        self.assertEqual(code, 0)

    def test_tp1_to_tp2(self):
        self.run_transfer(1, 2, "core")

    def test_tp2_to_tp1(self):
        self.run_transfer(2, 1, "core")

    def test_tp1_to_tp2_connector(self):
        self.run_transfer(1, 2, "connector")


if __name__ == "__main__":
    unittest.main()
