"""The persistent tier's writer: one rank's shard file, written from a snapshot slot in the NVRx
``AsyncCallsQueue`` background process (or inline for synchronous saves). It maps the slot file itself (no
tensor crosses a queue), writes ``<file>.partial``, fsyncs, renames, and reports its outcome (size, chunk
digests, or the error) through a small shared-memory buffer. It never raises."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

import torch
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest

from trainer.checkpoint.layout import CHUNK_BYTES, PARTIAL_SUFFIX
from trainer.checkpoint.slots import Layout, map_file, map_views

log = logging.getLogger(__name__)

REPORT_BYTES = 64 * 1024
"""Shared-memory buffer through which the writer process reports its outcome (JSON, length-prefixed)."""
_ORPHAN_CHECK_S = 0.5
_EXIT_ORPHANED = 3
_POLL_S = 0.005

FAULT_ENV = "TRAINER_CKPT_TEST_FAULT"
"""Test hook read at each persistent save and passed to the writer: ``slow_write:<seconds>`` (sleep after the
first bytes of a shard are written, so a test can kill mid-write, or a slow disk stalls a save), ``enospc`` (the
first write raises ENOSPC) or ``torch_short_write`` (torch's zip writer fails as it does on a full disk, without an
errno), optionally ``@<step>`` to affect only that step. Unset in production."""


def test_fault(step: int) -> str:
    """The ``FAULT_ENV`` hook for this step (``<fault>`` or ``<fault>@<step>``); empty when unset."""
    spec = os.environ.get(FAULT_ENV, "")
    fault, _, only_step = spec.partition("@")
    return fault if not only_step or int(only_step) == step else ""


class HashingWriter:
    """File wrapper for ``torch.save`` that hashes the bytes in ``CHUNK_BYTES`` chunks as they are written."""

    def __init__(self, f: BinaryIO, fault: str) -> None:
        self.f, self.fault, self.size = f, fault, 0
        self.digests: list[str] = []
        self._chunk, self._filled = hashlib.sha256(), 0

    def write(self, data: bytes | memoryview) -> int:
        if self.fault == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if self.fault == "torch_short_write" and self.size:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4160 vs 4096")
        n = self.f.write(data)
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), CHUNK_BYTES - self._filled)
            self._chunk.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == CHUNK_BYTES:
                self.digests.append(self._chunk.hexdigest())
                self._chunk, self._filled = hashlib.sha256(), 0
        self.size += len(memoryview(data).cast("B"))
        if self.fault.startswith("slow_write:"):
            time.sleep(float(self.fault.split(":", 1)[1]))  # test hook: a writer caught mid-file
            self.fault = ""
        return n

    def finish(self) -> list[str]:
        if self._filled:
            self.digests.append(self._chunk.hexdigest())
            self._chunk, self._filled = hashlib.sha256(), 0
        return self.digests

    def flush(self) -> None:
        self.f.flush()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_torch_save(obj: Any, path: Path, fault: str = "") -> tuple[int, list[str]]:
    """``torch.save`` to ``<path>.partial``, fsync, rename, fsync the directory; returns (bytes, chunk digests)."""
    tmp = path.with_name(path.name + PARTIAL_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            writer = HashingWriter(f, fault)
            torch.save(obj, writer)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write frees its space at once
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return writer.size, writer.finish()


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
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_ORPHAN_CHECK_S)
        os._exit(_EXIT_ORPHANED)

    threading.Thread(target=watch, name="ckpt-orphan-watchdog", daemon=True).start()


def write_shard(data_path: str, nbytes: int, layout: Layout, payload: dict[str, Any], path: str,
                report: torch.Tensor, fault: str = "", background: bool = True) -> None:
    """Write one rank's shard file atomically from its snapshot slot; report ``{"ok", "bytes", "chunk_sha256"}``
    or the error."""
    if background:
        _exit_when_orphaned()
    started = time.perf_counter()
    try:
        views = map_views(map_file(Path(data_path), nbytes), layout)
        size, digests = atomic_torch_save({**payload, "tensors": views}, Path(path), fault)
        result: dict[str, Any] = {"ok": True, "bytes": size, "chunk_bytes": CHUNK_BYTES, "chunk_sha256": digests}
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
        self.busy = False

    def start(self) -> None:
        """Start the background process now (a collective-free no-op request), so the first persistent write does
        not wait seconds for it to spawn and import torch while its snapshot slot stays locked. Idempotent."""
        if self._queue is None:
            self._queue = AsyncCallsQueue(persistent=True)
            self._queue.schedule_async_request(AsyncRequest(writer_ready, (), []))

    def submit(self, data_path: Path, nbytes: int, layout: Layout, payload: dict[str, Any], path: Path,
               fault: str, inline: bool) -> None:
        """Write a shard from a slot: inline (synchronous saves) or in the background process."""
        self._report[:8] = 0
        args = (str(data_path), nbytes, layout, payload, str(path), self._report, fault)
        if inline:
            write_shard(*args, background=False)
        else:
            if self._queue is None:
                self._queue = AsyncCallsQueue(persistent=True)
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
        if graceful and caller.process.is_alive() and not queue.get_num_unfinalized_calls():
            caller.close()  # sends DONE and joins
            return
        caller.process.kill()  # it ignores SIGTERM (see _exit_when_orphaned)
        caller.process.join(timeout=10)
        caller.process = None  # NVRx's close()/__del__ would wait forever on a dead worker's queue
