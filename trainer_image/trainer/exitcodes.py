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


def is_retryable(code: int) -> bool:
    """True when the cluster layer (PyTorchJob ExitCode policy, pipeline retry) should restart."""
    return code >= 128


class TrainerExit(SystemExit):
    """Raised to end the process with a contract exit code and a one-line reason."""

    def __init__(self, code: ExitCode, reason: str) -> None:
        super().__init__(int(code))
        self.exit_code = code
        self.reason = reason
