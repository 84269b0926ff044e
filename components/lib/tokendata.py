"""Data prep: a corpus (local path or URI) -> tokenizer -> token shards + manifest.

Writes the token-shard format specified in ``trainer_image/trainer/SHARDS.md`` (version 1); the trainer's reader
(``trainer.data``) checks it. Torch-free on purpose. The corpus is read by ``components.lib.corpus`` (one fsspec
code path for every scheme), the tokenizer comes from ``components.lib.tokenizer_files``; this module streams
documents through the tokenizer into shards and writes the manifest last.

CLI (``--help`` documents every option, the credentials' environment variables and the exit codes)::

    python -m components.lib.tokendata --out DIR [--corpus PATH_OR_URI] [--tokenizer PATH_OR_URI] ...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import sys
import sysconfig
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from itertools import chain
from pathlib import Path
from typing import IO, Any

import numpy as np

from components.lib.corpus import FORMATS, Corpus, Piece, Scan
from components.lib.storage import EXIT_DATA, EXIT_USAGE, CorpusDataError, CorpusError, Redactor
from components.lib.tokenizer_files import (
    COPIED_FILES,
    EOS_TOKEN,
    TOKENIZER_CONFIG,
    TOKENIZER_FILE,
    TokenizerFiles,
    load_tokenizer,
    load_tokenizer_files,
    train_tokenizer,
    trained_files,
)

__all__ = ["EOS_TOKEN", "FORMAT", "FORMAT_VERSION", "MANIFEST", "TOKENIZER_FILE", "CorpusDataError", "CorpusError",
           "build_dataset", "default_corpus", "dtype_for_vocab", "load_tokenizer", "main", "summarize"]

#: Format identity written to the manifest; must match ``trainer.data`` (see SHARDS.md).
FORMAT = "resilient-train.token-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
DEFAULT_SHARD_TOKENS = 2**24
#: Own BPE only: the tokenizer trainer sees at most this many bytes of train documents (spread over the corpus).
DEFAULT_TOKENIZER_SAMPLE_BYTES = 256 * 2**20
#: 256 byte tokens + EOS is the smallest byte-level vocabulary; ids must fit the uint32 shard dtype.
MIN_VOCAB_SIZE = 257
MAX_VOCAB_SIZE = 2**32
#: Pieces are encoded in batches of at most this many pieces and characters (bounded memory, parallel encode).
_BATCH_PIECES = 256
_BATCH_CHARS = 1 << 18
PROGRESS_INTERVAL_S = 5.0
_SHARD_NAME = re.compile(r"^(?:train|val)-\d{5}\.bin(?:\.tmp)?$")


def default_corpus() -> Path:
    """The running Python's standard library directory: a local corpus that every machine has."""
    return Path(sysconfig.get_paths()["stdlib"])


def default_pattern(corpus: str | Path) -> str:
    """``*.py`` for the default (stdlib) corpus, else ``*`` (every file that is not hidden)."""
    return "*.py" if str(corpus) == str(default_corpus()) else "*"


def dtype_for_vocab(vocab_size: int) -> str:
    """Shard dtype for a vocabulary: ``uint16`` when every id fits in 16 bits, else ``uint32``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


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


class Progress:
    """Progress lines for long reads (bytes, documents, tokens/s) on a stream: at most every ``interval_s``
    seconds, and once at the end. Lines start with ``tokendata:`` and never name credentials."""

    def __init__(self, stream: IO[str] | None = None, interval_s: float = PROGRESS_INTERVAL_S) -> None:
        self._stream = stream
        self._interval_s = interval_s
        self._start = self._last = time.monotonic()

    def update(self, phase: str, scan: Scan, tokens: int | None = None, *, final: bool = False) -> None:
        """Print a line if ``interval_s`` passed since the last one (always when ``final``)."""
        now = time.monotonic()
        if not final and now - self._last < self._interval_s:
            return
        self._last = now
        elapsed = max(now - self._start, 1e-9)
        rate = "" if tokens is None else f"{tokens:,} tokens ({tokens / elapsed:,.0f} tokens/s), "
        line = (f"tokendata: {phase}: {_human_bytes(scan.bytes_read)} read, {scan.num_documents:,} documents, "
                f"{rate}{scan.num_objects_read:,}/{scan.num_objects:,} objects, {elapsed:.0f} s")
        print(line, file=self._stream or sys.stderr, flush=True)


class NullProgress(Progress):
    """No progress lines (library callers that print their own)."""

    def update(self, phase: str, scan: Scan, tokens: int | None = None, *, final: bool = False) -> None:
        return


def _human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"  # unreachable


def _validate_args(vocab_size: int, val_fraction: float, shard_tokens: int, max_files: int | None,
                   max_bytes: int | None, sample_bytes: int, fmt: str) -> None:
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
    if sample_bytes < 1:
        raise ValueError(f"tokenizer_sample_bytes={sample_bytes} must be >= 1 (default "
                         f"{DEFAULT_TOKENIZER_SAMPLE_BYTES})")
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {list(FORMATS)}")


def _remove_stale_files(out_dir: Path, keep: set[str]) -> None:
    """Delete shard, tokenizer and tmp files of an older or interrupted build that the new manifest does not list
    (a stale special_tokens_map.json would change what transformers loads from the directory)."""
    for path in out_dir.iterdir():
        stale = _SHARD_NAME.match(path.name) or path.name.endswith(".json.tmp") or path.name in COPIED_FILES
        if path.name not in keep and stale:
            path.unlink()


def _sample_texts(source: Corpus, max_files: int | None, sample_bytes: int, max_bytes: int | None,
                  val_fraction: float, seed: int, progress: Progress) -> Iterator[str]:
    """Train-split text for the BPE trainer: at most ``sample_bytes`` characters, from every k-th object of the
    part of the corpus the dataset reads (k spreads the sample over a corpus larger than ``sample_bytes``)."""
    covered, total = 0, 0
    for obj in source.objects[:max_files]:
        if max_bytes is not None and total >= max_bytes:
            break
        covered, total = covered + 1, total + obj.size
    stride = max(1, math.ceil(total / sample_bytes))
    scan = source.scan(val_fraction=val_fraction, seed=seed, max_files=covered, max_bytes=max_bytes, stride=stride)
    taken = 0
    for piece in scan:
        progress.update("tokenizer sample", scan)
        if piece.split != "train":
            continue
        yield piece.text
        taken += len(piece.text)
        if taken >= sample_bytes:
            break
    progress.update("tokenizer sample", scan, final=True)


def _batches(pieces: Iterable[Piece]) -> Iterator[list[Piece]]:
    """Pieces grouped for one ``encode_batch`` call (bounded by `_BATCH_PIECES` and `_BATCH_CHARS`)."""
    batch: list[Piece] = []
    chars = 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece.text)
        if len(batch) >= _BATCH_PIECES or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _encode_into(pieces: Iterable[Piece], tok: TokenizerFiles, writers: dict[str, _ShardWriter], scan: Scan,
                 progress: Progress) -> int:
    """Encode pieces as ``[bos] text eos`` per document and append them to their split's shards; return tokens."""
    encode = getattr(tok.tokenizer, "encode_batch_fast", tok.tokenizer.encode_batch)
    bos = np.array([] if tok.bos_id is None else [tok.bos_id], dtype=np.uint32)
    eos = np.array([tok.eos_id], dtype=np.uint32)
    total = 0
    for batch in _batches(pieces):
        parts: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
        for piece, encoding in zip(batch, encode([p.text for p in batch], add_special_tokens=False)):
            out = parts[piece.split]
            if piece.start:
                out.append(bos)
            out.append(np.asarray(encoding.ids, dtype=np.uint32))
            if piece.end:
                out.append(eos)
        for split, arrays in parts.items():
            if arrays:
                ids = np.concatenate(arrays)
                writers[split].add(ids)
                total += len(ids)
        progress.update("encoding", scan, total)
    return total


def build_dataset(
    corpus: str | Path,
    out_dir: str | Path,
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    seed: int = 0,
    max_files: int | None = None,
    max_bytes: int | None = None,
    pattern: str | None = None,
    tokenizer: str | Path | None = None,
    *,
    fmt: str = "auto",
    text_field: str = "text",
    tokenizer_sample_bytes: int = DEFAULT_TOKENIZER_SAMPLE_BYTES,
    progress: Progress | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict:
    """Build a version-1 token-shard dataset from ``corpus`` (a path or URI) into ``out_dir``; return its manifest.

    Documents stream from the corpus (``components.lib.corpus``: formats, split rule, skipped documents) through
    the tokenizer into shards; memory stays bounded whatever the corpus size. ``tokenizer`` (a tokenizer.json,
    a model/dataset directory, local or URI) is used as it is, else a byte-level BPE of ``vocab_size`` is
    trained on at most ``tokenizer_sample_bytes`` of the train split. ``max_files`` keeps the first objects
    (sorted by path); ``max_bytes`` stops before the next document once that many bytes were read. Credentials
    come from ``environ`` (default: the process environment; ``components.lib.storage``).

    Nothing in ``out_dir`` changes until the corpus is listed, the tokenizer is ready and the first document was
    read; the manifest is deleted first and written last, so an interrupted build never looks complete.
    """
    _validate_args(vocab_size, val_fraction, shard_tokens, max_files, max_bytes, tokenizer_sample_bytes, fmt)
    progress = progress or Progress()
    pattern = pattern if pattern is not None else default_pattern(corpus)
    source = Corpus.open(str(corpus), pattern=pattern, fmt=fmt, text_field=text_field, environ=environ)
    if tokenizer:
        tok = load_tokenizer_files(str(tokenizer), environ)
    else:
        sample = _sample_texts(source, max_files, tokenizer_sample_bytes, max_bytes, val_fraction, seed, progress)
        tok = trained_files(train_tokenizer(sample, vocab_size))
    scan = source.scan(val_fraction=val_fraction, seed=seed, max_files=max_files, max_bytes=max_bytes)
    pieces = iter(scan)
    first = next(pieces, None)
    if first is None:
        raise CorpusDataError(f"corpus {source.uri!r} has no usable document matching {source.pattern!r} "
                              f"({scan.num_skipped} skipped as empty or not UTF-8): check the path, the pattern "
                              "and the format")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    written = {name: _atomic_write(out / name, data) for name, data in tok.files().items()}
    dtype = dtype_for_vocab(tok.vocab_size)
    writers = {split: _ShardWriter(out, split, dtype, shard_tokens) for split in SPLITS}
    tokens = _encode_into(chain([first], pieces), tok, writers, scan, progress)
    progress.update("done", scan, tokens, final=True)
    shards = {split: writers[split].close() for split in SPLITS}
    if not shards["train"] or not shards["val"]:
        raise CorpusDataError(
            f"corpus {source.uri!r} gave {scan.by_split['train']} train and {scan.by_split['val']} val documents "
            "(the first document of the first file is val): need at least one of each: add documents, or lower "
            "--val-fraction if every one went to val"
        )

    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "dtype": dtype,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "eos_token": tok.eos_token,
        "bos_id": tok.bos_id,
        "bos_token": tok.bos_token,
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_sha256": written[TOKENIZER_FILE],
        "tokenizer_config": TOKENIZER_CONFIG,
        "tokenizer_files": {name: written[name] for name in sorted(written)},
        "tokenizer_source": tok.source,
        "splits": shards,
        "num_tokens": {split: sum(e["num_tokens"] for e in shards[split]) for split in SPLITS},
        "source": _source_record(source, scan, text_field),
        "build": {
            "requested_vocab_size": vocab_size,
            "val_fraction": val_fraction,
            "seed": seed,
            "shard_tokens": shard_tokens,
            "max_files": max_files,
            "max_bytes": max_bytes,
            "tokenizer_from": None if tok.source == "trained" else tok.source,
            "tokenizer_sample_bytes": None if tokenizer else tokenizer_sample_bytes,
        },
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    _atomic_write(out / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode("utf-8"))
    _fsync_dir(out)
    _remove_stale_files(out, {e["file"] for entries in shards.values() for e in entries} | set(written))
    return manifest


def _source_record(source: Corpus, scan: Scan, text_field: str) -> dict[str, Any]:
    """The manifest's ``source``: the redacted URI, what was read, and each object's identity (capped)."""
    return {
        "uri": source.uri,
        "corpus": source.uri,
        "pattern": source.pattern,
        "format": source.format,
        "text_field": text_field,
        "num_files": scan.num_objects_read,
        "num_bytes": scan.bytes_read,
        "num_documents": scan.num_documents,
        "num_skipped_documents": scan.num_skipped,
        "num_documents_by_split": dict(scan.by_split),
        "objects": scan.records,
        "objects_truncated": scan.num_objects_read > len(scan.records),
        "objects_sha256": scan.objects_sha256,
    }


def summarize(manifest: dict, out_dir: str | Path) -> str:
    """A short human-readable summary of a dataset manifest."""
    src = manifest["source"]
    kind = "byte-level BPE (trained)" if manifest.get("tokenizer_source") == "trained" else (
        f"from {manifest.get('tokenizer_source')}")
    bos = manifest.get("bos_id")
    lines = [
        f"dataset     {out_dir}",
        f"corpus      {src['uri']} ({src['num_documents']:,} documents from {src['num_files']:,} file(s), "
        f"{src['num_skipped_documents']:,} skipped)",
        f"tokenizer   {kind}, vocab {manifest['vocab_size']}, "
        f"{'' if bos is None else f'bos_id {bos}, '}eos_id {manifest['eos_id']}, dtype {manifest['dtype']}",
    ]
    for split in SPLITS:
        lines.append(
            f"{split:<11} {manifest['num_tokens'][split]:,} tokens in {len(manifest['splits'][split])} shard(s), "
            f"{src['num_documents_by_split'][split]:,} documents"
        )
    return "\n".join(lines)


_EPILOG = f"""\
corpus URIs (one fsspec code path; a glob in the URI selects files too, e.g. s3://b/data/**/*.jsonl.gz):
  /path/dir, /path/file.txt, file:///path     local files
  s3://BUCKET/PREFIX                          S3 or an S3-compatible store (s3fs)
  gs://BUCKET/PREFIX                          Google Cloud Storage (gcsfs)
  hf://datasets/ORG/NAME[@REV][/PATH]         a Hugging Face dataset repository (huggingface_hub)
  gs:// and hf:// are implemented on the same code path as s3:// but were tested only against fsspec's in-memory
  filesystem here, not against the real services.

formats (--format auto picks by extension; .gz, .zst, .bz2 and .xz files are decompressed as they stream):
  text      each file is one document (UTF-8; files that are not, or are empty, are skipped)
  jsonl     .jsonl/.ndjson/.json: one JSON object per line; --text-field names the key (null/"" skipped)
  parquet   .parquet/.pq: --text-field names the string column; read by row group

memory: documents stream through the tokenizer into shards, so a corpus larger than RAM works. Our own BPE is
  trained on a bounded sample: at most --tokenizer-sample-bytes of train documents from every k-th file.

credentials (from the environment; in the pipeline, a Kubernetes Secret mounted as env; never printed):
  s3://   AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3),
          AWS_REGION (or AWS_DEFAULT_REGION); Kubeflow Trainer's initializer names ACCESS_KEY_ID,
          SECRET_ACCESS_KEY, ENDPOINT, REGION are used where the AWS_* ones are not set
  gs://   GOOGLE_APPLICATION_CREDENTIALS (a service-account key file), else the pod's default credentials
  hf://   HF_TOKEN (or ACCESS_TOKEN), HF_ENDPOINT

exit codes:
  0  the dataset was written (manifest.json last)
  {EXIT_USAGE}  something to change in the command or its environment: a bad option, a corpus or bucket that does
     not exist, no file matching the pattern, access denied / wrong keys, a --text-field that the data lacks,
     a tokenizer that cannot be used
  {EXIT_DATA}  the corpus was found but cannot be read or is unusable: invalid JSON, a record without the text field
     that earlier records have, a corrupt or unreadable file, a store that stopped answering, too few documents
  Either way one line on stderr says what to change, and no manifest.json is left, so nothing half-written
  looks like a dataset.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: build a dataset and print its summary; exit 2 / 3 on bad input (see --help)."""
    parser = argparse.ArgumentParser(
        prog="python -m components.lib.tokendata",
        description="Build a token-shard dataset (trainer_image/trainer/SHARDS.md) from a corpus on local disk, "
                    "S3, GCS or the Hugging Face Hub.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--corpus", default=str(default_corpus()),
                        help="local path or URI of a file, directory or prefix (see below; default: this Python's "
                             "stdlib, read with --pattern '*.py')")
    parser.add_argument("--out", required=True, help="output dataset directory")
    parser.add_argument("--pattern", default=None,
                        help="glob of the files to read under the corpus: without '/' it matches file names at "
                             "any depth, with '/' the relative path ('**' spans directories); hidden files are "
                             "skipped (default: '*', or '*.py' for the default corpus)")
    parser.add_argument("--format", default="auto", choices=FORMATS, dest="fmt",
                        help="how to read each file (default: auto, by extension)")
    parser.add_argument("--text-field", default="text",
                        help="JSON key (jsonl) or column (parquet) that holds the document text (default: text)")
    parser.add_argument("--tokenizer", default=None,
                        help="use this pretrained tokenizer instead of training one: a tokenizer.json path or URI, "
                             "or a directory/URI holding tokenizer.json and tokenizer_config.json (a base model's "
                             "directory such as hf://meta-llama/Llama-3.1-8B, or a dataset built by this tool). "
                             "Its vocabulary, BOS and EOS are used: documents become [bos] text eos when it adds "
                             "a BOS. Default: train a byte-level BPE (the demo)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="own BPE only: vocabulary size (default 4096)")
    parser.add_argument("--tokenizer-sample-bytes", type=int, default=DEFAULT_TOKENIZER_SAMPLE_BYTES,
                        help="own BPE only: at most this many bytes of train text are used to train it "
                             f"(default {DEFAULT_TOKENIZER_SAMPLE_BYTES})")
    parser.add_argument("--val-fraction", type=float, default=0.05,
                        help="share of documents in the val split: every (1/F)-th document from a seeded phase, "
                             "and the first document of the first file (default 0.05)")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    parser.add_argument("--max-files", type=int, default=None, help="read only the first N files (sorted by path)")
    parser.add_argument("--max-bytes", type=int, default=None,
                        help="stop before the next document once N bytes were read (the last may cross it)")
    args = parser.parse_args(argv)
    redactor = Redactor.from_env()
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
            fmt=args.fmt,
            text_field=args.text_field,
            tokenizer_sample_bytes=args.tokenizer_sample_bytes,
        )
    except CorpusError as err:
        print(f"error: {redactor(str(err))}", file=sys.stderr)
        return err.exit_code
    except ValueError as err:
        print(f"error: {redactor(str(err))}", file=sys.stderr)
        return EXIT_USAGE
    print(summarize(manifest, args.out))
    print(f"built in {time.monotonic() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
