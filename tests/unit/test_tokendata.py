"""Data prep (components/lib/tokendata.py): corpus -> tokenizer -> shards + manifest (SHARDS.md)."""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from components.lib import corpus as corpus_module
from components.lib import storage, tokendata, tokenizer_files
from components.lib.corpus import Corpus
from components.lib.tokendata import (
    CorpusDataError,
    CorpusError,
    build_dataset,
    default_corpus,
    dtype_for_vocab,
    load_tokenizer,
)

VOCAB = 400


def _source_docs(n: int = 12) -> dict[str, str]:
    """Small, varied UTF-8 'source files' (non-ASCII text and a literal EOS string included)."""
    docs = {}
    for i in range(n):
        body = "".join(
            f"def function_{i}_{j}(value):\n    '''Return héllo wörld ✓ {i * j}.'''\n    return value * {j} + {i}\n\n"
            for j in range(8 + i)
        )
        docs[f"pkg{i % 3}/mod_{i:02d}.py"] = f"# module {i}: 日本語 テキスト\n{body}"
    docs["pkg0/special.py"] = "text = 'before <|endoftext|> after'\n"
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A corpus dir of valid docs plus files the builder must skip or ignore."""
    root = tmp_path_factory.mktemp("corpus")
    docs = _source_docs()
    for rel, text in docs.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    (root / "pkg1" / "latin1.py").write_bytes("x = 'caf\xe9'\n".encode("latin-1"))  # not UTF-8: skipped
    (root / "pkg2" / "empty.py").write_bytes(b"")  # empty: skipped
    (root / "site-packages" / "dep").mkdir(parents=True)
    (root / "site-packages" / "dep" / "ignored.py").write_text("ignored = True\n")  # excluded dir
    (root / "notes.txt").write_text("not matched by *.py\n")
    return root, docs


@pytest.fixture(scope="module")
def built(corpus: tuple[Path, dict[str, str]], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The corpus built into a dataset with several train shards."""
    out = tmp_path_factory.mktemp("dataset")
    manifest = build_dataset(corpus[0], out, vocab_size=VOCAB, val_fraction=0.2, shard_tokens=1000, seed=0,
                             pattern="*.py")
    return out, manifest


def _split_docs(out: Path, manifest: dict, split: str) -> list[str]:
    """Decode a split's shards (read as raw little-endian arrays) back into document texts."""
    tokenizer = Tokenizer.from_file(str(out / manifest["tokenizer"]))
    stream = np.concatenate(
        [np.fromfile(out / e["file"], dtype=np.dtype(manifest["dtype"]).newbyteorder("<")) for e in manifest["splits"][split]]
    )
    assert stream[-1] == manifest["eos_id"], "every document, including the last, ends with EOS"
    ends = np.flatnonzero(stream == manifest["eos_id"])
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(stream[s:e].tolist()) for s, e in zip(starts, ends)]


def test_round_trip_decodes_to_source_text(corpus: tuple[Path, dict[str, str]], built: tuple[Path, dict]) -> None:
    _, docs = corpus
    out, manifest = built
    train, val = _split_docs(out, manifest, "train"), _split_docs(out, manifest, "val")
    assert sorted(train + val) == sorted(docs.values())
    in_sorted_order = [docs[k] for k in sorted(docs)]
    assert val[0] == in_sorted_order[0], "the first document is always val"
    assert 2 <= len(val) <= 1 + round(len(docs) * 0.2), "one val document per 1/val_fraction, plus the first"
    assert train == [d for d in in_sorted_order if d in train], "train docs keep corpus order"
    assert val == [d for d in in_sorted_order if d in val], "val docs keep corpus order"
    assert "text = 'before <|endoftext|> after'\n" in train + val, "a literal EOS string is text, not a boundary"


def test_manifest_fields_and_files(corpus: tuple[Path, dict[str, str]], built: tuple[Path, dict]) -> None:
    root, docs = corpus
    out, manifest = built
    assert json.loads((out / "manifest.json").read_text()) == manifest
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert manifest["format"] == tokendata.FORMAT and manifest["version"] == 1
    assert manifest["dtype"] == "uint16"
    assert manifest["vocab_size"] == tokenizer.get_vocab_size() <= VOCAB
    assert manifest["eos_id"] == tokenizer.token_to_id("<|endoftext|>") and manifest["eos_token"] == "<|endoftext|>"
    assert manifest["bos_id"] is None and manifest["bos_token"] is None, "our own BPE adds no BOS"
    assert manifest["tokenizer_source"] == "trained" and manifest["build"]["tokenizer_from"] is None
    assert manifest["tokenizer_sha256"] == hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    assert manifest["tokenizer_files"] == {
        name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in ("tokenizer.json", "tokenizer_config.json")
    }
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    source = manifest["source"]
    objects = source.pop("objects")
    by_split = source.pop("num_documents_by_split")
    assert source == {
        "uri": str(root),
        "corpus": str(root),
        "pattern": "*.py",
        "format": "auto",
        "text_field": "text",
        "num_files": len(docs) + 2,
        "num_bytes": sum(len(t.encode()) for t in docs.values()) + len("x = 'caf\xe9'\n".encode("latin-1")),
        "num_documents": len(docs),
        "num_skipped_documents": 2,
        "objects_truncated": False,
        "objects_sha256": hashlib.sha256(
            "".join(json.dumps(o, sort_keys=True) + "\n" for o in objects).encode()).hexdigest(),
    }
    assert by_split["train"] + by_split["val"] == len(docs) and by_split["val"] >= 1
    assert [o["path"] for o in objects] == sorted(list(docs) + ["pkg1/latin1.py", "pkg2/empty.py"])
    for o in objects:
        assert o["size"] == (root / o["path"]).stat().st_size and o["last_modified"].endswith("+00:00")
    for split in ("train", "val"):
        entries = manifest["splits"][split]
        assert manifest["num_tokens"][split] == sum(e["num_tokens"] for e in entries) > 0
        for entry in entries:
            data = (out / entry["file"]).read_bytes()
            assert entry["num_bytes"] == len(data) == 2 * entry["num_tokens"]
            assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["manifest.json", "tokenizer.json", "tokenizer_config.json"]
        + [e["file"] for s in ("train", "val") for e in manifest["splits"][s]]
    ), "no tmp or stray files left behind"


def test_shards_are_bounded_by_shard_tokens(built: tuple[Path, dict]) -> None:
    _, manifest = built
    train = manifest["splits"]["train"]
    assert len(train) >= 3
    assert [e["file"] for e in train] == [f"train-{i:05d}.bin" for i in range(len(train))]
    assert all(e["num_tokens"] == 1000 for e in train[:-1]) and 0 < train[-1]["num_tokens"] <= 1000


def test_build_is_deterministic(corpus: tuple[Path, dict[str, str]], built: tuple[Path, dict], tmp_path: Path) -> None:
    _, first = built
    common = dict(vocab_size=VOCAB, val_fraction=0.2, shard_tokens=1000, pattern="*.py")
    again = build_dataset(corpus[0], tmp_path / "again", seed=0, **common)
    assert again["splits"] == first["splits"] and again["tokenizer_sha256"] == first["tokenizer_sha256"]
    other = build_dataset(corpus[0], tmp_path / "seed1", seed=1, **common)
    assert _split_docs(tmp_path / "seed1", other, "val") != _split_docs(tmp_path / "again", again, "val")


def test_dtype_follows_vocab_size() -> None:
    assert dtype_for_vocab(257) == "uint16"
    assert dtype_for_vocab(65536) == "uint16"
    assert dtype_for_vocab(65537) == "uint32"


@pytest.mark.parametrize(("uri", "message"), [
    ("foo://bucket/corpus", "unknown URI scheme 'foo'"),
    ("hf://someorg/somemodel", "hf://datasets/<org>/<name>"),
])
def test_unusable_uri_gives_clear_error(uri: str, message: str, tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match=message) as info:
        build_dataset(uri, tmp_path / "out")
    assert info.value.exit_code == 2
    assert not (tmp_path / "out").exists(), "nothing is written for a rejected corpus"


def _rels(corpus: Corpus) -> list[str]:
    return [o.rel for o in corpus.objects]


def test_file_uri_single_file_patterns_and_limits(corpus: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    root, docs = corpus
    py_files = sorted(list(docs) + ["pkg1/latin1.py", "pkg2/empty.py"])
    assert _rels(Corpus.open(str(root), pattern="*.py")) == py_files
    assert _rels(Corpus.open(root.as_uri(), pattern="*.py")) == py_files
    assert _rels(Corpus.open(str(root))) == sorted(py_files + ["notes.txt"]), "default '*': every file"
    assert _rels(Corpus.open(f"{root}/pkg0/*.py")) == [p[5:] for p in py_files if p.startswith("pkg0/")], "URI glob"
    assert _rels(Corpus.open(str(root), pattern="pkg[12]/**/*.py")) == [p for p in py_files if p[3] in "12"]
    (root / ".git").mkdir(exist_ok=True)
    (root / ".git" / "HEAD.py").write_text("hidden = 1\n")
    (root / ".hidden.py").write_text("hidden = 1\n")
    assert _rels(Corpus.open(str(root), pattern="*.py")) == py_files, "hidden files and directories are skipped"
    one = root / "pkg0" / "special.py"
    assert _rels(Corpus.open(one.as_uri())) == ["special.py"]
    manifest = build_dataset(root, tmp_path / "three", vocab_size=VOCAB, pattern="*.py", max_files=3)
    assert [o["path"] for o in manifest["source"]["objects"]] == py_files[:3]
    first_size = (root / py_files[0]).stat().st_size
    manifest = build_dataset(root, tmp_path / "bytes", vocab_size=VOCAB, pattern="*.py", max_bytes=first_size + 1)
    assert manifest["source"]["num_files"] == 2, "stops before the next document once max_bytes were read"
    with pytest.raises(CorpusError, match="glob and a pattern"):
        Corpus.open(f"{root}/*.py", pattern="*.txt")


def test_empty_or_missing_corpus_errors_name_path_and_pattern(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match=r"empty.*has no files matching '\*\.md'") as info:
        build_dataset(tmp_path / "empty", tmp_path / "out", pattern="*.md")
    assert info.value.exit_code == 2
    with pytest.raises(CorpusError, match="does not exist"):
        build_dataset(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.py").write_text("a = 1\n")
    with pytest.raises(CorpusDataError, match="0 train and 1 val documents.*need at least one of each") as info:
        build_dataset(tmp_path / "one", tmp_path / "out")
    assert info.value.exit_code == 3
    assert not (tmp_path / "out" / "manifest.json").exists()
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "a.bin").write_bytes(b"\xff\xfe\x00" * 10)
    with pytest.raises(CorpusDataError, match="no usable document.*1 skipped"):
        build_dataset(tmp_path / "binary", tmp_path / "out2")
    assert not (tmp_path / "out2").exists(), "nothing is written before the first document was read"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_size": 100}, "vocab_size=100 is out of range"),
        ({"vocab_size": 2**33}, "out of range"),
        ({"val_fraction": 0.0}, r"val_fraction=0.0 is out of range: use a value in \(0, 0.5\]"),
        ({"val_fraction": 0.6}, "val_fraction=0.6"),
        ({"shard_tokens": 0}, "shard_tokens=0"),
        ({"max_files": 0}, "max_files=0"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict, message: str, corpus: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        build_dataset(corpus[0], tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_rebuild_replaces_old_dataset(corpus: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    out = tmp_path / "ds"
    small = build_dataset(corpus[0], out, vocab_size=VOCAB, shard_tokens=500)
    assert len(small["splits"]["train"]) > 1
    (out / "train-00099.bin.tmp").write_bytes(b"partial")  # leftover of an interrupted build
    big = build_dataset(corpus[0], out, vocab_size=VOCAB, shard_tokens=10**6)
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.json", "tokenizer.json", "tokenizer_config.json", "train-00000.bin", "val-00000.bin"]
    assert big["num_tokens"] == small["num_tokens"]


def test_interrupted_build_leaves_no_manifest(
    corpus: tuple[Path, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "ds"
    build_dataset(corpus[0], out, vocab_size=VOCAB, shard_tokens=500)

    def crash(self: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(tokendata._ShardWriter, "close", crash)
    with pytest.raises(KeyboardInterrupt):
        build_dataset(corpus[0], out, vocab_size=VOCAB, shard_tokens=500)
    assert not (out / "manifest.json").exists(), "a half-rewritten dataset must not look complete"


def test_cli_builds_and_prints_summary(corpus: tuple[Path, dict[str, str]], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = tokendata.main(["--corpus", str(corpus[0]), "--out", str(tmp_path / "ds"), "--vocab-size", str(VOCAB)])
    out = capsys.readouterr().out
    assert rc == 0
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert f"vocab {manifest['vocab_size']}" in out and f"{manifest['num_tokens']['train']:,} tokens" in out


def test_cli_bad_input_exits_2_bad_data_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert tokendata.main(["--corpus", "foo://bucket/data", "--out", str(tmp_path / "ds")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "unknown URI scheme" in err
    assert tokendata.main(["--corpus", str(tmp_path), "--out", str(tmp_path / "ds"), "--vocab-size", "10"]) == 2
    assert "vocab_size=10 is out of range" in capsys.readouterr().err
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\nnot json\n')
    assert tokendata.main(["--corpus", str(tmp_path / "c"), "--out", str(tmp_path / "ds")]) == 3
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: ") and "a.jsonl line 3 is not valid JSON" in err[-1]
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_help_documents_inputs_credentials_and_exit_codes(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        tokendata.main(["--help"])
    text = capsys.readouterr().out
    for needle in ("--corpus", "--pattern", "--format", "--text-field", "--tokenizer", "--tokenizer-sample-bytes",
                   "--vocab-size", "--max-bytes", "s3://", "gs://", "hf://datasets/", "AWS_ACCESS_KEY_ID",
                   "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_REGION", "ACCESS_KEY_ID",
                   "SECRET_ACCESS_KEY", "ENDPOINT", "REGION", "HF_TOKEN", "GOOGLE_APPLICATION_CREDENTIALS",
                   "exit codes", "  2  ", "  3  ", "not against the real services"):
        assert needle in text, needle


def test_default_corpus_is_local_stdlib(tmp_path: Path) -> None:
    root = default_corpus()
    assert (root / "os.py").is_file()
    manifest = build_dataset(root, tmp_path / "ds", vocab_size=512, max_files=30)
    assert manifest["source"]["num_files"] == 30 and manifest["source"]["pattern"] == "*.py"
    assert manifest["num_tokens"]["train"] > 10_000 and manifest["num_tokens"]["val"] > 0


@pytest.mark.parametrize("module", [tokendata, corpus_module, storage, tokenizer_files])
def test_builder_modules_are_torch_free(module) -> None:
    tree = ast.parse(Path(module.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"torch", "trainer", "nvidia_resiliency_ext", "transformers"}


def test_reused_tokenizer_gives_identical_ids_on_new_data(built: tuple[Path, dict], tmp_path: Path) -> None:
    """A warm start on fresh data must keep the token ids its weights were trained on."""
    out, manifest = built
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    for i in range(4):
        (fresh / f"f{i}.py").write_text(f"def fresh_{i}(x):\n    return x * {i} + 1\n" * 20)
    again = build_dataset(fresh, tmp_path / "out", tokenizer=out, vocab_size=300)
    assert again["tokenizer_sha256"] == manifest["tokenizer_sha256"]
    assert again["vocab_size"] == manifest["vocab_size"]
    original = load_tokenizer(out / "tokenizer.json")
    text = "def fresh_1(x):\n    return x * 1 + 1\n"
    assert load_tokenizer(tmp_path / "out").encode(text).ids == original.encode(text).ids
    with pytest.raises(CorpusError, match="does not exist"):
        build_dataset(fresh, tmp_path / "out2", tokenizer=tmp_path / "nope")
