"""The simulation's ``Costs``, each input with where it came from (``Costs.sources``): measured by the planned run's
own ledger, measured by an extra ledger (``--measured DIR``: a node loss from the two-node harness, a cluster restart
from the demo), given (``--cost``, a costs file), or a documented default (``defaults``: its source and the command
that would measure it). Missing or bad values raise ``PlanError`` (one line).

Per input, the first that has it: ``--cost`` > the run's own ledger > the extra ledgers in the order given > the
default. What a ledger measures: ``ledgers``. The peer tier's copy cost is measured from two ledgers of the same
model, world size and interval that differ in their replica count (``bench/peer_nodes.py --plan clean:0,clean:auto``):
the difference of their snapshot costs per replica; a run that pushed replicas itself has it inside ``snapshot_s``.

A costs file (JSON) holds the same keys: ``{"step_s", "snapshot_s", "persist_write_s", "recovery_s": {layer: s},
"publish_s", "persist_overhead_s", "restore_memory_s", "restore_persistent_s", "peer_copy_s", "peer_lag_s",
"peer_restore_s", "interval", "persist_every", "source"}``; what it leaves out takes its default.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from trainer.planning import LAYERS, PlanError
from trainer.planning.defaults import DEFAULTS
from trainer.planning.ledgers import Measured, from_figures as measure_figures, measure, number, read_jsonl
from trainer.planning.simulate import Costs

GPU_PUBLISH_STEPS = 3
REQUIRED = ("step_s", "snapshot_s", "persist_write_s", "recovery_s")
OPTIONAL = ("publish_s", "persist_overhead_s", "restore_memory_s", "restore_persistent_s", "peer_copy_s",
            "peer_lag_s", "peer_restore_s")
INPUTS = ("step_s", "snapshot_s", "publish_s", "persist_write_s", "persist_overhead_s",
          *(f"recovery_{x}" for x in LAYERS), "restore_memory_s", "restore_persistent_s", "peer_copy_s",
          "peer_lag_s", "peer_restore_s")
"""Every input the simulation uses, in the order the report lists them (``replacement_s``: the cluster's)."""

__all__ = ["Costs", "INPUTS", "checked", "from_figures", "from_file", "from_run", "read_jsonl"]


def measured(where: str) -> dict[str, str]:
    return {"kind": "measured", "from": where}


def given(where: str) -> dict[str, str]:
    return {"kind": "given", "from": where}


def default(key: str, value: float | None = None) -> dict[str, str]:
    d = DEFAULTS[key]
    return {"kind": "default", "from": d.source, "measure": d.measure,
            **({"value": value} if value is not None else {})}


def from_run(run_dir: str | Path, overrides: dict[str, Any] | None = None, extra: Sequence[str | Path] = ()) -> Costs:
    """The run's own ledger and metrics, the extra ledgers (``--measured``), ``--cost`` overrides, defaults."""
    overrides = dict(overrides or {})
    own = measure(run_dir, overrides.pop("interval", None), overrides.pop("persist_every", None))
    others = [measure(d, own=False) for d in extra]
    if not any(own.recoveries.values()) and not any(m.recoveries for m in others) and \
            not any(k.startswith("recovery_") for k in overrides):
        raise PlanError(f"{Path(run_dir) / 'recovery.jsonl'} has no recovery (no 'recovered' record): the planner "
                        "needs a run with at least one fault, an extra ledger with one (--measured DIR), or a costs "
                        "file")
    return compose(own, others, overrides, f"measured: {run_dir}")


def from_figures(path: str | Path, overrides: dict[str, Any] | None = None,
                 extra: Sequence[str | Path] = ()) -> Costs:
    """A GPU goodput run's figure lines (``ledgers.from_figures``); the interval and persist_every are given."""
    overrides = dict(overrides or {})
    own = measure_figures(path)
    own.interval, own.persist_every = overrides.pop("interval", 10), overrides.pop("persist_every", 1)
    if own.snapshot_s is None:
        raise PlanError(f"{path}: the goodput_strict line has no snapshot_cost_s: give --cost snapshot_s=SECONDS")
    if not own.recoveries:
        raise PlanError(f"{path}: no recovery line: the planner needs a run with at least one fault")
    return replace(compose(own, [measure(d, own=False) for d in extra], overrides, f"figures {path}"),
                   **own.figures)


def compose(own: Measured, others: list[Measured], overrides: dict[str, Any], source: str) -> Costs:
    """Each input from the first that has it: ``--cost``, the run, the extra ledgers, the default."""
    values: dict[str, Any] = {"step_s": own.step_s, "snapshot_s": own.snapshot_s, "interval": own.interval,
                              "persist_every": own.persist_every, "first_step_excess_s": own.first_step_excess_s,
                              "final_save_s": own.final_save_s, "source": source}
    sources: dict[str, dict[str, Any]] = {"step_s": measured(own.label()), "snapshot_s": measured(own.label())}
    gpu = "cuda" in own.device
    values["publish_s"] = own.step_s * GPU_PUBLISH_STEPS if gpu else 0.0
    sources["publish_s"] = default("publish_s", values["publish_s"])
    if own.writes:
        values["persist_write_s"] = statistics.fmean(own.writes)
        values["persist_overhead_s"] = own.write_overhead_s
        sources["persist_write_s"] = sources["persist_overhead_s"] = measured(own.label())
    else:
        values["persist_overhead_s"] = 0.0
        sources["persist_overhead_s"] = default("persist_overhead_s", 0.0)
        if own.final_save_s > 0:
            values["persist_write_s"] = own.final_save_s
            sources["persist_write_s"] = {**default("persist_write_s", own.final_save_s),
                                          "from": f"{DEFAULTS['persist_write_s'].source}: {own.final_save_from}"}
    recovery = {}
    for layer in LAYERS:
        value, src = _first(f"recovery_{layer}", [(m, m.recoveries.get(layer)) for m in (own, *others)])
        recovery[layer] = value
        sources[f"recovery_{layer}"] = src
    values["recovery_s"] = recovery
    values["restore_memory_s"], sources["restore_memory_s"] = _first(
        "restore_memory_s", [(own, own.restores.get("memory"))])
    values["restore_persistent_s"], sources["restore_persistent_s"] = _first(
        "restore_persistent_s", [(m, m.restores.get("persistent")) for m in (own, *others)])
    values["peer_restore_s"], sources["peer_restore_s"] = _first(
        "peer_restore_s", [(m, m.recoveries.get("node_peer")) for m in (own, *others)])
    pushes = [(m, [m.replica_push_s] if m.replica_push_s is not None else None) for m in (own, *others)]
    values["peer_lag_s"], sources["peer_lag_s"] = _first("peer_lag_s", pushes)
    values["peer_copy_s"], sources["peer_copy_s"] = _peer_copy(own, others)
    for key, value in overrides.items():
        name = key[len("recovery_"):] if key.startswith("recovery_") else None
        if name in LAYERS:
            recovery[name] = value
        elif key in Costs.__dataclass_fields__ and key not in ("recovery_s", "sources", "notes"):
            values[key] = value
        else:
            raise PlanError(f"--cost {key}: not an input; give one of {', '.join(INPUTS)}, interval, persist_every")
        sources[key] = given("--cost")
    if values.get("persist_write_s") is None:
        raise PlanError(f"{own.where}: no 'persisted' record and no final save (persist_every=0, or a trainer older "
                        "than the planner): give --cost persist_write_s=SECONDS")
    return checked(values, own.where, sources=sources)


def _first(key: str, candidates: list[tuple[Measured, list[float] | None]]) -> tuple[float | None, dict[str, Any]]:
    """The mean of the first ledger's values that has any, with its source; else the default (None: derived)."""
    for m, seen in candidates:
        if seen:
            return statistics.fmean(seen), measured(m.label())
    value = DEFAULTS[key].value
    return value, default(key, value)


def _peer_copy(own: Measured, others: list[Measured]) -> tuple[float | None, dict[str, Any]]:
    """Per snapshot and replica, the peer tier's step-time cost: inside the run's own snapshot cost when it pushed
    replicas; else the snapshot costs of two ledgers alike but for their replica count, apart (ledgers without a
    restart first); else the default."""
    if own.replicas:
        return 0.0, {"kind": "measured", "from": f"inside snapshot_s: {own.label()} pushed {own.replicas} replica(s)"}
    clean_first = sorted(others, key=lambda m: bool(m.recoveries))  # a run with no restart: every snapshot window
    for on in clean_first:
        if not on.replicas or on.snapshot_s is None:
            continue
        for off in clean_first:
            if off.replicas == 0 and off.snapshot_s is not None and \
                    (off.model, off.world_size, off.interval, off.device) == (on.model, on.world_size, on.interval,
                                                                              on.device):
                return (max(0.0, (on.snapshot_s - off.snapshot_s) / on.replicas),
                        measured(f"{on.label()} less {off.where} (snapshot cost with and without replicas)"))
    return None, default("peer_copy_s")


def from_file(path: str | Path, overrides: dict[str, Any] | None = None) -> Costs:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"costs file {p}: cannot read it as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise PlanError(f"costs file {p}: must be a JSON object with {', '.join(REQUIRED)}")
    sources = {k: given(f"costs file {p}") for k in INPUTS if k in data}
    sources.update({f"recovery_{k}": given(f"costs file {p}") for k in (data.get("recovery_s") or {})
                    if isinstance(data.get("recovery_s"), dict)})
    for key, value in (overrides or {}).items():
        if key.startswith("recovery_") and isinstance(data.get("recovery_s"), dict):
            data["recovery_s"][key[len("recovery_"):]] = value
        else:
            data[key] = value
        sources[key] = given("--cost")
    for key in OPTIONAL:
        if key not in sources and key in DEFAULTS:
            data.setdefault(key, DEFAULTS[key].value if DEFAULTS[key].value is not None else
                            (0.0 if key == "publish_s" else None))
            sources[key] = default(key, data[key])
    data.setdefault("source", f"costs file {p}")
    return checked(data, str(p), tuple(data.pop("notes", ()) or ()), sources)


def checked(values: dict[str, Any], where: str, notes: tuple[str, ...] = (),
            sources: dict[str, dict[str, Any]] | None = None) -> Costs:
    """``Costs`` from a mapping, every value checked: PlanError naming the first missing or bad one."""
    for key in REQUIRED:
        if values.get(key) is None:
            raise PlanError(f"{where}: {key} is missing")
    recovery = values["recovery_s"]
    if not isinstance(recovery, dict) or set(recovery) != set(LAYERS):
        raise PlanError(f"{where}: recovery_s must give seconds for each layer: {', '.join(LAYERS)}")
    for key, value in [*((k, values.get(k)) for k in ("step_s", "snapshot_s", "persist_write_s", *OPTIONAL)),
                       *((f"recovery_s.{k}", v) for k, v in recovery.items())]:
        if value is not None and not (number(value) and value >= 0):
            raise PlanError(f"{where}: {key} must be a number of seconds >= 0; got {value!r}")
    if values["step_s"] <= 0:
        raise PlanError(f"{where}: step_s must be > 0; got {values['step_s']!r}")
    for key, low in (("interval", 1), ("persist_every", 0)):
        value = values.get(key, Costs.__dataclass_fields__[key].default)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise PlanError(f"{where}: {key} must be a whole number >= {low}; got {value!r}")
    fields = {k: values[k] for k in Costs.__dataclass_fields__ if k in values and k not in ("notes", "sources")}
    fields["recovery_s"] = {k: float(v) for k, v in recovery.items()}
    return Costs(**fields, notes=notes, sources=dict(sources or {}))
