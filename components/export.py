"""``export_model``: the checkpoint step the gate evaluated -> a Hugging Face directory on shared storage."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Model, Output

from components.lib.params import DEFAULT_IMAGE


@dsl.component(base_image=DEFAULT_IMAGE, packages_to_install=[], install_kfp_package=False)
def export_model(decision: Input[Artifact], workdir: str, run_id: str, pvc_name: str, exported_model: Output[Model],
                 dtype: str = "bfloat16"):
    """Export the gate's candidate step (``python -m trainer.export``) to ``<workdir>/<run_id>/export/step-N``.

    ``exported_model`` holds ``model.json`` and metadata: ``export_dir``, ``uri`` (``pvc://<pvc_name>/...`` on
    the shared volume: what KServe loads and Model Registry records), format ``safetensors``, ``dtype``,
    ``step`` and ``source_checkpoint`` (the evaluated step directory).
    """
    import json
    import os

    from components.lib.export_step import export_candidate
    from components.lib.layout import RunLayout

    with open(decision.path) as f:
        candidate = json.load(f)["candidate"]
    meta = export_candidate(candidate, RunLayout(workdir, run_id), pvc_name=pvc_name, dtype=dtype)
    os.makedirs(exported_model.path, exist_ok=True)
    with open(os.path.join(exported_model.path, "model.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    exported_model.metadata.update(meta)
    print(f"[export] step {meta['step']} -> {meta['export_dir']} ({meta['bytes'] / 1e9:.2f} GB, {meta['tensors']} "
          f"tensors in {meta['shards']} safetensors file(s), {meta['dtype']}); serve it from {meta['uri']}")
