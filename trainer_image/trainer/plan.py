"""``python -m trainer.plan``: the goodput planner (``trainer/PLANNING.md``). What share of a job's time on N GPUs is
training, under a failure model with sources, from a finished run's own measured costs (or a costs file):

    python -m trainer.plan --run RUN_DIR --gpus 16384 --spares 4 --recommend --chart goodput.png --json plan.json
    python -m trainer.plan --costs costs.json --gpus 1024 --failure-model rsc1
    python -m trainer.plan --run RUN_DIR --replay          # the run's own faults and costs -> its measured goodput

Bad input (a ledger with no recovery, a missing or negative rate or cost, a cluster smaller than one node): one line
on stderr, exit 2. numpy and Pillow only: no torch (``components`` runs it as a subprocess).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.planning import LAYERS, PlanError, failures
from trainer.planning.chart import curves, draw, spares_for
from trainer.planning.costs import from_figures, from_file, from_run
from trainer.planning.recommend import recommend
from trainer.planning.replay import replay, replay_figures
from trainer.planning.simulate import CONFIGURATIONS, Cluster, simulate, with_spares

LOSS_COLUMNS = (("recoveries", ("recovery_inprocess", "recovery_injob", "recovery_node", "recovery_cluster")),
                ("redone", ("redone",)), ("snapshots", ("snapshots",)), ("persist", ("persist",)),
                ("waiting for a node", ("waiting_for_node",)))


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
    parser.add_argument("--gpus", type=int, default=16384, help="the job's GPUs (default 16,384)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--spares", type=int, default=0, help="spare nodes standing by (default 0)")
    parser.add_argument("--replacement-s", type=float, default=600.0,
                        help="seconds to get a replacement pod for a lost node (default 600)")
    parser.add_argument("--failure-model", default="llama3", help="llama3 (default), rsc1, rsc2, or a JSON file")
    parser.add_argument("--days", type=float, default=30.0, help="wall time simulated per trial (default 30)")
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost", action="append", default=[], metavar="KEY=VALUE",
                        help="override one cost (step_s, snapshot_s, persist_write_s, recovery_node, interval, ...)")
    parser.add_argument("--recommend", action="store_true", help="sweep interval, persist_every, spares, replicas")
    parser.add_argument("--chart", help="write goodput vs GPUs (8..16,384) per configuration to this PNG")
    parser.add_argument("--chart-trials", type=int, default=48)
    parser.add_argument("--replay", action="store_true", help="replay the run's own faults (needs --run)")
    parser.add_argument("--json", help="write everything as JSON here")
    return parser


def plan(args: argparse.Namespace) -> dict[str, Any]:
    if args.trials < 2 or args.days <= 0:
        raise PlanError("--trials must be >= 2 and --days > 0")
    overrides = parse_costs(args.cost)
    if args.run:
        costs = from_run(args.run, overrides)
    else:
        costs = from_figures(args.figures, overrides) if args.figures else from_file(args.costs, overrides)
    model = failures.load(args.failure_model)
    cluster = Cluster(args.gpus, args.gpus_per_node, args.spares, args.replacement_s)
    cluster.check()
    out: dict[str, Any] = {"cluster": cluster.__dict__, "failure_model": {
        "name": model.name, "source": model.source, "per_gpu_hour": model.per_gpu_hour(),
        "mtbf_h": round(model.mtbf_s(cluster.gpus) / 3600, 3)}, "costs": costs.to_dict()}
    out["configuration_names"] = {key: layers.name for key, layers in CONFIGURATIONS.items()}
    out["configurations"] = {key: simulate(costs, with_spares(cluster, spares_for(key, cluster)), model, layers,
                                           days=args.days, trials=args.trials, seed=args.seed).to_dict()
                             for key, layers in CONFIGURATIONS.items()}
    if args.recommend:
        out["recommendation"] = recommend(costs, cluster, model, CONFIGURATIONS["today"], days=args.days,
                                          trials=args.trials, seed=args.seed)
        out["recommendation_peer"] = recommend(costs, cluster, model, CONFIGURATIONS["peer"], days=args.days,
                                               trials=args.trials, seed=args.seed)
    if args.chart:
        data = curves(costs, cluster, model, days=args.days, trials=args.chart_trials, seed=args.seed)
        title = f"goodput vs GPUs: failure model {model.name}, costs {costs.source}"
        out["chart"] = {"png": str(draw(data, args.chart, title[:140])), "curves": data}
    if args.replay:
        if not (args.run or args.figures):
            raise PlanError("--replay needs --run or --figures: the run whose faults are replayed")
        out["replay"] = replay(args.run, costs) if args.run else replay_figures(args.figures, costs)
    return out


def report(out: dict[str, Any]) -> str:
    c, m, k = out["cluster"], out["failure_model"], out["costs"]
    lines = [f"goodput planner: {c['gpus']:,} GPUs ({c['gpus'] // c['gpus_per_node']:,} nodes of {c['gpus_per_node']}),"
             f" {c['spare_nodes']} spare node(s), replacement pod {c['replacement_s']:.0f} s",
             f"failure model {m['name']}: MTBF {m['mtbf_h']:.2f} h at this size ({m['source']})",
             f"costs ({k['source']}): step {k['step_s']:.4f} s; snapshot {k['snapshot_s']:.4f} s every {k['interval']} "
             f"steps; persisted write {k['persist_write_s']:.2f} s (+{k['persist_overhead_s']:.3f} s of slower steps) "
             f"every {k['persist_every']}; recovery " + ", ".join(f"{x} {k['recovery_s'][x]:.2f} s" for x in LAYERS),
             *(f"  note: {n}" for n in k["notes"])]
    first = next(iter(out["configurations"].values()))
    lines.append(f"simulated: {first['days']:g} days x {first['trials']} trials per configuration, "
                 f"{first['faults_per_day']:.2f} faults/day; losses as shares of wall time")
    lines.append(f"{'configuration':<38}{'goodput':>9}{'95% CI':>9}{'spares':>7}"
                 + "".join(f"{n:>20}" for n, _ in LOSS_COLUMNS))
    for key, r in out["configurations"].items():
        lines.append(_row(CONFIGURATIONS[key].name, r))
    for name in ("recommendation", "recommendation_peer"):
        if name in out:
            rec = out[name]
            lines.append(f"{name.replace('_', ' ')} (Young/Daly at this size: {rec['young_daly_interval']} steps):")
            for which in ("current", "recommended"):
                s = rec[which]
                lines.append(f"  {which:<12} interval {s['interval']}, persist_every {s['persist_every']}, "
                             f"spares {s['spares']}, replicas {s['replicas']}: goodput {s['goodput']:.4f} "
                             f"±{s['ci95']:.4f}, per booked GPU {s['goodput_per_booked_gpu']:.4f}")
    if "chart" in out:
        lines.append(f"chart: {out['chart']['png']}")
    if "replay" in out:
        r = out["replay"]
        lines.append(f"replay of {r['run']} (strict goodput): predicted {r['predicted_goodput']:.4f}, measured "
                     f"{r['measured_goodput']:.4f} ({r['difference_points']:+.2f} points)")
        lines += [f"  {f['layer']} fault at step {f['fault_step']}: steps redone predicted "
                  f"{f['steps_redone_predicted']}, recorded {f['steps_redone_recorded']}" for f in r["faults"]]
    return "\n".join(lines)


def _row(name: str, r: dict[str, Any]) -> str:
    cells = "".join(f"{sum(r['losses'].get(x, 0.0) for x in keys):>20.4f}" for _, keys in LOSS_COLUMNS)
    return f"{name:<38}{r['goodput']:>9.4f}{'±' + format(r['ci95'], '.4f'):>9}{r['spares']:>7}{cells}"


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

