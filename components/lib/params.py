"""The training pipeline's parameters: defaults, allowed ranges, and one validation that says what to change.

The pipeline's first step (``validate_params``) and the CLI/demo (before submitting) call
`PipelineParams.validate`, so a bad run fails in seconds with every problem listed, before data prep or a
PyTorchJob costs anything. The pipeline signature (``pipelines/training_pipeline.py``) uses the same
defaults (`DEFAULTS`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import urlparse

from components.lib.storage import redact_uri

BACKENDS = ("pytorchjob", "trainjob", "local")
CLUSTER_BACKENDS = ("pytorchjob", "trainjob")
FLAVOURS = ("tiny", "1b", "8b")
FAULT_KINDS = ("exception", "hang", "hang_gil", "sigkill", "oom", "sigterm", "corrupt_checkpoint", "slow", "node_lost",
               "data_error")
INIT_FROM_PROMOTED = "promoted"
#: Where the pipeline mounts the shared PVC in step pods, and the PyTorchJob in its pods.
SHARED_MOUNT = "/mnt/shared"
#: The components' ``base_image``. The pipeline overrides it on every step with its ``image`` parameter, whose
#: default is the image given to ``python -m pipelines.compile --image`` (there is no built-in default image).
DEFAULT_IMAGE = "ghcr.io/resilient-train/resilient-train:0.1.0"
#: What data prep can read: local paths and these URI schemes (``components.lib.tokendata``; hf:// only as
#: hf://datasets/<org>/<name>[/path]).
CORPUS_SCHEMES = ("file", "s3", "gs", "gcs", "hf")
#: What the trainer's ``model.from_hf`` (and a TrainJob's model initializer) downloads; else a local directory.
BASE_MODEL_SCHEMES = ("hf", "s3")
#: Default ``corpus_secret``: data prep mounts this Secret if it exists (optional); see `PipelineParams.corpus_secret`.
DEFAULT_CORPUS_SECRET = "train-data-credentials"
#: Trainer keys the pipeline sets itself; overriding them would break resume and the report.
RESERVED_OVERRIDES = ("train.run_dir", "checkpoint.dir", "data.path", "train.steps", "checkpoint.interval",
                      "checkpoint.init_from", "resiliency.faults", "resiliency.inprocess", "train.device",
                      "model.from_hf")
TOLERATION_KEYS = ("key", "operator", "value", "effect", "tolerationSeconds")

MAX_STEPS = 10_000_000
MAX_NODES = 256
MAX_GPUS_PER_NODE = 16
MAX_PROCS_PER_NODE = 64
MAX_RESTARTS = 100
MAX_VOCAB = 1 << 20
MAX_DEADLINE_HOURS = 24 * 30

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_OVERRIDE = re.compile(r"^--([a-z_]+)\.([a-z_0-9]+)=(.*)$", re.S)
_FAULT = re.compile(r"^(\d+):(\d+):([a-z_]+)(?::(\d+(?:\.\d+)?|\.\d+))?$")  # slow: rank:step:slow:<factor>
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")
_URI_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# hf://ORG/NAME (a model repo, as huggingface_hub's repo ids); hf://datasets/... and hf://spaces/... are not models.
_HF_MODEL = re.compile(r"^hf://(?!datasets/|spaces/)[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_S3_URI = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$")
MAX_TEXT_FIELD_LEN = 256
# An OCI image reference (distribution/reference grammar): [registry[:port]/]path[:tag][@digest].
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*(?::[0-9]+)?/)?"
_IMAGE_REF = re.compile(rf"^{_DOMAIN}{_COMPONENT}(?:/{_COMPONENT})*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?"
                        r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$")
MAX_IMAGE_REF_LEN = 255 + 1 + 128 + 1 + 71  # name, ':' tag, '@sha256:' digest


class ParamError(ValueError):
    """One or more pipeline parameters are invalid; the message lists each with what to change."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("invalid pipeline parameters:\n  - " + "\n  - ".join(errors))


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: ``rank:step:kind`` or ``rank:step:slow:<factor>`` (the trainer's ``resiliency.faults``
    item)."""

    rank: int
    step: int
    kind: str
    factor: str = ""

    def __str__(self) -> str:
        return f"{self.rank}:{self.step}:{self.kind}" + (f":{self.factor}" if self.factor else "")


def parse_faults(spec: str) -> list[Fault]:
    """Parse ``"0:20:exception,1:40:sigkill"``; ValueError naming the bad item."""
    faults = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        m = _FAULT.match(item)
        slow = bool(m) and m.group(3) == "slow"
        if not m or m.group(3) not in FAULT_KINDS or slow != bool(m.group(4)) or (slow and not 0 < float(m.group(4)) <= 10):
            raise ValueError(
                f"fault {item!r} must look like rank:step:kind with kind one of {list(FAULT_KINDS)}, "
                "e.g. '0:20:exception,1:40:sigkill' (slow takes a factor in (0, 10]: '1:20:slow:0.5')"
            )
        faults.append(Fault(int(m.group(1)), int(m.group(2)), m.group(3), m.group(4) or ""))
    return faults


@dataclass(frozen=True)
class PipelineParams:
    """Every user-facing parameter of the training pipeline, with its default."""

    model: str = "tiny"
    """Model flavour (tiny, 1b, 8b) or a trainer TOML file path inside the image."""
    steps: int = 400
    """Total optimizer steps; a retried or resumed run continues up to this step."""
    checkpoint_interval: int = 50
    """Save a checkpoint every N steps (and at the end); must be < steps."""
    nodes: int = 1
    """Training pods (PyTorchJob Master + Workers); the local backend runs one entrypoint per node on this machine."""
    spare_nodes: int = 0
    """Pods beyond ``nodes`` that wait in the rendezvous as spares: one takes a lost node's place at once, without
    waiting for a pod to be scheduled (its ranks restore from the peer tier); a lost pod's replacement becomes one."""
    min_nodes: int = 0
    """Elastic (opt-in): the fewest nodes that train on when a node is lost and neither a spare nor a replacement pod
    joins within TRAINER_NODE_WAIT_S; the job grows back when one does. The global batch stays the full size's (the
    ranks left accumulate the missing micro-batches), so every size from min_nodes to nodes must divide it. 0 (or
    nodes): the job waits for the lost node."""
    gpus_per_node: int = 0
    """GPUs (= ranks) per node; 0 trains on CPU with procs_per_node ranks (gloo)."""
    procs_per_node: int = 2
    """Ranks per node when gpus_per_node is 0."""
    seq_len: int = 0
    """Tokens per sample; 0 keeps the flavour's value."""
    batch_size: int = 0
    """Micro-batch per rank; 0 keeps the flavour's value."""
    faults: str = ""
    """Fault injection, comma-separated rank:step:kind (exception, hang, hang_gil, sigkill, oom, sigterm,
    corrupt_checkpoint); empty = none."""
    inprocess_restart: bool = True
    """Wrap training in NVRx in-process restart (catches exceptions and hangs without a process restart)."""
    ft_max_restarts: int = 3
    """In-job restarts by ft_launcher (SIGKILL, OOM kill, hung ranks) before the job fails."""
    max_cluster_restarts: int = 3
    """Pod restarts (exit >= 128) the launcher tolerates before failing the step (then the step's retry)."""
    backend: str = "pytorchjob"
    """Where training runs: pytorchjob (Kubeflow training-operator), trainjob (Kubeflow Trainer v2) or local
    (subprocess in the step)."""
    init_from: str = ""
    """Warm start: '' (none), 'promoted' (the promoted model's checkpoint) or a checkpoint directory."""
    base_model: str = ""
    """Start from a pretrained Llama-family Hugging Face model: a directory (config.json + safetensors; on the
    shared volume on a cluster) or hf://ORG/NAME or s3://BUCKET/PREFIX; '' = random weights. Its tokenizer
    builds the data unless tokenizer is set; not with init_from."""
    corpus: str = ""
    """Corpus: a directory or file on the shared volume, or a URI: file://, s3://, gs://,
    hf://datasets/<org>/<name>[/path] (a glob such as s3://b/data/*.jsonl selects files; credentials from the
    step's environment); text, JSON Lines or Parquet by extension. Empty = the image's Python standard library."""
    vocab_size: int = 4096
    """Vocabulary size of the byte-level BPE data prep trains when no tokenizer (or base_model) is given."""
    max_corpus_bytes: int = 0
    """Stop reading the corpus once N bytes were read (whole documents, files sorted by path); 0 = all of it."""
    tokenizer: str = ""
    """Pretrained tokenizer for data prep: a tokenizer.json or a directory holding one (path, or s3://, gs://,
    hf:// URI); '' = base_model's, else train a byte-level BPE of vocab_size."""
    text_field: str = "text"
    """Key (JSON Lines) or column (Parquet) holding each document's text."""
    corpus_secret: str = DEFAULT_CORPUS_SECRET
    """Kubernetes Secret with the credentials data prep (and a base_model download) uses, if it exists: keys
    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION, HF_TOKEN,
    GOOGLE_APPLICATION_CREDENTIALS (a service-account JSON); absent keys are skipped."""
    workdir: str = f"{SHARED_MOUNT}/resilient-train"
    """Run files go to <workdir>/<run id>/; on a cluster it must be under the PVC mount /mnt/shared."""
    pvc_name: str = "train-shared"
    """PersistentVolumeClaim mounted at /mnt/shared in every step and training pod (cluster only)."""
    namespace: str = ""
    """Namespace of the PyTorchJob; empty = the namespace the pipeline runs in."""
    image: str = ""
    """Trainer image (holds this project): the training pods and every pipeline step run it. Its default is
    the image given to `python -m pipelines.compile --image`; required with backend pytorchjob."""
    image_pull_secrets: list = field(default_factory=list)
    """Secret names the training pods pull the image with; its default comes from `python -m pipelines.compile
    --image-pull-secret` (the pipeline's own steps pull with step_image_pull_secret)."""
    step_image_pull_secret: str = ""
    """Secret the pipeline's own step pods pull the image with (one name: KFP takes a pull secret as a string
    parameter, never a list). Default: the first --image-pull-secret the pipeline was compiled with; a pipeline
    compiled without one takes none here (its steps pull with the ServiceAccount's imagePullSecrets)."""
    node_selector: dict = field(default_factory=dict)
    """nodeSelector of the training pods (the PyTorchJob) only, e.g. {"nvidia.com/gpu.product": "H100"};
    the pipeline's own steps never get it."""
    tolerations: list = field(default_factory=list)
    """Tolerations of the training pods (the PyTorchJob) and the evaluation step (which may use a GPU),
    e.g. [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]; never the train step."""
    launcher_node_selector: dict = field(default_factory=dict)
    """nodeSelector of the train step itself: a long-running CPU pod that only launches and watches the
    PyTorchJob; empty = any node its (absent) tolerations allow, i.e. not a tainted GPU node."""
    trainer_overrides: list = field(default_factory=list)
    """Extra trainer overrides, each '--section.key=value' (e.g. '--optim.lr=1e-3')."""
    eval_batch_size: int = 8
    """Evaluation batch size (sequences)."""
    eval_max_batches: int = 50
    """Evaluate on at most N validation batches."""
    eval_cpu: str = "4"
    """CPU request and limit of the evaluation step (a Kubernetes quantity); it loads the model in one process."""
    eval_memory: str = "32Gi"
    """Memory request and limit of the evaluation step: at least the model's weights in fp32 (8b: 32Gi) plus a
    batch."""
    eval_gpus: int = 0
    """GPUs (nvidia.com/gpu) of the evaluation step; 0 evaluates on CPU."""
    promoted_registry: str = ""
    """JSON record of the promoted model (path or file:// URI; empty = <workdir>/promoted-<model>.json), or a
    Kubeflow Model Registry address https://HOST[:PORT][/MODEL_NAME] (name default resilient-train-<model>)."""
    min_improvement: float = 0.0
    """Promote only when val loss beats the promoted model's by more than this."""
    replacement_pod_s: float = 350.0
    """Seconds a replacement pod for a lost node takes, for the report's goodput projection (the evaluation step's
    planner, with spare_nodes). Default 350 s, the planner's documented default: Kubernetes' defaults mark a lost
    node unreachable after node-monitor-grace-period (50 s since 1.32, 40 s before) and evict its pods after the
    default toleration of 300 s (DefaultTolerationSeconds); scheduling and the image pull are not in it (a lower
    bound). Set it to what your cluster measured."""
    deadline_hours: float = 168.0
    """Training wall-clock limit (the PyTorchJob's activeDeadlineSeconds; the local launcher's deadline)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_rank_node

    @property
    def procs_per_rank_node(self) -> int:
        """Ranks per node: one per GPU, else procs_per_node."""
        return self.gpus_per_node if self.gpus_per_node > 0 else self.procs_per_node

    def errors(self) -> list[str]:
        """Every problem, each saying what to change; empty when the parameters are usable."""
        e: list[str] = []
        _range(e, "steps", self.steps, 1, MAX_STEPS)
        _range(e, "nodes", self.nodes, 1, MAX_NODES)
        _range(e, "spare_nodes", self.spare_nodes, 0, MAX_NODES)
        _range(e, "min_nodes", self.min_nodes, 0, self.nodes if _is_int(self.nodes) else MAX_NODES,
               hint="(0 = not elastic)")
        _range(e, "gpus_per_node", self.gpus_per_node, 0, MAX_GPUS_PER_NODE)
        _range(e, "procs_per_node", self.procs_per_node, 1, MAX_PROCS_PER_NODE)
        _range(e, "ft_max_restarts", self.ft_max_restarts, 0, MAX_RESTARTS)
        _range(e, "max_cluster_restarts", self.max_cluster_restarts, 0, MAX_RESTARTS)
        _range(e, "vocab_size", self.vocab_size, 257, MAX_VOCAB, hint="(256 byte tokens + end-of-text at least)")
        _range(e, "max_corpus_bytes", self.max_corpus_bytes, 0, None, hint="(0 = the whole corpus)")
        _range(e, "seq_len", self.seq_len, 0, 1 << 20, hint="(0 = the flavour's value)")
        _range(e, "batch_size", self.batch_size, 0, 1 << 16, hint="(0 = the flavour's value)")
        _range(e, "eval_batch_size", self.eval_batch_size, 1, 1 << 16)
        _range(e, "eval_max_batches", self.eval_max_batches, 1, None)
        _range(e, "checkpoint_interval", self.checkpoint_interval, 1, None)
        _range(e, "eval_gpus", self.eval_gpus, 0, MAX_GPUS_PER_NODE)
        for name in ("eval_cpu", "eval_memory"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _QUANTITY.fullmatch(value):
                e.append(f"{name} must be a Kubernetes quantity like '4', '500m', '32Gi'; got {value!r}")
        if _is_int(self.steps) and _is_int(self.checkpoint_interval) and self.checkpoint_interval >= self.steps:
            e.append(f"steps ({self.steps}) must be greater than checkpoint_interval ({self.checkpoint_interval}) "
                     "so a checkpoint is written before the end of training and a restart can resume from it: "
                     "lower checkpoint_interval or raise steps")
        if not isinstance(self.min_improvement, (int, float)) or self.min_improvement < 0:
            e.append(f"min_improvement must be >= 0 (a val-loss margin); got {self.min_improvement!r}")
        if isinstance(self.replacement_pod_s, bool) or not isinstance(self.replacement_pod_s, (int, float)) or \
                not 0 <= self.replacement_pod_s < math.inf:
            e.append(f"replacement_pod_s must be a number of seconds >= 0; got {self.replacement_pod_s!r}")
        if not isinstance(self.deadline_hours, (int, float)) or not 0 < self.deadline_hours <= MAX_DEADLINE_HOURS:
            e.append(f"deadline_hours must be in (0, {MAX_DEADLINE_HOURS}]; got {self.deadline_hours!r}")
        if self.model not in FLAVOURS and not self.model.endswith(".toml"):
            e.append(f"model must be one of {list(FLAVOURS)} or a trainer .toml path; got {self.model!r}")
        if self.backend not in BACKENDS:
            e.append(f"backend must be one of {list(BACKENDS)}; got {self.backend!r}")
        self._check_backend(e)
        self._check_faults(e)
        if self.init_from not in ("", INIT_FROM_PROMOTED) and not self.init_from.startswith("/"):
            e.append(f"init_from must be '', {INIT_FROM_PROMOTED!r} or an absolute checkpoint directory; "
                     f"got {self.init_from!r}")
        if self.promoted_registry and not (self.promoted_registry.startswith(("/", "file://", "http://",
                                                                              "https://"))):
            e.append(f"promoted_registry must be an absolute path or file:// URI on shared storage (or empty for "
                     f"<workdir>/promoted-<model>.json), or a Kubeflow Model Registry address "
                     f"https://HOST[:PORT][/MODEL_NAME]; got {self.promoted_registry!r}")
        self._check_corpus(e)
        self._check_base_model(e)
        self._check_image(e)
        self._check_k8s_fields(e)
        self._check_overrides(e)
        self._check_elastic(e)
        return e

    def _check_corpus(self, e: list[str]) -> None:
        for name in ("corpus", "tokenizer"):
            value = getattr(self, name)
            m = _URI_SCHEME.match(value)
            shown = redact_uri(value)
            if m and m.group(1).lower() not in CORPUS_SCHEMES:
                e.append(f"{name} {shown!r}: data prep cannot read {m.group(1)!r} URIs; it reads a local path "
                         f"(e.g. on the shared volume) or a URI with scheme "
                         f"{', '.join(s + '://' for s in CORPUS_SCHEMES)}: copy it to a bucket or the volume, then "
                         "pass that")
            elif m and m.group(1).lower() == "hf" and name == "corpus" and not value.startswith("hf://datasets/"):
                e.append(f"corpus {shown!r}: a Hugging Face corpus is a dataset repo, hf://datasets/ORG/NAME[/PATH]")
            elif value and not m and not value.startswith("/") and name == "tokenizer":
                e.append(f"tokenizer {shown!r} must be an absolute path or a URI (every step must resolve it the "
                         "same), e.g. /mnt/shared/tokenizers/llama3 or hf://meta-llama/Llama-3.2-1B")
        if self.tokenizer and self.init_from:
            e.append(f"tokenizer must be empty with init_from={self.init_from!r}: a warm start reuses the tokenizer "
                     "its checkpoint was trained with")
        if not isinstance(self.text_field, str) or not self.text_field.strip() or len(self.text_field) > \
                MAX_TEXT_FIELD_LEN or self.text_field != self.text_field.strip() or not self.text_field.isprintable():
            e.append(f"text_field must name the JSON Lines key or Parquet column of the text (1-{MAX_TEXT_FIELD_LEN} "
                     f"printable characters, no surrounding spaces); got {self.text_field!r}")
        if not _DNS1123_LABEL.fullmatch(self.corpus_secret or "") or len(self.corpus_secret) > 63:
            e.append(f"corpus_secret must name a Secret (a DNS-1123 label: lowercase letters, digits, '-'; it cannot "
                     f"be empty: a missing Secret is fine, so keep the default {DEFAULT_CORPUS_SECRET!r} when there "
                     f"are no credentials); got {self.corpus_secret!r}")
        elif self.corpus_secret == self.pvc_name:
            e.append(f"corpus_secret and pvc_name must differ (both name a volume of the data prep pod); got "
                     f"{self.corpus_secret!r} for both")

    def _check_base_model(self, e: list[str]) -> None:
        value = self.base_model
        if not value:
            return
        m = _URI_SCHEME.match(value)
        if m and m.group(1).lower() not in BASE_MODEL_SCHEMES:
            e.append(f"base_model {value!r}: the trainer loads a directory or downloads "
                     f"{' or '.join(s + '://' for s in BASE_MODEL_SCHEMES)} URIs; copy the model to one of those")
        elif m and m.group(1) == "hf" and not _HF_MODEL.fullmatch(value):
            e.append(f"base_model {value!r} must name a model repo, hf://ORG/NAME (e.g. hf://meta-llama/Llama-3.2-1B)")
        elif m and m.group(1) == "s3" and not _S3_URI.fullmatch(value):
            e.append(f"base_model {value!r} must look like s3://BUCKET/PREFIX (the directory holding config.json)")
        elif not m and not value.startswith("/"):
            e.append(f"base_model {value!r} must be an absolute directory or an hf:// or s3:// URI")
        elif not m and self.backend in CLUSTER_BACKENDS and \
                PurePosixPath(SHARED_MOUNT) not in PurePosixPath(value).parents:
            e.append(f"base_model {value!r} must be under {SHARED_MOUNT} (the volume the training pods mount) with "
                     f"backend {self.backend!r}, or an hf:// or s3:// URI")
        if self.init_from:
            e.append(f"base_model and init_from={self.init_from!r} cannot both be set: a warm start's weights come "
                     "from its checkpoint; clear one of them")

    def _check_image(self, e: list[str]) -> None:
        if not isinstance(self.image, str):
            e.append(f"image must be a string; got {self.image!r}")
        elif self.image and (len(self.image) > MAX_IMAGE_REF_LEN or not _IMAGE_REF.fullmatch(self.image)):
            e.append(f"image {self.image!r} is not a valid image reference: expected "
                     "[registry[:port]/]name[:tag][@sha256:digest] with a lowercase name and no spaces, e.g. "
                     "registry.example.com/team/resilient-train:0.1.0")
        if not isinstance(self.image_pull_secrets, list) or not all(
                isinstance(s, str) and _DNS1123_LABEL.fullmatch(s) for s in self.image_pull_secrets):
            e.append(f"image_pull_secrets must be a list of Secret names (DNS-1123); got {self.image_pull_secrets!r}")
        if not isinstance(self.step_image_pull_secret, str) or (
                self.step_image_pull_secret and not _DNS1123_LABEL.fullmatch(self.step_image_pull_secret)):
            e.append(f"step_image_pull_secret must be one Secret name (DNS-1123) or empty; got "
                     f"{self.step_image_pull_secret!r}")

    def _check_backend(self, e: list[str]) -> None:
        if not self.workdir.startswith("/"):
            e.append(f"workdir must be an absolute path (every step and pod must resolve it the same); "
                     f"got {self.workdir!r}")
        if self.backend in CLUSTER_BACKENDS:
            mount = PurePosixPath(SHARED_MOUNT)
            if self.workdir.startswith("/") and mount not in PurePosixPath(self.workdir).parents:
                e.append(f"workdir {self.workdir!r} must be under {SHARED_MOUNT} (the PVC every step and training "
                         f"pod mounts) with backend {self.backend!r}, e.g. {SHARED_MOUNT}/resilient-train")
            if not _DNS1123_LABEL.fullmatch(self.pvc_name or ""):
                e.append(f"pvc_name must name an existing PersistentVolumeClaim (DNS-1123); got {self.pvc_name!r}")
            if isinstance(self.image, str) and not self.image.strip():
                e.append(f"image must name the trainer image with backend {self.backend!r}: compile with "
                         "`python -m pipelines.compile --image REGISTRY/resilient-train:TAG` or pass the image "
                         "parameter")
        if self.namespace and not _DNS1123_LABEL.fullmatch(self.namespace):
            e.append(f"namespace must be a DNS label or empty (the pipeline's namespace); got {self.namespace!r}")

    def _check_faults(self, e: list[str]) -> None:
        try:
            faults = parse_faults(self.faults)
        except ValueError as exc:
            e.append(str(exc))
            return
        for f in faults:
            if _is_int(self.steps) and not 1 <= f.step <= self.steps:
                e.append(f"fault {f}: step must be in 1..steps ({self.steps}); move it or raise steps")
            if _is_int(self.nodes) and _is_int(self.procs_per_rank_node) and f.rank >= self.world_size:
                e.append(f"fault {f}: rank must be < the world size ({self.world_size} = nodes x ranks per node)")
            if f.kind in ("exception", "hang", "hang_gil") and not self.inprocess_restart:
                e.append(f"fault {f}: the in-process layer that catches {f.kind!r} is off; set "
                         "inprocess_restart=True or the fault escalates to an in-job restart")

    def _check_k8s_fields(self, e: list[str]) -> None:
        for name in ("node_selector", "launcher_node_selector"):
            value = getattr(self, name)
            if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in value.items()):
                e.append(f"{name} must map label names to string values; got {value!r}")
        if not isinstance(self.tolerations, list) or not all(isinstance(t, dict) for t in self.tolerations):
            e.append(f"tolerations must be a list of objects like {{'key': 'nvidia.com/gpu', 'operator': "
                     f"'Exists', 'effect': 'NoSchedule'}}; got {self.tolerations!r}")
        else:
            for t in self.tolerations:
                unknown = sorted(set(t) - set(TOLERATION_KEYS))
                if unknown:
                    e.append(f"toleration {t!r}: unknown key(s) {unknown}; allowed: {list(TOLERATION_KEYS)}")

    def _check_overrides(self, e: list[str]) -> None:
        if not isinstance(self.trainer_overrides, list):
            e.append(f"trainer_overrides must be a list of '--section.key=value' strings; got "
                     f"{self.trainer_overrides!r}")
            return
        for item in self.trainer_overrides:
            m = _OVERRIDE.match(item) if isinstance(item, str) else None
            if not m:
                e.append(f"trainer override {item!r} must look like '--section.key=value', e.g. '--optim.lr=1e-3'")
            elif f"{m.group(1)}.{m.group(2)}" in RESERVED_OVERRIDES:
                e.append(f"trainer override {item!r} sets a key the pipeline controls; use the pipeline parameter "
                         "instead (steps, checkpoint_interval, faults, inprocess_restart, gpus_per_node, workdir)")

    def _check_elastic(self, e: list[str]) -> None:
        """Elastic: every size from min_nodes to nodes splits the global batch into whole micro-batches (its ranks
        accumulate the missing nodes' ones). With batch_size 0 (the flavour's, which the trainer reads) a given
        global batch is checked per rank only here; the trainer checks the rest at start (trainer.config)."""
        if not (_is_int(self.min_nodes) and _is_int(self.nodes) and 0 < self.min_nodes < self.nodes) or \
                not _is_int(self.batch_size) or not isinstance(self.trainer_overrides, list):
            return
        sizes, ranks = range(self.min_nodes, self.nodes + 1), self.procs_per_rank_node
        given = [m.group(3) for m in map(_OVERRIDE.match, (o for o in self.trainer_overrides if isinstance(o, str)))
                 if m and (m.group(1), m.group(2)) == ("train", "global_batch")]
        unit = math.lcm(*sizes) * ranks
        every = (f"a multiple of {unit * self.batch_size}" if self.batch_size else
                 f"a multiple of batch_size x {unit}")
        fix = f"'--train.global_batch=<{every}>' in trainer_overrides"
        if not given:
            lost = [k for k in sizes if self.nodes % k]
            if lost:
                e.append(f"min_nodes={self.min_nodes} cannot keep the global batch of {self.nodes} nodes on {lost[0]} "
                         f"nodes (it does not split into whole micro-batches there): set min_nodes={lost[-1] + 1}, "
                         f"or a global batch every size from {self.min_nodes} to {self.nodes} nodes divides: {fix}")
            return
        try:
            batch = int(given[-1])
        except ValueError:
            e.append(f"trainer override --train.global_batch={given[-1]!r} must be a whole number of sequences")
            return
        per_node = (self.batch_size or 1) * ranks
        lost = [k for k in sizes if batch <= 0 or batch % (per_node * k)]
        if lost:
            keeps = f"set min_nodes={lost[-1] + 1}, or " if lost[-1] < self.nodes else ""
            e.append(f"--train.global_batch={batch} cannot be kept on {lost[0]} nodes of {ranks} rank(s) (min_nodes="
                     f"{self.min_nodes} to nodes={self.nodes}): {keeps}{fix}")

    def validate(self) -> PipelineParams:
        """Raise `ParamError` listing every problem; return self when valid."""
        errors = self.errors()
        if errors:
            raise ParamError(errors)
        return self

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> PipelineParams:
        """Build from pipeline arguments; unknown names are an error that lists the known ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ParamError([f"unknown parameter(s) {unknown}; parameters are {sorted(names)}"])
        return cls(**values)

    def registry_path(self) -> str:
        return registry_location(self.promoted_registry, self.workdir, self.model)


def step_pull_secret_errors(step_image_pull_secret: str, compiled_pull_secrets: list) -> list[str]:
    """A run-time step pull secret needs a pipeline compiled with one: only then do its steps carry the
    parameter (a pod that names no pull secret keeps its ServiceAccount's, which an empty name would stop)."""
    if step_image_pull_secret and not compiled_pull_secrets:
        return [f"step_image_pull_secret {step_image_pull_secret!r}: this pipeline was compiled without "
                "--image-pull-secret, so its steps take no pull secret at run time; compile with "
                f"`python -m pipelines.compile --image-pull-secret {step_image_pull_secret}`, or add the Secret to "
                "the runs' ServiceAccount: kubectl patch serviceaccount default-editor -p "
                f"'{{\"imagePullSecrets\": [{{\"name\": \"{step_image_pull_secret}\"}}]}}'"]
    return []


def _flavour_slug(model: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", PurePosixPath(model).stem if model.endswith(".toml") else model)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _range(e: list[str], name: str, value: Any, low: int, high: int | None, hint: str = "") -> None:
    if not _is_int(value):
        e.append(f"{name} must be an integer; got {value!r}")
    elif value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        e.append(f"{name} must be {bound}{' ' + hint if hint else ''}; got {value}")


def descriptions() -> dict[str, str]:
    """Each parameter's one-line description (the field docstrings), for the pipeline's UI description."""
    import ast
    import inspect

    body = ast.parse(inspect.getsource(PipelineParams)).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())  # type: ignore[union-attr]
    return docs


DEFAULTS = PipelineParams()


def is_model_uri(base_model: str) -> bool:
    """Whether `base_model` is a URI something downloads (the trainer, or a TrainJob's model initializer) rather
    than a directory the pods already see."""
    m = _URI_SCHEME.match(base_model)
    return bool(m) and m.group(1).lower() in BASE_MODEL_SCHEMES


def registry_location(promoted_registry: str, workdir: str, model: str) -> str:
    """The promoted record's location: the parameter, else ``<workdir>/promoted-<model>.json``; a Model
    Registry address without a registered model name gets ``/resilient-train-<model>``."""
    if promoted_registry.startswith(("http://", "https://")) and not urlparse(promoted_registry).path.strip("/"):
        return f"{promoted_registry.rstrip('/')}/resilient-train-{_flavour_slug(model)}"
    return promoted_registry or f"{workdir.rstrip('/')}/promoted-{_flavour_slug(model)}.json"
