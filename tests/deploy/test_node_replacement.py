"""The cluster manifests say what the local two-node runs do: every pod of a 2-node PyTorchJob or TrainJob gets the
rendezvous settings ``entrypoint.sh`` reads (as the local backend gives each node's entrypoint), and a pod that exits
with a retryable code or whose node is lost is replaced ALONE, with the same node rank, host name and rendezvous
address, while the other pods keep running (the in-job recovery ``tests/resiliency/test_nodes.py`` exercises).

The operators inject part of each pod's env and name its host at run time, so these tests apply to our manifests
what their sources do (the facts, and where they are):

- training-operator v1.9 (branch release-1.9): ``pkg/controller.v1/pytorch/envvar.go`` ``setPodEnv`` and
  ``master.go``: ``PET_NNODES`` = the replicas of all types, ``PET_NPROC_PER_NODE`` = ``spec.nprocPerNode``,
  ``PET_NODE_RANK`` = ``RANK`` = the index (+1 for a Worker), ``MASTER_ADDR`` = ``PET_MASTER_ADDR`` =
  ``<job>-master-0``, ``MASTER_PORT`` = ``PET_MASTER_PORT`` = the container port ``pytorchjob-port``, 23456 unless
  set (``pkg/apis/kubeflow.org/v1/pytorch_defaults.go``). ``pkg/controller.v1/common/pod.go`` ``ReconcilePods``: a
  pod that failed with a retryable code (ExitCode policy) is deleted; an index without a pod gets a new one, named
  ``<job>-<type>-<index>`` (the pod's host name too). ``common/service.go``: a headless Service of that same name
  per index, selecting the index's pod by labels (so ``<job>-master-0`` resolves to a replacement once it is ready).
- Kubeflow Trainer v2.3.0: ``pkg/runtime/framework/plugins/torch/torch.go`` ``EnforceMLPolicy``: ``PET_NNODES`` =
  ``numNodes``, ``PET_NPROC_PER_NODE`` = ``numProcPerNode``, ``PET_NODE_RANK`` from the pod annotation
  ``batch.kubernetes.io/job-completion-index``, ``PET_MASTER_ADDR`` = ``<trainjob>-node-0-0.<trainjob>``,
  ``PET_MASTER_PORT`` = 29500 (``pkg/constants``), no ``MASTER_ADDR``; ``plugins/jobset/jobset.go``: parallelism =
  completions = ``numNodes`` in the one ``node`` Job.
- JobSet v0.12.0 (what Trainer v2.3 installs): ``pkg/webhooks/jobset_webhook.go`` defaults ``completionMode:
  Indexed``, ``network.enableDNSHostnames`` and ``publishNotReadyAddresses`` to true; ``pkg/controllers/
  jobset_controller.go`` gives the pods the subdomain ``<jobset>`` and makes that headless Service; JobSet acts on a
  failed *Job* only (``failure_policy.go``), never on a pod. Kubernetes' Job controller gives an Indexed Job's pod
  the host name ``<job>-<index>`` (``pkg/controller/job/job_controller.go``), and the failure-count annotation only
  where ``backoffLimitPerIndex`` is set.
"""
from __future__ import annotations

import re

import pytest
from deploy_checks import DEPLOY, REPO, render, the, validate_object

from components.lib import trainjob
from components.lib.local_launcher import RETRYABLE_MIN
from components.lib.pytorchjob import (
    NODE_LOST_TAINTS,
    NODE_LOST_TOLERATION_S,
    TrainJobSpec,
    build_pytorchjob,
    pod_tolerations,
    to_manifest,
)

NODES, NPROC = 2, 8
NS = "team-a"
ENTRYPOINT_SH = REPO / "trainer_image" / "entrypoint.sh"
RUNTIME_DIR = DEPLOY / "cluster" / "trainjob-runtime"
PYTORCHJOB_PORT = 23456  # training-operator v1.9: PyTorchJobDefaultPort
TRAINER_PORT = 29500  # Trainer v2.3: constants.ContainerTrainerPort
LOST_TOLERATIONS = [{"key": k, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": NODE_LOST_TOLERATION_S}
                    for k in NODE_LOST_TAINTS]


def test_entrypoint_reads_the_variables_these_pods_get():
    """The variables checked below are the ones entrypoint.sh reads (the local backend sets the same ones)."""
    text = ENTRYPOINT_SH.read_text()
    for var in ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
                "FT_LOCAL_ADDR"):
        assert re.search(rf"\${{{var}\b", text), f"entrypoint.sh no longer reads {var}"


# --- PyTorchJob ------------------------------------------------------------------------------------------------
def _spec(**changes) -> TrainJobSpec:
    return TrainJobSpec(**{"name": "train-run-1-abcdef0123", "namespace": NS, "image": "trainer:1", "nodes": NODES,
                           "nproc_per_node": NPROC, "gpus_per_node": NPROC, "pvc_name": "train-shared",
                           "env": {"NCCL_DEBUG": "WARN"}, **changes})


def _pytorchjob() -> dict:
    spec = _spec()
    manifest = to_manifest(build_pytorchjob(spec))
    validate_object(manifest)
    return manifest


def _operator_pod(manifest: dict, rtype: str, index: int) -> tuple[str, dict[str, str]]:
    """The host name and env of the pod training-operator v1.9 makes for (rtype, index): the template's env with the
    downward API resolved, then what setPodEnv appends."""
    name = manifest["metadata"]["name"]
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    pod_name = f"{name}-{rtype.lower()}-{index}"
    (container,) = replicas[rtype]["template"]["spec"]["containers"]
    fields = {"metadata.name": pod_name, "spec.nodeName": "some-node"}
    env = {e["name"]: e["value"] if "value" in e else fields.get(e["valueFrom"].get("fieldRef", {}).get("fieldPath"))
           for e in container["env"]}
    port = next((p["containerPort"] for p in container.get("ports", []) if p["name"] == "pytorchjob-port"),
                PYTORCHJOB_PORT)
    rank = index + (1 if rtype == "Worker" else 0)
    env.update(PYTHONUNBUFFERED="1", MASTER_PORT=str(port), PET_MASTER_PORT=str(port),
               MASTER_ADDR=f"{name}-master-0", PET_MASTER_ADDR=f"{name}-master-0", WORLD_SIZE=str(NODES * NPROC),
               RANK=str(rank), PET_NODE_RANK=str(rank), PET_NPROC_PER_NODE=manifest["spec"]["nprocPerNode"],
               PET_NNODES=str(sum(r["replicas"] for r in replicas.values())))
    return pod_name, env


def test_pytorchjob_pods_get_the_local_runs_rendezvous_settings():
    manifest = _pytorchjob()
    pods = [_operator_pod(manifest, "Master", 0), _operator_pod(manifest, "Worker", 0)]
    (master_host, _), _ = pods
    for host, env in pods:
        assert (env["PET_NNODES"], env["PET_NPROC_PER_NODE"]) == (str(NODES), str(NPROC))
        # the store's host: MASTER_ADDR is the Master pod's host name, so its launcher serves the rendezvous
        assert env["PET_MASTER_ADDR"] == env["MASTER_ADDR"] == master_host
        assert env["PET_MASTER_PORT"] == env["MASTER_PORT"] == str(PYTORCHJOB_PORT)
        # its address in the rendezvous: the pod's name, which the index's headless Service resolves
        assert env["FT_LOCAL_ADDR"] == host
    assert [env["PET_NODE_RANK"] for _, env in pods] == ["0", "1"]
    assert len({env["FT_LOCAL_ADDR"] for _, env in pods}) == NODES
    # a replacement pod (same type and index) gets the same name, rank and address
    assert _operator_pod(manifest, "Worker", 0) == pods[1]


def test_pytorchjob_replaces_a_lost_or_retryable_pod_alone():
    """``restartPolicy: ExitCode`` on every replica: the operator deletes a pod that exits >= 128 and creates its
    index again; the other pods keep running. A lost node's pod is evicted after NODE_LOST_TOLERATION_S (not the
    cluster's 300 s); the operator re-creates it (same name) once the old pod object is gone: at once where the
    node's kubelet answers, else when the node is deleted or tainted ``node.kubernetes.io/out-of-service``."""
    for replica in _pytorchjob()["spec"]["pytorchReplicaSpecs"].values():
        assert replica["restartPolicy"] == "ExitCode"
        assert replica["template"]["spec"]["tolerations"] == LOST_TOLERATIONS


@pytest.mark.parametrize(("own", "added"), [
    ([], list(NODE_LOST_TAINTS)),
    ([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}], list(NODE_LOST_TAINTS)),
    ([{"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
       "tolerationSeconds": 30}], ["node.kubernetes.io/not-ready"]),
    ([{"key": "node.kubernetes.io/not-ready", "operator": "Exists"}], ["node.kubernetes.io/unreachable"]),
    ([{"operator": "Exists"}], []),  # tolerates every taint: the user's choice
    ([{"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoSchedule"}],
     list(NODE_LOST_TAINTS)),  # not the NoExecute taint that evicts
])
def test_a_users_own_toleration_for_a_lost_node_taint_wins(own, added):
    tolerations = pod_tolerations(own)
    assert tolerations[:len(own)] == own
    assert tolerations[len(own):] == [t for t in LOST_TOLERATIONS if t["key"] in added]


# --- TrainJob (Trainer v2.3, JobSet v0.12) ----------------------------------------------------------------------
def _trainjob() -> tuple[dict, dict]:
    spec = _spec(tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])
    manifest = trainjob.to_manifest(trainjob.build_trainjob(spec))
    validate_object(manifest)
    assert trainjob.webhook_errors(manifest) == []
    runtime = trainjob.to_manifest(trainjob.build_runtime())
    validate_object(runtime)
    return manifest, runtime


def _trainer_pod(manifest: dict, runtime: dict, index: int) -> tuple[str, dict[str, str]]:
    """The FQDN (what ``socket.getfqdn()`` gives: host name, JobSet subdomain, namespace) and env of node `index`'s
    pod: the runtime container's env, the TrainJob's, then the torch plugin's PET_*."""
    name, t = manifest["metadata"]["name"], manifest["spec"]["trainer"]
    (node,) = [j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"] if j["name"] == trainjob.NODE]
    (container,) = node["template"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value", "<downward API>") for e in container["env"] + t["env"]}
    env.update(PET_NNODES=str(t["numNodes"]), PET_NPROC_PER_NODE=str(t["numProcPerNode"]), PET_NODE_RANK=str(index),
               PET_MASTER_ADDR=f"{name}-{trainjob.NODE}-0-0.{name}", PET_MASTER_PORT=str(TRAINER_PORT))
    return f"{name}-{trainjob.NODE}-0-{index}.{name}.{manifest['metadata']['namespace']}.svc.cluster.local", env


def test_trainjob_pods_get_the_local_runs_rendezvous_settings():
    manifest, runtime = _trainjob()
    pods = [_trainer_pod(manifest, runtime, i) for i in range(NODES)]
    for fqdn, env in pods:
        assert (env["PET_NNODES"], env["PET_NPROC_PER_NODE"]) == (str(NODES), str(NPROC))
        assert env["PET_MASTER_PORT"] == str(TRAINER_PORT) and "MASTER_ADDR" not in env
        # no FT_LOCAL_ADDR: entrypoint.sh's default, the pod's FQDN, is its own, stable per index and resolvable
        assert "FT_LOCAL_ADDR" not in env and env["NCCL_DEBUG"] == "WARN"
    (master_fqdn, master_env), _ = pods
    assert master_fqdn.startswith(master_env["PET_MASTER_ADDR"] + ".")  # node 0's own name in the JobSet subdomain
    assert [env["PET_NODE_RANK"] for _, env in pods] == ["0", "1"]
    assert len({fqdn for fqdn, _ in pods}) == NODES
    assert _trainer_pod(manifest, runtime, 1) == pods[1]  # a replacement pod of index 1: same name, rank, env
    network = runtime["spec"]["template"]["spec"].get("network", {})
    assert network.get("enableDNSHostnames", True) and "subdomain" not in network  # JobSet's defaults: <trainjob>


def job_outcome(runtime: dict, exit_code: int | None, index_failures: int) -> str:
    """What happens to the ``node`` Job when one pod fails (`exit_code` None: its node was lost, PodGC failed it),
    the `index_failures`-th failure of its index: ``ReplacePod`` (that pod alone, by the Job controller) or the
    JobSet failure-policy action once the Job failed (Kubernetes batch/v1 semantics of the runtime's Job spec)."""
    jobset = runtime["spec"]["template"]["spec"]
    (node,) = [j for j in jobset["replicatedJobs"] if j["name"] == trainjob.NODE]
    job = node["template"]["spec"]
    reason = None
    for rule in (job.get("podFailurePolicy") or {}).get("rules", []):
        req = rule.get("onExitCodes")
        if req and exit_code is not None and (exit_code in req["values"]) == (req["operator"] == "In"):
            reason = trainjob.POD_FAILURE_POLICY_REASON if rule["action"] == trainjob.FAIL_JOB else None
            break
    if reason is None:
        if "backoffLimitPerIndex" in job:
            if index_failures <= job["backoffLimitPerIndex"]:
                return "ReplacePod"
            assert job["maxFailedIndexes"] == 0
            reason = trainjob.MAX_FAILED_INDEXES_REASON
        elif index_failures <= job.get("backoffLimit", 6):
            return "ReplacePod"
        else:
            reason = "BackoffLimitExceeded"
    for rule in (jobset.get("failurePolicy") or {}).get("rules", []):
        if reason in (rule.get("onJobFailureReasons") or [reason]) \
                and trainjob.NODE in (rule.get("targetReplicatedJobs") or [trainjob.NODE]):
            return rule["action"]
    return trainjob.RESTART_JOBSET


@pytest.mark.parametrize("model_initializer", [False, True])
def test_trainjob_replaces_a_lost_or_retryable_pod_alone(model_initializer):
    """JobSet v0.12 acts on a failed Job only and recreates EVERY pod (``RestartJobSet``; ``RestartJob`` would
    recreate the one ``node`` Job, which holds every pod; ``InPlaceRestart`` needs an agent in each pod). So the
    runtime's ``node`` Job replaces a failed pod itself: ``backoffLimitPerIndex`` gives each index its own budget
    (and the replacement its failure count, which the launcher counts), ``maxFailedIndexes: 0`` fails the Job as
    soon as one index has spent it, and only then does JobSet restart the whole set (its default action, no rule
    names ``MaxFailedIndexesExceeded``). A permanent code still ends the TrainJob at once."""
    runtime = trainjob.to_manifest(trainjob.build_runtime(model_initializer=model_initializer))
    validate_object(runtime)  # the vendored v2.3.0 CRD knows every field (none pruned)
    (node,) = [j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"] if j["name"] == trainjob.NODE]
    job = node["template"]["spec"]
    assert (job["completionMode"], job["maxFailedIndexes"]) == ("Indexed", 0) and "backoffLimit" not in job
    assert "podReplacementPolicy" not in job  # with a podFailurePolicy only "Failed" is allowed: the default
    assert job["template"]["spec"]["tolerations"] == LOST_TOLERATIONS
    limit = job["backoffLimitPerIndex"]
    assert limit == trainjob.NODE_REPLACEMENTS_PER_INDEX >= 1
    for code in [*range(1, 256), None]:
        permanent = code is not None and code < RETRYABLE_MIN
        assert job_outcome(runtime, code, 1) == (trainjob.FAIL_JOBSET if permanent else "ReplacePod"), code
        assert job_outcome(runtime, code, limit + 1) == (trainjob.FAIL_JOBSET if permanent
                                                         else trainjob.RESTART_JOBSET), code
    assert "restartStrategy" not in runtime["spec"]["template"]["spec"]["failurePolicy"]  # Recreate


def test_the_shipped_runtime_files_replace_pods_alone():
    for name in (trainjob.RUNTIME_NAME, trainjob.MODEL_RUNTIME_NAME):
        runtime = the(render(RUNTIME_DIR), "ClusterTrainingRuntime", name)
        assert job_outcome(runtime, 137, 1) == "ReplacePod" and job_outcome(runtime, None, 1) == "ReplacePod"


def test_a_trainjobs_tolerations_keep_the_lost_node_ones():
    """A runtimePatches entry's tolerations replace the runtime's list (strategic merge of an atomic list: Trainer
    v2.3 pkg/runtime/core/trainingruntime.go mergeRuntimePatches), so the patch carries the lost-node ones too."""
    manifest, _ = _trainjob()
    (patch,) = manifest["spec"]["runtimePatches"]
    jobs = {j["name"]: j for j in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]}
    pod = jobs[trainjob.NODE]["template"]["spec"]["template"]["spec"]
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                  *LOST_TOLERATIONS]
