"""Where data prep reads from: one fsspec code path for local paths, ``file://``, ``s3://``, ``gs://``, ``hf://``.

Every read goes through ``fsspec.core.url_to_fs``; only the storage options differ by protocol, and they come
from the environment (in the pipeline: a Kubernetes Secret mounted as env into the data prep step). The table
`ENV_OPTIONS` is the whole mapping. Credentials never leave this module in a printable form: `redact_uri`
strips them from URIs and `Redactor` scrubs their values from any line we print or write.

Torch-free; no network at import time.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

#: Exit code of the data prep CLI for input the user must change (arguments, URIs, credentials, the text field).
EXIT_USAGE = 2
#: Exit code for a corpus that was found but cannot be read or is unusable (as the trainer's DATA_ERROR).
EXIT_DATA = 3

#: fsspec storage options per protocol, each from the first of its environment variables that is set. The
#: second spellings are Kubeflow Trainer's dataset/model initializer settings. ``a.b`` nests (``client_kwargs``).
ENV_OPTIONS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "s3": (
        ("key", ("AWS_ACCESS_KEY_ID", "ACCESS_KEY_ID")),
        ("secret", ("AWS_SECRET_ACCESS_KEY", "SECRET_ACCESS_KEY")),
        ("token", ("AWS_SESSION_TOKEN",)),
        ("endpoint_url", ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "ENDPOINT")),
        ("client_kwargs.region_name", ("AWS_REGION", "AWS_DEFAULT_REGION", "REGION")),
    ),
    "gs": (
        ("token", ("GOOGLE_APPLICATION_CREDENTIALS",)),
        ("project", ("GOOGLE_CLOUD_PROJECT",)),
    ),
    "hf": (
        ("token", ("HF_TOKEN", "ACCESS_TOKEN")),
        ("endpoint", ("HF_ENDPOINT",)),
    ),
}
#: Environment variables whose values are secrets: scrubbed from every line we print or write.
SECRET_ENV = ("AWS_ACCESS_KEY_ID", "ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "SECRET_ACCESS_KEY",
              "AWS_SESSION_TOKEN", "HF_TOKEN", "ACCESS_TOKEN")
#: What a user sets to give each protocol credentials (named in access-denied messages).
CREDENTIAL_HINTS = {
    "s3": "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_REGION)",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS (a service-account key file) or the pod's workload identity",
    "hf": "HF_TOKEN (a Hugging Face token that can read the repository)",
}
#: Query parameters of a URI that identify data, not a caller: kept; every other value is redacted.
_SAFE_QUERY = {"versionId", "generation", "revision"}
_REDACTED = "***"
_URI_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>()\[\]{};,]+")
#: Secrets shorter than this are not scrubbed (they would mangle ordinary text, and are not real keys).
_MIN_SECRET_LEN = 6
#: Fields of an fsspec ``info()`` dict that identify one version of an object, per store (mapping as data).
_IDENTITY_KEYS = {
    "etag": ("ETag", "etag", "blob_id"),  # S3, GCS, Hugging Face (git blob id)
    "version_id": ("VersionId", "generation", "version_id"),  # S3 versioned buckets, GCS generations
    "last_modified": ("LastModified", "updated", "last_modified", "mtime", "created"),
}


class CorpusError(ValueError):
    """The input cannot be used as given; the message says what to change. ``exit_code`` is the CLI's."""

    exit_code = EXIT_USAGE


class CorpusDataError(CorpusError):
    """The corpus was found but cannot be read or is unusable (exit 3, as the trainer's DATA_ERROR)."""

    exit_code = EXIT_DATA


def protocol_of(uri: str) -> str:
    """The canonical fsspec protocol of a URI or path (``file`` for local paths; ``gcs`` -> ``gs``)."""
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", uri)
    if not match:
        return "file"
    name = match.group(1).lower()
    return {"gcs": "gs", "s3a": "s3", "local": "file"}.get(name, name)


def storage_options(protocol: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """fsspec options for ``protocol`` from the environment (`ENV_OPTIONS`); empty values count as unset."""
    env = os.environ if environ is None else environ
    options: dict[str, Any] = {}
    for option, names in ENV_OPTIONS.get(protocol, ()):
        value = next((env[n] for n in names if env.get(n)), None)
        if value is None:
            continue
        target = options
        *parents, leaf = option.split(".")
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    return options


def redact_uri(uri: str) -> str:
    """``uri`` without credentials: no ``user:pass@`` and no query values other than object versions."""
    text = str(uri)
    if "://" not in text:
        return text
    parts = urlsplit(text)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    query = urlencode([(k, v if k in _SAFE_QUERY else _REDACTED) for k, v in parse_qsl(parts.query,
                                                                                          keep_blank_values=True)],
                      safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


@dataclass(frozen=True)
class Redactor:
    """Scrubs credential values (from `SECRET_ENV`) and URI credentials out of text we print or write."""

    secrets: tuple[str, ...]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Redactor:
        env = os.environ if environ is None else environ
        found = {env[n] for n in SECRET_ENV if len(env.get(n) or "") >= _MIN_SECRET_LEN}
        return cls(tuple(sorted(found, key=len, reverse=True)))

    def __call__(self, text: str) -> str:
        text = _URI_IN_TEXT.sub(lambda m: redact_uri(m.group(0)), str(text))
        for secret in self.secrets:
            text = text.replace(secret, _REDACTED)
        return text


def open_fs(uri: str, environ: Mapping[str, str] | None = None) -> tuple[Any, str, str]:
    """``(filesystem, path, protocol)`` for a URI or local path, with the protocol's options from the env.

    A fresh filesystem instance each call (``skip_instance_cache``): credentials changed between calls apply.
    """
    from fsspec.core import url_to_fs

    protocol = protocol_of(uri)
    options = storage_options(protocol, environ)
    if protocol in ("s3", "gs"):
        options["use_listings_cache"] = False  # a listing holds one small record per object, then is dropped
    try:
        fs, path = url_to_fs(uri, skip_instance_cache=True, **options)
    except ImportError as err:
        raise CorpusError(f"{redact_uri(uri)}: reading {protocol}:// needs a package that is not installed "
                          f"({err.name or err}): pip install it into the image") from None
    except ValueError as err:
        if "Protocol not known" in str(err):
            raise CorpusError(f"{redact_uri(uri)}: unknown URI scheme {protocol!r}: use a local path, file://, "
                              "s3://, gs:// or hf://datasets/<org>/<name>") from None
        raise
    return fs, path, protocol


def explain(err: BaseException, what: str, protocol: str, redactor: Redactor) -> CorpusError:
    """One line for a failed read of ``what`` (already redacted), with the exit code of its cause."""
    detail = redactor(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
    name = type(err).__name__
    hint = CREDENTIAL_HINTS.get(protocol, "the file permissions")
    if isinstance(err, PermissionError) or name in ("NoCredentialsError", "PartialCredentialsError",
                                                   "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return CorpusError(f"{what}: access denied ({detail}): check the credentials: {hint}; and that they may "
                           "read this location")
    if isinstance(err, FileNotFoundError):
        if "bucket" in detail.lower():
            return CorpusError(f"{what}: the bucket does not exist ({detail}): check the bucket name in the URI "
                               "(and AWS_ENDPOINT_URL / AWS_REGION for the store that holds it)")
        return CorpusError(f"{what} does not exist ({detail}): check the path")
    if isinstance(err, IsADirectoryError | NotADirectoryError):
        return CorpusError(f"{what}: {detail}: check the path")
    return CorpusDataError(f"{what}: could not be read ({name}: {detail}); if the store was unreachable, "
                           "check its endpoint and network, then retry")


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One object of a corpus: its path, size and the version identity the store gives (else None)."""

    path: str
    rel: str
    size: int
    etag: str | None = None
    version_id: str | None = None
    last_modified: str | None = None

    @classmethod
    def from_info(cls, info: Mapping[str, Any], rel: str) -> ObjectInfo:
        """From an fsspec ``info()`` / ``find(detail=True)`` entry (`_IDENTITY_KEYS` say where to look)."""
        found = {field: next((info[k] for k in keys if info.get(k) not in (None, "")), None)
                 for field, keys in _IDENTITY_KEYS.items()}
        return cls(path=str(info["name"]), rel=rel, size=int(info.get("size") or 0),
                   etag=None if found["etag"] is None else str(found["etag"]).strip('"'),
                   version_id=None if found["version_id"] is None else str(found["version_id"]),
                   last_modified=_timestamp(found["last_modified"]))

    def with_details(self, details: Mapping[str, Any] | None) -> ObjectInfo:
        """This object updated from the details of the opened file (a HEAD gives S3's VersionId)."""
        if not details or "name" not in details:
            return self
        newer = ObjectInfo.from_info(details, self.rel)
        return ObjectInfo(self.path, self.rel, newer.size or self.size, newer.etag or self.etag,
                          newer.version_id or self.version_id, newer.last_modified or self.last_modified)

    def record(self) -> dict[str, Any]:
        """The manifest entry: path relative to the corpus root, size, and the identity fields the store has."""
        entry: dict[str, Any] = {"path": self.rel, "size": self.size}
        for field in _IDENTITY_KEYS:
            if getattr(self, field) is not None:
                entry[field] = getattr(self, field)
        return entry


def _timestamp(value: Any) -> str | None:
    """ISO 8601 UTC for a datetime, an epoch number or a string the store gave; None when absent."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.astimezone(timezone.utc).isoformat(timespec="seconds")
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, timezone.utc).isoformat(timespec="seconds")
    return str(value)
