"""A corpus behind a URI, listed once and read as a stream of documents with bounded memory.

`Corpus.open` lists the objects under a local path or URI (``components.lib.storage``: one fsspec code path for
every scheme); `Corpus.scan` reads them in order and yields `Piece` s of document text:

- ``text``: each file is one document (UTF-8; files that are not, or are empty, are skipped). A file larger
  than `TEXT_CHUNK_BYTES` is read and encoded in pieces that end at a line break (`_piece_end`), so memory
  never holds a whole file.
- ``jsonl``: each line is a JSON object; its ``text_field`` holds one document (null or "" is skipped).
- ``parquet``: each row's ``text_field`` column is one document, read by row group (pyarrow).
- ``auto``: by extension (``.jsonl``/``.ndjson``/``.json`` -> jsonl, ``.parquet``/``.pq`` -> parquet, else
  text). ``.gz``/``.zst``/``.bz2``/``.xz`` files are decompressed as they stream (fsspec's codecs).

Split: the first usable document of the first object is ``val`` (so a small corpus still has validation data);
after it, every (1 / ``val_fraction``)-th document is ``val``, counted over objects for whole-file documents and
over records inside a JSONL/Parquet object, from a phase seeded by ``seed`` (and the object's path). The split
of a document depends only on its position, never on what a scan read before it, so the tokenizer sample (which
reads objects in another order) sees only train documents.
"""

from __future__ import annotations

import codecs
import hashlib
import io
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from components.lib.storage import (
    CorpusDataError,
    CorpusError,
    ObjectInfo,
    Redactor,
    explain,
    open_fs,
    redact_uri,
)

FORMATS = ("auto", "text", "jsonl", "parquet")
#: Format of a file by its extension (after a compression extension), for ``--format auto``; else text.
EXTENSION_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet",
                     ".pq": "parquet"}
#: A text file larger than this is read and encoded in line-aligned pieces of about this size.
TEXT_CHUNK_BYTES = 1 << 16
#: A scan keeps the records (path, size, ETag, ...) of this many objects one by one; all go into a digest.
MAX_RECORDED_OBJECTS = 1000
#: Rows per batch read from a Parquet row group.
PARQUET_BATCH_ROWS = 1024
_READ_BUFFER_BYTES = 1 << 18
_GLOB = re.compile(r"[*\[]")
#: Filesystems listed by a directory walk that skips hidden and excluded directories (cheap when listings are
#: local); object stores are listed flat by ``find`` (one paginated listing, no request per "directory").
_PRUNED_WALK = ("file",)


@dataclass(frozen=True)
class Piece:
    """Text of one document (``start`` and ``end`` both True) or of a part of one; ``split`` is train/val."""

    text: str
    split: str
    start: bool
    end: bool


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """A compiled glob: without ``/`` it matches a file name at any depth (like ``rglob``); with ``/``, the path
    relative to the corpus root, where ``**`` spans directories."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:[^/]+/)*")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "[" and (end := pattern.find("]", i + 2)) != -1:
            body = pattern[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body).replace("\\", "\\\\") + "]")
            i = end + 1
            continue
        out.append({"*": "[^/]*", "?": "[^/]"}.get(c, re.escape(c)))
        i += 1
    body = "".join(out)
    return re.compile(body if "/" in pattern else r"(?:.*/)?" + body, re.S)


def split_glob(uri: str) -> tuple[str, str | None]:
    """``s3://b/data/**/*.jsonl`` -> (``s3://b/data``, ``**/*.jsonl``); a URI without ``*`` or ``[``: (uri, None)."""
    head, sep, path = uri.partition("://") if "://" in uri else ("", "", uri)
    parts = path.split("/")
    first = next((i for i, part in enumerate(parts) if _GLOB.search(part)), None)
    if first is None:
        return uri, None
    return head + sep + "/".join(parts[:first]), "/".join(parts[first:])


def format_of(rel: str, fmt: str) -> str:
    """The format of one object: ``fmt``, or for ``auto`` the one its extension names (`EXTENSION_FORMATS`)."""
    if fmt != "auto":
        return fmt
    from fsspec.utils import infer_compression

    name = rel.lower()
    if infer_compression(name):
        name = name.rsplit(".", 1)[0]
    ext = "." + name.rsplit(".", 1)[-1] if "." in name.rsplit("/", 1)[-1] else ""
    return EXTENSION_FORMATS.get(ext, "text")


def _walk(fs: Any, root: str, excluded: set[str]) -> dict[str, dict[str, Any]]:
    """``find(detail=True)`` of a local tree, without descending into hidden or excluded directories."""
    found: dict[str, dict[str, Any]] = {}
    for _, dirs, files in fs.walk(root, detail=True, topdown=True):
        for name in [d for d in dirs if d.startswith(".") or d in excluded]:
            del dirs[name]
        found.update((info["name"], info) for info in files.values())
    return found


def _piece_end(text: str) -> int:
    """Where a piece of a large text file ends: after the last newline that a letter or digit follows. Byte-level
    BPE pre-tokenizers (GPT-2's, Llama 3's) never join a newline with the word after it, so the pieces encode
    to the same ids as the whole text (a SentencePiece-style Metaspace tokenizer may still mark a word start at a
    piece start). Without such a newline: after the last newline, else the whole text."""
    end = len(text)
    while (newline := text.rfind("\n", 0, end - 1)) != -1:
        if text[newline + 1].isalnum():
            return newline + 1
        end = newline + 1
    return text.rfind("\n") + 1 or len(text)


def _read_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean 'this object could not be read' (as opposed to a bug in this code)."""
    errors: list[type[BaseException]] = [OSError, EOFError]
    for module, name in (("botocore.exceptions", "BotoCoreError"), ("botocore.exceptions", "ClientError"),
                         ("zstandard", "ZstdError"), ("pyarrow", "ArrowException")):
        try:
            errors.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


class Corpus:
    """The listed objects of one corpus URI, in a deterministic order; `scan` reads them."""

    def __init__(self, uri: str, fs: Any, protocol: str, objects: list[ObjectInfo], *, single: bool, fmt: str,
                 text_field: str, pattern: str, redactor: Redactor) -> None:
        self.uri = redact_uri(uri)
        self.root_uri = redact_uri(split_glob(uri)[0])
        self.fs = fs
        self.protocol = protocol
        self.objects = objects
        self.single = single
        self.format = fmt
        self.text_field = text_field
        self.pattern = pattern
        self.redactor = redactor

    @classmethod
    def open(cls, uri: str, *, pattern: str | None = None, fmt: str = "auto", text_field: str = "text",
             exclude_dirs: Sequence[str] = ("site-packages",), environ: Mapping[str, str] | None = None) -> Corpus:
        """List the corpus: a file, or every file under a directory / prefix whose relative path matches
        ``pattern`` (default ``*``; a glob in the URI itself works too), skipping hidden files and directories
        (a name starting with ``.``) and any path through a directory named in ``exclude_dirs``."""
        if fmt not in FORMATS:
            raise CorpusError(f"format {fmt!r} is not one of {list(FORMATS)}")
        if not text_field:
            raise CorpusError("text_field is empty: name the JSON key / Parquet column that holds the text")
        uri = str(uri)
        root_uri, uri_pattern = split_glob(uri)
        if uri_pattern is not None and pattern not in (None, "*"):
            raise CorpusError(f"corpus {redact_uri(uri)!r} has a glob and a pattern {pattern!r} is given too: "
                              "use one of them")
        pattern = uri_pattern or pattern or "*"
        redactor = Redactor.from_env(environ)
        shown = redact_uri(uri)
        fs, root, protocol = open_fs(root_uri, environ)
        if protocol == "hf" and not root_uri.split("://", 1)[1].startswith("datasets/"):
            raise CorpusError(f"corpus {shown!r}: a Hugging Face corpus is a dataset repository: "
                              "hf://datasets/<org>/<name>[/path] (with @<revision> after the name to pin one)")
        root = root.rstrip("/") or root
        excluded = set(exclude_dirs)
        try:
            single = fs.isfile(root)
            if single:
                listing = {root: fs.info(root)}
            elif protocol in _PRUNED_WALK:
                listing = _walk(fs, root, excluded)
            else:
                listing = fs.find(root, detail=True, withdirs=False)
            exists = bool(listing) or fs.exists(root)
        except _read_errors() as err:
            raise explain(err, f"corpus {shown}", protocol, redactor) from None
        if not exists:
            raise CorpusError(f"corpus {shown!r} does not exist: pass an existing directory, file or prefix")
        matches = pattern_regex(pattern)
        objects = []
        for name, info in listing.items():
            rel = name.rsplit("/", 1)[-1] if single else name[len(root):].lstrip("/")
            parts = rel.split("/")
            if info.get("type", "file") != "file":
                continue
            hidden = any(p.startswith(".") for p in parts) or excluded.intersection(parts[:-1])
            if not single and (hidden or not matches.fullmatch(rel)):
                continue
            objects.append(ObjectInfo.from_info(info, rel))
        if not objects:
            raise CorpusError(f"corpus {shown!r} has no files matching {pattern!r}: check the path and the "
                              "pattern (--pattern, or a glob in the URI)")
        objects.sort(key=lambda o: o.rel)
        return cls(uri, fs, protocol, objects, single=single, fmt=fmt, text_field=text_field, pattern=pattern,
                   redactor=redactor)

    def where(self, obj: ObjectInfo) -> str:
        """A redacted name for one object in messages: the URI, plus its relative path for a directory."""
        return self.uri if self.single else f"{self.root_uri.rstrip('/')}/{obj.rel}"

    def scan(self, *, val_fraction: float, seed: int, max_files: int | None = None, max_bytes: int | None = None,
             stride: int = 1) -> Scan:
        """A pass over the first ``max_files`` objects (all by default) that yields `Piece` s; see `Scan`.

        With ``stride`` k > 1 it reads every k-th object first, then the others (a sample spread over the corpus
        that a consumer stops early; split and record numbers do not depend on the order).
        """
        count = min(len(self.objects), max_files or len(self.objects))
        indices: Iterable[int] = range(count)
        if stride > 1:
            indices = chain(range(0, count, stride), (i for i in range(count) if i % stride))
        return Scan(self, indices, count, val_fraction=val_fraction, seed=seed, max_bytes=max_bytes)


@dataclass
class Scan:
    """One streaming pass over a corpus. Iterate it for `Piece` s; its counters say what was read so far.

    ``max_bytes`` stops before the next document once that many bytes (decompressed) have been read, so the
    last document may cross it. Memory holds one piece (at most ~`TEXT_CHUNK_BYTES` of text, or one JSON line,
    or one Parquet batch) at a time.
    """

    corpus: Corpus
    indices: Iterable[int]
    num_objects: int
    val_fraction: float
    seed: int
    max_bytes: int | None = None
    bytes_read: int = 0
    num_documents: int = 0
    num_skipped: int = 0
    by_split: dict[str, int] = field(default_factory=lambda: {"train": 0, "val": 0})
    num_objects_read: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)
    _digest: Any = field(default_factory=hashlib.sha256)
    _first_pending: bool = True
    _field_seen: bool = False

    @property
    def objects_sha256(self) -> str:
        """sha256 over the records of every object read so far (JSON lines), also those past the listed cap."""
        return self._digest.hexdigest()

    def _record(self, obj: ObjectInfo) -> None:
        """Remember what was read: the first `MAX_RECORDED_OBJECTS` records in full, every one in the digest."""
        record = obj.record()
        self.num_objects_read += 1
        if len(self.records) < MAX_RECORDED_OBJECTS:
            self.records.append(record)
        self._digest.update((json.dumps(record, sort_keys=True) + "\n").encode("utf-8"))

    def __iter__(self) -> Iterator[Piece]:
        readers = {"text": self._text, "jsonl": self._jsonl, "parquet": self._parquet}
        errors = _read_errors()
        for index in self.indices:
            if self._full():
                return
            obj = self.corpus.objects[index]
            where = self.corpus.where(obj)
            fmt = format_of(obj.rel, self.corpus.format)
            try:
                with self._open(obj, raw=fmt == "parquet") as stream:
                    yield from readers[fmt](stream, obj, index, where)
            except errors as err:
                raise explain(err, where, self.corpus.protocol, self.corpus.redactor) from None

    def _full(self) -> bool:
        return self.max_bytes is not None and self.bytes_read >= self.max_bytes

    @contextmanager
    def _open(self, obj: ObjectInfo, raw: bool) -> Iterator[Any]:
        """The object's byte stream: decompressed by extension and buffered, or the raw seekable file."""
        from fsspec.compression import compr
        from fsspec.utils import infer_compression

        with self.corpus.fs.open(obj.path, "rb") as f:
            self._record(obj.with_details(getattr(f, "details", None)))
            codec = None if raw else infer_compression(obj.rel)
            if raw:
                yield f
                return
            with (compr[codec](f, mode="rb") if codec else f) as inner:
                yield io.BufferedReader(inner, _READ_BUFFER_BYTES)  # type: ignore[arg-type]

    def _split_of(self, obj: ObjectInfo, index: int, record: int) -> str:
        """``val`` for the first usable document of the first object; else every (1/val_fraction)-th position,
        from a seeded phase: positions are object indices for whole-file documents, record numbers inside a
        JSONL/Parquet object. A document's split never depends on which other objects a scan reads."""
        if index == 0 and self._first_pending:
            self._first_pending = False
            split = "val"
        else:
            position, key = (index, "") if record == 0 else (record, obj.rel)
            digest = hashlib.blake2b(f"{self.seed}\0{key}".encode(), digest_size=8).digest()
            phase = int.from_bytes(digest, "little") / 2**64
            f = self.val_fraction
            split = "val" if math.floor((position + 1) * f + phase) > math.floor(position * f + phase) else "train"
        self.num_documents += 1
        self.by_split[split] += 1
        return split

    def _text(self, stream: io.BufferedReader, obj: ObjectInfo, index: int, where: str) -> Iterator[Piece]:
        chunk = stream.read(TEXT_CHUNK_BYTES)
        following = stream.read(TEXT_CHUNK_BYTES)
        self.bytes_read += len(chunk) + len(following)
        decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            text = decoder.decode(chunk, final=not following)
        except UnicodeDecodeError:
            text = ""
        if not text:
            self.num_skipped += 1  # not UTF-8 (within its first piece) or empty: skipped, as before
            return
        split, start = self._split_of(obj, index, 0), True
        while following:
            chunk, following = following, stream.read(TEXT_CHUNK_BYTES)
            self.bytes_read += len(following)
            try:
                text += decoder.decode(chunk, final=not following)
            except UnicodeDecodeError as err:
                raise CorpusDataError(f"{where} is not valid UTF-8 near byte {self.bytes_read - len(following)} "
                                      f"({err.reason}): re-encode it as UTF-8 or leave it out with --pattern") from None
            cut = _piece_end(text)
            if following:
                yield Piece(text[:cut], split, start, False)
                text, start = text[cut:], False
        yield Piece(text, split, start, True)

    def _jsonl(self, stream: io.BufferedReader, obj: ObjectInfo, index: int, where: str) -> Iterator[Piece]:
        name = self.corpus.text_field
        for lineno, line in enumerate(stream, 1):
            if self._full():
                return
            self.bytes_read += len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise CorpusDataError(f"{where} line {lineno} is not valid JSON ({getattr(err, 'msg', err)}): "
                                      "fix or remove the line, or read the files as plain text with --format text"
                                      ) from None
            if not isinstance(record, dict):
                raise CorpusDataError(f"{where} line {lineno} is a JSON {type(record).__name__}, not an object "
                                      f"with a {name!r} key: JSON Lines needs one object per line")
            if name not in record:
                self._missing_field(f"{where} line {lineno}", "key", list(record))
            value = record[name]
            if value is None or value == "":
                self.num_skipped += 1
                continue
            if not isinstance(value, str):
                raise CorpusDataError(f"{where} line {lineno}: {name!r} is a JSON {type(value).__name__}, not a "
                                      "string: set --text-field to the key that holds the text")
            self._field_seen = True
            yield Piece(value, self._split_of(obj, index, lineno), True, True)

    def _parquet(self, f: Any, obj: ObjectInfo, index: int, where: str) -> Iterator[Piece]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        name = self.corpus.text_field
        try:
            parquet = pq.ParquetFile(f)
        except pa.ArrowException as err:
            raise CorpusDataError(f"{where} is not a readable Parquet file ({err}): check the file, or its "
                                  "format (--format)") from None
        schema = parquet.schema_arrow
        if name not in schema.names:
            self._missing_field(where, "column", schema.names)
        kind = schema.field(name).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
            raise CorpusError(f"{where}: column {name!r} holds {kind}, not text: set --text-field to a string "
                              f"column (columns: {', '.join(schema.names[:20])})")
        self._field_seen = True
        row = 0
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[name]):
            for value in batch.column(0).to_pylist():
                row += 1
                if self._full():
                    return
                if not value:
                    self.num_skipped += 1
                    continue
                self.bytes_read += len(value.encode("utf-8"))
                yield Piece(value, self._split_of(obj, index, row), True, True)

    def _missing_field(self, where: str, kind: str, available: Sequence[str]) -> None:
        """Raise: exit 2 when no record so far had the field (the name is wrong), else exit 3 (bad record)."""
        name = self.corpus.text_field
        have = ", ".join(repr(k) for k in list(available)[:20]) or "none"
        if self._field_seen:
            raise CorpusDataError(f"{where} has no {name!r} {kind} (it has {have}) though earlier records do: "
                                  "fix or remove that record")
        raise CorpusError(f"{where} has no {name!r} {kind} (it has {have}): set --text-field to the {kind} "
                          "that holds the text")
