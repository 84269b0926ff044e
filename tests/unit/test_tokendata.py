"""Data prep (components/lib/tokendata.py): corpus -> tokenizer -> shards + manifest (SHARDS.md)."""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from components.lib import tokendata
from components.lib.tokendata import (
    CorpusError,
    build_dataset,
    default_corpus,
    dtype_for_vocab,
    iter_corpus_files,
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
    manifest = build_dataset(corpus[0], out, vocab_size=VOCAB, val_fraction=0.2, shard_tokens=1000, seed=0)
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
    assert len(val) == round(len(docs) * 0.2)
    in_sorted_order = [docs[k] for k in sorted(docs)]
    assert train == [d for d in in_sorted_order if d in train], "train docs keep corpus order"
    assert "text = 'before <|endoftext|> after'\n" in train + val, "a literal EOS string is text, not a boundary"


def test_manifest_fields_and_files(corpus: tuple[Path, dict[str, str]], built: tuple[Path, dict]) -> None:
    root, docs = corpus
    out, manifest = built
    assert json.loads((out / "manifest.json").read_text()) == manifest
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert manifest["format"] == tokendata.FORMAT and manifest["version"] == 1
    assert manifest["dtype"] == "uint16"
    assert manifest["vocab_size"] == tokenizer.get_vocab_size() <= VOCAB
    assert manifest["eos_id"] == tokenizer.token_to_id("<|endoftext|>")
    assert manifest["tokenizer_sha256"] == hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    assert manifest["source"] == {
        "corpus": str(root),
        "pattern": "*.py",
        "num_files": len(docs) + 2,
        "num_documents": len(docs),
        "num_skipped_files": 2,
        "num_documents_by_split": {"train": len(docs) - round(len(docs) * 0.2), "val": round(len(docs) * 0.2)},
    }
    for split in ("train", "val"):
        entries = manifest["splits"][split]
        assert manifest["num_tokens"][split] == sum(e["num_tokens"] for e in entries) > 0
        for entry in entries:
            data = (out / entry["file"]).read_bytes()
            assert entry["num_bytes"] == len(data) == 2 * entry["num_tokens"]
            assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["manifest.json", "tokenizer.json"] + [e["file"] for s in ("train", "val") for e in manifest["splits"][s]]
    ), "no tmp or stray files left behind"


def test_shards_are_bounded_by_shard_tokens(built: tuple[Path, dict]) -> None:
    _, manifest = built
    train = manifest["splits"]["train"]
    assert len(train) >= 3
    assert [e["file"] for e in train] == [f"train-{i:05d}.bin" for i in range(len(train))]
    assert all(e["num_tokens"] == 1000 for e in train[:-1]) and 0 < train[-1]["num_tokens"] <= 1000


def test_build_is_deterministic(corpus: tuple[Path, dict[str, str]], built: tuple[Path, dict], tmp_path: Path) -> None:
    _, first = built
    again = build_dataset(corpus[0], tmp_path / "again", vocab_size=VOCAB, val_fraction=0.2, shard_tokens=1000, seed=0)
    assert again["splits"] == first["splits"] and again["tokenizer_sha256"] == first["tokenizer_sha256"]
    other = build_dataset(corpus[0], tmp_path / "seed1", vocab_size=VOCAB, val_fraction=0.2, shard_tokens=1000, seed=1)
    assert _split_docs(tmp_path / "seed1", other, "val") != _split_docs(tmp_path / "again", again, "val")


def test_dtype_follows_vocab_size() -> None:
    assert dtype_for_vocab(257) == "uint16"
    assert dtype_for_vocab(65536) == "uint16"
    assert dtype_for_vocab(65537) == "uint32"


@pytest.mark.parametrize("uri", ["gs://bucket/corpus", "s3://bucket/corpus", "https://example.com/corpus.txt"])
def test_remote_uri_gives_clear_error(uri: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="only local paths and file:// URIs") as info:
        build_dataset(uri, tmp_path / "out")
    assert "copy the corpus locally" in str(info.value) and "Mount the bucket" in str(info.value)
    assert not (tmp_path / "out").exists(), "nothing is written for a rejected corpus"


def test_file_uri_single_file_and_limits(corpus: tuple[Path, dict[str, str]]) -> None:
    root, docs = corpus
    all_files = list(iter_corpus_files(root))
    assert [p.relative_to(root).as_posix() for p in all_files] == sorted(list(docs) + ["pkg1/latin1.py", "pkg2/empty.py"])
    assert list(iter_corpus_files(root.as_uri())) == all_files
    one = root / "pkg0" / "special.py"
    assert list(iter_corpus_files(one.as_uri())) == [one]
    assert tokendata._select_files(all_files, 3, None) == all_files[:3]
    assert tokendata._select_files(all_files, None, 1) == all_files[:1]


def test_empty_or_missing_corpus_errors_name_path_and_pattern(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match=r"empty.*has no files matching '\*\.md'"):
        build_dataset(tmp_path / "empty", tmp_path / "out", pattern="*.md")
    with pytest.raises(CorpusError, match="does not exist"):
        build_dataset(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.py").write_text("a = 1\n")
    with pytest.raises(CorpusError, match="need at least 2"):
        build_dataset(tmp_path / "one", tmp_path / "out")


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
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "tokenizer.json", "train-00000.bin", "val-00000.bin"]
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


def test_cli_bad_corpus_exits_2_with_message(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert tokendata.main(["--corpus", "gs://bucket/data", "--out", str(tmp_path / "ds")]) == 2
    assert "only local paths and file:// URIs" in capsys.readouterr().err


def test_default_corpus_is_local_stdlib(tmp_path: Path) -> None:
    root = default_corpus()
    assert (root / "os.py").is_file()
    manifest = build_dataset(root, tmp_path / "ds", vocab_size=512, max_files=30)
    assert manifest["source"]["num_files"] == 30
    assert manifest["num_tokens"]["train"] > 10_000 and manifest["num_tokens"]["val"] > 0


def test_builder_module_is_torch_free() -> None:
    tree = ast.parse(Path(tokendata.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"torch", "trainer", "nvidia_resiliency_ext"}


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
    with pytest.raises(CorpusError, match="not found"):
        build_dataset(fresh, tmp_path / "out2", tokenizer=tmp_path / "nope")
