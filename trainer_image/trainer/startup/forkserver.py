"""The node's fork server: torch, NVRx and the trainer imported once per node; every worker, warm standby and
checkpoint writer of the node is a fork of it.

The first of a node's processes to come to life (the package's docstring tells the rest). ``entrypoint.sh`` (knob
``TRAINER_FORKSERVER``, on by default) starts ``python -m trainer.startup.forkserver serve --dir
$TRAINER_FORKSERVER_DIR`` before ft_launcher, one per node (the directory is under the node's own job directory:
never shared by two nodes). It imports ``PRELOAD`` and then
checks that it may fork (``unfit``): one thread, no CUDA initialised, no ``/dev/nvidia*`` file open; so nothing
of a device, a lock held by another thread, or an OpenMP/MKL pool (made at the first parallel operation, which
the server never runs) is copied into a child. It listens on ``forkserver.sock`` and forks, on request:

- a **worker**: ft_launcher starts ``python -m trainer`` as ever; before importing torch it hands itself over
  (``handoff.py``, the same path as a warm standby's, ``standby.py``, which is asked first). The
  server checks the import-time environment (``handoff.import_time_mismatch``: a worker whose differs runs
  itself, one line says why) and forks; the child makes its own session, answers with its pid, takes the
  launched process's environment, working directory, stdio, command line and start clock (``handoff.take``) and
  runs the trainer's ``main``. The launched process is its proxy before ft_launcher (signals forwarded, exit code
  or signal death passed on, a lifeline both ways). The child's pid is the worker's: NVRx's rank monitor, the
  reaper's ``owner-<pid>`` records and the exit-code files see it. Its CUDA context, process groups and threads
  are its own, made after the fork;
- a **process** (``Process``: a checkpoint writer, ``trainer/checkpoint/writer.py``, or a warm standby,
  ``standby.py``'s ``forked_warm``): a ``multiprocessing`` process whose preparation data and pickled
  object come through a pipe, as ``multiprocessing``'s own fork server sends them; the server writes the child's
  pid, and later its exit code, to the requester's sentinel pipe, which ``multiprocessing.popen_forkserver.Popen``
  reads. The child takes the requester's stdio, environment and working directory; its parent is the server, and
  ``multiprocessing.parent_process()`` is its requester, whose end tells it when the requester is gone (a writer's
  watchdog and a standby not yet taken exit then, as they do when their parent dies).

The server reaps its children. When it is gone (killed, or it did not start), a worker's ``hand_over`` and a
writer's or standby's ``Process.start`` find its socket refusing: each says so in one line and starts the ordinary
way (``python -m trainer`` imports everything itself; NVRx spawns the writer; the standby server spawns the
standby). It dies with its entrypoint
(``PR_SET_PDEATHSIG``), which also stops it when the job ends; a child lives on without it (a worker belongs to its
proxy, a writer to its worker).

Why not ``multiprocessing.forkserver`` itself, which forks preloaded children too: its server is started by, and
lives only as long as, the one process that first uses it, whose children alone can reach it (the address and
the alive pipe are that process's private state); here the server must outlive every worker, be reached by
processes it did not start (each of ft_launcher's launched workers, and their writers), and give each child its
requester's stdio, environment and working directory, which its children take from the server. Its wire format
and child bootstrap are kept for processes: a writer's ``Popen`` is ``multiprocessing.popen_forkserver.Popen``
aimed at this server, and the child runs ``multiprocessing.spawn._main`` as that module's children do.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import io
import os
import select
import signal
import socket
import sys
import time
from multiprocessing import context, forkserver, popen_forkserver, process, reduction, spawn, util
from pathlib import Path

from trainer.startup.handoff import PR_SET_PDEATHSIG, adopt, answer, forkserver_path, import_time_mismatch, \
    receive, run_target, send_request, take
from trainer.startup.phases import FORKSERVER_DIR_ENV, FORKSERVER_SOCKET

PRELOAD = ("torch", "trainer.cli", "trainer.resiliency", "trainer.ledger", "trainer.train",
           "trainer.checkpoint.writer")
"""What a worker or a writer imports, once in the server: ``trainer.cli`` imports the rest lazily."""
DEFAULT_TARGET = "trainer.cli:main"
POLL_S = 0.2
PR_SET_NAME = 15
"""How often the server reaps its children and checks for SIGTERM while no request comes."""


def _say(line: str) -> None:
    print(f"forkserver: {line}", file=sys.stderr, flush=True)


def unfit() -> str | None:
    """Why this process must not fork workers (None: it may): a second thread (its locks could be copied held), CUDA
    initialised, or a ``/dev/nvidia*`` file open (a child would share the device's state)."""
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:
        return f"{len(threads)} threads after its imports"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised by its imports"
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            return f"{target} is open"
    return None


class Server:
    """One per node (``python -m trainer.startup.forkserver serve``)."""

    def __init__(self, directory: str, target: str) -> None:
        self.path = os.path.join(directory, FORKSERVER_SOCKET)
        self.target = target
        self.listener: socket.socket | None = None
        self.sentinels: dict[int, int | None] = {}
        """Children not yet reaped -> the sentinel pipe a process's requester reads (None for a worker)."""
        self.stopping = False

    def serve(self) -> int:
        """Listen and fork until SIGTERM; in a forked child, its exit code once its work ends."""
        started = time.monotonic()
        # numpy's OpenBLAS starts its thread pool as it is loaded, unless told one thread: loaded so here (a forked
        # child's BLAS runs on its calling thread, as under ft_launcher's OMP_NUM_THREADS=1), then forgotten
        blas = os.environ.pop("OPENBLAS_NUM_THREADS", None)
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
        try:
            for name in PRELOAD:
                importlib.import_module(name)
        finally:
            os.environ.pop("OPENBLAS_NUM_THREADS")
            if blas is not None:
                os.environ["OPENBLAS_NUM_THREADS"] = blas
        problem = unfit()
        if problem is not None:
            _say(f"not serving: {problem}; this node's processes start the ordinary way")
            return 1
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        partial = f"{self.path}.{os.getpid()}"
        Path(partial).unlink(missing_ok=True)
        self.listener.bind(partial)
        self.listener.listen(64)
        os.replace(partial, self.path)  # connectable as soon as it is there
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the entrypoint forwards ^C to the launcher; its trap stops us
        _say(f"ready in {time.monotonic() - started:.1f} s (pid {os.getpid()}): forks this node's workers and "
             "checkpoint writers")
        try:
            while not self.stopping:
                readable, _, _ = select.select([self.listener], [], [], POLL_S)
                if readable:
                    code = self._accept()
                    if code is not None:  # a child, whose work has ended
                        return code
                self._reap()
        finally:
            if self.listener is not None and not self.listener.fileno() < 0:
                Path(self.path).unlink(missing_ok=True)
        return 0

    def _stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def _accept(self) -> int | None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return None
        try:
            fds, request = receive(conn)
        except (OSError, ValueError):
            conn.close()
            return None
        kind = request.get("kind")
        if kind == "worker":
            reason = import_time_mismatch(dict(os.environ), request["env"], sys.path, request["path"])
            if reason is not None:
                return _refuse(conn, fds, reason)
        elif kind != "process" or len(fds) < 5:
            return _refuse(conn, fds, f"an unknown request ({kind!r})")
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as exc:  # EAGAIN, ENOMEM: the requester starts the ordinary way
            return _refuse(conn, fds, f"fork failed ({exc})")
        if pid == 0:
            return self._child(conn, fds, request)
        if kind == "process":  # the requester's Popen reads the pid, then the exit code, from its sentinel
            child_w = fds.pop(4)
            forkserver.write_signed(child_w, pid)
            self.sentinels[pid] = child_w
        else:
            self.sentinels[pid] = None
        _close(conn, fds)
        return None

    def _child(self, conn: socket.socket, fds: list[int], request: dict) -> int:
        """In the forked child: the server's listener, signal handlers and other children's pipes go; then it
        becomes the requested worker or process. Returns its exit code."""
        self.listener.close()
        for sentinel in self.sentinels.values():
            if sentinel is not None:
                os.close(sentinel)
        self.sentinels = {}
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()  # like ft_launcher's workers: its own process group, which its proxy may stop as a whole
        # its command line is the server's: its name (/proc/<pid>/comm) tells a worker from a writer
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, f"fork-{request['kind']}".encode(), 0, 0, 0)
        if request["kind"] == "worker":
            answer(conn, True)
            lifeline = take(conn, fds, request)
            print(f"trainer: forked by the node's fork server (pid {os.getpid()}) for local rank "
                  f"{request['env'].get('LOCAL_RANK', '?')} (rank {request['env'].get('RANK', '?')}, launched as pid "
                  f"{request['pid']})", file=sys.stderr, flush=True)
            return run_target(self.target, lifeline)
        conn.close()
        return _become_process(fds, request)

    def _reap(self) -> None:
        while self.sentinels:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            sentinel = self.sentinels.pop(pid, None)
            if sentinel is not None:
                try:
                    forkserver.write_signed(sentinel, os.waitstatus_to_exitcode(status))
                except OSError:  # its requester is gone
                    pass
                os.close(sentinel)


def _close(conn: socket.socket, fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    conn.close()


def _refuse(conn: socket.socket, fds: list[int], reason: str) -> None:
    """Tell the requester why not (it starts the ordinary way), and forget its request."""
    try:
        answer(conn, False, reason)
    except OSError:
        pass
    _close(conn, fds)


def _become_process(fds: list[int], request: dict) -> int:
    """A ``multiprocessing`` child, as ``multiprocessing.forkserver``'s are (``spawn._main``), with the requester's
    stdio, environment and working directory; the descriptors it pickled are found by index as there."""
    adopt(fds, request)
    child_r, child_w, inherited = fds[3], fds[4], fds[5:]
    os.close(child_w)  # the server's end: the requester's sentinel
    forkserver._forkserver._inherited_fds = inherited  # what popen_forkserver's DupFd.detach reads in a child
    parent_sentinel = os.dup(child_r)  # closed when the requester is gone: multiprocessing.parent_process()
    return spawn._main(child_r, parent_sentinel)


# --- the requesting side: a process forked by the node's server ---------------------------------------------------

def available() -> bool:
    """This process's node runs a fork server (``$TRAINER_FORKSERVER_DIR`` is set)."""
    return bool(os.environ.get(FORKSERVER_DIR_ENV))


class _Popen(popen_forkserver.Popen):
    """``multiprocessing``'s fork-server ``Popen``, aimed at the node's server instead of one of its own."""

    def _launch(self, process_obj: process.BaseProcess) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            context.set_spawning_popen(None)
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.connect(forkserver_path() or "")
                send_request(client, {"kind": "process"}, [0, 1, 2, child_r, child_w, *self._fds])
        except BaseException:
            for fd in (parent_r, parent_w):
                os.close(fd)
            raise
        finally:
            for fd in (child_r, child_w):
                os.close(fd)
        self.sentinel = parent_r
        _parent_w = os.dup(parent_w)  # held while this Popen lives: the child's parent_process() sentinel
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(parent_w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)  # EOFError: the server refused or died


class Process(process.BaseProcess):
    """A ``multiprocessing.Process`` forked by the node's fork server. ``start`` raises OSError (the server is
    gone) or EOFError (it refused or died before it forked): the caller then starts one the ordinary way."""

    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj: process.BaseProcess) -> _Popen:
        return _Popen(process_obj)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.startup.forkserver",
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="import once, then fork this node's workers and checkpoint writers")
    serve.add_argument("--dir", default=os.environ.get(FORKSERVER_DIR_ENV), help="where the server listens")
    serve.add_argument("--target", default=DEFAULT_TARGET, help="module:function a worker runs (tests only)")
    serve.add_argument("job", nargs=argparse.REMAINDER, help="the job's trainer arguments, after --: unused, but in "
                       "this server's command line, which its forked children share (ps shows whose they are)")
    args = parser.parse_args(argv)
    if not args.dir or not os.path.isdir(args.dir):
        parser.error(f"--dir (or ${FORKSERVER_DIR_ENV}) must be an existing directory; got {args.dir!r}")
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # FT: never outlive the entrypoint
    return Server(args.dir, args.target).serve()


if __name__ == "__main__":
    raise SystemExit(main())
