"""Run by test_gloo_release.py under torchrun (2 ranks): rank 1 fails and leaves the default gloo group (what
train() does after a fault) while rank 0 is blocked in an FSDP2 collective; rank 0 must fail at once, not at the
collective timeout, and the launcher's store must still work."""

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from trainer import parallel

done = Path(sys.argv[1])
env = parallel.DistEnv.from_environ()
parallel.init_process_group(torch.device("cpu"), env, timeout_s=120)


class Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


model = Blocks()
for layer in model.layers:
    fully_shard(layer)
fully_shard(model)
model(torch.randn(2, 64)).sum().backward()
dist.barrier()
if env.rank == 1:
    time.sleep(1.0)
    parallel.abort_process_group()
    # Stay alive (as an in-process restart does) until rank 0 is out: its release must not come from our exit.
    deadline = time.monotonic() + 300
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
else:
    started = time.monotonic()
    try:
        model(torch.randn(2, 64)).sum().backward()
        print("rank0: forward returned", flush=True)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        print(f"rank0: released after {time.monotonic() - started:.1f}s by {type(exc).__name__}: {exc}", flush=True)
    done.touch()
