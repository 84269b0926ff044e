"""Every overlay renders with kubectl's kustomize, and every object it renders is one the API server
would accept (Kubernetes OpenAPI, strict) — without a cluster."""
from __future__ import annotations

import pytest
from deploy_checks import DEPLOY, OVERLAYS, render, the, validate_object, validate_pytorchjob

NAMESPACED = {"ServiceAccount", "Role", "RoleBinding", "PersistentVolumeClaim", "ConfigMap", "LocalQueue"}


def storage_gi(pvc: dict) -> float:
    quantity = pvc["spec"]["resources"]["requests"]["storage"]
    units = {"Mi": 1 / 1024, "Gi": 1, "Ti": 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


def test_overlay_directories_are_the_ones_tested():
    assert sorted(p.name for p in (DEPLOY / "overlays").iterdir() if p.is_dir()) == sorted(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_objects_the_api_server_accepts(overlay):
    objects = render(DEPLOY / "overlays" / overlay)
    kinds = {o["kind"] for o in objects}
    assert {"Role", "RoleBinding", "PersistentVolumeClaim", "ConfigMap"} <= kinds
    for obj in objects:
        validate_object(obj)
    # Namespaced objects all land in one namespace, so the RoleBinding's subject is the ServiceAccount
    # the runs use and the PVC is the one the pods mount.
    namespaces = {o["metadata"].get("namespace") for o in objects if o["kind"] in NAMESPACED}
    assert len(namespaces) == 1 and None not in namespaces, f"namespaces differ or are missing: {namespaces}"
    assert kinds <= NAMESPACED, f"cluster-scoped or unexpected kinds: {kinds - NAMESPACED}"
    binding = the(objects, "RoleBinding", "train-launcher")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "default-editor", "namespace": namespaces.pop()}
    ]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "train-launcher"}


def test_shared_volume_per_overlay():
    local = the(render(DEPLOY / "overlays" / "local-dev"), "PersistentVolumeClaim", "train-shared")
    gpu = the(render(DEPLOY / "overlays" / "gpu-cluster"), "PersistentVolumeClaim", "train-shared")
    # Pods on several nodes write checkpoint shards at once: a multi-node cluster needs ReadWriteMany.
    assert gpu["spec"]["accessModes"] == ["ReadWriteMany"]
    # A single-node cluster gets what local provisioners offer.
    assert local["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert storage_gi(local) <= 10 < 1024 <= storage_gi(gpu)


def test_kueue_overlay_hands_its_local_queue_to_the_launcher():
    objects = render(DEPLOY / "overlays" / "kueue")
    queue = the(objects, "LocalQueue")
    config = the(objects, "ConfigMap", "train-launcher-config")
    assert config["data"]["KUEUE_QUEUE_NAME"] == queue["metadata"]["name"]
    # Same volume as the GPU cluster: the kueue overlay builds on it.
    assert the(objects, "PersistentVolumeClaim")["spec"] == the(
        render(DEPLOY / "overlays" / "gpu-cluster"), "PersistentVolumeClaim"
    )["spec"]
    # Without Kueue, the launcher gets no queue name and labels nothing.
    for overlay in ("local-dev", "gpu-cluster"):
        plain = the(render(DEPLOY / "overlays" / overlay), "ConfigMap", "train-launcher-config")
        assert plain["data"]["KUEUE_QUEUE_NAME"] == ""


# The validators themselves must reject what the API server rejects, or the tests above prove nothing.

def test_validator_rejects_an_unknown_field_in_a_core_object():
    pvc = dict(the(render(DEPLOY / "overlays" / "local-dev"), "PersistentVolumeClaim"))
    pvc["spec"] = {**pvc["spec"], "acessModes": ["ReadWriteOnce"]}
    with pytest.raises(Exception, match="acessModes"):
        validate_object(pvc)


def minimal_pytorchjob() -> dict:
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "t", "namespace": "ns"},
        "spec": {
            "pytorchReplicaSpecs": {
                "Master": {
                    "replicas": 1,
                    "restartPolicy": "OnFailure",
                    "template": {"spec": {"containers": [{"name": "pytorch", "image": "img"}]}},
                }
            }
        },
    }


def test_pytorchjob_validator_accepts_a_minimal_job_and_rejects_bad_ones():
    validate_pytorchjob(minimal_pytorchjob())
    wrong_type = minimal_pytorchjob()
    wrong_type["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = "one"
    with pytest.raises(AssertionError, match="replicas"):
        validate_pytorchjob(wrong_type)
    misspelled = minimal_pytorchjob()
    misspelled["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicyy"] = "Never"
    with pytest.raises(AssertionError, match="restartPolicyy"):
        validate_pytorchjob(misspelled)
