"""Corpus formats, URI dispatch and bounded memory of data prep (components/lib/corpus.py, storage.py).

The same fsspec code path serves every scheme; gs:// and hf:// are exercised here through filesystems registered
under those protocols that keep their files in memory (fsspec's MemoryFileSystem), because the real services
cannot be reached from the test machine. S3 runs against a real server: tests/unit/test_corpus_s3.py.
"""

from __future__ import annotations

import gzip
import importlib
import io
import json
import tracemalloc
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem
from tokenizers import Tokenizer

from components.lib import corpus as corpus_module
from components.lib.corpus import Corpus, format_of, pattern_regex, split_glob
from components.lib.storage import CorpusDataError, CorpusError, Redactor, redact_uri, storage_options
from components.lib.tokendata import NullProgress, Progress, build_dataset
from components.lib.tokenizer_files import train_tokenizer, trained_files

VOCAB = 300
#: fsspec's protocol -> filesystem class table (``fsspec.registry`` is a read-only view of it).
_REGISTRY = importlib.import_module("fsspec.registry")._registry


def _docs(n: int = 24) -> list[str]:
    return [f"document {i}: " + " ".join(f"wörd{(i * j) % 17} ✓" for j in range(30 + i)) + "\n" for i in range(n)]


def _decode_docs(out: Path, manifest: dict) -> list[str]:
    """Every document of both splits, decoded (documents end at eos_id; a BOS, when used, is dropped)."""
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    texts = []
    for split in ("train", "val"):
        stream = np.concatenate([np.fromfile(out / e["file"], dtype=np.dtype(manifest["dtype"]).newbyteorder("<"))
                                 for e in manifest["splits"][split]])
        ends = np.flatnonzero(stream == manifest["eos_id"])
        for s, e in zip(np.concatenate([[0], ends[:-1] + 1]), ends):
            ids = stream[s:e].tolist()
            if manifest["bos_id"] is not None:
                assert ids[0] == manifest["bos_id"]
                ids = ids[1:]
            texts.append(tok.decode(ids))
    return texts


def _write_formats(root: Path, docs: list[str]) -> dict[str, Path]:
    """The same documents as text files, JSON Lines (plain, .gz, .zst) and Parquet (several row groups)."""
    text = root / "text"
    text.mkdir(parents=True)
    for i, d in enumerate(docs):
        (text / f"doc-{i:03d}.txt").write_text(d, encoding="utf-8")
    lines = "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)).encode()
    (root / "jsonl").mkdir()
    (root / "jsonl" / "part-0.jsonl").write_bytes(lines)
    (root / "gz").mkdir()
    (root / "gz" / "part-0.jsonl.gz").write_bytes(gzip.compress(lines))
    (root / "zst").mkdir()
    (root / "zst" / "part-0.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    (root / "parquet").mkdir()
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), root / "parquet" / "part-0.parquet",
                   row_group_size=5)
    return {name: root / name for name in ("text", "jsonl", "gz", "zst", "parquet")}


@pytest.fixture(scope="module")
def formats(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], list[str]]:
    docs = _docs()
    return _write_formats(tmp_path_factory.mktemp("formats"), docs), docs


@pytest.mark.parametrize("name", ["text", "jsonl", "gz", "zst", "parquet"])
def test_every_format_yields_every_document(formats, name: str, tmp_path: Path) -> None:
    paths, docs = formats
    manifest = build_dataset(paths[name], tmp_path / "ds", vocab_size=VOCAB, val_fraction=0.25,
                             progress=NullProgress())
    assert sorted(_decode_docs(tmp_path / "ds", manifest)) == sorted(docs)
    assert manifest["source"]["num_documents"] == len(docs)
    by_split = manifest["source"]["num_documents_by_split"]
    assert 1 + len(docs) // 4 - 1 <= by_split["val"] <= 1 + len(docs) // 4 + 1, "val_fraction holds, +1 first doc"


def test_auto_format_follows_the_extension() -> None:
    assert [format_of(n, "auto") for n in ("a.txt", "b.jsonl", "c.JSONL.gz", "d.ndjson.zst", "e.json", "f.parquet",
                                           "g.pq", "h.py", "dir.v2/noext")] == [
        "text", "jsonl", "jsonl", "jsonl", "jsonl", "parquet", "parquet", "text", "text"]
    assert format_of("b.jsonl", "text") == "text"


def test_patterns_and_uri_globs() -> None:
    assert pattern_regex("*.py").fullmatch("a/b/c.py") and not pattern_regex("*.py").fullmatch("a/b/c.pyc")
    assert pattern_regex("data/*.jsonl").fullmatch("data/x.jsonl")
    assert not pattern_regex("data/*.jsonl").fullmatch("data/sub/x.jsonl")
    assert pattern_regex("data/**/*.jsonl").fullmatch("data/sub/deeper/x.jsonl")
    assert pattern_regex("data/**/*.jsonl").fullmatch("data/x.jsonl")
    assert pattern_regex("part-[0-9].txt").fullmatch("part-3.txt") and not pattern_regex("part-[!0-9].txt").fullmatch(
        "part-3.txt")
    assert split_glob("s3://b/data/**/*.jsonl.gz") == ("s3://b/data", "**/*.jsonl.gz")
    assert split_glob("/mnt/c/part-*.parquet") == ("/mnt/c", "part-*.parquet")
    assert split_glob("hf://datasets/org/name/data") == ("hf://datasets/org/name/data", None)


def test_jsonl_text_field_errors_say_what_to_change(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    (root / "a.jsonl").write_text('{"content": "x", "id": 1}\n')
    with pytest.raises(CorpusError, match=r"a.jsonl line 1 has no 'text' key \(it has 'content', 'id'\): set "
                                          "--text-field") as info:
        build_dataset(root, tmp_path / "out", progress=NullProgress())
    assert info.value.exit_code == 2 and not (tmp_path / "out").exists()
    (root / "a.jsonl").write_text('{"text": "one"}\n\n{"text": null}\n{"text": "two"}\n{"body": "three"}\n')
    with pytest.raises(CorpusDataError, match=r"a.jsonl line 5 has no 'text' key \(it has 'body'\) though earlier "
                                              "records do") as info:
        build_dataset(root, tmp_path / "out", progress=NullProgress())
    assert info.value.exit_code == 3
    assert not (tmp_path / "out" / "manifest.json").exists()
    (root / "a.jsonl").write_text('{"text": "one"}\n{"text": ["two"]}\n')
    with pytest.raises(CorpusDataError, match="line 2: 'text' is a JSON list, not a string"):
        build_dataset(root, tmp_path / "out", progress=NullProgress())
    (root / "a.jsonl").write_text('{"text": "one"}\n[1, 2]\n')
    with pytest.raises(CorpusDataError, match="line 2 is a JSON list, not an object"):
        build_dataset(root, tmp_path / "out", progress=NullProgress())
    (root / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n{"text": "three"}\n{"text": null}\n')
    manifest = build_dataset(root, tmp_path / "ok", progress=NullProgress())
    assert manifest["source"]["num_documents"] == 3 and manifest["source"]["num_skipped_documents"] == 1


def test_parquet_column_errors(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    pq.write_table(pa.table({"body": ["a", "b"], "n": [1, 2]}), root / "a.parquet")
    with pytest.raises(CorpusError, match=r"has no 'text' column \(it has 'body', 'n'\): set --text-field") as info:
        build_dataset(root, tmp_path / "out", progress=NullProgress())
    assert info.value.exit_code == 2
    with pytest.raises(CorpusError, match="column 'n' holds int64, not text: set --text-field to a string column"):
        build_dataset(root, tmp_path / "out", text_field="n", progress=NullProgress())
    (root / "a.parquet").write_bytes(b"PAR1 this is not parquet PAR1")
    with pytest.raises(CorpusDataError, match="a.parquet is not a readable Parquet file") as info:
        build_dataset(root, tmp_path / "out", progress=NullProgress())
    assert info.value.exit_code == 3
    assert not (tmp_path / "out").exists()


def test_corrupt_compressed_file_is_a_data_error(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    (root / "a.jsonl.gz").write_bytes(gzip.compress(b'{"text": "one"}\n' * 50)[:-30] + b"garbage" * 5)
    with pytest.raises(CorpusDataError, match="a.jsonl.gz: could not be read") as info:
        build_dataset(root, tmp_path / "out", progress=NullProgress())
    assert info.value.exit_code == 3 and "\n" not in str(info.value)


def test_large_text_file_streams_in_pieces_as_one_document(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "c"
    root.mkdir()
    big = "".join(f"def line_{i}(x):  # of a long file ✓\n    return x\n\n" for i in range(2000))
    (root / "a-big.txt").write_text(big)
    (root / "b-small.txt").write_text("small document\n")
    (root / "c-other.txt").write_text("another document\n")
    monkeypatch.setattr(corpus_module, "TEXT_CHUNK_BYTES", 4096)
    source = Corpus.open(str(root))
    pieces = list(source.scan(val_fraction=0.05, seed=0))
    assert len(pieces) > 10 and pieces[0].start and not pieces[0].end and pieces[-1].end
    firsts = [p for p in pieces if p.start]
    assert len(firsts) == 3 and "".join(p.text for p in pieces[: len(pieces) - 2]) == big
    assert all(len(p.text.encode()) <= 2 * 4096 for p in pieces)
    tok = train_tokenizer([big], 2000)  # knows whitespace runs such as "\n   ": a piece cut before them would show
    (tmp_path / "tok").mkdir()
    for name, data in trained_files(tok).files().items():
        (tmp_path / "tok" / name).write_bytes(data)
    manifest = build_dataset(root, tmp_path / "ds", tokenizer=tmp_path / "tok", progress=NullProgress())
    assert sorted(_decode_docs(tmp_path / "ds", manifest)) == sorted([big, "small document\n", "another document\n"])
    val = np.fromfile(tmp_path / "ds" / "val-00000.bin", dtype="<u2").tolist()  # the first file's document
    assert val == tok.encode(big).ids + [manifest["eos_id"]], "pieces encode to the ids of the whole text"
    (root / "a-big.txt").write_bytes(big.encode() + b"\xff\xfe broken" + big.encode())
    with pytest.raises(CorpusDataError, match="a-big.txt is not valid UTF-8 near byte") as info:
        build_dataset(root, tmp_path / "ds2", vocab_size=VOCAB, progress=NullProgress())
    assert info.value.exit_code == 3


# --- URIs, credentials and the fsspec dispatch ------------------------------------------------------------
def test_storage_options_come_from_the_environment_with_kubeflow_spellings() -> None:
    env = {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEY", "SECRET_ACCESS_KEY": "kubeflow-spelling-secret",
           "ENDPOINT": "http://minio:9000", "REGION": "eu-west-1", "AWS_REGION": "us-east-2"}
    assert storage_options("s3", env) == {"key": "AKIAEXAMPLEKEY", "secret": "kubeflow-spelling-secret",
                                          "endpoint_url": "http://minio:9000",
                                          "client_kwargs": {"region_name": "us-east-2"}}
    assert storage_options("hf", {"HF_TOKEN": "hf_secret_token", "ACCESS_TOKEN": "other"}) == {"token": "hf_secret_token"}
    assert storage_options("hf", {"ACCESS_TOKEN": "initializer_token"}) == {"token": "initializer_token"}
    assert storage_options("gs", {"GOOGLE_APPLICATION_CREDENTIALS": "/var/secrets/sa.json"}) == {
        "token": "/var/secrets/sa.json"}
    assert storage_options("file", env) == {} and storage_options("s3", {"AWS_ACCESS_KEY_ID": ""}) == {}


def test_fsspec_dispatches_gs_and_hf_to_their_libraries() -> None:
    import gcsfs
    import huggingface_hub

    assert fsspec.get_filesystem_class("gs") is gcsfs.GCSFileSystem
    assert fsspec.get_filesystem_class("gcs") is gcsfs.GCSFileSystem
    assert fsspec.get_filesystem_class("hf") is huggingface_hub.HfFileSystem


def test_redaction_of_uris_and_secret_values() -> None:
    assert redact_uri("s3://user:p4ss@bucket/x?versionId=3&X-Amz-Signature=abc") == (
        "s3://bucket/x?versionId=3&X-Amz-Signature=***")
    assert redact_uri("https://host/c.txt?token=hf_abcdef") == "https://host/c.txt?token=***"
    assert redact_uri("/local/path") == "/local/path"
    scrub = Redactor.from_env({"AWS_SECRET_ACCESS_KEY": "s3cr3t-value", "HF_TOKEN": "hf_tokenvalue", "REGION": "eu"})
    line = "failed with s3cr3t-value at gs://u:pw@b/k?sig=1 and hf_tokenvalue; eu stays"
    assert scrub(line) == "failed with *** at gs://b/k?sig=*** and ***; eu stays"


def _memory_fs(protocol: str) -> type[MemoryFileSystem]:
    """A MemoryFileSystem registered under a real store's protocol: the same dispatch, files in memory."""

    class StoreInMemory(MemoryFileSystem):
        store: dict = {}
        pseudo_dirs = [""]
        seen_options: list[dict] = []

        def __init__(self, *args, **options):
            super().__init__(*args, **options)
            StoreInMemory.seen_options.append(options)

        @classmethod
        def _strip_protocol(cls, path):
            return super()._strip_protocol(path.split("://", 1)[-1] if path.startswith(f"{protocol}://") else path)

    StoreInMemory.protocol = (protocol,)
    return StoreInMemory


@pytest.mark.parametrize(("protocol", "uri", "env", "expected_options"), [
    ("gs", "gs://corpus-bucket/data", {"GOOGLE_APPLICATION_CREDENTIALS": "/var/secrets/sa.json"},
     {"token": "/var/secrets/sa.json", "use_listings_cache": False}),
    ("hf", "hf://datasets/someorg/somecorpus/data", {"HF_TOKEN": "hf_secret_token_123"},
     {"token": "hf_secret_token_123"}),
])
def test_gs_and_hf_uris_read_through_the_same_code_path(protocol, uri, env, expected_options, formats, tmp_path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Not the real GCS / Hub (no network here): their protocols dispatch to an in-memory filesystem."""
    fs_class = _memory_fs(protocol)
    monkeypatch.setitem(_REGISTRY, protocol, fs_class)
    paths, docs = formats
    root = uri.split("://", 1)[1]
    for source in sorted(paths["jsonl"].iterdir()) + sorted(paths["parquet"].iterdir()):
        fs_class().pipe_file(f"/{root}/{source.name}", source.read_bytes())
    manifest = build_dataset(uri, tmp_path / "ds", vocab_size=VOCAB, environ=env, progress=NullProgress())
    assert sorted(_decode_docs(tmp_path / "ds", manifest)) == sorted(docs + docs)
    assert {k: v for k, v in fs_class.seen_options[-1].items() if k != "skip_instance_cache"} == expected_options
    assert manifest["source"]["uri"] == uri
    assert [o["path"] for o in manifest["source"]["objects"]] == ["part-0.jsonl", "part-0.parquet"]
    assert all("last_modified" in o and o["size"] > 0 for o in manifest["source"]["objects"])
    assert "secret" not in json.dumps(manifest)


# --- bounded memory and progress ----------------------------------------------------------------------------
_WORDS = ("the quick brown fox jumps over lazy dog while seven happy wizards quietly pack boxes of liquor "
          "jugs and vexing quartz sphinxes judge my vow").split()
_PERIOD = "".join('{"text": "' + " ".join(_WORDS[(i * 7 + j * 3) % len(_WORDS)] for j in range(12 + i % 9)) + '"}\n'
                  for i in range(2000)).encode()


class _GeneratedFile(AbstractBufferedFile):
    def _fetch_range(self, start: int, end: int) -> bytes:
        out = io.BytesIO()
        pos = start
        while pos < end:
            offset = pos % len(_PERIOD)
            take = min(end - pos, len(_PERIOD) - offset)
            out.write(_PERIOD[offset:offset + take])
            pos += take
        return out.getvalue()


class GeneratedCorpusFS(AbstractFileSystem):
    """Objects whose bytes are generated on read: three text files, each one document larger than the memory
    cap of the test, and a JSON Lines file of 8,000 short documents."""

    protocol = "gencorpus"
    files = {"/big/a.txt": len(_PERIOD) * 40, "/big/b.txt": len(_PERIOD) * 40, "/big/c.txt": len(_PERIOD) * 40,
             "/big/d.jsonl": len(_PERIOD) * 4}

    @classmethod
    def _strip_protocol(cls, path):
        return "/" + path.split("://", 1)[-1].strip("/")

    def ls(self, path, detail=True, **kwargs):
        path = self._strip_protocol(path)
        entries = [{"name": n, "size": s, "type": "file"} for n, s in self.files.items() if n.rsplit("/", 1)[0] == path]
        if not entries and path in self.files:
            entries = [{"name": path, "size": self.files[path], "type": "file"}]
        return entries if detail else [e["name"] for e in entries]

    def info(self, path, **kwargs):
        path = self._strip_protocol(path)
        if path in self.files:
            return {"name": path, "size": self.files[path], "type": "file"}
        if any(n.startswith(path + "/") for n in self.files):
            return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None, **kwargs):
        return _GeneratedFile(self, path, mode, block_size=1 << 18, size=self.files[self._strip_protocol(path)],
                              cache_type="readahead")


def test_memory_stays_bounded_for_a_corpus_much_larger_than_the_cap(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(_REGISTRY, "gencorpus", GeneratedCorpusFS)
    corpus_bytes = sum(GeneratedCorpusFS.files.values())
    cap = 6 * 2**20  # measured peak: ~4.7 MiB, the same for a corpus twice this size
    assert corpus_bytes > 3.5 * cap and min(GeneratedCorpusFS.files.values()) < cap < GeneratedCorpusFS.files["/big/a.txt"]
    tracemalloc.start()
    try:
        manifest = build_dataset("gencorpus://big", tmp_path / "ds", vocab_size=512, shard_tokens=200_000,
                                 tokenizer_sample_bytes=2**20, progress=NullProgress())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert manifest["source"]["num_bytes"] == corpus_bytes, "the whole corpus was read"
    assert manifest["source"]["num_documents"] == 3 + 4 * 2000
    assert manifest["source"]["num_documents_by_split"]["train"] >= 2, "the sample and the split see train text"
    assert sum(manifest["num_tokens"].values()) > corpus_bytes // 8
    assert peak < cap, f"peak traced memory {peak / 2**20:.1f} MiB for a {corpus_bytes / 2**20:.0f} MiB corpus"


def test_progress_lines_are_rate_limited_and_end_with_a_summary(formats, tmp_path: Path) -> None:
    paths, docs = formats
    quiet, chatty = io.StringIO(), io.StringIO()
    build_dataset(paths["jsonl"], tmp_path / "a", vocab_size=VOCAB, progress=Progress(quiet, interval_s=3600))
    lines = quiet.getvalue().splitlines()
    assert [line.split(":")[1].strip() for line in lines] == ["tokenizer sample", "done"]
    assert lines[-1].startswith("tokendata: done: ") and f"{len(docs)} documents" in lines[-1]
    assert " tokens (" in lines[-1] and "tokens/s" in lines[-1] and "KB read" in lines[-1]
    build_dataset(paths["text"], tmp_path / "b", vocab_size=VOCAB, progress=Progress(chatty, interval_s=0))
    assert len(chatty.getvalue().splitlines()) > len(docs), "interval 0: a line per document read"


def test_the_tokenizer_sample_holds_only_train_documents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from components.lib import tokendata

    root = tmp_path / "c"
    root.mkdir()
    (root / "a-empty.txt").write_text("")  # the first object has no document: no forced val document
    docs = _docs(40)
    for i, d in enumerate(docs):
        (root / f"d-{i:03d}.txt").write_text(d)
    seen: list[str] = []
    real_train = tokendata.train_tokenizer

    def recording(texts, vocab_size):
        return real_train((seen.append(t) or t for t in texts), vocab_size)

    monkeypatch.setattr(tokendata, "train_tokenizer", recording)
    sample_bytes = sum(len(d) for d in docs) // 3  # every 3rd-or-so file first: a spread sample
    manifest = build_dataset(root, tmp_path / "ds", vocab_size=VOCAB, val_fraction=0.2,
                             tokenizer_sample_bytes=sample_bytes, progress=NullProgress())
    source = Corpus.open(str(root))
    pieces = list(source.scan(val_fraction=0.2, seed=0))
    train = {p.text for p in pieces if p.split == "train"}
    val = {p.text for p in pieces if p.split == "val"}
    assert len(val) == manifest["source"]["num_documents_by_split"]["val"] == 8, "every 5th of 40"
    assert seen and set(seen) <= train and not set(seen) & val
    assert sum(len(t) for t in seen) >= sample_bytes and len(seen) < len(train)
    positions = [docs.index(t) for t in seen]
    assert max(positions) >= len(docs) // 2, "a third of the corpus, spread over it, not its first files"
