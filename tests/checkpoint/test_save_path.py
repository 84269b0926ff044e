"""The save path against a slow persistent tier, in one process (gloo, world size 1): memory checkpoints never skip
while a write is in flight, the persistent tier's lag is reported once per episode, and the final save writes the
state once. 2-rank runs: slow_disk_ranks.py."""

from __future__ import annotations

import logging
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from statelib import (  # noqa: F401 - pg
    assert_equal, fail_while_staging, make_state, manager, pg, snapshot, train_step,
)
from testlib import REPO, torchrun_probe
from trainer.checkpoint import FAULT_ENV, committed_steps, load_model_weights, storage
from trainer.checkpoint.slots import SnapshotStore


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
    # A new process's first seconds: a slot still being page-locked waits; an older snapshot's slot is ready now.
    store = _store(tmp_path, [(14, False), (28, False), (None, False)])
    store.slots[2].ready.clear()
    assert store.choose().step == 14
    store.slots[2].ready.set()
    assert store.choose().step is None  # once reserved, the empty slot is the oldest


@pytest.mark.parametrize("slots, worst", [(2, 40), (3, 10)])
def test_a_persist_in_flight_costs_no_restore_point_with_three_slots(tmp_path, slots, worst):
    """A snapshot every 10 steps; the one of step 610 is persisted for 46 steps (17 GB on an H100). A fault one step
    after each snapshot, while it is being staged, restores the newest complete one: with 2 slots, the one being
    written (up to 40 steps redone, at step 651), with 3 the snapshot before (10), as with no write at all."""
    store = SnapshotStore(tmp_path, 0, slots, "job", "{}", node_local=False)
    redone = {}
    for step in range(600, 720, 10):
        slot = store.choose()
        assert slot is not None, f"the snapshot of step {step} was skipped"
        slot.step = None  # being staged: not a restore point
        newest = max(s.step for s in store.slots if s.step is not None) if step > 600 else None
        if newest is not None:
            redone[step + 1] = step + 1 - 1 - newest  # the fault at step + 1 redoes these
        slot.step = step
        if step == 610:
            slot.locked = True  # the persistent write starts
        if step == 650:
            next(s for s in store.slots if s.locked).locked = False  # 46 steps later it committed
    assert max(redone.values()) == worst, redone


def test_memory_slots_auto_takes_three_where_host_memory_holds_them_else_two(tmp_path, pg, monkeypatch, caplog):
    from trainer.checkpoint import hostmem

    state = make_state()
    slot_bytes = sum(t.numel() * t.element_size() for t in state["model"].state_dict().values())
    mgr = manager(tmp_path, memory_slots="auto")
    assert len(mgr.snapshots.slots) == 3
    monkeypatch.setattr(hostmem, "cgroup_room", lambda *a, **k: int(2.6 * 3 * slot_bytes))  # room for 2, not 3
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        mgr._check_host_memory(state)
    assert len(mgr.snapshots.slots) == 2
    lines = [r.getMessage() for r in caplog.records if "memory_slots=auto" in r.getMessage()]
    assert len(lines) == 1 and "2 slots per rank, not 3" in lines[0], lines
    monkeypatch.setattr(hostmem, "cgroup_room", lambda *a, **k: slot_bytes)  # not even 2: exit 2, one line
    with pytest.raises(Exception, match="checkpoint.memory_slots"):
        manager(tmp_path / "b", memory_slots="auto")._check_host_memory(state)
    mgr.close()


def test_a_slow_persistent_tier_never_makes_a_snapshot_skip(tmp_path, pg, monkeypatch, caplog):
    """Every write stalls 1 s (a disk far slower than a step) with a memory checkpoint and a persist due at every
    step: every step still gets its memory snapshot, only the slot being written is held, the lag is logged once,
    and once the disk is fast again the persistent tier catches up (one line, one ledger record)."""
    monkeypatch.setenv(FAULT_ENV, "slow_write:1")
    state = make_state()
    mgr = manager(tmp_path, interval=1, persist_every=1)
    records, persisted = [], []  # the persist_behind records; the persisted ones (the planner's write times)
    mgr.event_sink = lambda event, **fields: (persisted if event == "persisted" else records).append((event, fields))
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
        assert max(f["write_s"] for _, f in persisted) >= 1.0  # the planner's write times: the slow ones stalled 1 s
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
    mgr = manager(tmp_path, interval=1, persist_every=1, memory_slots=2)
    try:
        train_step(state, 1)
        mgr.save(1, state)
        at_step_1 = snapshot(state)
        train_step(state, 2)
        mgr.save(2, state)
        assert mgr.snapshots.held_steps() == [1, 2] and mgr.persistent.inflight.step == 1
        train_step(state, 3)
        fail_while_staging(monkeypatch, mgr, state, 3)
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
    assert results[0].startswith("snapshots at every step 1.."), out
    last = int(re.match(r"snapshots at every step 1\.\.(\d+);", results[0]).group(1))  # 24, more on a loaded machine
    persisted = [int(s) for s in re.search(r"persisted \[([\d, ]+)\]", results[0]).group(1).split(", ")]
    assert 3 <= len(persisted) < last and persisted[-1] == last, out  # some deferred, none lost, the final one written
    assert load_model_weights(tmp_path / "ckpt", step=last).keys()


def test_the_final_save_writes_the_state_once(tmp_path, pg, monkeypatch, caplog):
    """A final save (the last step, a preemption's forced save) never writes a state twice: after its step's
    write committed it writes nothing, while that write is in flight it waits for it, and an older write still in
    flight is cancelled (not waited for and followed by a second full write). Counted at the writer."""
    state = make_state()
    mgr = manager(tmp_path, interval=5, persist_every=1, keep=10)
    written: list[str] = []
    submit = mgr.writer.submit
    monkeypatch.setattr(mgr.writer, "submit", lambda *a, **kw: (written.append(a[4].parent.name), submit(*a, **kw))[1])

    def train_until(last: int) -> None:
        for step in range(state["progress"].step + 1, last + 1):
            train_step(state, step)
            mgr.save(step, state)

    def settle() -> None:  # the write in flight commits in the background (each save() polls it)
        while mgr.persistent.inflight is not None:
            mgr.save(state["progress"].step, state)
            time.sleep(0.05)

    try:
        train_until(5)
        settle()
        train_until(10)
        settle()
        assert committed_steps(mgr.dir) == [5, 10]
        assert mgr.save(10, state, force=True)  # preempted right after: the committed write is the final one
        assert written == ["step-00000005.tmp", "step-00000010.tmp"]

        monkeypatch.setenv(FAULT_ENV, "slow_write:2@15")
        train_until(15)  # step 15's write is in flight (stalled 2 s) when the preemption's save comes
        assert mgr.persistent.inflight.step == 15
        assert mgr.save(15, state, force=True)
        assert committed_steps(mgr.dir)[-1] == 15 and written.count("step-00000015.tmp") == 1

        monkeypatch.setenv(FAULT_ENV, "slow_write:60@20")
        train_until(24)  # step 20's write stalls on a slow disk
        assert mgr.persistent.inflight.step == 20
        train_step(state, 25)
        started = time.monotonic()
        with caplog.at_level(logging.INFO, logger="trainer.checkpoint"):
            assert mgr.save(25, state, last_step=True)
        assert time.monotonic() - started < 30, "the final save waited for the superseded write"
        assert "the write of step 20 is cancelled" in caplog.text
        assert written == [f"step-{s:08d}.tmp" for s in (5, 10, 15, 20, 25)]  # each state submitted once
        assert committed_steps(mgr.dir) == [5, 10, 15, 25]
        storage.wait_for_removals()  # the cancelled write's directory is out of the namespace, deleted in a thread
        assert not list(mgr.dir.glob("*.tmp")) and not list(mgr.dir.rglob("*.partial"))
        shards = sorted(mgr.dir.rglob("shard-*.pt"))
        assert [p.parent.name for p in shards] == [f"step-{s:08d}" for s in (5, 10, 15, 25)]
        load_model_weights(mgr.dir, step=25)
    finally:
        mgr.close(job_over=True)


def test_the_writer_hashes_every_chunk_of_the_file_while_writing_and_stops_when_cancelled(tmp_path, monkeypatch):
    """Chunks small enough that they span torch's write calls and the big record spans many: every digest equals
    the sha256 of its chunk of the file as written; a cancelled write raises and leaves no partial file."""
    import hashlib

    from trainer.checkpoint import writer

    monkeypatch.setattr(writer, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(writer, "FLUSH_BYTES", 3000)
    obj = {"a": torch.arange(5000, dtype=torch.float32), "b": torch.arange(7, dtype=torch.int8), "meta": {"step": 3}}
    size, digests = writer.atomic_torch_save(obj, tmp_path / "shard.pt")
    data = (tmp_path / "shard.pt").read_bytes()
    assert size == len(data) > 20_000
    assert digests == [hashlib.sha256(data[i : i + 1000]).hexdigest() for i in range(0, len(data), 1000)]
    assert torch.equal(torch.load(tmp_path / "shard.pt", weights_only=True)["a"], obj["a"])

    cancel = torch.zeros(8, dtype=torch.uint8)
    cancel[0] = 1
    with pytest.raises(writer.WriteCancelled):
        writer.atomic_torch_save(obj, tmp_path / "cancelled.pt", cancel=cancel)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.pt"]


def test_the_snapshots_tensor_list_is_resolved_once_per_attempt_and_stays_exact(tmp_path, pg, monkeypatch):
    """The state-dict walk runs at the first save only (the tensors are updated in place); the hyperparameters are
    still read at every save (the learning rate changes every step), and a restore, which replaces the optimizer's
    state tensors, is followed by a new walk."""
    from trainer.checkpoint import state as state_module

    walks = []
    real = state_module.local_tensors
    monkeypatch.setattr(state_module, "local_tensors", lambda state: (walks.append(1), real(state))[1])
    state = make_state()
    mgr = manager(tmp_path, interval=1, persist_every=0)
    try:
        for step in range(1, 5):
            for group in state["optimizer"].param_groups:
                group["lr"] = 1e-3 * step
            train_step(state, step)
            mgr.save(step, state)
            slot = mgr.latest_in_memory()
            tensors, _, extra = real(state)
            assert slot.payload["param_groups"] == extra["param_groups"]
            assert slot.payload["optim_scalars"] == extra["optim_scalars"]
            assert all(torch.equal(slot.views[key], tensor) for key, tensor in tensors.items())
        assert len(walks) == 1
        restored = make_state(seed=5)
        assert mgr.load_latest(restored) == 4
        train_step(restored, 5)
        mgr.save(5, restored)
        assert len(walks) == 2
        tensors, _, _ = real(restored)
        assert all(torch.equal(mgr.latest_in_memory().views[key], tensor) for key, tensor in tensors.items())
    finally:
        mgr.close(job_over=True)


def _storage(t: torch.Tensor) -> int:
    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage().data_ptr()


def _reachable(root, targets: list[torch.Tensor]) -> list[str]:
    """The paths (attribute and key names) from ``root`` to a tensor sharing memory with one of ``targets`` (the
    tensors themselves, or views of them), over the objects ``root`` refers to and what they refer to, not through
    modules, classes or a module's globals (a function's ``__globals__`` would reach every object of the process)."""
    import gc
    import sys
    import types

    wanted = {_storage(t) for t in targets}
    opaque = {id(vars(m)) for m in list(sys.modules.values()) if m is not None}
    seen, queue, found = {id(root)}, [(root, "manager")], []
    while queue and len(seen) < 500_000:
        obj, path = queue.pop()
        names = {id(v): repr(k)[:40] for k, v in obj.items()} if isinstance(obj, dict) else {}
        for child in gc.get_referents(obj):
            if id(child) in seen or isinstance(child, (types.ModuleType, type)) or id(child) in opaque:
                continue
            seen.add(id(child))
            name = names.get(id(child), type(child).__name__)
            step = path if child is getattr(obj, "__dict__", None) else f"{path}[{name}]"
            if isinstance(child, torch.Tensor) and _storage(child) in wanted:
                found.append(step)
            queue.append((child, step))
    return found


def test_an_attempts_model_and_optimizer_state_are_not_kept_alive_after_it_ends(tmp_path, pg):
    """The snapshot's cached tensor list must not outlive the attempt: on a GPU it held a failed attempt's whole
    state (16.75 GiB for ``1b``) beside the in-process restart's new one until the first snapshot. Checked as what the
    manager can reach (not as the tensors' liveness, which anything else in the test process may extend): the
    parameters and optimizer state are reachable from it before the attempt ends, and not after."""
    state = make_state()
    mgr = manager(tmp_path, interval=1, persist_every=0)
    try:
        train_step(state, 1)
        mgr.save(1, state)
        tensors = [*state["model"].parameters()]
        tensors += [v for s in state["optimizer"].state.values() for v in s.values() if torch.is_tensor(v)]
        assert _reachable(mgr, tensors), "the check must see the attempt's tensors the snapshot's cache holds"
        mgr.unbind()  # the attempt ends (train()'s finally, after a fault too)
        held = _reachable(mgr, tensors)
        assert not held, f"{len(held)} tensors on the attempt's memory still reachable from the manager: {held[:3]}"
    finally:
        mgr.close(job_over=True)


def test_copies_split_at_the_page_locked_pieces_move_every_byte():
    """``checkpoint.pin_chunk_mib``: a slot registered in pieces is copied one piece at a time (a copy spanning two
    registrations may be staged through pageable memory); the split covers each tensor's bytes exactly."""
    from trainer.checkpoint.chunked import pieces_of, split_copy

    assert pieces_of(0, 10, 0) == [(0, 10)]
    assert pieces_of(5, 20, 8) == [(5, 8), (8, 16), (16, 24), (24, 25)]
    assert pieces_of(16, 8, 8) == [(16, 24)]
    # and at most `most` bytes a copy (a snapshot's copies: SNAPSHOT_COPY_BYTES), inside the pieces
    assert pieces_of(0, 10, 0, most=4) == [(0, 4), (4, 8), (8, 10)]
    assert pieces_of(5, 20, 8, most=5) == [(5, 8), (8, 13), (13, 16), (16, 21), (21, 24), (24, 25)]
    assert pieces_of(3, 0, 8, most=4) == [(3, 3)]
    slot = torch.zeros(4096, dtype=torch.uint8)
    offset = 1000
    for tensor in (torch.randn(37, 11), torch.randn(300).bfloat16(), torch.arange(5, dtype=torch.int64)):
        nbytes = tensor.numel() * tensor.element_size()
        for piece, most in ((256, 0), (0, 100), (256, 96)):
            slot.zero_()
            split_copy(slot, offset, tensor, piece, True, most)
            assert torch.equal(slot[offset : offset + nbytes], tensor.reshape(-1).view(torch.uint8))
            back = torch.empty_like(tensor)
            split_copy(slot, offset, back, piece, False, most)
            assert torch.equal(back, tensor)
    strided = torch.randn(8, 8).t()  # read through a copy when staged; written only when contiguous
    split_copy(slot, 0, strided, 100, to_slot=True)
    assert torch.equal(slot[: 256].view(torch.float32).view(8, 8), strided.contiguous())


def test_page_locking_in_pieces_skips_what_a_restore_locked_and_pauses_after_each(monkeypatch):
    """The loop of ``register_in_pieces`` (the driver call itself needs a GPU: the staging test runs it there)."""
    from trainer.checkpoint import chunked

    calls, pauses = [], []
    monkeypatch.setattr(chunked, "cuda_register", lambda address, nbytes: calls.append((address, nbytes)) or True)
    buffer = torch.zeros(10 * 1024, dtype=torch.uint8)
    base = buffer.data_ptr()
    registered = [base + 4096]  # a restore's chunk of the same size
    assert chunked.register_in_pieces(buffer, 4096, registered, pauses.append)
    assert calls == [(base, 4096), (base + 8192, 2048)]
    assert registered == [base + 4096, base, base + 8192] and len(pauses) == 2 and min(pauses) >= 0
    monkeypatch.setattr(chunked, "cuda_register", lambda address, nbytes: address == base)  # the driver refuses
    kept: list[int] = []
    assert not chunked.register_in_pieces(buffer, 4096, kept)
    assert kept == [base]  # what was locked stays recorded, for release() to undo


def test_a_snapshot_whose_slot_is_still_being_reserved_is_deferred_not_waited_for(tmp_path, pg, monkeypatch, caplog):
    """On CUDA a new process's slots are page-locked in the background for seconds after its first step: a snapshot
    due meanwhile is deferred (the loop goes on) and taken at the first step that finds its slot ready; a final save
    waits for it instead. The reservation is held here by a gate (a fail-safe timer opens it: a save that waited
    for it instead of deferring returns True, late, and fails the test)."""
    import threading

    from trainer.checkpoint.slots import Slot

    gate, real_reserve = threading.Event(), Slot.reserve
    monkeypatch.setattr(Slot, "reserve", lambda self, *a, **kw: gate.wait() and real_reserve(self, *a, **kw))
    failsafe = threading.Timer(30.0, gate.set)
    failsafe.start()
    state = make_state()
    mgr = manager(tmp_path, interval=2, persist_every=0)
    mgr.reservation.defer_unready = True  # as on CUDA (page-locking); on CPU a save waits for its slot's reservation
    assert mgr.load_latest(state) is None  # asks for the slots' reservation from the end of the first step
    try:
        with caplog.at_level(logging.INFO, logger="trainer.checkpoint"):
            for step in (1, 2, 3):
                train_step(state, step)
                assert not mgr.save(step, state)  # 1: not due; 2: due, deferred; 3: owed, still deferred
            assert mgr.latest_in_memory() is None and not gate.is_set()
            gate.set()
            mgr.reservation.join()
            train_step(state, 4)
            assert mgr.save(4, state) and mgr.latest_in_memory().step == 4  # the owed snapshot, at once
            train_step(state, 5)
            assert not mgr.save(5, state)  # back on the interval: nothing owed
        deferred = [r.getMessage() for r in caplog.records if "deferred" in r.getMessage()]
        assert deferred == [deferred[0], "memory checkpoint deferred from step 2 taken at step 4"], deferred
        assert deferred[0].startswith("memory checkpoint of step 2 deferred")  # once per deferral, not per step
        assert not [r for r in caplog.records if "skipped" in r.getMessage()]
    finally:
        failsafe.cancel()
        mgr.close(job_over=True)


def test_a_final_save_waits_for_its_slot_instead_of_deferring(tmp_path, pg, monkeypatch):
    import threading

    from trainer.checkpoint.slots import Slot

    gate, real_reserve = threading.Event(), Slot.reserve
    monkeypatch.setattr(Slot, "reserve", lambda self, *a, **kw: gate.wait() and real_reserve(self, *a, **kw))
    state = make_state()
    mgr = manager(tmp_path, interval=100, persist_every=1)
    mgr.reservation.defer_unready = True
    assert mgr.load_latest(state) is None
    try:
        train_step(state, 1)
        assert not mgr.save(1, state)  # starts the background reservation, held by the gate
        train_step(state, 2)
        threading.Timer(0.5, gate.set).start()
        assert mgr.save(2, state, last_step=True)
        assert committed_steps(mgr.dir) == [2] and mgr.latest_in_memory().step == 2
    finally:
        gate.set()
        mgr.close(job_over=True)


def test_a_drain_part_is_half_a_step_unless_the_next_snapshot_needs_more():
    """``staging.drain_part_bytes``: half a step at the copy rate, so a step's own copies never queue behind it; but
    the rest must land before the next snapshot is due (it waits for it), so a short step with a large state drains
    faster than that; no measured step time, or no step left: all at once (None)."""
    from trainer.checkpoint.policy import IntervalPolicy
    from trainer.checkpoint.staging import DRAIN_STEP_FRACTION, drain_part_bytes

    gb = 10**9
    half_step = int(DRAIN_STEP_FRACTION * 0.32 * 50 * gb)  # 1b on H200: 0.32 s steps, ~50 GB/s
    assert drain_part_bytes(0.32, 50 * gb, 18 * gb, steps_left=9) == half_step  # interval 10: paced
    assert drain_part_bytes(0.32, 50 * gb, 18 * gb, steps_left=None) == half_step  # nothing scheduled
    assert drain_part_bytes(0.03, 50 * gb, 18 * gb, steps_left=4) == 18 * gb // 4  # short steps: the deadline rules
    assert drain_part_bytes(0.03, 50 * gb, 18 * gb + 1, steps_left=4) == 18 * gb // 4 + 1  # rounded up
    assert drain_part_bytes(-1.0, 50 * gb, 18 * gb, steps_left=9) is None
    assert drain_part_bytes(0.32, 50 * gb, 18 * gb, steps_left=0) is None
    every = IntervalPolicy(10, 86400.0)
    assert [every.steps_to_next(s) for s in (10, 11, 19, 20)] == [0, 9, 1, 0]
    assert IntervalPolicy(0, 86400.0).steps_to_next(7) is None
    auto = IntervalPolicy("auto", 86400.0)
    auto.next_due = 25
    assert auto.steps_to_next(21) == 4 and auto.steps_to_next(30) == 0


def test_a_drain_lands_within_two_steps_of_its_snapshot_where_the_copy_rate_allows():
    """``staging.drain_part_bytes`` with ``parts_left``: the drain is spread over ``DRAIN_WITHIN_STEPS`` (2) steps, so
    a snapshot is a restore point for a SIGKILL from the third step after it; where half a step at the copy rate is
    not enough (1b on H200: 18 GB at ~55 GB/s in 0.27 s steps) each part is larger than the pace, up to
    ``DRAIN_PART_MAX_FRACTION`` of a step; a state too large for that takes more parts, none outlasting its step."""
    from trainer.checkpoint.staging import (
        DRAIN_PART_MAX_FRACTION, DRAIN_STEP_FRACTION, DRAIN_WITHIN_STEPS, drain_part_bytes, parts_left,
    )

    assert DRAIN_WITHIN_STEPS == 2 and [parts_left(q) for q in range(4)] == [2, 1, 1, 1]
    gb = 10**9

    def parts(step_s: float, state: int, steps_left: int = 9) -> list[int]:
        remaining, out = state, []
        while remaining > 0:
            part = min(remaining, drain_part_bytes(step_s, 55 * gb, remaining, steps_left - len(out), parts_left(len(out))))
            out.append(part)
            remaining -= part
        return out

    assert parts(0.27, 18 * gb) == [9 * gb, 9 * gb] and 9 * gb > DRAIN_STEP_FRACTION * 0.27 * 55 * gb
    cap = int(DRAIN_PART_MAX_FRACTION * 0.1 * 55 * gb)  # 0.1 s steps: 18 GB is 3.3 steps of copy
    assert parts(0.1, 18 * gb)[:3] == [cap] * 3 and len(parts(0.1, 18 * gb)) == 4
    assert parts(0.27, 2 * gb) == [2 * gb]  # a small state: one part, within the pace
    assert parts(0.1, 18 * gb, steps_left=2) == [9 * gb, 9 * gb]  # the next snapshot's deadline is not capped


class _Event:  # a CUDA event's duck type: a copy in flight until it lands (or the host waits for it)
    def __init__(self, landed: bool) -> None:
        self.landed, self.host_waits = landed, 0

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.host_waits += 1
        self.landed = True


def test_a_step_never_waits_on_the_host_for_a_snapshots_copy(tmp_path, pg):
    """``wait_for_staging`` (before every ``optimizer.step()``): the training stream waits once, on the device, for
    the copier's ``sources_read`` (the point after which the live tensors may change; consumed here before the
    call, as at the first step after a save); after that the host never waits for the copy still in flight. It did:
    for a device-staged drain, the second step after a save queued the rest of the drain at once and held the host
    thread for it, 169 ms a snapshot on H200 with 1b. The slot becomes the snapshot once its copy has landed."""
    from trainer.checkpoint.staging import Drain

    class LandingDrain(_Event, Drain):  # a device-staged drain whose parts are not all queued yet
        def __init__(self) -> None:
            _Event.__init__(self, landed=False)
            Drain.__init__(self, None, None, [(0, 1)])  # type: ignore[arg-type]

    mgr = manager(tmp_path, interval=1, persist_every=0)
    try:
        slot = mgr.snapshots.slots[0]
        mgr.blocking_s.append(0.0)
        for event in (LandingDrain(), _Event(landed=False)):  # a device-staged drain, a DirectCopy
            slot.staging, slot.event, slot.sources_read = 5, event, None
            mgr.wait_for_staging()
            assert event.host_waits == 0 and mgr.snapshots.staged() is slot, type(event).__name__
            event.landed = True
            mgr.wait_for_staging()  # landed: the slot becomes the snapshot of step 5
            assert mgr.snapshots.staged() is None and mgr.latest_in_memory() is slot and slot.step == 5
            slot.step = None
    finally:
        mgr.close()


@pytest.mark.parametrize("read", [True, False], ids=["sources-read", "sources-unread"])
def test_an_in_process_restart_finishes_a_snapshot_whose_sources_were_read(tmp_path, pg, caplog, read):
    """An exception a step after a snapshot, its device-staged drain still in flight: the copy had read the live
    tensors (the device-to-device copy landed) when the attempt ended, so the next attempt's ``bind`` finishes the
    drain and the snapshot is the restore point, not the one before. A copy that had not read them when the attempt
    ended (the tensors are freed after) is dropped, even if it lands later."""
    state = make_state()
    mgr = manager(tmp_path, interval=1, persist_every=0)
    try:
        train_step(state, 1)
        mgr.save(1, state)
        train_step(state, 2)
        mgr.save(2, state)
        expected = snapshot(state)
        slot = mgr.latest_in_memory()
        assert slot.step == 2
        slot.published.wait()
        sources, drain = _Event(landed=read), _Event(landed=False)
        slot.staging, slot.step, slot.event, slot.sources_read = 2, None, drain, sources  # the drain in flight
        mgr.unbind()  # the attempt ends (a fault); no collective
        sources.landed = True
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        with caplog.at_level(logging.INFO, logger="trainer.checkpoint"):
            mgr.bind()
        assert drain.host_waits == 1 and mgr.snapshots.staged() is None
        said = "in flight when the attempt ended, is finished: a restore point"
        assert (said in caplog.text) == read, caplog.text
        restored = make_state(seed=4)
        assert mgr.load_latest(restored) == (2 if read else 1)
        if read:
            assert_equal(snapshot(restored), expected)
    finally:
        mgr.close()
