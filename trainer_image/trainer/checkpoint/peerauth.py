"""The peer tier's authentication (``replicas``): the job's secret, the signed messages of its protocol, and the seal
that says a rank of the job made a replica. That is this module's one concern.

**The secret.** Every rank of a job reads the same secret: from the file ``TRAINER_JOB_SECRET_FILE`` names (the
launch step makes a Kubernetes Secret owned by the job and mounts it into every pod; the local launcher writes a
0600 file in its own temporary directory for the nodes it starts), else from ``<checkpoint.dir>.peer-secret`` beside
the shared checkpoint directory, which the first rank to get there creates (0600, published with a hard link, so
every node reads the one that won). Whoever can read that file can read the checkpoints beside it anyway. The keys
are derived from it and the job key (``slots.job_key``), so two jobs that share a secret still cannot talk.

**Messages.** Every request, reply and trailer of the protocol carries a nonce, the sender's clock and an
HMAC-SHA256 over its JSON head (canonical form), its kind and the SHA-256 of its blob (a snapshot's header). A
reply and a trailer name the request's nonce (``re``), so neither can be replayed into another exchange; a request
names the rank it is for, and a server refuses one for another rank, one whose clock is more than ``WINDOW_S`` off,
or one whose nonce it has seen.

**Seals.** A snapshot's bytes are hashed while they are sent and while they are received (SHA-256 of each
``PIECE``, on a few threads, then of the pieces' digests: ``Digest``); the seal is an HMAC over the job, source
rank, step, size, the header's digest and that content digest. A holder keeps the seal beside the replica and
checks it when the replica arrives; the rank that fetches it back checks it again on the bytes it received, before
the replica is restored. The bytes travel in the clear: the seal makes them tamper-evident, not secret.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import mmap
import os
import secrets
import stat
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainer.checkpoint.errors import CheckpointError

SECRET_FILE_ENV = "TRAINER_JOB_SECRET_FILE"
"""A file holding the job's secret (the mounted Kubernetes Secret, or the local launcher's file)."""
SECRET_SUFFIX = ".peer-secret"
MIN_SECRET_BYTES = 32
WINDOW_S = 300.0
"""How far a request's clock may be from the server's (nodes keep their clocks in sync to well within this)."""
PIECE = 16 << 20
"""Bytes per hashed piece of a snapshot: the pieces are hashed in parallel."""
_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))
_CONTEXT = b"resilient-train peer tier v1\0"
_SECRET_WAIT_S = 10.0


def load_secret(checkpoint_dir: Path) -> bytes:
    """The job's secret (module docstring); ``CheckpointError`` saying what to change when it cannot be had."""
    named = os.environ.get(SECRET_FILE_ENV)
    if named:
        try:
            return _valid(Path(named), Path(named).read_bytes())
        except OSError as exc:
            raise CheckpointError(f"{SECRET_FILE_ENV}={named}: the job's secret cannot be read ({exc.strerror}): mount "
                                  f"the job's Secret there, or unset {SECRET_FILE_ENV} to share one beside "
                                  "checkpoint.dir") from None
    path = Path(checkpoint_dir).parent / (Path(checkpoint_dir).name + SECRET_SUFFIX)
    if not path.exists():
        _create(path)
    deadline = time.monotonic() + _SECRET_WAIT_S
    while True:  # a node that created it without a hard link may still be writing it
        info = path.stat()
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise CheckpointError(f"the job's secret {path} may be read by others (mode {stat.filemode(info.st_mode)})"
                                  f": chmod 600 it, or remove it to have a new one made")
        text = path.read_bytes()
        if len(text.strip()) >= MIN_SECRET_BYTES or time.monotonic() > deadline:
            return _valid(path, text)
        time.sleep(0.05)


def _valid(path: Path, text: bytes) -> bytes:
    secret = text.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise CheckpointError(f"the job's secret {path} holds {len(secret)} bytes; it needs at least "
                              f"{MIN_SECRET_BYTES} random ones: remove it to have one made, or write a longer one")
    return secret


def _create(path: Path) -> None:
    """A new secret at ``path`` unless another rank made one first: written to a file of its own, then linked into
    place (atomic, never replacing); where the file system has no hard links, created exclusively."""
    token = secrets.token_urlsafe(48).encode()
    own = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(own, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, token)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(own, path)
    except FileExistsError:
        pass
    except OSError:  # no hard links here
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(token)
    finally:
        own.unlink(missing_ok=True)


class PeerAuth:
    """Signs and checks the peer tier's messages and seals for one job."""

    def __init__(self, secret: bytes, job: str) -> None:
        self._key = hmac.new(secret, _CONTEXT + job.encode(), hashlib.sha256).digest()
        self.job = job
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def _mac(self, kind: str, head: dict[str, Any], blob: bytes) -> str:
        body = json.dumps({k: v for k, v in head.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
        message = kind.encode() + b"\0" + body.encode() + b"\0" + hashlib.sha256(blob).digest()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def sign(self, kind: str, head: dict[str, Any], blob: bytes = b"", re: str = "") -> dict[str, Any]:
        """``head`` with a nonce, the clock, ``re`` (the request's nonce, for a reply or trailer) and its MAC."""
        signed = {**head, "kind": kind, "nonce": secrets.token_hex(16), "time": round(time.time(), 3)}
        if re:
            signed["re"] = re
        signed["mac"] = self._mac(kind, signed, blob)
        return signed

    def check(self, kind: str, head: dict[str, Any], blob: bytes = b"", re: str = "") -> str:
        """'' when ``head`` (with ``blob``) is a ``kind`` message of this job (answering ``re``), else why not."""
        mac = head.get("mac")
        if not isinstance(mac, str) or not hmac.compare_digest(mac, self._mac(kind, head, blob)):
            return "no valid MAC of this job's secret" if mac else "not signed"
        if head.get("kind") != kind or head.get("re", "") != re:
            return f"a {head.get('kind')} message where a {kind} was expected"
        return ""

    def fresh(self, head: dict[str, Any]) -> str:
        """'' for a request seen for the first time within ``WINDOW_S`` of its clock, else why not (a replay)."""
        now, nonce = time.time(), str(head.get("nonce", ""))
        if abs(now - float(head.get("time", 0))) > WINDOW_S:
            return f"its clock is {now - float(head.get('time', 0)):+.0f} s off this node's (a replay?)"
        with self._lock:
            self._seen = {n: t for n, t in self._seen.items() if t > now - 2 * WINDOW_S}
            if nonce in self._seen:
                return "its nonce was used before (a replay)"
            self._seen[nonce] = now
        return ""

    def seal(self, rank: int, step: int, nbytes: int, header: bytes, digest: str) -> str:
        """The HMAC that says a rank of this job made this snapshot: header and content digest included."""
        fields = json.dumps([self.job, rank, step, nbytes, hashlib.sha256(header).hexdigest(), digest])
        return hmac.new(self._key, b"seal\0" + fields.encode(), hashlib.sha256).hexdigest()

    def sealed(self, seal: Any, rank: int, step: int, nbytes: int, header: bytes, digest: str) -> bool:
        return isinstance(seal, str) and hmac.compare_digest(seal, self.seal(rank, step, nbytes, header, digest))


class Digest:
    """The content digest of a snapshot: each ``PIECE`` hashed on a thread as soon as it is complete (the
    caller's views of a mapping stay valid until ``hexdigest`` returns, which releases them)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="peer-digest")
        self._parts: list[Future[bytes]] = []

    def add(self, view: memoryview) -> None:
        """The next piece (``PIECE`` bytes, the last one shorter), in order."""
        def one(piece: memoryview = view) -> bytes:
            with piece:
                return hashlib.sha256(piece).digest()

        self._parts.append(self._pool.submit(one))

    def hexdigest(self) -> str:
        try:
            return hashlib.sha256(b"".join(part.result() for part in self._parts)).hexdigest()
        finally:
            self._pool.shutdown(wait=True)


def file_digest(path: Path, nbytes: int) -> str:
    """The content digest of the first ``nbytes`` of ``path`` (``Digest``)."""
    digest = Digest()
    if nbytes == 0:
        return digest.hexdigest()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ) as mapped:
        with memoryview(mapped) as view:
            try:
                for start in range(0, nbytes, PIECE):
                    digest.add(view[start:start + PIECE])
            finally:
                result = digest.hexdigest()
        return result
