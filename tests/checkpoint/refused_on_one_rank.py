"""Run by test_tiers.py under torchrun (2 ranks). Attempt 0 takes memory checkpoints at steps 1 and 2 (nothing
persisted). Both workers are respawned (here: new managers in the same processes) and rank 1's snapshots have a
flipped bit each: rank 0 copies step 2 in and it verifies, rank 1's copy fails its check, then the same for step 1.
No step is left that both can restore, so both must start over from a freshly built state; rank 0 must not go on
from the step it alone restored (three nodes once did: "ranks saved different steps" at the next persisted step)."""

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from statelib import make_state, snapshot, train_step  # noqa: E402
from trainer.checkpoint import CheckpointManager  # noqa: E402
from trainer.config import CheckpointConfig  # noqa: E402
from trainer.parallel import DistEnv  # noqa: E402

root = Path(sys.argv[1])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
rank = dist.get_rank()
cfg = CheckpointConfig(interval=1, keep=3, persist_every=0, node_local_dir=str(root / f"node{rank}"))


def manager() -> CheckpointManager:
    mgr = CheckpointManager(cfg, root / "ckpt", DistEnv.from_environ(), json.dumps({"test": True}),
                            coordination_timeout_s=10)
    mgr.bind()
    return mgr


state, first = make_state(), manager()
for step in (1, 2):
    train_step(state, step)
    first.save(step, state)
first.close()
if rank == 1:
    for meta in (root / "node1").rglob("*.meta"):
        data = meta.with_suffix(".data")
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 3] ^= 0x40
        data.write_bytes(bytes(raw))

state, second = make_state(seed=7), manager()
restored = second.load_latest(state, fresh=lambda: make_state(seed=7))
fresh = snapshot(make_state(seed=7))
now = snapshot(state)
same = now.keys() == fresh.keys() and all(torch.equal(now[k], fresh[k]) for k in fresh)
result = (f"restored {restored}; step {state['progress'].step}; position {state['dataloader'].position}; "
          f"state {'fresh' if same else 'not fresh'}; overwrote {second.restore_overwrote}")
second.close(job_over=True)
(root / f"rank{rank}.result").write_text(result)
