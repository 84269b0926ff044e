"""Components through ``.python_func`` with real artifact objects (no KFP runner)."""

import json
from pathlib import Path

import pytest
from kfp import dsl

from components.cleanup import cleanup
from components.data_prep import data_prep
from components.evaluate import promote
from components.lib.params import ParamError, PipelineParams
from components.validate import validate_params


def all_params(**kw):
    return {**PipelineParams(image="registry.example.com/team/resilient-train:0.1.0").__dict__, **kw}


def test_validate_params_fails_with_the_fix():
    compiled = {"compiled_version": "", "compiled_pull_secrets": []}
    assert "tiny x 400 steps" in validate_params.python_func(**all_params(), **compiled)
    with pytest.raises(ParamError, match="lower checkpoint_interval or raise steps"):
        validate_params.python_func(**all_params(steps=10, checkpoint_interval=10), **compiled)


def test_a_step_pull_secret_needs_a_pipeline_compiled_with_one():
    """Compiled without --image-pull-secret, the steps carry no pull-secret parameter: a value would be ignored."""
    with pytest.raises(ParamError, match="compiled without --image-pull-secret.*kubectl patch serviceaccount"):
        validate_params.python_func(**all_params(step_image_pull_secret="ghcr-cred"), compiled_version="",
                                    compiled_pull_secrets=[])
    assert validate_params.python_func(**all_params(step_image_pull_secret="ghcr-cred"), compiled_version="",
                                       compiled_pull_secrets=["regcred"])


def test_data_prep_writes_shards_to_the_run_and_the_manifest_to_the_artifact(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + 1\n" * 40)
    artifact = dsl.Dataset(uri=str(tmp_path / "artifact" / "dataset"))
    common = dict(vocab_size=300, max_corpus_bytes=0, workdir=str(tmp_path / "w"), model="tiny", promoted_registry="")
    data_prep.python_func(corpus=str(corpus), run_id="r1", init_from="", dataset=artifact, **common)
    meta = artifact.metadata
    assert meta["data_dir"] == str(tmp_path / "w" / "r1" / "data")
    assert meta["train_tokens"] > 0 and meta["val_tokens"] > 0 and len(meta["shard_sha256"]) == meta["num_shards"]
    manifest = json.loads((tmp_path / "artifact" / "dataset" / "manifest.json").read_text())
    assert manifest["tokenizer_sha256"] == meta["tokenizer_sha256"]

    # A warm start from the promoted model on fresh data reuses that model's tokenizer.
    (tmp_path / "w" / "promoted-tiny.json").write_text(json.dumps({"data_dir": meta["data_dir"]}))
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    for i in range(4):
        (fresh / f"n{i}.py").write_text(f"class C{i}:\n    value = {i}\n" * 30)
    warm = dsl.Dataset(uri=str(tmp_path / "artifact" / "warm"))
    data_prep.python_func(corpus=str(fresh), run_id="r2", init_from="promoted", dataset=warm, **common)
    assert warm.metadata["tokenizer_sha256"] == meta["tokenizer_sha256"]


def test_promote_records_the_candidate_once(tmp_path):
    candidate = {"checkpoint_dir": "/c", "step": 5, "model": "tiny", "val_loss": 3.0}
    decision = dsl.Artifact(uri=str(tmp_path / "artifact" / "decision"))
    Path(decision.path).parent.mkdir(parents=True)
    Path(decision.path).write_text(json.dumps({"promote": True, "reason": "promoted: first", "current_id": "",
                                               "candidate": candidate}))
    kw = dict(workdir=str(tmp_path), model="tiny", promoted_registry="")
    assert promote.python_func(decision=decision, **kw).startswith("promoted tiny step 5")
    assert json.loads((tmp_path / "promoted-tiny.json").read_text())["checkpoint_dir"] == "/c"
    # a second promotion based on the stale "nothing promoted" view is refused, not overwritten
    assert promote.python_func(decision=decision, **kw).startswith("not promoted")


def test_cleanup_local_is_idempotent(tmp_path):
    status = dsl.PipelineTaskFinalStatus(state="FAILED", pipeline_job_resource_name="p", pipeline_task_name="t",
                                         error_code=None, error_message=None)
    for _ in range(2):
        assert cleanup.python_func(backend="local", workdir=str(tmp_path), namespace="", run_id="r",
                                   status=status) == "no local training processes left"
