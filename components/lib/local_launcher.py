"""Local backend of the train step: runs ``trainer_image/entrypoint.sh`` as subprocesses, one per node, as the pods.

`LocalLauncher.run(spec)` gives the local run the cluster layer's semantics (the PyTorchJob's
``restartPolicy: ExitCode`` plus the launcher's restart budget):

- every node exits 0: done;
- a node exits 1-127 (permanent: config, data, checkpoint error or a bug): fail with the log tail (the other nodes
  stop with the same code by themselves: ``trainer.resiliency.launch``; what still runs after a grace is killed);
- a node exits >= 128 or dies by a signal (its pod lost, killed, an unhealthy node, its rendezvous not found again)
  while others still run: that node is started again at once, with an empty node-local directory, as the operator
  recreates a pod; it joins the job's rendezvous and the job goes on (the trainer's ``node`` recovery);
- every node has ended, retryable (preempted, in-job budget spent): relaunch the whole job;
- each restart, of a node or of the job, counts against ``max_cluster_restarts``; when it is spent the step fails and
  the pipeline's ``set_retry`` takes over (the next attempt resumes too).

Several nodes on one machine get what pods would: ``PET_NNODES``, their own ``PET_NODE_RANK``, the same
``MASTER_ADDR``/``MASTER_PORT``, an address each (``FT_LOCAL_ADDR`` 127.0.0.<k+1>: the rendezvous keeps a node's
ranks by it; the node's replica servers listen there too) and their own ``--checkpoint.node_local_dir`` (the pod's
memory). Every node of a launch gets the same job secret for its peer tier (``components.lib.jobsecret``): a 0600
file in the launch's temporary directory.

The entrypoint runs in its own session with a marker in its environment; every process it starts
inherits both. Any way out of `run` other than a normal exit (deadline, SIGTERM when the pipeline is
cancelled, an error) kills that process tree, and `kill_leftovers` (the exit handler) finds what is left
from the state file and the marker — idempotently. The command is always an argument list, never a shell
string; ``PATH`` starts with this interpreter's bin directory so the entrypoint finds ``ft_launcher``.

Each launch gets its own ``TMPDIR`` (under the system's), removed when the launch ends
however it ends: what killed workers leave there (``pymp-*``, ``torchelastic_*``, rank-monitor sockets) goes
with it, even when the entrypoint itself was killed before its own clean-up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import components
from components.lib.jobsecret import REPLICA_ADDR_ENV, SECRET_FILE_ENV, write_secret_file
from components.lib.signals import sigterm_raises

log = logging.getLogger(__name__)

#: Mirror of ``trainer.exitcodes`` (components never import the trainer); a test keeps them equal.
RETRYABLE_MIN = 128
EXIT_NAMES = {
    0: "OK", 1: "CODE_ERROR", 2: "CONFIG_ERROR", 3: "DATA_ERROR", 4: "CHECKPOINT_ERROR", 137: "KILLED",
    143: "TERMINATED", 200: "RESTART_BUDGET_EXHAUSTED", 201: "UNHEALTHY_NODE", 202: "PREEMPTED", 203: "RANKS_LOST",
    204: "LAUNCHER_LOST", 205: "RENDEZVOUS_LOST", 206: "RANK_MONITOR_REFUSED",
    207: "DEVICE_OUT_OF_MEMORY",
}
MARKER_ENV = "RESILIENT_TRAIN_LOCAL_JOB"
STATE_FILE = "local-job.json"
TERMINATE_GRACE_S = 15.0
POLL_S = 0.5
RELAUNCH_DELAY_S = 1.0
LOG_TAIL_LINES = 40
PROGRESS_EVERY_PCT = 5.0

# The trainer's rank-0 step line (trainer.metrics): "step    120 loss 5.2100 lr 3.00e-03 12,345 tok/s 80 ms"
_STEP_LINE = re.compile(r"\bstep\s+(\d+)\s+loss\s+([-+0-9.eE]+|nan|inf)\b(?:.*?([\d,]+) tok/s)?")


ECHO_ALL, ECHO_PROGRESS = "all", "progress"
ECHO_ENV = "RESILIENT_TRAIN_LOG_ECHO"
"""Environment override of ``LocalJobSpec.echo`` for local runs (the demo sets ``progress``)."""
#: Trainer log lines that still reach stdout with ``echo="progress"``: what a person follows a recovery by.
RECOVERY_EVENTS = re.compile(
    r"injecting fault|restored step|fn_ex:|Worker group|entrypoint:|preempt|exit \d+ \(|config error:|CRITICAL|Traceback"
    r"|straggler at step"
)


def exit_name(code: int) -> str:
    """``"202 (PREEMPTED)"``; codes 128+N without a name are reported as the signal N."""
    if code in EXIT_NAMES:
        return f"{code} ({EXIT_NAMES[code]})"
    if code > 128:
        with contextlib.suppress(ValueError):
            return f"{code} (signal {signal.Signals(code - 128).name})"
    return str(code)


def is_retryable(code: int) -> bool:
    return code >= RETRYABLE_MIN


def default_entrypoint() -> Path:
    """``trainer_image/entrypoint.sh`` of the installed project (``/opt/app/...`` in the image)."""
    return Path(components.__file__).resolve().parents[1] / "trainer_image" / "entrypoint.sh"


class LocalLaunchError(RuntimeError):
    """The local training run failed; the train step must fail."""

    def __init__(self, message: str, exit_code: int | None = None, log_tail: Sequence[str] = ()) -> None:
        self.exit_code = exit_code
        self.log_tail = list(log_tail)
        tail = ("\n--- last %d lines of the training log ---\n" % len(self.log_tail) + "\n".join(self.log_tail)
                if self.log_tail else "")
        super().__init__(message + tail)


class PermanentFailure(LocalLaunchError):
    """Exit 1-127: retrying cannot help."""


class RestartBudgetExceeded(LocalLaunchError):
    """Retryable exits used up ``max_cluster_restarts``; the pipeline's retry may resume the run."""


class DeadlineExceeded(LocalLaunchError):
    """The run did not finish within ``deadline_s``; it was killed."""


class LauncherTerminated(LocalLaunchError):
    """SIGTERM reached the launcher (pipeline cancelled); the run was killed."""


@dataclass(frozen=True)
class LocalJobSpec:
    """One local training job: the entrypoint's arguments and the restart policy around it."""

    args: Sequence[str]
    """Trainer CLI args, e.g. ("--config", "tiny", "--train.steps=100")."""
    nproc_per_node: int = 2
    """Processes ft_launcher starts (env NPROC_PER_NODE)."""
    nodes: int = 1
    """Entrypoints that train, one per node (env PET_NODE_RANK)."""
    spare_nodes: int = 0
    """More entrypoints that wait in the rendezvous as spares (env PET_NNODES = nodes + spare_nodes, TRAINER_NODES =
    nodes); one takes a lost node's place. The launcher counts them and says when the last one is in use."""
    min_nodes: int = 0
    """Fewest nodes that train on when one is lost and none takes its place within the entrypoint's
    TRAINER_NODE_WAIT_S (env TRAINER_MIN_NODES, TRAINER_NODES = nodes); 0 or ``nodes``: not elastic."""
    ft_max_restarts: int = 3
    """In-job restart budget of ft_launcher (env FT_MAX_RESTARTS)."""
    max_cluster_restarts: int = 0
    """Relaunches after a retryable exit (>= 128) before the step fails."""
    state_dir: Path | None = None
    """Where the process-tree record and per-launch logs go (the exit handler reads it)."""
    total_steps: int | None = None
    """For the progress line's percentage."""
    entrypoint: Path | None = None
    """Defaults to `default_entrypoint()`."""
    env: Mapping[str, str] = field(default_factory=dict)
    deadline_s: float | None = None
    relaunch_delay_s: float = RELAUNCH_DELAY_S
    cwd: Path | None = None
    echo: str = ECHO_ALL
    """``all``: every trainer log line goes to stdout (the step log); ``progress``: only progress lines and
    recovery events (faults, restarts, exits) — the full log is in the launch's log file either way."""

    def __post_init__(self) -> None:
        if self.echo not in (ECHO_ALL, ECHO_PROGRESS):
            raise ValueError(f"echo must be {ECHO_ALL!r} or {ECHO_PROGRESS!r}; got {self.echo!r}")
        if isinstance(self.args, str):
            raise ValueError(f"args must be a list of arguments, not one string; got {self.args!r}")
        for name in ("nproc_per_node", "nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        for name in ("ft_max_restarts", "max_cluster_restarts", "spare_nodes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}")
        if not 0 <= self.min_nodes <= self.nodes:
            raise ValueError(f"min_nodes must be from 0 (not elastic) to nodes ({self.nodes}); got {self.min_nodes}")

    @property
    def elastic(self) -> bool:
        """The job goes on with fewer nodes (from ``min_nodes``) when a node is lost and none takes its place."""
        return 0 < self.min_nodes < self.nodes


@dataclass
class Launch:
    """One start of the job: its entrypoints, one per node."""

    number: int
    exit_code: int
    duration_s: float
    log_file: str | None
    node_restarts: int = 0
    """Nodes started again while the others ran (a lost pod replaced)."""


@dataclass
class LocalJobResult:
    launches: list[Launch]
    duration_s: float

    @property
    def relaunches(self) -> int:
        """Cluster-layer restarts done by this launcher: launches after the first, and nodes started again."""
        return _restarts_used(self.launches)


class ProgressReporter:
    """Turns the trainer's step lines into ``[train] step 120/400 loss 5.21 (30%)`` lines."""

    def __init__(self, total_steps: int | None, every_pct: float = PROGRESS_EVERY_PCT) -> None:
        self.total, self.every = total_steps, every_pct
        self.last_step = 0
        self._last_pct = -every_pct

    def feed(self, line: str) -> str | None:
        m = _STEP_LINE.search(line)
        if not m:
            return None
        step, loss, tok_s = int(m.group(1)), m.group(2), m.group(3)
        redo = step <= self.last_step
        self.last_step = step
        if not self.total:
            return f"[train] step {step} loss {loss}"
        pct = 100.0 * step / self.total
        if not (redo or step >= self.total or pct - self._last_pct >= self.every):
            return None
        self._last_pct = pct
        speed = f" {tok_s} tok/s" if tok_s else ""
        note = " (resumed)" if redo else ""
        return f"[train] step {step}/{self.total} loss {float(loss):.4f} ({pct:.0f}%){speed}{note}"


class LocalLauncher:
    """Runs a `LocalJobSpec` to completion under the restart policy; see the module docstring."""

    def __init__(self, out: TextIO | None = None) -> None:
        self._out = out or sys.stdout

    def run(self, spec: LocalJobSpec) -> LocalJobResult:
        entrypoint = Path(spec.entrypoint or default_entrypoint())
        if not entrypoint.is_file() or not os.access(entrypoint, os.X_OK):
            raise PermanentFailure(f"training entrypoint {entrypoint} is missing or not executable; install the "
                                   "project (pip install -e .) or pass LocalJobSpec.entrypoint")
        started = time.monotonic()
        deadline = started + spec.deadline_s if spec.deadline_s else None
        progress = ProgressReporter(spec.total_steps)
        launches: list[Launch] = []
        if spec.state_dir:
            Path(spec.state_dir).mkdir(parents=True, exist_ok=True)
            kill_leftovers(spec.state_dir)  # a launcher killed hard may have left its tree running
        with sigterm_raises(lambda: LauncherTerminated('the train step received SIGTERM (pipeline run cancelled?)')):
            while True:
                number = len(launches) + 1
                used = _restarts_used(launches)
                self._say(f"[train] launch {number}: {entrypoint.name} on {spec.nodes} node(s) x "
                          f"{spec.nproc_per_node} process(es), in-job restarts {spec.ft_max_restarts}, cluster "
                          f"restarts used {used}/{spec.max_cluster_restarts}")
                run = _Run(self, spec, entrypoint, number, deadline, progress, spare=spec.max_cluster_restarts - used)
                code, tail, log_file, took = run.launch()
                launches.append(Launch(number, code, round(took, 3), log_file, run.replaced))
                used = _restarts_used(launches)
                if code == 0:
                    self._say(f"[train] finished after {len(launches)} launch(es) in {time.monotonic() - started:.0f} s")
                    return LocalJobResult(launches, time.monotonic() - started)
                if not is_retryable(code):
                    raise PermanentFailure(
                        f"training exited {exit_name(code)}: a permanent failure (1-127), not retried; fix the "
                        "cause named in the log", code, tail)
                if used >= spec.max_cluster_restarts:
                    raise RestartBudgetExceeded(
                        f"training exited {exit_name(code)} (retryable) and the local restart budget is spent "
                        f"(max_cluster_restarts={spec.max_cluster_restarts}, {used} restart(s) done); "
                        "the pipeline step's retry resumes from the latest checkpoint", code, tail)
                self._say(f"[train] exit {exit_name(code)} is retryable: relaunching "
                          f"({used + 1}/{spec.max_cluster_restarts}), resuming from the latest checkpoint")
                time.sleep(spec.relaunch_delay_s)

    def _say(self, message: str) -> None:
        self._out.write(message + "\n")
        self._out.flush()


NODE_ENDED_GRACE_S = 30.0
"""After a node's permanent exit, how long the others get to stop by themselves (with the same code) before they are
killed."""


class _Run:
    """One launch: an entrypoint per node in a session of its own (all marked, ``MARKER_ENV``), their output in one log
    (``[node k]`` before each line when there are several), a node that ends retryable while others run started again
    (``spare`` times at most: the restart budget left)."""

    def __init__(self, launcher: LocalLauncher, spec: LocalJobSpec, entrypoint: Path, number: int,
                 deadline: float | None, progress: ProgressReporter, spare: int) -> None:
        self.launcher, self.spec, self.entrypoint, self.number = launcher, spec, entrypoint, number
        self.deadline, self.progress, self.spare = deadline, progress, spare
        self.marker = uuid.uuid4().hex
        self.port = _free_port()  # a free rendezvous port per launch: other local runs (tests, a demo) may hold 29500
        self.tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self.log_path = Path(spec.state_dir) / f"launch-{number}.log" if spec.state_dir else None
        self.lock = threading.Lock()
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.incarnations: dict[int, int] = {}
        self.readers: list[threading.Thread] = []
        self.replaced = 0
        self.log_file: TextIO | None = None
        self.tmp = Path(tempfile.mkdtemp(prefix=f"train-launch-{number}."))
        self.secret = write_secret_file(self.tmp)
        """The job's secret (``jobsecret``): in the launch's own 0700 directory, gone with it."""
        self.pods = spec.nodes + spec.spare_nodes
        self.spares = spec.spare_nodes
        """Spares waiting in the rendezvous: one fewer per node lost while the others run, one more per replacement."""
        self.memory = _node_memory_base(spec.args, self.marker) if self.pods > 1 else None

    def launch(self) -> tuple[int, list[str], str | None, float]:
        """Run every node until the job ends; (code, log tail, log file, seconds)."""
        began = time.monotonic()
        try:
            with open(self.log_path, "a") if self.log_path else contextlib.nullcontext() as log_file:
                self.log_file = log_file
                code = self._supervise()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if self.memory is not None:
                shutil.rmtree(self.memory, ignore_errors=True)
        return code, list(self.tail), str(self.log_path) if self.log_path else None, time.monotonic() - began

    def _supervise(self) -> int:
        for node in range(self.pods):
            self._start(node)
        if self.spec.state_dir:
            _write_state(Path(self.spec.state_dir), self.procs[0].pid, self.marker)
        ended: dict[int, int] = {}
        try:
            while len(ended) < len(self.procs):
                time.sleep(POLL_S)
                if self.deadline is not None and time.monotonic() > self.deadline:
                    raise DeadlineExceeded(f"training did not finish within the deadline ({self.spec.deadline_s:.0f} "
                                           "s); killed it", None, list(self.tail))
                for node, proc in list(self.procs.items()):
                    if node in ended or proc.poll() is None:
                        continue
                    code = 128 - proc.returncode if proc.returncode < 0 else proc.returncode  # -N: signal N
                    running = [k for k in self.procs if k != node and k not in ended]
                    if is_retryable(code) and running and self.spares:
                        self._spare_used(node, code)
                    if is_retryable(code) and running and self.replaced < self.spare:
                        self.replaced += 1
                        self.launcher._say(f"[train] node {node} exited {exit_name(code)} while the others run: "
                                           f"starting it again, as a replacement pod ({self.replaced} node "
                                           "restart(s) in this launch)")
                        self._start(node)
                        self.spares += bool(self.spec.spare_nodes)  # the replacement waits as a spare in turn
                        continue
                    ended[node] = code
                    if code and running:  # a permanent exit stops the others by itself; an unreplaced node never
                        self._stop_others(ended, gracefully=not is_retryable(code))  # comes back: stop them
        except BaseException:
            self.launcher._say(f"[train] stopping: killing the training process tree (pid {self.procs[0].pid})")
            _kill_tree(self.procs[0].pid, self.marker)
            self._reap()
            raise
        self._reap()
        leftovers = _kill_tree(self.procs[0].pid, self.marker)  # workers must not outlive their entrypoint
        if leftovers:
            self.launcher._say(f"[train] killed {leftovers} process(es) left behind by the entrypoints")
        codes = list(ended.values())
        permanent = [c for c in codes if 0 < c < RETRYABLE_MIN]
        return permanent[0] if permanent else next((c for c in codes if c), 0)

    def _spare_used(self, node: int, code: int) -> None:
        self.spares -= 1
        left = f"{self.spares} of {self.spec.spare_nodes} spare node(s) left" if self.spares else \
            "that was the last spare node: the next node lost waits for a replacement"
        self.launcher._say(f"[train] node {node} exited {exit_name(code)}: a spare node takes its place ({left})")

    def _stop_others(self, ended: dict[int, int], gracefully: bool) -> None:
        """The job cannot go on: wait for the other nodes to stop by themselves (a permanent exit), or SIGTERM them
        (an unreplaced node), then kill what is left; their codes are recorded."""
        give_up = time.monotonic() + (NODE_ENDED_GRACE_S if gracefully else TERMINATE_GRACE_S)
        for node, proc in self.procs.items():
            if node not in ended and not gracefully:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        for node, proc in self.procs.items():
            if node in ended:
                continue
            try:
                proc.wait(timeout=max(0.1, give_up - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_tree(proc.pid, self.marker, grace_s=0)
                proc.wait()
            ended[node] = 128 - proc.returncode if proc.returncode < 0 else proc.returncode

    def _start(self, node: int) -> None:
        spec, several = self.spec, self.pods > 1
        incarnation = self.incarnations[node] = self.incarnations.get(node, -1) + 1
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.port),
            SECRET_FILE_ENV: str(self.secret),  # every node of the launch signs its peer tier with it
            **spec.env,
            "PET_NNODES": str(self.pods),
            **({"TRAINER_NODES": str(spec.nodes)} if spec.spare_nodes or spec.elastic else {}),
            **({"TRAINER_MIN_NODES": str(spec.min_nodes)} if spec.elastic else {}),
            "PET_NODE_RANK": str(node),
            "NPROC_PER_NODE": str(spec.nproc_per_node),
            "FT_MAX_RESTARTS": str(spec.ft_max_restarts),
            "PYTHONUNBUFFERED": "1",
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            "TMPDIR": str(self.tmp),
            MARKER_ENV: self.marker,
        }
        args = list(spec.args)
        if several:  # what a pod of its own would have: an address, and memory of its own (empty in a new pod)
            env["FT_LOCAL_ADDR"] = env[REPLICA_ADDR_ENV] = f"127.0.0.{node + 1}"
            args.append(f"--checkpoint.node_local_dir={self.memory}/node{node}.{incarnation}")
        proc = subprocess.Popen(  # noqa: S603 - an argument list, never a shell string
            [str(self.entrypoint), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            errors="replace", bufsize=1, env=env, cwd=spec.cwd, start_new_session=True)
        self.procs[node] = proc
        reader = threading.Thread(target=self._pump, args=(proc.stdout, f"[node {node}] " if several else ""),
                                  daemon=True)
        reader.start()
        self.readers.append(reader)

    def _pump(self, stream: TextIO, prefix: str) -> None:
        for raw in stream:
            line = prefix + raw.rstrip("\n")
            with self.lock:
                self.tail.append(line)
                if self.log_file:
                    self.log_file.write(line + "\n")
                if self.spec.echo == ECHO_ALL or RECOVERY_EVENTS.search(line):
                    self.launcher._out.write(line + "\n")
                report = self.progress.feed(line)
                if report:
                    self.launcher._out.write(report + "\n")
                self.launcher._out.flush()

    def _reap(self) -> None:
        for proc in self.procs.values():
            proc.wait()
        for reader in self.readers:
            reader.join(10)
        if self.spec.state_dir:
            (Path(self.spec.state_dir) / STATE_FILE).unlink(missing_ok=True)


def _restarts_used(launches: Sequence[Launch]) -> int:
    """Cluster-layer restarts so far: every launch after the first, every node started again."""
    return max(0, len(launches) - 1) + sum(launch.node_restarts for launch in launches)


def _node_memory_base(args: Sequence[str], marker: str) -> Path:
    """Where the nodes' node-local directories go: under the job's ``--checkpoint.node_local_dir`` (memory,
    ``/dev/shm`` by default), in a directory of this launch's own."""
    base = next((a.split("=", 1)[1] for a in reversed(args) if a.startswith("--checkpoint.node_local_dir=")),
                "/dev/shm")
    return Path(base) / f"resilient-train-nodes.{marker[:12]}"


def _free_port() -> int:
    """A rendezvous port free now, below the kernel's ephemeral range where one is (as ``trainer.resiliency.launch``
    picks its workers' port): a connection opened on this machine while the launcher starts can take an ephemeral
    port that was free a moment before, and the launcher then cannot host the store on it."""
    try:
        first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768
    for port in random.sample(range(max(1024, first - 10_000), first), 64):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("", port))
            return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# --- process-tree bookkeeping (Linux /proc; elsewhere only the process group is used) --------------------
def _start_ticks(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/<pid>/stat): tells a reused pid from ours."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _write_state(state_dir: Path, pid: int, marker: str) -> None:
    record = {"pid": pid, "pgid": pid, "start_ticks": _start_ticks(pid), "marker": marker}
    tmp = state_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, state_dir / STATE_FILE)


def _marked_pids(marker: str) -> list[int]:
    """Processes (of any session) whose environment carries ``MARKER_ENV=marker``."""
    needle = f"{MARKER_ENV}={marker}".encode()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in entry.joinpath("environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return [p for p in pids if p != os.getpid()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    state = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError):
        if state.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def _kill_tree(pgid: int | None, marker: str, grace_s: float = TERMINATE_GRACE_S) -> int:
    """SIGTERM the process group and every marked process, then SIGKILL what is left; return how many."""
    targets = set(_marked_pids(marker))
    if pgid is not None and pgid > 1:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
    for pid in targets:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    give_up = time.monotonic() + grace_s
    while time.monotonic() < give_up and any(_alive(p) for p in targets):
        time.sleep(0.1)
    if pgid is not None and pgid > 1:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    for pid in targets | set(_marked_pids(marker)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return len(targets)


def kill_leftovers(state_dir: str | Path, grace_s: float = TERMINATE_GRACE_S) -> int:
    """Kill a local training tree recorded in ``state_dir`` if any of it still runs; idempotent.

    Returns the number of processes signalled (0 when nothing was left or no state file exists).
    """
    path = Path(state_dir) / STATE_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return 0
    pgid, marker = int(record["pgid"]), str(record["marker"])
    count = len(_marked_pids(marker))
    same_leader = _start_ticks(pgid) is not None and _start_ticks(pgid) == record.get("start_ticks")
    if count or same_leader:
        log.warning("killing leftover local training processes of %s (%d marked)", state_dir, count)
        count = max(count, _kill_tree(pgid if same_leader else None, marker, grace_s))
    path.unlink(missing_ok=True)
    return count
