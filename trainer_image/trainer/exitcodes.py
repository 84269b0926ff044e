"""The exit-code contract between the trainer and everything that restarts it.

Kubeflow's PyTorchJob with ``restartPolicy: ExitCode`` restarts a pod whose container exits with a code
>= 128 and fails the job for codes 1-127. The pipeline's launcher and its ``set_retry`` follow the same rule,
and so does ``ft_launcher`` (which restarts workers in the job for any failure until ``--max-restarts``).

- **Permanent (1-127)**: retrying cannot help - bad config, bad data, a bug. Nothing retries these.
- **Retryable (>= 128)**: the node or the job's budget failed, not the code - a restart elsewhere or later
  resumes from the latest checkpoint. Codes 128 + N are what the kernel reports for a process killed by
  signal N (137 = SIGKILL/OOM kill, 143 = SIGTERM); ours are chosen above that range so a log line tells
  which one happened.

Use the names, never the numbers.
"""

from __future__ import annotations

import enum


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
    """A health check failed on this node: do not restart here, replace the node/pod."""
    PREEMPTED = 202
    """SIGTERM (preemption, eviction) was handled: a final checkpoint was committed; resume anywhere."""
    RANKS_LOST = 203
    """A peer rank was lost: a collective failed because a peer died or hung (gloo/NCCL error), or the
    in-process layer cannot continue without a terminated rank; the in-job layer (ft_launcher) or the
    cluster restarts the whole group."""


def is_retryable(code: int) -> bool:
    """True when the cluster layer (PyTorchJob ExitCode policy, pipeline retry) should restart."""
    return code >= 128


#: Environment variable naming a directory where each worker records its exit code (file ``rank-<RANK>``
#: holding ``"<TORCHELASTIC_RESTART_COUNT> <code>"``). Set by ``entrypoint.sh``: ``ft_launcher`` itself exits
#: 1 for every failure, so the entrypoint maps the workers' last-attempt codes onto this contract.
EXIT_CODE_DIR_ENV = "TRAINER_EXIT_CODE_DIR"
PREEMPTING_MARKER = "preempting"
"""Created in ``$TRAINER_EXIT_CODE_DIR`` by ``entrypoint.sh`` when the pod itself got SIGTERM (preemption,
eviction) before it forwards the signal. A worker that gets SIGTERM without it is being stopped by ft_launcher
for an in-job restart: it exits at once instead of waiting for a final checkpoint its dead peer never joins."""


def classify(exc: BaseException) -> ExitCode:
    """The contract code for an exception that ended training (the cause chain is searched).

    Permanent: ``ConfigError`` -> CONFIG_ERROR, data ``ShardError`` -> DATA_ERROR, ``CheckpointError`` ->
    CHECKPOINT_ERROR, anything else -> CODE_ERROR. Retryable: ``TrainerExit`` carries its own code; an
    unhealthy node (``health.NodeUnhealthy``) -> UNHEALTHY_NODE; the in-process layer giving up
    (NVRx ``FaultCounterExceeded`` or another ``RestartError``) -> RESTART_BUDGET_EXHAUSTED; a collective
    or store failure caused by a lost peer -> RANKS_LOST.
    """
    chain = _cause_chain(exc)
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
    ("FaultCounterExceeded", ExitCode.RESTART_BUDGET_EXHAUSTED),
    ("RestartError", ExitCode.RESTART_BUDGET_EXHAUSTED),  # any other NVRx Wrapper give-up (barrier timeout ...)
    ("DistError", ExitCode.RANKS_LOST),  # torch.distributed store/network errors: a peer or the store is gone
)
# gloo and NCCL raise plain RuntimeErrors when a peer died or hung; their messages name the transport.
_PEER_LOST_MARKERS = ("/gloo/", "NCCL", "Connection reset by peer", "Connection closed by peer")


def _cause_chain(exc: BaseException) -> list[BaseException]:
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


def record_exit(code: int) -> None:
    """Write this worker's exit code where ``entrypoint.sh`` reads it (no-op outside the entrypoint)."""
    import os

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
        pass


class TrainerExit(SystemExit):
    """Raised to end the process with a contract exit code and a one-line reason."""

    def __init__(self, code: ExitCode, reason: str) -> None:
        super().__init__(int(code))
        self.exit_code = code
        self.reason = reason
