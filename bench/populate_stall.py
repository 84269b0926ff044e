"""How much a new snapshot slot's population stalls a training loop on this host: ``chunked.populate`` (through
``slots.map_file``, as the reservation calls it) against the same population with each populating thread's whole range
in one torch call (``SERIAL_PAGES`` unbounded: the intra-op pool fans every call out over all CPUs).

While a slot of ``--gib`` GiB is populated in a background thread, the main thread runs fixed iterations: on a GPU
a chain of bf16 matmuls and a synchronize (~``--iter-ms`` ms, launched from the host like a training step), else a
CPU busy-loop of that length. Each iteration's time against the median of the iterations before the population
began gives the stall: the excess summed, and the largest. ``/proc/self/task`` is sampled for the peak thread count.
The variants alternate, ``--rounds`` times each; the file is removed between rounds.

Prints one JSON line per round and variant.

    python bench/populate_stall.py --gib 16.7 --rounds 2
    python bench/populate_stall.py --gib 4 --rounds 3 --intra-op-threads 16   # the 2-core machine
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "trainer_image")]

import torch  # noqa: E402

from trainer.checkpoint import chunked  # noqa: E402
from trainer.checkpoint.slots import map_file  # noqa: E402


def iteration(ms: float, device: torch.device, operands: tuple[torch.Tensor, torch.Tensor] | None,
              matmuls: int) -> None:
    if operands is None:
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            pass
        return
    a, b = operands
    for _ in range(matmuls):
        a = a @ b
    torch.cuda.synchronize(device)


def calibrate(ms: float, device: torch.device) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, int]:
    if device.type != "cuda":
        return None, 0
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16) / 64
    b = torch.eye(4096, device=device, dtype=torch.bfloat16)
    iteration(0, device, (a, b), 20)
    began = time.perf_counter()
    iteration(0, device, (a, b), 50)
    per = (time.perf_counter() - began) / 50
    return (a, b), max(1, round(ms / 1e3 / per))


def measure(variant: str, nbytes: int, ms: float, device: torch.device, operands, matmuls: int,
            directory: Path) -> dict:
    serial = chunked.SERIAL_PAGES
    chunked.SERIAL_PAGES = 10**12 if variant == "whole-range" else serial
    path = directory / f"slot-{variant}.data"
    before = []
    for _ in range(20):
        began = time.perf_counter()
        iteration(ms, device, operands, matmuls)
        before.append(time.perf_counter() - began)
    base = statistics.median(before)
    peak, done = [len(os.listdir("/proc/self/task"))], threading.Event()
    took: list[float] = []

    def populate() -> None:
        began = time.perf_counter()
        map_file(path, nbytes, allocate=True)
        took.append(time.perf_counter() - began)
        done.set()

    thread = threading.Thread(target=populate, daemon=True)
    times = []
    thread.start()
    try:
        while not done.is_set():
            began = time.perf_counter()
            iteration(ms, device, operands, matmuls)
            times.append(time.perf_counter() - began)
            peak[0] = max(peak[0], len(os.listdir("/proc/self/task")))
        thread.join()
    finally:
        chunked.SERIAL_PAGES = serial
        path.unlink(missing_ok=True)
    excess = [max(0.0, t - base) for t in times]
    return {"figure": "populate_stall", "variant": variant, "slot_gib": round(nbytes / 2**30, 2),
            "populate_s": round(took[0], 2), "threads_populating": chunked.populate_threads(),
            "intra_op_threads": torch.get_num_threads(), "threads_peak": peak[0], "iteration_s": round(base, 4),
            "iterations": len(times), "excess_s": round(sum(excess), 3), "largest_excess_s": round(max(excess), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=16.7)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iter-ms", type=float, default=50.0)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--intra-op-threads", type=int, default=0,
                        help="torch.set_num_threads first (0: torch's default, one per core): a worker's pool on a "
                             "host with more cores than this one")
    args = parser.parse_args()
    if args.intra_op_threads:
        torch.set_num_threads(args.intra_op_threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    operands, matmuls = calibrate(args.iter_ms, device)
    directory = Path(tempfile.mkdtemp(prefix="populate-stall-", dir=args.dir))
    try:
        for _ in range(args.rounds):
            for variant in ("whole-range", "serial"):
                print(json.dumps(measure(variant, int(args.gib * 2**30) // 4096 * 4096, args.iter_ms, device,
                                         operands, matmuls, directory)), flush=True)
    finally:
        for leftover in directory.iterdir():
            leftover.unlink()
        directory.rmdir()


if __name__ == "__main__":
    main()
