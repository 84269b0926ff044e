"""What differs between the two job resources the launcher (`components.lib.k8s_launcher`) runs.

A `JobKind` holds, for a Kubeflow training-operator v1.9 ``PyTorchJob`` (`PYTORCHJOB`) and a Kubeflow Trainer
v2.3 ``TrainJob`` (`TRAINJOB`): the API coordinates, the manifest builder and its pre-submit webhook rules,
the success condition, which pod is rank 0, where the ``suspend`` flag Kueue sets lives, and how
cluster-level restarts show (`RestartCounter`): a ``Restarting`` condition for a PyTorchJob, the
``jobset.sigs.k8s.io/restart-attempt`` label of a TrainJob's pods plus the failure counts the Job controller puts on
the pods it replaced alone. `job_state` and `is_suspended` read a job's
status the same way for both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kubeflow.training import constants
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from components.lib import trainjob
from components.lib.k8s_logs import DISCONNECT_ERRORS
from components.lib.pytorchjob import CONTAINER_NAME, TrainJobSpec, build_pytorchjob, to_manifest, webhook_errors

log = logging.getLogger(__name__)

GROUP = constants.GROUP
VERSION = constants.VERSION
PLURAL = constants.PYTORCHJOB_PLURAL
MASTER_REPLICA_LABEL = "master"  # value of training.kubeflow.org/replica-type on the Master pod

CREATED, RUNNING, RESTARTING, SUCCEEDED, FAILED, SUSPENDED = (
    "Created", "Running", "Restarting", "Succeeded", "Failed", "Suspended")
COMPLETE = "Complete"  # TrainJob's success condition
PENDING = "Pending"  # no condition yet: the operator has not seen the job
REACHED_MAX_RESTARTS = "ReachedMaxRestarts"  # JobSet's Failed reason when its maxRestarts is spent


def true_condition(job: Mapping[str, Any], ctype: str) -> dict[str, Any] | None:
    """The job's condition of type `ctype` when its status is True, else None."""
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype and cond.get("status") == "True":
            return cond
    return None


def job_state(job: Mapping[str, Any], succeeded: str = SUCCEEDED) -> str:
    """``Failed``/`succeeded` if terminal, else the newest true condition's type, else ``Running`` when a
    TrainJob's ``jobsStatus`` has active Jobs (TrainJob has no Running condition), else ``Pending``."""
    for terminal in (FAILED, succeeded):
        if true_condition(job, terminal):
            return terminal
    status = job.get("status") or {}
    true_types = [c.get("type") for c in status.get("conditions") or [] if c.get("status") == "True"]
    if true_types:
        return true_types[-1]  # the operator appends the newest condition
    return RUNNING if any(j.get("active") for j in status.get("jobsStatus") or []) else PENDING


def is_suspended(job: Mapping[str, Any], suspend_path: tuple[str, ...]) -> bool:
    """Whether the job waits for admission: its ``suspend`` flag is set (Kueue sets it when the job is created
    and clears it when it admits the job) or the operator still reports it ``Suspended`` (it lags the flag)."""
    flag: Any = job
    for key in suspend_path:
        flag = flag.get(key) if isinstance(flag, Mapping) else None
    return flag is True or true_condition(job, SUSPENDED) is not None


class RestartCounter(Protocol):
    """Counts one job's cluster-level restarts from its observed versions."""

    def observe(self, job: Mapping[str, Any]) -> tuple[int, str]:
        """Restarts so far, and what the newest one said."""


class ConditionRestarts:
    """PyTorchJob: one restart per ``Restarting=True`` condition that appears or gets a new transition time."""

    def __init__(self) -> None:
        self._count, self._mark, self._message = 0, None, "-"

    def observe(self, job: Mapping[str, Any]) -> tuple[int, str]:
        restarting = true_condition(job, RESTARTING)
        mark = str(restarting.get("lastTransitionTime")) if restarting else None
        if mark is not None and mark != self._mark:
            self._count += 1
            self._message = str(restarting.get("message", "-"))
        self._mark = mark
        return self._count, self._message


class RequestTimings(Protocol):
    """The one timeout a restart counter needs (`components.lib.k8s_launcher.LauncherTimings` has it)."""

    request_timeout_s: float


class RestartAttemptLabels:
    """TrainJob: the highest ``jobset.sigs.k8s.io/restart-attempt`` label on the TrainJob's pods, plus the pods the
    ``node`` Job replaced alone, read each time the TrainJob's status changes.

    JobSet stamps each pod it creates with its restart count at the time (``status.restarts``), so the label
    is absolute, as the JobSet's count is, and a re-attaching launcher sees restarts from before it attached.
    A pod that fails with a retryable code, or whose node is lost, is first replaced in its Job (the runtime's
    ``backoffLimitPerIndex``): the replacement keeps the attempt label and carries the Job controller's count of its
    index's failures (``batch.kubernetes.io/job-index-failure-count``, and ``-ignored-failure-count``), so each
    replacement counts as a restart, as a PyTorchJob pod's does. Those counts start again with each JobSet attempt:
    the counts of an attempt seen while this launcher watched are kept after it. It needs only ``pods: list``,
    which a Kubeflow profile owner may grant; reading the JobSet itself would need ``jobsets: get``, which Kubeflow's
    edit/admin roles do not give. A TrainJob's own v2.3 status (conditions, ``jobsStatus``, ``trainerStatus``) has
    no restart count. A restart counts once its new pods exist and the TrainJob's status changes again (at the latest
    when they become ready)."""

    def __init__(self, core: k8s.CoreV1Api, name: str, namespace: str, timings: RequestTimings) -> None:
        self._core, self._name, self._namespace, self._t = core, name, namespace, timings
        self._count, self._attempt, self._seen_status = 0, 0, None
        self._replaced: dict[tuple[str, str, str], int] = {}
        """(restart attempt, job index, completion index) -> pods of that index replaced in its Job."""

    def observe(self, job: Mapping[str, Any]) -> tuple[int, str]:
        status = job.get("status")
        if status != self._seen_status:
            try:
                pods = self._core.list_namespaced_pod(
                    self._namespace, label_selector=f"{trainjob.JOBSET_NAME_LABEL}={self._name}",
                    _request_timeout=self._t.request_timeout_s).items
            except (ApiException, *DISCONNECT_ERRORS) as exc:  # keep the count; read again on the next change
                log.info("listing the pods of %s for its restart count failed (%s)", self._name, exc)
            else:
                self._seen_status = status
                attempts = [(p.metadata.labels or {}).get(trainjob.RESTART_ATTEMPT_LABEL, "0") for p in pods]
                self._attempt = max([self._attempt] + [int(a) for a in attempts if a.isdigit()])
                for pod in pods:
                    key, replaced = _index_replacements(pod)
                    if key is not None:
                        self._replaced[key] = max(self._replaced.get(key, 0), replaced)
                self._count = max(self._count, self._attempt + sum(self._replaced.values()))
        replaced = sum(self._replaced.values())
        return self._count, (f"JobSet {self._name} recreated its pods (restart attempt {self._attempt})"
                             + (f"; {replaced} pod(s) replaced alone in its Job" if replaced else ""))


def _index_replacements(pod: Any) -> tuple[tuple[str, str, str] | None, int]:
    """A ``node`` pod's (restart attempt, job index, completion index) and how many pods of that index its Job
    replaced before it (the Job controller's failure-count annotations); (None, 0) for any other pod."""
    labels, notes = pod.metadata.labels or {}, pod.metadata.annotations or {}
    if labels.get(trainjob.REPLICATED_JOB_LABEL) != trainjob.NODE:
        return None, 0
    counts = [notes.get(a, "0") for a in (trainjob.INDEX_FAILURE_COUNT_ANNOTATION,
                                          trainjob.INDEX_IGNORED_FAILURE_COUNT_ANNOTATION)]
    key = (labels.get(trainjob.RESTART_ATTEMPT_LABEL, "0"), labels.get(trainjob.JOB_INDEX_LABEL, "0"),
           labels.get(trainjob.COMPLETION_INDEX_LABEL) or notes.get(trainjob.COMPLETION_INDEX_LABEL, "0"))
    return key, sum(int(c) for c in counts if c.isdigit())


@dataclass(frozen=True)
class JobKind:
    """What differs between the job resources the launcher runs."""

    kind: str
    group: str
    version: str
    plural: str
    succeeded: str
    """The condition type of success (``Succeeded``, ``Complete``)."""
    container: str
    """The training container's name in every pod."""
    manifest: Callable[[TrainJobSpec], dict[str, Any]]
    errors: Callable[[Mapping[str, Any]], list[str]]
    """Admission-webhook rules checked before submitting."""
    rank0_selector: Callable[[str], str]
    """Label selector of the rank-0 pod, by job name."""
    pods_selector: Callable[[str], str]
    """Label selector of all the job's pods, by job name."""
    restarts: Callable[[k8s.CoreV1Api, str, str, RequestTimings], RestartCounter]
    suspend_path: tuple[str, ...] = ("spec", "suspend")
    """Where the job's ``suspend`` flag is (Kueue sets it at creation and clears it on admission)."""
    budget_reasons: frozenset[str] = frozenset()
    """``Failed`` reasons meaning a server-side restart limit was reached."""


def _pytorchjob_manifest(spec: TrainJobSpec) -> dict[str, Any]:
    return to_manifest(build_pytorchjob(spec))


def _trainjob_manifest(spec: TrainJobSpec) -> dict[str, Any]:
    """ValueError for settings a TrainJob cannot carry (the launcher reports it as an invalid job)."""
    return trainjob.to_manifest(trainjob.build_trainjob(spec))


PYTORCHJOB = JobKind(
    kind=constants.PYTORCHJOB_KIND, group=GROUP, version=VERSION, plural=PLURAL, succeeded=SUCCEEDED,
    container=CONTAINER_NAME, manifest=_pytorchjob_manifest, errors=webhook_errors,
    rank0_selector=lambda name: f"{constants.JOB_NAME_LABEL}={name},{constants.REPLICA_TYPE_LABEL}={MASTER_REPLICA_LABEL}",
    pods_selector=lambda name: f"{constants.JOB_NAME_LABEL}={name}",
    restarts=lambda *_: ConditionRestarts(), suspend_path=("spec", "runPolicy", "suspend"))
TRAINJOB = JobKind(
    kind=trainjob.KIND, group=trainjob.GROUP, version=trainjob.VERSION, plural=trainjob.PLURAL, succeeded=COMPLETE,
    container=trainjob.NODE, manifest=_trainjob_manifest, errors=trainjob.webhook_errors,
    rank0_selector=trainjob.node0_selector, pods_selector=lambda name: f"{trainjob.JOBSET_NAME_LABEL}={name}",
    restarts=RestartAttemptLabels, budget_reasons=frozenset({REACHED_MAX_RESTARTS}))
