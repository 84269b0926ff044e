"""Launches that end without recovering, through the same launchers as ``test_recovery``: a spent restart budget
exits retryable, a bad config permanent, an unhealthy node 201. They count no recoveries and measure no timing, so
unlike ``test_recovery`` they run two at a time with the other multiprocess tests (`make test`)."""

import sys

import pytest

from test_recovery import BASE, GRACE, _run, entrypoint
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
