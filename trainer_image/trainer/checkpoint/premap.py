"""A rank's node-local snapshot slots mapped and page-locked ahead of an in-job restart, by the warm standby that
will become the restarted worker (``trainer/startup/standby.py``, knob ``resiliency.standby_premap``).

A respawned worker restores from the slots its dead predecessor left in ``/dev/shm``. Copying 18 GB of a fresh
mapping to the GPU is bounded by page-locking it (``cudaHostRegister`` faults in and pins every page: ~1.4 s for
18 GB on H200), which also holds the CUDA driver beside the restore's warm-up (``restore`` 3-4 s against a 0.35 s
pinned copy). A standby is the same process as the worker it becomes (it runs the trainer's ``main`` after the
handoff), so mappings it makes are the worker's: while it waits, a ``Premapper`` thread maps the slot files named in
the worker's first-step marker and registers them in ``chunked.CHUNK_BYTES`` chunks (the restore's own chunks),
at the lowest priority, pausing after each, the slot likeliest to hold the newest snapshot at a takeover first
(``lock_order``). The files are the live worker's slots (``MAP_SHARED``: the same pages,
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
"""How often the standby looks at the slot files again once it has locked them all (new, resized, replaced, removed)."""
PAUSE_FACTOR = 1.0
"""After page-locking a chunk, the thread sleeps this many times as long as the chunk took."""
PACE_GUESS = 3 << 30
"""Bytes a second a standby locks, pauses counted, before it has measured its own (``lock_order``)."""

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


def published(path: str) -> float | None:
    """When the snapshot in slot file ``path`` was published (its header, ``.meta`` beside the ``.data``, is written
    last); None while the slot has none (being restaged)."""
    try:
        return os.stat(str(Path(path).with_suffix(".meta"))).st_mtime
    except OSError:
        return None


def lock_order(paths: list[str], lock_s: Callable[[str], float], now: float | None = None) -> list[str]:
    """The order to page-lock slot files in so that, at a takeover, the newest snapshot's slot is the one most likely
    locked: its copy is quick only from chunks already page-locked. The worker restages its slots in turn (the one
    being restaged, then the oldest snapshot's, ..., the newest's last), each holding the newest snapshot for one
    interval (the time between the two newest headers): that is the order, except that the newest snapshot's slot
    goes first where ``lock_s(path)`` (the seconds left to lock it) ends before the next snapshot replaces it."""
    now = time.time() if now is None else now
    stamps = {path: published(path) for path in paths}
    headers = sorted((p for p in paths if stamps[p] is not None), key=lambda p: stamps[p], reverse=True)
    order = [p for p in paths if stamps[p] is None] + headers[::-1]
    if headers:
        newest = headers[0]
        interval = stamps[newest] - stamps[headers[1]] if len(headers) > 1 else math.inf
        if lock_s(newest) <= interval - (now - stamps[newest]):
            order.remove(newest)
            order.insert(0, newest)
    return order


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
        self._pace = PACE_GUESS
        """Bytes a second this thread locks, its pauses counted (``lock_order``'s estimate); a guess until measured."""
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
            for path in self.paths:  # changed or removed files are let go of first
                self.refresh(path, lock=False)
            work = [path for path in lock_order(self.paths, self.lock_s) if self.lock_s(path) > 0]
            locked = self.locked_bytes()
            if work:
                self.refresh(work[0])  # then the order again: the worker may have published meanwhile
            if not work or self.locked_bytes() == locked:  # nothing left, or a file it could not map: the next poll
                self._stop.wait(self.poll_s)

    def lock_s(self, path: str) -> float:
        """Seconds left to page-lock ``path`` at this thread's pace so far (0: locked, or not there)."""
        with _LOCK:
            entry = _REGISTRY.get(path)
        now = identity(path)
        if now is None:
            return 0.0
        left = now[2] if entry is None or entry.identity != now else entry.buffer.numel() - entry.locked_bytes
        return left / self._pace if left > 0 else 0.0

    def refresh(self, path: str, lock: bool = True) -> None:
        """Map ``path`` again if it changed, and page-lock its next chunks until it is whole (or ``stop``); with
        ``lock`` False, only let go of a mapping whose file changed or went."""
        now = identity(path)
        with _LOCK:
            entry = _REGISTRY.get(path)
            if entry is not None and entry.identity != now:
                del _REGISTRY[path]
        if entry is not None and entry.identity != now:
            _drop(entry, self.unregister)
            entry = None
        if now is None or not lock:
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
            took = time.perf_counter() - began
            self._stop.wait(PAUSE_FACTOR * took)
            self._pace = min(chunked.CHUNK_BYTES, nbytes - start) / max(1e-6, (1 + PAUSE_FACTOR) * took)
