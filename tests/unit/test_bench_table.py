"""The runner of record's arithmetic (issue 21): per-step medians from step marks, and the same-call table."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from figures import StepClock, step_figure, table  # noqa: E402


def test_step_figure_is_the_median_of_the_steps_after_skip():
    seconds = {s: 0.5 for s in range(1, 11)} | {11: 0.2, 12: 0.3, 13: 9.0, 14: 0.25}
    fig = step_figure(seconds, tokens_per_step=1000, skip=10, until=13)
    assert fig["steps_timed"] == 3 and fig["step_s_median"] == 0.3 and fig["tokens_per_s_steps"] == round(1000 / 0.3)
    assert fig["step_ms"][13] == 9000.0 and len(fig["step_ms"]) == 14
    assert step_figure(seconds, 1000, skip=20)["steps_timed"] == 0


def test_step_clock_times_from_one_step_start_to_the_next():
    clock = StepClock()
    for step in (1, 2, 3):
        clock.mark(step)
    seconds = clock.seconds()
    assert sorted(seconds) == [1, 2] and all(t >= 0 for t in seconds.values())


def _line(label, tps, mem=10.0, **extra):
    return {"figure": "throughput", "label": label, "tokens_per_s_steps": tps, "tokens_per_s": tps,
            "step_s_median": 16384 / tps if tps else None, "mem_reserved_gib": mem, "mem_allocated_gib": mem - 1,
            **extra}


def test_table_pairs_the_frameworks_and_lists_the_leave_one_out_rows():
    lines = [_line("ours-compiled", 63000, 48.0), _line("titan-compiled", 60000, 50.7),
             _line("ours-eager", 54000, 72.0), {"figure": "anchor", "label": "titan-eager", "error": "exit 1: OOM"},
             _line("loo-compiled", 63000), _line("loo-compiled:plain-loss", 61740, overrides=["--train.chunked_loss=false"])]
    text = table(lines)
    compiled = next(row for row in text.splitlines() if row.startswith("| compiled"))
    assert "63,000 | 60,000 | **1.050** met" in compiled and "48.00 / 50.70 GiB | met" in compiled
    eager = next(row for row in text.splitlines() if row.startswith("| eager"))
    assert "**—**" in eager and "torchtitan: exit 1: OOM" in eager
    assert "| plain-loss | --train.chunked_loss=false | 61,740 | -2.0 % |" in text
    assert text.index("| all |") < text.index("| plain-loss |")
    assert "allocator as torchtitan's" not in text  # no such row measured
    alloc = table(lines + [_line("ours-compiled-alloc", 62000, 47.0)])
    row = next(r for r in alloc.splitlines() if r.startswith("| compiled, allocator as torchtitan's"))
    assert "62,000 | 60,000 | **1.033** missed" in row and "47.00 / 50.70 GiB | met" in row


def test_goodput_loss_parts_sum_to_the_loss_and_name_each_cause():
    """A synthetic run (fault-free step 1 s, snapshots every 10): step 1 slow by 2 s, step 11 by 0.5 s, a fault
    after step 14 restores step 10 after a 3 s recovery (11-14 redone: 4 s), the redone step 11 slow by 0.25 s;
    step 23 (the last a snapshot at 20 costs) by 0.1 s, step 24 (a plain one) by 0.05 s."""
    from figures import _losses

    first = [(1, 3.0)] + [(s, 1.0) for s in range(2, 11)] + [(11, 1.5), (12, 1.0), (13, 1.0), (14, 1.0)]
    again = [(11, 1.25)] + [(s, {23: 1.1, 24: 1.05}.get(s, 1.0)) for s in range(12, 31)]
    steps, t = [], 100.0
    for i, (step, seconds) in enumerate(first + again):
        t += seconds + (3.0 if i == len(first) else 0.0)  # the recovery before the redone step 11
        steps.append({"step": step, "step_time_s": seconds, "time": t})
    by_step = {r["step"]: r["step_time_s"] for r in steps}
    wall = steps[-1]["time"] - (steps[0]["time"] - steps[0]["step_time_s"])
    lost = _losses(steps, by_step, {0, 10}, 1.0, wall - 1.0 * 30, 10)
    assert lost == {"recoveries": 3.0, "redone": 4.5, "step_1": 2.0, "restart_first_steps": 0.25, "snapshots": 0.1,
                    "other": 0.05, "total": 9.9}
