"""Shared helpers of the Python tests: host-memory ranks in bytearrays with guard
bytes, deterministic requests and page tables, and a pure-Python reference of what a
transfer must write (computed from the head ownership rule, independently of the
library), plus the prefill worker that the end-to-end tests run in a child process."""
import os
import random
import sys
import traceback
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # python/ (when PYTHONPATH is not set)

import kvwire  # noqa: E402
from kvwire import LayerKind, Pool, Role  # noqa: E402

GUARD = 64


def library_or_skip():
    try:
        kvwire.load_library()
    except kvwire.LibraryNotFound as e:
        raise unittest.SkipTest(str(e))


def gptoss_model(window=32, num_kv_heads=8, head_dim=64, layers=4):
    """gpt-oss-like: layers alternate sliding window and full attention, bf16."""
    kinds = [("swa", window) if l % 2 == 0 else "full" for l in range(layers)]
    return kvwire.Model(kinds, num_kv_heads=num_kv_heads, head_dim=head_dim, elem_size=2)


def heads_owned(tp_size, rank, num_heads):
    """The column-parallel ownership rule of DESIGN.md section 3, written out again."""
    if tp_size <= num_heads:
        assert num_heads % tp_size == 0
        per = num_heads // tp_size
        return rank * per, per
    assert tp_size % num_heads == 0
    return rank // (tp_size // num_heads), 1


class Plane:
    """One buffer of a host rank: [guard][data][guard] inside one bytearray."""

    def __init__(self, layer, role, pool, page_size, heads, head_bytes, pages, rng, guard):
        self.layer, self.role, self.pool = layer, role, pool
        self.page_size, self.heads, self.head_bytes = page_size, heads, head_bytes
        self.row = heads * head_bytes
        self.page_bytes = page_size * self.row
        self.length = pages * self.page_bytes
        self.guard = guard
        n = self.length + 2 * guard
        self.mem = bytearray(rng.getrandbits(8 * n).to_bytes(n, "little"))

    def off(self, page, in_page, local_head):
        return self.guard + page * self.page_bytes + in_page * self.row + \
            local_head * self.head_bytes


class HostRank:
    """A rank whose K and V caches (NHD) live in guarded bytearrays."""

    def __init__(self, model, tp_size, tp_rank, *, page_size=16, swa_page_size=16,
                 full_pages=64, swa_pages=32, seed=1, guard=GUARD, describe=True):
        self.model = model
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.page_size = {Pool.FULL: page_size, Pool.SWA: swa_page_size}
        self.first_head, self.heads = heads_owned(tp_size, tp_rank, model.num_kv_heads)
        rng = random.Random(seed * 1000003 + tp_rank)
        self.planes = []
        buffers = []
        for layer, l in enumerate(model.layers):
            pool = Pool.SWA if l.kind == LayerKind.SWA else Pool.FULL
            npages = swa_pages if pool == Pool.SWA else full_pages
            for role in (Role.K, Role.V):
                p = Plane(layer, role, pool, self.page_size[pool], self.heads,
                          model.head_bytes(role), npages, rng, guard)
                self.planes.append(p)
                buffers.append(kvwire.Buffer(layer, role, p.mem, offset=guard, length=p.length,
                                             page_size=p.page_size, num_heads=p.heads,
                                             head_bytes=p.head_bytes))
        self.buffers = buffers
        self.rank = kvwire.Rank(model, kvwire.Parallel(tp_size, tp_rank), buffers) \
            if describe else None

    def snapshot(self):
        return [bytearray(p.mem) for p in self.planes]


# ---------------------------------------------------------------- requests and pages

def make_requests():
    """Requests of a few shapes: tiny, one page, a cached prefix, chunked (page
    aligned and not)."""
    return [
        {"room": 11, "n": 1, "prefix": 0, "chunks": [(0, 1)]},
        {"room": 12, "n": 40, "prefix": 0, "chunks": [(0, 40)]},
        {"room": 13, "n": 100, "prefix": 20, "chunks": [(0, 100)]},
        {"room": 14, "n": 80, "prefix": 0, "chunks": [(0, 32), (32, 64), (64, 80)]},
        {"room": 15, "n": 47, "prefix": 5, "chunks": [(0, 30), (30, 47)]},
        {"room": 16, "n": 16, "prefix": 0, "chunks": [(0, 16)]},
    ]


def _pages_needed(begin, end, ps):
    return 0 if begin >= end else (end + ps - 1) // ps - begin // ps


def swa_start(n, window, ps):
    t = max(n - window, 0)
    return t // ps * ps


def assign_pages(reqs, full_ps, swa_ps, window, full_pages, swa_pages, seed):
    """{room: (full list, swa list, swa_first_token)}, disjoint across requests."""
    rng = random.Random(seed)
    fp = list(range(full_pages))
    sp = list(range(swa_pages))
    rng.shuffle(fp)
    rng.shuffle(sp)
    out = {}
    for r in reqs:
        n = r["n"]
        nf = _pages_needed(0, n, full_ps)
        s0 = swa_start(n, window, swa_ps)
        ns = _pages_needed(s0, n, swa_ps)
        if nf > len(fp) or ns > len(sp):
            raise ValueError("pools too small for the test requests")
        out[r["room"]] = (fp[:nf], sp[:ns], s0)
        del fp[:nf], sp[:ns]
    return out


# ---------------------------------------------------------------- reference

def ref_apply(model, srcs, src_data, src_pages, dst, expect, dst_pages, req):
    """Writes into `expect` (dst's planes) what request `req` must deliver.

    srcs: the prefill HostRanks (one TP group, ranks in order); src_data: their
    bytes; *_pages: {room: (full, swa, swa_first)} of each side (src_pages per source
    rank index)."""
    H = model.num_kv_heads
    S = srcs[0].tp_size
    if S > H:
        raise NotImplementedError("reference covers source TP <= heads")
    per_src = H // S
    n, prefix = req["n"], req["prefix"]
    dfull, dswa, dswa0 = dst_pages[req["room"]]
    for j, dp in enumerate(dst.planes):
        kind = model.layers[dp.layer].kind
        if kind == LayerKind.FULL:
            t0, t1 = prefix, n
            dlist, dfirst = dfull, 0
        else:
            w = model.layers[dp.layer].window
            t0, t1 = max(n - w, prefix, 0), n
            dlist, dfirst = dswa, dswa0
        for t in range(t0, t1):
            dpage = dlist[(t - dfirst) // dp.page_size]
            din = (t - dfirst) % dp.page_size
            g = dst.first_head
            while g < dst.first_head + dst.heads:
                s = g // per_src
                run = min(dst.first_head + dst.heads, (s + 1) * per_src) - g
                src = srcs[s]
                sp = src.planes[j]
                sfull, sswa, sswa0 = src_pages[s][req["room"]]
                slist, sfirst = (sfull, 0) if kind == LayerKind.FULL else (sswa, sswa0)
                spage = slist[(t - sfirst) // sp.page_size]
                sin = (t - sfirst) % sp.page_size
                so = sp.off(spage, sin, g - s * per_src)
                do = dp.off(dpage, din, g - dst.first_head)
                nb = run * dp.head_bytes
                expect[j][do:do + nb] = src_data[s][j][so:so + nb]
                g += run


def first_difference(a, b):
    if len(a) != len(b):
        return "lengths %d and %d" % (len(a), len(b))
    for i in range(len(a)):
        if a[i] != b[i]:
            return "byte %d: got %d, expected %d" % (i, a[i], b[i])
    return None


# ---------------------------------------------------------------- prefill worker

FULL_PS, SWA_PS, WINDOW = 16, 16, 32
FULL_PAGES, SWA_PAGES = 40, 24
PREFILL_SEED, DECODE_SEED = 7, 13


def prefill_pages(reqs, tp_rank):
    return assign_pages(reqs, FULL_PS, SWA_PS, WINDOW, FULL_PAGES, SWA_PAGES, 31 + tp_rank)


def decode_pages(reqs, tp_rank):
    return assign_pages(reqs, FULL_PS, SWA_PS, WINDOW, FULL_PAGES, SWA_PAGES, 37 + tp_rank)


def make_prefill_ranks(tp):
    m = gptoss_model(WINDOW)
    return m, [HostRank(m, tp, r, page_size=FULL_PS, swa_page_size=SWA_PS, full_pages=FULL_PAGES,
                        swa_pages=SWA_PAGES, seed=PREFILL_SEED) for r in range(tp)]


def room_metadata(room):
    """The per-room metadata the core-API prefill attaches: 5000 bytes (more than one
    transport notification holds), derived from the room id."""
    return bytes((room * 131 + i * 7) & 0xFF for i in range(5000))


def prefill_worker(conn, cfg):
    """Runs a prefill instance (TP cfg["tp"]) in this process: hosts the bootstrap,
    reports its address, sends every request when told, reports each room's end."""
    objs = []
    try:
        model, ranks = make_prefill_ranks(cfg["tp"])
        reqs = make_requests()
        api = cfg.get("api", "core")
        addr = "127.0.0.1:0"
        ctxs = []
        for hr in ranks:
            if api == "core":
                c = kvwire.Context(hr.rank, "prefill", addr, transport=cfg.get("transport"),
                                   host_bootstrap=hr.tp_rank == 0, wait_timeout_ms=20000,
                                   bootstrap_timeout_ms=10000)
            else:
                from kvwire.connector import KVManager
                c = KVManager(model, kvwire.Parallel(hr.tp_size, hr.tp_rank), "prefill", addr,
                              buffers=hr.buffers, transport=cfg.get("transport"),
                              wait_timeout_ms=20000, bootstrap_timeout_ms=10000)
            ctxs.append(c)
            addr = c.bootstrap_addr
        objs = ctxs
        conn.send(("addr", addr))
        msg = conn.recv()
        if msg != "go":
            return
        rooms = []
        for k, hr in enumerate(ranks):
            pages = prefill_pages(reqs, hr.tp_rank)
            for r in reqs:
                full, swa, swa0 = pages[r["room"]]
                if api == "core":
                    s = ctxs[k].sender(r["room"])
                    # Every prefill rank attaches the same per-room metadata.
                    s.set_metadata(room_metadata(r["room"]))
                    for (b, e) in r["chunks"]:
                        last = e == r["n"]
                        fp = b // FULL_PS
                        s.send(r["n"], b, e, last, full[fp:_pages_needed(0, e, FULL_PS)],
                               fp * FULL_PS, swa if last else (), swa0 if last else 0, -1)
                else:
                    from kvwire.connector import KVSender
                    s = KVSender(ctxs[k], bootstrap_addr=addr, bootstrap_room=r["room"])
                    s.init_tokens(r["n"])
                    for (b, e) in r["chunks"]:
                        fp = b // FULL_PS
                        s.send(full[fp:_pages_needed(0, e, FULL_PS)], chunk_end=e,
                               swa_pages=swa if e == r["n"] else None)
                rooms.append((r["room"], hr.tp_rank, s))
        results = []
        for room, tpr, s in rooms:
            if api == "core":
                st = s.wait(timeout=30)
                results.append((room, tpr, st.name, s.failure_reason, s.metrics().bytes))
            else:
                import time
                from kvwire.connector import KVPoll
                t_end = time.monotonic() + 30
                while s.poll() not in (KVPoll.Success, KVPoll.Failed) and \
                        time.monotonic() < t_end:
                    time.sleep(0.001)
                results.append((room, tpr, s.poll().name, s.failure_reason, s.metrics().bytes))
        conn.send(("results", results))
        conn.recv()  # "exit": the decode side has verified
        for _, _, s in rooms:
            s.close()
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
    finally:
        for c in objs:
            c.close()
        conn.close()
