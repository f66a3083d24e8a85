"""Unit tests: struct layouts and enum values against the C headers, topology against
DESIGN.md's hand-derived tables, error reporting, buffers, and a local plan checked
byte for byte against the pure-Python reference."""
import ctypes
import os
import re
import shutil
import subprocess
import tempfile
import unittest

import kvtest_util as U
import kvwire
from kvwire import _native as N
from kvwire import Status

REPO = os.path.dirname(os.path.dirname(U.HERE))
INCLUDE = os.environ.get("KVW_INCLUDE_DIR", os.path.join(REPO, "include"))

ENUM_PREFIXES = [
    (kvwire.Status, "KVW_"),
    (kvwire.LayerKind, "KVW_LAYER_"),
    (kvwire.Pool, "KVW_POOL_"),
    (kvwire.Role, "KVW_ROLE_"),
    (kvwire.Layout, "KVW_LAYOUT_"),
    (kvwire.MemKind, "KVW_MEM_"),
    (kvwire.Side, "KVW_SIDE_"),
    (kvwire.RoomState, "KVW_ROOM_"),
    (kvwire.RankField, "KVW_RANK_FIELD_"),
    (kvwire.CtxField, "KVW_CTX_FIELD_"),
]
ENUM_TYPES = ["kvw_status_t", "kvw_layer_kind_t", "kvw_pool_t", "kvw_role_t", "kvw_layout_t",
              "kvw_mem_kind_t", "kvw_side_t", "kvw_room_state_t"]


def _c_layout():
    """Compiles and runs a C program printing every size, alignment, offset and enum
    value the Python mirrors depend on. Returns {key: int} or None without gcc."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None or not os.path.exists(os.path.join(INCLUDE, "kvwire", "xfer.h")):
        return None
    lines = ["#include <stddef.h>", "#include <stdio.h>", "#include <kvwire/xfer.h>",
             "int main(void) {"]
    for name, cls in N.STRUCTS.items():
        lines.append('printf("size %s %%zu\\n", sizeof(%s));' % (name, name))
        lines.append('printf("align %s %%zu\\n", _Alignof(%s));' % (name, name))
        for field, _ in cls._fields_:
            lines.append('printf("off %s.%s %%zu\\n", offsetof(%s, %s));'
                         % (name, field, name, field))
            lines.append('printf("fsize %s.%s %%zu\\n", sizeof(((%s *)0)->%s));'
                         % (name, field, name, field))
    for t in ENUM_TYPES:
        lines.append('printf("size %s %%zu\\n", sizeof(%s));' % (t, t))
    for cls, prefix in ENUM_PREFIXES:
        for m in cls:
            lines.append('printf("enum %s%s %%lld\\n", (long long)%s%s);'
                         % (prefix, m.name, prefix, m.name))
    for const in ("KVW_MAX_STATE_GROUPS", "KVW_NUM_POOLS"):
        lines.append('printf("const %s %%lld\\n", (long long)%s);' % (const, const))
    lines += ["return 0;", "}"]
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "layout.c"), os.path.join(d, "layout")
        with open(src, "w") as f:
            f.write("\n".join(lines) + "\n")
        subprocess.run([cc, "-std=c11", "-I", INCLUDE, src, "-o", exe], check=True,
                       capture_output=True)
        out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    vals = {}
    for line in out.splitlines():
        kind, key, val = line.split()
        vals[kind + " " + key] = int(val)
    return vals


class TestLayout(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        try:
            cls.c = _c_layout()
        except subprocess.CalledProcessError as e:
            raise AssertionError("the layout program failed: %s" % e.stderr)

    def setUp(self):
        if self.c is None:
            self.skipTest("no C compiler or no kvwire headers at %s" % INCLUDE)

    def test_struct_sizes_and_offsets(self):
        for name, cls in N.STRUCTS.items():
            with self.subTest(struct=name):
                self.assertEqual(ctypes.sizeof(cls), self.c["size " + name], "sizeof " + name)
                self.assertEqual(ctypes.alignment(cls), self.c["align " + name],
                                 "alignment of " + name)
                for field, _ in cls._fields_:
                    d = getattr(cls, field)
                    self.assertEqual(d.offset, self.c["off %s.%s" % (name, field)],
                                     "offset of %s.%s" % (name, field))
                    self.assertEqual(d.size, self.c["fsize %s.%s" % (name, field)],
                                     "size of %s.%s" % (name, field))

    def test_enums_are_c_ints(self):
        for t in ENUM_TYPES:
            self.assertEqual(self.c["size " + t], ctypes.sizeof(N.c_enum), t)

    def test_enum_values(self):
        for cls, prefix in ENUM_PREFIXES:
            for m in cls:
                self.assertEqual(int(m), self.c["enum %s%s" % (prefix, m.name)],
                                 "%s%s" % (prefix, m.name))
        self.assertEqual(N.KVW_MAX_STATE_GROUPS, self.c["const KVW_MAX_STATE_GROUPS"])
        self.assertEqual(N.KVW_NUM_POOLS, self.c["const KVW_NUM_POOLS"])


class TestTopo(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        U.library_or_skip()

    def routes(self, s, d, h):
        return [tuple(r) for r in kvwire.topo_routes(s, d, h)]

    def test_design_tables(self):
        # DESIGN.md section 3: (src, dst, src_start, dst_start, n)
        self.assertEqual(self.routes(1, 4, 2), [(0, 0, 0, 0, 1), (0, 1, 0, 0, 1),
                                                (0, 2, 1, 0, 1), (0, 3, 1, 0, 1)])
        self.assertEqual(self.routes(4, 2, 8), [(0, 0, 0, 0, 2), (1, 0, 0, 2, 2),
                                                (2, 1, 0, 0, 2), (3, 1, 0, 2, 2)])
        self.assertEqual(self.routes(2, 4, 8), [(0, 0, 0, 0, 2), (0, 1, 2, 0, 2),
                                                (1, 2, 0, 0, 2), (1, 3, 2, 0, 2)])
        self.assertEqual(self.routes(8, 2, 8),
                         [(s, 0, 0, s, 1) for s in range(4)] +
                         [(s, 1, 0, s - 4, 1) for s in range(4, 8)])
        self.assertEqual(self.routes(8, 4, 2), [(0, 0, 0, 0, 1), (1, 1, 0, 0, 1),
                                                (4, 2, 0, 0, 1), (5, 3, 0, 0, 1)])
        self.assertEqual(self.routes(3, 2, 6), [(0, 0, 0, 0, 2), (1, 0, 0, 2, 1),
                                                (1, 1, 1, 0, 1), (2, 1, 0, 1, 2)])
        self.assertEqual(self.routes(4, 4, 8), [(r, r, 0, 0, 2) for r in range(4)])

    def test_tp1_to_tp2(self):
        # The e2e tests' case: decode rank r holds heads [4r, 4r+4) of the prefill's 8.
        self.assertEqual(self.routes(1, 2, 8), [(0, 0, 0, 0, 4), (0, 1, 4, 0, 4)])
        r = kvwire.topo_routes(1, 2, 8)[1]
        self.assertEqual(r.src_head_start, 4)
        self.assertEqual(r.num_heads, 4)

    def test_heads(self):
        self.assertEqual(kvwire.topo_heads(2, 1, 8), (4, 4))
        self.assertEqual(kvwire.topo_heads(8, 5, 2), (1, 1))
        for t, r, h in [(1, 0, 8), (2, 0, 8), (4, 3, 8), (3, 2, 6), (8, 7, 2)]:
            self.assertEqual(kvwire.topo_heads(t, r, h), U.heads_owned(t, r, h))

    def test_incompatible_heads(self):
        with self.assertRaises(kvwire.KvwireError) as cm:
            kvwire.topo_routes(1, 3, 8)
        e = cm.exception
        self.assertEqual(e.status, Status.ERR_INCOMPATIBLE)
        self.assertEqual(e.code, -4)
        self.assertEqual(e.status_name, "ERR_INCOMPATIBLE")
        self.assertEqual(e.status_text, kvwire.status_string(-4))
        self.assertIn("8", e.message)
        self.assertIn("3", e.message)
        with self.assertRaises(kvwire.KvwireError) as cm:
            kvwire.topo_heads(3, 0, 8)
        self.assertEqual(cm.exception.status, Status.ERR_INCOMPATIBLE)


class TestErrorsAndBuffers(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        U.library_or_skip()

    def test_status_strings(self):
        self.assertEqual(kvwire.status_string(0), "success")
        self.assertEqual(kvwire.status_string(Status.ERR_REJECTED), "rejected by peer")
        e = kvwire.KvwireError(-999, "x")
        self.assertEqual(e.code, -999)
        self.assertEqual(e.status_text, "unknown status")
        self.assertIsInstance(e, RuntimeError)

    def test_versions_agree(self):
        # One version for the C header, the loaded library and this package.
        with open(os.path.join(INCLUDE, "kvwire", "version.h")) as f:
            hdr = dict(re.findall(r"^#define KVW_VERSION_(MAJOR|MINOR|PATCH) +(\d+)$", f.read(),
                                  re.M))
        want = "%s.%s.%s" % (hdr["MAJOR"], hdr["MINOR"], hdr["PATCH"])
        with open(os.path.join(REPO, "python", "pyproject.toml")) as f:
            pyproject = re.search(r'^version = "([^"]+)"$', f.read(), re.M).group(1)
        self.assertEqual(kvwire.library_version(), want)
        self.assertEqual(kvwire.__version__, want)
        self.assertEqual(pyproject, want)
        self.assertEqual(N.load().kvw_version_number(),
                         int(hdr["MAJOR"]) * 10000 + int(hdr["MINOR"]) * 100 + int(hdr["PATCH"]))

    def test_rank_8_heads_on_tp3(self):
        m = U.gptoss_model()
        mem = bytearray(3 * 16 * 128 * 4)
        bufs = [kvwire.Buffer(l, r, mem, page_size=16, num_heads=3, head_bytes=128)
                for l in range(4) for r in (kvwire.Role.K, kvwire.Role.V)]
        with self.assertRaises(kvwire.KvwireError) as cm:
            kvwire.Rank(m, kvwire.Parallel(tp_size=3, tp_rank=0), bufs)
        self.assertEqual(cm.exception.status, Status.ERR_INCOMPATIBLE)

    def test_rank_wrong_head_bytes(self):
        m = U.gptoss_model()
        mem = bytearray(8 * 16 * 256)
        bufs = [kvwire.Buffer(l, r, mem, page_size=16, num_heads=8, head_bytes=256)
                for l in range(4) for r in (kvwire.Role.K, kvwire.Role.V)]
        with self.assertRaises(kvwire.KvwireError) as cm:
            kvwire.Rank(m, kvwire.Parallel(), bufs)
        self.assertEqual(cm.exception.status, Status.ERR_INCOMPATIBLE)
        self.assertIn("128", cm.exception.message)

    def test_rank_missing_v_buffer(self):
        m = U.gptoss_model()
        mem = bytearray(8 * 16 * 128)
        bufs = [kvwire.Buffer(l, kvwire.Role.K, mem, page_size=16, num_heads=8, head_bytes=128)
                for l in range(4)]
        with self.assertRaises(kvwire.KvwireError) as cm:
            kvwire.Rank(m, kvwire.Parallel(), bufs)
        self.assertEqual(cm.exception.status, Status.ERR_INVALID_PARAM)

    def test_vectorized_layout_unsupported(self):
        m = kvwire.Model(["full"], num_kv_heads=1, head_dim=4, elem_size=2)
        mem = bytearray(8 * 4)
        bufs = [kvwire.Buffer(0, r, mem, page_size=4, num_heads=1, head_bytes=8,
                              layout="vectorized_5d") for r in ("k", "v")]
        with self.assertRaises(kvwire.KvwireError) as cm:
            kvwire.Rank(m, kvwire.Parallel(), bufs)
        self.assertEqual(cm.exception.status, Status.ERR_UNSUPPORTED)

    def test_buffer_sources(self):
        ba = bytearray(1000)
        b = kvwire.Buffer(0, "k", ba, offset=100, length=512)
        base = ctypes.addressof((ctypes.c_char * 1000).from_buffer(ba))
        self.assertEqual(b.addr, base + 100)
        self.assertEqual(b.length, 512)
        self.assertEqual(b.mem_kind, kvwire.MemKind.HOST)
        self.assertEqual(kvwire.Buffer(0, "v", memoryview(ba)[10:20]).addr, base + 10)
        self.assertEqual(kvwire.Buffer(0, "v", ba).length, 1000)
        raw = kvwire.Buffer.from_address(0x1000, 4096, 3, kvwire.Role.V)
        self.assertEqual((raw.addr, raw.length, raw.layer, raw.role), (0x1000, 4096, 3,
                                                                       kvwire.Role.V))
        with self.assertRaises(ValueError):
            kvwire.Buffer(0, "k", bytes(10))  # read-only
        with self.assertRaises(ValueError):
            kvwire.Buffer(0, "k", ba, offset=900, length=200)
        with self.assertRaises(TypeError):
            kvwire.Buffer(0, "k", object())
        with self.assertRaises(ValueError):
            kvwire.Buffer(0, "k", addr=0x1000)  # no length

        class FakeTensor:  # the part of torch.Tensor that Buffer uses
            is_cuda = True

            class device:
                index = 1

            def data_ptr(self):
                return 0x7000

            def numel(self):
                return 64

            def element_size(self):
                return 2

            def is_contiguous(self):
                return True
        t = kvwire.Buffer(2, "kv", FakeTensor())
        self.assertEqual((t.addr, t.length, t.mem_kind, t.device),
                         (0x7000, 128, kvwire.MemKind.CUDA, 1))

    def test_rank_keeps_description(self):
        hr = U.HostRank(U.gptoss_model(), 2, 1, full_pages=4, swa_pages=2)
        self.assertEqual(hr.rank.num_buffers, 8)
        for i, (b, p) in enumerate(zip(hr.buffers, hr.planes)):
            d = hr.rank.buffer_desc(i)
            self.assertEqual((d.layer, d.role, d.pool, d.page_size, d.num_heads, d.head_bytes,
                              d.addr, d.length, d.mem_kind, d.device),
                             (b.layer, int(b.role), int(p.pool), 16, 4, 128, b.addr, p.length,
                              0, 0))
        par = N.load().kvw_rank_parallel(hr.rank.handle)[0]
        self.assertEqual((par.tp_size, par.tp_rank, par.layer_begin, par.layer_end), (2, 1, 0, 4))
        mod = N.load().kvw_rank_model(hr.rank.handle)[0]
        self.assertEqual((mod.num_layers, mod.num_kv_heads, mod.k_head_dim, mod.elem_size,
                          mod.layers[0].kind, mod.layers[0].window, mod.layers[1].kind),
                         (4, 8, 64, 2, int(kvwire.LayerKind.SWA), 32,
                          int(kvwire.LayerKind.FULL)))

    def test_model_layers(self):
        m = kvwire.Model(["swa:128", "full", ("swa", 64), kvwire.Layer("mla")],
                         num_kv_heads=8, head_dim=64, mla_dim=576)
        self.assertEqual(m.kinds, [kvwire.LayerKind.SWA, kvwire.LayerKind.FULL,
                                   kvwire.LayerKind.SWA, kvwire.LayerKind.MLA])
        self.assertEqual(m.windows, [128, 0, 64, 0])
        self.assertEqual(m.max_window(), 128)
        self.assertEqual(m.head_bytes("latent"), 1152)
        m2 = kvwire.Model(["swa", "full"], windows=[16, 0], num_kv_heads=1, head_dim=8)
        self.assertEqual(m2.windows, [16, 0])
        with self.assertRaises(ValueError):
            kvwire.Model(["sliding"], num_kv_heads=1, head_dim=8)


class TestLocalPlan(unittest.TestCase):
    """TP1 -> TP2 inside this process through kvw_plan_exec_cpu, checked against the
    Python reference: validates the reference that the end-to-end tests rely on."""

    @classmethod
    def setUpClass(cls):
        U.library_or_skip()

    def test_tp1_to_tp2_exec_cpu(self):
        model, srcs = U.make_prefill_ranks(1)
        reqs = U.make_requests()
        dsts = [U.HostRank(model, 2, r, page_size=U.FULL_PS, swa_page_size=U.SWA_PS,
                           full_pages=U.FULL_PAGES, swa_pages=U.SWA_PAGES, seed=U.DECODE_SEED)
                for r in range(2)]
        src_data = [s.snapshot() for s in srcs]
        spages = [U.prefill_pages(reqs, 0)]
        for d in dsts:
            expect = d.snapshot()
            dpages = U.decode_pages(reqs, d.tp_rank)
            for r in reqs:
                U.ref_apply(model, srcs, src_data, spages, d, expect, dpages, r)
                sf, ss, s0 = spages[0][r["room"]]
                df, ds, d0 = dpages[r["room"]]
                for (b, e) in r["chunks"]:
                    with kvwire.Plan(srcs[0].rank, d.rank, r["n"],
                                     kvwire.SidePages(sf, 0, ss, s0),
                                     kvwire.SidePages(df, 0, ds, d0), chunk_begin=b,
                                     chunk_end=e, prefix_len=r["prefix"],
                                     last_chunk=e == r["n"]) as plan:
                        st = plan.stats()
                        self.assertEqual(sum(x.len for x in plan.runs()), st.bytes)
                        plan.exec_cpu()
            for j, p in enumerate(d.planes):
                self.assertTrue(p.mem == expect[j], "decode rank %d plane %d: %s" % (
                    d.tp_rank, j, U.first_difference(p.mem, expect[j])))
        # The source is only read.
        for s, data in zip(srcs, src_data):
            for p, before in zip(s.planes, data):
                self.assertTrue(p.mem == before)

    def test_field_masks(self):
        """A plan stats request with a bit the library does not know is refused, naming
        the struct and the bit; a request for some fields fills only those."""
        model, srcs = U.make_prefill_ranks(1)
        d = U.HostRank(model, 1, 0, full_pages=8, swa_pages=8)
        with kvwire.Plan(srcs[0].rank, d.rank, 40, kvwire.SidePages([0, 1, 2], 0, [0, 1, 2], 0),
                         kvwire.SidePages([3, 4, 5], 0, [3, 4, 5], 0)) as plan:
            lib = N.load()
            s = N.kvw_plan_stats_t(field_mask=N.KVW_PLAN_STATS_FIELDS_ALL | (1 << 40))
            self.assertEqual(lib.kvw_plan_stats(plan._handle(), ctypes.byref(s)),
                             int(Status.ERR_INVALID_PARAM))
            msg = lib.kvw_last_error().decode()
            self.assertIn("kvw_plan_stats_t", msg)
            self.assertIn("0x10000000000 unknown", msg)
            s = N.kvw_plan_stats_t(field_mask=1, num_routes=12345)  # bytes only
            self.assertEqual(lib.kvw_plan_stats(plan._handle(), ctypes.byref(s)), 0)
            self.assertEqual(s.bytes, plan.stats().bytes)
            self.assertEqual(s.num_routes, 12345)

    def test_fields_all_match_headers(self):
        """Every KVW_*_FIELDS_ALL of the binding equals the header's."""
        text = ""
        for h in ("kvwire.h", "xfer.h"):
            with open(os.path.join(INCLUDE, "kvwire", h)) as f:
                text += f.read()
        found = dict((m.group(1), int(m.group(2), 16)) for m in re.finditer(
            r"#define (KVW_\w+_FIELDS_ALL) 0x([0-9a-f]+)ull", text))
        names = [n for n in dir(N) if n.endswith("_FIELDS_ALL")]
        self.assertGreaterEqual(len(names), 16)
        for n in names:
            self.assertEqual(getattr(N, n), found.get(n), n)

    def test_plan_rejects_bad_pages(self):
        model, srcs = U.make_prefill_ranks(1)
        d = U.HostRank(model, 2, 0, full_pages=4, swa_pages=4)
        with self.assertRaises(kvwire.KvwireError) as cm:
            kvwire.Plan(srcs[0].rank, d.rank, 40, kvwire.SidePages([0, 1, 2], 0, [0, 1], 0),
                        kvwire.SidePages([0, 1, 99], 0, [0, 1], 0))
        self.assertEqual(cm.exception.status, Status.ERR_OUT_OF_RANGE)


if __name__ == "__main__":
    unittest.main()
