"""Context.metrics() and prometheus_text(): a prefill and a decode context in this process
move one room and abort another; the dict holds exactly what happened (rooms by outcome,
the abort's status, bytes equal to the rooms' own counts, one latency sample, peers), and
the Prometheus text parses back (a small parser of the text format, here) into the same
values, with well-formed HELP/TYPE lines and a cumulative histogram ending in +Inf."""
import math
import os
import re
import time
import unittest

import kvtest_util as U
import kvwire
from kvwire import RoomState
from kvwire import _native as N

REPO = os.path.dirname(os.path.dirname(U.HERE))
INCLUDE = os.environ.get("KVW_INCLUDE_DIR", os.path.join(REPO, "include"))

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')


def parse_prometheus(text):
    """{name: {"type": t, "help": h, "samples": [(labels dict, float)]}} of the text
    exposition format; raises AssertionError on a line it cannot read."""
    fams, types = {}, {}
    for line in text.split("\n"):
        if not line:
            continue
        if line.startswith("# HELP "):
            name, _, h = line[7:].partition(" ")
            fams.setdefault(name, {"samples": []})["help"] = h
            continue
        if line.startswith("# TYPE "):
            name, _, t = line[7:].partition(" ")
            assert t in ("counter", "gauge", "histogram"), line
            assert name not in types, "TYPE twice: " + line
            types[name] = t
            fams.setdefault(name, {"samples": []})["type"] = t
            continue
        m = _SAMPLE.match(line)
        assert m, "unreadable sample: %r" % line
        labels, body = {}, m.group(3) or ""
        pos = 0
        while pos < len(body):
            lm = _LABEL.match(body, pos)
            assert lm, "unreadable labels: %r" % line
            labels[lm.group(1)] = re.sub(r'\\(.)', lambda x: {"n": "\n"}.get(x.group(1),
                                                                              x.group(1)),
                                         lm.group(2))
            pos = lm.end()
        value = float(m.group(4).replace("+Inf", "inf"))
        name = m.group(1)
        fam = name
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and types.get(name[:-len(suffix)]) == "histogram":
                fam = name[:-len(suffix)]
        assert fam in types, "sample before its TYPE: %r" % line
        fams[fam]["samples"].append((name, labels, value))
    return fams


class TestContextMetrics(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        U.library_or_skip()
        cls.model, cls.srcs = U.make_prefill_ranks(1)
        cls.pctx = kvwire.Context(cls.srcs[0].rank, "prefill", "127.0.0.1:0",
                                  host_bootstrap=True, wait_timeout_ms=10000)
        cls.dst = U.HostRank(cls.model, 1, 0, page_size=U.FULL_PS, swa_page_size=U.SWA_PS,
                             full_pages=16, swa_pages=8, seed=3)
        cls.dctx = kvwire.Context(cls.dst.rank, "decode", cls.pctx.bootstrap_addr,
                                  prefill_tp=1, bootstrap_timeout_ms=10000)

    @classmethod
    def tearDownClass(cls):
        cls.dctx.close()
        cls.pctx.close()

    def test_constants_match_header(self):
        with open(os.path.join(INCLUDE, "kvwire", "xfer.h")) as f:
            text = f.read()
        for name in ("KVW_CTX_METRICS_STATUS_SLOTS", "KVW_CTX_METRICS_LATENCY_BUCKETS",
                     "KVW_CTX_METRICS_ACTIVE_STATES"):
            m = re.search(r"#define %s (\d+)" % name, text)
            self.assertIsNotNone(m, name)
            self.assertEqual(int(m.group(1)), getattr(N, name), name)

    def test_rooms_and_prometheus(self):
        # One room moved, one aborted by the decode after its post.
        rv = self.dctx.receiver(1)
        rv.post(40, 0, [0, 1, 2], 0, [0, 1, 2], 0)
        s = self.pctx.sender(1)
        s.send(40, full_pages=[3, 4, 5], swa_pages=[2, 3, 4])
        self.assertEqual(rv.wait(30), RoomState.SUCCESS, rv.failure_reason)
        self.assertEqual(s.wait(30), RoomState.SUCCESS, s.failure_reason)
        room_bytes = (s.metrics().bytes, rv.metrics().bytes)
        self.assertGreater(room_bytes[0], 0)
        self.assertEqual(room_bytes[0], room_bytes[1])
        s.close()
        rv.close()
        rv = self.dctx.receiver(2)
        s2 = self.pctx.sender(2)
        rv.post(20, 0, [6, 7], 0, [4, 5], 0)
        rv.abort()
        self.assertEqual(s2.wait(30), RoomState.FAILED)
        pfail = s2.status
        s2.close()
        rv.close()

        t_end = time.monotonic() + 10
        while time.monotonic() < t_end:
            pm, dm = self.pctx.metrics(), self.dctx.metrics()
            if not any(pm["rooms_in_flight"].values()) and \
                    not any(dm["rooms_in_flight"].values()) and dm["staging"]["in_use"] == 0:
                break
            time.sleep(0.01)
        for m, side, rb in ((pm, "prefill", room_bytes[0]), (dm, "decode", room_bytes[1])):
            self.assertEqual(m["side"], side)
            self.assertEqual(m["transport"], "tcp")
            self.assertEqual(m["rooms_in_flight"],
                             {"bootstrapping": 0, "waiting_for_input": 0, "transferring": 0})
            self.assertEqual(m["rooms_finished"], {"success": 1, "failed": 1}, side)
            self.assertEqual(m["bytes"]["direct"] + m["bytes"]["staged"], rb, side)
            lat = m["latency_us"]
            self.assertEqual(lat["count"], 1)
            self.assertEqual(sum(c for _, c in lat["buckets"]), 1)
            self.assertEqual(len(lat["buckets"]), N.KVW_CTX_METRICS_LATENCY_BUCKETS)
            # The one sample's bucket bounds it: sum < bound, and p50 == p99 == bound.
            bound = [b for b, c in lat["buckets"] if c][0]
            self.assertLess(lat["sum"], bound)
            self.assertTrue(bound == math.inf or lat["sum"] >= bound / 2 or bound == 1)
            self.assertEqual(lat["p50"], bound)
            self.assertEqual(lat["p99"], bound)
            self.assertEqual(m["peers"], {"connected": 1, "died": 0})
            self.assertEqual(sum(m["failures"].values()), 1)
        self.assertEqual(dm["failures"]["ERR_ABORTED"], 1)
        self.assertEqual(pm["failures"][kvwire.Status(pfail).name], 1)
        self.assertEqual(pm["staging"]["capacity"], 0)
        self.assertEqual(dm["staging"]["capacity"], 64 << 20)
        self.assertEqual(dm["staging"]["in_use"], 0)
        staged = dm["bytes"]["staged"] > 0
        self.assertEqual(dm["staging"]["high_water"] > 0, staged)

        text = kvwire.prometheus_text([(pm, {"rank": "p0"}), (dm, {"rank": 'd"0\\'})])
        self.assertTrue(text.endswith("\n"))
        fams = parse_prometheus(text)
        for name, fam in fams.items():
            self.assertTrue(name.startswith("kvwire_"), name)
            self.assertIn("type", fam, name)
            self.assertTrue(fam.get("help"), name)
            if fam["type"] == "counter":
                self.assertTrue(name.endswith("_total"), name)
        for m, rank in ((pm, "p0"), (dm, 'd"0\\')):
            def values(fam, key):
                out = {}
                for name, lab, v in fams[fam]["samples"]:
                    if lab.get("rank") == rank:
                        self.assertEqual(lab["side"], m["side"])
                        self.assertEqual(lab["transport"], m["transport"])
                        out[lab.get(key, name)] = v
                return out
            self.assertEqual(values("kvwire_rooms_in_flight", "state"), m["rooms_in_flight"])
            self.assertEqual(values("kvwire_rooms_finished_total", "outcome"),
                             m["rooms_finished"])
            self.assertEqual(values("kvwire_room_failures_total", "status"), m["failures"])
            self.assertEqual(values("kvwire_bytes_total", "path"), m["bytes"])
            for key in ("capacity", "in_use", "high_water"):
                self.assertEqual(values("kvwire_staging_%s_bytes" % key, None),
                                 {"kvwire_staging_%s_bytes" % key: m["staging"][key]})
            self.assertEqual(values("kvwire_peers_connected", None),
                             {"kvwire_peers_connected": m["peers"]["connected"]})
            self.assertEqual(values("kvwire_peers_died_total", None),
                             {"kvwire_peers_died_total": m["peers"]["died"]})
            self.assertEqual(values("kvwire_rooms_verify_total", "outcome"), m["verify"])
            hist = values("kvwire_room_latency_seconds", "le")
            self.assertEqual(hist.pop("kvwire_room_latency_seconds_count"),
                             m["latency_us"]["count"])
            self.assertAlmostEqual(hist.pop("kvwire_room_latency_seconds_sum"),
                                   m["latency_us"]["sum"] / 1e6)
            run, want = 0, {}
            for bound_us, c in m["latency_us"]["buckets"]:
                run += c
                want[float(bound_us / 1e6)] = run
            self.assertEqual({float(k.replace("+Inf", "inf")): v for k, v in hist.items()},
                             want)
            self.assertIn(math.inf, want)

        # The same through the context's own renderer.
        one = parse_prometheus(self.dctx.prometheus_text({"rank": "x"}))
        got = {lab["path"]: v for _, lab, v in one["kvwire_bytes_total"]["samples"]}
        self.assertEqual(got, self.dctx.metrics()["bytes"])

    def test_verify(self):
        # A decode context verifying every room: one room moved, its digests matched.
        with self.assertRaises(kvwire.KvwireError) as cm:
            kvwire.Context(self.dst.rank, "decode", self.pctx.bootstrap_addr, prefill_tp=1,
                           bootstrap_timeout_ms=10000, verify="always")
        self.assertEqual(cm.exception.status, kvwire.Status.ERR_INVALID_PARAM)
        self.assertIn("verify 'always' is not off, every or sample:F", str(cm.exception))
        dst = U.HostRank(self.model, 1, 0, page_size=U.FULL_PS, swa_page_size=U.SWA_PS,
                         full_pages=16, swa_pages=8, seed=5)
        d = kvwire.Context(dst.rank, "decode", self.pctx.bootstrap_addr, prefill_tp=1,
                           bootstrap_timeout_ms=10000, verify="every", instance_id=7)
        try:
            before = d.metrics()["verify"]
            self.assertEqual(before, {"verified": 0, "skipped": 0, "failed": 0})
            rv = d.receiver(11)
            rv.post(40, 0, [0, 1, 2], 0, [0, 1, 2], 0)
            s = self.pctx.sender(11)
            s.send(40, full_pages=[9, 10, 11], swa_pages=[5, 6, 7])
            self.assertEqual(rv.wait(30), RoomState.SUCCESS, rv.failure_reason)
            self.assertEqual(s.wait(30), RoomState.SUCCESS, s.failure_reason)
            s.close()
            rv.close()
            self.assertEqual(d.metrics()["verify"], {"verified": 1, "skipped": 0, "failed": 0})
        finally:
            d.close()

    def test_closed_context(self):
        p = kvwire.Context(self.srcs[0].rank, "prefill", "127.0.0.1:0", host_bootstrap=True)
        p.close()
        with self.assertRaises(ValueError):
            p.metrics()


if __name__ == "__main__":
    unittest.main()
