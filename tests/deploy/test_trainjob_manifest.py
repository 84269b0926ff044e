"""The Kubeflow Trainer v2 assets (components/lib/trainjob.py): the ClusterTrainingRuntime shipped in
deploy/cluster/trainjob-runtime/ is the builder's output and renders with kustomize; it and every TrainJob the
launcher builds validate against the vendored v2.3.0 CRD schemas without a pruned field; the TrainJob carries
the run's volume, image, args, env and placement; settings a TrainJob cannot carry fail before submission."""
from __future__ import annotations

import pytest
from deploy_checks import DEPLOY, render, the, validate_custom, validate_object

from components.lib import trainjob
from components.lib.params import SHARED_MOUNT
from components.lib.pytorchjob import ENTRYPOINT, TrainJobSpec, job_name

RUNTIME_DIR = DEPLOY / "cluster" / "trainjob-runtime"
KUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def test_shipped_runtime_is_the_builders_output():
    shipped = (RUNTIME_DIR / "clustertrainingruntime.yaml").read_text()
    assert shipped == trainjob.runtime_yaml(), (
        "deploy/cluster/trainjob-runtime/clustertrainingruntime.yaml is stale: regenerate it with "
        "`python -m components.lib.trainjob > deploy/cluster/trainjob-runtime/clustertrainingruntime.yaml`")


def test_runtime_renders_and_validates():
    runtime = the(render(RUNTIME_DIR), "ClusterTrainingRuntime", trainjob.RUNTIME_NAME)
    validate_object(runtime)
    assert "namespace" not in runtime["metadata"]  # cluster-scoped
    (node,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert node["name"] == trainjob.NODE and node["template"]["metadata"]["labels"][trainjob.ANCESTOR_LABEL] == "trainer"
    pod = node["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == trainjob.NODE and container["command"] == [ENTRYPOINT]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {mt["mountPath"]: mt["name"] for mt in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert volumes[mounts[SHARED_MOUNT]]["persistentVolumeClaim"]["claimName"] == "train-shared"
    assert runtime["spec"]["mlPolicy"]["torch"] == {}  # PET_* rendezvous env for entrypoint.sh
    assert pod["restartPolicy"] == "Never" and node["template"]["spec"]["backoffLimit"] == 0


def spec_for(overlay: str, **overrides) -> TrainJobSpec:
    objects = render(DEPLOY / "overlays" / overlay)
    pvc = the(objects, "PersistentVolumeClaim")
    fields = dict(name=job_name("run-1", "train"), image="registry.example.com/resilient-train:1",
                  namespace=pvc["metadata"]["namespace"], pvc_name=pvc["metadata"]["name"],
                  args=["--config", "tiny", "--train.steps=100"])
    return TrainJobSpec(**{**fields, **overrides})


CASES = {
    "cpu 1 node": {},
    "gpu 4 nodes x 8, placement, queue": dict(
        nodes=4, nproc_per_node=8, gpus_per_node=8, memory_request="512Gi", memory_limit="1Ti", shm_size="64Gi",
        node_selector={"nvidia.com/gpu.product": "NVIDIA-H200"}, env={"NCCL_DEBUG": "WARN"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        labels={KUEUE_LABEL: "train-queue"}, service_account="trainer", ft_max_restarts=5,
        image_pull_secrets=["regcred", "mirror-cred"]),
}


@pytest.mark.parametrize("case", CASES)
def test_trainjob_validates_and_carries_the_run(case):
    spec = spec_for("trainjob", **CASES[case])
    manifest = trainjob.to_manifest(trainjob.build_trainjob(spec))
    validate_custom(manifest)
    assert trainjob.webhook_errors(manifest) == []
    assert manifest["metadata"]["name"] == spec.name and manifest["metadata"]["namespace"] == spec.namespace
    assert spec.labels.items() <= manifest["metadata"]["labels"].items()
    body = manifest["spec"]
    assert body["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                  "name": trainjob.RUNTIME_NAME}
    assert body["activeDeadlineSeconds"] == spec.active_deadline_seconds
    t = body["trainer"]
    assert (t["image"], t["args"], t["numNodes"], t["numProcPerNode"]) == (
        spec.image, list(spec.args), spec.nodes, spec.nproc_per_node)
    env = {e["name"]: e["value"] for e in t["env"]}
    assert env == {"FT_MAX_RESTARTS": str(spec.ft_max_restarts), **spec.env}
    assert t["resourcesPerNode"].get("limits", {}).get("nvidia.com/gpu") == (
        str(spec.gpus_per_node) if spec.gpus_per_node else None)
    (patch,) = body["runtimePatches"]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = node["template"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": spec.shm_size}
    assert volumes["shared"]["persistentVolumeClaim"] == {"claimName": "train-shared"}
    assert pod.get("nodeSelector", {}) == dict(spec.node_selector)
    assert pod.get("tolerations", []) == [dict(t) for t in spec.tolerations]
    assert pod.get("serviceAccountName") == spec.service_account
    # A private registry: the pods pull with the run's secrets (the PyTorchJob backend's pod spec has them too).
    assert pod.get("imagePullSecrets", []) == [{"name": n} for n in spec.image_pull_secrets]


@pytest.mark.parametrize(("changes", "message"), [
    ({"secret_env_from": ["hf-token"]}, "secret_env_from: TrainJob has no envFrom"),
    ({"priority_class": "high"}, "priority_class: set priorityClassName in the ClusterTrainingRuntime"),
    ({"pvc_name": None}, "pvc_name: the runtime mounts the shared PVC"),
    ({"mount_path": "/data"}, "mount_path: the runtime mounts the shared PVC at /mnt/shared"),
])
def test_settings_a_trainjob_cannot_carry_say_so(changes, message):
    with pytest.raises(ValueError, match="cannot run as a TrainJob") as err:
        trainjob.build_trainjob(spec_for("trainjob", **changes))
    assert message in str(err.value)


def test_crd_validation_catches_unknown_and_mistyped_fields():
    manifest = trainjob.to_manifest(trainjob.build_trainjob(spec_for("trainjob")))
    manifest["spec"]["trainer"]["numNode"] = 2
    with pytest.raises(AssertionError, match="numNode"):
        validate_custom(manifest)
    manifest = trainjob.to_manifest(trainjob.build_trainjob(spec_for("trainjob")))
    manifest["spec"]["activeDeadlineSeconds"] = "1h"
    with pytest.raises(AssertionError, match="activeDeadlineSeconds"):
        validate_custom(manifest)


def test_num_proc_per_node_is_the_crds_int32_only():
    """v2.3 types numProcPerNode as int32: the builder writes an int, the CRD refuses a string ('auto' was
    Trainer < 2.3's), and the pre-submit rules do not claim otherwise."""
    manifest = trainjob.to_manifest(trainjob.build_trainjob(spec_for("trainjob", nproc_per_node=4)))
    assert manifest["spec"]["trainer"]["numProcPerNode"] == 4
    for stale in ("auto", "gpu", "4"):
        manifest["spec"]["trainer"]["numProcPerNode"] = stale
        with pytest.raises(AssertionError, match="numProcPerNode"):
            validate_custom(manifest)
        assert not [e for e in trainjob.webhook_errors(manifest) if "numProcPerNode" in e]
    manifest["spec"]["trainer"]["numProcPerNode"] = "8x"
    assert not [e for e in trainjob.webhook_errors(manifest) if "numProcPerNode" in e]


def test_webhook_rules_reject_reserved_env_and_unknown_jobs():
    manifest = trainjob.to_manifest(trainjob.build_trainjob(spec_for("trainjob")))
    manifest["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "2"})
    manifest["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["name"] = "x"
    errors = trainjob.webhook_errors(manifest)
    assert len(errors) == 2 and "reserved envs" in errors[0] and "'x' is not in runtime" in errors[1], errors
