#!/usr/bin/env bash
# The two-"node" torchrun launch of tests/test_tensor_parallel.py::test_torchrun_launch[2], N times
# in a row (default 50): two launchers on loopback, one rank each, through the c10d rendezvous.
# Prints one line per run (exit codes, seconds) and the failure count; keeps each failed run's
# output (and any core file) under $WORK/fail-<i>/.
#   usage: scripts/loop_torchrun_2node.sh [N] [WORK]      (run from the repository root)
# It runs the committed tree (git archive HEAD into $WORK/src), so that edits in progress in the
# working tree cannot fail a run; SRC=. runs the working tree instead.
set -u
N=${1:-50}
WORK=${2:-$(mktemp -d /tmp/loop_torchrun_2node.XXXXXX)}
RUN_TIMEOUT=${RUN_TIMEOUT:-120}      # per launcher; a hang counts as a failure
export OMP_NUM_THREADS=1
PY=${PYTHON:-python}
TORCHRUN=$(dirname "$(command -v "$PY")")/torchrun
mkdir -p "$WORK"
if [ -z "${SRC:-}" ]; then
    SRC="$WORK/src"
    rm -rf "$SRC" && mkdir -p "$SRC" && git archive HEAD qwen_ops tests | tar -x -C "$SRC"
fi
SRC=$(cd "$SRC" && pwd)
export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}"     # ahead of the editable install's finder
ulimit -c unlimited 2>/dev/null || true

"$PY" - "$WORK" "$SRC" <<'EOF'
import sys, textwrap
from pathlib import Path
sys.path.insert(0, sys.argv[2] + "/tests")
from checkpoints import make_qwen3_checkpoint
import test_tensor_parallel as t
work = Path(sys.argv[1])
if not (work / "ckpt").exists():
    make_qwen3_checkpoint(work / "ckpt")
(work / "run.py").write_text(t.SCRIPT)
EOF

fails=0
total_start=$(date +%s.%N)
for i in $(seq 1 "$N"); do
    out="$WORK/run-$i"; mkdir -p "$out"
    port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    start=$(date +%s.%N)
    pids=()
    for r in 0 1; do
        (cd "$out" && exec timeout -s KILL "$RUN_TIMEOUT" "$TORCHRUN" --nnodes=2 --nproc-per-node=1 --node-rank=$r \
            --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:$port --rdzv-id=qwen-ops-loop \
            "$WORK/run.py" "$WORK/ckpt" "$out" >"$out/node$r.log" 2>&1) &
        pids+=($!)
    done
    rcs=()
    for p in "${pids[@]}"; do wait "$p"; rcs+=($?); done
    secs=$(echo "$(date +%s.%N) - $start" | bc)
    same=$(cmp -s "$out/rank0.json" "$out/rank1.json" && echo same || echo differ)
    if [ "${rcs[0]}" != 0 ] || [ "${rcs[1]}" != 0 ] || [ "$same" != same ]; then
        fails=$((fails + 1))
        mv "$out" "$WORK/fail-$i"
        printf 'run %2d: FAIL rc=%s,%s tokens %s %.1f s (%s)\n' "$i" "${rcs[0]}" "${rcs[1]}" "$same" "$secs" "$WORK/fail-$i"
    else
        rm -rf "$out"
        printf 'run %2d: ok %.1f s\n' "$i" "$secs"
    fi
done
total=$(echo "$(date +%s.%N) - $total_start" | bc)
printf '%d/%d failed, %.1f s per run (%s, qwen_ops from %s)\n' "$fails" "$N" "$(echo "$total / $N" | bc -l)" "$WORK" "$SRC"
[ "$fails" = 0 ]
