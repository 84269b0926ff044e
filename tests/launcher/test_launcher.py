"""PyTorchJobLauncher against the stub API server: every path the train step can take."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import threading
from pathlib import Path

import pytest
import yaml
from k8s_stub import (
    FAST_TIMINGS,
    Scenario,
    StubCluster,
    condition,
    failing,
    finishing,
    launcher_permissions,
    master_exit,
    rbac_rules,
    running_forever,
    restarting,
    succeeding,
)

from components.lib import k8s_kinds
from components.lib.k8s_launcher import (
    DeadlineExceededError,
    InvalidJobError,
    JobFailedError,
    LauncherError,
    LauncherTerminated,
    PyTorchJobLauncher,
    RestartBudgetExceededError,
)
from components.lib.pytorchjob import TrainJobSpec, build_pytorchjob, job_name, to_manifest

NS = "ml"
GONE_WAIT_S = 3.0
TEST_DEADLINE_S = 15  # a launcher that misses its exit fails on its deadline instead of hanging
pytestmark = pytest.mark.timeout(30)


def _spec(step: str = "train", **changes: object) -> TrainJobSpec:
    fields: dict[str, object] = {"active_deadline_seconds": TEST_DEADLINE_S, **changes}
    return TrainJobSpec(name=job_name("run-42", step), namespace=NS, image="trainer:1",
                        args=["--train.steps=10"], **fields)


def _verbs(cluster: StubCluster, resource: str) -> list[str]:
    return [verb for _, _, (_, res, verb) in cluster.requests if res == resource]


def test_success_streams_master_log_and_logs_transitions(caplog: pytest.LogCaptureFixture) -> None:
    spec, out = _spec(), io.StringIO()
    caplog.set_level(logging.INFO, logger="components.lib.k8s_launcher")
    with StubCluster(Scenario(succeeding("step 1 loss 3.1", "step 2 loss 2.7", "done"))) as cluster:
        result = cluster.launcher(out).run(spec)
        assert cluster.deleted == []
        assert cluster.created == [spec.name]
    assert (result.name, result.state, result.restarts) == (spec.name, "Succeeded", 0)
    assert [c["type"] for c in result.conditions if c["status"] == "True"] == ["Created", "Succeeded"]
    pod = f"[{spec.name}-master-0]"
    assert [ln for ln in out.getvalue().splitlines() if not ln.startswith(f"{pod} ---")] == [
        f"{pod} step 1 loss 3.1", f"{pod} step 2 loss 2.7", f"{pod} done"]
    assert "Created -> Running" in caplog.text and "Running -> Succeeded" in caplog.text


def test_log_stream_reconnects_without_repeating_lines() -> None:
    spec, out = _spec(), io.StringIO()
    with StubCluster(Scenario(succeeding("l1", "l2", "l3", "l4"), log_disconnects=2)) as cluster:
        assert cluster.launcher(out).run(spec).state == "Succeeded"
        assert _verbs(cluster, "pods/log").count("get") == 3
    lines = [ln.split("] ", 1)[1] for ln in out.getvalue().splitlines() if "] ---" not in ln]
    assert lines == ["l1", "l2", "l3", "l4"]


def test_conflict_attaches_to_the_running_job() -> None:
    spec, out = _spec(), io.StringIO()
    with StubCluster(Scenario(finishing("resumed at step 500"))) as cluster:
        cluster.put_job(to_manifest(build_pytorchjob(spec)), "Running")
        result = cluster.launcher(out).run(spec)
        assert _verbs(cluster, "pytorchjobs")[:2] == ["create", "get"]  # 409, then attach
        assert cluster.created == [] and cluster.deleted == []
    assert result.state == "Succeeded"
    assert "resumed at step 500" in out.getvalue()


def test_existing_succeeded_job_is_returned_without_resubmitting() -> None:
    spec = _spec()
    with StubCluster(Scenario(succeeding("never runs"))) as cluster:
        cluster.put_job(to_manifest(build_pytorchjob(spec)), "Succeeded")
        result = cluster.launcher().run(spec)
        assert _verbs(cluster, "pytorchjobs") == ["create", "get"]
        assert cluster.created == [] and cluster.deleted == []
    assert result.state == "Succeeded"


def test_failed_job_fails_the_step_with_reason_and_log_tail() -> None:
    spec = _spec()
    scenario = Scenario(failing("PyTorchJob is failing because 1 Master replica(s) failed.",
                                "step 7 loss nan", "ValueError: loss is NaN"))
    with StubCluster(scenario) as cluster:
        with pytest.raises(JobFailedError) as err:
            cluster.launcher().run(spec)
        assert cluster.deleted == []  # finished: kept for post-mortems until its TTL or the exit handler
    assert err.value.reason == "PyTorchJobFailed"
    assert "1 Master replica(s) failed" in str(err.value)
    assert err.value.log_tail[-2:] == ["step 7 loss nan", "ValueError: loss is NaN"]
    assert "ValueError: loss is NaN" in str(err.value)


def test_failed_job_from_an_earlier_attempt_is_deleted_and_resubmitted() -> None:
    spec, out = _spec(), io.StringIO()
    with StubCluster(Scenario(succeeding("resuming from checkpoint step 900"))) as cluster:
        cluster.put_job(to_manifest(build_pytorchjob(spec)), "Failed")
        result = cluster.launcher(out).run(spec)
        assert cluster.deleted == [(spec.name, True)]  # foreground: the pods go before the job
        assert cluster.created == [spec.name]
        assert _verbs(cluster, "pytorchjobs")[:4] == ["create", "get", "delete", "get"]
    assert result.state == "Succeeded"
    assert "resuming from checkpoint step 900" in out.getvalue()


def test_watch_disconnect_and_410_gone_reconnect_and_still_see_success(caplog: pytest.LogCaptureFixture) -> None:
    spec = _spec()
    caplog.set_level(logging.INFO, logger="components.lib.k8s_launcher")
    # Lockstep: the re-list precedes the job's 3 status changes, so each cut watch carries one of them.
    scenario = Scenario(succeeding("a", "b", "c"), watch_disconnects=2, watch_gone=1, lockstep=True)
    with StubCluster(scenario) as cluster:
        result = cluster.launcher().run(spec)
        verbs = _verbs(cluster, "pytorchjobs")
    assert result.state == "Succeeded"
    assert verbs == ["create", "list", "watch", "list", "watch", "watch", "watch"]  # 410, re-list, 2 cuts, last
    assert caplog.text.count("disconnected") == 2 and "410 Gone" in caplog.text


def test_deadline_deletes_the_job_and_raises() -> None:
    spec = _spec(active_deadline_seconds=1)
    with StubCluster(Scenario(running_forever())) as cluster:
        with pytest.raises(DeadlineExceededError, match="still Running after the launcher's deadline"):
            cluster.launcher().run(spec)
        assert cluster.deleted == [(spec.name, True)]
        assert cluster.wait_for(lambda: (NS, spec.name) not in cluster.jobs, GONE_WAIT_S)


def test_restarts_within_budget_are_counted_and_logs_follow_new_pods() -> None:
    spec, out = _spec(max_cluster_restarts=2), io.StringIO()
    scenario = Scenario(restarting(2) + [master_exit(0), condition("Succeeded")], step_delay_s=0.15)
    with StubCluster(scenario) as cluster:
        result = cluster.launcher(out).run(spec)
        assert cluster.deleted == []
    assert (result.state, result.restarts) == ("Succeeded", 2)
    text = out.getvalue()
    assert all(f"attempt {i}" in text for i in range(3))
    assert text.count("--- following the log of") == 3  # one per Master pod


def test_restart_budget_exceeded_deletes_the_job_and_raises() -> None:
    spec = _spec(max_cluster_restarts=2)
    with StubCluster(Scenario(restarting(3) + running_forever())) as cluster:
        with pytest.raises(RestartBudgetExceededError, match="restarted 3 times, more than max_cluster_restarts=2"):
            cluster.launcher().run(spec)
        assert cluster.deleted == [(spec.name, True)]


def test_sigterm_deletes_the_job() -> None:
    spec, before = _spec(), signal.getsignal(signal.SIGTERM)
    with StubCluster(Scenario(running_forever())) as cluster:
        running = threading.Thread(target=lambda: cluster.wait_for(
            lambda: "Running" in cluster.state_of(NS, spec.name), GONE_WAIT_S) and os.kill(os.getpid(), signal.SIGTERM))
        running.start()
        with pytest.raises(LauncherTerminated, match="SIGTERM"):
            cluster.launcher().run(spec)
        running.join()
        assert cluster.deleted == [(spec.name, True)]
    assert signal.getsignal(signal.SIGTERM) is before  # the launcher's handler is gone again


def test_manifest_breaking_a_webhook_rule_is_refused_before_any_request(monkeypatch: pytest.MonkeyPatch) -> None:
    def misnamed(job: object) -> dict[str, object]:
        manifest = to_manifest(job)  # type: ignore[arg-type]
        manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["name"] = "main"
        return manifest

    monkeypatch.setattr(k8s_kinds, "to_manifest", misnamed)
    with StubCluster(Scenario(succeeding())) as cluster:
        with pytest.raises(InvalidJobError, match="a container named 'pytorch'"):
            cluster.launcher().run(_spec())
        assert cluster.requests == []


def test_delete_is_idempotent() -> None:
    spec = _spec()
    with StubCluster(Scenario()) as cluster:
        cluster.put_job(to_manifest(build_pytorchjob(spec)), "Running")
        launcher = cluster.launcher()
        assert launcher.delete(spec.name, NS) is True
        assert cluster.wait_for(lambda: (NS, spec.name) not in cluster.jobs, GONE_WAIT_S)
        assert launcher.delete(spec.name, NS) is False


def test_from_environment_without_credentials_says_what_to_do(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(LauncherError, match="no Kubernetes credentials.*point KUBECONFIG"):
        PyTorchJobLauncher.from_environment(kubeconfig=str(tmp_path / "missing"))


def test_from_environment_uses_a_kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    spec = _spec()
    with StubCluster(Scenario(succeeding("hello"))) as cluster:
        kubeconfig = tmp_path / "config"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "stub",
            "clusters": [{"name": "stub", "cluster": {"server": f"http://127.0.0.1:{cluster.port}"}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "u"}}]}))
        launcher = PyTorchJobLauncher.from_environment(kubeconfig=str(kubeconfig), timings=FAST_TIMINGS,
                                                       out=io.StringIO())
        assert launcher.run(spec).state == "Succeeded"


def test_recorded_permissions() -> None:
    assert launcher_permissions() == {
        ("kubeflow.org", "pytorchjobs", "create"), ("kubeflow.org", "pytorchjobs", "get"),
        ("kubeflow.org", "pytorchjobs", "list"), ("kubeflow.org", "pytorchjobs", "watch"),
        ("kubeflow.org", "pytorchjobs", "delete"), ("", "pods", "list"), ("", "pods/log", "get"),
        ("", "secrets", "create"), ("", "secrets", "get"), ("", "secrets", "delete"),
        ("networking.k8s.io", "networkpolicies", "create"), ("networking.k8s.io", "networkpolicies", "get"),
        ("networking.k8s.io", "networkpolicies", "delete")}


def test_attaching_keeps_the_jobs_secret_and_a_stale_one_is_replaced() -> None:
    """A launcher that attaches to its running job keeps the job's Secret (its pods hold it); a Secret and policy
    left by an earlier job of the same name (the garbage collector not done) are replaced by the new job's own."""
    spec = _spec()
    with StubCluster(Scenario(finishing("resumed"))) as cluster:
        job = cluster.put_job(to_manifest(build_pytorchjob(spec)), "Running")
        cluster.put_companions(job, job["metadata"]["uid"])
        before = json.dumps(list(cluster.owned.values()), sort_keys=True)
        assert cluster.launcher().run(spec).state == "Succeeded"
        assert json.dumps(list(cluster.owned.values()), sort_keys=True) == before
        assert _verbs(cluster, "secrets") == ["create", "get"]
    with StubCluster(Scenario(succeeding("again"))) as cluster:
        old = cluster.put_job(to_manifest(build_pytorchjob(spec)), "Failed")
        cluster.put_companions(old, "an-earlier-job")
        assert cluster.launcher().run(spec).state == "Succeeded"
        new = cluster.jobs[(NS, spec.name)]["metadata"]["uid"]
        assert [o["metadata"]["ownerReferences"][0]["uid"] for o in cluster.owned.values()] == [new, new]
        assert _verbs(cluster, "secrets") == ["create", "get", "delete", "create"]


def test_a_secret_the_launcher_may_not_create_fails_the_launch_and_deletes_the_job() -> None:
    spec = _spec()
    with StubCluster(Scenario(running_forever(), forbidden=("secrets",))) as cluster:
        with pytest.raises(LauncherError, match="Secret or NetworkPolicy could not be made: HTTP 403 .*needs "
                                                "create, get and delete on secrets"):
            cluster.launcher().run(spec)
        assert cluster.deleted == [(spec.name, True)]


def test_rbac_rules_group_verbs_per_resource(monkeypatch: pytest.MonkeyPatch) -> None:
    import k8s_stub

    monkeypatch.setattr(k8s_stub, "launcher_permissions", lambda backend: {
        ("", "pods", "list"), ("kubeflow.org", "pytorchjobs", "get"), ("kubeflow.org", "pytorchjobs", "create")})
    assert rbac_rules() == [("", "pods", ("list",)), ("kubeflow.org", "pytorchjobs", ("create", "get"))]
