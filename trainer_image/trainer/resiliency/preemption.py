"""SIGTERM in a worker: a preemption's final checkpoint on a step every rank agrees on, or, when ft_launcher stops the
worker group for an in-job restart, an exit at once, wherever the main thread is.

``entrypoint.sh`` tells the two apart: it writes ``PREEMPTING_MARKER`` in ``TRAINER_EXIT_CODE_DIR`` before it forwards a
SIGTERM the pod got; a worker that gets SIGTERM without it is being stopped by its launcher (a peer died, a node joined,
the rendezvous was lost), and a final checkpoint would wait for that peer until the launcher's stop timeout.

Python runs a signal handler in the main thread between two bytecodes only: a main thread blocked in C++ (the
process group's store waiting for a rank that died, a collective, a store call) runs it when the call returns, so a
worker stopped during its start would wait for the launcher's ``--term-timeout`` and its SIGKILL before the job
could meet again (``tests/resiliency/drill_kill_anytime.py`` finds such moments). The signal's arrival is also
written to a pipe (``signal.set_wakeup_fd``, from the C-level handler), which a thread reads: a stop for an in-job
restart exits from there at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from trainer.exitcodes import (
    EXIT_CODE_DIR_ENV,
    PREEMPTING_MARKER,
    ExitCode,
    ending_code,
    exit_being_recorded,
    record_exit,
)

log = logging.getLogger("trainer.resiliency")


def stopped_for_a_restart() -> bool:
    """Whether a SIGTERM that reached this worker is its launcher's stop (no ``PREEMPTING_MARKER``) under
    ``entrypoint.sh``."""
    exit_dir = os.environ.get(EXIT_CODE_DIR_ENV)
    return bool(exit_dir) and not os.path.exists(os.path.join(exit_dir, PREEMPTING_MARKER))


def _forget_the_watch(read: int, write: int) -> None:
    """In a child forked from a worker (NVRx's in-process monitor is one): a signal it gets must not be written to the
    worker's pipe, where the worker's watch would take it for its own."""
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # not the child's main thread
        pass
    for fd in (read, write):
        try:
            os.close(fd)
        except OSError:
            pass


def exit_for_the_restart() -> None:
    log.warning("SIGTERM from ft_launcher (in-job restart): exiting now")
    code = record_exit(ExitCode.TERMINATED)
    logging.shutdown()
    os._exit(code)


class _FlagReduction:
    """One step's preemption flags, MAX-reduced over the ranks without a host sync: an async all-reduce whose
    result (CUDA) is copied to pinned host memory behind an event. Read a step later, when the GPU is long past
    it: the host waits for nothing while the GPU still has the next step queued."""

    def __init__(self, requested: bool, device: torch.device) -> None:
        self.flag = torch.full((1,), 1.0 if requested else 0.0, device=device)  # a fill: no host-to-device copy
        self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, async_op=True)
        self.host: torch.Tensor | None = None
        self.event: Any = None
        if device.type == "cuda":
            self.work.wait()  # NCCL: only the current stream waits for the reduction
            self.host = torch.empty(1, pin_memory=True)
            self.host.copy_(self.flag, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def any_requested(self) -> bool:
        if self.event is None:  # gloo: the CPU tensor is the result once the work is done
            self.work.wait()
            return bool(self.flag.item() > 0)
        self.event.synchronize()
        return bool(self.host.item() > 0)  # type: ignore[union-attr]


class Preemption:
    """SIGTERM: finish the step, write a synchronous checkpoint, exit PREEMPTED within the grace period.

    Ranks agree on the step (the launcher's forwarded SIGTERM reaches ranks at slightly different times): each
    step's flags are MAX-reduced without waiting and read at the end of the next step, so every rank stops on the
    same step, one step after the signal reached the last rank (with one rank: the step it arrived in). The final
    save therefore starts at most two steps after the signal; ``resiliency.preemption_grace_s`` must cover that
    and the save. A watchdog ends the process when the grace period is over: PREEMPTED if the final checkpoint
    was committed, else TERMINATED (both retryable).
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.requested = False
        self.committed = False
        self.pending: _FlagReduction | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if os.environ.get(EXIT_CODE_DIR_ENV):  # under entrypoint.sh: a stop for an in-job restart can come
            read, write = os.pipe()
            os.set_blocking(write, False)
            signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            os.register_at_fork(after_in_child=lambda: _forget_the_watch(read, write))
            threading.Thread(target=self._watch, args=(read,), name="sigterm-watch", daemon=True).start()

    def _watch(self, read: int) -> None:
        """Signals as the C-level handler writes them: a launcher's stop exits here, whatever the main thread does."""
        while True:
            if signal.SIGTERM in os.read(read, 64) and self._stop_for_a_restart():
                exit_for_the_restart()

    def _stop_for_a_restart(self) -> bool:
        """Whether a SIGTERM now is the launcher's stop of a worker that is not already ending (its own exit being
        recorded or done, or a preemption under way)."""
        return not exit_being_recorded() and ending_code() is None and not self.requested and stopped_for_a_restart()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if exit_being_recorded():  # this handler interrupted the process's own exit: let that finish
            return
        ending = ending_code()
        if ending is not None:  # already on its way out after its own error: end now, with that code
            logging.shutdown()
            os._exit(ending)
        if self.requested:
            return
        if stopped_for_a_restart():  # the restart resumes from the last checkpoint (module docstring)
            exit_for_the_restart()
        self.requested = True
        log.warning("SIGTERM: final checkpoint at the end of this step (grace %.0f s)", self.grace_s)
        threading.Thread(target=self._deadline, name="preemption-deadline", daemon=True).start()

    def _deadline(self) -> None:
        time.sleep(self.grace_s)
        code = ExitCode.PREEMPTED if self.committed else ExitCode.TERMINATED
        log.error("preemption grace of %.0f s is over: exiting %s", self.grace_s, code.name)
        code = record_exit(code)  # the main thread's exit, when it got there first
        logging.shutdown()
        os._exit(int(code))

    def agreed(self, device: torch.device, world_size: int) -> bool:
        """Whether every rank stops after this step (called once per step on every rank)."""
        if world_size == 1:
            return self.requested
        previous, self.pending = self.pending, _FlagReduction(self.requested, device)
        if previous is not None and previous.any_requested():
            self.requested = True
            return True
        return False

    def restart(self) -> None:
        """A new attempt (in-process restart): a reduction left by the previous one belongs to its process group."""
        self.pending = None

    def drain(self) -> None:
        """Training is over: wait for the last step's reduction before the process group goes."""
        if self.pending is not None:
            self.pending.any_requested()
            self.pending = None
