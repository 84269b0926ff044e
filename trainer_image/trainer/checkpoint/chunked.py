"""Copying a node-local snapshot (a ``/dev/shm`` mapping a previous process wrote) into GPU memory at the pinned-copy
speed, and checking it there.

A mapping nobody page-locked is copied to the GPU through the driver's pageable path (measured on H200 for the 1B
model's 18 GiB: 3.16 s), and page-locking it whole first (``cudaHostRegister``) costs 1.40 s before a 0.35 s copy.
Here the slot is page-locked in chunks (``CHUNK_BYTES``, page multiples) by a small thread pool while the chunks
already locked are copied asynchronously (measured: 0.99 s), and the snapshot's checksum is computed on the GPU from
the tensors it landed in (milliseconds), instead of a pass over host memory competing with the copy.

Used by ``SnapshotStore.restore``. The chunks stay registered after the restore (``Slot.chunk_pins``); the slot's
own registration replaces them when the slots are prepared for the next snapshots, after the first step
(``SnapshotStore.prepare``), unless ``checkpoint.pin_chunk_mib`` is 1024 (the default): then they are kept.

Also here: page-locking a slot in pieces (``register_in_pieces``) and the copies split at those pieces
(``split_copy``), for ``checkpoint.pin_chunk_mib``; faulting a new slot's pages in on several threads before it is
page-locked (``populate``); and whether a directory can be page-locked at all (``memory_backed``: Linux
page-locks file mappings only on memory file systems); and the slot checksum, over host memory (``checksum``) or
computed on the device from the tensors a slot holds (``device_checksum``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 30
"""Bytes page-locked and copied at a time (a multiple of every page size in use)."""
REGISTER_THREADS = 2
"""Chunks being page-locked at once, ahead of the copies."""

Plan = list[tuple[int, int, list[tuple[str, int, int, int]]]]
"""Per chunk: (start, end, [(key, byte offset in its tensor, byte offset in the slot, length)])."""


def chunk_plan(layout: dict[str, tuple[str, int, tuple[int, ...]]], keys: Iterable[str], nbytes: int,
               chunk_bytes: int = CHUNK_BYTES) -> Plan:
    """The slot's bytes ``[0, nbytes)`` in chunks of ``chunk_bytes``, each with the pieces of the ``keys``' tensors
    (``layout``: key -> (dtype name, byte offset, shape)) that lie inside it; chunks holding no piece are left out."""
    chunks: Plan = [(start, min(start + chunk_bytes, nbytes), []) for start in range(0, nbytes, chunk_bytes)]
    for key in keys:
        dtype_name, offset, shape = layout[key]
        length = getattr(torch, dtype_name).itemsize
        for n in shape:
            length *= n
        position = offset
        while position < offset + length:
            index = position // chunk_bytes
            end = min(offset + length, (index + 1) * chunk_bytes)
            chunks[index][2].append((key, position - offset, position, end - position))
            position = end
    return [chunk for chunk in chunks if chunk[2]]


def copy_in_chunks(buffer: torch.Tensor, plan: Plan, targets: dict[str, torch.Tensor],
                   register: Callable[[int, int], bool], registered: list[int], stream: Any = None,
                   thread_init: Callable[[], None] = lambda: None) -> None:
    """Copy the planned pieces of ``buffer`` (the slot's bytes) into the contiguous ``targets``. Each chunk is first
    page-locked by ``register(address, nbytes)`` on ``REGISTER_THREADS`` threads (``thread_init`` runs in each), so
    later chunks are being locked while earlier ones are copied (asynchronously, on ``stream`` when given). A chunk
    ``register`` could not lock is copied from pageable memory. Every address locked is appended to ``registered``
    as soon as it is (also when a copy fails: the caller unregisters them); one already in it is not locked again."""
    flat = {key: target.view(-1).view(torch.uint8) for key, target in targets.items()}
    base = buffer.data_ptr()
    guard = threading.Lock()
    already = set(registered)  # locked ahead (a standby's premap: ``premap``), in these same chunks

    def lock_chunk(address: int, nbytes: int) -> bool:
        if address in already:
            return True
        if not register(address, nbytes):
            return False
        with guard:
            registered.append(address)
        return True

    with ThreadPoolExecutor(REGISTER_THREADS, thread_name_prefix="snapshot-register", initializer=thread_init) as pool:
        locked = [pool.submit(lock_chunk, base + start, end - start) for start, end, _ in plan]
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for (_, _, pieces), lock in zip(plan, locked):
                lock.result()
                for key, at, src, length in pieces:
                    flat[key][at : at + length].copy_(buffer[src : src + length], non_blocking=True)


UNPINNED_WARNED: set[str] = set()
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "hugetlbfs")
"""Where the driver can page-lock a file mapping (Linux refuses long-term pins of files on a disk)."""


def memory_backed(path: Path) -> bool:
    """Whether ``path`` lies on a memory file system (``/proc/self/mountinfo``; True when that cannot be read)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return True
    target, best, kind = str(Path(path).resolve()), "", ""
    for line in lines:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        mount = fields[4].encode().decode("unicode_escape")
        fstype = line.split(" - ", 1)[1].split()[0]
        if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, fstype
    return kind in MEMORY_FILESYSTEMS


def warn_unpinned(directory: Path) -> None:
    """Once per directory and process: the slots there are used without page-locking (correct, slower)."""
    if str(directory) in UNPINNED_WARNED:
        return
    UNPINNED_WARNED.add(str(directory))
    log.warning("snapshot slots in %s cannot be page-locked (not a memory file system: Linux page-locks files only "
                "on tmpfs such as /dev/shm): snapshots are copied to and from the GPU through pageable memory, "
                "several times slower; point checkpoint.node_local_dir at a tmpfs", directory)


SNAPSHOT_COPY_BYTES = 64 << 20
"""The pieces a device-staged snapshot's drain to host memory is queued in (``staging.Drain``): its parts, one per
step, are whole pieces, so this is how finely a part's size can follow its budget."""


def pieces_of(start: int, length: int, piece: int, most: int = 0) -> list[tuple[int, int]]:
    """The byte range ``[start, start + length)`` of a slot split where its ``piece``-sized registrations meet (one
    piece: one copy the driver sees as page-locked), and into ranges of at most ``most`` bytes; ``piece`` and
    ``most`` 0: not split."""
    end = start + length
    cuts = range((start // piece + 1) * piece, end, piece) if piece > 0 else ()
    bounds = [start, *cuts, end]
    ranges = list(itertools.pairwise(bounds))
    if most <= 0 or length <= 0:
        return ranges
    return [(a, min(a + most, b)) for lo, b in ranges for a in range(lo, b, most)]


def split_copy(slot_bytes: torch.Tensor, offset: int, tensor: torch.Tensor, piece: int, to_slot: bool,
               most: int = 0) -> None:
    """Copy between ``tensor`` and its region of the slot (bytes from ``offset``), one asynchronous copy per
    registered piece (a copy spanning two registrations may be taken for pageable memory: staged and synchronous)
    and per ``most`` bytes. ``to_slot=False`` needs a contiguous ``tensor`` (its bytes are written in place)."""
    flat = tensor.reshape(-1).view(torch.uint8) if to_slot else tensor.view(-1).view(torch.uint8)
    for a, b in pieces_of(offset, flat.numel(), piece, most):
        here, there = slot_bytes[a:b], flat[a - offset : b - offset]
        (here if to_slot else there).copy_(there if to_slot else here, non_blocking=True)


def register_in_pieces(buffer: torch.Tensor, piece: int, registered: list[int],
                       pause: Callable[[float], Any] | None = None) -> bool:
    """Page-lock ``buffer`` in ``piece``-byte registrations (page multiples), skipping addresses already in
    ``registered`` (a restore's chunks of the same size) and appending each new one. ``pause(seconds)`` after each
    piece, with the seconds it took: a registration holds the CUDA driver, and the training thread's kernel
    launches wait for it (an 18 GB slot in one call holds it for seconds). False when the driver refused."""
    base, done = buffer.data_ptr(), set(registered)
    for start in range(0, buffer.numel(), piece):
        if base + start in done:
            continue
        began = time.perf_counter()
        if not cuda_register(base + start, min(piece, buffer.numel() - start)):
            return False
        registered.append(base + start)
        if pause is not None:
            pause(time.perf_counter() - began)
    return True


POPULATE_THREADS = 8
"""Threads that fault a new slot's pages in (``populate``): at most this many, and at most half the CPUs this process
may run on, shared among the node's local ranks (``LOCAL_WORLD_SIZE``), which populate their slots at once."""
PAGE_BYTES = 4096
SERIAL_PAGES = 8192
"""Pages one torch call of ``populate`` touches: below ATen's grain size (32,768 elements), so the call runs on the
thread that makes it, not on the intra-op pool. Whole ranges in one call each fanned out over an OpenMP team of every
CPU (8 populating threads x 16 on a 16-CPU host), which crowded the run queue and stalled the training loop as each
slot's population ended (BENCHMARKS.md, "Snapshot cost")."""


def populate_threads(most: int = POPULATE_THREADS) -> int:
    """How many threads ``populate`` uses in this process (``POPULATE_THREADS``)."""
    from trainer.parallel import DistEnv  # the launcher's environment; imported here, where a worker has it already

    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 2
    return max(1, min(most, cpus // (2 * max(1, DistEnv.from_environ().local_world_size))))


def populate(buffer: torch.Tensor, threads: int = POPULATE_THREADS) -> None:
    """Fault in every page of a NEW, all-zero shared mapping (a fallocated tmpfs file) on several threads
    (``populate_threads``): one zero written per 4 KiB page, by strided torch ops of ``SERIAL_PAGES`` pages each (the
    GIL is released; each op stays on its own thread). ``posix_fallocate`` on tmpfs reserves pages without clearing
    or mapping them; left to the page-locking (``cudaHostRegister``), each page's fault and clearing ran inside the
    registration with the CUDA driver held, and left to a first copy into a pageable slot, it made that copy ~20x
    slower (4 GiB here: 11 s, 0.5 s once populated). Tried first on H200: ``madvise(MADV_POPULATE_WRITE)`` over GiB
    ranges stalled the training loop for seconds, probably by holding the address space's lock for each whole range;
    single faults take it briefly."""
    flat = buffer.view(-1)
    count = populate_threads(threads)
    share = -(-flat.numel() // count // PAGE_BYTES) * PAGE_BYTES
    ranges = [(start, min(start + share, flat.numel())) for start in range(0, flat.numel(), share)]
    step = SERIAL_PAGES * PAGE_BYTES

    def touch(span: tuple[int, int]) -> None:
        for start in range(span[0], span[1], step):
            flat[start:min(start + step, span[1]):PAGE_BYTES].zero_()

    with ThreadPoolExecutor(len(ranges), thread_name_prefix="slot-populate") as pool:
        list(pool.map(touch, ranges))


def cuda_register(address: int, nbytes: int) -> bool:
    """Page-lock host memory for this thread's CUDA device; False when the driver refuses (the copy is then pageable)."""
    status = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
    return getattr(status, "value", status) == 0


def cuda_unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


def wrap64(value: int) -> int:
    """A sum of 64-bit words as the wrapping int64 the slot checksums are."""
    return (value + 2**63) % 2**64 - 2**63


def checksum(buffer: torch.Tensor) -> int:
    """Wrapping sum of the buffer's 64-bit words: a memory-speed (multi-threaded) check that catches stale or
    flipped bytes. Not cryptographic; the persistent tier keeps sha256."""
    return int(buffer.view(torch.int64).sum())


def device_checksum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``checksum`` of a slot computed from the tensors staged into it, on their device: each tensor's bytes
    zero-padded to whole 64-bit words equal its region of the slot (64-byte aligned, zero padding). On CUDA this
    runs on the copy's stream, instead of a pass over host memory that competes with the training loop for the
    CPU (measured on H200: +0.35 s on the step after every 1B snapshot). One reduction per tensor, no copies: a
    tensor's last partial word is folded in from its few tail bytes. (A device-staged snapshot sums its staging
    buffer instead: one reduction.)"""
    device = next((t.device for t in tensors if t.is_cuda), tensors[0].device if tensors else torch.device("cpu"))
    sums = []
    for tensor in tensors:
        raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
        whole = raw.numel() // 8 * 8
        if whole:
            sums.append(raw[:whole].view(torch.int64).sum().to(device))
        if whole < raw.numel():  # little-endian: byte i of the zero-padded word is worth 2**(8 i)
            tail = raw[whole:].to(torch.int64)
            shifts = torch.arange(0, 8 * tail.numel(), 8, device=tail.device)
            sums.append((tail << shifts).sum().to(device))
    return torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.int64, device=device)


def by_device(tensors: Any) -> list[list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device, []).append(tensor)
    return list(groups.values())
