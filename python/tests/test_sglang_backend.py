"""The SGLang backend (kvwire.sglang) driven the way SGLang's schedulers drive a
transfer backend: the prefill bootstrap queue (poll until WaitingForInput, then init),
the prefill forward with chunked prefill and the inflight queue, the decode prealloc
queue (init, poll until WaitingForInput, send_metadata) and the decode transfer queue
(poll until Success), with polls reduced over the TP ranks by their minimum as SGLang
does. Two prefill instances (TP1 and TP2, each with its own KVBootstrapServer) feed one
decode instance (TP2); some requests are aborted on either side. Host buffers are
handed over as raw pointers in SGLang's flat KVArgs lists. Every decode byte is
checked against kvtest_util's reference, guard bytes included, and so is the aux
data."""
import ctypes
import os
import sys
import time
import types
import unittest
from unittest import mock

import kvtest_util as U
from order_standins import Event, Room, fake_torch
import kvwire
from kvwire.sglang import (KVArgs, KVBootstrapServer, KVManager, KVPoll, KVReceiver, KVSender,
                           KVTransferError, StateType)

TRANSPORT = os.environ.get("KVW_PY_TRANSPORT") or None
PS, WINDOW = 16, 32
FULL_PAGES, SWA_PAGES = 48, 32
AUX_SLOTS, AUX_ITEMS = 8, (64, 200)   # output ids, hidden states: bytes per slot
DEADLINE = 60


def model_config(kinds):
    """An SGLang-like model config: HF layer_types and sliding_window."""
    names = {"full": "full_attention", "swa": "sliding_attention"}
    return types.SimpleNamespace(num_hidden_layers=len(kinds),
                                 layer_types=[names[k] for k in kinds], sliding_window=WINDOW,
                                 num_key_value_heads=8, head_dim=64)


def server_args(tp, bootstrap_port=None, port=30000):
    return types.SimpleNamespace(tp_size=tp, dp_size=1, pp_size=1, enable_dp_attention=False,
                                 host="127.0.0.1", port=port,
                                 disaggregation_bootstrap_port=bootstrap_port)


class SglRank:
    """One engine rank: a guarded kvtest_util.HostRank plus guarded aux buffers,
    described to the backend only through SGLang's flat pointer lists."""

    def __init__(self, model, tp, rank, seed, kinds, swa_pool=True, host_rank=None,
                 stage=None, mla=False, aux_items=AUX_ITEMS):
        """stage: (pp_rank, first layer, end layer or None) of a PP stage whose
        buffers are those layers of host_rank (shared by the stages). mla: the K
        planes (of a one-head model) are the latent buffers; the V planes stay out."""
        self.hr = host_rank or U.HostRank(model, tp, rank, page_size=PS, swa_page_size=PS,
                                          full_pages=FULL_PAGES + 1, swa_pages=SWA_PAGES + 1,
                                          seed=seed, describe=False)
        self._keep = []
        planes = self.hr.planes
        if stage is not None:
            pp_rank, first, end = stage
            planes = [p for p in planes if first <= p.layer < (end or model.num_layers)]
        full = [p for p in planes if not (swa_pool and p.pool == kvwire.Pool.SWA)]
        swa = [p for p in planes if swa_pool and p.pool == kvwire.Pool.SWA]

        def flat(ps):
            ks = [p for p in ps if p.role == kvwire.Role.K]
            vs = [p for p in ps if p.role == kvwire.Role.V]
            ordered = ks if mla else ks + vs
            return ([self.addr(p.mem) + p.guard for p in ordered],
                    [p.length for p in ordered], [p.page_bytes for p in ordered])

        a = KVArgs()
        a.engine_rank, a.page_size = rank, PS
        if not mla:
            a.kv_head_num, a.total_kv_head_num = self.hr.heads, model.num_kv_heads
        a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = flat(full)
        if swa:
            a.state_types = [StateType.SWA]
            p, l, i = flat(swa)
            a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [p], [l], [i]
        self.aux_items = aux_items
        self.aux = [bytearray(os.urandom(AUX_SLOTS * item + 2 * U.GUARD)) for item in aux_items]
        a.aux_data_ptrs = [self.addr(b) + U.GUARD for b in self.aux]
        a.aux_data_lens = [AUX_SLOTS * item for item in aux_items]
        a.aux_item_lens = list(aux_items)
        if stage is not None:
            a.pp_rank, a.prefill_start_layer, a.prefill_end_layer = stage
        self.args = a

    def addr(self, mem):
        c = (ctypes.c_ubyte * len(mem)).from_buffer(mem)
        self._keep.append(c)
        return ctypes.addressof(c)

    def set_aux(self, slot, data):
        """What SGLang's MetadataBuffers.set_buf does before the last chunk."""
        pos = 0
        for buf, item in zip(self.aux, self.aux_items):
            o = U.GUARD + slot * item
            buf[o:o + item] = data[pos:pos + item]
            pos += item

    def get_aux(self, slot):
        return b"".join(bytes(buf[U.GUARD + slot * item:U.GUARD + (slot + 1) * item])
                        for buf, item in zip(self.aux, self.aux_items))


def aux_payload(room):
    return bytes((room * 29 + i * 13) & 0xFF for i in range(sum(AUX_ITEMS)))


def reduce_min(polls):
    """poll_and_all_reduce: the minimum over the ranks (Failed = 0 wins)."""
    return KVPoll(min(int(p) for p in polls))


class Instance:
    """A prefill instance: its bootstrap server and one KVManager per rank (TP ranks,
    or the PP stages of one TP rank when pp_stages is given). srcs: the HostRanks
    of its TP group, for the reference."""

    def __init__(self, name, tp, seed, kinds, model, pp_stages=None, mla=False, dp=1):
        """dp > 1: DP attention, dp groups of tp ranks (server tp_size = tp * dp)."""
        self.name, self.tp, self.dp = name, tp, dp
        self.server = KVBootstrapServer("127.0.0.1", 0)
        self.addr = self.server.address
        if dp > 1:
            self.ranks = []
            for g in range(dp):
                for r in range(tp):
                    sr = SglRank(model, tp, r, seed + 7 * g, kinds)
                    sr.args.engine_rank = g * tp + r     # SGLang: the global TP rank
                    sr.args.system_dp_rank = g
                    self.ranks.append(sr)
            sa = server_args(tp * dp, self.server.port)
            sa.dp_size, sa.enable_dp_attention = dp, True
        elif pp_stages is None:
            self.ranks = [SglRank(model, tp, r, seed, kinds, mla=mla) for r in range(tp)]
            sa = server_args(tp, self.server.port)
        else:
            assert tp == 1
            hr = U.HostRank(model, 1, 0, page_size=PS, swa_page_size=PS,
                            full_pages=FULL_PAGES + 1, swa_pages=SWA_PAGES + 1, seed=seed,
                            describe=False)
            self.ranks = [SglRank(model, 1, 0, seed, kinds, host_rank=hr, stage=st)
                          for st in pp_stages]
            sa = server_args(1, self.server.port)
            sa.pp_size = len(pp_stages)
        self.srcs = [self.ranks[0].hr] if pp_stages else [r.hr for r in self.ranks]
        if mla:
            # Every TP rank holds the same latent cache, as in an MLA engine.
            for r in self.ranks[1:]:
                for p, p0 in zip(r.hr.planes, self.ranks[0].hr.planes):
                    p.mem[:] = p0.mem
            # The reference's view: one TP1 rank holding that cache.
            ref = U.HostRank(model, 1, 0, page_size=PS, swa_page_size=PS,
                             full_pages=FULL_PAGES + 1, swa_pages=SWA_PAGES + 1, describe=False)
            for p, p0 in zip(ref.planes, self.ranks[0].hr.planes):
                p.mem[:] = p0.mem
            self.srcs, self.tp = [ref], 1
        self.mgrs = []
        for r in self.ranks:
            self.mgrs.append(KVManager(r.args, "prefill", sa, mla,
                                       model_config=model_config(kinds),
                                       transport=TRANSPORT, wait_timeout_ms=30000))

    def group(self, dp_rank):
        """The ranks (SglRank, KVManager) of DP group dp_rank."""
        k = dp_rank * self.tp if self.dp > 1 else 0
        n = self.tp if self.dp > 1 else len(self.ranks)
        return self.ranks[k:k + n], self.mgrs[k:k + n]

    def group_srcs(self, dp_rank):
        if self.dp == 1:
            return self.srcs
        return [r.hr for r in self.group(dp_rank)[0]]

    def close(self):
        for m in self.mgrs:
            m.close()
        self.server.close()


def req_pages(reqs, seed):
    """{room: (full pages from token 0, swa pages, swa first token)}, SGLang's SWA rule;
    page 0 of every pool is left out, as SGLang's allocators leave out their padding
    page (kvwire.sglang may write the SWA pool's: see KVManager.swa_side)."""
    out = U.assign_pages(reqs, PS, PS, WINDOW, FULL_PAGES, SWA_PAGES, seed)
    return {room: ([p + 1 for p in f], [p + 1 for p in w], w0)
            for room, (f, w, w0) in out.items()}


def whole_pages(model, req, swa_first):
    """The model and request the reference applies for what kvwire.sglang moves: whole
    pages (N = pages x PS tokens) and, for sliding-window layers, every listed SWA page
    (the window reaching back to the list's first token)."""
    n = -(-req["n"] // PS) * PS
    layers = [kvwire.Layer(l.kind, n - swa_first if l.kind == kvwire.LayerKind.SWA else l.window)
              for l in model.layers]
    return types.SimpleNamespace(num_kv_heads=model.num_kv_heads, layers=layers), dict(req, n=n)


class TestSGLangBackend(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        U.library_or_skip()

    def test_two_prefill_instances_one_decode_instance(self):
        kinds = ["swa", "full", "swa", "full"]
        model = U.gptoss_model(WINDOW)
        inst = {"A": self.instance("A", 1, 101, kinds, model),
                "B": self.instance("B", 2, 202, kinds, model)}
        # owner, chunk ends (every one but the last page aligned, as SGLang sends them)
        reqs = [
            {"room": 201, "n": 1, "prefix": 0, "chunks": [1], "owner": "A"},
            {"room": 202, "n": 40, "prefix": 0, "chunks": [16, 40], "owner": "B"},
            {"room": 203, "n": 100, "prefix": 16, "chunks": [32, 64, 100], "owner": "A"},
            {"room": 204, "n": 80, "prefix": 0, "chunks": [80], "owner": "B"},
            {"room": 205, "n": 47, "prefix": 32, "chunks": [47], "owner": "A"},
            {"room": 206, "n": 64, "prefix": 0, "chunks": [48, 64], "owner": "B"},
            {"room": 207, "n": 50, "prefix": 0, "chunks": [50], "owner": "A",
             "abort": "decode"},
            {"room": 208, "n": 70, "prefix": 0, "chunks": [32, 70], "owner": "B",
             "abort": "prefill"},
        ]
        self.drive(model, kinds, reqs, inst, decode_tp=2)

    def test_pp2_prefill_instance(self):
        # One TP1 prefill instance in two PP stages (uneven: layers [0, 1) and [1, 4);
        # the second stage's end is left for the backend to infer from its buffers),
        # one TP2 decode instance.
        kinds = ["swa", "full", "swa", "full"]
        model = U.gptoss_model(WINDOW)
        inst = {"P": self.instance("P", 1, 303, kinds, model,
                                   pp_stages=[(0, 0, 1), (1, 1, None)])}
        reqs = [
            {"room": 601, "n": 90, "prefix": 0, "chunks": [32, 90], "owner": "P"},
            {"room": 602, "n": 17, "prefix": 16, "chunks": [17], "owner": "P"},
            {"room": 603, "n": 64, "prefix": 0, "chunks": [64], "owner": "P"},
        ]
        self.assertEqual(inst["P"].mgrs[1].parallel.layer_end, 4)
        self.drive(model, kinds, reqs, inst, decode_tp=2)

    def test_dp_attention_prefill_instance(self):
        # A prefill instance with DP attention (2 groups of TP2; SGLang routes a room
        # to group room % dp) and a TP1 prefill instance feed one TP1 decode instance;
        # receivers name the group per room.
        kinds = ["swa", "full", "swa", "full"]
        model = U.gptoss_model(WINDOW)
        inst = {"D": self.instance("D", 2, 606, kinds, model, dp=2),
                "A": self.instance("A", 1, 707, kinds, model)}
        reqs = [{"room": room, "n": n, "prefix": 0, "chunks": ch, "owner": "D",
                 "dp": room % 2} for room, n, ch in ((800, 45, [16, 45]), (801, 33, [33]),
                                                     (802, 96, [64, 96]), (803, 8, [8]))]
        reqs.append({"room": 804, "n": 60, "prefix": 16, "chunks": [60], "owner": "A"})
        self.assertEqual(inst["D"].mgrs[3].parallel.dp_rank, 1)
        self.drive(model, kinds, reqs, inst, decode_tp=1)

    def test_mla_tp1_and_tp2_to_tp2(self):
        # MLA: every decode rank receives whole latent rows from one prefill rank.
        kinds = ["full", "full", "full"]
        model = kvwire.Model(kinds, num_kv_heads=1, head_dim=144, elem_size=2)
        inst = {"A": self.instance("A", 1, 404, kinds, model, mla=True),
                "B": self.instance("B", 2, 505, kinds, model, mla=True)}
        reqs = [
            {"room": 701, "n": 33, "prefix": 0, "chunks": [16, 33], "owner": "A"},
            {"room": 702, "n": 64, "prefix": 32, "chunks": [64], "owner": "B"},
            {"room": 703, "n": 5, "prefix": 0, "chunks": [5], "owner": "B"},
        ]
        self.assertEqual(inst["A"].mgrs[0].model.kinds, [kvwire.LayerKind.MLA] * 3)
        self.drive(model, kinds, reqs, inst, decode_tp=2, mla=True)

    def instance(self, *args, **kw):
        i = Instance(*args, **kw)
        self.addCleanup(i.close)
        return i

    def drive(self, model, kinds, reqs, inst, decode_tp, mla=False):
        """Runs the requests through both schedulers' queues and checks everything."""
        for r in reqs:
            r["chunks"] = [(0 if i == 0 else r["chunks"][i - 1], e)
                           for i, e in enumerate(r["chunks"])]
        by_room = {r["room"]: r for r in reqs}

        def states(swa_pages):
            """state_indices as SGLang builds them: one entry per state type."""
            return [swa_pages] if "swa" in kinds else []
        dranks = [SglRank(model, decode_tp, r, U.DECODE_SEED, kinds, mla=mla)
                  for r in range(decode_tp)]
        dmgrs = []
        # The decode ranks verify every room's KV end to end (KVWIRE_SGLANG_VERIFY).
        os.environ["KVWIRE_SGLANG_VERIFY"] = "every"
        try:
            for d in dranks:
                dmgrs.append(KVManager(d.args, "decode", server_args(decode_tp, port=31000),
                                       mla, model_config=model_config(kinds),
                                       transport=TRANSPORT,
                                       wait_timeout_ms=30000))
            os.environ.pop("KVWIRE_SGLANG_VERIFY", None)
            spages = req_pages(reqs, 31)    # every rank of an instance shares its page table
            dpages = req_pages(reqs, 37)
            before = [d.hr.snapshot() for d in dranks]
            daux_before = [[bytes(b) for b in d.aux] for d in dranks]
            p_aux = {r["room"]: r["room"] % AUX_SLOTS for r in reqs}
            d_aux = {r["room"]: (r["room"] * 3 + 1) % AUX_SLOTS for r in reqs}
            self.assertEqual(len(set(d_aux.values())), len(reqs))

            # Both schedulers create their per-request objects on arrival.
            p_boot, d_prealloc, d_rooms = [], [], {}
            for r in reqs:
                i = inst[r["owner"]]
                g = r.get("dp", 0)
                ss = [KVSender(m, i.addr, r["room"], [k], 0)
                      for k, m in enumerate(i.group(g)[1])]
                self.assertEqual(reduce_min(s.poll() for s in ss), KVPoll.Bootstrapping)
                p_boot.append((r, ss))
                rvs = [KVReceiver(m, i.addr, r["room"]) for m in dmgrs]
                self.assertEqual(reduce_min(rv.poll() for rv in rvs), KVPoll.Bootstrapping)
                for rv in rvs:
                    rv.init(g)          # the scheduler's fast path (dp rank known)
                d_prealloc.append((r, rvs))
                d_rooms[r["room"]] = rvs
            p_wait, p_inflight, d_transfer = [], [], []
            p_done, d_done = {}, {}
            t_end = time.monotonic() + DEADLINE
            while len(p_done) < len(reqs) or len(d_done) < len(reqs):
                self.assertLess(time.monotonic(), t_end, "prefill %s decode %s" % (
                    sorted(p_done), sorted(d_done)))
                # -- decode prealloc queue: once WaitingForInput, allocate and send metadata
                keep = []
                for r, rvs in d_prealloc:
                    st = reduce_min(rv.poll() for rv in rvs)
                    if st == KVPoll.Bootstrapping:
                        keep.append((r, rvs))
                        continue
                    self.assertEqual(st, KVPoll.WaitingForInput, r["room"])
                    full, swa, _ = dpages[r["room"]]
                    for rv in rvs:
                        rv.send_metadata(full[r["prefix"] // PS:], d_aux[r["room"]], states(swa),
                                         decode_prefix_len=r["prefix"])
                    d_transfer.append((r, rvs))
                d_prealloc = keep
                # -- prefill bootstrap queue: once the decode is ready, init (page count)
                keep = []
                for r, ss in p_boot:
                    st = reduce_min(s.poll() for s in ss)
                    if st == KVPoll.Bootstrapping:
                        keep.append((r, ss))
                        continue
                    if st == KVPoll.Failed:
                        p_done[r["room"]] = (st, ss)
                        continue
                    for s in ss:
                        s.init(-(-r["n"] // PS), p_aux[r["room"]])
                    if r.get("abort") == "decode":
                        # The client cancels on the decode side while the prefill has
                        # the request queued (its pages have reached the prefill).
                        for rv in d_rooms[r["room"]]:
                            rv.abort()
                    p_wait.append([r, ss, 0])
                p_boot = keep
                # -- prefill forward: one chunk per request and step; the last one with
                #    the aux data (set_buf) and the SWA pages, then to the inflight queue
                keep = []
                for item in p_wait:
                    r, ss, k = item
                    b, e = r["chunks"][k]
                    last = k == len(r["chunks"]) - 1
                    full, swa, _ = spages[r["room"]]
                    pages = full[b // PS:-(-e // PS)]
                    if last:
                        for pr in inst[r["owner"]].group(r.get("dp", 0))[0]:
                            pr.set_aux(p_aux[r["room"]], aux_payload(r["room"]))
                    for s in ss:
                        if s.should_send_kv_chunk(len(pages), last):
                            s.send(pages, states(swa) if last else None)
                    if r.get("abort") == "prefill" and k == 0:
                        for s in ss:
                            s.abort()
                    if last:
                        p_inflight.append((r, ss))
                    else:
                        item[2] += 1
                        keep.append(item)
                p_wait = keep
                # -- prefill inflight queue
                keep = []
                for r, ss in p_inflight:
                    st = reduce_min(s.poll() for s in ss)
                    if st in (KVPoll.Success, KVPoll.Failed):
                        p_done[r["room"]] = (st, ss)
                        if st == KVPoll.Success:
                            for s in ss:
                                s.clear()
                    else:
                        keep.append((r, ss))
                p_inflight = keep
                # -- decode transfer queue
                keep = []
                for r, rvs in d_transfer:
                    st = reduce_min(rv.poll() for rv in rvs)
                    if st in (KVPoll.Success, KVPoll.Failed):
                        d_done[r["room"]] = (st, rvs)
                    else:
                        keep.append((r, rvs))
                d_transfer = keep
                time.sleep(0.001)   # a scheduler step; nothing waits on it

            # Outcomes: aborted rooms fail on both sides with a reason, the others succeed.
            for room, (st, rvs) in d_done.items():
                r = by_room[room]
                if r.get("abort"):
                    self.assertEqual(st, KVPoll.Failed, room)
                    with self.assertRaises(KVTransferError) as cm:
                        rvs[0].failure_exception()
                    self.assertIn(inst[r["owner"]].addr, str(cm.exception))
                    self.assertTrue(cm.exception.failure_reason)
                else:
                    msg = ""
                    if st == KVPoll.Failed:
                        try:
                            rvs[0].failure_exception()
                        except KVTransferError as e:
                            msg = str(e)
                    self.assertEqual(st, KVPoll.Success, "room %d: %s" % (room, msg))
                    self.assertGreater(rvs[0].get_transfer_metric().transfer_total_bytes, 0)
            # The managers' counters agree with what the scheduler saw (every decode
            # rank takes part in every room) and render as Prometheus text.
            ok = sum(1 for st, _ in d_done.values() if st == KVPoll.Success)
            for m in dmgrs:
                mt = m.metrics()
                self.assertEqual(mt["rooms_finished"]["success"], ok, mt)
                self.assertEqual(mt["verify"]["verified"], ok, mt)
                self.assertEqual(mt["verify"]["failed"], 0, mt)
                self.assertGreaterEqual(mt["rooms_finished"]["failed"], len(d_done) - ok, mt)
                text = m.prometheus_text({"instance": "d0"})
                self.assertIn('side="decode"', text)
                self.assertIn('instance="d0"', text)
            for room, (st, ss) in p_done.items():
                expect = KVPoll.Failed if by_room[room].get("abort") else KVPoll.Success
                self.assertEqual(st, expect, room)
                if st == KVPoll.Failed:
                    with self.assertRaises(KVTransferError) as cm:
                        ss[0].failure_exception()
                    self.assertIn(inst[by_room[room]["owner"]].addr, str(cm.exception))
                else:   # cleared already: the metric survives clear(), as SGLang needs
                    self.assertGreater(ss[0].get_transfer_metric().transfer_total_bytes, 0)
            # A cleared sender keeps its final state.
            ok = [room for room in p_done if not by_room[room].get("abort")]
            self.assertEqual(p_done[ok[0]][1][0].poll(), KVPoll.Success)

            # Aux data: written at the decode's own slot, nothing else touched.
            for k, d in enumerate(dranks):
                for r in reqs:
                    if not r.get("abort"):
                        self.assertEqual(d.get_aux(d_aux[r["room"]]), aux_payload(r["room"]),
                                         "decode rank %d room %d aux" % (k, r["room"]))
                for j, (buf, item) in enumerate(zip(d.aux, AUX_ITEMS)):
                    exp = bytearray(daux_before[k][j])
                    for r in reqs:
                        if not r.get("abort"):
                            o = U.GUARD + d_aux[r["room"]] * item
                            exp[o:o + item] = bytes(buf[o:o + item])
                    self.assertEqual(bytes(buf), bytes(exp), "aux buffer %d changed elsewhere" % j)

            # Every KV byte against the reference.
            moved = 0
            for k, d in enumerate(dranks):
                snap = [bytes(p.mem) for p in d.hr.planes]
                expect = [bytearray(x) for x in before[k]]
                for r in reqs:
                    if r.get("abort"):
                        # An aborted room may leave any bytes in its own pages only.
                        full, swa, _ = dpages[r["room"]]
                        for j, p in enumerate(d.hr.planes):
                            lst = swa if p.pool == kvwire.Pool.SWA else full
                            for pg in lst:
                                o = p.guard + pg * p.page_bytes
                                expect[j][o:o + p.page_bytes] = snap[j][o:o + p.page_bytes]
                        continue
                    i = inst[r["owner"]]
                    srcs = i.group_srcs(r.get("dp", 0))
                    m_ref, r_ref = whole_pages(model, r, dpages[r["room"]][2])
                    U.ref_apply(m_ref, srcs, [s.snapshot() for s in srcs],
                                [spages] * len(srcs), d.hr, expect, dpages, r_ref)
                for j, p in enumerate(d.hr.planes):
                    # Page 0 of the SWA pool, the padding page, takes the window's
                    # spill-over (KVManager.swa_side); every other pool's stays as it was.
                    if p.pool == kvwire.Pool.SWA:
                        expect[j][p.guard:p.guard + p.page_bytes] = \
                            snap[j][p.guard:p.guard + p.page_bytes]
                if mla:
                    # MLA: whole latent rows (the K planes of a one-head model, so the
                    # reference's rule applies); the V planes are no buffers at all.
                    for j, p in enumerate(d.hr.planes):
                        if p.role == kvwire.Role.V:
                            expect[j] = bytearray(before[k][j])
                for j, p in enumerate(d.hr.planes):
                    self.assertEqual(snap[j][:U.GUARD], before[k][j][:U.GUARD])
                    self.assertEqual(snap[j][-U.GUARD:], before[k][j][-U.GUARD:])
                    self.assertTrue(snap[j] == expect[j], "decode rank %d buffer %d (layer %d %s): "
                                    "%s" % (k, j, p.layer, p.role.name,
                                            U.first_difference(snap[j], expect[j])))
                    moved += sum(1 for x, y in zip(before[k][j], expect[j]) if x != y)
            self.assertGreater(moved, 10000)   # the check compared real transfers
            for _, (_, rvs) in d_done.items():
                for rv in rvs:
                    rv.clear()
        finally:
            os.environ.pop("KVWIRE_SGLANG_VERIFY", None)
            for m in dmgrs:
                m.close()


class TestSGLangBackendUnits(unittest.TestCase):
    """Token counts, whole pages, geometry checks and errors an engine can act on."""

    @classmethod
    def setUpClass(cls):
        U.library_or_skip()

    def test_interface_matches_sglang(self):
        """Positional parameters, in order, as SGLang's base classes declare them
        (sglang.srt.disaggregation.base.conn); extensions are keyword-only."""
        import inspect

        def positional(f):
            return [p.name for p in inspect.signature(f).parameters.values()
                    if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD][1:]

        def keyword_only(f):
            return [p.name for p in inspect.signature(f).parameters.values()
                    if p.kind == inspect.Parameter.KEYWORD_ONLY]
        self.assertEqual(positional(KVManager.__init__),
                         ["args", "disaggregation_mode", "server_args", "is_mla_backend"])
        self.assertEqual(positional(KVSender.__init__),
                         ["mgr", "bootstrap_addr", "bootstrap_room", "dest_tp_ranks", "pp_rank",
                          "req_has_disagg_prefill_dp_rank"])
        self.assertEqual(positional(KVSender.init), ["num_kv_indices", "aux_index"])
        self.assertEqual(keyword_only(KVSender.init), [])
        self.assertEqual(positional(KVSender.send),
                         ["kv_indices", "state_indices", "token_position_offset"])
        self.assertEqual(positional(KVReceiver.__init__),
                         ["mgr", "bootstrap_addr", "bootstrap_room", "prefill_dp_rank"])
        self.assertEqual(positional(KVReceiver.init), ["prefill_dp_rank"])
        self.assertEqual(positional(KVReceiver.send_metadata),
                         ["kv_indices", "aux_index", "state_indices", "decode_prefix_len"])
        self.assertEqual(keyword_only(KVReceiver.send_metadata), [])
        self.assertEqual(positional(KVBootstrapServer.__init__), ["host", "port"])
        for cls in (KVSender, KVReceiver):
            for m in ("poll", "failure_exception", "abort", "clear", "get_transfer_metric"):
                self.assertEqual(positional(getattr(cls, m)), [], m)
        self.assertEqual([(k.name, int(k)) for k in KVPoll],
                         [("Failed", 0), ("Bootstrapping", 1), ("WaitingForInput", 2),
                          ("Transferring", 3), ("Success", 4)])
        self.assertEqual(StateType.SWA.value, "swa")
        self.assertEqual(StateType.MAMBA.value, "mamba")

    def test_whole_pages_without_token_hint(self):
        # No sliding-window pool: SGLang's page counts are enough; a 40-token request
        # moves its 3 whole pages (tokens [0, 48)), as SGLang's other backends do.
        kinds = ["full", "full"]
        model = kvwire.Model(["full", "full"], num_kv_heads=8, head_dim=64, elem_size=2)
        with KVBootstrapServer("127.0.0.1", 0) as server:
            p = SglRank(model, 1, 0, 5, kinds)
            d = SglRank(model, 1, 0, 6, kinds)
            pm = KVManager(p.args, "prefill", server_args(1, server.port),
                           model_config=model_config(kinds), transport=TRANSPORT)
            dm = KVManager(d.args, "decode", server_args(1), model_config=model_config(kinds),
                           transport=TRANSPORT)
            try:
                before = d.hr.snapshot()
                req = {"room": 301, "n": 40, "prefix": 0}
                sp = req_pages([req], 1)
                dp = req_pages([req], 2)
                rv = KVReceiver(dm, server.address, 301)
                rv.init(0)
                rv.send_metadata(dp[301][0], 3)
                s = KVSender(pm, server.address, 301, [0], 0)
                t_end = time.monotonic() + DEADLINE
                while s.poll() == KVPoll.Bootstrapping:
                    self.assertLess(time.monotonic(), t_end)
                    time.sleep(0.001)
                s.init(3, 1)
                self.assertEqual(s.num_tokens, 48)
                p.set_aux(1, aux_payload(301))
                s.send(sp[301][0])
                while rv.poll() not in (KVPoll.Success, KVPoll.Failed):
                    self.assertLess(time.monotonic(), t_end)
                    time.sleep(0.001)
                self.assertEqual(rv.poll(), KVPoll.Success)
                self.assertEqual(d.get_aux(3), aux_payload(301))
                expect = [bytearray(x) for x in before]
                U.ref_apply(model, [p.hr], [p.hr.snapshot()], [sp], d.hr, expect, dp,
                            dict(req, n=48))
                for j, pl in enumerate(d.hr.planes):
                    self.assertTrue(pl.mem == expect[j], U.first_difference(pl.mem, expect[j]))
                self.assertNotEqual([bytes(x) for x in before], [bytes(x.mem) for x in d.hr.planes])
            finally:
                dm.close()
                pm.close()

    def test_streamed_layers(self):
        # send(..., streamed=True) then layers_ready() as the forward pass proceeds: the
        # decode holds exactly the layers marked, is not Success before the last one,
        # and the aux data written at the end of the forward pass arrives with it.
        kinds = ["full", "full", "full"]
        model = kvwire.Model(kinds, num_kv_heads=8, head_dim=64, elem_size=2)
        with KVBootstrapServer("127.0.0.1", 0) as server:
            p = SglRank(model, 1, 0, 15, kinds)
            d = SglRank(model, 1, 0, 16, kinds)
            pm = KVManager(p.args, "prefill", server_args(1, server.port),
                           model_config=model_config(kinds), transport=TRANSPORT)
            dm = KVManager(d.args, "decode", server_args(1), model_config=model_config(kinds),
                           transport=TRANSPORT, wait_timeout_ms=60000)
            try:
                before = d.hr.snapshot()
                req = {"room": 311, "n": 48, "prefix": 0}
                sp = req_pages([req], 3)
                dp = req_pages([req], 4)
                rv = KVReceiver(dm, server.address, 311)
                rv.init(0)
                rv.send_metadata(dp[311][0], 5)
                s = KVSender(pm, server.address, 311, [0], 0)
                t_end = time.monotonic() + DEADLINE
                while s.poll() == KVPoll.Bootstrapping:
                    self.assertLess(time.monotonic(), t_end)
                    time.sleep(0.001)
                s.init(3, 2)
                with self.assertRaisesRegex(ValueError, "no streamed chunk"):
                    s.layers_ready(0)
                s.send(sp[311][0], streamed=True)
                with self.assertRaisesRegex(ValueError, r"layers \[2, 4\) are not a range"):
                    s.layers_ready(2, 4)
                s.layers_ready(2)
                s.layers_ready(0)
                s.layers_ready(2)
                expect = [bytearray(x) for x in before]
                U.ref_apply(model, [p.hr], [p.hr.snapshot()], [sp], d.hr, expect, dp, req)
                partial = [bytearray(x) if pl.layer == 1 else bytearray(e)
                           for x, e, pl in zip(before, expect, d.hr.planes)]
                want = 2 * 48 * 8 * 128 * 2  # two layers of K and V, 8 heads of 128 bytes
                while rv.get_transfer_metric().transfer_total_bytes < want and rv.poll() != KVPoll.Failed:
                    self.assertLess(time.monotonic(), t_end)
                    time.sleep(0.001)
                self.assertEqual(rv.get_transfer_metric().transfer_total_bytes, want)
                self.assertEqual(rv.poll(), KVPoll.Transferring)
                for j, pl in enumerate(d.hr.planes):
                    self.assertTrue(pl.mem == partial[j], U.first_difference(pl.mem, partial[j]))
                p.set_aux(2, aux_payload(311))   # the forward pass produced the token
                s.layers_ready(1)
                while rv.poll() not in (KVPoll.Success, KVPoll.Failed):
                    self.assertLess(time.monotonic(), t_end)
                    time.sleep(0.001)
                self.assertEqual(rv.poll(), KVPoll.Success,
                                 rv._room.failure_reason if rv._room else rv._error)
                self.assertEqual(d.get_aux(5), aux_payload(311))
                for j, pl in enumerate(d.hr.planes):
                    self.assertTrue(pl.mem == expect[j], U.first_difference(pl.mem, expect[j]))
                self.assertNotEqual([bytes(x) for x in before], [bytes(x.mem) for x in d.hr.planes])
            finally:
                dm.close()
                pm.close()

    def test_aux_layout_mismatch_fails_closed(self):
        # Same total aux bytes, different split: the decode must not scatter them.
        kinds = ["full"]
        model = kvwire.Model(["full"], num_kv_heads=8, head_dim=64, elem_size=2)
        with KVBootstrapServer("127.0.0.1", 0) as server:
            p = SglRank(model, 1, 0, 11, kinds)
            d = SglRank(model, 1, 0, 12, kinds, aux_items=tuple(reversed(AUX_ITEMS)))
            pm = KVManager(p.args, "prefill", server_args(1, server.port),
                           model_config=model_config(kinds), transport=TRANSPORT)
            dm = KVManager(d.args, "decode", server_args(1), model_config=model_config(kinds),
                           transport=TRANSPORT)
            try:
                aux_before = [bytes(b) for b in d.aux]
                rv = KVReceiver(dm, server.address, 901)
                rv.init(0)
                rv.send_metadata([4, 5], 2, [])
                s = KVSender(pm, server.address, 901, [0], 0)
                t_end = time.monotonic() + DEADLINE
                while s.poll() == KVPoll.Bootstrapping:
                    self.assertLess(time.monotonic(), t_end)
                    time.sleep(0.001)
                s.init(2, 0)
                p.set_aux(0, aux_payload(901))
                s.send([7, 8], [])
                while rv.poll() not in (KVPoll.Success, KVPoll.Failed):
                    self.assertLess(time.monotonic(), t_end)
                    time.sleep(0.001)
                self.assertEqual(rv.poll(), KVPoll.Failed)
                with self.assertRaisesRegex(KVTransferError, r"aux items \[64, 200\].*"
                                            r"\[200, 64\]"):
                    rv.failure_exception()
                self.assertEqual([bytes(b) for b in d.aux], aux_before)
                s.clear()
                rv.clear()
            finally:
                dm.close()
                pm.close()

    def test_page_counts_and_indices_checked(self):
        kinds = ["swa", "full"]
        model = U.gptoss_model(WINDOW, layers=2)
        d = SglRank(model, 1, 0, 7, kinds)
        dm = KVManager(d.args, "decode", server_args(1), model_config=model_config(kinds),
                       transport=TRANSPORT)
        with KVBootstrapServer("127.0.0.1", 0) as server:
            p = SglRank(model, 1, 0, 8, kinds)
            pm = KVManager(p.args, "prefill", server_args(1, server.port),
                           model_config=model_config(kinds), transport=TRANSPORT)
            try:
                # kvwire's SWA window: the config's 32 rounded up to cover SGLang's pages.
                self.assertEqual(pm.swa_window, 48)
                s = KVSender(pm, server.address, 401, [0], 0)
                dup = KVSender(pm, server.address, 401, [0], 0)   # room already open here
                self.assertEqual(dup.poll(), KVPoll.Failed)
                with self.assertRaises(KVTransferError) as cm:
                    dup.failure_exception()
                self.assertEqual(cm.exception.status, kvwire.Status.ERR_BUSY)
                self.assertIn(server.address, str(cm.exception))
                with self.assertRaisesRegex(ValueError, "positive page count"):
                    s.init(0, 0)
                s.init(3, 0)                            # 3 pages: 48 tokens move
                self.assertEqual(s.num_tokens, 48)
                with self.assertRaisesRegex(ValueError, "init\\(\\) announced 3"):
                    s.send([1, 2, 3, 4])
                with self.assertRaisesRegex(ValueError, "SWA pages"):
                    s.send([1, 2, 3], [None])          # the last chunk needs the window
                with self.assertRaisesRegex(ValueError, "4 SWA pages do not end"):
                    s.send([1, 2, 3], [[5, 6, 7, 8]])  # more pages than the request has
                with self.assertRaisesRegex(ValueError, "token_position_offset=2"):
                    s.send([1, 2, 3], [[5, 6]], 2)
                # The window's pages as SGLang passes them: [floor_page(L - 32), L).
                self.assertEqual(pm.swa_side(48, [5, 6], "t"), ([0, 5, 6], 0))
                self.assertEqual(pm.swa_side(48, [4, 5, 6], "t"), ([4, 5, 6], 0))
                self.assertEqual(pm.swa_side(160, [7, 8, 9], "t"), ([7, 8, 9], 112))
                self.assertEqual(pm.swa_side(160, [8, 9], "t"), ([0, 8, 9], 112))
                with self.assertRaisesRegex(ValueError, "more than one page short"):
                    pm.swa_side(160, [9], "t")
                rv = KVReceiver(dm, server.address, 401)
                with self.assertRaises(RuntimeError):
                    rv.send_metadata([1, 2, 3], 0, [[1, 2, 3]])    # before init()
                rv.init(0)
                with self.assertRaises(RuntimeError):
                    rv.init(0)
                self.assertIsNone(rv.conclude_state)
                with self.assertRaisesRegex(ValueError, "whole number"):
                    rv.send_metadata([1, 2], 0, [[1, 2]], 8)
                with self.assertRaisesRegex(ValueError, "2 state index entries"):
                    rv.send_metadata([1, 2, 3], 0, [[1, 2, 3], None])
                with self.assertRaisesRegex(ValueError, "aux_index 8 outside"):
                    rv.send_metadata([1, 2, 3], AUX_SLOTS, [[1, 2, 3]])
                rv.send_metadata([1, 2, 3], 0, [[1, 2, 3]])
                rv.abort()
                self.assertEqual(rv.poll(), KVPoll.Failed)
                self.assertEqual(rv.conclude_state, KVPoll.Failed)
                s.clear()
                rv.clear()
            finally:
                pm.close()
                dm.close()

    def test_geometry_refused_at_construction(self):
        kinds = ["swa", "full"]
        model = U.gptoss_model(WINDOW, layers=2)
        d = SglRank(model, 1, 0, 9, kinds)
        # The config says 2 full layers; the KV lists hold one (K, V) pair.
        with self.assertRaisesRegex(ValueError, "2 full-attention layers"):
            KVManager(d.args, "decode", server_args(1), model_config=model_config(["full"] * 2))
        with self.assertRaisesRegex(ValueError, "needs the model config"):
            KVManager(d.args, "decode", server_args(1))
        with self.assertRaisesRegex(ValueError, "owns 8 of 8"):
            bad = KVArgs(**d.args.__dict__)
            bad.kv_head_num = 4
            KVManager(bad, "decode", server_args(1), model_config=model_config(kinds))
        with self.assertRaisesRegex(ValueError, "decode pipeline parallelism"):
            bad = KVArgs(**d.args.__dict__)
            bad.pp_rank = 1
            sa = server_args(1)
            sa.pp_size = 2
            KVManager(bad, "decode", sa, model_config=model_config(kinds))
        with self.assertRaisesRegex(ValueError, "Mamba state together with an SWA pool"):
            bad = KVArgs(**d.args.__dict__)
            bad.state_types = ["swa", "mamba"]
            KVManager(bad, "decode", server_args(1), model_config=model_config(kinds))
        with self.assertRaisesRegex(ValueError, "state type 'dsa' is not supported.*DSA"):
            bad = KVArgs(**d.args.__dict__)
            bad.state_types = ["swa", "dsa"]
            KVManager(bad, "decode", server_args(1), model_config=model_config(kinds))
        with self.assertRaisesRegex(ValueError, "attention context parallelism"):
            sa = server_args(1)
            sa.attn_cp_size = 2
            KVManager(d.args, "decode", sa, model_config=model_config(kinds))
        with self.assertRaisesRegex(ValueError, "token_position_offset=3"):
            bad = KVArgs(**d.args.__dict__)
            bad.token_position_offset = 3
            KVManager(bad, "decode", server_args(1), model_config=model_config(kinds))

    def test_bad_bootstrap_address_fails_at_once(self):
        kinds = ["full"]
        model = kvwire.Model(["full"], num_kv_heads=8, head_dim=64, elem_size=2)
        d = SglRank(model, 1, 0, 10, kinds)
        # A long bootstrap timeout: failing at once must not mean waiting for it.
        dm = KVManager(d.args, "decode", server_args(1), model_config=model_config(kinds),
                       transport=TRANSPORT, bootstrap_timeout_ms=60000)
        try:
            for room, addr in ((501, "127.0.0.1:1"), (502, "no-port-given"),
                               (503, "host.invalid:99999"), (504, "::1:8998")):
                t0 = time.monotonic()
                rv = KVReceiver(dm, addr, room)
                rv.init(0)
                rv.send_metadata([1], 0)
                while rv.poll() != KVPoll.Failed:
                    self.assertNotEqual(rv.poll(), KVPoll.Success)
                    self.assertLess(time.monotonic() - t0, 15, addr)
                    time.sleep(0.001)
                with self.assertRaises(KVTransferError) as cm:
                    rv.failure_exception()
                self.assertIn(addr, str(cm.exception))
                self.assertEqual(cm.exception.bootstrap_addr, addr)
                self.assertEqual(cm.exception.bootstrap_room, room)
                self.assertFalse(cm.exception.is_from_another_rank)
                rv.clear()
            # Aborted before init (no room yet), with an address or a DP-size setting
            # kvwire cannot use: the request fails here, abort() raises nothing, and
            # SGLang's later init() leaves it Failed.
            os.environ["KVWIRE_SGLANG_PREFILL_DP_SIZE"] = "two"
            try:
                for room, addr in ((511, "::1:8998"), (512, "127.0.0.1:1")):
                    rv = KVReceiver(dm, addr, room)
                    rv.abort()
                    self.assertEqual(rv.poll(), KVPoll.Failed)
                    rv.init(0)
                    self.assertEqual(rv.poll(), KVPoll.Failed)
                    self.assertEqual(rv.conclude_state, KVPoll.Failed)
                    with self.assertRaisesRegex(KVTransferError, "aborted locally"):
                        rv.failure_exception()
                    rv.clear()
            finally:
                del os.environ["KVWIRE_SGLANG_PREFILL_DP_SIZE"]
        finally:
            dm.close()

    def test_addresses_as_sglang_spells_them(self):
        """Bootstrap endpoints where SGLang's register_to_bootstrap puts them, IPv6 in
        SGLang's "[host]:port" spelling; listen hosts from SGLang's host selection."""
        import socket
        import kvwire.sglang as ks

        def boot(host, dia=None):
            sa = types.SimpleNamespace(host=host, dist_init_addr=dia,
                                       disaggregation_bootstrap_port=8998)
            return ks._bootstrap_addr_of(sa)
        self.assertEqual(boot("0.0.0.0"), "127.0.0.1:8998")
        self.assertEqual(boot("::"), "[::1]:8998")
        self.assertEqual(boot("fd00::7"), "[fd00::7]:8998")
        self.assertEqual(boot("127.0.0.1", "[fd00::5]:5000"), "[fd00::5]:8998")
        self.assertEqual(boot("0.0.0.0", "node0:5000"), "node0:8998")
        self.assertEqual(ks._split_host_port("[fe80::1%eth0]:80"), ("fe80::1%eth0", 80))
        with self.assertRaisesRegex(ValueError, "brackets"):
            ks._split_host_port("::1:8998")
        old = {k: os.environ.get(k) for k in ("SGLANG_HOST_IP", "HOST_IP")}
        try:
            os.environ.pop("HOST_IP", None)
            os.environ["SGLANG_HOST_IP"] = "[::1]"
            self.assertEqual(ks._local_ip(), "::1")
            os.environ["SGLANG_HOST_IP"] = "10.1.2.3"
            self.assertEqual(ks._local_ip(), "10.1.2.3")
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        try:
            with socket.socket(socket.AF_INET6) as t:
                t.bind(("::1", 0))
        except OSError as e:
            self.skipTest("no IPv6 loopback: %s" % e)
        with KVBootstrapServer("::1", 0) as srv:
            self.assertTrue(srv.address.startswith("[::1]:"), srv.address)
            self.assertGreater(srv.port, 0)
            socket.create_connection(("::1", srv.port), timeout=5).close()


class TestSendOrdering(unittest.TestCase):
    """KVSender.send with KV pools in GPU memory: each chunk is ordered after the
    engine's writes (SGLang's _early_send_wait_event, else an event on the current
    stream). The room and the events are stand-ins that record what the sender asks of
    them, so this runs without a GPU; on one, python/tests/sglang_real's
    unsynchronized_forward and prefill_cached_prefix_early_send check the bytes."""

    def sender(self, mem_kind, num_pages=4, ps=16):
        mgr = types.SimpleNamespace(page_size=ps, mem_kind=mem_kind, device=0, aux=False,
                                    state_types=[],
                                    parallel=types.SimpleNamespace(layer_begin=2, layer_end=5))
        s = object.__new__(KVSender)
        s.kv_mgr, s.bootstrap_room, s.aux_index = mgr, 77, None
        s.num_kv_indices, s.num_tokens = num_pages, num_pages * ps
        s._pages_sent, s._last_sent, s._stream, s._written = 0, False, None, None
        s._error, s._room, s._early_send_wait_event = None, Room(), None
        return s

    def test_early_send_event_pending_then_next_chunk(self):
        # SGLang's early send of a cached prefix hands over an event still pending: the
        # chunk goes streamed, every layer of the stage waiting on that event; the next
        # chunk first waits for it and marks the layers, then goes out.
        s = self.sender(kvwire.MemKind.CUDA)
        log = []
        ev = Event(done=False, log=log)
        s._early_send_wait_event = ev
        s.send([1, 2])
        self.assertEqual(s._room.calls, [("send_streamed", 0, 32, False), ("layers_ready", 2, 5, ev)])
        self.assertIsNone(s._early_send_wait_event)
        self.assertEqual(log, [])                    # nobody waited
        made = []
        torch = fake_torch(made)
        with mock.patch.dict(sys.modules, {"torch": torch}):
            s.send([3, 4])
        self.assertEqual(log, [("synchronize", ev)])
        self.assertEqual(s._room.calls[2:], [("layers_ready", 2, 5, None), ("send", 32, 64, True)])
        self.assertEqual(len(made), 1)               # the second chunk's own event...
        self.assertEqual(made[0].recorded_on, ("stream", 0))   # ...on the current stream
        self.assertIsNone(s._error)

    def test_current_stream_event(self):
        # No event from SGLang: one recorded on the caller's current stream; complete,
        # the chunk is a plain send; pending, it waits on the event thread.
        for done, want in ((True, [("send", 0, 64, True)]),
                           (False, [("send_streamed", 0, 64, True), ("layers_ready", 2, 5)])):
            s = self.sender(kvwire.MemKind.CUDA)
            made = []
            torch = fake_torch(made, done)
            with mock.patch.dict(sys.modules, {"torch": torch}):
                s.send([1, 2, 3, 4])
            self.assertEqual(len(made), 1)
            self.assertEqual(made[0].recorded_on, ("stream", 0))
            got = [c[:3] if c[0] == "layers_ready" else c for c in s._room.calls]
            self.assertEqual(got, want)
            if not done:
                self.assertIs(s._room.calls[1][3], made[0])
                self.assertIs(s._written, made[0])

    def test_host_pools(self):
        # Host pools: no event of our own; SGLang's, if any, is waited for here.
        s = self.sender(kvwire.MemKind.HOST)
        log = []
        ev = Event(done=False, log=log)
        s._early_send_wait_event = ev
        s.send([1, 2, 3, 4])
        self.assertEqual(log, [("synchronize", ev)])
        self.assertEqual(s._room.calls, [("send", 0, 64, True)])


if __name__ == "__main__":
    unittest.main()
