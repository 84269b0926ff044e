"""Run by test_coordination_release.py under torchrun (2 ranks): rank 1 leaves an attempt (unbind) while rank 0
waits in one of the manager's gloo collectives; rank 0 must fail at once, not at the coordination timeout."""

import datetime
import sys
import time
from pathlib import Path

import torch.distributed as dist

from trainer.checkpoint import CheckpointManager
from trainer.config import CheckpointConfig
from trainer.parallel import DistEnv

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
manager = CheckpointManager(CheckpointConfig(node_local_dir=str(Path(sys.argv[1]) / "node")), sys.argv[1],
                            DistEnv.from_environ(), "{}", coordination_timeout_s=120)
manager.bind()
released = Path(sys.argv[1]) / "rank0-released"
if dist.get_rank() == 1:
    time.sleep(1.0)
    manager.unbind()  # what train()'s finally does after a fault
    # Stay alive (as an in-process restart does) until rank 0 is out: its release must not come from our exit.
    deadline = time.monotonic() + 300  # beyond the test's own 100 s limit
    while not released.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    print("rank1 done", flush=True)
else:
    started = time.monotonic()
    try:
        manager._barrier()  # stands for any collective of the commit protocol
        print("rank0: barrier returned", flush=True)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        print(f"rank0: released after {time.monotonic() - started:.1f}s by {type(exc).__name__}: {exc}", flush=True)
    released.touch()
manager.close()
