"""Hardware floors the GPU figures are held against, measured in the same run (one JSON line each).

``python bench/floors.py --dir /path/on/checkpoint/disk [--gib 4]`` prints: cold CUDA process start, pinned and
pageable device<->host copy bandwidth, pinned allocation time, and sequential write bandwidth with fsync.
``torchrun --nproc-per-node N bench/floors.py --nccl`` prints the NCCL init + first all-reduce time instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def emit(figure: str, value: float, unit: str, **extra: object) -> None:
    print(json.dumps({"figure": figure, "value": round(value, 4), "unit": unit, **extra}), flush=True)


def cold_start() -> None:
    code = "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    emit("cold_cuda_process_s", time.perf_counter() - t0, "s")


def copies(gib: float) -> None:
    import torch

    n = int(gib * 2**30)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.random_(0, 255)
    t0 = time.perf_counter()
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    emit("pinned_alloc_s", time.perf_counter() - t0, "s", gib=gib)
    pageable = torch.empty(n, dtype=torch.uint8)
    for name, host in (("pinned", pinned), ("pageable", pageable)):
        for direction in ("d2h", "h2d"):
            src, dst = (dev, host) if direction == "d2h" else (host, dev)
            dst.copy_(src, non_blocking=True)  # warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            emit(f"{direction}_{name}_GBps", n / (time.perf_counter() - t0) / 1e9, "GB/s", gib=gib)


def disk(directory: Path, gib: float) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "floors-write.bin"
    block = os.urandom(64 * 2**20)
    total = int(gib * 2**30) // len(block) * len(block)
    t0 = time.perf_counter()
    with path.open("wb") as f:
        for _ in range(total // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    emit("disk_write_fsync_GBps", total / (time.perf_counter() - t0) / 1e9, "GB/s", dir=str(directory), gib=gib)
    path.unlink()


def nccl_init() -> None:
    import datetime

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    t0 = time.perf_counter()
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    x = torch.ones(1, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    if rank == 0:
        emit("nccl_init_first_allreduce_s", elapsed, "s", world_size=dist.get_world_size())
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/floors"))
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--nccl", action="store_true")
    args = parser.parse_args()
    if args.nccl:
        nccl_init()
        return
    cold_start()
    copies(args.gib)
    disk(args.dir, args.gib)


if __name__ == "__main__":
    main()
