"""kvwire.memkind.pointer_mem_kind: host memory answers (HOST, -1) where CUDA can be
asked (the CPU stand-in of the CUDA module here), and the call raises ERR_UNSUPPORTED
with the library's reason where it cannot (no module). Each case runs in a child
interpreter: the library loads its CUDA module once per process."""
import os
import subprocess
import sys
import textwrap
import unittest

import kvtest_util as U

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _build_dir():
    return os.environ.get("KVW_BUILD_DIR") or os.path.join(REPO, "build")


def _run(code, module):
    env = dict(os.environ)
    env["KVW_CUDA_MODULE"] = module
    env["PYTHONPATH"] = os.path.join(REPO, "python") + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=60)


class TestPointerMemKind(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        U.library_or_skip()

    def test_host_memory_with_the_stand_in(self):
        emu = os.path.join(_build_dir(), "libkvwire_cuda_emu.so")
        if not os.path.exists(emu):
            self.skipTest("no %s (build the tree first)" % emu)
        r = _run("""
            import ctypes
            import kvwire
            from kvwire.memkind import pointer_mem_kind, cuda_pointer_query_available
            buf = ctypes.create_string_buffer(4096)
            addr = ctypes.addressof(buf)
            assert cuda_pointer_query_available() is True
            for a in (addr, addr + 4095, 0):
                got = pointer_mem_kind(a)
                assert got == (kvwire.MemKind.HOST, -1), (a, got)
                assert isinstance(got[0], kvwire.MemKind), got
            for bad in ("0x10", 1.5, None, -1, True):
                try:
                    pointer_mem_kind(bad)
                except kvwire.KvwireError as e:
                    assert e.status == kvwire.Status.ERR_INVALID_PARAM, (bad, e)
                else:
                    raise AssertionError("pointer_mem_kind(%r) did not raise" % (bad,))
            print("ok")
        """, emu)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(r.stdout.strip(), "ok")

    def test_raises_without_cuda(self):
        r = _run("""
            import ctypes
            import kvwire
            from kvwire.memkind import pointer_mem_kind, cuda_pointer_query_available
            assert cuda_pointer_query_available() is False
            buf = ctypes.create_string_buffer(64)
            try:
                pointer_mem_kind(ctypes.addressof(buf))
            except kvwire.KvwireError as e:
                assert e.status == kvwire.Status.ERR_UNSUPPORTED, e
                assert "could not be loaded" in e.message, e.message
                print("ok")
            else:
                raise AssertionError("no error without a CUDA module")
        """, "/nonexistent-kvwire/libkvwire_cuda.so")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(r.stdout.strip(), "ok")


if __name__ == "__main__":
    unittest.main()
