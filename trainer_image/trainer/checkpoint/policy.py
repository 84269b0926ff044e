"""When a memory checkpoint is due (every ``checkpoint.interval`` steps, or ``"auto"`` by Young/Daly with the MTBF of
``checkpoint.mtbf_s`` or, when it is 0, of the planner's failure model at the job's size), and which
of them also go to the persistent tier (``PersistPolicy``)."""

from __future__ import annotations

import collections
import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

from trainer.planning import failures

log = logging.getLogger(__name__)

AUTO_FIRST_STEP = 5
"""With ``interval = "auto"``: the first snapshot, after the first steps' warm-up (compilation, allocator)."""
AUTO_PROBE_STEPS = 5
"""... and the next ones, until one snapshot's cost has been measured and the interval is chosen. The first snapshot
of a process is not measured: it pays one-time costs (the slots' reservation, the writer's start, the device
staging buffer) that would make Young/Daly choose an interval several times too long."""
AUTO_COST_WINDOW = 4
"""A snapshot's cost is the extra time of the steps after it, up to this many (or until the next one): on a GPU
the staging copies run beside the next step and the drain to host memory beside the ones after (H200, ``1b``:
+1.5, +9.7, +4.1, +1.7 ms at S..S+3), so the snapshot step alone shows a fraction of it."""
_MIN_COST_S = 1e-3


def interval_mtbf(cfg: Any, world_size: int) -> tuple[float, str]:
    """The MTBF ``interval = "auto"`` uses, and its basis for the ledger: ``checkpoint.mtbf_s`` when > 0, else the
    MTBF of ``checkpoint.failure_model`` at the job's size (one GPU a rank: ``world_size`` GPUs)."""
    if cfg.mtbf_s > 0:
        return float(cfg.mtbf_s), "checkpoint.mtbf_s"
    model = failures.load(cfg.failure_model)
    return model.mtbf_s(world_size), f"failure model {model.name} at {world_size} GPU(s)"


def young_daly_steps(cost_s: float, step_s: float, mtbf_s: float) -> int:
    """Young/Daly's optimal checkpoint period sqrt(2 * cost * MTBF), in steps (at least 1)."""
    return max(1, round(math.sqrt(2.0 * max(cost_s, _MIN_COST_S) * mtbf_s) / max(step_s, 1e-6)))


class IntervalPolicy:
    """Decides the steps at which a memory checkpoint is due. Ranks stay in step because the inputs of every
    decision are agreed at the previous due step (``CheckpointManager`` all-reduces them)."""

    def __init__(self, interval: int | str, mtbf_s: float) -> None:
        self.auto = interval == "auto"
        self.every = 0 if self.auto else int(interval)
        self.mtbf_s = mtbf_s
        self.next_due = AUTO_FIRST_STEP
        self.chosen: int | None = None
        self._last_t: float | None = None
        self._since: int | None = None
        """Steps since the last snapshot (None before the first)."""
        self._snapshots = 0
        self.owed_since: int | None = None
        """The step of a due snapshot that was deferred (its slot not ready yet): every step is due until one is
        taken."""
        self._plain: collections.deque[float] = collections.deque(maxlen=50)
        self._snap: collections.deque[tuple[float, int]] = collections.deque(maxlen=8)
        """(summed duration, steps) of the steps after each measured snapshot (``AUTO_COST_WINDOW``)."""
        self._window_s: float | None = None
        """The steps after the last snapshot so far (``_since`` of them), summed; None: not measured."""

    def tick(self) -> None:
        """Called once per step (from ``save``): the time since the last call is one step's duration (the
        first after a snapshot includes the save's own work)."""
        now = time.perf_counter()
        if self._last_t is not None:
            duration = now - self._last_t
            if self._since is not None:
                self._since += 1
            if self._since is None or self._since > AUTO_COST_WINDOW:  # a plain step: no snapshot's cost in it
                self._plain.append(duration)
            if self._window_s is not None:
                self._window_s += duration
                if self._since == AUTO_COST_WINDOW:
                    self._close_window()
        self._last_t = now

    def _close_window(self) -> None:
        if self._window_s is not None and self._since:
            self._snap.append((self._window_s, self._since))
        self._window_s = None

    def due(self, step: int) -> bool:
        return self.steps_to_next(step) == 0

    def steps_to_next(self, step: int) -> int | None:
        """Steps from ``step`` to the next step due (0: ``step`` itself); None when none is scheduled."""
        if self.owed_since is not None:
            return 0
        if self.auto:
            return max(0, self.next_due - step)
        return (-step) % self.every if self.every > 0 else None

    def defer(self, step: int) -> bool:
        """The snapshot due at ``step`` could not be staged yet (``CheckpointManager``: every rank agreed). True
        when this starts a deferral (none was owed)."""
        first = self.owed_since is None
        self.owed_since = step if first else self.owed_since
        return first

    def measurements(self) -> tuple[float, float]:
        """(step time without a snapshot, extra time of a step with one); -1 for what is not measured yet."""
        step_s = statistics.median(self._plain) if self._plain else -1.0
        if not self._snap or step_s <= 0:
            return step_s, -1.0
        return step_s, max(_MIN_COST_S, statistics.median(total - steps * step_s for total, steps in self._snap))

    def snapshot_taken(self, step: int, step_s: float, cost_s: float) -> int | None:
        """After a snapshot at ``step``, with the agreed (maximum over ranks) step time and snapshot cost.
        Returns the newly chosen interval when ``auto`` chose one (to be logged and recorded), else None."""
        self.owed_since = None
        self._close_window()  # the previous snapshot's steps end here (an interval shorter than the window)
        self._since = 0
        self._window_s = 0.0 if self._snapshots > 0 else None  # the first one's one-time costs are not its cost
        self._snapshots += 1
        if not self.auto:
            return None
        if step_s <= 0 or cost_s <= 0:
            self.next_due = step + AUTO_PROBE_STEPS
            return None
        interval = young_daly_steps(cost_s, step_s, self.mtbf_s)
        self.next_due = step + interval
        changed = self.chosen is None or abs(interval - self.chosen) > 0.2 * self.chosen
        self.chosen = interval
        return interval if changed else None


@dataclass
class _Behind:
    """An episode in which the persistent tier could not keep up with ``persist_every``."""

    since_step: int
    since_t: float
    deferred: int = 1
    max_steps: int = 0
    max_s: float = 0.0


class PersistPolicy:
    """Which memory checkpoints are also written to the persistent tier: every ``persist_every``-th one. One that
    falls due while the previous write is still in flight is not skipped: it is owed, and the next memory
    checkpoint that finds the writer free (the newest one by then) is persisted, so the persistent tier is at
    most one interval behind the writer's pace. The memory tier never waits for it (only the slot being
    written is held). The log says when the persistent tier falls behind and by how much, once per episode.

    Every input of ``decide`` is agreed across ranks (``CheckpointManager`` all-reduces ``wants()`` and whether a
    write is in flight), so the ranks' counters stay identical; one that drifted (a rank that failed while
    staging) is realigned at the next persisted checkpoint."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.since = 0
        """Memory checkpoints taken since the last persisted one."""
        self.owed = False
        """A persist fell due while a write was in flight: the next memory checkpoint with the writer free is persisted."""
        self.behind: _Behind | None = None

    def wants(self) -> bool:
        """Whether this rank's next memory checkpoint is due for the persistent tier (to be agreed: MAX over ranks)."""
        return self.owed or (self.every > 0 and self.since + 1 >= self.every)

    def decide(self, step: int, want: bool, idle: bool, final: bool, lag: tuple[int, float] | None,
               writing: tuple[int, float] | None) -> bool:
        """A memory checkpoint of ``step`` is taken: persist it? ``want``: agreed ``wants()``; ``idle``: no write
        in flight on any rank; ``final``: the run's last or a preemption's checkpoint (always persisted). ``lag``:
        (steps, seconds) since the newest committed checkpoint's snapshot, None when this process committed none;
        ``writing``: (step, seconds running) of the write in flight. Both only go into the log."""
        self.since += 1
        if final or (want and idle):
            self.since, self.owed = 0, False
            return True
        if want:
            self.owed = True
            self._fell_behind(step, lag, writing)
        return False

    def _fell_behind(self, step: int, lag: tuple[int, float] | None, writing: tuple[int, float] | None) -> None:
        behind = self.behind
        if behind is not None:
            behind.deferred += 1
        else:
            behind = self.behind = _Behind(step, time.monotonic())
            what = f"the write of step {writing[0]} has run {writing[1]:.1f} s" if writing else "a write"
            how_far = (f"the newest committed checkpoint is {lag[0]} steps ({lag[1]:.1f} s) behind the memory tier"
                       if lag else "no checkpoint committed yet by this process")
            log.warning(
                "persistent tier behind: step %d's memory checkpoint is due in checkpoint.dir, but %s and is still "
                "in flight; %s. Memory checkpoints go on every interval; the newest one is written as soon as a "
                "memory checkpoint finds the writer free. The storage writes one state slower than checkpoint."
                "persist_every memory checkpoints: raise it, or use faster storage", step, what, how_far)
        if lag is not None:
            behind.max_steps, behind.max_s = max(behind.max_steps, lag[0]), max(behind.max_s, lag[1])

    def committed(self, step: int, current: int) -> dict[str, Any] | None:
        """A write of ``step`` committed during training step ``current``. When no persist fell due meanwhile, the
        persistent tier has caught up: ends the episode with one line; returns its record for the recovery ledger
        (else None)."""
        behind = self.behind
        if behind is None or self.owed:
            return None
        self.behind = None
        seconds = time.monotonic() - behind.since_t
        log.info("persistent tier caught up: step %d committed at step %d; it was behind from step %d for %d steps "
                 "(%.1f s), at most %d steps (%.1f s) behind the memory tier, %d write(s) deferred", step, current,
                 behind.since_step, current - behind.since_step, seconds, behind.max_steps, behind.max_s,
                 behind.deferred)
        return {"since_step": behind.since_step, "until_step": current, "committed_step": step,
                "seconds": round(seconds, 3), "max_lag_steps": behind.max_steps, "max_lag_s": round(behind.max_s, 3),
                "deferred": behind.deferred}
