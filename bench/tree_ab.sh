#!/usr/bin/env bash
# Same-call A/B of the trainer on two trees: the working tree ("new") against a base tree from a `git archive`
# tarball ("base"), alternated ROUNDS times, same flags, one GPU, eager. Each run's metrics and log land in
# $OUT/<name>-<tree>-<round>/, and its snapshot figures (bench/figures.py goodput: the steps around each snapshot
# against the median step) in $OUT/figures.jsonl.
#
#   git archive -o .ab/base.tar HEAD trainer_image            # here, before the device call; carry .ab
#   BASE=.ab/base.tar OUT=$OUT ROUNDS=1 bash bench/tree_ab.sh NAME [trainer flags...]
# NEW_FLAGS (word-split) go to the new tree's runs only (a flag the base tree does not know, e.g. a profile).
set -uo pipefail
cd "$(dirname "$0")/.."
name=$1; shift
OUT="${OUT:-runs/ab}"; ROUNDS="${ROUNDS:-1}"; INTERVAL="${INTERVAL:-10}"
DATA="${BENCH_DATA:-$PWD/.benchdata/data}"
CKPT_ROOT="${BENCH_CKPT_ROOT:-$PWD/.bench-ckpt}"
mkdir -p "$OUT"; base="$(mktemp -d)"
tar -xf "${BASE:?set BASE to a git archive of trainer_image}" -C "$base"
for round in $(seq 1 "$ROUNDS"); do
  for tree in base new; do
    root=$PWD extra=(${NEW_FLAGS:-}); [[ $tree == base ]] && root=$base extra=()
    run="$OUT/$name-$tree-$round"
    rm -rf "$CKPT_ROOT/ab"
    PYTHONPATH="$root/trainer_image:$PWD:${PYTHONPATH:-}" timeout "${AB_TIMEOUT_S:-300}" torchrun --standalone \
      --nproc-per-node 1 -m trainer --config "${AB_CONFIG:-1b}" --data.path="$DATA" --train.run_dir="$run" \
      --checkpoint.dir="$CKPT_ROOT/ab" --train.log_every=1 --train.compile=false --train.device="${AB_DEVICE:-cuda}" "$@" "${extra[@]}" >"$run.log" 2>&1
    echo "== $name $tree round $round: exit $?" >&2
    python3 bench/figures.py goodput "$run" --interval "$INTERVAL" | sed "s/^{/{\"tree\": \"$tree\", \"round\": $round, /" \
      | tee -a "$OUT/figures.jsonl"
  done
done
rm -rf "$CKPT_ROOT/ab" "$base"
