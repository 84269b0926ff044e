"""Local backend of the train step: runs ``trainer_image/entrypoint.sh`` as a subprocess, like one pod.

`LocalLauncher.run(spec)` gives the local run the cluster layer's semantics (the PyTorchJob's
``restartPolicy: ExitCode`` plus the launcher's restart budget):

- exit 0: done;
- exit 1-127 (permanent: config, data, checkpoint error or a bug): fail at once with the log tail;
- exit >= 128 (retryable: killed, preempted, in-job budget spent): relaunch while ``max_cluster_restarts``
  remains; the trainer resumes from its latest checkpoint. When the budget is spent the step fails and
  the pipeline's ``set_retry`` takes over (the next attempt resumes too).

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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import components
from components.lib.signals import sigterm_raises

log = logging.getLogger(__name__)

#: Mirror of ``trainer.exitcodes`` (components never import the trainer); a test keeps them equal.
RETRYABLE_MIN = 128
EXIT_NAMES = {
    0: "OK", 1: "CODE_ERROR", 2: "CONFIG_ERROR", 3: "DATA_ERROR", 4: "CHECKPOINT_ERROR", 137: "KILLED",
    143: "TERMINATED", 200: "RESTART_BUDGET_EXHAUSTED", 201: "UNHEALTHY_NODE", 202: "PREEMPTED", 203: "RANKS_LOST",
    204: "LAUNCHER_LOST", 205: "RENDEZVOUS_LOST",
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
        for name in ("nproc_per_node",):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        for name in ("ft_max_restarts", "max_cluster_restarts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}")


@dataclass
class Launch:
    """One start of the entrypoint."""

    number: int
    exit_code: int
    duration_s: float
    log_file: str | None


@dataclass
class LocalJobResult:
    launches: list[Launch]
    duration_s: float

    @property
    def relaunches(self) -> int:
        """Cluster-layer restarts done by this launcher (launches after the first)."""
        return len(self.launches) - 1


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
                self._say(f"[train] launch {number}: {entrypoint.name} with {spec.nproc_per_node} process(es), "
                          f"in-job restarts {spec.ft_max_restarts}, cluster restarts used "
                          f"{number - 1}/{spec.max_cluster_restarts}")
                code, tail, log_file, took = self._launch_once(spec, entrypoint, number, deadline, progress)
                launches.append(Launch(number, code, round(took, 3), log_file))
                if code == 0:
                    self._say(f"[train] finished after {len(launches)} launch(es) in {time.monotonic() - started:.0f} s")
                    return LocalJobResult(launches, time.monotonic() - started)
                if not is_retryable(code):
                    raise PermanentFailure(
                        f"training exited {exit_name(code)}: a permanent failure (1-127), not retried; fix the "
                        "cause named in the log", code, tail)
                if number > spec.max_cluster_restarts:
                    raise RestartBudgetExceeded(
                        f"training exited {exit_name(code)} (retryable) and the local restart budget is spent "
                        f"(max_cluster_restarts={spec.max_cluster_restarts}, {number - 1} relaunch(es) done); "
                        "the pipeline step's retry resumes from the latest checkpoint", code, tail)
                self._say(f"[train] exit {exit_name(code)} is retryable: relaunching "
                          f"({number}/{spec.max_cluster_restarts}), resuming from the latest checkpoint")
                time.sleep(spec.relaunch_delay_s)

    def _launch_once(self, spec: LocalJobSpec, entrypoint: Path, number: int, deadline: float | None,
                     progress: ProgressReporter) -> tuple[int, list[str], str | None, float]:
        marker = uuid.uuid4().hex
        tmp = Path(tempfile.mkdtemp(prefix=f"train-launch-{number}."))
        try:
            return self._launch_in(spec, entrypoint, number, deadline, progress, marker, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _launch_in(self, spec: LocalJobSpec, entrypoint: Path, number: int, deadline: float | None,
                   progress: ProgressReporter, marker: str, tmp: Path) -> tuple[int, list[str], str | None, float]:
        env = {
            **os.environ,
            # a free rendezvous port per launch: other local runs (tests, a second demo) may hold 29500
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            **spec.env,
            "NPROC_PER_NODE": str(spec.nproc_per_node),
            "FT_MAX_RESTARTS": str(spec.ft_max_restarts),
            "PYTHONUNBUFFERED": "1",
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            "TMPDIR": str(tmp),
            MARKER_ENV: marker,
        }
        log_path = Path(spec.state_dir) / f"launch-{number}.log" if spec.state_dir else None
        tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        began = time.monotonic()
        proc = subprocess.Popen(  # noqa: S603 - an argument list, never a shell string
            [str(entrypoint), *spec.args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            errors="replace", bufsize=1, env=env, cwd=spec.cwd, start_new_session=True)
        if spec.state_dir:
            _write_state(Path(spec.state_dir), proc.pid, marker)
        reader = threading.Thread(target=self._pump, args=(proc.stdout, log_path, tail, progress, spec.echo),
                                  daemon=True)
        reader.start()
        try:
            while True:
                try:
                    code = proc.wait(timeout=POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    if deadline is not None and time.monotonic() > deadline:
                        raise DeadlineExceeded(f"training did not finish within the deadline "
                                               f"({spec.deadline_s:.0f} s); killed it", None, list(tail))
        except BaseException:
            self._say(f"[train] stopping: killing the training process tree (pid {proc.pid})")
            _kill_tree(proc.pid, marker)
            proc.wait()
            reader.join(5)
            if spec.state_dir:
                (Path(spec.state_dir) / STATE_FILE).unlink(missing_ok=True)
            raise
        reader.join(10)
        # Workers that outlived the entrypoint (they should not) must not train on into the next launch.
        leftovers = _kill_tree(proc.pid, marker)
        if leftovers:
            self._say(f"[train] killed {leftovers} process(es) left behind by the entrypoint")
        if spec.state_dir:
            (Path(spec.state_dir) / STATE_FILE).unlink(missing_ok=True)
        code = 128 - code if code < 0 else code  # -N: killed by signal N -> 128 + N, as a shell reports it
        return code, list(tail), str(log_path) if log_path else None, time.monotonic() - began

    def _pump(self, stream: TextIO, log_path: Path | None, tail: deque[str], progress: ProgressReporter,
              echo: str) -> None:
        with open(log_path, "a") if log_path else contextlib.nullcontext() as log_file:
            for raw in stream:
                line = raw.rstrip("\n")
                tail.append(line)
                if log_file:
                    log_file.write(line + "\n")
                if echo == ECHO_ALL or RECOVERY_EVENTS.search(line):
                    self._out.write(line + "\n")
                report = progress.feed(line)
                if report:
                    self._out.write(report + "\n")
                self._out.flush()

    def _say(self, message: str) -> None:
        self._out.write(message + "\n")
        self._out.flush()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
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
