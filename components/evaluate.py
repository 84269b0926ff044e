"""``evaluate_checkpoint`` (val loss, perplexity, HTML report, promotion gate) and ``promote`` (records the export)."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Metrics, Model, Output

from components.lib.params import DEFAULT_IMAGE


@dsl.component(base_image=DEFAULT_IMAGE, packages_to_install=[], install_kfp_package=False)
def evaluate_checkpoint(
    checkpoint: Input[Model], dataset: Input[Dataset], run_id: str, workdir: str, model: str,
    promoted_registry: str, eval_batch_size: int, eval_max_batches: int, min_improvement: float,
    spare_nodes: int, gpus_per_node: int, replacement_pod_s: float,
    metrics: Output[Metrics], report: Output[HTML], decision: Output[Artifact],
) -> bool:
    """Evaluate the newest valid checkpoint on the validation split; gate its promotion.

    The report projects the run's goodput at scale with the run's own spare nodes, GPUs per node (8 for a CPU run)
    and ``replacement_pod_s`` (``components.lib.planning``).

    Returns True when it beats the promoted model (compared on the same tokenizer and validation data).
    ``decision`` holds, as JSON, the ``reason``, the ``candidate`` record ``promote`` writes and the
    ``current_id`` of the record it replaces (reason and current_id also in its metadata, for the UI).
    The gate is the single return value because ``kfp.local`` resolves a condition on a component's
    ``Output`` channel but not on a named output of a NamedTuple.
    """
    import json

    from components.lib.evaluation import evaluate_and_gate
    from components.lib.layout import RunLayout
    from components.lib.params import registry_location

    registry = registry_location(promoted_registry, workdir, model)
    outcome = evaluate_and_gate(
        checkpoint=checkpoint.metadata, dataset=dataset.metadata, registry=registry, run_id=run_id,
        eval_dir=RunLayout(workdir, run_id).eval_dir, batch_size=eval_batch_size, max_batches=eval_max_batches,
        min_improvement=min_improvement,
        planning={"spares": spare_nodes, "gpus_per_node": gpus_per_node, "replacement_s": replacement_pod_s})
    r, d = outcome.result, outcome.decision
    for name in ("val_loss", "perplexity", "step", "val_tokens"):
        metrics.log_metric(name, float(r[name]))
    metrics.log_metric("promote", 1.0 if d.promote else 0.0)
    if d.baseline_val_loss is not None:
        metrics.log_metric("promoted_val_loss", d.baseline_val_loss)
    with open(report.path, "w") as f:
        f.write(outcome.report_html)
    print(f"[eval] step {r['step']}: val loss {r['val_loss']:.4f}, perplexity {r['perplexity']:.2f}; {d.reason}")
    with open(decision.path, "w") as f:
        json.dump({"promote": d.promote, "reason": d.reason, "current_id": d.current_id,
                   "candidate": outcome.candidate}, f, sort_keys=True)
    decision.metadata.update({"promote": d.promote, "reason": d.reason, "current_id": d.current_id})
    return d.promote


@dsl.component(base_image=DEFAULT_IMAGE, packages_to_install=[], install_kfp_package=False)
def promote(decision: Input[Artifact], exported_model: Input[Model], workdir: str, model: str,
            promoted_registry: str) -> str:
    """Record the gate's candidate, pointing at its export, as the promoted model (the JSON record, or a new
    Model Registry version of the exported directory), unless another run promoted one since the gate."""
    import json

    from components.lib.evaluation import PromotionConflict, write_registry
    from components.lib.params import registry_location
    from components.lib.promoted import PromotedRecord

    registry = registry_location(promoted_registry, workdir, model)
    with open(decision.path) as f:
        gate = json.load(f)
    record = PromotedRecord.from_mapping(gate["candidate"]).with_export(exported_model.metadata)
    try:
        path = write_registry(registry, record.to_dict(), expected_current=gate["current_id"])
    except PromotionConflict as exc:
        print(f"[promote] not promoted: {exc}")
        return f"not promoted: {exc}"
    message = f"promoted {record.model} step {record.step} (val loss {record.val_loss:.4f}) -> {path}"
    print(f"[promote] {message}")
    return message
