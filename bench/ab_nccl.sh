#!/usr/bin/env bash
# A/B of one change on one GPU, interleaved in one call: the trainer in $OLD (a trainer_image directory of another
# commit) against this tree's, each a 30-step run of $CFG eager under bench/trainer_run.py with the recovery layers
# and the in-process Wrapper on and an exception at step 20. Prints, per run: how many NCCL communicators were made
# (NCCL's own INIT lines), the times of steps 1, 2, 21 and 22, and the in-process recovery with its phases.
# E.g. OLD = 5bac579's trainer_image (the communicator made at init with one rank):
#   git archive 5bac579 trainer_image | tar -x -C bench/_old   # here, before the device call (untracked)
#   source bench/gpu_env.sh && OLD=$PWD/bench/_old/trainer_image bash bench/ab_nccl.sh
# On a CPU: DEV=cpu CFG=tiny (gloo: no communicator either way).
set -u
cd "$(dirname "$0")/.."
DEV=${DEV:-cuda}; CFG=${CFG:-1b}; DATA=${DATA:-$PWD/.benchdata/data}; OLD=${OLD:-$PWD/bench/_old/trainer_image}
for tree in ${TREES:-new old new old}; do
  [ "$tree" = old ] && tp=$OLD || tp=$PWD/trainer_image
  run=/tmp/ab-$tree-$RANDOM; rm -rf "$run"
  PYTHONPATH=/tmp/site:$tp:$PWD NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT timeout 150 python3 bench/trainer_run.py \
    --stop-at 30 --layers on --label "$tree" -- --config "$CFG" --data.path="$DATA" --train.run_dir="$run" \
    --train.device="$DEV" --train.compile=false --train.log_every=1 --checkpoint.interval=10 \
    --checkpoint.persist_every=0 --resiliency.inprocess=true --resiliency.faults=0:20:exception >"$run.log" 2>&1
  echo "== $tree rc $?"
  grep -c "Init COMPLETE" "$run.log" | sed 's/^/nccl inits: /'
  grep -m3 "Init COMPLETE\|nranks 1" "$run.log" | cut -c1-160
  python3 -c "
import json
for line in open('$run/metrics.jsonl'):
    r = json.loads(line)
    if r.get('event') == 'step' and r['step'] in (1, 2, 21, 22):
        print('step', r['step'], round(r['step_time_s'], 3))
"
  python3 bench/figures.py recovery "$run" | cut -c1-330
  rm -rf "$run" "$run.log"
done
