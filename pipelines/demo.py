"""``python -m pipelines.demo``: the whole pipeline locally (``kfp.local``), with a fault for every layer.

Trains the tiny model on 2 nodes of one CPU process each (two ``entrypoint.sh``, as two pods: gloo across them) on a
slice of this Python's standard library, and injects:

- an ``exception`` on rank 0 -> caught by the in-process layer (NVRx Wrapper), same processes go on;
- a ``sigkill`` of rank 1 -> the in-job layer (ft_launcher) restarts the workers of both nodes from their memory;
- a ``node_lost`` on rank 1 -> its whole node goes (processes and memory); the local backend starts it again as a
  replacement pod (the one cluster restart ``max_cluster_restarts=1`` allows), which joins the rendezvous: rank 0
  resumes from its node's memory, rank 1 from the replica node 0 holds of it (the node layer, the peer tier);
- a ``sigterm`` to rank 0's pod (preemption drill) -> every rank commits a final checkpoint of the same step and the
  preempted node exits 202 (retryable); with the restart budget spent the local backend stops the other node, the
  train step fails, and the pipeline's ``set_retry`` starts a new attempt that resumes from that checkpoint (the
  cluster / pipeline-retry layer).

Then evaluates the checkpoint, writes the HTML report, and promotes the model if it beats the promoted one.

The terminal shows progress lines, recovery events, each step's outcome and the summary; everything (kfp.local's
executor input/output JSON, the full trainer log) goes to ``<root>/logs/demo-<time>.log`` (`filtered_output`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from components.lib.layout import RunLayout
from components.lib.local_launcher import ECHO_ALL, ECHO_ENV, ECHO_PROGRESS, RECOVERY_EVENTS
from components.lib.params import PipelineParams
from components.lib.report import LAYER_TITLES, read_jsonl, summarize_ledger

ROOT = Path("runs") / "demo"
STEPS = 60
# exception (in-process) at 15, sigkill (in-job) at 27, node_lost (node: a replacement pod) at 38, sigterm (cluster: the
# step fails, pipeline retry) at 50.
FAULTS = "0:15:exception,1:27:sigkill,1:38:node_lost,0:50:sigterm"
#: Lines the terminal shows (the rest is in the log file): the steps' own progress lines, kfp.local's outcome of
#: each task and of the pipeline, and the trainer's recovery events (`RECOVERY_EVENTS`).
SHOWN = re.compile(r"^\[(demo|validate|data|train|eval|promote|cleanup)\] |^\S+ - \w+ - (Task|Pipeline) .* finished with "
                   r"status|^[\w.]+\.\w+(Error|Exceeded|Failure|Terminated|Exception|Mismatch): ")
#: Shown elsewhere: a step's exception line is shown, the traceback header alone says nothing.
HIDDEN = re.compile(r"^Traceback \(most recent call last\):$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
LOG_TAIL_ON_ERROR = 40
PUMP_JOIN_S = 10.0


def demo_params(workdir: Path, steps: int = STEPS, faults: str = FAULTS, **overrides: Any) -> dict[str, Any]:
    """Pipeline arguments of the local demo (every one validated by `PipelineParams`)."""
    params = dict(
        model="tiny", steps=steps, checkpoint_interval=10, nodes=2, procs_per_node=1, gpus_per_node=0, seq_len=128,
        batch_size=8, faults=faults, inprocess_restart=True, ft_max_restarts=2, max_cluster_restarts=1,
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


def shown(line: str) -> str | None:
    """The line as the terminal shows it (colours and kfp.local's indentation removed), or None to log only."""
    text = _ANSI.sub("", line).strip()
    if HIDDEN.match(text):
        return None
    return text if SHOWN.search(text) or RECOVERY_EVENTS.search(text) else None


def _pump(read_fd: int, log_path: Path, terminal: TextIO, verbose: bool) -> None:
    seen: set[str] = set()  # a failed step's error repeats the log tail already shown
    with os.fdopen(read_fd, "r", errors="replace") as source, open(log_path, "a") as log:
        for line in source:
            log.write(line)
            log.flush()
            text = line.rstrip("\n") if verbose else shown(line)
            if text is None or (not verbose and text in seen):
                continue
            seen.add(text)
            terminal.write(text + "\n")
            terminal.flush()


@contextlib.contextmanager
def filtered_output(log_path: Path, verbose: bool = False) -> Iterator[TextIO]:
    """Send everything written to stdout and stderr (by this process and the processes it starts) to
    ``log_path``; the terminal gets only the `shown` lines (every line with ``verbose``). Yields the terminal."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    terminal = os.fdopen(os.dup(1), "w", buffering=1)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    pump = threading.Thread(target=_pump, args=(read_fd, log_path, terminal, verbose), daemon=True)
    pump.start()
    streams = sys.stdout, sys.stderr
    # Python-level writers too, wherever sys.stdout pointed (a wrapper that is not fd 1, e.g. under pytest).
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - restored below
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    try:
        yield terminal
    finally:
        sys.stdout.close()
        sys.stderr.close()
        sys.stdout, sys.stderr = streams
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)
        pump.join(PUMP_JOIN_S)  # EOF once no process holds the pipe any more
        terminal.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(ROOT), help=f"where runs go (default {ROOT})")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--faults", default=FAULTS, help="rank:step:kind,... ('' for none)")
    parser.add_argument("--trainer-override", action="append", default=[], metavar="--SECTION.KEY=VALUE",
                        help="a trainer config override, repeatable (e.g. --trainer-override=--resiliency.straggler=evict)")
    parser.add_argument("--verbose", action="store_true",
                        help="show everything (kfp.local's executor JSON, the full trainer log), not only progress")
    args = parser.parse_args(argv)
    # The local train step echoes progress and recovery events; the full trainer log is in <run>/launcher/.
    os.environ.setdefault(ECHO_ENV, ECHO_ALL if args.verbose else ECHO_PROGRESS)
    root = Path(args.root)
    params = demo_params(root / "work", steps=args.steps, faults=args.faults, trainer_overrides=args.trainer_override)
    log_path = root / "logs" / f"demo-{time.strftime('%Y%m%d-%H%M%S')}.log"
    print(f"[demo] tiny model, {args.steps} steps, 2 nodes x 1 CPU process; faults: {args.faults or 'none'}\n"
          f"[demo] progress and recovery events below; the full log: {log_path}", flush=True)
    started = time.monotonic()
    try:
        with filtered_output(log_path, args.verbose):
            run_root = run_local(params, root / "kfp")
    except Exception as exc:
        tail = log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_ON_ERROR:]
        print("\n".join(["[demo] the last lines of the log:", *tail, f"[demo] failed: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}", f"[demo] full log: {log_path}"]),
              file=sys.stderr)
        return 1
    print(format_summary(summarize(run_root), time.monotonic() - started))
    print(f"  full log     {log_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
