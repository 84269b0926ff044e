"""The PyTorchJobs the launcher builds (components/lib/pytorchjob.py) fit the deployment: the CRD v1.9.4
schema accepts them without pruning a field, /dev/shm is memory-backed with no PodDefault, the shared
volume is the PVC that deploy/ creates, and the kueue overlay's queue name becomes the job's label."""
from __future__ import annotations

import pytest
from deploy_checks import DEPLOY, render, the, validate_object

from components.lib.pytorchjob import TrainJobSpec, build_pytorchjob, to_manifest, webhook_errors

KUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def spec_for(overlay: str, **overrides) -> TrainJobSpec:
    """A job as the pipeline would launch it in `overlay`'s namespace, on its PVC, with its queue name."""
    objects = render(DEPLOY / "overlays" / overlay)
    pvc = the(objects, "PersistentVolumeClaim")
    queue = the(objects, "ConfigMap", "train-launcher-config")["data"]["KUEUE_QUEUE_NAME"]
    fields = dict(
        name="train-run-1234567890", image="registry.example.com/resilient-train:1",
        namespace=pvc["metadata"]["namespace"],
        args=["--config", "/opt/app/trainer_image/trainer/configs/tiny.toml"], pvc_name=pvc["metadata"]["name"],
        labels={KUEUE_LABEL: queue} if queue else {}, service_account=None,
    )
    fields.update(overrides)
    return TrainJobSpec(**fields)


CASES = {
    "local-dev cpu": ("local-dev", {}),
    "gpu 4 nodes x 8": ("gpu-cluster", dict(nodes=4, nproc_per_node=8, gpus_per_node=8, memory_request="512Gi",
                                            shm_size="64Gi", secret_env_from=["hf-token"],
                                            tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists",
                                                          "effect": "NoSchedule"}])),
    "kueue 2 nodes": ("kueue", dict(nodes=2, nproc_per_node=8, gpus_per_node=8)),
    "2 nodes and 2 spares": ("local-dev", dict(nodes=2, spare_nodes=2)),
    "1 node and a spare": ("local-dev", dict(nodes=1, spare_nodes=1)),
    "4 nodes, min 2, a spare": ("gpu-cluster", dict(nodes=4, min_nodes=2, spare_nodes=1, nproc_per_node=8,
                                                    gpus_per_node=8)),
    "2 nodes, min 1": ("local-dev", dict(nodes=2, min_nodes=1)),
    "3 nodes, min 3 (not elastic)": ("local-dev", dict(nodes=3, min_nodes=3)),
}


@pytest.mark.parametrize("case", CASES)
def test_launcher_pytorchjob_matches_crd_and_deployment(case):
    overlay, overrides = CASES[case]
    spec = spec_for(overlay, **overrides)
    manifest = to_manifest(build_pytorchjob(spec))
    validate_object(manifest)

    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    assert sum(r["replicas"] for r in replicas.values()) == spec.nodes + spec.spare_nodes
    assert replicas["Master"]["replicas"] == 1
    elastic = 0 < spec.min_nodes < spec.nodes
    if elastic:
        # the operator's PET_NNODES = "min:max" and PET_RDZV_ENDPOINT = the Master (MASTER_ADDR), not <job>-worker-0
        assert manifest["spec"]["elasticPolicy"] == {
            "rdzvBackend": "c10d", "minReplicas": spec.min_nodes, "maxReplicas": spec.nodes,
            "rdzvHost": f"{spec.name}-master-0", "rdzvPort": 23456}
        assert manifest["spec"]["nprocPerNode"] == str(spec.nproc_per_node)  # never nProcPerNode in the policy
    else:
        assert "elasticPolicy" not in manifest["spec"]
    assert webhook_errors(manifest) == []
    for replica in replicas.values():
        pod = replica["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        (container,) = [c for c in pod["containers"] if c["name"] == "pytorch"]
        # spares: every pod counts in PET_NNODES (the operator's); TRAINER_NODES is the rendezvous's size (its max),
        # TRAINER_MIN_NODES its min when elastic (entrypoint.sh: --nnodes MIN:MAX)
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env.get("TRAINER_NODES") == (str(spec.nodes) if spec.spare_nodes or elastic else None)
        assert env.get("TRAINER_MIN_NODES") == (str(spec.min_nodes) if elastic else None)
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        # /dev/shm: a memory-backed emptyDir in the manifest itself (no PodDefault, no admission webhook).
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["sizeLimit"] == spec.shm_size
        # The shared volume is the PVC the overlay creates.
        shared = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert [v["persistentVolumeClaim"]["claimName"] for v in shared] == ["train-shared"]
        assert container["command"] == ["/opt/app/trainer_image/entrypoint.sh"]
    labels = manifest["metadata"].get("labels", {})
    if overlay == "kueue":
        assert labels[KUEUE_LABEL] == the(render(DEPLOY / "overlays" / "kueue"), "LocalQueue")["metadata"]["name"]
    else:
        assert KUEUE_LABEL not in labels


def test_a_base_model_download_gets_the_credentials_by_reference_only():
    """base_model=hf://... on a PyTorchJob: the trainer downloads it, with the credentials Secret's keys as optional
    secretKeyRef env (absent keys and a missing Secret are fine); no value is in the manifest."""
    from components.lib.credentials import TRAINER_ENV
    from components.lib.pytorchjob import ModelInitializer

    manifest = to_manifest(build_pytorchjob(spec_for("gpu-cluster", credentials_secret="team-creds")))
    validate_object(manifest)
    for replica in manifest["spec"]["pytorchReplicaSpecs"].values():
        (container,) = replica["template"]["spec"]["containers"]
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]
                if "secretKeyRef" in e.get("valueFrom", {})}
        assert refs == {name: {"name": "team-creds", "key": key, "optional": True} for key, name in TRAINER_ENV.items()}
    with pytest.raises(ValueError, match="a PyTorchJob has no model initializer"):
        build_pytorchjob(spec_for("gpu-cluster", model_initializer=ModelInitializer("hf://a/b", "rt/r1/workspace")))


def test_elastic_policy_needs_a_worker_and_min_at_most_max():
    """The v1.9 webhook refuses an elasticPolicy without a Worker replica spec; our own rule: minReplicas <= max."""
    manifest = to_manifest(build_pytorchjob(spec_for("local-dev", nodes=2, min_nodes=1)))
    del manifest["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert webhook_errors(manifest) == [
        "spec.pytorchReplicaSpecs[Worker]: Required value: must be configured if elastic policy is used"]
    manifest = to_manifest(build_pytorchjob(spec_for("local-dev", nodes=2, min_nodes=1)))
    manifest["spec"]["elasticPolicy"]["minReplicas"] = 3
    errors = webhook_errors(manifest)
    assert len(errors) == 1 and errors[0].startswith("spec.elasticPolicy.minReplicas: Invalid value 3"), errors
    single = to_manifest(build_pytorchjob(spec_for("local-dev")))  # no elasticPolicy: no Worker needed
    assert "elasticPolicy" not in single["spec"] and "Worker" not in single["spec"]["pytorchReplicaSpecs"]
    assert webhook_errors(single) == []


@pytest.mark.parametrize("min_nodes", [3, -1, 1.5, True])
def test_min_nodes_outside_zero_to_nodes_says_what_to_change(min_nodes):
    with pytest.raises(ValueError, match=r"min_nodes must be an integer from 0 to nodes \(2\)"):
        spec_for("local-dev", nodes=2, min_nodes=min_nodes)
