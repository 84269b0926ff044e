"""CheckpointManager in one process (gloo, world size 1): async snapshot semantics, integrity fallback, disk full,
in-memory restore, warm start, writer shutdown. Multi-rank behaviour is in test_resume.py."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainer.checkpoint import (
    FAULT_ENV, MANIFEST, CheckpointError, CheckpointManager, CheckpointStorageError, _copy_overlap,
    committed_steps, load_model_weights, step_dir_name,
)
from trainer.config import CheckpointConfig, ModelConfig, OptimConfig, TrainConfig
from trainer.exitcodes import ExitCode
from trainer.model import Transformer
from trainer.parallel import DistEnv, apply_fsdp
from trainer.train import TrainProgress, build_optimizer

MODEL = ModelConfig(name="micro", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64)
SEQ = 8


class FakeLoader:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


@pytest.fixture
def pg():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make_state(seed: int = 0) -> dict:
    model = Transformer(MODEL, max_seq_len=SEQ)
    model.init_weights(seed)
    model = apply_fsdp(model, TrainConfig(device="cpu"), torch.device("cpu"))
    optimizer = build_optimizer(model, OptimConfig())
    return {"model": model, "optimizer": optimizer, "progress": TrainProgress(), "dataloader": FakeLoader()}


def train_step(state: dict, step: int) -> None:
    tokens = torch.randint(0, MODEL.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(step))
    logits = state["model"](tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad(set_to_none=True)
    state["progress"].step = step
    state["dataloader"].position += 2


def snapshot(state: dict) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors (local), cloned."""
    out = {f"model/{k}": v.to_local().clone() for k, v in state["model"].state_dict().items()}
    for i, (p, st) in enumerate(state["optimizer"].state.items()):
        for name, value in st.items():
            out[f"optim/{i}/{name}"] = (value.to_local() if hasattr(value, "to_local") else value).clone()
    return out


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def manager(tmp_path: Path, **kw) -> CheckpointManager:
    cfg = CheckpointConfig(**{"interval": 1, "keep": 3, **kw})
    mgr = CheckpointManager(cfg, tmp_path / "ckpt", DistEnv(0, 1, 0, 1), config_json=json.dumps({"test": True}))
    mgr.bind()
    return mgr


def test_async_save_returns_before_the_write_and_snapshots_the_state(tmp_path, pg, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "slow_write:2")
    state = make_state()
    train_step(state, 1)
    mgr = manager(tmp_path, interval=2)
    try:
        before = snapshot(state)
        assert mgr.save(2, state) is True
        # save() returned while the writer is still inside the file: nothing committed, no report yet.
        assert not mgr._local_done(blocking=False)
        assert committed_steps(mgr.dir) == [] and mgr.latest_in_memory() is None
        train_step(state, 3)  # training goes on and mutates params, moments and the CPU Adam ``step`` tensors
        assert not torch.equal(snapshot(state)["optim/0/step"], before["optim/0/step"])
        mgr.save(3, state)  # not due: polls the writer, commits if finished
        mgr.save(4, state, last_step=True)
        assert committed_steps(mgr.dir) == [2, 4]
        fresh = make_state(seed=1)
        mgr2 = manager(tmp_path)  # a new manager: no in-memory copy, reads the disk
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
        assert "in-memory copy" in caplog.text
        assert_equal(snapshot(restored), expected)
        assert restored["progress"].step == 1 and restored["dataloader"].position == 2
        from_disk = make_state(seed=6)
        mgr._memory = None
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
        train_step(state, 1)
        mgr.save(1, state)
        step1 = snapshot(state)
        train_step(state, 2)
        mgr.save(2, state)
        corrupt(mgr.dir / step_dir_name(2))
        mgr._memory = None  # a restarted process: only the disk
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
        mgr._memory = None
        with pytest.raises(CheckpointError, match=r"no valid checkpoint in .*ckpt.*step-00000002 \(checksum-mismatch\)") as err:
            mgr.load_latest(make_state())
        assert err.value.exit_code == ExitCode.CHECKPOINT_ERROR
        with pytest.raises(CheckpointError, match="no valid checkpoint"):
            load_model_weights(mgr.dir)
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
        with pytest.raises(CheckpointStorageError, match="disk is full") as err:
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
    process = mgr._queue.persistent_caller.process
    assert process.is_alive()
    mgr.close()
    mgr.close()
    assert not process.is_alive() and process.exitcode == 0


def test_in_flight_save_is_committed_by_the_next_attempt(tmp_path, pg):
    state = make_state()
    mgr = manager(tmp_path)
    try:
        train_step(state, 1)
        mgr.save(1, state)
        mgr.unbind()  # a fault ends the attempt; no collective
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        mgr.bind()
        assert committed_steps(mgr.dir) == [1] and mgr.latest_in_memory().step == 1
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
            covered = sum(_copy_overlap(dst, (d_off, 0), s, (o, 0), tuple(s.shape)) for s, o in zip(src, offsets))
            assert covered == dst.numel()
        assert torch.equal(torch.cat(dst_chunks), full)
