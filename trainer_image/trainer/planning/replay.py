"""Replay a recorded run: its own fault schedule (which layer recovered each fault, at which step) with its measured
costs (``costs``), through the planner's model of the tiers, and predict the goodput its ledger measured.

The prediction is the run's wall time (the ledger's ``summary``: from the ``start`` record to the end of training):

    wall = steps x ``step_s`` + snapshots x ``snapshot_s`` + persisted writes x ``persist_overhead_s``
           + the first step's excess over ``step_s`` (compilation, warm-up) + the final save
           + per fault: its layer's recovery (``recovery_s``) + the steps it redoes x ``step_s``

where the steps redone follow from the model, not from the ledger: a memory-tier layer resumes from the newest
snapshot published before the fault (``publish_s``), a persistent-tier one from the newest checkpoint committed by its
restart (a preemption's final save included); only for a fault that was not injected (its step unknown) the
ledger's ``steps_redone`` is taken. Compared in the project's strict measure (``bench/figures.py``):
goodput = steps x ``step_s`` / wall, measured with the ledger's wall. The ledger's own goodput (productive = the step
times of the steps that count) is reported beside it: it also counts as productive the first step after each restart,
whose excess over ``step_s`` the planner charges to the recovery (``recovery_s`` runs to that step's end).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trainer.planning import LAYERS, PlanError
from trainer.planning.costs import from_run, read_jsonl
from trainer.planning.simulate import Costs, Layers


def replay(run_dir: str | Path, costs: Costs | None = None, layers: Layers | None = None) -> dict[str, Any]:
    run = Path(run_dir)
    costs = costs or from_run(run)
    layers = layers or Layers("today")
    ledger, metrics = read_jsonl(run / "recovery.jsonl"), read_jsonl(run / "metrics.jsonl")
    summary = next((r for r in reversed(ledger) if r.get("event") == "summary"), None)
    if summary is None or not summary.get("goodput"):
        raise PlanError(f"{run / 'recovery.jsonl'} has no summary with a goodput: the run did not finish training")
    recovered = [r for r in ledger if r.get("event") == "recovered" and r.get("layer") in LAYERS]
    if not recovered:
        raise PlanError(f"{run / 'recovery.jsonl'} has no recovery (no 'recovered' record): nothing to replay")
    steps = int(summary["steps"])
    first_excess = costs.first_step_excess_s
    commits = sorted((r["time"], r["step"]) for r in ledger if r.get("event") == "persisted")
    restarts = sorted(r["time"] for r in ledger if r.get("event") == "restart" and r.get("rank") == 0)
    publish_steps = math.ceil(costs.publish_s / costs.step_s - 1e-9)
    tiers = layers.tiers()
    rows, redone_total, recovery_total = [], 0, 0.0
    for r in recovered:
        fault_step = r.get("fault_step")
        at = max((t for t in restarts if t <= r["time"]), default=r["time"])  # its restart: what was committed by
        if not isinstance(fault_step, int):  # a fault that was not injected: its step is unknown, take the ledger's
            redone = r.get("steps_redone") or 0
        elif tiers[r["layer"]] == "memory":  # then is there to resume from (a preemption's final save included)
            redone = max(0, fault_step - 1 - (fault_step - 1 - publish_steps) // costs.interval * costs.interval)
        else:
            redone = max(0, fault_step - 1 - max((step for t, step in commits if t <= at), default=0))
        redone_total += redone
        recovery_total += costs.recovery_s[r["layer"]]
        rows.append({"layer": r["layer"], "fault": r.get("fault_kind"), "fault_step": fault_step,
                     "steps_redone_predicted": redone, "steps_redone_recorded": r.get("steps_redone"),
                     "recovery_s_used": round(costs.recovery_s[r["layer"]], 3),
                     "recovery_s_recorded": r.get("recovery_s")})
    writes = len(commits)
    work = steps * costs.step_s
    wall = (work + steps // costs.interval * costs.snapshot_s + writes * costs.persist_overhead_s + first_excess
            + recovery_total + redone_total * costs.step_s + costs.final_save_s)
    predicted, measured = work / wall, work / float(summary["wall_s"])
    return {"run": str(run), "steps": steps, "faults": rows, "measure": "strict",
            "measured_goodput": round(measured, 4), "predicted_goodput": round(predicted, 4),
            "difference_points": round(100 * (predicted - measured), 2),
            "predicted": {"work_s": round(work, 3), "wall_s": round(wall, 3)},
            "measured": {"wall_s": summary.get("wall_s"), "ledger_goodput": summary.get("goodput"),
                         "productive_s": summary.get("productive_s")}, "costs": costs.to_dict()}


def replay_figures(path: str | Path, costs: Costs, layers: Layers | None = None) -> dict[str, Any]:
    """Replay a GPU goodput run from its figure lines (``costs.from_figures``), in its strict measure: fault-free step
    time x steps / (first step's start to last step's end). Work = steps x ``step_s``; lost = each fault's layer
    recovery, the steps it redoes (from the model's tiers), the snapshots, the first step's excess."""
    lines = read_jsonl(Path(path))
    tiers = (layers or Layers("today")).tiers()
    if not costs.steps or not costs.goodput_strict:
        raise PlanError(f"{path}: the goodput_strict line has no steps or goodput_strict")
    publish_steps = math.ceil(costs.publish_s / costs.step_s - 1e-9)
    rows, lost = [], costs.first_step_excess_s + costs.steps // costs.interval * costs.snapshot_s
    for r in lines:
        if r.get("figure") != "recovery" or r.get("layer") not in LAYERS or not isinstance(r.get("fault_step"), int):
            continue
        if tiers[r["layer"]] != "memory":
            raise PlanError(f"{path}: a {r['layer']} recovery needs the persistent tier's commits, not in figure lines")
        newest = (r["fault_step"] - 1 - publish_steps) // costs.interval * costs.interval
        redone = max(0, r["fault_step"] - 1 - newest)
        lost += costs.recovery_s[r["layer"]] + redone * costs.step_s
        rows.append({"layer": r["layer"], "fault_step": r["fault_step"], "steps_redone_predicted": redone,
                     "steps_redone_recorded": r.get("steps_redone"), "recovery_s_recorded": r.get("recovery_s")})
    work = costs.steps * costs.step_s
    predicted = work / (work + lost)
    return {"run": str(path), "steps": costs.steps, "faults": rows, "measure": "strict",
            "measured_goodput": costs.goodput_strict, "predicted_goodput": round(predicted, 4),
            "difference_points": round(100 * (predicted - costs.goodput_strict), 2),
            "predicted": {"work_s": round(work, 3), "lost_s": round(lost, 3)}, "costs": costs.to_dict()}
