"""A stub Kubernetes API server for launcher tests, and the permissions the launcher uses.

`StubCluster` serves, on 127.0.0.1 (a free port, `http.server.ThreadingHTTPServer` in a thread), just
what `components.lib.k8s_launcher` calls, for one backend: ``kubeflow.org/v1`` ``pytorchjobs`` or
``trainer.kubeflow.org/v1alpha1`` ``trainjobs`` (namespaced create/get/list/watch (``?watch=true``, chunked
JSON lines)/delete); ``pods`` list; ``pods/log`` (follow, chunked); ``secrets`` and ``networkpolicies``
(create/get/delete; deleted with the job that owns them, as the garbage collector does). A `Scenario` plays the
operator: after each create it applies its actions in order (conditions, rank-0 pods that start, log and exit), and
it scripts watch disconnects, ``410 Gone`` and a pre-existing job from an earlier attempt.

The actions are written once for both backends; the stub's `_Flavour` says how each operator shows them.
PyTorchJob: conditions as training-operator v1.9 sets them, pod ``<job>-master-0``. TrainJob: what the
trainer reflects of its JobSet — ``jobsStatus`` per replicated job while it runs, ``Complete``/``Failed``
conditions with JobSet's reasons at the end; pods ``<job>-node-0-0-<attempt>`` labelled as JobSet labels them
(``restart-attempt``, JobSet's restart count when it made the pod, included).
`master_fails` lets the operator decide from the exit code: ``restartPolicy: ExitCode`` for PyTorchJob, and
for TrainJob the failure policy of the ClusterTrainingRuntime that `components.lib.trainjob` builds,
evaluated by `jobset_action` as the Job and JobSet controllers would.

The HTTP side lives in `k8s_stub_http`: it records every request as (method, path) and maps it to the RBAC
triple (apiGroup, resource[/subresource], verb). `launcher_permissions()` runs representative launcher
scenarios against the stub and returns the set of triples the launcher used; `rbac_rules()` groups them per
resource. A Role test (``deploy/``) compares its rules with these, so the Role follows the code rather than a
list typed by hand.
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from http.server import ThreadingHTTPServer
from typing import Any

from kubernetes import client as k8s

from k8s_stub_http import WAIT_SLICE_S, _Handler

from components.lib import k8s_guard, trainjob
from components.lib.k8s_launcher import JobLauncher, LauncherError, LauncherTimings, PyTorchJobLauncher, TrainJobLauncher
from components.lib.pytorchjob import TrainJobSpec, job_name

STEP_DELAY_S = 0.05
"""Pause between two scenario actions, so the launcher sees each state."""
COMPANIONS_WAIT_S = 5.0
"""How long a created job's "operator" waits for the job's Secret and NetworkPolicy before it plays its actions."""
DELETE_DELAY_S = 0.2
"""How long a foreground-deleted job lingers with a deletionTimestamp."""
FAST_TIMINGS = LauncherTimings(watch_timeout_s=2, request_timeout_s=5.0, stream_grace_s=2.0, deadline_margin_s=1.0,
                               delete_timeout_s=5.0, poll_s=0.05, log_read_timeout_s=5.0, log_drain_s=3.0,
                               log_tail_lines=20)
SWEEP_TIMINGS = replace(FAST_TIMINGS, deadline_margin_s=0.2)
"""For `launcher_permissions`: its deadline scenario need not wait long."""

BACKENDS = ("pytorchjob", "trainjob")

Action = Callable[["StubCluster", str, str], None]
"""One scripted operator step applied to job (namespace, name)."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def condition(ctype: str, message: str = "", reason: str | None = None) -> Action:
    """Set a job condition as training-operator v1.9 does (Running and Restarting replace each other); for a
    TrainJob, its JobSet-reflected equivalent (see the module docstring)."""
    return lambda cluster, ns, name: cluster.set_condition(ns, name, ctype, reason, message)


def master_fails(code: int) -> Action:
    """The rank-0 container exits with `code` and the operator applies its failure policy to it."""
    return lambda cluster, ns, name: cluster.fail_master(ns, name, code)


def master_up(*lines: str) -> Action:
    """A (new) Master pod starts Running and prints `lines`."""
    return lambda cluster, ns, name: cluster.start_master(ns, name, lines)


def master_log(*lines: str) -> Action:
    """The running Master pod prints `lines`."""
    return lambda cluster, ns, name: cluster.master_log(ns, name, lines)


def master_exit(code: int) -> Action:
    """The Master container exits with `code` (pod phase Succeeded for 0, Failed otherwise)."""
    return lambda cluster, ns, name: cluster.exit_master(ns, name, code)


def succeeding(*lines: str) -> list[Action]:
    """Created -> Running (Master prints `lines`) -> Succeeded."""
    return [condition("Created"), master_up(*lines[:1]), condition("Running"), master_log(*lines[1:]),
            master_exit(0), condition("Succeeded")]


def failing(message: str, *lines: str) -> list[Action]:
    """Created -> Running (Master prints `lines`, exits 1: permanent) -> Failed with `message`."""
    return [condition("Created"), master_up(), condition("Running"), master_log(*lines), master_exit(1),
            condition("Failed", message)]


def restarting(times: int) -> list[Action]:
    """Running, then `times` cycles of Master exit 137 -> Restarting -> new Master pod -> Running."""
    actions = [condition("Created"), master_up("attempt 0"), condition("Running")]
    for attempt in range(1, times + 1):
        actions += [master_exit(137), condition("Restarting", f"PyTorchJob restarting because 1 Master replica(s) "
                                                              f"failed (attempt {attempt})."),
                    master_up(f"attempt {attempt}"), condition("Running")]
    return actions


def finishing(*lines: str) -> list[Action]:
    """For a job already Running: a Master pod prints `lines`, exits 0 -> Succeeded."""
    return [master_up(*lines), master_exit(0), condition("Succeeded")]


def pause(seconds: float) -> Action:
    """Nothing happens for `seconds` (a job waiting in a queue)."""
    return lambda cluster, ns, name: time.sleep(seconds)


def admitted() -> Action:
    """Kueue admits the job: it clears the suspend flag, and the operator reports the job resumed."""
    return lambda cluster, ns, name: cluster.set_suspended(ns, name, False)


def suspended() -> Action:
    """Kueue suspends the job again (preempted by a higher-priority workload): flag set, condition Suspended."""
    return lambda cluster, ns, name: cluster.set_suspended(ns, name, True)


def running_forever() -> list[Action]:
    """Created -> Running, and nothing after."""
    return [condition("Created"), master_up("training..."), condition("Running")]


@dataclass
class Scenario:
    """What the stub's "operator" does with each created job, and which faults the API serves."""

    actions: Sequence[Action] = ()
    step_delay_s: float = STEP_DELAY_S
    watch_disconnects: int = 0
    """The first N watch connections are cut (no final chunk) after their first event."""
    watch_gone: int = 0
    """The first N watches that resume from a resourceVersion get ERROR 410 Gone."""
    log_disconnects: int = 0
    """The first N follow streams of a pod log are cut after their first line."""
    existing_state: str | None = None
    """A job of the launched name already exists in this state (an earlier attempt); put it with
    `StubCluster.put_job`. The actions play on an existing ``Running`` job, else on the next created one."""
    delete_delay_s: float = DELETE_DELAY_S
    suspend_on_create: bool = False
    """A created job arrives with its suspend flag set, as Kueue's webhook sets it for a queued job."""
    companions: str = ""
    """With `existing_state`: the existing job's Secret and NetworkPolicy exist too, owned by it (``own``, a launcher
    that attaches adopts them), or left by an earlier job of the name (``stale``, replaced); put them with
    `StubCluster.put_companions`."""
    forbidden: tuple[str, ...] = ()
    """Resources the launcher's account may not touch (HTTP 403), e.g. ``("secrets",)``."""
    lockstep: bool = False
    """Each action waits until a watch of jobs is open and has no event in flight, so every status change
    reaches a watch (never a list), however slow the machine: tests that count watches need this."""


@dataclass
class _PodLog:
    lines: list[tuple[float, str, str]] = field(default_factory=list)
    """(monotonic time, RFC3339 timestamp, text) per line."""
    closed: bool = False


@dataclass(frozen=True)
class _Flavour:
    """How one operator shows the scenario's actions."""

    group: str
    plural: str
    list_kind: str
    launcher: type[JobLauncher]
    container: str
    job_label: str
    """Pod label naming the job."""

    @property
    def suspend_path(self) -> tuple[str, ...]:
        return ("spec", "runPolicy", "suspend") if self.plural == "pytorchjobs" else ("spec", "suspend")

    def pod_name(self, job: str, attempt: int) -> str:
        return f"{job}-master-0" if self.plural == "pytorchjobs" else f"{job}-node-0-0-{attempt:05d}"

    def pod_labels(self, job: str, attempt: int) -> dict[str, str]:
        if self.plural == "pytorchjobs":
            return {self.job_label: job, "training.kubeflow.org/replica-type": "master",
                    "training.kubeflow.org/replica-index": "0"}
        return {self.job_label: job, trainjob.REPLICATED_JOB_LABEL: trainjob.NODE, trainjob.JOB_INDEX_LABEL: "0",
                trainjob.COMPLETION_INDEX_LABEL: "0", trainjob.RESTART_ATTEMPT_LABEL: str(attempt)}


FLAVOURS = {
    "pytorchjob": _Flavour("kubeflow.org", "pytorchjobs", "PyTorchJobList", PyTorchJobLauncher, "pytorch",
                           "training.kubeflow.org/job-name"),
    "trainjob": _Flavour(trainjob.GROUP, trainjob.PLURAL, "TrainJobList", TrainJobLauncher, trainjob.NODE,
                         trainjob.JOBSET_NAME_LABEL),
}


def manifest_for(spec: TrainJobSpec, backend: str) -> dict[str, Any]:
    """The manifest the `backend`'s launcher submits for `spec`."""
    return FLAVOURS[backend].launcher.kind.manifest(spec)


def jobset_action(runtime: dict[str, Any], exit_code: int) -> str:
    """What the runtime's failure policy does once the ``node`` Job has failed after the container exited with
    `exit_code` != 0: the Job's podFailurePolicy (first matching rule; FailJob fails the Job with reason
    PodFailurePolicy, else the index's spent replacements fail it: the stub skips the per-index replacements the
    real Job controller makes first, tests/deploy/test_node_replacement.py models those), then the JobSet's
    failurePolicy rules (first rule whose onJobFailureReasons holds the reason; none: RestartJobSet)."""
    jobset = runtime["spec"]["template"]["spec"]
    (node,) = [j for j in jobset["replicatedJobs"] if j["name"] == trainjob.NODE]
    reason = "BackoffLimitExceeded"
    for rule in (node["template"]["spec"].get("podFailurePolicy") or {}).get("rules", []):
        req = rule.get("onExitCodes")
        if req and req.get("containerName") in (None, trainjob.NODE) \
                and (exit_code in req["values"]) == (req["operator"] == "In"):
            reason = {"FailJob": trainjob.POD_FAILURE_POLICY_REASON}.get(rule["action"], reason)
            break
    for rule in (jobset.get("failurePolicy") or {}).get("rules", []):
        if reason in (rule.get("onJobFailureReasons") or [reason]):
            return rule["action"]
    return trainjob.RESTART_JOBSET


class StubCluster:
    """The stub API server and its state; a context manager that serves while open."""

    def __init__(self, scenario: Scenario, backend: str = "pytorchjob") -> None:
        self.scenario = scenario
        self.backend, self.flavour = backend, FLAVOURS[backend]
        self.runtime = trainjob.to_manifest(trainjob.build_runtime())
        """The ClusterTrainingRuntime whose failure policy the TrainJob "operator" applies."""
        self.jobset_restarts: dict[tuple[str, str], int] = {}
        """The JobSet's ``status.restarts`` per TrainJob: the restart-attempt label of the pods it makes next."""
        self.exit_codes: dict[tuple[str, str], int] = {}
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.logs: dict[str, _PodLog] = {}
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self.owned: dict[tuple[str, str, str], dict[str, Any]] = {}
        """(resource, namespace, name) -> a Secret or NetworkPolicy; the garbage collector deletes those a removed job
        owns."""
        self.requests: list[tuple[str, str, tuple[str, str, str]]] = []
        self.created: list[str] = []
        self.deleted: list[tuple[str, bool]] = []
        """(name, foreground) of every delete of an existing job."""
        self._rv = itertools.count(1000)
        self.changed = threading.Condition()
        self.watching = 0
        """Watches of jobs waiting for an event now (for `Scenario.lockstep`)."""
        self.stopping = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.stub = self  # type: ignore[attr-defined]
        self.port = self._server.server_address[1]

    # --- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> StubCluster:
        threading.Thread(target=self._server.serve_forever, args=(WAIT_SLICE_S,), name="k8s-stub",
                         daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        with self.changed:
            self.changed.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def api_client(self) -> k8s.ApiClient:
        """A client configured for this server."""
        return k8s.ApiClient(k8s.Configuration(host=f"http://127.0.0.1:{self.port}"))

    def launcher(self, out: io.StringIO | None = None,
                 timings: LauncherTimings = FAST_TIMINGS) -> JobLauncher:
        """A launcher of this stub's backend whose clients talk to this server."""
        api = self.api_client()
        return self.flavour.launcher(k8s.CustomObjectsApi(api), k8s.CoreV1Api(api), timings, out or io.StringIO())

    def permissions(self) -> set[tuple[str, str, str]]:
        """(apiGroup, resource, verb) of every request served so far."""
        return {perm for _, _, perm in self.requests}

    # --- the "operator" ------------------------------------------------------------------------
    def put_job(self, manifest: dict[str, Any], state: str | None = None) -> dict[str, Any]:
        """Store a job, optionally already in `state`; the scenario plays on new and Running jobs."""
        meta = manifest["metadata"]
        job = json.loads(json.dumps(manifest))
        job["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=_now())
        job["status"] = {"conditions": []}
        if self.scenario.suspend_on_create and state is None:
            self._suspend_flag(job, True)
        with self.changed:
            self.jobs[(meta["namespace"], meta["name"])] = job
            self.jobset_restarts[(meta["namespace"], meta["name"])] = 0
            self._bump("ADDED", job)
        if state is not None:
            self.set_condition(meta["namespace"], meta["name"], state, None, f"earlier {state}")
        if state in (None, "Running"):
            threading.Thread(target=self._play, args=(meta["namespace"], meta["name"], job["metadata"]["uid"]),
                             daemon=True).start()
        return job

    def _play(self, ns: str, name: str, uid: str) -> None:
        # the pods start once the job's Secret exists (they mount it); the launcher makes it and the policy next
        self.wait_for(lambda: sum(uid in {r["uid"] for r in o["metadata"].get("ownerReferences", [])}
                                  for o in self.owned.values()) >= 2 or self.stopping.is_set(), COMPANIONS_WAIT_S)
        for action in self.scenario.actions:
            time.sleep(self.scenario.step_delay_s)
            with self.changed:
                if self.scenario.lockstep:
                    self.changed.wait_for(lambda: self.watching > 0 or self.stopping.is_set(), timeout=30)
                job = self.jobs.get((ns, name))
                if self.stopping.is_set() or job is None or job["metadata"]["uid"] != uid \
                        or "deletionTimestamp" in job["metadata"]:
                    return
            action(self, ns, name)

    def _bump(self, etype: str, obj: dict[str, Any]) -> None:
        """Give `obj` a new resourceVersion and publish the event (caller holds `changed`)."""
        rv = next(self._rv)
        obj["metadata"]["resourceVersion"] = str(rv)
        self.events.append((rv, etype, json.loads(json.dumps(obj))))
        self.changed.notify_all()

    def set_condition(self, ns: str, name: str, ctype: str, reason: str | None, message: str) -> None:
        if self.backend == "trainjob":
            self._trainjob_status(ns, name, ctype, reason, message)
            return
        reason, message = reason or f"PyTorchJob{ctype}", message or f"PyTorchJob {name} is {ctype.lower()}."
        with self.changed:
            job = self.jobs[(ns, name)]
            now = _now()
            replaced = {ctype, {"Running": "Restarting", "Restarting": "Running"}.get(ctype, ctype)}
            conds = [c for c in job["status"]["conditions"] if c["type"] not in replaced]
            for c in conds:
                if ctype in ("Succeeded", "Failed") and c["type"] == "Running":
                    c["status"] = "False"
            conds.append({"type": ctype, "status": "True", "reason": reason, "message": message,
                          "lastUpdateTime": now, "lastTransitionTime": now})
            job["status"]["conditions"] = conds
            self._bump("MODIFIED", job)

    def _suspend_flag(self, job: dict[str, Any], value: bool) -> None:
        *parents, key = self.flavour.suspend_path
        node = job
        for part in parents:
            node = node.setdefault(part, {})
        node[key] = value

    def set_suspended(self, ns: str, name: str, value: bool) -> None:
        """Kueue sets or clears the job's suspend flag; the operator mirrors it in condition ``Suspended``
        (True while suspended, False with reason ``Resumed`` once admitted), as both operators do."""
        prefix = "PyTorchJob" if self.backend == "pytorchjob" else ""
        with self.changed:
            job = self.jobs[(ns, name)]
            self._suspend_flag(job, value)
            conds = [c for c in job["status"]["conditions"] if c["type"] != "Suspended"]
            conds.append({"type": "Suspended", "status": "True" if value else "False",
                          "reason": f"{prefix}{'Suspended' if value else 'Resumed'}",
                          "message": "suspended by its queue" if value else "admitted", "lastTransitionTime": _now()})
            job["status"]["conditions"] = conds
            self._bump("MODIFIED", job)

    def _trainjob_status(self, ns: str, name: str, ctype: str, reason: str | None, message: str) -> None:
        """What the trainer reflects into the TrainJob of its JobSet for the scenario's `ctype`."""
        with self.changed:
            job = self.jobs[(ns, name)]
            status = job["status"]
            counts = {"name": trainjob.NODE, "active": 0, "ready": 0, "succeeded": 0, "failed": 0, "suspended": 0}
            if ctype in ("Created", "Running"):
                counts.update(active=1, ready=int(ctype == "Running"))
            elif ctype == "Restarting":  # JobSet recreates its Jobs: a new restart attempt, pods not ready yet
                self.jobset_restarts[(ns, name)] += 1
                counts.update(active=1)
            elif ctype in ("Succeeded", "Failed", "Suspended"):
                counts.update(succeeded=int(ctype == "Succeeded"), failed=int(ctype == "Failed"),
                              suspended=int(ctype == "Suspended"))
                default_reason, default_message = {
                    "Succeeded": ("AllJobsCompleted", "jobset completed successfully"),
                    "Failed": ("FailedJobs", "jobset failed due to one or more job failures"),
                    "Suspended": ("Suspended", "TrainJob is suspended")}[ctype]
                ttype = {"Succeeded": "Complete"}.get(ctype, ctype)
                status["conditions"] = [c for c in status["conditions"] if c["type"] != ttype] + [
                    {"type": ttype, "status": "True", "reason": reason or default_reason,
                     "message": message or default_message, "lastTransitionTime": _now()}]
            else:
                raise ValueError(f"the stub has no TrainJob equivalent of condition {ctype!r}")
            status["jobsStatus"] = [counts]
            self._bump("MODIFIED", job)

    def fail_master(self, ns: str, name: str, code: int) -> None:
        """The rank-0 container exits with `code`; the operator applies its exit-code policy."""
        self.exit_master(ns, name, code)
        if self.backend == "pytorchjob":  # restartPolicy: ExitCode
            verdict = "restarting" if code >= 128 else "failing"
            self.set_condition(ns, name, "Restarting" if code >= 128 else "Failed", None,
                               f"PyTorchJob {name} is {verdict} because 1 Master replica(s) failed.")
            return
        action = jobset_action(self.runtime, code)
        max_restarts = self.runtime["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"]
        if action == trainjob.FAIL_JOBSET:
            self.set_condition(ns, name, "Failed", "FailJobSetFailurePolicyAction",
                               f"applying FailJobSet failure policy action (first failed job: {name}-node-0)")
        elif self.jobset_restarts[(ns, name)] >= max_restarts:
            self.set_condition(ns, name, "Failed", "ReachedMaxRestarts",
                               "jobset failed due to reaching max number of restarts")
        else:
            self.set_condition(ns, name, "Restarting", None, "")

    def _rank0(self, ns: str, name: str) -> dict[str, Any]:
        """The newest rank-0 pod of the job (caller holds `changed`)."""
        pods = [p for (n, _), p in self.pods.items() if n == ns
                and p["metadata"]["labels"].get(self.flavour.job_label) == name]
        return max(pods, key=lambda p: p["metadata"]["creationTimestamp"])

    def start_master(self, ns: str, name: str, lines: Sequence[str]) -> None:
        uid = str(uuid.uuid4())
        with self.changed:
            attempt = self.jobset_restarts.get((ns, name), 0)
            pod_name = self.flavour.pod_name(name, attempt)
            old = self.pods.get((ns, pod_name))
            if old is not None:
                self.logs[old["metadata"]["uid"]].closed = True
            self.pods[(ns, pod_name)] = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod_name, "namespace": ns, "uid": uid, "creationTimestamp": _now(),
                             "labels": self.flavour.pod_labels(name, attempt)},
                "spec": {"containers": [{"name": self.flavour.container, "image": "trainer"}]},
                "status": {"phase": "Running"},
            }
            self.logs[uid] = _PodLog([(time.monotonic(), _now(), line) for line in lines])
            self.changed.notify_all()

    def master_log(self, ns: str, name: str, lines: Sequence[str]) -> None:
        with self.changed:
            log = self.logs[self._rank0(ns, name)["metadata"]["uid"]]
            log.lines += [(time.monotonic(), _now(), line) for line in lines]
            self.changed.notify_all()

    def exit_master(self, ns: str, name: str, code: int) -> None:
        with self.changed:
            pod = self._rank0(ns, name)
            pod["status"] = {"phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [
                {"name": self.flavour.container, "ready": False, "restartCount": 0, "image": "trainer",
                 "imageID": "", "state": {"terminated": {"exitCode": code, "finishedAt": _now()}}}]}
            self.logs[pod["metadata"]["uid"]].closed = True
            self.exit_codes[(ns, name)] = code
            self.changed.notify_all()

    def delete_job(self, ns: str, name: str, foreground: bool) -> dict[str, Any] | None:
        with self.changed:
            job = self.jobs.get((ns, name))
            if job is None:
                return None
            self.deleted.append((name, foreground))
            if "deletionTimestamp" not in job["metadata"]:
                job["metadata"]["deletionTimestamp"] = _now()
                if foreground:
                    job["metadata"]["finalizers"] = ["foregroundDeletion"]
                self._bump("MODIFIED", job)
                delay = self.scenario.delete_delay_s if foreground else 0.0
                threading.Timer(delay, self._remove_job, args=(ns, name, job["metadata"]["uid"])).start()
            return json.loads(json.dumps(job))

    def _remove_job(self, ns: str, name: str, uid: str) -> None:
        with self.changed:
            job = self.jobs.get((ns, name))
            if job is None or job["metadata"]["uid"] != uid:
                return
            for key in [k for k, p in self.pods.items()
                        if k[0] == ns and p["metadata"]["labels"][self.flavour.job_label] == name]:
                self.logs[self.pods.pop(key)["metadata"]["uid"]].closed = True
            del self.jobs[(ns, name)]
            self._bump("DELETED", job)
            for key in [k for k, o in self.owned.items()
                        if uid in {ref["uid"] for ref in o["metadata"].get("ownerReferences", [])}]:
                del self.owned[key]  # the garbage collector: what the job owned goes with it

    def stored(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` as the API server stores a created object: a uid, a resourceVersion, a Secret's data base64."""
        obj = json.loads(json.dumps(body))
        obj["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=_now(), resourceVersion=str(next(self._rv)))
        if obj.get("kind") == "Secret" and "stringData" in obj:
            obj["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in obj.pop("stringData").items()}
        return obj

    def put_companions(self, job: dict[str, Any], owner_uid: str) -> None:
        """The job's Secret and NetworkPolicy as the launcher makes them, owned by the object of ``owner_uid``."""
        owner = {**job, "metadata": {**job["metadata"], "uid": owner_uid}}
        for obj in k8s_guard.manifests(owner, {}, self.flavour.launcher.kind.pods_selector(job["metadata"]["name"])):
            meta = obj["metadata"]
            with self.changed:
                resource = {"Secret": "secrets", "NetworkPolicy": "networkpolicies"}[obj["kind"]]
                self.owned[(resource, meta["namespace"], meta["name"])] = self.stored(obj)

    def state_of(self, ns: str, name: str) -> list[str]:
        """Types of the job's true conditions; [] when the job does not exist."""
        with self.changed:
            job = self.jobs.get((ns, name))
            return [] if job is None else [c["type"] for c in job["status"]["conditions"] if c["status"] == "True"]

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Block until `predicate()` holds (re-checked on every change) or `timeout_s` passes."""
        end = time.monotonic() + timeout_s
        with self.changed:
            while not predicate():
                if time.monotonic() >= end:
                    return False
                self.changed.wait(WAIT_SLICE_S)
        return True


# --- permissions --------------------------------------------------------------------------------
def representative_runs() -> Iterator[tuple[str, Scenario, TrainJobSpec]]:
    """The launcher paths whose API calls make up its permissions."""
    def spec(step: str, **kw: Any) -> TrainJobSpec:
        return TrainJobSpec(name=job_name("rbac-run", step), namespace="ml", image="trainer:1",
                            pvc_name="train-shared", **kw)

    yield "succeeds", Scenario(succeeding("step 1", "step 2")), spec("ok")
    yield "fails", Scenario(failing("exit 1", "boom")), spec("fail")
    yield "attaches", Scenario(finishing("resumed"), existing_state="Running", companions="own"), spec("attach")
    yield "resubmits", Scenario(succeeding("again"), existing_state="Failed", companions="stale"), spec("resubmit")
    yield "reconnects", Scenario(succeeding("a", "b"), watch_disconnects=1, watch_gone=1), spec("watch")
    yield "deadline", Scenario(running_forever()), spec("deadline", active_deadline_seconds=1)
    yield "restarts", Scenario(restarting(1) + finishing("done")), spec("restart")


def launcher_permissions(backend: str = "pytorchjob") -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of every request `backend`'s launcher made in `representative_runs`."""
    used: set[tuple[str, str, str]] = set()
    for _, scenario, spec in representative_runs():
        with StubCluster(scenario, backend) as cluster:
            if scenario.existing_state:
                job = cluster.put_job(manifest_for(spec, backend), scenario.existing_state)
                if scenario.companions:
                    cluster.put_companions(job, job["metadata"]["uid"] if scenario.companions == "own" else "gone")
            try:
                cluster.launcher(timings=SWEEP_TIMINGS).run(spec)
            except LauncherError:
                pass  # failing paths are part of the sample
            cluster.launcher().delete(spec.name, spec.namespace)  # the exit handler's call
            used |= cluster.permissions()
    return used


def rbac_rules(backend: str = "pytorchjob") -> list[tuple[str, str, tuple[str, ...]]]:
    """`launcher_permissions` grouped as Role rules: (apiGroup, resource, sorted verbs)."""
    grouped: dict[tuple[str, str], set[str]] = {}
    for group, resource, verb in launcher_permissions(backend):
        grouped.setdefault((group, resource), set()).add(verb)
    return [(g, r, tuple(sorted(v))) for (g, r), v in sorted(grouped.items())]

