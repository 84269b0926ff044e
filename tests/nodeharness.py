"""Several nodes on one machine: one ``entrypoint.sh`` per node, as a PyTorchJob runs one per pod.

Each node gets ``PET_NNODES``, its own ``PET_NODE_RANK``, the job's ``MASTER_ADDR``/``MASTER_PORT``, an address of its
own (``FT_LOCAL_ADDR`` and ``TRAINER_REPLICA_ADDR``, where its replica servers listen: 127.0.0.<rank + 1>, as pods
have their own) and its own ``--checkpoint.node_local_dir`` (its pod's memory ``emptyDir``); every node shares the
run directory (the shared volume), and the job's secret beside its checkpoints, which the first rank makes. A node
runs in a process session of its own, so losing it (``lose``) SIGKILLs its entrypoint, launcher, workers and their
helpers at once and removes its node-local directory, as a drained node takes its pod and its memory with it;
``start`` again with the same node rank is the replacement pod.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from testlib import REPO, VENV_BIN, free_port
from trainer.checkpoint import reaper
from trainer.faults import process_tree
from trainer.ledger import read

ENTRYPOINT = REPO / "trainer_image" / "entrypoint.sh"


@dataclass
class Node:
    rank: int
    incarnation: int
    proc: subprocess.Popen
    log: Path
    memory: Path
    """Its node-local directory (``checkpoint.node_local_dir``)."""
    lost: bool = False

    @property
    def name(self) -> str:
        return f"node{self.rank}.{self.incarnation}"

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def processes(self) -> list[int]:
        """Every live process of this node: its entrypoint's process session and everything below the entrypoint
        (ft_launcher starts each worker in a session of its own)."""
        members = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                    if int(stat[3]) == self.proc.pid and stat[0] != "Z":
                        members.append(int(entry))
        return sorted(set(members) | set(process_tree(self.proc.pid)))

    def workers(self) -> list[int]:
        """The node's training workers: those the node's fork server forked (``fork-worker``,
        trainer/startup/forkserver.py) and the launched ``python -m trainer`` processes that run themselves; not the
        proxies of forked ones (named by their worker's ``launched as pid`` line), the launcher nor a helper."""
        proxies = {int(p) for p in re.findall(r"launched as pid (\d+)\)", self.output())}
        pids = []
        for pid in self.processes():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            launched = "-m" in argv and argv[argv.index("-m") + 1:argv.index("-m") + 2] == ["trainer"] and \
                not any(a.endswith("ft_launcher") for a in argv)
            if name == "fork-worker" or (launched and pid not in proxies):
                pids.append(pid)
        return pids


@dataclass
class Cluster:
    """``nnodes`` nodes of ``nproc`` workers training one run under ``base``."""

    base: Path
    dataset: Path
    nnodes: int | str
    nproc: int
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    nodes: list[Node] = field(default_factory=list)
    recorded: set[str] = field(default_factory=set)
    """The node-memory entries (``/dev/shm``) the run's processes recorded so far (``note_memory``)."""
    _noted_at: float = 0.0

    @property
    def run_dir(self) -> Path:
        return self.base / "run"

    def start(self, rank: int, extra_env: dict[str, str] | None = None) -> Node:
        """Start node ``rank`` (again: a replacement pod, with a new, empty node-local directory)."""
        incarnation = sum(n.rank == rank for n in self.nodes)
        memory = self.base / f"node{rank}.{incarnation}-shm"
        log = self.base / f"node{rank}.{incarnation}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
               "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "PET_NNODES": str(self.nnodes),
               "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": str(self.nproc), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(self.port), "FT_LOCAL_ADDR": f"127.0.0.{rank + 1}",
               "TRAINER_REPLICA_ADDR": f"127.0.0.{rank + 1}", **self.env, **(extra_env or {})}
        cmd = [str(ENTRYPOINT), *self.args, f"--data.path={self.dataset}", f"--train.run_dir={self.run_dir}",
               f"--checkpoint.node_local_dir={memory}"]
        self.base.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                    start_new_session=True)
        node = Node(rank, incarnation, proc, log, memory)
        self.nodes.append(node)
        return node

    def start_all(self) -> list[Node]:
        count = int(str(self.nnodes).split(":")[-1])
        return [self.start(rank) for rank in range(count)]

    def note_memory(self, every_s: float = 0.5) -> None:
        """Add what the run's processes recorded in their nodes' memory (``reaper.recorded``) to ``recorded``, at most
        every ``every_s``: the names this run may leave in ``/dev/shm``, told apart from other jobs' on the machine."""
        if time.monotonic() - self._noted_at < every_s:
            return
        self._noted_at = time.monotonic()
        for job in self.base.glob("node*-shm/*"):
            if job.is_dir():
                self.recorded |= reaper.recorded(job)

    def left_in_memory(self) -> set[str]:
        """The entries this run's processes recorded that are still in ``/dev/shm`` (none once every node ended)."""
        self.note_memory(every_s=0)
        return {name for name in self.recorded if (reaper.SHM_ROOT / name).exists()}

    def lose(self, node: Node) -> None:
        """The node is gone with its pod: every process of it SIGKILLed at once, its node memory removed."""
        self.note_memory(every_s=0)
        for _ in range(3):  # what a process forks while the others are being killed is caught the next time
            for pid in node.processes():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        node.proc.wait()
        node.lost = True
        for job in node.memory.glob("*"):  # the pod's memory goes too: the semaphores its processes recorded
            reaper.reap(job, files=True, node_gone=True)
        shutil.rmtree(node.memory, ignore_errors=True)

    def steps(self) -> list[int]:
        # read while the ranks append (and a lost node's rank may die mid-line): a torn line is skipped
        return [r["step"] for r in read(self.run_dir / "metrics.jsonl") if r.get("event") == "step"]

    def replace_lost(self) -> None:
        """The cluster's part: a node whose entrypoint died by a signal (its pod lost) is started again."""
        for node in list(self.nodes):
            if not node.lost and node.proc.poll() is not None and node.proc.returncode < 0:
                node.lost = True
                self.start(node.rank)

    def wait_for_step(self, step: int, timeout: float = 120) -> None:
        """Until a step record reaches ``step``, lost nodes replaced meanwhile."""
        deadline = time.monotonic() + timeout
        while not any(s >= step for s in self.steps()):
            self.replace_lost()
            self.note_memory()
            if all(n.proc.poll() is not None for n in self.nodes if not n.lost):
                raise AssertionError(f"every node ended before step {step}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"step {step} not reached in {timeout} s:\n{self.tail()}")
            time.sleep(0.05)

    def run_to_end(self, timeout: float = 240) -> dict[str, int]:
        """Until every node still running ends, lost nodes replaced meanwhile; their exit codes by name."""
        deadline = time.monotonic() + timeout
        while any(n.proc.poll() is None for n in self.nodes if not n.lost) and time.monotonic() < deadline:
            self.replace_lost()
            self.note_memory()
            time.sleep(0.1)
        return self.wait(timeout=max(1.0, deadline - time.monotonic()))

    def wait(self, timeout: float = 240) -> dict[str, int]:
        """Every node still running ends; their exit codes by name. At ``timeout`` every node's process session gets
        SIGABRT (each Python process prints its threads' stacks) and SIGKILL, and the test fails with the logs' tails."""
        deadline = time.monotonic() + timeout
        codes = {}
        for node in self.nodes:
            if node.lost:
                continue
            try:
                codes[node.name] = node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stop(signal.SIGABRT)
                time.sleep(3)
                self.stop(signal.SIGKILL)
                raise AssertionError(f"nodes still running after {timeout} s:\n{self.tail()}") from None
        return codes

    def stop(self, sig: int = signal.SIGKILL) -> None:
        for node in self.nodes:
            for pid in node.processes():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        for node in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=10)

    def tail(self, chars: int = 4000) -> str:
        return "\n".join(f"=== {n.name}{' (lost)' if n.lost else ''}\n{n.output()[-chars:]}" for n in self.nodes)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
