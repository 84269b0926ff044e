"""``python -m pipelines.demo``: the whole pipeline locally (``kfp.local``), with a fault for every layer.

Trains the tiny model on 2 CPU processes (gloo) on a slice of this Python's standard library, and injects:

- an ``exception`` on rank 0 -> caught by the in-process layer (NVRx Wrapper), same processes go on;
- a ``sigkill`` of rank 1 -> the in-job layer (ft_launcher) restarts the workers from the checkpoint;
- a ``sigterm`` (preemption drill) -> the trainer commits a final checkpoint and exits 202 (retryable);
  ``max_cluster_restarts=0`` makes the train step fail, and the pipeline's ``set_retry`` starts a new
  attempt that resumes from that checkpoint (the cluster / pipeline-retry layer).

Then evaluates the checkpoint, writes the HTML report, and promotes the model if it beats the promoted one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from components.lib.layout import RunLayout
from components.lib.local_launcher import ECHO_ALL, ECHO_ENV, ECHO_PROGRESS
from components.lib.params import PipelineParams
from components.lib.report import LAYER_TITLES, read_jsonl, summarize_ledger

ROOT = Path("runs") / "demo"
STEPS = 60
# exception (in-process) at 15, sigkill (in-job) at 33, sigterm (cluster: step fails, pipeline retry) at 48.
FAULTS = "0:15:exception,1:33:sigkill,0:48:sigterm"


def demo_params(workdir: Path, steps: int = STEPS, faults: str = FAULTS, **overrides: Any) -> dict[str, Any]:
    """Pipeline arguments of the local demo (every one validated by `PipelineParams`)."""
    params = dict(
        model="tiny", steps=steps, checkpoint_interval=10, procs_per_node=2, gpus_per_node=0, seq_len=128,
        batch_size=8, faults=faults, inprocess_restart=True, ft_max_restarts=2, max_cluster_restarts=0,
        backend="local", corpus="", vocab_size=2048, max_corpus_bytes=1_500_000, workdir=str(workdir.resolve()),
        eval_batch_size=8, eval_max_batches=20, deadline_hours=1.0,
    )
    params.update(overrides)
    PipelineParams.from_mapping(params).validate()
    return params


def run_local(params: dict[str, Any], pipeline_root: Path) -> Path:
    """Run the local pipeline variant synchronously; return this run's directory under the workdir."""
    from kfp import local

    from pipelines.training_pipeline import local_pipeline

    workdir = Path(params["workdir"])
    workdir.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in workdir.iterdir() if p.is_dir()}
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(pipeline_root.resolve()),
               raise_on_error=True)
    try:
        local_pipeline(**params)
    finally:
        new = [p for p in workdir.iterdir() if p.is_dir() and p.name not in before]
    if len(new) != 1:
        raise RuntimeError(f"expected one new run directory in {workdir}; found {[p.name for p in new]}")
    return new[0]


def summarize(run_root: Path) -> dict[str, Any]:
    """The numbers a person wants after the run: eval, restarts per layer, goodput, promotion."""
    layout = RunLayout(run_root.parent, run_root.name)
    ledger, _ = read_jsonl(layout.run_dir / "recovery.jsonl")
    result = json.loads((layout.eval_dir / "result.json").read_text())
    decision = json.loads((layout.eval_dir / "decision.json").read_text())
    return {"run_id": layout.run_id, "eval": result, "recovery": summarize_ledger(ledger), "decision": decision,
            "report": str(layout.eval_dir / "report.html")}


def format_summary(s: dict[str, Any], took_s: float) -> str:
    rec, ev = s["recovery"], s["eval"]
    goodput = "n/a" if rec["goodput"] is None else f"{rec['goodput']:.1%}"
    restarts = ", ".join(f"{LAYER_TITLES[k]} {v}" for k, v in rec["restarts"].items())
    return "\n".join([
        f"demo run {s['run_id']} finished in {took_s:.0f} s",
        f"  val loss     {ev['val_loss']:.4f} (perplexity {ev['perplexity']:.1f}) at step {ev['step']}",
        f"  restarts     {restarts}",
        f"  goodput      {goodput} ({rec['steps_redone']} step(s) redone)",
        f"  promotion    {s['decision']['reason']}",
        f"  report       {s['report']}",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(ROOT), help=f"where runs go (default {ROOT})")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--faults", default=FAULTS, help="rank:step:kind,... ('' for none)")
    parser.add_argument("--verbose", action="store_true", help="stream the full trainer log, not only progress")
    args = parser.parse_args(argv)
    # The local train step echoes progress and recovery events; the full log is in <run>/launcher/.
    os.environ.setdefault(ECHO_ENV, ECHO_ALL if args.verbose else ECHO_PROGRESS)
    root = Path(args.root)
    params = demo_params(root / "work", steps=args.steps, faults=args.faults)
    print(f"[demo] tiny model, {args.steps} steps, 2 CPU processes; faults: {args.faults or 'none'}", flush=True)
    started = time.monotonic()
    run_root = run_local(params, root / "kfp")
    print(format_summary(summarize(run_root), time.monotonic() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main())
