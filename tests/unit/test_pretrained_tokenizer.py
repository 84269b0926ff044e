"""A pretrained tokenizer for data prep (components/lib/tokenizer_files.py), and the Hugging Face tokenizer files
every dataset carries: ``transformers.AutoTokenizer.from_pretrained(dataset_dir)`` must load what the shards use.

The tokenizers are built in the test (no network): a Llama-3-style one whose post-processor adds
``<|begin_of_text|>`` and whose tokenizer_config.json names the special tokens as AddedToken dicts.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

from components.lib.data_step import prepare
from components.lib.layout import RunLayout
from components.lib.storage import CorpusError
from components.lib.tokendata import NullProgress, build_dataset
from components.lib.tokenizer_files import load_tokenizer_files
from trainer.data import ShardedTokens

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
TEXTS = [f"def f{i}(x):\n    return x * {i} + {i * i}  # naïve ✓\n" * (3 + i % 4) for i in range(12)]


def _base_tokenizer(special: tuple[str, ...] = (BOS, EOS), vocab: int = 400) -> Tokenizer:
    """A byte-level BPE with Llama-3-like special tokens at the end of its vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXTS * 3, trainer=trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens(list(special))
    return tok


_PLAIN = _base_tokenizer()
BOS_ID, EOS_ID = _PLAIN.token_to_id(BOS), _PLAIN.token_to_id(EOS)  # after the trained vocabulary
VOCAB = _PLAIN.get_vocab_size(with_added_tokens=True)


def _model_dir(root: Path, *, config: dict | None, post_bos: bool = True, tok: Tokenizer | None = None) -> Path:
    """A base-model-like directory: tokenizer.json (+ tokenizer_config.json, config.json)."""
    tok = tok or _base_tokenizer()
    if post_bos:
        bos_id = tok.token_to_id(BOS)
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                           special_tokens=[(BOS, bos_id)])
    root.mkdir(parents=True)
    tok.save(str(root / "tokenizer.json"))
    if config is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return root


LLAMA3_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": {"__type": "AddedToken", "content": BOS, "lstrip": False, "normalized": False, "rstrip": False,
                  "single_word": False},
    "eos_token": EOS,
    "clean_up_tokenization_spaces": True,
    "model_input_names": ["input_ids", "attention_mask"],
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(TEXTS):
        (root / f"m{i:02d}.py").write_text(text)
    return root


def _documents(out: Path, manifest: dict) -> list[list[int]]:
    """Each document's ids (BOS and EOS included) across both splits."""
    docs = []
    for split in ("train", "val"):
        stream = np.concatenate([np.fromfile(out / e["file"], dtype=np.dtype(manifest["dtype"]).newbyteorder("<"))
                                 for e in manifest["splits"][split]]).tolist()
        start = 0
        for i, token in enumerate(stream):
            if token == manifest["eos_id"]:
                docs.append(stream[start:i + 1])
                start = i + 1
        assert start == len(stream)
    return docs


def test_base_model_directory_gives_vocab_bos_eos_and_hf_files(corpus: Path, tmp_path: Path) -> None:
    base = _model_dir(tmp_path / "base", config=LLAMA3_CONFIG)
    out = tmp_path / "ds"
    manifest = build_dataset(corpus, out, tokenizer=base, vocab_size=5000, progress=NullProgress())
    source = Tokenizer.from_file(str(base / "tokenizer.json"))
    assert manifest["vocab_size"] == source.get_vocab_size(with_added_tokens=True) == VOCAB == EOS_ID + 1
    assert manifest["bos_id"] == source.token_to_id(BOS) == BOS_ID and manifest["bos_token"] == BOS
    assert manifest["eos_id"] == source.token_to_id(EOS) == EOS_ID and manifest["eos_token"] == EOS
    assert manifest["tokenizer_source"] == str(base) == manifest["build"]["tokenizer_from"]
    assert manifest["build"]["tokenizer_sample_bytes"] is None
    assert (out / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes(), "copied unchanged"
    assert (out / "tokenizer_config.json").read_bytes() == (base / "tokenizer_config.json").read_bytes()
    docs = _documents(out, manifest)
    assert len(docs) == len(TEXTS)
    expected = {tuple([BOS_ID] + source.encode(t, add_special_tokens=False).ids + [EOS_ID]) for t in TEXTS}
    assert {tuple(d) for d in docs} == expected, "every document is [bos] text eos"
    hf = AutoTokenizer.from_pretrained(out)
    assert (hf.bos_token_id, hf.eos_token_id) == (manifest["bos_id"], manifest["eos_id"])
    assert hf(TEXTS[3])["input_ids"] == [BOS_ID] + source.encode(TEXTS[3], add_special_tokens=False).ids
    tokens = ShardedTokens(out, "train")  # the trainer's reader takes the dataset as it is
    assert tokens.vocab_size == VOCAB and tokens.eos_id == EOS_ID and tokens.bos_id == BOS_ID


def test_a_tokenizer_json_path_uses_its_directory_and_add_bos_token_false_drops_bos(corpus, tmp_path) -> None:
    base = _model_dir(tmp_path / "base", config={**LLAMA3_CONFIG, "add_bos_token": False})
    manifest = build_dataset(corpus, tmp_path / "ds", tokenizer=base / "tokenizer.json", progress=NullProgress())
    assert manifest["bos_id"] is None and manifest["eos_id"] == EOS_ID
    assert all(d[0] != BOS_ID for d in _documents(tmp_path / "ds", manifest))


def test_special_tokens_without_a_config(corpus, tmp_path) -> None:
    base = _model_dir(tmp_path / "bare", config=None)  # bos from the post-processor, no eos anywhere
    with pytest.raises(CorpusError, match="names no end-of-document token: add \"eos_token\" to its "
                                          "tokenizer_config.json") as info:
        build_dataset(corpus, tmp_path / "ds", tokenizer=base, progress=NullProgress())
    assert info.value.exit_code == 2 and not (tmp_path / "ds").exists()
    gpt2ish = _model_dir(tmp_path / "gpt2ish", config=None, post_bos=False,
                         tok=_base_tokenizer(special=("<|endoftext|>",)))
    (tmp_path / "ds2").mkdir()
    (tmp_path / "ds2" / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS}))  # an older build's
    manifest = build_dataset(corpus, tmp_path / "ds2", tokenizer=gpt2ish, progress=NullProgress())
    assert not (tmp_path / "ds2" / "special_tokens_map.json").exists(), "a stale tokenizer file is removed"
    assert manifest["bos_id"] is None and manifest["eos_token"] == "<|endoftext|>"
    written = json.loads((tmp_path / "ds2" / "tokenizer_config.json").read_text())
    assert written["eos_token"] == "<|endoftext|>" and written["bos_token"] is None
    assert AutoTokenizer.from_pretrained(tmp_path / "ds2").eos_token_id == manifest["eos_id"]


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: (d / "tokenizer_config.json").write_text(json.dumps({**LLAMA3_CONFIG, "eos_token": "</s>"})),
     "eos_token '</s>' is not in its tokenizer.json"),
    (lambda d: (d / "tokenizer.json").write_text('{"not": "a tokenizer"}'), "tokenizer.json is not a tokenizers file"),
    (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer.json there"),
    (lambda d: (d / "tokenizer_config.json").write_text("{broken"), "tokenizer_config.json is not valid JSON"),
])
def test_unusable_tokenizers_give_one_line_and_exit_2(corpus, tmp_path, mutate, message) -> None:
    base = _model_dir(tmp_path / "base", config=LLAMA3_CONFIG)
    mutate(base)
    with pytest.raises(CorpusError, match=message) as info:
        build_dataset(corpus, tmp_path / "ds", tokenizer=base, progress=NullProgress())
    assert info.value.exit_code == 2 and "\n" not in str(info.value)
    assert not (tmp_path / "ds").exists()


def test_a_vocabulary_above_65536_writes_uint32_shards(corpus, tmp_path) -> None:
    words = {f"w{i}": i for i in range(70_000)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([BOS, EOS])
    base = _model_dir(tmp_path / "big", config=LLAMA3_CONFIG, tok=tok)
    root = tmp_path / "c"
    root.mkdir()
    for i in range(6):
        (root / f"{i}.txt").write_text(" ".join(f"w{69_990 + (i + j) % 10}" for j in range(50)))
    manifest = build_dataset(root, tmp_path / "ds", tokenizer=base, progress=NullProgress())
    assert manifest["vocab_size"] == 70_002 and manifest["dtype"] == "uint32"
    assert manifest["bos_id"] == 70_000 and manifest["eos_id"] == 70_001
    tokens = ShardedTokens(tmp_path / "ds", "train")
    assert tokens.dtype == "uint32" and int(max(s.max() for s in tokens.shards)) == 70_001


def test_a_tokenizer_uri_reads_through_fsspec(corpus, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hf://<org>/<model> on an in-memory stand-in for the Hub (no network here): the same code path."""

    class HubInMemory(MemoryFileSystem):
        store: dict = {}
        pseudo_dirs = [""]
        protocol = ("hf",)
        tokens: list = []

        def __init__(self, *args, token=None, **kw):
            super().__init__(*args, **kw)
            HubInMemory.tokens.append(token)

        @classmethod
        def _strip_protocol(cls, path):
            return super()._strip_protocol(path[len("hf://"):] if path.startswith("hf://") else path)

    monkeypatch.setitem(importlib.import_module("fsspec.registry")._registry, "hf", HubInMemory)
    base = _model_dir(tmp_path / "base", config=LLAMA3_CONFIG)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        HubInMemory().pipe_file(f"/someorg/base-model/{name}", (base / name).read_bytes())
    files = load_tokenizer_files("hf://someorg/base-model", {"HF_TOKEN": "hf_secret_for_the_hub"})
    assert HubInMemory.tokens[-1] == "hf_secret_for_the_hub"
    assert files.tokenizer_json == (base / "tokenizer.json").read_bytes() and files.bos_id == BOS_ID
    assert files.source == "hf://someorg/base-model"


def test_own_bpe_dataset_loads_in_transformers_with_the_same_ids(corpus, tmp_path) -> None:
    manifest = build_dataset(corpus, tmp_path / "ds", vocab_size=300, progress=NullProgress())
    hf = AutoTokenizer.from_pretrained(tmp_path / "ds")
    ours = Tokenizer.from_file(str(tmp_path / "ds" / "tokenizer.json"))
    assert hf.eos_token == "<|endoftext|>" and hf.eos_token_id == manifest["eos_id"] and hf.bos_token is None
    assert hf(TEXTS[5])["input_ids"] == ours.encode(TEXTS[5]).ids
    assert len(hf) == manifest["vocab_size"]


def test_a_warm_start_refuses_a_different_tokenizer(corpus, tmp_path) -> None:
    base = _model_dir(tmp_path / "base", config=LLAMA3_CONFIG)
    first = prepare(str(corpus), RunLayout(str(tmp_path / "w"), "r1"), vocab_size=300, tokenizer=str(base))
    assert first["tokenizer_source"] == str(base) and first["bos_id"] == BOS_ID and first["eos_id"] == EOS_ID
    same = prepare(str(corpus), RunLayout(str(tmp_path / "w"), "r2"), vocab_size=300,
                   tokenizer_from=first["data_dir"], tokenizer=str(base))
    assert same["tokenizer_sha256"] == first["tokenizer_sha256"]
    other = _model_dir(tmp_path / "other", config=LLAMA3_CONFIG, tok=_base_tokenizer(special=(BOS, EOS, "<|pad|>")))
    with pytest.raises(CorpusError, match="differs from the tokenizer of .* which the warm start's weights were "
                                          "trained with"):
        prepare(str(corpus), RunLayout(str(tmp_path / "w"), "r3"), vocab_size=300,
                tokenizer_from=first["data_dir"], tokenizer=str(other))
