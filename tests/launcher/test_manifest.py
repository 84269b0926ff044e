"""PyTorchJob manifests: CRD schema (v1.9.4), webhook rules, spec validation, job names."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from components.lib.pytorchjob import (
    MAX_JOB_NAME_LEN,
    TrainJobSpec,
    build_pytorchjob,
    is_dns1035,
    job_name,
    pod_tolerations,
    to_manifest,
    webhook_errors,
)

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "deploy" / "crds" / "kubeflow.org_pytorchjobs.v1.9.4.yaml"
ARGS = ["--config", "/opt/app/trainer_image/trainer/configs/1b.toml", "--data.path=/mnt/shared/data/x",
        "--train.steps=1000", "--checkpoint.dir=/mnt/shared/ckpt/run-1"]


def _strict(schema: Any) -> Any:
    """The CRD schema with unknown fields rejected (the API server would silently prune them)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def validator() -> jsonschema.Validator:
    if not CRD.is_file():
        pytest.fail(f"PyTorchJob CRD schema not found at {CRD}: it ships in the repository (deploy/crds/)")
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


def _schema_errors(validator: jsonschema.Validator, manifest: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(manifest)]


NAME = job_name("run-1", "train")
SPECS = {
    "cpu-1-node": TrainJobSpec(name=NAME, image="trainer:1", args=ARGS, nproc_per_node=2),
    "gpu-1-node-8": TrainJobSpec(name=NAME, image="trainer:1", args=ARGS, nproc_per_node=8, gpus_per_node=8,
                                 memory_limit="512Gi", shm_size="64Gi"),
    "gpu-4-nodes-pvc": TrainJobSpec(name=NAME, image="trainer:1", args=ARGS, nodes=4, nproc_per_node=8,
                                    gpus_per_node=8, pvc_name="train-data", mount_path="/mnt/shared"),
    "gpu-4-nodes-elastic": TrainJobSpec(name=NAME, image="trainer:1", args=ARGS, nodes=4, min_nodes=2,
                                        nproc_per_node=8, gpus_per_node=8, pvc_name="train-data"),
    "scheduling-secrets-labels": TrainJobSpec(
        name=NAME, namespace="team-a", image="registry.local/trainer:2", args=ARGS, nodes=2, nproc_per_node=4,
        gpus_per_node=4, cpu_request="16", cpu_limit="32", memory_request="200Gi", memory_limit="400Gi",
        node_selector={"nvidia.com/gpu.product": "NVIDIA-H200"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                     {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
                      "tolerationSeconds": 30}],
        env={"NCCL_DEBUG": "WARN"}, secret_env_from=["hf-token", "wandb"], service_account="trainer",
        image_pull_secrets=["regcred", "mirror-cred"],
        image_pull_policy="Always", labels={"kueue.x-k8s.io/queue-name": "team-a-queue"},
        annotations={"example.com/owner": "ml-team"}, priority_class="training-high", ft_max_restarts=5,
        active_deadline_seconds=3600, backoff_limit=0, ttl_seconds_after_finished=600),
}


@pytest.mark.parametrize("case", SPECS)
def test_manifest_matches_crd_schema_and_webhook(case: str, validator: jsonschema.Validator) -> None:
    manifest = to_manifest(build_pytorchjob(SPECS[case]))
    assert _schema_errors(validator, manifest) == []
    assert webhook_errors(manifest) == []


@pytest.mark.parametrize("case", SPECS)
def test_manifest_fields(case: str) -> None:
    spec = SPECS[case]
    manifest = to_manifest(build_pytorchjob(spec))
    assert (manifest["apiVersion"], manifest["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert manifest["metadata"]["name"] == spec.name and manifest["metadata"]["namespace"] == spec.namespace
    body = manifest["spec"]
    assert body["nprocPerNode"] == str(spec.nproc_per_node)
    # elastic: the operator's rendezvous env names the Master (rdzvHost), never nProcPerNode in the policy (webhook)
    assert body.get("elasticPolicy") == ({"rdzvBackend": "c10d", "minReplicas": spec.min_nodes,
                                          "maxReplicas": spec.nodes, "rdzvHost": f"{NAME}-master-0",
                                          "rdzvPort": 23456} if spec.elastic else None)
    assert body["runPolicy"] == {"activeDeadlineSeconds": spec.active_deadline_seconds,
                                 "backoffLimit": spec.backoff_limit, "cleanPodPolicy": "Running",
                                 "ttlSecondsAfterFinished": spec.ttl_seconds_after_finished}
    replicas = body["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1
    if spec.nodes == 1:
        assert set(replicas) == {"Master"}
    else:
        assert replicas["Worker"]["replicas"] == spec.nodes - 1
    for replica in replicas.values():
        assert replica["restartPolicy"] == "ExitCode"
        pod = replica["template"]["spec"]
        assert "restartPolicy" not in pod  # the operator derives it from the replica's policy
        (container,) = pod["containers"]
        assert container["name"] == "pytorch"
        assert container["command"] == ["/opt/app/trainer_image/entrypoint.sh"] and container["args"] == ARGS
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in container["env"]
        # the rendezvous address: the pod's name, the same in a replacement pod (tests/deploy/test_node_replacement.py)
        assert {"name": "FT_LOCAL_ADDR", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
        assert env["FT_MAX_RESTARTS"] == str(spec.ft_max_restarts)
        assert (env.get("TRAINER_NODES"), env.get("TRAINER_MIN_NODES")) == (
            (str(spec.nodes), str(spec.min_nodes)) if spec.elastic else (None, None))
        assert {k: env[k] for k in spec.env} == dict(spec.env)
        assert container.get("envFrom", []) == [{"secretRef": {"name": s}} for s in spec.secret_env_from]
        limits = container["resources"].get("limits", {})
        assert limits.get("nvidia.com/gpu") == (str(spec.gpus_per_node) if spec.gpus_per_node else None)
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": spec.shm_size}
        if spec.pvc_name:
            assert volumes[mounts[spec.mount_path]]["persistentVolumeClaim"] == {"claimName": spec.pvc_name}
        else:
            assert spec.mount_path not in mounts
        assert pod.get("nodeSelector", {}) == dict(spec.node_selector)
        assert pod["tolerations"] == pod_tolerations(spec.tolerations)  # + the lost-node taints' unless given
        assert pod.get("serviceAccountName") == spec.service_account
        assert pod.get("imagePullSecrets", []) == [{"name": n} for n in spec.image_pull_secrets]
        assert pod.get("priorityClassName") == spec.priority_class
        assert spec.labels.items() <= replica["template"]["metadata"]["labels"].items()
    assert spec.labels.items() <= manifest["metadata"]["labels"].items()
    assert manifest["metadata"].get("annotations", {}) == dict(spec.annotations)


def _base() -> dict[str, Any]:
    return to_manifest(build_pytorchjob(SPECS["gpu-4-nodes-pvc"]))


def _wrong_container_name(m: dict[str, Any]) -> None:
    m["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = "trainer"


def _two_masters(m: dict[str, Any]) -> None:
    m["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = 2


def _nproc_twice(m: dict[str, Any]) -> None:
    m["spec"]["elasticPolicy"] = {"nProcPerNode": 8, "rdzvBackend": "c10d"}


def _chief_replica(m: dict[str, Any]) -> None:
    m["spec"]["pytorchReplicaSpecs"]["Chief"] = copy.deepcopy(m["spec"]["pytorchReplicaSpecs"]["Worker"])


def _no_master(m: dict[str, Any]) -> None:
    del m["spec"]["pytorchReplicaSpecs"]["Master"]


def _bad_name(m: dict[str, Any]) -> None:
    m["metadata"]["name"] = "1-Train_Job"


def _no_image(m: dict[str, Any]) -> None:
    m["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["image"] = ""


def _elastic_without_worker(m: dict[str, Any]) -> None:
    m["spec"]["elasticPolicy"] = {"rdzvBackend": "c10d", "minReplicas": 1, "maxReplicas": 1}
    del m["spec"]["pytorchReplicaSpecs"]["Worker"]


def _elastic_min_above_max(m: dict[str, Any]) -> None:
    m["spec"]["elasticPolicy"] = {"rdzvBackend": "c10d", "minReplicas": 4, "maxReplicas": 2}


@pytest.mark.parametrize(("mutate", "expected"), [
    (_wrong_container_name, "spec.pytorchReplicaSpecs[Worker].template.spec.containers: Required value: a container "
                            "named 'pytorch'"),
    (_two_masters, "spec.pytorchReplicaSpecs[Master].replicas: Forbidden: must be 1; got 2"),
    (_nproc_twice, "spec.elasticPolicy.nProcPerNode: Forbidden: must not be used with spec.nprocPerNode"),
    (_chief_replica, "spec.pytorchReplicaSpecs[Chief]: Unsupported value 'Chief'"),
    (_no_master, "spec.pytorchReplicaSpecs[Master]: Required value"),
    (_bad_name, "metadata.name: Invalid value '1-Train_Job'"),
    (_no_image, "spec.pytorchReplicaSpecs[Master].template.spec.containers[0].image: Required value"),
    (_elastic_without_worker, "spec.pytorchReplicaSpecs[Worker]: Required value: must be configured if elastic policy "
                              "is used"),
    (_elastic_min_above_max, "spec.elasticPolicy.minReplicas: Invalid value 4: must not exceed maxReplicas (2)"),
])
def test_webhook_errors_report_rule_breaks(mutate: Any, expected: str) -> None:
    manifest = _base()
    mutate(manifest)
    errors = webhook_errors(manifest)
    assert len(errors) == 1 and errors[0].startswith(expected), errors


def test_schema_check_catches_wrong_types_and_unknown_fields(validator: jsonschema.Validator) -> None:
    manifest = _base()
    manifest["spec"]["nprocPerNode"] = 8
    manifest["spec"]["runPolicy"]["activeDeadline"] = 60
    errors = _schema_errors(validator, manifest)
    assert any(e.startswith("spec.nprocPerNode: 8 is not of type 'string'") for e in errors), errors
    assert any(e.startswith("spec.runPolicy: Additional properties") and "activeDeadline" in e for e in errors)


@pytest.mark.parametrize(("changes", "message"), [
    ({"nodes": 0}, "nodes must be an integer >= 1; got 0"),
    ({"name": "Train_Job"}, "name must be a DNS-1035 label"),
    ({"name": "a" * (MAX_JOB_NAME_LEN + 1)}, "use job_name(run_id, step)"),
    ({"gpus_per_node": 8, "nproc_per_node": 4},
     "nproc_per_node must equal gpus_per_node (one rank per GPU); got 4 and 8"),
    ({"env": {"FT_MAX_RESTARTS": "9"}}, "use ft_max_restarts for FT_MAX_RESTARTS"),
    ({"env": {"PET_NNODES": "2"}}, "env 'PET_NNODES' is set by the operator"),
    ({"env": {"FT_LOCAL_ADDR": "10.0.0.1"}}, "env 'FT_LOCAL_ADDR' is set by the operator or this module"),
    ({"env": {"TRAINER_MIN_NODES": "1"}}, "env 'TRAINER_MIN_NODES' is set by the operator or this module"),
    ({"nodes": 2, "min_nodes": 3}, "min_nodes must be an integer from 0 to nodes (2)"),
    ({"min_nodes": -1}, "min_nodes must be an integer from 0 to nodes (1)"),
    ({"memory_request": "16GB"}, "memory_request must be a Kubernetes quantity"),
    ({"tolerations": [{"key": "a", "tolerations_seconds": 3}]}, "got unknown ['tolerations_seconds']"),
    ({"args": "--config x.toml"}, "args must be a list of CLI arguments"),
    ({"active_deadline_seconds": 0}, "active_deadline_seconds must be an integer >= 1"),
    ({"image_pull_policy": "always"}, "image_pull_policy must be one of"),
    ({"secret_env_from": ["HF_TOKEN=abc"]}, "secret_env_from must be a list of Secret names"),
    ({"image_pull_secrets": "regcred"}, "image_pull_secrets must be a list of Secret names"),
    ({"image_pull_secrets": ["Reg Cred"]}, "image_pull_secrets must be a list of Secret names"),
    ({"labels": {"kueue.x-k8s.io/queue-name": "bad value"}}, "is not a valid Kubernetes label"),
])
def test_invalid_spec_says_what_to_change(changes: dict[str, Any], message: str) -> None:
    fields = {"name": NAME, "image": "trainer:1", **changes}
    with pytest.raises(ValueError) as err:
        TrainJobSpec(**fields)
    assert message in str(err.value)


def test_invalid_spec_reports_every_problem() -> None:
    with pytest.raises(ValueError) as err:
        TrainJobSpec(name="Bad", image="", nodes=0)
    assert str(err.value).count("\n  - ") == 3


def test_job_name_is_deterministic_and_dns1035() -> None:
    run = "3f2a9c1b-5d6e-4f00-8a1b-1234567890ab"
    assert job_name(run, "train") == job_name(run, "train")
    for run_id, step in [(run, "train"), ("R" * 200, "Train Step #1"), ("123", "456"), ("run", "-_-x-_-"),
                         ("a/b:c", "ÜBER_step")]:
        name = job_name(run_id, step)
        assert is_dns1035(name) and len(name) <= MAX_JOB_NAME_LEN, name
        assert is_dns1035(f"{name}-worker-127")
        TrainJobSpec(name=name, image="trainer:1")  # accepted as a spec name


def test_job_name_differs_across_runs_and_steps() -> None:
    long_prefix = "pipeline-run-" + "x" * 60
    names = {job_name(f"{long_prefix}-{i}", "train") for i in range(50)}
    names |= {job_name(f"{long_prefix}-0", step) for step in ("eval", "train-2")}
    assert len(names) == 52  # same readable prefix after truncation, different hashes


def test_job_name_needs_run_and_step() -> None:
    with pytest.raises(ValueError, match="non-empty run_id and step"):
        job_name("", "train")


@pytest.mark.parametrize("case", SPECS)
def test_pods_run_as_the_images_non_root_user(case: str) -> None:
    """The pods' securityContext matches the USER of trainer_image/Dockerfile (and is not root)."""
    user = [line.split()[1] for line in (REPO / "trainer_image" / "Dockerfile").read_text().splitlines()
            if line.startswith("USER ")][-1]
    uid, gid = (int(x) for x in user.split(":"))
    for replica in to_manifest(build_pytorchjob(SPECS[case]))["spec"]["pytorchReplicaSpecs"].values():
        ctx = replica["template"]["spec"]["securityContext"]
        assert ctx == {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": gid, "fsGroup": gid} and uid != 0


def test_every_pod_leaves_a_lost_node_within_a_minute_unless_the_spec_says_otherwise() -> None:
    """Each replica tolerates node.kubernetes.io/not-ready and /unreachable (NoExecute) for 60 s, not the cluster's
    default 300 s: a lost node's pod is evicted and the operator creates it again (restartPolicy ExitCode). A spec's
    own toleration for one of those keys is kept as it is, and that key gets no other."""
    from components.lib.pytorchjob import NODE_LOST_TOLERATION_S

    default = to_manifest(build_pytorchjob(SPECS["gpu-4-nodes-pvc"]))["spec"]["pytorchReplicaSpecs"]
    own = to_manifest(build_pytorchjob(SPECS["scheduling-secrets-labels"]))["spec"]["pytorchReplicaSpecs"]
    for replicas, expected in ((default, {"node.kubernetes.io/not-ready": NODE_LOST_TOLERATION_S,
                                          "node.kubernetes.io/unreachable": NODE_LOST_TOLERATION_S}),
                               (own, {"node.kubernetes.io/not-ready": NODE_LOST_TOLERATION_S,
                                      "node.kubernetes.io/unreachable": 30})):
        assert set(replicas) == {"Master", "Worker"}
        for replica in replicas.values():
            noexecute = {t["key"]: t["tolerationSeconds"] for t in replica["template"]["spec"]["tolerations"]
                         if t.get("effect") == "NoExecute"}
            assert noexecute == expected


@pytest.mark.parametrize(("nodes", "min_nodes", "elastic"), [(4, 2, True), (2, 1, True), (4, 0, False), (4, 4, False),
                                                            (1, 1, False), (1, 0, False)])
def test_elastic_only_when_min_nodes_is_between_zero_and_nodes(nodes: int, min_nodes: int, elastic: bool) -> None:
    spec = TrainJobSpec(name=NAME, image="trainer:1", nodes=nodes, min_nodes=min_nodes)
    assert spec.elastic is elastic
    body = to_manifest(build_pytorchjob(spec))["spec"]
    assert ("elasticPolicy" in body) is elastic
    # replica counts do not change with min_nodes: one Master, nodes-1 Workers
    assert sum(r["replicas"] for r in body["pytorchReplicaSpecs"].values()) == nodes
