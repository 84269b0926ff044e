"""Idempotent, loud launcher of the train step's cluster job: a PyTorchJob (training-operator v1.9) or a
TrainJob (Kubeflow Trainer v2.3).

One implementation, `JobLauncher`, holds every guarantee below; a `JobKind` (`components.lib.k8s_kinds`) says
what differs between the two resources (API coordinates, the success condition, which pod is rank 0, where the
suspend flag is, how restarts show).
`PyTorchJobLauncher` runs the job built by `components.lib.pytorchjob`, `TrainJobLauncher` the one built by
`components.lib.trainjob`; both take the same `TrainJobSpec`. `PyTorchJobLauncher.run(spec)`:

- **idempotent**: "already exists" (HTTP 409) attaches to the job of the same deterministic name (a
  pipeline retry or a restarted launcher pod finds its job); an existing ``Failed`` job is deleted
  (foreground) and resubmitted, the trainer resuming from its latest checkpoint; an existing
  ``Succeeded`` job is returned without resubmitting.
- **never hangs**: the job is watched (field selector ``metadata.name``); a watch that times out or
  disconnects is re-opened from the last resourceVersion, and a ``410 Gone`` re-lists. An overall
  deadline of ``activeDeadlineSeconds + LauncherTimings.deadline_margin_s`` deletes the job and raises; it
  runs from the job's admission, not its submission: while Kueue keeps the job suspended (``suspend`` set,
  ``runPolicy.suspend`` for a PyTorchJob, or a ``Suspended`` condition) it waits in its queue without one, and
  a job suspended again (preempted) gets a new deadline when it is re-admitted.
- **restart budget** (PyTorchJob): ``restartPolicy: ExitCode`` makes the operator delete and recreate a
  pod that exited >= 128, ignoring ``backoffLimit``. Each time it does, v1.9 sets the job condition
  ``Restarting=True``, which replaces ``Running`` (and ``Running`` replaces it when the pods are up
  again). A restart is counted each time a ``Restarting=True`` condition appears that was absent in the
  previous observation or carries a new ``lastTransitionTime``. ``replicaStatuses`` counts only the
  pods present now, so it cannot count restarts. When the count exceeds ``spec.max_cluster_restarts``
  the job is deleted and `RestartBudgetExceededError` raised. Restarts that happened before the
  launcher attached and are no longer visible are not counted.
- **restart budget** (TrainJob): the runtime's ``node`` Job replaces a pod that exited >= 128, or whose node was
  lost, on its own (``backoffLimitPerIndex``: the other pods go on, as a PyTorchJob's do), fails the TrainJob for
  1-127, and JobSet restarts the whole set only after an index spent its replacements (`components.lib.trainjob`).
  JobSet's ``maxRestarts`` sits in the shared runtime, so the per-run budget is the launcher's own, as for
  PyTorchJob: it reads what the pods carry each time the TrainJob's status changes, the restart attempt JobSet
  stamps (``jobset.sigs.k8s.io/restart-attempt``) and the Job controller's per-index failure count, absolute counts
  (restarts before the launcher attached count too), and deletes the TrainJob when their sum exceeds
  ``spec.max_cluster_restarts``. A TrainJob failed by JobSet's own backstop (reason ``ReachedMaxRestarts``) raises
  the same error.
- **the step fails when the job fails**: ``Failed`` raises `JobFailedError` with the condition's
  reason and message, the trainer's exit code (the rank-0 container's, else any failed training
  container's) and the tail of the rank-0 log.
- **loud**: every state transition is logged; the rank-0 pod's log (PyTorchJob Master, TrainJob node 0)
  is followed into stdout (``[<pod>] line``) in a background thread, re-attached when a restart replaces
  the pod (`components.lib.k8s_logs`).
- **closes the job off**: right after the job, its Secret (the peer tier's secret, mounted into every pod) and a
  NetworkPolicy admitting ingress to its pods only from its own pods, both owned by the job, so deleted with it
  (`components.lib.k8s_guard`); attaching adopts them, one left by an earlier job of the name is replaced.
- **cleans up**: any other way out of `run` — deadline, restart budget, SIGTERM when the pipeline is
  cancelled, an unexpected error — deletes the job. `delete` (idempotent) serves the exit handler.

Permissions: the (apiGroup, resource, verb) triples this launcher uses are not typed by hand. The stub
API server in ``tests/launcher/k8s_stub.py`` records every request, and its ``launcher_permissions()``
runs representative launcher scenarios and returns the set of triples (``rbac_rules()`` groups them
per resource), for the RBAC Role test to compare against.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TextIO

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException
from kubernetes.watch import Watch

from components.lib import k8s_guard
from components.lib.k8s_kinds import (
    FAILED,
    PYTORCHJOB,
    RESTARTING,
    TRAINJOB,
    JobKind,
    RestartCounter,
    is_suspended,
    job_state,
    true_condition,
)
from components.lib.k8s_logs import DISCONNECT_ERRORS, MasterLogStreamer
from components.lib.local_launcher import exit_name
from components.lib.pytorchjob import TrainJobSpec
from components.lib.signals import sigterm_raises

log = logging.getLogger(__name__)

HTTP_NOT_FOUND, HTTP_CONFLICT, HTTP_GONE = 404, 409, 410
TRANSIENT_HTTP = frozenset({429, 500, 502, 503, 504})

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
    """How a PyTorchJob or TrainJob ended."""

    name: str
    namespace: str
    state: str
    restarts: int
    """Cluster-level restarts observed by this launcher (see the module docstring)."""
    duration_s: float
    conditions: list[dict[str, Any]] = field(default_factory=list)


class LauncherError(RuntimeError):
    """The train step must fail."""


class InvalidJobError(LauncherError):
    """The manifest breaks a training-operator webhook rule or the API server rejected it."""


class JobFailedError(LauncherError):
    """The job ended ``Failed``; `exit_code` is the trainer's (None when no pod reported one)."""

    def __init__(self, name: str, reason: str, message: str, log_tail: list[str], exit_code: int | None = None,
                 kind: str = "PyTorchJob") -> None:
        self.name, self.reason, self.message, self.log_tail = name, reason, message, log_tail
        self.exit_code = exit_code
        tail = "\n".join(log_tail) if log_tail else "(no rank-0 log was captured)"
        code = "no exit code reported" if exit_code is None else f"trainer exit code {exit_name(exit_code)}"
        super().__init__(f"{kind} {name} failed ({code}): {reason}: {message}\n"
                         f"--- last {len(log_tail)} lines of the rank-0 log ---\n{tail}")


class DeadlineExceededError(LauncherError):
    """The job did not finish before the launcher's deadline; it was deleted."""


class RestartBudgetExceededError(LauncherError):
    """The job restarted more often than ``max_cluster_restarts``; it was deleted."""


class JobDeletedError(LauncherError):
    """The job was deleted by someone else while the launcher waited for it."""


class LauncherTerminated(LauncherError):
    """The launcher received SIGTERM (the pipeline run was cancelled); the job was deleted."""


class _JobTracker:
    """Follows one job's status: logs transitions, counts restarts, enforces the restart budget."""

    def __init__(self, kind: JobKind, name: str, namespace: str, max_restarts: int,
                 counter: RestartCounter, budget_s: float) -> None:
        self.kind, self.name, self.namespace, self.max_restarts = kind, name, namespace, max_restarts
        self.counter, self.budget_s = counter, budget_s
        self.state = "Submitted"
        self.restarts = 0
        self.conditions: list[dict[str, Any]] = []
        self.admitted_at: float | None = None
        """When the job was (last) admitted (monotonic); None while it waits suspended in a queue."""

    def deadline(self) -> float | None:
        """The launcher's deadline (monotonic): `budget_s` after admission; None while the job is queued.

        FT: time suspended by Kueue is not training time; the operator's own activeDeadlineSeconds restarts on
        admission too (the job's start time is reset when it resumes), so this backstop follows it."""
        return None if self.admitted_at is None else self.admitted_at + self.budget_s

    def _admission(self, job: Mapping[str, Any]) -> None:
        suspended = is_suspended(job, self.kind.suspend_path)
        if suspended and self.admitted_at is not None:
            log.warning("%s %s/%s was suspended again (preempted by its queue?); its deadline restarts when it is "
                        "admitted again", self.kind.kind, self.namespace, self.name)
            self.admitted_at = None
        elif not suspended and self.admitted_at is None:
            self.admitted_at = time.monotonic()
            log.info("%s %s/%s is admitted; the launcher's deadline is %.0f s from now (activeDeadlineSeconds + "
                     "margin)", self.kind.kind, self.namespace, self.name, self.budget_s)

    def observe(self, job: Mapping[str, Any]) -> str:
        """Record one observed version of the job; return its state."""
        self.conditions = list((job.get("status") or {}).get("conditions") or [])
        self._admission(job)
        state = job_state(job, self.kind.succeeded)
        if state != self.state:
            cond = true_condition(job, state) or {}
            # Routine progress (Created, Running, Succeeded) at INFO; a failure or a restart at WARNING.
            log.log(logging.WARNING if state in (FAILED, RESTARTING) else logging.INFO,
                    "%s %s/%s: %s -> %s (%s: %s)", self.kind.kind, self.namespace, self.name, self.state, state,
                    cond.get("reason", "-"), cond.get("message", "-"))
            self.state = state
        count, message = self.counter.observe(job)
        for n in range(self.restarts + 1, count + 1):
            log.warning("%s %s/%s: cluster-level restart %d (budget %d): %s", self.kind.kind, self.namespace,
                        self.name, n, self.max_restarts, message)
        self.restarts = max(self.restarts, count)
        reached = state == FAILED and (true_condition(job, FAILED) or {}).get("reason") in self.kind.budget_reasons
        if self.restarts > self.max_restarts or reached:
            raise RestartBudgetExceededError(
                f"{self.kind.kind} {self.namespace}/{self.name} restarted {self.restarts} times, more than "
                f"max_cluster_restarts={self.max_restarts}; deleting it (raise max_cluster_restarts if the "
                "faults are expected)")
        return state

    def terminal(self) -> bool:
        return self.state in (FAILED, self.kind.succeeded)


class JobLauncher:
    """Submits a job of `kind` and waits for it; see the module docstring for the guarantees."""

    kind: ClassVar[JobKind]

    def __init__(self, custom: k8s.CustomObjectsApi, core: k8s.CoreV1Api,
                 timings: LauncherTimings = LauncherTimings(), out: TextIO | None = None) -> None:
        """`out` receives the Master log (default: sys.stdout at the time of the call)."""
        self._custom, self._core, self._t = custom, core, timings
        self._out = sys.stdout if out is None else out

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None, timings: LauncherTimings = LauncherTimings(),
                         out: TextIO | None = None) -> JobLauncher:
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
        kind = self.kind
        try:
            manifest = kind.manifest(spec)
        except ValueError as exc:  # a setting this kind of job cannot carry
            raise InvalidJobError(str(exc)) from exc
        errors = kind.errors(manifest)
        if errors:
            raise InvalidJobError(f"{kind.kind} {spec.name} would be rejected:\n  - " + "\n  - ".join(errors))
        started = time.monotonic()
        tracker = _JobTracker(kind, spec.name, spec.namespace, spec.max_cluster_restarts,
                              kind.restarts(self._core, spec.name, spec.namespace, self._t),
                              spec.active_deadline_seconds + self._t.deadline_margin_s)
        with sigterm_raises(lambda: LauncherTerminated('received SIGTERM (pipeline run cancelled?)')):
            try:
                final = self._submit(manifest, tracker)
                if final is None:
                    with MasterLogStreamer(self._core, spec.name, spec.namespace, self._out, self._t,
                                           kind.rank0_selector(spec.name), kind.container) as logs:
                        final = self._wait(spec.name, spec.namespace, tracker)
                    if tracker.state == FAILED:
                        cond = true_condition(final, FAILED) or {}
                        raise JobFailedError(spec.name, cond.get("reason", FAILED), cond.get("message", ""),
                                             logs.tail(), self.exit_code(spec.name, spec.namespace), kind.kind)
            except JobFailedError:
                raise  # finished: its pods hold no GPUs; kept for post-mortems until the TTL or exit handler
            except BaseException as exc:
                log.error("launcher stopping (%s: %s); deleting %s %s/%s", type(exc).__name__, exc, kind.kind,
                          spec.namespace, spec.name)
                self._delete_quietly(spec.name, spec.namespace)
                raise
        result = JobResult(spec.name, spec.namespace, tracker.state, tracker.restarts,
                           time.monotonic() - started, tracker.conditions)
        log.info("%s %s/%s succeeded after %.0f s with %d restart(s)", kind.kind, spec.namespace, spec.name,
                    result.duration_s, result.restarts)
        return result

    def exit_code(self, name: str, namespace: str) -> int | None:
        """The trainer's exit code: the newest non-zero exit of the training container, rank 0 first."""
        try:
            pods = self._core.list_namespaced_pod(namespace, label_selector=self.kind.pods_selector(name),
                                                  _request_timeout=self._t.request_timeout_s).items
        except (ApiException, *DISCONNECT_ERRORS) as exc:
            log.info("listing the pods of %s for its exit code failed (%s)", name, exc)
            return None
        rank0 = {p.metadata.uid for p in pods if _matches(p, self.kind.rank0_selector(name))}
        exits = []
        for pod in pods:
            for status in pod.status.container_statuses or []:
                for state in (status.state, status.last_state):
                    done = state.terminated if state else None
                    if status.name == self.kind.container and done is not None and done.exit_code:
                        exits.append((pod.metadata.uid in rank0, str(done.finished_at or ""), done.exit_code))
        return max(exits)[2] if exits else None

    def delete(self, name: str, namespace: str) -> bool:
        """Delete the job and its pods (foreground); False if it did not exist."""
        k = self.kind
        try:
            self._custom.delete_namespaced_custom_object(
                k.group, k.version, namespace, k.plural, name, propagation_policy="Foreground",
                _request_timeout=self._t.request_timeout_s)
        except ApiException as exc:
            if exc.status == HTTP_NOT_FOUND:
                log.info("%s %s/%s is already gone", k.kind, namespace, name)
                return False
            raise
        log.info("deleted %s %s/%s (foreground: its pods go first)", k.kind, namespace, name)
        return True

    def _delete_quietly(self, name: str, namespace: str) -> None:
        try:
            self.delete(name, namespace)
        except (ApiException, *DISCONNECT_ERRORS) as exc:
            log.error("could not delete %s %s/%s (%s); the exit handler or its activeDeadlineSeconds "
                      "will end it", self.kind.kind, namespace, name, exc)

    def _create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Create the job, then its Secret and NetworkPolicy (``k8s_guard``: owned by it, so it needs its uid)."""
        meta, k = manifest["metadata"], self.kind
        try:
            job = self._custom.create_namespaced_custom_object(k.group, k.version, meta["namespace"], k.plural,
                                                               manifest, _request_timeout=self._t.request_timeout_s)
        except ApiException as exc:
            if exc.status == HTTP_CONFLICT:
                raise
            raise InvalidJobError(f"the API server refused {k.kind} {meta['namespace']}/{meta['name']}: "
                                  f"HTTP {exc.status} {exc.reason}: {exc.body}") from exc
        log.info("created %s %s/%s", k.kind, meta["namespace"], meta["name"])
        self._guard(job)
        return job

    def _guard(self, job: Mapping[str, Any]) -> None:
        """The job's Secret and NetworkPolicy (``k8s_guard``), created or adopted; a refusal fails the launch (the
        caller deletes the job: its pods would wait for the Secret)."""
        try:
            k8s_guard.ensure(self._core, k8s.NetworkingV1Api(self._core.api_client), job, job["metadata"].get("labels")
                             or {}, self.kind.pods_selector(job["metadata"]["name"]), self._t.request_timeout_s,
                             self._t.poll_s)
        except ApiException as exc:
            raise LauncherError(f"the job's Secret or NetworkPolicy could not be made: HTTP {exc.status} {exc.reason}"
                                f": the launcher's Role needs create, get and delete on secrets and networkpolicies "
                                f"(deploy/base/rbac.yaml)") from exc

    def _submit(self, manifest: Mapping[str, Any], tracker: _JobTracker) -> dict[str, Any] | None:
        """Create the job, or attach to it; return the job if it already succeeded, else None."""
        name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
        k = self.kind
        while True:
            try:
                self._create(manifest)
                return None
            except ApiException:  # 409: a job of this name exists
                pass
            try:
                existing = self._custom.get_namespaced_custom_object(k.group, k.version, namespace, k.plural, name,
                                                                     _request_timeout=self._t.request_timeout_s)
                break
            except ApiException as exc:
                if exc.status != HTTP_NOT_FOUND:
                    raise
                log.info("%s %s/%s vanished after the conflict (TTL?); creating it again", k.kind, namespace, name)
        state = job_state(existing, k.succeeded)
        if existing["metadata"].get("deletionTimestamp") or state == FAILED:
            log.warning("%s %s/%s exists from an earlier attempt (%s%s); deleting it and resubmitting, "
                        "the trainer resumes from its latest checkpoint", k.kind, namespace, name, state,
                        ", being deleted" if existing["metadata"].get("deletionTimestamp") else "")
            self.delete(name, namespace)
            self._wait_gone(name, namespace)
            self._create(manifest)
            return None
        log.info("%s %s/%s already exists (%s); attaching to it", k.kind, namespace, name, state)
        if state == k.succeeded:
            tracker.observe(existing)
            return existing
        self._guard(existing)  # made when it was created, unless that launcher stopped in between
        return None

    def _wait_gone(self, name: str, namespace: str) -> None:
        give_up = time.monotonic() + self._t.delete_timeout_s
        while time.monotonic() < give_up:
            try:
                self._custom.get_namespaced_custom_object(self.kind.group, self.kind.version, namespace,
                                                          self.kind.plural, name,
                                                          _request_timeout=self._t.request_timeout_s)
            except ApiException as exc:
                if exc.status == HTTP_NOT_FOUND:
                    return
                raise
            time.sleep(self._t.poll_s)
        raise LauncherError(f"{self.kind.kind} {namespace}/{name} was still being deleted after "
                            f"{self._t.delete_timeout_s:.0f} s; check for stuck finalizers or pods")

    def _wait(self, name: str, namespace: str, tracker: _JobTracker) -> dict[str, Any]:
        """Watch the job until it is terminal; reconnect on disconnects, re-list on 410 Gone. The deadline runs
        from the job's admission: a job Kueue keeps suspended waits in its queue without one."""
        selector = f"metadata.name={name}"
        k = self.kind
        resource_version: str | None = None
        while True:
            deadline = tracker.deadline()
            remaining = math.inf if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceededError(
                    f"{k.kind} {namespace}/{name} is still {tracker.state} after the launcher's deadline "
                    f"(activeDeadlineSeconds + {self._t.deadline_margin_s:.0f} s from its admission); deleting it")
            try:
                if resource_version is None:
                    listing = self._custom.list_namespaced_custom_object(
                        k.group, k.version, namespace, k.plural, field_selector=selector,
                        _request_timeout=self._t.request_timeout_s)
                    if not listing["items"]:
                        raise JobDeletedError(f"{k.kind} {namespace}/{name} disappeared while running")
                    resource_version = listing["metadata"]["resourceVersion"]
                    tracker.observe(listing["items"][0])
                    if tracker.terminal():
                        return listing["items"][0]
                timeout = max(1, min(self._t.watch_timeout_s, math.ceil(min(remaining, 1e9))))
                for event in Watch().stream(
                        self._custom.list_namespaced_custom_object, k.group, k.version, namespace, k.plural,
                        field_selector=selector, resource_version=resource_version, timeout_seconds=timeout,
                        _request_timeout=(self._t.request_timeout_s, timeout + self._t.stream_grace_s)):
                    job = event["raw_object"]
                    resource_version = job["metadata"]["resourceVersion"]
                    if event["type"] == "DELETED":
                        raise JobDeletedError(f"{k.kind} {namespace}/{name} was deleted while the launcher "
                                              "waited for it")
                    tracker.observe(job)
                    if tracker.terminal():
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


def _matches(pod: k8s.V1Pod, selector: str) -> bool:
    labels = pod.metadata.labels or {}
    return all(labels.get(key) == value for key, _, value in (kv.partition("=") for kv in selector.split(",")))


class PyTorchJobLauncher(JobLauncher):
    """A Kubeflow training-operator v1 PyTorchJob (`components.lib.pytorchjob`)."""

    kind = PYTORCHJOB


class TrainJobLauncher(JobLauncher):
    """A Kubeflow Trainer v2 TrainJob on our ClusterTrainingRuntime (`components.lib.trainjob`)."""

    kind = TRAINJOB
