#!/usr/bin/env bash
# CPU restart figures, each restart split into its phases: 2 gloo ranks of the tiny model under entrypoint.sh with the
# in-process layer on, an exception on rank 1 at step 5 (in-process) and a SIGKILL of rank 0 at step 9 (in-job),
# snapshots every 2 steps; RUNS repeats. Prints bench/figures.py's recovery (with phases) and starts lines.
#
#   bash bench/restart_cpu.sh [RUNS]        (from the repo root, after `make setup`; OUT=... to keep the runs)
# Heavy (training processes): on a shared machine run it under `flock /tmp/heavy.lock`.
set -uo pipefail
cd "$(dirname "$0")/.."
RUNS="${1:-3}"
OUT="${OUT:-$(mktemp -d /tmp/restart-cpu.XXXXXX)}"
DATA="$OUT/data"
export PATH="$PWD/.venv/bin:$PATH" PYTHONPATH="$PWD/trainer_image:$PWD" OMP_NUM_THREADS=1
export FT_RANK_HEARTBEAT_TIMEOUT=30 FT_INITIAL_RANK_HEARTBEAT_TIMEOUT=60 FT_WORKLOAD_CHECK_INTERVAL=1 \
  FT_WORKERS_STOP_TIMEOUT=5 FT_TERM_TIMEOUT=20
[[ -f "$DATA/manifest.json" ]] || python -c "
from pathlib import Path
from components.lib.tokendata import build_dataset, default_corpus
build_dataset(default_corpus(), Path('$DATA'), vocab_size=2048, max_bytes=2_000_000, seed=0)" >/dev/null
for i in $(seq 1 "$RUNS"); do
  run="$OUT/run$i"
  MASTER_PORT=$((31000 + RANDOM % 2000)) timeout 300 trainer_image/entrypoint.sh --config tiny --train.steps=12 \
    --checkpoint.interval=2 --checkpoint.keep=3 --data.path="$DATA" --train.run_dir="$run" \
    --checkpoint.node_local_dir="$run-node" --resiliency.inprocess=true --resiliency.collective_timeout_s=3 \
    --resiliency.soft_timeout_s=6 --resiliency.hard_timeout_s=12 --resiliency.heartbeat_timeout_s=10 \
    --resiliency.termination_grace_s=2 --resiliency.preemption_grace_s=10 \
    --resiliency.faults=1:5:exception,0:9:sigkill >"$run.log" 2>&1
  echo "== run $i: exit $?" >&2
  python bench/figures.py recovery "$run"
  python bench/figures.py starts "$run"
done
echo "== runs in $OUT" >&2
