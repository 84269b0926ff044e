"""Nothing is left in node memory (/dev/shm) when a job ends, however it ends: a failed plain-torchrun run removes
its snapshot slots, and the semaphores of a worker killed together with its children (checkpoint writer and
multiprocessing's resource tracker, as a launcher's process-group SIGKILL does) are removed by the in-job restart.

Only what the run itself created is counted, so other jobs on the machine cannot disturb the checks: its snapshot
slots live in a directory of its own, and its semaphores are the ``/dev/shm/sem.*`` files the run's processes had
mapped (read from /proc while it runs)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

from test_recovery import ENTRYPOINT, FT_ENV, GRACE, PRESET, VENV_BIN, events, node_dir
from testlib import RESTARTED, free_port, run_session
from trainer.ledger import read

pytestmark = pytest.mark.multiprocess


def _processes() -> dict[int, tuple[int, list[str]]]:
    """pid -> (parent pid, argv) of every process."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out[int(entry)] = (ppid, argv)
    return out


def _descendants(pid: int, table: dict[int, tuple[int, list[str]]]) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        children = [p for p, (ppid, _) in table.items() if ppid == parent]
        found += children
        todo += children
    return found


class Watch:
    """Polls the processes of one run (its command lines name its run directory, or descend from one that does)
    and collects the semaphores they have mapped; ``kill_worker`` SIGKILLs one training worker with every process
    below it at once, once it holds semaphores."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.stop = str(run_dir), threading.Event()
        self.names: set[str] = set()
        self.inodes: set[int] = set()
        self.kill_rank: str | None = None
        self.seen_at: float | None = None
        self.killed: list[int] = []
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> "Watch":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def _poll(self) -> None:
        while not self.stop.is_set():
            table = _processes()
            roots = [pid for pid, (_, argv) in table.items() if any(self.run_dir in a for a in argv)]
            run = set(roots) | {d for r in roots for d in _descendants(r, table)}
            held_by: dict[int, set[int]] = {}
            for pid in run:  # a semaphore is mapped under glibc's temporary name: match the files by inode
                try:
                    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
                except OSError:
                    continue
                held_by[pid] = {int(line.split()[4]) for line in maps if "/dev/shm/sem." in line}
            inodes = set().union(*held_by.values()) if held_by else set()
            self.inodes |= inodes
            for entry in os.scandir("/dev/shm"):
                try:
                    if entry.name.startswith("sem.") and entry.inode() in inodes:
                        self.names.add(entry.name)
                except OSError:
                    continue
            if self.kill_rank is not None and not self.killed:
                worker = next((p for p, held in held_by.items() if held and self._is_worker(p, table)), None)
                if worker is not None and self.seen_at is None:
                    self.seen_at = time.monotonic()
                if worker is not None and time.monotonic() - self.seen_at > 1.0:  # its writer has started
                    self._kill_tree(worker, table)
            time.sleep(0.1)

    def _is_worker(self, pid: int, table: dict[int, tuple[int, list[str]]]) -> bool:
        argv = table[pid][1]
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == "fork-worker":  # its environ is its server's
                ledger = Path(self.run_dir) / "recovery.jsonl"
                return any(r["pid"] == pid and str(r["rank"]) == self.kill_rank for r in read(ledger))
        if "trainer" not in argv or "--nnodes" in argv or argv[argv.index("trainer") - 1] != "-m":
            return False
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return False
        return f"RANK={self.kill_rank}".encode() in env

    def _kill_tree(self, pid: int, table: dict[int, tuple[int, list[str]]]) -> None:
        self.killed = [pid, *_descendants(pid, table)]
        for victim in self.killed:  # at once: its resource tracker cannot clean up after it
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _launch(cmd: list[str], env_extra: dict[str, str], timeout: float = 240) -> tuple[int, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MASTER_PORT": str(free_port()),
           "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", **env_extra}
    return run_session(cmd, env, timeout, f"timed out after {timeout} s")


def _left_in_node_memory(run_dir: Path, watch: Watch) -> list[str]:
    time.sleep(1.0)  # writer processes of the last attempt exit a moment after their trainer
    slots = [str(p) for p in node_dir(run_dir).rglob("*")] if node_dir(run_dir).is_dir() else []
    semaphores = [e.name for e in os.scandir("/dev/shm")
                  if e.name.startswith("sem.") and (e.name in watch.names or e.inode() in watch.inodes)]
    return slots + sorted(semaphores)


def test_a_failed_plain_torchrun_run_leaves_nothing_in_node_memory(tmp_path, tiny_dataset):
    """torchrun without restarts: rank 0 fails at step 6, rank 1 is stopped; no rank will be restarted on this
    node, so each removes its snapshot slots whatever its exit code (rank 1's is retryable)."""
    cmd = [str(VENV_BIN / "torchrun"), "--nproc-per-node=2", f"--master-port={free_port()}", "-m", "trainer", *PRESET,
           f"--data.path={tiny_dataset}", f"--train.run_dir={tmp_path}",
           f"--checkpoint.node_local_dir={node_dir(tmp_path)}", "--resiliency.inprocess=false",
           "--resiliency.faults=0:6:exception"]
    with Watch(tmp_path) as watch:
        rc, out = _launch(cmd, {})
    assert rc != 0, out[-4000:]
    assert watch.names, "the run's checkpoint writers were never seen"
    assert not _left_in_node_memory(tmp_path, watch), out[-4000:]


def test_a_worker_killed_with_its_children_leaves_nothing_in_node_memory(tmp_path, tiny_dataset):
    """Rank 0's worker, its checkpoint writer and its resource tracker are SIGKILLed together from outside (a
    launcher's process-group kill, no injected fault): its semaphores outlive it. ft_launcher restarts the worker
    group once, every rank's restart names the cause (killed, no exit recorded), the new worker removes what the dead
    one recorded, and the job ends with nothing of it in /dev/shm nor in its TMPDIR (ft_launcher's and the workers'
    temp files)."""
    cmd = [str(ENTRYPOINT), *PRESET, "--train.steps=16", f"--data.path={tiny_dataset}", f"--train.run_dir={tmp_path}",
           f"--checkpoint.node_local_dir={node_dir(tmp_path)}", *GRACE]
    tmpdir = Path(tempfile.mkdtemp(prefix="nm-", dir="/tmp"))  # short: socket paths live there
    try:
        with Watch(tmp_path) as watch:
            watch.kill_rank = "0"
            rc, out = _launch(cmd, {**FT_ENV, "FT_MAX_RESTARTS": "2", "TMPDIR": str(tmpdir)})
        left_in_tmp = list(tmpdir.iterdir())
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    assert watch.killed, "rank 0's worker was never killed: it never held a semaphore"
    assert rc == 0, out[-4000:]
    assert out.count(RESTARTED) == 1 and "Traceback" not in out, out[-4000:]
    restarts = events(tmp_path, "restart")
    assert {r["rank"] for r in restarts} == {0, 1} and {r["layer"] for r in restarts} == {"injob"}, restarts
    for r in restarts:
        assert r["fault"]["kind"] == "killed" and "rank 0: no exit recorded" in r["fault"]["detail"], r
    assert not _left_in_node_memory(tmp_path, watch), out[-4000:]
    assert "left in node memory: sem." in out, "the dead worker's semaphores were not removed by this job"
    assert not left_in_tmp, f"the job's TMPDIR was not cleaned up: {left_in_tmp}"
