"""``validate_params``: the pipeline's first step; fails in seconds listing every bad parameter."""

from kfp import dsl

from components.lib.params import DEFAULT_IMAGE


@dsl.component(base_image=DEFAULT_IMAGE, packages_to_install=[], install_kfp_package=False)
def validate_params(
    model: str, steps: int, checkpoint_interval: int, nodes: int, spare_nodes: int, min_nodes: int,
    gpus_per_node: int, procs_per_node: int,
    seq_len: int, batch_size: int, faults: str, inprocess_restart: bool, ft_max_restarts: int,
    max_cluster_restarts: int, backend: str, init_from: str, corpus: str, vocab_size: int, max_corpus_bytes: int,
    base_model: str, tokenizer: str, text_field: str, corpus_secret: str,
    workdir: str, pvc_name: str, namespace: str, image: str, image_pull_secrets: list,
    step_image_pull_secret: str, node_selector: dict,
    tolerations: list, launcher_node_selector: dict, trainer_overrides: list, eval_batch_size: int,
    eval_max_batches: int, eval_cpu: str, eval_memory: str, eval_gpus: int, promoted_registry: str,
    min_improvement: float, replacement_pod_s: float, deadline_hours: float, compiled_version: str, compiled_pull_secrets: list,
) -> str:
    """Check every pipeline parameter (``components.lib.params``) and that the image was built from the version
    the pipeline was compiled from (``components.lib.version``); return a one-line summary of the run."""
    values = dict(locals())
    from components.lib.params import ParamError, PipelineParams, step_pull_secret_errors
    from components.lib.version import check_image_version

    compiled = ("compiled_version", "compiled_pull_secrets")
    p = PipelineParams.from_mapping({k: v for k, v in values.items() if k not in compiled}).validate()
    errors = step_pull_secret_errors(p.step_image_pull_secret, compiled_pull_secrets)
    if errors:
        raise ParamError(errors)
    print(f"[validate] {check_image_version(compiled_version, image)}")
    summary = (f"{p.model} x {p.steps} steps on {p.nodes} node(s) x {p.procs_per_rank_node} rank(s) "
               f"({'GPU' if p.gpus_per_node else 'CPU'}), backend {p.backend}, checkpoint every "
               f"{p.checkpoint_interval}, faults: {p.faults or 'none'}"
               + (f", from base model {p.base_model}" if p.base_model else ""))
    print(f"[validate] parameters OK: {summary}")
    return summary
