"""The snapshot taken at a fault: an in-process restart resumes from the last step that finished whole, not from the
last memory checkpoint. This module's one concern is knowing which step that is and what the rest of the state was
at its end.

An exception or a hang anywhere but in ``optimizer.step()`` leaves the model's parameters and the optimizer's state
as the last finished step left them: the next step's forward and backward write only gradients and activations.
What that step's end also was, the step counter, the RNG states, the data position (the next step may have drawn
its batch already) and the heartbeats' learned timeouts, is a few small dicts; ``WholeStep.mark`` keeps a copy of
them after each step's update, with a CUDA event recorded on the training stream behind the update, and
``WholeStep.updating`` forgets them before the next update begins.

After a fault, ``CheckpointManager.snapshot_at_fault`` (the failed attempt's end, before its ``unbind``) stages that
step into a free snapshot slot like any memory checkpoint, with the kept dicts as its rank state, its copy ordered
after the kept event only (a step hung behind it on the training stream does not hold it). The slot becomes a
snapshot at the next ``bind``, as one in flight at a fault does, and the restore's agreement takes the newest step
every rank holds: a rank that could not take it leaves the others at the snapshot before. It is taken only where it
saves ``MIN_STEPS`` or more (a snapshot in flight at the fault is its restore point already, and the drain of the
state to host memory costs about a step on an H100: BENCHMARKS.md, "Recovery per layer"); off with
``checkpoint.snapshot_at_fault=false``. A SIGKILL leaves no attempt's end: the in-job layer restores the newest
node-local snapshot as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.checkpoint.state import rank_state

MIN_STEPS = 2
"""A snapshot at the fault is taken where the newest snapshot is this many steps or more behind the last whole step."""


@dataclass
class Whole:
    """The last step that finished whole: its number, its rank state (``state.rank_state``) and the event behind its
    update on the training stream (None on the CPU)."""

    step: int
    rank_state: dict[str, Any]
    updated: Any


class WholeStep:
    """The training loop's marks around each update (``updating`` before ``optimizer.step()``, ``mark`` after the
    step's counter moved on); ``take`` hands the last whole step to the snapshot at a fault, once."""

    def __init__(self) -> None:
        self.whole: Whole | None = None

    def updating(self) -> None:
        self.whole = None

    def mark(self, step: int, state: dict[str, Any]) -> None:
        updated = None
        if next(state["model"].parameters()).is_cuda:
            updated = torch.cuda.Event()
            updated.record()
        self.whole = Whole(step, rank_state(state), updated)

    def take(self, newest: int | None) -> Whole | None:
        """The last whole step, where it is ``MIN_STEPS`` or more ahead of ``newest`` (the newest snapshot's step);
        None otherwise, or where no step finished whole since the attempt began or since the last update began."""
        whole, self.whole = self.whole, None
        if whole is None or (newest is not None and whole.step - newest < MIN_STEPS):
            return None
        return whole
