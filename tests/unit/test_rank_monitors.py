"""ft_launcher's rank monitors against our heartbeat client, both real (NVRx's ``RankMonitorServer`` in a process of
its own, our ``Heartbeat`` over NVRx's client): a monitor left ``ABORTED`` refuses heartbeats and is a rank failure
for an in-job restart, not a lost launcher; an in-process restart before the first heartbeat does not leave it so;
and every attempt of the launcher's workers gets new monitors (``trainer/resiliency/monitors.py``)."""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from pathlib import Path

import pytest

from trainer.exitcodes import ExitCode, TrainerExit, ends_job
from trainer.resiliency.heartbeat import FT_SOCKET_ENV, Heartbeat, monitor_listening
from trainer.resiliency.monitors import RETIRE_S


def start_monitor(path: Path) -> multiprocessing.Process:
    from nvidia_resiliency_ext.fault_tolerance.config import FaultToleranceConfig
    from nvidia_resiliency_ext.fault_tolerance.rank_monitor_server import RankMonitorServer

    # No heartbeat timeouts: a monitor that times out SIGKILLs the rank it watches, here the test's own process.
    cfg = FaultToleranceConfig(initial_rank_heartbeat_timeout=None, rank_heartbeat_timeout=None,
                               workload_check_interval=0.2, restart_check_interval=0.2)
    return RankMonitorServer.run_in_subprocess(cfg, str(path), mp_ctx=multiprocessing.get_context("fork"))


@pytest.fixture
def monitor(tmp_path, monkeypatch):
    path = tmp_path / "rmon.socket"
    for name, value in ((FT_SOCKET_ENV, str(path)), ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                        ("LOCAL_WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    process = start_monitor(path)
    yield process
    process.kill()
    process.join(10)


def connect_beat_leave(beat: bool) -> None:
    """A worker's life as the monitor sees it: connect, maybe a heartbeat, then the connection is lost."""
    hb = Heartbeat(floor_s=None)
    hb.start()
    if beat:
        hb.beat()
    hb.client.shutdown_workload_monitoring()


def test_a_live_monitor_that_refuses_heartbeats_is_a_rank_failure_for_an_in_job_restart(monitor):
    connect_beat_leave(beat=True)  # the killed worker: the monitor takes its lost connection for a restart
    connect_beat_leave(beat=False)  # its successor, lost before its first heartbeat: the monitor is ABORTED now
    hb = Heartbeat(floor_s=None)
    hb.start()
    with pytest.raises(TrainerExit) as err:
        hb.beat()
    assert err.value.exit_code == ExitCode.RANK_MONITOR_REFUSED and not ends_job(err.value.exit_code)
    assert "alive but refused" in err.value.reason and "\n" not in err.value.reason
    hb.stop()


def test_an_in_process_restart_before_the_first_heartbeat_leaves_the_monitor_usable(monitor):
    connect_beat_leave(beat=True)  # a worker killed after its first steps: the monitor is HANDLING_START
    hb = Heartbeat(floor_s=None)  # the worker that takes over ...
    hb.start()
    hb.start()  # ... restarts in-process (an OOM in its restore) before its first heartbeat
    hb.start()  # ... and again
    for _ in range(3):
        hb.beat()
    hb.stop()


def test_a_monitor_that_is_gone_is_a_lost_launcher(monitor):
    hb = Heartbeat(floor_s=None)
    hb.start()
    hb.beat()
    monitor.kill()
    monitor.join(10)
    assert not monitor_listening(os.environ[FT_SOCKET_ENV])
    with pytest.raises(TrainerExit) as err:
        for _ in range(3):  # the first write after the peer died may still land in the socket's buffer
            hb.beat()
    assert err.value.exit_code == ExitCode.LAUNCHER_LOST and ends_job(err.value.exit_code)


def test_each_attempt_gets_new_rank_monitors(tmp_path, monkeypatch):
    """NVRx's own ``setup_rank_monitors``, as ft_launcher calls it at each attempt's start, with ours around it."""
    from nvidia_resiliency_ext.fault_tolerance import launcher as ft
    from nvidia_resiliency_ext.fault_tolerance.config import FaultToleranceConfig

    from trainer.resiliency.monitors import fresh_monitor_per_attempt

    class Agent(ft.LocalElasticAgent):
        def __init__(self) -> None:  # only what setup_rank_monitors reads
            self._local_rank_to_rmon = {}
            self._ft_cfg = FaultToleranceConfig(initial_rank_heartbeat_timeout=None, rank_heartbeat_timeout=None)
            self._is_store_host = True

    assert fresh_monitor_per_attempt(Agent)
    envs = {r: {"LOCAL_RANK": str(r), FT_SOCKET_ENV: str(tmp_path / f"rmon{r}.socket")} for r in range(2)}
    agent = Agent()
    agent.get_rank_mon_socket_path = lambda r: envs[r][FT_SOCKET_ENV]  # ft_launcher's, from its pid
    try:
        agent.setup_rank_monitors(envs)
        first = dict(agent._local_rank_to_rmon)
        agent.setup_rank_monitors(envs)  # the next attempt
        second = dict(agent._local_rank_to_rmon)
        assert set(second) == {0, 1} and all(second[r].pid != first[r].pid for r in (0, 1))
        assert not any(p.is_alive() for p in first.values()) and all(p.is_alive() for p in second.values())
        for r in (0, 1):  # the old monitor's exit removed its socket path before the new one made it again
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.connect(envs[r][FT_SOCKET_ENV])
            probe.close()
    finally:
        began = time.monotonic()
        agent.shutdown_rank_monitors()  # bounded: NVRx's joins a monitor that ignores SIGTERM for ever
    assert time.monotonic() - began < 2 * (RETIRE_S + 1) + 5
    assert not any(p.is_alive() for p in second.values())
    assert not any(Path(e[FT_SOCKET_ENV]).exists() for e in envs.values())


def test_the_launchers_end_retires_a_monitor_that_ignores_sigterm(tmp_path):
    """A monitor stuck before its SIGTERM handler can run (forked while another thread of the launcher held a lock)
    is killed after ``RETIRE_S``, instead of holding the launcher's end for ever."""
    import signal

    from nvidia_resiliency_ext.fault_tolerance import launcher as ft

    from trainer.resiliency.monitors import fresh_monitor_per_attempt

    class Agent(ft.LocalElasticAgent):
        def __init__(self) -> None:
            self._local_rank_to_rmon = {}

    assert fresh_monitor_per_attempt(Agent)
    agent = Agent()
    stuck = multiprocessing.get_context("fork").Process(target=_ignore_sigterm, daemon=True)
    stuck.start()
    agent._local_rank_to_rmon[0] = stuck
    agent.get_rank_mon_socket_path = lambda r: str(tmp_path / "gone.socket")
    time.sleep(0.5)  # its SIG_IGN is in place
    began = time.monotonic()
    agent.shutdown_rank_monitors()
    assert not stuck.is_alive() and stuck.exitcode == -signal.SIGKILL
    assert RETIRE_S <= time.monotonic() - began < RETIRE_S + 5


def _ignore_sigterm() -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)
