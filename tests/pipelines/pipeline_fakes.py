"""Fakes for the pipeline tests: entrypoints and trainer run files (``from pipeline_fakes import ...``)."""

from __future__ import annotations

import json
import stat
import sys
import textwrap
from pathlib import Path


def write_script(path: Path, body: str) -> Path:
    """An executable Python script (a stand-in for entrypoint.sh or the evaluation CLI)."""
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def write_run_files(run_dir: Path, steps: int, restarts: dict[str, int] | None = None) -> None:
    """metrics.jsonl, summary.json and recovery.jsonl as the trainer writes them (trainer/ledger.py schema)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = 1_700_000_000.0
    metrics = [{"event": "start", "time": t0, "model": "tiny", "world_size": 2}]
    metrics += [{"event": "step", "time": t0 + s, "step": s, "loss": 8.0 - s * 0.05, "lr": 1e-3,
                 "tokens_per_s": 1000.0, "step_time_s": 1.0, "mfu": None} for s in range(1, steps + 1)]
    summary = {"event": "summary", "steps": steps, "tokens": steps * 2048, "final_loss": 8.0 - steps * 0.05,
               "wall_time_s": steps * 1.2, "world_size": 2}
    metrics.append(summary)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run_dir / "summary.json").write_text(json.dumps(summary))
    ledger = [{"event": "start", "time": t0, "rank": 0}]
    t = t0 + 5
    for layer, n in (restarts or {}).items():
        for _ in range(n):
            ledger.append({"event": "fault", "kind": "sigkill", "step": 5, "time": t, "rank": 1})
            for rank in (1, 0):  # every rank writes its restart record, as the trainer does
                ledger.append({"event": "restart", "layer": layer, "resumed_step": 4, "time": t + 2, "rank": rank,
                               "fault": {"kind": "sigkill", "step": 5, "time": t}})
            ledger.append({"event": "recovered", "layer": layer, "step": 5, "fault_kind": "sigkill", "fault_step": 5,
                           "recovery_s": 3.0, "steps_redone": 0, "time": t + 3, "rank": 0})
            t += 10
    ledger.append({"event": "summary", "steps": steps, "wall_s": 100.0, "productive_s": 80.0, "goodput": 0.8,
                   "time": t + 50, "rank": 0})
    (run_dir / "recovery.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ledger) + '{"torn": ')
