#!/usr/bin/env python3
"""Randomized configuration sweep of `kvwire demo` (run through scripts/sweep.sh).

Each run draws a model preset, TP (1-16) and PP (1-3) sizes per side, page sizes
(1-256) and KV layouts per side, a transport and a small request shape, runs the demo
with a wall-clock limit and classifies the outcome:

  verified  exit 0 and the demo's "every byte and guard" verdict
  refused   exit 3: the demo refused the configuration before any transfer, with a
            "demo: ..." message naming the reason (heads that do not split over TP...)
  failed    any other exit status (failed rooms, wrong bytes, usage errors)
  crashed   the demo or one of its processes died of a signal, or a sanitizer reported
  hung      still running at the per-run limit (the whole process group is killed)

Every run checks each room's KV digest end to end (--verify every, the default).
Only verified and refused pass. The exit status is 1 if any run failed, crashed or hung.
Run i of seed S always draws the same configuration, and every failing run is printed as
the exact command line that reproduces it.
"""

import argparse
import math
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

CLASSES = ("verified", "refused", "failed", "crashed", "hung")
PASSING = ("verified", "refused")
# Exit status of `kvwire demo` for a configuration refused before any transfer.
DEMO_REFUSED = 3
POW2 = [1, 2, 4, 8, 16]


def cli_output(cli, *args):
    r = subprocess.run([cli, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=60)
    return r.returncode, r.stdout


def presets(cli):
    """Model presets, from the line after "--model NAME ... one of:" in demo --help."""
    rc, out = cli_output(cli, "demo", "--help")
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith("--model") and i + 1 < len(lines):
            names = lines[i + 1].split()
            if names and all(re.fullmatch(r"[a-z0-9.\-]+", n) for n in names):
                return names
    sys.exit("sweep: no model presets in '%s demo --help' (exit %d)" % (cli, rc))


def transports(cli, allowed):
    """shm and tcp where built in; ucx only where built in and UCX lists a transport."""
    _, out = cli_output(cli, "info")
    built, section = [], None
    for line in out.splitlines():
        # "transports (usable here, or why not):", one "  NAME  usable" or
        # "  NAME  not usable: WHY" line each (older builds: "  NAME" under
        # "transports compiled in:").
        if line.startswith("transports"):
            section = "tl"
            continue
        if line.startswith("UCX devices"):
            section = "ucx"
            continue
        if section == "tl":
            m = re.fullmatch(r"  ([a-z_]+)( +usable)?", line)
            if m:
                built.append(m.group(1))
            elif not line.startswith("  "):
                section = None
        elif section == "ucx" and "Transport:" in line:
            section = "ucx-ok"
    usable = [t for t in ("shm", "tcp") if t in built]
    if "ucx" in built and section == "ucx-ok":
        usable.append("ucx")
    if allowed:
        usable = [t for t in usable if t in allowed]
    if not usable:
        sys.exit("sweep: no usable transport (built in: %s)" % " ".join(built))
    return usable


def draw_tp(rng):
    # Mostly sizes that split the presets' heads; the rest exercise the refusals.
    return rng.choice(POW2) if rng.random() < 0.8 else rng.randint(1, 16)


def draw_pp(rng):
    return rng.choices([1, 2, 3], weights=[5, 3, 2])[0]


def draw_page(rng):
    return rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 256]) if rng.random() < 0.5 \
        else rng.randint(1, 256)


def draw(seed, i, models, tls, a):
    """The demo arguments of run i of this seed (a pure function of seed and i)."""
    rng = random.Random("kvwire-sweep/%d/%d" % (seed, i))
    model = rng.choice(models)
    # TP and PP per side; redrawn while the prefill x decode rank pairs exceed the cap
    # (start-up cost grows with the pairs: every decode rank handshakes every prefill rank).
    for _ in range(1000):
        ptp, dtp, ppp, dpp = draw_tp(rng), draw_tp(rng), draw_pp(rng), draw_pp(rng)
        if ptp * ppp * dtp * dpp <= a.max_pairs:
            break
    else:
        ptp = dtp = ppp = dpp = 1
    ppage = draw_page(rng)
    dpage = ppage if rng.random() < 0.3 else draw_page(rng)
    requests = rng.randint(1, a.max_requests)
    args = [
        "--model", model,
        # Mostly enough layers for every PP stage; the rest exercise that refusal.
        "--layers", str(rng.randint(min(max(ppp, dpp), a.max_layers) if rng.random() < 0.9
                                    else 1, a.max_layers)),
        "--prefill-tp", str(ptp), "--decode-tp", str(dtp),
        "--prefill-pp", str(ppp), "--decode-pp", str(dpp),
        "--page-size", str(ppage), "--decode-page-size", str(dpage),
        "--prefill-layout", rng.choice(["nhd", "hnd"]),
        "--decode-layout", rng.choice(["nhd", "hnd"]),
        "--transport", rng.choice(tls),
        # Log-uniform: short requests (1 token, part of a page) as often as long ones.
        "--max-tokens", str(max(1, int(round(math.exp(rng.uniform(0, math.log(a.max_tokens))))))),
        "--requests", str(requests),
        "--concurrency", str(rng.randint(1, min(requests, 8))),
        "--seed", str(rng.randint(1, 2**31 - 1)),
    ]
    # Now and then another KV head count, so that TP 3, 6, 12... also run (and refuse).
    if model != "deepseek-v3" and rng.random() < 0.15:
        args += ["--kv-heads", str(rng.choice([1, 2, 3, 4, 6, 8, 12, 16]))]
    # Rooms time out well inside the run's limit, so a stuck room is a failure with a
    # reason rather than a hang.
    args += ["--timeout-ms", str(a.room_timeout_ms), "--quiet"]
    # Every room's KV digest checked end to end (a mismatch fails the room, and the run).
    if a.verify:
        args += ["--verify", a.verify]
    return args


def classify(rc, out, err, timed_out):
    """(class, one-line reason) of one run."""
    tail = [l for l in err.splitlines() if l.strip()]
    last = tail[-1] if tail else ""
    if timed_out:
        return "hung", "still running at the limit; process group killed"
    if rc < 0:
        return "crashed", "killed by signal %d (%s)" % (-rc, signal.Signals(-rc).name)
    san = re.search(r"(ERROR: \w+Sanitizer[^\n]*|runtime error:[^\n]*)", err)
    if san:
        return "crashed", san.group(1)
    sig = re.search(r"killed by signal[^,)]*\)?", err)
    if sig:
        return "crashed", last
    if rc == 0:
        if re.search(r"yes: every byte and guard", out):
            return "verified", ""
        return "failed", "exit 0 without the verified verdict"
    if rc == DEMO_REFUSED:
        reasons = [l for l in tail if l.startswith("demo: ")]
        if reasons and "WRONG BYTES" not in err:
            return "refused", reasons[-1][len("demo: "):]
        return "failed", "exit 3 without a refusal message: " + last
    wrong = re.search(r"[^\n]*(WRONG BYTES|guard bytes changed)[^\n]*", err)
    return "failed", "exit %d: %s" % (rc, wrong.group(0) if wrong else last)


def run_one(cli, args, limit):
    cmd = [cli, "demo"] + args
    t0 = time.monotonic()
    # Its own session, so that a hung demo is killed with both of its child processes.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, text=True, errors="replace",
                         start_new_session=True)
    timed_out = False
    try:
        out, err = p.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = p.communicate()
    secs = time.monotonic() - t0
    cls, why = classify(p.returncode, out, err, timed_out)
    return cmd, cls, why, secs, err


def norm(reason):
    """A refusal reason with its numbers (and rank names) folded, for counting."""
    return re.sub(r"\d+", "N", reason.split(" (need ")[0])


def main():
    ap = argparse.ArgumentParser(
        prog="sweep.sh", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="CI-sized: sweep.sh --seed 1 --runs 20 (under 2 minutes on 2 cores).\n"
               "At length: sweep.sh --seed 7 --seconds 3600 --max-pairs 2304 "
               "--max-tokens 2048 --timeout 300")
    ap.add_argument("--seed", type=int, default=None,
                    help="seed of the draws (default: from the clock, printed)")
    ap.add_argument("--runs", type=int, default=None,
                    help="number of runs (default 20; unlimited with --seconds)")
    ap.add_argument("--seconds", type=float, default=None,
                    help="start no run after this many seconds")
    ap.add_argument("--cli", default=None, help="kvwire binary (default $BUILD/kvwire)")
    ap.add_argument("--timeout", type=float, default=60, help="wall-clock limit per run, s")
    ap.add_argument("--jobs", type=int, default=1, help="runs side by side (default 1)")
    ap.add_argument("--max-pairs", type=int, default=64,
                    help="cap on prefill ranks x decode ranks (default 64; 2304 = no cap)")
    ap.add_argument("--max-layers", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--max-requests", type=int, default=12)
    ap.add_argument("--room-timeout-ms", type=int, default=20000)
    ap.add_argument("--transports", default="", help="comma list to draw from "
                    "(default: shm, tcp and, where usable, ucx)")
    ap.add_argument("--only", type=int, default=None, help="run only run number N (1-based)")
    ap.add_argument("--verify", default="every",
                    help="the demo's --verify (default every: each room's KV digest is "
                    "checked; '' leaves it to KVW_VERIFY)")
    a = ap.parse_args()

    cli = a.cli or os.path.join(os.environ.get("BUILD", "build"), "kvwire")
    if not os.access(cli, os.X_OK):
        sys.exit("sweep: %s is not an executable kvwire binary (build first, or --cli)" % cli)
    seed = a.seed if a.seed is not None else int(time.time()) % 1000000
    if a.runs is None and a.seconds is None:
        a.runs = 20
    if a.jobs < 1 or (a.runs is not None and a.runs < 1) or a.max_pairs < 1:
        sys.exit("sweep: --jobs, --runs and --max-pairs must be at least 1")
    models = presets(cli)
    tls = transports(cli, [t for t in a.transports.split(",") if t])
    print("sweep: seed %d, %s, up to %s s per run, %d side by side; presets %s; "
          "transports %s; at most %d rank pairs"
          % (seed, "%d runs" % a.runs if a.runs is not None else "runs for %g s" % a.seconds,
             "%g" % a.timeout, a.jobs, " ".join(models), " ".join(tls), a.max_pairs),
          flush=True)

    counts = {c: 0 for c in CLASSES}
    refusals, bad = {}, []
    lock = threading.Lock()
    t0 = time.monotonic()
    state = {"next": a.only or 1, "done": 0}
    last = a.only if a.only else a.runs

    def take():
        with lock:
            i = state["next"]
            if (last is not None and i > last) or \
                    (a.seconds is not None and time.monotonic() - t0 >= a.seconds):
                return None
            state["next"] += 1
            return i

    def worker():
        while True:
            i = take()
            if i is None:
                return
            cmd, cls, why, secs, err = run_one(cli, draw(seed, i, models, tls, a), a.timeout)
            with lock:
                counts[cls] += 1
                state["done"] += 1
                if cls == "refused":
                    refusals[norm(why)] = refusals.get(norm(why), 0) + 1
                elif cls not in PASSING:
                    bad.append((i, cls, why, secs, cmd, err))
                print("[%4d] %-8s %6.1fs  %s%s" % (i, cls, secs, " ".join(cmd[2:-3]),
                                                   "" if cls == "verified" else "  -> " + why),
                      flush=True)

    threads = [threading.Thread(target=worker) for _ in range(a.jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    total = state["done"]
    print("\nsweep: seed %d, %d runs in %.0f s" % (seed, total, time.monotonic() - t0))
    print("%-10s %6s" % ("class", "runs"))
    for c in CLASSES:
        print("%-10s %6d%s" % (c, counts[c], "" if c in PASSING else "   (fails the sweep)"))
    if refusals:
        print("\nrefusal reasons (numbers folded to N):")
        for r, n in sorted(refusals.items(), key=lambda kv: -kv[1]):
            print("  %4d  %s" % (n, r))
    if bad:
        print("\nfailing runs (each line reproduces its run):")
        for i, cls, why, secs, cmd, err in sorted(bad):
            print("  run %d %s after %.1f s: %s" % (i, cls, secs, why))
            print("    " + shlex.join(cmd))
            for line in [l for l in err.splitlines() if l.strip()][-6:]:
                print("    | " + line)
    if total == 0:
        print("sweep: no run was made", file=sys.stderr)
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
