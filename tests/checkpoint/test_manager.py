"""CheckpointManager in one process (gloo, world size 1): async snapshot semantics, integrity fallback, disk full,
in-memory restore, warm start, writer shutdown. Multi-rank behaviour is in test_resume.py."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from statelib import (  # noqa: F401 - pg
    assert_equal, disk_only, make_state, manager, pg, save_two_steps, snapshot, train_step,
)
from trainer.checkpoint import (
    FAULT_ENV, MANIFEST, CheckpointError, CheckpointStorageError, committed_steps, copy_overlap, load_model_weights,
    step_dir_name,
)
from trainer.exitcodes import ExitCode


def test_async_save_returns_before_the_write_and_snapshots_the_state(tmp_path, pg, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "slow_write:2")
    state = make_state()
    train_step(state, 1)
    mgr = manager(tmp_path, interval=2)
    try:
        assert mgr.blocking_figures() is None
        before = snapshot(state)
        assert mgr.save(2, state) is True
        # save() returned while the writer is still inside the file: nothing committed, but the snapshot already
        # counts in the memory tier.
        assert committed_steps(mgr.dir) == [] and mgr.writer.busy
        assert mgr.latest_in_memory().step == 2
        train_step(state, 3)  # training goes on and mutates params, moments and the CPU Adam ``step`` tensors
        assert not torch.equal(snapshot(state)["optim/0/step"], before["optim/0/step"])
        while committed_steps(mgr.dir) != [2]:  # not due: each call polls the writer, commits once it finished
            assert mgr.save(3, state) is False
            time.sleep(0.1)
        assert mgr.blocking_figures()["count"] == 1
        mgr.save(4, state, last_step=True)
        assert committed_steps(mgr.dir) == [2, 4]
        figures = mgr.blocking_figures()  # the run's summary.json carries them: the host time each checkpoint took
        assert figures["count"] == 2 and 0 < figures["median_s"] <= figures["p90_s"] <= figures["max_s"]
        assert figures["max_s"] == round(max(mgr.blocking_s), 4)
        fresh = make_state(seed=1)
        mgr2 = manager(tmp_path, node_local=False)  # a new manager on a new node: reads the disk
        try:
            shutil.rmtree(mgr.dir / step_dir_name(4))
            assert mgr2.load_latest(fresh) == 2
            assert_equal(snapshot(fresh), before)  # the state at save time, not the mutated one (NVRx #376)
        finally:
            mgr2.close()
    finally:
        mgr.close()


def test_sync_and_in_memory_restore_are_bit_identical(tmp_path, pg, caplog):
    state = make_state()
    train_step(state, 1)
    mgr = manager(tmp_path, async_save=False)
    try:
        mgr.save(1, state)
        expected = snapshot(state)
        mem = mgr.latest_in_memory()
        assert mem is not None and mem.step == 1
        restored = make_state(seed=5)
        with caplog.at_level(logging.INFO, logger="trainer.checkpoint"):
            assert mgr.load_latest(restored) == 1
        assert "from the memory tier" in caplog.text and mgr.restored_from == "memory"
        assert_equal(snapshot(restored), expected)
        assert restored["progress"].step == 1 and restored["dataloader"].position == 2
        from_disk = make_state(seed=6)
        disk_only(mgr)
        assert mgr.load_latest(from_disk) == 1
        assert_equal(snapshot(from_disk), expected)
    finally:
        mgr.close()


def _flip_bytes(step_dir: Path) -> None:
    shard = step_dir / "shard-00000-of-00001.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _truncate(step_dir: Path) -> None:
    shard = step_dir / "shard-00000-of-00001.pt"
    shard.write_bytes(shard.read_bytes()[:1000])


def _drop_manifest(step_dir: Path) -> None:
    (step_dir / MANIFEST).unlink()


@pytest.mark.parametrize(
    "corrupt, reason",
    [(_flip_bytes, "checksum-mismatch"), (_truncate, "size-mismatch"), (_drop_manifest, "missing-manifest")],
)
def test_corrupt_newest_falls_back_to_previous(tmp_path, pg, caplog, corrupt, reason):
    state = make_state()
    mgr = manager(tmp_path, async_save=False)
    try:
        step1 = save_two_steps(mgr, state)
        corrupt(mgr.dir / step_dir_name(2))
        disk_only(mgr)
        restored = make_state(seed=3)
        with caplog.at_level(logging.INFO, logger="trainer.checkpoint"):
            assert mgr.load_latest(restored) == 1
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors and "step-00000002" in errors[0].getMessage() and reason in errors[0].getMessage()
        assert (mgr.dir / f"step-00000002.corrupt-{reason}").is_dir()  # kept for inspection
        assert_equal(snapshot(restored), step1)
        assert load_model_weights(mgr.dir).keys() == {k[len("model/"):] for k in step1 if k.startswith("model/")}
    finally:
        mgr.close()


def test_no_valid_checkpoint_is_a_clear_permanent_error(tmp_path, pg):
    state = make_state()
    mgr = manager(tmp_path, async_save=False)
    try:
        for step in (1, 2):
            train_step(state, step)
            mgr.save(step, state)
            _flip_bytes(mgr.dir / step_dir_name(step))
        disk_only(mgr)
        with pytest.raises(CheckpointError, match=r"no valid checkpoint in .*ckpt.*step-00000002 \(checksum-mismatch\)") as err:
            mgr.load_latest(make_state())
        assert err.value.exit_code == ExitCode.CHECKPOINT_ERROR
        with pytest.raises(CheckpointError, match=r"no committed checkpoint .*corrupt-checksum-mismatch.*quarantined"):
            load_model_weights(mgr.dir)  # evaluation: one line that names what is there
    finally:
        mgr.close()


@pytest.mark.parametrize("async_save", [True, False])
def test_disk_full_is_reported_and_loses_no_checkpoint(tmp_path, pg, monkeypatch, async_save):
    state = make_state()
    mgr = manager(tmp_path, async_save=async_save)
    try:
        train_step(state, 1)
        mgr.save(1, state, last_step=True)
        monkeypatch.setenv(FAULT_ENV, "enospc")
        train_step(state, 2)
        with pytest.raises(CheckpointStorageError, match="disk full") as err:
            mgr.save(2, state, last_step=True)
        assert str(mgr.dir) in str(err.value) and "step-00000001" in str(err.value)
        assert committed_steps(mgr.dir) == [1]
        assert not (mgr.dir / "step-00000002.tmp").exists()
        assert load_model_weights(mgr.dir).keys()
    finally:
        mgr.close()


def test_close_terminates_the_writer_and_is_idempotent(tmp_path, pg):
    state = make_state()
    mgr = manager(tmp_path)
    train_step(state, 1)
    mgr.save(1, state, last_step=True)
    process = mgr.writer._queue.persistent_caller.process
    assert process.is_alive()
    mgr.close()
    mgr.close()
    assert not process.is_alive() and process.exitcode == 0


def test_in_process_restart_never_waits_for_the_disk(tmp_path, pg, monkeypatch, caplog):
    monkeypatch.setenv(FAULT_ENV, "slow_write:3")
    state = make_state()
    mgr = manager(tmp_path)
    try:
        train_step(state, 1)
        mgr.save(1, state)
        expected = snapshot(state)
        mgr.unbind()  # a fault ends the attempt while the write is in flight; no collective
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        mgr.bind()
        restored = make_state(seed=4)
        with caplog.at_level(logging.INFO, logger="trainer.checkpoint"):
            assert mgr.load_latest(restored) == 1
        # Restored from host memory while the write still runs: nothing was committed or read yet.
        assert mgr.restored_from == "memory" and mgr.writer.busy and committed_steps(mgr.dir) == []
        assert_equal(snapshot(restored), expected)
        train_step(restored, 2)
        with caplog.at_level(logging.INFO, logger="trainer.checkpoint"):
            mgr.save(2, restored, last_step=True)  # the final save supersedes step 1's write (still stalled)
        assert "the write of step 1 is cancelled" in caplog.text
        assert committed_steps(mgr.dir) == [2] and not list(mgr.dir.glob("*.tmp"))
    finally:
        mgr.close()


def test_the_final_save_keeps_the_liveness_signals_going_while_a_stuck_write_stops(tmp_path, pg, monkeypatch):
    """A write blocked in the kernel (a slow disk's write or fsync) stops only when that call returns: while the final
    save waits for it, the loop's liveness signals go on (a preemption's final save must not look like a hang). Step
    1's write stalls 8 s (the final save comes well within it); the final one is not slowed."""
    monkeypatch.setenv(FAULT_ENV, "slow_write:8@1")
    state = make_state()
    mgr = manager(tmp_path)
    beats = []
    mgr.keepalive = lambda: beats.append(time.monotonic())
    try:
        train_step(state, 1)
        mgr.save(1, state)
        poll, stops_at = mgr.writer.poll, time.monotonic() + 2.5
        monkeypatch.setattr(mgr.writer, "poll",  # the writer sees the cancel only 2.5 s from now
                            lambda blocking: None if time.monotonic() < stops_at else poll(blocking))
        train_step(state, 2)
        mgr.save(2, state, last_step=True)
        assert committed_steps(mgr.dir) == [2]
        assert len(beats) >= 2, f"liveness signals while the cancelled write stopped: {beats}"
    finally:
        mgr.close()


def test_the_final_save_can_let_an_older_write_commit_first(tmp_path, pg, monkeypatch, caplog):
    """``checkpoint.final_cancels_older_write=false``: the write of step 1, still in flight at the final save, is
    committed (not cancelled) before the final checkpoint is written: both steps are on disk."""
    monkeypatch.setenv(FAULT_ENV, "slow_write:1@1")
    state = make_state()
    mgr = manager(tmp_path, final_cancels_older_write=False)
    try:
        train_step(state, 1)
        mgr.save(1, state)
        train_step(state, 2)
        assert mgr.writer.busy, "step 1's write finished too early to test anything"
        with caplog.at_level(logging.INFO, logger="trainer.checkpoint"):
            mgr.save(2, state, last_step=True)
        assert "cancelled" not in caplog.text
        assert committed_steps(mgr.dir) == [1, 2]
    finally:
        mgr.close()


def test_warm_start_loads_only_model_weights(tmp_path, pg):
    source = make_state()
    src_mgr = manager(tmp_path / "src", async_save=False)
    try:
        train_step(source, 1)
        src_mgr.save(1, source)
    finally:
        src_mgr.close()
    mgr = manager(tmp_path / "dst", init_from=str(tmp_path / "src" / "ckpt"))
    try:
        target = make_state(seed=9)
        assert mgr.load_latest(target) is None
        got, want = snapshot(target), snapshot(source)
        assert_equal({k: v for k, v in got.items() if k.startswith("model/")},
                     {k: v for k, v in want.items() if k.startswith("model/")})
        assert target["progress"].step == 0 and not target["optimizer"].state
    finally:
        mgr.close()


def test_uneven_chunks_reassemble_on_any_world_size():
    """FSDP2's Shard(0) is torch.chunk-style (last chunk shorter, possibly empty): 5 rows over 3 and 4 ranks."""
    full = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    for n_src, n_dst in ((3, 2), (4, 1), (2, 4)):
        src = list(torch.chunk(full, n_src))
        offsets = [sum(c.shape[0] for c in src[:i]) for i in range(len(src))]
        dst_chunks = list(torch.chunk(torch.empty_like(full), n_dst))
        dst_offsets = [sum(c.shape[0] for c in dst_chunks[:i]) for i in range(len(dst_chunks))]
        for dst, d_off in zip(dst_chunks, dst_offsets):
            covered = sum(copy_overlap(dst, (d_off, 0), s, (o, 0), tuple(s.shape)) for s, o in zip(src, offsets))
            assert covered == dst.numel()
        assert torch.equal(torch.cat(dst_chunks), full)


def test_a_killed_writer_process_is_not_a_storage_error(tmp_path, pg, monkeypatch, caplog):
    """The OOM killer, or a preemption's SIGTERM to the whole process group while the writer is still starting:
    the shard is written again in the trainer process and the checkpoint commits."""
    monkeypatch.setenv(FAULT_ENV, "slow_write:5")
    state = make_state()
    mgr = manager(tmp_path)
    try:
        train_step(state, 1)
        mgr.save(1, state)
        mgr.writer._queue.persistent_caller.process.kill()
        train_step(state, 2)
        mgr.save(2, state, last_step=True)
        assert committed_steps(mgr.dir) == [1, 2]
        assert "writing step 1's shard again in this process" in caplog.text
        assert load_model_weights(mgr.dir, step=1).keys()
    finally:
        mgr.close(job_over=True)


@pytest.mark.parametrize("hung", [False, True])
def test_a_blocking_save_keeps_the_rank_alive_while_the_disk_writes_within_its_budget(tmp_path, pg, monkeypatch,
                                                                                      caplog, hung):
    """The final save waits 3 s on the disk (a slow fsync). The loop's liveness signals go on meanwhile, or the
    in-job layer would take a slow disk for a hung rank and restart it into the same wait; past the write's budget
    (30 s + the shard at checkpoint.min_write_mbps; here cut to nothing) they stop, so a hung disk is still found."""
    from trainer.checkpoint import persistent as persistent_module

    monkeypatch.setenv(FAULT_ENV, "slow_write:3")
    if hung:
        monkeypatch.setattr(persistent_module, "_WRITE_GRACE_S", 0.0)
    state = make_state()
    train_step(state, 1)
    mgr = manager(tmp_path, interval=5, min_write_mbps=1e9 if hung else 20.0)
    beats: list[float] = []
    mgr.keepalive = lambda: beats.append(time.monotonic())
    try:
        with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
            assert mgr.save(1, state, last_step=True)
        assert committed_steps(mgr.dir) == [1]
        if hung:
            assert len(beats) <= 1 and "the liveness signals stop" in caplog.text
        else:
            assert len(beats) >= 2 and max(b - a for a, b in zip(beats, beats[1:])) < 1.5
            assert "liveness" not in caplog.text
    finally:
        mgr.close()


def test_the_writer_process_starts_after_the_first_step_and_is_ready_for_the_first_write(tmp_path, pg):
    """Spawning the writer (it imports torch) is neither on the path to the first step nor on the first write's: it
    starts at the end of the first step, protected from a preemption's SIGTERM from then on, and stops cleanly."""
    import os
    import signal

    state = make_state()
    mgr = manager(tmp_path, interval=2)
    try:
        mgr.load_latest(state)
        assert mgr.writer._queue is None
        train_step(state, 1)
        assert not mgr.save(1, state)  # not due: starts the writer
        process = mgr.writer._queue.persistent_caller.process
        assert process.is_alive()
        deadline = time.monotonic() + 60
        while mgr.writer._queue.persistent_caller.comp_q.empty() and time.monotonic() < deadline:
            time.sleep(0.1)  # the start request ran: the writer is ready
        os.kill(process.pid, signal.SIGTERM)  # ft_launcher signals the whole process group on preemption
        train_step(state, 2)
        assert mgr.save(2, state, force=True)
        assert committed_steps(mgr.dir) == [2] and process.is_alive(), "written by the pre-started writer"
    finally:
        mgr.close(job_over=True)
    assert not process.is_alive(), "stopped with the manager"


@pytest.mark.timeout(60)
def test_a_writer_that_could_not_start_stops_without_an_error_of_its_own(pg, monkeypatch):
    """Spawning the writer process failed (the system's process or memory limit): that error reaches the caller,
    and stopping the writer afterwards neither raises about a process that never ran nor hangs (it did: NVRx's
    caller then waits forever on the queue of a worker that does not exist)."""
    import errno
    import multiprocessing.context

    from trainer.checkpoint.writer import Writer

    def refuse(self):
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", refuse)
    writer = Writer()
    with pytest.raises(OSError, match="Resource temporarily unavailable"):
        writer.start()
    writer.stop(graceful=True)
    writer.stop(graceful=False)
    assert writer._queue is None


def test_the_write_fault_hook_takes_a_step_of_its_own_before_one_for_every_step(monkeypatch):
    from trainer.checkpoint.writer import test_fault as write_fault

    monkeypatch.setenv(FAULT_ENV, "slow_write:3,slow_write:8@10,enospc@4")
    assert [write_fault(step) for step in (2, 4, 10)] == ["slow_write:3", "enospc", "slow_write:8"]
    monkeypatch.setenv(FAULT_ENV, "slow_write:1@1")
    assert [write_fault(step) for step in (1, 2)] == ["slow_write:1", ""]
    monkeypatch.delenv(FAULT_ENV)
    assert write_fault(1) == ""
