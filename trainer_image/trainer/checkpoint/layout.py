"""The persistent tier's on-disk format (the contract in ``CHECKPOINTS.md``): names, manifest, verification
and reading on any world size. Needs no process group; evaluation uses it read-only."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.errors import CheckpointError

log = logging.getLogger(__name__)

FORMAT = "resilient-train.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
STEP_DIGITS = 8
TMP_SUFFIX = ".tmp"
CORRUPT_INFIX = ".corrupt-"
PARTIAL_SUFFIX = ".partial"
REMOVING_INFIX = ".removing-"
"""``step-X.removing-<id>``: a checkpoint directory retention took out of the namespace, deleted in the background."""
MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
CHUNK_BYTES = 64 * 2**20
"""Shards are hashed in chunks of this size (``chunk_sha256`` in the manifest) so a reader verifies them with
several threads while it reads: one pass over the disk, not a hash pass followed by a load pass."""
HASH_THREADS = max(1, min(16, (os.cpu_count() or 1)))
_COMMITTED_RE = re.compile(r"^step-(\d{%d})$" % STEP_DIGITS)


def step_dir_name(step: int) -> str:
    return f"step-{step:0{STEP_DIGITS}d}"


def shard_file_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


def committed_steps(directory: Path) -> list[int]:
    """Steps of the committed checkpoints in ``directory`` (not verified), ascending."""
    try:
        entries = list(Path(directory).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for p in entries if (m := _COMMITTED_RE.match(p.name)) and p.is_dir())


@dataclass(frozen=True)
class Piece:
    """Where one rank's local tensor sits inside the global tensor."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    sharded: bool


def piece_record(piece: Piece) -> list[Any]:
    """A piece as a snapshot header stores it (lists and bools: a weights-only load reads it; ``reshard``)."""
    return [list(piece.global_shape), list(piece.offset), list(piece.shape), piece.sharded]


# ---- verification ---------------------------------------------------------------------------------------------
def read_manifest(step_dir: Path) -> tuple[dict[str, Any] | None, str, str]:
    """(manifest, reason slug, message); the manifest is None when missing or invalid."""
    path = step_dir / MANIFEST
    if not path.is_file():
        return None, "missing-manifest", f"{path} does not exist"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, "bad-manifest", f"{path} is not valid JSON: {exc}"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        return None, "bad-manifest", f"{path} is not a {FORMAT} v{VERSION} manifest"
    return manifest, "", ""


def _chunk_digest(path: Path, index: int, chunk_bytes: int) -> str:
    with open(path, "rb", buffering=0) as f:
        return hashlib.sha256(os.pread(f.fileno(), chunk_bytes, index * chunk_bytes)).hexdigest()


def _whole_file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def verify_shards(step_dir: Path, manifest: dict[str, Any], ranks: range | list[int], checksums: bool) -> list[tuple[str, str]]:
    """Problems ``(reason slug, message)`` with the listed shard files: missing, wrong size, wrong checksum, or
    not loadable with ``weights_only``. Chunk digests are computed by a thread pool (hashlib releases the GIL),
    which also brings the files into the page cache for the load that follows: reading is one disk pass."""
    problems: list[tuple[str, str]] = []
    shards = manifest["shards"]
    jobs: list[tuple[Path, int, int, str]] = []
    whole: list[tuple[Path, str]] = []
    for i in ranks:
        if i >= len(shards):
            continue
        entry = shards[i]
        path = step_dir / entry["file"]
        if not path.is_file():
            problems.append(("missing-shard", f"{path} does not exist"))
            continue
        if path.stat().st_size != entry["bytes"]:
            problems.append(("size-mismatch", f"{path} has {path.stat().st_size} bytes, manifest says {entry['bytes']}"))
            continue
        if not checksums:
            continue
        if "chunk_sha256" in entry:
            jobs += [(path, k, int(entry["chunk_bytes"]), d) for k, d in enumerate(entry["chunk_sha256"])]
        else:  # a manifest written before chunked digests: one whole-file sha256
            whole.append((path, entry["sha256"]))
    if jobs or whole:
        with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="ckpt-verify") as pool:
            chunk_results = pool.map(lambda j: (j[0], j[3] == _chunk_digest(j[0], j[1], j[2])), jobs)
            whole_results = pool.map(lambda w: (w[0], w[1] == _whole_file_digest(w[0])), whole)
            bad = sorted({str(path) for path, ok in [*chunk_results, *whole_results] if not ok})
        problems += [("checksum-mismatch", f"{path} sha256 differs from the manifest") for path in bad]
    return problems


# ---- reading ---------------------------------------------------------------------------------------------------
class ShardUnreadable(CheckpointError):
    """A shard file that verified but cannot be loaded safely (refused by ``weights_only``, not a zip, truncated)."""

    reason = "unloadable"


def load_shard_file(path: Path) -> dict[str, Any]:
    """A shard file, memory-mapped (only the slices actually read are paged in); ``weights_only``, always.

    A file that a weights-only load refuses is never loaded any other way: it is reported as unloadable."""
    try:
        if not zipfile.is_zipfile(path):
            raise ShardUnreadable(f"{path} is not a torch checkpoint (not a zip archive); it was not loaded")
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except ShardUnreadable:
        raise
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()
        detail = next((line for line in first if "Unsupported" in line or "global" in line.lower()), first[0] if first else "")
        raise ShardUnreadable(
            f"{path} holds objects a weights-only load refuses ({detail.strip()[:200]}): not a shard this trainer "
            "wrote, or tampered with. It was not loaded, and must never be loaded with weights_only=False"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError, zipfile.BadZipFile) as exc:
        raise ShardUnreadable(f"{path} cannot be read as a torch checkpoint ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None


class Shards:
    """Lazily opened shard files of one committed checkpoint."""

    def __init__(self, step_dir: Path, manifest: dict[str, Any]) -> None:
        self.dir, self.manifest, self._open = step_dir, manifest, {}

    def file(self, rank: int) -> dict[str, Any]:
        if rank not in self._open:
            self._open[rank] = load_shard_file(self.dir / self.manifest["shards"][rank]["file"])
        return self._open[rank]

    def sources(self, key: str, piece: Piece) -> list[int]:
        """The ranks whose files hold part of this rank's box of ``key``."""
        meta = self._meta(key, piece)
        out = []
        for src in meta["pieces"] if meta["sharded"] else meta["pieces"][:1]:
            if overlaps(piece.offset, piece.shape, tuple(src["offset"]), tuple(src["shape"])):
                out.append(src["rank"])
        return out

    def _meta(self, key: str, piece: Piece) -> dict[str, Any]:
        meta = self.manifest["tensors"].get(key)
        if meta is None:
            raise CheckpointError(f"{self.dir}: has no tensor {key!r}; the model/optimizer differ from the checkpoint's")
        if tuple(meta["global_shape"]) != piece.global_shape:
            raise CheckpointError(
                f"{self.dir}: {key} has shape {tuple(meta['global_shape'])} in the checkpoint but "
                f"{piece.global_shape} in this model; use the model config the checkpoint was saved with"
            )
        return meta

    def fill(self, key: str, dst: torch.Tensor, piece: Piece) -> None:
        """Copy the region ``piece`` of the global tensor ``key`` into ``dst`` from whichever files hold it."""
        meta = self._meta(key, piece)
        sources = meta["pieces"] if meta["sharded"] else meta["pieces"][:1]
        covered, seen = 0, set()
        for src in sources:
            region = (tuple(src["offset"]), tuple(src["shape"]))
            if region in seen:  # a replicated copy (e.g. HSDP) of a region already read
                continue
            seen.add(region)
            if not overlaps(piece.offset, piece.shape, *region):
                continue
            covered += copy_overlap(dst, piece.offset, self.file(src["rank"])["tensors"][key], *region)
        if covered != dst.numel():
            raise CheckpointError(f"{self.dir}: {key} covers {covered} of {dst.numel()} elements of this rank's shard")


def overlaps(a_off: tuple[int, ...], a_shape: tuple[int, ...], b_off: tuple[int, ...], b_shape: tuple[int, ...]) -> bool:
    """Whether two boxes of the same global tensor intersect (a 0-dim tensor: always)."""
    return all(max(a, b) < min(a + n, b + m) for a, n, b, m in zip(a_off, a_shape, b_off, b_shape)) or not a_shape


def copy_overlap(dst: torch.Tensor, dst_offset: tuple[int, ...], src: torch.Tensor, src_offset: tuple[int, ...], src_shape: tuple[int, ...]) -> int:
    """Copy the intersection of two boxes of the same global tensor; returns the elements copied."""
    dst_idx, src_idx, count = [], [], 1
    for d in range(dst.ndim):
        lo = max(dst_offset[d], src_offset[d])
        hi = min(dst_offset[d] + dst.shape[d], src_offset[d] + src_shape[d])
        if hi <= lo:
            return 0
        dst_idx.append(slice(lo - dst_offset[d], hi - dst_offset[d]))
        src_idx.append(slice(lo - src_offset[d], hi - src_offset[d]))
        count *= hi - lo
    with torch.no_grad():
        dst[tuple(dst_idx)].copy_(src[tuple(src_idx)])
    return count


def probe_loadable(step_dir: Path, manifest: dict[str, Any], ranks: range | list[int]) -> list[tuple[str, str]]:
    """Problems with opening the listed shard files (weights-only, memory-mapped: cheap, reads no tensor data)."""
    problems = []
    for i in ranks:
        if i < len(manifest["shards"]):
            try:
                load_shard_file(step_dir / manifest["shards"][i]["file"])
            except ShardUnreadable as exc:
                problems.append((ShardUnreadable.reason, str(exc)))
    return problems


def find_valid_checkpoint(directory: str | Path, step: int | None = None, checksums: bool = True) -> tuple[Path, dict[str, Any]]:
    """The newest (or the given) committed checkpoint whose manifest and shards verify and load; read-only
    (no renames). Invalid newer ones are skipped with a WARNING. Raises ``CheckpointError`` when there is none,
    with every reason in its message."""
    directory = Path(directory)
    steps = [step] if step is not None else committed_steps(directory)[::-1]
    skipped = []
    for candidate in steps:
        step_dir = directory / step_dir_name(candidate)
        manifest, reason, message = read_manifest(step_dir)
        everyone = range(len(manifest["shards"])) if manifest else range(0)
        problems = [(reason, message)] if manifest is None else (
            verify_shards(step_dir, manifest, everyone, checksums) or probe_loadable(step_dir, manifest, everyone))
        if not problems:
            return step_dir, manifest  # type: ignore[return-value]
        log.warning("checkpoint %s is invalid (%s): %s; skipping it", step_dir, problems[0][0], problems[0][1])
        skipped.append(f"{step_dir.name}: {problems[0][0]} ({problems[0][1]})")
    if not steps:
        leftovers = sorted(p.name for p in directory.glob("step-*")) if directory.is_dir() else []
        what = (f"only {', '.join(leftovers)} (not committed checkpoints: a save in progress, a crash mid-save, or "
                "quarantined)") if leftovers else "nothing"
        where = "does not exist" if not directory.exists() else f"holds {what}"
        raise CheckpointError(f"no committed checkpoint in {directory}: it {where}")
    raise CheckpointError(f"no valid checkpoint in {directory}: " + "; ".join(skipped))


def load_model_weights(directory: str | Path, step: int | None = None) -> dict[str, torch.Tensor]:
    """The full (unsharded) model weights of the newest valid (or the given) checkpoint, written on any world size.

    One process, no process group needed (evaluation). Keys are the model's FQNs."""
    step_dir, manifest = find_valid_checkpoint(directory, step)
    shards = Shards(step_dir, manifest)
    weights = {}
    for key, meta in manifest["tensors"].items():
        if not key.startswith(MODEL_PREFIX):
            continue
        full = torch.empty(meta["global_shape"], dtype=getattr(torch, meta["dtype"]))
        shards.fill(key, full, Piece(tuple(meta["global_shape"]), (0,) * full.ndim, tuple(full.shape), full.dtype, False))
        weights[key[len(MODEL_PREFIX) :]] = full
    return weights
