"""The Kubeflow Trainer v2 assets (components/lib/trainjob.py): the ClusterTrainingRuntime shipped in
deploy/cluster/trainjob-runtime/ is the builder's output and renders with kustomize; it and every TrainJob the
launcher builds validate against the vendored v2.3.0 CRD schemas without a pruned field; the TrainJob carries
the run's volume, image, args, env and placement; settings a TrainJob cannot carry fail before submission."""
from __future__ import annotations

import pytest
from deploy_checks import DEPLOY, render, the, validate_custom, validate_object

from components.lib import trainjob
from components.lib.params import SHARED_MOUNT
from components.lib.pytorchjob import ENTRYPOINT, ModelInitializer, TrainJobSpec, job_name, pod_tolerations

RUNTIME_DIR = DEPLOY / "cluster" / "trainjob-runtime"
KUEUE_LABEL = "kueue.x-k8s.io/queue-name"


@pytest.mark.parametrize(("file", "flag"), [("clustertrainingruntime.yaml", ""),
                                          ("clustertrainingruntime-model-initializer.yaml", " --model-initializer")])
def test_shipped_runtime_is_the_builders_output(file, flag):
    shipped = (RUNTIME_DIR / file).read_text()
    assert shipped == trainjob.runtime_yaml(model_initializer=bool(flag)), (
        f"deploy/cluster/trainjob-runtime/{file} is stale: regenerate it with "
        f"`python -m components.lib.trainjob{flag} > deploy/cluster/trainjob-runtime/{file}`")


def test_runtime_renders_and_validates():
    assert trainjob.main(["--model-initializer", "-x"]) == 2  # the CLI refuses what it does not know
    runtime = the(render(RUNTIME_DIR), "ClusterTrainingRuntime", trainjob.RUNTIME_NAME)
    validate_object(runtime)
    assert "namespace" not in runtime["metadata"]  # cluster-scoped
    (node,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert node["name"] == trainjob.NODE
    assert node["template"]["metadata"]["labels"][trainjob.ANCESTOR_LABEL] == "trainer"
    pod = node["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == trainjob.NODE and container["command"] == [ENTRYPOINT]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {mt["mountPath"]: mt["name"] for mt in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert volumes[mounts[SHARED_MOUNT]]["persistentVolumeClaim"]["claimName"] == "train-shared"
    assert runtime["spec"]["mlPolicy"]["torch"] == {}  # PET_* rendezvous env for entrypoint.sh
    # a failed pod is replaced alone, per index; a permanent code fails the job (tests/deploy/test_node_replacement.py)
    assert pod["restartPolicy"] == "Never" and node["template"]["spec"]["backoffLimitPerIndex"] >= 1


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
    "2 nodes and a spare": dict(nodes=2, spare_nodes=1),
    "4 nodes, min 2, a spare": dict(nodes=4, min_nodes=2, spare_nodes=1, nproc_per_node=8, gpus_per_node=8),
    "2 nodes, min 1": dict(nodes=2, min_nodes=1),
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
        spec.image, list(spec.args), spec.nodes + spec.spare_nodes, spec.nproc_per_node)
    env = {e["name"]: e.get("value") for e in t["env"] if "value" in e}
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in t["env"]
    elastic = 0 < spec.min_nodes < spec.nodes
    # the rendezvous's size (its max): the rest wait as spares; its min when elastic (entrypoint: --nnodes MIN:MAX)
    nodes = {"TRAINER_NODES": str(spec.nodes)} if spec.spare_nodes or elastic else {}
    nodes |= {"TRAINER_MIN_NODES": str(spec.min_nodes)} if elastic else {}
    # and the peer tier's secret, mounted from the job's Secret (tests/deploy/test_job_guard.py)
    assert env == {"FT_MAX_RESTARTS": str(spec.ft_max_restarts), **nodes, **spec.env,
                   "TRAINER_JOB_SECRET_FILE": "/var/run/secrets/resilient-train/peer-secret"}
    assert "elasticPolicy" not in body and "elasticPolicy" not in t  # Trainer v2 has none: the entrypoint's range
    assert t["resourcesPerNode"].get("limits", {}).get("nvidia.com/gpu") == (
        str(spec.gpus_per_node) if spec.gpus_per_node else None)
    (patch,) = body["runtimePatches"]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = node["template"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": spec.shm_size}
    assert volumes["shared"]["persistentVolumeClaim"] == {"claimName": "train-shared"}
    assert pod.get("nodeSelector", {}) == dict(spec.node_selector)
    assert pod["tolerations"] == pod_tolerations(spec.tolerations)  # + the lost-node taints' (60 s)
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


# --- the model initializer (Kubeflow Trainer v2.3) -------------------------------------------------------------
UPSTREAM_MODEL_INITIALIZER_ENV = {
    "hf://": {"STORAGE_URI", "IGNORE_PATTERNS", "ACCESS_TOKEN"},
    "s3://": {"STORAGE_URI", "IGNORE_PATTERNS", "ENDPOINT", "ACCESS_KEY_ID", "SECRET_ACCESS_KEY", "REGION", "ROLE_ARN"},
}
"""The env the upstream initializer reads (kubeflow/trainer v2.3.0 pkg/initializers/types/types.py:
HuggingFaceModelInitializer, S3ModelInitializer; utils.get_config_from_env upper-cases the field names)."""


def test_model_initializer_runtime_has_the_jobs_the_controller_requires():
    runtime = the(render(RUNTIME_DIR), "ClusterTrainingRuntime", trainjob.MODEL_RUNTIME_NAME)
    validate_object(runtime)
    jobs = {j["name"]: j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"]}
    assert list(jobs) == [trainjob.MODEL_INITIALIZER, trainjob.NODE]
    init = jobs[trainjob.MODEL_INITIALIZER]
    assert init["template"]["metadata"]["labels"][trainjob.ANCESTOR_LABEL] == "model-initializer"
    init_pod = init["template"]["spec"]["template"]["spec"]
    (container,) = init_pod["containers"]
    assert container["name"] == "model-initializer" and container["image"].endswith(":v2.3.0")
    assert jobs[trainjob.NODE]["dependsOn"] == [{"name": "model-initializer", "status": "Complete"}]
    node_pod = jobs[trainjob.NODE]["template"]["spec"]["template"]["spec"]
    (node,) = node_pod["containers"]
    for pod, c in ((init_pod, container), (node_pod, node)):
        # the webhook's requirement (a mount named "initializer"), at /workspace, the run's own directory of the PVC
        (mount,) = [mt for mt in c["volumeMounts"] if mt["name"] == "initializer"]
        assert mount == {"name": "initializer", "mountPath": "/workspace", "subPathExpr": "$(WORKSPACE_SUBPATH)"}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["initializer"]["persistentVolumeClaim"] == {"claimName": "train-shared"}
        assert pod["securityContext"]["runAsUser"] == 1000  # the initializer writes as the run's own user
    rules = runtime["spec"]["template"]["spec"]["failurePolicy"]["rules"]
    assert rules[0] == {"name": "ModelDownloadFailed", "action": "FailJobSet",
                        "targetReplicatedJobs": ["model-initializer"]}
    plain = the(render(RUNTIME_DIR), "ClusterTrainingRuntime", trainjob.RUNTIME_NAME)
    assert [j["name"] for j in plain["spec"]["template"]["spec"]["replicatedJobs"]] == [trainjob.NODE]


@pytest.mark.parametrize(("uri", "secret_keys"), [
    ("hf://meta-llama/Llama-3.2-1B", {"ACCESS_TOKEN": "HF_TOKEN"}),
    ("s3://models/llama-3.1-8b", {"ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID", "SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY",
                                  "ENDPOINT": "AWS_ENDPOINT_URL", "REGION": "AWS_REGION"}),
])
def test_trainjob_with_a_base_model_uri_downloads_it_with_the_initializer(uri, secret_keys):
    init = ModelInitializer(uri, "resilient-train/run-1/workspace")
    spec = spec_for("trainjob", model_initializer=init, credentials_secret="team-creds", nodes=2,
                    nproc_per_node=8, gpus_per_node=8)
    manifest = trainjob.to_manifest(trainjob.build_trainjob(spec))
    validate_custom(manifest)
    assert trainjob.webhook_errors(manifest) == []
    body = manifest["spec"]
    assert body["runtimeRef"]["name"] == trainjob.MODEL_RUNTIME_NAME
    model = body["initializer"]["model"]
    assert model["storageUri"] == uri and "dataset" not in body["initializer"]
    env = {e["name"]: e for e in model["env"]}
    assert env.pop("WORKSPACE_SUBPATH")["value"] == "resilient-train/run-1/workspace"
    assert {name: e["valueFrom"]["secretKeyRef"] for name, e in env.items()} == {
        name: {"name": "team-creds", "key": key, "optional": True} for name, key in secret_keys.items()}
    assert set(env) <= UPSTREAM_MODEL_INITIALIZER_ENV[uri[:5]]  # names the upstream initializer reads
    trainer_env = {e["name"]: e.get("value") for e in body["trainer"]["env"]}
    assert trainer_env["WORKSPACE_SUBPATH"] == "resilient-train/run-1/workspace"  # the nodes see the same copy
    (patch,) = body["runtimePatches"]
    jobs = {j["name"]: j["template"]["spec"]["template"]["spec"]
            for j in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]}
    assert set(jobs) == {"model-initializer", "node"}
    for pod in jobs.values():
        assert {"name": "initializer", "persistentVolumeClaim": {"claimName": "train-shared"}} in pod["volumes"]
    assert "tolerations" not in jobs["model-initializer"]  # a CPU pod: not the GPU placement


def test_initializer_settings_that_cannot_work_fail_before_submission():
    with pytest.raises(ValueError, match="credentials_secret: a TrainJob hands credentials to its model initializer"):
        trainjob.build_trainjob(spec_for("trainjob", credentials_secret="team-creds"))
    with pytest.raises(ValueError, match="model_initializer needs an hf:// or s3:// storage_uri"):
        spec_for("trainjob", model_initializer=ModelInitializer("gs://b/m", "rt/r1/workspace"))
    with pytest.raises(ValueError, match="relative to the PVC's root"):
        spec_for("trainjob", model_initializer=ModelInitializer("hf://a/b", "/mnt/shared/rt/r1/workspace"))
    manifest = trainjob.to_manifest(trainjob.build_trainjob(
        spec_for("trainjob", model_initializer=ModelInitializer("hf://a/b", "rt/r1/workspace")),
        runtime=trainjob.RUNTIME_NAME))
    errors = trainjob.webhook_errors(manifest)
    assert any("must have model-initializer job" in e for e in errors), errors
    assert any("'model-initializer' is not in runtime" in e for e in errors), errors


def test_elastic_trainjob_carries_the_node_range_in_the_trainer_env():
    """min_nodes on a TrainJob: no elastic policy (Trainer v2 has none); numNodes counts every pod, and the trainer
    env gives entrypoint.sh the rendezvous's range: TRAINER_MIN_NODES:TRAINER_NODES."""
    spec = spec_for("trainjob", nodes=4, min_nodes=3, spare_nodes=2, env={"NCCL_DEBUG": "WARN"})
    manifest = trainjob.to_manifest(trainjob.build_trainjob(spec))
    validate_custom(manifest)  # deploy/crds/trainer.kubeflow.org_trainjobs.v2.3.0.yaml, nothing pruned
    assert trainjob.webhook_errors(manifest) == []
    t = manifest["spec"]["trainer"]
    assert t["numNodes"] == 6
    values = [(e["name"], e.get("value")) for e in t["env"]]
    ranges = ("TRAINER_NODES", "TRAINER_MIN_NODES")
    assert [v for v in values if v[0] in ranges] == [("TRAINER_NODES", "4"), ("TRAINER_MIN_NODES", "3")]
    plain = trainjob.to_manifest(trainjob.build_trainjob(spec_for("trainjob", nodes=4, min_nodes=4)))
    assert not [e for e in plain["spec"]["trainer"]["env"] if e["name"] in ranges]
