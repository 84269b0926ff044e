"""The settings that maximise goodput at a given size: the snapshot interval, ``persist_every``, spare nodes and (where
the peer tier exists: modelled) replicas, by coordinate ascent over candidate grids, each point simulated with the same
random faults (common random numbers, so the comparisons are sharper than each result's interval).

Spare nodes are GPUs booked but idle: the objective is goodput x GPUs / (GPUs + spares x GPUs per node), the share of
the booked GPU time that is training; the job's own goodput is reported beside it."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from trainer.planning.failures import FailureModel
from trainer.planning.simulate import Cluster, Costs, Layers, Result, simulate, with_spares

PERSIST_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
SPARE_CANDIDATES = (0, 1, 2, 4, 8, 16)
REPLICA_CANDIDATES = (2, 3)
INTERVAL_FACTORS = (0.25, 0.5, 0.71, 1.0, 1.41, 2.0, 4.0)


def booked(result: Result, cluster: Cluster) -> float:
    """Goodput per booked GPU: spares count as booked and idle."""
    return result.goodput * cluster.gpus / (cluster.gpus + result.spares * cluster.gpus_per_node)


def young_daly_interval(costs: Costs, model: FailureModel, gpus: int) -> int:
    """Young/Daly's interval in steps for the job's MTBF under ``model`` (the start of the interval sweep)."""
    return max(1, round(math.sqrt(2.0 * max(costs.snapshot_s, 1e-3) * model.mtbf_s(gpus)) / costs.step_s))


def recommend(costs: Costs, cluster: Cluster, model: FailureModel, layers: Layers, *, days: float = 30.0,
              trials: int = 200, seed: int = 0) -> dict[str, Any]:
    def run(setting: dict[str, int], n: int) -> Result:
        return simulate(costs, with_spares(cluster, setting["spares"]), model,
                        replace(layers, replicas=setting["replicas"]), interval=setting["interval"],
                        persist_every=setting["persist_every"], days=days, trials=n, seed=seed)

    current = {"interval": costs.interval, "persist_every": costs.persist_every, "spares": cluster.spare_nodes,
               "replicas": layers.replicas}
    young = young_daly_interval(costs, model, cluster.gpus)
    grids = {"interval": sorted({costs.interval, *(max(1, round(young * f)) for f in INTERVAL_FACTORS)}),
             "persist_every": sorted({costs.persist_every, *PERSIST_CANDIDATES} - {0}),
             "spares": sorted({cluster.spare_nodes, *SPARE_CANDIDATES}),
             "replicas": list(REPLICA_CANDIDATES) if layers.peer_tier else [layers.replicas]}
    best, sweep_trials, seen = dict(current), max(32, trials // 2), {}

    def score(setting: dict[str, int]) -> float:
        key = tuple(sorted(setting.items()))
        if key not in seen:
            result = run(setting, sweep_trials)
            seen[key] = booked(result, with_spares(cluster, setting["spares"]))
        return seen[key]

    for _ in range(2):
        for name, grid in grids.items():
            best[name] = max(grid, key=lambda v: score({**best, name: v}))
    now, then = run(current, trials), run(best, trials)
    return {"young_daly_interval": young, "current": {**current, **_brief(now, cluster, current["spares"])},
            "recommended": {**best, **_brief(then, cluster, best["spares"])}, "simulations": len(seen) + 2,
            "recommended_result": then.to_dict(), "current_result": now.to_dict()}


def _brief(result: Result, cluster: Cluster, spares: int) -> dict[str, float]:
    return {"goodput": round(result.goodput, 4), "ci95": round(result.ci95, 4),
            "goodput_per_booked_gpu": round(booked(result, with_spares(cluster, spares)), 4)}
