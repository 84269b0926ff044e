"""The default group's NCCL communicator: made at init with more than one rank, never with one (no collective runs
on it there, so the in-process restart's abort has nothing to tear down). No NCCL here: the arguments are checked."""

import pytest
import torch
import torch.distributed as dist

from trainer import parallel


@pytest.mark.parametrize("world_size,eager", [(1, False), (2, True), (8, True)])
def test_the_communicator_is_made_at_init_only_with_peers(monkeypatch, world_size, eager):
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    env = parallel.DistEnv(rank=0, world_size=world_size, local_rank=0, local_world_size=min(world_size, 8))
    device = torch.device("cuda", 0)
    parallel.init_process_group(device, env, timeout_s=30, store=dist.HashStore())
    (kwargs,) = calls
    assert kwargs["backend"] == "nccl" and kwargs["world_size"] == world_size
    assert ("device_id" in kwargs) == eager and kwargs.get("device_id", device) == device
