#!/usr/bin/env bash
# The first step of a new `1b` eager worker, with and without `resiliency.start_warmup` (trainer/warmstart.py),
# alternating, on one GPU: each run as the goodput run starts it (entrypoint.sh: compile-ahead, ft_launcher, the
# in-process layer), 5 steps, its checkpoints on /dev/shm (the final save is not what is measured). The first run
# fills Triton's cache, as a job's first start on a node does; the others find it filled.
#
#   source bench/gpu_env.sh && BENCH_DATA=$PWD/.benchdata/data OUT=$OUT bash bench/first_step.sh
#
# Prints per run one JSON line: the start phases of rank 0 and the times of steps 1-3. FIRST_STEP_RUNS (3) pairs;
# FIRST_STEP_PROFILE=1 adds one run of each with `--train.profile_steps=1-1` (a Chrome trace of step 1 in $OUT).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/bench}"
DATA="${BENCH_DATA:-$OUT/data}"
CKPT_ROOT="${FIRST_STEP_CKPT_ROOT:-/dev/shm/first-step-ckpt}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"

run() {  # name warm [overrides...]
  local name=$1 warm=$2; shift 2
  rm -rf "$CKPT_ROOT"
  NPROC_PER_NODE=1 MASTER_PORT=$((29500 + RANDOM % 1000)) FT_MAX_RESTARTS=0 timeout 150 trainer_image/entrypoint.sh \
    --config 1b --data.path="$DATA" --train.run_dir="$OUT/$name" --checkpoint.dir="$CKPT_ROOT" --train.log_every=1 \
    --train.compile=false --resiliency.inprocess=true --train.steps=5 --checkpoint.interval=0 \
    --resiliency.start_warmup="$warm" "$@" ${TRAINER_OVERRIDES:-} >"$OUT/$name.log" 2>&1
  local rc=$?
  rm -rf "$CKPT_ROOT"
  python3 - "$OUT/$name" "$name" "$warm" "$rc" <<'PY'
import json, re, sys
from pathlib import Path
run, name, warm, rc = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
log = (run / "logs" / "trainer-rank0.log")
text = log.read_text(errors="replace") if log.is_file() else ""
phases = re.search(r"start phases \(s\): (.*?); ([\d.]+) s from process start", text)
warmed = re.search(r"start warm-up: (.*)", text)
steps = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"step"' in l] \
    if (run / "metrics.jsonl").is_file() else []
times = {r["step"]: r["step_time_s"] for r in steps if r.get("event") == "step"}
print(json.dumps({"figure": "first_step", "run": name, "start_warmup": warm == "true", "rc": rc,
                  "phases": dict((k, float(v)) for k, v in (p.split() for p in phases[1].split(", "))) if phases else None,
                  "start_s": float(phases[2]) if phases else None,
                  "steps_s": [round(times[s], 4) for s in sorted(times)[:3]],
                  "warm_up": warmed[1][:220] if warmed else None}))
PY
}

for i in $(seq "${FIRST_STEP_RUNS:-3}"); do
  run "first-off-$i" false
  run "first-on-$i" true
done
if [[ "${FIRST_STEP_PROFILE:-0}" == 1 ]]; then
  for warm in false true; do
    run "first-profile-$warm" "$warm" --train.profile_steps=1-1
    cp "$OUT/first-profile-$warm"/profile/*.json.gz "$OUT/first-profile-$warm.json.gz" 2>/dev/null
  done
fi
