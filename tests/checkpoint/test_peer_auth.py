"""The peer tier's authentication (``trainer/checkpoint/peerauth.py``, ``replicas.py``) with real replica servers on
127.0.0.1 in one process: rank 0 pushes its snapshot to rank 1 and fetches it back; an outsider (``peerlib``), a
replayed request, a put larger than the source's slot, and bytes altered on the holder's disk or in flight get
nothing, write nothing, and are refused with one line naming the peer."""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path

import pytest
import torch

from peerlib import ATTACK_SLOT, OTHER_SECRET, assert_nothing_got, attack
from trainer.checkpoint import peerauth, replicas
from trainer.checkpoint.chunked import checksum
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.layout import Piece
from trainer.checkpoint.peerauth import SECRET_FILE_ENV, PeerAuth, load_secret
from trainer.checkpoint.replicas import Replicator
from trainer.checkpoint.slots import SNAPSHOT_FORMAT, SNAPSHOT_VERSION, SnapshotStore

JOB = "the-job-key"
SECRET = b"this job's secret: 32 bytes or more"
N = 1 << 16
STEP = 4


def publish(store: SnapshotStore, step: int) -> torch.Tensor:
    """A snapshot of ``step`` in ``store``'s slot 0, written as ``SnapshotStore._publish`` writes one."""
    data = torch.randint(0, 256, (N,), dtype=torch.uint8, generator=torch.Generator().manual_seed(step))
    slot = store.slots[0]
    store.dir.mkdir(parents=True, exist_ok=True)
    slot.data_path.write_bytes(data.numpy().tobytes())
    torch.save({"format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION, "job": store.job, "rank": store.rank,
                "world_size": 2, "config_hash": store.config_hash, "step": step, "nbytes": N,
                "checksum": checksum(data), "layout": {"x": ["uint8", 0, [N]]}, "pieces": {}, "payload": {}},
               slot.meta_path)
    return data


def pieces() -> dict[str, Piece]:
    return {"x": Piece((N,), (0,), (N,), torch.uint8, False)}


@pytest.fixture
def ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Rank 0 (the source) and rank 1 (its holder), on "nodes" of their own, serving on 127.0.0.1."""
    monkeypatch.setenv(replicas.ADDR_ENV, "127.0.0.1")
    pair = []
    for rank in (0, 1):
        store = SnapshotStore(tmp_path / f"node{rank}", rank, 2, JOB, "{}", node_local=True)
        store.world_size = 2
        pair.append(Replicator(store, 1, PeerAuth(SECRET, JOB)))
    for replicator in pair:
        replicator.addresses = [("127.0.0.1", r.server.port) for r in pair]
        replicator.server.limits = [N, N]
    pair[0].targets = [1]
    yield pair
    for replicator in pair:
        replicator.close(remove=True)


def replica(holder: Replicator) -> list[str]:
    return sorted(p.name for p in holder.store.dir.glob("peer-rank-*"))


@pytest.mark.parametrize("piece", [None, 5000])
def test_a_replica_is_pushed_sealed_and_fetched_back_bit_equal(ranks, piece, monkeypatch):
    """Hashed as one piece, and in pieces of 5000 bytes (the last one shorter) as they arrive."""
    if piece:
        monkeypatch.setattr(peerauth, "PIECE", piece)
    source, holder = ranks
    data = publish(source.store, STEP)
    source.push(source.store.slots[0], STEP)
    assert replica(holder) == ["peer-rank-00000.slot-0.data", "peer-rank-00000.slot-0.meta",
                               "peer-rank-00000.slot-0.seal"]
    for path in source.store.dir.iterdir():  # the node is lost with its memory
        path.unlink()
    assert source.fetch(STEP, 1, pieces) == ("", N)
    assert source.store.slots[0].data_path.read_bytes() == data.numpy().tobytes()
    assert source.store.restore(STEP, {"x": torch.empty(N, dtype=torch.uint8)}) == ""  # its checksum too


def test_an_outsider_gets_nothing_and_writes_nothing(ranks, caplog):
    """Unsigned, or signed with another job's secret under this job's key: a fetch, a put, a put of 1 TiB."""
    source, holder = ranks
    publish(source.store, STEP)
    source.push(source.store.slots[0], STEP)
    before = {p.name: p.read_bytes() for p in holder.store.dir.iterdir()}
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint.replicas"):
        got = attack(("127.0.0.1", holder.server.port), JOB, source="127.0.0.9")
    assert_nothing_got(got)
    assert {p.name: p.read_bytes() for p in holder.store.dir.iterdir()} == before  # nothing written or reserved
    assert not list(holder.store.dir.glob(f"*.slot-{ATTACK_SLOT}.*"))
    refused = [r.getMessage() for r in caplog.records if "refused a request from 127.0.0.9:" in r.getMessage()]
    assert len(refused) == len(got) == 46, caplog.text  # one line each, naming the peer
    assert any("no valid MAC" in line for line in refused) and any("not signed" in line for line in refused)


def test_a_replayed_request_is_refused(ranks, caplog):
    source, holder = ranks
    publish(source.store, STEP)
    source.push(source.store.slots[0], STEP)
    request = source.auth.sign("request", {"op": "get", "rank": 0, "step": STEP, "to": 1})
    answers = []
    for port in (holder.server.port, holder.server.port, source.server.port):
        # the rank's own fetch; someone who recorded it sends it again, and to another rank's server
        with socket.create_connection(("127.0.0.1", port)) as sock:
            replicas._send(sock, request)
            head, blob = replicas._receive(sock)
            answers.append((head.get("ok"), len(blob) > 0))
    assert answers == [(True, True), (False, False), (False, False)]
    assert "its nonce was used before (a replay)" in caplog.text and "addressed to rank 1, not this one" in caplog.text


def test_a_put_larger_than_the_sources_slot_is_refused_before_a_byte_is_reserved(ranks, caplog):
    """Signed by a rank of the job, but larger than that rank's slot (from its layout): refused before fallocate."""
    source, holder = ranks
    publish(source.store, STEP)
    holder.server.limits = [N // 2, N]
    source.push(source.store.slots[0], STEP)
    assert not holder.store.dir.exists() or replica(holder) == []
    assert f"{N} bytes, more than rank 0's snapshot slot ({N // 2} bytes" in caplog.text
    assert "step 4 not replicated to rank 1" in caplog.text  # the source's one line


def flip(path: Path, sum_preserving: bool = False) -> None:
    """Alter the file: one byte flipped; or two 64-bit words moved by +1 and -1, which the snapshot's checksum (a
    wrapping sum of its words) does not see."""
    words = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.int64)
    if sum_preserving:
        words[1] += 1
        words[2] -= 1
    else:
        words.view(torch.uint8)[len(words) * 4] ^= 0xFF
    path.write_bytes(words.numpy().tobytes())


@pytest.mark.parametrize("sum_preserving", [False, True])
def test_a_replica_altered_on_the_holders_disk_is_refused_when_fetched(ranks, sum_preserving):
    source, holder = ranks
    publish(source.store, STEP)
    source.push(source.store.slots[0], STEP)
    data = holder.store.dir / "peer-rank-00000.slot-0.data"
    before = checksum(torch.frombuffer(bytearray(data.read_bytes()), dtype=torch.uint8))
    flip(data, sum_preserving)
    assert (checksum(torch.frombuffer(bytearray(data.read_bytes()), dtype=torch.uint8)) == before) == sum_preserving
    problem, _ = source.fetch(STEP, 1, pieces)
    assert "does not match its seal: altered on disk or in flight" in problem
    assert not source.store.slots[0].meta_path.exists()  # not a snapshot of this rank's


class Tamperer:
    """A TCP relay on 127.0.0.1 that flips one byte of what it relays from the client to the server (``upstream``)
    or back (``downstream``), past the first ``skip`` bytes: an attacker on the path."""

    def __init__(self, target: tuple[str, int], downstream: bool, skip: int) -> None:
        self.target, self.downstream, self.skip = target, downstream, skip
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self.target)
        threading.Thread(target=self._pump, args=(client, server, not self.downstream), daemon=True).start()
        self._pump(server, client, self.downstream)

    def _pump(self, src: socket.socket, dst: socket.socket, alter: bool) -> None:
        seen = 0
        while chunk := src.recv(1 << 16):
            if alter and seen <= self.skip < seen + len(chunk):
                chunk = bytearray(chunk)
                chunk[self.skip - seen] ^= 0x01
                chunk = bytes(chunk)
            seen += len(chunk)
            dst.sendall(chunk)
        dst.shutdown(socket.SHUT_WR)


def test_a_replica_altered_in_flight_is_refused_by_the_holder_and_by_the_fetching_rank(ranks, caplog):
    source, holder = ranks
    publish(source.store, STEP)
    header = source.store.slots[0].meta_path.stat().st_size
    relay = Tamperer(("127.0.0.1", holder.server.port), downstream=False, skip=header + 4096 + N // 2)
    source.addresses[1] = relay.address
    source.push(source.store.slots[0], STEP)
    assert replica(holder) == [] and "do not match its seal (altered in flight?): not kept" in caplog.text
    source.addresses[1] = ("127.0.0.1", holder.server.port)
    source.push(source.store.slots[0], STEP)  # the next snapshot's push gets through
    assert len(replica(holder)) == 3
    relay = Tamperer(("127.0.0.1", holder.server.port), downstream=True, skip=header + 4096 + N // 2)
    source.addresses[1] = relay.address
    problem, _ = source.fetch(STEP, 1, pieces)
    assert "does not match its seal" in problem


def test_the_secret_is_read_from_the_named_file_or_made_beside_the_checkpoints(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    made = load_secret(checkpoints)
    shared = tmp_path / "run" / "checkpoints.peer-secret"
    assert shared.stat().st_mode & 0o777 == 0o600 and load_secret(checkpoints) == made  # every rank reads the one
    shared.chmod(0o644)
    with pytest.raises(CheckpointError, match="may be read by others .* chmod 600 it"):
        load_secret(checkpoints)
    named = tmp_path / "mounted"
    named.write_bytes(SECRET + b"\n")
    monkeypatch.setenv(SECRET_FILE_ENV, str(named))
    assert load_secret(checkpoints) == SECRET
    named.write_bytes(b"short")
    with pytest.raises(CheckpointError, match="holds 5 bytes; it needs at least 32"):
        load_secret(checkpoints)
    monkeypatch.setenv(SECRET_FILE_ENV, str(tmp_path / "absent"))
    with pytest.raises(CheckpointError, match="cannot be read .*: mount the job's Secret there"):
        load_secret(checkpoints)


def test_keys_differ_between_jobs_and_secrets():
    head = {"op": "get", "rank": 0, "step": 1}
    signed = PeerAuth(SECRET, JOB).sign("request", head)
    assert PeerAuth(SECRET, JOB).check("request", signed) == ""
    assert PeerAuth(SECRET, "another-job").check("request", signed) == "no valid MAC of this job's secret"
    assert PeerAuth(OTHER_SECRET, JOB).check("request", signed) == "no valid MAC of this job's secret"
    assert PeerAuth(SECRET, JOB).check("reply", signed) == "no valid MAC of this job's secret"  # reflected
    assert PeerAuth(SECRET, JOB).check("request", {**signed, "step": 2}) == "no valid MAC of this job's secret"
