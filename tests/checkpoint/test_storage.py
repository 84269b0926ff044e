"""Checkpoint storage faults and unloadable shards are permanent, one clear line, and lose nothing.

Disk-full cases run on a real size-limited filesystem (a tmpfs mounted with ``size=``); where mounting is not
allowed they are skipped with that reason, and the injected-ENOSPC tests in test_manager.py still run."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch

from statelib import (  # noqa: F401 - pg
    assert_equal, disk_only, make_state, manager, pg, save_two_steps, snapshot, train_step,
)
from trainer.checkpoint import (
    MANIFEST, CheckpointError, CheckpointStorageError, committed_steps, find_valid_checkpoint, is_disk_full,
    load_model_weights, step_dir_name,
)
from trainer.checkpoint.layout import CHUNK_BYTES
from trainer.checkpoint.writer import atomic_torch_save
from trainer.exitcodes import ExitCode, classify


@pytest.fixture
def small_fs(tmp_path):
    """``small_fs(bytes)`` mounts a tmpfs of that size and returns its path; unmounted after the test."""
    mounts: list[Path] = []

    def mount(size: int) -> Path:
        path = tmp_path / f"fs{len(mounts)}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a size-limited tmpfs here ({done.stderr.strip()}); the injected-fault "
                        "variants in test_manager.py cover disk full")
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _ballast(directory: Path, leave: int) -> None:
    """Fill the filesystem until ``leave`` bytes are free."""
    free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
    with open(directory / "ballast", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


def _listing(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()}


def test_checkpoint_dir_that_is_a_file_fails_at_start(tmp_path, pg):
    (tmp_path / "ckpt").write_text("not a directory")
    with pytest.raises(CheckpointStorageError, match="is a file, not a directory") as err:
        manager(tmp_path)
    assert classify(err.value) == ExitCode.CHECKPOINT_ERROR and "\n" not in str(err.value)
    assert (tmp_path / "ckpt").read_text() == "not a directory"


def test_checkpoint_dir_under_a_file_fails_at_start(tmp_path, pg):
    (tmp_path / "parent").write_text("x")
    with pytest.raises(CheckpointStorageError, match="cannot be created"):
        from trainer.checkpoint import CheckpointManager
        from trainer.config import CheckpointConfig
        from trainer.parallel import DistEnv

        CheckpointManager(CheckpointConfig(), tmp_path / "parent" / "ckpt", DistEnv(0, 1, 0, 1), "{}")


def test_read_only_checkpoint_dir_fails_at_start(small_fs, pg, tmp_path):
    fs = small_fs(1 << 20)
    (fs / "ckpt").mkdir()
    (fs / "ckpt" / "keep-me").write_text("data")
    subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
    with pytest.raises(CheckpointStorageError, match="not writable") as err:
        manager(fs)
    assert "checkpoint.dir" in str(err.value)
    assert (fs / "ckpt" / "keep-me").read_text() == "data"


def test_too_little_room_for_what_retention_keeps_fails_at_start(small_fs, pg):
    fs = small_fs(256 * 1024)  # one micro checkpoint is ~240 KB; keep=3 needs three
    mgr = manager(fs, keep=3, node_local_dir=str(fs.parent / "node"))
    try:
        with pytest.raises(CheckpointStorageError, match=r"disk full: .* free .* need") as err:
            mgr.load_latest(make_state())
        assert classify(err.value) == ExitCode.CHECKPOINT_ERROR
    finally:
        mgr.close(job_over=True)


def test_retention_makes_room_before_a_save_and_keeps_the_newest(small_fs, pg, caplog):
    fs = small_fs(700 * 1024)  # room for two checkpoints, not three
    state = make_state()
    mgr = manager(fs, keep=2, node_local_dir=str(fs.parent / "node"))
    try:
        mgr.load_latest(state)
        for step in (1, 2, 3):
            train_step(state, step)
            mgr.save(step, state, last_step=True)
        assert committed_steps(mgr.dir) == [2, 3]
        assert "to make room for the next checkpoint" in caplog.text
        assert load_model_weights(mgr.dir).keys()
    finally:
        mgr.close(job_over=True)


def test_disk_full_mid_run_is_exit_4_with_free_and_needed_bytes(small_fs, pg):
    fs = small_fs(2 << 20)
    state = make_state()
    mgr = manager(fs, keep=2, node_local_dir=str(fs.parent / "node"))
    try:
        mgr.load_latest(state)
        train_step(state, 1)
        mgr.save(1, state, last_step=True)
        _ballast(fs, leave=64 * 1024)
        before = _listing(mgr.dir)
        train_step(state, 2)
        with pytest.raises(CheckpointStorageError, match=r"disk full: .* has 0\.\d+ GiB free, a checkpoint needs") as err:
            mgr.save(2, state, last_step=True)
        assert "step-00000001" in str(err.value) and "\n" not in str(err.value)
        assert _listing(mgr.dir) == before  # nothing deleted or changed, no partial save left
    finally:
        mgr.close(job_over=True)


def test_torch_writer_failing_on_a_full_disk_is_recognised(small_fs):
    fs = small_fs(128 * 1024)
    big = {"t": torch.arange(200_000, dtype=torch.float32)}  # 800 KB: does not fit
    with pytest.raises(BaseException) as err:
        atomic_torch_save(big, fs / "shard.pt")
    assert is_disk_full(err.value), repr(err.value)
    assert not list(fs.iterdir())  # the partial file is removed at once


def test_node_local_dir_too_small_is_a_clear_error_not_a_crash(small_fs, pg, tmp_path):
    shm = small_fs(64 * 1024)  # like docker's default /dev/shm, far too small for the state
    state = make_state()
    mgr = manager(tmp_path, node_local_dir=str(shm))
    try:
        train_step(state, 1)
        with pytest.raises(CheckpointStorageError, match=r"node-local snapshot directory .* has no room .*memory_slots"):
            mgr.save(1, state)
        assert committed_steps(mgr.dir) == []
    finally:
        mgr.close(job_over=True)


# ---- shards that verify but must not be loaded ----------------------------------------------------------------
class _Payload:
    """Unpickling this would create the marker file: a weights-only load must refuse it without running it."""

    marker = ""

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _replace_newest_shard(directory: Path, content: bytes) -> None:
    """Swap the newest checkpoint's shard for ``content`` and make the manifest match it (size and digests)."""
    step_dir = directory / step_dir_name(committed_steps(directory)[-1])
    shard = next(step_dir.glob("shard-*.pt"))
    shard.write_bytes(content)
    manifest = json.loads((step_dir / MANIFEST).read_text())
    entry = manifest["shards"][0]
    entry["bytes"] = len(content)
    entry["chunk_sha256"] = [hashlib.sha256(content[i:i + CHUNK_BYTES]).hexdigest()
                             for i in range(0, max(len(content), 1), CHUNK_BYTES)]
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


def _pickle_with_code(marker: Path, tmp_path: Path) -> bytes:
    _Payload.marker = str(marker)
    path = tmp_path / "evil.pt"
    torch.save({"tensors": {}, "payload": _Payload()}, path)
    return path.read_bytes()


@pytest.mark.parametrize("kind", ["pickle-with-code", "not-a-zip"])
def test_a_shard_weights_only_refuses_is_quarantined_and_the_previous_one_used(tmp_path, pg, caplog, kind):
    marker = tmp_path / "code-ran"
    state = make_state()
    mgr = manager(tmp_path, async_save=False)
    try:
        at_step_1 = save_two_steps(mgr, state)
        content = _pickle_with_code(marker, tmp_path) if kind == "pickle-with-code" else b"\x00raw bytes" * 1000
        _replace_newest_shard(mgr.dir, content)
        # Evaluation (read-only): skips it with a warning, changes nothing.
        step_dir, _ = find_valid_checkpoint(mgr.dir)
        assert step_dir.name == "step-00000001" and (mgr.dir / "step-00000002").is_dir()
        disk_only(mgr)
        restored = make_state(seed=4)
        assert mgr.load_latest(restored) == 1
        assert (mgr.dir / "step-00000002.corrupt-unloadable").is_dir()
        errors = " ".join(r.getMessage() for r in caplog.records if r.levelname == "ERROR")
        assert "weights_only=False" not in errors.replace("never be loaded with weights_only=False", "")
        assert not marker.exists()  # the code in the pickle never ran
        assert_equal(snapshot(restored), at_step_1)
    finally:
        mgr.close(job_over=True)


def test_no_loadable_checkpoint_left_is_exit_4(tmp_path, pg):
    state = make_state()
    mgr = manager(tmp_path, async_save=False)
    try:
        train_step(state, 1)
        mgr.save(1, state)
        _replace_newest_shard(mgr.dir, pickle.dumps({"x": 1}))
        disk_only(mgr)
        with pytest.raises(CheckpointError, match="unloadable") as err:
            mgr.load_latest(make_state())
        assert classify(err.value) == ExitCode.CHECKPOINT_ERROR
    finally:
        mgr.close(job_over=True)


def test_retention_deletes_in_the_background_and_the_commit_does_not_wait(tmp_path, pg, monkeypatch):
    """Deleting a superseded 17 GB checkpoint takes seconds, which every rank would spend waiting at the commit.
    Retention renames it out of the namespace and deletes it in a thread: here the delete is held until the
    saves are done, and the saves neither wait for it nor see the doomed directory as a checkpoint."""
    import shutil
    import threading

    from trainer.checkpoint import storage
    from trainer.checkpoint.layout import REMOVING_INFIX

    release, real_rmtree = threading.Event(), shutil.rmtree

    def held_rmtree(path, *args, **kwargs):
        if REMOVING_INFIX in Path(path).name:
            assert release.wait(30), "the test never released the removal"
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", held_rmtree)
    state = make_state()
    mgr = manager(tmp_path, keep=1)
    try:
        mgr.load_latest(state)
        for step in (1, 2, 3):
            train_step(state, step)
            mgr.save(step, state, last_step=True)  # returns with the removals of steps 1 and 2 still held
        assert committed_steps(mgr.dir) == [3]
        doomed = sorted(p.name.split(REMOVING_INFIX)[0] for p in mgr.dir.glob(f"step-*{REMOVING_INFIX}*"))
        assert doomed == [step_dir_name(1), step_dir_name(2)]
        assert find_valid_checkpoint(mgr.dir)[0].name == step_dir_name(3)
        release.set()
        storage.wait_for_removals()
        assert sorted(p.name for p in mgr.dir.iterdir()) == [step_dir_name(3)]
    finally:
        release.set()
        mgr.close()


def test_a_removal_cut_short_by_a_crash_is_finished_by_the_next_start(tmp_path, pg):
    from trainer.checkpoint import storage
    from trainer.checkpoint.layout import REMOVING_INFIX

    state = make_state()
    mgr = manager(tmp_path)
    try:
        mgr.load_latest(state)
        train_step(state, 1)
        mgr.save(1, state, last_step=True)
    finally:
        mgr.close()
    leftover = mgr.dir / f"{step_dir_name(0)}{REMOVING_INFIX}0badc0de"  # what a SIGKILL mid-delete leaves
    (leftover / "sub").mkdir(parents=True)
    (leftover / "sub" / "shard.pt").write_bytes(b"x" * 4096)
    again = manager(tmp_path)
    try:
        assert again.load_latest(make_state()) == 1
        storage.wait_for_removals()
        assert not leftover.exists() and committed_steps(again.dir) == [1]
    finally:
        again.close()
