"""PyTorchJob manifests for the train step (Kubeflow training-operator v1.9, ``kubeflow.org/v1``).

`TrainJobSpec` describes one training job; `build_pytorchjob` turns it into the training SDK's model,
built only from ``kubeflow.training`` and ``kubernetes.client`` models; `to_manifest` serializes it to
the camelCase dict the API server takes; `webhook_errors` re-implements the training-operator's
validating-webhook rules we rely on, so a bad manifest fails before it is submitted.

Contract with the trainer image: the container runs `ENTRYPOINT` with the trainer CLI args; the
entrypoint reads the rendezvous env the operator injects (``PET_*``, ``MASTER_ADDR``/``MASTER_PORT``)
and runs ``ft_launcher`` with the in-job restart budget from env ``FT_MAX_RESTARTS``. Exit codes
1-127 are permanent and >= 128 retryable, which is what ``restartPolicy: ExitCode`` acts on.

A lost pod is replaced alone (training-operator v1.9, pkg/controller.v1/common/pod.go ``ReconcilePods``): a pod
that failed with a retryable code is deleted and, like any missing index, created again under the same name
``<job>-<master|worker>-<i>``, with the same ``PET_NODE_RANK``, while the other pods keep running. The rendezvous
env it gets (pkg/controller.v1/pytorch/envvar.go, master.go): ``PET_NNODES`` (Master + Workers),
``PET_NPROC_PER_NODE`` (``spec.nprocPerNode``), ``PET_NODE_RANK`` (Master 0, Worker i: i+1), ``MASTER_ADDR`` =
``PET_MASTER_ADDR`` = ``<job>-master-0``, ``MASTER_PORT`` = ``PET_MASTER_PORT`` = the container port
``pytorchjob-port`` (23456 by default), plus ``WORLD_SIZE``, ``RANK``, ``PYTHONUNBUFFERED``. ``<job>-master-0``
is both the Master pod's host name (so its launcher hosts the rendezvous store) and a headless Service the
operator keeps selecting index 0 of the Master (so it resolves to the replacement pod once that is ready). This
module adds ``FT_LOCAL_ADDR`` = the pod's name (downward API): the node's address in the rendezvous, the same for
every pod of an index, resolvable through that index's Service; ``TRAINER_REPLICA_ADDR`` = the pod's IP, where its
replica servers listen; and the job's Secret (``<job>-peer-secret``, made by the launcher once the job exists:
`components.lib.k8s_guard`) mounted read-only, named by ``TRAINER_JOB_SECRET_FILE`` (`components.lib.jobsecret`).

A pod whose node is lost: the node controller taints the node ``node.kubernetes.io/unreachable`` (or
``not-ready``) ``NoExecute``, and the pod is evicted (deleted) once its toleration of that taint runs out. Every
training pod tolerates those two taints for `NODE_LOST_TOLERATION_S` instead of the cluster's default 300 s (unless
the spec brings its own toleration for the key): `pod_tolerations`. The operator creates the replacement, under the
same name, only once the old pod object is gone: at once where the node's kubelet still answers, else when the node
object is deleted or tainted ``node.kubernetes.io/out-of-service`` (PodGC then force-deletes its terminating pods).

Elastic training (``min_nodes``): the job trains on with fewer nodes, down to ``min_nodes``, when a node is lost and
neither a spare nor the replacement joins in time. The entrypoint runs the launcher with ``--nnodes MIN:MAX`` from
``TRAINER_MIN_NODES`` and ``TRAINER_NODES`` (pods beyond MAX wait as spares), both set in the container env. The
PyTorchJob also carries ``spec.elasticPolicy`` (c10d, ``minReplicas``/``maxReplicas`` = min_nodes/nodes), so the
operator's env agrees: it sets ``PET_NNODES`` = "min:max" instead of the replica count, ``PET_RDZV_BACKEND``, and
``PET_RDZV_ENDPOINT`` = rdzvHost:rdzvPort (pkg/controller.v1/pytorch/elastic.go, envvar.go). rdzvHost is
``<job>-master-0`` and rdzvPort `PYTORCHJOB_PORT` because the operator would otherwise name ``<job>-worker-0``,
while our rendezvous is hosted by the Master (``MASTER_ADDR``). maxRestarts stays unset (no ``PET_MAX_RESTARTS``):
the in-job restart budget is ``FT_MAX_RESTARTS``. nProcPerNode stays out of the policy: the webhook forbids it
together with ``spec.nprocPerNode``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubeflow.training import (
    KubeflowOrgV1ElasticPolicy,
    KubeflowOrgV1PyTorchJob,
    KubeflowOrgV1PyTorchJobSpec,
    KubeflowOrgV1ReplicaSpec,
    KubeflowOrgV1RunPolicy,
    constants,
)
from kubernetes import client as k8s

from components.lib.credentials import TRAINER_ENV
from components.lib.jobsecret import REPLICA_ADDR_ENV, SECRET_FILE_ENV, peer_env, secret_mount, secret_volume

ENTRYPOINT = "/opt/app/trainer_image/entrypoint.sh"
IMAGE_UID = 1000  # the non-root user trainer_image/Dockerfile creates and runs as
CONTAINER_NAME = "pytorch"  # the training-operator webhook requires this container name
MASTER = "Master"
WORKER = "Worker"
REPLICA_TYPES = (MASTER, WORKER)
RESTART_POLICY = "ExitCode"  # restart pods that exit >= 128, fail the job on 1-127
# "Running": when the job finishes, pods still running (workers left behind by a finished or failed
# master, stragglers) are deleted at once and free their GPUs; completed and failed pods stay for
# `kubectl logs` post-mortems until ttlSecondsAfterFinished. "All" would lose the failed pods' logs;
# "None" would leave hung workers holding GPUs after the job has finished.
CLEAN_POD_POLICY = "Running"
GPU_RESOURCE = "nvidia.com/gpu"
FT_MAX_RESTARTS_ENV = "FT_MAX_RESTARTS"
NODE_NAME_ENV = "NODE_NAME"
"""The training pods' node name (downward API), which the trainer's host-naming lines read."""
NODES_ENV = "TRAINER_NODES"
"""entrypoint.sh: the nodes that train (the rendezvous's max); the job's other pods (``spare_nodes``) wait as spares."""
MIN_NODES_ENV = "TRAINER_MIN_NODES"
"""entrypoint.sh: the fewest nodes that train on (the rendezvous's min); set with `NODES_ENV` when elastic."""
PYTORCHJOB_PORT = 23456
"""training-operator v1.9's default master port: the container port ``pytorchjob-port`` (``MASTER_PORT``)."""
RDZV_BACKEND = "c10d"
LOCAL_ADDR_ENV = "FT_LOCAL_ADDR"
"""entrypoint.sh: this node's address in the rendezvous (a fresh round numbers nodes in the order of these)."""
NODE_LOST_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
"""The NoExecute taints the node controller puts on a node that stopped reporting (unreachable) or reports itself
not ready; a pod that does not tolerate them is evicted at once, the cluster default is 300 s."""
NODE_LOST_TOLERATION_S = 60
"""How long a training pod stays bound to a lost node before it is evicted and replaced (the others wait for it)."""
SHM_VOLUME = "dshm"
SHM_PATH = "/dev/shm"
SHARED_VOLUME = "shared"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "resilient-train-launcher"
# Kubeflow namespaces often have Istio injection on; a sidecar keeps a finished pod running forever.
POD_ANNOTATIONS = {"sidecar.istio.io/inject": "false"}

MAX_JOB_NAME_LEN = 40  # leaves room for pod/service names "<job>-worker-123" (<= 63 chars)
JOB_NAME_HASH_LEN = 10
DNS1035_MAX_LEN = 63
DNS1123_SUBDOMAIN_MAX_LEN = 253
DEFAULT_ACTIVE_DEADLINE_S = 7 * 24 * 3600
DEFAULT_TTL_AFTER_FINISHED_S = 24 * 3600

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
# Set by the training-operator (rendezvous) or by this module; a user value would be overwritten.
RESERVED_ENV = frozenset(
    {FT_MAX_RESTARTS_ENV, NODE_NAME_ENV, LOCAL_ADDR_ENV, NODES_ENV, MIN_NODES_ENV, "MASTER_ADDR", "MASTER_PORT",
     "WORLD_SIZE", "RANK", "PYTHONUNBUFFERED", SECRET_FILE_ENV, REPLICA_ADDR_ENV}
)
RESERVED_ENV_PREFIX = "PET_"
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}


def is_dns1035(name: str) -> bool:
    """Whether `name` is a DNS-1035 label (what the webhook requires of a job name)."""
    return len(name) <= DNS1035_MAX_LEN and _DNS1035.match(name) is not None


def _slug(text: str) -> str:
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]", "-", text.lower())).strip("-")


def job_name(run_id: str, step: str) -> str:
    """Deterministic DNS-1035 job name for (run_id, step): readable prefix + hash of both.

    The same pipeline run and step always get the same name (a retry attaches to its job); distinct
    runs differ in the hash even when the readable part is truncated to the same text.
    """
    if not run_id or not step:
        raise ValueError(f"job_name needs a non-empty run_id and step; got run_id={run_id!r}, step={step!r}")
    digest = hashlib.sha256(f"{run_id}\0{step}".encode()).hexdigest()[:JOB_NAME_HASH_LEN]
    prefix = "-".join(p for p in (_slug(step), _slug(run_id)) if p)
    if not prefix[:1].isalpha():
        prefix = f"job-{prefix}"
    prefix = prefix[: MAX_JOB_NAME_LEN - JOB_NAME_HASH_LEN - 1].rstrip("-")
    return f"{prefix}-{digest}"


@dataclass(frozen=True)
class ModelInitializer:
    """A TrainJob's model initializer (Kubeflow Trainer v2): downloads the base model before training starts."""

    storage_uri: str
    """hf://ORG/NAME or s3://BUCKET/PREFIX; the initializer writes the model to /workspace/model."""
    workspace_subpath: str
    """Directory on the shared PVC mounted at /workspace in the initializer and the training pods (relative to
    the PVC's root, e.g. ``resilient-train/<run id>/workspace``): each run downloads into its own."""


@dataclass(frozen=True)
class TrainJobSpec:
    """One training PyTorchJob. Invalid values raise `ValueError` naming the field to change."""

    name: str
    """Job name: DNS-1035, <= MAX_JOB_NAME_LEN; use `job_name(run_id, step)`."""
    image: str
    """Trainer image holding the project at /opt/app."""
    args: Sequence[str] = ()
    """Trainer CLI args, e.g. ("--config", ".../1b.toml", "--train.steps=1000")."""
    namespace: str = "default"
    nodes: int = 1
    """Pods that train: one Master plus nodes-1 Workers."""
    spare_nodes: int = 0
    """More Workers that wait in the rendezvous as spares (``TRAINER_NODES`` = nodes): one takes a lost node's place
    without waiting for a pod to be scheduled; a lost pod's replacement becomes a spare in turn."""
    min_nodes: int = 0
    """Fewest nodes that train on when a node is lost with no spare and no replacement within the entrypoint's
    ``TRAINER_NODE_WAIT_S`` (``TRAINER_MIN_NODES``); 0 or ``nodes``: not elastic (the default)."""
    nproc_per_node: int = 1
    """Ranks per pod; equals gpus_per_node when GPUs are used."""
    gpus_per_node: int = 0
    """nvidia.com/gpu limit per pod; 0 trains on CPU."""
    cpu_request: str = "1"
    cpu_limit: str | None = None
    memory_request: str = "4Gi"
    memory_limit: str | None = None
    shm_size: str = "1Gi"
    """Size of the memory-backed /dev/shm (counts against the pod's memory)."""
    pvc_name: str | None = None
    """PersistentVolumeClaim with data and checkpoints, shared by all pods; None mounts nothing."""
    mount_path: str = "/mnt/shared"
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Mapping[str, Any]] = ()
    """Kubernetes tolerations, camelCase keys: key, operator, value, effect, tolerationSeconds."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Plain env vars; never secrets (use secret_env_from)."""
    secret_env_from: Sequence[str] = ()
    """Names of Secrets whose keys become env vars (envFrom); values never appear in the spec."""
    service_account: str | None = None
    image_pull_secrets: Sequence[str] = ()
    """Secrets (docker-registry) the pods pull the image with, for a private registry."""
    image_pull_policy: str = "IfNotPresent"
    active_deadline_seconds: int = DEFAULT_ACTIVE_DEADLINE_S
    """Always set: ExitCode restarts ignore backoffLimit, so this bounds a crash-looping job."""
    backoff_limit: int = 3
    """Applies to OnFailure-style restarts only; ExitCode restarts are bounded by the launcher."""
    ttl_seconds_after_finished: int = DEFAULT_TTL_AFTER_FINISHED_S
    ft_max_restarts: int = 3
    """In-job restart budget of ft_launcher (env FT_MAX_RESTARTS)."""
    max_cluster_restarts: int = 3
    """Pod restarts the launcher tolerates (ExitCode >= 128) before it deletes the job; not in the manifest."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Job and pod labels, e.g. {"kueue.x-k8s.io/queue-name": "team-a"}."""
    annotations: Mapping[str, str] = field(default_factory=dict)
    priority_class: str | None = None
    credentials_secret: str | None = None
    """Secret holding the credentials (``components.lib.credentials``) of whatever downloads the base model: the
    training containers (PyTorchJob: optional ``secretKeyRef`` env, ``TRAINER_ENV``) or the model initializer
    (TrainJob). Keys it lacks, or a Secret that does not exist, are skipped."""
    model_initializer: ModelInitializer | None = None
    """TrainJob only: download the base model with Kubeflow Trainer's model initializer before training."""

    def __post_init__(self) -> None:
        errors = _spec_errors(self)
        if errors:
            raise ValueError(f"invalid TrainJobSpec {self.name!r}:\n  - " + "\n  - ".join(errors))

    @property
    def elastic(self) -> bool:
        """Whether the job trains on with fewer nodes (down to min_nodes) when one is lost: 0 < min_nodes < nodes."""
        return 0 < self.min_nodes < self.nodes


def _spec_errors(s: TrainJobSpec) -> list[str]:
    errors: list[str] = []
    if not is_dns1035(s.name) or len(s.name) > MAX_JOB_NAME_LEN:
        errors.append(
            f"name must be a DNS-1035 label (lowercase letters, digits, '-', starting with a letter) of at most "
            f"{MAX_JOB_NAME_LEN} chars; got {s.name!r}: use job_name(run_id, step)"
        )
    if not is_dns1035(s.namespace):
        errors.append(f"namespace must be a DNS label; got {s.namespace!r}")
    if not s.image.strip():
        errors.append("image must name the trainer image; got an empty string")
    if isinstance(s.args, str):
        errors.append(f"args must be a list of CLI arguments, not one string; got {s.args!r}")
    for fname, low in (("nodes", 1), ("spare_nodes", 0), ("nproc_per_node", 1), ("gpus_per_node", 0),
                       ("backoff_limit", 0), ("active_deadline_seconds", 1), ("ttl_seconds_after_finished", 0),
                       ("ft_max_restarts", 0), ("max_cluster_restarts", 0)):
        value = getattr(s, fname)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            errors.append(f"{fname} must be an integer >= {low}; got {value!r}")
    if not isinstance(s.min_nodes, int) or isinstance(s.min_nodes, bool) or s.min_nodes < 0 \
            or (isinstance(s.nodes, int) and s.min_nodes > s.nodes):
        errors.append(f"min_nodes must be an integer from 0 to nodes ({s.nodes!r}): the fewest nodes that train on, "
                      f"0 to turn elastic training off; got {s.min_nodes!r}")
    if isinstance(s.gpus_per_node, int) and s.gpus_per_node > 0 and s.nproc_per_node != s.gpus_per_node:
        errors.append(
            f"nproc_per_node must equal gpus_per_node (one rank per GPU); got {s.nproc_per_node} and {s.gpus_per_node}"
        )
    for fname in ("cpu_request", "cpu_limit", "memory_request", "memory_limit", "shm_size"):
        value = getattr(s, fname)
        if value is not None and not _QUANTITY.match(str(value)):
            errors.append(f"{fname} must be a Kubernetes quantity like '500m', '4', '16Gi'; got {value!r}")
    if s.pvc_name is not None and not _is_subdomain(s.pvc_name):
        errors.append(f"pvc_name must be a DNS-1123 name of an existing PVC; got {s.pvc_name!r}")
    if not s.mount_path.startswith("/") or s.mount_path in ("/", SHM_PATH):
        errors.append(f"mount_path must be an absolute path other than / and {SHM_PATH}; got {s.mount_path!r}")
    for env_name in s.env:
        if not _ENV_NAME.match(env_name):
            errors.append(f"env name {env_name!r} is not a valid variable name")
        elif env_name in RESERVED_ENV or env_name.startswith(RESERVED_ENV_PREFIX):
            errors.append(f"env {env_name!r} is set by the operator or this module; remove it "
                          f"(use ft_max_restarts for {FT_MAX_RESTARTS_ENV})")
    for field_name in ("secret_env_from", "image_pull_secrets"):
        values = getattr(s, field_name)
        if isinstance(values, str) or not all(isinstance(v, str) and _is_subdomain(v) for v in values):
            errors.append(f"{field_name} must be a list of Secret names; got {values!r}")
    if s.credentials_secret is not None and not _is_subdomain(s.credentials_secret):
        errors.append(f"credentials_secret must be a Secret name; got {s.credentials_secret!r}")
    init = s.model_initializer
    if init is not None and (not init.storage_uri.startswith(("hf://", "s3://")) or
                             not init.workspace_subpath or init.workspace_subpath.startswith("/")
                             or ".." in init.workspace_subpath.split("/")):
        errors.append(f"model_initializer needs an hf:// or s3:// storage_uri and a workspace_subpath relative to "
                      f"the PVC's root; got {init!r}")
    for name in (s.service_account, s.priority_class):
        if name is not None and not _is_subdomain(name):
            errors.append(f"service_account and priority_class must be DNS-1123 names; got {name!r}")
    if s.image_pull_policy not in PULL_POLICIES:
        errors.append(f"image_pull_policy must be one of {PULL_POLICIES}; got {s.image_pull_policy!r}")
    for tol in s.tolerations:
        unknown = set(tol) - TOLERATION_KEYS
        if unknown:
            errors.append(f"toleration keys must be among {sorted(TOLERATION_KEYS)}; got unknown {sorted(unknown)}")
    for key, value in {**s.labels, **s.node_selector}.items():
        if not _is_label_key(key) or not isinstance(value, str) or len(value) > DNS1035_MAX_LEN \
                or not _LABEL_VALUE.match(value):
            errors.append(f"labels/node_selector entry {key!r}: {value!r} is not a valid Kubernetes label")
    return errors


def _is_subdomain(name: str) -> bool:
    return len(name) <= DNS1123_SUBDOMAIN_MAX_LEN and _DNS1123_SUBDOMAIN.match(name) is not None


def _is_label_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    return (not prefix or _is_subdomain(prefix)) and len(name) <= DNS1035_MAX_LEN and bool(_LABEL_NAME.match(name))


def _tolerates(toleration: Mapping[str, Any], key: str) -> bool:
    """Whether `toleration` already covers the NoExecute taint `key` (its key, or every key with Exists)."""
    same_key = toleration.get("key") == key or (not toleration.get("key") and toleration.get("operator") == "Exists")
    return same_key and toleration.get("effect") in (None, "", "NoExecute")


def pod_tolerations(tolerations: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The training pods' tolerations (camelCase): the spec's, then, for each of `NODE_LOST_TAINTS` the spec does
    not tolerate itself, ``Exists``/``NoExecute`` for `NODE_LOST_TOLERATION_S`: a lost node's pod is evicted and
    replaced after about a minute instead of the cluster's default five."""
    own = [dict(t) for t in tolerations]
    return own + [{"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": NODE_LOST_TOLERATION_S}
                  for key in NODE_LOST_TAINTS if not any(_tolerates(t, key) for t in own)]


def _container(spec: TrainJobSpec) -> k8s.V1Container:
    requests = {"cpu": spec.cpu_request, "memory": spec.memory_request}
    limits = {k: v for k, v in (("cpu", spec.cpu_limit), ("memory", spec.memory_limit)) if v is not None}
    if spec.gpus_per_node:
        limits[GPU_RESOURCE] = str(spec.gpus_per_node)
    env = [k8s.V1EnvVar(name=FT_MAX_RESTARTS_ENV, value=str(spec.ft_max_restarts)),
           k8s.V1EnvVar(name="PYTHONUNBUFFERED", value="1"),  # training logs reach the step log promptly
           # the node, for the lines that name a host (a straggler eviction): the pod's hostname is not the node's
           k8s.V1EnvVar(name=NODE_NAME_ENV, value_from=k8s.V1EnvVarSource(
               field_ref=k8s.V1ObjectFieldSelector(field_path="spec.nodeName"))),
           # the rendezvous address: the pod's name <job>-<type>-<i>, the same in a replacement pod, and the name of
           # the headless Service the operator makes for that index (other pods resolve it)
           k8s.V1EnvVar(name=LOCAL_ADDR_ENV, value_from=k8s.V1EnvVarSource(
               field_ref=k8s.V1ObjectFieldSelector(field_path="metadata.name"))),
           *peer_env(k8s)]
    if spec.spare_nodes or spec.elastic:  # the rendezvous's max: the operator counts every pod in PET_NNODES
        env.append(k8s.V1EnvVar(name=NODES_ENV, value=str(spec.nodes)))
    if spec.elastic:  # the rendezvous's min: entrypoint.sh runs the launcher with --nnodes MIN:MAX
        env.append(k8s.V1EnvVar(name=MIN_NODES_ENV, value=str(spec.min_nodes)))
    env += [k8s.V1EnvVar(name=k, value=v) for k, v in sorted(spec.env.items())]
    if spec.credentials_secret:  # for the base model's download (trainer model.from_hf=hf://..., s3://...)
        env += [k8s.V1EnvVar(name=name, value_from=k8s.V1EnvVarSource(secret_key_ref=k8s.V1SecretKeySelector(
            name=spec.credentials_secret, key=key, optional=True))) for key, name in TRAINER_ENV.items()]
    mounts = [k8s.V1VolumeMount(name=SHM_VOLUME, mount_path=SHM_PATH),
              secret_mount(k8s)]
    if spec.pvc_name:
        mounts.append(k8s.V1VolumeMount(name=SHARED_VOLUME, mount_path=spec.mount_path))
    return k8s.V1Container(
        name=CONTAINER_NAME,
        image=spec.image,
        image_pull_policy=spec.image_pull_policy,
        command=[ENTRYPOINT],
        args=list(spec.args),
        env=env,
        env_from=[k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=s)) for s in spec.secret_env_from]
        or None,
        resources=k8s.V1ResourceRequirements(requests=requests, limits=limits or None),
        volume_mounts=mounts,
    )


def _pod_template(spec: TrainJobSpec) -> k8s.V1PodTemplateSpec:
    volumes = [k8s.V1Volume(name=SHM_VOLUME, empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory",
                                                                                size_limit=spec.shm_size)),
               secret_volume(k8s, spec.name)]
    if spec.pvc_name:
        volumes.append(k8s.V1Volume(
            name=SHARED_VOLUME,
            persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(claim_name=spec.pvc_name)))
    tolerations = [
        k8s.V1Toleration(key=t.get("key"), operator=t.get("operator"), value=t.get("value"), effect=t.get("effect"),
                         toleration_seconds=t.get("tolerationSeconds"))
        for t in pod_tolerations(spec.tolerations)
    ]
    return k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(labels=_labels(spec), annotations=dict(POD_ANNOTATIONS)),
        spec=k8s.V1PodSpec(
            containers=[_container(spec)],
            volumes=volumes,
            node_selector=dict(spec.node_selector) or None,
            tolerations=tolerations,
            service_account_name=spec.service_account,
            image_pull_secrets=[k8s.V1LocalObjectReference(name=n) for n in spec.image_pull_secrets] or None,
            priority_class_name=spec.priority_class,
            # The image runs as this non-root user (trainer_image/Dockerfile); fsGroup makes the shared volume
            # writable for it.
            security_context=k8s.V1PodSecurityContext(
                run_as_non_root=True, run_as_user=IMAGE_UID, run_as_group=IMAGE_UID, fs_group=IMAGE_UID
            ),
        ),
    )


def _labels(spec: TrainJobSpec) -> dict[str, str]:
    return {**spec.labels, MANAGED_BY_LABEL: MANAGED_BY}


def master_host(name: str) -> str:
    """The Master pod's host name and headless Service, ``<job>-master-0``: the rendezvous host (MASTER_ADDR)."""
    return f"{name}-{MASTER.lower()}-0"


def _elastic_policy(spec: TrainJobSpec) -> KubeflowOrgV1ElasticPolicy | None:
    """`spec.elasticPolicy` when elastic (module docstring): no nProcPerNode, no maxRestarts."""
    if not spec.elastic:
        return None
    return KubeflowOrgV1ElasticPolicy(rdzv_backend=RDZV_BACKEND, min_replicas=spec.min_nodes, max_replicas=spec.nodes,
                                      rdzv_host=master_host(spec.name), rdzv_port=PYTORCHJOB_PORT)


def build_pytorchjob(spec: TrainJobSpec) -> KubeflowOrgV1PyTorchJob:
    """The PyTorchJob for `spec`: one Master, nodes-1+spare_nodes Workers, restartPolicy ExitCode on each, and an
    elasticPolicy when `spec.elastic`."""
    if spec.model_initializer is not None:
        raise ValueError(f"TrainJobSpec {spec.name!r}: a PyTorchJob has no model initializer; pass the base model's "
                         "URI to the trainer (model.from_hf) and credentials_secret for its download")
    replicas = {MASTER: KubeflowOrgV1ReplicaSpec(replicas=1, restart_policy=RESTART_POLICY,
                                                 template=_pod_template(spec))}
    if spec.nodes + spec.spare_nodes > 1:
        replicas[WORKER] = KubeflowOrgV1ReplicaSpec(replicas=spec.nodes + spec.spare_nodes - 1,
                                                    restart_policy=RESTART_POLICY,
                                                    template=_pod_template(spec))
    return KubeflowOrgV1PyTorchJob(
        api_version=constants.API_VERSION,
        kind=constants.PYTORCHJOB_KIND,
        metadata=k8s.V1ObjectMeta(name=spec.name, namespace=spec.namespace, labels=_labels(spec),
                                  annotations=dict(spec.annotations) or None),
        spec=KubeflowOrgV1PyTorchJobSpec(
            nproc_per_node=str(spec.nproc_per_node),  # here only, never also in elasticPolicy (webhook)
            elastic_policy=_elastic_policy(spec),
            pytorch_replica_specs=replicas,
            run_policy=KubeflowOrgV1RunPolicy(
                backoff_limit=spec.backoff_limit,
                active_deadline_seconds=spec.active_deadline_seconds,
                ttl_seconds_after_finished=spec.ttl_seconds_after_finished,
                clean_pod_policy=CLEAN_POD_POLICY,
            ),
        ),
    )


def to_manifest(job: KubeflowOrgV1PyTorchJob) -> dict[str, Any]:
    """The camelCase dict the API server takes (None fields dropped)."""
    return k8s.ApiClient().sanitize_for_serialization(job)


def webhook_errors(manifest: Mapping[str, Any]) -> list[str]:
    """Violations of the training-operator v1.9 PyTorchJob validating-webhook rules; empty when valid."""
    errors: list[str] = []
    name = manifest.get("metadata", {}).get("name", "")
    if not is_dns1035(name):
        errors.append(f"metadata.name: Invalid value {name!r}: must be a DNS-1035 label "
                      "(lowercase alphanumerics and '-', starting with a letter, at most 63 chars)")
    spec = manifest.get("spec", {})
    elastic = spec.get("elasticPolicy")
    if elastic is not None and WORKER not in (spec.get("pytorchReplicaSpecs") or {}):
        errors.append(f"spec.pytorchReplicaSpecs[{WORKER}]: Required value: must be configured if elastic policy "
                      "is used")
    elastic_nproc = (elastic or {}).get("nProcPerNode")
    if elastic_nproc is not None and spec.get("nprocPerNode") is not None:
        errors.append("spec.elasticPolicy.nProcPerNode: Forbidden: must not be used with spec.nprocPerNode")
    low, high = (elastic or {}).get("minReplicas"), (elastic or {}).get("maxReplicas")
    # ours, not the webhook's (v1.9 does not compare them): torchrun refuses --nnodes MIN:MAX with MIN > MAX
    if isinstance(low, int) and isinstance(high, int) and low > high:
        errors.append(f"spec.elasticPolicy.minReplicas: Invalid value {low!r}: must not exceed maxReplicas ({high!r})")
    replica_specs = spec.get("pytorchReplicaSpecs")
    if not replica_specs:
        return errors + ["spec.pytorchReplicaSpecs: Required value: must be required"]
    if MASTER not in replica_specs:
        errors.append(f"spec.pytorchReplicaSpecs[{MASTER}]: Required value: exactly one {MASTER} is needed")
    for rtype, rspec in replica_specs.items():
        path = f"spec.pytorchReplicaSpecs[{rtype}]"
        if rtype not in REPLICA_TYPES:
            errors.append(f"{path}: Unsupported value {rtype!r}: supported values: {', '.join(REPLICA_TYPES)}")
        containers = (((rspec or {}).get("template") or {}).get("spec") or {}).get("containers") or []
        if not containers:
            errors.append(f"{path}.template.spec.containers: Required value: must be specified")
        for idx, container in enumerate(containers):
            if not container.get("image"):
                errors.append(f"{path}.template.spec.containers[{idx}].image: Required value: must be required")
        if containers and not any(c.get("name") == CONTAINER_NAME for c in containers):
            errors.append(f"{path}.template.spec.containers: Required value: a container named {CONTAINER_NAME!r}")
        count = (rspec or {}).get("replicas")
        if rtype == MASTER and count != 1:
            errors.append(f"{path}.replicas: Forbidden: must be 1; got {count!r}")
        elif rtype != MASTER and count is not None and count < 1:
            errors.append(f"{path}.replicas: Forbidden: must be at least 1; got {count!r}")
    return errors
