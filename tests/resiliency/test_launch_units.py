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


def _commit(ckpt, step, ranks=2):
    """A committed checkpoint of ``step`` as the persistent tier lays it out: shard files and the manifest."""
    import torch

    from trainer.checkpoint.layout import FORMAT, MANIFEST, VERSION, shard_file_name, step_dir_name

    step_dir = ckpt / step_dir_name(step)
    step_dir.mkdir(parents=True)
    shards = []
    for rank in range(ranks):
        path = step_dir / shard_file_name(rank, ranks)
        torch.save({"model/w": torch.full((4,), float(rank))}, path)
        shards.append({"file": path.name, "bytes": path.stat().st_size})
    (step_dir / MANIFEST).write_text(json.dumps({"format": FORMAT, "version": VERSION, "step": step,
                                                  "shards": shards}))
    return step_dir


def test_a_run_is_finished_once_its_last_step_is_committed_whole(tmp_path):
    from trainer.config import parse_args

    argv = ["--nnodes=2", "-m", "trainer", "--config", "tiny", "--data.path=d", "--train.steps=40",
            f"--train.run_dir={tmp_path}"]
    cfg = launch.trainer_config(argv)
    assert cfg is not None and cfg.checkpoint_dir == tmp_path / "checkpoints"
    assert launch.trainer_config(["--nnodes=2", "-m", "trainer", "--train.steps=-1"]) is None  # the workers say why
    assert launch.finished(cfg) == ""
    _commit(cfg.checkpoint_dir, 38)
    assert launch.finished(cfg) == "", "an earlier step is not the end"
    last = _commit(cfg.checkpoint_dir, 40)
    assert launch.finished(cfg) == str(last)
    (last / "shard-00001-of-00002.pt").write_bytes(b"torn")  # a shard at the wrong size
    assert launch.finished(cfg) == ""
    longer = parse_args(["--config", "tiny", "--data.path=d", "--train.steps=80", f"--train.run_dir={tmp_path}"])[1]
    assert launch.finished(longer) == "", "a relaunch with more steps still has steps to train"


def test_a_launcher_waiting_in_the_rendezvous_leaves_a_run_that_finished_meanwhile(tmp_path, monkeypatch):
    """The wait is left from the main thread's rendezvous call (the signal handler raises there), not elsewhere: a
    launcher whose workers run (outside the rendezvous) is left alone, whatever the checkpoint directory holds."""
    import signal
    import threading
    import time

    monkeypatch.setattr(launch, "POLL_S", 0.05)
    previous = signal.getsignal(launch.FINISHED_SIGNAL)
    ends = {"at": time.monotonic() + 0.5}
    monkeypatch.setattr(launch, "finished", lambda cfg: "step-40" if time.monotonic() > ends["at"] else "")

    class Agent:
        def _rendezvous(self, group):
            while True:  # a node alone in the rendezvous: the others left when the run ended
                time.sleep(0.01)

        def _monitor(self):
            time.sleep(0.3)  # outside the rendezvous: never interrupted
            return "monitored"

    stop = threading.Event()
    try:
        check = launch.leave_a_finished_run(Agent, object())
        watch = launch.JobEndings(tmp_path / "recovery.jsonl", 0)  # the launcher's one watch of the run: no ending
        threading.Thread(target=launch._watch, args=(watch, check, stop), daemon=True).start()
        ends["at"] = 0.0
        assert Agent()._monitor() == "monitored"
        ends["at"] = time.monotonic() + 0.3
        began = time.monotonic()
        try:
            Agent()._rendezvous("default")
        except launch.RunFinished as exc:
            assert str(exc) == "step-40"
        else:
            raise AssertionError("the rendezvous was not left")
        assert 0.3 <= time.monotonic() - began < 5
    finally:
        stop.set()
        signal.signal(launch.FINISHED_SIGNAL, previous)


def test_a_round_whose_node_is_lost_before_the_ranks_are_assigned_is_given_up_for_the_next(monkeypatch):
    """Round 0 completes with two nodes, but the other one is lost before it writes its rank-assignment record: this
    node gives the round up after RANK_ASSIGNMENT_TIMEOUT_S (not NVRx's 300 s) and meets the replacement in round 1."""
    import datetime
    import threading
    import time
    from types import SimpleNamespace

    import torch.distributed as dist
    from nvidia_resiliency_ext.fault_tolerance import launcher as ft

    monkeypatch.setattr(launch, "RANK_ASSIGNMENT_TIMEOUT_S", 1.0)
    port = launch.free_port("127.0.0.1")
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=30))
    peers_store = dist.TCPStore("127.0.0.1", port, 1, False, timeout=datetime.timedelta(seconds=30))  # its own client
    rounds = []

    class Handler:
        def next_rendezvous(self):
            rounds.append(time.monotonic())
            prefix = f"torch.rendezvous.test.{len(rounds) - 1}"
            if len(rounds) == 2:  # the replacement node writes its record in round 1
                peer = SimpleNamespace(role="default", local_world_size=1)
                threading.Thread(target=Agent._share_and_gather,
                                 args=(None, dist.PrefixStore(prefix, peers_store), 1, 2, peer)).start()
            return dist.PrefixStore(prefix, store), 0, 2

    class Agent(ft.LocalElasticAgent):  # patched here only
        pass

    launch.retry_a_round_a_node_left(Agent)
    agent = object.__new__(Agent)
    agent._remaining_restarts = 3
    spec = SimpleNamespace(role="default", local_world_size=1, rdzv_handler=Handler(), master_addr=None,
                           master_port=None, local_addr=None, max_restarts=3)
    group = SimpleNamespace(spec=spec)
    Agent._rendezvous(agent, group)
    assert len(rounds) == 2 and 1.0 <= rounds[1] - rounds[0] < 10, rounds
    assert [w.global_rank for w in group.workers] == [0] and group.group_world_size == 2
