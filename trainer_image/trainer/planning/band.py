"""The uncertainty of a projection beyond its Monte Carlo interval: a band over the failure model's own rate (the 95 %
Poisson interval of the count it was made from: ``FailureModel.rate_band``) and over every input that was not measured
(each default, the replacement pod's time included, at x0.5 and x1.5), each alone and both together.

Goodput falls as a rate or a cost grows, so each band's ends are two simulations: the low end with the high rate and
every unmeasured cost x1.5, the high end with the low rate and x0.5, on the same random numbers as the projection."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from trainer.planning import LAYERS
from trainer.planning.failures import FailureModel
from trainer.planning.simulate import Cluster, Costs, Layers, simulate

SPREAD = 0.5
"""An unmeasured input is taken at (1 - SPREAD) and (1 + SPREAD) times its default."""


def unmeasured(costs: Costs, replacement_default: bool) -> list[str]:
    """The inputs that hold a default (``costs.sources``), and ``replacement_s`` when it was not given."""
    names = [k for k, src in costs.sources.items() if src.get("kind") == "default"]
    return names + (["replacement_s"] if replacement_default else [])


def scaled(costs: Costs, cluster: Cluster, names: list[str], factor: float, interval: int) -> tuple[Costs, Cluster]:
    """Every input in ``names`` times ``factor`` (a derived default is resolved first: the peer tier's copy cost from
    the snapshot cost, its lag from the interval, its restore from the node layer's)."""
    changes: dict[str, Any] = {}
    recovery = dict(costs.recovery_s)
    for name in names:
        if name.startswith("recovery_") and name[len("recovery_"):] in LAYERS:
            recovery[name[len("recovery_"):]] *= factor
        elif name == "peer_copy_s":
            changes[name] = costs.copy_s() * factor
        elif name == "peer_lag_s":
            changes[name] = costs.lag_s(interval) * factor
        elif name == "peer_restore_s":
            restore = costs.recovery_s["node"] if costs.peer_restore_s is None else costs.peer_restore_s
            changes[name] = restore * factor
        elif name != "replacement_s":
            changes[name] = getattr(costs, name) * factor
    out = replace(costs, recovery_s=recovery, **changes)
    return out, replace(cluster, replacement_s=cluster.replacement_s * factor) if "replacement_s" in names else cluster


def band(costs: Costs, cluster: Cluster, model: FailureModel, layers: Layers, *, replacement_default: bool,
         interval: int | None = None, persist_every: int | None = None, **kw: Any) -> dict[str, Any]:
    """Per source of uncertainty (``rate``, ``unmeasured``, ``both``): the goodput's low and high end, and per booked
    GPU; ``rate`` is None when the failure model gives no event count, ``unmeasured`` None when every input was
    measured or given."""
    interval = costs.interval if interval is None else interval
    names = unmeasured(costs, replacement_default)
    rate = model.rate_band()
    models = (model.scaled(rate[1]), model.scaled(rate[0])) if rate else (model, model)
    low_costs, low_cluster = scaled(costs, cluster, names, 1 + SPREAD, interval)
    high_costs, high_cluster = scaled(costs, cluster, names, 1 - SPREAD, interval)

    def ends(low: tuple[Costs, Cluster, FailureModel], high: tuple[Costs, Cluster, FailureModel]) -> dict[str, Any]:
        results = [simulate(c, k, m, layers, interval=interval, persist_every=persist_every, **kw)
                   for c, k, m in (low, high)]
        return {"goodput": [round(r.goodput, 4) for r in results],
                "goodput_per_booked_gpu": [round(r.goodput_per_booked_gpu, 4) for r in results]}

    out: dict[str, Any] = {"unmeasured_inputs": names, "rate_factors": [round(x, 4) for x in rate] if rate else None,
                           "rate": None, "unmeasured": None}
    if rate:
        out["rate"] = ends((costs, cluster, models[0]), (costs, cluster, models[1]))
    if names:
        out["unmeasured"] = ends((low_costs, low_cluster, model), (high_costs, high_cluster, model))
    out["both"] = ends((low_costs, low_cluster, models[0]), (high_costs, high_cluster, models[1]))
    return out
