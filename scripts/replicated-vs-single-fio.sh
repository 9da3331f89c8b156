#!/usr/bin/env bash
# Sequential 1 MiB writes at queue depth 16 through fio's nbd engine, to a
# volume on one node and to one with 3 copies (three nodes on loopback, one
# machine). Prints one line per run and the medians. Bounded: each fio run
# writes SIZE (default 1 GiB) and stops after 60 s at most.
# Usage: scripts/replicated-vs-single-fio.sh [ITERATIONS] [SIZE]
set -euo pipefail
ITER=${1:-3}
SIZE=${2:-1G}
BIN=${BIN:-target/release/coronafs}
WORK=$(mktemp -d /tmp/cfs-repl-bench.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
{
  echo "rpc_secret = \"$SECRET\""
  echo "write_quorum = 2"
  for i in 1 2 3; do
    printf '[[nodes]]\nname = "n%s"\nnbd = "127.0.0.1:%s"\napi = "127.0.0.1:%s"\nreplica = "127.0.0.1:%s"\nzone = "z%s"\n' \
      "$i" $((21800 + i)) $((21810 + i)) $((21820 + i)) "$i"
  done
} > "$WORK/cluster.toml"
for i in 1 2 3; do
  "$BIN" serve --data-dir "$WORK/n$i" --cluster "$WORK/cluster.toml" --node "n$i" >"$WORK/n$i.log" 2>&1 &
  PIDS+=($!)
done
"$BIN" serve --data-dir "$WORK/single" --nbd 127.0.0.1:21830 --api 127.0.0.1:21831 >"$WORK/single.log" 2>&1 &
PIDS+=($!)
sleep 1
"$BIN" volume create single --size "$SIZE" --api http://127.0.0.1:21831 >/dev/null
"$BIN" volume create repl --size "$SIZE" --replicas 3 --api http://127.0.0.1:21811

run() { # URI -> MiB/s
  fio --name=w --ioengine=nbd --uri="$1" --rw=write --bs=1M --iodepth=16 --size="$SIZE" \
      --end_fsync=1 --runtime=60 --output-format=json 2>"$WORK/fio.err" |
    python3 -c 'import json,sys; t=sys.stdin.read(); j=json.loads(t[t.index("{"):]); print("%.1f" % (j["jobs"][0]["write"]["bw"]/1024))'
}
S=(); R=()
for i in $(seq 1 "$ITER"); do
  s=$(run nbd://127.0.0.1:21830/single); r=$(run nbd://127.0.0.1:21801/repl)
  echo "iteration $i: single $s MiB/s, replicated x3 $r MiB/s"
  S+=("$s"); R+=("$r")
done
python3 - "${S[*]}" "${R[*]}" <<'PY'
import statistics, sys
s = [float(x) for x in sys.argv[1].split()]; r = [float(x) for x in sys.argv[2].split()]
ms, mr = statistics.median(s), statistics.median(r)
print(f"median single {ms:.1f} MiB/s, replicated x3 {mr:.1f} MiB/s, ratio {mr/ms:.2f}x")
PY
grep -h "replica dropped\|link down" "$WORK"/n*.log || true
