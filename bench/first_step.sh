#!/usr/bin/env bash
# The first step of a new `1b` eager worker, with and without `resiliency.start_warmup` (trainer/startup/warmup.py),
# alternating, on one GPU: each run as the goodput run starts it (entrypoint.sh: compile-ahead, ft_launcher, the
# in-process layer), 5 steps, its checkpoints on /dev/shm (the final save is not what is measured). The first run
# fills Triton's cache, as a job's first start on a node does; the others find it filled.
#
#   source bench/gpu_env.sh && BENCH_DATA=$PWD/.benchdata/data OUT=$OUT bash bench/first_step.sh
#
# Prints per run the first `start` line of `bench/figures.py starts` (rank 0's phases, `first_step` the step's time;
# the run's name says whether the warm-up ran) and, on stderr, its warm-up line. FIRST_STEP_RUNS (3) pairs;
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
  echo "== $name: exit $?" >&2
  rm -rf "$CKPT_ROOT"
  python3 bench/figures.py starts "$OUT/$name" | head -1  # its first start: phases, first_step included
  grep -h "start warm-up" "$OUT/$name/logs/trainer-rank0.log" | cut -c1-240 >&2
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
