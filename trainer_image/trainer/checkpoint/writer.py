"""The persistent tier's writer: one rank's shard file, written from a snapshot slot in the NVRx
``AsyncCallsQueue`` background process (or inline for synchronous saves). It maps the slot file itself (no
tensor crosses a queue), writes ``<file>.partial`` (hashing and flushing to the disk while it writes), fsyncs,
renames, and reports its outcome (size, chunk digests, or the error) through a small shared-memory buffer. It
never raises. Its owner can cancel a write in flight (``Writer.cancel``): it stops between chunks."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import torch
from nvidia_resiliency_ext.checkpointing.async_ckpt import core as nvrx_async
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest, PersistentAsyncCaller

from trainer.startup import forkserver

from trainer.checkpoint.layout import CHUNK_BYTES, PARTIAL_SUFFIX
from trainer.checkpoint.slots import Layout, map_file, map_views

log = logging.getLogger(__name__)

REPORT_BYTES = 64 * 1024
"""Shared-memory buffer through which the writer process reports its outcome (JSON, length-prefixed)."""
_ORPHAN_CHECK_S = 0.5
_EXIT_ORPHANED = 3
_POLL_S = 0.005
FLUSH_BYTES = 256 * 2**20
"""A write starts flushing to the disk in the background every this many bytes (``HashingWriter``)."""
WRITE_HASH_THREADS = max(1, min(4, os.cpu_count() or 1))

FAULT_ENV = "TRAINER_CKPT_TEST_FAULT"
"""Test hook read at each persistent save and passed to the writer: ``slow_write:<seconds>`` (sleep after the
first bytes of a shard are written, so a test can kill mid-write, or a slow disk stalls a save), ``enospc`` (the
first write raises ENOSPC) or ``torch_short_write`` (torch's zip writer fails as it does on a full disk, without an
errno), optionally ``@<step>`` to affect only that step; several separated by commas (``slow_write:3,slow_write:8@10``:
every write stalls 3 s, step 10's 8 s). Unset in production."""


def test_fault(step: int) -> str:
    """The ``FAULT_ENV`` hook for this step: the fault named for this step (``<fault>@<step>``), else the first one
    named for every step (``<fault>``); empty when there is none."""
    every = ""
    for spec in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        fault, _, only_step = spec.partition("@")
        if not only_step:
            every = every or fault
        elif int(only_step) == step:
            return fault
    return every


class WriteCancelled(Exception):
    """The owner cancelled this write (a newer state supersedes it: the final save)."""


def _sha256(data: memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


class HashingWriter:
    """File wrapper for ``torch.save``. Writes in ``CHUNK_BYTES`` pieces and hashes every ``CHUNK_BYTES`` chunk of
    the file (``chunk_sha256``) in a thread pool while the next pieces are written (hashlib and file writes release
    the GIL: hashing no longer adds to the write's time). Every ``FLUSH_BYTES`` it starts flushing what was written
    to the disk in a background thread, so dirty pages stay bounded (the final fsync, and a cancel, never wait
    for gigabytes) and the written pages leave the page cache. Between pieces it stops when ``cancel[0]`` is set.

    torch's zip writer replaces any exception of ``write`` with its own "unexpected pos" error: the first one
    raised here is kept in ``error`` so the caller can raise it instead (an ENOSPC keeps its errno)."""

    def __init__(self, f: BinaryIO, fault: str = "", cancel: torch.Tensor | None = None,
                 threads: int = WRITE_HASH_THREADS) -> None:
        self.f, self.fault, self.cancel, self.size = f, fault, cancel, 0
        self.error: BaseException | None = None
        self._digests: list[str | Future[str]] = []
        self._partial: Any = None
        self._filled = 0
        self._hashers = ThreadPoolExecutor(threads, thread_name_prefix="ckpt-hash")
        self._flusher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-flush")
        self._flushing: Future[None] | None = None
        self._unflushed = 0

    def write(self, data: bytes | memoryview) -> int:
        try:
            return self._write(memoryview(data).cast("B"))
        except BaseException as exc:
            self.error = self.error or exc
            raise

    def _write(self, view: memoryview) -> int:
        if self.fault == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if self.fault == "torch_short_write" and self.size:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4160 vs 4096")
        pending = self._hash(view)
        try:
            for start in range(0, len(view), CHUNK_BYTES):
                self._check_cancel()
                piece = view[start : start + CHUNK_BYTES]
                self.f.write(piece)
                self.size += len(piece)
                self._unflushed += len(piece)
                if self._unflushed >= FLUSH_BYTES:
                    self._flush_behind()
                if self.fault.startswith("slow_write:"):
                    self._stall(float(self.fault.split(":", 1)[1]))  # test hook: a writer caught mid-file
                    self.fault = ""
        finally:
            for future in pending:  # the caller's buffer is only valid during this call
                future.result()
        return len(view)

    def _hash(self, view: memoryview) -> list[Future[str]]:
        """Hash the file's chunks that ``view`` completes: whole ones in the pool, the ends here (at most one chunk)."""
        pos, pending = 0, []
        if self._filled:
            pos = min(len(view), CHUNK_BYTES - self._filled)
            self._partial.update(view[:pos])
            self._filled += pos
            if self._filled == CHUNK_BYTES:
                self._digests.append(self._partial.hexdigest())
                self._partial, self._filled = None, 0
        while len(view) - pos >= CHUNK_BYTES:
            pending.append(self._hashers.submit(_sha256, view[pos : pos + CHUNK_BYTES]))
            self._digests.append(pending[-1])
            pos += CHUNK_BYTES
        if pos < len(view):
            self._partial, self._filled = hashlib.sha256(view[pos:]), len(view) - pos
        return pending

    def _check_cancel(self) -> None:
        if self.cancel is not None and int(self.cancel[0]):
            raise WriteCancelled("cancelled by its owner")

    def _stall(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._check_cancel()
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _flush_behind(self) -> None:
        """Start writing what is in the page cache to the disk; at most one flush runs, so the dirty pages this file
        holds stay below about 2 x ``FLUSH_BYTES``."""
        if self._flushing is not None:
            self._flushing.result()
        self.f.flush()
        upto, fd = self.size, self.f.fileno()
        self._flushing = self._flusher.submit(_flush, fd, upto)
        self._unflushed = 0

    def finish(self) -> list[str]:
        """Wait for the background hashing and flushing; the chunk digests, in file order."""
        if self._flushing is not None:
            self._flushing.result()
        if self._filled:
            self._digests.append(self._partial.hexdigest())
            self._partial, self._filled = None, 0
        return [d if isinstance(d, str) else d.result() for d in self._digests]

    def close(self) -> None:
        self._hashers.shutdown(wait=True)
        self._flusher.shutdown(wait=True)

    def flush(self) -> None:
        self.f.flush()


def _flush(fd: int, upto: int) -> None:
    os.fdatasync(fd)
    if hasattr(os, "posix_fadvise"):  # written pages are not read again here: leave the page cache to others
        os.posix_fadvise(fd, 0, upto, os.POSIX_FADV_DONTNEED)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _without_crc32() -> Iterator[None]:
    """torch.save's per-record CRC32 is a serial pass over every byte (~1.7 GB/s: 10 s for an 18 GB shard); the
    chunk digests already cover the file, and torch.load reads records without it."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def atomic_torch_save(obj: Any, path: Path, fault: str = "", cancel: torch.Tensor | None = None) -> tuple[int, list[str]]:
    """``torch.save`` to ``<path>.partial``, fsync, rename, fsync the directory; returns (bytes, chunk digests).
    Raises ``WriteCancelled`` when ``cancel[0]`` was set, the error of the write itself when one failed."""
    tmp = path.with_name(path.name + PARTIAL_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            writer = HashingWriter(f, fault, cancel)
            try:
                with _without_crc32():
                    torch.save(obj, writer)  # type: ignore[arg-type]
                f.flush()
                digests = writer.finish()
                os.fsync(f.fileno())
            except BaseException as exc:
                if writer.error is not None and writer.error is not exc:
                    raise writer.error from exc  # torch's writer hides it behind "unexpected pos"
                raise
            finally:
                writer.close()
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write frees its space at once
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return writer.size, digests


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + PARTIAL_SUFFIX)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


_watchdog_started = False


def _exit_when_orphaned() -> None:
    """In the writer process: exit when the trainer that owns it dies (SIGKILL leaves no one to say DONE).

    The writer ignores SIGTERM/SIGINT: on preemption ft_launcher signals each worker's whole process group, and
    the trainer's final checkpoint needs this writer alive to finish. It is stopped by its owner (DONE, or
    SIGKILL) or by this watchdog when the owner is gone."""
    global _watchdog_started
    if _watchdog_started:
        return
    _watchdog_started = True
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # FT: preemption must not kill an in-flight save
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent, owner = os.getppid(), multiprocessing.parent_process()
    if owner is not None and owner.pid != parent:  # forked by the node's fork server: the owner's pipe tells
        owner_alive = owner.is_alive
    else:
        owner_alive = lambda: os.getppid() == parent  # noqa: E731

    def watch() -> None:
        while owner_alive():
            time.sleep(_ORPHAN_CHECK_S)
        os._exit(_EXIT_ORPHANED)

    threading.Thread(target=watch, name="ckpt-orphan-watchdog", daemon=True).start()


def write_shard(data_path: str, nbytes: int, layout: Layout, payload: dict[str, Any], path: str,
                report: torch.Tensor, fault: str = "", cancel: torch.Tensor | None = None,
                background: bool = True) -> None:
    """Write one rank's shard file atomically from its snapshot slot; report ``{"ok", "bytes", "chunk_sha256"}``
    or the error (``"cancelled": True`` when its owner cancelled it)."""
    if background:
        _exit_when_orphaned()
    started = time.perf_counter()
    try:
        if cancel is not None and int(cancel[0]):  # cancelled before this process got to it
            raise WriteCancelled("cancelled by its owner")
        views = map_views(map_file(Path(data_path), nbytes), layout)
        size, digests = atomic_torch_save({**payload, "tensors": views}, Path(path), fault, cancel)
        result: dict[str, Any] = {"ok": True, "bytes": size, "chunk_bytes": CHUNK_BYTES, "chunk_sha256": digests}
    except WriteCancelled:
        result = {"ok": False, "cancelled": True, "error": "cancelled: a newer checkpoint supersedes it"}
    except Exception as exc:  # reported to every rank at commit; never kill the persistent writer
        result = {"ok": False, "errno": getattr(exc, "errno", None), "error": f"{type(exc).__name__}: {exc}"}
    result["write_s"] = round(time.perf_counter() - started, 4)
    put_report(report, result)


def writer_ready() -> None:
    """The request that starts the writer process ahead of the first write (``Writer.start``): by the time it runs,
    the process has imported torch, NVRx and this module; from now on it survives a preemption's SIGTERM and exits
    when its trainer dies."""
    _exit_when_orphaned()


def put_report(report: torch.Tensor, result: dict[str, Any]) -> None:
    data = json.dumps(result).encode()
    if len(data) > REPORT_BYTES - 8:
        data = json.dumps({"ok": False, "error": "writer report too large"}).encode()
    report[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    report[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)


def take_report(report: torch.Tensor) -> dict[str, Any] | None:
    n = int.from_bytes(bytes(report[:8].tolist()), "little")
    if n == 0:
        return None
    result = json.loads(bytes(report[8 : 8 + n].tolist()))
    report[:8] = 0
    return result


class Writer:
    """The background writer process (NVRx ``AsyncCallsQueue``, persistent), one write at a time."""

    def __init__(self) -> None:
        self._queue: AsyncCallsQueue | None = None
        self._report = torch.zeros(REPORT_BYTES, dtype=torch.uint8).share_memory_()
        self._cancel = torch.zeros(8, dtype=torch.uint8).share_memory_()
        self.busy = False

    def start(self) -> None:
        """Start the background process now (a collective-free no-op request), so the first persistent write does
        not wait for it to start while its snapshot slot stays locked. Idempotent."""
        if self._queue is None:
            self._queue = self._new_queue()
            self._queue.schedule_async_request(AsyncRequest(writer_ready, (), []))

    @staticmethod
    def _new_queue() -> AsyncCallsQueue:
        """NVRx's persistent queue; its process forked by the node's fork server (``trainer/startup/forkserver.py``:
        torch, NVRx and this module already imported, so it is ready in a fraction of a spawn's time), else, without
        one, spawned by NVRx (which imports them)."""
        queue = AsyncCallsQueue(persistent=True)
        if not forkserver.available():
            return queue
        caller = PersistentAsyncCaller()
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        level = logging.getLogger(nvrx_async.__name__).getEffectiveLevel()
        writer = forkserver.Process(target=PersistentAsyncCaller.async_loop, name=f"checkpoint-writer-{rank}",
                                    args=(rank, caller.queue, caller.preload_q, caller.comp_q, level))
        try:
            writer.start()
        except (OSError, EOFError) as exc:  # FT: the server is gone: NVRx spawns the writer as without one
            log.warning("the node's fork server did not fork the checkpoint writer (%s: %s); it starts the "
                        "ordinary way", type(exc).__name__, exc)
            return queue
        caller.process, caller.rank = writer, rank  # NVRx starts a process only where it has none
        queue.persistent_caller = caller
        log.info("checkpoint writer forked by the node's fork server (pid %d)", writer.pid)
        return queue

    def submit(self, data_path: Path, nbytes: int, layout: Layout, payload: dict[str, Any], path: Path,
               fault: str, inline: bool) -> None:
        """Write a shard from a slot: inline (synchronous saves) or in the background process."""
        self._report[:8] = 0
        self._cancel[0] = 0
        args = (str(data_path), nbytes, layout, payload, str(path), self._report, fault, self._cancel)
        if inline:
            write_shard(*args, background=False)
        else:
            if self._queue is None:
                self._queue = self._new_queue()
            # no_dist everywhere: NVRx's own cross-rank checks all-reduce CUDA tensors; ours run at commit on gloo.
            self._queue.schedule_async_request(AsyncRequest(write_shard, args, []))
        self.busy = True

    def poll(self, blocking: bool) -> dict[str, Any] | None:
        """The outcome of the write in flight once it finished (None while it runs; waits when ``blocking``)."""
        while self.busy:
            if self._queue is not None and self._queue.get_num_unfinalized_calls():
                self._queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
            if self._queue is None or not self._queue.get_num_unfinalized_calls():
                self.busy = False
                return take_report(self._report) or {"ok": False, "error": "the writer sent no report"}
            if not self._alive():
                code = self._queue.persistent_caller.process.exitcode  # type: ignore[union-attr]
                self.stop(graceful=False)
                self.busy = False
                return {"ok": False, "writer_died": True,
                        "error": f"the checkpoint writer process died (exit code {code})"}
            if not blocking:
                return None
            time.sleep(_POLL_S)
        return None

    def cancel(self) -> None:
        """Ask the write in flight to stop (between chunks; its partial file is removed); ``poll`` then reports
        ``cancelled``, or the outcome when it had finished first."""
        self._cancel[0] = 1

    def _alive(self) -> bool:
        caller = self._queue.persistent_caller if self._queue is not None else None
        return caller is not None and caller.process is not None and caller.process.is_alive()

    def stop(self, graceful: bool) -> None:
        if self._queue is None:
            return
        queue, self._queue = self._queue, None
        if graceful and not self.busy:
            with contextlib.suppress(Exception):  # the start request, if done: then the process is idle
                queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
        caller = queue.persistent_caller
        if caller is None or caller.process is None:
            return
        if caller.process.pid is None:
            # its start failed (spawn: EAGAIN, ENOMEM): nothing to stop, and that error is the one to report (NVRx's
            # close() would wait forever for a worker that never ran)
            caller.process = None
            return
        if graceful and caller.process.is_alive() and not queue.get_num_unfinalized_calls():
            caller.close()  # sends DONE and joins
            return
        caller.process.kill()  # it ignores SIGTERM (see _exit_when_orphaned)
        caller.process.join(timeout=10)
        caller.process = None  # NVRx's close()/__del__ would wait forever on a dead worker's queue
