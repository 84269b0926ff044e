"""Turn a training run directory into benchmark figures, one JSON line each.

``python bench/figures.py throughput RUN_DIR [--skip 10] [--until N]``: median tokens/s, tokens/s per GPU, step time
and MFU over the logged steps after ``--skip`` warm-up steps (compilation, allocator warm-up), peak memory, losses.
``python bench/figures.py recovery RUN_DIR``: every ``recovered`` record of the recovery ledger (layer, fault,
seconds from the fault to the first productive step, steps redone, and where those seconds went: ``phases``, see
``trainer/startup/phases.py``) and the ledger's goodput summary.
``python bench/figures.py goodput RUN_DIR --interval N``: goodput counted strictly from ``metrics.jsonl`` (a run logged
with ``train.log_every=1``): the fault-free step time (median of every logged step) x the run's steps / the wall time
from the first step's start to the last step's end; beside it the ledger's figure, start-up and the final save apart,
the cost of a memory checkpoint (the step after each snapshot step, where its staging waits, against the median),
and where the loss went (``lost_s``: recoveries, redone steps, step 1, the steps after restarts and snapshots).
``python bench/figures.py starts RUN_DIR [--rank 0]``: every start of that rank (the first, each in-process and
in-job restart) with its phases, from the ``start phases`` lines of ``RUN_DIR/logs/trainer-rank<R>.log``.
``python bench/figures.py table THROUGHPUT_JSONL``: the markdown tables of ``bench/throughput_suite.sh``: the project
against torchtitan (same call, same steps) and the leave-one-out rows.

``StepClock`` and ``step_figure`` time every step on the GPU's own timeline (a CUDA event at the start of each step,
no host sync); the trainer's runner and the torchtitan anchor both use them, so both sides are measured alike.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
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


class StepClock:
    """Per-step durations without a host sync: an event at the start of every step and one after the last
    (``mark(last + 1)``); CUDA events on a GPU (the time between them on the device's timeline, idle gaps
    included), the host clock otherwise."""

    def __init__(self) -> None:
        self.marks: dict[int, object] = {}

    def mark(self, step: int) -> None:
        import torch

        if torch.cuda.is_available():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[step] = event
        else:
            self.marks[step] = time.perf_counter()

    def seconds(self) -> dict[int, float]:
        """{step: seconds from its start to the next step's start}; syncs once, at the end."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out = {}
        for step, start in sorted(self.marks.items()):
            end = self.marks.get(step + 1)
            if end is not None:
                out[step] = end - start if isinstance(start, float) else start.elapsed_time(end) / 1e3  # type: ignore
        return out


def step_figure(seconds: dict[int, float], tokens_per_step: int, skip: int, until: int | None = None) -> dict:
    """Median step time over the steps after ``skip`` (up to ``until``), as tokens/s; every step's time in ms."""
    measured = [t for s, t in seconds.items() if s > skip and (until is None or s <= until)]
    if not measured:
        return {"steps_timed": 0, "step_ms": {s: round(t * 1e3, 2) for s, t in sorted(seconds.items())}}
    median = statistics.median(measured)
    return {"tokens_per_s_steps": round(tokens_per_step / median), "step_s_median": round(median, 5),
            "steps_timed": len(measured), "step_ms": {s: round(t * 1e3, 2) for s, t in sorted(seconds.items())}}


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
    by_step = {r["step"]: r["step_time_s"] for r in steps}  # a step redone after a restart: its last time
    restarts = {r.get("step", 0) for r in records if r.get("event") in ("start", "resume")}
    # Fault-free step time: the median step far from any snapshot and any restart. A snapshot of step S costs
    # step S (its host part: train.py takes it before the step's line) and the next few (its copies: the
    # device-to-device copy in S+1, the drain to host memory in parts from S+1's start), so the plain steps
    # are those PLAIN_FROM or more steps after one. Without snapshots (interval 0) every step counts.
    plain = [t for s, t in by_step.items() if not interval or (not _after_snapshot(s, interval)
                                                                and not _near_restart(s, restarts, interval))]
    fault_free = statistics.median(plain or list(by_step.values()))
    first = steps[0]
    first_start = first["time"] - first["step_time_s"]
    last_end = max(r["time"] for r in steps if r["step"] == final)
    wall = last_end - first_start
    # What a snapshot costs: each whole interval after it (steps S+1 .. S+interval, the next snapshot's host part
    # included) against `interval` fault-free steps; intervals with a (re)start in them left out.
    excess = []
    for begin in range(2 * interval + 1, final - interval + 2, interval) if interval else ():
        window = range(begin, begin + interval)
        if all(s in by_step for s in window) and not _near_restart(begin - 1, restarts, interval):
            excess.append(sum(by_step[s] for s in window) - interval * fault_free)
    lost = _losses(steps, by_step, restarts, fault_free, wall - fault_free * final, interval)
    summary = next((r for r in reversed(records) if r.get("event") == "summary"), {})
    ledger = [r for r in read(run_dir / "recovery.jsonl") if r.get("event") == "summary"]
    log = run_dir / "logs" / "trainer-rank0.log"
    first_start_line = next((START_LINE.match(line) for line in
                             (log.read_text(errors="replace").splitlines() if log.is_file() else [])
                             if START_LINE.match(line)), None)
    emit({"figure": "goodput_strict", "run": run_dir.name, "steps": final, "fault_free_step_s": round(fault_free, 4),
          "wall_first_step_to_last_s": round(wall, 2), "goodput_strict": round(fault_free * final / wall, 4),
          "goodput_ledger": ledger[-1].get("goodput") if ledger else None,
          "startup_s": float(first_start_line[3]) if first_start_line else None,  # process start -> first step's end
          "final_save_s": round(summary["time"] - last_end, 2) if summary else None,
          "snapshot_intervals": len(excess),
          "snapshot_cost_s": round(statistics.mean(excess), 4) if excess else None,
          "snapshot_cost_median_s": round(statistics.median(excess), 4) if excess else None,
          "snapshot_cost_over_interval": round(statistics.mean(excess) / (fault_free * interval), 4)
          if excess else None, "lost_s": lost})


def _losses(steps: list[dict], by_step: dict[int, float], restarts: set[int], fault_free: float, total: float,
            interval: int) -> dict[str, float]:
    """Where the strict goodput's loss ``total`` (wall - fault-free step x steps) went; the parts sum to it:
    ``recoveries`` the time between a step's end and the next logged step's start (a restart before its first step);
    ``redone`` every step record of a step run again later; then each kept step's time over the fault-free step:
    ``step_1``, ``restart_first_steps`` (the two steps after each restart), ``snapshots`` (the steps a snapshot at
    step S costs: ``_after_snapshot``) and ``other``."""
    parts = dict.fromkeys(("recoveries", "redone", "step_1", "restart_first_steps", "snapshots", "other"), 0.0)
    last_seen = {r["step"]: i for i, r in enumerate(steps)}
    for i, r in enumerate(steps[1:], 1):  # a gap before a step that goes back is a recovery; others (the host's
        # clock against the step's device-timed length: a few ms either way) count as "other"
        gap = r["time"] - r["step_time_s"] - steps[i - 1]["time"]
        parts["recoveries" if r["step"] <= steps[i - 1]["step"] else "other"] += gap
    parts["redone"] = sum(r["step_time_s"] for i, r in enumerate(steps) if last_seen[r["step"]] != i)
    for step, seconds in by_step.items():
        key = ("step_1" if step == 1 else "restart_first_steps" if any(0 < step - r <= 2 for r in restarts if r)
               else "snapshots" if _after_snapshot(step, interval) else "other")
        parts[key] += seconds - fault_free
    return {k: round(v, 2) for k, v in (parts | {"total": total}).items()}


PLAIN_FROM = 4
"""Steps this far or further after a snapshot (and from a restart) count as fault-free steps."""


def _after_snapshot(step: int, interval: int) -> bool:
    """Whether ``step`` is one a snapshot costs: S .. S + PLAIN_FROM - 1 for a snapshot at step S."""
    return bool(interval) and step % interval < min(PLAIN_FROM, interval - 1)


def _near_restart(step: int, restarts: set[int], interval: int) -> bool:
    """Whether ``step`` lies within ``interval`` steps after a (re)start (its warm-up, redone steps)."""
    return any(0 <= step - r < interval for r in restarts)


START_LINE = re.compile(r"^(\S+ \S+) .*start phases \(s\): (.*); ([\d.]+) s from (process start|the in-process re-entry)")


def starts(run_dir: Path, rank: int) -> None:
    """Each start's phases as logged by ``trainer.startup.phases.report`` (one line per start and rank)."""
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


GOALS = {"compiled": 1.05, "eager": 1.10}  # issue 21: the project's tokens/s over torchtitan's, same call


def _fmt(value: float | None, spec: str = ",.0f") -> str:
    return "—" if value is None else format(value, spec)


def table(lines: list[dict]) -> str:
    """Markdown: the project against torchtitan per mode (labels ``ours-<mode>`` / ``titan-<mode>``), then one
    table per leave-one-out group (labels ``loo-<mode>`` and ``loo-<mode>:<variant>``). Tokens/s are medians of
    per-step times (``tokens_per_s_steps``); the 10-step windows' medians are the second ratio."""
    by_label = {r["label"]: r for r in lines if r.get("label")}
    out = ["| run | project tokens/s | torchtitan tokens/s | ratio (per step) | ratio (10-step windows) | goal | "
           "peak reserved, project / torchtitan | memory |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows = [(mode, "", goal) for mode, goal in GOALS.items()]
    rows += [(mode, "-alloc", goal) for mode, goal in GOALS.items() if f"ours-{mode}-alloc" in by_label]
    for mode, variant, goal in rows:  # -alloc: the project with torchtitan's allocator settings (suite part alloc)
        ours, titan = by_label.get(f"ours-{mode}{variant}", {}), by_label.get(f"titan-{mode}", {})
        a, b = ours.get("tokens_per_s_steps"), titan.get("tokens_per_s_steps")
        wa, wb = ours.get("tokens_per_s"), titan.get("tokens_per_s")
        ratio = a / b if a and b else None
        wratio = wa / wb if wa and wb else None
        ma, mb = ours.get("mem_reserved_gib"), titan.get("mem_reserved_gib")
        verdict = "—" if ratio is None else ("met" if ratio >= goal else "missed")
        memory = "—" if ma is None or mb is None else ("met" if ma <= mb else "missed")
        problem = " ".join(f"{side}: {r.get('error') or r.get('figure') or 'no line'}"  # why a side has no figure
                           for side, r in (("project", ours), ("torchtitan", titan)) if not r.get("tokens_per_s_steps"))
        name = f"{mode}, allocator as torchtitan's" if variant else mode
        out.append(f"| {name} | {_fmt(a)} | {_fmt(b)} | **{_fmt(ratio, '.3f')}** {verdict} | {_fmt(wratio, '.3f')} "
                   f"| ≥ {goal:.2f} | {_fmt(ma, '.2f')} / {_fmt(mb, '.2f')} GiB | {memory} |"
                   + (f" {problem[:200]}" if problem else ""))
    groups = sorted({label.split(":")[0] for label in by_label if label.startswith("loo-")})
    for group in groups:
        base = by_label.get(group, {})
        out += ["", f"**{group}** (every change on, then each left out; per-step medians)", "",
                "| variant | overrides | tokens/s | vs every change on | step | peak reserved / allocated |",
                "| --- | --- | --- | --- | --- | --- |"]
        for label in [group] + sorted(k for k in by_label if k.startswith(group + ":")):
            r = by_label[label]
            tps, ref = r.get("tokens_per_s_steps"), base.get("tokens_per_s_steps")
            change = f"{(tps / ref - 1) * 100:+.1f} %" if tps and ref and label != group else ("1" if tps else "—")
            step = r.get("step_s_median")
            overrides = " ".join(r.get("overrides") or []) + (" layers off" if r.get("layers") == "off" else "")
            out.append(f"| {label.split(':', 1)[-1] if ':' in label else 'all'} | {overrides or '—'} | {_fmt(tps)} "
                       f"| {change} | {_fmt(step * 1e3 if step else None, '.1f')} ms "
                       f"| {_fmt(r.get('mem_reserved_gib'), '.2f')} / {_fmt(r.get('mem_allocated_gib'), '.2f')} GiB |"
                       + (f" {r.get('error', '')[:200]}" if not tps else ""))
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=("throughput", "recovery", "starts", "goodput", "table"))
    parser.add_argument("run_dir", type=Path, help="a run directory (table: the suite's throughput.jsonl)")
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
    elif args.kind == "table":
        print(table(read(args.run_dir)), end="")
    else:
        recovery(args.run_dir)


if __name__ == "__main__":
    main()
