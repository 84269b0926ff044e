"""Straggler detection without a process group: config, the ``slow`` fault, scores from NVRx reports, the policy,
and NVRx's Detector timing sections and reporting in one process (CPU: no CUPTI, no CUDA)."""

import json
import math
import time

import pytest
import torch
from nvidia_resiliency_ext.straggler import Report, Statistic

from trainer.config import ConfigError, ResiliencyConfig, load_config
from trainer.faults import FaultInjector, FaultSpec, parse_faults
from trainer.ledger import Ledger, read
from trainer.resiliency import Layers
from trainer.resiliency import straggler as stragglers
from trainer.resiliency.straggler import RankScore, Streaks, rank_scores


# --- config and the slow fault ----------------------------------------------------------------------------
def test_slow_fault_parses_with_its_factor():
    assert parse_faults(["1:5:slow:0.5", "0:3:exception"]) == [FaultSpec(1, 5, "slow", 0.5), FaultSpec(0, 3, "exception")]


@pytest.mark.parametrize("item, message", [
    ("1:5:slow", "slow needs a factor"),
    ("1:5:slow:fast", "the slow factor must be a number, got 'fast'"),
    ("1:5:slow:0", r"the slow factor must be in \(0, 10\]"),
    ("1:5:slow:11", r"the slow factor must be in \(0, 10\]"),
    ("1:5:exception:2", "must look like rank:step:kind"),
])
def test_bad_slow_fault_says_what_to_change(item, message):
    with pytest.raises(ConfigError, match=message):
        parse_faults([item])


@pytest.mark.parametrize("overrides, message", [
    (["--resiliency.straggler=kill"], r"resiliency.straggler must be one of \['off', 'report', 'evict'\]; got 'kill'"),
    (["--resiliency.straggler_report_every=0"], "resiliency.straggler_report_every must be >= 1"),
    (["--resiliency.straggler_threshold=1.2"], "resiliency.straggler_threshold must be between 0 and 1"),
    (["--resiliency.straggler_threshold=0"], "resiliency.straggler_threshold must be between 0 and 1"),
    (["--resiliency.straggler_patience=0"], "resiliency.straggler_patience must be >= 1"),
    (["--resiliency.straggler_sample_every=3"], r"resiliency.straggler_sample_every must be >= 1 and divide "
                                                r"resiliency.straggler_report_every \(10\); got 3"),
    (["--resiliency.straggler_sample_every=0"], "resiliency.straggler_sample_every must be >= 1"),
])
def test_bad_straggler_config_is_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", ["--data.path=/d", *overrides])


def test_straggler_defaults():
    r = ResiliencyConfig()
    assert (r.straggler, r.straggler_report_every, r.straggler_threshold, r.straggler_patience) == ("report", 100, 0.75, 3)
    assert load_config("tiny", ["--data.path=/d"]).resiliency.straggler_report_every == 10  # CPU steps: the demo


def test_slow_fault_stretches_each_timed_part_from_its_step_once_per_run_dir(tmp_path):
    specs = parse_faults(["0:3:slow:1.0"])
    injector = FaultInjector(specs, tmp_path, rank=0, checkpoint_dir=tmp_path / "ckpt")
    injector.maybe_fire(2)
    assert injector.slowdown == 0.0
    injector.maybe_fire(3)
    assert injector.slowdown == 1.0
    start = time.perf_counter()
    with injector.slowed():
        time.sleep(0.05)
    assert time.perf_counter() - start >= 0.1, "factor 1.0: the part takes twice as long"
    again = FaultInjector(specs, tmp_path, rank=0, checkpoint_dir=tmp_path / "ckpt")  # the relaunch after an eviction
    again.maybe_fire(3)
    assert again.slowdown == 0.0


def test_a_slow_fault_is_never_a_restart_cause(tmp_path):
    ledger = Ledger(tmp_path, rank=0, world_size=2)
    ledger.on_train_start(0, 0)
    ledger.fault("slow", 3)
    for rank in (0, 1):
        Ledger(tmp_path, rank=rank, world_size=2).exit(201, "UNHEALTHY_NODE", "straggler")
    relaunch = Ledger(tmp_path, rank=0, world_size=2)
    relaunch.on_train_start(0, 10)
    (restart,) = [r for r in read(tmp_path / "recovery.jsonl") if r["event"] == "restart"]
    assert restart["layer"] == "cluster" and restart["fault"]["kind"] == "unhealthy_node"


# --- scores from a gathered NVRx report --------------------------------------------------------------------
def report(relative, individual, rank0_medians, gpu=None, hosts=("a", "b", "c")):
    """An NVRx ``Report`` as rank 0 gets it (gather_on_rank0=True)."""
    ranks = range(len(next(iter(relative.values()))))
    gpu = gpu or {r: math.nan for r in ranks}
    return Report(
        gpu_relative_perf_scores=gpu, section_relative_perf_scores=relative,
        gpu_individual_perf_scores=gpu, section_individual_perf_scores=individual,
        rank_to_node={r: hosts[r] for r in ranks},
        local_section_summaries={s: {Statistic.MED: m, Statistic.NUM: 10} for s, m in rank0_medians.items()},
        local_kernel_summaries={}, generate_report_elapsed_time=1.0, gather_on_rank0=True, rank=0)


def test_host_scores_come_from_the_collective_free_sections_weighted_by_time():
    # rank 2 is 2x slower in data and optimizer; forward_backward (collectives) names rank 0, who waited there
    rel = {"data": {0: 1.0, 1: 1.0, 2: 0.5}, "forward_backward": {0: 0.5, 1: 1.0, 2: 1.0},
           "optimizer": {0: 1.0, 1: 0.8, 2: 0.5}}
    ind = {s: {0: 1.0, 1: 1.0, 2: 0.5} for s in rel}
    basis, scores = rank_scores(report(rel, ind, {"data": 1.0, "forward_backward": 200.0, "optimizer": 9.0}),
                                Statistic.MED)
    assert basis == "host"
    by_rank = {s.rank: s for s in scores}
    assert by_rank[0].relative == pytest.approx(1.0)  # not named for waiting in the collectives
    assert by_rank[2].relative == pytest.approx(0.5)
    # rank 1: data 1 ms (fastest), optimizer 9 / 0.8 = 11.25 ms -> (1 + 9) / (1 + 11.25)
    assert by_rank[1].relative == pytest.approx(10 / 12.25)
    assert by_rank[2].individual == pytest.approx(0.5)
    # every rank's medians follow from rank 0's and the relative scores: fb fastest = 0.5 * 200 = 100 ms
    assert by_rank[1].sections["forward_backward"]["median_ms"] == pytest.approx(100.0)
    assert by_rank[2].step_time_s == pytest.approx((2.0 + 100.0 + 18.0) / 1000)
    assert by_rank[2].host == "c"


def test_kernel_scores_decide_where_cupti_measured_them():
    rel = {"optimizer": {0: 1.0, 1: 0.5}}
    basis, scores = rank_scores(report(rel, rel, {"optimizer": 5.0}, gpu={0: 0.97, 1: 1.0}), Statistic.MED)
    assert basis == "kernels" and [s.relative for s in scores] == [0.97, 1.0]


def test_missing_sections_give_no_score_rather_than_a_false_one():
    basis, scores = rank_scores(report({"forward_backward": {0: 1.0, 1: 0.4}}, {}, {"forward_backward": 10.0}),
                                Statistic.MED)
    assert all(math.isnan(s.relative) for s in scores)
    assert Streaks(0.75, 1).update(scores) == []


def score(rank, relative):
    return RankScore(rank, f"h{rank}", relative, 1.0, 0.1)


def test_patience_counts_reports_in_a_row_and_a_good_report_starts_again():
    streaks = Streaks(threshold=0.75, patience=3)
    for expected in (1, 2):
        below = streaks.update([score(0, 1.0), score(1, 0.6)])
        assert [(s.rank, s.streak) for s in below] == [(1, expected)] and streaks.due(below) is None
    streaks.update([score(0, 1.0), score(1, 0.9)])  # one good report: a false alarm so far
    for _ in range(2):
        below = streaks.update([score(0, 1.0), score(1, 0.6)])
    assert streaks.due(below) is None
    below = streaks.update([score(0, 0.7), score(1, 0.6)])
    assert streaks.due(below).rank == 1 and [s.rank for s in below] == [1, 0]  # slowest first


# --- NVRx's Detector in this process ------------------------------------------------------------------------
class Sink:
    def __init__(self):
        self.records = []

    def log(self, record):
        self.records.append(json.loads(json.dumps(record)))


def test_detector_times_sections_and_reports_on_the_report_steps(tmp_path):
    cfg = load_config("tiny", ["--data.path=/d", "--resiliency.straggler_report_every=4", f"--train.run_dir={tmp_path}"])
    sink = Sink()
    layers = Layers.create(cfg, 0, 1, 0, torch.device("cpu"), metrics=sink)
    try:
        assert isinstance(layers.straggler, stragglers.Straggler)
        layers.on_loop_start(0)
        for step in range(1, 21):
            if step == 13:
                layers.on_loop_start(12)  # an in-process restart: a new start-up interval (step 16: discarded)
            for name, seconds in (("data", 0.001), ("forward_backward", 0.004), ("optimizer", 0.002)):
                with layers.section(name):
                    time.sleep(seconds)
            layers.straggler.after_step(step, commit=lambda: pytest.fail("nothing to evict"))
    finally:
        layers.straggler.close()
    assert [r["step"] for r in sink.records] == [8, 12, 20], "steps 4 and 16 close start-up intervals"
    (rank0,) = sink.records[-1]["ranks"]
    assert rank0["relative"] == 1.0 and 0 < rank0["individual"] <= 1.0
    assert set(rank0["sections"]) == {"data", "forward_backward", "optimizer"}
    assert rank0["sections"]["forward_backward"]["median_ms"] >= 4.0
    assert rank0["step_time_s"] >= 0.007 and sink.records[-1]["basis"] == "host"
    ledger = [r for r in read(tmp_path / "recovery.jsonl") if r["event"] == "straggler_report"]
    assert [r["step"] for r in ledger] == [8, 12, 20] and ledger[0]["slowest"][0]["host"] == stragglers.host_label()


def test_detector_times_one_step_in_straggler_sample_every(tmp_path):
    cfg = load_config("tiny", ["--data.path=/d", "--resiliency.straggler_report_every=20",
                               "--resiliency.straggler_sample_every=5", f"--train.run_dir={tmp_path}"])
    sink = Sink()
    layers = Layers.create(cfg, 0, 1, 0, torch.device("cpu"), metrics=sink)
    timed = []
    try:
        layers.on_loop_start(0)
        for step in range(1, 41):
            with layers.section("data"):
                time.sleep(0.05 if step % 5 == 1 else 0.001)  # the steps NVRx times (entries 0, 5, 10, ...) are slow
            timed.append(len(layers.straggler.detector.custom_sections["data"].cpu_elapsed_times))
            layers.straggler.after_step(step, commit=lambda: pytest.fail("nothing to evict"))
    finally:
        layers.straggler.close()
    assert timed[20:24] == [1, 1, 1, 1] and timed[25] == 2, "one entry in 5 is timed"
    (record,) = sink.records  # step 20 closed the start-up interval; step 40 reports steps 21-40
    assert record["step"] == 40
    assert record["ranks"][0]["sections"]["data"]["median_ms"] >= 50.0  # only the timed (slow) entries count


def test_a_cuda_report_waits_for_the_loops_stream_only_not_the_snapshot_copy_on_its_side_stream(tmp_path, monkeypatch):
    cfg = load_config("tiny", ["--data.path=/d", f"--train.run_dir={tmp_path}"])
    layers = Layers.create(cfg, 0, 1, 0, torch.device("cpu"))
    waited = []

    class Stream:
        def synchronize(self):
            waited.append("loop stream")

    def device_wide():  # what NVRx's generate_report calls first: it would wait for the snapshot's copy stream too
        raise AssertionError("torch.cuda.synchronize() waits for every stream of the device")

    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    try:
        layers.straggler.cuda = True  # the report path of a CUDA rank, on this CPU
        with layers.section("data"):
            time.sleep(0.001)
        report = layers.straggler._report()
    finally:
        layers.straggler.close()
    assert waited == ["loop stream"] and report is not None


def test_off_times_nothing(tmp_path):
    cfg = load_config("tiny", ["--data.path=/d", "--resiliency.straggler=off", f"--train.run_dir={tmp_path}"])
    layers = Layers.create(cfg, 0, 1, 0, torch.device("cpu"))
    assert type(layers.straggler) is stragglers.NullStraggler
    with layers.section("data"):
        pass
    layers.straggler.after_step(100, commit=lambda: pytest.fail("off"))


def test_host_label_names_the_node_when_the_downward_api_gives_it(monkeypatch):
    monkeypatch.setenv("NODE_NAME", "gpu-node-17")
    assert stragglers.host_label().endswith("(node gpu-node-17)")
