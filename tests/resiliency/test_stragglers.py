"""Straggler detection on 2 gloo ranks of the tiny model (NVRx ``straggler.Detector``, host-timed sections).

- rank 1 slowed by 50 % (``slow:0.5``) is named within ``straggler_patience`` reports, rank 0 never;
- ``evict`` ends the job UNHEALTHY_NODE (201) through ``entrypoint.sh`` with one line naming the host, the ledger
  records it, and a relaunch resumes from the eviction's checkpoint and ends bit-identical to a run without it;
- with no slow rank, 120 steps (5 scored reports of 20 steps) give no report below the threshold.

Why the last one is robust on a loaded 2-core machine (threshold 0.75, the default; a report every 20 steps): a
relative score compares the ranks over the same steps, so load on the whole machine cancels out (a report during
which both ranks' forward/backward slowed to 0.62 of their best still scored both ranks at 0.95 or above); each
section's score uses its median over the 20 steps, which up to 9 disturbed steps of one rank cannot move; the
deciding score weights the collective-free sections by time, so it is the ~15 ms optimizer step's, not the
~0.25 ms data section's jitter; and to fall below 0.75 a rank's median must be 1.33x the other's for the whole
interval, while the slowed rank measures about 0.61-0.64. The forward/backward section (FSDP's collectives) never
decides, so every run here trains on small batches (2 x 64 tokens per rank): the scored sections, the data and
optimizer steps of the same model, cost what they cost at the preset's batch; the steps themselves ~8x less, and a
``slow`` fault sleeps in proportion to each timed part, so a slowed rank's score does not depend on the batch. It ran
200 steps (9 scored reports, 32 s alone) until 120 (5, ~22 s) were judged enough for a check of the false-alarm
rate within the serial part's time: each report is scored as before; there are fewer of them.
"""

import re
import socket

import pytest

from test_recovery import ENTRYPOINT, FT_ENV, GRACE, VENV_BIN, _run, assert_same_weights, events, node_dir
from trainer.checkpoint import load_model_weights
from trainer.exitcodes import ExitCode
from trainer.ledger import read

pytestmark = [pytest.mark.multiprocess, pytest.mark.serial]  # scores and the evicting report's step: alone

STEPS = 25
EVERY = 5
PATIENCE = 3
THRESHOLD = 0.75
HOST = socket.gethostname()
NO_SLOW_STEPS = 120  # the false-alarm test: a report every 20 steps, the first closing the start-up interval
SMALL_BATCHES = ("--train.batch_size=2", "--data.seq_len=64")  # unscored forward/backward: ~8x cheaper steps


def args(run_dir, dataset, *extra, steps=STEPS, every=EVERY):
    return ["--config", "tiny", f"--train.steps={steps}", "--checkpoint.interval=5", *SMALL_BATCHES,
            f"--data.path={dataset}",
            f"--train.run_dir={run_dir}", f"--checkpoint.node_local_dir={node_dir(run_dir)}",
            f"--resiliency.straggler_report_every={every}", *extra]


def torchrun(run_dir, dataset, *extra, timeout=150, **kw):
    cmd = [str(VENV_BIN / "torchrun"), "--nproc-per-node=2", "--master-port={port}", "-m", "trainer",
           *args(run_dir, dataset, *extra, **kw)]
    return _run(cmd, run_dir, timeout=timeout)


def entrypoint(run_dir, dataset, *extra):
    return _run([str(ENTRYPOINT), *args(run_dir, dataset, *extra, *GRACE)], run_dir, env_extra=FT_ENV)


def straggler_metrics(run_dir):
    return [r for r in read(run_dir / "metrics.jsonl") if r["event"] == "straggler"]


@pytest.fixture(scope="module")
def slowed_run(tmp_path_factory, tiny_dataset):
    """``report`` mode, rank 1 50 % slower from step 6 (after the start-up interval of steps 1-5). A slow rank only sleeps, so its final weights are also the
    reference of a run without faults for the eviction test."""
    run_dir = tmp_path_factory.mktemp("slowed")
    rc, out, _ = torchrun(run_dir, tiny_dataset, "--resiliency.straggler=report",
                          f"--resiliency.straggler_patience={PATIENCE}", "--resiliency.faults=1:6:slow:0.5")
    assert rc == 0, out[-4000:]
    return run_dir, out


def test_a_rank_slowed_by_half_is_named_within_patience_reports_and_the_fast_rank_never(slowed_run):
    run_dir, out = slowed_run
    reports = events(run_dir, "straggler_report")
    assert [r["step"] for r in reports] == [10, 15, 20, 25], "step 5 closes the start-up interval: not scored"
    assert all(0 not in [s["rank"] for s in r["stragglers"]] for r in reports), "the fast rank was named"
    named = [r["step"] for r in reports[:PATIENCE] if [s["rank"] for s in r["stragglers"]] == [1]]
    assert named, f"rank 1 not named within {PATIENCE} reports: {reports}"
    first = next(r for r in reports if r["step"] == named[0])
    assert first["stragglers"][0]["host"] == HOST and first["stragglers"][0]["relative"] < THRESHOLD
    assert first["slowest"][0]["rank"] == 1 and first["basis"] == "host"
    assert f"straggler at step {named[0]}: rank 1 on {HOST} runs at" in out
    metrics = {r["step"]: {x["rank"]: x for x in r["ranks"]} for r in straggler_metrics(run_dir)}
    assert sorted(metrics) == [10, 15, 20, 25]
    assert all(m[0]["relative"] >= THRESHOLD for m in metrics.values())
    assert metrics[named[0]][1]["step_time_s"] > metrics[named[0]][0]["step_time_s"]
    assert list(run_dir.glob("events.out.tfevents.*")), "the scores also go to TensorBoard"
    assert not events(run_dir, "straggler_evicted") and (run_dir / "summary.json").exists()


def test_evict_ends_the_job_unhealthy_naming_the_host_once_and_a_relaunch_resumes_bit_identical(
        tmp_path, tiny_dataset, slowed_run):
    # Slowed from step 6 as in slowed_run, but twice as slow (slow:1.0, a score of ~0.5): the reports of steps 10
    # and 15 must both name it, the second one evicting. At slow:0.5 (~0.67, against the 0.75 threshold) a 5-step
    # window in which rank 0's optimizer step also ran slow (CI, 983b5dc: 7.5 against its usual 6.3 ms, the first
    # persisted checkpoint's writer beside it) scored rank 1 at 0.77, and the eviction came at step 25. Sleeping
    # changes no arithmetic: slowed_run's weights stay the reference.
    evict = ["--resiliency.straggler=evict", "--resiliency.straggler_patience=2", "--resiliency.faults=1:6:slow:1.0"]
    rc, out, _ = entrypoint(tmp_path, tiny_dataset, *evict)
    assert rc == ExitCode.UNHEALTHY_NODE, out[-4000:]
    exits = [line for line in out.splitlines() if "exit 201 (UNHEALTHY_NODE)" in line]
    naming = [line for line in exits if HOST in line.split("exit 201", 1)[1]]
    assert len(naming) == 1, exits
    assert re.search(rf"straggler: rank 1 on host {re.escape(HOST)} ran at 0\.\d\d of the fastest rank's speed in 2 "
                     r"report\(s\) in a row .*a checkpoint of step 15 was committed", naming[0]), naming[0]
    assert "Traceback" not in out and "will restart worker group" not in out, "no in-job restart on this node"
    (evicted,) = events(tmp_path, "straggler_evicted")
    assert (evicted["rank"], evicted["host"], evicted["step"], evicted["reports"], evicted["checkpoint"]) == (
        1, HOST, 15, 2, 15)
    assert {(r["rank"], r["code"]) for r in events(tmp_path, "exit")} == {(0, 201), (1, 201)}

    rc, out, _ = entrypoint(tmp_path, tiny_dataset, *evict)  # the relaunch: the slow fault does not fire again
    assert rc == 0, out[-4000:]
    (restart,) = [r for r in events(tmp_path, "restart") if r["rank"] == 0]
    assert (restart["layer"], restart["resumed_step"], restart["fault"]["kind"]) == ("cluster", 15, "unhealthy_node")
    # Not slowed again: the slow fault does not fire in the relaunch, and no rank is evicted again. (Scores are not
    # checked: one report of one window of 5 small steps named a rank at 0.72 when the machine's load landed on it,
    # and below 0.6 in another CI run; the eviction needs two reports in a row.)
    assert "injecting fault slow" not in out, out[-4000:]
    after = [r for r in events(tmp_path, "straggler_report") if r["step"] > 15]
    assert len(after) == 1, after
    assert len(events(tmp_path, "straggler_evicted")) == 1
    assert_same_weights(tmp_path, load_model_weights(slowed_run[0] / "checkpoints"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_no_slow_rank_no_report_below_the_threshold_in_120_steps(tmp_path, tiny_dataset):
    rc, out, _ = torchrun(tmp_path, tiny_dataset, "--resiliency.straggler=evict", steps=NO_SLOW_STEPS,
                          every=20, timeout=540)
    assert rc == 0, out[-4000:]
    reports = straggler_metrics(tmp_path)
    steps = list(range(40, NO_SLOW_STEPS + 1, 20))
    assert [r["step"] for r in reports] == steps, "step 20 closes the start-up interval"
    lowest = min(x["relative"] for r in reports for x in r["ranks"])
    assert all(r["stragglers"] == [] for r in reports), [
        (r["step"], [(x["rank"], x["relative"]) for x in r["ranks"]]) for r in reports]
    assert lowest >= THRESHOLD and not events(tmp_path, "straggler_evicted")
    print(f"lowest relative score in {len(reports)} reports: {lowest}")
