"""The slots' reservation ahead of the first snapshot (trainer/checkpoint/reservation.py): on CUDA a new process's
slot files are populated from the end of the restore, with no CUDA call, and page-locked only from the first step's
end, each slot after its own population."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from trainer.checkpoint import reservation as reservation_module
from trainer.checkpoint.reservation import Reservation
from trainer.checkpoint.slots import SnapshotStore

NBYTES = 1 << 20


def store(tmp_path, slots: int = 3) -> SnapshotStore:
    return SnapshotStore(tmp_path / "snapshots", rank=0, slots=slots, job="job", config_json="{}", node_local=True)


@pytest.fixture
def no_cuda(monkeypatch):
    """Any CUDA driver call fails the test: the populate stage must make none."""
    def refuse(*args, **kwargs):
        raise AssertionError("a CUDA call during the populate stage")

    monkeypatch.setattr(torch.cuda, "cudart", refuse)
    monkeypatch.setattr(torch.cuda, "set_device", refuse)


def test_cuda_slots_are_populated_from_the_restore_with_no_cuda_call(tmp_path, no_cuda, monkeypatch, caplog):
    snapshots = store(tmp_path)
    gate, mapped, real_map = threading.Event(), [], reservation_module.map_file

    def gated_map(path, nbytes, allocate=False):
        assert gate.wait(30) and allocate
        mapped.append(path.name)
        return real_map(path, nbytes, allocate=allocate)

    monkeypatch.setattr(reservation_module, "map_file", gated_map)
    reservation = Reservation(snapshots)
    with caplog.at_level(logging.INFO, logger="trainer.checkpoint.reservation"):
        reservation.prepare(NBYTES, torch.device("cuda", 0))
        # while populating, no slot is ready: a snapshot at a fault in the first step does not stage into one
        assert not any(slot.ready.is_set() for slot in snapshots.slots)
        assert reservation.deferring(snapshots.choose()) is False  # not deferring before page-locking was asked for
        gate.set()
        reservation.join()
    assert mapped == [f"rank-00000.slot-{i}.data" for i in range(3)]
    assert all(slot.buffer is not None and slot.buffer.numel() == NBYTES and slot.ready.is_set()
               for slot in snapshots.slots)
    assert all(not slot.pinned for slot in snapshots.slots)
    assert [r.getMessage().split(" populated")[0] for r in caplog.records if "populated" in r.getMessage()] == \
        [f"snapshot slot {i}" for i in range(3)]
    reservation.prepare(NBYTES, torch.device("cuda", 0))  # asked again (an in-process restart): nothing new
    assert len(reservation.threads) == 1
    snapshots.close(remove=True)


def test_page_locking_takes_each_slot_after_its_population(tmp_path, monkeypatch):
    """The second stage (CPU here: it maps instead of page-locking) reserves a slot only once the first stage has
    populated it, and the slot the next snapshot goes into is ready before the others are populated."""
    snapshots = store(tmp_path, slots=2)
    gates = {0: threading.Event(), 1: threading.Event()}
    real_map = reservation_module.map_file

    def gated_map(path, nbytes, allocate=False):
        index = int(path.name.split("slot-")[1].split(".")[0])
        assert gates[index].wait(30)
        return real_map(path, nbytes, allocate=allocate)

    monkeypatch.setattr(reservation_module, "map_file", gated_map)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    reserved: list[int] = []
    from trainer.checkpoint.slots import Slot

    real_reserve = Slot.reserve
    monkeypatch.setattr(Slot, "reserve", lambda self, nbytes, pin, **kw: (
        reserved.append(self.index), real_reserve(self, nbytes, False, **kw))[1])
    reservation = Reservation(snapshots)
    reservation.prepare(NBYTES, torch.device("cuda", 0))
    reservation.start_prepare()  # the first step's end, before any slot is populated
    assert reservation.defer_unready is True
    assert reservation.deferring(snapshots.choose())  # a snapshot due now is deferred, not waited for
    gates[0].set()
    assert snapshots.slots[0].ready.wait(30)
    assert reserved == [0] and not snapshots.slots[1].ready.is_set()
    gates[1].set()
    reservation.join()
    assert reserved == [0, 1] and all(slot.ready.is_set() for slot in snapshots.slots)
    assert not reservation.deferring(snapshots.choose())
    snapshots.close(remove=True)


def test_a_failed_population_is_left_to_the_page_locking_stage(tmp_path, monkeypatch, caplog):
    snapshots = store(tmp_path, slots=2)
    calls = []

    def failing_map(path, nbytes, allocate=False):
        calls.append(path.name)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(reservation_module, "map_file", failing_map)
    reservation = Reservation(snapshots)
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint.reservation"):
        reservation.prepare(NBYTES, torch.device("cuda", 0))
        reservation.join()
    assert len(calls) == 2 and all(slot.buffer is None and slot.ready.is_set() for slot in snapshots.slots)
    assert "snapshot slot 0 not populated ahead: [Errno 28] No space left on device" in caplog.text
    snapshots.close(remove=True)


def test_a_restarts_mapped_slot_is_ready_before_the_ones_still_being_populated(tmp_path, monkeypatch):
    """A restart: one slot holds the dead worker's snapshot, mapped (and page-locked ahead by the standby); the others
    are new. The mapped one is made ready at once, not behind the others' population, even though it holds the
    newest snapshot (the next snapshot's slot is otherwise first)."""
    from trainer.checkpoint.slots import Slot, map_file

    snapshots = store(tmp_path)
    snapshots.dir.mkdir(parents=True)
    held = snapshots.slots[0]
    held.buffer, held.step = map_file(held.data_path, NBYTES, allocate=True), 20
    gate, real_map = threading.Event(), reservation_module.map_file
    monkeypatch.setattr(reservation_module, "map_file",
                        lambda path, nbytes, allocate=False: gate.wait(30) and real_map(path, nbytes, allocate=allocate))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    real_reserve = Slot.reserve
    monkeypatch.setattr(Slot, "reserve", lambda self, nbytes, pin, **kw: real_reserve(self, nbytes, False, **kw))
    reservation = Reservation(snapshots)
    try:
        reservation.prepare(NBYTES, torch.device("cuda", 0))
        assert held.ready.is_set() and not snapshots.slots[1].ready.is_set()  # only the new ones are populated
        reservation.start_prepare()
        assert held.ready.wait(10), "the mapped slot waited for the others' population"
        assert not snapshots.slots[1].ready.is_set() and not snapshots.slots[2].ready.is_set()
        assert held.step == 20 and held.buffer.numel() == NBYTES  # its snapshot kept
    finally:
        gate.set()
        reservation.join()
    assert all(slot.ready.is_set() for slot in snapshots.slots)
    snapshots.close(remove=True)


def test_a_failed_page_locking_stage_does_not_free_a_slot_still_being_populated(tmp_path, monkeypatch, caplog):
    """The page-locking stage fails at once (here: its device); the slots become usable (a snapshot then reserves
    its own), but never one the populate stage is still mapping."""
    snapshots = store(tmp_path, slots=2)
    gate, real_map = threading.Event(), reservation_module.map_file
    monkeypatch.setattr(reservation_module, "map_file",
                        lambda path, nbytes, allocate=False: gate.wait(30) and real_map(path, nbytes, allocate=allocate))

    def no_device(device):
        raise RuntimeError("no CUDA device")

    monkeypatch.setattr(torch.cuda, "set_device", no_device)
    reservation = Reservation(snapshots)
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint.reservation"):
        reservation.prepare(NBYTES, torch.device("cuda", 0))
        reservation.start_prepare()
        assert not snapshots.slots[0].ready.wait(0.5), "a slot freed while its population still ran"
        gate.set()
        reservation.join()
    assert "snapshot slots not prepared ahead of the first save: no CUDA device" in caplog.text
    assert all(slot.ready.is_set() and slot.buffer is not None for slot in snapshots.slots)
    snapshots.close(remove=True)


def test_a_restarts_mapped_slots_are_page_locked_least_left_first(tmp_path, monkeypatch):
    """A takeover: the standby page-locked some chunks of each slot (the restore all of the newest one's). The slot
    with the least left to lock is made ready first, so the first snapshot after the restart, which takes the first
    slot ready, is not deferred behind a slot the standby had hardly begun."""
    from trainer.checkpoint import chunked
    from trainer.checkpoint.slots import Slot, map_file

    chunk = NBYTES // 4
    monkeypatch.setattr(chunked, "CHUNK_BYTES", chunk)
    snapshots = store(tmp_path)
    snapshots.dir.mkdir(parents=True)
    for slot, step, locked in zip(snapshots.slots, (10, 30, 20), (1, 4, 3)):  # slot 1: the newest, restored from
        slot.buffer, slot.step, slot.pin_piece = map_file(slot.data_path, NBYTES, allocate=True), step, chunk
        slot.chunk_pins = [slot.buffer.data_ptr() + i * chunk for i in range(locked)]
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    reserved, real_reserve = [], Slot.reserve
    monkeypatch.setattr(Slot, "reserve", lambda self, nbytes, pin, **kw: (reserved.append(self.index),
                                                                          real_reserve(self, nbytes, False, **kw)))
    reservation = Reservation(snapshots)
    reservation.prepare(NBYTES, torch.device("cuda", 0))
    reservation.start_prepare()
    reservation.join()
    assert reserved == [1, 2, 0]  # 0, 1 and 3 chunks left to lock
    for slot in snapshots.slots:
        slot.chunk_pins = []
    snapshots.close(remove=True)
