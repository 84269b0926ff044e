"""A finished run's measured costs (``simulate.Costs``), from its recovery ledger and metrics, or from a costs file
written by hand. Missing or bad values raise ``PlanError`` (one line).

From a run directory (``recovery.jsonl`` + ``metrics.jsonl``, schemas in ``trainer.ledger``):

- ``step_s``: the mean time of the plain steps (the last run of each step, as the ledger's ``productive_s`` counts
  them, less step 1, the first step after each restart and the steps that carry a snapshot's cost): the planner
  predicts expected time, so every figure here is a mean, not a median;
- ``snapshot_s``: per snapshot (every ``interval`` steps: the metrics' ``start`` record, or the ledger's
  ``checkpoint_interval`` for ``auto``), the extra time of the steps S..S+3 over ``step_s`` (where a GPU's staging
  copies and drain land, ``checkpoint.policy.AUTO_COST_WINDOW``), mean over snapshots;
- ``publish_s``: not measured: 3 steps on a GPU (the drain), 0 on CPU;
- ``persist_write_s``: the ledger's ``persisted`` records (snapshot -> commit) of the periodic writes (not the final
  or a preemption's save, written while training waits), mean; ``persist_overhead_s``: the extra time of the steps
  that ended during each of them, mean;
- ``recovery_s`` per layer: the ``recovered`` records' ``recovery_s`` less one step (the first productive step is
  work), mean; a layer the run did not exercise takes the slowest measured layer's (said in ``notes``);
- ``final_save_s`` (``replay`` only: the ledger's wall includes it): the last step's ``persisted`` record.

A costs file (JSON) holds the same keys: ``{"step_s", "snapshot_s", "persist_write_s", "recovery_s": {layer: s},
"publish_s", "persist_overhead_s", "peer_copy_s", "interval", "persist_every", "source"}``.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from trainer.planning import LAYERS, PlanError
from trainer.planning.simulate import Costs

WINDOW = 4
"""Steps S..S+3 carry a snapshot's cost (``trainer.checkpoint.policy.AUTO_COST_WINDOW``)."""
GPU_PUBLISH_STEPS = 3
REQUIRED = ("step_s", "snapshot_s", "persist_write_s", "recovery_s")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise PlanError(f"{path} does not exist: give the run directory that holds recovery.jsonl and metrics.jsonl")
    records = []
    for line in path.read_text(errors="replace").splitlines():
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
        if r.get("event") == "step" and isinstance(r.get("step"), int) and _number(r.get("step_time_s")):
            last[r["step"]] = float(r["step_time_s"])
    return last


def from_run(run_dir: str | Path, overrides: dict[str, Any] | None = None) -> Costs:
    run = Path(run_dir)
    ledger, metrics = read_jsonl(run / "recovery.jsonl"), read_jsonl(run / "metrics.jsonl")
    overrides = dict(overrides or {})
    times = step_times(metrics)
    start = next((r for r in metrics if r.get("event") == "start"), {})
    settings = start.get("checkpoint") or {}
    interval = overrides.pop("interval", settings.get("interval"))
    if interval == "auto":
        chosen = [r["steps"] for r in ledger if r.get("event") == "checkpoint_interval"]
        interval = chosen[-1] if chosen else None
    persist_every = overrides.pop("persist_every", settings.get("persist_every"))
    if not isinstance(interval, int) or not isinstance(persist_every, int) or interval < 1:
        raise PlanError(f"{run / 'metrics.jsonl'} does not say the run's checkpoint interval and persist_every (a "
                        "trainer older than the planner, or interval 0): give --cost interval=N --cost persist_every=N")
    step_s = _plain_step_time(times, interval, metrics)
    if step_s is None:
        raise PlanError(f"{run / 'metrics.jsonl'} has {len(times)} step record(s): too few plain steps to measure one")
    notes = []
    recovered = [r for r in ledger if r.get("event") == "recovered" and r.get("layer") in LAYERS]
    if not recovered and "recovery_s" not in overrides:
        raise PlanError(f"{run / 'recovery.jsonl'} has no recovery (no 'recovered' record): the planner needs a run "
                        "with at least one fault, or a costs file")
    recovery = {}
    for layer in LAYERS:
        seen = [r["recovery_s"] - step_s for r in recovered if r["layer"] == layer and _number(r.get("recovery_s"))]
        if seen:
            recovery[layer] = max(0.0, statistics.fmean(seen))
    for layer in LAYERS:
        if layer not in recovery and recovery:
            slowest = max(recovery, key=recovery.get)
            recovery[layer] = recovery[slowest]
            notes.append(f"{layer} recovery not measured in this run: taken as the {slowest} layer's "
                         f"{recovery[slowest]:.2f} s (--cost recovery_{layer}=S to give it)")
    snapshot_s = _snapshot_cost(times, interval, step_s, metrics)
    final = {r.get("step") for r in ledger if r.get("event") == "preempted"} | {max(times, default=None)}
    writes = [r for r in ledger if r.get("event") == "persisted" and _number(r.get("write_s"))
              and r.get("step") not in final]
    values: dict[str, Any] = {"step_s": step_s, "snapshot_s": snapshot_s, "recovery_s": recovery,
                              "interval": interval, "persist_every": persist_every,
                              "first_step_excess_s": max(0.0, times.get(1, step_s) - step_s),
                              "publish_s": step_s * GPU_PUBLISH_STEPS if "cuda" in str(start.get("device")) else 0.0}
    values["final_save_s"] = _final_save(ledger, metrics, max(times, default=0), notes)
    if writes:
        values["persist_write_s"] = statistics.fmean(r["write_s"] for r in writes)
        values["persist_overhead_s"] = _write_overhead(writes, metrics, step_s)
    for key, value in overrides.items():
        if key.startswith("recovery_") and key[len("recovery_"):] in LAYERS:
            values["recovery_s"][key[len("recovery_"):]] = value
            notes = [n for n in notes if not n.startswith(key[len("recovery_"):] + " ")]
        else:
            values[key] = value
    if "persist_write_s" not in values:
        raise PlanError(f"{run / 'recovery.jsonl'} has no 'persisted' record (persist_every=0, or a trainer older "
                        "than the planner): give --cost persist_write_s=SECONDS")
    values["source"] = f"measured: {run}"
    return checked(values, str(run), tuple(notes))


def _restarted(metrics: list[dict[str, Any]]) -> set[int]:
    """The first step after each restart (the metrics' ``resume`` records)."""
    return {r["step"] + 1 for r in metrics if r.get("event") == "resume" and isinstance(r.get("step"), int)}


def _plain_step_time(times: dict[int, float], interval: int, metrics: list[dict[str, Any]]) -> float | None:
    """The mean of the steps that carry no snapshot cost, no start and no restart; None when fewer than 4."""
    skip = _restarted(metrics) | {1} | {s + i for s in range(interval, max(times, default=0) + 1, interval)
                                       for i in range(WINDOW)}
    plain = [t for step, t in times.items() if step not in skip]
    return statistics.fmean(plain) if len(plain) >= WINDOW else None


def _snapshot_cost(times: dict[int, float], interval: int, step_s: float, metrics: list[dict[str, Any]]) -> float:
    """The extra time of steps S..S+3 per snapshot S, mean; a window holding a restart's first step is skipped."""
    restarts = _restarted(metrics)
    costs = []
    for s in range(interval, max(times) - WINDOW + 2, interval) if interval > 0 else ():
        window = range(s, s + WINDOW)
        if s > WINDOW and all(i in times for i in window) and not restarts.intersection(window):
            costs.append(sum(times[i] - step_s for i in window))
    if costs:
        return max(0.0, statistics.fmean(costs))
    blocking = next((r.get("snapshot_blocking") for r in reversed(metrics) if r.get("event") == "summary"), None)
    if isinstance(blocking, dict) and _number(blocking.get("median_s")):
        return float(blocking["median_s"])
    raise PlanError("no snapshot's cost could be measured (no snapshot with 4 steps after it): give "
                    "--cost snapshot_s=SECONDS")


def _final_save(ledger: list[dict[str, Any]], metrics: list[dict[str, Any]], last: int, notes: list[str]) -> float:
    """The final save's time: its ``persisted`` record, else the longest snapshot blocking of the last process (a
    trainer older than the planner: the final save blocks longest), else 0."""
    final = [r["write_s"] for r in ledger if r.get("event") == "persisted" and r.get("step") == last
             and _number(r.get("write_s"))]
    if final:
        return float(final[-1])
    blocking = next((r.get("snapshot_blocking") for r in reversed(metrics) if r.get("event") == "summary"), None)
    if isinstance(blocking, dict) and _number(blocking.get("max_s")):
        notes.append("final save: no persisted record of it; taken as the longest snapshot blocking "
                     f"({blocking['max_s']:.2f} s)")
        return float(blocking["max_s"])
    return 0.0


def _write_overhead(writes: list[dict[str, Any]], metrics: list[dict[str, Any]], step_s: float) -> float:
    """Per persisted write: the extra time (over ``step_s``) of the steps that ended while it ran, mean."""
    steps = [(r["time"], float(r["step_time_s"])) for r in metrics
             if r.get("event") == "step" and _number(r.get("time")) and _number(r.get("step_time_s"))]
    extra = []
    for w in writes:
        if _number(w.get("time")):
            begin = w["time"] - w["write_s"]
            extra.append(sum(max(0.0, t - step_s) for at, t in steps if begin < at <= w["time"]))
    return statistics.fmean(extra) if extra else 0.0


def from_figures(path: str | Path, overrides: dict[str, Any] | None = None) -> Costs:
    """Costs from a GPU goodput run's figure lines (``bench/figures.py goodput``: ``goodput_strict`` and ``recovery``
    lines, as BENCHMARKS.md, "Goodput", links them): step = the fault-free step time, snapshot = its mean cost, persisted write =
    the final save (one state; its background write's own time is not in those lines), no write slowdown measured."""
    lines = read_jsonl(Path(path))
    strict = next((r for r in lines if r.get("figure") == "goodput_strict"), None)
    if strict is None:
        raise PlanError(f"{path}: no goodput_strict line (bench/figures.py goodput)")
    step_s = strict.get("fault_free_step_s")
    recovery = {}
    for r in lines:
        if r.get("figure") == "recovery" and r.get("layer") in LAYERS and _number(r.get("recovery_s")) and _number(step_s):
            recovery[r["layer"]] = max(0.0, r["recovery_s"] - step_s)
    if not recovery:
        raise PlanError(f"{path}: no recovery line: the planner needs a run with at least one fault")
    notes = ["persisted write time: the final save's (not measured in the background); write slowdown: not measured"]
    for layer in LAYERS:
        if layer not in recovery:
            slowest = max(recovery, key=recovery.get)
            recovery[layer] = recovery[slowest]
            notes.append(f"{layer} recovery not measured in this run: taken as the {slowest} layer's "
                         f"{recovery[slowest]:.2f} s (--cost recovery_{layer}=S to give it)")
    values = {"step_s": step_s, "snapshot_s": strict.get("snapshot_cost_s"), "recovery_s": recovery,
              "persist_write_s": strict.get("final_save_s"), "publish_s": (step_s or 0) * GPU_PUBLISH_STEPS,
              "persist_overhead_s": 0.0, "source": f"figures {path}", "first_step_excess_s":
              (strict.get("lost_s") or {}).get("step_1", 0.0), "steps": strict.get("steps"),
              "goodput_strict": strict.get("goodput_strict")}
    for key, value in (overrides or {}).items():
        if key.startswith("recovery_") and key[len("recovery_"):] in LAYERS:
            recovery[key[len("recovery_"):]] = value
            notes = [n for n in notes if not n.startswith(key[len("recovery_"):] + " ")]
        else:
            values[key] = value
    return checked(values, str(path), tuple(notes))


def from_file(path: str | Path, overrides: dict[str, Any] | None = None) -> Costs:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"costs file {p}: cannot read it as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise PlanError(f"costs file {p}: must be a JSON object with {', '.join(REQUIRED)}")
    for key, value in (overrides or {}).items():
        if key.startswith("recovery_") and isinstance(data.get("recovery_s"), dict):
            data["recovery_s"][key[len("recovery_"):]] = value
        else:
            data[key] = value
    data.setdefault("source", f"costs file {p}")
    return checked(data, str(p), tuple(data.pop("notes", ()) or ()))


def checked(values: dict[str, Any], where: str, notes: tuple[str, ...] = ()) -> Costs:
    """``Costs`` from a mapping, every value checked: PlanError naming the first missing or bad one."""
    for key in REQUIRED:
        if values.get(key) is None:
            raise PlanError(f"{where}: {key} is missing")
    recovery = values["recovery_s"]
    if not isinstance(recovery, dict) or set(recovery) != set(LAYERS):
        raise PlanError(f"{where}: recovery_s must give seconds for each layer: {', '.join(LAYERS)}")
    for key, value in [*((k, values.get(k)) for k in ("step_s", "snapshot_s", "persist_write_s", "publish_s",
                                                      "persist_overhead_s", "peer_copy_s")),
                       *((f"recovery_s.{k}", v) for k, v in recovery.items())]:
        if value is not None and not (_number(value) and value >= 0):
            raise PlanError(f"{where}: {key} must be a number of seconds >= 0; got {value!r}")
    if values["step_s"] <= 0:
        raise PlanError(f"{where}: step_s must be > 0; got {values['step_s']!r}")
    for key, low in (("interval", 1), ("persist_every", 0)):
        value = values.get(key, Costs.__dataclass_fields__[key].default)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise PlanError(f"{where}: {key} must be a whole number >= {low}; got {value!r}")
    fields = {k: values[k] for k in Costs.__dataclass_fields__ if k in values and k != "notes"}
    fields["recovery_s"] = {k: float(v) for k, v in recovery.items()}
    return Costs(**fields, notes=notes)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
