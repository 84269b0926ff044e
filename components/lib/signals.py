"""SIGTERM as an exception, so a launcher's cleanup (delete the job, kill the process tree) runs when the
pipeline run is cancelled: KFP stops a step's pod with SIGTERM."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def sigterm_raises(make_error: Callable[[], BaseException]) -> Iterator[None]:
    """Inside the block, SIGTERM raises ``make_error()`` (main thread only, where signals are delivered);
    further SIGTERMs are ignored so the cleanup can finish. The previous handler is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise make_error()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
