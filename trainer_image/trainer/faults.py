"""Deterministic fault injection for resiliency tests and drills (off by default).

``--resiliency.faults=1:5:exception,0:8:sigkill`` fires fault ``kind`` on global rank ``rank`` at the start
of step ``step`` (before its forward pass, so that step is not completed). Each fault fires **once per run
directory**: a marker file ``<run_dir>/faults/<rank>-<step>-<kind>`` is written (and fsynced) *before* the
fault fires, so neither an in-process restart, an in-job restart nor a relaunch fires it again.

Kinds:

- ``exception``: raise ``InjectedFault`` (a ``RuntimeError``): recoverable in-process.
- ``hang``: sleep forever in a ``time.sleep`` loop; the GIL is released, so NVRx can interrupt it.
- ``hang_gil``: sleep forever inside a C call made with the GIL held (``ctypes.PyDLL``), with SIGTERM and
  SIGINT blocked: models a rank stuck in a driver call. Only termination (hard timeout, heartbeat
  timeout) ends it.
- ``sigkill``: ``SIGKILL`` this process.
- ``oom``: exit as the kernel OOM killer would: log, then ``SIGKILL`` self (exit status 137 / -9).
- ``sigterm``: preemption drill: ``SIGTERM`` the pod's entrypoint (``TRAINER_ENTRYPOINT_PID``, as a
  Kubernetes eviction does; it forwards to ft_launcher, which forwards to every worker), else the launcher
  (the parent under torchrun), else this process.
- ``node_lost``: the rank's whole node goes, as a drained node takes its pod: the node-local snapshot directory
  (``TRAINER_SNAPSHOT_DIR``, the pod's memory) is removed, then the pod's entrypoint (``TRAINER_ENTRYPOINT_PID``),
  its launcher, every worker and helper below it and this process are SIGKILLed at once. Under a plain launcher
  (torchrun), the launcher and everything below it. A replacement pod (the cluster's, or the local backend's
  relaunch of that node) joins the job's rendezvous.
- ``data_error``: raise a ``ShardError``, as a corrupt shard found mid-run would: a permanent exit (3), which ends
  every node of the job after one attempt.
- ``corrupt_checkpoint``: overwrite the middle of the largest file of the newest committed checkpoint
  with random bytes (the next load must detect it and fall back), then continue training.
- ``slow:<factor>`` (``1:5:slow:0.5``): a straggler drill. From that step on, for the life of the process, the
  rank sleeps ``factor`` times the duration of each timed part of its step (data, forward/backward, optimizer;
  ``slowed``) inside it, so its step takes ``1 + factor`` times as long as a rank's doing the same work, the way a
  throttled device would; numerics are unchanged. On CUDA the device is synchronized first, so the sleep is a
  fraction of the device time too. A relaunch of the run directory (after an eviction) is not slowed again.

Only the standard library is imported at module level; ``trainer.config`` parses the fault specs.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

from trainer.config import KINDS, ConfigError, FaultSpec, parse_faults  # noqa: F401 - re-exported
from trainer.exitcodes import ENTRYPOINT_PID_ENV

log = logging.getLogger(__name__)

MARKER_DIR = "faults"
_CORRUPT_BYTES = 4096


class InjectedFault(RuntimeError):
    """The ``exception`` fault kind."""


class FaultInjector:
    """Fires this rank's faults. ``on_fire(spec)`` runs after the marker is written, before the fault."""

    def __init__(
        self,
        specs: list[FaultSpec],
        run_dir: str | Path,
        rank: int,
        checkpoint_dir: str | Path,
        on_fire: Callable[[FaultSpec], None] = lambda spec: None,
    ) -> None:
        self.specs = {s.step: s for s in specs if s.rank == rank}
        self.marker_dir = Path(run_dir) / MARKER_DIR
        self.checkpoint_dir = Path(checkpoint_dir)
        self.on_fire = on_fire
        self.slowdown = 0.0  # set by a ``slow`` fault: the fraction of each timed part of the step slept

    def __bool__(self) -> bool:
        return bool(self.specs)

    def maybe_fire(self, step: int) -> None:
        spec = self.specs.get(step)
        if spec is None or self.fired(spec):
            return
        self._write_marker(spec)
        log.warning("injecting fault %s at step %d (pid %d)", spec.kind, step, os.getpid())
        self.on_fire(spec)
        FIRE[spec.kind](self, spec)

    @contextlib.contextmanager
    def slowed(self) -> Iterator[None]:
        """Around a timed part of the step: once a ``slow`` fault fired, sleep ``factor`` times its duration."""
        if not self.slowdown:
            yield
            return
        start = time.perf_counter()
        yield
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # a drill: the device time of the part counts too
        time.sleep(self.slowdown * (time.perf_counter() - start))

    def fired(self, spec: FaultSpec) -> bool:
        return (self.marker_dir / spec.marker_name).exists()

    def _write_marker(self, spec: FaultSpec) -> None:
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        path = self.marker_dir / spec.marker_name
        with open(path, "w") as f:
            f.write(f"{time.time():.3f} pid={os.getpid()}\n")
            f.flush()
            os.fsync(f.fileno())
        dir_fd = os.open(self.marker_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    # --- the faults --------------------------------------------------------------------------------------
    def _exception(self, spec: FaultSpec) -> None:
        raise InjectedFault("injected fault: exception")

    def _hang(self, spec: FaultSpec) -> None:
        while True:
            time.sleep(0.1)

    def _hang_gil(self, spec: FaultSpec) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held during the call
        while True:
            libc.sleep(3600)

    def _sigkill(self, spec: FaultSpec) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def _oom(self, spec: FaultSpec) -> None:
        log.error("Out of memory: Killed process %d (python) (injected)", os.getpid())
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def _sigterm(self, spec: FaultSpec) -> None:
        if os.environ.get(ENTRYPOINT_PID_ENV):  # the pod's PID 1, as a Kubernetes eviction does
            target = int(os.environ[ENTRYPOINT_PID_ENV])
        elif "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun / ft_launcher forward it to every worker
            target = os.getppid()
        else:
            target = os.getpid()
        os.kill(target, signal.SIGTERM)

    def _node_lost(self, spec: FaultSpec) -> None:
        import shutil

        from trainer.checkpoint import reaper
        from trainer.checkpoint.slots import SNAPSHOT_DIR_ENV

        memory = os.environ.get(SNAPSHOT_DIR_ENV)
        if memory:  # the pod's memory: its snapshots and the semaphores its processes recorded there
            reaper.reap(Path(memory), files=True, node_gone=True)
            shutil.rmtree(memory, ignore_errors=True)
        root = int(os.environ.get(ENTRYPOINT_PID_ENV) or os.getppid())
        for handler in logging.getLogger().handlers:
            handler.flush()
        for pid in [root, *process_tree(root)]:  # at once: nothing of the node outlives it to notice the others
            if pid != os.getpid():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def _data_error(self, spec: FaultSpec) -> None:
        from trainer.data import ShardError

        raise ShardError(f"injected fault: a corrupt token shard found at step {spec.step}")

    def _corrupt_checkpoint(self, spec: FaultSpec) -> None:
        target = corrupt_newest_checkpoint(self.checkpoint_dir)
        log.warning("corrupted checkpoint file %s", target)

    def _slow(self, spec: FaultSpec) -> None:
        self.slowdown = spec.factor
        log.warning("rank %d is a straggler from now on: it sleeps %.0f %% of each timed part of its step",
                    spec.rank, 100 * spec.factor)


FIRE: dict[str, Callable[[FaultInjector, FaultSpec], None]] = {
    "exception": FaultInjector._exception,
    "hang": FaultInjector._hang,
    "hang_gil": FaultInjector._hang_gil,
    "sigkill": FaultInjector._sigkill,
    "oom": FaultInjector._oom,
    "sigterm": FaultInjector._sigterm,
    "corrupt_checkpoint": FaultInjector._corrupt_checkpoint,
    "slow": FaultInjector._slow,
    "node_lost": FaultInjector._node_lost,
    "data_error": FaultInjector._data_error,
}
assert set(FIRE) == set(KINDS)


def process_tree(root: int) -> list[int]:
    """Every live descendant of ``root`` (Linux ``/proc``), whatever session it runs in."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
    found, todo = [], [root]
    while todo:
        parent = todo.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found += children
        todo += children
    return found


def corrupt_newest_checkpoint(checkpoint_dir: Path) -> Path | None:
    """Overwrite bytes in the middle of the largest shard of the newest committed checkpoint.

    Returns the corrupted file, or None when there is no committed checkpoint yet.
    """
    from trainer.checkpoint.layout import committed_steps, step_dir_name  # torch: only when this fault fires

    steps = committed_steps(Path(checkpoint_dir))
    if not steps:
        return None
    step_dir = Path(checkpoint_dir) / step_dir_name(steps[-1])
    files = [f for f in step_dir.rglob("*") if f.is_file() and f.suffix == ".pt"]
    if not files:
        return None
    target = max(files, key=lambda f: f.stat().st_size)
    size = target.stat().st_size
    with open(target, "r+b") as f:
        f.seek(max(0, size // 2 - _CORRUPT_BYTES // 2))
        f.write(os.urandom(min(_CORRUPT_BYTES, size)))
        f.flush()
        os.fsync(f.fileno())
    return target
