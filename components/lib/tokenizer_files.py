"""The tokenizer of a dataset: our own byte-level BPE, or a pretrained one from a path or URI.

A pretrained tokenizer is a ``tokenizer.json`` (the ``tokenizers`` format every Hugging Face fast tokenizer
saves), or a directory holding one - a base model's directory or repository (``hf://meta-llama/Llama-3.1-8B``),
or a dataset built by this data prep. Its special tokens come from ``tokenizer_config.json`` (``bos_token`` /
``eos_token``, plain strings or AddedToken dicts; ``add_bos_token``), else ``special_tokens_map.json``, else the
dataset manifest next to it, else from what the tokenizer's post-processor adds around a text.

`TokenizerFiles.files` are what a Hugging Face directory needs for the tokenizer (``tokenizer.json``,
``tokenizer_config.json`` and ``special_tokens_map.json`` when the source has it): the dataset directory holds
them, so ``transformers.AutoTokenizer.from_pretrained(dataset_dir)`` loads the tokenizer its shards were made with.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from components.lib.storage import CorpusError, Redactor, explain, open_fs, redact_uri

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
#: Files of a pretrained tokenizer's directory that are copied verbatim into the dataset when present.
COPIED_FILES = (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)
#: A dataset manifest next to a tokenizer.json names its EOS token (datasets built before tokenizer_config.json).
_DATASET_MANIFEST = "manifest.json"
_PROBE_TEXT = "a"


@dataclass
class TokenizerFiles:
    """A tokenizer, its document-boundary tokens, and the files to write next to the shards.

    ``bos_id`` is the token that starts every document, or None when the tokenizer adds none; ``eos_id`` ends
    every document. ``source`` is the redacted path/URI it came from, or ``trained``.
    """

    tokenizer: Tokenizer
    tokenizer_json: bytes
    config: dict[str, Any]
    source: str
    eos_token: str
    eos_id: int
    bos_token: str | None = None
    bos_id: int | None = None
    copied: dict[str, bytes] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        """Vocabulary size including added tokens (and above the largest id, should ids have gaps)."""
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        return max(self.tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)

    def files(self) -> dict[str, bytes]:
        """File name -> bytes for the dataset directory; ``tokenizer.json`` is the source's bytes, unchanged."""
        out = {TOKENIZER_FILE: self.tokenizer_json}
        out[TOKENIZER_CONFIG] = self.copied.get(TOKENIZER_CONFIG) or (
            json.dumps(self.config, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
        out.update({k: v for k, v in self.copied.items() if k != TOKENIZER_CONFIG})
        return out


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


def trained_files(tokenizer: Tokenizer) -> TokenizerFiles:
    """The files of a tokenizer trained by `train_tokenizer`: no BOS, ``<|endoftext|>`` ends documents."""
    config = _config(None, EOS_TOKEN)
    return TokenizerFiles(tokenizer, tokenizer.to_str().encode("utf-8"), config, "trained", EOS_TOKEN,
                          _require_id(tokenizer, EOS_TOKEN, "eos_token", "trained"))


def load_tokenizer_files(uri: str, environ: Mapping[str, str] | None = None) -> TokenizerFiles:
    """A pretrained tokenizer from a ``tokenizer.json`` path/URI or a directory holding one (see module doc)."""
    shown = redact_uri(str(uri))
    fs, path, protocol = open_fs(str(uri), environ)
    redactor = Redactor.from_env(environ)
    try:
        if not fs.exists(path):
            raise CorpusError(f"tokenizer {shown!r} does not exist: give a {TOKENIZER_FILE} path or URI, or a "
                              f"directory holding {TOKENIZER_FILE} and {TOKENIZER_CONFIG}")
        if fs.isdir(path):
            directory, json_path = path.rstrip("/"), f"{path.rstrip('/')}/{TOKENIZER_FILE}"
        else:
            directory, json_path = path.rsplit("/", 1)[0] if "/" in path else "", path
        if not fs.isfile(json_path):
            raise CorpusError(f"tokenizer {shown!r}: no {TOKENIZER_FILE} there: give a {TOKENIZER_FILE}, or a "
                              f"directory holding {TOKENIZER_FILE} and {TOKENIZER_CONFIG} (a Hugging Face model "
                              "directory; a tokenizer saved only as tokenizer.model can be converted with "
                              "transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir))")
        raw = fs.cat_file(json_path)
        siblings = {name: fs.cat_file(p) for name in (*COPIED_FILES, _DATASET_MANIFEST)
                    if fs.isfile(p := f"{directory}/{name}" if directory else name)}
    except CorpusError:
        raise
    except (OSError, ValueError) as err:
        raise explain(err, f"tokenizer {shown}", protocol, redactor) from None
    try:
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
        raise CorpusError(f"tokenizer {shown!r}: {TOKENIZER_FILE} is not a tokenizers file "
                          f"({str(err).splitlines()[0][:200]}): give the tokenizer.json of a fast tokenizer") from None
    parsed = {name: _json(siblings[name], f"tokenizer {shown!r}: {name}") for name in siblings}
    config, special = parsed.get(TOKENIZER_CONFIG, {}), parsed.get(SPECIAL_TOKENS_MAP, {})
    prefix, suffix = _added_around(tokenizer)
    bos = _token(config.get("bos_token")) or _token(special.get("bos_token"))
    if bos is None and len(prefix) == 1:
        bos = tokenizer.id_to_token(prefix[0])
    eos = (_token(config.get("eos_token")) or _token(special.get("eos_token"))
           or _token(parsed.get(_DATASET_MANIFEST, {}).get("eos_token")))
    if eos is None and len(suffix) == 1:
        eos = tokenizer.id_to_token(suffix[0])
    if eos is None and tokenizer.token_to_id(EOS_TOKEN) is not None:
        eos = EOS_TOKEN
    if eos is None:
        raise CorpusError(f"tokenizer {shown!r} names no end-of-document token: add \"eos_token\" to its "
                          f"{TOKENIZER_CONFIG} (or give the model directory that has one)")
    eos_id = _require_id(tokenizer, eos, "eos_token", shown)
    bos_id = _require_id(tokenizer, bos, "bos_token", shown) if bos is not None else None
    add_bos = config.get("add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = bos_id is not None and prefix == [bos_id]
    tokenizer.encode_special_tokens = True
    copied = {name: siblings[name] for name in COPIED_FILES if name in siblings}
    return TokenizerFiles(tokenizer, raw, config or _config(bos if add_bos else None, eos), shown, eos, eos_id,
                          bos if add_bos else None, bos_id if add_bos else None, copied)


def load_tokenizer(path: str, environ: Mapping[str, str] | None = None) -> Tokenizer:
    """The tokenizer of a tokenizer.json or a directory holding one, ready to encode as data prep does."""
    return load_tokenizer_files(str(path), environ).tokenizer


def _config(bos: str | None, eos: str) -> dict[str, Any]:
    """A tokenizer_config.json for a tokenizer that has none (our own BPE): a plain fast tokenizer."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "add_bos_token": bos is not None,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
    }


def _added_around(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids the post-processor puts before and after a text (e.g. ``[<|begin_of_text|>]`` and ``[]``)."""
    plain = tokenizer.encode(_PROBE_TEXT, add_special_tokens=False).ids
    full = tokenizer.encode(_PROBE_TEXT, add_special_tokens=True).ids
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return full[:i], full[i + len(plain):]
    return [], []


def _token(value: Any) -> str | None:
    """A special token from a config: a string, or an AddedToken dict's ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _require_id(tokenizer: Tokenizer, token: str, key: str, shown: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise CorpusError(f"tokenizer {shown!r}: {key} {token!r} is not in its {TOKENIZER_FILE}: the tokenizer "
                          f"files come from different tokenizers; give one model's {TOKENIZER_FILE} and "
                          f"{TOKENIZER_CONFIG}")
    return token_id


def _json(raw: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError as err:
        raise CorpusError(f"{what} is not valid JSON ({err}): fix or remove it") from None
    return value if isinstance(value, dict) else {}
