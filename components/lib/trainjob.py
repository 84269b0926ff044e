"""Kubeflow Trainer v2 manifests for the train step (``trainer.kubeflow.org/v1alpha1``, Trainer v2.3).

Two resources, both built only from the ``kubeflow_trainer_api`` models (PyPI ``kubeflow-trainer-api``):

- `build_runtime` gives the ``ClusterTrainingRuntime`` this trainer runs on (``RUNTIME_NAME``): the
  ``torch`` ML policy (the trainer injects ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``,
  ``PET_MASTER_ADDR``, ``PET_MASTER_PORT`` into the container named ``node``, which is what
  ``trainer_image/entrypoint.sh`` reads), one replicated job ``node`` running `ENTRYPOINT` (ft_launcher) in
  our image, a memory-backed ``/dev/shm`` and the shared PVC at ``/mnt/shared``. It ships rendered in
  ``deploy/cluster/trainjob-runtime/`` (``python -m components.lib.trainjob`` prints it; a test keeps the
  file equal to this function's output).
- `build_runtime` with ``model_initializer=True`` gives ``MODEL_RUNTIME_NAME``: the same plus Kubeflow
  Trainer's model initializer (upstream image, replicated job and container ``model-initializer``), which
  downloads ``spec.initializer.model.storageUri`` (hf://, s3://) into ``/workspace/model`` before the ``node``
  job starts (``dependsOn: Complete``). ``/workspace`` is the volume ``initializer`` in both pods: the shared
  PVC at the run's own directory (``subPathExpr: $(WORKSPACE_SUBPATH)``, set per TrainJob to
  ``<workdir below the PVC>/<run id>/workspace``), so every node of a multi-node job reads the same copy and
  no extra volume is provisioned. There is no dataset initializer: data prep, a pipeline step before the job,
  already read the corpus (s3://, gs://, hf://) and wrote token shards to the PVC, where the training pods and
  the evaluation step read them; and upstream v2.3 runs every initializer job a runtime declares (one without
  ``STORAGE_URI`` fails), so a dataset initializer would force each job to download a dataset it never reads.
- `build_trainjob` turns the same `TrainJobSpec` the PyTorchJob backend takes into a ``TrainJob`` that
  references the runtime: image, args, nodes, ranks per node, resources and env in ``spec.trainer``; the
  per-run volume (PVC name, /dev/shm size), the job's Secret (volume and the ``node`` container's read-only mount:
  `components.lib.jobsecret`; the launcher makes the Secret, owned by the TrainJob: `components.lib.k8s_guard`),
  node selector, tolerations, service account and image pull secrets in a ``runtimePatches`` entry of ours; with a
  `ModelInitializer`, ``spec.initializer.model`` (storage URI, the workspace directory, credentials as optional
  ``secretKeyRef`` env under the initializer's names: `MODEL_INITIALIZER_ENV`) on ``MODEL_RUNTIME_NAME``.

The exit-code contract as a failure policy (FT: the cluster recovery layer for this backend), JobSet v0.12 (the
version Trainer v2.3 installs):

- The ``node`` Job (``completionMode: Indexed``; one Job, one pod per node) has a ``podFailurePolicy`` whose rule
  ``FailJob`` matches exit codes 1-127 of the ``node`` container (permanent: bad config, data, a bug); the Job then
  fails with reason ``PodFailurePolicy``, and the JobSet's ``failurePolicy`` rule ``FailJobSet`` on that reason ends
  the whole job at once: a permanent code is never restarted.
- Any other failure of a pod (>= 128: killed, preempted, budget spent, unhealthy node; a lost node's pod, failed
  by PodGC) replaces THAT pod only: ``backoffLimitPerIndex`` (`NODE_REPLACEMENTS_PER_INDEX`) lets the Job controller
  create the index again while the other pods keep running, so the job recovers in the job, as a PyTorchJob's
  ``restartPolicy: ExitCode`` does. The new pod has the same completion index (``PET_NODE_RANK``), the same host
  name ``<trainjob>-node-0-<i>`` in the JobSet's subdomain ``<trainjob>`` (so ``PET_MASTER_ADDR``,
  ``<trainjob>-node-0-0.<trainjob>``, names the replacement of node 0, and each node's FQDN, its rendezvous address,
  stays its own), the same ``jobset.sigs.k8s.io/restart-attempt`` label, and the annotation
  ``batch.kubernetes.io/job-index-failure-count`` (its index's failures so far), from which the launcher counts it.
  The Job controller waits 10 s, doubling per failure of the index, before it creates the replacement; with a
  ``podFailurePolicy`` it replaces a pod only once that pod is terminal (``podReplacementPolicy: Failed``).
- An index that fails more often (``maxFailedIndexes: 0``) fails the Job (``MaxFailedIndexesExceeded``), which
  takes JobSet's default action, ``RestartJobSet``: every pod is recreated and the trainer resumes from its latest
  checkpoint. A model initializer that still fails after its Job's own retries (``INITIALIZER_BACKOFF_LIMIT``: a
  wrong repo, a refused token) ends the TrainJob (rule ``ModelDownloadFailed``).
- Every training pod tolerates the lost-node taints for `NODE_LOST_TOLERATION_S` (`pod_tolerations`), in the
  runtime and in each TrainJob's ``runtimePatches`` (a patch's tolerations replace the runtime's list).
- The restart *budget* is the launcher's own (``max_cluster_restarts``, per run), as for PyTorchJob: JobSet's
  ``maxRestarts`` and the Job's per-index limit live in the shared runtime and cannot be patched per TrainJob, so they
  are set to the largest budget the pipeline accepts (`MAX_RESTARTS`) as server-side backstops, and the launcher
  counts JobSet's restarts (the ``restart-attempt`` label of the pods) plus the pods replaced in the Job (their
  failure-count annotations) and deletes the TrainJob when the run's budget is spent.

Elastic training (``min_nodes``): Kubeflow Trainer v2 has no elastic policy (v2.2.0 removed the unimplemented one),
and needs none here: the runtime replaces a failed pod per index while the other pods keep running (above), so the
entrypoint's node range carries the elasticity, as in a PyTorchJob. ``spec.trainer.env`` sets ``TRAINER_NODES`` =
nodes and ``TRAINER_MIN_NODES`` = min_nodes; the entrypoint runs the launcher with ``--nnodes MIN:MAX``, so when a
node is lost and neither a spare nor its replacement joins within ``TRAINER_NODE_WAIT_S``, the job trains on with as
few as ``min_nodes`` nodes. ``numNodes`` stays nodes + spare_nodes (the torch plugin's ``PET_NNODES`` counts every
pod; pods beyond ``TRAINER_NODES`` wait as spares).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import yaml
from kubeflow_trainer_api import models as m

from components.lib.jobsecret import peer_env, secret_mount, secret_volume
from components.lib.local_launcher import RETRYABLE_MIN
from components.lib.params import DEFAULTS, MAX_RESTARTS, SHARED_MOUNT
from components.lib.pytorchjob import (
    DEFAULT_TTL_AFTER_FINISHED_S,
    ENTRYPOINT,
    FT_MAX_RESTARTS_ENV,
    GPU_RESOURCE,
    MIN_NODES_ENV,
    NODE_NAME_ENV,
    NODES_ENV,
    IMAGE_UID,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    POD_ANNOTATIONS,
    SHARED_VOLUME,
    SHM_PATH,
    SHM_VOLUME,
    ModelInitializer,
    TrainJobSpec,
    is_dns1035,
    pod_tolerations,
)

GROUP = "trainer.kubeflow.org"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TrainJob"
PLURAL = "trainjobs"
RUNTIME_KIND = "ClusterTrainingRuntime"
RUNTIME_NAME = "resilient-train-torch"
NODE = "node"
"""Name of the replicated job and of its container: the torch plugin injects PET_* into this container only."""
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
"""Marks the replicated job that TrainJob.spec.trainer overrides."""
FRAMEWORK_LABEL = "trainer.kubeflow.org/framework"
PATCH_MANAGER = "resilient-train.dev/launcher"
"""Owner of our runtimePatches entry (a domain-prefixed path, as the trainer's webhook requires)."""
PERMANENT_EXIT_CODES = list(range(1, RETRYABLE_MIN))
"""1-127: nothing restarts these (the trainer's exitcodes contract, mirrored: components never import it)."""
PERMANENT_RULE = "PermanentExitCode"
POD_FAILURE_POLICY_REASON = "PodFailurePolicy"
"""The batch/v1 Job failure reason when a podFailurePolicy FailJob rule matched."""
FAIL_JOBSET, RESTART_JOBSET, FAIL_JOB = "FailJobSet", "RestartJobSet", "FailJob"
TORCH_RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
#: Pod labels JobSet sets; the launcher finds the rank-0 pod and the restart attempt with them.
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
RESTART_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
"""JobSet's restart count when it created the pod (its ``status.restarts`` then): the launcher's restart count."""
INDEX_FAILURE_COUNT_ANNOTATION = "batch.kubernetes.io/job-index-failure-count"
"""The Job controller's count of the failed pods of a pod's completion index (Jobs with backoffLimitPerIndex)."""
INDEX_IGNORED_FAILURE_COUNT_ANNOTATION = "batch.kubernetes.io/job-index-ignored-failure-count"
"""The same for failures a podFailurePolicy ``Ignore`` rule matched (absent when none)."""
NODE_REPLACEMENTS_PER_INDEX = MAX_RESTARTS
"""``backoffLimitPerIndex`` of the ``node`` Job: a backstop only, the launcher enforces ``max_cluster_restarts``."""
INDEXED = "Indexed"
MAX_FAILED_INDEXES_REASON = "MaxFailedIndexesExceeded"
"""The batch/v1 Job failure reason when an index used up its backoffLimitPerIndex (maxFailedIndexes: 0)."""
DEFAULT_PULL_POLICY = "IfNotPresent"
DEFAULT_SHM_SIZE = "1Gi"

# --- the model initializer (Kubeflow Trainer v2.3: pkg/initializers, pkg/constants) ---------------------------
MODEL_RUNTIME_NAME = "resilient-train-torch-model-initializer"
MODEL_INITIALIZER = "model-initializer"
"""Name of its replicated job, container and ancestor label value (fixed by the trainer's controller)."""
MODEL_INITIALIZER_IMAGE = "ghcr.io/kubeflow/trainer/model-initializer:v2.3.0"
INITIALIZER_VOLUME = "initializer"
"""The volume the controller's webhook requires in an initializer container."""
WORKSPACE = "/workspace"
MODEL_PATH = f"{WORKSPACE}/model"
"""Where the initializer writes the model; the trainer gets ``--model.from_hf`` pointing here."""
WORKSPACE_SUBPATH_ENV = "WORKSPACE_SUBPATH"
DEFAULT_WORKSPACE_SUBPATH = "resilient-train/workspace"
"""Used only by a TrainJob that does not set `WORKSPACE_SUBPATH_ENV` (the launcher always does)."""
INITIALIZER_BACKOFF_LIMIT = 2
"""Pod retries of a failed download (a network error) before the initializer Job, then the TrainJob, fails."""
MODEL_DOWNLOAD_RULE = "ModelDownloadFailed"
MODEL_INITIALIZER_ENV = {
    "hf://": {"HF_TOKEN": "ACCESS_TOKEN"},
    "s3://": {"AWS_ACCESS_KEY_ID": "ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY": "SECRET_ACCESS_KEY",
              "AWS_ENDPOINT_URL": "ENDPOINT", "AWS_REGION": "REGION"},
}
"""Secret key (``components.lib.credentials``) -> the initializer's env variable, per storage URI scheme."""


def _quantity(value: str) -> m.IoK8sApimachineryPkgApiResourceQuantity:
    return m.IoK8sApimachineryPkgApiResourceQuantity(value)


def _volumes(pvc_name: str, shm_size: str) -> list[m.IoK8sApiCoreV1Volume]:
    return [
        m.IoK8sApiCoreV1Volume(name=SHM_VOLUME, empty_dir=m.IoK8sApiCoreV1EmptyDirVolumeSource(
            medium="Memory", size_limit=_quantity(shm_size))),
        m.IoK8sApiCoreV1Volume(name=SHARED_VOLUME, persistent_volume_claim=(
            m.IoK8sApiCoreV1PersistentVolumeClaimVolumeSource(claim_name=pvc_name))),
    ]


RUNTIME_IMAGE = "ghcr.io/resilient-train/resilient-train:0.1.0"
"""The runtime's default image: every TrainJob the launcher builds sets the run's image in ``spec.trainer``."""


def _initializer_volume(pvc_name: str) -> m.IoK8sApiCoreV1Volume:
    return m.IoK8sApiCoreV1Volume(name=INITIALIZER_VOLUME, persistent_volume_claim=(
        m.IoK8sApiCoreV1PersistentVolumeClaimVolumeSource(claim_name=pvc_name)))


def _workspace_mount() -> m.IoK8sApiCoreV1VolumeMount:
    return m.IoK8sApiCoreV1VolumeMount(name=INITIALIZER_VOLUME, mount_path=WORKSPACE,
                                       sub_path_expr=f"$({WORKSPACE_SUBPATH_ENV})")


def _security_context() -> m.IoK8sApiCoreV1PodSecurityContext:
    # The image's non-root user (trainer_image/Dockerfile); fsGroup makes the shared volume writable. The model
    # initializer runs as the same user, so the files it writes into the run's workspace are the run's own.
    return m.IoK8sApiCoreV1PodSecurityContext(run_as_non_root=True, run_as_user=IMAGE_UID, run_as_group=IMAGE_UID,
                                              fs_group=IMAGE_UID)


def _node_job(image: str, pvc_name: str, model_initializer: bool = False) -> m.JobsetV1alpha2ReplicatedJob:
    env = [m.IoK8sApiCoreV1EnvVar(name="PYTHONUNBUFFERED", value="1")]
    mounts = [m.IoK8sApiCoreV1VolumeMount(name=SHM_VOLUME, mount_path=SHM_PATH),
              m.IoK8sApiCoreV1VolumeMount(name=SHARED_VOLUME, mount_path=SHARED_MOUNT)]
    volumes = _volumes(pvc_name, DEFAULT_SHM_SIZE)
    if model_initializer:
        env.append(m.IoK8sApiCoreV1EnvVar(name=WORKSPACE_SUBPATH_ENV, value=DEFAULT_WORKSPACE_SUBPATH))
        mounts.append(_workspace_mount())
        volumes.append(_initializer_volume(pvc_name))
    container = m.IoK8sApiCoreV1Container(
        name=NODE, image=image, image_pull_policy=DEFAULT_PULL_POLICY, command=[ENTRYPOINT], env=env,
        volume_mounts=mounts)
    # FT: exit codes 1-127 fail the Job with reason PodFailurePolicy (never restarted); the JobSet rule below
    # turns that into FailJobSet. Any other failure: the Job controller replaces that pod alone (same index, host
    # name and PET_NODE_RANK), up to backoffLimitPerIndex times per index; then the Job fails and JobSet restarts
    # the set.
    failure = m.IoK8sApiBatchV1PodFailurePolicy(rules=[m.IoK8sApiBatchV1PodFailurePolicyRule(
        action=FAIL_JOB, on_exit_codes=m.IoK8sApiBatchV1PodFailurePolicyOnExitCodesRequirement(
            container_name=NODE, operator="In", values=PERMANENT_EXIT_CODES))])
    pod = m.IoK8sApiCoreV1PodTemplateSpec(
        metadata=m.IoK8sApimachineryPkgApisMetaV1ObjectMeta(annotations=dict(POD_ANNOTATIONS),
                                                           labels={MANAGED_BY_LABEL: MANAGED_BY}),
        spec=m.IoK8sApiCoreV1PodSpec(
            restart_policy="Never",  # podFailurePolicy requires it; pods are replaced by the Job, then JobSet
            containers=[container], volumes=volumes, security_context=_security_context(),
            tolerations=_tolerations(())))
    return m.JobsetV1alpha2ReplicatedJob(
        name=NODE, replicas=1,
        depends_on=[m.JobsetV1alpha2DependsOn(name=MODEL_INITIALIZER, status="Complete")] if model_initializer
        else None,
        template=m.IoK8sApiBatchV1JobTemplateSpec(
            metadata=m.IoK8sApimachineryPkgApisMetaV1ObjectMeta(labels={ANCESTOR_LABEL: "trainer"}),
            spec=m.IoK8sApiBatchV1JobSpec(completion_mode=INDEXED, backoff_limit_per_index=NODE_REPLACEMENTS_PER_INDEX,
                                          max_failed_indexes=0, pod_failure_policy=failure, template=pod)))


def _model_initializer_job(pvc_name: str) -> m.JobsetV1alpha2ReplicatedJob:
    """Upstream's model initializer (``python -m pkg.initializers.model``: STORAGE_URI -> /workspace/model)."""
    container = m.IoK8sApiCoreV1Container(
        name=MODEL_INITIALIZER, image=MODEL_INITIALIZER_IMAGE, image_pull_policy=DEFAULT_PULL_POLICY,
        env=[m.IoK8sApiCoreV1EnvVar(name=WORKSPACE_SUBPATH_ENV, value=DEFAULT_WORKSPACE_SUBPATH),
             # huggingface_hub.login(ACCESS_TOKEN) stores the token under HF_HOME: writable for the non-root user
             m.IoK8sApiCoreV1EnvVar(name="HF_HOME", value="/tmp/huggingface")],
        resources=m.IoK8sApiCoreV1ResourceRequirements(requests={"cpu": _quantity("1"), "memory": _quantity("2Gi")}),
        volume_mounts=[_workspace_mount()])
    pod = m.IoK8sApiCoreV1PodTemplateSpec(
        metadata=m.IoK8sApimachineryPkgApisMetaV1ObjectMeta(annotations=dict(POD_ANNOTATIONS),
                                                           labels={MANAGED_BY_LABEL: MANAGED_BY}),
        spec=m.IoK8sApiCoreV1PodSpec(restart_policy="Never", containers=[container],
                                     volumes=[_initializer_volume(pvc_name)], security_context=_security_context()))
    return m.JobsetV1alpha2ReplicatedJob(
        name=MODEL_INITIALIZER, replicas=1,
        template=m.IoK8sApiBatchV1JobTemplateSpec(
            metadata=m.IoK8sApimachineryPkgApisMetaV1ObjectMeta(labels={ANCESTOR_LABEL: MODEL_INITIALIZER}),
            spec=m.IoK8sApiBatchV1JobSpec(backoff_limit=INITIALIZER_BACKOFF_LIMIT, template=pod)))


def build_runtime(image: str = RUNTIME_IMAGE, pvc_name: str = DEFAULTS.pvc_name, name: str | None = None,
                  model_initializer: bool = False) -> m.TrainerV1alpha1ClusterTrainingRuntime:
    """The ClusterTrainingRuntime of this trainer, with the model initializer or without (module docstring)."""
    rules = [m.JobsetV1alpha2FailurePolicyRule(name=PERMANENT_RULE, action=FAIL_JOBSET,
                                               on_job_failure_reasons=[POD_FAILURE_POLICY_REASON])]
    jobs = [_node_job(image, pvc_name, model_initializer)]
    if model_initializer:  # FT: a download that failed its Job's retries is permanent: no JobSet restart
        rules.insert(0, m.JobsetV1alpha2FailurePolicyRule(name=MODEL_DOWNLOAD_RULE, action=FAIL_JOBSET,
                                                          target_replicated_jobs=[MODEL_INITIALIZER]))
        jobs.insert(0, _model_initializer_job(pvc_name))
    jobset = m.JobsetV1alpha2JobSetSpec(
        replicated_jobs=jobs,
        ttl_seconds_after_finished=DEFAULT_TTL_AFTER_FINISHED_S,
        failure_policy=m.JobsetV1alpha2FailurePolicy(
            max_restarts=MAX_RESTARTS,  # backstop only: the launcher enforces each run's max_cluster_restarts
            rules=rules))
    name = name or (MODEL_RUNTIME_NAME if model_initializer else RUNTIME_NAME)
    return m.TrainerV1alpha1ClusterTrainingRuntime(
        api_version=API_VERSION, kind=RUNTIME_KIND,
        metadata=m.IoK8sApimachineryPkgApisMetaV1ObjectMeta(name=name, labels={FRAMEWORK_LABEL: "torch"}),
        spec=m.TrainerV1alpha1TrainingRuntimeSpec(
            ml_policy=m.TrainerV1alpha1MLPolicy(num_nodes=1, torch=m.TrainerV1alpha1TorchMLPolicySource()),
            template=m.TrainerV1alpha1JobSetTemplateSpec(spec=jobset)))


def unsupported_fields(spec: TrainJobSpec) -> list[str]:
    """`TrainJobSpec` settings a TrainJob cannot carry (the runtime fixes them); empty when none."""
    errors = []
    if spec.secret_env_from:
        errors.append("secret_env_from: TrainJob has no envFrom; pass secrets as env valueFrom in the runtime")
    if spec.priority_class:
        errors.append("priority_class: set priorityClassName in the ClusterTrainingRuntime instead")
    if spec.image_pull_policy != DEFAULT_PULL_POLICY:
        errors.append(f"image_pull_policy: the runtime fixes {DEFAULT_PULL_POLICY}; got {spec.image_pull_policy!r}")
    if not spec.pvc_name:
        errors.append("pvc_name: the runtime mounts the shared PVC; name it")
    if spec.mount_path != SHARED_MOUNT:
        errors.append(f"mount_path: the runtime mounts the shared PVC at {SHARED_MOUNT}; got {spec.mount_path!r}")
    if spec.credentials_secret and spec.model_initializer is None:
        errors.append("credentials_secret: a TrainJob hands credentials to its model initializer only; set "
                      "model_initializer")
    return errors


def _resources(spec: TrainJobSpec) -> m.IoK8sApiCoreV1ResourceRequirements:
    requests = {"cpu": spec.cpu_request, "memory": spec.memory_request}
    limits = {k: v for k, v in (("cpu", spec.cpu_limit), ("memory", spec.memory_limit)) if v is not None}
    if spec.gpus_per_node:
        limits[GPU_RESOURCE] = str(spec.gpus_per_node)
    return m.IoK8sApiCoreV1ResourceRequirements(
        requests={k: _quantity(v) for k, v in requests.items()},
        limits={k: _quantity(v) for k, v in limits.items()} or None)


def _runtime_patch(spec: TrainJobSpec) -> m.TrainerV1alpha1RuntimePatch:
    tolerations = _tolerations(spec.tolerations)  # always: the patch's list replaces the runtime's
    volumes = _volumes(str(spec.pvc_name), spec.shm_size)
    if spec.model_initializer is not None:  # the run's PVC behind /workspace too
        volumes.append(_initializer_volume(str(spec.pvc_name)))
    volumes.append(secret_volume(m, spec.name))
    # the node container's mounts: the runtime's, and the job's Secret (read-only: `components.lib.jobsecret`)
    mounts = [m.IoK8sApiCoreV1VolumeMount(name=SHM_VOLUME, mount_path=SHM_PATH),
              m.IoK8sApiCoreV1VolumeMount(name=SHARED_VOLUME, mount_path=SHARED_MOUNT), secret_mount(m)]
    if spec.model_initializer is not None:
        mounts.insert(2, _workspace_mount())
    pod = m.TrainerV1alpha1PodTemplatePatch(
        metadata=m.IoK8sApimachineryPkgApisMetaV1ObjectMeta(labels=_labels(spec)),
        spec=m.TrainerV1alpha1PodSpecPatch(
            containers=[m.TrainerV1alpha1ContainerPatch(name=NODE, volume_mounts=mounts)],
            volumes=volumes, node_selector=dict(spec.node_selector) or None,
            tolerations=tolerations, service_account_name=spec.service_account,
            image_pull_secrets=[m.IoK8sApiCoreV1LocalObjectReference(name=n) for n in spec.image_pull_secrets]
            or None))
    jobs = [m.TrainerV1alpha1ReplicatedJobPatch(
        name=NODE, template=m.TrainerV1alpha1JobTemplatePatch(spec=m.TrainerV1alpha1JobSpecPatch(template=pod)))]
    if spec.model_initializer is not None:
        # The initializer's pod: the same PVC; a CPU pod, so none of the training pods' GPU placement.
        init_pod = m.TrainerV1alpha1PodTemplatePatch(
            metadata=m.IoK8sApimachineryPkgApisMetaV1ObjectMeta(labels=_labels(spec)),
            spec=m.TrainerV1alpha1PodSpecPatch(volumes=[_initializer_volume(str(spec.pvc_name))],
                                               service_account_name=spec.service_account))
        jobs.insert(0, m.TrainerV1alpha1ReplicatedJobPatch(name=MODEL_INITIALIZER, template=(
            m.TrainerV1alpha1JobTemplatePatch(spec=m.TrainerV1alpha1JobSpecPatch(template=init_pod)))))
    return m.TrainerV1alpha1RuntimePatch(
        manager=PATCH_MANAGER, training_runtime_spec=m.TrainerV1alpha1TrainingRuntimeSpecPatch(
            template=m.TrainerV1alpha1JobSetTemplatePatch(
                spec=m.TrainerV1alpha1JobSetSpecPatch(replicated_jobs=jobs))))


def _tolerations(own: Sequence[Mapping[str, Any]]) -> list[m.IoK8sApiCoreV1Toleration]:
    """The training pods' tolerations: `own`, and the lost-node taints for NODE_LOST_TOLERATION_S
    (`components.lib.pytorchjob.pod_tolerations`)."""
    return [m.IoK8sApiCoreV1Toleration(key=t.get("key"), operator=t.get("operator"), value=t.get("value"),
                                       effect=t.get("effect"), toleration_seconds=t.get("tolerationSeconds"))
            for t in pod_tolerations(own)]


def _initializer(init: ModelInitializer, secret: str | None) -> m.TrainerV1alpha1Initializer:
    env = [m.IoK8sApiCoreV1EnvVar(name=WORKSPACE_SUBPATH_ENV, value=init.workspace_subpath)]
    scheme = next(s for s in MODEL_INITIALIZER_ENV if init.storage_uri.startswith(s))
    if secret:  # never a value in the manifest: optional references, an absent key is skipped
        env += [m.IoK8sApiCoreV1EnvVar(name=name, value_from=m.IoK8sApiCoreV1EnvVarSource(
            secret_key_ref=m.IoK8sApiCoreV1SecretKeySelector(name=secret, key=key, optional=True)))
            for key, name in MODEL_INITIALIZER_ENV[scheme].items()]
    return m.TrainerV1alpha1Initializer(model=m.TrainerV1alpha1ModelInitializer(storage_uri=init.storage_uri, env=env))


def _labels(spec: TrainJobSpec) -> dict[str, str]:
    return {**spec.labels, MANAGED_BY_LABEL: MANAGED_BY}


def build_trainjob(spec: TrainJobSpec, runtime: str | None = None) -> m.TrainerV1alpha1TrainJob:
    """The TrainJob for `spec` on ClusterTrainingRuntime `runtime` (default: ours, with the model initializer
    when `spec` has one); ValueError for settings it cannot carry."""
    errors = unsupported_fields(spec)
    if errors:
        raise ValueError(f"TrainJobSpec {spec.name!r} cannot run as a TrainJob:\n  - " + "\n  - ".join(errors))
    init = spec.model_initializer
    runtime = runtime or (MODEL_RUNTIME_NAME if init else RUNTIME_NAME)
    env = [m.IoK8sApiCoreV1EnvVar(name=FT_MAX_RESTARTS_ENV, value=str(spec.ft_max_restarts)),
           m.IoK8sApiCoreV1EnvVar(name=NODE_NAME_ENV, value_from=m.IoK8sApiCoreV1EnvVarSource(
               field_ref=m.IoK8sApiCoreV1ObjectFieldSelector(field_path="spec.nodeName"))),
           *peer_env(m)]
    if spec.spare_nodes or spec.elastic:  # the rendezvous's max: numNodes counts the spares too
        env.append(m.IoK8sApiCoreV1EnvVar(name=NODES_ENV, value=str(spec.nodes)))
    if spec.elastic:  # the rendezvous's min: entrypoint.sh runs the launcher with --nnodes MIN:MAX
        env.append(m.IoK8sApiCoreV1EnvVar(name=MIN_NODES_ENV, value=str(spec.min_nodes)))
    env += [m.IoK8sApiCoreV1EnvVar(name=k, value=v) for k, v in sorted(spec.env.items())]
    if init:
        env.append(m.IoK8sApiCoreV1EnvVar(name=WORKSPACE_SUBPATH_ENV, value=init.workspace_subpath))
    return m.TrainerV1alpha1TrainJob(
        api_version=API_VERSION, kind=KIND,
        metadata=m.IoK8sApimachineryPkgApisMetaV1ObjectMeta(
            name=spec.name, namespace=spec.namespace, labels=_labels(spec),
            annotations=dict(spec.annotations) or None),
        spec=m.TrainerV1alpha1TrainJobSpec(
            runtime_ref=m.TrainerV1alpha1RuntimeRef(api_group=GROUP, kind=RUNTIME_KIND, name=runtime),
            active_deadline_seconds=spec.active_deadline_seconds,
            initializer=_initializer(init, spec.credentials_secret) if init else None,
            trainer=m.TrainerV1alpha1Trainer(
                image=spec.image, args=list(spec.args), env=env, num_nodes=spec.nodes + spec.spare_nodes,
                num_proc_per_node=spec.nproc_per_node, resources_per_node=_resources(spec)),
            runtime_patches=[_runtime_patch(spec)]))


def to_manifest(obj: m.TrainerV1alpha1TrainJob | m.TrainerV1alpha1ClusterTrainingRuntime) -> dict[str, Any]:
    """The camelCase dict the API server takes (None fields dropped)."""
    return obj.to_dict()


def webhook_errors(manifest: Mapping[str, Any]) -> list[str]:
    """Violations of the Trainer v2.3 TrainJob admission rules we rely on; empty when valid."""
    errors: list[str] = []
    name = manifest.get("metadata", {}).get("name", "")
    if not is_dns1035(name):
        errors.append(f"metadata.name: Invalid value {name!r}: must be a DNS-1035 label")
    spec = manifest.get("spec") or {}
    if not (spec.get("runtimeRef") or {}).get("name"):
        errors.append("spec.runtimeRef.name: Required value: the ClusterTrainingRuntime to run on")
    trainer = spec.get("trainer") or {}
    reserved = sorted({e.get("name") for e in trainer.get("env") or []} & set(TORCH_RESERVED_ENV))
    if reserved:
        errors.append(f"spec.trainer.env: Invalid value: must not have reserved envs, invalid envs configured: "
                      f"{reserved}")
    runtime = (spec.get("runtimeRef") or {}).get("name")
    jobs_of_runtime = RUNTIME_JOBS.get(runtime, ())
    if ((spec.get("initializer") or {}).get("model")) and MODEL_INITIALIZER not in jobs_of_runtime:
        errors.append(f"spec.runtimeRef: Invalid value: must have {MODEL_INITIALIZER} job when trainJob is "
                      f"configured with input modelConfig (runtime {runtime!r}; use {MODEL_RUNTIME_NAME!r})")
    for patch in spec.get("runtimePatches") or []:
        jobs = ((((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {})
                .get("replicatedJobs") or [])
        for job in jobs:
            if job.get("name") not in jobs_of_runtime:
                errors.append(f"spec.runtimePatches: Invalid value: replicated job {job.get('name')!r} is not in "
                              f"runtime {runtime!r} (it has {list(jobs_of_runtime)})")
            for c in (((job.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec", {}).get(
                    "containers") or []:
                if c.get("env"):
                    errors.append(f"spec.runtimePatches: Invalid value: must not have envs for the container "
                                  f"{c.get('name')!r}")
    return errors


RUNTIME_JOBS = {RUNTIME_NAME: (NODE,), MODEL_RUNTIME_NAME: (MODEL_INITIALIZER, NODE)}
"""Replicated jobs of each runtime we ship."""


def node0_selector(name: str) -> str:
    """Label selector of the TrainJob's rank-0 pod (node 0 of replicated job ``node``)."""
    return (f"{JOBSET_NAME_LABEL}={name},{REPLICATED_JOB_LABEL}={NODE},{JOB_INDEX_LABEL}=0,"
            f"{COMPLETION_INDEX_LABEL}=0")


def runtime_yaml(image: str = RUNTIME_IMAGE, pvc_name: str = DEFAULTS.pvc_name, model_initializer: bool = False) -> str:
    """A shipped runtime file's text: deploy/cluster/trainjob-runtime/clustertrainingruntime.yaml, or
    clustertrainingruntime-model-initializer.yaml with `model_initializer`."""
    flag = " --model-initializer" if model_initializer else ""
    header = (f"# Generated by `python -m components.lib.trainjob{flag}` from components/lib/trainjob.py "
              "(build_runtime);\n# a test keeps it equal. Cluster-scoped: a cluster admin applies it once per "
              "cluster.\n")
    runtime = build_runtime(image, pvc_name, model_initializer=model_initializer)
    return header + yaml.safe_dump(to_manifest(runtime), sort_keys=False, default_flow_style=None)


_IMAGE = re.compile(r"^\S+$")


def main(argv: list[str] | None = None) -> int:
    """Print a ClusterTrainingRuntime: ``python -m components.lib.trainjob [--model-initializer] [IMAGE [PVC]]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    model_initializer = "--model-initializer" in args
    args = [a for a in args if a != "--model-initializer"]
    if len(args) > 2 or (args and (not _IMAGE.match(args[0]) or args[0].startswith("-"))):
        print("usage: python -m components.lib.trainjob [--model-initializer] [IMAGE [PVC_NAME]]", file=sys.stderr)
        return 2
    sys.stdout.write(runtime_yaml(*args, model_initializer=model_initializer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
