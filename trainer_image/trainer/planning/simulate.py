"""A discrete-event simulation of a training job under a failure model: N trials, the mean goodput with a 95 %
confidence interval, and where the rest of the time went.

The job (per trial, vectorised over the trials with numpy):

- trains in cycles: ``interval`` steps of work, then a memory snapshot that costs ``snapshot_s``; a snapshot is
  usable ``publish_s`` after it ends (a fault in between falls back to the one before);
- with the peer tier (``Layers.peer_tier``, ``replicas`` other nodes hold a copy of each node's snapshot), each
  snapshot is also copied to the replica holders in the background: the copies slow the steps by ``peer_copy_s`` per
  replica (measured; by default one snapshot's cost), and a replica is usable ``peer_lag_s`` after its snapshot is;
- every ``persist_every``-th snapshot is also written to the persistent tier in the background: the write takes
  ``persist_write_s`` from its snapshot to its commit and slows the steps by ``persist_overhead_s`` in all; a write due
  while the previous one still runs goes with the next snapshot that finds the writer free (``PersistPolicy``), so the
  persistent tier falls further behind as the write time grows; a write in flight when a fault strikes is lost;
- faults arrive as a Poisson process at the failure model's rate for the job's GPUs; each is recovered by the layer
  of its class (``failures``); the layer's tier says where training resumes and what the recovery costs
  (``Layers.tiers``, ``Costs.layer_recovery``): in-process, and in-job with the node-local tier, from the newest
  usable snapshot; in-job without node-local from the persistent tier (its restore phase from memory swapped for a
  read of the persistent tier); a node fault from the newest replica with the peer tier (``peer_restore_s``), else
  from the persistent tier (or the persistent tier's newer step: a restore takes the newest a tier holds); the
  cluster layer from the persistent tier;
- the peer tier's capacity: a lost node's replicas (those it held for others) are gone until the first snapshot
  after its recovery is copied again; a node fault in that window whose every replica holder was among the nodes
  lost in it (drawn: the holders are ``replicas`` of the other nodes) restores from the persistent tier;
- a node fault also takes a spare when one is free, else waits for a replacement pod (``replacement_s``; each spare
  taken is replaced by a new pod after ``replacement_s``); a fault during a recovery starts another recovery.

Goodput = work done that is kept (steps not redone) / wall time, over ``days`` of wall time; per booked GPU it is
multiplied by GPUs / (GPUs + spare nodes x GPUs per node): spares are booked and idle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from trainer.planning import LAYERS, PlanError
from trainer.planning.defaults import DEFAULTS
from trainer.planning.failures import FailureModel

NO_PERSIST = 1e12
"""``persist_every = 0`` (only the final save): a cycle count that is never reached."""
Z95 = 1.959964


@dataclass(frozen=True)
class Costs:
    """A run's costs in seconds, each with where it came from (``sources``: ``costs``)."""

    step_s: float
    snapshot_s: float
    persist_write_s: float
    recovery_s: dict[str, float]
    """Per layer: fault -> first productive step, less that step's own time (waiting for a pod not included); the
    node layer's restores from the persistent tier."""
    publish_s: float = 0.0
    persist_overhead_s: float = 0.0
    restore_memory_s: float = 0.0
    """The in-job restart's restore phase from node-local memory (taken out without the node-local tier)."""
    restore_persistent_s: float = 0.0
    """A state's read from the persistent tier (put in instead without the node-local tier)."""
    peer_copy_s: float | None = None
    """The peer tier's step-time cost per snapshot and replica (background copies); None: ``snapshot_s``."""
    peer_lag_s: float | None = None
    """From a snapshot's publication to its replicas' arrival; None: one snapshot interval."""
    peer_restore_s: float | None = None
    """A lost node restored from a peer's memory (fault -> first productive step, less it); None: the node layer's."""
    interval: int = 10
    persist_every: int = 1
    source: str = ""
    first_step_excess_s: float = 0.0
    """A run's first step's time over ``step_s`` (``replay`` only)."""
    final_save_s: float = 0.0
    """A run's final save (synchronous; inside the ledger's wall time: ``replay`` only)."""
    steps: int | None = None
    """The recorded run's steps (figures only: ``replay``)."""
    goodput_strict: float | None = None
    """The recorded run's strict goodput (figures only: ``replay``)."""
    notes: tuple[str, ...] = ()
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Input -> ``{"kind": measured | given | default, "from", "measure"}`` (``costs.INPUTS``)."""

    def copy_s(self) -> float:
        return self.snapshot_s if self.peer_copy_s is None else self.peer_copy_s

    def lag_s(self, interval: int) -> float:
        return interval * self.step_s if self.peer_lag_s is None else self.peer_lag_s

    def layer_recovery(self, layers: "Layers") -> dict[str, float]:
        """Each layer's recovery under ``layers``: without node-local the in-job restart reads the persistent tier
        instead of memory; with the peer tier a node restores from a peer's memory."""
        out = dict(self.recovery_s)
        if not layers.node_local:
            out["injob"] = max(0.0, out["injob"] - self.restore_memory_s) + self.restore_persistent_s
        if layers.peer_tier:
            out["node"] = out["node"] if self.peer_restore_s is None else self.peer_restore_s
        return out

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("step_s", "snapshot_s", "publish_s", "persist_write_s",
                                                "persist_overhead_s", "restore_memory_s", "restore_persistent_s",
                                                "peer_copy_s", "peer_lag_s", "peer_restore_s", "recovery_s",
                                                "interval", "persist_every", "source", "sources")} | {
            "notes": list(self.notes)}


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    spare_nodes: int = 0
    replacement_s: float = DEFAULTS["replacement_s"].value
    """The time to get a replacement pod for a lost node (``defaults``: Kubernetes' eviction defaults)."""

    def check(self) -> None:
        if self.gpus_per_node < 1:
            raise PlanError(f"gpus per node must be >= 1; got {self.gpus_per_node}")
        if self.gpus < self.gpus_per_node:
            raise PlanError(f"a cluster of {self.gpus} GPU(s) is smaller than one node of {self.gpus_per_node}; "
                            "give --gpus >= --gpus-per-node")
        if self.spare_nodes < 0 or self.replacement_s < 0:
            raise PlanError("spare nodes and the replacement pod's time must be >= 0")


@dataclass(frozen=True)
class Layers:
    """A recovery configuration: which layers and tiers exist."""

    name: str
    inprocess: bool = True
    node_local: bool = True
    peer_tier: bool = False
    replicas: int = 1
    """Other nodes holding a copy of each node's snapshot (``checkpoint.replicas``), with the peer tier."""

    def tiers(self) -> dict[str, str]:
        """Where each layer resumes from: ``memory`` (newest usable snapshot), ``peer`` (newest replica) or
        ``persistent``."""
        return {"inprocess": "memory", "injob": "memory" if self.node_local else "persistent",
                "node": "peer" if self.peer_tier and self.replicas >= 1 else "persistent", "cluster": "persistent"}


CONFIGURATIONS = {
    "today": Layers("today's layers, no replica"),
    "no-inprocess": Layers("without in-process", inprocess=False),
    "no-node-local": Layers("without node-local", node_local=False),
    "peer": Layers("with the peer tier (1 replica)", peer_tier=True, replicas=1),
}


@dataclass
class Result:
    goodput: float
    ci95: float
    trials: int
    days: float
    interval: int
    persist_every: int
    spares: int
    replicas: int
    faults_per_day: float
    goodput_per_booked_gpu: float = 0.0
    """Goodput x GPUs / (GPUs + spare nodes x GPUs per node)."""
    losses: dict[str, float] = field(default_factory=dict)
    """Share of wall time per cause: ``recovery_<layer>``, ``waiting_for_node``, ``redone``, ``snapshots``,
    ``peer_copies``, ``persist``."""

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in self.__dict__.items() if k != "losses"} | {
            "losses": {k: round(v, 5) for k, v in self.losses.items()}}


def _cycles(e: np.ndarray, tau: float, c: float, m: float, o: float) -> tuple[np.ndarray, ...]:
    """For ``e`` seconds of training since a (re)start: (work, snapshot time, persist overhead, snapshots done). A
    cycle is ``tau`` of work and a snapshot of ``c``; every ``m``-th cycle adds ``o`` of persist overhead."""
    cycle = tau + c
    span = m * cycle + o
    q = np.floor(e / span)
    r = e - q * span
    i = np.minimum(np.floor(r / cycle), m)
    rr = r - i * cycle
    inside = i < m
    work = q * m * tau + np.where(inside, i * tau + np.minimum(rr, tau), m * tau)
    snap = q * m * c + np.where(inside, i * c + np.maximum(rr - tau, 0.0), m * c)
    over = q * o + np.where(inside, 0.0, r - m * cycle)
    return work, snap, over, q * m + i


def _done(e: np.ndarray, tau: float, c: float, m: float, o: float) -> np.ndarray:
    return np.where(e > 0, _cycles(np.maximum(e, 0.0), tau, c, m, o)[3], 0.0)


def persist_cycles(costs: Costs, interval: int, persist_every: int, c: float) -> float:
    """Snapshots between persisted writes: ``persist_every``, or more when a write outlasts them (the writer is
    busy)."""
    if persist_every <= 0:
        return NO_PERSIST
    cycle = interval * costs.step_s + c
    return float(max(persist_every, math.ceil((costs.persist_write_s + c) / cycle - 1e-9)))


def simulate(costs: Costs, cluster: Cluster, model: FailureModel, layers: Layers, *, interval: int | None = None,
             persist_every: int | None = None, days: float = 30.0, trials: int = 200, seed: int = 0,
             rates: dict[str, float] | None = None) -> Result:
    """Goodput of the job over ``days`` of wall time, ``trials`` times; ``rates`` (faults per second by layer)
    replaces the model's rates at the cluster's size (the closed-form tests). The same ``seed`` draws the same
    faults for every configuration (common random numbers: their differences are sharper than each interval)."""
    cluster.check()
    interval = costs.interval if interval is None else interval
    persist_every = costs.persist_every if persist_every is None else persist_every
    if interval < 1:
        raise PlanError(f"the snapshot interval must be >= 1 step; got {interval}")
    rates = dict(rates or model.layer_rates(cluster.gpus))
    if not layers.inprocess:
        rates["injob"] += rates["inprocess"]
        rates["inprocess"] = 0.0
    total = sum(rates.values())
    horizon = days * 86400.0
    nodes = cluster.gpus // cluster.gpus_per_node
    replicas = min(layers.replicas, nodes - 1) if layers.peer_tier else 0
    layers = replace(layers, peer_tier=replicas >= 1, replicas=max(replicas, 0))
    copies = replicas * costs.copy_s()
    c = costs.snapshot_s + copies
    tau = interval * costs.step_s
    lag = costs.lag_s(interval)
    m = persist_cycles(costs, interval, persist_every, c)
    o = costs.persist_overhead_s if m < NO_PERSIST else 0.0
    tiers = layers.tiers()
    tier = np.array([("memory", "peer", "persistent").index(tiers[layer]) for layer in LAYERS])
    by_layer = costs.layer_recovery(layers)
    recovery = np.array([by_layer[layer] for layer in LAYERS])
    node = LAYERS.index("node")

    rng = np.random.default_rng(seed)
    n = trials
    expected = total * horizon
    k = int(expected + 10 * math.sqrt(expected) + 20) if total > 0 else 0
    times = np.cumsum(rng.exponential(1.0 / total, (n, k)), axis=1) if k else np.zeros((n, 0))
    while k and times[:, -1].min() < horizon:  # (never in practice) more faults than drawn
        more = times[:, -1:] + np.cumsum(rng.exponential(1.0 / total, (n, k)), axis=1)
        times = np.concatenate([times, more], axis=1)
    kinds = rng.choice(len(LAYERS), size=times.shape, p=[rates[x] / total for x in LAYERS]) if k else times.astype(int)
    draws = rng.random(times.shape) if layers.peer_tier else None  # which nodes a node fault hit (capacity)

    s0 = np.zeros(n)  # when training (re)starts
    base = np.zeros(n)  # the work position it restarts from
    pers = np.zeros(n)  # the newest committed persistent checkpoint's position
    exposed_until, exposed = np.zeros(n), np.zeros(n)  # replicas lost with nodes, until copied again
    rec_start, rec_wait, rec_layer = np.zeros(n), np.zeros(n), np.full(n, -1)
    lost = {key: np.zeros(n) for key in ("redone", "snapshots", "peer_copies", "persist", "waiting_for_node",
                                         *(f"recovery_{x}" for x in LAYERS))}
    spares = cluster.spare_nodes
    pending = np.full((n, spares + 1), np.inf)  # replacement pods on their way (each becomes a spare)
    rows = np.arange(n)

    def close_recovery(mask: np.ndarray, until: np.ndarray) -> None:
        """Charge the recovery that started at ``rec_start`` up to ``until`` (its end, or the next fault)."""
        mask = mask & (rec_layer >= 0)
        used = np.where(mask, np.minimum(until, s0) - rec_start, 0.0)
        waited = np.minimum(used, rec_wait)
        lost["waiting_for_node"] += waited
        for i, layer in enumerate(LAYERS):
            lost[f"recovery_{layer}"] += np.where(rec_layer == i, used - waited, 0.0)

    def charge(mask: np.ndarray, snap: np.ndarray, over: np.ndarray) -> None:
        lost["snapshots"] += np.where(mask, snap * (costs.snapshot_s / c if c > 0 else 1.0), 0.0)
        lost["peer_copies"] += np.where(mask, snap * (copies / c if c > 0 else 0.0), 0.0)
        lost["persist"] += np.where(mask, over, 0.0)

    for j in range(times.shape[1]):
        f, kind = times[:, j], kinds[:, j]
        active = f < horizon
        if not active.any():
            break
        training = active & (f >= s0)
        close_recovery(active, f)
        e = np.where(training, f - s0, 0.0)
        work, snap, over, _ = _cycles(e, tau, c, m, o)
        charge(training, snap, over)
        position = np.where(training, base + work, base)
        committed = np.floor(_done(e - costs.persist_write_s, tau, c, m, o) / m) * m * tau
        pers = np.where(training & (committed > 0), np.maximum(pers, base + committed), pers)
        newest = np.where(training, base + tau * _done(e - costs.publish_s, tau, c, m, o), base)
        replica = np.where(training, base + tau * _done(e - costs.publish_s - lag, tau, c, m, o), base)
        hit = active & (kind == node)
        level = tier[kind]
        if layers.peer_tier:  # a node fault whose replica holders were all lost since their replicas were copied
            window = np.where(f < exposed_until, exposed, 0.0)
            level = np.where(hit & (draws[:, j] < _all_holders_lost(window, replicas, nodes)), 2, level)
        persistent = np.minimum(pers, newest)  # a restore takes the newest step a tier holds for every rank
        target = np.select([level == 0, level == 1], [newest, np.maximum(replica, persistent)], persistent)
        lost["redone"] += np.where(active, position - target, 0.0)

        wait = np.zeros(n)
        if hit.any():
            arrived = hit[:, None] & (pending <= f[:, None])
            pending[arrived] = np.inf
            free = spares - np.isfinite(pending).sum(axis=1)
            slot = np.argmax(np.isinf(pending), axis=1)
            pending[rows[hit], slot[hit]] = f[hit] + cluster.replacement_s
            short = hit & (free <= 0)
            if short.any():
                first = np.argmin(pending, axis=1)
                wait = np.where(short, pending[rows, first] - f, 0.0)
                pending[rows[short], first[short]] = np.inf
        rec_start = np.where(active, f, rec_start)
        rec_wait = np.where(active, wait, rec_wait)
        rec_layer = np.where(active, kind, rec_layer)
        s0 = np.where(active, f + wait + recovery[kind], s0)
        base = np.where(active, target, base)
        if layers.peer_tier:
            exposed = np.where(hit, np.where(f < exposed_until, exposed, 0.0) + 1, exposed)
            exposed_until = np.where(hit, s0 + tau + c + costs.publish_s + lag, exposed_until)

    end = np.full(n, horizon)
    close_recovery(np.ones(n, bool), end)
    e = np.maximum(end - s0, 0.0)
    work, snap, over, _ = _cycles(e, tau, c, m, o)
    charge(np.ones(n, bool), snap, over)
    goodput = (base + work) / horizon
    mean = float(goodput.mean())
    return Result(
        goodput=mean, ci95=float(Z95 * goodput.std(ddof=1) / math.sqrt(n)) if n > 1 else math.inf,
        trials=n, days=days, interval=interval, persist_every=persist_every, spares=spares, replicas=replicas,
        faults_per_day=total * 86400.0, goodput_per_booked_gpu=booked(mean, cluster),
        losses={key: float(v.mean() / horizon) for key, v in lost.items()})


def booked(goodput: float, cluster: Cluster) -> float:
    """Goodput per booked GPU: spare nodes count as booked and idle."""
    return goodput * cluster.gpus / (cluster.gpus + cluster.spare_nodes * cluster.gpus_per_node)


def _all_holders_lost(lost_nodes: np.ndarray, replicas: int, nodes: int) -> np.ndarray:
    """The chance that the ``replicas`` holders of a node hit now, drawn among the other ``nodes - 1``, are all
    among the ``lost_nodes`` whose replicas are not copied again yet: C(lost, r) / C(nodes - 1, r)."""
    lost = np.minimum(lost_nodes, nodes - 1)  # a node lost twice in the window counts once
    p = np.ones_like(lost)
    for i in range(replicas):
        p = p * np.clip(lost - i, 0.0, None) / max(nodes - 1 - i, 1)
    return p


def closed_form_goodput(rate: float, interval_s: float, snapshot_s: float, recovery_s: float) -> float:
    """Expected goodput of one recovery layer, exactly, for Poisson faults at ``rate`` that may also strike during a
    snapshot or a recovery, restarting from the last snapshot: each ``interval_s`` of work takes on average
    e^(rate * recovery_s) * (e^(rate * (interval_s + snapshot_s)) - 1) / rate of wall time (the classic
    checkpoint/restart renewal argument). ``PLANNING.md`` says why this stands in for Meta's ETTR model."""
    per_cycle = math.exp(rate * recovery_s) * math.expm1(rate * (interval_s + snapshot_s)) / rate
    return interval_s / per_cycle


def young_daly(rate: float, snapshot_s: float, recovery_s: float) -> tuple[float, float]:
    """Young/Daly's first-order optimum interval sqrt(2 * snapshot * MTBF) and its expected loss there,
    snapshot / interval + rate * (interval / 2 + recovery)."""
    interval = math.sqrt(2.0 * snapshot_s / rate)
    return interval, snapshot_s / interval + rate * (interval / 2.0 + recovery_s)


def with_spares(cluster: Cluster, spares: int) -> Cluster:
    return replace(cluster, spare_nodes=spares)
