#!/usr/bin/env bash
# Do huge pages shorten what 4 KiB pages cost a node-local snapshot slot: its page-locking, and the release of a
# SIGKILLed worker's device memory (BENCHMARKS.md, "Recovery per layer": ~2 s with three 16.7 GiB page-locked slots,
# 0.09 s without; the takeover waits for it)? `bench/pin_probe.py` in /dev/shm (4 KiB pages where the host's
# transparent_hugepage/shmem_enabled is "never") and in a tmpfs mounted with huge=always, one after the other.
#
#   bash bench/hugepage_probe.sh [GIB]        GIB: slot size (16.7, the 1b model's); the JSON lines on stdout
#
# Needs the right to mount a tmpfs (root with CAP_SYS_ADMIN); without it, says so and measures /dev/shm only. In a
# cluster the same backing comes from a HugePages emptyDir (hugetlbfs, pages reserved on the node) or from the node's
# shmem_enabled=force; neither is set by the project.
set -uo pipefail
cd "$(dirname "$0")/.."
GIB="${1:-16.7}"
HUGE="${HUGE_DIR:-/mnt/pin-probe-huge}"
probe() {  # directory label
  python3 bench/pin_probe.py --dir "$1" --gib "$GIB" --slots 3 --device-gib 60 | sed "s/^{/{\"backing\": \"$2\", /"
  python3 bench/pin_probe.py --dir "$1" --gib "$GIB" --slots 3 --device-gib 60 --variants after --rounds 2 \
    | sed "s/^{/{\"backing\": \"$2\", /"
  rm -rf "$1"/*.data
}
probe /dev/shm/pin-probe "4k"
mkdir -p "$HUGE"
size=$(python3 -c "import math; print(math.ceil(3 * $GIB) + 8)")g
if mount -t tmpfs -o huge=always,size="$size" tmpfs "$HUGE" 2>/dev/null; then
  probe "$HUGE" "huge"
  grep -E "ShmemHugePages|ShmemPmdMapped" /proc/meminfo >&2
  umount "$HUGE"
else
  echo '{"figure": "skipped", "backing": "huge", "why": "cannot mount a tmpfs here"}'
fi
