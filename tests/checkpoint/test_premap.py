"""A warm standby maps and page-locks the node-local snapshot slots of the worker it may replace
(``trainer/checkpoint/premap.py``), and the worker it becomes restores from those mappings without locking them
again. Here the driver's registration is a recorder (CPU); on a GPU the effect is the in-job ``restore`` phase
(BENCHMARKS.md, "Recovery per layer")."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

from statelib import assert_equal, make_state, manager, pg, save_two_steps, snapshot, train_step  # noqa: F401 - pg
from trainer.checkpoint import chunked, premap

CHUNK = 4096


class Driver:
    """cudaHostRegister/cudaHostUnregister as a ledger of locked addresses."""

    def __init__(self, refuse: bool = False) -> None:
        self.locked: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []
        self.refuse = refuse

    def register(self, address: int, nbytes: int) -> bool:
        self.calls.append(("register", address))
        if self.refuse:
            return False
        assert address not in self.locked, "locked twice"
        self.locked[address] = nbytes
        return True

    def unregister(self, address: int) -> None:
        self.calls.append(("unregister", address))
        assert self.locked.pop(address, None) is not None, "unlocked what was not locked"


@pytest.fixture
def driver(monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK_BYTES", CHUNK)
    drv = Driver()
    monkeypatch.setattr(chunked, "cuda_unregister", drv.unregister)  # what a slot releases its chunks with
    monkeypatch.setattr(chunked, "memory_backed", lambda directory: True)  # tmp_path may be on a disk
    yield drv
    premap.release_all(drv.unregister)


def _write(path: Path, nbytes: int, seed: int = 0) -> bytes:
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    path.write_bytes(data.numpy().tobytes())
    return data.numpy().tobytes()


def test_a_slot_file_is_locked_chunk_by_chunk_and_its_mapping_shows_the_workers_latest_bytes(tmp_path, driver):
    path = tmp_path / "rank-00000.slot-0.data"
    _write(path, 3 * CHUNK + CHUNK // 2)
    mapper = premap.Premapper([str(path)], driver.register, driver.unregister)
    mapper.refresh(str(path))
    mapper.refresh(str(path))  # nothing changed: nothing locked again
    assert mapper.locked_bytes() == 3 * CHUNK + CHUNK // 2
    newer = _write(tmp_path / "newer", path.stat().st_size, seed=1)
    with open(path, "r+b") as f:  # the live worker writes its next snapshot into the same file
        f.write(newer)
    entry = premap.take(path, path.stat().st_size, driver.unregister)
    assert entry is not None and bytes(entry.buffer.numpy()) == newer  # MAP_SHARED: the same pages
    base = entry.buffer.data_ptr()
    assert entry.chunks == [base + i * CHUNK for i in range(4)]
    assert driver.locked == {base: CHUNK, base + CHUNK: CHUNK, base + 2 * CHUNK: CHUNK, base + 3 * CHUNK: CHUNK // 2}
    assert premap.take(path, path.stat().st_size, driver.unregister) is None  # taken once; the taker owns it


def test_a_resized_replaced_or_removed_file_is_unlocked_and_mapped_again(tmp_path, driver):
    path = tmp_path / "slot.data"
    _write(path, 2 * CHUNK)
    mapper = premap.Premapper([str(path)], driver.register, driver.unregister)
    mapper.refresh(str(path))
    first = sorted(driver.locked)
    os.truncate(path, 3 * CHUNK)  # the worker's state grew: its slot was resized
    mapper.refresh(str(path))
    unlocked = [address for call, address in driver.calls if call == "unregister"]
    assert unlocked == first and sum(driver.locked.values()) == 3 * CHUNK  # (the new mapping may reuse the address)
    _write(tmp_path / "other", 3 * CHUNK)
    os.replace(tmp_path / "other", path)  # another file at that path: the mapping is stale
    assert premap.take(path, 3 * CHUNK, driver.unregister) is None and driver.locked == {}
    mapper.refresh(str(path))
    path.unlink()  # the job ended and removed its slots: nothing may stay pinned
    mapper.refresh(str(path))
    assert driver.locked == {} and mapper.locked_bytes() == 0


def test_the_newest_snapshots_slot_is_locked_first(tmp_path, driver):
    """A takeover restores the newest snapshot: its slot file is page-locked before the others, whatever its index;
    a slot being restaged (no header) comes last."""
    paths = [tmp_path / f"rank-00000.slot-{i}.data" for i in range(3)]
    for index, path in enumerate(paths):
        _write(path, CHUNK, seed=index)
    for path, age in ((paths[0], 30), (paths[2], 10)):  # slot 2's snapshot is the newest; slot 1 has no header
        meta = path.with_suffix(".meta")
        meta.write_bytes(b"header")
        os.utime(meta, (meta.stat().st_mtime - age, meta.stat().st_mtime - age))
    assert premap.newest_first([str(p) for p in paths]) == [str(paths[2]), str(paths[0]), str(paths[1])]
    mapper = premap.Premapper([str(p) for p in paths], driver.register, driver.unregister, poll_s=30)
    mapper.start()
    deadline = time.monotonic() + 10
    while mapper.locked_bytes() < 3 * CHUNK and time.monotonic() < deadline:
        time.sleep(0.01)
    mapper.stop()
    order = [premap.take(p, CHUNK, driver.unregister).buffer.data_ptr() for p in (paths[2], paths[0], paths[1])]
    assert [address for call, address in driver.calls if call == "register"] == order
    for address in order:
        driver.unregister(address)


def test_stop_ends_after_the_chunk_being_locked_and_a_refusal_ends_the_thread(tmp_path, driver):
    path = tmp_path / "slot.data"
    _write(path, 4 * CHUNK)
    mapper = premap.Premapper([str(path)], driver.register, driver.unregister)

    def register_then_stop(address: int, nbytes: int) -> bool:
        mapper.stop()  # the handoff arrives while a chunk is being locked
        return driver.register(address, nbytes)

    mapper.register = register_then_stop
    mapper.refresh(str(path))
    assert len(driver.locked) == 1 and mapper.locked_bytes() == CHUNK
    premap.release_all(driver.unregister)
    refusing = Driver(refuse=True)
    mapper = premap.Premapper([str(path)], refusing.register, refusing.unregister, poll_s=0.01)
    mapper.start()
    mapper._thread.join(timeout=30)
    assert not mapper._thread.is_alive() and "refused" in mapper.refused  # the restore locks what it needs itself
    assert [c for c, _ in refusing.calls] == ["register"]


def test_a_respawned_worker_restores_from_the_standbys_mapping_and_releases_it_once(tmp_path, pg, driver, caplog):
    state = make_state()
    mgr = manager(tmp_path, persist_every=0, memory_slots=2)  # two steps saved: two slot files
    save_two_steps(mgr, state)
    expected = snapshot(state)
    files = mgr.snapshot_files()
    assert len(files) == 2 and all(Path(f).is_file() for f in files)
    mgr.close()  # the worker dies; its standby had mapped and locked its slots
    mapper = premap.Premapper(files, driver.register, driver.unregister)
    for path in files:
        mapper.refresh(path)
    ahead = {premap._REGISTRY[f].buffer.data_ptr(): list(premap._REGISTRY[f].chunks) for f in files}
    other = tmp_path / "rank-00001.slot-0.data"  # the standby's worker had another rank before this restart
    _write(other, 2 * CHUNK)
    mapper.paths.append(str(other))
    mapper.refresh(str(other))
    others = list(premap._REGISTRY[str(other)].chunks)
    respawned = manager(tmp_path, memory_slots=2)
    try:
        restored = make_state(seed=7)
        with caplog.at_level(logging.INFO, logger="trainer.checkpoint"):
            assert respawned.load_latest(restored) == 2
        assert "page-locked ahead by the standby" in caplog.text
        assert_equal(snapshot(restored), expected)
        for slot in respawned.snapshots.slots:  # the standby's mappings, not new ones
            assert slot.chunk_pins == ahead[slot.buffer.data_ptr()]
        assert premap._REGISTRY == {} and not set(others) & set(driver.locked)  # what no slot took: released
    finally:
        respawned.close(job_over=True)
    assert driver.locked == {}, "a chunk the standby locked was never unlocked"


def _worker_dies_with_step_2_changed(tmp_path, driver, change):
    """A worker saves steps 1 and 2 into its two slots and dies; ``change(slot)`` alters step 2's slot files; then
    its standby maps and locks both files. Returns that slot and the chunks the standby locked of it."""
    mgr = manager(tmp_path, persist_every=0, memory_slots=2)
    save_two_steps(mgr, make_state())
    files = mgr.snapshot_files()
    mgr.close()
    slot = next(s for s in mgr.snapshots.slots if s.step == 2)
    change(slot)
    mapper = premap.Premapper(files, driver.register, driver.unregister)
    for path in files:
        mapper.refresh(path)
    return slot, list(premap._REGISTRY[str(slot.data_path)].chunks)


def test_a_slot_file_without_a_snapshot_keeps_the_standbys_locked_mapping_as_an_empty_slot(tmp_path, pg, driver):
    """The dead worker was copying a snapshot into one slot (no header: not a snapshot). The standby had locked that
    file too: the respawned worker keeps the mapping as that slot's empty buffer, locked chunks and all (locking it
    again after the first step held the driver under the first steps for seconds), with every byte outside its
    tensors zeroed (the checksum counts them); its next snapshot lands there and restores bit-identical."""
    def cut_off(slot) -> None:
        slot.meta_path.unlink()  # the copy of step 2 was cut off: its header never written
        slot.data_path.write_bytes(b"\xff" * slot.data_path.stat().st_size)  # another layout's bytes, say

    cut, ahead = _worker_dies_with_step_2_changed(tmp_path, driver, cut_off)
    respawned = manager(tmp_path, persist_every=0, memory_slots=2)
    try:
        restored = make_state(seed=7)
        assert respawned.load_latest(restored) == 1
        empty = respawned.snapshots.slots[cut.index]
        assert empty.step is None and empty.buffer is not None and empty.chunk_pins == ahead
        assert not any(call == ("unregister", a) for call in driver.calls for a in ahead), "its chunks were released"
        covered = torch.zeros(empty.buffer.numel(), dtype=torch.bool)
        for dtype, offset, shape in empty.layout.values():
            covered[offset:offset + getattr(torch, dtype).itemsize * int(torch.Size(shape).numel())] = True
        assert (empty.buffer[~covered] == 0).all(), "bytes outside the tensors were left as they were"
        assert (empty.buffer[covered] == 0xFF).any()  # the tensors' bytes are the next snapshot's to write
        address = empty.buffer.data_ptr()
        train_step(restored, 2)
        respawned.save(2, restored)
        assert respawned.snapshots.slot_for(2) is empty and empty.buffer.data_ptr() == address, "mapped anew"
        expected = snapshot(restored)
        again = make_state(seed=9)
        assert respawned.load_latest(again) == 2
        assert_equal(snapshot(again), expected)
    finally:
        respawned.close(job_over=True)
    assert driver.locked == {}, "a chunk the standby locked was never unlocked"


def test_a_slot_file_whose_header_is_refused_is_left_as_it_is(tmp_path, pg, driver):
    """A file with a header this process refuses (here another configuration; after a change of world size, the
    old ranks' snapshots, which the restore may cut into the new shards) is not taken as an empty slot: its bytes
    stay as they are and the standby's lock on it is released."""
    def other_config(slot) -> None:
        meta = torch.load(slot.meta_path, weights_only=True)
        meta["config_hash"] = "0" * 64
        torch.save(meta, slot.meta_path)

    other, ahead = _worker_dies_with_step_2_changed(tmp_path, driver, other_config)
    before = other.data_path.read_bytes()
    respawned = manager(tmp_path, persist_every=0, memory_slots=2)
    try:
        assert respawned.load_latest(make_state(seed=7)) == 1
        assert respawned.snapshots.slots[other.index].buffer is None
        assert all(("unregister", a) in driver.calls for a in ahead), "the standby's lock on it was kept"
        assert other.data_path.read_bytes() == before, "a refused snapshot's bytes were changed"
    finally:
        respawned.close(job_over=True)


def test_manager_names_no_slot_files_without_the_node_local_tier(tmp_path, pg):
    mgr = manager(tmp_path, node_local=False)
    try:
        assert mgr.snapshot_files() == []
    finally:
        mgr.close()


def test_slots_on_a_disk_are_not_page_locked(tmp_path, driver, monkeypatch):
    """Linux page-locks no file mapping on a disk; the driver's refusal would leave a CUDA error behind in the
    process that becomes the worker. The standby says so and leaves the slots to the restore's pageable copy."""
    path = tmp_path / "slot.data"
    _write(path, 2 * CHUNK)
    monkeypatch.setattr(chunked, "memory_backed", lambda directory: False)
    mapper = premap.Premapper([str(path)], driver.register, driver.unregister)
    mapper.refresh(str(path))
    assert driver.calls == [] and "not on a memory file system" in mapper.refused and mapper.locked_bytes() == 0
