"""Snapshots on CUDA, with and without device staging (checkpoint.device_staging): every tier restores the state
bit-identical, the next optimizer step never races the copy, and the checksum computed on the device equals the
slot's. Needs a GPU: skipped on CPU-only machines (the lead runs it with bench/gpu_suite.sh checkpoint)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from statelib import MODEL, SEQ, FakeLoader, assert_equal, snapshot
from trainer.checkpoint import CheckpointManager, committed_steps
from trainer.checkpoint.chunked import memory_backed
from trainer.checkpoint.slots import Slot, checksum
from trainer.checkpoint.staging import DeviceStagedCopy, DirectCopy
from trainer.checkpoint.state import local_tensors
from trainer.config import CheckpointConfig, OptimConfig, TrainConfig
from trainer.model import Transformer
from trainer.parallel import DistEnv, apply_fsdp
from trainer.train import TrainProgress, build_optimizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="device staging needs a CUDA device")
DEVICE = torch.device("cuda", 0)


@pytest.fixture
def cuda_pg():
    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _state(seed: int = 0) -> dict:
    with torch.device(DEVICE):
        model = Transformer(MODEL, max_seq_len=SEQ)
    model.init_weights(seed)
    model = apply_fsdp(model, TrainConfig(device="cuda"), DEVICE)
    optimizer = build_optimizer(model, OptimConfig())
    return {"model": model, "optimizer": optimizer, "progress": TrainProgress(), "dataloader": FakeLoader()}


def _step(state: dict, step: int, mgr: CheckpointManager) -> None:
    """One step as the trainer's loop takes it: a snapshot's drain pumped at its start, the optimizer step only
    after ``wait_for_staging``."""
    mgr.before_step(step)
    tokens = torch.randint(0, MODEL.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(step)).to(DEVICE)
    logits = state["model"](tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    mgr.wait_for_staging()
    state["optimizer"].step()
    state["optimizer"].zero_grad(set_to_none=True)
    state["progress"].step = step
    state["dataloader"].position += 2


@pytest.fixture
def shm_dir():
    """Node-local slots where production keeps them: a memory-backed file system (Linux page-locks no file on a
    disk, and the test's tmp_path is on one on the GPU machine)."""
    directory = Path(tempfile.mkdtemp(prefix="test-staging-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _manager(tmp_path, mode: str, node_dir: Path, piece: int = 0) -> CheckpointManager:
    cfg = CheckpointConfig(interval=1, persist_every=2, keep=3, node_local_dir=str(node_dir),
                           device_staging=mode)
    mgr = CheckpointManager(cfg, tmp_path / "ckpt", DistEnv(0, 1, 0, 1), config_json=json.dumps({"test": True}))
    mgr.snapshots.pin_in_pieces(piece)  # checkpoint.pin_chunk_mib, in bytes: pieces far smaller than the state
    mgr.bind()
    return mgr


@pytest.mark.parametrize("piece", [0, 64 << 10], ids=["one-registration", "pinned-in-pieces"])
@pytest.mark.parametrize("mode, copier", [("on", DeviceStagedCopy), ("off", DirectCopy)])
def test_cuda_snapshots_restore_bit_identical_from_every_tier(tmp_path, cuda_pg, shm_dir, mode, copier, piece):
    state = _state()
    mgr = _manager(tmp_path, mode, shm_dir, piece)
    try:
        mgr.load_latest(state)
        expected = {}
        for step in range(1, 7):
            _step(state, step, mgr)
            torch.cuda.synchronize()
            expected[step] = {k: t.detach().cpu().clone() for k, t in local_tensors(state)[0].items()}
            mgr.save(step, state)
        assert isinstance(mgr._copier, copier)
        _step(state, 7, mgr)  # its optimizer step runs while step 6's copy may still drain
        mgr.save(7, state, last_step=True)
        torch.cuda.synchronize()
        held = {slot.step: slot for slot in mgr.snapshots.slots if slot.step is not None}
        # the newest two; with memory_slots=auto a third, older one where memory allows (which one depends on the
        # saves deferred while the slots were page-locked in the background)
        assert {6, 7} <= set(held) and len(held) <= len(mgr.snapshots.slots), sorted(held)
        assert all(slot.pinned for slot in held.values()), "the slots in /dev/shm were not page-locked"
        assert all(len(slot.chunk_pins) > 1 for slot in held.values()) == bool(piece)
        assert all(torch.equal(held[6].views[k], v) for k, v in expected[6].items()), "step 7's update leaked in"
        assert all(torch.equal(held[s].views[k], v) for s in held if s in expected for k, v in expected[s].items())
        for slot in held.values():
            assert slot.checksum == checksum(slot.buffer), "the checksum computed on the device != the slot's"
        restored = _state(seed=3)
        assert mgr.load_latest(restored) == 7 and mgr.restored_from == "memory"
        assert_equal(snapshot(restored), snapshot(state))
        assert committed_steps(mgr.dir)[-1] == 7
    finally:
        mgr.close()
    respawned = _manager(tmp_path, mode, shm_dir, piece)  # a new process on the same node: the node-local tier, checksum verified
    try:
        restored = _state(seed=4)
        assert respawned.load_latest(restored) == 7 and respawned.restored_from == "node-local"
        assert_equal(snapshot(restored), snapshot(state))
    finally:
        respawned.close(job_over=True)


@pytest.mark.parametrize("buffer_holds", ["the step restored", "another step"])
def test_an_in_process_restore_copies_from_the_staging_buffer_where_it_holds_the_step(tmp_path, cuda_pg, shm_dir,
                                                                                      caplog, buffer_holds):
    """The staging buffer outlives an in-process restart: the restore of the step it holds is a device-to-device copy
    (the host slot is not read: zeroed here, the state still comes back bit-identical); where it holds another step,
    the slot is read."""
    state = _state()
    mgr = _manager(tmp_path, "on", shm_dir)
    try:
        mgr.load_latest(state)
        for step in range(1, 6):
            _step(state, step, mgr)
            mgr.save(step, state, last_step=step == 5)
        torch.cuda.synchronize()
        copier = mgr._copier
        assert isinstance(copier, DeviceStagedCopy) and copier.step == 5
        slot = mgr.snapshots.slot_for(5)
        if buffer_holds == "the step restored":
            slot.buffer.zero_()  # only the staging buffer can give the state back now
        else:
            copier.buffer.fill_(7)
            copier.step = 4
        restored = _state(seed=3)
        with caplog.at_level(logging.INFO, logger="trainer.checkpoint.restore"):
            assert mgr.load_latest(restored) == 5 and mgr.restored_from == "memory"
        assert_equal(snapshot(restored), snapshot(state))
        line = next(r.getMessage() for r in caplog.records if "restored step 5" in r.getMessage())
        assert ("device copy" in line) == (buffer_holds == "the step restored"), line
    finally:
        mgr.close(job_over=True)


def test_slots_on_a_disk_are_used_pageable_with_one_warning(tmp_path, caplog):
    """checkpoint.node_local_dir on a disk: the driver refuses to page-lock the mapping; the slot works pageable and
    one WARNING says what to change, instead of every save failing."""
    if memory_backed(tmp_path):
        pytest.skip("tmp_path is memory-backed here: the driver page-locks it")
    slots = [Slot(i, tmp_path / f"slot-{i}.data", tmp_path / f"slot-{i}.meta") for i in range(2)]
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        for slot in slots:
            slot.reserve(1 << 20, pin=True)
    assert all(slot.pin_refused and not slot.pinned and slot.buffer is not None for slot in slots)
    warned = [r for r in caplog.records if "cannot be page-locked" in r.getMessage()]
    assert len(warned) == 1 and "checkpoint.node_local_dir" in warned[0].getMessage()
    assert memory_backed(Path("/dev/shm")) or not Path("/dev/shm").is_dir()
    slots[0].buffer[:4].copy_(torch.arange(4, dtype=torch.uint8, device=DEVICE), non_blocking=True)
    torch.cuda.synchronize()
    assert slots[0].buffer[:4].tolist() == [0, 1, 2, 3]
    for slot in slots:
        slot.release()


def test_a_staged_snapshot_drains_a_part_per_step_and_restores_bit_identical(tmp_path, cuda_pg, shm_dir, monkeypatch):
    """The drain to host memory is queued a part at each step's start (``staging.Drain``), never all at once: the
    copy engine runs ready device-to-host copies in order, and a step's loss copy waited behind a whole drain. The
    snapshot is complete only once every part landed; its bytes and checksum are the step's."""
    from trainer.checkpoint import staging

    monkeypatch.setattr(staging, "SNAPSHOT_COPY_BYTES", 4 << 10)  # the test model's state: ~60 pieces
    monkeypatch.setattr(staging.DeviceStagedCopy, "drain_budget", lambda self, *_: 3 * (4 << 10))
    state = _state()
    mgr = _manager(tmp_path, "on", shm_dir)
    try:
        mgr.load_latest(state)
        step, taken = 0, False
        while not taken:  # the first saves may be deferred while the slots are page-locked in the background
            step += 1
            _step(state, step, mgr)
            torch.cuda.synchronize()
            expected = {k: t.detach().cpu().clone() for k, t in local_tensors(state)[0].items()}
            taken = mgr.save(step, state)
        first = step
        drain = mgr.snapshots.staged().event
        assert isinstance(drain, staging.Drain) and drain.done is None and not drain.query()
        parts = [len(drain.pieces)]
        while drain.pieces:  # the loop's next steps, without saves: only their starts pump the drain
            step += 1
            _step(state, step, mgr)
            parts.append(len(drain.pieces))
            if drain.pieces:  # not every part queued, let alone landed: not a snapshot yet
                assert mgr.snapshots.newest() is None or mgr.snapshots.newest().step != first
        # a part per step: no step's wait_for_staging queued the rest at once (it did: [4, 1, 0] on H200)
        assert len(parts) > 3 and all(a - b == 3 for a, b in zip(parts, parts[1:-1])), parts
        torch.cuda.synchronize()
        step += 1
        _step(state, step, mgr)  # landed: the next step makes it the snapshot, no save needed
        slot = mgr.snapshots.slot_for(first)
        assert slot is not None and mgr.snapshots.newest() is slot, "the drained snapshot did not become a snapshot"
        mgr.save(step, state, last_step=True)  # takes and persists its own
        assert all(torch.equal(slot.views[k], v) for k, v in expected.items()), "a later step leaked in"
        assert slot.checksum == checksum(slot.buffer), "the checksum computed on the device != the slot's"
    finally:
        mgr.close(job_over=True)


def test_a_snapshot_in_flight_when_the_attempt_fails_is_the_restore_point(tmp_path, shm_dir, monkeypatch):
    """An exception at the start of the step after a snapshot, its copy still in flight (device staging: the drain's
    first part only just queued): the in-process restart's ``bind`` finishes the copy, and the restore reads that
    snapshot from memory, bit-identical, not the one before."""
    from trainer.checkpoint import staging

    monkeypatch.setattr(staging, "SNAPSHOT_COPY_BYTES", 4 << 10)  # the test model's state: ~60 pieces
    monkeypatch.setattr(staging.DeviceStagedCopy, "drain_budget", lambda self, *_: 3 * (4 << 10))
    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
    state = _state()
    mgr = _manager(tmp_path, "on", shm_dir)
    try:
        mgr.load_latest(state)
        step, taken = 0, False
        while not taken or step < 3:
            step += 1
            _step(state, step, mgr)
            torch.cuda.synchronize()
            expected = {k: t.detach().cpu().clone() for k, t in local_tensors(state)[0].items()}
            taken = mgr.save(step, state)
        mgr.before_step(step + 1)  # the next step starts; its fault comes before its forward
        staged = mgr.snapshots.staged()
        assert staged is not None and staged.staging == step
        assert isinstance(staged.event, staging.Drain) and staged.event.pieces, "the drain is not in flight"
        mgr.unbind()
        dist.destroy_process_group()
        del state
        dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
        mgr.bind()
        fresh = _state(seed=3)
        assert mgr.load_latest(fresh) == step and mgr.restored_from == "memory"
        got = {k: t.detach().cpu() for k, t in local_tensors(fresh)[0].items()}
        assert all(torch.equal(got[k], v) for k, v in expected.items())
    finally:
        mgr.close(job_over=True)
        dist.destroy_process_group()
