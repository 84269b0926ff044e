"""``python -m trainer.plan``: the goodput planner (``trainer/PLANNING.md``). What share of a job's time on N GPUs is
training, under a failure model with sources, from a finished run's own measured costs (or a costs file):

    python -m trainer.plan --run RUN_DIR --gpus 16384 --spares 4 --recommend --chart goodput.png --json plan.json
    python -m trainer.plan --run RUN_DIR --measured NODE_LOSS_RUN --measured DEMO_RUN --gpus 16384   # more ledgers
    python -m trainer.plan --costs costs.json --gpus 1024 --failure-model rsc1
    python -m trainer.plan --run RUN_DIR --replay          # the run's own faults and costs -> its measured goodput

Every input is printed with where it came from: measured (and by which ledger), given, or a documented default with
the command that would measure it (``planning/defaults.py``). Bad input (a ledger with no recovery, a missing or
negative rate or cost, a cluster smaller than one node): one line on stderr, exit 2. numpy and Pillow only: no torch
(``components`` runs it as a subprocess).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from trainer.planning import PlanError, failures
from trainer.planning.band import band
from trainer.planning.chart import GOAL, curves, draw, spares_for
from trainer.planning.costs import INPUTS, from_figures, from_file, from_run
from trainer.planning.defaults import DEFAULTS
from trainer.planning.recommend import recommend
from trainer.planning.replay import replay, replay_figures
from trainer.planning.simulate import CONFIGURATIONS, Cluster, simulate, with_spares

LOSS_COLUMNS = (("recoveries", ("recovery_inprocess", "recovery_injob", "recovery_node", "recovery_cluster")),
                ("redone", ("redone",)), ("snapshots", ("snapshots",)), ("peer copies", ("peer_copies",)),
                ("persist", ("persist",)), ("waiting for a node", ("waiting_for_node",)))


def parse_costs(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise PlanError(f"--cost {item!r}: give KEY=VALUE, e.g. --cost persist_write_s=12.5")
        try:
            out[key] = int(raw) if key in ("interval", "persist_every") else float(raw)
        except ValueError:
            raise PlanError(f"--cost {item!r}: {raw!r} is not a number") from None
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer.plan", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="a finished run's directory (recovery.jsonl, metrics.jsonl)")
    source.add_argument("--costs", help="a costs file (JSON) written by hand (PLANNING.md)")
    source.add_argument("--figures", help="a GPU goodput run's figure lines (bench/figures.py goodput)")
    parser.add_argument("--measured", action="append", default=[], metavar="RUN_DIR",
                        help="another run's directory whose measurements the planned run lacks are used (a node loss, "
                             "a cluster restart, the peer tier's costs); repeat for more, the first that has one wins")
    parser.add_argument("--gpus", type=int, default=16384, help="the job's GPUs (default 16,384)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--spares", type=int, default=0, help="spare nodes standing by (default 0), in every row")
    parser.add_argument("--replacement-s", type=float, default=None,
                        help="seconds to get a replacement pod for a lost node (default "
                             f"{DEFAULTS['replacement_s'].value:.0f}: Kubernetes' eviction defaults, PLANNING.md)")
    parser.add_argument("--failure-model", default="llama3", help="llama3 (default), rsc1, rsc2, or a JSON file")
    parser.add_argument("--days", type=float, default=30.0, help="wall time simulated per trial (default 30)")
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost", action="append", default=[], metavar="KEY=VALUE",
                        help="give one input (step_s, snapshot_s, persist_write_s, recovery_node, peer_copy_s, "
                             "interval, ...): printed as given")
    parser.add_argument("--recommend", action="store_true", help="sweep interval, persist_every, spares, replicas")
    parser.add_argument("--chart", help="write goodput per booked GPU vs GPUs (8..16,384) per configuration to a PNG")
    parser.add_argument("--chart-trials", type=int, default=48)
    parser.add_argument("--replay", action="store_true", help="replay the run's own faults (needs --run)")
    parser.add_argument("--json", help="write everything as JSON here")
    return parser


def plan(args: argparse.Namespace) -> dict[str, Any]:
    if args.trials < 2 or args.days <= 0:
        raise PlanError("--trials must be >= 2 and --days > 0")
    if args.spares < 0:
        raise PlanError(f"--spares must be >= 0; got {args.spares}")
    overrides = parse_costs(args.cost)
    if args.run:
        costs = from_run(args.run, overrides, args.measured)
    elif args.figures:
        costs = from_figures(args.figures, overrides, args.measured)
    else:
        if args.measured:
            raise PlanError("--measured goes with --run or --figures: a costs file gives every input itself")
        costs = from_file(args.costs, overrides)
    model = failures.load(args.failure_model)
    replacement_default = args.replacement_s is None
    replacement = DEFAULTS["replacement_s"].value if replacement_default else args.replacement_s
    cluster = Cluster(args.gpus, args.gpus_per_node, args.spares, replacement)
    cluster.check()
    sim = {"days": args.days, "trials": args.trials, "seed": args.seed}
    out: dict[str, Any] = {"cluster": cluster.__dict__, "failure_model": {
        "name": model.name, "source": model.source, "per_gpu_hour": model.per_gpu_hour(), "events": model.events,
        "mtbf_h": round(model.mtbf_s(cluster.gpus) / 3600, 3)}, "costs": costs.to_dict(),
        "inputs": inputs(costs, replacement_default, replacement),
        "suggested_spares": spares_for(cluster)}
    out["configuration_names"] = {key: layers.name for key, layers in CONFIGURATIONS.items()}
    out["configurations"] = {}
    for key, layers in CONFIGURATIONS.items():
        result = simulate(costs, cluster, model, layers, **sim).to_dict()
        result["band"] = band(costs, cluster, model, layers, replacement_default=replacement_default, **sim)
        out["configurations"][key] = result
    if args.recommend:
        for name, key in (("recommendation", "today"), ("recommendation_peer", "peer")):
            layers = CONFIGURATIONS[key]
            rec = recommend(costs, cluster, model, layers, **sim)
            best = rec["recommended"]
            rec["recommended"]["band"] = band(
                costs, with_spares(cluster, best["spares"]), model, replace(layers, replicas=best["replicas"]),
                replacement_default=replacement_default, interval=best["interval"],
                persist_every=best["persist_every"], **sim)
            out[name] = rec
    if args.chart:
        data = curves(costs, cluster, model, days=args.days, trials=args.chart_trials, seed=args.seed)
        title = f"goodput per booked GPU vs GPUs: failure model {model.name}, costs {costs.source}"
        out["chart"] = {"png": str(draw(data, args.chart, title[:140])), "curves": data}
    if args.replay:
        if not (args.run or args.figures):
            raise PlanError("--replay needs --run or --figures: the run whose faults are replayed")
        out["replay"] = replay(args.run, costs) if args.run else replay_figures(args.figures, costs)
    return out


def inputs(costs: Any, replacement_default: bool, replacement: float) -> list[dict[str, Any]]:
    """Every input with its value and source, in ``costs.INPUTS`` order, then the replacement pod's time."""
    rows = []
    values = {**{f"recovery_{k}": v for k, v in costs.recovery_s.items()},
              **{k: getattr(costs, k) for k in INPUTS if hasattr(costs, k)}}
    for key in INPUTS:
        src = costs.sources.get(key, {"kind": "given", "from": costs.source})
        rows.append({"input": key, "value": values.get(key), **src})
    if replacement_default:
        rows.append({"input": "replacement_s", "value": replacement, "kind": "default",
                     "from": DEFAULTS["replacement_s"].source, "measure": DEFAULTS["replacement_s"].measure})
    else:
        rows.append({"input": "replacement_s", "value": replacement, "kind": "given", "from": "--replacement-s"})
    return rows


DERIVED = {"peer_copy_s": "= snapshot_s per replica", "peer_lag_s": "= one snapshot interval",
           "peer_restore_s": "= recovery_node"}


def _value(row: dict[str, Any]) -> str:
    value = row.get("value")
    return DERIVED.get(row["input"], "?") if value is None else f"{value:.4g} s"


def report(out: dict[str, Any]) -> str:
    c, m = out["cluster"], out["failure_model"]
    nodes = c["gpus"] // c["gpus_per_node"]
    lines = [f"goodput planner: {c['gpus']:,} GPUs ({nodes:,} nodes of {c['gpus_per_node']}), {c['spare_nodes']} "
             f"spare node(s) as asked (suggestion: {out['suggested_spares']} for {nodes:,} nodes, 2 per 100; not "
             f"used: --spares N to use it), replacement pod {c['replacement_s']:.0f} s",
             f"failure model {m['name']}: MTBF {m['mtbf_h']:.2f} h at this size ({m['source']})"
             + (f"; rate band from its {m['events']} events (Poisson 95 %)" if m.get("events") else ""),
             f"inputs (costs {out['costs']['source']}):"]
    for row in out["inputs"]:
        lines.append(f"  {row['input']:<22}{_value(row):>26}  {row['kind']}: {row['from']}")
        if row["kind"] == "default":
            lines.append(f"  {'':<48}  measure it: {row['measure']}")
    node = next(r for r in out["inputs"] if r["input"] == "recovery_node")
    if node["kind"] == "default":
        lines.append("  note: no ledger measured a node loss: a lost node is charged the documented default above, "
                     "not the in-job restart's time")
    lines += [f"  note: {n}" for n in out["costs"]["notes"]]
    first = next(iter(out["configurations"].values()))
    lines.append(f"simulated: {first['days']:g} days x {first['trials']} trials per configuration, "
                 f"{first['faults_per_day']:.2f} faults/day; losses as shares of wall time; band: the failure rate's "
                 "95 % Poisson interval and every default x0.5..x1.5, together")
    lines.append(f"{'configuration':<34}{'goodput':>9}{'95% CI':>9}{'per booked GPU':>16}{'band (per booked)':>20}"
                 f"{'spares':>7}" + "".join(f"{n:>{_width(n)}}" for n, _ in LOSS_COLUMNS))
    for key, r in out["configurations"].items():
        lines.append(_row(out["configuration_names"][key], r))
    for name in ("recommendation", "recommendation_peer"):
        if name in out:
            rec = out[name]
            tiers = rec["faults_per_day_by_tier"]
            lines.append(f"{name.replace('_', ' ')} (Young/Daly on the faults each tier serves: "
                         f"{rec['young_daly_interval']} steps for memory, {tiers['memory']:.2f}/day; persist_every "
                         f"{rec['young_daly_persist_every']} for the persistent tier, {tiers['persistent']:.2f}/day):")
            for which in ("current", "recommended"):
                s = rec[which]
                both = s.get("band", {}).get("both", {}).get("goodput_per_booked_gpu")
                verdict = "" if not both else "reaches" if both[0] >= GOAL else \
                    "not sure to reach" if both[1] >= GOAL else "misses"
                lines.append(f"  {which:<12} interval {s['interval']}, persist_every {s['persist_every']}, "
                             f"spares {s['spares']}, replicas {s['replicas']}: goodput {s['goodput']:.4f} "
                             f"±{s['ci95']:.4f}, per booked GPU {s['goodput_per_booked_gpu']:.4f}"
                             + (f" (band {both[0]:.4f}-{both[1]:.4f}: {verdict} {GOAL})" if both else ""))
    if "chart" in out:
        lines.append(f"chart: {out['chart']['png']}")
    if "replay" in out:
        r = out["replay"]
        lines.append(f"replay of {r['run']} (strict goodput): predicted {r['predicted_goodput']:.4f}, measured "
                     f"{r['measured_goodput']:.4f} ({r['difference_points']:+.2f} points)")
        lines += [f"  {f['layer']} fault at step {f['fault_step']}: steps redone predicted "
                  f"{f['steps_redone_predicted']}, recorded {f['steps_redone_recorded']}" for f in r["faults"]]
    return "\n".join(lines)


def _width(column: str) -> int:
    return max(12, len(column) + 2)


def _row(name: str, r: dict[str, Any]) -> str:
    cells = "".join(f"{sum(r['losses'].get(x, 0.0) for x in keys):>{_width(n)}.4f}" for n, keys in LOSS_COLUMNS)
    lo, hi = r["band"]["both"]["goodput_per_booked_gpu"]
    return (f"{name:<34}{r['goodput']:>9.4f}{'±' + format(r['ci95'], '.4f'):>9}{r['goodput_per_booked_gpu']:>16.4f}"
            f"{f'{lo:.4f}-{hi:.4f}':>20}{r['spares']:>7}{cells}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = plan(args)
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
