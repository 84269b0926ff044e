"""The in-job layer's client: NVRx ``RankMonitorClient`` heartbeats to ``ft_launcher``'s rank monitor (see the
package docstring, layer 2), or a null object when there is no launcher to tell."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Any, Iterator

import torch.distributed as dist

from trainer.checkpoint.persistent import KEEPALIVE_S
from trainer.config import ConfigError
from trainer.exitcodes import ExitCode, TrainerExit

log = logging.getLogger("trainer.resiliency")

SAVES_BEFORE_TIMEOUT_CALC = 2  # compute heartbeat timeouts once an interval containing a save was seen, then again
TIMEOUT_CALC_EVERY_SAVES = 10  # every 10th save: NVRx all-reduces on the training group (not with one rank: on_save),
# then 3 host syncs (.item())
KEEPALIVES_PER_TIMEOUT = 5
"""A learned ``subsequent`` timeout spans at least this many of the liveness signals a blocking save sends while it
waits on the disk (``checkpoint.persistent.KEEPALIVE_S`` apart): NVRx's safety factor over the steps' intervals,
applied to that cadence. Fast steps teach a timeout under the cadence itself, and a rank waiting on a slow disk
would then be restarted into the same wait."""


def _one_rank_has_nothing_to_synchronize() -> None:
    return None


FT_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"
PROBE_TIMEOUT_S = 2.0


def monitor_listening(path: str) -> bool:
    """Whether a rank monitor still accepts connections on its socket ``path`` (a dead one's path refuses them)."""
    if not path:
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PROBE_TIMEOUT_S)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


# --- in-job layer: heartbeats -------------------------------------------------------------------------
class NullHeartbeat:
    """No ft_launcher: nothing to tell. Its (empty) state still goes into the checkpoint as ``ft``."""

    active = False

    def start(self) -> None: ...
    def beat(self) -> None: ...
    def on_save(self) -> None: ...
    def stop(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: return {}  # noqa: E704
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Heartbeat(NullHeartbeat):
    """NVRx ``RankMonitorClient``: a heartbeat per step; timeouts learned from observed intervals."""

    active = True

    def __init__(self, floor_s: float | None) -> None:
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        self.client = RankMonitorClient()
        self.floor_s = floor_s  # in-process hard timeout + margin when the Wrapper is on
        self.saves, self.logged = 0, None  # saves seen; the learned timeouts last logged
        self.first_beat_s: float | None = None  # ft_launcher's initial heartbeat timeout, read at the first connect
        self.beaten = False  # a heartbeat went over the current connection

    def start(self) -> None:
        """(Re)connect to this rank's monitor; per in-process iteration, as NVRx's nested example does. A connection
        that has carried no heartbeat yet gets one before it closes: the monitor takes two lost connections without a
        heartbeat between them for an aborted restart and refuses every heartbeat after (``monitors``)."""
        with self._monitor_link("connect to"):
            if self.client.is_initialized:
                if not self.beaten:
                    self.client.send_heartbeat()  # FT: this process is alive; it is restarting in-process
                self.client.shutdown_workload_monitoring()
            self.client.init_workload_monitoring()
        self.beaten = False
        if self.first_beat_s is None:
            self.first_beat_s = self.client.cfg.initial_rank_heartbeat_timeout
        configured = self.client.cfg.rank_heartbeat_timeout
        if self.floor_s is not None and configured is not None and configured < self.floor_s:
            raise ConfigError(
                f"ft_launcher's rank heartbeat timeout ({configured:g} s) must exceed the in-process hard "
                f"timeout plus grace ({self.floor_s:g} s), or the in-job layer kills ranks the in-process "
                "layer is about to recover: raise FT_RANK_HEARTBEAT_TIMEOUT (entrypoint.sh) or lower "
                "resiliency.hard_timeout_s"
            )

    def beat(self) -> None:
        with self._monitor_link("send a heartbeat to"):
            self.client.send_heartbeat()
        self.beaten = True

    def on_save(self) -> None:
        """Called on every rank at the same step (a save step): learns timeouts (a collective)."""
        self.saves += 1
        if self.saves < SAVES_BEFORE_TIMEOUT_CALC or (self.saves - SAVES_BEFORE_TIMEOUT_CALC) % TIMEOUT_CALC_EVERY_SAVES:
            return
        calc = getattr(self.client, "timeouts_calc", None)
        if calc is not None and dist.is_initialized() and dist.get_world_size() == 1:
            # NVRx's TimeoutsCalc.synchronize_all all-reduces the measured times on the default group even with one
            # rank: on NCCL that makes a one-rank communicator (at the second save), and every in-process abort after
            # it tears that down (most of a second on an H200, against milliseconds without it). With one rank the
            # maximum over the ranks is this rank's own.
            calc.synchronize_all = _one_rank_has_nothing_to_synchronize
        with self._monitor_link("send heartbeat timeouts to"):
            learned = self.client.calculate_and_set_hb_timeouts(skip_if_not_ready=True)
        if learned:
            bounded = self._bounded(self.client.hb_timeouts)
            if bounded != self.client.hb_timeouts:
                with self._monitor_link("send heartbeat timeouts to"):
                    # No public setter for an adjusted value; this is what calculate_and_set_* calls.
                    self.client._set_calculated_timeouts(new_hb_timeouts=bounded, new_section_timeouts=None)
            if self.client.hb_timeouts != self.logged:  # learned again at every save; logged when they change
                self.logged = self.client.hb_timeouts
                log.info("in-job heartbeat timeouts: %s", self.client.hb_timeouts)

    def _bounded(self, timeouts: Any) -> Any:
        """Learned timeouts, bounded below. ``subsequent`` never below the in-process floor (layers nest
        outward) nor ``KEEPALIVES_PER_TIMEOUT`` of a blocking save's liveness signals. ``initial`` never below
        ft_launcher's configured one: NVRx learns it from the time between connecting and the first heartbeat of
        this attempt (a fraction of a second: the connection is made just before the loop), but the rank monitor
        outlives the worker and applies it to the respawned worker, which connects before it loads its checkpoint.
        A learned 0.71 s killed a respawned worker while it loaded, and the killed worker left its monitor ABORTED,
        refusing every later heartbeat."""
        from nvidia_resiliency_ext.fault_tolerance.data import HeartbeatTimeouts

        floor = self.floor_s or 0.0
        initial = max(timeouts.initial, self.first_beat_s or 0.0, floor)
        subsequent = max(timeouts.subsequent, floor, KEEPALIVES_PER_TIMEOUT * KEEPALIVE_S)
        if (initial, subsequent) == (timeouts.initial, timeouts.subsequent):
            return timeouts
        return HeartbeatTimeouts(initial=initial, subsequent=subsequent, were_calculated=True)

    def stop(self) -> None:
        with contextlib.suppress(Exception):  # teardown: the monitor may already be gone (that was reported)
            self.client.shutdown_workload_monitoring()

    @contextlib.contextmanager
    def _monitor_link(self, action: str) -> Iterator[None]:
        """FT: a broken rank-monitor link is not a bug. A monitor that still accepts connections refused this
        worker (``RANK_MONITOR_REFUSED``: an in-job restart, with new monitors); one that is gone is a lost launcher,
        for a new pod (``LAUNCHER_LOST``). Both are ``TrainerExit``, which passes through the in-process Wrapper."""
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClientError

        try:
            yield
        except (OSError, RankMonitorClientError) as exc:  # BrokenPipe, ConnectionRefused, a broken reply
            cause = f"{type(exc).__name__}: {exc}"
            if monitor_listening(os.environ.get(FT_SOCKET_ENV, "")):
                raise TrainerExit(ExitCode.RANK_MONITOR_REFUSED,
                                  f"ft_launcher's rank monitor is alive but refused to let this worker {action} it "
                                  f"({cause}); the in-job layer restarts the group with new monitors") from exc
            raise TrainerExit(ExitCode.LAUNCHER_LOST,
                              f"cannot {action} ft_launcher's rank monitor ({cause}); the pod restarts") from exc

    def state_dict(self) -> dict[str, Any]:
        return dict(self.client.state_dict()) if self.client.hb_timeouts is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Timeouts a checkpoint carries, bounded as learned ones are (an older checkpoint may hold a learned
        ``initial`` below ft_launcher's)."""
        import dataclasses

        from nvidia_resiliency_ext.fault_tolerance.data import HeartbeatTimeouts

        key = self.client.CURRENT_TIMEOUTS_STATE_KEY
        saved = dict(state.get(key) or {})
        if "heartbeat" in saved:
            saved["heartbeat"] = dataclasses.asdict(self._bounded(HeartbeatTimeouts(**saved["heartbeat"])))
            state = {**state, key: saved}
        with self._monitor_link("send heartbeat timeouts to"):
            self.client.load_state_dict(state)

