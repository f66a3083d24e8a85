"""PyTorch on GPUs: a prefill instance (TP1, KV cache as CUDA tensors on one GPU, in a
child process) sends to a decode instance (TP2, CUDA tensors on another GPU, in this
process) over the "cuda_ipc" transport; every destination tensor is compared with
torch.equal against a reference built with torch indexing from the head ownership
rule (decode rank r holds heads [4r, 4r+4) of the prefill's 8), guard regions around
every destination tensor included.

Skipped unless torch is importable, at least two CUDA GPUs are visible and the
library has the cuda_ipc transport. KVW_TORCH_PREFILL_GPU / KVW_TORCH_DECODE_GPU pick
the devices (default 0 and 1).
"""
import multiprocessing
import os
import time
import unittest

import kvtest_util as U
import kvwire

try:
    import torch
except ImportError:  # pragma: no cover - depends on the machine
    torch = None

PREFILL_GPU = int(os.environ.get("KVW_TORCH_PREFILL_GPU", "0"))
DECODE_GPU = int(os.environ.get("KVW_TORCH_DECODE_GPU", "1"))
GUARD = 4096  # bytes before and after every destination tensor
HEADS, HEAD_DIM = 8, 64
TIMEOUT = 60


def _skip_reason():
    """Only a machine without torch or without a CUDA device skips. Where both exist, a
    missing libkvwire or CUDA module is a failure of the test, not a skip."""
    if torch is None:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def _decode_gpu():
    return DECODE_GPU if torch.cuda.device_count() > DECODE_GPU else 0


def _page_shape(heads, pages):
    return (pages, U.FULL_PS, heads, HEAD_DIM)


class TorchRank:
    """A rank's K and V caches as bf16 CUDA tensors [page][token][head][dim] (NHD),
    each a view into the middle of a larger uint8 allocation whose ends are guards."""

    def __init__(self, model, tp_size, tp_rank, device, seed):
        self.tp_rank = tp_rank
        self.first_head, self.heads = U.heads_owned(tp_size, tp_rank, HEADS)
        g = torch.Generator().manual_seed(seed * 1000003 + tp_rank)
        self.planes, self.allocs, bufs = [], [], []
        for layer, l in enumerate(model.layers):
            swa = l.kind == kvwire.LayerKind.SWA
            pages = U.SWA_PAGES if swa else U.FULL_PAGES
            shape = _page_shape(self.heads, pages)
            nbytes = 2
            for s in shape:
                nbytes *= s
            for role in (kvwire.Role.K, kvwire.Role.V):
                raw = torch.randint(0, 256, (nbytes + 2 * GUARD,), dtype=torch.uint8,
                                    generator=g).to(device)
                t = raw[GUARD:GUARD + nbytes].view(torch.bfloat16).view(shape)
                self.allocs.append(raw)
                self.planes.append((layer, swa, t))
                bufs.append(kvwire.Buffer(layer, role, t, page_size=U.FULL_PS,
                                          num_heads=self.heads,
                                          head_bytes=HEAD_DIM * 2))
        self.buffers = bufs
        self.rank = kvwire.Rank(model, kvwire.Parallel(tp_size, tp_rank), bufs)


def _bits(t):
    return t.view(torch.int16)  # bf16 compared bit for bit (random bits hold NaNs)


def _unsynchronized_write(tr):
    """Zeroes the rank's KV (synchronized), then queues on the current stream a long
    sleep followed by the writes of its real contents, and returns without waiting: a
    send that does not order its reads after this stream reads zeros."""
    real = [t.clone() for _, _, t in tr.planes]
    for _, _, t in tr.planes:
        t.zero_()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU clock cycles
    for (_, _, t), r in zip(tr.planes, real):
        t.copy_(r, non_blocking=True)


def _connector_sends(tr, model, transport, conn):
    """The connector's calls on KV written without synchronizing (_unsynchronized_write):
    KVManager, then KVSender.init_tokens and send per chunk, polled to the end."""
    from kvwire.connector import KVManager, KVPoll, KVSender
    mgr = KVManager(model, kvwire.Parallel(1, 0), "prefill", "127.0.0.1:0", buffers=tr.buffers,
                    transport=transport, wait_timeout_ms=30000)
    try:
        conn.send(("addr", mgr.bootstrap_addr))
        if conn.recv() != "go":
            return
        reqs = U.make_requests()
        pages = U.prefill_pages(reqs, 0)
        _unsynchronized_write(tr)
        senders = []
        for r in reqs:
            full, swa, swa0 = pages[r["room"]]
            s = KVSender(mgr, bootstrap_room=r["room"])
            s.init_tokens(r["n"])
            for (b, e) in r["chunks"]:
                s.send(full, chunk_end=e, first_page=0, swa_pages=swa, swa_first_token=swa0)
            senders.append((r["room"], s))
        out = []
        t_end = time.monotonic() + TIMEOUT
        for room, s in senders:
            while s.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < t_end:
                time.sleep(0.001)
            st = s.poll()
            out.append((room, "SUCCESS" if st == KVPoll.Success else st.name, s.failure_reason))
        conn.send(("results", out))
        conn.recv()
        for _, s in senders:
            s.close()
    finally:
        mgr.close()


def prefill_worker_torch(conn, transport="cuda_ipc", events=False, api="core"):
    ctx = None
    try:
        torch.cuda.set_device(PREFILL_GPU)
        model = U.gptoss_model(U.WINDOW, HEADS, HEAD_DIM)
        tr = TorchRank(model, 1, 0, "cuda:%d" % PREFILL_GPU, U.PREFILL_SEED)
        torch.cuda.synchronize()
        if api == "connector":
            _connector_sends(tr, model, transport, conn)
            return
        ctx = kvwire.Context(tr.rank, "prefill", "127.0.0.1:0", transport=transport,
                             host_bootstrap=True, wait_timeout_ms=30000)
        conn.send(("addr", ctx.bootstrap_addr))
        if conn.recv() != "go":
            return
        reqs = U.make_requests()
        pages = U.prefill_pages(reqs, 0)
        senders = []
        for r in reqs:
            full, swa, swa0 = pages[r["room"]]
            s = ctx.sender(r["room"])
            for (b, e) in r["chunks"]:
                last = e == r["n"]
                if events and last:
                    # The last chunk streams: each layer is marked by a CUDA event recorded
                    # on the forward stream, and nothing here waits for the GPU.
                    s.send_streamed(r["n"], b, e, last, full, 0, swa, swa0)
                    for layer in reversed(range(model.num_layers)):
                        ev = torch.cuda.Event()
                        ev.record()
                        s.layers_ready(layer, layer + 1, event=ev)
                else:
                    s.send(r["n"], b, e, last, full, 0, swa if last else (), swa0 if last else 0)
            senders.append((r["room"], s))
        out = []
        for room, s in senders:
            st = s.wait(timeout=TIMEOUT)
            out.append((room, st.name, s.failure_reason))
        conn.send(("results", out))
        conn.recv()
        for _, s in senders:
            s.close()
    except BaseException:
        import traceback
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
    finally:
        if ctx is not None:
            ctx.close()
        conn.close()


def _reference(model, src, dst, spages, dpages, reqs):
    """Expected decode tensors: the initial ones with every moved head slice copied
    from the prefill's tensors (on the decode GPU)."""
    exp = [t.clone() for _, _, t in dst.planes]
    dev = exp[0].device
    h0, hn = dst.first_head, dst.heads
    for r in reqs:
        n, prefix = r["n"], r["prefix"]
        sfull, sswa, sswa0 = spages[r["room"]]
        dfull, dswa, dswa0 = dpages[r["room"]]
        for j, (layer, swa, _) in enumerate(dst.planes):
            if swa:
                t0, t1 = max(n - model.layers[layer].window, prefix, 0), n
                sl, sf, dl, df = sswa, sswa0, dswa, dswa0
            else:
                t0, t1 = prefix, n
                sl, sf, dl, df = sfull, 0, dfull, 0
            if t0 >= t1:
                continue
            tok = torch.arange(t0, t1)
            sp = torch.tensor(sl)[(tok - sf) // U.FULL_PS]
            dp = torch.tensor(dl)[(tok - df) // U.FULL_PS]
            si, di = (tok - sf) % U.FULL_PS, (tok - df) % U.FULL_PS
            src_t = src.planes[j][2]
            vals = src_t[sp.to(src_t.device), si.to(src_t.device), h0:h0 + hn].to(dev)
            exp[j][dp.to(dev), di.to(dev)] = vals
    return exp


class TestTorchGpu(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        reason = _skip_reason()  # probed here, not at import: spawned children import us
        if reason:
            raise unittest.SkipTest(reason)

    def test_tp1_to_tp2_cuda_tensors(self):
        """cuda_ipc: the fused kernel writes the decode GPU's tensors (two GPUs)."""
        if torch.cuda.device_count() < 2:
            self.skipTest("cuda_ipc needs 2 CUDA GPUs, torch sees %d" % torch.cuda.device_count())
        kvwire.load_library()  # a missing library fails here, it is not a skip
        self.assertTrue(kvwire.transport_available("cuda_ipc"),
                        "this libkvwire has no cuda_ipc transport")
        self._run("cuda_ipc")

    def test_tp1_to_tp2_cuda_tensors_tcp(self):
        """tcp: GPU tensors gathered into pinned host memory, across loopback TCP,
        scattered on the decode GPU (one GPU or two)."""
        kvwire.load_library()
        self._run("tcp")

    def test_tp1_to_tp2_streamed_on_cuda_events_tcp(self):
        """tcp, the last chunk of every request streamed, each layer marked by a
        torch.cuda.Event (layers_ready(event=...)), in reverse order."""
        kvwire.load_library()
        self._run("tcp", events=True)

    def test_connector_unsynchronized_writes_tcp(self):
        """kvwire.connector on KV the prefill wrote with kernels still queued on its
        stream (a long sleep ahead of them), sent at once without synchronizing: the
        decode must receive the written bytes, not the zeros there before."""
        kvwire.load_library()
        self._run("tcp", api="connector")

    def _run(self, transport, events=False, api="core"):
        model = U.gptoss_model(U.WINDOW, HEADS, HEAD_DIM)
        reqs = U.make_requests()
        mp = multiprocessing.get_context("spawn")
        conn, child = mp.Pipe()
        proc = mp.Process(target=prefill_worker_torch, args=(child, transport, events, api),
                          daemon=True)
        proc.start()
        child.close()

        def recv(what):
            self.assertTrue(conn.poll(TIMEOUT), "no %s from the prefill process" % what)
            kind, val = conn.recv()
            if kind == "error":
                self.fail("prefill process failed:\n" + val)
            self.assertEqual(kind, what)
            return val

        ctxs, rooms = [], []
        try:
            addr = recv("addr")
            torch.cuda.set_device(_decode_gpu())
            dev = "cuda:%d" % _decode_gpu()
            dsts = [TorchRank(model, 2, r, dev, U.DECODE_SEED) for r in range(2)]
            torch.cuda.synchronize()
            before = [[a.clone() for a in d.allocs] for d in dsts]
            for d in dsts:
                ctx = kvwire.Context(d.rank, "decode", addr, transport=transport, prefill_tp=1,
                                     wait_timeout_ms=30000)
                ctxs.append(ctx)
                pages = U.decode_pages(reqs, d.tp_rank)
                for r in reqs:
                    full, swa, swa0 = pages[r["room"]]
                    rv = ctx.receiver(r["room"])
                    rv.post(r["n"], r["prefix"], full, 0, swa, swa0)
                    rooms.append((r["room"], d.tp_rank, rv))
            conn.send("go")
            t_end = time.monotonic() + TIMEOUT
            for room, tpr, rv in rooms:
                while not rv.poll().terminal and time.monotonic() < t_end:
                    time.sleep(0.001)
                self.assertEqual(rv.poll(), kvwire.RoomState.SUCCESS,
                                 "room %d decode rank %d: %s" % (room, tpr, rv.failure_reason))
            for room, state, reason in recv("results"):
                self.assertEqual(state, "SUCCESS", "prefill room %d: %s" % (room, reason))
            torch.cuda.synchronize()

            # The reference needs the prefill's bytes: rebuilt here from the same seed.
            src = TorchRank(model, 1, 0, dev, U.PREFILL_SEED)
            spages = U.prefill_pages(reqs, 0)
            for d, b in zip(dsts, before):
                exp = _reference(model, src, d, spages, U.decode_pages(reqs, d.tp_rank), reqs)
                for j, (layer, _, t) in enumerate(d.planes):
                    self.assertTrue(torch.equal(_bits(t), _bits(exp[j])),
                                    "decode rank %d layer %d buffer %d differs"
                                    % (d.tp_rank, layer, j))
                    self.assertFalse(torch.equal(_bits(t), _bits(
                        b[j][GUARD:-GUARD].view(torch.bfloat16).view(t.shape))),
                        "decode rank %d buffer %d: nothing arrived" % (d.tp_rank, j))
                for j, a in enumerate(d.allocs):
                    self.assertTrue(torch.equal(a[:GUARD], b[j][:GUARD]) and
                                    torch.equal(a[-GUARD:], b[j][-GUARD:]),
                                    "decode rank %d buffer %d: guard bytes changed"
                                    % (d.tp_rank, j))
        finally:
            for _, _, rv in rooms:
                rv.close()
            for c in ctxs:
                c.close()
            try:
                conn.send("exit")
            except OSError:
                pass
            proc.join(TIMEOUT)
            if proc.is_alive():
                proc.terminate()
            conn.close()
        self.assertEqual(proc.exitcode, 0)


if __name__ == "__main__":
    unittest.main()
