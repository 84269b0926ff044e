"""A local rank's GPU passing from a dead worker to the next one: no worker allocates on device memory its
predecessor still holds. That is this module's one concern.

A worker killed with a large allocation frees its device memory seconds after it dies: the kernel first unmaps its
page-locked host memory (the snapshot slots, tens of GB), and the device memory goes only when the last file
descriptor of ``/dev/nvidia*`` that the process opened is closed, by it or by any child that inherited it. A warm
standby (``trainer/startup/standby.py``) takes over within milliseconds; its first allocation then meets a full device
(an ``OutOfMemoryError`` with the dead worker's tens of GiB still listed), and so may a fresh worker on a fast start.

- **What the job needs** (``NeedRecord``): a worker notes its device's peak reserved memory (the caching allocator's,
  the snapshot's device staging buffer included) in ``$TRAINER_DEVICE_DIR/need-<local rank>.json`` after its first
  step and whenever that peak grows. ``entrypoint.sh`` makes the directory per pod: it outlives every worker.
- **The wait** (``wait_for_predecessor``): a worker that takes over a local rank (a standby or a fresh process)
  waits until the device's free memory (NVML, which needs no CUDA context; else the CUDA runtime's, where this process
  has one), plus what this process itself caches, covers that need; a worker re-entering ``train()`` after an
  in-process restart too. A new worker waits in two stages: for ``CONTEXT_ROOM`` before it makes its CUDA context,
  and for the whole need before its model is built. Its start until the model (recovery layers, in-process Wrapper,
  process group) then runs while the kernel still releases the dead worker's memory, which its proxy reported as
  the exit began (``trainer/startup/handoff.py``). One line says how long it waited and why; past
  ``resiliency.device_wait_s`` it gives up with one line and exits ``UNHEALTHY_NODE``: something other than the
  job holds the device, and a new pod is what helps.
- **Children let go** (``release_inherited_device_files``): a child forked from a worker (NVRx's in-process monitor
  process, a data or checkpoint helper) has its inherited ``/dev/nvidia*`` descriptors pointed at ``/dev/null`` right
  after the fork, so it never keeps the worker's device memory alive after the worker dies (NVRx's monitor lives
  on for seconds, up to its store's timeout, after its worker is killed). A forked child cannot use CUDA anyway.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("trainer.resiliency")

DEVICE_DIR_ENV = "TRAINER_DEVICE_DIR"
"""Exported by ``entrypoint.sh``: a directory of the pod that outlives its workers, for ``NeedRecord``."""
DEVICE_FILE_PREFIXES = ("/dev/nvidia",)
"""The device files a forked child lets go of: the control device, each GPU, UVM, and their kin."""
POLL_S = 0.05
GROWTH_BYTES = 256 << 20
"""A peak that grew by less than this since the last record is not written again."""
GIB = 2**30
CONTEXT_ROOM = 3 * GIB
"""What a new worker needs free before its first stage (``wait_for_predecessor``'s ``at_most``): a CUDA context,
cuBLAS's workspaces and NCCL's buffers, with room to spare."""


@dataclass
class NeedRecord:
    """``need-<local rank>.json`` in ``TRAINER_DEVICE_DIR``: the device memory the job's worker of one local rank
    took at its peak (bytes reserved by the caching allocator), written by that worker, read by its successor."""

    directory: Path
    local_rank: int
    written: int = 0

    @classmethod
    def from_environ(cls, local_rank: int) -> "NeedRecord | None":
        directory = os.environ.get(DEVICE_DIR_ENV)
        return cls(Path(directory), local_rank) if directory else None

    @property
    def path(self) -> Path:
        return self.directory / f"need-{self.local_rank}.json"

    def read(self) -> int:
        """The recorded need in bytes; 0 when no worker of this local rank recorded one."""
        try:
            return int(json.loads(self.path.read_text())["peak_reserved"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def note(self, peak_reserved: int, total: int) -> bool:
        """Record ``peak_reserved`` when it grew by ``GROWTH_BYTES`` since the last note (atomic rename); True when
        written."""
        if peak_reserved < self.written + GROWTH_BYTES:
            return False
        temporary = self.path.with_suffix(f".{os.getpid()}.tmp")
        try:
            temporary.write_text(json.dumps({"peak_reserved": int(peak_reserved), "total": int(total),
                                             "pid": os.getpid(), "time": time.time()}))
            os.replace(temporary, self.path)
        except OSError as exc:  # a record not written only costs the next worker its wait
            log.warning("device memory need not recorded in %s: %s", self.path, exc)
            return False
        self.written = peak_reserved
        return True


def note_peak(record: "NeedRecord | None", device: object) -> None:
    """After a step on ``device`` (a ``torch.device``): its peak reserved memory into ``record`` where it grew."""
    if record is None or getattr(device, "type", "") != "cuda":
        return
    import torch

    record.note(torch.cuda.max_memory_reserved(device), torch.cuda.get_device_properties(device).total_memory)


# --- free memory ----------------------------------------------------------------------------------------------
def nvml_memory(index: int) -> Callable[[], Any] | None:
    """NVML's memory reading (``.free``, ``.total`` in bytes) of CUDA device ``index`` (as this process numbers it),
    which makes no CUDA context: a fresh worker can ask while its predecessor still fills the device, and a standby
    before it makes its own. None where NVML is unavailable."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = _nvml_handle(pynvml, index)
    except Exception as exc:  # noqa: BLE001 - no NVML library, no driver, an unknown device: the caller falls back
        log.debug("NVML unavailable for device %d: %s", index, exc)
        return None
    return lambda: pynvml.nvmlDeviceGetMemoryInfo(handle)


def nvml_free(index: int) -> Callable[[], int] | None:
    """Free bytes of CUDA device ``index`` through NVML (``nvml_memory``); None where NVML is unavailable."""
    memory = nvml_memory(index)
    return None if memory is None else lambda: int(memory().free)


def _nvml_handle(pynvml: object, index: int) -> object:
    """NVML's handle of this process's CUDA device ``index``: through CUDA_VISIBLE_DEVICES (indices or UUIDs)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return pynvml.nvmlDeviceGetHandleByIndex(index)  # type: ignore[attr-defined]
    entry = visible[index]
    if entry.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))  # type: ignore[attr-defined]
    return pynvml.nvmlDeviceGetHandleByUUID(entry)  # type: ignore[attr-defined]


def cuda_free(index: int) -> Callable[[], int] | None:
    """Free bytes through the CUDA runtime, only where this process already has a context (a warm standby): making
    one on a full device fails."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return lambda: int(torch.cuda.mem_get_info(index)[0])


# --- the wait -------------------------------------------------------------------------------------------------
class DeviceHeld(RuntimeError):
    """The device did not free the memory the job needs within the bound."""


def wait_for_memory(need: int, free: Callable[[], int], held_by_me: int = 0, bound_s: float = 120.0,
                    label: str = "the device", why: str = "", holders: Callable[[], str] | None = None) -> float:
    """Wait until ``free() + held_by_me`` covers ``need`` bytes; returns the seconds waited. Says so in one line
    when it waited, with who held the device when the wait began (``holders``, e.g. ``device_holders``); raises
    ``DeviceHeld`` (its message one line) when ``bound_s`` passed first."""
    began = time.monotonic()
    available = free() + held_by_me
    if available >= need:
        return 0.0
    first = available
    held = holders() if holders is not None else ""
    if held:
        why = f"{why or 'held by another process'}; at first {held}"
    while time.monotonic() - began < bound_s:
        time.sleep(POLL_S)
        available = free() + held_by_me
        if available >= need:
            waited = time.monotonic() - began
            log.warning("waited %.2f s for %s's memory: %.1f GiB free at first, %.1f GiB now; the job needs %.1f GiB "
                        "(%s)", waited, label, first / GIB, available / GIB, need / GIB, why or "held by another process")
            return waited
    raise DeviceHeld(f"{label} still has only {available / GIB:.1f} GiB free after {bound_s:g} s (resiliency."
                     f"device_wait_s); the job needs {need / GIB:.1f} GiB ({why or 'held by another process'}): "
                     "something outside the job holds it, replace the node")


def wait_for_predecessor(local_rank: int, bound_s: float, why: str, at_most: int | None = None) -> float:
    """Before a worker's allocations on ``local_rank``'s GPU (a new process taking over the local rank, or an
    in-process restart re-entering ``train()``): waits for the memory its predecessor recorded (``NeedRecord``), or
    for ``at_most`` bytes of it (a first stage), the memory this process caches counting as its own (a standby's, the
    failed attempt's). Returns the seconds waited (0: nothing recorded, nothing to wait for)."""
    record = NeedRecord.from_environ(local_rank)
    need = record.read() if record is not None else 0
    if at_most is not None:
        need = min(need, at_most)
    if need <= 0:
        return 0.0
    free = nvml_free(local_rank) or cuda_free(local_rank)
    if free is None:
        log.warning("cannot read cuda:%d's free memory (no NVML, no CUDA context yet): starting without waiting for "
                    "its predecessor's %.1f GiB", local_rank, need / GIB)
        return 0.0
    import torch

    mine = torch.cuda.memory_reserved(local_rank) if torch.cuda.is_initialized() else 0
    return wait_for_memory(need, free, held_by_me=mine, bound_s=bound_s, label=f"cuda:{local_rank}", why=why,
                           holders=lambda: device_holders(local_rank))


def device_holders(index: int) -> str:
    """The processes NVML lists on CUDA device ``index`` with the memory each holds and its state here (``exiting``:
    killed, its memory still being released; ``exited``: a zombie its parent has not reaped; ``not here``: gone, or
    in another pid namespace), largest first: whom a takeover waits for. Empty where NVML cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
        listed = pynvml.nvmlDeviceGetComputeRunningProcesses(_nvml_handle(pynvml, index))
    except Exception as exc:  # noqa: BLE001 - no NVML, no permission: the line goes without it
        log.debug("NVML cannot list device %d's processes: %s", index, exc)
        return ""
    if not listed:
        return "NVML listed no process on it"
    parts = []
    for proc in sorted(listed, key=lambda p: -(p.usedGpuMemory or 0)):
        used = f"{proc.usedGpuMemory / GIB:.1f} GiB" if proc.usedGpuMemory else "memory not reported"
        parts.append(f"pid {proc.pid} ({used}, {process_state(proc.pid)})")
    return "held by " + ", ".join(parts)


_STATES = {"R": "running", "S": "sleeping", "D": "in the kernel", "Z": "exited", "X": "exited", "T": "stopped",
           "t": "stopped"}


def process_state(pid: int) -> str:
    """A few words for ``pid``'s state in ``/proc``: this process; exiting (a SIGKILL pending); exited (a zombie:
    its leader is gone, though its other threads may still be tearing down, counted); or its scheduler state."""
    if pid == os.getpid():
        return "this process"
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":" in line)
    except (OSError, ValueError):
        return "not here"
    state = stat[stat.rindex(")") + 2:].split()[0]
    pending = int(status.get("SigPnd", "0").strip() or "0", 16) | int(status.get("ShdPnd", "0").strip() or "0", 16)
    word = "exiting" if state not in "ZX" and pending & (1 << (signal.SIGKILL - 1)) else _STATES.get(state, state)
    threads = int(status.get("Threads", "1").strip() or "1")
    return f"{word}, {threads} threads" if threads > 1 else word


# --- children -------------------------------------------------------------------------------------------------
def release_inherited_device_files(prefixes: tuple[str, ...] = DEVICE_FILE_PREFIXES) -> int:
    """Point every descriptor of this process open on a file under ``prefixes`` at ``/dev/null`` (in a forked
    child: ``install``); returns how many. ``/dev/null`` rather than a close: the CUDA library copied into the child
    still believes in those numbers, and a closed number may be reused for another file."""
    released = 0
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    null = -1
    for name in fds:
        try:
            fd = int(name)
            target = os.readlink(f"/proc/self/fd/{fd}")
        except (ValueError, OSError):
            continue
        if not target.startswith(prefixes):
            continue
        if null < 0:
            null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        try:
            os.dup2(null, fd, inheritable=False)
            released += 1
        except OSError:
            pass
    if null >= 0:
        os.close(null)
    return released


_installed = False


def install(prefixes: tuple[str, ...] = DEVICE_FILE_PREFIXES) -> None:
    """From now on, every child forked from this process lets go of the device files it inherited (``prefixes``).
    Once per process (a worker, before anything forks)."""
    global _installed
    if not _installed:
        os.register_at_fork(after_in_child=lambda: release_inherited_device_files(prefixes))
        _installed = True
