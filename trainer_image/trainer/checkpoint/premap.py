"""A rank's node-local snapshot slots mapped and page-locked ahead of an in-job restart, by the warm standby that
will become the restarted worker (``trainer/startup/standby.py``, knob ``resiliency.standby_premap``).

A respawned worker restores from the slots its dead predecessor left in ``/dev/shm``. Copying 18 GB of a fresh
mapping to the GPU is bounded by page-locking it (``cudaHostRegister`` faults in and pins every page: ~1.4 s for
18 GB on H200), which also holds the CUDA driver beside the restore's warm-up (``restore`` 3-4 s against a 0.35 s
pinned copy). A standby is the same process as the worker it becomes (it runs the trainer's ``main`` after the
handoff), so mappings it makes are the worker's: while it waits, a ``Premapper`` thread maps the slot files named in
the worker's first-step marker and registers them in ``chunked.CHUNK_BYTES`` chunks (the restore's own chunks),
at the lowest priority, pausing after each. The files are the live worker's slots (``MAP_SHARED``: the same pages,
no extra memory), so the mapping always shows what the worker last wrote.

At the handoff the thread stops (``stop``), and ``SnapshotStore.discover`` takes a file's mapping (``take``) when it
is still the same file (device, inode, size); the restore then copies at once from the chunks already locked and
locks the rest. A file that changed or vanished is unregistered and unmapped; so is what no slot took, once
``discover`` is done (``release_all``)."""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from trainer.checkpoint import chunked

POLL_S = 2.0
"""How often the standby looks at the slot files again (new, resized, replaced or removed, the newest snapshot's)."""
PAUSE_FACTOR = 1.0
"""After page-locking a chunk, the thread sleeps this many times as long as the chunk took."""

_REGISTRY: dict[str, Premapped] = {}
_LOCK = threading.Lock()
TAKEN: list[int] = []
"""Bytes of each mapping ``take`` handed over in this process (a restore that copies at once)."""


@dataclass
class Premapped:
    """One slot file's mapping and the addresses of its chunks page-locked so far (in order from its start)."""

    identity: tuple[int, int, int]
    """(st_dev, st_ino, st_size) of the file when it was mapped."""
    buffer: torch.Tensor
    chunks: list[int] = field(default_factory=list)

    @property
    def locked_bytes(self) -> int:
        return min(len(self.chunks) * chunked.CHUNK_BYTES, self.buffer.numel())


def identity(path: str) -> tuple[int, int, int] | None:
    """The file's (device, inode, size); None when it is missing or empty (a slot not reserved yet)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size) if st.st_size > 0 else None


def take(path: str | os.PathLike, nbytes: int, unregister: Callable[[int], None] | None = None) -> Premapped | None:
    """The standby's mapping of ``path`` for a slot of ``nbytes``, if it is still that file; the caller owns its
    registered chunks from now on. Otherwise None (a stale mapping is unregistered and dropped)."""
    with _LOCK:
        entry = _REGISTRY.pop(str(path), None)
    if entry is None:
        return None
    if entry.identity == identity(str(path)) and entry.buffer.numel() == nbytes:
        TAKEN.append(entry.locked_bytes)
        return entry
    _drop(entry, unregister)
    return None


def adopt(path: str | os.PathLike, layout: dict[str, tuple[str, int, tuple[int, ...]]],
          nbytes: int) -> Premapped | None:
    """The standby's mapping of a slot file that holds no snapshot (no header: the dead worker's copy into it was cut
    off), for the slot to keep as its empty buffer with the chunks already page-locked: the next snapshot into it
    locks nothing. Released instead, the worker locked it again after its first step, holding the CUDA driver under
    its first steps for seconds (BENCHMARKS.md, "Recovery per layer"). The bytes outside ``layout``'s tensors are
    zeroed: the slot's checksum counts them. None where the standby did not map the file, or it is too small."""
    now = identity(str(path))
    entry = take(path, now[2]) if now is not None else None
    if entry is None or entry.buffer.numel() < nbytes:
        if entry is not None:
            _drop(entry, None)
        return None
    end = 0
    for start, stop in sorted((offset, offset + getattr(torch, dtype).itemsize * math.prod(shape))
                              for dtype, offset, shape in layout.values()):
        entry.buffer[end:max(end, start)].zero_()
        end = max(end, stop)
    entry.buffer[end:].zero_()
    return entry


def release_all(unregister: Callable[[int], None] | None = None) -> None:
    """Unregister and unmap whatever was not taken (a standby that ends unused, or a restore that did not use it)."""
    with _LOCK:
        entries = list(_REGISTRY.values())
        _REGISTRY.clear()
    for entry in entries:
        _drop(entry, unregister)


def _drop(entry: Premapped, unregister: Callable[[int], None] | None) -> None:
    for address in entry.chunks:
        (unregister or chunked.cuda_unregister)(address)
    entry.chunks = []


def newest_first(paths: list[str]) -> list[str]:
    """Slot files by their snapshots, the newest first (its header, ``.meta`` beside the ``.data``, written last),
    then those without one (being restaged): a takeover restores the newest snapshot, and its copy is quick only
    from chunks already page-locked, so those are locked first."""
    def published(path: str) -> float:
        try:
            return os.stat(str(Path(path).with_suffix(".meta"))).st_mtime
        except OSError:
            return -math.inf

    return sorted(paths, key=published, reverse=True)


class Premapper:
    """Keeps ``paths`` mapped and page-locked in a background thread until ``stop``."""

    def __init__(self, paths: list[str], register: Callable[[int, int], bool] = chunked.cuda_register,
                 unregister: Callable[[int], None] = chunked.cuda_unregister, poll_s: float = POLL_S,
                 thread_init: Callable[[], None] = lambda: None) -> None:
        self.paths = [str(p) for p in paths]
        self.register, self.unregister, self.poll_s = register, unregister, poll_s
        self.thread_init = thread_init
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refused = ""
        """Why the driver refused to page-lock a chunk (then the thread ends; the restore locks them itself)."""

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="standby-premap", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop after the chunk being locked (the handoff: the worker's restore may start right after)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def locked_bytes(self) -> int:
        with _LOCK:
            entries = [_REGISTRY[p] for p in self.paths if p in _REGISTRY]
        return sum(e.locked_bytes for e in entries)

    def _run(self) -> None:
        try:
            os.nice(19)  # this thread only (Linux): it never competes with the worker it may replace
        except OSError:
            pass
        self.thread_init()
        while not self._stop.is_set() and not self.refused:
            for path in newest_first(self.paths):
                if self._stop.is_set() or self.refused:
                    break
                self.refresh(path)
            self._stop.wait(self.poll_s)

    def refresh(self, path: str) -> None:
        """Map ``path`` again if it changed, and page-lock its next chunks until it is whole (or ``stop``)."""
        now = identity(path)
        with _LOCK:
            entry = _REGISTRY.get(path)
            if entry is not None and entry.identity != now:
                del _REGISTRY[path]
        if entry is not None and entry.identity != now:
            _drop(entry, self.unregister)
            entry = None
        if now is None:
            return
        if entry is None and not chunked.memory_backed(Path(path).parent):
            self.refused = f"{Path(path).parent} is not on a memory file system"  # the driver would refuse and
            return                                                               # leave a CUDA error behind
        if entry is None:
            try:
                buffer = torch.from_file(path, shared=True, size=now[2], dtype=torch.uint8)
            except (OSError, RuntimeError):  # removed meanwhile: the next poll sees it gone
                return
            entry = Premapped(now, buffer)
            with _LOCK:
                _REGISTRY[path] = entry
        base, nbytes = entry.buffer.data_ptr(), entry.buffer.numel()
        while not self._stop.is_set():
            start = len(entry.chunks) * chunked.CHUNK_BYTES
            if start >= nbytes:
                return
            began = time.perf_counter()
            if not self.register(base + start, min(chunked.CHUNK_BYTES, nbytes - start)):
                self.refused = f"the driver refused to page-lock {path}"
                return
            entry.chunks.append(base + start)  # ``take`` runs only after ``stop`` has joined this thread
            self._stop.wait(PAUSE_FACTOR * (time.perf_counter() - began))
