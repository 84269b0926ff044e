"""Which step every rank restores, and from which tier each rank reads it: the one concern of this module.

Each rank knows the snapshots it holds in memory (this process's slots, or the node-local ones a previous process on
this node published) and the replicas it holds of other ranks' snapshots (the peer tier, ``replicas``); rank 0
lists the persistent tier's committed steps. The step restored is the newest one every rank can reach, and each rank
reads it from the nearest tier that holds it: its own slots, else a replica on another node, else the disk. So
after a node is lost and its ranks come back on a replacement pod or a spare, those ranks fetch their replicas from
the nodes holding them, the other ranks restore from their node-local snapshots, and no checkpoint file is read
(unless the disk holds a newer step than the replicas: a fault while the newest snapshot was being pushed); when a node and every holder of its replicas are lost, its ranks read the persistent
tier (one line each says so). After a change of world size (``min_nodes``), the snapshots of the old size are cut
into the new ranks' shards where some node holds all of them (``reshard``), before the disk is read for that step or an
older one. A snapshot or replica that fails its check is dropped by its rank, and that rank
tries the next tier for the same step (a replica, then the disk); a checkpoint on disk that fails its check is moved
aside (``step-X.corrupt-<reason>``), and the next candidate is tried. A step every rank gives up for another leaves
the other ranks' copies of it in the training state: the next step restored overwrites them, and when no step is
left the state is built afresh, so no rank trains from a step its peers did not restore. Each rank logs where its state came from and
how many bytes it read from each tier (``CheckpointManager.bytes_read``, in the ledger's restart record), and rank
0 one line for the whole job.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from trainer.checkpoint import reshard
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.layout import committed_steps, step_dir_name
from trainer.checkpoint.state import apply, flatten, local_piece, local_tensors

log = logging.getLogger(__name__)

MEMORY, NODE_LOCAL, PEER, DISK = "memory", "node-local", "peer", "disk"
OWN = "own"


@dataclass
class Candidates:
    """What each rank holds in memory, what its peers hold for it and what the disk holds, as the restore narrows
    them down."""

    held: list[set[int]]
    """Per rank: the steps of its verified snapshots (memory or node-local)."""
    disk: list[int]
    """Committed steps of the persistent tier, oldest first."""
    peer: list[dict[int, int]] = field(default_factory=list)
    """Per rank: step -> a rank (on another node) holding a replica of this rank's snapshot of it."""
    tried: list[str] = field(default_factory=list)
    """Checkpoints on disk that failed verification (moved aside)."""

    def newest(self) -> int | None:
        """The newest step every rank can reach: in its memory, a peer's replica, or on disk; None when there is
        none."""
        peer = self.peer or [{} for _ in self.held]
        reach = [held | set(replicas) | set(self.disk) for held, replicas in zip(self.held, peer)]
        common = set.intersection(*reach) if reach else set()
        return max(common) if common else None

    def sources(self, step: int) -> list[str]:
        """Per rank: where it reads ``step`` from: its own snapshot (``own``), a peer's replica, else the disk."""
        peer = self.peer or [{} for _ in self.held]
        return [OWN if step in held else PEER if step in replicas else DISK for held, replicas in zip(self.held, peer)]


def restore_newest(mgr: Any, state: dict[str, Any], while_copying: Callable[[], None]) -> int | None:
    """Restore the newest step every rank can reach (collective) with the parts of ``mgr`` (the ``CheckpointManager``:
    its snapshots, replicas, persistent tier and coordination group); returns the step, None when there is none.
    Sets ``mgr.restored_from`` to this rank's tier, counts ``mgr.bytes_read`` per tier and sets
    ``mgr.restore_overwrote`` when a step was copied into ``state`` and then given up (on every rank alike). Raises
    ``CheckpointError`` when checkpoints exist on disk, none verifies and no snapshot is left."""
    coord, snapshots = mgr.coord, mgr.snapshots
    mgr.restore_overwrote = False
    in_process = any(s.buffer is not None for s in snapshots.slots)
    began = time.perf_counter()
    held = snapshots.discover(lambda: _timed(snapshots.restore_times, "state dict", lambda: local_tensors(state)[1]))
    walked = snapshots.restore_times.get("state dict", 0.0)  # the discovery's own state-dict walk, counted apart
    discovered = time.perf_counter() - began - walked
    holding = mgr.replicas.holdings() if mgr.replicas is not None else {}
    reports = coord.all_gather((held, holding))
    peer: list[dict[int, int]] = [{} for _ in reports]
    for holder, (_, theirs) in enumerate(reports):
        for source, steps in theirs.items():
            if source < len(peer):  # a rank may hold its own (renumbered) replica: fetched over loopback
                peer[source].update({s: holder for s in steps if s not in peer[source]})
    found = Candidates([set(h) for h, _ in reports],
                       coord.broadcast(committed_steps(mgr.dir) if mgr.rank == 0 else None) or [], peer)
    replicated = bool(peer[mgr.rank])  # before any replica is refused
    # FT: a job that changed size: the steps of the old world size some node holds every old rank's snapshot of
    cut, local = reshard.candidates(mgr)  # collective on every rank, whatever its own process holds
    while (step := found.newest()) is not None or cut:
        if cut and (step is None or max(cut)[0] >= step):  # memory before the disk for the same step
            (newest, world), holder = max(cut.items())
            problem, sources = reshard.gather(mgr, state, newest, world, holder, local)
            problem = problem or reshard.restore(mgr, state, newest, world, sources)
            if not any(coord.all_gather(problem)):
                mgr.restored_from = NODE_LOCAL if newest in local else PEER
                _summarise(mgr, newest, coord.all_gather(mgr.restored_from))
                return newest
            mgr.restore_overwrote = True  # every rank gives the step up; a later one overwrites what was copied
            del cut[(newest, world)]
            if problem:
                log.warning("step %d of %d ranks cannot be cut out of the nodes' memory (%s); trying the next tier",
                            newest, world, problem)
            continue
        sources = found.sources(step)
        mine = sources[mgr.rank]
        agreed = time.perf_counter() - began - walked - discovered  # the tiers' listings, gathered, the step chosen
        if mine == OWN:
            problem = _from_snapshot(mgr, state, step, while_copying, MEMORY if in_process else NODE_LOCAL)
        elif mine == PEER:
            problem = _from_peer(mgr, state, step, found.peer[mgr.rank][step], while_copying)
        else:
            if mgr.replicas is not None and not found.held[mgr.rank]:  # a node new to the job
                left = sorted(found.peer[mgr.rank])
                log.warning("rank %d: no snapshot of step %d in this node's memory and no replica of it on a live "
                            "node (%s): reading the persistent tier", mgr.rank, step,
                            f"the replicas of this rank hold steps {left} only" if left else
                            "its replicas were refused above" if replicated else
                            "its node and every holder of its replicas lost")
            problem = mgr.persistent.read(state, step)
            mgr.bytes_read[DISK] = mgr.bytes_read.get(DISK, 0) + mgr.persistent.bytes_read
        problems = coord.all_gather(problem)
        if not any(problems):
            if mine == OWN:
                mgr.restored_from = MEMORY if in_process else NODE_LOCAL
                parts, snapshots.restore_times = snapshots.restore_times, {}
                times = {"checks": parts.pop("checks", 0.0), "discover": discovered, "agree": agreed, **parts}
                log.info("restored step %d from the %s tier (%s); %s", step, mgr.restored_from,
                         "in-process restart: no file read" if in_process else f"{snapshots.dir}: no checkpoint file read",
                         ", ".join(f"{k} {v:.2f} s" for k, v in times.items()))
            else:
                mgr.restored_from = mine
            _summarise(mgr, step, coord.all_gather(mgr.restored_from))
            return step
        # FT: a bad snapshot or replica is dropped by its rank (that rank tries the next tier for the step); a bad
        # checkpoint on disk is moved aside and the next candidate tried. Every rank copied something of this step
        # into the training state (the ranks whose copy verified, all of it): a later step restored overwrites it,
        # and when none is left the caller builds the state afresh (``CheckpointManager.load_latest``).
        mgr.restore_overwrote = True
        disk_problems = [p for source, p in zip(sources, problems) if p and source == DISK]
        for rank, (source, problem) in enumerate(zip(sources, problems)):
            if problem and source != DISK:
                (found.held[rank].discard if source == OWN else found.peer[rank].pop)(step)
                if rank == mgr.rank:
                    log.warning("%s of step %d is unusable (%s); trying the next tier",
                                "the peer tier's replica" if source == PEER else "the node-local snapshot", step, problem)
        if disk_problems:
            found.disk.remove(step)
            found.tried.append(f"{step_dir_name(step)} ({disk_problems[0][0][0]})")
            if mgr.rank == 0:
                mgr.persistent.quarantine(step, [p for per_rank in disk_problems for p in per_rank])
            coord.barrier()
    if found.tried:
        raise CheckpointError(
            f"no valid checkpoint in {mgr.dir}: {', '.join(found.tried)} failed verification and were moved aside "
            "as *.corrupt-*; restore a good checkpoint there, or set checkpoint.resume=false to start over"
        )
    return None


def _from_peer(mgr: Any, state: dict[str, Any], step: int, holder: int, while_copying: Callable[[], None]) -> Any:
    """Fetch this rank's replica of ``step`` from ``holder`` into one of its slots, then copy it in like a node-local
    snapshot (verified while copied); '' when it verified, else why not."""
    began = time.perf_counter()
    problem, nbytes = mgr.replicas.fetch(step, holder, lambda: local_tensors(state)[1])
    mgr.bytes_read[PEER] = mgr.bytes_read.get(PEER, 0) + nbytes
    fetched = time.perf_counter() - began
    problem = problem or _from_snapshot(mgr, state, step, while_copying, None)
    if not problem:
        log.info("restored step %d from the peer tier: the replica held by rank %d on node %s, %.1f MiB fetched in "
                 "%.2f s (%.0f MiB/s); no checkpoint file read", step, holder, mgr.replicas.node_of(holder),
                 nbytes / 2**20, fetched, nbytes / 2**20 / max(fetched, 1e-9))
    return problem


def _from_snapshot(mgr: Any, state: dict[str, Any], step: int, while_copying: Callable[[], None],
                   tier: str | None) -> Any:
    """Copy this rank's snapshot of ``step`` in, verified while copied; '' when it verified, else why not. Counts
    its bytes under ``tier`` (None: counted by the caller)."""
    slot = mgr.snapshots.slot_for(step)
    assert slot is not None
    if tier is not None and slot.buffer is not None:
        mgr.bytes_read[tier] = mgr.bytes_read.get(tier, 0) + slot.buffer.numel()
    live, _ = _timed(mgr.snapshots.restore_times, "state dict", lambda: flatten(state))
    targets = {}
    for key, value in live.items():
        dst, piece = local_piece(value)
        if key not in slot.views or slot.pieces.get(key, piece) != piece:
            raise CheckpointError(f"snapshot has no matching {key}; the model changed")
        targets[key] = dst
    with torch.no_grad():
        began = time.perf_counter()
        if tier == MEMORY and mgr.restore_on_device(slot, step, targets):  # the staging buffer still holds it
            mgr.snapshots.restore_times["device copy"] = time.perf_counter() - began
            while_copying()
            problem = ""
        else:  # FT: verified while copied in (on the GPU: page-locked in chunks, checked there)
            problem = mgr.snapshots.restore(step, targets, while_copying)
    if problem:
        return problem
    applying = time.perf_counter()
    apply(state, live, slot.payload)
    mgr.snapshots.restore_times["apply"] = time.perf_counter() - applying
    return ""


def _timed(times: dict[str, float], part: str, work: Callable[[], Any]) -> Any:
    """``work()``, its seconds added to ``times[part]`` (the restore line's parts). The state-dict walk is one: an
    optimizer without state gets it there (the state-dict API's zero step), the first time in a new process."""
    began = time.perf_counter()
    try:
        return work()
    finally:
        times[part] = times.get(part, 0.0) + time.perf_counter() - began


def _summarise(mgr: Any, step: int, tiers: list[str]) -> None:
    """Rank 0's line for the job when the ranks did not all restore from one tier: which ranks read what."""
    if mgr.rank != 0 or len(set(tiers)) == 1:
        return
    by_tier: dict[str, list[int]] = {}
    for rank, tier in enumerate(tiers):
        by_tier.setdefault(tier, []).append(rank)
    parts = [f"{tier} on ranks {_ranges(ranks)}" for tier, ranks in sorted(by_tier.items())]
    log.info("restored step %d: %s (a node that joined, or one that lost its memory, reads a peer's replica, else "
             "the persistent tier)", step, "; ".join(parts))


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
