"""``train.profile_steps``: a ``torch.profiler`` trace of a few steps of a real run, on every rank.

``--train.profile_steps=30-32`` profiles steps 30 to 32 (host ops, and CUDA kernels and copies on a GPU) and writes
``<run_dir>/profile/rank<R>-steps30-32.json.gz``, a Chrome trace (chrome://tracing, Perfetto). Each step is one
``step N`` range; the checkpoint manager's call inside it is ``checkpoint.save``. Steps outside the window run
without the profiler. A run restarted inside the window (in-process or in-job) profiles the rest of it again."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, ContextManager

import torch

from trainer.config_checks import step_window

log = logging.getLogger(__name__)


class StepProfiler:
    """Starts the profiler at the first step of the window, ends it after the last (or when the loop ends) and
    exports the trace. ``step(n)`` at each step's start; ``label(name)`` marks a part of a step in the trace."""

    def __init__(self, spec: str, run_dir: str, rank: int, device: torch.device) -> None:
        self.window = step_window("train.profile_steps", spec)
        self.path = Path(run_dir) / "profile"
        self.rank, self.device = rank, device
        self.profiler: Any = None
        self.range: Any = None
        self.started = self.latest = 0  # the first and the latest step profiled

    def step(self, step: int) -> None:
        if self.window is None:
            return
        self._end_range()
        first, last = self.window
        if self.profiler is None and first <= step <= last:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.profiler = profile(activities=activities)
            self.profiler.__enter__()
            self.started = step
        if self.profiler is not None and step > last:
            self.close()
            return
        if self.profiler is not None:
            self.latest = step
            self.range = torch.profiler.record_function(f"step {step}")
            self.range.__enter__()

    def label(self, name: str) -> ContextManager[Any]:
        return torch.profiler.record_function(name) if self.profiler is not None else contextlib.nullcontext()

    def _end_range(self) -> None:
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None

    def close(self) -> None:
        """Ends the window and writes the trace: after its last step, or at the loop's end inside it (the name says
        which steps it holds). An attempt that failed inside it: ``discard``."""
        if self.profiler is None:
            return
        self._end_range()
        profiler, self.profiler = self.profiler, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the window's kernels in the trace
        profiler.__exit__(None, None, None)
        self.path.mkdir(parents=True, exist_ok=True)
        target = self.path / f"rank{self.rank}-steps{self.started}-{self.latest}.json.gz"
        profiler.export_chrome_trace(str(target))
        log.info("profile of steps %d-%d written to %s", self.started, self.latest, target)

    def discard(self) -> None:
        """Ends the window without a trace and without waiting for the device (an attempt that failed)."""
        profiler, self.profiler, self.range = self.profiler, None, None
        if profiler is not None:
            with contextlib.suppress(Exception):
                profiler.__exit__(None, None, None)
