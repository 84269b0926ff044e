"""The launched worker's side of the warm standby (``trainer/standby.py``): hand this rank's work to a standby that
has already imported torch, the trainer and NVRx and made its CUDA context, and become its proxy.

``python -m trainer`` calls ``hand_over()`` before anything imports torch. With ``TRAINER_STANDBY_DIR`` set and a
standby listening on ``standby-<LOCAL_RANK>.sock`` there, this process sends it its command line, environment,
working directory and start time, and its stdin/stdout/stderr (SCM_RIGHTS). The standby either refuses (an
environment variable read at import or CUDA-init time differs; one line here, then this process runs normally)
or takes over: it runs the trainer's ``main`` as this rank's worker, and this process becomes its proxy:

- SIGTERM/SIGINT/SIGUSR1/SIGUSR2/SIGHUP sent here (ft_launcher stopping the group, a preemption) go to the worker;
- this process exits with the worker's exit code, once the worker is gone (its exit handlers, which clean
  ``/dev/shm``, have run);
- a worker killed by a signal (SIGKILL by a fault, the OOM killer, NVRx's rank monitor) sends no code: this
  process then stops the worker's process group (its checkpoint writers, monitors) with SIGTERM, as ft_launcher
  would have, and kills itself with SIGKILL, so ft_launcher sees a signal death (retryable) as before;
- if this process is killed (ft_launcher's SIGKILL after its stop timeout, ``kill -9``), the worker kills its own
  process group at once (``standby.Lifeline``).

Wire format on the unix socket: request = 4-byte big-endian length (with fds 0, 1, 2 attached) + JSON; reply = one
JSON line (``{"ok": true, "pid": P, "group": bool}`` or ``{"ok": false, "reason": "..."}``); then the worker sends
``exit <code>`` lines (the last one counts) until it ends.

Standard library only: it runs before torch is imported, in every launched worker.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

from trainer.startup import STANDBY_DIR_ENV, process_start_time  # standard library only

SOCKET_NAME = "standby-{rank}.sock"
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
REPLY_TIMEOUT_S = 30.0
"""How long the launched process waits for a standby's answer before it runs itself (a standby that answers
late finds this end closed and kills itself: never two workers for one rank)."""
HEADER = struct.Struct(">I")


def socket_path(directory: str, local_rank: int | str) -> str:
    return os.path.join(directory, SOCKET_NAME.format(rank=local_rank))


def hand_over() -> int | None:
    """Hand this process's work to this rank's standby: returns None when there is none or it refused (run here);
    otherwise never returns (exits with the worker's code, or dies by SIGKILL as the worker did)."""
    directory = os.environ.get(STANDBY_DIR_ENV)
    if not directory:
        return None
    local_rank = os.environ.get("LOCAL_RANK", "0")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_path(directory, local_rank))
    except OSError:  # no standby warm for this rank (the first start, or not ready yet): the normal path
        sock.close()
        return None
    signals = _Forwarder()
    try:
        reply, rest = _request(sock)
    except (OSError, ValueError) as exc:
        sock.close()
        signals.restore()
        _say(f"the standby for local rank {local_rank} did not answer ({exc}); starting normally")
        return None
    if not reply.get("ok"):
        sock.close()
        signals.restore()
        _say(f"the standby for local rank {local_rank} refused: {reply.get('reason', '?')}; starting normally")
        return None
    signals.target(int(reply["pid"]))
    code = _wait_for_exit(sock, rest)
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
    body = json.dumps({"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(),
                       "start_time": process_start_time(), "path": sys.path, "pid": os.getpid()}).encode()
    socket.send_fds(sock, [HEADER.pack(len(body))], [0, 1, 2])
    sock.sendall(body)
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


def _wait_for_exit(sock: socket.socket, buffer: bytes) -> int | None:
    """The last ``exit <code>`` the worker sent before its end closed the socket (``buffer``: what was read with
    the reply); None if it sent none."""
    code: int | None = None
    while True:
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.startswith(b"exit "):
                code = int(line.split()[1])
        chunk = sock.recv(4096)
        if not chunk:
            return code
        buffer += chunk


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
