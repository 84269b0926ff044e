"""Checkpoint cost: blocking time per save (sync vs async), state bytes per rank, pinned D2H floor (GPU), and
training throughput with and without a checkpoint every N steps, side by side in one process. JSON lines on rank 0.

CPU:  PYTHONPATH=.:trainer_image .venv/bin/python bench/checkpoint_bench.py --config tiny
GPU:  torchrun --nproc-per-node=2 bench/checkpoint_bench.py --config 8b --train.activation_checkpointing=true
Extra arguments are config overrides (``--section.key=value``). Synthetic tokens: no dataset needed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
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


def run_steps(state: dict, steps: int, start: int, device: torch.device, ckpt: CheckpointManager | None, every: int) -> float:
    """Train ``steps`` steps; returns the seconds taken (the checkpointer saves every ``every`` steps if given).

    A write still in flight at the end is not waited for: over a long run it overlaps the following steps."""
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
        if ckpt is not None and step % every == 0:
            ckpt.save(step, state)
    sync(device)
    return time.perf_counter() - t0


def _remove(directory: Path, env: parallel.DistEnv) -> None:
    dist.barrier()
    if env.is_main:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--saves", type=int, default=5, help="saves per path (median reported)")
    parser.add_argument("--steps", type=int, default=20, help="steps per throughput phase")
    parser.add_argument("--every", type=int, default=5, help="checkpoint interval of the throughput phase")
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
    run_steps(state, 2, 1, device, None, 0)  # warm-up; creates the optimizer state
    emit(env, {"bench": "checkpoint", "config": args.config, "device": str(device), "world_size": env.world_size,
               "d2h_pinned_GBps": (bw / 1e9) if (bw := d2h_bandwidth(device)) else None})
    for mode in ("sync", "async"):
        cfg.checkpoint.async_save = mode == "async"
        cfg.checkpoint.interval = 1
        mgr = CheckpointManager(cfg.checkpoint, root / mode, env, cfg.to_json())
        mgr.bind()
        step = 0
        for step in range(1, args.saves + 1):
            run_steps(state, 1, step, device, None, 0)
            mgr.wait_for_staging()
            mgr.save(step, state)
            mgr.wait_for_staging()
        mgr.save(step, state, last_step=True)
        nbytes = mgr._staging.nbytes()
        blocking = mgr.blocking_s[:-1] if len(mgr.blocking_s) > 1 else mgr.blocking_s
        emit(env, {"path": mode, "saves": args.saves, "blocking_s_median": statistics.median(blocking),
                   "blocking_s_all": [round(b, 4) for b in blocking], "state_bytes_per_rank": nbytes,
                   "floor_s": (nbytes / bw) if device.type == "cuda" and bw else None})
        mgr.unbind()
        mgr.close()
        _remove(root / mode, env)  # checkpoints of a large model fill a disk quickly
    tokens = cfg.train.batch_size * cfg.data.seq_len * env.world_size * args.steps
    cfg.checkpoint.async_save = True
    mgr = CheckpointManager(cfg.checkpoint, root / "throughput", env, cfg.to_json())
    mgr.bind()
    mgr.save(99, state, force=True)  # warm-up: this manager's staging buffers are allocated once, here
    base = run_steps(state, args.steps, 100, device, None, 0)
    with_ckpt = run_steps(state, args.steps, 100 + args.steps, device, mgr, args.every)
    started = time.perf_counter()
    mgr.save(100 + 2 * args.steps, state, force=True)  # drain the last write (reported, not in the ratio)
    drain = time.perf_counter() - started
    emit(env, {"throughput": "tokens_per_s", "without_ckpt": tokens / base, "with_async_ckpt": tokens / with_ckpt,
               "ratio": base / with_ckpt, "every_steps": args.every, "steps": args.steps,
               "final_drain_s": drain, "first_save_s": mgr.blocking_s[0]})
    mgr.unbind()
    mgr.close()
    _remove(root / "throughput", env)
    parallel.destroy_process_group()


if __name__ == "__main__":
    main()
