"""The peer tier: each rank's newest snapshot copied into the host memory of a rank on another node, and fetched back
by a rank whose node was lost. That is this module's one concern.

**Placement** (``holders``): the nodes, in rank order, form a ring; the ranks of node i replicate to the ranks of the
same local index on the next ``checkpoint.replicas`` nodes, nodes of another rack first where every node names its
rack (``TRAINER_NODE_RACK``). So the loss of any one node (and, where racks are known and the replicas fit, of any
one rack) leaves a copy of every shard. As in NVRx's ``CliqueReplicationStrategy`` a rank's copies sit whole nodes
away (its ``replication_jump`` is the ranks per node); unlike it, saving is never collective and never touches the
GPU: once a slot's node-local header is published (``SnapshotStore.on_published``), the publishing thread sends the
slot's file to each holder over a socket (``sendfile``: the bytes the device-to-host copy already landed), while
training goes on. A slot is restaged only after its push finished (``Slot.published``), so no push is torn.

**A holder** serves its replicas from a socket of its own (``ReplicaServer``, one thread per connection). It mirrors
the source's slots: slot j of rank r goes to ``peer-rank-<r>.slot-<j>.data`` in its node-local directory, with the
header as the source published it (job, rank, world size, config hash, step, layout, checksum, the rank's non-tensor
state), renamed into place last. So the replicas hold the steps the source's own memory holds (the slot a slow
persistent write keeps locked included), which the other ranks' memory holds too: a step every rank can reach. A
replica of a step at or beyond the one arriving (a future the job did not keep) is dropped first.

**Only the job's ranks take part** (``peerauth``): every request, reply and trailer is signed with the job's secret
(a nonce against replay); a request that is not is refused with one line naming the peer, and nothing is read,
written or served for it. A put is received only when its header is of this job and its size is no more than the
source rank's slot (``Replicator.expect``: every rank's slot size, known from its layout, exchanged once per
attempt): before a byte is reserved. The bytes are hashed while they travel and sealed by the source (HMAC over
header and content digest); the holder checks the seal on arrival and keeps it beside the replica, and the rank
that fetches it back checks it again on the bytes it received, so a replica altered on disk or in flight is refused
and the next tier used. The server listens on the address the ranks reach it at, not on every interface.

A node's own slots of a rank it no longer runs (a new rendezvous numbered the nodes otherwise: a spare took a place
between them) are served like replicas. **At restore** (``restore.py``) each rank reports what it holds; a rank that lacks the chosen step in its own
memory fetches it from a holder into one of its own slot files, where the node-local tier's guards and checksum
check it like any snapshot found on the node (a bad one is refused, and the next tier is used).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import mmap
import os
import socket
import struct
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from trainer.checkpoint import headers, peerauth, reshard
from trainer.checkpoint.slots import Slot, SnapshotStore
from trainer.checkpoint.snapshot_header import decode_header

log = logging.getLogger(__name__)

RACK_ENV = "TRAINER_NODE_RACK"
"""This node's rack (or any failure domain), e.g. from the node's topology label; unset: unknown."""
ADDR_ENV = "TRAINER_REPLICA_ADDR"
"""The address other nodes reach this node's replica server at; default: this host name's address."""
NODE_ENV = "TRAINER_NODE_ID"
_HEAD = struct.Struct("!II")  # JSON length, blob length
_PIECE = 16 << 20
_TIMEOUT_S = 60.0
_MAX_HEAD = 1 << 16
_MAX_BLOB = 256 << 20
"""The largest JSON head and blob (a snapshot's header) a message may have: bounded before either is read."""


def resolve_count(setting: int | str, nodes: int) -> int:
    """``checkpoint.replicas`` for a job of ``nodes`` nodes: ``auto`` is 1 from 2 nodes on; never more than the
    other nodes."""
    wanted = (1 if nodes >= 2 else 0) if setting == "auto" else int(setting)
    return max(0, min(wanted, nodes - 1))


def holders(nodes: list[str], racks: list[str], count: int) -> list[list[int]]:
    """Per rank (``nodes[r]``: its node's id, ``racks[r]``: its rack or ''), the ranks that hold its replicas: the
    next nodes in the ring; where racks are known, nodes of another rack first, the least loaded of them first, so
    that no node holds far more than the others."""
    order = list(dict.fromkeys(nodes))
    members = {node: [r for r, n in enumerate(nodes) if n == node] for node in order}
    rack_of = {nodes[r]: racks[r] for r in range(len(nodes))}
    known = all(rack_of.values()) and len(set(rack_of.values())) > 1
    load = dict.fromkeys(order, 0)
    chosen: dict[str, list[str]] = {}
    for i, node in enumerate(order):
        ring = [order[(i + k) % len(order)] for k in range(1, len(order))]
        if known:  # another rack first; among those, the least loaded, then the nearest in the ring
            ring.sort(key=lambda other: (rack_of[other] == rack_of[node], load[other]))
        chosen[node] = ring[:count]
        for other in chosen[node]:
            load[other] += 1
    return [[members[other][members[node].index(rank) % len(members[other])] for other in chosen[node]]
            for rank, node in enumerate(nodes)]


# ---- the wire: a JSON head, a blob (a header file), then raw bytes and a trailer; every message signed -----------
class _Refused(ValueError):
    """A message that is not this job's (``peerauth``), or an answer that refused."""


def _send(sock: socket.socket, head: dict[str, Any], blob: bytes = b"") -> None:
    text = json.dumps(head).encode()
    sock.sendall(_HEAD.pack(len(text), len(blob)) + text + blob)


def _exact(sock: socket.socket, nbytes: int) -> bytes:
    out = bytearray()
    while len(out) < nbytes:
        chunk = sock.recv(min(nbytes - len(out), _PIECE))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        out += chunk
    return bytes(out)


def _receive(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    size, blob = _HEAD.unpack(_exact(sock, _HEAD.size))
    if size > _MAX_HEAD or blob > _MAX_BLOB:  # before anything is read into memory
        raise _Refused(f"a message of {size} + {blob} bytes, more than the protocol's")
    head = json.loads(_exact(sock, size))
    if not isinstance(head, dict):
        raise _Refused("not a message of the peer tier's protocol")
    return head, _exact(sock, blob)


def _receive_file(sock: socket.socket, path: Path, nbytes: int) -> str:
    """``nbytes`` from the socket straight into the file's pages (reserved first: a full tmpfs is an error here,
    not a SIGBUS), hashed piece by piece as they arrive; returns their content digest (``peerauth.Digest``)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, max(nbytes, 1))
        with mmap.mmap(fd, max(nbytes, 1)) as mapped, memoryview(mapped) as view:
            digest, done, hashed = peerauth.Digest(), 0, 0
            try:
                while done < nbytes:
                    with view[done:min(nbytes, done + _PIECE)] as part:  # released before the mapping closes
                        got = sock.recv_into(part)
                    if not got:
                        raise ConnectionError("the peer closed the connection mid-copy")
                    done += got
                    while hashed < nbytes and (done - hashed >= peerauth.PIECE or done == nbytes):
                        digest.add(view[hashed:min(nbytes, hashed + peerauth.PIECE)])
                        hashed = min(nbytes, hashed + peerauth.PIECE)
            finally:
                result = digest.hexdigest()  # every piece's view released
            return result
    finally:
        os.close(fd)


def _send_file(sock: socket.socket, path: Path, nbytes: int, hashed: bool = True) -> str:
    """The file's first ``nbytes`` (``sendfile``), hashed meanwhile on other threads when ``hashed``; returns the
    content digest ('' when not hashed)."""
    with ThreadPoolExecutor(1, thread_name_prefix="peer-send-digest") as pool:
        digest = pool.submit(peerauth.file_digest, path, nbytes) if hashed else None
        if nbytes:
            with open(path, "rb") as f:
                sock.sendfile(f, 0, nbytes)
        return digest.result() if digest is not None else ""


class _Exchange:
    """One connection's messages after its request: each signed and checked against the request's nonce."""

    def __init__(self, sock: socket.socket, auth: peerauth.PeerAuth, nonce: str) -> None:
        self.sock, self.auth, self.nonce = sock, auth, nonce

    def send(self, kind: str, head: dict[str, Any], blob: bytes = b"") -> None:
        _send(self.sock, self.auth.sign(kind, head, blob, re=self.nonce), blob)

    def receive(self, kind: str) -> tuple[dict[str, Any], bytes]:
        head, blob = _receive(self.sock)
        why = self.auth.check(kind, head, blob, re=self.nonce)
        if why:
            raise _Refused(f"an answer not signed with this job's secret ({why}; it said {str(head.get('why'))!r})")
        return head, blob


class ReplicaServer:
    """This rank's replicas of other ranks' snapshots: ``put`` (a source pushes one) and ``get`` (a rank fetches its
    own back), for requests signed with the job's secret only; one lock per source rank, so a get never reads a
    replica being overwritten. It listens on the address the job's ranks reach it at (``advertised_host``)."""

    def __init__(self, store: SnapshotStore, auth: peerauth.PeerAuth) -> None:
        self.store, self.auth = store, auth
        self.listener = _listen(advertised_host())
        self.port = self.listener.getsockname()[1]
        log.info("peer tier: replicas served at %s:%d, to requests signed with the job's secret only",
                 self.listener.getsockname()[0], self.port)
        self.limits: list[int] = []
        """Per rank of this attempt: the bytes of its snapshot slot (``Replicator.expect``); a larger put is refused."""
        self._locks: defaultdict[int, threading.Lock] = defaultdict(threading.Lock)
        self._closed = False
        threading.Thread(target=self._accept, name="replica-server", daemon=True).start()

    def _paths(self, rank: int, index: int) -> tuple[Path, Path]:
        stem = f"{headers.PEER}rank-{rank:05d}.slot-{index}"
        return self.store.dir / f"{stem}.meta", self.store.dir / f"{stem}.data"

    def held(self) -> dict[int, dict[int, Path]]:
        """Source rank -> {step: header} of the snapshots held here for this job, world size and config: the replicas,
        and the node's own slots of a rank it no longer runs (a new rendezvous numbered its ranks otherwise)."""
        out: dict[int, dict[int, Path]] = defaultdict(dict)
        for found in headers.scan(self.store):
            if found.kind == headers.FETCHED or (not found.kind and found.rank == self.store.rank):
                continue  # a reshard's fetched copy, or this rank's own slots: the node-local tier's
            if found.meta.get("world_size") == self.store.world_size:
                out[found.rank][int(found.meta["step"])] = found.meta_path
        return dict(out)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="replica-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            peer = _peer(conn)
            try:
                conn.settimeout(_TIMEOUT_S)
                head, blob = _receive(conn)
                why = self.auth.check("request", head, blob) or self.auth.fresh(head) or (
                    "" if head.get("to") == self.store.rank else f"addressed to rank {head.get('to')}, not this one")
                if why:  # FT/security: nothing is read, written or served for it
                    log.warning("peer tier: refused a request from %s: %s; nothing served or written", peer, why)
                    _send(conn, {"ok": False, "why": "refused: not signed with this job's secret"})
                    return
                exchange = _Exchange(conn, self.auth, head["nonce"])
                if head.get("op") == "put":
                    self._put(exchange, peer, head, blob)
                elif head.get("op") == "get":
                    self._get(exchange, int(head["rank"]), int(head["step"]))
                elif head.get("op") == "get_cut":
                    self._get_cut(exchange, int(head["rank"]), int(head["step"]), int(head["world"]),
                                  bool(head["data"]))
                else:
                    exchange.send("reply", {"ok": False, "why": f"no operation {head.get('op')!r}"})
            except Exception as exc:  # noqa: BLE001 - one failed transfer; the source logs it, the next one may pass
                log.warning("peer tier: a transfer with %s failed: %s", peer, exc)

    def _admissible(self, rank: int, index: int, step: int, nbytes: int, header: bytes) -> str:
        """'' when a signed put may be received: a slot of the job's, no larger than the source's (known from its
        layout), and a header of this job naming the same rank, step and size; else why not."""
        limit = self.limits[rank] if 0 <= rank < len(self.limits) else None
        if not 0 <= index < len(self.store.slots):
            return f"slot {index}: the job's ranks have {len(self.store.slots)}"
        if limit is None:
            return f"rank {rank}'s slot size is not known here (not a rank of this attempt?)"
        if nbytes > limit:
            return f"{nbytes} bytes, more than rank {rank}'s snapshot slot ({limit} bytes, from its layout)"
        meta = torch.load(io.BytesIO(header), map_location="cpu", weights_only=True)  # signed: a rank's own header
        if not isinstance(meta, dict) or [meta.get(k) for k in ("job", "rank", "step", "nbytes")] != \
                [self.store.job, rank, step, nbytes]:
            return "its header names another job, rank, step or size than the request"
        return ""

    def _put(self, exchange: _Exchange, peer: str, head: dict[str, Any], header: bytes) -> None:
        rank, index, step, nbytes = (int(head[k]) for k in ("rank", "slot", "step", "nbytes"))
        why = self._admissible(rank, index, step, nbytes, header)
        if why:  # before a byte is reserved
            log.warning("peer tier: refused rank %d's replica of step %d from %s: %s", rank, step, peer, why)
            exchange.send("reply", {"ok": False, "why": why})
            return
        with self._locks[rank]:
            for held_step, other in self.held().get(rank, {}).items():
                if held_step >= step and other.name.startswith(headers.PEER):  # a future the job did not keep, or again
                    other.unlink(missing_ok=True)
            meta_path, data_path = self._paths(rank, index)
            meta_path.unlink(missing_ok=True)
            self.store.dir.mkdir(parents=True, exist_ok=True)
            exchange.send("reply", {"ok": True})  # send the bytes
            try:
                digest = _receive_file(exchange.sock, data_path, nbytes)
                trailer, _ = exchange.receive("trailer")
            except BaseException:
                data_path.unlink(missing_ok=True)
                raise
            if trailer.get("digest") != digest or not self.auth.sealed(trailer.get("seal"), rank, step, nbytes,
                                                                        header, digest):
                data_path.unlink(missing_ok=True)
                why = "its bytes do not match its seal (altered in flight?): not kept"
                log.warning("peer tier: refused rank %d's replica of step %d from %s: %s", rank, step, peer, why)
                exchange.send("reply", {"ok": False, "why": why})
                return
            headers.seal_path(meta_path).write_text(json.dumps({"digest": digest, "seal": trailer["seal"]}))
            partial = meta_path.with_name(meta_path.name + ".partial")
            partial.write_bytes(header)
            os.replace(partial, meta_path)
        exchange.send("reply", {"ok": True})

    def _get(self, exchange: _Exchange, rank: int, step: int) -> None:
        with self._locks[rank]:
            meta_path = self.held().get(rank, {}).get(step)
            if meta_path is None:
                exchange.send("reply", {"ok": False, "why": f"no replica of rank {rank}'s step {step} here"})
                return
            self._send_snapshot(exchange, rank, step, meta_path, headers.data_path(meta_path), with_data=True)

    def _get_cut(self, exchange: _Exchange, rank: int, step: int, world: int, data: bool) -> None:
        """A snapshot of another world size on this node (``reshard``): its header, and its file when ``data``."""
        held_world, sources = reshard.held_steps(self.store).get(step, (0, {}))
        source = sources.get(rank) if held_world == world else None
        if source is None:
            exchange.send("reply", {"ok": False, "why": f"no snapshot of rank {rank}'s step {step} of {world} ranks "
                                                        "here"})
            return
        self._send_snapshot(exchange, rank, step, source.meta_path, source.data, data)

    def _send_snapshot(self, exchange: _Exchange, rank: int, step: int, meta_path: Path, data: Path,
                       with_data: bool) -> None:
        """Header, then (``with_data``) the bytes and their seal: a replica's as its source made it; this node's own
        snapshot sealed by this rank, hashed while it is sent."""
        header, stored = meta_path.read_bytes(), None
        if meta_path.name.startswith(headers.PEER):
            try:
                stored = json.loads(headers.seal_path(meta_path).read_text())
            except (OSError, ValueError):
                exchange.send("reply", {"ok": False, "why": f"rank {rank}'s replica of step {step} has no seal here"})
                return
        nbytes = data.stat().st_size if with_data else 0
        exchange.send("reply", {"ok": True, "nbytes": nbytes}, header)
        if with_data:
            digest = _send_file(exchange.sock, data, nbytes, hashed=stored is None)
            exchange.send("trailer", stored or {"digest": digest,
                                                "seal": self.auth.seal(rank, step, nbytes, header, digest)})

    def close(self, remove: bool) -> None:
        self._closed = True
        self.listener.close()
        if remove:
            for path in [*self.store.dir.glob(f"{headers.PEER}rank-*"), *self.store.dir.glob(f"{headers.FETCHED}rank-*")]:
                path.unlink(missing_ok=True)


def _peer(conn: socket.socket) -> str:
    try:
        return "%s:%d" % conn.getpeername()[:2]
    except OSError:
        return "a peer"


def advertised_host() -> str:
    """Where other nodes reach this node: ``TRAINER_REPLICA_ADDR``, else the address of this host's name."""
    if os.environ.get(ADDR_ENV):
        return os.environ[ADDR_ENV]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _listen(host: str) -> socket.socket:
    """A listening socket on ``host`` only; on every interface, with a warning, where ``host`` is not this node's."""
    try:
        return socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as exc:
        log.warning("peer tier: cannot listen on %s, where other nodes reach this one (%s): listening on every "
                    "interface; set %s to this node's address", host, exc.strerror, ADDR_ENV)
        return socket.create_server(("", 0))


class Replicator:
    """This rank's part of the peer tier: it serves the replicas it holds, pushes its own newest snapshot to its
    holders, and fetches a replica of its own back at restore; every exchange signed with the job's secret."""

    def __init__(self, store: SnapshotStore, setting: int | str, auth: peerauth.PeerAuth) -> None:
        self.store, self.setting, self.auth = store, setting, auth
        self.server = ReplicaServer(store, auth)
        self.addresses: list[tuple[str, int]] = []
        self.nodes: list[str] = []
        self.targets: list[int] = []
        """The ranks holding this rank's replicas (this attempt)."""
        self.count = 0
        self._failed: set[int] = set()
        self._sealed: tuple[int, int, str] | None = None
        """(slot, step, content digest) of the snapshot being pushed: hashed once, for its first holder."""
        self.pushed: dict[int, float] = {}
        """Step -> seconds its last push to every holder took (the newest few)."""
        store.on_published = self.push

    def bind(self, coord: Any) -> None:
        """Per attempt (collective): every rank's node, rack and replica server address; the holders from them."""
        node = os.environ.get(NODE_ENV) or socket.gethostname()
        table = coord.all_gather((node, os.environ.get(RACK_ENV, ""), advertised_host(), self.server.port))
        self.nodes = [t[0] for t in table]
        self.addresses = [(t[2], t[3]) for t in table]
        self.count = resolve_count(self.setting, len(set(self.nodes)))
        plan = holders(self.nodes, [t[1] for t in table], self.count)
        if plan[coord.rank] != self.targets:
            log.info("peer tier: rank %d's snapshots are replicated to rank(s) %s (%d node(s))", coord.rank,
                     plan[coord.rank] or "none", len(set(self.nodes)))
        self.targets, self._failed = plan[coord.rank], set()
        if self.setting not in ("auto", 0) and self.count < int(self.setting) and coord.rank == 0:
            log.warning("checkpoint.replicas=%s, but the job has %d other node(s): %d replica(s) per snapshot",
                        self.setting, len(set(self.nodes)) - 1, self.count)

    def push_figures(self) -> dict[str, Any] | None:
        """This rank's newest pushes (``pushed``): count, mean and max seconds; None before the first."""
        if not self.pushed:
            return None
        values = list(self.pushed.values())
        return {"count": len(values), "mean_s": round(sum(values) / len(values), 4), "max_s": round(max(values), 4)}

    def expect(self, coord: Any, nbytes: int) -> None:
        """Per attempt, once the model is built (collective): every rank's snapshot slot size (``nbytes``, its
        layout's prediction, or a larger slot it maps), the bound of a put from that rank and of a fetch."""
        own = max([nbytes] + [s.buffer.numel() for s in self.store.slots if s.buffer is not None])
        self.server.limits = [int(n) for n in coord.all_gather(own)]

    def node_of(self, rank: int) -> str:
        return self.nodes[rank].split("/")[0] if rank < len(self.nodes) else "?"

    def holdings(self) -> dict[int, list[int]]:
        """Source rank -> the steps of its replicas this rank holds."""
        return {rank: sorted(steps) for rank, steps in self.server.held().items()}

    @contextlib.contextmanager
    def _request(self, holder: int, head: dict[str, Any],
                 blob: bytes = b"") -> Iterator[tuple[_Exchange, dict[str, Any], bytes]]:
        """A signed request to ``holder``'s server, and its signed reply (``_Refused`` for any other)."""
        with socket.create_connection(self.addresses[holder], timeout=_TIMEOUT_S) as sock:
            request = self.auth.sign("request", {**head, "to": holder}, blob)  # not to be replayed to another rank
            _send(sock, request, blob)
            exchange = _Exchange(sock, self.auth, request["nonce"])
            yield (exchange, *exchange.receive("reply"))

    def push(self, slot: Slot, step: int) -> None:
        """In the publishing thread, once ``slot``'s header of ``step`` is in place: the slot's file, header and seal
        to every holder. A holder that cannot be reached, or refuses, is warned about once per attempt."""
        began = time.perf_counter()
        for target in list(self.targets):
            try:
                nbytes, header = slot.data_path.stat().st_size, slot.meta_path.read_bytes()
                head = {"op": "put", "rank": self.store.rank, "slot": slot.index, "step": step, "nbytes": nbytes}
                with self._request(target, head, header) as (exchange, reply, _):
                    if not reply.get("ok"):
                        raise _Refused(reply.get("why", "refused"))
                    known = self._sealed[2] if self._sealed and self._sealed[:2] == (slot.index, step) else ""
                    digest = _send_file(exchange.sock, slot.data_path, nbytes, hashed=not known) or known
                    self._sealed = (slot.index, step, digest)
                    exchange.send("trailer", {"digest": digest,
                                              "seal": self.auth.seal(self.store.rank, step, nbytes, header, digest)})
                    done, _ = exchange.receive("reply")
                if not done.get("ok"):
                    raise _Refused(done.get("why", "refused"))
            except (OSError, ValueError) as exc:
                if target not in self._failed:
                    self._failed.add(target)
                    log.warning("peer tier: step %d not replicated to rank %d at %s:%d (%s); the next snapshot "
                                "tries again", step, target, *self.addresses[target], exc)
                continue
        self.pushed = {**dict(list(self.pushed.items())[-4:]), step: time.perf_counter() - began}

    def _limit(self, rank: int) -> int | None:
        limits = self.server.limits
        return limits[rank] if 0 <= rank < len(limits) else None

    def fetch(self, step: int, holder: int, pieces_fn: Callable[[], Any]) -> tuple[str, int]:
        """This rank's replica of ``step`` from ``holder`` into one of its own slots, its seal checked on the bytes
        received, then found there as a node-local snapshot (guards checked; its checksum is checked when it is
        copied in). Returns ('' or why not, bytes)."""
        store = self.store
        slot = min(store.slots, key=lambda s: (s.locked, s.buffer is not None, s.step or -1))
        slot.published.wait()
        slot.release()
        slot.step = None
        slot.meta_path.unlink(missing_ok=True)
        store.dir.mkdir(parents=True, exist_ok=True)
        nbytes = 0
        try:
            with self._request(holder, {"op": "get", "rank": store.rank, "step": step}) as (exchange, head, header):
                if not head.get("ok"):
                    return f"rank {holder} has no replica of it ({head.get('why')})", 0
                nbytes, limit = int(head["nbytes"]), self._limit(store.rank)
                if limit is not None and nbytes > limit:
                    return f"rank {holder} offers {nbytes} bytes, more than this rank's slot ({limit} bytes)", 0
                digest = _receive_file(exchange.sock, slot.data_path, nbytes)
                trailer, _ = exchange.receive("trailer")
        except (OSError, ValueError) as exc:
            return f"fetching it from rank {holder} failed ({exc})", nbytes
        if trailer.get("digest") != digest or not self.auth.sealed(trailer.get("seal"), store.rank, step, nbytes,
                                                                    header, digest):
            return (f"the replica from rank {holder} does not match its seal: altered on disk or in flight, or not "
                    "made by a rank of this job"), nbytes
        partial = slot.meta_path.with_name(slot.meta_path.name + ".partial")
        partial.write_bytes(header)
        os.replace(partial, slot.meta_path)
        if step not in store.discover(pieces_fn, only=slot):
            return f"the replica from rank {holder} was refused (see the warning above)", nbytes
        return "", nbytes

    def fetch_cut(self, holder: int, rank: int, step: int, world: int, data: bool) -> tuple[str, dict[str, Any], int]:
        """Old rank ``rank``'s snapshot of ``step`` (of ``world`` ranks) from ``holder``'s node (``reshard``): its
        header, and with ``data`` its file (its seal checked), fetched into this node's directory as
        ``headers.FETCHED``. Returns ('' or why not, the header, bytes). Its file is named for this rank too: the
        node's other ranks may fetch the same."""
        stem = self.store.dir / f"{headers.FETCHED}rank-{rank:05d}.slot-{self.store.rank}"
        data_path, nbytes = stem.with_name(stem.name + ".data"), 0
        try:
            with self._request(holder, {"op": "get_cut", "rank": rank, "step": step, "world": world, "data": data}) \
                    as (exchange, head, header):
                if not head.get("ok"):
                    return f"rank {holder}'s node has no snapshot of it ({head.get('why')})", {}, 0
                meta = decode_header(io.BytesIO(header))
                if data:
                    nbytes = int(head["nbytes"])
                    if nbytes != meta.get("nbytes"):
                        return f"rank {holder} offers {nbytes} bytes of a snapshot of {meta.get('nbytes')}", {}, 0
                    self.store.dir.mkdir(parents=True, exist_ok=True)
                    digest = _receive_file(exchange.sock, data_path, nbytes)
                    trailer, _ = exchange.receive("trailer")
                    if trailer.get("digest") != digest or not self.auth.sealed(trailer.get("seal"), rank, step,
                                                                                nbytes, header, digest):
                        data_path.unlink(missing_ok=True)
                        return (f"rank {rank}'s snapshot of step {step} from rank {holder} does not match its seal "
                                "(altered on disk or in flight)"), {}, nbytes
                    partial = stem.with_name(stem.name + ".meta.partial")
                    partial.write_bytes(header)
                    os.replace(partial, stem.with_name(stem.name + ".meta"))  # a new file: read afresh (load_header)
        except (OSError, ValueError, RuntimeError) as exc:
            return f"fetching rank {rank}'s snapshot of step {step} from rank {holder} failed ({exc})", {}, 0
        return "", meta, nbytes

    def check_held(self, source: headers.Header) -> str:
        """'' when a replica held on this node still matches the seal its source made (before a reshard reads it
        in place), else why not."""
        try:
            stored = json.loads(headers.seal_path(source.meta_path).read_text())
        except (OSError, ValueError):
            return f"the replica {source.meta_path} has no seal"
        nbytes, step = int(source.meta["nbytes"]), int(source.meta["step"])
        digest = peerauth.file_digest(source.data, nbytes)
        if stored.get("digest") != digest or not self.auth.sealed(stored.get("seal"), source.rank, step, nbytes,
                                                                   source.meta_path.read_bytes(), digest):
            return f"the replica {source.data} does not match its seal (altered on disk)"
        return ""

    def close(self, remove: bool) -> None:
        self.server.close(remove)
