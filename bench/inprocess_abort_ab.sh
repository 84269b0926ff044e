#!/usr/bin/env bash
# Where the in-process restart's time goes under entrypoint.sh (ft_launcher, standby) on one GPU: 1b eager, an
# exception at step 20 (FAULT_STEP), snapshots every 10 steps. Variants (VARIANTS, each REPEAT times, interleaved),
# one process tree each: shipped (only the final save persisted); write-in-flight (every snapshot persisted: step
# 10's write is in flight at the fault); goodput-like (every 20th persisted, as in gpu_suite.sh goodput);
# no-standby (TRAINER_STANDBY=0); no-expandable (expandable segments off). Prints each rank's "in-process abort"
# line (every part's seconds, the torch.distributed part's two steps and its groups), the Wrapper's part split
# (health checks, garbage collection, the rest) and the recovery's phases.
#   source bench/gpu_env.sh && bash bench/inprocess_abort_ab.sh      (CFG=tiny on a CPU: a dry run of the script)
#   VARIANTS="shipped write-in-flight" REPEAT=3 bash bench/inprocess_abort_ab.sh
#   FAULT_STEP=205 (default 20): the exception later in the run (the run is FAULT_STEP + 10 steps)
set -u
cd "$(dirname "$0")/.."
DATA=${DATA:-$PWD/.benchdata/data}; CKPT=${CKPT:-/tmp/abort-ab-ckpt}
run() {  # label, then environment assignments. Each run is killed (its process group) 2 s after its recovery is
  # recorded: the figures are in by then, and the final save of 18 GB would only cost device time.
  local label=$1; shift
  local dir=/tmp/abort-ab-$label; rm -rf "$dir" "$CKPT"
  setsid env "$@" NPROC_PER_NODE=1 MASTER_PORT=$((29500 + RANDOM % 1000)) trainer_image/entrypoint.sh \
    --config "${CFG:-1b}" --data.path="$DATA" --train.run_dir="$dir" --checkpoint.dir="$CKPT" --train.compile=false \
    --checkpoint.node_local_dir=/dev/shm/abort-ab \
    --train.steps=$(( ${FAULT_STEP:-20} + 10 )) --train.log_every=1 --checkpoint.interval=10 --checkpoint.persist_every=0 \
    --resiliency.inprocess=true --resiliency.faults=0:${FAULT_STEP:-20}:exception ${EXTRA_ARGS:-} >"$dir.log" 2>&1 &
  local pid=$! deadline=$((SECONDS + ${RUN_TIMEOUT_S:-120}))
  while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ] \
      && ! grep -qs '"recovered"' "$dir/recovery.jsonl"; do sleep 0.5; done
  sleep 2; kill -KILL -- "-$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  echo "== $label: $(grep -cs '"recovered"' "$dir/recovery.jsonl") recovery record(s)"
  grep -hE "in-process abort|in-process restart, from|start phases.*in-process|Traceback|Error" "$dir.log" | cut -c1-260 | head -20
  python3 bench/figures.py recovery "$dir" | cut -c1-400
  rm -rf "$dir" "$dir.log" "$CKPT" /dev/shm/abort-ab  # the killed job could not remove its slots
}
for _ in $(seq "${REPEAT:-1}"); do
  for variant in ${VARIANTS:-shipped write-in-flight no-standby no-expandable}; do
    case $variant in
      shipped) EXTRA_ARGS="" run shipped TRAINER_STANDBY=1 ;;
      write-in-flight) EXTRA_ARGS="--checkpoint.persist_every=1" run write-in-flight TRAINER_STANDBY=1 ;;
      goodput-like) EXTRA_ARGS="--checkpoint.persist_every=20" run goodput-like TRAINER_STANDBY=1 ;;
      no-standby) EXTRA_ARGS="" run no-standby TRAINER_STANDBY=0 ;;
      no-expandable) EXTRA_ARGS="" run no-expandable TRAINER_STANDBY=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False ;;
      *) echo "inprocess_abort_ab.sh: unknown variant '$variant' (shipped, write-in-flight, goodput-like, no-standby, no-expandable)" >&2
         exit 2 ;;
    esac
  done
done
