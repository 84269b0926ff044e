"""``trainer.resiliency.launch`` in one process: what counts as a lost rendezvous, the watch for another node's
permanent exit in the ledger, the keep-alive and the stopped store host's short wait."""

from __future__ import annotations

import datetime
import json

from trainer.resiliency import launch
from trainer.ledger import Ledger


def test_a_lost_store_connection_is_a_lost_rendezvous_and_a_timeout_is_not():
    class RendezvousConnectionError(Exception):
        pass

    class RendezvousTimeoutError(Exception):
        pass

    wrapped = RuntimeError("agent run failed")  # the agent's error, raised from the store's
    wrapped.__cause__ = RendezvousConnectionError("The connection to the C10d store has failed")
    assert launch.rendezvous_lost(wrapped)
    assert not launch.rendezvous_lost(RuntimeError("agent run failed"))
    assert not launch.rendezvous_lost(RendezvousTimeoutError("no quorum in 600 s"))


def test_only_permanent_exits_recorded_after_the_start_end_the_node(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    Ledger(run_dir, rank=1).exit(2, "CONFIG_ERROR", "an earlier run's")  # before this pod started: not ours
    monkeypatch.setenv(launch.LEDGER_OFFSET_ENV, str(tmp_path / "offset"))
    watch = launch.JobEndings.since_pod_start(run_dir)
    assert watch.poll() is None
    Ledger(run_dir, rank=0).exit(143, "TERMINATED", "stopped for an in-job restart")  # retryable: not an ending
    assert watch.poll() is None
    ledger = run_dir / "recovery.jsonl"
    line = json.dumps({"event": "exit", "rank": 5, "code": 3, "reason": "ShardError: bad shard"}) + "\n"
    with ledger.open("a") as f:
        f.write(line[:20])  # a line being written
    assert watch.poll() is None
    with ledger.open("a") as f:
        f.write(line[20:])
    assert watch.poll() == (5, 3, "ShardError: bad shard")
    # a launcher started again on this pod (a lost rendezvous) still sees what came after the pod's start
    again = launch.JobEndings.since_pod_start(run_dir)
    assert again.poll() == (5, 3, "ShardError: bad shard")


def test_the_keep_alive_interval_is_set_on_every_new_handler(monkeypatch):
    from nvidia_resiliency_ext.fault_tolerance import _ft_rendezvous as rdzv

    class Settings:
        keep_alive_interval = datetime.timedelta(seconds=5)

    class Handler:
        _settings = Settings()

    monkeypatch.setattr(rdzv.FtRendezvousHandler, "from_backend", classmethod(lambda cls, *a, **k: Handler()))
    assert launch.tune_keep_alive(1.5)
    assert rdzv.FtRendezvousHandler.from_backend().__class__ is Handler
    assert Handler._settings.keep_alive_interval == datetime.timedelta(seconds=1.5)


def test_a_stopped_store_host_waits_briefly_and_a_finished_one_as_before():
    waits = []

    class Agent:
        _exit_barrier_timeout = 300.0

        def clean_rdzv_shutdown(self, close):
            waits.append(self._exit_barrier_timeout)

    launch.brief_linger_when_stopped(Agent)
    Agent().clean_rdzv_shutdown(close=True)
    Agent().clean_rdzv_shutdown(close=False)
    assert waits == [300.0, launch.STOPPED_LINGER_S]


def test_the_workers_port_is_chosen_below_the_ephemeral_range(monkeypatch):
    """The rendezvous's port for the workers (rank 0 listens on it after its imports) is never one the kernel gives a
    connection meanwhile: rank 0 exited 203 (EADDRINUSE) twice in one day of tests with torch's choice."""
    from pathlib import Path

    from nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat.agent.server import api as agent_api
    from torch.distributed.elastic.rendezvous import api as rendezvous_api

    monkeypatch.setattr(agent_api, "_get_socket_with_port", agent_api._get_socket_with_port)
    monkeypatch.setattr(rendezvous_api, "get_free_port", rendezvous_api.get_free_port)
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    launch.workers_port_outside_the_ephemeral_range()
    for _ in range(20):
        with agent_api._get_socket_with_port() as sock:
            assert sock.getsockname()[1] < low
        assert rendezvous_api.get_free_port() < low
