"""What one recorded run measured, from its ledger and metrics (``recovery.jsonl`` + ``metrics.jsonl``, schemas in
``trainer.ledger``) or from a GPU goodput run's figure lines (``bench/figures.py goodput``): ``Measured``.
``costs`` turns the planned run's own measurements, those of extra ledgers (``--measured``) and the documented
defaults (``defaults``) into the simulation's ``Costs``.

- ``step_s``: the mean time of the plain steps (the last run of each step, less step 1, the first step after each
  restart and the steps that carry a snapshot's cost); where the interval is unknown (an extra ledger of an older
  trainer), the median step: the planner predicts expected time, so the run's own figure is a mean;
- ``snapshot_s``: per snapshot S (every ``interval`` steps), the extra time of the steps S..S+3 over ``step_s``
  (where a GPU's staging copies and drain land, ``checkpoint.policy.AUTO_COST_WINDOW``), mean over snapshots;
- ``recoveries``: per layer, the ``recovered`` records' ``recovery_s`` less one step (the first productive step is
  work); a node loss is ``node`` when a rank of it read the persistent tier (or the record names no tier: a ledger
  older than the peer tier), ``node_peer`` when its ranks restored from memory and a peer's replica;
- ``restores``: the restore phase (``phases.restore``) of the in-job restarts from memory (``memory``) and of every
  restart that read the persistent tier (``persistent``);
- ``writes``: the ``persisted`` records of the periodic writes (snapshot -> commit; not the final or a preemption's
  save, written while training waits) and ``write_overhead_s``, the extra time of the steps that ended during them;
- ``replicas``: the start record's replica count (the peer tier), ``replica_push_s``: the summary's mean push time.
"""

from __future__ import annotations

import gzip
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.planning import LAYERS, PlanError

WINDOW = 4
"""Steps S..S+3 carry a snapshot's cost (``trainer.checkpoint.policy.AUTO_COST_WINDOW``)."""
MEMORY_TIERS = ("memory", "node-local")


@dataclass
class Measured:
    where: str
    step_s: float
    interval: int | None = None
    persist_every: int | None = None
    device: str = ""
    model: str = ""
    world_size: int | None = None
    replicas: int | None = None
    snapshot_s: float | None = None
    recoveries: dict[str, list[float]] = field(default_factory=dict)
    restores: dict[str, list[float]] = field(default_factory=dict)
    writes: list[float] = field(default_factory=list)
    write_overhead_s: float = 0.0
    final_save_s: float = 0.0
    final_save_from: str = ""
    first_step_excess_s: float = 0.0
    replica_push_s: float | None = None
    figures: dict[str, Any] = field(default_factory=dict)
    """Figure lines only: the recorded run's ``steps`` and ``goodput_strict`` (``replay``)."""

    def label(self) -> str:
        """The ledger and what ran it, for the report: ``DIR (cuda:0, 1b)``."""
        what = ", ".join(x for x in (self.device, self.model) if x)
        return f"{self.where} ({what})" if what else self.where


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """JSON lines (a ``.gz`` beside a missing plain file is read instead); a torn line is skipped."""
    zipped = path.with_name(path.name + ".gz")
    if not path.is_file() and zipped.is_file():
        text = gzip.decompress(zipped.read_bytes()).decode(errors="replace")
    elif path.is_file():
        text = path.read_text(errors="replace")
    else:
        raise PlanError(f"{path} does not exist: give the run directory that holds recovery.jsonl and metrics.jsonl")
    records = []
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue  # a torn last line (a process killed mid-write)
        if isinstance(value, dict):
            records.append(value)
    return records


def step_times(metrics: list[dict[str, Any]]) -> dict[int, float]:
    """Step -> step time of its last run."""
    last: dict[int, float] = {}
    for r in metrics:
        if r.get("event") == "step" and isinstance(r.get("step"), int) and number(r.get("step_time_s")):
            last[r["step"]] = float(r["step_time_s"])
    return last


def measure(run_dir: str | Path, interval: Any = None, persist_every: Any = None, *, own: bool = True) -> Measured:
    """What the run in ``run_dir`` measured. ``own``: the planned run, whose settings and snapshot cost are required
    (PlanError saying what to give); else an extra ledger, of which only what it measured is taken."""
    run = Path(run_dir)
    ledger, metrics = read_jsonl(run / "recovery.jsonl"), read_jsonl(run / "metrics.jsonl")
    times = step_times(metrics)
    start = next((r for r in metrics if r.get("event") == "start"), {})
    settings = start.get("checkpoint") or {}
    interval = settings.get("interval") if interval is None else interval
    if interval == "auto":
        chosen = [r["steps"] for r in ledger if r.get("event") == "checkpoint_interval"]
        interval = chosen[-1] if chosen else None
    persist_every = settings.get("persist_every") if persist_every is None else persist_every
    known = isinstance(interval, int) and interval >= 1
    if own and (not known or not isinstance(persist_every, int)):
        raise PlanError(f"{run / 'metrics.jsonl'} does not say the run's checkpoint interval and persist_every (a "
                        "trainer older than the planner, or interval 0): give --cost interval=N --cost persist_every=N")
    step_s = _plain_step_time(times, interval, metrics) if known else None
    if step_s is None and not own and len(times) >= WINDOW:
        step_s = statistics.median(times.values())
    if step_s is None:
        raise PlanError(f"{run / 'metrics.jsonl'} has {len(times)} step record(s): too few plain steps to measure one")
    summary = next((r for r in reversed(metrics) if r.get("event") == "summary"), {})
    push = summary.get("replica_push") if isinstance(summary.get("replica_push"), dict) else {}
    m = Measured(str(run), step_s, interval if known else None, persist_every, str(start.get("device") or ""),
                 str(start.get("model") or ""), start.get("world_size"), settings.get("replicas"),
                 first_step_excess_s=max(0.0, times.get(1, step_s) - step_s),
                 replica_push_s=push.get("mean_s") if number(push.get("mean_s")) else None)
    if known:
        m.snapshot_s = _snapshot_cost(times, interval, step_s, metrics, summary)
    if own and m.snapshot_s is None:
        raise PlanError("no snapshot's cost could be measured (no snapshot with 4 steps after it): give "
                        "--cost snapshot_s=SECONDS")
    for r in ledger:
        if r.get("event") == "recovered" and r.get("layer") in LAYERS and number(r.get("recovery_s")):
            _add_recovery(m, r, r["recovery_s"] - step_s, _tiers(r, ledger))
    final = {r.get("step") for r in ledger if r.get("event") == "preempted"} | {max(times, default=None)}
    writes = [r for r in ledger if r.get("event") == "persisted" and number(r.get("write_s"))
              and r.get("step") not in final]
    m.writes = [float(r["write_s"]) for r in writes]
    m.write_overhead_s = _write_overhead(writes, metrics, step_s)
    m.final_save_s, m.final_save_from = _final_save(ledger, summary, max(times, default=0))
    return m


def from_figures(path: str | Path) -> Measured:
    """A GPU goodput run's figure lines (``bench/figures.py goodput``: ``goodput_strict`` and ``recovery`` lines,
    as BENCHMARKS.md, "Goodput", links them): step = the fault-free step time, snapshot = its mean cost, the final
    save; the recoveries (with their restore phases where the lines hold them)."""
    lines = read_jsonl(Path(path))
    strict = next((r for r in lines if r.get("figure") == "goodput_strict"), None)
    if strict is None or not number(strict.get("fault_free_step_s")):
        raise PlanError(f"{path}: no goodput_strict line with a fault_free_step_s (bench/figures.py goodput)")
    step_s = float(strict["fault_free_step_s"])
    m = Measured(str(path), step_s, device="cuda", snapshot_s=strict.get("snapshot_cost_s"),
                 final_save_s=float(strict.get("final_save_s") or 0.0), final_save_from="the figure lines' final save",
                 first_step_excess_s=float((strict.get("lost_s") or {}).get("step_1", 0.0)),
                 figures={"steps": strict.get("steps"), "goodput_strict": strict.get("goodput_strict")})
    for r in lines:
        if r.get("figure") == "recovery" and r.get("layer") in LAYERS and number(r.get("recovery_s")):
            tiers = {"memory": [0]} if r["layer"] in ("inprocess", "injob") else {}
            _add_recovery(m, r, r["recovery_s"] - step_s, tiers)
    return m


def _tiers(record: dict[str, Any], ledger: list[dict[str, Any]]) -> dict[str, Any]:
    """The tiers a recovery restored from: its own ``tiers``, else its restart records' ``tier`` (older ledgers)."""
    if isinstance(record.get("tiers"), dict):
        return record["tiers"]
    before = [r for r in ledger if r.get("event") == "restart" and r.get("time", 0) <= record.get("time", 0)]
    last = max((r.get("time", 0) for r in before), default=None)
    return {str(r.get("tier")): [r.get("rank")] for r in before if r.get("time", 0) >= (last or 0) - 5}


def _add_recovery(m: Measured, record: dict[str, Any], seconds: float, tiers: dict[str, Any]) -> None:
    names = set(tiers)
    persistent = "disk" in names or not names & {*MEMORY_TIERS, "peer"}
    layer = record["layer"]
    if layer == "node" and not persistent and "peer" in names:
        layer = "node_peer"
    m.recoveries.setdefault(layer, []).append(max(0.0, seconds))
    restore = (record.get("phases") or {}).get("restore")
    if number(restore):
        if persistent and names:
            m.restores.setdefault("persistent", []).append(float(restore))
        elif record["layer"] == "injob" and names <= set(MEMORY_TIERS):
            m.restores.setdefault("memory", []).append(float(restore))


def _restarted(metrics: list[dict[str, Any]]) -> set[int]:
    """The first step after each restart (the metrics' ``resume`` records)."""
    return {r["step"] + 1 for r in metrics if r.get("event") == "resume" and isinstance(r.get("step"), int)}


def _plain_step_time(times: dict[int, float], interval: int, metrics: list[dict[str, Any]]) -> float | None:
    """The mean of the steps that carry no snapshot cost, no start and no restart; None when fewer than 4."""
    skip = _restarted(metrics) | {1} | {s + i for s in range(interval, max(times, default=0) + 1, interval)
                                       for i in range(WINDOW)}
    plain = [t for step, t in times.items() if step not in skip]
    return statistics.fmean(plain) if len(plain) >= WINDOW else None


def _snapshot_cost(times: dict[int, float], interval: int, step_s: float, metrics: list[dict[str, Any]],
                   summary: dict[str, Any]) -> float | None:
    """The extra time of steps S..S+3 per snapshot S, mean (a window holding a restart's first step is skipped);
    else the summary's median snapshot blocking; else None."""
    restarts = _restarted(metrics)
    costs = []
    for s in range(interval, max(times, default=0) - WINDOW + 2, interval):
        window = range(s, s + WINDOW)
        if s > WINDOW and all(i in times for i in window) and not restarts.intersection(window):
            costs.append(sum(times[i] - step_s for i in window))
    if costs:
        return max(0.0, statistics.fmean(costs))
    blocking = summary.get("snapshot_blocking")
    if isinstance(blocking, dict) and number(blocking.get("median_s")):
        return float(blocking["median_s"])
    return None


def _final_save(ledger: list[dict[str, Any]], summary: dict[str, Any], last: int) -> tuple[float, str]:
    """The final save's time and where it came from: its ``persisted`` record, else the longest snapshot blocking
    of the last process (a trainer older than the planner: the final save blocks longest), else 0."""
    final = [r["write_s"] for r in ledger if r.get("event") == "persisted" and r.get("step") == last
             and number(r.get("write_s"))]
    if final:
        return float(final[-1]), "the final save's persisted record"
    blocking = summary.get("snapshot_blocking")
    if isinstance(blocking, dict) and number(blocking.get("max_s")):
        return float(blocking["max_s"]), "the longest snapshot blocking (no persisted record of the final save)"
    return 0.0, ""


def _write_overhead(writes: list[dict[str, Any]], metrics: list[dict[str, Any]], step_s: float) -> float:
    """Per persisted write: the extra time (over ``step_s``) of the steps that ended while it ran, mean."""
    steps = [(r["time"], float(r["step_time_s"])) for r in metrics
             if r.get("event") == "step" and number(r.get("time")) and number(r.get("step_time_s"))]
    extra = []
    for w in writes:
        if number(w.get("time")):
            begin = w["time"] - w["write_s"]
            extra.append(sum(max(0.0, t - step_s) for at, t in steps if begin < at <= w["time"]))
    return statistics.fmean(extra) if extra else 0.0


def number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
