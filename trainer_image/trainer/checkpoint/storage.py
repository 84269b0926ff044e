"""The persistent tier's storage: start-up checks, free space, and making room before a save.

Every problem is a ``CheckpointStorageError`` (exit CHECKPOINT_ERROR) whose one line says what to change."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import uuid
from pathlib import Path

from trainer.checkpoint.errors import CheckpointStorageError
from trainer.checkpoint.layout import REMOVING_INFIX, committed_steps, step_dir_name

log = logging.getLogger(__name__)

SIZE_MARGIN = 1.02
"""A shard file is its tensors plus a little zip and pickle overhead."""


_removals: list[threading.Thread] = []


def remove_in_background(path: Path) -> None:
    """Take ``path`` out of the checkpoint namespace at once (a rename to ``<name>.removing-<id>``, which no reader
    takes for a checkpoint), then delete it in a daemon thread. Deleting a 17 GB checkpoint took 5.1 s on the H200
    machine's disk, with every rank waiting at the commit that applied retention; the rename takes microseconds.
    A process that dies mid-delete leaves the renamed directory, which the next start removes the same way."""
    # FT: a rename is atomic; the delete can be interrupted at any point without leaving a half checkpoint
    doomed = path if REMOVING_INFIX in path.name else path.with_name(f"{path.name}{REMOVING_INFIX}{uuid.uuid4().hex[:8]}")
    try:
        if doomed != path:
            os.rename(path, doomed)
    except FileNotFoundError:
        return
    except OSError as exc:  # e.g. a read-only parent: delete in place, as before
        log.warning("could not rename %s for removal (%s); removing it in place", path, os.strerror(exc.errno or 0))
        shutil.rmtree(path, ignore_errors=True)
        return
    thread = threading.Thread(target=shutil.rmtree, args=(doomed,), kwargs={"ignore_errors": True},
                              name="checkpoint-remove", daemon=True)
    _removals[:] = [t for t in _removals if t.is_alive()] + [thread]
    thread.start()


def wait_for_removals() -> None:
    """Block until every background removal of this process has finished (before measuring free space, at close)."""
    for thread in list(_removals):
        thread.join()
    _removals[:] = [t for t in _removals if t.is_alive()]


def remove_leftovers(directory: Path) -> None:
    """Directories a previous process took out of the namespace but did not finish deleting."""
    for path in directory.glob(f"step-*{REMOVING_INFIX}*") if directory.is_dir() else []:
        remove_in_background(path)


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def check_directory(directory: Path, rank: int) -> None:
    """The checkpoint directory exists or can be created, is a directory, and this rank can write to it."""
    where = f"checkpoint.dir {str(directory)!r}"
    if directory.exists() and not directory.is_dir():
        raise CheckpointStorageError(f"{where} is a file, not a directory: point checkpoint.dir at a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise CheckpointStorageError(f"{where} cannot be created: a parent of it is a file; point checkpoint.dir "
                                     "at a directory") from None
    except OSError as exc:
        raise CheckpointStorageError(f"{where} cannot be created ({os.strerror(exc.errno or 0)}): create it, or "
                                     "point checkpoint.dir at a writable volume") from None
    probe = directory / f".write-probe-{rank}-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"ok")
        probe.unlink()
    except OSError as exc:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
        reason = "disk full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else os.strerror(exc.errno or 0)
        raise CheckpointStorageError(f"{where} is not writable by this process ({reason}, uid {os.getuid()}): fix "
                                     "its permissions or mount, or point checkpoint.dir at a writable volume") from None


def directory_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def room_problem(directory: Path, save_bytes: int, keep: int) -> str:
    """'' when there is room for what retention keeps: ``keep`` checkpoints of ``save_bytes`` each, counting the
    space the committed checkpoints already there hold (retention frees it before a save when it must)."""
    free = shutil.disk_usage(directory).free
    existing = sum(directory_bytes(directory / step_dir_name(s)) for s in committed_steps(directory))
    needed = int(save_bytes * SIZE_MARGIN) * keep
    if free + existing < needed:
        return (
            f"disk full: checkpoint.dir {str(directory)!r} has {gib(free)} free (+{gib(existing)} in committed "
            f"checkpoints) but checkpoint.keep={keep} checkpoints of {gib(save_bytes)} need {gib(needed)}: free "
            "space there, lower checkpoint.keep (>= 2), or point checkpoint.dir at a larger volume"
        )
    return ""


def make_room(directory: Path, save_bytes: int) -> str:
    """Before a save (rank 0): delete the oldest committed checkpoints, never the newest, until one save fits.
    Returns '' when it fits, else the disk-full message (the save is then reported failed on every rank)."""
    needed = int(save_bytes * SIZE_MARGIN)
    free = shutil.disk_usage(directory).free
    if free < needed:  # space being freed in the background counts before anything more is deleted
        wait_for_removals()
        free = shutil.disk_usage(directory).free
    steps = committed_steps(directory)
    while free < needed and len(steps) > 1:
        oldest = directory / step_dir_name(steps.pop(0))
        shutil.rmtree(oldest, ignore_errors=True)
        log.warning("retention: removed %s to make room for the next checkpoint (%s free, %s needed)",
                    oldest, gib(free), gib(needed))
        free = shutil.disk_usage(directory).free
    if free < needed:
        return disk_full_message(directory, needed, free)
    return ""


def disk_full_message(directory: Path, needed: int, free: int | None = None) -> str:
    if free is None:
        free = shutil.disk_usage(directory).free
    return (f"disk full: checkpoint.dir {str(directory)!r} has {gib(free)} free, a checkpoint needs {gib(needed)}; "
            "free space there or point checkpoint.dir at a larger volume (the newest checkpoint is kept)")
