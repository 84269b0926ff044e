"""The exit-code contract between the trainer and everything that restarts it.

Kubeflow's PyTorchJob with ``restartPolicy: ExitCode`` restarts a pod whose container exits with a code
>= 128 and fails the job for codes 1-127; the local backend (``components/lib/local_launcher.py``) follows
the same rule. ``ft_launcher`` (0.4.1) restarts the worker group for any failure, so
``entrypoint.sh`` stops it as soon as a worker exits with a code that ``ends_job`` (each such worker
signals it, see ``record_exit``): a permanent code ends the whole job after one attempt, whatever launches it.

- **Permanent (1-127)**: retrying cannot help - bad config, bad data, unusable checkpoint storage, a bug.
  Nothing in the job retries these: not the in-process layer, not ft_launcher, not the pod. (The pipeline's
  ``set_retry`` re-runs a failed train step whatever its code: KFP's retry policy cannot filter on it.)
- **Retryable (>= 128)**: the node or the job's budget failed, not the code - a restart elsewhere or later
  resumes from the latest checkpoint. Codes 128 + N are what the kernel reports for a process killed by
  signal N (137 = SIGKILL/OOM kill, 143 = SIGTERM); ours are chosen above that range so a log line tells
  which one happened. ``UNHEALTHY_NODE`` and ``LAUNCHER_LOST`` are retryable but skip the in-job layer,
  which would restart on the same node with the same launcher.

What an operator sees: an expected error (config, data, checkpoint, unhealthy node, preemption, lost
launcher) is one line on stderr without a traceback; a real code error (exit 1) keeps its traceback. Every
line, tracebacks included, is also in the run's log ``<run_dir>/logs/trainer-rank<R>.log``.

Use the names, never the numbers.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator


class ExitCode(enum.IntEnum):
    OK = 0

    # --- permanent: nothing retries these --------------------------------------------------------------
    CODE_ERROR = 1
    """An unexpected exception (a bug); the traceback is in the log."""
    CONFIG_ERROR = 2
    """Invalid configuration or command line; the message says which key to change."""
    DATA_ERROR = 3
    """The dataset is missing, corrupt or does not match the model; re-run data prep."""
    CHECKPOINT_ERROR = 4
    """No valid checkpoint could be loaded where one was required, or checkpoint storage is unusable
    (e.g. disk full); a retry would fail the same way until an operator acts."""

    # --- retryable: PyTorchJob ExitCode policy and the pipeline retry act on these -----------------------
    KILLED = 137
    """128 + SIGKILL: the kernel's code for a killed process (OOM killer, ``kill -9``)."""
    TERMINATED = 143
    """128 + SIGTERM, as reported for a process that did not handle SIGTERM."""
    RESTART_BUDGET_EXHAUSTED = 200
    """The in-job (ft_launcher) or in-process restart budget is spent; resubmit the job."""
    UNHEALTHY_NODE = 201
    """A health check failed on this node, or ``resiliency.straggler=evict`` found a rank too slow (every rank exits
    with it, after a checkpoint of that step): do not restart here, replace the node/pod."""
    PREEMPTED = 202
    """SIGTERM (preemption, eviction) was handled: a final checkpoint was committed; resume anywhere."""
    RANKS_LOST = 203
    """A peer rank was lost: a collective failed because a peer died or hung (gloo/NCCL error), or the
    in-process layer cannot continue without a terminated rank; the in-job layer (ft_launcher) or the
    cluster restarts the whole group."""
    LAUNCHER_LOST = 204
    """This worker lost ft_launcher: its rank monitor or the launcher's IPC socket is gone (BrokenPipe,
    ConnectionRefused). A launcher whose processes die under it is not trusted with an in-job restart:
    ``entrypoint.sh`` stops the launcher and the pod exits with this code for the cluster layer. (A monitor that is
    alive but refuses heartbeats is ``RANK_MONITOR_REFUSED``.)"""
    RENDEZVOUS_LOST = 205
    """This node lost the job's rendezvous (its store's host node is gone) and did not find it again within
    ``FT_RDZV_REJOIN_TIMEOUT`` (``entrypoint.sh`` joins it again as long as that lasts: ``trainer.resiliency.launch``);
    the pod restarts, as after a lost launcher."""
    RANK_MONITOR_REFUSED = 206
    """This worker's rank monitor is alive but refuses its heartbeats (NVRx's state machine left ``ABORTED`` by two
    lost connections without a heartbeat between them): a rank failure, which ft_launcher restarts; each attempt
    gets new rank monitors (``trainer.resiliency.monitors``)."""
    DEVICE_OUT_OF_MEMORY = 207
    """A CUDA allocation failed in a job whose model has fit on this local rank before (its first step ran: an OOM at
    the first step of a model that never fit is ``CONFIG_ERROR``): memory held by another process or fragmented. The
    in-process layer restarts first (after waiting for the device's memory: ``trainer.resiliency.device``), the
    in-job layer when its budget is spent or it is off."""


def is_retryable(code: int) -> bool:
    """True when the cluster layer (PyTorchJob ExitCode policy, pipeline retry) should restart."""
    return code >= 128


def ends_job(code: int) -> bool:
    """True when no in-job restart can help: a permanent code; an unhealthy node or a lost launcher (retryable,
    but only by a new pod)."""
    return 1 <= code <= 127 or code in (ExitCode.UNHEALTHY_NODE, ExitCode.LAUNCHER_LOST)


#: Environment variable naming a directory where each worker records its exit code (file ``rank-<RANK>``
#: holding ``"<TORCHELASTIC_RESTART_COUNT> <code>"``). Set by ``entrypoint.sh``: ``ft_launcher`` itself exits
#: 1 for every failure, so the entrypoint maps the workers' last-attempt codes onto this contract.
EXIT_CODE_DIR_ENV = "TRAINER_EXIT_CODE_DIR"
#: The entrypoint's pid (exported by ``entrypoint.sh``): a worker whose code ``ends_job`` sends it SIGUSR1.
ENTRYPOINT_PID_ENV = "TRAINER_ENTRYPOINT_PID"
PREEMPTING_MARKER = "preempting"
"""Created in ``$TRAINER_EXIT_CODE_DIR`` by ``entrypoint.sh`` when the pod itself got SIGTERM (preemption,
eviction) before it forwards the signal. A worker that gets SIGTERM without it is being stopped by ft_launcher
for an in-job restart: it exits at once instead of waiting for a final checkpoint its dead peer never joins."""


def classify(exc: BaseException) -> ExitCode:
    """The contract code for an exception that ended training (the cause chain is searched).

    Permanent: ``ConfigError`` -> CONFIG_ERROR, data ``ShardError`` -> DATA_ERROR, ``CheckpointError`` ->
    CHECKPOINT_ERROR, anything else -> CODE_ERROR. Retryable: ``TrainerExit`` carries its own code; an
    unhealthy node (``health.NodeUnhealthy``) -> UNHEALTHY_NODE; the in-process layer giving up
    (NVRx ``FaultCounterExceeded`` or another ``RestartError``) -> RESTART_BUDGET_EXHAUSTED; the rank
    monitor or launcher IPC gone (NVRx ``RankMonitorClientError``) -> LAUNCHER_LOST; a collective or store
    failure caused by a lost peer -> RANKS_LOST.
    """
    chain = cause_chain(exc)
    for link in chain:
        if isinstance(link, TrainerExit):
            return link.exit_code
    names = {cls.__name__ for link in chain for cls in type(link).__mro__}
    for name, code in _BY_CLASS_NAME:
        if name in names:
            return code
    if any(marker in str(link) for link in chain for marker in _PEER_LOST_MARKERS):
        return ExitCode.RANKS_LOST
    return ExitCode.CODE_ERROR


# Matched by class name so this module stays importable without torch/numpy (the trainer's CLI reports
# argument errors before importing them). Priority: the first entry found anywhere in the cause chain wins.
_BY_CLASS_NAME: tuple[tuple[str, ExitCode], ...] = (
    ("ConfigError", ExitCode.CONFIG_ERROR),
    ("ShardError", ExitCode.DATA_ERROR),
    ("CheckpointError", ExitCode.CHECKPOINT_ERROR),
    ("NodeUnhealthy", ExitCode.UNHEALTHY_NODE),
    ("DeviceHeld", ExitCode.UNHEALTHY_NODE),  # the GPU's memory stayed held by something outside the job
    ("RankMonitorClientError", ExitCode.LAUNCHER_LOST),  # NVRx: the rank monitor's socket broke
    ("FaultCounterExceeded", ExitCode.RESTART_BUDGET_EXHAUSTED),
    ("RestartError", ExitCode.RESTART_BUDGET_EXHAUSTED),  # any other NVRx Wrapper give-up (barrier timeout ...)
    ("OutOfMemoryError", ExitCode.DEVICE_OUT_OF_MEMORY),  # torch's CUDA OOM (Python's MemoryError is not one)
    ("DistError", ExitCode.RANKS_LOST),  # torch.distributed store/network errors: a peer or the store is gone
)
# gloo and NCCL raise plain RuntimeErrors when a peer died or hung; their messages name the transport.
_PEER_LOST_MARKERS = ("/gloo/", "NCCL", "Connection reset by peer", "Connection closed by peer")


def cause_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception it was raised from or during (``__cause__``, ``__context__``), each once."""
    chain: list[BaseException] = []
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        link = todo.pop(0)
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        chain.append(link)
        todo += [link.__cause__, link.__context__]
    return chain


def code_name(code: int) -> str:
    """``"DATA_ERROR"``; a code without a name: ``"SIGNAL_<N>"`` above 128, else ``"EXIT_<code>"``."""
    if code in ExitCode._value2member_map_:
        return ExitCode(code).name
    return f"SIGNAL_{code - 128}" if code > 128 else f"EXIT_{code}"


_exit_listeners: list[Callable[[int, str], None]] = []
RECORD_WAIT_S = 10.0
"""How long a second way out of the process waits for the first one's ``record_exit`` to finish writing."""


@contextlib.contextmanager
def on_exit(listener: Callable[[int, str], None]) -> Iterator[None]:
    """While open, ``record_exit`` calls ``listener(code, reason)`` (the CLI: the run's recovery ledger)."""
    _exit_listeners.append(listener)
    try:
        yield
    finally:
        _exit_listeners.remove(listener)


class _Ending:
    """The exit this process has recorded: the first ``record_exit`` wins. A second way out (ft_launcher's
    SIGTERM arriving while the process tears down after its own error, or a second SIGTERM re-entering the
    handler) must neither write a second exit into the ledger nor end the process with another code."""

    def __init__(self) -> None:
        import threading

        self.code: int | None = None
        self.written = False  # the ledger, the entrypoint's file and its signal are done
        self.done = threading.Event()  # set with ``written``: another thread's way out waits for it
        self.recorder: int | None = None  # the thread that records


_ending = _Ending()


def ending_code() -> int | None:
    """The code this process already recorded as its exit (``record_exit`` was called), else None."""
    return _ending.code


def exit_being_recorded() -> bool:
    """True while ``record_exit`` runs (a signal handler interrupted it): let it finish, do not exit now."""
    return _ending.code is not None and not _ending.written


def record_exit(code: int, reason: str = "") -> int:
    """Tell the exit listeners, and write this worker's exit code where ``entrypoint.sh`` reads it (outside
    the entrypoint: nothing more); when the code ``ends_job``, signal the entrypoint (SIGUSR1) to stop
    ft_launcher before it restarts the group. Once per process, from every way out: a later call changes
    nothing and returns the code recorded first, the one the process must end with."""
    import threading

    if _ending.code is not None:
        if _ending.recorder != threading.get_ident():
            # FT: another thread records (a launcher's SIGTERM is read by the watch thread and by the main thread's
            # handler at once): the process must not end before that thread's file and ledger line are written
            _ending.done.wait(RECORD_WAIT_S)
        return _ending.code
    _ending.code, _ending.recorder = int(code), threading.get_ident()
    try:
        _record(int(code), reason)
    finally:
        _ending.written = True
        _ending.done.set()
    return int(code)


def _record(code: int, reason: str) -> None:
    import os
    import signal

    for listener in _exit_listeners:
        try:
            listener(int(code), reason)
        except Exception:  # noqa: BLE001 - the exit itself must still be recorded and happen
            pass
    directory = os.environ.get(EXIT_CODE_DIR_ENV)
    if not directory:
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    path = os.path.join(directory, f"rank-{os.environ.get('RANK', '0')}")
    try:
        with open(path + ".tmp", "w") as f:
            f.write(f"{attempt} {int(code)}\n")
        os.replace(path + ".tmp", path)
    except OSError:  # the exit code itself still reaches the launcher
        return
    entrypoint = os.environ.get(ENTRYPOINT_PID_ENV, "")
    if ends_job(int(code)) and entrypoint.isdigit():
        import threading

        if threading.current_thread() is threading.main_thread():
            # The launcher's stop (SIGTERM) must not turn this exit into TERMINATED while the process ends.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:  # FT: ft_launcher would restart the group on any failure; the entrypoint stops it instead
            os.kill(int(entrypoint), signal.SIGUSR1)
        except OSError:  # the entrypoint is gone: nothing left to stop
            pass


class TrainerExit(SystemExit):
    """Raised to end the process with a contract exit code and a one-line reason."""

    def __init__(self, code: ExitCode, reason: str) -> None:
        super().__init__(int(code))
        self.exit_code = code
        self.reason = reason
