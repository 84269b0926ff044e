"""What the peer tier's authentication costs (``trainer/checkpoint/peerauth.py``): one rank's snapshot pushed to its
holder and fetched back (``Replicator.push``, ``Replicator.fetch``: real replica servers, two processes' worth of
sockets on 127.0.0.1 in one process, files in /dev/shm), with authentication on (every message signed and checked,
the bytes hashed while they travel, the seal checked on arrival and when fetched back) and off (the same protocol
with the MACs, digests and seals stubbed out), alternated run by run. One JSON line per run, then one per size and
mode with the median seconds and GB/s, and the overhead.

    PYTHONPATH=trainer_image .venv/bin/python bench/peer_auth.py [--mib 64,512] [--runs 7] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from trainer.checkpoint import peerauth, replicas
from trainer.checkpoint.chunked import checksum
from trainer.checkpoint.layout import Piece
from trainer.checkpoint.replicas import Replicator
from trainer.checkpoint.slots import SNAPSHOT_FORMAT, SNAPSHOT_VERSION, SnapshotStore

JOB = "bench-job"


class NoAuth(peerauth.PeerAuth):
    """Authentication off: nothing signed, nothing checked."""

    def sign(self, kind: str, head: dict[str, Any], blob: bytes = b"", re: str = "") -> dict[str, Any]:
        return {**head, "nonce": "-", "kind": kind, **({"re": re} if re else {})}

    def check(self, kind: str, head: dict[str, Any], blob: bytes = b"", re: str = "") -> str:
        return ""

    def fresh(self, head: dict[str, Any]) -> str:
        return ""

    def seal(self, rank: int, step: int, nbytes: int, header: bytes, digest: str) -> str:
        return ""

    def sealed(self, seal: Any, rank: int, step: int, nbytes: int, header: bytes, digest: str) -> bool:
        return True


class NoDigest:
    def add(self, view: memoryview) -> None:
        view.release()

    def hexdigest(self) -> str:
        return ""


@contextmanager
def mode(auth_on: bool) -> Iterator[None]:
    saved = peerauth.Digest, peerauth.file_digest
    if not auth_on:
        peerauth.Digest, peerauth.file_digest = NoDigest, lambda path, nbytes: ""  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        peerauth.Digest, peerauth.file_digest = saved  # type: ignore[misc]


def pair(base: Path, nbytes: int, auth_on: bool) -> tuple[Replicator, Replicator]:
    make = (lambda: peerauth.PeerAuth(b"x" * 48, JOB)) if auth_on else (lambda: NoAuth(b"x" * 48, JOB))
    out = []
    for rank in (0, 1):
        store = SnapshotStore(base / f"node{rank}", rank, 2, JOB, "{}", node_local=True)
        store.world_size = 2
        out.append(Replicator(store, 1, make()))
    for r in out:
        r.addresses = [("127.0.0.1", x.server.port) for x in out]
        r.server.limits = [nbytes, nbytes]
    out[0].targets = [1]
    return out[0], out[1]


def publish(store: SnapshotStore, nbytes: int, step: int) -> None:
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(step))
    slot = store.slots[0]
    store.dir.mkdir(parents=True, exist_ok=True)
    data.numpy().tofile(slot.data_path)
    torch.save({"format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION, "job": store.job, "rank": store.rank,
                "world_size": 2, "config_hash": store.config_hash, "step": step, "nbytes": nbytes,
                "checksum": checksum(data), "layout": {"x": ["uint8", 0, [nbytes]]}, "pieces": {}, "payload": {}},
               slot.meta_path)


def one(base: Path, nbytes: int, auth_on: bool, step: int) -> dict[str, Any]:
    with mode(auth_on):
        source, holder = pair(base, nbytes, auth_on)
        try:
            publish(source.store, nbytes, step)
            began = time.perf_counter()
            source.push(source.store.slots[0], step)
            pushed = time.perf_counter() - began
            assert (holder.store.dir / "peer-rank-00000.slot-0.meta").exists(), "the push failed"
            source.store.slots[0].release()
            for path in source.store.dir.iterdir():
                path.unlink()
            began = time.perf_counter()
            problem, got = source.fetch(step, 1, lambda: {"x": Piece((nbytes,), (0,), (nbytes,), torch.uint8, False)})
            fetched = time.perf_counter() - began
            assert problem == "" and got == nbytes, problem
        finally:
            source.close(remove=True)
            holder.close(remove=True)
            shutil.rmtree(base, ignore_errors=True)
    return {"mib": nbytes >> 20, "auth": auth_on, "push_s": round(pushed, 4), "fetch_s": round(fetched, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="64,512", help="snapshot sizes, MiB, comma-separated")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--dir", default="/dev/shm")
    args = parser.parse_args()
    os.environ.setdefault(replicas.ADDR_ENV, "127.0.0.1")
    print(json.dumps({"cpus": os.cpu_count(), "hash_threads": peerauth._THREADS, "piece_mib": peerauth.PIECE >> 20,
                      "torch": torch.__version__, "load_avg": os.getloadavg()}), flush=True)
    for mib in (int(m) for m in args.mib.split(",")):
        runs: list[dict[str, Any]] = []
        for i in range(args.runs):
            for auth_on in ((True, False) if i % 2 else (False, True)):  # alternated: drift hits both alike
                base = Path(tempfile.mkdtemp(prefix="peer-auth-bench.", dir=args.dir))
                runs.append(one(base, mib << 20, auth_on, step=2 * i + 2))
                print(json.dumps(runs[-1]), flush=True)
        summary = {}
        for auth_on in (False, True):
            mine = [r for r in runs if r["auth"] == auth_on]
            summary[auth_on] = {k: statistics.median(r[k] for r in mine) for k in ("push_s", "fetch_s")}
            print(json.dumps({"mib": mib, "auth": auth_on, "runs": len(mine),
                              **{f"median_{k}": round(v, 4) for k, v in summary[auth_on].items()},
                              **{f"{k[:-2]}_gbps": round((mib << 20) / v / 1e9, 2)
                                 for k, v in summary[auth_on].items()}}), flush=True)
        print(json.dumps({"mib": mib, "overhead_pct": {
            k: round(100 * (summary[True][k] / summary[False][k] - 1), 1) for k in ("push_s", "fetch_s")}}),
            flush=True)
    print(json.dumps({"load_avg": os.getloadavg()}), flush=True)  # the machine's other work meanwhile


if __name__ == "__main__":
    main()
