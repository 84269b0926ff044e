"""``python -m trainer.resiliency.launch <ft_launcher arguments> -m trainer <trainer arguments>``: one node's
``ft_launcher`` (NVRx), as ``entrypoint.sh`` runs it in every pod, with what a job of several nodes needs around it.

Its one concern is the node's place in the job's rendezvous:

- **The rendezvous is lost.** torch's c10d rendezvous keeps its store in the launcher of one node (the pod whose
  host name ``MASTER_ADDR`` is). When that node is lost, every other launcher's agent fails at its next call on the
  store (``RendezvousConnectionError``). This exits ``RENDEZVOUS_LOST`` instead of ft_launcher's 1, and
  ``entrypoint.sh`` starts a new launcher that joins the rendezvous again: at the replacement pod's store, or on a
  host that any node may serve (``127.0.0.1``) at its own. The node's snapshots in memory outlive it (the
  entrypoint owns them), so its ranks resume from them.
- **Another node's rank ended the job.** A permanent exit (1-127) ends every node after one attempt. The rank that
  exits records it in the run's recovery ledger on the shared volume (``trainer.ledger``) and its own entrypoint
  stops its launcher; every other node's launcher would restart its workers into a rendezvous that the failed node
  never joins again. This watches the ledger for such an exit recorded since the node's entrypoint started and
  hands it to the entrypoint as the exit of that rank (``ended-rank-<R>`` in ``TRAINER_EXIT_CODE_DIR``, then
  SIGUSR1, as a worker of its own would), which stops the launcher and exits with the same code.
- **A lost node is noticed sooner.** The rendezvous drops a node whose keep-alive it has not heard for 3 intervals;
  NVRx 0.4.1 fixes the interval at 5 s, so a lost node held the others' next round for 15 s. ``entrypoint.sh``'s
  ``FT_RDZV_KEEP_ALIVE_S`` sets it (``KEEP_ALIVE_ENV``).
- **A stopped store host leaves at once.** A launcher leaving the rendezvous waits, where it hosts the store, until
  every other node left too (up to 300 s), so the others need not lose the store while they leave. That is right when
  the job ends; when this node alone is stopped (its pod preempted or ended by a permanent exit) the others are not
  leaving, they wait for it, and its pod would hang there until killed. Stopped, it waits ``STOPPED_LINGER_S``: the
  others join the rendezvous again at the replacement's store.
- **The workers' port stays free until rank 0 listens on it.** The rendezvous's first node picks the workers'
  ``MASTER_PORT`` (torch's ``get_free_port``: a port the kernel would give, in its ephemeral range) and frees it;
  rank 0 binds it seconds later, after its imports, and any connection opened meanwhile on the machine (or the pod)
  may have been given it as its own port: rank 0 then exits 203 (``EADDRINUSE``) and the job takes an in-job
  restart for nothing. ``bound_socket`` picks one below the ephemeral range, which no
  connection is given.

- **A node lost while the ranks are assigned stalls no one.** Past the round's completion, the agents exchange their
  rank-assignment records through the round's store; NVRx waits 300 s for a node's record, and a node lost before it
  wrote it held the others that long while its replacement waited in the next round. The wait is
  ``RANK_ASSIGNMENT_TIMEOUT_S``, and a round given up is followed by the next (``retry_a_round_a_node_left``).
- **A node that comes to a finished run exits 0.** The nodes that trained a run leave when it ends; a node started
  after that (a replacement pod for one lost in the last seconds, a pod restarted after the job ended) would wait
  for them until the rendezvous's join timeout (15 minutes) and fail the job. A launcher whose run's last step is
  committed exits 0 at once, and one waiting in the rendezvous leaves it when the run finishes meanwhile
  (``finished``, ``leave_a_finished_run``).

Each attempt's rank monitors are new (``trainer.resiliency.monitors``). Everything else is ft_launcher's: its
arguments, its exit codes (0 or 1), its logs.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from trainer.exitcodes import ENTRYPOINT_PID_ENV, EXIT_CODE_DIR_ENV, ExitCode, cause_chain
from trainer.resiliency.monitors import fresh_monitor_per_attempt

if TYPE_CHECKING:
    from trainer.config import JobConfig

log = logging.getLogger("trainer.launch")

LEDGER_OFFSET_ENV = "TRAINER_LEDGER_OFFSET_FILE"
"""Set by ``entrypoint.sh``: a file of its own where the first launcher of the pod notes the ledger's size, so a
launcher started again after a lost rendezvous still sees the exits recorded since the pod started."""
ENDED_PREFIX = "ended-rank-"
"""``TRAINER_EXIT_CODE_DIR/ended-rank-<R>`` holds the code with which rank R, on another node, ended the job."""
KEEP_ALIVE_ENV = "TRAINER_RDZV_KEEP_ALIVE_S"
"""Seconds between this node's keep-alives to the rendezvous (set by ``entrypoint.sh``; unset: NVRx's)."""
POLL_S = 1.0
RANK_ASSIGNMENT_TIMEOUT_S = 30.0
"""How long the nodes of a completed rendezvous round wait for each other's rank-assignment records (written within
milliseconds of the round's completion by a live node): past it, the round is given up
(``retry_a_round_a_node_left``)."""
ROUND_RETRIES = 3
"""Rounds given up in a row before the wait's error ends the launcher (``retry_a_round_a_node_left``)."""
FINISHED_SIGNAL = signal.SIGUSR2
"""Sent to itself by a launcher that finds the run finished while it waits in the rendezvous
(``leave_a_finished_run``)."""
STOPPED_LINGER_S = 5.0
"""How long a store host stopped by a signal waits for the other nodes to leave the rendezvous."""
_LOST = ("RendezvousConnectionError", "DistNetworkError")
"""The agent's store is unreachable (its host is gone); a rendezvous that timed out or was closed is not lost."""


def bound_socket(host: str = "") -> socket.socket:
    """A socket bound to a port free on ``host`` (every interface by default), below the kernel's ephemeral range
    (``ip_local_port_range``), so that once it is closed only an explicit bind can take the port; to one in the
    ephemeral range if none is free below it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default range starts there
    draw = random.Random()
    for _ in range(64):
        sock = socket.socket()
        try:
            sock.bind((host, draw.randrange(max(1024, low - 10_000), low)))
            return sock
        except OSError:
            sock.close()
    sock = socket.socket()
    sock.bind((host, 0))
    return sock


def free_port(host: str = "") -> int:
    """A port free now and outside the ephemeral range (``bound_socket``)."""
    with bound_socket(host) as sock:
        return sock.getsockname()[1]


def workers_port_outside_the_ephemeral_range() -> None:
    """The rendezvous picks the workers' ``MASTER_PORT`` with ``bound_socket`` (module docstring): in NVRx's copy of
    torch's agent (0.4.1) and in torch's rendezvous (where later NVRx releases take it)."""
    from torch.distributed.elastic.rendezvous import api as rendezvous_api

    if hasattr(rendezvous_api, "get_free_port"):
        rendezvous_api.get_free_port = free_port
    try:
        from nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat.agent.server import api as agent_api
    except ImportError:
        return
    if hasattr(agent_api, "_get_socket_with_port"):
        agent_api._get_socket_with_port = bound_socket


def rendezvous_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) says the agent lost the connection to the rendezvous's store."""
    return any(cls.__name__ in _LOST for link in cause_chain(exc) for cls in type(link).__mro__)


def trainer_config(argv: list[str]) -> JobConfig | None:
    """The trainer's configuration from the arguments after ``-m trainer`` (None when they do not parse: the workers
    report that themselves)."""
    if "-m" not in argv:
        return None
    rest = argv[argv.index("-m") + 1:]
    if not rest or rest[0] != "trainer":
        return None
    from trainer.config import ConfigError, parse_args

    try:
        _, cfg = parse_args(rest[1:])
    except (ConfigError, SystemExit, OSError, ValueError):
        return None
    return cfg


def retry_a_round_a_node_left(agent_cls: type) -> None:
    """A node lost between the completion of a rendezvous round and the end of the agents' rank assignment (each
    agent writes its record to the round's store and reads everyone's; the store's host waits for every other node's
    last write) left the others waiting for its record for 300 s, NVRx's fixed wait, while its replacement waited in
    the next round. The assignment (``agent_cls._share_and_gather``) waits ``RANK_ASSIGNMENT_TIMEOUT_S`` instead, and
    a wait that times out (``DistStoreError``) sends the node to the next round (``_rendezvous`` again), as an in-job
    restart does, at most ``ROUND_RETRIES`` times in a row. A store that is gone is not a timeout: the rendezvous is
    lost (``rendezvous_lost``)."""
    try:
        from nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat.agent.server import api as agent_api
    except ImportError:
        agent_api = None
    rendezvous = getattr(agent_cls, "_rendezvous", None)
    info_cls = getattr(agent_api, "_RoleInstanceInfo", None)
    if rendezvous is None or info_cls is None or not hasattr(agent_cls, "_share_and_gather"):
        log.warning("a node lost while the ranks are assigned holds the others for 300 s: this NVRx's agent differs")
        return
    from torch.distributed import DistStoreError

    def _share_and_gather(self: object, store: object, group_rank: int, group_world_size: int, spec: object) -> list:
        mine = info_cls(spec.role, group_rank, spec.local_world_size)  # type: ignore[attr-defined]
        gathered = agent_api.store_util.synchronize(store, mine.serialize(), group_rank, group_world_size,
                                                    "torchelastic/role_info", RANK_ASSIGNMENT_TIMEOUT_S)
        return [info_cls.deserialize(record) for record in gathered]

    def _rendezvous(self: object, *args: object, **kwargs: object) -> object:
        for _ in range(ROUND_RETRIES):
            try:
                return rendezvous(self, *args, **kwargs)
            except DistStoreError as exc:
                log.warning("a node of this rendezvous round did not assign its ranks in %.0f s (%s): it was lost "
                            "meanwhile; joining the next round", RANK_ASSIGNMENT_TIMEOUT_S, str(exc).splitlines()[0])
        return rendezvous(self, *args, **kwargs)  # the last round's error ends the launcher

    agent_cls._share_and_gather = _share_and_gather  # type: ignore[attr-defined]
    agent_cls._rendezvous = _rendezvous  # type: ignore[attr-defined]


class RunFinished(Exception):
    """The run's last step is committed in its checkpoint directory: a node that comes to it has nothing to train."""


def finished(cfg: JobConfig) -> str:
    """Where the run's last step (``train.steps``) is committed, whole: its manifest and every shard file present at
    its size and openable (``find_valid_checkpoint`` without checksums: cheap; the checksums are read by whoever
    loads it, as the evaluation does). Empty while it is not."""
    from trainer.checkpoint import CheckpointError, committed_steps, find_valid_checkpoint

    steps, directory = cfg.train.steps, cfg.checkpoint_dir
    if steps not in committed_steps(directory):
        return ""
    try:
        step_dir, _ = find_valid_checkpoint(directory, step=steps, checksums=False)
    except (CheckpointError, OSError, ValueError, KeyError):
        return ""
    return str(step_dir)


def leave_a_finished_run(agent_cls: type, cfg: JobConfig) -> Callable[[], None]:
    """A launcher waiting in the rendezvous (``agent_cls._rendezvous``: the job's start, or a node's return) for a
    run that meanwhile finished leaves it with ``RunFinished``. The nodes that trained the run left when it ended, so
    a node started again after that (a replacement pod, or one lost in the job's last seconds) would wait for them
    until the rendezvous's join timeout and fail the job. Returns the check the launcher's watch runs every
    ``POLL_S`` (``_watch``); the exception is raised in the main thread (a signal handler) only while it is still
    inside the rendezvous, before any worker of this node started."""
    original = getattr(agent_cls, "_rendezvous", None)
    if original is None:
        log.warning("a node started after the run finished waits in the rendezvous: this NVRx's agent has no "
                    "_rendezvous")
        return lambda: None
    waiting = threading.Event()

    def _rendezvous(self: object, *args: object, **kwargs: object) -> object:
        waiting.set()
        try:
            return original(self, *args, **kwargs)
        finally:
            waiting.clear()

    def on_signal(signum: int, frame: object) -> None:
        if waiting.is_set() and (where := finished(cfg)):
            raise RunFinished(where)

    def check() -> None:
        if waiting.is_set() and finished(cfg):
            os.kill(os.getpid(), FINISHED_SIGNAL)

    agent_cls._rendezvous = _rendezvous  # type: ignore[attr-defined]
    signal.signal(FINISHED_SIGNAL, on_signal)
    return check


class JobEndings:
    """Polls the run's recovery ledger for a permanent exit (1-127) recorded after ``offset``, from any node."""

    def __init__(self, ledger: Path, offset: int) -> None:
        self.ledger, self.offset = ledger, offset
        self._partial = b""

    @classmethod
    def since_pod_start(cls, run_dir: Path) -> "JobEndings":
        from trainer.ledger import LEDGER_FILE

        ledger = run_dir / LEDGER_FILE
        size = ledger.stat().st_size if ledger.exists() else 0
        note = os.environ.get(LEDGER_OFFSET_ENV)
        if note:
            path = Path(note)
            try:
                size = int(path.read_text())
            except (OSError, ValueError):
                path.write_text(str(size))
        return cls(ledger, size)

    def poll(self) -> tuple[int, int, str] | None:
        """The first new permanent exit as (rank, code, reason), else None."""
        try:
            with open(self.ledger, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return None
        self.offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            code = record.get("code")
            if record.get("event") == "exit" and isinstance(code, int) and 1 <= code <= 127:
                return int(record.get("rank", -1)), code, str(record.get("reason", ""))
        return None


def tune_keep_alive(seconds: float) -> bool:
    """Every rendezvous handler made from now on sends its keep-alive every ``seconds`` (NVRx 0.4.1 fixes 5 s in
    ``FtRendezvousHandler.from_backend``; a node missing 3 is dropped). False, logged, where the handler differs."""
    import datetime
    import importlib

    try:  # NVRx 0.4's c10d rendezvous handler (0.6 on: a barrier-based one, with its own settings)
        rdzv = importlib.import_module("nvidia_resiliency_ext.fault_tolerance._ft_rendezvous")
    except ImportError:
        rdzv = None
    handler_cls = getattr(rdzv, "FtRendezvousHandler", None)
    original = getattr(handler_cls, "from_backend", None)
    if original is None:
        log.warning("FT_RDZV_KEEP_ALIVE_S ignored: this NVRx has no FtRendezvousHandler.from_backend")
        return False

    def from_backend(*args: object, **kwargs: object) -> object:
        handler = original(*args, **kwargs)
        settings = getattr(handler, "_settings", None)
        if settings is not None and hasattr(settings, "keep_alive_interval"):
            object.__setattr__(settings, "keep_alive_interval", datetime.timedelta(seconds=seconds))  # frozen
        return handler

    handler_cls.from_backend = from_backend  # type: ignore[union-attr]
    return True


def brief_linger_when_stopped(agent_cls: type) -> None:
    """``agent_cls.clean_rdzv_shutdown(close)``: with ``close`` False (the agent was stopped by a signal, or its node
    found unhealthy: the rendezvous stays open for the others) a store host waits ``STOPPED_LINGER_S`` at most for the
    other nodes to leave; at the job's end (``close``) as long as before."""
    original = getattr(agent_cls, "clean_rdzv_shutdown", None)
    if original is None:
        log.warning("a stopped store host may wait for the other nodes: this NVRx has no clean_rdzv_shutdown")
        return

    def clean_rdzv_shutdown(self: object, close: bool) -> None:
        if not close and hasattr(self, "_exit_barrier_timeout"):
            self._exit_barrier_timeout = min(self._exit_barrier_timeout, STOPPED_LINGER_S)  # type: ignore[attr-defined]
        original(self, close)

    agent_cls.clean_rdzv_shutdown = clean_rdzv_shutdown  # type: ignore[attr-defined]


def _hand_over(ending: tuple[int, int, str]) -> None:
    """Tell the entrypoint that rank R ended the job with its code, as a worker of this node would."""
    rank, code, reason = ending
    directory = os.environ.get(EXIT_CODE_DIR_ENV)
    entrypoint = os.environ.get(ENTRYPOINT_PID_ENV, "")
    log.error("rank %d ended the job with exit %d (%s): stopping this node", rank, code, reason or "no reason recorded")
    if not directory or not entrypoint.isdigit():
        os.kill(os.getpid(), signal.SIGTERM)  # no entrypoint: the agent stops its workers and this exits
        return
    path = Path(directory) / f"{ENDED_PREFIX}{rank}"
    path.with_suffix(".tmp").write_text(f"{code}\n")
    os.replace(path.with_suffix(".tmp"), path)
    os.kill(int(entrypoint), signal.SIGUSR1)


def _watch(endings: JobEndings, run_finished: Callable[[], None], stop: threading.Event) -> None:
    """The run's shared state, every ``POLL_S``: another node's permanent exit in the ledger, the run's end."""
    while not stop.wait(POLL_S):
        ending = endings.poll()
        if ending is not None:
            _hand_over(ending)
            return
        run_finished()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from nvidia_resiliency_ext.fault_tolerance import launcher as ft

    args = ft.parse_args(argv)
    brief_linger_when_stopped(getattr(ft, "LocalElasticAgent", object))
    fresh_monitor_per_attempt(getattr(ft, "LocalElasticAgent", object))
    workers_port_outside_the_ephemeral_range()
    if os.environ.get(KEEP_ALIVE_ENV):
        tune_keep_alive(float(os.environ[KEEP_ALIVE_ENV]))
    stop = threading.Event()
    cfg = trainer_config(argv)
    if cfg is not None:
        if where := finished(cfg):
            log.info("the run already finished: its last step is committed in %s; this node has nothing to train",
                     where)
            return 0
        run_finished = leave_a_finished_run(getattr(ft, "LocalElasticAgent", object), cfg)
        threading.Thread(target=_watch, args=(JobEndings.since_pod_start(Path(cfg.train.run_dir)), run_finished, stop),
                         name="run-watch", daemon=True).start()
    retry_a_round_a_node_left(getattr(ft, "LocalElasticAgent", object))
    try:
        ft.run(args)
    except Exception as exc:  # noqa: BLE001 - ft_launcher's own main maps every failure to 1, as this does
        ended = next((link for link in cause_chain(exc) if isinstance(link, RunFinished)), None)
        if ended is not None:
            log.info("the run finished while this node waited in its rendezvous: its last step is committed in %s; "
                     "this node has nothing to train", ended)
            return 0
        if rendezvous_lost(exc):
            log.error("lost the rendezvous (%s: %s): its store's host is gone; this node joins it again",
                      type(exc).__name__, exc)
            return ExitCode.RENDEZVOUS_LOST
        log.error("ft_launcher ended with %s: %s", type(exc).__name__, exc)
        return 1
    finally:
        stop.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())  # logging is configured by ft_launcher's module when main() imports it: its format, its level
