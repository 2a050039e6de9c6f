#!/bin/bash
# This checkout against an earlier revision checked out beside it, in turns (so that the
# machine's noise falls on both alike): the beyond-RAM run (a 2 GiB memory cgroup, root)
# and the capacity run (max_size 10^6 and 10^8), ROUNDS times each, JSON into OUT.
#
#   git worktree add /tmp/zarr_rb-before <revision>
#   bash benchmarks/against.sh /tmp/zarr_rb-before /tmp/against 3
set -euo pipefail
BEFORE=$(cd "$1" && pwd)
OUT=$2
ROUNDS=${3:-3}
NOW=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
mkdir -p "$OUT"
for round in $(seq 1 "$ROUNDS"); do
  for who in now before; do
    if [ "$who" = before ]; then dir=$BEFORE; else dir=$NOW; fi
    for part in beyond-ram capacity; do
      work=$(mktemp -d)
      (cd "$dir" && PYTHONPATH=$dir $PY benchmarks/run.py --parts "$part" --memory-limit 2G \
        --capacities 1000000,100000000 --json "$OUT/$part-$who-$round.json" --workdir "$work" \
        > "$OUT/$part-$who-$round.log" 2>&1)
      rm -rf "$work"
    done
  done
done
$PY - "$OUT" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
def med(who, part, get):
    return statistics.median(get(json.load(open(f))) for f in glob.glob(f"{out}/{part}-{who}-*.json"))
z = lambda d: d["beyond_ram"]["storages"]["ZarrStorage"]
rows = {
    "extend GB/s": ("beyond-ram", lambda d: z(d)["extend_gbps"]),
    "sample(256) random ms": ("beyond-ram", lambda d: z(d)["sample_random"]["median_ms"]),
    "sample(256) slices ms": ("beyond-ram", lambda d: z(d)["sample_slices"]["median_ms"]),
}
for cap, name in (("1000000", "10^6"), ("100000000", "10^8")):
    flush = lambda d, cap=cap: d["capacity"][cap]["flush_ms"]
    held = lambda d, cap=cap: d["capacity"][cap]["rss_held_mb"]
    rows[f"flush at max_size {name} ms"] = ("capacity", flush)
    rows[f"RSS held at max_size {name} MB"] = ("capacity", held)
print("| | now | before | now / before |\n|---|---|---|---|")
for name, (part, get) in rows.items():
    a, b = med("now", part, get), med("before", part, get)
    print(f"| {name} | {a:.3g} | {b:.3g} | {a / b:.2f} |")
PY
