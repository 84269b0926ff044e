"""What a standby runs instead of the trainer in tests/resiliency/test_standby.py (``--target standby_target:main``).

``exit N``: print a line naming this process on stdout, return N. ``os_exit N``: ``os._exit(N)`` (the trainer's fast
exits). ``sleep DIR``: write ``DIR/pid`` and wait; SIGTERM writes ``DIR/sigterm`` and exits 143. ``hang_gil DIR``: write
``DIR/pid``, then sleep in a C call that holds the GIL. ``hold DIR``: fill ``HOLD_MIB`` MiB of memory (a worker's
large allocation: its release takes the kernel a while after a SIGKILL), then as ``sleep``. ``probe FILE``: write what this process inherited as JSON
(its threads, torch's CUDA state, open ``/dev/nvidia*`` files, the pid NVRx's rank-monitor client reports) and
return 0 (the fork server's tests, ``test_forkserver.py``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    action, arg = argv
    if action == "exit":
        print(f"target pid {os.getpid()} cwd {os.getcwd()} rank {os.environ.get('RANK')}", flush=True)
        return int(arg)
    if action == "os_exit":
        sys.stdout.flush()
        os._exit(int(arg))
    if action == "probe":
        return probe(Path(arg))
    directory = Path(arg)
    if action == "hang_gil":  # stuck in a C call that holds the GIL, as a rank stuck in a driver call
        import ctypes

        (directory / "pid").write_text(str(os.getpid()))
        ctypes.PyDLL(None).sleep(600)

    def on_sigterm(signum: int, frame: object) -> None:
        (directory / "sigterm").write_text(str(os.getpid()))
        os._exit(143)

    if action == "hold":
        import mmap

        held = mmap.mmap(-1, int(os.environ["HOLD_MIB"]) << 20)
        for offset in range(0, len(held), mmap.PAGESIZE):
            held[offset] = 1
    signal.signal(signal.SIGTERM, on_sigterm)
    (directory / "pid").write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)


def probe(path: Path) -> int:
    import json
    import threading

    import torch
    from nvidia_resiliency_ext.fault_tolerance.data import RankInfo

    threads = len(os.listdir("/proc/self/task"))  # before anything here may start one
    fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
           if os.path.exists(f"/proc/self/fd/{fd}")]
    path.write_text(json.dumps({
        "pid": os.getpid(), "threads": threads, "python_threads": threading.active_count(),
        "cuda_initialized": torch.cuda.is_initialized(),
        "nvidia_files": [f for f in fds if f.startswith("/dev/nvidia")],
        "rank_monitor_pid": RankInfo.get_for_current_rank().pid, "torch_imported_before": "torch" in PRELOADED,
        "cwd": os.getcwd(), "argv": sys.argv, "env_marker": os.environ.get("PROBE_MARKER"),
    }))
    return 0




def process_report(path: str, code: int) -> None:
    """A ``trainer.startup.forkserver.Process`` target: write what it was given (pid, parent, owner, environment,
    working directory) as JSON, then exit ``code``."""
    import json
    import multiprocessing

    Path(path).write_text(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(),
                                      "owner": multiprocessing.parent_process().pid,
                                      "env_marker": os.environ.get("PROBE_MARKER")}))
    sys.exit(code)


def orphan_watch(path: str) -> None:
    """A ``trainer.startup.forkserver.Process`` target: the checkpoint writer's orphan watchdog, then wait
    (``DIR/pid``)."""
    from trainer.checkpoint.writer import _exit_when_orphaned

    _exit_when_orphaned()
    Path(path).write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)


PRELOADED = set(sys.modules)
"""Modules already imported when this module was (a forked worker: the fork server's)."""


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
