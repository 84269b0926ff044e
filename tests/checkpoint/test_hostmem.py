"""Host memory for the snapshot slots and the peer tier's replicas is checked at start (``checkpoint.hostmem``): a
shortfall is one line naming the settings to change, exit 2, before any slot is allocated."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from testlib import REPO
from trainer.checkpoint import hostmem
from trainer.config import ConfigError
from trainer.exitcodes import ExitCode


def test_the_memory_limit_counts_and_the_jobs_own_files_are_reused(tmp_path):
    node = tmp_path / "job"
    node.mkdir()
    hostmem.check(node, 100 << 20, memory_slots=2, replica_slots=2, local_ranks=2, room=1 << 40)
    with pytest.raises(ConfigError, match="the pod's memory limit leaves 0.39 GiB"):
        hostmem.check(node, 100 << 20, memory_slots=2, replica_slots=2, local_ranks=2, room=400 << 20)
    (node / "rank-00000.slot-0.data").write_bytes(b"\0" * (400 << 20))  # a published slot: reused, so available
    hostmem.check(node, 100 << 20, memory_slots=2, replica_slots=2, local_ranks=2, room=400 << 20)


def test_the_cgroup_limit_is_read_v2_and_v1(tmp_path):
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    usage.write_text("1000\n")
    limit.write_text("max\n")
    assert hostmem.cgroup_room(((str(limit), str(usage)),)) is None
    limit.write_text("5000\n")
    assert hostmem.cgroup_room(((str(limit), str(usage)),)) == 4000
    assert hostmem.cgroup_room(((str(tmp_path / "absent"), str(usage)),)) is None


def test_a_trainer_whose_slots_do_not_fit_exits_2_with_one_line(tmp_path, tiny_dataset):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "--config", "tiny", f"--data.path={tiny_dataset}",
         f"--train.run_dir={tmp_path / 'run'}", f"--checkpoint.node_local_dir={tmp_path / 'node'}",
         "--checkpoint.memory_slots=20000"],  # 20,000 copies of a 48 MB state: about 1 TB
        capture_output=True, text=True, timeout=240, env={**env, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert result.returncode == ExitCode.CONFIG_ERROR, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "config error:" in line]
    assert len(lines) == 1 and "host memory for snapshots: this node needs" in lines[0], result.stderr[-3000:]
    assert "checkpoint.memory_slots" in lines[0] and "checkpoint.replicas" in lines[0]
    assert not list((tmp_path / "node").rglob("*.data")), "a slot was allocated before the check"
