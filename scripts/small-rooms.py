#!/usr/bin/env python3
"""Small rooms on the host transports, repeated: `kvwire bench --latency` and the
throughput mode of `kvwire bench` on the same room (deepseek-v3, 1 layer, 4 tokens:
4,608 bytes), ROUNDS times, rotating the order of the four runs each round, so that the
load of a shared host falls on all of them alike. Prints the median over the rounds of
each figure, every figure also as a ratio against the raw round trip of its own run.

usage: scripts/small-rooms.py [--bench PATH] [--rounds N] [--rooms N] [--json PATH]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run_latency(bench, tl, rooms, tmp):
    out = os.path.join(tmp, f"lat-{tl}.json")
    subprocess.run([bench, "--latency", "--transport", tl, "--rooms", str(rooms), "--json", out],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = json.load(open(out))["results"][0]
    return {"rtt_p50": r["rtt_p50_us"], "post_p50": r["post_success_p50_us"],
            "post_p99": r["post_success_p99_us"], "inflight_p50": r["inflight_p50_us"],
            "ratio": r["post_success_p50_us"] / r["rtt_p50_us"]}


def run_throughput(bench, tl, reps, tmp):
    out = os.path.join(tmp, f"thr-{tl}.json")
    subprocess.run([bench, "--transport", tl, "--model", "deepseek-v3", "--layers", "1",
                    "--lengths", "4", "--reps", str(reps), "--decode-tp", "1", "--mem-rooms",
                    "0", "--rate-rooms", "1000", "--json", out, "--png",
                    os.path.join(tmp, "x.png")], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    d = json.load(open(out))
    t = d["throughput"][0]
    per_rep = [t["bytes"] / (g * 1e3) for g in t["gbps_reps"] if g > 0]  # us
    cp = d["control_plane"][0]
    return {"p50": statistics.median(per_rep), "rate_rooms_per_s": cp["rooms_per_s"],
            "rate_p50": cp["latency_p50_us"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", default="build/kvwire-bench")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rooms", type=int, default=200)
    ap.add_argument("--json")
    a = ap.parse_args()
    jobs = [("lat", "tcp"), ("lat", "shm"), ("thr", "tcp"), ("thr", "shm")]
    res = {j: [] for j in jobs}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(a.rounds):
            order = jobs[k % len(jobs):] + jobs[:k % len(jobs)]
            for kind, tl in order:
                f = run_latency if kind == "lat" else run_throughput
                res[(kind, tl)].append(f(a.bench, tl, a.rooms if kind == "lat" else 50, tmp))
            print(f"round {k + 1} of {a.rounds} done", file=sys.stderr)
    med = lambda xs: statistics.median(xs)
    out = {"rounds": a.rounds, "bench": a.bench}
    for tl in ("tcp", "shm"):
        L, T = res[("lat", tl)], res[("thr", tl)]
        o = {k: med([x[k] for x in L]) for k in L[0]}
        o.update({"throughput_" + k: med([x[k] for x in T]) for k in T[0]})
        o["p99_over_p50"] = med([x["post_p99"] / x["post_p50"] for x in L])
        o["throughput_over_latency"] = o["throughput_p50"] / o["post_p50"]
        out[tl] = o
        print(f"{tl}: raw RTT p50 {o['rtt_p50']:.1f} us; post->Success p50 {o['post_p50']:.1f} "
              f"us ({o['ratio']:.2f}x RTT, median of per-run ratios), p99 {o['post_p99']:.1f} us "
              f"({o['p99_over_p50']:.2f}x p50); 64 in flight p50 {o['inflight_p50']:.1f} us; "
              f"throughput mode p50 {o['throughput_p50']:.1f} us "
              f"({o['throughput_over_latency']:.2f}x the latency mode); control-plane rate "
              f"{o['throughput_rate_rooms_per_s']:.0f} rooms/s, p50 {o['throughput_rate_p50']:.0f} us")
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
