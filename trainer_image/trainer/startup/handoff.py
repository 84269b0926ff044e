"""The hand-over of a launched worker to a process that has already imported torch, the trainer and NVRx: both
sides. The taker is this rank's warm standby (``trainer/startup/standby.py``, which has also made its CUDA context)
or, without one, a child that the node's fork server (``trainer/startup/forkserver.py``) forks for it.

``python -m trainer`` calls ``hand_over()`` before anything imports torch. It asks, in order, a standby listening
on ``standby-<LOCAL_RANK>.sock`` in ``$TRAINER_STANDBY_DIR``, then the fork server on ``forkserver.sock`` in
``$TRAINER_FORKSERVER_DIR``; with neither variable set it returns at once. It sends the taker its command line,
environment, working directory and start time, and its stdin/stdout/stderr (SCM_RIGHTS). The taker either refuses
(an environment variable read at import or CUDA-init time differs: ``import_time_mismatch``; one line here, then
this process runs normally) or takes over (``take``, ``run_target``): it runs the trainer's ``main`` as this
rank's worker, with this process's environment, working directory, stdio, command line and start clock, and this
process becomes its proxy:

- SIGTERM/SIGINT/SIGUSR1/SIGUSR2/SIGHUP sent here (ft_launcher stopping the group, a preemption) go to the worker;
- this process exits with the worker's exit code, once the worker is gone (its exit handlers, which clean
  ``/dev/shm``, have run);
- a worker killed by a signal (SIGKILL by a fault, the OOM killer, NVRx's rank monitor) sends no code: this
  process then stops the worker's process group (its checkpoint writers, monitors) with SIGTERM, as ft_launcher
  would have, and kills itself with SIGKILL, so ft_launcher sees a signal death (retryable) as before;
- if this process is killed (ft_launcher's SIGKILL after its stop timeout, ``kill -9``), the worker kills its own
  process group at once (``Lifeline``).

The worker's pid is its own (the standby's, or the forked child's): NVRx's rank monitor, the in-process Wrapper's
monitor, the reaper's ``owner-<pid>`` records and the exit-code files all see the real worker, which its proxy
stands for before ft_launcher. A fork server that is gone (its socket refuses) costs one line here, and this
process starts the ordinary way.

Wire format on the unix socket: request = 4-byte big-endian length (with fds 0, 1, 2 attached) + JSON; reply = one
JSON line (``{"ok": true, "pid": P, "group": bool}`` or ``{"ok": false, "reason": "..."}``); then the worker sends
``exit <code>`` lines (the last one counts) until it ends.

Standard library only: it runs before torch is imported, in every launched worker.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

from trainer.startup.phases import FORKSERVER_DIR_ENV, FORKSERVER_PID_ENV, FORKSERVER_SOCKET, STANDBY_DIR_ENV, \
    process_start_time

SOCKET_NAME = "standby-{rank}.sock"
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
REPLY_TIMEOUT_S = 30.0
"""How long the launched process waits for a standby's answer before it runs itself (a standby that answers
late finds this end closed and kills itself: never two workers for one rank)."""
EXIT_POLL_S = 0.02
"""How often a proxy looks whether its worker has begun to exit (``exiting``): a read of one ``/proc`` file."""
HEADER = struct.Struct(">I")
SERVER_START_WAIT_S = 300.0
"""How long a launched worker waits for the node's fork server to finish its imports (while its process lives)."""
MAX_FDS = 16
"""File descriptors a request may carry (stdio, and a forked process's pipes: ``trainer/startup/forkserver.py``)."""
IMPORT_TIME_ENV = ("LD_PRELOAD", "LD_LIBRARY_PATH", "MKL_NUM_THREADS", "NVIDIA_TF32_OVERRIDE")
IMPORT_TIME_PREFIXES = ("TORCH_", "PYTORCH_", "TORCHINDUCTOR_", "TORCHDYNAMO_", "CUDA_", "CUBLAS", "PYTHON")
"""Variables read when the interpreter starts, torch is imported, or the CUDA context / cuBLAS handle is made
(CUDA_VISIBLE_DEVICES, PYTORCH_CUDA_ALLOC_CONF, PYTHONPATH ...): a taker whose values differ refuses."""
READ_LATER_PREFIXES = ("TORCH_NCCL_",)
"""Read when a process group is created, after the handoff (ft_launcher sets TORCH_NCCL_ASYNC_ERROR_HANDLING)."""
PR_SET_PDEATHSIG = 1


def socket_path(directory: str, local_rank: int | str) -> str:
    return os.path.join(directory, SOCKET_NAME.format(rank=local_rank))


def forkserver_path() -> str | None:
    """The node's fork server's socket (``$TRAINER_FORKSERVER_DIR/forkserver.sock``); None when there is none."""
    directory = os.environ.get(FORKSERVER_DIR_ENV)
    return os.path.join(directory, FORKSERVER_SOCKET) if directory else None


def _connect() -> tuple[socket.socket, str] | None:
    """A connection to this rank's warm standby, else to the node's fork server, and what it is; None: neither."""
    local_rank = os.environ.get("LOCAL_RANK", "0")
    standbys = os.environ.get(STANDBY_DIR_ENV)
    server = forkserver_path()
    for path, who in ((standbys and socket_path(standbys, local_rank), f"the standby for local rank {local_rank}"),
                      (server, "the node's fork server")):
        if not path:
            continue
        if path == server:
            _wait_for_server(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock, who
        except OSError as exc:  # no standby warm for this rank (the first start, or not ready yet): the next one
            sock.close()
            if path == server:  # FT: the fork server is gone: this start pays the imports, and says so
                _say(f"the node's fork server ({path}) does not answer ({type(exc).__name__}); starting normally")
    return None


def _wait_for_server(path: str) -> None:
    """Wait while the node's fork server imports (its socket is not there yet, its process is): the first workers
    of a job are launched while it starts, and it finishes those imports before any of them would."""
    pid = os.environ.get(FORKSERVER_PID_ENV, "")
    deadline = time.monotonic() + SERVER_START_WAIT_S
    while pid.isdigit() and not os.path.exists(path) and time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    return
        except (OSError, IndexError):  # gone: the caller says so
            return
        time.sleep(0.05)


def hand_over() -> int | None:
    """Hand this process's work to this rank's standby or the node's fork server: returns None when there is none
    or it refused (run here); otherwise never returns (exits with the worker's code, or dies by SIGKILL as the
    worker did)."""
    connected = _connect()
    if connected is None:
        return None
    sock, who = connected
    signals = _Forwarder()
    try:
        reply, rest = _request(sock)
    except (OSError, ValueError) as exc:
        sock.close()
        signals.restore()
        _say(f"{who} did not answer ({exc}); starting normally")
        return None
    if not reply.get("ok"):
        sock.close()
        signals.restore()
        _say(f"{who} refused: {reply.get('reason', '?')}; starting normally")
        return None
    signals.target(int(reply["pid"]))
    code = _wait_for_exit(sock, rest, int(reply["pid"]))
    if code is not None:
        return code
    # FT: the worker died by a signal: stop its group (as ft_launcher stops a worker's) and die by one too
    if reply.get("group"):
        try:
            os.killpg(int(reply["pid"]), signal.SIGTERM)
        except OSError:
            pass
    signals.restore()
    os.kill(os.getpid(), signal.SIGKILL)
    return None  # not reached


def _request(sock: socket.socket) -> tuple[dict, bytes]:
    """Send the request; the standby's reply, and what the worker sent after it in the same read."""
    send_request(sock, {"kind": "worker", "argv": sys.argv, "start_time": process_start_time()}, [0, 1, 2])
    sock.settimeout(REPLY_TIMEOUT_S)
    received = b""
    while b"\n" not in received:
        chunk = sock.recv(4096)
        if not chunk:
            raise ValueError("it closed the connection")
        received += chunk
    sock.settimeout(None)
    line, rest = received.split(b"\n", 1)
    return json.loads(line), rest


def _wait_for_exit(sock: socket.socket, buffer: bytes, pid: int) -> int | None:
    """The last ``exit <code>`` the worker sent before its end closed the socket (``buffer``: what was read with
    the reply); None if it sent none: it died by a signal.

    A signal death is answered as soon as the worker begins to exit (``exiting``), not when its end of the socket
    closes: a worker killed with tens of GiB of device memory and page-locked host memory takes seconds in the
    kernel to release them, and its lifeline's watcher, which holds the same socket, goes only after that. Reported
    at once, ft_launcher restarts the rank while the kernel is still at it; the worker that follows waits for the
    memory it needs (``trainer/resiliency/device.py``) instead of the launcher waiting for all of it."""
    code: int | None = None
    sock.settimeout(EXIT_POLL_S)
    while True:
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.startswith(b"exit "):
                code = int(line.split()[1])
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            if code is None and exiting(pid):
                # what the worker sent before its exit began is in the socket already: read it before deciding
                sock.setblocking(False)
                chunk = _drain(sock)
                if b"\nexit " not in b"\n" + buffer + chunk:
                    _say(f"worker pid {pid} is exiting without an exit code (a signal): reported before the "
                         "kernel has released its memory")
                    return None
                sock.settimeout(EXIT_POLL_S)
            else:
                continue
        if not chunk:
            return code
        buffer += chunk


def _drain(sock: socket.socket) -> bytes:
    """What a non-blocking socket holds now."""
    data = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return data
        if not chunk:
            return data
        data += chunk


PF_EXITING = 0x4
"""The kernel's flag of a task in ``do_exit`` (``/proc/PID/stat``'s ninth field): set when the exit begins, before the
process's memory and files are released."""


def exiting(pid: int) -> bool:
    """Whether process ``pid`` has begun to exit (or is gone): its main thread is in the kernel's exit path, a zombie,
    or has no ``/proc`` entry."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    fields = stat[stat.rindex(b")") + 2:].split()
    return fields[0] in (b"Z", b"X") or bool(int(fields[6]) & PF_EXITING)


class _Forwarder:
    """Signals that arrive while this process is a proxy go to the worker; those that arrive before its pid is
    known are held, and delivered to it (or, after a refusal, to this process's default handling)."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.pending: list[int] = []
        self.saved = {sig: signal.signal(sig, self._on_signal) for sig in FORWARDED_SIGNALS}

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.pid is None:
            self.pending.append(signum)
            return
        try:
            os.kill(self.pid, signum)
        except OSError:  # the worker is gone: its end closes the socket
            pass

    def target(self, pid: int) -> None:
        self.pid = pid
        for signum in self.pending:
            self._on_signal(signum, None)
        self.pending = []

    def restore(self) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        for signum in self.pending:  # what would have happened to this process had it not asked a standby
            os.kill(os.getpid(), signum)
        self.pending = []


def _say(line: str) -> None:
    print(f"trainer: {line}", file=sys.stderr, flush=True)


# --- the wire: one request, both sides --------------------------------------------------------------------------

def send_request(sock: socket.socket, fields: dict, fds: list[int]) -> None:
    """A request: ``fields`` with this process's environment, working directory, module search path and pid, and
    the file descriptors ``fds`` attached to its length prefix."""
    body = json.dumps({**fields, "env": dict(os.environ), "cwd": os.getcwd(), "path": sys.path,
                       "pid": os.getpid()}).encode()
    socket.send_fds(sock, [HEADER.pack(len(body))], fds)
    sock.sendall(body)


def receive(conn: socket.socket, timeout: float = 10.0) -> tuple[list[int], dict]:
    """The taker's side of ``send_request``: the attached file descriptors and the request (raises ValueError or
    OSError for a malformed or truncated one, its descriptors closed)."""
    fds: list[int] = []
    try:
        conn.settimeout(timeout)
        head, fds, _, _ = socket.recv_fds(conn, HEADER.size, MAX_FDS)
        if len(head) != HEADER.size or len(fds) < 3:
            raise ValueError("a malformed request")
        (size,) = HEADER.unpack(head)
        body = b""
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise ValueError("a truncated request")
            body += chunk
        request = json.loads(body)
        if not isinstance(request, dict) or not isinstance(request.get("env"), dict):
            raise ValueError("a request without an environment")
        conn.settimeout(None)
        return fds, request
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def answer(conn: socket.socket, ok: bool, reason: str = "") -> None:
    """The taker's one-line reply: taken (by this process, its own process group's leader or not), or refused."""
    reply = {"ok": True, "pid": os.getpid(), "group": os.getpgrp() == os.getpid()} if ok else \
        {"ok": False, "reason": reason}
    conn.sendall((json.dumps(reply) + "\n").encode())


def import_time_mismatch(mine: dict[str, str], theirs: dict[str, str], my_path: list[str],
                         their_path: list[str]) -> str | None:
    """Why a taker with environment ``mine`` cannot run a worker launched with ``theirs`` (None: it can)."""
    if my_path != their_path:
        return f"the module search path differs (taker: {my_path}, worker: {their_path})"
    for name in sorted(set(mine) | set(theirs)):
        checked = name in IMPORT_TIME_ENV or name.startswith(IMPORT_TIME_PREFIXES)
        if not checked or name.startswith(READ_LATER_PREFIXES) or mine.get(name) == theirs.get(name):
            continue
        return f"{name} differs (taker: {mine.get(name)!r}, worker: {theirs.get(name)!r})"
    if "OMP_NUM_THREADS" in mine and "OMP_NUM_THREADS" not in theirs:
        return f"OMP_NUM_THREADS is set for the taker ({mine['OMP_NUM_THREADS']}), not for the worker"
    return None


# --- the taker's side -------------------------------------------------------------------------------------------

WATCHER = """
import ctypes, os, signal, socket, sys
worker, fd = int(sys.argv[1]), int(sys.argv[2])
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: gone with the worker
if os.getppid() != worker:
    sys.exit(0)
link = socket.socket(fileno=fd)
while link.recv(64):
    pass
os.killpg(worker, signal.SIGKILL) if os.getpgid(worker) == worker else os.kill(worker, signal.SIGKILL)
"""
"""The lifeline's watcher, a child process of the worker: it blocks on the proxy's socket and ends the worker's
process group when the proxy dies. A process, not a thread: a worker hung in a C call that holds the GIL (a stuck
driver call) could not run a thread's kill."""


class Lifeline:
    """The worker's link to its proxy (the launched process): it reports the exit code, and ends the worker's
    process group at once if the proxy dies first (ft_launcher's SIGKILL, ``kill -9``), as ft_launcher's own
    SIGKILL of a worker's group would (``WATCHER``)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.pid = os.getpid()
        self._exit = os._exit

    def start(self) -> None:
        # FT: the proxy is this worker's only tie to ft_launcher: nothing may outlive it
        subprocess.Popen([sys.executable, "-I", "-S", "-c", WATCHER, str(self.pid), str(self.conn.fileno())],
                         pass_fds=(self.conn.fileno(),), stdin=subprocess.DEVNULL)
        os.register_at_fork(after_in_child=self.conn.close)  # a forked child must not keep the proxy waiting
        os._exit = self._reporting_exit  # the trainer's fast exits (SIGTERM, preemption deadline) report too

    def report(self, code: int) -> None:
        if os.getpid() != self.pid:
            return
        try:
            self.conn.sendall(f"exit {int(code)}\n".encode())
        except OSError:  # the proxy is gone: the watcher ends this process
            pass

    def _reporting_exit(self, code: int) -> None:
        self.report(code)
        self._exit(code)


def adopt(fds: list[int], request: dict) -> None:
    """Become the requester's process in what it passed: stdin/stdout/stderr (``fds``' first three, closed
    after), environment, working directory and module search path. Python's temporary directory is found again
    from the new environment (a job's own TMPDIR, where ft_launcher's rank-monitor sockets are)."""
    sys.stdout.flush()
    sys.stderr.flush()
    for target_fd, fd in enumerate(fds[:3]):
        os.dup2(fd, target_fd)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[:] = list(request["path"])
    tempfile.tempdir = None


def take(conn: socket.socket, fds: list[int], request: dict) -> Lifeline:
    """Take over the launched worker that sent ``request`` (after ``answer``): its lifeline, stdio, environment,
    working directory, command line, thread count and start clock become this process's."""
    lifeline = Lifeline(conn)
    lifeline.start()
    adopt(fds, request)
    sys.argv = list(request["argv"])
    torch = sys.modules.get("torch")
    threads = request["env"].get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    phases = sys.modules.get("trainer.startup.phases")
    if phases is not None:  # the start clock's origin is the launched process's creation
        phases.CLOCK = phases.StartClock(origin=float(request["start_time"]))
    return lifeline


def run_target(target: str, lifeline: Lifeline) -> int:
    """Run ``module:function`` (the trainer's ``main``) with this process's command line, as the interpreter runs a
    program: its exit code, reported to the proxy (again from ``os._exit``, if an exit handler ends the process
    another way)."""
    module, function = target.split(":")
    try:
        code = getattr(importlib.import_module(module), function)(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    lifeline.report(code)
    return code
