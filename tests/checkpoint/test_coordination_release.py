"""A rank blocked in the checkpoint manager's gloo collective is released when its peer's attempt ends."""

import os
import signal
import subprocess

import pytest

from testlib import REPO, VENV_BIN

pytestmark = pytest.mark.multiprocess


def test_peer_unbind_releases_a_rank_blocked_in_coordination(tmp_path):
    """Without the release, rank 0 would wait for the 120 s coordination timeout while rank 1 stays alive (as an
    in-process restart does), and this run would hit its 100 s limit."""
    script = REPO / "tests" / "checkpoint" / "coordination_release.py"
    proc = subprocess.Popen(
        [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node=2", str(script), str(tmp_path / "ckpt")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        out, _ = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail("rank 0 stayed blocked in the coordination collective after rank 1 unbound:\n" + out[-3000:])
    line = next((l for l in out.splitlines() if l.startswith("rank0:")), "")
    assert "released" in line and "Timed out" not in line, out[-3000:]
