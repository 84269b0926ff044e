"""Checkpoints in three tiers: memory, node-local (``/dev/shm``) and persistent (``checkpoint.dir``).

Modules mirror the design (``CHECKPOINTS.md`` describes the layout and the choices):

- ``layout``: the persistent tier's on-disk format, verification, reading on any world size (no process group);
- ``state``: the training state as flat local tensors plus per-rank state;
- ``slots``: snapshot slots in named shared memory: the memory and node-local tiers;
- ``staging``: how a snapshot's tensors get into its slot (CPU copy, direct device-to-host, device staging);
- ``premap``: a warm standby's mapping and page-locking of the slots ahead of the in-job restart it may serve;
- ``reaper``: what the job leaves in node memory, and its removal when no process needs it any more;
- ``writer``: the background writer of the persistent tier (NVRx ``AsyncCallsQueue``);
- ``persistent``: the persistent tier: a write in flight, its commit, retention, and loading from disk;
- ``coordination``: the manager's own gloo group, through which the ranks agree on every decision;
- ``storage``: start-up checks of ``checkpoint.dir``, free space, retention before a save;
- ``policy``: when a memory checkpoint is due (fixed, or Young/Daly), and which ones are persisted;
- ``manager``: ``CheckpointManager``, which composes them.

Only this package and ``trainer.resiliency`` import NVRx.

``CheckpointManager`` is imported on first use (``__getattr__``): each rank's checkpoint writer process imports
this package to reach ``writer``, and the manager's imports (``torch.distributed.checkpoint``, DTensor) are about
half of that process's start-up, none of which it uses.
"""

from typing import TYPE_CHECKING

from trainer.checkpoint.errors import CheckpointError, CheckpointStorageError, is_disk_full
from trainer.checkpoint.layout import (
    MANIFEST, ShardUnreadable, committed_steps, copy_overlap, find_valid_checkpoint, load_model_weights,
    step_dir_name,
)
from trainer.checkpoint.writer import FAULT_ENV

if TYPE_CHECKING:
    from trainer.checkpoint.manager import CheckpointManager

__all__ = [
    "FAULT_ENV", "MANIFEST", "CheckpointError", "CheckpointManager", "CheckpointStorageError", "ShardUnreadable",
    "committed_steps", "copy_overlap", "find_valid_checkpoint", "is_disk_full", "load_model_weights", "step_dir_name",
]


def __getattr__(name: str):
    if name == "CheckpointManager":
        from trainer.checkpoint.manager import CheckpointManager

        globals()[name] = CheckpointManager
        return CheckpointManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
