"""The settings that maximise goodput per booked GPU at a given size: the snapshot interval, ``persist_every``,
spare nodes and (with the peer tier) replicas, by coordinate ascent over candidate grids, each point simulated with
the same random faults (common random numbers, so the comparisons are sharper than each result's interval).

The sweeps start from Young/Daly on the faults each tier serves: the snapshot interval from the rate of the faults
that resume from a memory snapshot or a replica (``Layers.tiers``) and the snapshot's cost with the replicas' copies;
``persist_every`` from the rate of those that resume from the persistent tier and a persisted write's slowdown of
the steps. Spare nodes are GPUs booked but idle: the objective is goodput x GPUs / (GPUs + spares x GPUs per node);
the job's own goodput is reported beside it."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from trainer.planning import LAYERS
from trainer.planning.failures import FailureModel
from trainer.planning.simulate import Cluster, Costs, Layers, Result, simulate, with_spares

PERSIST_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
SPARE_CANDIDATES = (0, 1, 2, 4, 8, 16)
REPLICA_CANDIDATES = (1, 2)
INTERVAL_FACTORS = (0.25, 0.5, 0.71, 1.0, 1.41, 2.0, 4.0)


def served_rates(model: FailureModel, gpus: int, layers: Layers) -> dict[str, float]:
    """Faults per second by the tier they resume from (``memory`` with replicas, ``persistent``) under ``layers``."""
    rates = model.layer_rates(gpus)
    if not layers.inprocess:
        rates["injob"] += rates.pop("inprocess")
    tiers = layers.tiers()
    out = {"memory": 0.0, "persistent": 0.0}
    for layer in LAYERS:
        out["persistent" if tiers[layer] == "persistent" else "memory"] += rates.get(layer, 0.0)
    return out


def young_daly_interval(costs: Costs, model: FailureModel, gpus: int, layers: Layers | None = None) -> int:
    """Young/Daly's interval in steps for the faults that resume from memory (or a replica): sqrt(2 C / rate),
    C the snapshot's cost with its replicas' copies; the costs' own interval when no fault resumes from memory."""
    layers = layers or Layers("today")
    rate = served_rates(model, gpus, layers)["memory"]
    cost = costs.snapshot_s + (layers.replicas * costs.copy_s() if layers.peer_tier else 0.0)
    if rate <= 0:
        return costs.interval
    return max(1, round(math.sqrt(2.0 * max(cost, 1e-3) / rate) / costs.step_s))


def young_daly_persist_every(costs: Costs, model: FailureModel, gpus: int, layers: Layers, interval: int) -> int:
    """Young/Daly for the persistent tier, in snapshots: sqrt(2 W / rate) over a snapshot cycle, W a persisted
    write's slowdown of the steps, rate that of the faults that resume from the persistent tier (1 when writes
    cost the steps nothing)."""
    rate = served_rates(model, gpus, layers)["persistent"]
    if costs.persist_overhead_s <= 0 or rate <= 0:
        return 1
    return max(1, round(math.sqrt(2.0 * costs.persist_overhead_s / rate) / (interval * costs.step_s)))


def recommend(costs: Costs, cluster: Cluster, model: FailureModel, layers: Layers, *, days: float = 30.0,
              trials: int = 200, seed: int = 0) -> dict[str, Any]:
    def run(setting: dict[str, int], n: int) -> Result:
        return simulate(costs, with_spares(cluster, setting["spares"]), model,
                        replace(layers, replicas=setting["replicas"]), interval=setting["interval"],
                        persist_every=setting["persist_every"], days=days, trials=n, seed=seed)

    current = {"interval": costs.interval, "persist_every": costs.persist_every, "spares": cluster.spare_nodes,
               "replicas": layers.replicas if layers.peer_tier else 0}
    young = young_daly_interval(costs, model, cluster.gpus, layers)
    young_persist = young_daly_persist_every(costs, model, cluster.gpus, layers, young)
    grids = {"interval": sorted({costs.interval, *(max(1, round(young * f)) for f in INTERVAL_FACTORS)}),
             "persist_every": sorted({costs.persist_every, young_persist, *PERSIST_CANDIDATES} - {0}),
             "spares": sorted({cluster.spare_nodes, *SPARE_CANDIDATES}),
             "replicas": list(REPLICA_CANDIDATES) if layers.peer_tier else [0]}
    best, sweep_trials, seen = dict(current), max(32, trials // 2), {}

    def score(setting: dict[str, int]) -> float:
        key = tuple(sorted(setting.items()))
        if key not in seen:
            seen[key] = run(setting, sweep_trials).goodput_per_booked_gpu
        return seen[key]

    for _ in range(2):
        for name, grid in grids.items():
            best[name] = max(grid, key=lambda v: score({**best, name: v}))
    now, then = run(current, trials), run(best, trials)
    rates = served_rates(model, cluster.gpus, layers)
    return {"young_daly_interval": young, "young_daly_persist_every": young_persist,
            "faults_per_day_by_tier": {k: round(v * 86400, 3) for k, v in rates.items()},
            "current": {**current, **_brief(now)}, "recommended": {**best, **_brief(then)},
            "simulations": len(seen) + 2, "recommended_result": then.to_dict(), "current_result": now.to_dict()}


def _brief(result: Result) -> dict[str, float]:
    return {"goodput": round(result.goodput, 4), "ci95": round(result.ci95, 4),
            "goodput_per_booked_gpu": round(result.goodput_per_booked_gpu, 4)}
