"""A snapshot of another world size, restored from this node's memory: the one concern of this module.

When a job goes on with fewer nodes (``min_nodes``: a node lost and none took its place), the survivors' node-local
directories still hold the snapshots their ranks published under the old world size, and the peer tier's replicas of
the lost node's ranks (``replicas``). Where every old rank's snapshot of a step is on this node, each new rank cuts
its own shard of every tensor out of them (the region its piece covers, from each old piece that overlaps it: the
same arithmetic as a checkpoint on disk read on another world size) instead of reading the persistent tier. Every
file read is checked against its header's checksum first (a replica against its source's seal too: ``peerauth``); a
step some rank cannot restore this way is left to the other tiers. When the job grows back, a node that joined (its
memory empty) fetches the old ranks' snapshots its ranks' shards overlap from the replica server of a node that
holds them all (``Replicator.fetch_cut``: each checked against its seal as it arrives).

Headers carry each tensor's piece (global shape, offset, local shape) from when they are published; a header
without them (an older trainer) is not used here.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from trainer.checkpoint import headers
from trainer.checkpoint.chunked import checksum
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.headers import FETCHED, PEER, Header
from trainer.checkpoint.layout import copy_overlap, overlaps
from trainer.checkpoint.slots import map_file, map_views
from trainer.checkpoint.state import apply, flatten, local_piece

log = logging.getLogger(__name__)


def held_steps(store: Any) -> dict[int, tuple[int, dict[int, Header]]]:
    """Step -> (old world size, {old rank: its snapshot}) for each step of another world size whose every rank's
    snapshot is in this node's directory (this job and configuration, file sizes as their headers say)."""
    found: dict[tuple[int, int], dict[int, Header]] = {}
    for header in headers.scan(store) if store.node_local else []:
        world = header.meta.get("world_size")
        if "pieces" in header.meta and world != store.world_size:
            found.setdefault((int(header.meta["step"]), int(world)), {})[header.rank] = header
    return {step: (world, sources) for (step, world), sources in sorted(found.items())
            if set(sources) == set(range(world))}


def drop_other_worlds(store: Any) -> int:
    """Remove the replicas and fetched copies of another world size from this node's directory once the restore is
    over on every rank (nothing reads them then: the next change of size reshards this size's snapshots); returns
    how many files went. The node's own slot files are reused by the new ranks' slots."""
    gone = [h for h in headers.scan(store) if h.kind and h.meta.get("world_size") != store.world_size]
    for header in gone:
        header.meta_path.unlink(missing_ok=True)
        header.data.unlink(missing_ok=True)
        headers.seal_path(header.meta_path).unlink(missing_ok=True)
    return len(gone)


def candidates(mgr: Any) -> tuple[dict[tuple[int, int], int], dict[int, tuple[int, dict[int, Header]]]]:
    """(step, old world size) -> a rank whose node holds every old rank's snapshot of it, over the job (collective);
    and this node's own such steps (`held_steps`)."""
    local = held_steps(mgr.snapshots)
    out: dict[tuple[int, int], int] = {}
    for rank, pairs in enumerate(mgr.coord.all_gather(sorted((s, w) for s, (w, _) in local.items()))):
        for pair in pairs:
            out.setdefault((int(pair[0]), int(pair[1])), rank)
    return out, local


def gather(mgr: Any, state: dict[str, Any], step: int, world: int, holder: int,
           local: dict[int, tuple[int, dict[int, Header]]]) -> tuple[str, dict[int, Header]]:
    """This rank's sources of ``step`` (of ``world`` ranks): its node's own, else the old ranks' snapshots its shard
    overlaps (and old rank 0's, for the non-tensor state), fetched from ``holder``'s node. ('' or why not, sources.)"""
    if step in local and local[step][0] == world:
        return "", local[step][1]
    if mgr.replicas is None:
        return "this node holds none of it and the peer tier is off (checkpoint.replicas=0)", {}
    pieces = {key: local_piece(v)[1] for key, v in flatten(state)[0].items()}
    sources: dict[int, Header] = {}
    for rank in range(world):
        problem, meta, _ = mgr.replicas.fetch_cut(holder, rank, step, world, data=False)
        if problem:
            return problem, {}
        theirs = meta.get("pieces", {})
        if rank and not any(p.sharded and p.shape and key in theirs and
                            overlaps(p.offset, p.shape, tuple(theirs[key][1]), tuple(theirs[key][2]))
                            for key, p in pieces.items()):
            continue  # none of this rank's shard is in it
        problem, meta, nbytes = mgr.replicas.fetch_cut(holder, rank, step, world, data=True)
        if problem:
            return problem, {}
        mgr.bytes_read["peer"] = mgr.bytes_read.get("peer", 0) + nbytes
        stem = mgr.snapshots.dir / f"{FETCHED}rank-{rank:05d}.slot-{mgr.rank}"
        sources[rank] = Header(FETCHED, rank, meta, stem.with_name(stem.name + ".meta"), stem.with_name(stem.name + ".data"))
    return "", sources


def restore(mgr: Any, state: dict[str, Any], step: int, world: int, sources: dict[int, Header]) -> str:
    """Fill this rank's shard of ``state`` with ``step`` cut out of the old ranks' snapshots ``sources``; '' when
    every file verified and every tensor was covered, else why not. Counts the bytes read as the node-local tier's."""
    live, _ = flatten(state)
    wanted = {key: local_piece(value) for key, value in live.items()}
    views: dict[int, dict[str, torch.Tensor]] = {}  # old rank -> its file's tensors, mapped once and verified
    nbytes = 0
    try:
        for key, (dst, piece) in wanted.items():
            covered, seen = 0, set()
            for rank in sorted(sources):
                record = sources[rank].meta["pieces"].get(key)
                if record is None or tuple(record[0]) != piece.global_shape:
                    return f"rank {rank}'s snapshot of step {step} has no {key} of this shape: the model changed"
                region = (tuple(record[1]), tuple(record[2]))
                if region in seen or not overlaps(piece.offset, piece.shape, *region):
                    continue  # a replicated tensor is read once
                seen.add(region)
                if rank not in views:
                    if sources[rank].kind == PEER and mgr.replicas is not None:  # FT: its source's seal, again
                        problem = mgr.replicas.check_held(sources[rank])
                        if problem:
                            return problem
                    buffer = map_file(sources[rank].data, int(sources[rank].meta["nbytes"]))
                    if checksum(buffer) != sources[rank].meta["checksum"]:
                        return f"checksum mismatch in {sources[rank].data} (flipped or stale bytes)"
                    layout = {k: (d, o, tuple(shape)) for k, (d, o, shape) in sources[rank].meta["layout"].items()}
                    views[rank], nbytes = map_views(buffer, layout), nbytes + buffer.numel()
                covered += copy_overlap(dst, piece.offset, views[rank][key], *region)
            if covered != dst.numel():
                return f"the snapshots of step {step} cover {covered} of {dst.numel()} elements of {key}"
        mgr.bytes_read["node-local"] = mgr.bytes_read.get("node-local", 0) + nbytes
        source = sources[mgr.rank if mgr.rank in sources else 0]
        apply(state, live, source.meta["payload"], restore_ft=source.rank == mgr.rank)
    except CheckpointError as exc:
        return str(exc)
    finally:
        views.clear()  # the mappings go with their tensors
        for fetched in (s for s in sources.values() if s.kind == FETCHED):  # node memory back at once
            fetched.data.unlink(missing_ok=True)
            fetched.meta_path.unlink(missing_ok=True)
    log.info("restored step %d from the nodes' memory: cut out of the snapshots of %d ranks (%s), no file read from "
             "the persistent tier", step, world, ", ".join(
                 f"{_KIND[s.kind]} {r}" for r, s in sorted(sources.items())))
    return ""


_KIND = {"": "own", PEER: "replica", FETCHED: "fetched"}
