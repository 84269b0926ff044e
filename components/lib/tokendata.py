"""Data prep: a local text corpus -> byte-level BPE tokenizer -> token shards + manifest.

Writes the token-shard format specified in ``trainer_image/trainer/SHARDS.md`` (version 1); the
trainer's reader (``trainer.data``) checks it. Torch-free on purpose: numpy and ``tokenizers`` only.

CLI::

    python -m components.lib.tokendata --out DIR [--corpus PATH] [--vocab-size N] ...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import sys
import sysconfig
import time
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import unquote, urlparse
from urllib.request import url2pathname

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

log = logging.getLogger(__name__)

#: Format identity written to the manifest; must match ``trainer.data`` (see SHARDS.md).
FORMAT = "resilient-train.token-shards"
FORMAT_VERSION = 1
EOS_TOKEN = "<|endoftext|>"
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
DEFAULT_SHARD_TOKENS = 2**24
#: 256 byte tokens + EOS is the smallest byte-level vocabulary; ids must fit the uint32 shard dtype.
MIN_VOCAB_SIZE = 257
MAX_VOCAB_SIZE = 2**32
_ENCODE_CHUNK_DOCS = 256
_SHARD_NAME = re.compile(r"^(?:train|val)-\d{5}\.bin(?:\.tmp)?$")


class CorpusError(ValueError):
    """The corpus cannot be used as given; the message says what to change."""


def default_corpus() -> Path:
    """The running Python's standard library directory: a local corpus that every machine has."""
    return Path(sysconfig.get_paths()["stdlib"])


def dtype_for_vocab(vocab_size: int) -> str:
    """Shard dtype for a vocabulary: ``uint16`` when every id fits in 16 bits, else ``uint32``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def _local_corpus_path(corpus: str | Path) -> Path:
    """Turn a corpus argument (path or ``file://`` URI) into an existing local path."""
    text = str(corpus)
    if "://" in text:
        uri = urlparse(text)
        if uri.scheme != "file":  # s3://, gs://, hf:// readers: the byo-data branch (params.CORPUS_SCHEMES)
            raise CorpusError(
                f"corpus {text!r}: only local paths and file:// URIs are supported in this build "
                f"(got scheme {uri.scheme!r}). Mount the bucket (e.g. gcsfuse, s3fs, a KFP volume) "
                "or copy the corpus locally, then pass the local path."
            )
        if uri.netloc not in ("", "localhost"):
            raise CorpusError(f"corpus {text!r}: file:// URIs must name a local path (file:///abs/path)")
        path = Path(url2pathname(unquote(uri.path)))
    else:
        path = Path(text)
    if not path.exists():
        raise CorpusError(f"corpus path {str(path)!r} does not exist: pass an existing directory or text file")
    return path


def iter_corpus_files(
    corpus: str | Path, pattern: str = "*.py", *, exclude_dirs: Sequence[str] = ("site-packages",)
) -> Iterator[Path]:
    """Yield the corpus files in a deterministic (sorted) order.

    ``corpus`` is a directory (searched recursively for ``pattern``, skipping any path through a
    directory named in ``exclude_dirs``), a single text file, or a ``file://`` URI of either.
    Remote URIs (``gs://``, ``s3://``, ``http(s)://``) raise :class:`CorpusError`.
    """
    root = _local_corpus_path(corpus)
    if root.is_file():
        yield root
        return
    excluded = set(exclude_dirs)
    found = (
        p
        for p in root.rglob(pattern)
        if p.is_file() and not excluded.intersection(p.relative_to(root).parts[:-1])
    )
    yield from sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _read_document(path: Path) -> str | None:
    """A file's text, or None when it is not valid UTF-8 or empty (such files are skipped)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text or None


def train_tokenizer(documents: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE tokenizer locally with ``<|endoftext|>`` as its only special token.

    Deterministic for the same documents in the same order. The result encodes a literal
    ``<|endoftext|>`` inside a document as text, so only real document ends yield the EOS id.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    tokenizer.encode_special_tokens = True
    return tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A byte-level BPE tokenizer from ``tokenizer.json`` or a dataset directory that holds one."""
    p = Path(path)
    if p.is_dir():
        p = p / TOKENIZER_FILE
    if not p.is_file():
        raise CorpusError(f"tokenizer {str(path)!r} not found: give a tokenizer.json or a dataset directory")
    tok = Tokenizer.from_file(str(p))
    if tok.token_to_id(EOS_TOKEN) is None:
        raise CorpusError(f"tokenizer {p} has no {EOS_TOKEN!r} token: it was not built by this data prep")
    tok.encode_special_tokens = True
    return tok


def _fsync_dir(directory: Path) -> None:
    """Persist a directory's entries (renames) on POSIX file systems."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> str:
    """Write ``data`` to ``path`` via a tmp file + fsync + rename; return its sha256 hex."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return hashlib.sha256(data).hexdigest()


class _ShardWriter:
    """Cuts a token stream of one split into shards of exactly ``shard_tokens`` (last one shorter)."""

    def __init__(self, out_dir: Path, split: str, dtype: str, shard_tokens: int) -> None:
        self._out_dir = out_dir
        self._split = split
        self._dtype = np.dtype(dtype).newbyteorder("<")
        self._shard_tokens = shard_tokens
        self._pending: list[np.ndarray] = []
        self._num_pending = 0
        self.entries: list[dict] = []

    def add(self, ids: np.ndarray) -> None:
        """Append token ids, writing every shard that fills up."""
        self._pending.append(ids.astype(self._dtype, copy=False))
        self._num_pending += len(ids)
        while self._num_pending >= self._shard_tokens:
            stream = np.concatenate(self._pending)
            self._write(stream[: self._shard_tokens])
            rest = stream[self._shard_tokens :]
            self._pending, self._num_pending = [rest], len(rest)

    def close(self) -> list[dict]:
        """Write the final partial shard; return the manifest entries of all shards."""
        if self._num_pending:
            self._write(np.concatenate(self._pending))
        self._pending, self._num_pending = [], 0
        return self.entries

    def _write(self, tokens: np.ndarray) -> None:
        name = f"{self._split}-{len(self.entries):05d}.bin"
        data = tokens.tobytes()
        sha = _atomic_write(self._out_dir / name, data)
        self.entries.append({"file": name, "num_tokens": len(tokens), "num_bytes": len(data), "sha256": sha})


def _select_files(files: Iterable[Path], max_files: int | None, max_bytes: int | None) -> list[Path]:
    """The first files of the corpus within the ``max_files`` / ``max_bytes`` limits."""
    selected: list[Path] = []
    total = 0
    for path in files:
        if max_files is not None and len(selected) >= max_files:
            break
        if max_bytes is not None and total >= max_bytes:
            break
        selected.append(path)
        total += path.stat().st_size
    return selected


def _validate_args(
    vocab_size: int, val_fraction: float, shard_tokens: int, max_files: int | None, max_bytes: int | None
) -> None:
    """Reject bad build arguments before any work is done."""
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is out of range: use {MIN_VOCAB_SIZE} (256 bytes + EOS) to {MAX_VOCAB_SIZE}"
        )
    if not 0 < val_fraction <= 0.5:
        raise ValueError(f"val_fraction={val_fraction} is out of range: use a value in (0, 0.5], e.g. 0.05")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens={shard_tokens} must be >= 1 (default {DEFAULT_SHARD_TOKENS})")
    for name, value in (("max_files", max_files), ("max_bytes", max_bytes)):
        if value is not None and value < 1:
            raise ValueError(f"{name}={value} must be >= 1, or None for no limit")


def _remove_stale_files(out_dir: Path, keep: set[str]) -> None:
    """Delete shard and tmp files of an older or interrupted build that the new manifest does not list."""
    for path in out_dir.iterdir():
        if path.name not in keep and (_SHARD_NAME.match(path.name) or path.name.endswith(".json.tmp")):
            path.unlink()


def build_dataset(
    corpus: str | Path,
    out_dir: str | Path,
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    seed: int = 0,
    max_files: int | None = None,
    max_bytes: int | None = None,
    pattern: str = "*.py",
    tokenizer: str | Path | None = None,
) -> dict:
    """Train a tokenizer on the corpus and write a version-1 token-shard dataset; return its manifest.

    Each corpus file is one document. Files that are not valid UTF-8 (or are empty) are skipped and
    counted in ``source.num_skipped_files``. Documents go to the val split by a seeded permutation
    (``round(n * val_fraction)``, at least one); the tokenizer is trained on the train split only.
    ``max_files`` / ``max_bytes`` keep only the first files (sorted order) of the corpus.
    ``tokenizer`` reuses an existing ``tokenizer.json`` (or a dataset directory holding one) instead of
    training a new one, so a warm-started model sees the token ids it was trained on; ``vocab_size`` is then
    ignored.
    """
    _validate_args(vocab_size, val_fraction, shard_tokens, max_files, max_bytes)
    candidates = _select_files(iter_corpus_files(corpus, pattern), max_files, max_bytes)
    if not candidates:
        raise CorpusError(f"corpus {str(corpus)!r} has no files matching {pattern!r}: check the path and the pattern")
    files = [p for p in candidates if _read_document(p) is not None]
    if len(files) < 2:
        raise CorpusError(
            f"corpus {str(corpus)!r} has {len(files)} usable UTF-8 file(s) matching {pattern!r} "
            f"({len(candidates) - len(files)} skipped): need at least 2 (one train, one val document)"
        )
    is_val = np.zeros(len(files), dtype=bool)
    is_val[np.random.default_rng(seed).permutation(len(files))[: max(1, round(len(files) * val_fraction))]] = True
    split_files = {"train": [p for p, v in zip(files, is_val) if not v], "val": [p for p, v in zip(files, is_val) if v]}

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)

    start = time.monotonic()
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    else:
        tok = train_tokenizer((d for p in split_files["train"] if (d := _read_document(p))), vocab_size)
    actual_vocab = tok.get_vocab_size()
    eos_id = tok.token_to_id(EOS_TOKEN)
    dtype = dtype_for_vocab(actual_vocab)
    tokenizer_sha = _atomic_write(out / TOKENIZER_FILE, tok.to_str().encode("utf-8"))
    log.info("%s tokenizer: vocab %d in %.1fs", "reused" if tokenizer else "trained", actual_vocab,
             time.monotonic() - start)

    shards: dict[str, list[dict]] = {}
    for split in SPLITS:
        writer = _ShardWriter(out, split, dtype, shard_tokens)
        paths = split_files[split]
        for i in range(0, len(paths), _ENCODE_CHUNK_DOCS):
            texts = [d for p in paths[i : i + _ENCODE_CHUNK_DOCS] if (d := _read_document(p))]
            flat: list[int] = []
            for encoding in tok.encode_batch(texts, add_special_tokens=False):
                flat.extend(encoding.ids)
                flat.append(eos_id)
            writer.add(np.array(flat, dtype=np.uint32))
        shards[split] = writer.close()
    log.info("encoded %d documents in %.1fs", len(files), time.monotonic() - start)

    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "dtype": dtype,
        "vocab_size": actual_vocab,
        "eos_id": eos_id,
        "eos_token": EOS_TOKEN,
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_sha256": tokenizer_sha,
        "splits": shards,
        "num_tokens": {split: sum(e["num_tokens"] for e in shards[split]) for split in SPLITS},
        "source": {
            "corpus": str(corpus),
            "pattern": pattern,
            "num_files": len(candidates),
            "num_documents": len(files),
            "num_skipped_files": len(candidates) - len(files),
            "num_documents_by_split": {split: len(split_files[split]) for split in SPLITS},
        },
        "build": {
            "requested_vocab_size": vocab_size,
            "val_fraction": val_fraction,
            "seed": seed,
            "shard_tokens": shard_tokens,
            "tokenizer_from": str(tokenizer) if tokenizer else None,
        },
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    _atomic_write(out / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode("utf-8"))
    _fsync_dir(out)
    _remove_stale_files(out, {e["file"] for entries in shards.values() for e in entries})
    return manifest


def summarize(manifest: dict, out_dir: str | Path) -> str:
    """A short human-readable summary of a dataset manifest."""
    src = manifest["source"]
    lines = [
        f"dataset     {out_dir}",
        f"corpus      {src['corpus']} ({src['num_documents']} documents, {src['num_skipped_files']} files skipped)",
        f"tokenizer   byte-level BPE, vocab {manifest['vocab_size']}, eos_id {manifest['eos_id']}, "
        f"dtype {manifest['dtype']}",
    ]
    for split in SPLITS:
        lines.append(
            f"{split:<11} {manifest['num_tokens'][split]:,} tokens in {len(manifest['splits'][split])} shard(s), "
            f"{src['num_documents_by_split'][split]} documents"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: build a dataset and print its summary; exit 2 on bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m components.lib.tokendata",
        description="Build a token-shard dataset (trainer_image/trainer/SHARDS.md) from a local text corpus.",
    )
    parser.add_argument(
        "--corpus",
        default=str(default_corpus()),
        help="directory, text file or file:// URI (default: this Python's stdlib)",
    )
    parser.add_argument("--out", required=True, help="output dataset directory")
    parser.add_argument("--pattern", default="*.py", help="file glob inside a corpus directory (default: *.py)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-files", type=int, default=None)
    parser.add_argument("--max-bytes", type=int, default=None)
    parser.add_argument("--tokenizer", default=None, help="reuse this tokenizer.json (or dataset dir's) instead of training one")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.monotonic()
    try:
        manifest = build_dataset(
            args.corpus,
            args.out,
            vocab_size=args.vocab_size,
            val_fraction=args.val_fraction,
            shard_tokens=args.shard_tokens,
            seed=args.seed,
            max_files=args.max_files,
            max_bytes=args.max_bytes,
            pattern=args.pattern,
            tokenizer=args.tokenizer,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(summarize(manifest, args.out))
    print(f"built in {time.monotonic() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
