"""Run the trainer in this process for a throughput benchmark: stop right after a given step (no final
checkpoint), optionally profile a few steps after the measured ones, with the recovery layers on or off.

    [torchrun --standalone --nproc-per-node N] python bench/trainer_run.py --stop-at 25 [--layers on|off]
        [--profile-steps 3] [--label NAME] -- --config 1b --data.path=DIR --train.run_dir=DIR [--section.key=value ...]

``--layers on`` runs ``resiliency.run(res, train)`` exactly as ``python -m trainer`` does (preemption agreement,
ledger, checkpoint manager, and the in-process Wrapper when ``--resiliency.inprocess=true``); ``off`` calls
``train()`` with the null layers of the unit tests. The trainer is imported from ``PYTHONPATH``, so the same
runner measures any tree of the trainer (``bench/throughput_suite.sh`` runs one tree per change).

The stop, the step clock and the profiler ride on the ``Layers`` hooks (``before_step``/``after_step``), which
every version of the loop calls once per step. Rank 0 prints one JSON line: ``bench/figures.py throughput`` over
the logged steps after ``--skip`` up to ``--stop-at`` (the trainer's own 10-step windows), the median of every
step's time on the GPU's timeline over the same steps (``StepClock``: no extra host sync), plus, with
``--profile-steps``, the profile's top CUDA kernels.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import StepClock, step_figure, throughput_figure  # noqa: E402

from trainer import resiliency  # noqa: E402
from trainer.config import parse_args  # noqa: E402
from trainer.exitcodes import ExitCode, TrainerExit  # noqa: E402
from trainer.train import Resources, train  # noqa: E402


class StopRun(TrainerExit):
    """Ends the run after ``--stop-at``; a ``TrainerExit``, so it passes through the in-process Wrapper."""


class StepProfiler:
    """``torch.profiler`` over ``count`` steps starting at ``start``; writes the kernel table to ``out``."""

    def __init__(self, start: int, count: int, out: Path) -> None:
        self.start, self.end, self.out = start, start + count - 1, out
        self.prof: torch.profiler.profile | None = None
        self.summary: dict = {}

    def before(self, step: int) -> None:
        if self.start <= step and self.prof is None and not self.summary:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()

    def after(self, step: int) -> None:
        if self.prof is None or step < self.end:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        self.summary = kernel_summary(self.prof, self.end - self.start + 1, self.out)
        self.prof = None


def kernel_summary(prof: torch.profiler.profile, steps: int, out: Path) -> dict:
    """Top device kernels by total time (ms per step) and the step's total kernel time."""
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total_us = sum(e.self_device_time_total for e in events)
    out.write_text(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=60) + "\n")
    top = [{"kernel": e.key[:90], "ms_per_step": round(e.self_device_time_total / 1e3 / steps, 2),
            "calls_per_step": round(e.count / steps, 1)} for e in events[:12]]
    return {"kernel_ms_per_step": round(total_us / 1e3 / steps, 1), "top_kernels": top}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stop-at", type=int, required=True, help="last measured step")
    parser.add_argument("--skip", type=int, default=10, help="warm-up steps left out of the figure")
    parser.add_argument("--layers", choices=("on", "off"), default="on")
    parser.add_argument("--profile-steps", type=int, default=0, help="profile this many steps after --stop-at")
    parser.add_argument("--label", default="")
    parser.add_argument("--variants", default="", help='JSON list of {"label", "set": [overrides], "layers", '
                        '"profile_steps"}: run each in turn in this process (run_dir/<label>), after the base run')
    args, rest = parser.parse_known_args()
    base = [a for a in rest if a != "--"]
    variants = [{"label": args.label, "set": [], "layers": args.layers, "profile_steps": args.profile_steps}]
    variants += json.loads(args.variants) if args.variants else []
    for i, variant in enumerate(variants):
        if i:  # a fresh start: no compiled graph, cached block or peak-memory record carried over
            torch._dynamo.reset()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
        figure = run_variant(base, variant, args.stop_at, args.skip, nested=i > 0)
        if figure is not None:
            print(json.dumps(figure), flush=True)
    return 0


def run_variant(base: list[str], variant: dict, stop_at: int, skip: int, nested: bool) -> dict | None:
    _, cfg = parse_args([*base, *variant.get("set", [])])
    if nested:
        cfg.train.run_dir = str(Path(cfg.train.run_dir) / variant["label"])
        cfg.checkpoint.dir = str(Path(cfg.train.run_dir) / "checkpoints")
    layers = variant.get("layers", "on")
    profile_steps = int(variant.get("profile_steps", 0))
    last = stop_at + profile_steps
    cfg.train.steps = max(cfg.train.steps, last + 1)  # never the last step: no final checkpoint
    run_dir = Path(cfg.train.run_dir)
    profiler = StepProfiler(stop_at + 1, profile_steps, run_dir / "profile.txt")
    clock = StepClock()

    def before_step(self: resiliency.Layers, step: int) -> None:
        clock.mark(step)
        if profile_steps:
            profiler.before(step)
        BEFORE_STEP(self, step)

    def after_step(self: resiliency.Layers, step: int, *rest: object) -> None:
        AFTER_STEP(self, step, *rest)
        if profile_steps:
            profiler.after(step)
        if step >= last:
            clock.mark(step + 1)
            raise StopRun(ExitCode.OK, f"benchmark: stopped after step {step}")

    resiliency.Layers.before_step = before_step  # type: ignore[method-assign]
    resiliency.Layers.after_step = after_step  # type: ignore[method-assign]
    res = Resources.create(cfg)
    try:
        if layers == "on":
            resiliency.run(res, train)
        else:
            train(res, None, resiliency.NULL())
    except StopRun:
        pass
    finally:
        # The benchmark is the whole job: trees with checkpoint tiers also drop their node-local snapshots.
        res.close(job_over=True)
        if dist.is_initialized():
            dist.destroy_process_group()
    seconds = clock.seconds()
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    try:
        figure = throughput_figure(run_dir, skip, stop_at)
    except ValueError as exc:
        figure = {"figure": "throughput", "error": str(exc)}
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len * int(os.environ.get("WORLD_SIZE", "1"))
    figure.update(step_figure(seconds, tokens_per_step, skip, stop_at))
    figure.update(label=variant.get("label") or run_dir.name, layers=layers, compile=cfg.train.compile,
                  overrides=variant.get("set", []), **profiler.summary)
    return figure


BEFORE_STEP, AFTER_STEP = resiliency.Layers.before_step, resiliency.Layers.after_step


if __name__ == "__main__":
    sys.exit(main())
