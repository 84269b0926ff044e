"""Turn a training run directory into benchmark figures, one JSON line each.

``python bench/figures.py throughput RUN_DIR [--skip 10] [--until N]``: median tokens/s, tokens/s per GPU, step time
and MFU over the logged steps after ``--skip`` warm-up steps (compilation, allocator warm-up), peak memory, losses.
``python bench/figures.py recovery RUN_DIR``: every ``recovered`` record of the recovery ledger (layer, fault,
seconds from the fault to the first productive step, steps redone, and where those seconds went: ``phases``, see
``trainer/startup.py``) and the ledger's goodput summary.
``python bench/figures.py goodput RUN_DIR --interval N``: goodput counted strictly from ``metrics.jsonl`` (a run logged
with ``train.log_every=1``): the fault-free step time (median of every logged step) x the run's steps / the wall time
from the first step's start to the last step's end; beside it the ledger's figure, start-up and the final save apart,
and the cost of a memory checkpoint (the step after each snapshot step, where its staging waits, against the median).
``python bench/figures.py starts RUN_DIR [--rank 0]``: every start of that rank (the first, each in-process and
in-job restart) with its phases, from the ``start phases`` lines of ``RUN_DIR/logs/trainer-rank<R>.log``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from trainer.ledger import read  # torch-free: the ledger and metrics files are JSON lines


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def throughput_figure(run_dir: Path, skip: int, until: int | None = None) -> dict:
    """Median tokens/s, step time and MFU over the step records after ``skip`` (up to ``until``), peak memory,
    and the logged losses (equal losses in two runs show a deterministic rerun)."""
    records = read(run_dir / "metrics.jsonl")
    start = next((r for r in records if r.get("event") == "start"), {})
    logged = [r for r in records if r.get("event") == "step" and (until is None or r["step"] <= until)]
    steps = [r for r in logged if r["step"] > skip]
    if not steps:
        raise ValueError(f"{run_dir}: no step records after step {skip}")
    world = start.get("world_size", 1)
    tps = statistics.median(r["tokens_per_s"] for r in steps)
    mfu = [r["mfu"] for r in steps if r.get("mfu") is not None]
    mem = {k: max(r[k] for r in logged) for k in ("mem_reserved_gib", "mem_allocated_gib") if k in logged[-1]}
    return {"figure": "throughput", "run": run_dir.name, "model": start.get("model"), "gpus": world,
            "tokens_per_s": round(tps), "tokens_per_s_per_gpu": round(tps / world),
            "step_time_s": round(statistics.median(r["step_time_s"] for r in steps), 4),
            "mfu": round(statistics.median(mfu), 4) if mfu else None, "steps_measured": len(steps), **mem,
            "losses": {r["step"]: r["loss"] for r in logged}}


def throughput(run_dir: Path, skip: int, until: int | None = None) -> None:
    try:
        emit(throughput_figure(run_dir, skip, until))
    except ValueError as exc:
        sys.exit(str(exc))


def recovery(run_dir: Path) -> None:
    ledger = read(run_dir / "recovery.jsonl")
    for r in ledger:
        if r.get("event") == "recovered":
            emit({"figure": "recovery", "run": run_dir.name, "layer": r.get("layer"), "fault": r.get("fault_kind"),
                  "fault_step": r.get("fault_step"), "recovery_s": r.get("recovery_s"),
                  "steps_redone": r.get("steps_redone"), "phases": r.get("phases")})
    summary = [r for r in ledger if r.get("event") == "summary"]
    if summary:
        s = summary[-1]
        emit({"figure": "goodput", "run": run_dir.name, "goodput": s.get("goodput"), "wall_s": s.get("wall_s"),
              "productive_s": s.get("productive_s"), "steps": s.get("steps"), "restarts": s.get("by_layer")})


def goodput(run_dir: Path, interval: int) -> None:
    records = read(run_dir / "metrics.jsonl")
    steps = [r for r in records if r.get("event") == "step"]
    if not steps:
        sys.exit(f"{run_dir}: no step records")
    final = max(r["step"] for r in steps)
    median = statistics.median(r["step_time_s"] for r in steps)
    first = steps[0]
    first_start = first["time"] - first["step_time_s"]
    last_end = max(r["time"] for r in steps if r["step"] == final)
    wall = last_end - first_start
    # A snapshot taken after step S (S % interval == 0) is waited for before step S+1's optimizer step: its cost
    # lands in the step time logged for S+1. Steps right after a (re)start are left out (warm-up, not snapshots).
    restarts = {r.get("step", 0) for r in records if r.get("event") in ("start", "resume")}
    after = [r["step_time_s"] for r in steps
             if interval and r["step"] % interval == 1 and r["step"] - 1 not in restarts and r["step"] > interval]
    summary = next((r for r in reversed(records) if r.get("event") == "summary"), {})
    ledger = [r for r in read(run_dir / "recovery.jsonl") if r.get("event") == "summary"]
    log = run_dir / "logs" / "trainer-rank0.log"
    first_start_line = next((START_LINE.match(line) for line in
                             (log.read_text(errors="replace").splitlines() if log.is_file() else [])
                             if START_LINE.match(line)), None)
    emit({"figure": "goodput_strict", "run": run_dir.name, "steps": final, "fault_free_step_s": round(median, 4),
          "wall_first_step_to_last_s": round(wall, 2), "goodput_strict": round(median * final / wall, 4),
          "goodput_ledger": ledger[-1].get("goodput") if ledger else None,
          "startup_s": float(first_start_line[3]) if first_start_line else None,  # process start -> first step's end
          "final_save_s": round(summary["time"] - last_end, 2) if summary else None,
          "snapshot_steps": len(after),
          "snapshot_cost_s": round(statistics.mean(after) - median, 4) if after else None,
          "snapshot_cost_over_interval": round((statistics.mean(after) - median) / (median * interval), 4)
          if after and interval else None})


START_LINE = re.compile(r"^(\S+ \S+) .*start phases \(s\): (.*); ([\d.]+) s from (process start|the in-process re-entry)")


def starts(run_dir: Path, rank: int) -> None:
    """Each start's phases as logged by ``trainer.startup.report`` (one line per start and rank)."""
    log = run_dir / "logs" / f"trainer-rank{rank}.log"
    if not log.is_file():
        sys.exit(f"{log} not found")
    for line in log.read_text(errors="replace").splitlines():
        match = START_LINE.match(line)
        if match:
            phases = {name: float(seconds) for name, seconds in (p.rsplit(" ", 1) for p in match[2].split(", "))}
            emit({"figure": "start", "run": run_dir.name, "rank": rank, "time": match[1],
                  "kind": "new process" if match[4] == "process start" else "in-process restart",
                  "total_s": float(match[3]), "phases": phases})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=("throughput", "recovery", "starts", "goodput"))
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--until", type=int, default=None, help="throughput: ignore step records after this step")
    parser.add_argument("--rank", type=int, default=0, help="starts: whose log")
    parser.add_argument("--interval", type=int, default=10, help="goodput: the run's checkpoint.interval")
    args = parser.parse_args()
    if args.kind == "throughput":
        throughput(args.run_dir, args.skip, args.until)
    elif args.kind == "starts":
        starts(args.run_dir, args.rank)
    elif args.kind == "goodput":
        goodput(args.run_dir, args.interval)
    else:
        recovery(args.run_dir)


if __name__ == "__main__":
    main()
