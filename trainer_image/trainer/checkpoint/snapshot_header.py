"""How a snapshot header is stored and read: its one concern.

A header (``<slot>.meta`` beside its data file) describes one rank's snapshot: the job, rank, world size and
configuration it belongs to, its step and checksum, where each tensor lies in the data file (``layout``), which piece of
each global tensor it is (``pieces``), and the non-tensor state (``payload``). It is written with ``torch.save`` and
read with ``torch.load(weights_only=True)``, its per-tensor tables as one JSON string (``encode_header``), and it is
replaced by a rename, never rewritten in place, so each version of the file is read once per process
(``load_header``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

SNAPSHOT_FORMAT = "resilient-train.snapshot"
SNAPSHOT_VERSION = 2
"""2: the per-tensor tables stored as one JSON string (``encode_header``)."""
HEADER_TABLES = ("layout", "pieces")


_HEADERS: dict[str, tuple[tuple[int, int, int, int], Any]] = {}
"""Header path -> (its file's device, inode, size and mtime; the header) as last read or published here."""


def _file_identity(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def load_header(path: Path) -> Any:
    """The snapshot header at ``path`` (``decode_header``), read once per version of the file in this process (a
    header is replaced by a rename, never rewritten in place: a new version is another file, its inode or its
    modification time another, ``_file_identity``). A restore looks through the node's headers several times (the
    node-local discovery, the peer tier's holdings, the reshard's candidates and its clean-up), each read on the
    restart's critical path; a header this process published is not read back at all. Raises what ``os.stat`` and
    ``decode_header`` raise. The caller must not modify what it returns."""
    key = _file_identity(path)  # FT: before the load: a file replaced in between is read again next time
    cached = _HEADERS.get(str(path))
    if cached is not None and cached[0] == key:
        return cached[1]
    meta = decode_header(path)
    _HEADERS[str(path)] = (key, meta)
    return meta


def encode_header(meta: dict[str, Any]) -> dict[str, Any]:
    """A snapshot header as it is stored: its per-tensor tables (``HEADER_TABLES``: a few entries for each of the
    state's ~600 tensors) as one JSON string, the rest (the non-tensor state, with RNG tensors) for ``torch.save``.
    ``torch.load``'s weights-only unpickler is Python code, slow on the tables' thousands of small objects; ``json``
    is not (``bench/restore_cpu.py``'s ``header read`` line; BENCHMARKS.md, "Recovery per layer")."""
    tables = {key: meta[key] for key in HEADER_TABLES if key in meta}
    return {**{k: v for k, v in meta.items() if k not in HEADER_TABLES},
            "tables": json.dumps(tables, separators=(",", ":"))}


def decode_header(source: Any) -> Any:
    """The header ``encode_header`` stored, from a path or a file object (``torch.load``, weights only; the tables
    parsed back in place and checked). Raises what ``torch.load`` and ``json.loads`` raise, and ``ValueError`` for a
    snapshot header whose tables are missing or malformed."""
    meta = torch.load(source, map_location="cpu", weights_only=True)
    if not isinstance(meta, dict) or meta.get("format") != SNAPSHOT_FORMAT:
        return meta  # not a snapshot header: its reader says so
    if isinstance(meta.get("tables"), str):
        tables = json.loads(meta.pop("tables"))
        if not isinstance(tables, dict):
            raise ValueError("a snapshot header's tables are not a JSON object")
        meta.update(tables)
    _check_tables(meta)
    return meta


def _check_tables(meta: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless ``meta`` has both tables in the shapes ``encode_header`` writes: every reader (the
    discovery, the peer tier, the reshard) unpacks them without looking further."""
    layout, pieces = (meta.get(key) for key in HEADER_TABLES)
    if not isinstance(layout, dict) or not isinstance(pieces, dict):
        raise ValueError("a snapshot header's tables lack its layout or its pieces")
    for entry in layout.values():  # [dtype name, byte offset, shape]
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and isinstance(entry[1], int) and isinstance(entry[2], list)):
            raise ValueError("a snapshot header's layout has a malformed entry")
    for entry in pieces.values():  # [global shape, offset, shape, sharded]
        if not (isinstance(entry, list) and len(entry) == 4 and all(isinstance(e, list) for e in entry[:3])
                and isinstance(entry[3], bool)):
            raise ValueError("a snapshot header's pieces have a malformed entry")


def remember_header(path: Path, meta: Any) -> None:
    """``meta`` as the header just renamed into place at ``path`` (by this process: no need to read it back)."""
    try:
        _HEADERS[str(path)] = (_file_identity(path), meta)
    except OSError:  # removed meanwhile: the next reader finds it gone
        _HEADERS.pop(str(path), None)
