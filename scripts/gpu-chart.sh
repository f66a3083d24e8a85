#!/usr/bin/env bash
# A chart of `kvwire bench --gpu` results: per topology, the whole protocol's GB/s (post to
# SUCCESS) beside the same-run baseline's, with the ratio above each pair. The GPU
# machines may lack gnuplot, so the chart is drawn wherever the JSON is.
#   scripts/gpu-chart.sh bench-gpu.json [out.png]          (needs python3 and gnuplot)
set -euo pipefail
in=${1:?usage: gpu-chart.sh BENCH.json [OUT.png]}
out=${2:-${in%.json}.png}
command -v gnuplot >/dev/null || { echo "gpu-chart: gnuplot is not installed (Debian: gnuplot-nox)"; exit 1; }
data=$(mktemp)
trap 'rm -f "$data"' EXIT
title=$(python3 - "$in" "$data" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
base = {"cuda_ipc": "device-to-device copy"}.get(d["transport"], "raw loopback TCP stream")
with open(sys.argv[2], "w") as f:
    for t in d["topologies"]:
        if not t["ok"]:
            continue
        name = "TP%d->TP%d %dx%d" % (t["prefill_tp"], t["decode_tp"], t["rooms"], t["tokens"])
        f.write('"%s" %.1f %.1f %.3f\n' % (name, t["protocol_gbps"], t["baseline_gbps"], t["ratio"]))
print("kvwire bench --gpu over %s (%s, %d layers, page %d, medians of %d): protocol vs %s"
      % (d["transport"], d["model"], d["layers"], d["page"], d["reps"], base))
PY
)
gnuplot <<EOF2
set terminal pngcairo size 1100,550 font 'sans,10' noenhanced
set output '$out'
set title "$title"
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set ylabel 'GB/s (payload)'
set yrange [0:*]
set key outside bottom center horizontal
set offsets graph 0, graph 0, graph 0.12, 0
set xtics nomirror
plot '$data' using 2:xtic(1) title 'protocol, post to SUCCESS', \
     '' using 3 title 'baseline, same run', \
     '' using 0:(\$2 > \$3 ? \$2 : \$3):(sprintf('%.2fx', \$4)) with labels offset 0,1 notitle
EOF2
echo "wrote $out"
