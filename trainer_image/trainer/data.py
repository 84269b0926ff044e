"""Token-shard reader and data loaders for the trainer.

Reads the dataset format specified in ``SHARDS.md`` next to this file (version 1), written by data
prep (``components/lib/tokendata.py``). numpy + torch only: no NVRx, no ``components`` imports.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any
from pathlib import Path

import numpy as np
import torch

from trainer.fileio import HASH_CHUNK_BYTES, sha256_file

#: Format identity this reader accepts (SHARDS.md); must match the writer's constants.
FORMAT = "resilient-train.token-shards"
SUPPORTED_VERSIONS = (1,)
MANIFEST = "manifest.json"
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_FIX = "re-run data prep (python -m components.lib.tokendata) to rebuild the dataset"
VERIFIED_FILE = "data-verified.json"
"""The trainer keeps it in ``train.run_dir``: the dataset files verified so far in this job (``VerifiedFiles``)."""

log = logging.getLogger(__name__)


class ShardError(ValueError):
    """A dataset file is missing, corrupt or inconsistent with its manifest; names the file."""


def _require_int(manifest_path: Path, where: str, value: object, minimum: int) -> int:
    """Return ``value`` if it is an int >= ``minimum``, else raise ShardError naming the field."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ShardError(f"{manifest_path}: {where} must be an integer >= {minimum}, got {value!r}; {_FIX}")
    return value


def _scan_file(path: Path, dtype: np.dtype) -> tuple[str, int]:
    """Chunked pass over a shard: its sha256 hex and its largest token id (memory bounded)."""
    digest = hashlib.sha256()
    max_id = 0
    buf = bytearray(HASH_CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
            chunk = np.frombuffer(view[: n - n % dtype.itemsize], dtype=dtype)
            if chunk.size:
                max_id = max(max_id, int(chunk.max()))
    return digest.hexdigest(), max_id


class VerifiedFiles:
    """The dataset files whose checksums were verified earlier in this job, so a restarted worker does not hash
    the whole dataset again (the 1B job's restart spent its start-up on it). Kept as JSON in ``marker``, keyed by
    the dataset directory and the sha256 of its manifest (which holds every file's sha256); a file counts as
    verified only while its size, modification time and inode are those it had when it was hashed, so a shard
    rewritten or replaced since is hashed again (and a corrupt one is still exit 3). Bytes that rot in place
    without any of those changing are not seen after the first verification, as they are not while training."""

    def __init__(self, marker: Path | None, dataset: Path, manifest_bytes: bytes) -> None:
        self.marker = marker
        self.key = {"dataset": str(dataset.resolve()), "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest()}
        self.files: dict[str, list[int]] = {}
        self.hashed: list[str] = []
        if marker is not None:
            try:
                saved = json.loads(marker.read_text(encoding="utf-8"))
                if isinstance(saved, dict) and all(saved.get(k) == v for k, v in self.key.items()):
                    self.files = dict(saved.get("files") or {})
            except (OSError, ValueError):
                pass  # none yet, or unreadable: verify

    @staticmethod
    def _identity(path: Path) -> list[int]:
        st = path.stat()
        return [st.st_size, st.st_mtime_ns, st.st_ino]

    def covers(self, path: Path) -> bool:
        return self.files.get(path.name) == self._identity(path)

    def add(self, path: Path) -> None:
        self.files[path.name] = self._identity(path)
        self.hashed.append(path.name)

    def save(self) -> None:
        """Record the files verified (best effort: without the marker the next start verifies again)."""
        if self.marker is None or not self.hashed:
            return
        tmp = self.marker.with_name(f"{self.marker.name}.{os.getpid()}.partial")
        try:
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({**self.key, "files": self.files}, indent=1) + "\n", encoding="utf-8")
            os.replace(tmp, self.marker)  # ranks verifying at once write the same content
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            log.warning("could not record the verified dataset in %s (%s): the next start verifies it again",
                        self.marker, exc)


class ShardedTokens:
    """One split of a token-shard dataset, validated against its manifest and memory-mapped read-only.

    ``verify=True`` additionally hashes every shard (and the tokenizer) and checks that every token
    id is below ``vocab_size``; size, dtype and presence checks always run. ``verified``: a marker file
    (``VerifiedFiles``) that lets later starts of the same job skip files verified before and unchanged since.
    """

    def __init__(self, path: str | Path, split: str = "train", verify: bool = True,
                 verified: str | Path | None = None) -> None:
        self.path = Path(path)
        self.split = split
        manifest_path = self.path / MANIFEST
        if not manifest_path.is_file():
            raise ShardError(f"{manifest_path} not found: no complete dataset at {self.path}; {_FIX}")
        try:
            manifest_bytes = manifest_path.read_bytes()
            manifest = json.loads(manifest_bytes.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ShardError(f"{manifest_path} is not valid JSON ({err}); {_FIX}") from err
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
            raise ShardError(f"{manifest_path}: format {got!r} is not {FORMAT!r}; {_FIX}")
        if manifest.get("version") not in SUPPORTED_VERSIONS:
            raise ShardError(
                f"{manifest_path}: format version {manifest.get('version')!r} is not supported by this trainer "
                f"(supports {list(SUPPORTED_VERSIONS)}); {_FIX} with the matching version, or upgrade the trainer image"
            )
        dtype_name = manifest.get("dtype")
        if dtype_name not in _DTYPES:
            raise ShardError(f"{manifest_path}: dtype {dtype_name!r} is not one of {sorted(_DTYPES)}; {_FIX}")
        vocab_size = _require_int(manifest_path, "vocab_size", manifest.get("vocab_size"), 1)
        expected_dtype = "uint16" if vocab_size <= 2**16 else "uint32"
        if dtype_name != expected_dtype:
            raise ShardError(
                f"{manifest_path}: dtype {dtype_name} does not match vocab_size {vocab_size} "
                f"(the format requires {expected_dtype}); {_FIX}"
            )
        eos_id = _require_int(manifest_path, "eos_id", manifest.get("eos_id"), 0)
        if eos_id >= vocab_size:
            raise ShardError(f"{manifest_path}: eos_id {eos_id} >= vocab_size {vocab_size}; {_FIX}")
        splits = manifest.get("splits") if isinstance(manifest.get("splits"), dict) else {}
        entries = splits.get(split)
        if not isinstance(entries, list) or not entries:
            raise ShardError(
                f"{manifest_path}: no shards listed for split {split!r} (splits: {sorted(splits)}); "
                f"use one of those splits or {_FIX}"
            )

        dtype = _DTYPES[dtype_name]
        started = time.perf_counter()
        done = VerifiedFiles(Path(verified) if verified else None, self.path, manifest_bytes)
        if verify:
            self._verify_tokenizer(manifest_path, manifest, done)
        shards: list[np.memmap] = []
        for i, entry in enumerate(entries):
            shards.append(self._open_shard(manifest_path, f"splits.{split}[{i}]", entry, dtype, vocab_size,
                                           verify, done))
        total = sum(len(s) for s in shards)
        declared = manifest.get("num_tokens", {}).get(split) if isinstance(manifest.get("num_tokens"), dict) else None
        if declared != total:
            raise ShardError(
                f"{manifest_path}: num_tokens.{split} is {declared!r} but its shards hold {total} tokens; {_FIX}"
            )
        self._manifest = manifest
        self._dtype_name = dtype_name
        self.shards: tuple[np.memmap, ...] = tuple(shards)
        if verify and done.hashed:
            done.save()
            log.info("dataset %s (%s): checksums of %d file(s) verified in %.2f s", self.path, split, len(done.hashed),
                     time.perf_counter() - started)
        elif verify:
            log.info("dataset %s (%s): checksums verified earlier in this job (%s), files unchanged since",
                     self.path, split, done.marker)

    def _verify_tokenizer(self, manifest_path: Path, manifest: dict, done: VerifiedFiles) -> None:
        """Check that the tokenizer file named by the manifest exists and matches its sha256."""
        name = manifest.get("tokenizer")
        if not isinstance(name, str) or Path(name).name != name:
            raise ShardError(f"{manifest_path}: tokenizer must be a file name in the dataset directory; {_FIX}")
        path = self.path / name
        if not path.is_file():
            raise ShardError(f"{path} is missing; {_FIX}")
        if done.covers(path):
            return
        if sha256_file(path) != manifest.get("tokenizer_sha256"):
            raise ShardError(f"{path} is corrupt: its sha256 does not match the manifest; {_FIX}")
        done.add(path)

    def _open_shard(
        self, manifest_path: Path, where: str, entry: object, dtype: np.dtype, vocab_size: int, verify: bool,
        done: VerifiedFiles,
    ) -> np.memmap:
        """Validate one manifest shard entry against its file and memory-map it."""
        bad_entry = f"{manifest_path}: {where} must name a shard file in the dataset directory; {_FIX}"
        if not isinstance(entry, dict):
            raise ShardError(bad_entry)
        name = entry.get("file")
        if not isinstance(name, str) or Path(name).name != name:
            raise ShardError(bad_entry)
        num_tokens = _require_int(manifest_path, f"{where}.num_tokens", entry.get("num_tokens"), 1)
        path = self.path / name
        if not path.is_file():
            raise ShardError(f"shard {path} is missing (listed in {manifest_path}); {_FIX}")
        expected_bytes = num_tokens * dtype.itemsize
        size = path.stat().st_size
        if size != expected_bytes or entry.get("num_bytes") != expected_bytes:
            raise ShardError(
                f"shard {path} has {size} bytes but the manifest expects {num_tokens} tokens x {dtype.itemsize} bytes "
                f"({dtype.name}) = {expected_bytes} (num_bytes={entry.get('num_bytes')!r}): the shard is truncated "
                f"or was written with another dtype; {_FIX}"
            )
        if verify and not done.covers(path):
            sha, max_id = _scan_file(path, dtype)
            if sha != entry.get("sha256"):
                raise ShardError(f"shard {path} is corrupt: its sha256 does not match the manifest; {_FIX}")
            if max_id >= vocab_size:
                raise ShardError(
                    f"shard {path} holds token id {max_id} >= vocab_size {vocab_size}: wrong dtype or "
                    f"wrong manifest; {_FIX}"
                )
            done.add(path)
        return np.memmap(path, dtype=dtype, mode="r", shape=(num_tokens,))

    @property
    def manifest(self) -> dict:
        """The parsed manifest.json (a copy)."""
        return json.loads(json.dumps(self._manifest))

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the tokenizer (size the embedding from it)."""
        return self._manifest["vocab_size"]

    @property
    def eos_id(self) -> int:
        """Token id that ends every document."""
        return self._manifest["eos_id"]

    @property
    def bos_id(self) -> int | None:
        """Token id that starts every document, or None when the tokenizer adds no BOS (SHARDS.md)."""
        return self._manifest.get("bos_id")

    @property
    def dtype(self) -> str:
        """On-disk token dtype name: ``uint16`` or ``uint32``."""
        return self._dtype_name

    @property
    def num_tokens(self) -> int:
        """Total tokens in this split."""
        return sum(len(s) for s in self.shards)

    def num_samples(self, seq_len: int) -> int:
        """Number of ``seq_len + 1``-token windows (step ``seq_len``) that fit inside the shards."""
        return int(self._sample_offsets(seq_len)[-1])

    def samples(self, indices: Sequence[int] | np.ndarray, seq_len: int) -> np.ndarray:
        """The windows with the given global sample indices, as an int64 array ``[len(indices), seq_len + 1]``.

        Sample ``k`` lies in the shard ``s`` with ``offsets[s] <= k < offsets[s + 1]`` and starts at
        token ``(k - offsets[s]) * seq_len`` of it (SHARDS.md, "Training samples").
        """
        offsets = self._sample_offsets(seq_len)
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= offsets[-1]):
            raise IndexError(f"sample index out of range [0, {offsets[-1]}) for seq_len {seq_len}")
        out = np.empty((len(idx), seq_len + 1), dtype=np.int64)
        shard_of = np.searchsorted(offsets, idx, side="right") - 1
        for row, (k, s) in enumerate(zip(idx.tolist(), shard_of.tolist())):
            start = (k - int(offsets[s])) * seq_len
            out[row] = self.shards[s][start : start + seq_len + 1]
        return out

    def _sample_offsets(self, seq_len: int) -> np.ndarray:
        """Cumulative sample counts per shard: ``[0, n0, n0 + n1, ...]``."""
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        counts = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def _check_layout(seq_len: int, batch_size: int, rank: int, world_size: int) -> None:
    """Reject impossible loader arguments with a message naming the bad value."""
    if seq_len < 1 or batch_size < 1 or world_size < 1:
        raise ValueError(f"seq_len, batch_size and world_size must be >= 1 (got {seq_len}, {batch_size}, {world_size})")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")


def _require_samples(tokens: ShardedTokens, seq_len: int, needed: int) -> int:
    """The split's sample count, or a clear error when it holds fewer than ``needed`` samples."""
    available = tokens.num_samples(seq_len)
    if available < needed:
        raise ValueError(
            f"split {tokens.split!r} of {tokens.path} has {tokens.num_tokens} tokens in "
            f"{len(tokens.shards)} shard(s) = "
            f"{available} samples of seq_len {seq_len}, but one global batch needs {needed} samples "
            f"(at least {needed * seq_len + 1} tokens in one shard): use more data, a smaller seq_len, "
            "or a smaller batch_size / world_size"
        )
    return available


def _to_tensors(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``[n, seq_len + 1]`` windows into contiguous int64 (inputs, targets) tensors."""
    inputs = torch.from_numpy(np.ascontiguousarray(windows[:, :-1]))
    return inputs, torch.from_numpy(np.ascontiguousarray(windows[:, 1:]))


class TokenLoader:
    """Infinite, shuffled, resumable training batches for one rank.

    Epoch ``e`` visits samples in the order ``np.random.default_rng([seed, e]).permutation(num_samples)``.
    Each global step consumes the next ``world_size * batch_size * accumulation`` indices (an incomplete tail is
    dropped); the ``k``-th micro-batch of rank ``r`` in a step takes the slice starting at
    ``(k * world_size + r) * batch_size`` of them. The state is the global position, so a resume on another world
    size with the same global batch size (``train.global_batch``: fewer ranks accumulate more micro-batches)
    continues with exactly the same samples in each step.
    """

    def __init__(
        self, tokens: ShardedTokens, seq_len: int, batch_size: int, rank: int, world_size: int, seed: int,
        accumulation: int = 1,
    ) -> None:
        _check_layout(seq_len, batch_size, rank, world_size)
        if accumulation < 1:
            raise ValueError(f"accumulation must be >= 1 (got {accumulation})")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.accumulation = accumulation
        self.global_batch_size = batch_size * world_size * accumulation
        self.num_samples = _require_samples(tokens, seq_len, self.global_batch_size)
        self.epoch = 0
        self.position = 0
        self._micro = 0  # micro-batches of the current step already served
        self._perm = self._permutation(0)
        self.served: list[int] | None = None
        """Sample indices this rank served since the last `take_served`; None: not recorded (``data.sample_log``
        sets a list)."""

    def _permutation(self, epoch: int) -> np.ndarray:
        """The sample order of one epoch."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro-batch (inputs, targets), each an int64 CPU tensor ``[batch_size, seq_len]``; the
        step's position advances after its last one."""
        if self._micro == 0 and self.position + self.global_batch_size > self.num_samples:
            self.epoch += 1
            self.position = 0
            self._perm = self._permutation(self.epoch)
        start = self.position + (self._micro * self.world_size + self.rank) * self.batch_size
        indices = self._perm[start : start + self.batch_size]
        if self.served is not None:
            self.served.extend(indices.tolist())
        self._micro += 1
        if self._micro == self.accumulation:
            self._micro = 0
            self.position += self.global_batch_size
        return _to_tensors(self.tokens.samples(indices, self.seq_len))

    def take_served(self) -> dict[str, Any]:
        """The samples served since the last call (``{"epoch", "samples"}``: sample indices); clears them."""
        served, self.served = self.served or [], []
        return {"epoch": self.epoch, "samples": served}

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """The global position (JSON-serializable ints); identical on every rank."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved global position; raise ValueError naming what to change on a mismatch."""
        missing = {"epoch", "position", "seed", "seq_len", "global_batch_size", "num_samples"} - set(state)
        if missing:
            raise ValueError(
                f"loader state is missing {sorted(missing)}: it was not produced by TokenLoader.state_dict()"
            )
        if state["seq_len"] != self.seq_len:
            raise ValueError(
                f"loader state has seq_len={state['seq_len']} but this loader has {self.seq_len}: "
                f"set seq_len={state['seq_len']} to resume"
            )
        if state["seed"] != self.seed:
            raise ValueError(
                f"loader state has seed={state['seed']} but this loader has {self.seed}: "
                f"set the data seed to {state['seed']} to resume"
            )
        if state["global_batch_size"] != self.global_batch_size:
            gbs = state["global_batch_size"]
            if gbs % (self.world_size * self.batch_size) == 0:  # fewer ranks: more micro-batches each
                hint = f"set train.global_batch={gbs}"
            elif gbs % self.world_size == 0:
                hint = f"set batch_size={gbs // self.world_size} (or a divisor of it, with train.global_batch={gbs})"
            else:
                hint = f"{gbs} is not divisible by world_size={self.world_size}: change the world size"
            raise ValueError(
                f"loader state has global batch size {gbs} but this loader has world_size*batch_size*accumulation = "
                f"{self.world_size}*{self.batch_size}*{self.accumulation} = {self.global_batch_size}: {hint} to resume"
            )
        if state["num_samples"] != self.num_samples:
            raise ValueError(
                f"loader state was saved on a dataset with {state['num_samples']} samples but {self.tokens.path} "
                f"({self.tokens.split}) has {self.num_samples}: resume with the same dataset"
            )
        if not (state["epoch"] >= 0 and 0 <= state["position"] <= self.num_samples):
            raise ValueError(
                f"loader state has an invalid position (epoch={state['epoch']}, position={state['position']})"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._micro = 0  # a state is saved between steps
        self._perm = self._permutation(self.epoch)


def eval_batches(
    tokens: ShardedTokens, seq_len: int, batch_size: int, rank: int, world_size: int, max_batches: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One deterministic, unshuffled pass over the split for validation loss (arguments checked eagerly).

    Global batch ``g`` is samples ``[g * G, (g + 1) * G)`` with ``G = world_size * batch_size``; rank
    ``r`` gets the contiguous slice ``[r * batch_size, (r + 1) * batch_size)`` of it. Only complete
    global batches are yielded, so every rank yields the same number of equally shaped batches (safe
    for per-batch collectives) and each sample is seen at most once across ranks.
    """
    _check_layout(seq_len, batch_size, rank, world_size)
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches={max_batches} must be >= 1, or None for the whole split")
    global_batch = batch_size * world_size
    num_batches = _require_samples(tokens, seq_len, global_batch) // global_batch
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    starts = [g * global_batch + rank * batch_size for g in range(num_batches)]
    return (_to_tensors(tokens.samples(np.arange(s, s + batch_size), seq_len)) for s in starts)
