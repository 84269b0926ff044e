"""Run by test_tiers.py under torchrun (2 ranks). Attempt 0 takes memory checkpoints at steps 4 and 8, but rank 1
dies while staging step 8, so only rank 0 keeps a node-local snapshot of it. Both workers are respawned (here: new
managers in the same processes) and resume from step 4, the newest step both hold. Rank 0's step-8 snapshot is
from a future the job did not keep: it must be forgotten, or rank 0 alone would take it for the next save of step 8
and skip the collective rank 1 enters (both then hang until a timeout)."""

import datetime
import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from statelib import assert_equal, make_state, snapshot, train_step  # noqa: E402
from trainer.checkpoint import CheckpointManager  # noqa: E402
from trainer.config import CheckpointConfig  # noqa: E402
from trainer.parallel import DistEnv  # noqa: E402

root = Path(sys.argv[1])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
rank = dist.get_rank()
cfg = CheckpointConfig(interval=4, keep=3, persist_every=0, node_local_dir=str(root / "node"))


def manager() -> CheckpointManager:
    mgr = CheckpointManager(cfg, root / "ckpt", DistEnv.from_environ(), json.dumps({"test": True}),
                            coordination_timeout_s=10)
    mgr.bind()
    return mgr


state, first = make_state(), manager()
for step in range(1, 9):
    train_step(state, step)
    first.save(step, state)
    if step == 4:
        at_step_4 = snapshot(state)
assert first.snapshots.held_steps() == [4, 8], first.snapshots.held_steps()
if rank == 1:  # died while staging step 8: its slot holds no snapshot
    first.snapshots.drop(first.snapshots.slot_for(8))
first.close()

state, second = make_state(seed=7), manager()
assert second.load_latest(state) == 4 and second.restored_from == "node-local"
assert_equal(snapshot(state), at_step_4)
held_after_restore = second.snapshots.held_steps()
started = time.monotonic()
try:
    for step in range(5, 9):
        train_step(state, step)
        assert second.save(step, state) == (step == 8)
    dist.barrier()
    outcome = f"saved step 8 on both ranks in {time.monotonic() - started:.1f} s"
except Exception as exc:  # noqa: BLE001 - the message is the result
    outcome = f"failed after {time.monotonic() - started:.1f} s: {type(exc).__name__}: {exc}"
held = second.snapshots.held_steps()
result = f"held after restore {held_after_restore}; {outcome}; held now {held}"
(root / f"rank{rank}.result").write_text(result)  # both ranks print at once: their lines can interleave
print(f"rank{rank}: {result}", flush=True)
second.close(job_over=True)
dist.destroy_process_group()
