"""Failure models: rates per GPU-hour by class, each class mapped to the layer that recovers it.

Layers (``trainer.ledger``): a software exception or a collective timeout -> ``inprocess``; a killed or hung worker
-> ``injob``; a lost GPU, HBM error, NIC or host -> ``node`` (a spare or a new pod; state from the peer tier when it
exists, else the persistent tier); a switch, a cable, several nodes at once -> ``cluster``.

Built-in models (sources and what was verified: ``PLANNING.md``):

- ``llama3`` (default): "The Llama 3 Herd of Models" (Meta, 2024), Table 5: 419 unexpected interruptions in 54 days of
  pre-training on 16,384 H100 GPUs, by component. The counts are used, not the printed percentages ("Faulty GPU": 148
  interruptions, 35.3 % of 419, printed as 30.1 %). Rate of a class = count / (16,384 GPUs x 54 x 24 h).
- ``rsc1``, ``rsc2``: Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research Clusters"
  (Meta, HPCA 2025, arXiv 2410.21680): 6.50 and 2.34 failures per 1,000 node-days on the two A100 clusters RSC-1 and
  RSC-2 (8 GPUs a node). The paper's totals; the split by class is Llama 3's shares (the planner needs one), scaled to
  each total.

A user file (JSON): ``{"name": "...", "source": "...", "events": 120, "classes": [{"name": "...", "layer": "node",
"per_gpu_hour": 1.2e-5}, ...]}`` (``events``, optional: how many events the rates were counted from, for the band
over the rate's uncertainty).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.planning import LAYERS, PlanError

LLAMA3_GPUS = 16384
LLAMA3_DAYS = 54
LLAMA3_SOURCE = ("The Llama 3 Herd of Models (Meta, 2024, arXiv 2407.21783), Table 5: 419 unexpected interruptions "
                 "in 54 days on 16,384 H100 GPUs")
LLAMA3_TABLE5 = (
    # (component, count, layer): the paper's component names and counts; the layer is this project's mapping.
    ("Faulty GPU", 148, "node"),
    ("GPU HBM3 Memory", 72, "node"),
    ("Software Bug", 54, "inprocess"),  # an exception in the training processes
    ("Network Switch/Cable", 35, "cluster"),  # every node behind the switch at once
    ("Host Maintenance", 32, "node"),  # unplanned: the host is taken out
    ("GPU SRAM Memory", 19, "node"),
    ("GPU System Processor", 17, "node"),
    ("NIC", 7, "node"),
    ("NCCL Watchdog Timeouts", 7, "inprocess"),  # a collective timeout
    ("Silent Data Corruption", 6, "node"),  # the GPU is taken out
    ("GPU Thermal Interface + Sensor", 6, "node"),
    ("SSD", 3, "node"),
    ("Power Supply", 3, "node"),
    ("Server Chassis", 2, "node"),
    ("IO Expansion Board", 2, "node"),
    ("Dependency", 2, "injob"),  # a worker killed or hung by what it depends on
    ("CPU", 2, "node"),
    ("System Memory", 2, "node"),
)
RSC_SOURCE = ("Kokolis et al., Revisiting Reliability in Large-Scale Machine Learning Research Clusters (Meta, HPCA "
              "2025, arXiv 2410.21680): {rate} failures per 1,000 node-days on {cluster} (8 A100 a node); split by "
              "class as Llama 3's Table 5")
RSC_NODE_DAY_RATES = {"rsc1": 6.50, "rsc2": 2.34}
RSC_GPUS_PER_NODE = 8


@dataclass(frozen=True)
class FailureClass:
    name: str
    layer: str
    per_gpu_hour: float


@dataclass(frozen=True)
class FailureModel:
    name: str
    source: str
    classes: tuple[FailureClass, ...]
    events: int | None = None
    """How many events the rates were counted from (Llama 3: 419), for the band over the rate's own uncertainty
    (``rate_band``); None: the source gives no count."""

    def scaled(self, factor: float) -> "FailureModel":
        """Every class's rate times ``factor`` (the same mix)."""
        return FailureModel(f"{self.name} x{factor:.3f}", self.source,
                            tuple(FailureClass(c.name, c.layer, c.per_gpu_hour * factor) for c in self.classes),
                            self.events)

    def rate_band(self) -> tuple[float, float] | None:
        """The 95 % interval of the rate's factor: a Poisson count's exact (Garwood) interval over the count, through
        Wilson and Hilferty's cube-root approximation of the chi-square quantiles (within 0.5 % of the exact
        interval from 10 events on: ``tests/unit/test_planner_inputs.py``); None without a count."""
        if not self.events:
            return None
        return poisson_interval(self.events)[0] / self.events, poisson_interval(self.events)[1] / self.events

    def per_gpu_hour(self) -> float:
        return sum(c.per_gpu_hour for c in self.classes)

    def layer_rates(self, gpus: int) -> dict[str, float]:
        """Faults per second of a job on ``gpus`` GPUs, by the layer that recovers them."""
        rates = {layer: 0.0 for layer in LAYERS}
        for c in self.classes:
            rates[c.layer] += c.per_gpu_hour * gpus / 3600.0
        return rates

    def mtbf_s(self, gpus: int) -> float:
        """Mean time between faults (any layer) of a job on ``gpus`` GPUs, in seconds."""
        total = sum(self.layer_rates(gpus).values())
        return math.inf if total <= 0 else 1.0 / total

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source,
                "classes": [{"name": c.name, "layer": c.layer, "per_gpu_hour": c.per_gpu_hour} for c in self.classes]}


def poisson_interval(count: int, z: float = 1.959964) -> tuple[float, float]:
    """The two-sided 95 % interval of a Poisson mean given ``count`` events: chi2(0.025, 2k)/2 and
    chi2(0.975, 2k+2)/2, each by Wilson-Hilferty."""
    def wh(k: float, sign: float) -> float:
        return k * (1 - 1 / (9 * k) + sign * z / (3 * math.sqrt(k))) ** 3

    return (wh(count, -1.0) if count > 0 else 0.0), wh(count + 1, 1.0)


def llama3() -> FailureModel:
    gpu_hours = LLAMA3_GPUS * LLAMA3_DAYS * 24.0
    classes = tuple(FailureClass(name, layer, count / gpu_hours) for name, count, layer in LLAMA3_TABLE5)
    return FailureModel("llama3", LLAMA3_SOURCE, classes, events=sum(count for _, count, _ in LLAMA3_TABLE5))


def rsc(cluster: str) -> FailureModel:
    per_gpu_hour = RSC_NODE_DAY_RATES[cluster] / 1000.0 / (RSC_GPUS_PER_NODE * 24.0)
    total = sum(count for _, count, _ in LLAMA3_TABLE5)
    classes = tuple(FailureClass(name, layer, per_gpu_hour * count / total) for name, count, layer in LLAMA3_TABLE5)
    return FailureModel(cluster, RSC_SOURCE.format(rate=f"{RSC_NODE_DAY_RATES[cluster]:.2f}",
                                                   cluster=cluster.upper().replace("RSC", "RSC-")), classes)


BUILT_IN = {"llama3": llama3, "rsc1": lambda: rsc("rsc1"), "rsc2": lambda: rsc("rsc2")}


def load(spec: str) -> FailureModel:
    """A built-in model by name (``llama3``, ``rsc1``, ``rsc2``) or a JSON file of rates."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]()
    path = Path(spec)
    if not path.is_file():
        raise PlanError(f"failure model {spec!r}: not one of {', '.join(BUILT_IN)} and no such file")
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise PlanError(f"failure model {path}: not JSON ({exc})") from None
    return from_dict(data, str(path))


def from_dict(data: Any, where: str) -> FailureModel:
    """A failure model from its JSON form; PlanError naming the first bad class."""
    if not isinstance(data, dict) or not isinstance(data.get("classes"), list) or not data["classes"]:
        raise PlanError(f"failure model {where}: needs \"classes\": a non-empty list of {{name, layer, per_gpu_hour}}")
    classes = []
    for i, c in enumerate(data["classes"]):
        name = c.get("name", f"class {i}") if isinstance(c, dict) else f"class {i}"
        if not isinstance(c, dict) or c.get("layer") not in LAYERS:
            raise PlanError(f"failure model {where}: {name}: \"layer\" must be one of {', '.join(LAYERS)}")
        rate = c.get("per_gpu_hour")
        if rate is None:
            raise PlanError(f"failure model {where}: {name}: \"per_gpu_hour\" is missing (failures per GPU-hour)")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate < 0:
            raise PlanError(f"failure model {where}: {name}: \"per_gpu_hour\" must be a number >= 0; got {rate!r}")
        classes.append(FailureClass(str(name), c["layer"], float(rate)))
    if sum(c.per_gpu_hour for c in classes) <= 0:
        raise PlanError(f"failure model {where}: every rate is 0; give at least one class a rate > 0")
    events = data.get("events")
    if events is not None and (isinstance(events, bool) or not isinstance(events, int) or events < 1):
        raise PlanError(f"failure model {where}: \"events\" (the count the rates come from) must be a whole number "
                        f">= 1; got {events!r}")
    return FailureModel(str(data.get("name", where)), str(data.get("source", "user file")), tuple(classes), events)
