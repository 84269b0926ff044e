"""The training pipeline: validate → data prep → train (PyTorchJob, TrainJob or local) → evaluate → if better:
export (Hugging Face directory) → promote.

Recovery policy at this level: the train step retries (``set_retry``) and, because every path derives from
the run id, a retry resumes from the run's latest checkpoint; an exit handler removes the training job or
local processes however the run ends. Steps with side effects on shared storage never come from the cache.
`make_pipeline` builds the DAG with a retry policy: `training_pipeline` (cluster: backoff of minutes, a
retry window of days) and `local_pipeline` (seconds, for ``kfp.local``); ``python -m pipelines.compile``
builds it with the image, pull secrets and version stamp of the deployment (`Build`).

Placement: the train step is a long-running CPU pod that only launches and watches the PyTorchJob, so it
gets no GPU node selector or toleration (only ``launcher_node_selector``); the PyTorchJob's pods get
``node_selector``/``tolerations`` from the launcher (``components/lib/pytorchjob.py``). Evaluation gets
resource requests and limits (``eval_cpu``, ``eval_memory``, ``eval_gpus``) and the tolerations, since it may
use a GPU; the export (CPU only: it holds the model's weights once) gets the same CPU and memory. Step pods pull
the image with ``step_image_pull_secret`` (a run parameter, in a pipeline compiled with ``--image-pull-secret``),
the training pods with ``image_pull_secrets``.

Credentials: data prep mounts the Secret ``corpus_secret`` as files (optional: a missing Secret mounts nothing;
``components/lib/credentials.py`` says why files and not env); its values never reach the YAML or a log.
"""

from dataclasses import dataclass

from kfp import dsl, kubernetes

from components.cleanup import cleanup
from components.data_prep import data_prep
from components.evaluate import evaluate_checkpoint, promote
from components.export import export_model
from components.lib import credentials
from components.lib.params import DEFAULTS, SHARED_MOUNT, PipelineParams, descriptions
from components.train import train
from components.validate import validate_params

PIPELINE_NAME = "resilient-train"
GPU_RESOURCE = "nvidia.com/gpu"
#: The train step's own pod: it runs the launcher (API calls, log streaming), not the training.
LAUNCHER_CPU, LAUNCHER_MEMORY = "250m", "512Mi"
LAUNCHER_CONFIG_MAP = "train-launcher-config"  # deploy/base/launcher-config.yaml
LAUNCHER_CONFIG_KEYS = {"KUEUE_QUEUE_NAME": "KUEUE_QUEUE_NAME"}


@dataclass(frozen=True)
class RetryPolicy:
    """The train step's ``set_retry``. Argo counts ``backoff_max_duration`` from the first attempt's start,
    so on a cluster it must cover whole training attempts, not just the waits between them."""

    num_retries: int
    backoff_duration: str
    backoff_factor: float
    backoff_max_duration: str


CLUSTER_RETRY = RetryPolicy(num_retries=3, backoff_duration="300s", backoff_factor=2.0,
                            backoff_max_duration=f"{7 * 24 * 3600}s")
LOCAL_RETRY = RetryPolicy(num_retries=2, backoff_duration="1s", backoff_factor=1.0, backoff_max_duration="60s")



@dataclass(frozen=True)
class Build:
    """What ``pipelines.compile`` bakes into the YAML for one deployment."""

    image: str = ""
    """Default of the ``image`` parameter (every step and the training pods run it)."""
    image_pull_secrets: tuple[str, ...] = ()
    """Pull secrets of every step's pod, and the default of the ``image_pull_secrets`` parameter."""
    version: str = ""
    """The build stamp (`components.lib.version.build_stamp`); "" = unstamped (the first step skips the check)."""


DESCRIPTION = (
    "Resilient LLM training: data prep -> PyTorchJob or TrainJob (FSDP + NVRx in-process / in-job restarts) -> "
    "checkpoint evaluation -> promotion gate -> Hugging Face export and registration of the promoted step. The "
    "train step retries and resumes from the run's latest checkpoint; an exit handler deletes the training job."
)


def _description(build: Build) -> str:
    if not build.version:
        return DESCRIPTION
    return f"{DESCRIPTION} Built from resilient-train {build.version} for image {build.image or '(unset)'}."


def _docstring(build: Build) -> str:
    lines = [_description(build), "", "Args:"]
    lines += [f"    {name}: {doc}" for name, doc in descriptions().items()]
    return "\n".join(lines)


def _pull_secrets(task: dsl.PipelineTask, step_secret: object, compiled: tuple[str, ...]) -> None:
    """The step pod's pull secrets: the run parameter `step_secret` first, then the other compiled names.

    KFP takes a pull secret from a string parameter (backend >= 2.5), never from a list. A 2.4 backend
    (Kubeflow 1.10) reads only the literal ``secretName`` and skips the parameter it does not know, so the
    first entry carries the compiled name too: 2.4 pulls with it, >= 2.5 resolves the parameter first."""
    kubernetes.set_image_pull_secrets(task, [step_secret, *compiled[1:]])
    task.platform_config["kubernetes"]["imagePullSecret"][0]["secretName"] = compiled[0]


def make_pipeline(retry: RetryPolicy, name: str = PIPELINE_NAME, build: Build = Build()):
    """The pipeline with ``retry`` on its train step, for the image and version of `build`."""

    def pipeline(
        model: str = DEFAULTS.model,
        steps: int = DEFAULTS.steps,
        checkpoint_interval: int = DEFAULTS.checkpoint_interval,
        nodes: int = DEFAULTS.nodes,
        spare_nodes: int = DEFAULTS.spare_nodes,
        min_nodes: int = DEFAULTS.min_nodes,
        gpus_per_node: int = DEFAULTS.gpus_per_node,
        procs_per_node: int = DEFAULTS.procs_per_node,
        seq_len: int = DEFAULTS.seq_len,
        batch_size: int = DEFAULTS.batch_size,
        faults: str = DEFAULTS.faults,
        inprocess_restart: bool = DEFAULTS.inprocess_restart,
        ft_max_restarts: int = DEFAULTS.ft_max_restarts,
        max_cluster_restarts: int = DEFAULTS.max_cluster_restarts,
        backend: str = DEFAULTS.backend,
        init_from: str = DEFAULTS.init_from,
        base_model: str = DEFAULTS.base_model,
        corpus: str = DEFAULTS.corpus,
        vocab_size: int = DEFAULTS.vocab_size,
        max_corpus_bytes: int = DEFAULTS.max_corpus_bytes,
        tokenizer: str = DEFAULTS.tokenizer,
        text_field: str = DEFAULTS.text_field,
        corpus_secret: str = DEFAULTS.corpus_secret,
        workdir: str = DEFAULTS.workdir,
        pvc_name: str = DEFAULTS.pvc_name,
        namespace: str = DEFAULTS.namespace,
        image: str = build.image,
        image_pull_secrets: list = list(build.image_pull_secrets),
        step_image_pull_secret: str = (build.image_pull_secrets or ("",))[0],
        node_selector: dict = DEFAULTS.node_selector,
        tolerations: list = DEFAULTS.tolerations,
        launcher_node_selector: dict = DEFAULTS.launcher_node_selector,
        trainer_overrides: list = DEFAULTS.trainer_overrides,
        eval_batch_size: int = DEFAULTS.eval_batch_size,
        eval_max_batches: int = DEFAULTS.eval_max_batches,
        eval_cpu: str = DEFAULTS.eval_cpu,
        eval_memory: str = DEFAULTS.eval_memory,
        eval_gpus: int = DEFAULTS.eval_gpus,
        promoted_registry: str = DEFAULTS.promoted_registry,
        min_improvement: float = DEFAULTS.min_improvement,
        replacement_pod_s: float = DEFAULTS.replacement_pod_s,
        deadline_hours: float = DEFAULTS.deadline_hours,
    ):
        params = {k: v for k, v in locals().items() if k in PipelineParams.__dataclass_fields__}
        run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER

        def on_cluster(task: dsl.PipelineTask) -> dsl.PipelineTask:
            """Every step runs the trainer image and sees the shared PVC (kfp.local ignores both)."""
            task.set_container_image(image)
            kubernetes.mount_pvc(task, pvc_name=pvc_name, mount_path=SHARED_MOUNT)
            if build.image_pull_secrets:
                _pull_secrets(task, step_image_pull_secret, build.image_pull_secrets)
            return task

        final = on_cluster(cleanup(backend=backend, workdir=workdir, namespace=namespace, run_id=run_id))
        final.set_caching_options(False).set_display_name("clean up training job")
        with dsl.ExitHandler(final, name="train-and-evaluate"):
            check = on_cluster(validate_params(**params, compiled_version=build.version,
                                               compiled_pull_secrets=list(build.image_pull_secrets)))
            # Never from the cache: it checks the image's version and the cluster's state, not just its inputs.
            check.set_caching_options(False).set_display_name("validate parameters")

            data = on_cluster(data_prep(corpus=corpus, vocab_size=vocab_size, max_corpus_bytes=max_corpus_bytes,
                                        workdir=workdir, run_id=run_id, init_from=init_from, model=model,
                                        promoted_registry=promoted_registry, tokenizer=tokenizer,
                                        text_field=text_field, base_model=base_model)).after(check)
            data.set_caching_options(False).set_display_name("prepare token data")
            kubernetes.use_secret_as_volume(data, secret_name=corpus_secret, mount_path=credentials.MOUNT_DIR,
                                            optional=True)

            trained = on_cluster(train(**params, run_id=run_id, dataset=data.outputs["dataset"]))
            trained.set_caching_options(False).set_display_name("train")
            trained.set_retry(num_retries=retry.num_retries, backoff_duration=retry.backoff_duration,
                              backoff_factor=retry.backoff_factor, backoff_max_duration=retry.backoff_max_duration)
            kubernetes.use_config_map_as_env(trained, LAUNCHER_CONFIG_MAP, LAUNCHER_CONFIG_KEYS, optional=True)
            # A CPU pod for days: never the GPU selector or tolerations (those go to the PyTorchJob's pods).
            kubernetes.add_node_selector_json(trained, launcher_node_selector)
            trained.set_cpu_request(LAUNCHER_CPU).set_memory_request(LAUNCHER_MEMORY)

            gate = on_cluster(evaluate_checkpoint(
                checkpoint=trained.outputs["checkpoint"], dataset=data.outputs["dataset"], run_id=run_id,
                workdir=workdir, model=model, promoted_registry=promoted_registry,
                eval_batch_size=eval_batch_size, eval_max_batches=eval_max_batches,
                min_improvement=min_improvement, spare_nodes=spare_nodes, gpus_per_node=gpus_per_node,
                replacement_pod_s=replacement_pod_s))
            gate.set_caching_options(False).set_display_name("evaluate checkpoint")
            # Limits too: a profile namespace with a ResourceQuota on limits refuses a pod without them.
            gate.set_cpu_request(eval_cpu).set_memory_request(eval_memory)
            gate.set_cpu_limit(eval_cpu).set_memory_limit(eval_memory)
            gate.set_accelerator_type(GPU_RESOURCE).set_accelerator_limit(eval_gpus)
            kubernetes.add_toleration_json(gate, tolerations)

            # The gate is evaluate_checkpoint's return value ("Output"): kfp.local resolves a condition on
            # a task's Output channel, not on a NamedTuple field.
            with dsl.If(gate.outputs["Output"] == True, name="better-than-promoted"):  # noqa: E712 - KFP DSL
                # The exact step the gate evaluated, as a Hugging Face directory; promotion registers it.
                exported = on_cluster(export_model(decision=gate.outputs["decision"], workdir=workdir,
                                                   run_id=run_id, pvc_name=pvc_name))
                exported.set_caching_options(False).set_display_name("export model")
                exported.set_cpu_request(eval_cpu).set_memory_request(eval_memory)
                exported.set_cpu_limit(eval_cpu).set_memory_limit(eval_memory)
                record = on_cluster(promote(decision=gate.outputs["decision"],
                                            exported_model=exported.outputs["exported_model"], workdir=workdir,
                                            model=model, promoted_registry=promoted_registry))
                record.set_caching_options(False).set_display_name("promote model")

    pipeline.__doc__ = _docstring(build)
    pipeline.__name__ = name.replace("-", "_")
    return dsl.pipeline(name=name, description=_description(build))(pipeline)


_BUILT_ON_FIRST_USE = {"training_pipeline": CLUSTER_RETRY, "local_pipeline": LOCAL_RETRY}


def __getattr__(name: str):
    """``training_pipeline`` and ``local_pipeline``, each built on its first use rather than at import: kfp's task
    setters call ``inspect.stack()``, so one build costs ~0.2 s of CPU in a plain process and ~1 s under a deep
    stack with torch loaded (a test process collecting this module paid 2.3 s for the two builds it never used)."""
    if name not in _BUILT_ON_FIRST_USE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    built = globals()[name] = make_pipeline(_BUILT_ON_FIRST_USE[name])
    return built
