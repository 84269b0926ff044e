"""Where a (re)start's time goes: from the process's creation, or an in-process re-entry of ``train()``, to the end
of its first step, in phases marked by the code that ends them. Reported once per start as one log line on every
rank (``start phases (s): ...``) and, on rank 0 after a fault, in the ledger's ``recovered`` record.

Phases of a new process, in order (each ends where the next begins):

- ``import``: interpreter start, argument parsing and module imports (from the process's creation, read from
  ``/proc``); when a warm standby (``trainer/startup/standby.py``) or a child of the node's fork server
  (``trainer/startup/forkserver.py``) took over, the launched process's start and the handoff (the clock's origin
  is still the launched process's creation);
- ``resources``: device and CUDA context, dataset, metrics and checkpoint manager (``Resources.create``);
- ``layers``: recovery ledger, node health checks, heartbeat client (``resiliency.Layers``);
- ``wrapper``: the in-process Wrapper's stores and monitor process, and the heartbeat connection, until
  ``train()`` is entered;
- ``process_group``: the default process group and the checkpoint manager's own;
- ``model``: model build and sharding, optimizer, data loader;
- ``restore``: ``load_latest`` (whichever tier it reads);
- ``warm`` (a new GPU worker with ``resiliency.start_warmup``): waiting for its warm-up thread to finish
  (``trainer/startup/warmup.py``), where it did not finish beside the phases before;
- ``first_step``: to the end of the first training step after it (the ledger's "first productive step").

An in-process restart begins again at ``train()``'s entry (``process_group`` ... ``first_step``). The ledger adds
what came before the start, so the phases of a ``recovered`` record add up to its ``recovery_s``: in-job,
``before_start`` (the launcher's detection, the stop of the other workers, the rendezvous, the new process);
in-process, ``unwind`` (fault -> its exception has left ``train()``: the attempt's ``finally`` blocks), ``detect``
(-> this rank's abort begins: NVRx's monitor thread hears of it and waits ``resiliency.last_call_wait_s``),
``abort`` (NCCL abort, process groups destroyed), ``wrapper`` (health check, barriers, garbage collection, until
the Wrapper calls the restartable function again) and ``reconnect`` (the heartbeat client's reconnection to the
rank monitor, until ``train()`` is entered again).

Standard library only: imported before torch so the import phase can be measured.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time
from typing import Any

STANDBY_DIR_ENV = "TRAINER_STANDBY_DIR"
"""Exported by ``entrypoint.sh`` when ``TRAINER_STANDBY`` is on: where the standbys listen
(``trainer/startup/standby.py``)."""
FORKSERVER_DIR_ENV = "TRAINER_FORKSERVER_DIR"
"""Exported by ``entrypoint.sh`` when ``TRAINER_FORKSERVER`` is on: where the node's fork server listens
(``trainer/startup/forkserver.py``), one per node (under the node's own job directory)."""
FORKSERVER_SOCKET = "forkserver.sock"
FORKSERVER_PID_ENV = "TRAINER_FORKSERVER_PID"
"""The fork server's pid (``entrypoint.sh``): a worker launched while it imports waits for it while it lives."""
FIRST_STEP_MARKER = "first-step-{rank}"
"""Written by a worker at the end of its first step (its command line and working directory, as JSON): the standby
server may now warm a replacement for it, configured from that record (``trainer/startup/warmup.py``)."""

PHASES = ("import", "resources", "layers", "wrapper", "process_group", "model", "restore", "warm", "first_step")


def process_start_time() -> float:
    """Wall-clock time this process was created (10 ms resolution, from ``/proc``); now when unreadable."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the command name may contain spaces
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 (starttime), counted after ')'
        return time.time() - max(0.0, age)
    except (OSError, ValueError, IndexError):
        return time.time()


class StartClock:
    """Phases of this process's current start; one per process (``CLOCK``)."""

    def __init__(self, origin: float | None = None) -> None:
        self.origin = process_start_time() if origin is None else origin
        """When this start began: the process's creation, or the in-process re-entry of ``train()``."""
        self._last = self.origin
        self._phases: dict[str, float] = {}
        self._entered_train = False
        self.reentry = False
        """This start is an in-process restart (``train()`` entered again in the same process)."""
        self.marks: dict[str, float] = {}
        """Wall times of the named moments of an in-process restart (see ``note``)."""

    def mark(self, phase: str) -> None:
        """The phase ``phase`` ends now (a phase marked twice adds up)."""
        now = time.time()
        self._phases[phase] = self._phases.get(phase, 0.0) + now - self._last
        self._last = now

    def entered_train(self) -> None:
        """``train()`` begins: ends the ``wrapper`` phase of a new process; an in-process restart's start begins."""
        if self._entered_train:
            self.origin = self._last = time.time()
            self._phases, self.reentry = {}, True
        else:
            self.mark("wrapper")
        self._entered_train = True

    def note(self, moment: str) -> None:
        """A moment of an in-process restart happens now, in order: ``left_train`` (an exception leaves
        ``train()``), ``abort_began`` and ``abort_ended`` (NVRx's abort), ``called_again`` (the Wrapper calls the
        restartable function). Taken with the phases (``take_marks``)."""
        self.marks[moment] = time.time()

    def take_marks(self) -> dict[str, float]:
        marks, self.marks = self.marks, {}
        return marks

    @property
    def last_mark(self) -> float:
        """Wall time of the latest phase's end (after ``take``: the end of the start's first step)."""
        return self._last

    def take(self) -> dict[str, float] | None:
        """This start's phases in seconds (and ``total``) once, at the end of its first step; None afterwards."""
        if not self._phases:
            return None
        phases = {name: round(seconds, 3) for name, seconds in self._phases.items()}
        phases["total"] = round(self._last - self.origin, 3)
        self._phases = {}
        return phases


CLOCK = StartClock()


FROZEN_MODULES: set[str] = set()
"""``sys.modules`` when ``freeze_collector`` ran."""


def freeze_collector() -> None:
    """``gc.freeze()``: what exists now (the imported modules, this process's resources) is never scanned again by a
    full collection, which NVRx runs before every in-process restart (``while gc.collect()``)."""
    FROZEN_MODULES.update(sys.modules)
    gc.freeze()


def unfrozen_summary(top: int = 6) -> str:
    """How many objects a full collection scans (tracked outside the frozen set) and which top-level packages were
    imported since the freeze (their objects are among them), for the log at the end of a start's first step."""
    counts: dict[str, int] = {}
    for name in set(sys.modules) - FROZEN_MODULES:
        package = name.split(".", 2)
        key = ".".join(package[:2]) if package[0] == "torch" else package[0]
        counts[key] = counts.get(key, 0) + 1
    packages = ", ".join(f"{k} ({n})" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])[:top]) or "none"
    objects = gc.get_objects()
    kinds: dict[str, int] = {}
    for obj in objects:
        kind = type(obj)
        name = f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else kind.__qualname__
        kinds[name] = kinds.get(name, 0) + 1
    common = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])[:top])
    return (f"{len(objects)} objects outside the frozen set (most: {common}); modules imported since the freeze: "
            f"{packages}")


def warm_cuda(device: str, local_rank: int) -> None:
    """Import torch, then create this rank's CUDA context in a background thread while the main thread imports the
    rest (the trainer, FSDP, NVRx): the context is created inside a tensor allocation, which releases the GIL.
    ``device``: ``train.device``; nothing happens for ``cpu``, or without a GPU for this rank (``select_device``
    then reports it)."""
    import threading

    import torch

    if device == "cpu":
        return

    def create() -> None:
        try:
            if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
                torch.empty(1, device=torch.device("cuda", local_rank))
        except Exception:  # noqa: BLE001 - the main thread's device selection reports any problem
            pass

    threading.Thread(target=create, name="cuda-context", daemon=True).start()


def report(log: logging.Logger, phases: dict[str, Any], reentry: bool, marks: dict[str, float]) -> None:
    """The one log line of a start: each phase, then the total (and an in-process restart's abort, from ``marks``)."""
    parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in phases.items() if name != "total")
    since = "the in-process re-entry of train()" if reentry else "process start"
    began, ended = marks.get("abort_began"), marks.get("abort_ended")
    before = f" (the in-process abort before it took {ended - began:.2f} s)" if began and ended else ""
    log.info("start phases (s): %s; %.2f s from %s to the end of the first step%s", parts, phases["total"], since,
             before)


def first_step_done(snapshot_files: list[str] | tuple[str, ...] = ()) -> None:
    """This worker finished its first step: the standby server (``trainer/startup/standby.py``) may now warm a
    replacement for it (``first-step-<LOCAL_RANK>`` in ``$TRAINER_STANDBY_DIR``, holding this worker's command
    line, working directory, world size and node-local snapshot slot files as JSON); nothing without that directory."""
    directory = os.environ.get(STANDBY_DIR_ENV)
    if not directory:
        return
    path = os.path.join(directory, FIRST_STEP_MARKER.format(rank=os.environ.get("LOCAL_RANK", "0")))
    # what the standby warms for (warmup.py) and the slots it page-locks ahead (checkpoint/premap.py)
    record = json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "world_size": int(os.environ.get("WORLD_SIZE", "1")),
                         "snapshot_files": list(snapshot_files)})
    try:  # FT: a standby for the next in-job restart is warmed only now, after this start-up and restore
        with open(f"{path}.{os.getpid()}", "w") as f:
            f.write(record)
        os.replace(f"{path}.{os.getpid()}", path)
    except OSError:  # the job is ending (its directory is gone): no standby needed
        pass
