"""A room between two processes through an installed kvwire package (tests/test_wheel.sh).

Run with the installed interpreter in isolated mode (python -I), from outside the source
tree: the package, the library and its modules must all come from the installation.

  wheel_room.py check PKGDIR        the package, library and modules are PKGDIR's
  wheel_room.py decode TRANSPORT    starts the prefill process (this script, "prefill"),
                                    moves a room over TRANSPORT and checks every byte

The model: 2 full-attention layers, 4 KV heads of 16 bytes, pages of 4 tokens; a
prefill TP1 instance in one process, a decode TP2 instance in the other (each decode rank
keeps 2 heads). The prefill bytes are a function of (layer, role, byte index), so the
decode process computes what each of its bytes must be with the arithmetic below, not
with the library; guard bytes around every decode buffer must stay untouched.
"""
import os
import subprocess
import sys
import time

import kvwire
from kvwire import _native

LAYERS, HEADS, HB, PS = 2, 4, 16, 4
TOKENS = 37  # 10 pages, the last one partial
SRC_PAGES = [7, 2, 9, 0, 4, 11, 5, 1, 8, 3]  # prefill page of each 4-token block
DST_PAGES = [3, 10, 0, 6, 1, 8, 2, 11, 5, 9]  # decode page of each block
NUM_PAGES = 12
GUARD = 64
ROOM = 4242
TIMEOUT_S = 30


def model():
    return kvwire.Model(["full"] * LAYERS, num_kv_heads=HEADS, head_dim=HB // 2, elem_size=2)


def src_byte(layer, role, i):
    return (i * 131 + layer * 17 + role * 7 + 1) % 251


def guarded(length, fill):
    return bytearray([fill]) * (GUARD + length + GUARD)


def buffers(m, tp, rank, mems):
    heads = HEADS // tp
    length = NUM_PAGES * PS * heads * HB
    out = []
    for layer in range(LAYERS):
        for role in (kvwire.Role.K, kvwire.Role.V):
            mem = mems[(layer, int(role))]
            out.append(kvwire.Buffer(layer, role, mem, offset=GUARD, length=length,
                                     page_size=PS, num_heads=heads, head_bytes=HB))
    return out


def prefill(transport):
    m = model()
    length = NUM_PAGES * PS * HEADS * HB
    mems = {}
    for layer in range(LAYERS):
        for role in (int(kvwire.Role.K), int(kvwire.Role.V)):
            b = guarded(length, 0)
            for i in range(length):
                b[GUARD + i] = src_byte(layer, role, i)
            mems[(layer, role)] = b
    rank = kvwire.Rank(m, kvwire.Parallel(1, 0), buffers(m, 1, 0, mems))
    ctx = kvwire.Context(rank, "prefill", "127.0.0.1:0", transport=transport,
                         host_bootstrap=True, wait_timeout_ms=TIMEOUT_S * 1000)
    print("ADDR", ctx.bootstrap_addr, flush=True)
    snd = ctx.sender(ROOM)
    snd.send(TOKENS, full_pages=SRC_PAGES)
    st = snd.wait(TIMEOUT_S)
    print("PREFILL", st.name, snd.metrics().bytes,
          snd.failure_reason if st != kvwire.RoomState.SUCCESS else "", flush=True)
    snd.close()
    ctx.close()
    rank.close()
    return 0 if st == kvwire.RoomState.SUCCESS else 1


def decode(transport):
    child = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), "prefill",
                              transport], stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().split()
        if len(line) != 2 or line[0] != "ADDR":
            print("FAIL: the prefill process printed %r" % line)
            return 1
        addr = line[1]
        m = model()
        tp, heads = 2, HEADS // 2
        length = NUM_PAGES * PS * heads * HB
        ranks, ctxs, rooms, mems = [], [], [], []
        for r in range(tp):
            mm = {(layer, role): guarded(length, 0xA5)
                  for layer in range(LAYERS) for role in (int(kvwire.Role.K),
                                                          int(kvwire.Role.V))}
            mems.append(mm)
            rank = kvwire.Rank(m, kvwire.Parallel(tp, r), buffers(m, tp, r, mm))
            ranks.append(rank)
            ctx = kvwire.Context(rank, "decode", addr, transport=transport, prefill_tp=1,
                                 wait_timeout_ms=TIMEOUT_S * 1000,
                                 bootstrap_timeout_ms=TIMEOUT_S * 1000)
            ctxs.append(ctx)
            rv = ctx.receiver(ROOM)
            rv.post(TOKENS, full_pages=DST_PAGES)
            rooms.append(rv)
        got = 0
        for r, rv in enumerate(rooms):
            st = rv.wait(TIMEOUT_S)
            if st != kvwire.RoomState.SUCCESS:
                print("FAIL: %s: decode rank %d: room %s: %s" % (transport, r, st.name,
                                                                 rv.failure_reason))
                return 1
            got += rv.metrics().bytes
        # Every byte of every decode buffer: moved tokens from the source arithmetic, the
        # rest (unused page slots, pages not in the list, guards) still 0xA5.
        bad = 0
        for r in range(tp):
            for (layer, role), b in mems[r].items():
                want = bytearray([0xA5]) * len(b)
                for t in range(TOKENS):
                    sp, dp, slot = SRC_PAGES[t // PS], DST_PAGES[t // PS], t % PS
                    for h in range(heads):
                        s0 = ((sp * PS + slot) * HEADS + r * heads + h) * HB
                        d0 = GUARD + ((dp * PS + slot) * heads + h) * HB
                        for k in range(HB):
                            want[d0 + k] = src_byte(layer, role, s0 + k)
                if b != want:
                    i = next(i for i in range(len(b)) if b[i] != want[i])
                    print("FAIL: %s: decode rank %d layer %d role %d: byte %d is %d, want %d"
                          % (transport, r, layer, role, i, b[i], want[i]))
                    bad += 1
        expect = LAYERS * 2 * TOKENS * HEADS * HB
        if got != expect:
            print("FAIL: %s: the decode ranks received %d bytes, expected %d" % (transport, got,
                                                                                 expect))
            bad += 1
        for rv in rooms:
            rv.close()
        for c in ctxs:
            c.close()
        for rk in ranks:
            rk.close()
        out, _ = child.communicate(timeout=TIMEOUT_S)
        if child.returncode != 0 or "PREFILL SUCCESS" not in out:
            print("FAIL: %s: the prefill process exited %d: %s" % (transport, child.returncode,
                                                                   out.strip()))
            bad += 1
        if bad:
            return 1
        print("room over %s: %d bytes to 2 decode ranks, every byte and guard verified"
              % (transport, got))
        return 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def check(pkgdir):
    """The package, the library and its modules come from pkgdir, with no KVWIRE_LIB."""
    pkgdir = os.path.realpath(pkgdir)
    bad = 0
    if "KVWIRE_LIB" in os.environ:
        print("FAIL: KVWIRE_LIB is set")
        bad += 1
    here = os.path.realpath(os.path.dirname(kvwire.__file__))
    if here != pkgdir:
        print("FAIL: kvwire imported from %s, not %s" % (here, pkgdir))
        bad += 1
    lib = os.path.realpath(kvwire.lib_path())
    if lib != os.path.join(pkgdir, "libkvwire.so"):
        print("FAIL: libkvwire loaded from %s, not the package" % lib)
        bad += 1
    if kvwire.library_version() != kvwire.__version__:
        print("FAIL: library %s, package %s" % (kvwire.library_version(), kvwire.__version__))
        bad += 1
    # The modules the library loads from its own directory, where the wheel carries them.
    # The transport module is loaded from there; the CUDA module too (a machine without a
    # GPU makes the module report that, not "could not be loaded").
    if os.path.exists(os.path.join(pkgdir, "libkvwire-ucx.so")):
        if not kvwire.transport_available("ucx"):
            print("FAIL: libkvwire-ucx.so is in the package but the ucx transport is not")
            bad += 1
    if os.path.exists(os.path.join(pkgdir, "libkvwire_cuda.so")):
        lib_h = _native.load()
        st = lib_h.kvw_cuda_available()
        why = kvwire.last_error() if st != 0 else ""
        if "could not be loaded" in why:
            print("FAIL: libkvwire_cuda.so is in the package but not loaded: %s" % why)
            bad += 1
        else:
            print("CUDA module loaded from the package: %s" % (why or "a GPU is usable"))
    print("package %s, library %s (%s)" % (here, lib, kvwire.library_version()))
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("check", "prefill", "decode"):
        sys.exit("usage: wheel_room.py check PKGDIR | decode TRANSPORT")
    fn = {"check": check, "prefill": prefill, "decode": decode}[sys.argv[1]]
    sys.exit(fn(sys.argv[2]))
