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

A node's own slots of a rank it no longer runs (a new rendezvous numbered the nodes otherwise: a spare took a place
between them) are served like replicas. **At restore** (``restore.py``) each rank reports what it holds; a rank that lacks the chosen step in its own
memory fetches it from a holder into one of its own slot files, where the node-local tier's guards and checksum
check it like any snapshot found on the node (a bad one is refused, and the next tier is used).
"""

from __future__ import annotations

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
from pathlib import Path
from typing import Any, Callable

import torch

from trainer.checkpoint import headers, reshard
from trainer.checkpoint.slots import SNAPSHOT_FORMAT, Slot, SnapshotStore

log = logging.getLogger(__name__)

RACK_ENV = "TRAINER_NODE_RACK"
"""This node's rack (or any failure domain), e.g. from the node's topology label; unset: unknown."""
ADDR_ENV = "TRAINER_REPLICA_ADDR"
"""The address other nodes reach this node's replica server at; default: this host name's address."""
NODE_ENV = "TRAINER_NODE_ID"
_HEAD = struct.Struct("!II")  # JSON length, blob length
_PIECE = 16 << 20
_TIMEOUT_S = 60.0
_MAX_SLOTS = 64


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


# ---- the wire: a JSON head, a blob (a header file), then raw bytes -----------------------------------------------
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
    return json.loads(_exact(sock, size)), _exact(sock, blob)


def _receive_file(sock: socket.socket, path: Path, nbytes: int) -> None:
    """``nbytes`` from the socket straight into the file's pages (reserved first: a full tmpfs is an error here,
    not a SIGBUS)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, max(nbytes, 1))
        with mmap.mmap(fd, max(nbytes, 1)) as mapped, memoryview(mapped) as view:
            done = 0
            while done < nbytes:
                with view[done:min(nbytes, done + _PIECE)] as part:  # released before the mapping closes
                    got = sock.recv_into(part)
                if not got:
                    raise ConnectionError("the peer closed the connection mid-copy")
                done += got
    finally:
        os.close(fd)


def _send_file(sock: socket.socket, path: Path, nbytes: int) -> None:
    with open(path, "rb") as f:
        sock.sendfile(f, 0, nbytes)


class ReplicaServer:
    """This rank's replicas of other ranks' snapshots: ``put`` (a source pushes one) and ``get`` (a rank fetches its
    own back); one lock per source rank, so a get never reads a replica being overwritten."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self.listener = socket.create_server(("", 0))
        self.port = self.listener.getsockname()[1]
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
            try:
                conn.settimeout(_TIMEOUT_S)
                head, blob = _receive(conn)
                if head.get("job") != self.store.job:
                    _send(conn, {"ok": False, "why": "another job"})
                elif head.get("op") == "put" and 0 <= int(head["slot"]) < _MAX_SLOTS:
                    self._put(conn, int(head["rank"]), int(head["slot"]), int(head["step"]), int(head["nbytes"]), blob)
                elif head.get("op") == "get":
                    self._get(conn, int(head["rank"]), int(head["step"]))
                elif head.get("op") == "get_cut":
                    self._get_cut(conn, int(head["rank"]), int(head["step"]), int(head["world"]), bool(head["data"]))
            except Exception as exc:  # noqa: BLE001 - one failed transfer; the source logs it, the next one may pass
                log.warning("peer tier: a transfer with %s failed: %s", _peer(conn), exc)

    def _put(self, conn: socket.socket, rank: int, index: int, step: int, nbytes: int, header: bytes) -> None:
        with self._locks[rank]:
            for held_step, other in self.held().get(rank, {}).items():
                if held_step >= step and other.name.startswith(headers.PEER):  # a future the job did not keep, or again
                    other.unlink(missing_ok=True)
            meta_path, data_path = self._paths(rank, index)
            meta_path.unlink(missing_ok=True)
            _receive_file(conn, data_path, nbytes)
            partial = meta_path.with_name(meta_path.name + ".partial")
            partial.write_bytes(header)
            os.replace(partial, meta_path)
        _send(conn, {"ok": True})

    def _get(self, conn: socket.socket, rank: int, step: int) -> None:
        with self._locks[rank]:
            meta_path = self.held().get(rank, {}).get(step)
            if meta_path is None:
                _send(conn, {"ok": False, "why": f"no replica of rank {rank}'s step {step} here"})
                return
            data_path = headers.data_path(meta_path)
            nbytes = data_path.stat().st_size
            _send(conn, {"ok": True, "nbytes": nbytes}, meta_path.read_bytes())
            _send_file(conn, data_path, nbytes)

    def _get_cut(self, conn: socket.socket, rank: int, step: int, world: int, data: bool) -> None:
        """A snapshot of another world size on this node (``reshard``): its header, and its file when ``data``."""
        held_world, sources = reshard.held_steps(self.store).get(step, (0, {}))
        source = sources.get(rank) if held_world == world else None
        if source is None:
            _send(conn, {"ok": False, "why": f"no snapshot of rank {rank}'s step {step} of {world} ranks here"})
            return
        nbytes = source.data.stat().st_size if data else 0
        _send(conn, {"ok": True, "nbytes": nbytes}, source.meta_path.read_bytes())
        if data:
            _send_file(conn, source.data, nbytes)

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


class Replicator:
    """This rank's part of the peer tier: it serves the replicas it holds, pushes its own newest snapshot to its
    holders, and fetches a replica of its own back at restore."""

    def __init__(self, store: SnapshotStore, setting: int | str) -> None:
        self.store, self.setting = store, setting
        self.server = ReplicaServer(store)
        self.addresses: list[tuple[str, int]] = []
        self.nodes: list[str] = []
        self.targets: list[int] = []
        """The ranks holding this rank's replicas (this attempt)."""
        self.count = 0
        self._failed: set[int] = set()
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

    def node_of(self, rank: int) -> str:
        return self.nodes[rank].split("/")[0] if rank < len(self.nodes) else "?"

    def holdings(self) -> dict[int, list[int]]:
        """Source rank -> the steps of its replicas this rank holds."""
        return {rank: sorted(steps) for rank, steps in self.server.held().items()}

    def push(self, slot: Slot, step: int) -> None:
        """In the publishing thread, once ``slot``'s header of ``step`` is in place: the slot's file and header to
        every holder. A holder that cannot be reached is warned about once per attempt."""
        began = time.perf_counter()
        for target in list(self.targets):
            try:
                with socket.create_connection(self.addresses[target], timeout=_TIMEOUT_S) as sock:
                    nbytes = slot.data_path.stat().st_size
                    _send(sock, {"op": "put", "job": self.store.job, "rank": self.store.rank, "slot": slot.index,
                                 "step": step, "nbytes": nbytes}, slot.meta_path.read_bytes())
                    _send_file(sock, slot.data_path, nbytes)
                    head, _ = _receive(sock)
                if not head.get("ok"):
                    raise ConnectionError(head.get("why", "refused"))
            except (OSError, ValueError) as exc:
                if target not in self._failed:
                    self._failed.add(target)
                    log.warning("peer tier: step %d not replicated to rank %d at %s:%d (%s); the next snapshot "
                                "tries again", step, target, *self.addresses[target], exc)
                continue
        self.pushed = {**dict(list(self.pushed.items())[-4:]), step: time.perf_counter() - began}

    def fetch(self, step: int, holder: int, pieces_fn: Callable[[], Any]) -> tuple[str, int]:
        """This rank's replica of ``step`` from ``holder`` into one of its own slots, found there as a node-local
        snapshot (guards checked; its checksum is checked when it is copied in). Returns ('' or why not, bytes)."""
        store = self.store
        slot = min(store.slots, key=lambda s: (s.locked, s.buffer is not None, s.step or -1))
        slot.published.wait()
        slot.release()
        slot.step = None
        slot.meta_path.unlink(missing_ok=True)
        store.dir.mkdir(parents=True, exist_ok=True)
        nbytes = 0
        try:
            with socket.create_connection(self.addresses[holder], timeout=_TIMEOUT_S) as sock:
                _send(sock, {"op": "get", "job": store.job, "rank": store.rank, "step": step})
                head, header = _receive(sock)
                if not head.get("ok"):
                    return f"rank {holder} has no replica of it ({head.get('why')})", 0
                nbytes = int(head["nbytes"])
                _receive_file(sock, slot.data_path, nbytes)
        except (OSError, ValueError) as exc:
            return f"fetching it from rank {holder} failed ({exc})", nbytes
        partial = slot.meta_path.with_name(slot.meta_path.name + ".partial")
        partial.write_bytes(header)
        os.replace(partial, slot.meta_path)
        if step not in store.discover(pieces_fn, only=slot):
            return f"the replica from rank {holder} was refused (see the warning above)", nbytes
        return "", nbytes

    def fetch_cut(self, holder: int, rank: int, step: int, world: int, data: bool) -> tuple[str, dict[str, Any], int]:
        """Old rank ``rank``'s snapshot of ``step`` (of ``world`` ranks) from ``holder``'s node (``reshard``): its
        header, and with ``data`` its file, fetched into this node's directory as ``headers.FETCHED``. Returns ('' or
        why not, the header, bytes). Its file is named for this rank too: the node's other ranks may fetch the same."""
        stem = self.store.dir / f"{headers.FETCHED}rank-{rank:05d}.slot-{self.store.rank}"
        try:
            with socket.create_connection(self.addresses[holder], timeout=_TIMEOUT_S) as sock:
                _send(sock, {"op": "get_cut", "job": self.store.job, "rank": rank, "step": step, "world": world,
                             "data": data})
                head, header = _receive(sock)
                if not head.get("ok"):
                    return f"rank {holder}'s node has no snapshot of it ({head.get('why')})", {}, 0
                meta = torch.load(io.BytesIO(header), map_location="cpu", weights_only=True)
                if data:
                    self.store.dir.mkdir(parents=True, exist_ok=True)
                    _receive_file(sock, stem.with_name(stem.name + ".data"), int(head["nbytes"]))
                    stem.with_name(stem.name + ".meta").write_bytes(header)
        except (OSError, ValueError, RuntimeError) as exc:
            return f"fetching rank {rank}'s snapshot of step {step} from rank {holder} failed ({exc})", {}, 0
        return "", meta, int(head["nbytes"])

    def close(self, remove: bool) -> None:
        self.server.close(remove)
