#!/usr/bin/env bash
# Issue 14's figures: the trainer against torchtitan on the same model shape, measured in one device call.
# JSON lines go to $OUT/throughput.jsonl (and stdout); logs, metrics and profiles to $OUT/runs.tar.gz.
#
#   source bench/gpu_env.sh && bash bench/throughput_suite.sh PART [PART ...]
#
# PARTs (each run is one process; the trainer runs are bench/trainer_run.py, which stops after the measured
# step instead of writing the final checkpoint):
#   headline  the trainer under trainer_image/entrypoint.sh (ft_launcher heartbeats, in-process Wrapper, the
#             checkpoint manager's per-step call, preemption agreement: every recovery layer on), compiled and
#             eager, and torchtitan (bench/anchor_torchtitan.py) compiled and eager; STEPS steps, median of the
#             10-step windows after step 10
#   before    the trainer tree in $BEFORE_TREE (the code before this issue): compiled with a profile, eager
#   ablation  this tree, one process: every change left out in turn, and the recovery layers' cost per step
#   kernels   the tree in $KERNELS_TREE (this tree without the RMSNorm/RoPE kernel change), compiled
# torchtitan is whichever version is importable (the anchor speaks the 0.2 and 0.3 APIs). 0.3.0 does not import
# under PyTorch 2.11 (DataParallelMeshDims is newer); on such a machine carry torchtitan 0.2.2 instead.
# Environment: NPROC (GPUs, default all), CONFIG (1b; 8b takes seq 8192, batch 1 and activation checkpointing
# from its TOML), STEPS (40), STOP (ablation runs' last measured step, 20), DATA (token shards; built when
# missing), DEADLINE_S (a run that would start later than this many seconds into the suite is skipped).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/tput}"
RUNS="${RUNS:-/tmp/tput-runs}"
DATA="${DATA:-$RUNS/data}"
CONFIG="${CONFIG:-1b}"
NPROC="${NPROC:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}"
STEPS="${STEPS:-40}"
STOP="${STOP:-20}"
DEADLINE_S="${DEADLINE_S:-100000}"
BASE_PYTHONPATH="${PYTHONPATH:-}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$RUNS"
FIG="$OUT/throughput.jsonl"

say() { printf '== [%4ds] %s\n' "$SECONDS" "$*" >&2; }
fig() { grep -o '{"figure".*' | tee -a "$FIG"; }
fits() {  # label seconds: false (and a JSON line saying so) when the run would start past DEADLINE_S
  if (( SECONDS + $2 > DEADLINE_S )); then
    printf '{"figure": "skipped", "label": "%s", "at_s": %d}\n' "$1" "$SECONDS" | tee -a "$FIG"
    return 1
  fi
}
ensure_data() {
  [[ -f "$DATA/manifest.json" ]] && return
  python3 -m components.lib.tokendata --out "$DATA" --vocab-size 4096 --max-bytes 12000000 >&2
}
common() {  # trainer arguments shared by every trainer run ($1: run dir)
  printf '%s\n' --config "$CONFIG" --data.path="$DATA" --train.run_dir="$1" --checkpoint.dir="$1/ckpt" \
    --train.log_every=10
}

ours() {  # label tree est_s [trainer_run.py args] -- [trainer overrides]: a trainer tree under torchrun
  local label=$1 tree=$2 est=$3; fits "$label" "$est" || return; shift 3
  say "ours $label ($tree)"
  rm -rf "${RUNS:?}/$label"
  mapfile -t base < <(common "$RUNS/$label")
  PYTHONPATH="$tree/trainer_image:$PWD:$BASE_PYTHONPATH" timeout $((3 * est)) torchrun --standalone \
    --nproc-per-node "$NPROC" bench/trainer_run.py --label "$label" "${base[@]}" "$@" 2>"$RUNS/$label.log" | fig
}

production() {  # label est_s [trainer overrides]: trainer_image/entrypoint.sh with every recovery layer on
  local label=$1 est=$2; fits "$label" "$est" || return; shift 2
  say "production $label"
  rm -rf "${RUNS:?}/$label"
  mapfile -t base < <(common "$RUNS/$label")
  # entrypoint.sh's ft_launcher, with bench/trainer_run.py (which calls resiliency.run like `-m trainer`
  # does, and stops after step STEPS) in place of `-m trainer`.
  local shim="$RUNS/ft_launcher_$label"
  cat >"$shim" <<EOF
#!/usr/bin/env bash
args=()
while ((\$#)); do
  if [[ \$1 == -m && \${2:-} == trainer ]]; then args+=("$PWD/bench/trainer_run.py" --stop-at "$STEPS" --label "$label"); shift 2
  else args+=("\$1"); shift; fi
done
exec ft_launcher "\${args[@]}"
EOF
  chmod +x "$shim"
  PYTHONPATH="$PWD/trainer_image:$PWD:$BASE_PYTHONPATH" FT_LAUNCHER="$shim" NPROC_PER_NODE="$NPROC" \
    MASTER_PORT=$((29500 + RANDOM % 1000)) FT_MAX_RESTARTS=0 timeout $((3 * est)) trainer_image/entrypoint.sh \
    "${base[@]}" --resiliency.inprocess=true "$@" 2>"$RUNS/$label.log" | fig
}

titan() {  # label est_s [anchor args]: torchtitan on the same shape and settings; on failure once more
  local label=$1 est=$2; fits "$label" "$est" || return; shift 2  # without CUDA graphs (torchtitan's option)
  say "torchtitan $label"
  PYTHONPATH="$PWD/trainer_image:$PWD:$BASE_PYTHONPATH" timeout $((3 * est)) python3 bench/anchor_torchtitan.py \
    --config "$CONFIG" --nproc "$NPROC" --steps "$STEPS" --out "$RUNS/$label" --label "$label" "$@" \
    >"$RUNS/$label.log" 2>&1 && { fig <"$RUNS/$label.log"; return; }
  fig <"$RUNS/$label.log"
  tail -n 30 "$RUNS/$label.log" >&2
  [[ "$*" == *--no-cuda-graphs* ]] || titan "$label-nographs" "$est" "$@" --no-cuda-graphs
}

part_headline() {
  production ours-compiled 70 --train.compile=true
  titan titan-compiled 90 --compile
  production ours-eager 35 --train.compile=false
  titan titan-eager 60 --no-compile
}

part_before() {
  ours before-compiled "${BEFORE_TREE:?set BEFORE_TREE to a trainer tree}" 80 --stop-at "$STOP" --profile-steps 3 \
    --variants '[{"label": "before-eager", "set": ["--train.compile=false"]}]' -- --train.compile=true \
    --train.log_every=5
}

part_ablation() {
  # Each variant leaves one change out (or the recovery layers); "after" has them all and is profiled.
  ours after "$PWD" 120 --stop-at "$STOP" --profile-steps 3 --variants '[
    {"label": "no-fused-adamw", "set": ["--optim.implementation=for_loop"]},
    {"label": "no-compiled-loss", "set": ["--train.compile_loss=false"]},
    {"label": "reshard-always", "set": ["--train.reshard_after_forward=always"]},
    {"label": "auto-gc", "set": ["--train.gc_every=0"]},
    {"label": "layers-off", "layers": "off"}
  ]' -- --train.compile=true --train.log_every=5
}

part_kernels() {
  ours kernels-old "${KERNELS_TREE:?set KERNELS_TREE to a trainer tree}" 50 --stop-at "$STOP" -- \
    --train.compile=true --train.log_every=5
}

pack() { tar -czf "$OUT/runs.tar.gz" -C "$RUNS" --exclude=ckpt --exclude=checkpoints --exclude=data . 2>/dev/null; }

ensure_data
python3 - <<'EOF' | fig
import json, subprocess, torch
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit",
                      "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
try:
    import torchtitan
    titan = torchtitan.__version__
except ImportError:
    titan = None
print(json.dumps({"figure": "env", "torch": torch.__version__, "cuda": torch.version.cuda,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())), "torchtitan": titan, "gpus": smi}))
EOF
for part in "$@"; do
  say "part $part"
  "part_$part"
  pack
done
say "done"
