"""Idempotent, loud launcher of the train step's PyTorchJob (training-operator v1.9).

`PyTorchJobLauncher.run(spec)` submits the job built by `components.lib.pytorchjob` and waits for it:

- **idempotent**: "already exists" (HTTP 409) attaches to the job of the same deterministic name (a
  pipeline retry or a restarted launcher pod finds its job); an existing ``Failed`` job is deleted
  (foreground) and resubmitted, the trainer resuming from its latest checkpoint; an existing
  ``Succeeded`` job is returned without resubmitting.
- **never hangs**: the job is watched (field selector ``metadata.name``); a watch that times out or
  disconnects is re-opened from the last resourceVersion, and a ``410 Gone`` re-lists. An overall
  deadline of ``activeDeadlineSeconds + LauncherTimings.deadline_margin_s`` deletes the job and raises.
- **restart budget**: ``restartPolicy: ExitCode`` makes the operator delete and recreate a pod that
  exited >= 128, ignoring ``backoffLimit``. Each time it does, v1.9 sets the job condition
  ``Restarting=True``, which replaces ``Running`` (and ``Running`` replaces it when the pods are up
  again). A restart is counted each time a ``Restarting=True`` condition appears that was absent in the
  previous observation or carries a new ``lastTransitionTime``. ``replicaStatuses`` counts only the
  pods present now, so it cannot count restarts. When the count exceeds ``spec.max_cluster_restarts``
  the job is deleted and `RestartBudgetExceededError` raised. Restarts that happened before the
  launcher attached and are no longer visible are not counted.
- **the step fails when the job fails**: ``Failed`` raises `JobFailedError` with the condition's
  reason and message and the tail of the Master's log.
- **loud**: every state transition is logged; the Master pod's log is followed into stdout
  (``[<pod>] line``) in a background thread, re-attached when a restart replaces the pod.
- **cleans up**: any other way out of `run` — deadline, restart budget, SIGTERM when the pipeline is
  cancelled, an unexpected error — deletes the job. `delete` (idempotent) serves the exit handler.

Permissions: the (apiGroup, resource, verb) triples this launcher uses are not typed by hand. The stub
API server in ``tests/launcher/k8s_stub.py`` records every request, and its ``launcher_permissions()``
runs representative launcher scenarios and returns the set of triples (``rbac_rules()`` groups them
per resource), for the RBAC Role test to compare against.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

import urllib3
from kubeflow.training import constants
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException
from kubernetes.watch import Watch
from kubernetes.watch.watch import iter_resp_lines

from components.lib.pytorchjob import CONTAINER_NAME, TrainJobSpec, build_pytorchjob, to_manifest, webhook_errors
from components.lib.signals import sigterm_raises

log = logging.getLogger(__name__)

GROUP = constants.GROUP
VERSION = constants.VERSION
PLURAL = constants.PYTORCHJOB_PLURAL
MASTER_REPLICA_LABEL = "master"  # value of training.kubeflow.org/replica-type on the Master pod

CREATED, RUNNING, RESTARTING, SUCCEEDED, FAILED, SUSPENDED = (
    "Created", "Running", "Restarting", "Succeeded", "Failed", "Suspended")
PENDING = "Pending"  # no condition yet: the operator has not seen the job
TERMINAL_STATES = (SUCCEEDED, FAILED)
LOGGABLE_POD_PHASES = ("Running", "Succeeded", "Failed")
HTTP_NOT_FOUND, HTTP_CONFLICT, HTTP_GONE = 404, 409, 410
TRANSIENT_HTTP = frozenset({429, 500, 502, 503, 504})
DISCONNECT_ERRORS = (urllib3.exceptions.HTTPError, OSError)

# Timeouts (seconds) for a real cluster; tests pass shorter ones.
WATCH_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 30.0
STREAM_GRACE_S = 30.0
DEADLINE_MARGIN_S = 1800.0
DELETE_TIMEOUT_S = 600.0
POLL_S = 5.0
LOG_READ_TIMEOUT_S = 600.0
LOG_DRAIN_S = 15.0
LOG_TAIL_LINES = 50


@dataclass(frozen=True)
class LauncherTimings:
    """Timeouts of the launcher; the defaults suit a real cluster."""

    watch_timeout_s: int = WATCH_TIMEOUT_S
    """Server-side timeout of one watch; it is then re-opened from the last resourceVersion."""
    request_timeout_s: float = REQUEST_TIMEOUT_S
    """Connect and read timeout of every non-streaming request."""
    stream_grace_s: float = STREAM_GRACE_S
    """Client read timeout of a watch beyond its server-side timeout (catches half-dead connections)."""
    deadline_margin_s: float = DEADLINE_MARGIN_S
    """Launcher deadline = activeDeadlineSeconds + this (queueing, image pulls, scheduling)."""
    delete_timeout_s: float = DELETE_TIMEOUT_S
    """How long a foreground delete may take before resubmission gives up."""
    poll_s: float = POLL_S
    """Back-off before reconnecting and between checks that an object is gone."""
    log_read_timeout_s: float = LOG_READ_TIMEOUT_S
    """A Master log stream silent this long is re-opened."""
    log_drain_s: float = LOG_DRAIN_S
    """After the job finishes, how long to wait for the last Master log lines."""
    log_tail_lines: int = LOG_TAIL_LINES
    """Master log lines kept for `JobFailedError`."""


@dataclass(frozen=True)
class JobResult:
    """How a PyTorchJob ended."""

    name: str
    namespace: str
    state: str
    restarts: int
    """Pod restarts observed by this launcher (see the module docstring)."""
    duration_s: float
    conditions: list[dict[str, Any]] = field(default_factory=list)


class LauncherError(RuntimeError):
    """The train step must fail."""


class InvalidJobError(LauncherError):
    """The manifest breaks a training-operator webhook rule or the API server rejected it."""


class JobFailedError(LauncherError):
    """The PyTorchJob ended ``Failed``."""

    def __init__(self, name: str, reason: str, message: str, log_tail: list[str]) -> None:
        self.name, self.reason, self.message, self.log_tail = name, reason, message, log_tail
        tail = "\n".join(log_tail) if log_tail else "(no Master log was captured)"
        super().__init__(f"PyTorchJob {name} failed: {reason}: {message}\n"
                         f"--- last {len(log_tail)} lines of the Master log ---\n{tail}")


class DeadlineExceededError(LauncherError):
    """The job did not finish before the launcher's deadline; it was deleted."""


class RestartBudgetExceededError(LauncherError):
    """The job restarted more often than ``max_cluster_restarts``; it was deleted."""


class JobDeletedError(LauncherError):
    """The job was deleted by someone else while the launcher waited for it."""


class LauncherTerminated(LauncherError):
    """The launcher received SIGTERM (the pipeline run was cancelled); the job was deleted."""


def _true_condition(job: Mapping[str, Any], ctype: str) -> dict[str, Any] | None:
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype and cond.get("status") == "True":
            return cond
    return None


def job_state(job: Mapping[str, Any]) -> str:
    """``Failed``/``Succeeded`` if terminal, else the newest true condition's type, else ``Pending``."""
    for terminal in (FAILED, SUCCEEDED):
        if _true_condition(job, terminal):
            return terminal
    true_types = [c.get("type") for c in (job.get("status") or {}).get("conditions") or []
                  if c.get("status") == "True"]
    return true_types[-1] if true_types else PENDING  # the operator appends the newest condition


class _JobTracker:
    """Follows one job's status: logs transitions, counts restarts, enforces the restart budget."""

    def __init__(self, name: str, namespace: str, max_restarts: int) -> None:
        self.name, self.namespace, self.max_restarts = name, namespace, max_restarts
        self.state = "Submitted"
        self.restarts = 0
        self.conditions: list[dict[str, Any]] = []
        self._restart_mark: str | None = None

    def observe(self, job: Mapping[str, Any]) -> str:
        """Record one observed version of the job; return its state."""
        self.conditions = list((job.get("status") or {}).get("conditions") or [])
        state = job_state(job)
        if state != self.state:
            cond = _true_condition(job, state) or {}
            # Routine progress (Created, Running, Succeeded) at INFO; a failure or a restart at WARNING.
            log.log(logging.WARNING if state in (FAILED, RESTARTING) else logging.INFO,
                    "PyTorchJob %s/%s: %s -> %s (%s: %s)", self.namespace, self.name, self.state, state,
                    cond.get("reason", "-"), cond.get("message", "-"))
            self.state = state
        restarting = _true_condition(job, RESTARTING)
        mark = str(restarting.get("lastTransitionTime")) if restarting else None
        if mark is not None and mark != self._restart_mark:
            self.restarts += 1
            log.warning("PyTorchJob %s/%s: cluster-level restart %d (budget %d): %s", self.namespace, self.name,
                        self.restarts, self.max_restarts, restarting.get("message", "-"))
        self._restart_mark = mark
        if self.restarts > self.max_restarts:
            raise RestartBudgetExceededError(
                f"PyTorchJob {self.namespace}/{self.name} restarted {self.restarts} times, more than "
                f"max_cluster_restarts={self.max_restarts}; deleting it (raise max_cluster_restarts if the "
                "faults are expected)")
        return state


class MasterLogStreamer:
    """Follows the Master pod's log into `out` in a background thread, across pod replacements."""

    def __init__(self, core: k8s.CoreV1Api, name: str, namespace: str, out: TextIO,
                 timings: LauncherTimings) -> None:
        self._core, self._name, self._namespace, self._out, self._t = core, name, namespace, out, timings
        self._selector = (f"{constants.JOB_NAME_LABEL}={name},"
                          f"{constants.REPLICA_TYPE_LABEL}={MASTER_REPLICA_LABEL}")
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
                pod_name, self._namespace, container=CONTAINER_NAME, follow=True, timestamps=True,
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
        if current is not None and current.metadata.uid == uid and _container_running(current):
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


def _container_running(pod: k8s.V1Pod) -> bool:
    if pod.status.phase != "Running":
        return False
    statuses = [s for s in pod.status.container_statuses or [] if s.name == CONTAINER_NAME]
    return not statuses or statuses[0].state is None or statuses[0].state.terminated is None


class PyTorchJobLauncher:
    """Submits a PyTorchJob and waits for it; see the module docstring for the guarantees."""

    def __init__(self, custom: k8s.CustomObjectsApi, core: k8s.CoreV1Api,
                 timings: LauncherTimings = LauncherTimings(), out: TextIO | None = None) -> None:
        """`out` receives the Master log (default: sys.stdout at the time of the call)."""
        self._custom, self._core, self._t = custom, core, timings
        self._out = sys.stdout if out is None else out

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None, timings: LauncherTimings = LauncherTimings(),
                         out: TextIO | None = None) -> PyTorchJobLauncher:
        """Clients from the in-cluster service account, else `kubeconfig` (default $KUBECONFIG, ~/.kube/config)."""
        configuration = k8s.Configuration()
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)
        except k8s_config.ConfigException as in_cluster_error:
            try:
                k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
            except (k8s_config.ConfigException, OSError) as kubeconfig_error:
                raise LauncherError(
                    "no Kubernetes credentials: not in a pod with a service account "
                    f"({in_cluster_error}) and no usable kubeconfig ({kubeconfig_error}); run the train step "
                    "in the cluster or point KUBECONFIG at a cluster's kubeconfig") from kubeconfig_error
        api = k8s.ApiClient(configuration)
        return cls(k8s.CustomObjectsApi(api), k8s.CoreV1Api(api), timings, out)

    def run(self, spec: TrainJobSpec) -> JobResult:
        """Submit (or attach to) the job and wait; return on ``Succeeded``, raise otherwise."""
        manifest = to_manifest(build_pytorchjob(spec))
        errors = webhook_errors(manifest)
        if errors:
            raise InvalidJobError(f"PyTorchJob {spec.name} would be rejected:\n  - " + "\n  - ".join(errors))
        started = time.monotonic()
        deadline = started + spec.active_deadline_seconds + self._t.deadline_margin_s
        tracker = _JobTracker(spec.name, spec.namespace, spec.max_cluster_restarts)
        with sigterm_raises(lambda: LauncherTerminated('received SIGTERM (pipeline run cancelled?)')):
            try:
                final = self._submit(manifest, tracker)
                if final is None:
                    with MasterLogStreamer(self._core, spec.name, spec.namespace, self._out, self._t) as logs:
                        final = self._wait(spec.name, spec.namespace, deadline, tracker)
                    if tracker.state == FAILED:
                        cond = _true_condition(final, FAILED) or {}
                        raise JobFailedError(spec.name, cond.get("reason", FAILED), cond.get("message", ""),
                                             logs.tail())
            except JobFailedError:
                raise  # finished: its pods hold no GPUs; kept for post-mortems until the TTL or exit handler
            except BaseException as exc:
                log.error("launcher stopping (%s: %s); deleting PyTorchJob %s/%s", type(exc).__name__, exc,
                          spec.namespace, spec.name)
                self._delete_quietly(spec.name, spec.namespace)
                raise
        result = JobResult(spec.name, spec.namespace, tracker.state, tracker.restarts,
                           time.monotonic() - started, tracker.conditions)
        log.info("PyTorchJob %s/%s succeeded after %.0f s with %d restart(s)", spec.namespace, spec.name,
                    result.duration_s, result.restarts)
        return result

    def delete(self, name: str, namespace: str) -> bool:
        """Delete the job and its pods (foreground); False if it did not exist."""
        try:
            self._custom.delete_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, propagation_policy="Foreground",
                _request_timeout=self._t.request_timeout_s)
        except ApiException as exc:
            if exc.status == HTTP_NOT_FOUND:
                log.info("PyTorchJob %s/%s is already gone", namespace, name)
                return False
            raise
        log.info("deleted PyTorchJob %s/%s (foreground: its pods go first)", namespace, name)
        return True

    def _delete_quietly(self, name: str, namespace: str) -> None:
        try:
            self.delete(name, namespace)
        except (ApiException, *DISCONNECT_ERRORS) as exc:
            log.error("could not delete PyTorchJob %s/%s (%s); the exit handler or its activeDeadlineSeconds "
                      "will end it", namespace, name, exc)

    def _create(self, manifest: Mapping[str, Any]) -> None:
        meta = manifest["metadata"]
        try:
            self._custom.create_namespaced_custom_object(GROUP, VERSION, meta["namespace"], PLURAL, manifest,
                                                         _request_timeout=self._t.request_timeout_s)
        except ApiException as exc:
            if exc.status == HTTP_CONFLICT:
                raise
            raise InvalidJobError(f"the API server refused PyTorchJob {meta['namespace']}/{meta['name']}: "
                                  f"HTTP {exc.status} {exc.reason}: {exc.body}") from exc
        log.info("created PyTorchJob %s/%s", meta["namespace"], meta["name"])

    def _submit(self, manifest: Mapping[str, Any], tracker: _JobTracker) -> dict[str, Any] | None:
        """Create the job, or attach to it; return the job if it already succeeded, else None."""
        name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
        while True:
            try:
                self._create(manifest)
                return None
            except ApiException:  # 409: a job of this name exists
                pass
            try:
                existing = self._custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                                                     _request_timeout=self._t.request_timeout_s)
                break
            except ApiException as exc:
                if exc.status != HTTP_NOT_FOUND:
                    raise
                log.info("PyTorchJob %s/%s vanished after the conflict (TTL?); creating it again", namespace, name)
        state = job_state(existing)
        if existing["metadata"].get("deletionTimestamp") or state == FAILED:
            log.warning("PyTorchJob %s/%s exists from an earlier attempt (%s%s); deleting it and resubmitting, "
                        "the trainer resumes from its latest checkpoint", namespace, name, state,
                        ", being deleted" if existing["metadata"].get("deletionTimestamp") else "")
            self.delete(name, namespace)
            self._wait_gone(name, namespace)
            self._create(manifest)
            return None
        log.info("PyTorchJob %s/%s already exists (%s); attaching to it", namespace, name, state)
        if state == SUCCEEDED:
            tracker.observe(existing)
            return existing
        return None

    def _wait_gone(self, name: str, namespace: str) -> None:
        give_up = time.monotonic() + self._t.delete_timeout_s
        while time.monotonic() < give_up:
            try:
                self._custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                                          _request_timeout=self._t.request_timeout_s)
            except ApiException as exc:
                if exc.status == HTTP_NOT_FOUND:
                    return
                raise
            time.sleep(self._t.poll_s)
        raise LauncherError(f"PyTorchJob {namespace}/{name} was still being deleted after "
                            f"{self._t.delete_timeout_s:.0f} s; check for stuck finalizers or pods")

    def _wait(self, name: str, namespace: str, deadline: float, tracker: _JobTracker) -> dict[str, Any]:
        """Watch the job until it is terminal; reconnect on disconnects, re-list on 410 Gone."""
        selector = f"metadata.name={name}"
        resource_version: str | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceededError(
                    f"PyTorchJob {namespace}/{name} is still {tracker.state} after the launcher's deadline "
                    f"(activeDeadlineSeconds + {self._t.deadline_margin_s:.0f} s); deleting it")
            try:
                if resource_version is None:
                    listing = self._custom.list_namespaced_custom_object(
                        GROUP, VERSION, namespace, PLURAL, field_selector=selector,
                        _request_timeout=self._t.request_timeout_s)
                    if not listing["items"]:
                        raise JobDeletedError(f"PyTorchJob {namespace}/{name} disappeared while running")
                    resource_version = listing["metadata"]["resourceVersion"]
                    if tracker.observe(listing["items"][0]) in TERMINAL_STATES:
                        return listing["items"][0]
                timeout = max(1, min(self._t.watch_timeout_s, math.ceil(remaining)))
                for event in Watch().stream(
                        self._custom.list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL,
                        field_selector=selector, resource_version=resource_version, timeout_seconds=timeout,
                        _request_timeout=(self._t.request_timeout_s, timeout + self._t.stream_grace_s)):
                    job = event["raw_object"]
                    resource_version = job["metadata"]["resourceVersion"]
                    if event["type"] == "DELETED":
                        raise JobDeletedError(f"PyTorchJob {namespace}/{name} was deleted while the launcher "
                                              "waited for it")
                    if tracker.observe(job) in TERMINAL_STATES:
                        return job
            except ApiException as exc:
                if exc.status == HTTP_GONE:
                    log.info("watch of %s expired (410 Gone); re-listing", name)
                    resource_version = None
                elif exc.status in TRANSIENT_HTTP:
                    log.warning("API server answered %s while watching %s; retrying", exc.status, name)
                    time.sleep(self._t.poll_s)
                else:
                    raise
            except DISCONNECT_ERRORS as exc:
                log.info("watch of %s disconnected (%s); reconnecting from resourceVersion %s", name, exc,
                         resource_version)
                time.sleep(self._t.poll_s)
