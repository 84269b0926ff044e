"""The goodput planner through the trainer's CLI (``python -m trainer.plan``, ``trainer/PLANNING.md``): this module
never imports the trainer. The evaluation step runs it on the finished run at ``EVAL_GPUS`` GPUs for the HTML report,
with the run's own spare nodes and GPUs per node and the pipeline's ``replacement_pod_s``; ``pipelines.cli plan`` runs
it for a user. A planner failure is one line for the report, never a failed step.

A ``replacement_pod_s`` equal to its pipeline default (``params.DEFAULTS``, the planner's documented default) is not
passed: the planner then reports the replacement pod's time as a default (and varies it in its band), not as given."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from components.lib.params import DEFAULTS

PLAN_MODULE = "trainer.plan"
EVAL_GPUS = 16384
CPU_RUN_GPUS_PER_NODE = 8
"""A run on CPU (``gpus_per_node`` 0) is projected onto nodes of 8 GPUs (the planner's default)."""
EVAL_TRIALS = 32
TIMEOUT_S = 300.0
PLAN_FILE, CHART_FILE = "plan.json", "goodput.png"


class PlanningError(RuntimeError):
    """The planner exited non-zero, timed out or wrote no result; the message is one line."""


def plan_command(run_dir: str | Path, out_dir: str | Path, *, gpus: int = EVAL_GPUS, trials: int = EVAL_TRIALS,
                 spares: int = 0, gpus_per_node: int = 0, replacement_s: float | None = None,
                 extra: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """The planner's command line; ``gpus_per_node`` 0 (a CPU run) projects nodes of ``CPU_RUN_GPUS_PER_NODE``."""
    out = Path(out_dir)
    per_node = gpus_per_node if gpus_per_node > 0 else CPU_RUN_GPUS_PER_NODE
    given = replacement_s is not None and replacement_s != DEFAULTS.replacement_pod_s
    return [python, "-m", PLAN_MODULE, "--run", str(run_dir), "--gpus", str(gpus), "--trials", str(trials),
            "--spares", str(spares), "--gpus-per-node", str(per_node),
            *(["--replacement-s", f"{replacement_s:g}"] if given else []),
            "--chart-trials", str(max(8, trials // 2)), "--recommend", "--chart", str(out / CHART_FILE),
            "--json", str(out / PLAN_FILE), *extra]


def run_planner(command: Sequence[str], out_dir: str | Path, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """Run the planner and return its JSON result (with ``text``: what it printed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / PLAN_FILE).unlink(missing_ok=True)
    try:
        proc = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout_s)  # noqa: S603
    except subprocess.TimeoutExpired:
        raise PlanningError(f"the goodput planner did not finish within {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise PlanningError(f"the goodput planner failed: {last}")
    try:
        result = json.loads((out / PLAN_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise PlanningError(f"the goodput planner wrote no readable {PLAN_FILE} ({exc})") from None
    result["text"] = proc.stdout
    return result


def plan_for_report(run_dir: str | Path, out_dir: str | Path, **kw: Any) -> tuple[dict[str, Any] | None, str | None]:
    """(planner result, None), or (None, a one-line note for the report) when the planner could not run."""
    try:
        return run_planner(plan_command(run_dir, out_dir, **kw), out_dir), None
    except PlanningError as exc:
        return None, str(exc).splitlines()[0]
