"""The preemption agreement without a host sync per step: every rank stops on the same step, one step after the
signal reached the last rank (with one rank: the step it arrived in). Two gloo processes, no training."""

import multiprocessing
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainer.resiliency import Preemption

STEPS = 8


def _ranks(init_file: str, rank: int, signal_step: dict[int, int], out: "multiprocessing.Queue") -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        preemption = Preemption(grace_s=10.0)
        stopped = None
        for step in range(1, STEPS + 1):
            if signal_step.get(rank) == step:
                preemption.requested = True  # the SIGTERM handler ran during this step
            if preemption.agreed(torch.device("cpu"), 2):
                stopped = step
                break
        preemption.drain()
        out.put((rank, stopped))
    finally:
        dist.destroy_process_group()


def _run(tmp_path: Path, signal_step: dict[int, int]) -> dict[int, int | None]:
    tmp_path.mkdir(exist_ok=True)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_ranks, args=(str(tmp_path / "init"), r, signal_step, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)  # a rank that failed puts nothing: Empty
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return results


@pytest.mark.multiprocess
def test_every_rank_stops_one_step_after_the_last_signal(tmp_path):
    assert _run(tmp_path, {1: 3}) == {0: 4, 1: 4}  # one rank signalled: both stop
    assert _run(tmp_path / "b", {0: 2, 1: 5}) == {0: 3, 1: 3}  # the first signal decides
    assert _run(tmp_path / "c", {}) == {0: None, 1: None}


def test_one_rank_stops_in_the_step_the_signal_arrived():
    preemption = Preemption(grace_s=10.0)
    assert not preemption.agreed(torch.device("cpu"), 1)
    preemption.requested = True
    assert preemption.agreed(torch.device("cpu"), 1) and preemption.pending is None  # no collective, no tensor
