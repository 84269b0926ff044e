"""``model.from_hf``: a Hugging Face base model on this node, from a directory or a URI.

A URI (``hf://org/model[@revision]``, ``s3://bucket/prefix``, ``gs://...``, ``file://...``, any fsspec protocol) is
downloaded by local rank 0 of each node into a node-local cache (``model.from_hf_cache``), in two parts: the small
files (``config.json``, tokenizer files, the safetensors index) when the trainer starts, the weights only when they
will be read (a fresh start; a resumed run never downloads them). Each part ends with a marker file, so a restart
on the node reuses it; a file lock keeps two local ranks from downloading at once, and the other local ranks wait
for the marker (or for rank 0's recorded failure). Credentials come from the environment (``HF_TOKEN``, ``AWS_*``,
``GOOGLE_APPLICATION_CREDENTIALS``) through the fsspec filesystem of each scheme; they are never logged.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.config import ModelConfig
from trainer.config_checks import ConfigError
from trainer.hf import adapter as hf_adapter
from trainer.hf.errors import BaseModelFilesError
from trainer.hf.reader import INDEX, SafetensorsFiles, load_into

log = logging.getLogger(__name__)

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
META_FILES = (CONFIG, "generation_config.json", TOKENIZER, "tokenizer_config.json", "special_tokens_map.json", INDEX)
"""Downloaded when the trainer starts (config.json is required, the others when the source has them)."""
CACHE_ENV_DEFAULT = "resilient-train-hf"
"""Under ``$TMPDIR`` when ``model.from_hf_cache`` is empty."""
_WAIT_POLL_S = 0.5


def is_uri(source: str) -> bool:
    return bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", source))


def redact(uri: str) -> str:
    """A URI without user info or query (where credentials hide), for messages and logs."""
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#]*@)?([^?#]*)", uri)
    return match.group(1) + match.group(3) if match else uri


class BaseModel:
    """A Llama-family Hugging Face checkpoint for ``model.from_hf``, available on this node.

    ``open`` reads and checks its ``config.json``; ``apply_shape`` sets the model config from it; ``check_data``
    compares the dataset's vocabulary and tokenizer with it; ``load_into`` reads this rank's shards of its weights
    (downloading them first when the source is a URI)."""

    def __init__(self, source: str, directory: Path, fetcher: "Fetcher | None") -> None:
        self.source, self.dir, self.fetcher = source, directory, fetcher
        path = directory / CONFIG
        try:
            self.hf_config = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(
                f"model.from_hf: {redact(source)} has no {CONFIG}: not a Hugging Face model directory") from None
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise BaseModelFilesError(f"{path} cannot be read as JSON ({type(exc).__name__}: {exc})") from None
        if not isinstance(self.hf_config, dict):
            raise BaseModelFilesError(f"{path} is not a JSON object")
        self.shape = hf_adapter.shape_from_hf(self.hf_config, f"{redact(source)}/{CONFIG}")

    @classmethod
    def open(cls, source: str, local_rank: int = 0, cache: str = "") -> "BaseModel":
        """The model at ``source`` (a directory, or a URI downloaded into ``cache`` on this node first)."""
        if not is_uri(source):
            directory = Path(source)
            if not directory.is_dir():
                raise ConfigError(f"model.from_hf: {source} is not a directory; give a Hugging Face model directory or "
                                  "a URI (hf://org/model, s3://bucket/prefix, gs://..., file://...)")
            return cls(source, directory, None)
        fetcher = Fetcher(source, Path(cache or Path(tempfile.gettempdir()) / CACHE_ENV_DEFAULT), local_rank)
        fetcher.fetch("meta")
        return cls(source, fetcher.dir, fetcher)

    @classmethod
    def for_model(cls, cfg: ModelConfig, local_rank: int = 0) -> "BaseModel | None":
        """``cfg.from_hf`` opened, with ``cfg``'s shape set from its config.json; None when ``from_hf`` is empty."""
        if not cfg.from_hf:
            return None
        base_model = cls.open(cfg.from_hf, local_rank, cfg.from_hf_cache)
        base_model.apply_shape(cfg)
        return base_model

    @property
    def name(self) -> str:
        """The model's name: the last part of the source (``Llama-3.2-1B`` for ``hf://meta-llama/Llama-3.2-1B``)."""
        return redact(self.source).rstrip("/").rsplit("/", 1)[-1].split("@", 1)[0] or "hf-model"

    def apply_shape(self, cfg: ModelConfig) -> None:
        """Set the shape fields (and ``name``) of ``cfg`` from ``config.json``, then check them."""
        changed = [f"{key} {getattr(cfg, key)!r} -> {value!r}" for key, value in self.shape.items()
                   if getattr(cfg, key) != value]
        for key, value in self.shape.items():
            setattr(cfg, key, value)
        cfg.name = self.name
        try:
            cfg.validate()
        except ConfigError as exc:
            raise ConfigError(f"model.from_hf: {redact(self.source)}/{CONFIG} describes a shape this trainer cannot "
                              f"build: {exc}") from None
        log.info("model shape from %s/%s%s", redact(self.source), CONFIG,
                 f" (replacing the configured {', '.join(changed)})" if changed else "")

    def check_data(self, data_dir: Path, data_vocab: int, model_vocab: int, tokenizer_file: str) -> None:
        """ConfigError when the dataset cannot have been tokenized for this model: its vocabulary is larger than the
        model's, or its tokenizer differs from the base model's ``tokenizer.json`` (when the model has one)."""
        fix = f"rebuild the dataset with the base model's tokenizer (data prep --tokenizer {redact(self.source)})"
        if data_vocab > model_vocab:
            raise ConfigError(
                f"the dataset {data_dir} has a vocabulary of {data_vocab} tokens, more than the base model's "
                f"{model_vocab} (model.from_hf={redact(self.source)}): it was not tokenized for this model; {fix}")
        ours, theirs = self.dir / TOKENIZER, data_dir / tokenizer_file
        if not ours.is_file() or not theirs.is_file() or _sha256(ours) == _sha256(theirs):
            return
        differ = _vocab_difference(ours, theirs)
        if differ:
            raise ConfigError(
                f"the dataset {data_dir} was tokenized with another tokenizer than the base model's "
                f"({redact(self.source)}/{TOKENIZER}): {differ}; {fix}")

    def fetch_weights(self) -> None:
        """Download the safetensors files of a URI source into the node-local cache (local rank 0; the other local
        ranks wait); nothing for a directory, or when a previous attempt on this node completed them."""
        if self.fetcher is not None:
            self.fetcher.fetch("weights", SafetensorsFiles.required_files(self.dir))

    def load_into(self, model: Any) -> dict[str, int]:
        """Read this rank's shards of the weights into the FSDP2-sharded ``model`` (no collective)."""
        self.fetch_weights()
        started = time.perf_counter()
        files = SafetensorsFiles(self.dir)
        stats = load_into(model, hf_adapter.LlamaAdapter(model.cfg), files)
        log.info("base model weights from %s: %d tensors, %d of their bytes read by this rank for its %d owned "
                 "(%.2f s)", redact(self.source), stats["tensors"], stats["bytes_read"], stats["bytes_owned"],
                 time.perf_counter() - started)
        return stats


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _vocab_difference(a: Path, b: Path) -> str:
    """'' when both tokenizer files map the same tokens to the same ids, else what differs, in words."""
    from tokenizers import Tokenizer

    try:
        va, vb = (Tokenizer.from_file(str(p)).get_vocab(with_added_tokens=True) for p in (a, b))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions for unreadable files
        raise BaseModelFilesError(f"a tokenizer file cannot be read ({a} or {b}: {exc})") from None
    if va == vb:
        return ""
    differing = sum(1 for token, i in vb.items() if va.get(token) != i)
    return f"{differing} of the dataset's {len(vb)} tokens have another id (or none) in the base model's {len(va)}"


# ---- the node-local download --------------------------------------------------------------------------------
class Fetcher:
    """Downloads a model URI into ``cache/<name>-<hash>/`` on this node, one part (``meta`` / ``weights``) at a time.

    Local rank 0 downloads under an exclusive file lock and writes ``.complete-<part>`` when done, or
    ``.failed-<part>`` with its error; the other local ranks wait for either (a failure of this attempt is raised
    again there, so every rank ends with the same one line)."""

    def __init__(self, uri: str, cache: Path, local_rank: int) -> None:
        self.uri, self.local_rank = uri, local_rank
        clean = redact(uri).rstrip("/")
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", clean.rsplit("/", 1)[-1])[:60] or "model"
        self.dir = cache / f"{slug}-{hashlib.sha256(uri.encode()).hexdigest()[:12]}"
        env = os.environ
        self.attempt = f"{env.get('TORCHELASTIC_RUN_ID', '')}:{env.get('TORCHELASTIC_RESTART_COUNT', '')}:{os.getppid()}"
        """Who a recorded failure belongs to: the launcher's run and restart, and the local ranks' parent."""

    def fetch(self, part: str, names: list[str] | None = None) -> None:
        """Make the files of ``part`` present in ``self.dir``: ``meta`` (``META_FILES`` the source has; config.json
        required) or ``weights`` (``names``, required)."""
        marker, failed = self.dir / f".complete-{part}", self.dir / f".failed-{part}"
        if marker.is_file():
            return
        if self.local_rank != 0:
            self._wait(marker, failed, part)
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"model.from_hf_cache: cannot create {self.dir} ({exc.strerror or exc}); set "
                              "--model.from_hf_cache to a writable node-local directory") from None
        with _locked(self.dir.with_name(self.dir.name + ".lock")):
            if marker.is_file():
                return
            failed.unlink(missing_ok=True)
            try:
                sizes = self._download(part, names)
            except (ConfigError, BaseModelFilesError) as exc:
                _write_json(failed, {"attempt": self.attempt, "config_error": isinstance(exc, ConfigError),
                                     "message": str(exc)})
                raise
            _write_json(marker, {"uri": redact(self.uri), "files": sizes, "completed_unix": round(time.time(), 3)})

    def _wait(self, marker: Path, failed: Path, part: str) -> None:
        log.info("waiting for local rank 0 to download %s of %s", part, redact(self.uri))
        while not marker.is_file():
            with contextlib.suppress(OSError, ValueError):
                record = json.loads(failed.read_text())
                if record.get("attempt") == self.attempt:
                    raise (ConfigError if record.get("config_error") else BaseModelFilesError)(record["message"])
            time.sleep(_WAIT_POLL_S)

    def _download(self, part: str, names: list[str] | None) -> dict[str, int]:
        import fsspec

        shown = redact(self.uri)
        try:
            fs, root = fsspec.core.url_to_fs(self.uri)
            listing = {Path(e["name"]).name: e for e in fs.ls(root, detail=True) if e.get("type") != "directory"}
        except (FileNotFoundError, PermissionError) as exc:
            raise ConfigError(
                f"model.from_hf: {shown} cannot be listed ({type(exc).__name__}: {exc}); check the URI and the "
                "credentials in the environment (HF_TOKEN, AWS_*, GOOGLE_APPLICATION_CREDENTIALS)") from None
        except ImportError as exc:
            raise ConfigError(f"model.from_hf: no filesystem for {shown} ({exc})") from None
        except Exception as exc:  # noqa: BLE001 - every store has its own network errors
            raise BaseModelFilesError(f"model.from_hf: {shown} cannot be listed ({type(exc).__name__}: {exc})") from None
        if part == "meta":
            if CONFIG not in listing:
                raise ConfigError(f"model.from_hf: {shown} has no {CONFIG}: not a Hugging Face model directory")
            wanted = [n for n in META_FILES if n in listing]
        else:
            wanted = list(names or [])
            missing = [n for n in wanted if n not in listing]
            if missing:
                raise BaseModelFilesError(
                    f"model.from_hf: {shown} lacks {', '.join(missing[:5])}; the model is incomplete")
        started, total = time.perf_counter(), 0
        sizes = {}
        for name in wanted:
            target, partial = self.dir / name, self.dir / f"{name}.partial"
            expected = listing[name].get("size")
            log.info("downloading %s/%s (%s bytes) into %s", shown, name, expected, self.dir)
            try:
                fs.get_file(f"{root.rstrip('/')}/{name}", str(partial))
            except Exception as exc:  # noqa: BLE001
                partial.unlink(missing_ok=True)
                raise BaseModelFilesError(f"model.from_hf: downloading {shown}/{name} failed ({type(exc).__name__}: "
                                          f"{exc})") from None
            size = partial.stat().st_size
            if expected is not None and size != int(expected):
                partial.unlink(missing_ok=True)
                raise BaseModelFilesError(f"model.from_hf: {shown}/{name} arrived with {size} bytes, the store lists "
                                          f"{expected}")
            os.replace(partial, target)
            sizes[name], total = size, total + size
        elapsed = time.perf_counter() - started
        log.info("downloaded %d file(s), %.1f MiB of %s in %.1f s", len(wanted), total / 2**20, shown, elapsed)
        return sizes


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
