"""The published snapshots in a node's directory, read from their headers: the one concern of this module.

A node's snapshot directory holds its ranks' own slots (``rank-R.slot-J``), the peer tier's replicas of other nodes'
ranks (``peer-rank-R.slot-J``) and old ranks' snapshots fetched for a reshard (``cut-rank-R.slot-J``), each a data
file beside its ``.meta`` header. The peer tier (which replicas it holds) and the reshard (which old world sizes
are complete here) both look through them with ``scan``. Every header file is written to a side name and renamed into
place (a new file per version), so ``snapshot_header.load_header`` unpickles each version once per process: a restore's
several scans, and the node-local discovery before them, read each header once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from trainer.checkpoint.snapshot_header import SNAPSHOT_FORMAT, load_header

PEER = "peer-"
"""The name prefix of a replica of another node's rank (the peer tier)."""
FETCHED = "cut-"
"""The name prefix of an old rank's snapshot fetched from another node for a reshard (removed with the job)."""
_NAME = re.compile(rf"({PEER}|{FETCHED})?rank-(\d{{5}})\.slot-(\d+)\.meta$")


@dataclass
class Header:
    """One published snapshot on this node: ``kind`` is '' (a slot of this node's), ``peer-`` or ``cut-``."""

    kind: str
    rank: int
    meta: dict[str, Any]
    meta_path: Path
    data: Path


def data_path(meta_path: Path) -> Path:
    return meta_path.with_name(meta_path.name.removesuffix(".meta") + ".data")


def seal_path(meta_path: Path) -> Path:
    """Where a replica's seal (``peerauth``: its content digest and the source rank's HMAC) is kept."""
    return meta_path.with_name(meta_path.name.removesuffix(".meta") + ".seal")


def scan(store: Any) -> Iterator[Header]:
    """Every snapshot in ``store``'s directory of its job and configuration whose header reads and whose data file
    has the size the header names (a half-written or foreign one is skipped: its writer completes or removes it)."""
    for meta_path in sorted(store.dir.glob("*rank-*.slot-*.meta")) if store.dir.is_dir() else []:
        match = _NAME.match(meta_path.name)
        if not match:
            continue
        try:
            meta = load_header(meta_path)  # once per version of the file: a restore scans several times
        except Exception:  # noqa: BLE001 - half-written or foreign
            continue
        if not isinstance(meta, dict) or meta.get("format") != SNAPSHOT_FORMAT or \
                (meta.get("job"), meta.get("config_hash")) != (store.job, store.config_hash):
            continue
        rank, data = int(match.group(2)), data_path(meta_path)
        if meta.get("rank") == rank and data.is_file() and data.stat().st_size == meta.get("nbytes"):
            yield Header(match.group(1) or "", rank, meta, meta_path, data)
