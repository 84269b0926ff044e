"""A streaming, sharded safetensors writer: every tensor's name, shape and dtype are known before any is read
(from a checkpoint manifest), so each file's header is written first and the tensors follow one at a time, never
more than one in memory.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, padded with spaces to a
multiple of 8), then the tensors' little-endian bytes back to back in header order.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_SHARD_BYTES = 5 * 10**9
"""``save_pretrained``'s default ``max_shard_size="5GB"``."""


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def plan_shards(entries: list[Entry], max_bytes: int = MAX_SHARD_BYTES) -> list[tuple[str, list[Entry]]]:
    """``[(file name, entries)]`` in order, each file at most ``max_bytes`` of tensor data (a larger tensor gets a
    file of its own). One file: ``model.safetensors``; more: ``model-0000i-of-0000n.safetensors``."""
    groups: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if groups[-1] and size + entry.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry.nbytes
    if len(groups) == 1:
        return [(SINGLE, groups[0])]
    n = len(groups)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", group) for i, group in enumerate(groups)]


def index_json(plan: list[tuple[str, list[Entry]]]) -> dict:
    """``model.safetensors.index.json`` for a plan of more than one file."""
    return {"metadata": {"total_size": sum(e.nbytes for _, group in plan for e in group)},
            "weight_map": {e.name: file for file, group in plan for e in group}}


class ShardWriter:
    """One safetensors file: ``write`` each planned tensor in plan order, then ``close`` (checks all arrived, fsyncs)."""

    def __init__(self, path: Path, entries: list[Entry], metadata: dict[str, str] | None = None) -> None:
        self.path, self.entries, self._next = Path(path), entries, 0
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for e in entries:
            if e.dtype not in DTYPES:
                raise ValueError(f"{e.name}: dtype {e.dtype} cannot be exported (one of {sorted(map(str, DTYPES))})")
            header[e.name] = {"dtype": DTYPES[e.dtype], "shape": list(e.shape),
                              "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.entries[self._next] if self._next < len(self.entries) else None
        if expected != Entry(name, tuple(tensor.shape), tensor.dtype):
            raise ValueError(f"{self.path.name}: got {name} {tuple(tensor.shape)} {tensor.dtype}, planned {expected}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.entries):
            self._file.close()
            raise ValueError(f"{self.path.name}: {len(self.entries) - self._next} planned tensors were not written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
