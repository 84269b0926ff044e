"""A snapshot of another world size, cut out of this node's memory (``trainer/checkpoint/reshard.py``): a job that
went on with fewer nodes restores from its own slot files and the peer tier's replicas, not from the disk.

The old world's files are written here as two ranks would have published them (rank 0's own slot, rank 1's replica
held on this node), from a one-rank state split along dim 0 the way FSDP2 shards it; one process restores them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from statelib import assert_equal, make_state, manager, pg, snapshot, train_step  # noqa: F401 - pg
from trainer.checkpoint import committed_steps
from trainer.checkpoint.chunked import checksum
from trainer.checkpoint.layout import Piece, piece_record
from trainer.checkpoint.peerauth import file_digest
from trainer.checkpoint.slots import SNAPSHOT_FORMAT, SNAPSHOT_VERSION, map_views, plan_layout
from trainer.checkpoint.state import local_tensors


def publish_as(mgr, state: dict, step: int, world: int, names: dict[int, str]) -> None:
    """Write ``state`` as ``world`` ranks' snapshots of ``step`` into ``mgr``'s node directory: rank r's file named
    ``names[r]`` (``rank-00000`` for a slot, ``peer-rank-00001`` for a replica)."""
    tensors, pieces, extra = local_tensors(state)
    payload = {**extra, "rank_state": {"progress": state["progress"].state_dict(),
                                       "dataloader": state["dataloader"].state_dict()}}
    for rank in range(world):
        mine, slices = {}, {}
        for key, piece in pieces.items():
            full = tensors[key]
            if piece.sharded and full.ndim:
                rows = -(-full.shape[0] // world)  # torch's chunking: ceil, the last rank the rest
                lo, hi = min(rank * rows, full.shape[0]), min((rank + 1) * rows, full.shape[0])
                slices[key] = full[lo:hi]
                mine[key] = Piece(piece.global_shape, (lo, *piece.offset[1:]), tuple(slices[key].shape),
                                  piece.dtype, True)
            else:
                slices[key], mine[key] = full, piece
        layout, nbytes = plan_layout(mine)
        buffer = torch.zeros(nbytes, dtype=torch.uint8)
        for key, view in map_views(buffer, layout).items():
            view.copy_(slices[key])
        stem = f"{names[rank]}.slot-0"
        mgr.snapshots.dir.mkdir(parents=True, exist_ok=True)
        (mgr.snapshots.dir / f"{stem}.data").write_bytes(buffer.numpy().tobytes())
        torch.save({"format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION, "job": mgr.snapshots.job, "rank": rank,
                    "world_size": world, "config_hash": mgr.snapshots.config_hash, "step": step, "nbytes": nbytes,
                    "checksum": checksum(buffer), "layout": {k: [d, o, list(s)] for k, (d, o, s) in layout.items()},
                    "pieces": {k: piece_record(p) for k, p in mine.items()}, "payload": payload},
                   mgr.snapshots.dir / f"{stem}.meta")
        if names[rank].startswith("peer-"):  # a replica as its holder keeps it: with its source's seal
            digest = file_digest(mgr.snapshots.dir / f"{stem}.data", nbytes)
            seal = mgr.replicas.auth.seal(rank, step, nbytes, (mgr.snapshots.dir / f"{stem}.meta").read_bytes(), digest)
            (mgr.snapshots.dir / f"{stem}.seal").write_text(json.dumps({"digest": digest, "seal": seal}))


def test_a_two_rank_snapshot_on_this_node_restores_one_rank_without_the_disk(tmp_path: Path, pg, caplog):
    state = make_state()
    for step in (1, 2, 3):
        train_step(state, step)
    expected = snapshot(state)
    mgr = manager(tmp_path, persist_every=0)
    publish_as(mgr, state, 3, 2, {0: "rank-00000", 1: "peer-rank-00001"})
    try:
        restored = make_state(seed=8)
        with caplog.at_level(logging.INFO, logger="trainer.checkpoint"):
            assert mgr.load_latest(restored) == 3
        assert mgr.restored_from == "node-local" and committed_steps(mgr.dir) == []
        assert "cut out of the snapshots of 2 ranks (own 0, replica 1)" in caplog.text
        assert_equal(snapshot(restored), expected)
        assert restored["progress"].step == 3 and restored["dataloader"].position == 6
        assert mgr.bytes_read["node-local"] > 0
        # the old world's replica goes once the restore is over; the node's own slot files are reused
        assert not list(mgr.snapshots.dir.glob("peer-rank-*")) and list(mgr.snapshots.dir.glob("rank-00000.slot-0.*"))
    finally:
        mgr.close(job_over=True)


@pytest.mark.parametrize("spoil, why", [
    ("missing", None),  # rank 1's replica is not on this node: nothing to cut step 3 from, step 2 is restored
    ("flipped", "does not match its seal (altered on disk)"),  # its source's seal, checked before its checksum
])
def test_an_incomplete_or_corrupt_old_world_falls_back_to_the_other_tiers(tmp_path: Path, pg, caplog, spoil, why):
    state = make_state()
    mgr = manager(tmp_path)  # every snapshot persisted: the disk (and this rank's own slots) hold step 2
    for step in (1, 2):
        train_step(state, step)
        mgr.save(step, state)
    mgr.save(2, state, last_step=True)
    on_disk = snapshot(state)
    train_step(state, 3)
    mgr.close()
    respawned = manager(tmp_path)
    publish_as(respawned, state, 3, 2, {0: "rank-00000", 1: "peer-rank-00001"})
    replica = respawned.snapshots.dir / "peer-rank-00001.slot-0"
    if spoil == "missing":
        replica.with_name(replica.name + ".meta").unlink()
    else:
        data = replica.with_name(replica.name + ".data")
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
    try:
        restored = make_state(seed=8)
        with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
            assert respawned.load_latest(restored, fresh=lambda: make_state(seed=8)) == 2
        assert respawned.restored_from in ("node-local", "disk") and "cut out of the snapshots" not in caplog.text
        assert_equal(snapshot(restored), on_disk)
        if why:
            assert why in caplog.text and "cannot be cut out of the nodes' memory" in caplog.text
    finally:
        respawned.close(job_over=True)
