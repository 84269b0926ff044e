"""The goodput projection at 1,024 and 16,384 GPUs from one run's ledger (BENCHMARKS.md, "Projection at scale"): the
planner (``python -m trainer.plan``) at each size with ``--recommend``, its text and JSON kept, and one summary table.

    PYTHONPATH=trainer_image .venv/bin/python bench/plan_scale.py --run RUN_DIR --out DIR [--label NAME] \\
        [-- PLANNER ARGS: --measured DIR, --cost KEY=VALUE, --spares N, --failure-model ...]
    # a ledger kept as two files (bench/results/...: recovery.jsonl and metrics.jsonl[.gz]):
    PYTHONPATH=trainer_image .venv/bin/python bench/plan_scale.py --recovery R.jsonl --metrics M.jsonl.gz --out DIR

Writes ``<label>-<gpus>.txt`` and ``.json`` per size and ``<label>-summary.md``: per size and configuration, the
goodput, per booked GPU with its band (the failure rate's Poisson interval and every unmeasured input x0.5..x1.5),
and the recommended settings (today's layers and the peer tier) with theirs; the ledger's files and their sha256.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import shutil
import sys
import tempfile
from pathlib import Path

from trainer import plan

SIZES = (1024, 16384)


def ledger_dir(args: argparse.Namespace, scratch: Path) -> Path:
    """The run directory: ``--run``, or one made of ``--recovery`` and ``--metrics`` (a ``.gz`` kept as such)."""
    if args.run:
        return args.run
    run = scratch / "run"
    run.mkdir()
    shutil.copy(args.recovery, run / "recovery.jsonl")
    metrics = args.metrics.name.endswith(".gz")
    shutil.copy(args.metrics, run / ("metrics.jsonl.gz" if metrics else "metrics.jsonl"))
    return run


def digest(run: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in sorted(run.iterdir()) if p.is_file()}


def summary(label: str, results: dict[int, dict], sources: dict[str, str], command: str) -> str:
    lines = [f"# {label}", "", f"`{command}`", "", "Ledger files (sha256, first 16): "
             + ", ".join(f"{k} {v}" for k, v in sources.items()), "",
             "| GPUs | configuration (interval, persist_every, spares, replicas) | goodput | per booked GPU | band |",
             "| --- | --- | --- | --- | --- |"]
    for gpus, out in results.items():
        for key, r in out["configurations"].items():
            lo, hi = r["band"]["both"]["goodput_per_booked_gpu"]
            lines.append(f"| {gpus:,} | {out['configuration_names'][key]} ({r['interval']}, {r['persist_every']}, "
                         f"{r['spares']}, {r['replicas']}) | {r['goodput']:.4f} ±{r['ci95']:.4f} | "
                         f"{r['goodput_per_booked_gpu']:.4f} | {lo:.4f}-{hi:.4f} |")
        for name in ("recommendation", "recommendation_peer"):
            s = out[name]["recommended"]
            lo, hi = s["band"]["both"]["goodput_per_booked_gpu"]
            lines.append(f"| {gpus:,} | {name.replace('_', ' ')} ({s['interval']}, {s['persist_every']}, "
                         f"{s['spares']}, {s['replicas']}) | {s['goodput']:.4f} ±{s['ci95']:.4f} | "
                         f"{s['goodput_per_booked_gpu']:.4f} | {lo:.4f}-{hi:.4f} |")
    kinds = {r["input"]: f"{r['kind']}" for r in next(iter(results.values()))["inputs"]}
    lines += ["", "Inputs: " + ", ".join(f"{k} {v}" for k, v in kinds.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, planner = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path)
    parser.add_argument("--recovery", type=Path)
    parser.add_argument("--metrics", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--label", default="projection")
    parser.add_argument("--trials", type=int, default=200)
    args = parser.parse_args(ours)
    if not args.run and not (args.recovery and args.metrics):
        parser.error("give --run RUN_DIR, or --recovery FILE and --metrics FILE")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        run = ledger_dir(args, Path(scratch))
        sources = digest(run)
        results = {}
        for gpus in SIZES:
            stem = args.out / f"{args.label}-{gpus}"
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                code = plan.main(["--run", str(run), "--gpus", str(gpus), "--trials", str(args.trials), "--recommend",
                                  "--json", f"{stem}.json", *planner])
            if code:
                return code
            shown = str(args.run or args.recovery.parent)  # the ledger's own place, not the scratch copy's
            for path, body in ((Path(f"{stem}.txt"), text.getvalue()), (Path(f"{stem}.json"), None)):
                path.write_text((body if body is not None else path.read_text()).replace(str(run), shown))
            results[gpus] = json.loads(Path(f"{stem}.json").read_text())
    command = "bench/plan_scale.py " + " ".join(ours + (["--", *planner] if planner else []))
    (args.out / f"{args.label}-summary.md").write_text(summary(args.label, results, sources, command))
    print((args.out / f"{args.label}-summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
