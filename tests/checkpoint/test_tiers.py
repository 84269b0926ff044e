"""The memory, node-local and persistent tiers in one process (gloo, world size 1); 2-rank runs with faults are in
tests/resiliency/test_recovery.py."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from testlib import REPO, torchrun_probe
from statelib import (  # noqa: F401 - pg
    assert_equal, fail_while_staging, make_state, manager, pg, snapshot, train_step,
)
from trainer.checkpoint import CheckpointError, committed_steps
from trainer.checkpoint.policy import IntervalPolicy, young_daly_steps
from trainer.config import CheckpointConfig


def _newest_slot_files(tmp_path: Path) -> tuple[Path, Path]:
    metas = sorted((tmp_path / "node").rglob("*.meta"), key=lambda p: torch.load(p, weights_only=True)["step"])
    return metas[-1], metas[-1].with_suffix(".data")


def _restart_in_process(mgr) -> None:
    """What an in-process restart does to the manager: the attempt ends, a new process group, bind again."""
    mgr.unbind()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mgr.bind()


def test_respawned_worker_resumes_from_the_node_local_tier(tmp_path, pg, caplog):
    state = make_state()
    mgr = manager(tmp_path, persist_every=0)  # nothing reaches the disk before the end: only the node tier has it
    for step in (1, 2):
        train_step(state, step)
        mgr.save(step, state)
    expected = snapshot(state)
    mgr.close()  # the worker dies: its snapshot files stay on the node
    respawned = manager(tmp_path)
    try:
        restored = make_state(seed=7)
        steps, real_step = [], restored["optimizer"].step
        restored["optimizer"].step = lambda *a, **kw: steps.append(1) or real_step(*a, **kw)
        with caplog.at_level(logging.INFO, logger="trainer.checkpoint"):
            assert respawned.load_latest(restored) == 2
        assert respawned.restored_from == "node-local" and "no checkpoint file read" in caplog.text
        assert steps == []  # the optimizer's state made directly (init_state), not by the state-dict API's step
        assert committed_steps(respawned.dir) == []
        assert_equal(snapshot(restored), expected)
        assert restored["progress"].step == 2 and restored["dataloader"].position == 4
    finally:
        respawned.close(job_over=True)


def test_a_slot_restaged_by_a_respawned_worker_restores_in_process(tmp_path, pg, caplog):
    """A respawned worker restores one node-local snapshot and stages its next snapshot into the other slot, which
    held an older one it never restored: an in-process restart then restores the new snapshot, not the one before it
    (the older snapshot's checksum, read with its header, no longer applies; a two-node run redid a whole interval)."""
    state = make_state()
    mgr = manager(tmp_path, persist_every=0)
    for step in (1, 2):
        train_step(state, step)
        mgr.save(step, state)
    mgr.close()
    respawned = manager(tmp_path)
    try:
        assert respawned.load_latest(state) == 2  # slot of step 2 verified; the slot of step 1 was only discovered
        train_step(state, 3)
        respawned.save(3, state)  # into the slot of step 1
        expected = snapshot(state)
        _restart_in_process(respawned)
        restored = make_state(seed=7)
        with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
            assert respawned.load_latest(restored) == 3, caplog.text
        assert respawned.restored_from == "memory" and "unusable" not in caplog.text
        assert_equal(snapshot(restored), expected)
    finally:
        respawned.close(job_over=True)


def _flip(meta: Path, data: Path) -> None:
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x40
    data.write_bytes(bytes(raw))


def _retag(field: str, value):
    def tamper(meta: Path, data: Path) -> None:
        header = torch.load(meta, weights_only=True)
        header[field] = value
        torch.save(header, meta)
    return tamper


@pytest.mark.parametrize("tamper, why", [
    (_flip, "checksum mismatch"),
    (_retag("job", "0" * 64), "another job"),
    (_retag("world_size", 2), "another world size"),
    (_retag("config_hash", "f" * 64), "another configuration"),
])
def test_stale_or_corrupt_node_snapshot_is_ignored_and_the_disk_is_used(tmp_path, pg, caplog, tamper, why):
    state = make_state()
    mgr = manager(tmp_path)  # every memory checkpoint is also persisted
    for step in (1, 2):
        train_step(state, step)
        mgr.save(step, state)
    mgr.save(2, state, last_step=True)
    expected = snapshot(state)
    mgr.close()
    tamper(*_newest_slot_files(tmp_path))
    respawned = manager(tmp_path)
    try:
        restored = make_state(seed=8)
        with caplog.at_level(logging.INFO, logger="trainer.checkpoint"):
            assert respawned.load_latest(restored) == 2
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(why in w for w in warnings), warnings
        assert respawned.restored_from == "disk"
        assert_equal(snapshot(restored), expected)
    finally:
        respawned.close(job_over=True)


def test_a_fault_while_staging_falls_back_to_the_previous_snapshot(tmp_path, pg, monkeypatch):
    state = make_state()
    mgr = manager(tmp_path, persist_every=0)
    for step in (1, 2):
        train_step(state, step)
        mgr.save(step, state)
    at_step_2 = snapshot(state)
    train_step(state, 3)
    fail_while_staging(monkeypatch, mgr, state, 3)
    _restart_in_process(mgr)
    restored = make_state(seed=2)
    assert mgr.load_latest(restored) == 2 and mgr.restored_from == "memory"
    assert_equal(snapshot(restored), at_step_2)
    mgr.close()  # and a respawned worker falls back to the same snapshot on the node
    respawned = manager(tmp_path)
    try:
        restored = make_state(seed=3)
        assert respawned.load_latest(restored) == 2 and respawned.restored_from == "node-local"
        assert_equal(snapshot(restored), at_step_2)
    finally:
        respawned.close(job_over=True)


def test_nothing_is_left_on_the_node_when_the_job_is_over(tmp_path, pg):
    state = make_state()
    mgr = manager(tmp_path)
    train_step(state, 1)
    mgr.save(1, state, last_step=True)
    assert list((tmp_path / "node").rglob("*.data"))
    mgr.close(job_over=True)
    assert not (tmp_path / "node").exists() or not any((tmp_path / "node").iterdir())
    assert committed_steps(mgr.dir) == [1]  # the persistent tier stays


def test_young_daly_interval():
    assert young_daly_steps(cost_s=0.5, step_s=1.0, mtbf_s=3600) == 60
    assert young_daly_steps(cost_s=0.02, step_s=0.5, mtbf_s=86400) == 118  # sqrt(3456) = 58.8 s of 0.5 s steps
    assert young_daly_steps(cost_s=0.0, step_s=10.0, mtbf_s=1.0) == 1  # never below one step


def test_auto_interval_is_chosen_from_measured_costs_and_recorded(tmp_path, pg, monkeypatch):
    now = {"t": 0.0}
    monkeypatch.setattr("trainer.checkpoint.policy.time.perf_counter", lambda: now["t"])
    state = make_state()
    mgr = manager(tmp_path, interval="auto", mtbf_s=3600.0, persist_every=0)
    events = []
    mgr.event_sink = lambda event, **fields: events.append((event, fields))
    taken = []
    try:
        for step in range(1, 81):  # a step takes 1.0 s; a step with a snapshot 1.5 s (the first one: 10 s)
            if mgr.save(step, state):
                now["t"] += 0.5 if taken else 9.0
                taken.append(step)
            now["t"] += 1.0
        # Probes: the first snapshot's one-time costs are not measured, the third measures the second's cost; then
        # Young/Daly: sqrt(2 * 0.5 s * 3600 s) / 1 s = 60.
        assert taken == [5, 10, 15, 75]
        assert events == [("checkpoint_interval", {"steps": 60, "cost_s": 0.5, "step_s": 1.0, "mtbf_s": 3600.0,
                                                   "basis": "checkpoint.mtbf_s"})]
    finally:
        mgr.close(job_over=True)


def test_auto_interval_without_mtbf_uses_the_failure_model_at_the_jobs_size(tmp_path, pg, monkeypatch):
    """``checkpoint.mtbf_s = 0`` (the default): Young/Daly with the MTBF of ``checkpoint.failure_model`` at the job's
    world size (Llama 3's 419 interruptions in 54 days on 16,384 GPUs: one GPU's MTBF is 16,384 x 54 x 24 / 419
    hours), and the ledger record says so."""
    now = {"t": 0.0}
    monkeypatch.setattr("trainer.checkpoint.policy.time.perf_counter", lambda: now["t"])
    state = make_state()
    mgr = manager(tmp_path, interval="auto", persist_every=0)
    assert CheckpointConfig().mtbf_s == 0 and CheckpointConfig().failure_model == "llama3"
    events = []
    mgr.event_sink = lambda event, **fields: events.append((event, fields))
    taken = []
    try:
        for step in range(1, 21):
            if mgr.save(step, state):
                now["t"] += 0.5 if taken else 9.0
                taken.append(step)
            now["t"] += 1.0
        mtbf_s = 16384 * 54 * 24 / 419 * 3600  # one GPU: the world size of this test
        assert events == [("checkpoint_interval", {"steps": round(math.sqrt(2 * 0.5 * mtbf_s)), "cost_s": 0.5,
                                                   "step_s": 1.0, "mtbf_s": round(mtbf_s, 1),
                                                   "basis": "failure model llama3 at 1 GPU(s)"})]
    finally:
        mgr.close(job_over=True)


def test_interval_policy_fixed():
    policy = IntervalPolicy(4, 1.0)
    assert [s for s in range(1, 13) if policy.due(s)] == [4, 8, 12]
    assert not any(IntervalPolicy(0, 1.0).due(s) for s in range(1, 10))


def test_checksum_computed_from_the_staged_tensors_equals_the_slot_checksum():
    """CUDA computes a snapshot's checksum from its tensors on the copy stream; a respawned worker checks it
    against the slot's bytes: both must agree for every dtype, odd byte counts, scalars and empty tensors."""
    from trainer.checkpoint.layout import Piece
    from trainer.checkpoint.slots import checksum, device_checksum, map_views, plan_layout

    tensors = [torch.randn(5, 3), torch.randn(7).to(torch.bfloat16), torch.tensor(3.0),
               torch.randint(-100, 100, (9,), dtype=torch.int64), torch.randn(0, 4), torch.randn(3).half()]
    pieces = {f"t{i}": Piece(tuple(t.shape), (0,) * t.ndim, tuple(t.shape), t.dtype, False) for i, t in enumerate(tensors)}
    layout, nbytes = plan_layout(pieces)
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    for key, view in map_views(buffer, layout).items():
        view.copy_(tensors[int(key[1:])])
    assert checksum(buffer) == int(device_checksum(tensors))
    buffer[layout["t1"][1]] ^= 1  # one flipped bit
    assert checksum(buffer) != int(device_checksum(tensors))


def test_slots_are_reserved_in_the_background_after_the_first_step_before_the_first_save(tmp_path, pg, caplog):
    """Nothing is reserved (on CUDA: page-locked, which holds the driver) during the restore and the first step;
    the reservation starts at the first save() call, the end of the first step, and the first snapshot reuses it."""
    state = make_state()
    mgr = manager(tmp_path, interval=2)
    try:
        with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
            mgr.load_latest(state)
            assert not mgr.reservation.threads and all(slot.buffer is None for slot in mgr.snapshots.slots)
            train_step(state, 1)
            assert not mgr.save(1, state)  # not due: it only starts the reservation
            mgr.reservation.join()
        assert "not prepared" not in caplog.text
        assert all(slot.buffer is not None and slot.ready.is_set() for slot in mgr.snapshots.slots)
        sizes = [slot.buffer.numel() for slot in mgr.snapshots.slots]
        train_step(state, 2)
        assert mgr.save(2, state)
        assert [slot.buffer.numel() for slot in mgr.snapshots.slots] == sizes  # the first save reuses them
    finally:
        mgr.close(job_over=True)


@pytest.mark.multiprocess
def test_a_snapshot_only_some_ranks_hold_is_forgotten_after_the_restore(tmp_path):
    """Rank 0 kept a node-local snapshot of step 8 that rank 1 lost; both resume from step 4 and save step 8 again
    together (before the fix rank 0 skipped the save's collective and both hung until the coordination timeout)."""
    out = torchrun_probe(REPO / "tests" / "checkpoint" / "diverged_snapshots.py", tmp_path,
                         "the ranks hung in the save of step 8 after the restore")
    for rank in (0, 1):
        result = (tmp_path / f"rank{rank}.result").read_text()
        assert result.startswith("held after restore [4]; saved step 8 on both ranks"), out
        assert result.endswith("held now [4, 8]"), out


def test_a_warm_up_step_while_the_snapshot_is_copied_in_changes_nothing(tmp_path, pg):
    """On GPU a respawned worker runs a discarded forward and backward while its node-local snapshot is copied in
    (resiliency.restore_warmup); here the same step on CPU: training then continues bit-identically."""
    from statelib import SEQ
    from trainer.train import warm_up_step

    state = make_state()
    mgr = manager(tmp_path, persist_every=0)
    for step in (1, 2):
        train_step(state, step)
        mgr.save(step, state)
    mgr.close()  # the worker dies; its snapshot of step 2 stays on the node
    continued = []
    for warm in (False, True):
        respawned = manager(tmp_path)
        try:
            restored = make_state(seed=7)
            calls = []
            hook = (lambda: calls.append(warm_up_step(restored["model"], 2, SEQ, torch.device("cpu")))) if warm else None
            assert respawned.load_latest(restored, while_copying=hook) == 2
            assert respawned.restored_from == "node-local" and len(calls) == int(warm)
            assert all(p.grad is None for p in restored["model"].parameters())
            torch.manual_seed(123)
            train_step(restored, 3)
            continued.append(snapshot(restored))
        finally:
            respawned.close()
    assert_equal(continued[0], continued[1])


def test_auto_interval_counts_a_snapshots_cost_over_the_steps_after_it(monkeypatch):
    """On a GPU a snapshot's cost lands on the steps after it (the staging copies beside the next step, the drain
    beside the ones after): the cost Young/Daly uses is their extra time over ``AUTO_COST_WINDOW`` steps, not the
    first step's alone (0.2 s here, which would choose 38 steps instead of 60)."""
    from trainer.checkpoint import policy as policy_module

    now = {"t": 0.0}
    monkeypatch.setattr(policy_module.time, "perf_counter", lambda: now["t"])
    policy = IntervalPolicy("auto", 3600.0)
    extra = {1: 0.2, 2: 0.2, 3: 0.1}  # seconds over a 1 s step, by steps after a snapshot; 9 s after the first one
    taken, chosen, since = [], [], None
    for step in range(1, 120):
        now["t"] += 1.0 + (0.0 if since is None else (9.0 if len(taken) == 1 and since == 1 else extra.get(since, 0.0)))
        policy.tick()
        since = None if since is None else since + 1
        if policy.due(step):
            step_s, cost_s = policy.measurements()
            interval = policy.snapshot_taken(step, step_s, cost_s)
            taken.append(step)
            chosen += [interval] if interval else []
            since = 0
    assert policy.measurements() == (1.0, pytest.approx(0.5))
    assert chosen == [60] and taken[:3] == [5, 10, 15] and taken[3] == 75


def _tampered_snapshots_only(root: Path, tamper) -> Any:
    """Snapshots of steps 1 and 2 on the node, nothing on disk, every header and file passed through ``tamper``; the
    manager of a worker respawned there."""
    state, mgr = make_state(), manager(root, persist_every=0)
    for step in (1, 2):
        train_step(state, step)
        mgr.save(step, state)
    mgr.close()
    for meta in (root / "node").rglob("*.meta"):
        tamper(meta, meta.with_suffix(".data"))
    return manager(root, persist_every=0)


def test_a_snapshot_refused_after_it_was_copied_in_leaves_a_fresh_state_when_no_other_step_is_left(tmp_path, pg,
                                                                                                     caplog):
    """Every snapshot fails its check while it is copied in (a flipped bit), and the disk holds nothing: the
    restore returns None, and the state it half overwrote is built afresh, its RNG as before the restore. (Before,
    the rank trained on from a mix of the refused step and the fresh weights; on three nodes the ranks whose copy
    verified went on from that step while the refused one started from 0: "ranks saved different steps".)"""
    fresh_weights = snapshot(make_state(seed=8))
    for fresh in (lambda: make_state(seed=8), None):
        respawned = _tampered_snapshots_only(tmp_path / ("fresh" if fresh else "none"), _flip)
        try:
            restored = make_state(seed=8)
            torch.manual_seed(5)
            rng = torch.get_rng_state()
            if fresh is None:  # nothing to build a fresh state with: one clear error, not a mixed state
                with pytest.raises(CheckpointError, match="partly copied"):
                    respawned.load_latest(restored)
                continue
            with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
                assert respawned.load_latest(restored, fresh=fresh) is None
            assert "checksum mismatch" in caplog.text and "starts over from step 0" in caplog.text
            assert_equal(snapshot(restored), fresh_weights)
            assert restored["progress"].step == 0 and restored["dataloader"].position == 0
            assert torch.equal(torch.get_rng_state(), rng) and respawned.restored_from is None
        finally:
            respawned.close(job_over=True)


def test_a_fresh_start_after_refused_snapshots_has_a_fresh_optimizer(tmp_path, pg):
    """Snapshots of another world size (a job that shrank) and nothing on disk: training starts fresh, and its
    optimizer has no state yet. The restore's look at the state (the state-dict API initialises an empty optimizer's
    state with a zero-gradient step at lr 0) must not leave AdamW a step count of 1: the first real step would take
    the second step's bias correction (an elastic run's fresh start once diverged from the fault-free run at step 2)."""
    respawned = _tampered_snapshots_only(tmp_path, _retag("world_size", 2))
    try:
        restored, reference = make_state(seed=8), make_state(seed=8)
        assert respawned.load_latest(restored) is None
        assert not restored["optimizer"].state
        train_step(restored, 1)
        train_step(reference, 1)
        assert_equal(snapshot(restored), snapshot(reference))
    finally:
        respawned.close(job_over=True)


@pytest.mark.multiprocess
def test_a_step_one_rank_restored_and_another_refused_is_given_up_by_both(tmp_path):
    """Rank 0's snapshots verify, rank 1's fail their check, and the disk holds nothing: both start over from a
    fresh state, rank 0 included, though it had copied a whole step in."""
    out = torchrun_probe(REPO / "tests" / "checkpoint" / "refused_on_one_rank.py", tmp_path,
                         "the ranks hung in the restore")
    for rank in (0, 1):
        result = (tmp_path / f"rank{rank}.result").read_text()
        assert result == "restored None; step 0; position 0; state fresh; overwrote True", f"rank {rank}: {result}\n{out}"
