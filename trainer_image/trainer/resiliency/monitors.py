"""ft_launcher's rank monitors: every attempt of the worker group gets a fresh one per local rank. That is this
module's one concern.

NVRx 0.4.1 starts one rank monitor process per local rank with the node's first workers and keeps it for every
later attempt. A monitor carries a state machine of the nested restarts it has seen: a lost connection moves it from
``INITIALIZE``/``HANDLING_COMPLETED`` to ``HANDLING_START`` and a heartbeat back to ``HANDLING_COMPLETED``, but a
second lost connection before any heartbeat (a worker killed, then its successor failing before its first step: a
warm standby that met its dead predecessor's memory, an in-process restart during a restore) leaves it ``ABORTED``,
from which only a signal moves it. An ``ABORTED`` monitor answers every later heartbeat with an ``AssertionError``
and closes the connection: each worker of that local rank then fails at its first heartbeat, for every in-job
restart that follows.

So the launcher retires each monitor when it starts the workers of a new attempt (the old workers are stopped by
then) and starts a new one on the same socket path: the old one's exit removes that path, so it is waited for first
(SIGTERM, then SIGKILL after ``RETIRE_S``; the launcher's end retires its last monitors the same way).
A worker that still finds its monitor alive but refusing exits ``RANK_MONITOR_REFUSED``
(``trainer.resiliency.heartbeat``), which ft_launcher restarts like any failure: the next attempt has a new monitor.
"""

from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger("trainer.launch")

RETIRE_S = 5.0
"""How long a retired monitor has to leave after SIGTERM before it is killed."""


def _retire(process: object) -> None:
    try:
        process.terminate()  # type: ignore[attr-defined]
        process.join(RETIRE_S)  # type: ignore[attr-defined]
        if process.is_alive():  # type: ignore[attr-defined]
            process.kill()  # type: ignore[attr-defined]
            process.join(RETIRE_S)  # type: ignore[attr-defined]
    except (OSError, ValueError, AssertionError) as exc:  # already gone, or never started
        log.debug("rank monitor already gone: %s", exc)


def fresh_monitor_per_attempt(agent_cls: type) -> bool:
    """``agent_cls.setup_rank_monitors`` (called as each attempt's workers start) first retires the monitors of the
    attempt before, and ``shutdown_rank_monitors`` (the launcher's end) retires each within ``RETIRE_S``: NVRx joins
    a terminated monitor without a bound, and a monitor forked while another thread of the launcher held a lock may
    never run its SIGTERM handler. False, logged, where this NVRx has no such methods."""
    original = getattr(agent_cls, "setup_rank_monitors", None)
    if original is None or not hasattr(agent_cls, "shutdown_rank_monitors"):
        log.warning("rank monitors outlive their attempts: this NVRx has no setup_rank_monitors")
        return False

    def shutdown_rank_monitors(self: object) -> None:
        monitors = getattr(self, "_local_rank_to_rmon", {})
        for local_rank in sorted(monitors):
            process = monitors[local_rank]
            _retire(process)
            path = getattr(self, "get_rank_mon_socket_path", None)
            if path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path(local_rank))

    def setup_rank_monitors(self: object, envs: dict) -> None:
        monitors = getattr(self, "_local_rank_to_rmon", None)
        if monitors:  # not the first attempt: its workers are stopped, their monitors go with them
            for local_rank in sorted(monitors):
                _retire(monitors.pop(local_rank))
            log.info("rank monitors: a new one for each local rank of this attempt")
        original(self, envs)

    agent_cls.setup_rank_monitors = setup_rank_monitors  # type: ignore[attr-defined]
    agent_cls.shutdown_rank_monitors = shutdown_rank_monitors  # type: ignore[attr-defined]
    return True
