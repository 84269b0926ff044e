"""Host memory for the snapshot slots and the peer tier's replicas, checked at start: the one concern of this module.

A node's ranks each hold ``checkpoint.memory_slots`` slots of their own state and, for every rank whose replicas
they hold, a mirror of its slots (each rank holds for ``checkpoint.replicas`` ranks). All of
it lives in files of ``checkpoint.node_local_dir`` (a memory ``emptyDir``, whose pages count against the pod's memory
limit). The need is computed from the model before the first snapshot and compared with that directory's free
space and, where a cgroup memory limit is set, with what the limit leaves; the files this job already has there
(slots a previous process of the node published, replicas) count as available, since they are reused. A shortfall
is a ``ConfigError`` (exit 2) naming the settings to change, instead of a full ``/dev/shm`` mid-run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from trainer.config import ConfigError

_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))
_NO_LIMIT = 1 << 60


def cgroup_room(files: tuple[tuple[str, str], ...] = _CGROUP_FILES) -> int | None:
    """Bytes the pod's (container's) memory limit leaves: limit - usage; None without a limit."""
    for limit_file, usage_file in files:
        try:
            limit_text = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= _NO_LIMIT:
            return None
        return int(limit_text) - usage
    return None


def job_bytes(directory: Path) -> int:
    """Bytes of the files this job already has in its node-local directory (reused, so available)."""
    try:
        return sum(p.stat().st_size for p in directory.iterdir() if p.is_file() and p.suffix == ".data")
    except OSError:
        return 0


def check(directory: Path, slot_bytes: int, memory_slots: int, replica_slots: int, local_ranks: int,
          room: int | None = None) -> None:
    """Raise ``ConfigError`` when this node's ``local_ranks`` ranks cannot hold their slots and replicas: ``slot_bytes``
    per copy, ``memory_slots`` copies each and ``replica_slots`` replicas each. ``room``: the cgroup's (default:
    read)."""
    per_rank = (memory_slots + replica_slots) * slot_bytes
    need = local_ranks * per_rank
    probe = directory if directory.exists() else directory.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    reused = job_bytes(directory)
    free = shutil.disk_usage(probe).free + reused
    limits = [(free, f"{probe} has {free / 2**30:.2f} GiB free")]
    room = cgroup_room() if room is None else room
    if room is not None:
        limits.append((room + reused, f"the pod's memory limit leaves {(room + reused) / 2**30:.2f} GiB"))
    have, where = min(limits)
    if need > have:
        raise ConfigError(
            f"host memory for snapshots: this node needs {need / 2**30:.2f} GiB ({local_ranks} rank(s) x "
            f"({memory_slots} checkpoint.memory_slots + {replica_slots} peer replicas) x {slot_bytes / 2**30:.3f} GiB) "
            f"and {where}: enlarge the memory emptyDir's sizeLimit (docker --shm-size) and the pod's memory limit, "
            "or lower checkpoint.memory_slots or checkpoint.replicas, or point checkpoint.node_local_dir elsewhere"
        )
