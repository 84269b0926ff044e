"""What this job leaves in the node's memory (``/dev/shm``) once its processes are gone.

Two kinds of entries outlive a process that is killed:

- its snapshot slots (``slots``): two copies of the rank's state. They are meant to outlive a worker that a
  launcher restarts in place (the node-local tier); otherwise they go when the job is over, however it ends
  (``restart_in_place_expected``).
- named POSIX semaphores (``sem.mp-*``) and shared memory that ``multiprocessing`` creates for spawned processes
  (the checkpoint writer's queues: 19 semaphores). Their names are unlinked by the process's finalizers, or by
  its ``resource_tracker`` process when it dies; a launcher that SIGKILLs the worker's whole process group kills
  the tracker too, and the names stay until the node reboots.

So every process of the job records the names it creates, with its pid and rank, in ``owner-<pid>`` in the job's
snapshot directory (``record``). A worker starting up removes what dead owners recorded (``reap``: the in-job
restart path), the end of the job removes the rest, and ``entrypoint.sh`` does the same when it exits. Only names
a process of this job recorded are ever removed: never another job's entries.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from multiprocessing import resource_tracker
from pathlib import Path

from trainer.checkpoint.slots import SNAPSHOT_DIR_ENV

log = logging.getLogger(__name__)

OWNER_PREFIX = "owner-"
SHM_ROOT = Path("/dev/shm")
"""Where Linux (glibc) keeps named semaphores (``sem.<name>``) and POSIX shared memory (``<name>``)."""
_RECORDED_TYPES = ("semaphore", "shared_memory")


class _Record:
    """This process's ``owner-<pid>`` file: its rank and the names it holds now (rewritten on each change)."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.rank = 0
        self.names: dict[str, str] = {}  # name -> resource type
        self.hooked = False
        self.lock = threading.RLock()  # objects are created and finalized from several threads (and by the GC)

    def write(self) -> None:
        with self.lock:
            self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        lines = [f"rank {self.rank}"] + [f"{rtype} {name}" for name, rtype in self.names.items()]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(self.path.name + ".partial")
            partial.write_text("\n".join(lines) + "\n")
            os.replace(partial, self.path)
        except OSError as exc:  # never fail the process over its bookkeeping
            log.warning("could not record this process's shared-memory names in %s: %s", self.path, exc)

    def remove(self) -> None:
        with self.lock:
            if self.path is not None:
                self.path.unlink(missing_ok=True)
            self.path = None

    def at_exit(self) -> None:
        """A process that holds no recorded name leaves no record (and no empty directory) behind it."""
        with self.lock:
            if self.path is None or self.names:
                return
            self.path.unlink(missing_ok=True)
            try:
                self.path.parent.rmdir()
            except OSError:  # other files are there (slots kept for a respawned worker, other owners)
                pass
            self.path = None


_record = _Record()


def record(directory: Path, rank: int) -> None:
    """Record from now on, in ``directory/owner-<pid>``, this process's rank and every named semaphore and
    shared-memory block it creates (through ``multiprocessing.resource_tracker``, with which every non-fork
    ``multiprocessing`` object registers its name); names it unlinks leave the record. The record stays when the
    process exits holding names (an exit can be cut short between its atexit handlers and the finalizers that
    unlink them): whoever reaps after it finds the pid gone; ``forget_own`` removes it when the job is over."""
    path = directory / f"{OWNER_PREFIX}{os.getpid()}"
    if _record.path is not None and _record.path != path:
        _record.remove()
    _record.path, _record.rank = path, rank
    _record.write()
    if _record.hooked:
        return
    _record.hooked = True
    register, unregister = resource_tracker.register, resource_tracker.unregister

    def recording_register(name: str, rtype: str) -> None:
        if rtype in _RECORDED_TYPES:
            _record.names[name] = rtype
            _record.write()
        register(name, rtype)

    def recording_unregister(name: str, rtype: str) -> None:
        if _record.names.pop(name, None) is not None:
            _record.write()
        unregister(name, rtype)

    resource_tracker.register, resource_tracker.unregister = recording_register, recording_unregister
    atexit.register(_record.at_exit)


def forget_own() -> None:
    """This process is done with the job's directory (its names are unlinked when it exits)."""
    _record.remove()


def reap(directory: Path, files: bool, node_gone: bool = False) -> list[str]:
    """Remove what the job's dead processes recorded in ``directory``: their semaphores and shared memory, and with
    ``files`` (the job is over) their ranks' snapshot files unless a live process holds that rank now. ``node_gone``:
    the node goes with every process on it (a drill of a lost node: its pod's memory goes too), so live owners'
    entries are removed as well. Returns the names removed."""
    removed: list[str] = []
    owners = _owners(directory)
    live = {pid for pid in owners if alive(pid) and not node_gone}
    live_ranks = {rank for pid, (rank, _) in owners.items() if pid in live}
    for pid, (rank, names) in owners.items():
        if pid in live:
            continue
        for rtype, name in names:
            target = SHM_ROOT / _entry(rtype, name)
            try:
                target.unlink()
                removed.append(target.name)
            except FileNotFoundError:
                pass  # unlinked by its own process or resource tracker
            except OSError as exc:
                log.warning("could not remove %s left by pid %d: %s", target, pid, exc)
        if files and rank is not None and rank not in live_ranks:
            for path in directory.glob(f"rank-{rank:05d}.slot-*"):
                path.unlink(missing_ok=True)
                removed.append(path.name)
        (directory / f"{OWNER_PREFIX}{pid}").unlink(missing_ok=True)
    if removed:
        log.info("removed what processes of this job that are gone left in node memory: %s", ", ".join(removed))
    return removed


def recorded(directory: Path) -> set[str]:
    """The node-memory entries (names under ``SHM_ROOT``) that the job's processes recorded in ``directory``, live or
    dead: what ``reap`` would remove. Lets a watcher tell this job's entries from another job's on a shared node."""
    return {_entry(rtype, name) for _, names in _owners(directory).values() for rtype, name in names}


def _entry(rtype: str, name: str) -> str:
    """Where glibc keeps a named semaphore (``sem.<name>``) or POSIX shared memory (``<name>``) under ``SHM_ROOT``."""
    return ("sem." if rtype == "semaphore" else "") + name.lstrip("/")


def _owners(directory: Path) -> dict[int, tuple[int | None, list[tuple[str, str]]]]:
    owners = {}
    for path in directory.glob(f"{OWNER_PREFIX}*"):
        pid_text = path.name[len(OWNER_PREFIX) :]
        if not pid_text.isdigit():
            continue
        rank, names = None, []
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            kind, _, value = line.partition(" ")
            if kind == "rank" and value.isdigit():
                rank = int(value)
            elif kind in _RECORDED_TYPES and value:
                names.append((kind, value))
        owners[int(pid_text)] = (rank, names)
    return owners


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not). A reused pid reads as alive: nothing is removed then."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def restart_in_place_expected() -> bool:
    """Whether a launcher will start this rank again on this node, to resume from its node-local snapshots:
    ``entrypoint.sh`` (it owns the snapshot directory and removes it when the job ends), or torchrun/ft_launcher
    with restarts left (``TORCHELASTIC_RESTART_COUNT`` < ``TORCHELASTIC_MAX_RESTARTS``). A plain process, or a
    launcher's last attempt, has none coming: when it exits, the job is over on this node."""
    if os.environ.get(SNAPSHOT_DIR_ENV):
        return True
    max_restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "")
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if not max_restarts.isdigit():
        return False
    return (int(count) if count.isdigit() else 0) < int(max_restarts)
