"""What a standby runs instead of the trainer in tests/resiliency/test_standby.py (``--target standby_target:main``).

``exit N``: print a line naming this process on stdout, return N. ``os_exit N``: ``os._exit(N)`` (the trainer's fast
exits). ``sleep DIR``: write ``DIR/pid`` and wait; SIGTERM writes ``DIR/sigterm`` and exits 143. ``hang_gil DIR``: write
``DIR/pid``, then sleep in a C call that holds the GIL.
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
    directory = Path(arg)
    if action == "hang_gil":  # stuck in a C call that holds the GIL, as a rank stuck in a driver call
        import ctypes

        (directory / "pid").write_text(str(os.getpid()))
        ctypes.PyDLL(None).sleep(600)

    def on_sigterm(signum: int, frame: object) -> None:
        (directory / "sigterm").write_text(str(os.getpid()))
        os._exit(143)

    signal.signal(signal.SIGTERM, on_sigterm)
    (directory / "pid").write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
