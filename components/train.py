"""``train``: run the trainer (PyTorchJob, TrainJob or local subprocess) and publish the checkpoint and metrics."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from components.lib.params import DEFAULT_IMAGE


@dsl.component(base_image=DEFAULT_IMAGE, packages_to_install=[], install_kfp_package=False)
def train(
    model: str, steps: int, checkpoint_interval: int, nodes: int, spare_nodes: int, min_nodes: int,
    gpus_per_node: int, procs_per_node: int,
    seq_len: int, batch_size: int, faults: str, inprocess_restart: bool, ft_max_restarts: int,
    max_cluster_restarts: int, backend: str, init_from: str, corpus: str, vocab_size: int, max_corpus_bytes: int,
    base_model: str, tokenizer: str, text_field: str, corpus_secret: str,
    workdir: str, pvc_name: str, namespace: str, image: str, image_pull_secrets: list,
    step_image_pull_secret: str, node_selector: dict,
    tolerations: list, launcher_node_selector: dict, trainer_overrides: list, eval_batch_size: int,
    eval_max_batches: int, eval_cpu: str, eval_memory: str, eval_gpus: int, promoted_registry: str,
    min_improvement: float, replacement_pod_s: float, deadline_hours: float,
    run_id: str, dataset: Input[Dataset], checkpoint: Output[Model], metrics: Output[Metrics],
):
    """Train (or resume) this run's model; ``checkpoint`` points at the run's checkpoint directory.

    The checkpoint stays on shared storage (no copy): the artifact holds a small ``checkpoint.json`` and
    the metadata (checkpoint_dir, step, model). ``metrics`` carries steps, tokens, final loss, restarts
    per recovery layer and goodput from the recovery ledger.
    """
    import json
    import os
    import sys

    from components.lib.params import PipelineParams
    from components.lib.train_step import PermanentFailureError, configure_step_logging, run_train

    configure_step_logging()
    values = dict(locals())
    p = PipelineParams.from_mapping({k: values[k] for k in PipelineParams.__dataclass_fields__})
    try:
        outcome = run_train(p, run_id, dataset.metadata["data_dir"])
    except PermanentFailureError as exc:  # a retry after a permanent exit: one line, the trainer's code
        print(exc, file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)
    pointer = {"checkpoint_dir": outcome.checkpoint_dir, "step": outcome.step, "model": outcome.model,
               "run_dir": outcome.run_dir, "run_id": run_id}
    os.makedirs(checkpoint.path, exist_ok=True)
    with open(os.path.join(checkpoint.path, "checkpoint.json"), "w") as f:
        json.dump(pointer, f, indent=2)
    checkpoint.metadata.update(pointer)
    for name, value in outcome.metrics.items():
        metrics.log_metric(name, value)
    restarts = ", ".join(f"{k.removeprefix('restarts_')} {int(v)}" for k, v in outcome.metrics.items()
                         if k.startswith("restarts_"))
    goodput = outcome.metrics.get("goodput")
    print(f"[train] done: step {outcome.step}, final loss {outcome.metrics['final_loss']:.4f}, restarts: "
          f"{restarts}, goodput {'n/a' if goodput is None else format(goodput, '.1%')}")
