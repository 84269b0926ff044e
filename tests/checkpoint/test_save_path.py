"""The save path against a slow persistent tier, in one process (gloo, world size 1): memory checkpoints never skip
while a write is in flight, the persistent tier's lag is reported once per episode, and the final save writes the
state once. 2-rank runs: slow_disk_ranks.py."""

from __future__ import annotations

import logging
import re
import time

import pytest
import torch.distributed as dist

from statelib import assert_equal, make_state, manager, pg, snapshot, train_step  # noqa: F401 - pg
from testlib import REPO, torchrun_probe
from trainer.checkpoint import FAULT_ENV, committed_steps, load_model_weights
from trainer.checkpoint.slots import Slot, SnapshotStore


def _store(tmp_path, steps_and_locks) -> SnapshotStore:
    store = SnapshotStore(tmp_path, 0, len(steps_and_locks), "job", "{}", node_local=False)
    for slot, (step, locked) in zip(store.slots, steps_and_locks):
        slot.step, slot.locked = step, locked
    return store


def test_the_newest_snapshot_is_restaged_only_when_a_locked_one_keeps_an_older_snapshot(tmp_path):
    # The older slot is being written to disk: restage the newest; the written one stays valid to fall back to.
    assert _store(tmp_path, [(10, True), (20, False)]).choose().step == 20
    # Otherwise never the newest: the oldest unlocked one (an empty slot first).
    assert _store(tmp_path, [(10, False), (20, False)]).choose().step == 10
    assert _store(tmp_path, [(10, False), (None, False), (20, True)]).choose().step is None
    # The locked slot holds no complete snapshot: restaging the newest would leave nothing to fall back to.
    assert _store(tmp_path, [(None, True), (20, False)]).choose() is None


def test_a_slow_persistent_tier_never_makes_a_snapshot_skip(tmp_path, pg, monkeypatch, caplog):
    """Every write stalls 1 s (a disk far slower than a step) with a memory checkpoint and a persist due at every
    step: every step still gets its memory snapshot, only the slot being written is held, the lag is logged once,
    and once the disk is fast again the persistent tier catches up (one line, one ledger record)."""
    monkeypatch.setenv(FAULT_ENV, "slow_write:1")
    state = make_state()
    mgr = manager(tmp_path, interval=1, persist_every=1)
    records = []
    mgr.event_sink = lambda event, **fields: records.append((event, fields))
    try:
        with caplog.at_level(logging.INFO, logger="trainer.checkpoint"):
            for step in range(1, 9):
                train_step(state, step)
                time.sleep(0.2)
                assert mgr.save(step, state), f"the memory checkpoint of step {step} was skipped"
                assert mgr.latest_in_memory().step == step
                assert sum(slot.locked for slot in mgr.snapshots.slots) <= 1
            assert len(committed_steps(mgr.dir)) < 8  # the disk could not keep up with one write per step
            behind = [r.getMessage() for r in caplog.records if "persistent tier behind" in r.getMessage()]
            assert len(behind) == 1, behind  # once per episode, not every step
            assert "still in flight" in behind[0]
            assert not records  # not caught up yet
            monkeypatch.delenv(FAULT_ENV)  # the disk is fast again: the next writes take milliseconds
            step = 8
            while not records and step < 60:
                step += 1
                train_step(state, step)
                time.sleep(0.2)
                assert mgr.save(step, state)
                assert mgr.latest_in_memory().step == step
        caught_up = [r.getMessage() for r in caplog.records if "persistent tier caught up" in r.getMessage()]
        assert len(caught_up) == 1, caught_up
        assert [event for event, _ in records] == ["persist_behind"]
        fields = records[0][1]
        assert fields["since_step"] == 2 and fields["deferred"] >= 2 and fields["until_step"] == step
        assert committed_steps(mgr.dir)[-1] == fields["committed_step"] >= 9
        assert not [r for r in caplog.records if "skipped" in r.getMessage()]
    finally:
        mgr.close(job_over=True)


def test_a_fault_while_restaging_the_newest_falls_back_to_the_snapshot_being_written(tmp_path, pg, monkeypatch):
    """2 slots, step 1 being written (its slot locked), step 2 the newest: step 3 restages step 2's slot. A fault
    during that copy leaves step 1, still valid, to restore from in memory."""
    monkeypatch.setenv(FAULT_ENV, "slow_write:3@1")
    state = make_state()
    mgr = manager(tmp_path, interval=1, persist_every=1)
    try:
        train_step(state, 1)
        mgr.save(1, state)
        at_step_1 = snapshot(state)
        train_step(state, 2)
        mgr.save(2, state)
        assert mgr.snapshots.held_steps() == [1, 2] and mgr.persistent.inflight.step == 1
        train_step(state, 3)
        real_ensure = Slot.ensure

        def ensure_then_fail(self, *args, **kwargs):
            real_ensure(self, *args, **kwargs)
            raise RuntimeError("injected fault while staging")

        monkeypatch.setattr(Slot, "ensure", ensure_then_fail)
        with pytest.raises(RuntimeError, match="while staging"):
            mgr.save(3, state)
        monkeypatch.setattr(Slot, "ensure", real_ensure)
        assert mgr.snapshots.held_steps() == [1]
        mgr.unbind()
        restored = make_state(seed=2)
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        mgr.bind()
        assert mgr.load_latest(restored) == 1 and mgr.restored_from == "memory"
        assert_equal(snapshot(restored), at_step_1)
    finally:
        mgr.close(job_over=True)


@pytest.mark.multiprocess
def test_ranks_decide_identically_when_one_ranks_disk_is_slow(tmp_path):
    """Rank 1's writes stall, rank 0's do not: both ranks take a memory checkpoint at every step, defer and persist
    at the same steps (one agreement all-reduce), and end with the same committed checkpoints, no hang."""
    out = torchrun_probe(REPO / "tests" / "checkpoint" / "slow_disk_ranks.py", tmp_path,
                         "the ranks hung: they disagreed about a save or a commit")
    results = [(tmp_path / f"rank{rank}.result").read_text() for rank in (0, 1)]
    assert results[0] == results[1], out
    assert results[0].startswith("snapshots at every step 1..24"), out
    persisted = [int(s) for s in re.search(r"persisted \[([\d, ]+)\]", results[0]).group(1).split(", ")]
    assert 3 <= len(persisted) < 24 and persisted[-1] == 24, out  # some deferred, none lost, the final one written
    assert load_model_weights(tmp_path / "ckpt", step=24).keys()
