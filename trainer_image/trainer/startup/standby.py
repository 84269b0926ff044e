"""Warm standby workers for the in-job restart: a restarted worker skips the imports and the CUDA context.

A restarted worker spends most of its start importing torch, the trainer and NVRx, and making its CUDA context
(``phases``' ``import`` and ``model`` phases). ``entrypoint.sh`` (knob ``TRAINER_STANDBY``) runs one server per
node, ``python -m trainer.startup.standby serve``, which keeps at most one warm standby process per local rank in
``$TRAINER_STANDBY_DIR``:

- a standby (``python -m trainer.startup.standby warm``; with the node's fork server, ``forkserver.py``, a child
  of that server instead, whose imports it shares, ``forked_warm``) is spawned for local rank R once R's current
  worker finished its first step (it touches ``first-step-R``: ``phases.first_step_done``), so it never competes
  with a start-up or a restore; it does its warm-up in a thread at the lowest priority (``os.nice`` is per thread on
  Linux: the worker it becomes runs at the normal one). It imports what the trainer imports, sets its device and
  makes its CUDA context and a cuBLAS handle (if that fails, e.g. in EXCLUSIVE_PROCESS compute mode while the worker
  holds the GPU, it stays warm without them and says so once). With a context, it then loads the kernels the
  worker's first steps would load, for the job's configuration (the command line and world size in the marker), at
  small shapes (``warmup.for_standby``, knob ``resiliency.standby_prewarm``). Then it listens on
  ``standby-R.sock``. It dies with the server (``PR_SET_PDEATHSIG``);
- a launched worker (``python -m trainer``) hands itself over to it (``handoff.py``), and becomes its proxy;
  the standby checks that the environment read at import or CUDA-init time is the same as its own
  (``import_time_mismatch``), then takes the worker's environment, working directory, stdio, command line and start
  time, and runs the trainer's ``main``. Its pid is the worker's pid: NVRx's rank monitor, the in-process Wrapper's
  monitor, the reaper's ``owner-<pid>`` records and the exit-code files all see the real worker;
- when a standby is taken, the server spawns its replacement on the same rule (after the new worker's first step).

What it costs: one more Python process per local rank with torch, the trainer and NVRx imported, and on a GPU one
more CUDA context (and cuBLAS workspace) on that rank's device.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import multiprocessing
import multiprocessing.connection
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

from trainer.startup import forkserver
from trainer.startup.handoff import PR_SET_PDEATHSIG, answer, import_time_mismatch, receive, run_target, \
    socket_path, take
from trainer.startup.phases import FIRST_STEP_MARKER, STANDBY_DIR_ENV

DEFAULT_TARGET = "trainer.cli:main"
WARM_IMPORTS = {DEFAULT_TARGET: ("torch", "trainer.resiliency", "trainer.ledger", "trainer.train")}
"""What a standby imports for its target, besides the target's module: what ``trainer.cli`` imports lazily."""
POLL_S = 0.2
MAX_FAILURES = 3
"""Standbys of one local rank that die before they are used, in a row, before the server stops making them."""
WARM_NICE = 19


def _say(line: str) -> None:
    print(f"standby: {line}", file=sys.stderr, flush=True)


# --- the standby process --------------------------------------------------------------------------------------

class Standby:
    """One warm standby of one local rank (``python -m trainer.startup.standby warm``)."""

    def __init__(self, local_rank: int, directory: str, target: str, status_fd: int | None) -> None:
        self.local_rank = local_rank
        self.directory = directory
        self.target = target
        self.status = os.fdopen(status_fd, "w", buffering=1) if status_fd is not None else None
        self.note = ""
        self.ready_at = 0.0
        self.device = None
        self.job_cfg = None
        self.snapshot_files: list[str] = []
        self.premapper = None
        self.taken = False
        """A launched worker handed itself over: from then on its proxy, not the server, decides its life."""

    def warm(self) -> None:
        """Imports and the CUDA context, in a thread at the lowest priority."""
        failure: list[BaseException] = []

        def work() -> None:
            try:
                os.nice(WARM_NICE)  # this thread only (Linux)
                module, _ = self.target.split(":")
                for name in (*WARM_IMPORTS.get(self.target, ()), module):
                    importlib.import_module(name)
                self.note = self._cuda_context()
                if self.device is not None and self.target == DEFAULT_TARGET:
                    self.note += self._prewarm()
                    self.note += self._premap()
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                failure.append(exc)

        thread = threading.Thread(target=work, name="standby-warm-up")
        thread.start()
        thread.join()
        if failure:
            raise failure[0]

    def _cuda_context(self) -> str:
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available():
            return ""
        if self.local_rank >= torch.cuda.device_count():
            return f"; no CUDA context (local rank {self.local_rank} has no GPU among {torch.cuda.device_count()})"
        short = _no_room_for_a_context(self.local_rank)
        if short:
            return f"; no CUDA context ({short}): the worker it becomes makes one"
        try:
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
            ones = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
            (ones @ ones).sum().item()  # the context, the allocator and a cuBLAS handle
            self.device = device
            return f"; CUDA context on cuda:{self.local_rank}"
        except Exception as exc:  # noqa: BLE001 - e.g. EXCLUSIVE_PROCESS mode while the worker holds the GPU
            line = " ".join(str(exc).split())[:200]
            return f"; no CUDA context ({type(exc).__name__}: {line}): the worker it becomes makes one"

    def _prewarm(self) -> str:
        """The warm-up of the job's kernels at small shapes (``warmup.for_standby``, knob
        ``resiliency.standby_prewarm``), configured by the command line and world size that the worker it replaces
        wrote into its first-step marker (``phases.first_step_done``)."""
        marker = os.path.join(self.directory, FIRST_STEP_MARKER.format(rank=self.local_rank))
        try:
            record = json.loads(Path(marker).read_text())
            argv, cwd = [str(a) for a in record["argv"]], str(record["cwd"])
            world_size = int(record.get("world_size", 1))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"; no prewarm (the first-step marker holds no command line: {type(exc).__name__})"
        environment = dict(os.environ)  # the handoff compares it with the worker's (import_time_mismatch)
        try:
            from trainer.config import parse_args
            from trainer.startup.warmup import for_standby

            os.chdir(cwd)  # a relative --config or data path, as the worker saw it (the handoff sets it again)
            _, cfg = parse_args(argv)
            self.job_cfg, self.snapshot_files = cfg, [str(p) for p in record.get("snapshot_files", [])]
            if not cfg.resiliency.standby_prewarm:
                return "; no prewarm (resiliency.standby_prewarm=false)"
            return f"; prewarm {for_standby(cfg, self.device, world_size)}"
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a standby without it is still warm
            line = " ".join(str(exc).split())[:200]
            return f"; no prewarm ({type(exc).__name__}: {line})"
        finally:  # what the warm-up set (Inductor's TORCHINDUCTOR_CACHE_DIR, seen on H200) is not the worker's
            os.environ.clear()
            os.environ.update(environment)

    def _premap(self) -> str:
        """Map and page-lock the node-local snapshot slots of the worker it replaces, in the background until it is
        taken (``trainer/checkpoint/premap.py``, knob ``resiliency.standby_premap``): its restore then copies
        at once instead of page-locking 18 GB first."""
        if self.job_cfg is None or not self.snapshot_files:
            return ""
        if not self.job_cfg.resiliency.standby_premap:
            return "; no premap (resiliency.standby_premap=false)"
        from trainer.checkpoint.premap import Premapper

        torch, device = sys.modules["torch"], self.device
        self.premapper = Premapper(self.snapshot_files, thread_init=lambda: torch.cuda.set_device(device))
        self.premapper.start()
        return f"; page-locking its {len(self.snapshot_files)} node-local snapshot slots in the background"

    def serve(self) -> int:
        """Listen until a launched worker hands itself over, then run as it; returns the exit code."""
        path = socket_path(self.directory, self.local_rank)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        partial = f"{path}.{os.getpid()}"
        Path(partial).unlink(missing_ok=True)
        listener.bind(partial)
        listener.listen(4)
        os.replace(partial, path)  # connectable as soon as it is there
        self.ready_at = time.monotonic()
        self._status(f"ready{self.note}; {_resident_mib()} MiB resident")
        while True:
            conn, _ = listener.accept()
            taken = self._handle(conn, listener, path)
            if taken is not None:
                return self._run(*taken)

    def _handle(self, conn: socket.socket, listener: socket.socket, path: str) -> tuple | None:
        try:
            fds, request = receive(conn)
        except (OSError, ValueError):
            conn.close()
            return None
        taken = False
        try:
            reason = import_time_mismatch(dict(os.environ), request["env"], sys.path, request["path"])
            if reason is None and request["env"].get("LOCAL_RANK", "0") != str(self.local_rank):
                reason = f"it is warm for local rank {self.local_rank}, not {request['env'].get('LOCAL_RANK')}"
            if reason is not None:
                answer(conn, False, reason)
                raise ValueError(reason)
            # FT: taken: from here this process is the worker of that local rank; the server makes a replacement
            taken = True
            listener.close()
            Path(path).unlink(missing_ok=True)
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 0)  # its life is its proxy's now
            self.taken = True
            self._status(f"taken {time.time_ns()}")
            if self.status is not None:
                self.status.close()
            answer(conn, True)
        except (OSError, ValueError, KeyError) as exc:
            for fd in fds:
                os.close(fd)
            conn.close()
            if taken:  # failed half-way through its takeover: nothing to go back to
                raise SystemExit(f"standby: the handoff failed after it was taken: {exc}") from exc
            return None
        return conn, fds, request

    def _run(self, conn: socket.socket, fds: list[int], request: dict) -> int:
        lifeline = take(conn, fds, request)
        premapped = ""
        if self.premapper is not None:  # FT: stopped before the restore that takes its mappings
            self.premapper.stop()
            premapped = f"; {self.premapper.locked_bytes() / 2**30:.1f} GiB of its snapshot slots page-locked ahead"
            if self.premapper.refused:
                premapped += f" ({self.premapper.refused})"
        print(f"trainer: standby worker (pid {os.getpid()}, warm for {time.monotonic() - self.ready_at:.1f} s) "
              f"took over local rank {self.local_rank} (rank {request['env'].get('RANK', '?')}, launched as pid "
              f"{request['pid']}){premapped}", file=sys.stderr, flush=True)
        return run_target(self.target, lifeline)

    def _status(self, line: str) -> None:
        if self.status is not None and not self.status.closed:
            try:
                self.status.write(line + "\n")
            except OSError:
                pass


def _no_room_for_a_context(local_rank: int) -> str:
    """Why this standby makes no CUDA context beside the running worker ('' where it has room): its context takes
    ``staging.STANDBY_DEVICE_BYTES``, and the worker keeps ``staging``'s margin for its own growth. The worker's
    budget line (``checkpoint.device_staging``) counts a standby in; this checks what the device really has."""
    from trainer.checkpoint.staging import STANDBY_DEVICE_BYTES, device_margin
    from trainer.resiliency.device import nvml_memory

    memory = nvml_memory(local_rank)
    if memory is None:
        return ""
    reading = memory()
    have, need = int(reading.free), STANDBY_DEVICE_BYTES + device_margin(int(reading.total))
    if have >= need:
        return ""
    return (f"{have / 2**30:.1f} GiB free on cuda:{local_rank}, a standby's context and the worker's margin need "
            f"{need / 2**30:.1f} GiB")


def _resident_mib() -> str:
    """This process's resident host memory (VmRSS), in MiB: what a warm standby costs the node."""
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return str(kib // 1024)
    except (OSError, StopIteration, ValueError):
        return "?"


def warm_main(args: argparse.Namespace) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # FT: never outlive the server
    if args.parent and os.getppid() != args.parent:  # it died before the line above
        return 0
    standby = Standby(args.local_rank, args.dir, args.target, args.status_fd)
    standby.warm()
    return standby.serve()


def forked_warm(local_rank: int, directory: str, target: str, status: Connection) -> None:
    """A standby forked by the node's fork server (``Server._spawn``): its parent is that server, so it watches the
    standby server that asked for it (its owner's pipe) and dies with it until it is taken, as a spawned standby
    does by ``PR_SET_PDEATHSIG``."""
    owner = multiprocessing.parent_process()
    status_fd = os.dup(status.fileno())
    status.close()
    standby = Standby(local_rank, directory, target, status_fd)

    def die_with_owner() -> None:
        multiprocessing.connection.wait([owner.sentinel])
        if not standby.taken:
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=die_with_owner, name="standby-owner-watch", daemon=True).start()
    standby.warm()
    sys.exit(standby.serve())


class _Forked:
    """A forked standby (``forkserver.Process``) as the server keeps a spawned one (``subprocess.Popen``)."""

    def __init__(self, process: forkserver.Process) -> None:
        self.process, self.pid = process, process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def wait(self) -> int | None:
        self.process.join()
        return self.process.exitcode


# --- the server -----------------------------------------------------------------------------------------------

class _Rank:
    """The server's view of one local rank: its warm (or warming) standby, and those that were taken."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.proc: subprocess.Popen | None = None
        self.status = b""
        self.pipe: int | None = None
        self.spawned = 0.0
        self.taken_ns = 0
        self.failures = 0
        self.workers: list[subprocess.Popen] = []


class Server:
    """Keeps at most one standby per local rank (``python -m trainer.startup.standby serve``)."""

    def __init__(self, nproc: int, directory: str, target: str) -> None:
        self.directory = directory
        self.target = target
        self.ranks = [_Rank(r) for r in range(nproc)]
        self.selector = selectors.DefaultSelector()
        self.stopping = False

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the entrypoint forwards ^C to the launcher; its trap stops us
        while not self.stopping:
            for key, _ in self.selector.select(POLL_S):
                self._read(key.data)
            for rank in self.ranks:
                self._check(rank)
        self._shutdown()
        return 0

    def _stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def _spawn(self, rank: _Rank) -> None:
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        rank.proc = self._fork(rank, write_end)
        if rank.proc is None:
            command = [sys.executable, "-m", "trainer.startup.standby", "warm", "--local-rank", str(rank.rank),
                       "--dir", self.directory, "--parent", str(os.getpid()), "--status-fd", str(write_end),
                       "--target", self.target]
            rank.proc = subprocess.Popen(command, pass_fds=(write_end,), stdin=subprocess.DEVNULL,
                                         start_new_session=True)  # like ft_launcher's workers: no terminal signals
        os.close(write_end)
        rank.pipe, rank.status, rank.spawned = read_end, b"", time.monotonic()
        self.selector.register(read_end, selectors.EVENT_READ, rank)

    def _fork(self, rank: _Rank, status_fd: int) -> _Forked | None:
        """A standby forked by the node's fork server (its imports are the server's); None without a server, or
        when it is gone (one line: the standby is then spawned)."""
        if not forkserver.available():
            return None
        status = Connection(os.dup(status_fd), readable=False)
        try:
            process = forkserver.Process(target=forked_warm, args=(rank.rank, self.directory, self.target, status),
                                         name=f"standby-{rank.rank}")
            process.start()
            return _Forked(process)
        except (OSError, EOFError) as exc:  # FT: the fork server is gone: spawned, it imports everything itself
            _say(f"local rank {rank.rank}: the node's fork server did not fork a standby ({type(exc).__name__}: "
                 f"{exc}); spawning one")
            return None
        finally:
            status.close()

    def _read(self, rank: _Rank) -> None:
        """Everything the standby of ``rank`` has written to its status pipe."""
        while rank.pipe is not None:
            try:
                chunk = os.read(rank.pipe, 4096)
            except BlockingIOError:
                return
            if not chunk:
                self._close_pipe(rank)
                return
            rank.status += chunk
            *lines, rank.status = rank.status.split(b"\n")
            for line in lines:
                self._on_status(rank, line.decode(errors="replace"))

    def _on_status(self, rank: _Rank, line: str) -> None:
        if line.startswith("ready"):
            rank.failures = 0
            _say(f"local rank {rank.rank}: warm in {time.monotonic() - rank.spawned:.1f} s (pid "
                 f"{rank.proc.pid if rank.proc else '?'}){line[len('ready'):]}")
        elif line.startswith("taken ") and rank.proc is not None:
            rank.taken_ns = int(line.split()[1])
            rank.workers.append(rank.proc)
            rank.proc = None

    def _close_pipe(self, rank: _Rank) -> None:
        if rank.pipe is not None:
            self.selector.unregister(rank.pipe)
            os.close(rank.pipe)
            rank.pipe = None

    def _check(self, rank: _Rank) -> None:
        rank.workers = [w for w in rank.workers if w.poll() is None]  # reaped when they end
        if rank.proc is not None and rank.proc.poll() is not None:
            self._read(rank)  # a "taken" line it wrote just before it ended
        if rank.proc is not None and rank.proc.poll() is not None:
            rank.failures += 1
            _say(f"local rank {rank.rank}: the standby (pid {rank.proc.pid}) exited {rank.proc.returncode} before "
                 "it was used" + ("; no more standbys for this rank" if rank.failures >= MAX_FAILURES else ""))
            self._close_pipe(rank)
            rank.proc = None
            Path(socket_path(self.directory, rank.rank)).unlink(missing_ok=True)
        if rank.proc is None and rank.failures < MAX_FAILURES and self._first_step_after(rank):
            self._spawn(rank)

    def _first_step_after(self, rank: _Rank) -> bool:
        """The current worker of ``rank`` finished its first step (after the last standby was taken)."""
        try:
            marker = os.stat(os.path.join(self.directory, FIRST_STEP_MARKER.format(rank=rank.rank)))
        except OSError:
            return False
        return marker.st_mtime_ns > rank.taken_ns

    def _shutdown(self) -> None:
        for rank in self.ranks:
            if rank.proc is not None and rank.proc.poll() is None:
                rank.proc.kill()
                rank.proc.wait()
                Path(socket_path(self.directory, rank.rank)).unlink(missing_ok=True)
            self._close_pipe(rank)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.startup.standby", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="keep one warm standby per local rank")
    serve.add_argument("--nproc", type=int, required=True, help="local ranks (workers on this node)")
    warm = sub.add_parser("warm", help="one standby (spawned by the server)")
    warm.add_argument("--local-rank", type=int, required=True)
    warm.add_argument("--parent", type=int, default=0, help="the server's pid")
    warm.add_argument("--status-fd", type=int, default=None)
    for p in (serve, warm):
        p.add_argument("--dir", default=os.environ.get(STANDBY_DIR_ENV), help="where the standbys listen")
        p.add_argument("--target", default=DEFAULT_TARGET, help="module:function a standby runs (tests only)")
    args = parser.parse_args(argv)
    if not args.dir or not os.path.isdir(args.dir):
        parser.error(f"--dir (or ${STANDBY_DIR_ENV}) must be an existing directory; got {args.dir!r}")
    if args.command == "serve":
        return Server(args.nproc, args.dir, args.target).run()
    return warm_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
