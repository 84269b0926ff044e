#!/usr/bin/env bash
# NVRx 0.4.1 (the pin) against 0.7.0 on one GPU, in one call: each version's wheels in a site of its own (.whl: 0.4.1,
# pynvml, defusedxml; .whl07: 0.7.0 and what it needs beyond the image's packages), then gpu_suite.sh's recovery part
# with each (1b eager, 60 steps, an exception at step 25, a SIGKILL at step 45: in-process and in-job recovery).
# Straggler detection is off in both: 0.7.0 moved its module (nvidia_resiliency_ext.attribution.straggler).
#   OUT=$OUT bash bench/nvrx_ab.sh     (the device tool; carry .whl and .whl07)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/bench}"
for v in 04 07; do
  wheels=.whl; [[ $v == 07 ]] && wheels=.whl07
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "/tmp/site$v" "$wheels"/*.whl \
    || { echo "install of $wheels failed" >&2; exit 1; }
done
for v in ${NVRX_AB_ORDER:-04 07}; do
  version=$(PYTHONPATH=/tmp/site$v python3 -c 'import importlib.metadata as m; print(m.version("nvidia-resiliency-ext"))')
  echo "== NVRx $version" >&2
  PYTHONPATH="/tmp/site$v:$PWD/trainer_image:$PWD" PATH="/tmp/site$v/bin:$PATH" OUT="$OUT/nvrx$v" \
    BENCH_DATA="$OUT/data" TRAINER_OVERRIDES="--resiliency.straggler=off" bash bench/gpu_suite.sh recovery
  sed "s/^{/{\"nvrx\": \"$version\", /" "$OUT/nvrx$v/figures.jsonl" >> "$OUT/ab.jsonl"
done
