"""Small file helpers shared by the data reader and the checkpoint manager (no torch, no NVRx)."""

from __future__ import annotations

import hashlib
from pathlib import Path

HASH_CHUNK_BYTES = 16 * 2**20


def sha256_file(path: str | Path) -> str:
    """sha256 hex digest of a file, read in chunks (a multi-GB shard is never read into memory at once)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
