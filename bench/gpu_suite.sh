#!/usr/bin/env bash
# GPU benchmark driver: the GPU figures of BENCHMARKS.md as JSON lines in $OUT/figures.jsonl (and on stdout).
#
#   bash bench/gpu_suite.sh PART [PART ...]     PART: floors throughput checkpoint recovery injob goodput restorepoint peer
#
# Runs on the lent H200 machine (source bench/gpu_env.sh first there) or any CUDA host with the project
# installed. `floors throughput checkpoint recovery` fit one 10-minute device call on 2 GPUs; `recovery` alone
# (one GPU) takes ~3 minutes; `goodput` (an 8-minute run with one exception and one SIGKILL) takes a call of its own.
# TRAINER_OVERRIDES (word-split) is appended to the recovery and goodput runs' trainer flags, for an A/B of one key,
# e.g. TRAINER_OVERRIDES=--checkpoint.pin_chunk_mib=1024.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/bench}"
mkdir -p "$OUT"
FIG="$OUT/figures.jsonl"
DATA="${BENCH_DATA:-$OUT/data}"
NGPU="$(python3 -c 'import torch; print(torch.cuda.device_count())')"
CKPT_ROOT="${BENCH_CKPT_ROOT:-$PWD/.bench-ckpt}"   # local disk, as a node-local checkpoint tier would be
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

say() { printf '== %s\n' "$*" >&2; }
fig() { tee -a "$FIG"; }

ensure_data() {
  [[ -f "$DATA/manifest.json" ]] && return
  python3 -m components.lib.tokendata --out "$DATA" --vocab-size 4096 --max-bytes 12000000 >&2
}

train() {  # name nproc [overrides...]: the trainer under torchrun, log in $OUT/name.log
  local name=$1 n=$2; shift 2
  rm -rf "$CKPT_ROOT/$name"
  timeout 300 torchrun --standalone --nproc-per-node "$n" -m trainer --config 1b --data.path="$DATA" \
    --train.run_dir="$OUT/$name" --checkpoint.dir="$CKPT_ROOT/$name" --train.log_every=1 "$@" \
    >"$OUT/$name.log" 2>&1
  say "$name: exit $?"
}

faulty() {  # name nproc [overrides...]: the trainer under entrypoint.sh (ft_launcher), in-process layer on
  local name=$1 n=$2; shift 2
  rm -rf "$CKPT_ROOT/$name"
  NPROC_PER_NODE=$n MASTER_PORT=$((29500 + RANDOM % 1000)) FT_MAX_RESTARTS=3 \
    timeout "${FAULTY_TIMEOUT_S:-540}" trainer_image/entrypoint.sh --config 1b --data.path="$DATA" --train.run_dir="$OUT/$name" \
    --checkpoint.dir="$CKPT_ROOT/$name" --train.log_every=1 --train.compile=false \
    --resiliency.inprocess=true "$@" ${TRAINER_OVERRIDES:-} >"$OUT/$name.log" 2>&1
  say "$name: exit $?"
}

part_floors() {
  python3 bench/floors.py --dir "$CKPT_ROOT/floors" --gib 4 | fig
  (( NGPU > 1 )) && torchrun --standalone --nproc-per-node "$NGPU" bench/floors.py --nccl | fig
}

part_throughput() {
  ensure_data
  for n in 1 $(( NGPU > 1 ? NGPU : 1 )); do
    train "tput-compile-$n" "$n" --train.steps=40 --checkpoint.interval=0 --checkpoint.async_save=false
    python3 bench/figures.py throughput "$OUT/tput-compile-$n" --skip 10 | fig
    rm -rf "$CKPT_ROOT/tput-compile-$n"
  done
}

part_checkpoint() {  # the tiers as a run uses them, on one GPU (18 GB of state): blocking vs the D2H floor, what a
  # snapshot every 10 steps costs (node-local publication on, every 2nd one written to disk during the phase), the
  # profile of one snapshot's steps, the final save, disk load vs read floor. ~3 min per mode; CKPT_DEVICE_STAGING
  # lists the checkpoint.device_staging modes to run (default: auto; "auto off" compares with direct copies).
  python3 -m pytest -q -p no:cacheprovider tests/checkpoint/test_device_staging.py 2>&1 | tail -3 >&2
  for mode in ${CKPT_DEVICE_STAGING:-auto}; do
    timeout "${CHECKPOINT_TIMEOUT_S:-300}" torchrun --standalone --nproc-per-node 1 bench/checkpoint_bench.py \
      --config 1b --steps 60 --every 10 --persist-every 2 --profile --dir "$CKPT_ROOT/bench" --train.compile=false \
      --checkpoint.device_staging="$mode" 2>"$OUT/checkpoint_bench-$mode.log" | fig
    rm -rf "$CKPT_ROOT/bench"
  done
}

part_injob() {  # ~1 minute: one in-job restart (SIGKILL at step 35 of 45, node-local tier), a peer for the goodput
  # run's in-job restart in the same call (e.g. TRAINER_STANDBY=0 here against the goodput run's default).
  # INJOB_FAULT_STEP (35; the standby is warm and has page-locked the slots ~40 s after the first step: 125 for
  # the goodput run's path), INJOB_STEPS (fault + 10), INJOB_NAME (injob) for several runs in one call.
  ensure_data
  local at="${INJOB_FAULT_STEP:-35}" name="${INJOB_NAME:-injob}"
  faulty "$name" 1 --train.steps="${INJOB_STEPS:-$(( at + 10 ))}" --checkpoint.interval=10 \
    --checkpoint.persist_every=0 --resiliency.faults=0:"$at":sigkill
  python3 bench/figures.py recovery "$OUT/$name" | fig
  grep -hE "start phases|standby|fork server|forkserver|page-locked|restored step|injecting fault|Worker group|garbage collector" \
    "$OUT/$name.log" | cut -c1-260 > "$OUT/$name-events.log"
  rm -rf "$CKPT_ROOT/$name"
}

part_recovery() {  # ~3 minutes: in-process (exception) and in-job (SIGKILL) recovery, 1b eager on one GPU
  ensure_data
  # Snapshots every 10 steps (node-local publication on); nothing persisted before the final save. The exception
  # (in-process: memory tier) and the SIGKILL (in-job: node-local tier) land 5 steps after a snapshot.
  faulty "recovery" 1 --train.steps=60 --checkpoint.interval=10 --checkpoint.persist_every=0 \
    --resiliency.faults=0:25:exception,0:45:sigkill
  python3 bench/figures.py recovery "$OUT/recovery" | fig  # recovery_s with its phases (trainer/startup/phases.py)
  python3 bench/figures.py starts "$OUT/recovery" | fig   # every start of rank 0, the first one included
  grep -hE "start phases|warm-up|restored step|injecting fault|term_ex|Worker group|joined round|checkpoint committed" \
    "$OUT/recovery.log" | cut -c1-260 > "$OUT/recovery-events.log"
  python3 bench/startup_probe.py | fig  # cold start: context made serially vs while the trainer imports
  rm -rf "$CKPT_ROOT/recovery"
}

part_goodput() {  # ~8 minutes, one exception (in-process) and one SIGKILL (in-job; GOODPUT_KILLS=2: two)
  ensure_data
  # 1,200 steps of 1b eager at ~0.31 s; a memory snapshot every 10 steps, every 20th of them persisted (disk every
  # 200 steps); the exception at step 405 on the last rank, the SIGKILL at step 805 on rank 0: mid-way between
  # snapshots, a third and two thirds into the run. Every step logged (the strict goodput needs each step's time).
  local last=$(( NGPU - 1 )) steps="${GOODPUT_STEPS:-1200}"
  local exc=$(( steps / 3 / 10 * 10 + 5 )) kill=$(( 2 * steps / 3 / 10 * 10 + 5 )) kill2=$(( 5 * steps / 6 / 10 * 10 + 5 ))
  if [[ -n "${GOODPUT_SEED:-}" ]]; then  # each fault 1 to 9 steps after a snapshot, drawn from the seed
    RANDOM=$GOODPUT_SEED
    exc=$(( exc - 5 + 1 + RANDOM % 9 )) kill=$(( kill - 5 + 1 + RANDOM % 9 )) kill2=$(( kill2 - 5 + 1 + RANDOM % 9 ))
    say "goodput: seed $GOODPUT_SEED: the exception at step $exc, the SIGKILL at $kill$([[ ${GOODPUT_KILLS:-1} == 2 ]] && echo " and $kill2")"
  fi
  local faults="$last:$exc:exception,0:$kill:sigkill"
  [[ "${GOODPUT_KILLS:-1}" == 2 ]] && faults+=",0:$kill2:sigkill"  # a second in-job restart, its standby new
  # The host and the GPU sampled every second through the run: a window of slower steps is matched against the SM
  # clock, power, temperature and the clock-event reasons (throttling), and against the host's CPU and I/O.
  local q=timestamp,utilization.gpu,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active
  nvidia-smi --query-gpu="$q" --format=csv,noheader >/dev/null 2>&1 || q=${q/clocks_event_reasons/clocks_throttle_reasons}
  nvidia-smi --query-gpu="$q" --format=csv -l 1 >"$OUT/goodput-gpu.csv" 2>&1 & local smi=$!
  vmstat -t 1 >"$OUT/goodput-vmstat.log" 2>&1 & local vm=$!
  faulty "goodput" "$NGPU" --train.steps="$steps" --checkpoint.interval=10 \
    --checkpoint.persist_every=20 --resiliency.faults="$faults"
  kill "$smi" "$vm" 2>/dev/null
  python3 bench/figures.py goodput "$OUT/goodput" --interval 10 | fig  # strict goodput, start-up, final save
  python3 bench/figures.py recovery "$OUT/goodput" | fig
  python3 bench/figures.py starts "$OUT/goodput" | fig
  grep -hE "injecting fault|term_ex|restored step|ft_launcher|Worker group|rendezvous|checkpoint committed|skipped|behind|caught up|start phases|standby|garbage collector|in-process restart:" \
    "$OUT/goodput.log" | cut -c1-240 > "$OUT/goodput-events.log"
  # the whole run directory and the samples, as one file
  tar -czf "$OUT/goodput-run.tar.gz" -C "$OUT" goodput goodput.log goodput-gpu.csv goodput-vmstat.log
  rm -rf "$CKPT_ROOT/goodput"
}

part_restorepoint() {  # ~2 minutes: is a snapshot the restore point 1, 2 and 3 steps after it is taken? (issue 41)
  ensure_data
  # interval 10, one fault a snapshot: an exception 1 step after (at the start of step 31), SIGKILLs 2 and 3 after
  # (52, 73), an exception 2 after (92). Each recovery's fault_step and steps_redone say which snapshot it restored
  # (steps_redone = fault_step - 1 - restored). RESTORE_NAME names the run (a peer on other code in the same call).
  local name="${RESTORE_NAME:-restorepoint}"
  faulty "$name" "$NGPU" --train.steps=100 --checkpoint.interval=10 --checkpoint.persist_every=0 \
    --resiliency.faults="0:31:exception,0:52:sigkill,0:73:sigkill,0:92:exception"
  python3 bench/figures.py recovery "$OUT/$name" | fig
  grep -hE "injecting fault|restored step|in flight when" "$OUT/$name.log" | cut -c1-240 > "$OUT/$name-events.log"
  rm -rf "$CKPT_ROOT/$name"
}

part_peer() {  # ~6 minutes on 2 GPUs: checkpoint.replicas 0 against auto, two nodes of one GPU each (peer_nodes.py)
  ensure_data
  PYTHONPATH="$PYTHONPATH:$PWD/tests" python3 bench/peer_nodes.py --data "$DATA" --ckpt "$CKPT_ROOT/peer" \
    --out "/dev/shm/peer-gpu" ${PEER_ARGS:-} | fig
  tar -czf "$OUT/peer-runs.tar.gz" --exclude='*-shm' -C /dev/shm peer-gpu 2>/dev/null
  rm -rf "$CKPT_ROOT/peer" /dev/shm/peer-gpu
}

for part in "$@"; do
  say "part $part"
  "part_$part"
done
