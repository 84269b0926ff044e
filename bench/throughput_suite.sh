#!/usr/bin/env bash
# Issue 21's runner of record: the trainer against torchtitan (0.2.2 on the GPU machine's PyTorch 2.11) on the same
# model shape, in ONE device call, plus the leave-one-out rows of the changes that closed the gap.
#
#   source bench/gpu_env.sh && OUT=$OUT bash bench/throughput_suite.sh headline loo table
#
# PARTs, in the order given:
#   headline  torchtitan's flavour checked against the trainer's (anchor --check: parameter count, FFN width),
#             then interleaved, one process each, STEPS (40) steps: ours-compiled (trainer_image/entrypoint.sh:
#             ft_launcher heartbeats, in-process Wrapper, every recovery layer on; the 1b TOML's defaults: compile
#             on, log_every 10), titan-compiled (bench/anchor_torchtitan.py), ours-eager, titan-eager
#             (HEADLINE_MODES, default "compiled eager": which pairs run)
#   loo       leave-one-out, one process per mode (bench/trainer_run.py --variants, recovery layers on, no
#             ft_launcher), LOO_STOP (25) steps per variant: loo-compiled (every change on; then 3 steps profiled:
#             its top kernels in the JSON line, profile.txt in runs.tar.gz) then each change off, and the recovery
#             layers off, and the straggler detector (issue 22) off / reporting every 5 steps instead of 100, and
#             the blocks' bf16 copies kept from the forward to the backward (keep-block-copies: one rank's
#             train.reshard_after_forward=never), Inductor's loss and PyTorch's gradient pass instead of
#             trainer/kernels.py's (torch-kernels: train.kernels=torch), PyTorch's fused AdamW instead of the
#             Triton AdamW that reads one rank's bf16 gradients itself (fused-adamw);
#             loo-eager likewise, torch-kernels also SwiGLU (RoPE's kernel is the same in eager mode: no row). torchrun without entrypoint.sh: the default allocator unless PYTORCH_ALLOC_CONF is set
#   alloc     ours-compiled and ours-eager again with PYTORCH_ALLOC_CONF=$TITAN_ALLOC_CONF (torchtitan's
#             launcher exports expandable segments; so does entrypoint.sh now, when neither PYTORCH_ALLOC_CONF nor
#             PYTORCH_CUDA_ALLOC_CONF is set: with the default TITAN_ALLOC_CONF these rows repeat the headline's)
#   nostandby ours-compiled again with TRAINER_STANDBY=0: the steps without a warm standby starting beside them
#   before    the trainer tree in $BEFORE_TREE, compiled and eager (20 steps)
#   table     $OUT/table.md from $OUT/throughput.jsonl (bench/figures.py table)
# Every figure: median over the steps after 10 of each step's time on the GPU's timeline (CUDA events at step
# starts, no extra host sync, the same code on both sides: bench/figures.py StepClock), tokens/s from it; plus each
# framework's own 10-step windows (both sync every 10 steps); peak reserved/allocated memory per process.
#
# Budget: each run starts only if its estimate fits before DEADLINE_S (default 540 s into the suite; a skipped run
# is a JSON line) and is killed at HARD_S (DEADLINE_S + 30). A process's finished variants are printed as they end.
# Outputs in $OUT (flat): throughput.jsonl (every JSON line), table.md, suite.log (progress, timestamped),
# runs.tar.gz (each run's log, metrics.jsonl, recovery ledger; no checkpoints).
# Environment: NPROC (GPUs, default all), CONFIG (1b), STEPS (40), LOO_STOP (25), DATA (token shards; built when
# missing), RUNS (scratch, /tmp/tput-runs), DEADLINE_S, TITAN_ALLOC_CONF (the allocator settings torchtitan's runs
# get: by default those its launcher, run_train.sh, exports; each side runs as its own launcher runs it, and the
# trainer's entrypoint.sh exports the same unless one is set; an empty PYTORCH_ALLOC_CONF counts as unset).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/tput}"
RUNS="${RUNS:-/tmp/tput-runs}"
DATA="${DATA:-$RUNS/data}"
CONFIG="${CONFIG:-1b}"
NPROC="${NPROC:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}"
STEPS="${STEPS:-40}"
LOO_STOP="${LOO_STOP:-25}"
DEADLINE_S="${DEADLINE_S:-540}"
HARD_S=$((DEADLINE_S + 30))
BASE_PYTHONPATH="${PYTHONPATH:-}"
TITAN_ALLOC_CONF="${TITAN_ALLOC_CONF-expandable_segments:True}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$RUNS"
FIG="$OUT/throughput.jsonl"
LOG="$OUT/suite.log"

say() { printf '== %s [%4ds] %s\n' "$(date +%H:%M:%S)" "$SECONDS" "$*" | tee -a "$LOG" >&2; }
fig() { grep --line-buffered -o '{"figure".*' | tee -a "$FIG"; }
fits() {  # label est_s: false (and a JSON line saying so) when the run would start past DEADLINE_S
  if (( SECONDS + $2 > DEADLINE_S )); then
    printf '{"figure": "skipped", "label": "%s", "at_s": %d}\n' "$1" "$SECONDS" | tee -a "$FIG"
    say "skipped $1 (estimate $2 s, deadline $DEADLINE_S s)"
    return 1
  fi
}
limit() { local left=$((HARD_S - SECONDS)); (( $1 < left )) && echo "$1" || echo "$left"; }  # a run's timeout
done_run() { say "done $1 (rc $2, $((SECONDS - $3)) s)"; }
ensure_data() {
  [[ -f "$DATA/manifest.json" ]] && return
  say "building the token shards in $DATA"
  python3 -m components.lib.tokendata --out "$DATA" --vocab-size 4096 --max-bytes 4000000 >&2
}
common() {  # trainer arguments shared by every trainer run ($1: run dir)
  printf '%s\n' --config "$CONFIG" --data.path="$DATA" --train.run_dir="$1" --checkpoint.dir="$1/ckpt" \
    --train.log_every=10
}

ours() {  # label tree est_s [trainer_run.py args] -- [trainer overrides]: a trainer tree under torchrun
  local label=$1 tree=$2 est=$3 t0=$SECONDS; fits "$label" "$est" || return; shift 3
  say "ours $label ($tree), timeout $(limit $((2 * est))) s"
  rm -rf "${RUNS:?}/$label"
  mapfile -t base < <(common "$RUNS/$label")
  PYTHONPATH="$tree/trainer_image:$PWD:$BASE_PYTHONPATH" timeout "$(limit $((2 * est)))" torchrun --standalone \
    --nproc-per-node "$NPROC" bench/trainer_run.py --label "$label" "${base[@]}" "$@" 2>"$RUNS/$label.log" | fig
  done_run "$label" "${PIPESTATUS[0]}" "$t0"
}

production() {  # label est_s [trainer overrides]: trainer_image/entrypoint.sh with every recovery layer on
  local label=$1 est=$2 t0=$SECONDS; fits "$label" "$est" || return; shift 2
  say "production $label, timeout $(limit $((2 * est))) s"
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
  PYTORCH_ALLOC_CONF="${OURS_ALLOC_CONF:-${PYTORCH_ALLOC_CONF:-}}" \
  PYTHONPATH="$PWD/trainer_image:$PWD:$BASE_PYTHONPATH" FT_LAUNCHER="$shim" NPROC_PER_NODE="$NPROC" \
    MASTER_PORT=$((29500 + RANDOM % 1000)) FT_MAX_RESTARTS=0 timeout "$(limit $((2 * est)))" \
    trainer_image/entrypoint.sh "${base[@]}" --resiliency.inprocess=true "$@" 2>"$RUNS/$label.log" | fig
  done_run "$label" "${PIPESTATUS[0]}" "$t0"
}

titan() {  # label est_s [anchor args]: torchtitan on the same shape and settings
  local label=$1 est=$2 t0=$SECONDS rc; fits "$label" "$est" || return; shift 2
  say "torchtitan $label, timeout $(limit $((2 * est))) s"
  PYTHONPATH="$PWD/trainer_image:$PWD:$BASE_PYTHONPATH" PYTORCH_ALLOC_CONF="$TITAN_ALLOC_CONF" \
    timeout "$(limit $((2 * est)))" python3 \
    bench/anchor_torchtitan.py --config "$CONFIG" --nproc "$NPROC" --steps "$STEPS" --out "$RUNS/$label" \
    --label "$label" "$@" >"$RUNS/$label.log" 2>&1
  rc=$?
  if ! grep -q '{"figure"' "$RUNS/$label.log"; then  # it died before its JSON line: say so in the table
    python3 -c 'import json, sys; print(json.dumps({"figure": "anchor", "label": sys.argv[1], "error": f"exit {sys.argv[2]}: " + sys.argv[3]}))' \
      "$label" "$rc" "$(grep -v '^\s*$' "$RUNS/$label.log" | tail -n 1 | cut -c1-300)" >>"$RUNS/$label.log"
  fi
  fig <"$RUNS/$label.log"
  (( rc == 0 )) || tail -n 30 "$RUNS/$label.log" >&2
  done_run "$label" "$rc" "$t0"
}

part_headline() {
  say "torchtitan flavour check (no training)"
  PYTHONPATH="$PWD/trainer_image:$PWD:$BASE_PYTHONPATH" timeout 60 python3 bench/anchor_torchtitan.py \
    --config "$CONFIG" --check 2>>"$LOG" | fig
  if [[ " ${HEADLINE_MODES:-compiled eager} " == *" compiled "* ]]; then
    production ours-compiled 65 --train.compile=true
    titan titan-compiled 60 --compile
  fi
  if [[ " ${HEADLINE_MODES:-compiled eager} " == *" eager "* ]]; then
    production ours-eager 45 --train.compile=false
    titan titan-eager 55 --no-compile
  fi
}

part_alloc() {  # the headline's two trainer rows again with the allocator settings torchtitan's runs get
  OURS_ALLOC_CONF="$TITAN_ALLOC_CONF" production ours-compiled-alloc 80 --train.compile=true
  OURS_ALLOC_CONF="$TITAN_ALLOC_CONF" production ours-eager-alloc 45 --train.compile=false
}

part_nostandby() {  # the headline's compiled trainer row without the warm standby: what its start costs the steps
  TRAINER_STANDBY=0 production ours-compiled-nostandby 65 --train.compile=true
}

pick() {  # a variants JSON array, keeping only the labels whose part after ":" is in LOO_ONLY (when set)
  python3 -c 'import json, os, sys
only = os.environ.get("LOO_ONLY", "").split()
print(json.dumps([v for v in json.loads(sys.argv[1]) if not only or v["label"].split(":")[1] in only]))' "$1"
}

part_loo() {
  # Each variant leaves one change of issue 21 out; the label before ":" names the group's every-change-on row.
  # LOO_MODES (default "compiled eager"): which of the two groups run; LOO_ONLY (e.g. "fused-adamw torch-kernels"):
  # only those variants (the estimates below are for every variant).
  [[ " ${LOO_MODES:-compiled eager} " == *" compiled "* ]] && ours loo-compiled "$PWD" 220 --stop-at "$LOO_STOP" --profile-steps 3 --variants "$(pick '[
    {"label": "loo-compiled:fsdp-at-one-rank", "set": ["--train.single_rank=fsdp"]},
    {"label": "loo-compiled:plain-loss", "set": ["--train.chunked_loss=false"]},
    {"label": "loo-compiled:complex-rope", "set": ["--train.rope_kernel=complex"]},
    {"label": "loo-compiled:layers-off", "layers": "off"},
    {"label": "loo-compiled:straggler-off", "set": ["--resiliency.straggler=off"]},
    {"label": "loo-compiled:straggler-every-5", "set": ["--resiliency.straggler_report_every=5"]},
    {"label": "loo-compiled:keep-block-copies", "set": ["--train.reshard_after_forward=never"]},
    {"label": "loo-compiled:torch-kernels", "set": ["--train.kernels=torch"]},
    {"label": "loo-compiled:fused-adamw", "set": ["--optim.implementation=fused"]}
  ]')" -- --train.compile=true
  [[ " ${LOO_MODES:-compiled eager} " == *" eager "* ]] && ours loo-eager "$PWD" 100 --stop-at "$LOO_STOP" --variants "$(pick '[
    {"label": "loo-eager:torch-kernels", "set": ["--train.kernels=torch"]},
    {"label": "loo-eager:fused-adamw", "set": ["--optim.implementation=fused"]},
    {"label": "loo-eager:fsdp-at-one-rank", "set": ["--train.single_rank=fsdp"]},
    {"label": "loo-eager:plain-loss", "set": ["--train.chunked_loss=false"]},
    {"label": "loo-eager:keep-block-copies", "set": ["--train.reshard_after_forward=never"]}
  ]')" -- --train.compile=false
}

part_before() {
  ours before-compiled "${BEFORE_TREE:?set BEFORE_TREE to a trainer tree}" 80 --stop-at 20 \
    --variants '[{"label": "before-eager", "set": ["--train.compile=false"]}]' -- --train.compile=true
}

part_table() {
  PYTHONPATH="$PWD/trainer_image:$PWD:$BASE_PYTHONPATH" python3 bench/figures.py table "$FIG" | tee "$OUT/table.md"
}

pack() { tar -czf "$OUT/runs.tar.gz" -C "$RUNS" --exclude=ckpt --exclude=checkpoints --exclude=data . 2>/dev/null; }

say "suite: parts $*; deadline ${DEADLINE_S} s, hard stop ${HARD_S} s"
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
  [[ $part == table ]] || pack
done
say "done"
