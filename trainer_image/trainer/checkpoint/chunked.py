"""Copying a node-local snapshot (a ``/dev/shm`` mapping a previous process wrote) into GPU memory at the pinned-copy
speed, and checking it there.

A mapping nobody page-locked is copied to the GPU through the driver's pageable path (measured on H200 for the 1B
model's 18 GiB: 3.16 s), and page-locking it whole first (``cudaHostRegister``) costs 1.40 s before a 0.35 s copy.
Here the slot is page-locked in chunks (``CHUNK_BYTES``, page multiples) by a small thread pool while the chunks
already locked are copied asynchronously (measured: 0.99 s), and the snapshot's checksum is computed on the GPU from
the tensors it landed in (milliseconds), instead of a pass over host memory competing with the copy.

Used by ``SnapshotStore.restore``. The chunks stay registered after the restore (``Slot.chunk_pins``); the slot's own registration replaces them when
the slots are prepared for the next snapshots, after the first step (``SnapshotStore.prepare``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

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
    as soon as it is (also when a copy fails: the caller unregisters them)."""
    flat = {key: target.view(-1).view(torch.uint8) for key, target in targets.items()}
    base = buffer.data_ptr()
    guard = threading.Lock()

    def lock_chunk(address: int, nbytes: int) -> bool:
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


def cuda_register(address: int, nbytes: int) -> bool:
    """Page-lock host memory for this thread's CUDA device; False when the driver refuses (the copy is then pageable)."""
    status = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
    return getattr(status, "value", status) == 0


def cuda_unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


def wrap64(value: int) -> int:
    """A sum of 64-bit words as the wrapping int64 the slot checksums are."""
    return (value + 2**63) % 2**64 - 2**63
