"""Rank 0 writes TensorBoard event files next to metrics.jsonl: the step scalars and the recovery events."""

from __future__ import annotations

import builtins
import json
import logging
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer import metrics
from trainer.metrics import MetricsLogger, NullTensorBoard


def step(n: int, loss: float) -> dict:
    return {"event": "step", "step": n, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "step_time_s": 0.1,
            "tokens_per_s": 1000.0, "mfu": None}


def ledger(run_dir: Path, *records: dict) -> None:
    with open(run_dir / "recovery.jsonl", "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def events(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)]


def test_scalars_and_recovery_events_land_next_to_metrics_jsonl(tmp_path):
    ledger(tmp_path, {"event": "start", "rank": 0})  # before this process: not replayed
    logger = MetricsLogger(tmp_path, enabled=True, echo=False)
    logger.log(step(1, 5.0))
    ledger(tmp_path, {"event": "fault", "kind": "sigkill", "step": 2, "rank": 1},
           {"event": "restart", "layer": "injob", "resumed_step": 1, "rank": 1, "fault": None},
           {"event": "restart", "layer": "injob", "resumed_step": 1, "rank": 0, "fault": {"kind": "sigkill"}})
    with open(tmp_path / "recovery.jsonl", "a") as f:
        f.write('{"event": "recovered", "layer": "injob", "st')  # torn: still being written
    logger.log(step(2, 4.0))
    with open(tmp_path / "recovery.jsonl", "a") as f:
        f.write('ep": 2, "recovery_s": 12.5, "steps_redone": 0, "rank": 0}\n')
    logger.log({"event": "summary", "steps": 2, "final_loss": 4.0, "wall_time_s": 30.0})
    logger.close()

    assert (tmp_path / "metrics.jsonl").is_file()
    assert list(tmp_path.glob("events.out.tfevents.*")), "no event file next to metrics.jsonl"
    acc = events(tmp_path)
    assert scalars(acc, "train/loss") == [(1, 5.0), (2, 4.0)]
    assert scalars(acc, "train/tokens_per_s") == [(1, 1000.0), (2, 1000.0)]
    assert "train/mfu" not in acc.Tags()["scalars"]  # None on CPU: not drawn
    assert scalars(acc, "recovery/fault_sigkill") == [(2, 1.0)]
    assert scalars(acc, "recovery/restart_injob") == [(1, 1.0)]  # rank 0's record only
    assert scalars(acc, "recovery/recovery_s") == [(2, 12.5)]
    assert scalars(acc, "summary/final_loss") == [(2, 4.0)]
    texts = [t.tensor_proto.string_val[0].decode() for t in acc.Tensors("recovery/events/text_summary")]
    assert any("fault sigkill on rank 1 at step 2" in t for t in texts)
    assert any("injob restart after sigkill, resumed at step 1" in t for t in texts)


def test_other_ranks_write_no_event_files(tmp_path):
    logger = MetricsLogger(tmp_path, enabled=False)
    logger.log(step(1, 5.0))
    logger.close()
    assert not list(tmp_path.iterdir())


def test_without_tensorboard_the_writer_is_a_null_object_with_one_log_line(tmp_path, monkeypatch, caplog):
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("TensorBoard logging requires TensorBoard version 1.15 or above")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with caplog.at_level(logging.WARNING, logger=metrics.__name__):
        logger = MetricsLogger(tmp_path, enabled=True, echo=False)
        assert isinstance(logger._tensorboard.opened(), NullTensorBoard)  # opened in the background
    assert len(caplog.records) == 1 and "pip install tensorboard" in caplog.records[0].getMessage()
    logger.log(step(1, 5.0))
    logger.close()
    assert not list(tmp_path.glob("events.out.tfevents.*"))
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 5.0


@pytest.mark.parametrize("enabled", [True, False])
def test_null_object_when_not_rank_zero(tmp_path, enabled):
    writer = metrics.tensorboard_events(tmp_path, enabled)
    assert isinstance(writer, NullTensorBoard) is (not enabled)
    writer.close()


def test_restarts_leave_one_point_per_step(tmp_path):
    """An in-process restart (same writer) and an in-job restart (a new process) redo steps: TensorBoard shows
    each step once, from the attempt that ran it last, and keeps the faults the redone stretch held."""
    first = MetricsLogger(tmp_path, enabled=True, echo=False)
    first.log({"event": "start", "world_size": 2})
    for n in range(1, 15):
        first.log(step(n, 10.0 - n * 0.1))
    ledger(tmp_path, {"event": "fault", "kind": "exception", "step": 15, "rank": 0})
    first.log({"event": "resume", "step": 10})  # in-process: restored step 10 in the same process
    for n in range(11, 21):
        first.log(step(n, 9.0 - n * 0.1))
    ledger(tmp_path, {"event": "fault", "kind": "sigkill", "step": 21, "rank": 1})
    first.close()  # the process is killed; ft_launcher starts a new one
    second = MetricsLogger(tmp_path, enabled=True, echo=False)
    second.log({"event": "resume", "step": 18})
    for n in range(19, 23):
        second.log(step(n, 8.0 - n * 0.1))
    second.log({"event": "summary", "steps": 22, "final_loss": 5.8, "wall_time_s": 3.0})
    second.close()

    acc = events(tmp_path)
    loss = scalars(acc, "train/loss")
    assert [s for s, _ in loss] == list(range(1, 23)), loss
    assert dict(loss)[12] == round(9.0 - 1.2, 6) and dict(loss)[20] == round(8.0 - 2.0, 6)  # the last attempt's
    assert scalars(acc, "recovery/fault_exception") == [(15, 1.0)]
    assert scalars(acc, "recovery/fault_sigkill") == [(21, 1.0)]


def test_straggler_reports_draw_each_ranks_scores_and_one_console_line(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, enabled=True, echo=True)
    ranks = [{"rank": 0, "host": "a", "relative": 1.0, "individual": 0.99, "step_time_s": 0.3},
             {"rank": 1, "host": "b", "relative": 0.6, "individual": 0.58, "step_time_s": 0.45}]
    logger.log({"event": "straggler", "step": 20, "basis": "host", "threshold": 0.75, "stragglers": [1], "ranks": ranks})
    ledger(tmp_path, {"event": "straggler_evicted", "step": 30, "rank": 1, "host": "b", "reports": 3, "threshold": 0.75})
    logger.log({"event": "summary", "steps": 30, "final_loss": 4.0, "wall_time_s": 30.0})
    logger.close()
    acc = events(tmp_path)
    assert scalars(acc, "straggler/relative/rank1") == [(20, 0.6)]
    assert scalars(acc, "straggler/individual/rank0") == [(20, 0.99)]
    assert scalars(acc, "straggler/step_time_s/rank1") == [(20, 0.45)]
    out = capsys.readouterr().out
    assert "straggler report step 20 (host): slowest relative rank 1 (b) 0.60, rank 0 (a) 1.00; below 0.75: [1]" in out
    assert '"ranks"' not in out  # not the whole record


def test_tensorboard_opens_in_the_background_and_keeps_what_was_logged_meanwhile(tmp_path, monkeypatch):
    """Importing tensorboard is off the path to the first step: the logger returns at once, and records logged
    before the writer is open reach it in order."""
    import threading

    release = threading.Event()
    real = metrics.tensorboard_events

    def slow_open(*args):
        release.wait(10)
        return real(*args)

    monkeypatch.setattr(metrics, "tensorboard_events", slow_open)
    logger = MetricsLogger(tmp_path, enabled=True, echo=False)  # returns while the writer is still opening
    logger.log(step(1, 5.0))
    logger.log(step(2, 4.0))
    assert not list(tmp_path.glob("events.out.tfevents.*"))
    release.set()
    logger.log(step(3, 3.0))
    logger.close()
    assert scalars(events(tmp_path), "train/loss") == [(1, 5.0), (2, 4.0), (3, 3.0)]
