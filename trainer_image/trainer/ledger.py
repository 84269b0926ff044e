"""Recovery ledger: every fault and restart of a run as JSON lines in ``<run_dir>/recovery.jsonl``.

It sits beside ``metrics.jsonl`` and feeds the pipeline's HTML report. Lines are appended with one
``write`` each (``O_APPEND``), by the rank that saw the event, from every process of every attempt. A line
survives its process's death (the kernel holds it); only ``exit`` and the records written outside the training
loop are also fsynced. On the loop's path (start, restart, recovered, fault, straggler reports) an fsync can
wait behind a checkpoint write or a slow disk flush. On H200, every straggler report that wrote a line came with a
0.35 s step. The ones that wrote none, the first after each start, did not. NVRx's report alone takes milliseconds
on CPU, so the fsync is the likely cause, though not isolated.

Record schema (every record has ``event``, ``time`` (Unix seconds), ``rank``, ``pid``, ``attempt``
(``TORCHELASTIC_RESTART_COUNT``, 0 without a launcher) and ``iteration`` (the in-process restart count)):

``{"event": "start", "world_size"}``
    Rank 0, first start of a run from scratch (no checkpoint). Wall time is measured from here.
``{"event": "fault", "kind", "step"}``
    The faulting rank, just before an injected fault fires (``step`` is the step it interrupts).
``{"event": "exit", "code", "name", "reason", "step"}``
    Every rank whose process ends with a non-zero code (``trainer.cli``, and the SIGTERM paths of
    ``trainer.resiliency``, through ``exitcodes.record_exit``): what the next attempt names as the cause; ``step``
    is the step it was in (null before its first completed).
``{"event": "restart", "layer", "resumed_step", "tier", "fault", "joined", "world_size"}``
    Every rank, when training starts again after a fault (``pid`` shows whether the process survived); ``tier`` is
    the checkpoint tier it resumed from (``memory``, ``node-local``, ``peer``, ``disk``, or null). ``layer`` is the layer that recovered it:
    ``inprocess`` (same processes, NVRx Wrapper iteration > 0), ``injob`` (new processes on the same nodes, started by
    their launchers), ``node`` (some ranks run on a node that joined the job: a replacement pod, a spare, while the
    other nodes stayed) or ``cluster`` (every node new: pod restarts or a pipeline retry, resuming from a
    checkpoint). ``joined`` lists the ranks whose node joined (``node`` only). A node is new to the job when no worker of
    its local rank started its loop in its pod before (``node_joined``). ``fault`` names the cause, never null: the last unrecovered injected fault record, a
    handled SIGTERM (``preemption``), or, for a fault that was not injected, what this attempt can know of
    it: ``{"kind", "time", "step", "detail"}`` where ``kind`` is ``exception`` (in-process: the
    exception the Wrapper caught on this rank) or ``peer_fault`` (in-process: another rank failed), else
    from the ``exit`` records since the last (re)start: ``killed`` when a rank recorded no exit (SIGKILL, OOM
    kill, ft_launcher's heartbeat timeout, a lost node), otherwise the lower-case name of the first exit
    code other than the TERMINATED of ranks stopped for the restart (e.g. ``ranks_lost``). ``detail`` lists
    every rank's exit; ``time`` is the first exit's (null when none was recorded), ``step`` the step the ranks that
    recorded one were in (a lost node's: the step the others stopped in; null when none was recorded).
``{"event": "elastic", "step", "before", "after", "layer", "cause"}``
    Rank 0, when a restart runs on another world size than the attempt before (``before`` -> ``after`` ranks: a
    node lost with no spare under ``PET_NNODES=MIN:MAX``, or one that joined again); ``step`` is the step it resumed
    from, ``cause`` the restart's fault kind. The time at a size runs from one record to the next.
``{"event": "recovered", "layer", "step", "fault_kind", "fault_step", "recovery_s", "steps_redone", "tiers", "bytes_read"}``
    Rank 0, after the first productive (completed) step following a restart. ``tiers`` maps each tier the ranks
    resumed from to those ranks (``{"node-local": [0, 1], "peer": [2, 3]}``; ``peer``: a replica fetched from
    another node's memory; ``none``: nothing to restore, those ranks started over from step 0); ``bytes_read`` the bytes all ranks read from each tier during the restore, a refused
    copy's included (``{"node-local": ..., "peer": ...}``: no ``disk`` key, no checkpoint file read). ``recovery_s`` is the time
    from the fault (or, when its time is unknown, from the restart) to that step's end; ``steps_redone`` is how
    many steps completed before the fault must be trained again (fault step - 1 - resumed step; null when
    the fault's step is unknown). ``phases`` (when the restart ran under ``resiliency.run``): where those seconds
    went: what came before the start (in-job ``before_start``: fault -> this process's creation; in-process
    ``detect``, ``abort``, ``wrapper``: fault -> abort -> re-entry of ``train()``), then the start's own phases and
    their ``total`` (``trainer.startup.phases``).
``{"event": "straggler_report", "step", "basis", "threshold", "slowest", "stragglers"}``
    Rank 0, every ``resiliency.straggler_report_every`` steps (``trainer.resiliency.straggler``): ``slowest`` are
    the (up to) three slowest ranks, ``stragglers`` the ranks below the threshold, each
    ``{"rank", "host", "relative", "individual", "streak"}`` (``streak``: reports in a row below it).
``{"event": "straggler_evicted", "step", "rank", "host", "relative", "reports", "threshold", "checkpoint"}``
    Rank 0, when ``resiliency.straggler=evict`` ends the job (every rank exits UNHEALTHY_NODE) because ``rank`` stayed
    below the threshold for ``reports`` reports; ``checkpoint`` is the step committed first (null if that failed).
``{"event": "preempted", "step"}``
    Rank 0, after the final checkpoint of a handled SIGTERM (a restart after it counts it as the fault
    ``preemption`` unless an injected ``sigterm`` fault is pending).
``{"event": "checkpoint_interval", "steps", "cost_s", "step_s", "mtbf_s", "basis"}``
    Rank 0, when ``checkpoint.interval = "auto"`` chooses an interval (Young/Daly) or changes it by more than 20 %;
    ``basis`` says where the MTBF came from (``checkpoint.mtbf_s``, or ``failure model llama3 at 16 GPU(s)``).
``{"event": "persisted", "step", "at_step", "write_s"}``
    Rank 0, when a write to the persistent tier commits (during training step ``at_step``): ``write_s`` from its
    snapshot to the commit (the goodput planner's persisted write time, ``trainer.planning.costs``).
``{"event": "persist_behind", "since_step", "until_step", "committed_step", "seconds", "max_lag_s", "max_lag_steps", "deferred"}``
    Rank 0, when the persistent tier has caught up after falling behind (a write still in flight when the next
    one fell due): from which step until which, at most how far the newest committed checkpoint lagged the
    memory tier, and how many writes were deferred.
``{"event": "summary", "steps", "wall_s", "productive_s", "goodput", "faults", "restarts", "by_layer"}``
    Rank 0, at the end of training. ``productive_s`` sums the step times (``metrics.jsonl``) of the steps
    that count (the last run of each step, redone ones excluded); ``goodput = productive_s / wall_s``,
    ``wall_s`` runs from the ``start`` record. ``by_layer`` counts restarts per layer.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from trainer.exitcodes import EXIT_CODE_DIR_ENV

LEDGER_FILE = "recovery.jsonl"
NOTHING_RESTORED = "none"
"""The ``tiers`` key of the ranks a restart found nothing to restore for (they started over from step 0)."""
METRICS_FILE = "metrics.jsonl"
LAYERS = ("inprocess", "injob", "node", "cluster")
NOT_CRASHES = ("corrupt_checkpoint", "slow")
"""Injected fault kinds that do not end the process: never the cause of a restart."""


def read(path: str | Path) -> list[dict[str, Any]]:
    """All records of a ledger (or metrics) file; a torn last line (writer killed) is skipped."""
    records = []
    p = Path(path)
    if not p.exists():
        return records
    for line in p.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class Ledger:
    """Appends records for one process; created once per process (survives in-process restarts)."""

    def __init__(self, run_dir: str | Path, rank: int, world_size: int = 1) -> None:
        self.path = Path(run_dir) / LEDGER_FILE
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.world_size = world_size
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.iteration = 0
        self._pending: dict[str, Any] | None = None  # restart awaiting its first productive step
        self._done: int | None = None  # the last step this process completed
        self._caught: dict[str, Any] | None = None  # the exception behind the next in-process restart

    def write(self, event: str, sync: bool = True, **fields: Any) -> dict[str, Any]:
        """Append one record; ``sync``: fsynced before returning (an fsync waits behind a checkpoint write in flight
        on the same disk: records on the training loop's path that a crash may lose are written without it)."""
        record = {
            "event": event, "time": round(time.time(), 3), "rank": self.rank, "pid": os.getpid(),
            "attempt": self.attempt, "iteration": self.iteration, **fields,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return record

    def fault(self, kind: str, step: int) -> None:
        """An injected fault, about to fire: its ``time`` starts the recovery clock. Not fsynced: the kernel keeps
        the line through the process's death. An fsync here waits behind a checkpoint write in flight (H200: 0.32 s
        from this record to the Wrapper catching the exception, with 18 GB being written), recovery time that no
        real fault spends (the marker file was made durable before)."""
        self.write("fault", sync=False, kind=kind, step=step)

    def exit(self, code: int, name: str, reason: str = "") -> None:
        """This process ends with ``code`` (non-zero): the cause the next attempt's restart names."""
        if code:
            self.write("exit", code=int(code), name=name, reason=reason, step=self._in_progress())

    def note_exception(self, exc: BaseException | None) -> None:
        """The exception the in-process Wrapper caught on this rank (its health check sees it)."""
        if exc is not None:
            self._caught = {"kind": "exception", "time": round(time.time(), 3), "step": self._in_progress(),
                            "detail": f"{type(exc).__name__}: {exc}"}

    def on_train_start(self, iteration: int, resumed_step: int, tier: str | None = None,
                       joined: list[int] | None = None, tiers: list[str | None] | None = None,
                       bytes_read: dict[str, int] | None = None) -> None:
        """Called by every rank when ``train()`` (re)starts, after the checkpoint is loaded from ``tier``
        (memory, node-local, disk; None when nothing was loaded). ``joined``: the ranks whose node is new to the job
        (``node_joined``, gathered), None when unknown (no entrypoint: every rank new at attempt 0, none after);
        ``tiers``: every rank's ``tier``; ``bytes_read``: bytes the ranks read per tier, summed."""
        self.iteration = iteration
        if joined is None:
            joined = list(range(self.world_size)) if self.attempt == 0 else []
        if iteration > 0:
            layer = "inprocess"
        elif not joined:
            layer = "injob"
        elif len(joined) < self.world_size:
            layer = "node"
        elif resumed_step > 0 or (self.rank == 0 and self._trained_before()):  # a relaunch (others: rank 0 wrote)
            layer = "cluster"
        else:
            if self.rank == 0:
                self.write("start", sync=False, world_size=self.world_size)
            return
        fault = self._last_unrecovered_fault() or self._uninjected_cause(layer)
        self._caught = None
        extra: dict[str, Any] = {"joined": joined} if layer == "node" else {}
        before = self._previous_world_size() if self.rank == 0 else None
        record = self.write("restart", sync=False, layer=layer, resumed_step=resumed_step, tier=tier, fault=fault,
                            world_size=self.world_size, **extra)
        if before is not None and before != self.world_size:  # the job went on with fewer nodes, or grew back
            self.write("elastic", sync=False, step=resumed_step, before=before, after=self.world_size, layer=layer,
                       cause=fault.get("kind"))
        if self.rank == 0:
            by_tier: dict[str, list[int]] = {}
            for rank, where in enumerate(tiers or [tier]):
                by_tier.setdefault(where or NOTHING_RESTORED, []).append(rank)
            self._pending = {**record, "tiers": by_tier, "bytes_read": dict(sorted((bytes_read or {}).items()))}

    def _trained_before(self) -> bool:
        """Whether an earlier launch of this run started its loop (a ``start`` or ``restart`` record): a relaunch.
        The exit of a worker that died before its loop is not one (a first start whose worker could not start)."""
        return any(r["event"] in ("start", "restart") for r in read(self.path))

    def on_step_end(self, step: int, start: dict[str, Any] | None = None) -> None:
        """After every step; the first productive step after a restart writes ``recovered``. ``start``: the
        phases of this (re)start (``{"origin": its wall time, "phases": {...}, "marks": {...}}``:
        ``trainer.startup.phases``), when measured."""
        self._done = step
        if self._pending is None or self.rank != 0:
            return
        restart, self._pending = self._pending, None
        fault = restart["fault"]
        since = fault.get("time") or restart["time"]
        redone = max(0, fault["step"] - 1 - restart["resumed_step"]) if fault.get("step") is not None else None
        extra, end = {}, time.time()
        if start is not None:  # the first step's end as its phases saw it: what runs after it (the start's log
            end = start.get("end", end)  # lines, the garbage collector's summary) lands in the next step's time
            marks = start.get("marks") or {}
            if since <= marks.get("abort_began", -1.0):
                before = in_process_phases(since, marks, start["origin"])
            else:
                before = {"before_start": max(0.0, start["origin"] - since)}
            extra["phases"] = {**{k: round(v, 3) for k, v in before.items()}, **start["phases"]}
        self.write(
            "recovered", sync=False, layer=restart["layer"], step=step,
            fault_kind=fault["kind"], fault_step=fault.get("step"),
            recovery_s=round(end - since, 3), steps_redone=redone, tiers=restart["tiers"],
            bytes_read=restart["bytes_read"], **extra,
        )

    def summarize(self, steps: int) -> dict[str, Any] | None:
        if self.rank != 0:
            return None
        records = read(self.path)
        starts = [r["time"] for r in records if r["event"] == "start"]
        t0 = starts[0] if starts else min((r["time"] for r in records), default=time.time())
        wall = time.time() - t0
        productive = productive_seconds(self.run_dir / METRICS_FILE, steps)
        restarts = [r for r in records if r["event"] == "restart" and r["rank"] == 0]
        by_layer = {layer: sum(r["layer"] == layer for r in restarts) for layer in LAYERS}
        return self.write(
            "summary", steps=steps, wall_s=round(wall, 3), productive_s=round(productive, 3),
            goodput=round(productive / wall, 4) if wall > 0 else None,
            faults=sum(r["event"] == "fault" for r in records), restarts=len(restarts), by_layer=by_layer,
        )

    def _last_unrecovered_fault(self) -> dict[str, Any] | None:
        last = None
        for r in read(self.path):
            if r["event"] == "fault" and r.get("kind") not in NOT_CRASHES:
                last = r
            elif r["event"] == "preempted" and last is None:  # a real SIGTERM: the interrupted step is next
                last = {**r, "kind": "preemption", "step": r["step"] + 1}
            elif (r["event"] == "restart" and r["rank"] == self.rank and r.get("fault") and last
                  and r["fault"]["time"] == last["time"]):
                last = None
        return last

    def _uninjected_cause(self, layer: str) -> dict[str, Any]:
        """The cause of a restart no injected fault explains, as far as this attempt can know it."""
        if layer == "inprocess":
            return self._caught or {"kind": "peer_fault", "time": None, "step": None,
                                    "detail": "another rank failed or hung; the in-process Wrapper restarted all"}
        records = read(self.path)  # in append order: the exits after this rank's last (re)start ended that attempt
        since = max((i for i, r in enumerate(records)
                     if r["event"] == "start" or (r["event"] == "restart" and r["rank"] == self.rank)), default=-1)
        exits = sorted((r for r in records[since + 1:] if r["event"] == "exit"),
                       key=lambda r: (r["name"] == "TERMINATED", r["time"]))  # the stopped peers last
        killed = [rank for rank in range(self.world_size) if rank not in {r["rank"] for r in exits}]
        kind = "killed" if killed else exits[0]["name"].lower()
        parts = [f"rank {rank}: no exit recorded (SIGKILL, OOM kill, heartbeat timeout or node lost)" for rank in killed]
        parts += [f"rank {r['rank']}: exit {r['code']} ({r['name']}) {r.get('reason', '')}".rstrip()
                  for r in sorted(exits, key=lambda r: (r["rank"], r["time"]))]
        times = [r["time"] for r in exits]
        steps = [r["step"] for r in exits if r.get("step") is not None]  # the step the ranks stopped in (lockstep)
        return {"kind": kind, "time": min(times) if times else None, "step": max(steps) if steps else None,
                "detail": "; ".join(parts)}

    def _previous_world_size(self) -> int | None:
        """The world size of the last attempt (its rank 0's start or restart record), None when not recorded."""
        for r in reversed(read(self.path)):
            if r.get("rank") == 0 and r["event"] in ("start", "restart"):
                return r.get("world_size")
        return None

    def _in_progress(self) -> int | None:
        """The step this process was in (the one after its last completed), None before its first completed."""
        return None if self._done is None else self._done + 1


def _started_marker(local_rank: int) -> Path | None:
    directory = os.environ.get(EXIT_CODE_DIR_ENV)
    return Path(directory) / f"started-local-rank-{local_rank}" if directory else None


def node_joined(local_rank: int) -> bool | None:
    """Whether no worker of this local rank started its loop in this pod yet (the node is new to the job: its first
    start, a replacement pod, a spare taking over); False once one did (``mark_started``), whatever made its launcher
    start another (its own failure, another node's, a node joining: the launchers' restart counts cannot tell, as only
    the first counts). A worker that died before its loop started does not count: a relaunched pod whose first
    worker could not start is still new to the job. None without ``entrypoint.sh`` (no pod to know)."""
    marker = _started_marker(local_rank)
    return None if marker is None else not marker.exists()


def mark_started(local_rank: int) -> None:
    """This worker's loop started and its (re)start is in the ledger: the next workers of its local rank in this pod
    are not new to the job (``node_joined``)."""
    marker = _started_marker(local_rank)
    if marker is not None:
        with contextlib.suppress(OSError):
            marker.touch()


def productive_seconds(metrics_path: Path, steps: int) -> float:
    """Sum of step times of the last run of each step 1..steps (a metrics line covering N steps counts N)."""
    last: dict[int, dict[str, Any]] = {}
    for r in read(metrics_path):
        if r.get("event") == "step" and r.get("step", 0) <= steps:
            last[r["step"]] = r
    total, prev = 0.0, 0
    for step in sorted(last):
        total += last[step]["step_time_s"] * (step - prev)
        prev = step
    return total


def in_process_phases(since: float, marks: dict[str, float], origin: float) -> dict[str, float]:
    """An in-process restart from the fault (``since``) to the re-entry of ``train()`` (``origin``), in phases named
    by the moment each ends at (``trainer.startup.phases``): ``unwind`` (the exception left ``train()``), ``detect`` (the
    abort began), ``abort`` (it ended), ``wrapper`` (the restartable function was called again), ``reconnect``
    (``train()`` entered). A moment not noted, or out of order, is left out: the next phase takes its time."""
    again = marks.get("called_again")
    ends = [("unwind", marks.get("left_train")), ("detect", marks.get("abort_began")), ("abort", marks.get("abort_ended"))]
    ends += [("wrapper", again), ("reconnect", origin)] if again is not None else [("wrapper", origin)]
    phases, last = {}, since
    for name, moment in ends:
        if moment is None or moment < last or moment > origin:
            continue
        phases[name], last = moment - last, moment
    return phases


def sum_by_key(counts: list[dict[str, int]]) -> dict[str, int]:
    """``[{"disk": 3}, {"disk": 1, "peer": 2}]`` -> ``{"disk": 4, "peer": 2}``."""
    total: dict[str, int] = {}
    for count in counts:
        for key, value in count.items():
            total[key] = total.get(key, 0) + int(value)
    return total
