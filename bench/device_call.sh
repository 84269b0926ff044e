#!/usr/bin/env bash
# One call on a lent GPU machine, its outputs packed so that they all come back (the machine returns a handful of
# files): the card and commit, then the parts asked for, each part's figures in $DEST/figures.jsonl and everything
# else in $DEST/raw.tar.gz, repacked after each part (a call cut short still returns what finished).
#
#   bash bench/device_call.sh DEST [PART ...]
#
# PART: any of bench/gpu_suite.sh's parts (goodput, restorepoint, injob, recovery, ...), `injob@N` (the in-job part
# with its SIGKILL at step N), `probe` (bench/pin_probe.py's release variants PROBE_VARIANTS, default
# plain,active,after) or `hugepages` (bench/hugepage_probe.sh). Needs the carried .whl/ (bench/gpu_env.sh) and
# .benchdata/data (docs/benchmarks.md). The commit is the one in .device-commit when present (a lent machine's
# checkout may show an older one), else git's.
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=$1; shift
RAW=/tmp/device-call/raw; rm -rf "$RAW"; mkdir -p "$RAW" "$DEST"  # outside DEST: only the archive comes back
source bench/gpu_env.sh || exit 1
commit=$(cat .device-commit 2>/dev/null || git rev-parse --short HEAD)
{ echo "commit $commit"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  cat /sys/kernel/mm/transparent_hugepage/shmem_enabled; } > "$DEST/gpu.txt" 2>&1
rm -rf /tmp/device-ckpt /dev/shm/pin-probe /dev/shm/resilient-* 2>/dev/null
export OUT="$RAW" BENCH_DATA="$PWD/.benchdata/data" BENCH_CKPT_ROOT=/tmp/device-ckpt
pack() {  # figures beside the archive; the archive replaced whole, never left half-written
  cp "$RAW/figures.jsonl" "$DEST/" 2>/dev/null
  tar -czf "$DEST/raw.tar.gz.part" -C "$(dirname "$RAW")" raw && mv "$DEST/raw.tar.gz.part" "$DEST/raw.tar.gz"
}
for part in "$@"; do
  case "$part" in
    injob@*) INJOB_FAULT_STEP=${part#injob@} INJOB_NAME="injob-${part#injob@}" bash bench/gpu_suite.sh injob ;;
    probe) python3 bench/pin_probe.py --gib 16.7 --slots 3 --device-gib 60 \
             --variants "${PROBE_VARIANTS:-plain,active,after}" --rounds "${PROBE_ROUNDS:-2}" \
             | tee -a "$RAW/figures.jsonl"
           rm -rf /dev/shm/pin-probe ;;
    hugepages) bash bench/hugepage_probe.sh | tee -a "$RAW/figures.jsonl" ;;
    *) bash bench/gpu_suite.sh "$part" ;;
  esac
  pack
done
ls -la "$DEST"
