"""The straggler detector's cost on the step time, with and without it, in one process (one device call).

    source bench/gpu_env.sh && python3 bench/straggler_overhead.py [--order off,report,off,report] [--stop-at 210]
        [--skip 100] [--compile false] [--out runs/straggler] [-- --section.key=value ...]

Runs ``bench/trainer_run.py`` (every recovery layer as ``python -m trainer`` composes them) once, with one variant per
entry of ``--order`` (``resiliency.straggler`` = off / report / evict), A/B/A/B so drift over the call hits both.
Each variant trains ``--stop-at`` steps of ``--config`` (``1b``) at the default ``straggler_report_every`` (100): the
report at step 100 closes the start-up interval, the one at step 200 is a full report, inside the measured window
(steps ``--skip``+1 .. ``--stop-at``). The figure is the *mean* step time over that window (a report's cost lands in
one logged 10-step window, which a median would drop), per mode, and the overhead of each mode over ``off`` in ms
per step and as a fraction of the measured step and of a compiled ``1b`` step on one H200 (0.307 s).
``--compile false`` (the default here) keeps four runs inside one 10-minute call; the detector's cost per step does
not depend on compilation, so the fraction of the compiled step is the conservative figure. Output: one JSON line
per variant and a summary line, on stdout and in ``<out>/straggler_overhead.jsonl``; the runs' metrics (with the
straggler reports: ``basis`` says whether CUPTI profiled kernels) under ``<out>/runs``.

``--micro`` (any machine, no training): the host cost of the loop's three timed sections per step, off and on, and of
one report in a single process (``straggler_micro`` lines).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMPILED_1B_STEP_S = 0.307  # `1b`, torch.compile per block, 1 H200: the step this overhead is reported against


def window(metrics: Path, skip: int, stop: int) -> dict:
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("event") == "step" and skip < r["step"] <= stop]
    reports = [r for r in records if r.get("event") == "straggler"]
    prev, total = skip, 0.0
    for r in steps:  # a step record averages the steps since the previous one
        total += r["step_time_s"] * (r["step"] - prev)
        prev = r["step"]
    return {"mean_step_s": round(total / (prev - skip), 5) if steps else None,
            "median_window_s": round(statistics.median(r["step_time_s"] for r in steps), 5) if steps else None,
            "steps": prev - skip, "reports": [r["step"] for r in reports],
            "basis": reports[-1]["basis"] if reports else None}


def micro(repeats: int = 5, n: int = 20000) -> None:
    """Host cost per step of ``Layers.section`` x 3 (off: the null objects; report: NVRx ``detection_section``), and of
    one report over 100 steps of samples (world size 1: NVRx's scoring without a collective)."""
    import tempfile

    import torch

    from trainer.config import load_config
    from trainer.resiliency import Layers

    for mode in ("off", "report"):
        with tempfile.TemporaryDirectory() as run_dir:
            cfg = load_config("tiny", ["--data.path=unused", f"--resiliency.straggler={mode}", f"--train.run_dir={run_dir}",
                                       "--resiliency.straggler_report_every=100"])
            layers = Layers.create(cfg, 0, 1, 0, torch.device("cpu"))
            layers.on_loop_start(0)
            per_step = []
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(n):
                    for name in ("data", "forward_backward", "optimizer"):
                        with layers.section(name):
                            pass
                per_step.append((time.perf_counter() - start) / n * 1e6)
            report_ms = []
            for step in range(1, 401):
                for name in ("data", "forward_backward", "optimizer"):
                    with layers.section(name):
                        pass
                start = time.perf_counter()
                layers.straggler.after_step(step, commit=lambda: None)
                if step % 100 == 0 and step > 100:  # step 100 closes the start-up interval
                    report_ms.append((time.perf_counter() - start) * 1e3)
            layers.straggler.close()
        print(json.dumps({"figure": "straggler_micro", "straggler": mode, "sections_us_per_step_min": round(min(per_step), 2),
                          "sections_us_per_step_median": round(statistics.median(per_step), 2),
                          "report_ms": [round(x, 3) for x in report_ms]}), flush=True)


def main() -> int:
    if "--micro" in sys.argv:
        micro()
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--order", default="off,report,off,report")
    parser.add_argument("--config", default="1b")
    parser.add_argument("--stop-at", type=int, default=210)
    parser.add_argument("--skip", type=int, default=100)
    parser.add_argument("--compile", default="false")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/straggler")))
    parser.add_argument("--data", type=Path, default=Path("/tmp/straggler-bench-data"))
    parser.add_argument("--deadline-s", type=float, default=480.0,
                        help="stop the runs after this long; the variants done by then are still reported")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    modes = args.order.split(",")
    labels = [f"{mode}{modes[:i + 1].count(mode)}" for i, mode in enumerate(modes)]
    args.out.mkdir(parents=True, exist_ok=True)
    runs = (args.out / "runs").resolve()
    if not (args.data / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "components.lib.tokendata", "--out", str(args.data), "--vocab-size", "4096",
                        "--max-bytes", "12000000"], check=True)
    base = ["--config", args.config, f"--data.path={args.data}", f"--train.run_dir={runs}",
            f"--checkpoint.dir={runs}/ckpt", "--train.log_every=10", f"--train.compile={args.compile}", *extra]
    variants = [{"label": label, "set": [f"--resiliency.straggler={mode}"]} for label, mode in zip(labels[1:], modes[1:])]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "bench/trainer_run.py",
           "--stop-at", str(args.stop_at), "--skip", str(args.skip), "--label", labels[0], "--variants", json.dumps(variants), "--", *base, f"--resiliency.straggler={modes[0]}"]
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        rc = proc.wait(timeout=args.deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    figures = []
    with open(args.out / "straggler_overhead.jsonl", "a") as out:
        for i, (label, mode) in enumerate(zip(labels, modes)):
            metrics = (runs if i == 0 else runs / label) / "metrics.jsonl"
            if not metrics.exists():
                continue
            fig = {"figure": "straggler_variant", "label": label, "straggler": mode, "compile": args.compile,
                   **window(metrics, args.skip, args.stop_at)}
            if fig["steps"] == args.stop_at - args.skip:  # a run the deadline cut short is shown, not counted
                figures.append(fig)
            print(json.dumps(fig), flush=True)
            out.write(json.dumps(fig) + "\n")
        off = [f["mean_step_s"] for f in figures if f["straggler"] == "off" and f["mean_step_s"]]
        summary = {"figure": "straggler_overhead", "config": args.config, "compile": args.compile,
                   "report_every": next((int(a.split("=", 1)[1]) for a in extra
                                         if a.startswith("--resiliency.straggler_report_every=")), 100),
                   "off_mean_step_s": statistics.mean(off) if off else None, "rc": rc}
        for mode in sorted({f["straggler"] for f in figures} - {"off"}):
            on = [f["mean_step_s"] for f in figures if f["straggler"] == mode and f["mean_step_s"]]
            if off and on:
                delta = statistics.mean(on) - statistics.mean(off)
                summary[mode] = {"mean_step_s": round(statistics.mean(on), 5), "overhead_ms_per_step": round(delta * 1e3, 3),
                                 "overhead_of_measured_step": round(delta / statistics.mean(off), 5),
                                 "overhead_of_compiled_1b_step": round(delta / COMPILED_1B_STEP_S, 5),
                                 "spread_off_ms": round((max(off) - min(off)) * 1e3, 3)}
        print(json.dumps(summary), flush=True)
        out.write(json.dumps(summary) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
