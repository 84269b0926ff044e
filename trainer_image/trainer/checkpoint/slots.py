"""The memory and node-local tiers: snapshot slots in named shared memory.

Each rank owns ``slots`` snapshot slots. A slot is one file in the job's node-local directory (``/dev/shm``, a
memory-backed ``emptyDir`` in Kubernetes), memory-mapped and page-locked on CUDA; the device-to-host copy of a
save lands in it directly, so staging a snapshot *is* writing the node-local tier, with no second copy:

- **memory tier**: a slot counts as a snapshot of step S as soon as its copy finished on this rank; an
  in-process restart resumes from the newest step every rank holds (agreed with one small all-gather at
  restore time: nothing is exchanged while saving);
- **node-local tier**: once the copy finished, a background thread computes a fast checksum (a wrapping sum of
  the slot's 64-bit words) and writes ``<slot>.meta`` (job, rank, world size, config hash, step, layout,
  checksum, the rank's non-tensor state) by rename. A worker respawned on the same node maps the file and
  loads from it when every guard matches and the checksum verifies; otherwise it warns and uses the next tier.

Restaging a slot first removes its ``.meta``, so a crash while staging leaves that slot invalid and the other
slots valid. The slot a persistent write is reading is locked; the newest complete snapshot is restaged only when
every other slot is locked by a write that keeps an older complete snapshot (``choose``): only the slot being
persisted is held, and a snapshot is never skipped because the disk is slow.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from trainer.checkpoint import chunked, premap
from trainer.checkpoint.chunked import by_device, checksum, device_checksum, memory_backed, warn_unpinned
from trainer.checkpoint.errors import CheckpointError, CheckpointStorageError
from trainer.checkpoint.layout import Piece, piece_record
from trainer.checkpoint.snapshot_header import SNAPSHOT_FORMAT, SNAPSHOT_VERSION, encode_header, load_header, \
    remember_header

log = logging.getLogger(__name__)

SNAPSHOT_DIR_ENV = "TRAINER_SNAPSHOT_DIR"
"""Set by ``entrypoint.sh`` to a directory it creates for the job and removes when the job ends, however it ends."""
JOB_ID_ENV = "TRAINER_JOB_ID"
DIR_PREFIX = "resilient-train-"
_ALIGN_BYTES = 64
"""Every tensor starts at a multiple of this many bytes inside its slot (any dtype can view it; 8-byte words)."""


Layout = dict[str, tuple[str, int, tuple[int, ...]]]
"""key -> (dtype name, byte offset, shape)."""


def snapshot_dir(node_local_dir: str, checkpoint_dir: Path) -> Path:
    """This job's directory of snapshot slots on this node."""
    if os.environ.get(SNAPSHOT_DIR_ENV):
        return Path(os.environ[SNAPSHOT_DIR_ENV])
    return Path(node_local_dir) / (DIR_PREFIX + job_key(checkpoint_dir)[:16])


def job_key(checkpoint_dir: Path) -> str:
    """Identifies the job whose snapshots these are: the launcher's job id and the checkpoint directory."""
    job = os.environ.get(JOB_ID_ENV) or os.environ.get("TORCHELASTIC_RUN_ID", "")
    return hashlib.sha256(f"{job}\0{Path(checkpoint_dir).resolve()}".encode()).hexdigest()


def plan_layout(pieces: dict[str, Piece]) -> tuple[Layout, int]:
    """Byte offsets of every local tensor inside a slot, and the slot's size (a multiple of ``_ALIGN_BYTES``)."""
    layout: Layout = {}
    size = 0
    for key, piece in pieces.items():
        numel = 1
        for n in piece.shape:
            numel *= n
        layout[key] = (str(piece.dtype).removeprefix("torch."), size, tuple(piece.shape))
        size += -(-max(numel * piece.dtype.itemsize, 1) // _ALIGN_BYTES) * _ALIGN_BYTES
    return layout, max(size, _ALIGN_BYTES)


def map_views(buffer: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Typed views of a slot's bytes, one per tensor (also used by the writer process on its own mapping)."""
    views = {}
    for key, (dtype_name, offset, shape) in layout.items():
        dtype = getattr(torch, dtype_name)
        numel = 1
        for n in shape:
            numel *= n
        views[key] = buffer[offset : offset + numel * dtype.itemsize].view(dtype).view(shape)
    return views


def map_file(path: Path, nbytes: int, allocate: bool = False) -> torch.Tensor:
    """The file's bytes as a shared (MAP_SHARED) uint8 tensor. ``allocate`` creates or resizes the file and
    reserves its pages first: on a full tmpfs that is a clear error here, where a write into an unbacked page of
    the mapping would kill the process with SIGBUS mid-copy. A new file on a memory file system has its pages
    faulted in here (``chunked.populate``); an existing one keeps its bytes."""
    fresh = False
    if allocate:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fresh = os.fstat(fd).st_size == 0
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            free = shutil.disk_usage(path.parent).free
            raise CheckpointStorageError(
                f"node-local snapshot directory {str(path.parent)!r} has no room for a snapshot slot "
                f"({free / 2**30:.2f} GiB free, a slot needs {nbytes / 2**30:.2f} GiB; {os.strerror(exc.errno or 0)}): "
                "enlarge it (the memory emptyDir's sizeLimit, docker --shm-size), lower checkpoint.memory_slots, "
                "or point checkpoint.node_local_dir elsewhere"
            ) from None
        os.close(fd)
    mapped = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    if fresh and memory_backed(path.parent):  # new pages: mapped on several threads, not one by one
        chunked.populate(mapped)                # by the page-locking or the first copy
    return mapped


def config_hash(config_json: str) -> str:
    """The run's configuration, less where a node keeps its snapshots (``checkpoint.node_local_dir``, which may differ
    between a lost node and its replacement, whose ranks take the lost node's snapshots from the peer tier)."""
    try:
        config = json.loads(config_json)
        config.get("checkpoint", {}).pop("node_local_dir", None)
        config_json = json.dumps(config, sort_keys=True)
    except (ValueError, AttributeError):  # not a config of sections: hashed as it is
        pass
    return hashlib.sha256(config_json.encode()).hexdigest()


@dataclass
class Slot:
    """One snapshot slot of this rank."""

    index: int
    data_path: Path
    meta_path: Path
    buffer: torch.Tensor | None = None
    layout: Layout = field(default_factory=dict)
    views: dict[str, torch.Tensor] = field(default_factory=dict)
    pinned: int = 0
    step: int | None = None
    """The step whose snapshot this slot holds completely on this rank (memory tier), else None."""
    staging: int | None = None
    """The step being copied in (CUDA: until its event completes)."""
    event: Any = None
    """CUDA: recorded when the copy into the slot finished."""
    sources_read: Any = None
    """CUDA: recorded when the copy no longer reads the live tensors (the next optimizer step waits for it)."""
    pieces: dict[str, Piece] = field(default_factory=dict)
    payload: dict[str, Any] = field(default_factory=dict)
    locked: bool = False
    """A persistent write reads this slot."""
    published: threading.Event = field(default_factory=threading.Event)
    """Set while no node-local publication of this slot is in flight."""
    checksum: int | None = None
    """The snapshot's checksum when it was computed while staging (CUDA), else None (computed when published)."""
    pending_checksum: Any = None
    dirty: bool = False
    """Bytes outside the current layout's tensors may be non-zero (an earlier layout was staged here)."""
    chunk_pins: list[int] = field(default_factory=list)
    """Addresses of the chunks a node-local restore page-locked (``chunked``); replaced by the slot's own pin."""
    pin_piece: int = 0
    """Bytes per page-locked registration (``checkpoint.pin_chunk_mib``; 0: one); copies split at them (``chunked``)."""
    pin_refused: bool = False
    """The driver refused to page-lock this slot's mapping (a file on a disk, not a tmpfs): it is used pageable."""
    ready: threading.Event = field(default_factory=threading.Event)
    """Cleared while this slot is reserved in the background (``reservation.py``)."""

    def ensure(self, layout: Layout, nbytes: int, pin: bool) -> None:
        """Map (and pin on CUDA) the slot for this layout; a large enough mapping is kept, its views rebuilt."""
        self.reserve(nbytes, pin)
        if layout != self.layout or not self.views:
            assert self.buffer is not None
            if self.dirty:  # the checksum counts the padding between tensors as zeros
                self.buffer.zero_()
                self.dirty = False
            self.layout, self.views = layout, map_views(self.buffer, layout)

    def reserve(self, nbytes: int, pin: bool, keep_content: bool = False, pause: Any = None) -> None:
        """Allocate (and pin) at least ``nbytes``: the slow part of a first save (seconds per slot for the 1B model:
        BENCHMARKS.md, "Snapshot cost"), done ahead of it by ``reservation.Reservation``. A mapped slot (a discovered
        snapshot) is pinned in place."""
        if self.buffer is not None and self.buffer.numel() >= nbytes and (pin or not self.pinned):
            if pin and not self.pinned and not self.pin_refused:
                self._pin(pause)
            return
        if keep_content and self.buffer is not None:
            return  # a snapshot too small for the estimate: its first restaging reallocates it
        self.release()
        self.buffer = map_file(self.data_path, nbytes, allocate=True)
        if pin and not self.pin_refused:
            self._pin(pause)

    def _pin(self, pause: Any = None) -> None:
        """Page-lock the slot: in one registration, or in ``pin_piece`` pieces (``pause(seconds)`` after each, given
        how long it took, so the training thread's kernel launches get the driver in between)."""
        assert self.buffer is not None
        if self.pin_piece != chunked.CHUNK_BYTES:  # a restore's 1 GiB chunks are kept when the pieces match them
            self._unpin_chunks()
        if not memory_backed(self.data_path.parent):  # the driver would refuse (and leave a CUDA error behind)
            self.pin_refused = True
            warn_unpinned(self.data_path.parent)
            return
        if self.pin_piece:
            status = 0 if chunked.register_in_pieces(self.buffer, self.pin_piece, self.chunk_pins, pause) else -1
        else:
            status = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.buffer.numel(), 0)
        if (code := getattr(status, "value", status)) != 0:
            raise CheckpointError(f"cudaHostRegister of a snapshot slot in {self.data_path.parent} failed with CUDA "
                                  f"error {code}: check the memory-lock limit (ulimit -l) and /dev/shm's size")
        self.pinned = self.buffer.data_ptr()

    def _unpin_chunks(self) -> None:
        for address in self.chunk_pins:
            chunked.cuda_unregister(address)
        self.chunk_pins = []

    def release(self) -> None:
        self._unpin_chunks()
        if self.pinned and not self.pin_piece:
            torch.cuda.cudart().cudaHostUnregister(self.pinned)
        self.buffer, self.views, self.layout, self.pinned = None, {}, {}, 0

    def invalidate(self) -> None:
        """Before restaging: the slot stops being a snapshot in every tier."""
        self.published.wait()
        self.step, self.staging, self.event, self.sources_read = None, None, None, None
        self.meta_path.unlink(missing_ok=True)


class SnapshotStore:
    """This rank's snapshot slots (memory + node-local tiers)."""

    def __init__(self, directory: Path, rank: int, slots: int, job: str, config_json: str, node_local: bool) -> None:
        self.dir, self.rank, self.job, self.node_local = directory, rank, job, node_local
        self.config_hash = config_hash(config_json)
        self.world_size = 1
        self.pin_piece = 0
        self.slots = [self._slot(i) for i in range(slots)]
        self._threads: list[threading.Thread] = []
        self.on_published: Callable[[Slot, int], None] = lambda slot, step: None
        self._expected_checksum: dict[int, int] = {}
        """Slot index -> checksum its header promises, for snapshots discovered from a previous process."""
        self.restore_times: dict[str, float] = {}
        """The last ``restore``'s parts in seconds (logged with the restore): ``copy`` (page-locking included, in
        its thread), ``overlap`` (the caller's work meanwhile), ``check`` (the checksum on the device)."""

    def _slot(self, index: int) -> Slot:
        stem = f"rank-{self.rank:05d}.slot-{index}"
        slot = Slot(index, self.dir / f"{stem}.data", self.dir / f"{stem}.meta", pin_piece=self.pin_piece)
        slot.published.set()
        slot.ready.set()
        return slot

    def rebind(self, rank: int, world_size: int) -> None:
        """A new attempt: the rank can only change with a new process (in-job restart), when slots are fresh."""
        if rank != self.rank and any(s.buffer is not None for s in self.slots):
            raise CheckpointError(f"rank changed from {self.rank} to {rank} within a process")
        if rank != self.rank:
            self.rank = rank
            self.slots = [self._slot(i) for i in range(len(self.slots))]
        self.world_size = world_size

    def pin_in_pieces(self, nbytes: int) -> None:
        """``checkpoint.pin_chunk_mib``: slots page-locked from now on are registered in pieces of ``nbytes``."""
        self.pin_piece = nbytes
        for slot in self.slots:
            if not slot.pinned:
                slot.pin_piece = nbytes

    # ---- saving ---------------------------------------------------------------------------------------------
    def choose(self) -> Slot | None:
        """A slot to stage into: never one a persistent write reads (locked), the oldest of the others, and the
        newest complete snapshot only when every other slot is locked and one of them holds an older complete
        snapshot (2 slots, a write in flight): that one stays valid meanwhile, so a fault while staging falls
        back to it, and the memory tier never waits for the disk. A slot already reserved goes before one still
        being page-locked in a new process's first seconds (a third slot is reserved last, and a snapshot does not
        wait for it while another holds an older one). None when no slot qualifies (the save is skipped): every
        other slot locked without a complete snapshot."""
        newest = self.newest()
        unlocked = [s for s in self.slots if not s.locked]
        others = [s for s in unlocked if s is not newest]
        if others:
            return min(others, key=lambda s: (not s.ready.is_set(), -1 if s.step is None else s.step))
        fallback = any(s.step is not None and s is not newest for s in self.slots)
        return newest if newest is not None and not newest.locked and fallback else None

    def stage(self, slot: Slot, step: int, locals_: dict[str, torch.Tensor], pieces: dict[str, Piece],
              payload: dict[str, Any], copier: Any, after: Any = None) -> None:
        """Copy this rank's tensors into ``slot`` with ``copier`` (``staging``: synchronously on CPU, on a side stream
        on CUDA after the training stream's work or the event ``after``; the slot is a snapshot at ``complete``)."""
        slot.ready.wait()  # reserved in the background (reservation.py)
        slot.invalidate()
        # FT: from now on the slot holds this process's own copy: a checksum discovered for its previous content (a
        # snapshot of the process before, never restored) would fail the next in-process restore of this one
        self._expected_checksum.pop(slot.index, None)
        layout, nbytes = plan_layout(pieces)
        on_cuda = any(t.is_cuda for t in locals_.values())
        self.dir.mkdir(parents=True, exist_ok=True)
        slot.ensure(layout, nbytes, pin=on_cuda)
        slot.pieces, slot.payload, slot.staging, slot.dirty, slot.checksum = pieces, payload, step, True, None
        copier.copy(slot, locals_, checksum=self.node_local, after=after)
        if slot.event is None:
            self.complete(slot)

    def staged(self) -> Slot | None:
        return next((s for s in self.slots if s.staging is not None), None)

    def complete(self, slot: Slot) -> None:
        """Wait for the copy into ``slot``: it becomes a memory-tier snapshot, and its node-local publication
        starts in the background."""
        if slot.staging is None:
            return
        if slot.event is not None:
            slot.event.synchronize()
            if slot.pending_checksum is not None and self.node_local:
                slot.checksum = int(slot.pending_checksum)
        slot.step, slot.staging, slot.event, slot.sources_read = slot.staging, None, None, None
        if self.node_local:
            slot.published.clear()
            thread = threading.Thread(target=self._publish, args=(slot, slot.step), name="snapshot-publish", daemon=True)
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def _publish(self, slot: Slot, step: int) -> None:
        try:
            assert slot.buffer is not None
            meta = {
                "format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION, "job": self.job, "rank": self.rank,
                "world_size": self.world_size, "config_hash": self.config_hash, "step": step,
                "nbytes": slot.buffer.numel(),
                "checksum": slot.checksum if slot.checksum is not None else checksum(slot.buffer),
                "layout": {k: [d, o, list(s)] for k, (d, o, s) in slot.layout.items()},
                "pieces": {k: piece_record(p) for k, p in slot.pieces.items()},  # a reshard reads them (reshard.py)
                "payload": slot.payload,
            }
            partial = slot.meta_path.with_name(slot.meta_path.name + ".partial")
            torch.save(encode_header(meta), partial)
            if slot.step == step:  # not invalidated meanwhile
                os.replace(partial, slot.meta_path)
                remember_header(slot.meta_path, meta)  # the next restore in this process reads it from here
                self.on_published(slot, step)  # the peer tier's copy (replicas.py): restaging waits for it
            else:
                partial.unlink(missing_ok=True)
        except Exception as exc:  # the memory tier still holds it; only the node-local copy is missing
            log.warning("node-local snapshot of step %d not published: %s", step, exc)
        finally:
            slot.published.set()

    def newest(self) -> Slot | None:
        complete = [s for s in self.slots if s.step is not None]
        return max(complete, key=lambda s: s.step) if complete else None  # type: ignore[arg-type, return-value]

    def held_steps(self) -> list[int]:
        return sorted(s.step for s in self.slots if s.step is not None)  # type: ignore[misc]

    def slot_for(self, step: int) -> Slot | None:
        return next((s for s in self.slots if s.step == step), None)

    # ---- a respawned worker: discover the node-local tier -------------------------------------------------
    def discover(self, pieces_fn: Callable[[], dict[str, Piece]], only: Slot | None = None) -> list[int]:
        """Map the slots a previous process of this rank published (``only``: that slot, a replica fetched into it);
        returns their steps (not yet verified). A snapshot of another job, rank, world size, config or model is
        ignored with a warning. ``pieces_fn`` gives this model's pieces; called only when there is a header."""
        try:
            return self._discover(pieces_fn, only)
        finally:  # FT: what a standby page-locked and no slot took (another rank's files, a slot with no header)
            premap.release_all()

    def _discover(self, pieces_fn: Callable[[], dict[str, Piece]], only: Slot | None) -> list[int]:
        if not self.node_local or (only is None and any(s.buffer is not None for s in self.slots)):
            return self.held_steps()
        headers = [slot for slot in self.slots if slot.meta_path.is_file() and only in (None, slot)]
        if not headers:
            return []
        pieces = pieces_fn()
        expected, nbytes = plan_layout(pieces)
        for slot in headers:
            why, meta = self._read_meta(slot, expected, nbytes)
            if why:
                log.warning("ignoring node-local snapshot %s: %s; the next tier is used", slot.meta_path, why)
                continue
            premapped = premap.take(slot.data_path, meta["nbytes"])  # FT: mapped and locked by the standby
            slot.buffer = premapped.buffer if premapped else map_file(slot.data_path, meta["nbytes"])
            slot.chunk_pins = premapped.chunks if premapped else []
            if premapped:
                log.info("node-local snapshot of step %d: %.1f of %.1f GiB page-locked ahead by the standby",
                         meta["step"], premapped.locked_bytes / 2**30, meta["nbytes"] / 2**30)
            slot.layout, slot.views = expected, map_views(slot.buffer, expected)
            slot.step, slot.payload, slot.pieces = meta["step"], meta["payload"], dict(pieces)
            self._expected_checksum[slot.index] = meta["checksum"]
        for slot in self.slots:  # FT: a headerless file the standby locked: kept empty (a header's may be resharded)
            if slot.buffer is None and only is None and not slot.meta_path.exists() and (
                    kept := premap.adopt(slot.data_path, expected, nbytes)):
                slot.buffer, slot.chunk_pins, slot.layout, slot.views = kept.buffer, kept.chunks, expected, {}
        return self.held_steps()

    def _read_meta(self, slot: Slot, expected: Layout, nbytes: int) -> tuple[str, dict[str, Any]]:
        try:
            meta = load_header(slot.meta_path)
        except Exception as exc:  # noqa: BLE001 - any unreadable header only disqualifies this snapshot
            return f"unreadable header ({type(exc).__name__})", {}
        if not isinstance(meta, dict) or meta.get("format") != SNAPSHOT_FORMAT or meta.get("version") != SNAPSHOT_VERSION:
            return "not a snapshot header", {}
        checks = [("job", self.job, "another job"), ("rank", self.rank, "another rank"),
                  ("world_size", self.world_size, "another world size"),
                  ("config_hash", self.config_hash, "another configuration")]
        for key, value, what in checks:
            if meta.get(key) != value:
                return f"written by {what} ({key} {str(meta.get(key))[:16]} != {str(value)[:16]})", {}
        layout = {k: (d, o, tuple(s)) for k, (d, o, s) in meta["layout"].items()}  # checked by decode_header
        if layout != expected or meta.get("nbytes", 0) < nbytes:
            return "its tensors differ from this model's", {}
        if not slot.data_path.is_file() or slot.data_path.stat().st_size != meta["nbytes"]:
            return "its data file is missing or has the wrong size", {}
        return "", meta

    def verify(self, step: int) -> Callable[[], str]:
        """Start checking this rank's snapshot of ``step`` against its header's checksum (discovered snapshots
        only) in a background thread, so the check overlaps the copy into the model; the returned function waits
        and gives '' when it passed, else why not (the snapshot is then dropped)."""
        slot = self.slot_for(step)
        if slot is None:
            return lambda: f"no snapshot of step {step}"
        expected = self._expected_checksum.get(slot.index)
        if expected is None:  # written by this process: its own memory, nothing to verify
            return lambda: ""
        assert slot.buffer is not None
        result: list[int] = []
        thread = threading.Thread(target=lambda: result.append(checksum(slot.buffer)), name="snapshot-verify",
                                  daemon=True)
        thread.start()

        def outcome() -> str:
            thread.join()
            if result != [expected]:
                self.drop(slot)
                return f"checksum mismatch in {slot.data_path} (flipped or stale bytes)"
            self._expected_checksum.pop(slot.index, None)
            return ""

        return outcome

    def restore(self, step: int, targets: dict[str, torch.Tensor], overlap: Callable[[], None] = lambda: None) -> str:
        """Copy this rank's snapshot of ``step`` into ``targets`` (key -> local tensor of the slot's layout), running
        ``overlap`` while the copy is in flight; '' when it verified (a snapshot of this process: nothing to verify),
        else why not (the snapshot is then dropped; the targets are overwritten by whatever is loaded next).

        A discovered snapshot going to the GPU is page-locked in chunks while copied and checked on the GPU
        (``chunked``); any other is copied tensor by tensor, a discovered one checked by a thread meanwhile."""
        slot = self.slot_for(step)
        if slot is None:
            return f"no snapshot of step {step}"
        expected = self._expected_checksum.get(slot.index)
        on_gpu = (any(t.is_cuda for t in targets.values()) and all(t.is_contiguous() for t in targets.values())
                  and memory_backed(self.dir))  # chunks are page-locked as they are copied: a tmpfs only
        if expected is None or not on_gpu:
            verified = self.verify(step)  # FT: the checksum runs while the snapshot is copied in
            for key, target in targets.items():
                if slot.pinned and slot.pin_piece and target.is_cuda and target.is_contiguous():
                    chunked.split_copy(slot.buffer, slot.layout[key][1], target, slot.pin_piece, to_slot=False)
                else:
                    target.copy_(slot.views[key], non_blocking=True)
            overlap()
            return verified()
        assert slot.buffer is not None
        device = next(t.device for t in targets.values() if t.is_cuda)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the targets were just made on the current stream
        plan = chunked.chunk_plan(slot.layout, targets, slot.buffer.numel())
        outcome: dict[str, Any] = {}

        def copy() -> None:
            began = time.perf_counter()
            try:
                torch.cuda.set_device(device)
                chunked.copy_in_chunks(slot.buffer, plan, targets, chunked.cuda_register, slot.chunk_pins, stream,
                                       thread_init=lambda: torch.cuda.set_device(device))
                stream.synchronize()
            except BaseException as exc:  # re-raised in the caller
                outcome["error"] = exc
            outcome["copy"] = time.perf_counter() - began

        began = time.perf_counter()
        copier = threading.Thread(target=copy, name="snapshot-restore", daemon=True)
        copier.start()
        try:
            overlap()
        finally:
            overlapped = time.perf_counter() - began
            copier.join()
        if "error" in outcome:
            raise outcome["error"]
        torch.cuda.current_stream(device).wait_stream(stream)
        checked = time.perf_counter()
        total = chunked.wrap64(sum(int(device_checksum(list(group))) for group in by_device(targets.values())))
        self.restore_times.update(copy=outcome["copy"], overlap=overlapped, check=time.perf_counter() - checked)
        if total != expected:
            self.drop(slot)
            return f"checksum mismatch in {slot.data_path} (flipped or stale bytes)"
        self._expected_checksum.pop(slot.index, None)
        return ""

    def forget_after(self, step: int | None) -> list[int]:
        """After a restore of ``step`` (None: nothing restored), forget every snapshot of a later step: some ranks
        held it and others did not (a fault during its staging), so it belongs to a future the job did not
        keep. Left in place, this rank alone would take it for the next save of that step and skip the
        collective its peers enter. A slot a write in flight still reads is kept. Returns the steps forgotten."""
        forgotten = []
        for slot in self.slots:
            if slot.step is not None and not slot.locked and (step is None or slot.step > step):
                slot.published.wait()
                forgotten.append(slot.step)
                self.drop(slot)
        return sorted(forgotten)

    def drop(self, slot: Slot) -> None:
        """Forget a snapshot that failed verification (its files are removed)."""
        self._expected_checksum.pop(slot.index, None)
        slot.step = None
        slot.meta_path.unlink(missing_ok=True)

    # ---- end --------------------------------------------------------------------------------------------------
    def close(self, remove: bool) -> None:
        """Unmap the slots; ``remove`` deletes this rank's files (the job is over) and the directory once empty."""
        for thread in self._threads:
            thread.join(timeout=30)
        for slot in self.slots:
            slot.release()
            if remove:
                for path in (slot.meta_path, slot.data_path, slot.meta_path.with_name(slot.meta_path.name + ".partial")):
                    path.unlink(missing_ok=True)
        if remove:
            try:
                self.dir.rmdir()
            except OSError:  # other ranks' files are still there, or it is gone already
                pass
