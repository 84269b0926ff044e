"""Checkpoint exceptions. All are permanent (exit CHECKPOINT_ERROR): retrying cannot help until an operator acts."""

from __future__ import annotations

import errno

from trainer.exitcodes import ExitCode

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# torch's zip writer reports a failed write as an "enforce fail" RuntimeError without the errno; these are the
# messages PyTorchStreamWriter raises when the underlying write came up short.
_TORCH_WRITE_FAILURES = ("unexpected pos", "PytorchStreamWriter failed writing", "file write failed")


class CheckpointError(RuntimeError):
    """No valid checkpoint can be loaded, or a checkpoint cannot be written. Permanent: retrying cannot help."""

    exit_code = ExitCode.CHECKPOINT_ERROR


class CheckpointStorageError(CheckpointError):
    """The checkpoint directory is unusable (missing, not a directory, read-only, full) or a write failed;
    the committed checkpoints are intact."""


def is_disk_full(exc: BaseException | None = None, errno_value: int | None = None, message: str = "") -> bool:
    """Whether a failed write ran out of space: ENOSPC/EDQUOT anywhere in the cause chain, or torch's zip
    writer failing mid-file (it drops the errno; the caller confirms with the free space it measures)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if getattr(exc, "errno", None) in DISK_FULL_ERRNOS:
            return True
        message += " " + str(exc)
        exc = exc.__cause__ or exc.__context__
    return errno_value in DISK_FULL_ERRNOS or any(marker in message for marker in _TORCH_WRITE_FAILURES)
