"""What the launch step submits beside each job (``components/lib/k8s_guard.py``), for both backends, as the launcher
sends it to the stub API server (``tests/launcher/k8s_stub.py``): the job's Secret and its NetworkPolicy validate
against the schemas vendored in ``deploy/crds/`` (``core_schemas``), are owned by the job and go when it is deleted
(the stub's garbage collector follows ``ownerReferences``), every pod mounts the Secret and names it to the trainer,
the policy admits ingress to the job's pods from the job's pods only, and the secret itself appears nowhere but in
the Secret."""
from __future__ import annotations

import base64
import importlib
import io
import json
import logging
import sys

import pytest
from core_schemas import CORE, CRDS, standalone, validate_core
from deploy_checks import REPO, validate_custom

from components.lib import jobsecret
from components.lib.pytorchjob import TrainJobSpec, job_name

STUB = REPO / "tests" / "launcher"


@pytest.fixture(scope="module")
def stub():
    sys.path.insert(0, str(STUB))
    try:
        yield importlib.import_module("k8s_stub")
    finally:
        sys.path.remove(str(STUB))


def test_the_vendored_schemas_are_the_ones_kubernetes_validate_bundles():
    for name, file in CORE.values():
        assert (CRDS / file).is_file(), f"deploy/crds/{file} is missing: run python tests/deploy/core_schemas.py"
        assert standalone(name) == json.loads((CRDS / file).read_text()), \
            f"deploy/crds/{file} differs from kubernetes-validate's: run python tests/deploy/core_schemas.py"


def pod_specs(job: dict) -> list[tuple[list[dict], list[dict], list[dict]]]:
    """(volumes, the training container's env, its mounts) of every pod template of the job."""
    if job["kind"] == "PyTorchJob":
        out = []
        for replica in job["spec"]["pytorchReplicaSpecs"].values():
            pod = replica["template"]["spec"]
            (container,) = pod["containers"]
            out.append((pod["volumes"], container["env"], container["volumeMounts"]))
        return out
    (patch,) = job["spec"]["runtimePatches"]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = node["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return [(pod["volumes"], job["spec"]["trainer"]["env"], container["volumeMounts"])]


@pytest.mark.parametrize("backend", ["pytorchjob", "trainjob"])
def test_the_secret_and_policy_beside_the_job_validate_are_owned_by_it_and_go_with_it(stub, backend, caplog):
    spec = TrainJobSpec(name=job_name("guard-run", backend), namespace="ml", image="trainer:1", nodes=2,
                        pvc_name="train-shared", labels={"team": "a"})
    out = io.StringIO()
    with stub.StubCluster(stub.Scenario(stub.succeeding("step 1")), backend) as cluster, \
            caplog.at_level(logging.DEBUG):
        assert cluster.launcher(out).run(spec).state in ("Succeeded", "Complete")
        job = cluster.jobs[("ml", spec.name)]
        owned = {key[0]: obj for key, obj in cluster.owned.items()}
        assert sorted(owned) == ["networkpolicies", "secrets"]
        validate_custom({k: v for k, v in job.items() if k != "status"})
        for obj in owned.values():
            validate_core({k: v for k, v in obj.items() if k != "data"} if obj["kind"] == "Secret" else obj)
            assert obj["metadata"]["ownerReferences"] == [{
                "apiVersion": job["apiVersion"], "kind": job["kind"], "name": spec.name,
                "uid": job["metadata"]["uid"]}]
            assert obj["metadata"]["labels"]["team"] == "a"
        secret, policy = owned["secrets"], owned["networkpolicies"]
        assert secret["metadata"]["name"] == jobsecret.secret_name(spec.name) and secret["immutable"] is True
        value = base64.b64decode(secret["data"][jobsecret.SECRET_KEY]).decode()
        assert len(value) >= 32
        for volumes, env, mounts in pod_specs(job):
            (volume,) = [v for v in volumes if "secret" in v]
            assert volume["secret"]["secretName"] == secret["metadata"]["name"]
            (mount,) = [m for m in mounts if m["name"] == volume["name"]]
            assert mount["readOnly"] is True
            named = {e["name"]: e for e in env}
            assert named[jobsecret.SECRET_FILE_ENV]["value"] == f"{mount['mountPath']}/{jobsecret.SECRET_KEY}"
            assert named[jobsecret.REPLICA_ADDR_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        pods = stub.FLAVOURS[backend].pod_labels(spec.name, 0)
        job_label = stub.FLAVOURS[backend].job_label
        assert policy["spec"] == {"podSelector": {"matchLabels": {job_label: spec.name}},
                                  "policyTypes": ["Ingress"],
                                  "ingress": [{"from": [{"podSelector": {"matchLabels": {job_label: spec.name}}}]}]}
        assert pods[job_label] == spec.name  # the label every pod of the job carries
        assert value not in caplog.text and value not in out.getvalue() and value not in str(job)
        cluster.launcher().delete(spec.name, "ml")
        assert cluster.wait_for(lambda: not cluster.jobs and not cluster.owned, timeout_s=5), cluster.owned
