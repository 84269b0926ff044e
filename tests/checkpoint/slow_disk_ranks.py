"""Run by test_save_path.py under torchrun (2 ranks): rank 1's persistent writes stall 0.5 s each, rank 0's do not.
A memory checkpoint and a persist are due at every step. Both ranks must take every memory checkpoint, defer the
persists that fall due while rank 1 still writes, persist at the same steps and commit the final step together
(a rank deciding alone would enter a collective its peer never enters: a hang until the gloo timeout)."""

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from statelib import make_state, train_step  # noqa: E402
from trainer.checkpoint import FAULT_ENV, CheckpointManager, committed_steps  # noqa: E402
from trainer.config import CheckpointConfig  # noqa: E402
from trainer.parallel import DistEnv  # noqa: E402

STEPS = 24
"""At least this many steps; more while fewer than ``PERSISTS`` persists have started on every rank (a loaded machine
can keep the first write, whose writer process imports torch, busy for the whole 24 steps)."""
PERSISTS = 3
MAX_STEPS = 400

def main() -> None:
    root = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    if rank == 1:
        os.environ[FAULT_ENV] = "slow_write:0.5"
    cfg = CheckpointConfig(interval=1, persist_every=1, keep=20, node_local_dir=str(root / "node"))
    mgr = CheckpointManager(cfg, root / "ckpt", DistEnv.from_environ(), json.dumps({"test": True}),
                            coordination_timeout_s=20)
    mgr.bind()
    state = make_state()
    mgr.load_latest(state)
    taken, persisted = [], []
    start = mgr.persistent.start
    mgr.persistent.start = lambda slot, step: (persisted.append(step), start(slot, step))[1]
    step, last = 0, False
    while not last:
        step += 1
        train_step(state, step)
        time.sleep(0.15)
        # the ranks agree on the last step (each must pass the same last_step to save): both have seen enough persists
        enough = torch.tensor([int(step >= MAX_STEPS or (step >= STEPS and len(persisted) >= PERSISTS - 1))])
        dist.all_reduce(enough, op=dist.ReduceOp.MIN)
        last = bool(enough.item())
        if mgr.save(step, state, last_step=last):
            taken.append(step)
    dist.barrier()
    every = taken == list(range(1, step + 1))
    result = f"snapshots at every step 1..{step}" if every else f"snapshots {taken}"
    result += f"; persisted {persisted}; committed {committed_steps(root / 'ckpt')}"
    (root / f"rank{rank}.result").write_text(result)
    print(f"rank{rank}: {result}", flush=True)
    mgr.close(job_over=True)
    dist.destroy_process_group()


if __name__ == "__main__":  # the checkpoint writer is a spawned process: it imports this file
    main()
