"""The checkpoint manager's own gloo group, one per attempt: every decision the ranks must take together (stage or
skip, persist, commit, which tier to restore from) goes through it, never through the training process group."""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

import torch
import torch.distributed as dist


class Coordination:
    """Small collectives on a gloo group of its own (on CPU too, so the tests exercise the GPU path): they never
    interleave with training collectives, and ``close()`` can end the group without touching the training one."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.group: Any = None
        self.rank, self.world_size = 0, 1

    def open(self) -> None:
        """Per attempt, after ``init_process_group`` (collective)."""
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))

    def close(self) -> None:
        """No collective: the process group may be broken. Closing this rank's sockets releases a peer blocked in
        one of the group's gloo collectives (they cannot be aborted) within a second instead of at the timeout."""
        group, self.group = self.group, None
        if group is not None:
            with contextlib.suppress(Exception):  # the process group may already be broken
                dist.destroy_process_group(group)

    def all_gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def all_reduce(self, values: list[float], op: Any) -> list[float]:
        """Element-wise ``op`` (``dist.ReduceOp.MAX``/``MIN``) over the ranks of a few float64 values."""
        if self.world_size == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=op, group=self.group)
        return tensor.tolist()
