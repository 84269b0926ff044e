"""Launches that end without recovering, through the same launchers as ``test_recovery``: a spent restart budget
exits retryable, a bad config permanent, an unhealthy node 201. They count no recoveries and measure no timing, so
unlike ``test_recovery`` they run two at a time with the other multiprocess tests (`make test`). So does the check that the ranks' store
needs no port beside ``MASTER_PORT``."""

import os
import signal
import socket
import subprocess
import sys

import pytest

from test_recovery import BASE, GRACE, INPROCESS, REPO, _run, entrypoint, node_dir
from testlib import free_port
from trainer.exitcodes import ExitCode

pytestmark = pytest.mark.multiprocess


def test_spent_restart_budget_exits_retryable(tmp_path, tiny_dataset):
    rc, out, _ = entrypoint(tmp_path, tiny_dataset, *GRACE, "--resiliency.faults=1:2:sigkill",
                            env={"FT_MAX_RESTARTS": "0"})
    assert rc == ExitCode.RESTART_BUDGET_EXHAUSTED, out[-4000:]
    assert "ft_launcher gave up" in out
    assert "pynvml" not in out, "no deprecation warning from the launcher, the ranks or their checkpoint writers"


def test_bad_config_exits_permanent_through_the_launcher(tmp_path, tiny_dataset):
    rc, out, _ = entrypoint(tmp_path, tiny_dataset, "--checkpoint.keep=1", env={"FT_MAX_RESTARTS": "1"})
    assert rc == ExitCode.CONFIG_ERROR, out[-4000:]
    assert "checkpoint.keep must be >= 2" in out


def test_unhealthy_node_exits_201(tmp_path, tiny_dataset):
    port_dir = tmp_path / "sys" / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    port_dir.mkdir(parents=True)
    (port_dir / "state").write_text("1: DOWN\n")
    cmd = [sys.executable, "-m", "trainer", *BASE, f"--data.path={tiny_dataset}", f"--train.run_dir={tmp_path}",
           f"--resiliency.sysfs_root={tmp_path / 'sys'}"]
    rc, out, _ = _run(cmd, tmp_path)
    assert rc == ExitCode.UNHEALTHY_NODE, out[-4000:]
    assert "InfiniBand mlx5_0 has no ACTIVE port" in out


def _squat(port: int) -> socket.socket | None:
    """A listener on ``port`` that accepts and never answers (another process's server); None if it is taken."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    sock.listen()
    return sock


def test_ports_beside_master_port_held_by_another_process_do_not_stall_the_ranks(tmp_path, tiny_dataset):
    """Without an agent that shares its store (ft_launcher's c10d rendezvous does not; here no launcher at all),
    rank 0 serves the ranks' store on MASTER_PORT, as ``env://`` does. The ports beside it belong to whoever took
    them: with both held by a listener that never answers, a 2-rank in-process run still ends at once (it used to
    host NVRx's store on MASTER_PORT + 1, fall back to a client of that listener, and wait 2 x 300 s)."""
    for _ in range(20):
        port = free_port()
        squatters = [_squat(port + 1), _squat(port + 2)]
        if all(squatters):
            break
        for sock in filter(None, squatters):
            sock.close()
    else:
        pytest.fail("no two free ports next to a free port")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    cmd = [sys.executable, "-m", "trainer", *BASE, *INPROCESS, f"--data.path={tiny_dataset}",
           f"--train.run_dir={tmp_path}", f"--checkpoint.node_local_dir={node_dir(tmp_path)}", "--train.steps=3"]
    ranks = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
             for r in (0, 1)]
    try:
        outs = [rank.communicate(timeout=120)[0] for rank in ranks]
    except subprocess.TimeoutExpired:
        for rank in ranks:
            os.killpg(rank.pid, signal.SIGKILL)
        pytest.fail("the ranks were still starting after 120 s: a store on a port beside MASTER_PORT?\n"
                    + "".join((rank.communicate()[0] or "")[-2000:] for rank in ranks))
    finally:
        for sock in squatters:
            sock.close()
    assert [rank.returncode for rank in ranks] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
