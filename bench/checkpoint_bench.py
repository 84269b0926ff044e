"""Checkpoint tiers' cost as a run uses them, in one process; JSON lines on rank 0 (stdout):

- ``memory_checkpoint``: the pinned device-to-host floor of this rank's state, and how long each memory
  checkpoint blocks the training loop's host thread (``blocking_s``) against it; the first snapshots' cost;
- ``snapshot_cost``: what a snapshot really costs. A memory checkpoint every ``--every`` steps with node-local
  publication on and every ``--persist-every``-th one written to disk in the background, as a run does: every
  step is timed (the training stream synchronised at its end, not the copy's), and the steps holding a snapshot
  (its own and the next, whose optimizer step waits for the copy) are compared with the steps without; the same
  number of steps with no checkpoint at all, before and after, is the baseline (``throughput_ratio``);
- ``persisted_checkpoint``: the persistent tier over that phase (writes committed, deferred) and the final save;
- ``disk_load``: loading the final checkpoint from disk (verified while read) against the disk's read floor, the
  page cache dropped first (root only; otherwise said in the record).

``--profile`` adds ``snapshot_profile``: the top CPU and CUDA ops of one snapshot's two steps (torch.profiler key
averages; the tables go to stderr).

CPU:  PYTHONPATH=.:trainer_image .venv/bin/python bench/checkpoint_bench.py --config tiny
GPU:  torchrun --nproc-per-node=1 bench/checkpoint_bench.py --config 1b --train.compile=false [--profile]
Extra arguments are config overrides (``--section.key=value``, e.g. ``--checkpoint.device_staging=off``).
Synthetic tokens: no dataset needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
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


def run_steps(state: dict, steps: int, start: int, device: torch.device, ckpt: CheckpointManager | None,
              times: list[float] | None = None) -> float:
    """Train ``steps`` steps as the trainer's loop does (the manager decides when a checkpoint is due); returns the
    seconds taken. With ``times``, each step is timed: the training stream is synchronised at its end (a copy or
    a write still running on the side is not waited for, as in the trainer). A write still in flight at the end
    is not waited for either: over a long run it overlaps later steps."""
    model, optimizer, loader = state["model"], state["optimizer"], state["dataloader"]
    sync(device)
    t0 = last = time.perf_counter()
    for step in range(start, start + steps):
        if ckpt is not None:
            ckpt.before_step(step)  # as the trainer's loop: the next part of a snapshot's drain
        inputs, targets = loader.next_batch()
        F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten(0, 1)).backward()
        if ckpt is not None:
            ckpt.wait_for_staging()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["progress"].step = step
        if ckpt is not None:
            ckpt.save(step, state)
        if times is not None:
            sync_training(device)
            now = time.perf_counter()
            times.append(now - last)
            last = now
    sync(device)
    return time.perf_counter() - t0


def sync_training(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def snapshot_costs(times: list[float], start: int, every: int, plain_s: float) -> dict:
    """Per-step times of a phase starting at step ``start`` with a snapshot every ``every`` steps: a snapshot's
    cost is its step and the next one (where the optimizer step waits for the copy) minus two plain steps."""
    steps = range(start, start + len(times))
    window = {s for s in steps if s % every == 0} | {s + 1 for s in steps if s % every == 0}
    with_snapshot = [t for s, t in zip(steps, times) if s in window]
    without = [t for s, t in zip(steps, times) if s not in window]
    pairs = [times[i] + times[i + 1] for i, s in enumerate(steps) if s % every == 0 and i + 1 < len(times)]
    between = statistics.median(without) if without else plain_s
    cost = statistics.median(pairs) - 2 * between if pairs else None
    return {
        "step_s_plain": round(plain_s, 4), "step_s_between_snapshots": round(between, 4),
        "step_s_snapshot_step": round(statistics.median([t for s, t in zip(steps, times) if s % every == 0]), 4)
        if pairs else None,
        "step_s_after_snapshot": round(statistics.median([t for s, t in zip(steps, times)
                                                          if s % every == 1 and s - 1 in window]), 4) if pairs else None,
        "snapshot_cost_s": round(cost, 4) if cost is not None else None,
        "snapshot_cost_vs_plain_s": round(statistics.median(pairs) - 2 * plain_s, 4) if pairs else None,
        "cost_fraction_of_step_time": round(cost / (every * plain_s), 4) if cost is not None else None,
        "snapshots": len(pairs), "steps_with_snapshot": len(with_snapshot),
    }


def profile_snapshot(state: dict, start: int, device: torch.device, ckpt: CheckpointManager, every: int) -> dict:
    """torch.profiler over one snapshot's two steps (the snapshot step and the next): the top ops by self time."""
    from torch.profiler import ProfilerActivity, profile

    first = (start // every + 1) * every  # the next snapshot step
    run_steps(state, first - start, start, device, ckpt)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run_steps(state, 2, first, device, ckpt)
    averages = prof.key_averages()
    out: dict = {"bench": "snapshot_profile", "steps": [first, first + 1]}
    for kind, key in (("cpu", "self_cpu_time_total"), ("cuda", "self_device_time_total")):
        if kind == "cuda" and device.type != "cuda":
            continue
        rows = sorted(averages, key=lambda e: getattr(e, key, 0), reverse=True)[:12]
        out[f"top_{kind}_ms"] = [[e.key[:60], round(getattr(e, key, 0) / 1e3, 2), e.count] for e in rows]
        print(averages.table(sort_by=key, row_limit=15), file=sys.stderr, flush=True)
    out["next_step"] = first + 2
    return out


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
    parser.add_argument("--profile", action="store_true", help="profile one snapshot's steps (torch.profiler)")
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
    step = 100
    # The tiers as a run uses them: node-local publication on, every persist_every-th snapshot written to disk.
    tiers = manager(cfg, root / "tiers", env, interval=args.every, persist_every=args.persist_every, node_local=True)
    tiers.load_latest(state)  # reserves the slots in the background, as the trainer does at start
    first: list[float] = []
    run_steps(state, 2 * args.every, step, device, tiers, first)  # the first snapshots: slots, writer process
    first_snapshots = [round(first[i] + first[i + 1], 3) for i in range(len(first) - 1) if (step + i) % args.every == 0]
    step += 2 * args.every
    warm = len(tiers.blocking_s)
    nbytes = tiers.snapshots.slots[0].buffer.numel()
    plain_times: list[float] = []
    base = run_steps(state, args.steps, step, device, None, plain_times)
    step += args.steps
    tier_times: list[float] = []
    phase_start, persisted_before = step, tiers.persistent.last_committed
    with_tiers = run_steps(state, args.steps, step, device, tiers, tier_times)
    step += args.steps
    base += run_steps(state, args.steps, step, device, None, plain_times)
    step += args.steps
    base /= 2
    blocking = tiers.blocking_s[warm:]
    plain_s = statistics.median(plain_times)
    tokens = cfg.train.batch_size * cfg.data.seq_len * env.world_size * args.steps
    emit(env, {"bench": "memory_checkpoint", "config": args.config, "device": str(device), "world_size": env.world_size,
               "state_bytes_per_rank": nbytes, "d2h_pinned_GBps": round(bw / 1e9, 2) if bw else None,
               "d2h_floor_s": round(nbytes / bw, 4) if bw else None,
               "device_staging": type(tiers._copier).__name__ if tiers._copier is not None else None,
               "blocking_s_median": round(statistics.median(blocking), 4) if blocking else None,
               "blocking_over_floor": round(statistics.median(blocking) / (nbytes / bw), 3) if bw and blocking else None,
               "first_snapshots_blocking_s": [round(b, 3) for b in tiers.blocking_s[:warm]],
               "first_snapshots_two_steps_s": first_snapshots, "node_local": True})
    emit(env, {"bench": "snapshot_cost", "every_steps": args.every, "persist_every": args.persist_every,
               "steps": args.steps, "tokens_per_s_none": round(tokens / base),
               "tokens_per_s_tiers": round(tokens / with_tiers), "throughput_ratio": round(base / with_tiers, 4),
               **snapshot_costs(tier_times, phase_start, args.every, plain_s)})
    if args.profile:
        record = profile_snapshot(state, step, device, tiers, args.every)
        step = record.pop("next_step")
        emit(env, record)
    writes_committed = tiers.persistent.last_committed
    started = time.perf_counter()
    tiers.save(step, state, last_step=True)  # the final save: the newest state, committed, written once
    final_s = time.perf_counter() - started
    shard_bytes = sum(p.stat().st_size for p in (root / "tiers" / f"step-{step:08d}").glob("shard-*"))
    emit(env, {"bench": "persisted_checkpoint", "persist_every": args.persist_every,
               "last_committed_before_phase": persisted_before, "last_committed_after_phase": writes_committed,
               "behind_episode_open": tiers.persist_policy.behind is not None,
               "final_save_s": round(final_s, 3), "final_save_bytes": shard_bytes,
               "final_save_GBps": round(shard_bytes / final_s / 1e9, 3) if final_s else None})
    tiers.close(job_over=True)
    # Loading from disk, verified while read, against the read floor (both with a cold page cache).
    dist.barrier()
    cold = drop_page_cache() if env.is_main else False
    committed = root / "tiers" / f"step-{step:08d}"
    floor_bytes, floor_s = read_floor(committed)
    cold = drop_page_cache() and cold
    loader = manager(cfg, root / "tiers", env, node_local=False)
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
