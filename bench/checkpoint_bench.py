"""Checkpoint tiers' cost, side by side in one process; JSON lines on rank 0:

- the pinned device-to-host floor, and the blocking time of a memory checkpoint (a snapshot into the slot;
  its copy overlaps the next step's forward and backward) against it;
- training throughput with no checkpoint, with a memory checkpoint every ``--every`` steps, and with every
  ``--persist-every``-th of those also written to disk in the background;
- loading the persisted checkpoint from disk (verified while read) against the disk's read floor, measured in
  the same process with the page cache dropped first (root only; otherwise said in the record).

CPU:  PYTHONPATH=.:trainer_image .venv/bin/python bench/checkpoint_bench.py --config tiny
GPU:  torchrun --nproc-per-node=1 bench/checkpoint_bench.py --config 1b --train.compile=false
Extra arguments are config overrides (``--section.key=value``). Synthetic tokens: no dataset needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer import parallel
from trainer.checkpoint import CheckpointManager
from trainer.config import load_config
from trainer.train import TrainProgress, build_model, build_optimizer

D2H_BYTES = 2 * 2**30


class SyntheticLoader:
    """Random tokens; a resumable position like TokenLoader's."""

    def __init__(self, vocab: int, batch: int, seq: int, device: torch.device) -> None:
        self.vocab, self.batch, self.seq, self.device, self.position = vocab, batch, seq, device, 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.position += 1
        tokens = torch.randint(0, self.vocab, (self.batch, self.seq + 1), device=self.device)
        return tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def emit(env: parallel.DistEnv, record: dict) -> None:
    if env.is_main:
        print(json.dumps(record), flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def d2h_bandwidth(device: torch.device) -> float | None:
    """Pinned device-to-host copy rate (bytes/s): the floor of an async save's blocking time."""
    if device.type != "cuda":
        return None
    src = torch.empty(D2H_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty(D2H_BYTES, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    sync(device)
    return D2H_BYTES / (time.perf_counter() - start)


def run_steps(state: dict, steps: int, start: int, device: torch.device, ckpt: CheckpointManager | None) -> float:
    """Train ``steps`` steps as the trainer's loop does (the manager decides when a checkpoint is due); returns the
    seconds taken. A write still in flight at the end is not waited for: over a long run it overlaps later steps."""
    model, optimizer, loader = state["model"], state["optimizer"], state["dataloader"]
    sync(device)
    t0 = time.perf_counter()
    for step in range(start, start + steps):
        inputs, targets = loader.next_batch()
        F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten(0, 1)).backward()
        if ckpt is not None:
            ckpt.wait_for_staging()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["progress"].step = step
        if ckpt is not None:
            ckpt.save(step, state)
    sync(device)
    return time.perf_counter() - t0


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def read_floor(directory: Path) -> tuple[int, float]:
    """Bytes and seconds to read every file under ``directory`` sequentially (one reader per file, in parallel)."""
    files = [p for p in directory.rglob("*") if p.is_file()]

    def read(path: Path) -> int:
        n = 0
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(64 * 2**20):
                n += len(chunk)
        return n

    start = time.perf_counter()
    with ThreadPoolExecutor(max(1, len(files))) as pool:
        total = sum(pool.map(read, files))
    return total, time.perf_counter() - start


def manager(cfg, directory: Path, env: parallel.DistEnv, **overrides) -> CheckpointManager:
    ckpt_cfg = dataclasses.replace(cfg.checkpoint, **overrides)
    mgr = CheckpointManager(ckpt_cfg, directory, env, cfg.to_json())
    mgr.bind()
    return mgr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--steps", type=int, default=50, help="steps per throughput phase")
    parser.add_argument("--every", type=int, default=25, help="memory checkpoint interval")
    parser.add_argument("--persist-every", type=int, default=2, help="every N-th memory checkpoint also to disk")
    parser.add_argument("--dir", default="", help="checkpoint directory (default: a temp dir)")
    args, overrides = parser.parse_known_args()
    cfg = load_config(args.config, ["--data.path=synthetic", *overrides])
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = 32000
    env = parallel.DistEnv.from_environ()
    device = parallel.select_device(cfg.train, env)
    parallel.init_process_group(device, env, 600.0)
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    model = build_model(cfg, device)
    state = {"model": model, "optimizer": build_optimizer(model, cfg.optim), "progress": TrainProgress(),
             "dataloader": SyntheticLoader(cfg.model.vocab_size, cfg.train.batch_size, cfg.data.seq_len, device)}
    run_steps(state, 3, 1, device, None)  # warm-up; creates the optimizer state
    bw = d2h_bandwidth(device)
    tokens = cfg.train.batch_size * cfg.data.seq_len * env.world_size * args.steps
    step = 100
    # Memory checkpoints only: warm the slots up (allocation and pinning happen once per slot), then measure.
    mem = manager(cfg, root / "memory", env, interval=args.every, persist_every=0, node_local=False)
    run_steps(state, 2 * args.every, step, device, mem)
    step += 2 * args.every
    nbytes = mem.snapshots.slots[0].buffer.numel()
    warm = len(mem.blocking_s)
    base = run_steps(state, args.steps, step, device, None)
    step += args.steps
    with_mem = run_steps(state, args.steps, step, device, mem)
    step += args.steps
    blocking = mem.blocking_s[warm:]
    emit(env, {"bench": "memory_checkpoint", "config": args.config, "device": str(device), "world_size": env.world_size,
               "state_bytes_per_rank": nbytes, "d2h_pinned_GBps": round(bw / 1e9, 2) if bw else None,
               "d2h_floor_s": round(nbytes / bw, 4) if bw else None,
               "blocking_s_median": round(statistics.median(blocking), 4) if blocking else None,
               "blocking_over_floor": round(statistics.median(blocking) / (nbytes / bw), 3) if bw and blocking else None,
               "first_snapshots_s": [round(b, 3) for b in mem.blocking_s[:warm]],
               "tokens_per_s_none": round(tokens / base), "tokens_per_s_memory": round(tokens / with_mem),
               "throughput_ratio": round(base / with_mem, 4), "every_steps": args.every, "steps": args.steps})
    mem.close(job_over=True)
    # Memory checkpoints, every persist_every-th written to disk in the background.
    disk = manager(cfg, root / "disk", env, interval=args.every, persist_every=args.persist_every, node_local=False)
    run_steps(state, 2 * args.every, step, device, disk)  # warm-up: slots and the writer process
    step += 2 * args.every
    base = run_steps(state, args.steps, step, device, None)
    step += args.steps
    with_disk = run_steps(state, args.steps, step, device, disk)
    step += args.steps
    started = time.perf_counter()
    disk.save(step, state, force=True)  # drain: the newest state, committed
    drain = time.perf_counter() - started
    emit(env, {"bench": "persisted_checkpoint", "tokens_per_s_none": round(tokens / base),
               "tokens_per_s_with_persist": round(tokens / with_disk), "throughput_ratio": round(base / with_disk, 4),
               "every_steps": args.every, "persist_every": args.persist_every, "final_sync_save_s": round(drain, 3)})
    disk.close(job_over=True)
    # Loading from disk, verified while read, against the read floor (both with a cold page cache).
    dist.barrier()
    cold = drop_page_cache() if env.is_main else False
    committed = root / "disk" / f"step-{step:08d}"
    floor_bytes, floor_s = read_floor(committed)
    cold = drop_page_cache() and cold
    loader = manager(cfg, root / "disk", env, node_local=False)
    started = time.perf_counter()
    loaded = loader.load_latest(state)
    sync(device)
    load_s = time.perf_counter() - started
    emit(env, {"bench": "disk_load", "step": loaded, "bytes": floor_bytes, "read_floor_s": round(floor_s, 3),
               "read_floor_GBps": round(floor_bytes / floor_s / 1e9, 3), "load_s": round(load_s, 3),
               "load_over_floor": round(load_s / floor_s, 3), "page_cache_dropped": cold,
               "verify_checksums": cfg.checkpoint.verify_checksums})
    loader.close(job_over=True)
    dist.barrier()
    if env.is_main:
        shutil.rmtree(root, ignore_errors=True)  # checkpoints of a large model fill a disk quickly
    parallel.destroy_process_group()


if __name__ == "__main__":
    main()
