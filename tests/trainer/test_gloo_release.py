"""A rank blocked in an FSDP2 gloo collective is released at once when its failed peer leaves the group."""

import os
import signal
import subprocess

import pytest

from testlib import REPO, VENV_BIN

pytestmark = pytest.mark.multiprocess


def test_peer_abort_releases_a_rank_blocked_in_an_fsdp_collective(tmp_path):
    """Without shutting the group's connections, rank 0 waits for the 120 s collective timeout while rank 1 stays
    alive (as an in-process restart does): measured with destroy_process_group and _abort_process_group alone."""
    script = REPO / "tests" / "trainer" / "gloo_release.py"
    proc = subprocess.Popen(
        [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node=2", str(script), str(tmp_path / "done")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO / 'trainer_image'}"},
    )
    try:
        out, _ = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail("rank 0 stayed blocked in the FSDP collective after rank 1 left the group:\n" + out[-3000:])
    line = next((l for l in out.splitlines() if l.startswith("rank0:")), "")
    assert "released" in line and "Connection closed by peer" in line, out[-3000:]
    assert proc.returncode == 0, out[-3000:]
