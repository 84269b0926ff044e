"""Which step every rank restores, and from which tier each rank reads it: the one concern of this module.

Each rank knows the snapshots it holds in memory (this process's slots, or the node-local ones a previous process on
this node published); rank 0 lists the persistent tier's committed steps. The step restored is the newest one
every rank can reach: in its own memory or node-local snapshot, else on disk. So after a node is lost and its
ranks come back on a replacement pod or a spare, the ranks on the other nodes restore from their node-local
snapshots where the step agrees, and only the new node's ranks read the persistent tier; when the newest step on
disk is newer than every snapshot, everyone reads the disk. A snapshot that fails its check is dropped by its rank,
and that rank reads the same step from disk if it is there; a checkpoint on disk that fails its check is moved
aside (``step-X.corrupt-<reason>``), and the next candidate is tried. Each rank logs where its state came from, and
rank 0 one line for the whole job.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.layout import committed_steps, step_dir_name
from trainer.checkpoint.state import apply, flatten, local_piece, local_tensors

log = logging.getLogger(__name__)

MEMORY, NODE_LOCAL, DISK = "memory", "node-local", "disk"


@dataclass
class Candidates:
    """What each rank holds in memory and what the disk holds, as the restore narrows them down."""

    held: list[set[int]]
    """Per rank: the steps of its verified snapshots (memory or node-local)."""
    disk: list[int]
    """Committed steps of the persistent tier, oldest first."""
    tried: list[str] = field(default_factory=list)
    """Checkpoints on disk that failed verification (moved aside)."""

    def newest(self) -> int | None:
        """The newest step every rank can reach, in its memory or on disk; None when there is none."""
        reachable = set(self.disk).union(*self.held)
        for step in sorted(reachable, reverse=True):
            if all(step in held or step in self.disk for held in self.held):
                return step
        return None

    def sources(self, step: int) -> list[bool]:
        """Per rank: whether it restores ``step`` from its own snapshot (else from disk)."""
        return [step in held for held in self.held]


def restore_newest(mgr: Any, state: dict[str, Any], while_copying: Callable[[], None]) -> int | None:
    """Restore the newest step every rank can reach (collective) with the parts of ``mgr`` (the ``CheckpointManager``:
    its snapshots, persistent tier and coordination group); returns the step, None when there is none. Sets
    ``mgr.restored_from`` to this rank's tier. Raises ``CheckpointError`` when checkpoints exist on disk, none
    verifies and no snapshot is left."""
    coord, snapshots = mgr.coord, mgr.snapshots
    in_process = any(s.buffer is not None for s in snapshots.slots)
    began = time.perf_counter()
    held = snapshots.discover(lambda: local_tensors(state)[1])
    discovered = time.perf_counter() - began
    found = Candidates([set(h) for h in coord.all_gather(held)],
                       coord.broadcast(committed_steps(mgr.dir) if mgr.rank == 0 else None) or [])
    while (step := found.newest()) is not None:
        sources = found.sources(step)
        mine = sources[mgr.rank]
        if mine:
            problem = _from_snapshot(mgr, state, step, while_copying)
        else:
            problem = mgr.persistent.read(state, step)
        problems = coord.all_gather(problem)
        if not any(problems):
            if mine:
                mgr.restored_from = MEMORY if in_process else NODE_LOCAL
                times = {"discover": discovered, **snapshots.restore_times}
                snapshots.restore_times = {}
                log.info("restored step %d from the %s tier (%s); %s", step, mgr.restored_from,
                         "in-process restart: no file read" if in_process else f"{snapshots.dir}: no checkpoint file read",
                         ", ".join(f"{k} {v:.2f} s" for k, v in times.items()))
            else:
                mgr.restored_from = DISK
            _summarise(mgr, step, coord.all_gather(mgr.restored_from))
            return step
        # FT: a bad snapshot is dropped by its rank (that rank reads the step from disk if it is there); a bad
        # checkpoint on disk is moved aside and the next candidate tried
        disk_problems = [p for source, p in zip(sources, problems) if p and not source]
        for rank, (source, problem) in enumerate(zip(sources, problems)):
            if problem and source:
                found.held[rank].discard(step)
                if rank == mgr.rank:
                    log.warning("node-local snapshot of step %d is unusable (%s); trying the next tier", step, problem)
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


def _from_snapshot(mgr: Any, state: dict[str, Any], step: int,
                   while_copying: Callable[[], None]) -> Any:
    """Copy this rank's snapshot of ``step`` in, verified while copied; '' when it verified, else why not."""
    slot = mgr.snapshots.slot_for(step)
    assert slot is not None
    live, _ = flatten(state)
    targets = {}
    for key, value in live.items():
        dst, piece = local_piece(value)
        if key not in slot.views or slot.pieces.get(key, piece) != piece:
            raise CheckpointError(f"snapshot has no matching {key}; the model changed")
        targets[key] = dst
    with torch.no_grad():  # FT: verified while copied in (on the GPU: page-locked in chunks, checked there)
        problem = mgr.snapshots.restore(step, targets, while_copying)
    if problem:
        return problem
    applying = time.perf_counter()
    apply(state, live, slot.payload)
    mgr.snapshots.restore_times["apply"] = time.perf_counter() - applying
    return ""


def _summarise(mgr: Any, step: int, tiers: list[str]) -> None:
    """Rank 0's line for the job when the ranks did not all restore from one tier: which ranks read what."""
    if mgr.rank != 0 or len(set(tiers)) == 1:
        return
    by_tier: dict[str, list[int]] = {}
    for rank, tier in enumerate(tiers):
        by_tier.setdefault(tier, []).append(rank)
    parts = [f"{tier} on ranks {_ranges(ranks)}" for tier, ranks in sorted(by_tier.items())]
    log.info("restored step %d: %s (the ranks without a snapshot of it read the persistent tier: a node that "
             "joined, or one that lost its memory)", step, "; ".join(parts))


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
