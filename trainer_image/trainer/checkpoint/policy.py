"""When a memory checkpoint is due: every ``checkpoint.interval`` steps, or ``"auto"`` by Young/Daly."""

from __future__ import annotations

import collections
import logging
import math
import statistics
import time

log = logging.getLogger(__name__)

AUTO_FIRST_STEP = 5
"""With ``interval = "auto"``: the first snapshot, after the first steps' warm-up (compilation, allocator)."""
AUTO_PROBE_STEPS = 5
"""... and the second, so that one snapshot's cost has been measured before the interval is chosen."""
_MIN_COST_S = 1e-3


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
        self._last_was_snapshot = False
        self._plain: collections.deque[float] = collections.deque(maxlen=50)
        self._snap: collections.deque[float] = collections.deque(maxlen=8)

    def tick(self) -> None:
        """Called once per step (from ``save``): the time since the last call is one step's duration."""
        now = time.perf_counter()
        if self._last_t is not None:
            (self._snap if self._last_was_snapshot else self._plain).append(now - self._last_t)
        self._last_t, self._last_was_snapshot = now, False

    def due(self, step: int) -> bool:
        if self.auto:
            return step >= self.next_due
        return self.every > 0 and step % self.every == 0

    def measurements(self) -> tuple[float, float]:
        """(step time without a snapshot, extra time of a step with one); -1 for what is not measured yet."""
        step_s = statistics.median(self._plain) if self._plain else -1.0
        cost_s = max(_MIN_COST_S, statistics.median(self._snap) - step_s) if self._snap and step_s > 0 else -1.0
        return step_s, cost_s

    def snapshot_taken(self, step: int, step_s: float, cost_s: float) -> int | None:
        """After a snapshot at ``step``, with the agreed (maximum over ranks) step time and snapshot cost.
        Returns the newly chosen interval when ``auto`` chose one (to be logged and recorded), else None."""
        self._last_was_snapshot = True
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
