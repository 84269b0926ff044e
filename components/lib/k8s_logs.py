"""Follows the rank-0 pod's log of a training job into the train step's log (the launcher's log streamer).

`MasterLogStreamer` runs in a background thread while `components.lib.k8s_launcher` watches the job: it
finds the newest live rank-0 pod by label selector (a PyTorchJob's Master, a TrainJob's node 0), follows its
training container's log (``follow``, kubelet timestamps) into `out` as ``[<pod>] line``, reconnects a
stream that drops or stays silent, skipping lines already shown, and moves on to the pod that replaces it
after a restart. It keeps the last lines for the launcher's failure message. It only reads: ``pods`` list
and ``pods/log`` get.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from typing import Protocol, TextIO

import urllib3
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

log = logging.getLogger(__name__)

LOGGABLE_POD_PHASES = ("Running", "Succeeded", "Failed")
DISCONNECT_ERRORS = (urllib3.exceptions.HTTPError, OSError)
"""What a dropped connection raises (the launcher's watch reconnects on the same errors)."""


class StreamTimings(Protocol):
    """The timeouts the streamer reads (`components.lib.k8s_launcher.LauncherTimings` has them)."""

    request_timeout_s: float
    poll_s: float
    log_read_timeout_s: float
    log_drain_s: float
    log_tail_lines: int


class MasterLogStreamer:
    """Follows the rank-0 pod's log into `out` in a background thread, across pod replacements."""

    def __init__(self, core: k8s.CoreV1Api, name: str, namespace: str, out: TextIO, timings: StreamTimings,
                 selector: str, container: str) -> None:
        """Follow container `container` of the pods matching label `selector` (the rank-0 pod of job `name`)."""
        self._core, self._name, self._namespace, self._out, self._t = core, name, namespace, out, timings
        self._selector, self._container = selector, container
        self._tail: deque[str] = deque(maxlen=timings.log_tail_lines)
        self._done_uids: set[str] = set()
        self._last_line_at: dict[str, float] = {}
        self._last_stamp: dict[str, str] = {}
        self._finishing = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"master-log-{name}", daemon=True)

    def __enter__(self) -> MasterLogStreamer:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        self.finish(drain=exc_type is None)

    def finish(self, drain: bool) -> None:
        """Stop following; with `drain`, first let the finished pod's last lines arrive (<= log_drain_s).

        An undrained stream's daemon thread ends at its next line or when the pod goes away."""
        self._finishing.set()
        if drain:
            self._thread.join(self._t.log_drain_s)
        self._stopped.set()
        if drain and self._thread.is_alive():
            log.warning("Master log of %s did not drain within %.0f s; stopped following it",
                        self._name, self._t.log_drain_s)

    def tail(self) -> list[str]:
        """The last lines of the Master log seen so far."""
        return list(self._tail)

    def _run(self) -> None:
        while not self._stopped.is_set():
            pod = self._master_pod()
            if pod is not None and pod.metadata.uid not in self._done_uids \
                    and pod.status.phase in LOGGABLE_POD_PHASES:
                if self._follow(pod):
                    continue
            elif self._finishing.is_set():
                return
            # Sleep, but wake at once when the job finishes (or, once finishing, when stopped).
            (self._stopped if self._finishing.is_set() else self._finishing).wait(self._t.poll_s)

    def _master_pod(self) -> k8s.V1Pod | None:
        try:
            pods = self._core.list_namespaced_pod(self._namespace, label_selector=self._selector,
                                                  _request_timeout=self._t.request_timeout_s).items
        except (ApiException, *DISCONNECT_ERRORS) as exc:
            log.info("listing Master pods of %s failed (%s); retrying", self._name, exc)
            return None
        live = [p for p in pods if p.metadata.deletion_timestamp is None]
        return max(live, key=lambda p: p.metadata.creation_timestamp, default=None)

    def _follow(self, pod: k8s.V1Pod) -> bool:
        """Stream one pod's log; True once its container has exited and the whole log was read.

        Lines carry kubelet timestamps, so a reconnect skips what was already shown."""
        pod_name, uid = pod.metadata.name, pod.metadata.uid
        last = self._last_line_at.get(uid)
        since = None if last is None else math.ceil(time.monotonic() - last) + 1
        self._emit(pod_name, f"--- following the log of {pod_name} (uid {uid})"
                   + ("" if since is None else ", reconnected") + " ---")
        response: urllib3.HTTPResponse | None = None
        try:
            response = self._core.read_namespaced_pod_log(
                pod_name, self._namespace, container=self._container, follow=True, timestamps=True,
                since_seconds=since, _preload_content=False,
                _request_timeout=(self._t.request_timeout_s, self._t.log_read_timeout_s))
            for raw in iter_resp_lines(response):
                if self._stopped.is_set():
                    return False
                stamp, _, line = raw.partition(" ")
                if _stamp_key(stamp) <= self._last_stamp.get(uid, ""):
                    continue
                self._last_stamp[uid] = _stamp_key(stamp)
                self._last_line_at[uid] = time.monotonic()
                self._tail.append(line)
                self._emit(pod_name, line)
        except (ApiException, *DISCONNECT_ERRORS) as exc:
            if not self._stopped.is_set():
                log.info("log stream of %s interrupted (%s); reconnecting", pod_name, exc)
            return False
        finally:
            if response is not None:
                response.release_conn()
        current = self._master_pod()
        if current is not None and current.metadata.uid == uid and _container_running(current, self._container):
            log.info("log stream of %s ended while its container runs; reconnecting", pod_name)
            return False
        self._done_uids.add(uid)
        return True

    def _emit(self, pod_name: str, line: str) -> None:
        self._out.write(f"[{pod_name}] {line}\n")
        self._out.flush()


def _stamp_key(stamp: str) -> str:
    """A kubelet RFC3339Nano UTC timestamp as a sortable string (its fraction drops trailing zeros)."""
    head, _, fraction = stamp.rstrip("Z").partition(".")
    return f"{head}.{fraction.ljust(9, '0')}"


def _container_running(pod: k8s.V1Pod, container: str) -> bool:
    if pod.status.phase != "Running":
        return False
    statuses = [s for s in pod.status.container_statuses or [] if s.name == container]
    return not statuses or statuses[0].state is None or statuses[0].state.terminated is None
