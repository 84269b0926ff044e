"""The launcher's guarantees for BOTH cluster backends (PyTorchJob, TrainJob) against the stub API server:
attach, failure with each exit class, the restart budget, cancel, and re-attach after the launcher's own pod
restarts. The TrainJob "operator" decides restarts from the failure policy of the ClusterTrainingRuntime that
`components.lib.trainjob` builds (`k8s_stub.jobset_action`), so these tests exercise the shipped policy."""

from __future__ import annotations

import io
import os
import signal
import threading

import pytest
from k8s_stub import (
    BACKENDS,
    Scenario,
    StubCluster,
    admitted,
    condition,
    finishing,
    jobset_action,
    launcher_permissions,
    manifest_for,
    master_exit,
    master_fails,
    master_log,
    master_up,
    pause,
    running_forever,
    succeeding,
    suspended,
)

from components.lib import trainjob
from components.lib.k8s_launcher import (
    DeadlineExceededError,
    JobFailedError,
    LauncherTerminated,
    RestartBudgetExceededError,
)
from components.lib.pytorchjob import TrainJobSpec, job_name
from trainer.exitcodes import ExitCode, is_retryable

NS = "ml"
GONE_WAIT_S = 3.0
PERMANENT = [c for c in ExitCode if c != ExitCode.OK and not is_retryable(c)]
RETRYABLE = [c for c in ExitCode if is_retryable(c)]
pytestmark = pytest.mark.timeout(30)


def _spec(**changes: object) -> TrainJobSpec:
    fields: dict[str, object] = {"active_deadline_seconds": 15, "pvc_name": "train-shared", **changes}
    return TrainJobSpec(name=job_name("run-42", "train"), namespace=NS, image="trainer:1",
                        args=["--train.steps=10"], **fields)


def _started(*lines: str) -> list:
    return [condition("Created"), master_up(*lines), condition("Running")]


@pytest.mark.parametrize("backend", BACKENDS)
def test_success_follows_the_rank0_log(backend: str) -> None:
    spec, out = _spec(), io.StringIO()
    with StubCluster(Scenario(succeeding("step 1 loss 3.1", "done")), backend) as cluster:
        result = cluster.launcher(out).run(spec)
        assert cluster.created == [spec.name] and cluster.deleted == []
    assert (result.restarts, result.state) == (0, {"pytorchjob": "Succeeded", "trainjob": "Complete"}[backend])
    assert [ln.split("] ", 1)[1] for ln in out.getvalue().splitlines() if "] ---" not in ln] == [
        "step 1 loss 3.1", "done"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_conflict_attaches_to_the_running_job(backend: str) -> None:
    spec, out = _spec(), io.StringIO()
    with StubCluster(Scenario(finishing("resumed at step 500")), backend) as cluster:
        cluster.put_job(manifest_for(spec, backend), "Running")
        cluster.launcher(out).run(spec)
        assert cluster.created == [] and cluster.deleted == []
    assert "resumed at step 500" in out.getvalue()


@pytest.mark.parametrize("code", PERMANENT, ids=lambda c: c.name)
@pytest.mark.parametrize("backend", BACKENDS)
def test_permanent_exit_fails_at_once_with_the_trainers_code(backend: str, code: ExitCode) -> None:
    spec = _spec(max_cluster_restarts=3)
    scenario = Scenario(_started() + [master_log(f"fatal: {code.name}"), master_fails(code)])
    with StubCluster(scenario, backend) as cluster:
        with pytest.raises(JobFailedError) as err:
            cluster.launcher().run(spec)
        assert cluster.jobset_restarts.get((NS, spec.name), 0) == 0  # never restarted
        assert cluster.deleted == []  # finished: kept for post-mortems until the exit handler
    assert err.value.exit_code == code
    assert f"trainer exit code {int(code)} ({code.name})" in str(err.value)
    assert err.value.log_tail[-1] == f"fatal: {code.name}"


@pytest.mark.parametrize("code", RETRYABLE, ids=lambda c: c.name)
@pytest.mark.parametrize("backend", BACKENDS)
def test_retryable_exit_restarts_and_resumes(backend: str, code: ExitCode) -> None:
    spec, out = _spec(max_cluster_restarts=1), io.StringIO()
    scenario = Scenario(_started("attempt 0") + [master_fails(code), master_up("attempt 1"), condition("Running"),
                                                 master_exit(0), condition("Succeeded")], step_delay_s=0.1)
    with StubCluster(scenario, backend) as cluster:
        result = cluster.launcher(out).run(spec)
    assert result.restarts == 1
    assert "attempt 0" in out.getvalue() and "attempt 1" in out.getvalue()


@pytest.mark.parametrize("backend", BACKENDS)
def test_restart_budget_exceeded_deletes_the_job(backend: str) -> None:
    spec = _spec(max_cluster_restarts=1)
    actions = _started("attempt 0")
    for attempt in (1, 2):
        actions += [master_fails(ExitCode.KILLED), master_up(f"attempt {attempt}"), condition("Running")]
    with StubCluster(Scenario(actions + running_forever()[2:], step_delay_s=0.1), backend) as cluster:
        with pytest.raises(RestartBudgetExceededError, match="restarted 2 times, more than max_cluster_restarts=1"):
            cluster.launcher().run(spec)
        assert cluster.deleted == [(spec.name, True)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigterm_cancel_deletes_the_job(backend: str) -> None:
    spec = _spec()
    with StubCluster(Scenario(running_forever()), backend) as cluster:
        running = threading.Thread(target=lambda: cluster.wait_for(
            lambda: bool(cluster.pods), GONE_WAIT_S) and os.kill(os.getpid(), signal.SIGTERM))
        running.start()
        with pytest.raises(LauncherTerminated, match="SIGTERM"):
            cluster.launcher().run(spec)
        running.join()
        assert cluster.deleted == [(spec.name, True)]
        assert cluster.wait_for(lambda: (NS, spec.name) not in cluster.jobs, GONE_WAIT_S)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reattach_after_the_launchers_pod_restarts(backend: str) -> None:
    """The first launcher pod died without cleaning up (no exit handler ran): its job runs on. The next
    launcher finds it by its deterministic name, follows the current rank-0 pod, counts the restart that
    happens while it watches, and the exit handler deletes the finished job."""
    spec, out = _spec(max_cluster_restarts=2), io.StringIO()
    actions = [master_up("step 40 (before the launcher restarted)"), master_fails(ExitCode.UNHEALTHY_NODE),
               master_up("resumed from step 40"), condition("Running"), master_exit(0), condition("Succeeded")]
    with StubCluster(Scenario(actions, step_delay_s=0.1), backend) as cluster:
        cluster.put_job(manifest_for(spec, backend), "Running")
        launcher = cluster.launcher(out)
        result = launcher.run(spec)
        assert cluster.created == []
        assert launcher.delete(spec.name, NS) is True  # the exit handler
        assert cluster.wait_for(lambda: (NS, spec.name) not in cluster.jobs, GONE_WAIT_S)
    assert result.restarts == 1
    assert "resumed from step 40" in out.getvalue()


QUEUED_S = 3.0
"""Longer than the whole launcher deadline of `_spec(active_deadline_seconds=1)` (1 s + the 1 s margin)."""


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_deadline_starts_when_the_queue_admits_the_job(backend: str) -> None:
    """Kueue creates the job suspended and admits it later: the time in the queue is not training time."""
    spec, out = _spec(active_deadline_seconds=1), io.StringIO()
    actions = [pause(QUEUED_S), admitted()] + _started("step 1") + [master_exit(0), condition("Succeeded")]
    with StubCluster(Scenario(actions, suspend_on_create=True), backend) as cluster:
        result = cluster.launcher(out).run(spec)
        assert cluster.deleted == []
    assert result.state in ("Succeeded", "Complete") and "step 1" in out.getvalue()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_job_suspended_again_gets_a_new_deadline_when_readmitted(backend: str) -> None:
    spec = _spec(active_deadline_seconds=1)
    actions = [admitted(), pause(1.2), suspended(), pause(QUEUED_S), admitted()] + _started() + [
        master_exit(0), condition("Succeeded")]
    with StubCluster(Scenario(actions, suspend_on_create=True), backend) as cluster:
        assert cluster.launcher().run(spec).restarts == 0
        assert cluster.deleted == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_admitted_job_still_has_its_deadline(backend: str) -> None:
    spec = _spec(active_deadline_seconds=1)
    with StubCluster(Scenario([pause(0.5), admitted()] + running_forever(), suspend_on_create=True),
                     backend) as cluster:
        with pytest.raises(DeadlineExceededError, match="from its admission"):
            cluster.launcher().run(spec)
        assert cluster.deleted == [(spec.name, True)]


def test_runtime_failure_policy_never_restarts_a_permanent_code() -> None:
    runtime = trainjob.to_manifest(trainjob.build_runtime())
    for code in range(1, 256):
        expected = trainjob.RESTART_JOBSET if is_retryable(code) else trainjob.FAIL_JOBSET
        assert jobset_action(runtime, code) == expected, code


def test_trainjob_permissions() -> None:
    assert launcher_permissions("trainjob") == {
        ("trainer.kubeflow.org", "trainjobs", "create"), ("trainer.kubeflow.org", "trainjobs", "get"),
        ("trainer.kubeflow.org", "trainjobs", "list"), ("trainer.kubeflow.org", "trainjobs", "watch"),
        ("trainer.kubeflow.org", "trainjobs", "delete"), ("", "pods", "list"), ("", "pods/log", "get"),
        ("", "secrets", "create"), ("", "secrets", "get"), ("", "secrets", "delete"),
        ("networking.k8s.io", "networkpolicies", "create"), ("networking.k8s.io", "networkpolicies", "get"),
        ("networking.k8s.io", "networkpolicies", "delete")}


def test_trainjob_state_comes_from_conditions_then_jobs_status() -> None:
    from components.lib.k8s_launcher import job_state

    def status(conditions: list, active: int) -> dict:
        return {"status": {"conditions": conditions, "jobsStatus": [{"name": "node", "active": active}]}}

    suspended = {"type": "Suspended", "status": "False", "reason": "Resumed"}
    assert job_state(status([], 0), "Complete") == "Pending"
    assert job_state(status([suspended], 1), "Complete") == "Running"
    assert job_state(status([{**suspended, "status": "True"}], 0), "Complete") == "Suspended"
    assert job_state(status([{"type": "Complete", "status": "True"}], 0), "Complete") == "Complete"
    assert job_state(status([{"type": "Failed", "status": "True"}], 1), "Complete") == "Failed"


def test_trainjob_counts_restarts_from_before_the_launcher_attached() -> None:
    """JobSet's restart count is absolute, and so is the restart-attempt label it puts on the pods it makes:
    a re-attaching launcher sees a budget already spent, with no right beyond pods: list."""
    spec = _spec(max_cluster_restarts=1)
    with StubCluster(Scenario(), "trainjob") as cluster:
        cluster.put_job(manifest_for(spec, "trainjob"), "Running")
        cluster.jobset_restarts[(NS, spec.name)] = 2
        cluster.start_master(NS, spec.name, ["attempt 2 runs"])  # pod labelled restart-attempt=2
        with pytest.raises(RestartBudgetExceededError, match="restarted 2 times, more than max_cluster_restarts=1"):
            cluster.launcher().run(spec)
        assert cluster.deleted == [(spec.name, True)]


def test_trainjob_failed_by_jobsets_own_restart_limit_is_a_spent_budget() -> None:
    scenario = Scenario(_started() + [condition("Failed", "jobset failed due to reaching max number of restarts",
                                                reason="ReachedMaxRestarts")])
    with StubCluster(scenario, "trainjob") as cluster:
        with pytest.raises(RestartBudgetExceededError):
            cluster.launcher().run(_spec())


def test_trainjob_counts_pods_replaced_alone_in_its_job() -> None:
    """The runtime's node Job replaces a pod that exits >= 128, or whose node is lost, by itself (backoffLimitPerIndex:
    tests/deploy/test_node_replacement.py); the replacement keeps JobSet's restart-attempt label and carries the Job
    controller's failure count of its index, so each replacement counts against max_cluster_restarts, as a PyTorchJob
    pod's does. Counts of an earlier JobSet attempt, seen while watching, are kept after a JobSet restart."""
    from types import SimpleNamespace

    from components.lib.k8s_kinds import RestartAttemptLabels

    def pod(attempt: int, index: int, failures: int | None = None, ignored: int | None = None,
            job: str = trainjob.NODE) -> SimpleNamespace:
        labels = {trainjob.RESTART_ATTEMPT_LABEL: str(attempt), trainjob.REPLICATED_JOB_LABEL: job,
                  trainjob.JOB_INDEX_LABEL: "0", trainjob.COMPLETION_INDEX_LABEL: str(index)}
        notes = {k: str(v) for k, v in ((trainjob.INDEX_FAILURE_COUNT_ANNOTATION, failures),
                                        (trainjob.INDEX_IGNORED_FAILURE_COUNT_ANNOTATION, ignored)) if v is not None}
        return SimpleNamespace(metadata=SimpleNamespace(labels=labels, annotations=notes or None))

    listed: list[list[SimpleNamespace]] = []

    class Core:
        def list_namespaced_pod(self, namespace: str, label_selector: str, _request_timeout: float) -> SimpleNamespace:
            assert label_selector == f"{trainjob.JOBSET_NAME_LABEL}=tj"
            return SimpleNamespace(items=listed[-1])

    counter = RestartAttemptLabels(Core(), "tj", NS, SimpleNamespace(request_timeout_s=1.0))
    steps = [  # (pods now, expected restarts)
        ([pod(0, 0), pod(0, 1)], 0),
        ([pod(0, 0), pod(0, 1, failures=0), pod(0, 1, failures=1)], 1),  # node 1 replaced once (old pod still listed)
        ([pod(0, 0), pod(0, 1, failures=2)], 2),  # again; the first two pods of index 1 are gone (PodGC)
        ([pod(0, 0, failures=0, ignored=1), pod(0, 1, failures=2), pod(0, 0, job="model-initializer", failures=5)], 3),
        ([pod(1, 0), pod(1, 1)], 4),  # JobSet restarted the set: attempt 1 + the 3 replacements of attempt 0
    ]
    for i, (pods, expected) in enumerate(steps):
        listed.append(pods)
        count, message = counter.observe({"status": {"n": i}})
        assert count == expected, (i, count)
    assert message == "JobSet tj recreated its pods (restart attempt 1); 3 pod(s) replaced alone in its Job"
