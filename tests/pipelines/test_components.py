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


CANDIDATE = {"checkpoint_dir": "/w/r1/checkpoints", "step": 5, "model": "tiny", "val_loss": 3.0, "perplexity": 20.1,
             "val_tokens": 4096, "checkpoint": "/w/r1/checkpoints/step-00000005", "run_id": "r1",
             "data_dir": "/w/r1/data"}
EXPORT = {"export_dir": "/w/r1/export/step-00000005", "uri": "file:///w/r1/export/step-00000005",
          "model_format": "safetensors", "dtype": "bfloat16", "step": 5,
          "source_checkpoint": "/w/r1/checkpoints/step-00000005"}


def gate_artifacts(tmp_path, export=EXPORT):
    decision = dsl.Artifact(uri=str(tmp_path / "artifact" / "decision"))
    Path(decision.path).parent.mkdir(parents=True, exist_ok=True)
    Path(decision.path).write_text(json.dumps({"promote": True, "reason": "promoted: first", "current_id": "",
                                               "candidate": CANDIDATE}))
    exported = dsl.Model(uri=str(tmp_path / "artifact" / "exported_model"), metadata=dict(export))
    return decision, exported


def test_promote_records_the_candidate_with_its_export_once(tmp_path):
    decision, exported = gate_artifacts(tmp_path)
    kw = dict(workdir=str(tmp_path), model="tiny", promoted_registry="")
    assert promote.python_func(decision=decision, exported_model=exported, **kw).startswith("promoted tiny step 5")
    record = json.loads((tmp_path / "promoted-tiny.json").read_text())
    assert record["checkpoint_dir"] == "/w/r1/checkpoints"
    # init_from=promoted still warm-starts from the checkpoint, with its data's tokenizer
    import io

    from components.lib.data_step import warm_start_data_dir
    from components.lib.train_step import resolve_init_from

    warm = PipelineParams(backend="local", workdir=str(tmp_path), init_from="promoted")
    assert resolve_init_from(warm, io.StringIO()) == "/w/r1/checkpoints"
    assert warm_start_data_dir("promoted", warm.registry_path()) == "/w/r1/data"
    assert (record["export_dir"], record["model_uri"], record["model_format"]) == (
        EXPORT["export_dir"], EXPORT["uri"], "safetensors")
    # a second promotion based on the stale "nothing promoted" view is refused, not overwritten
    assert promote.python_func(decision=decision, exported_model=exported, **kw).startswith("not promoted")


def test_promote_refuses_an_export_of_another_step(tmp_path):
    decision, exported = gate_artifacts(tmp_path, {**EXPORT, "step": 4,
                                                   "source_checkpoint": "/w/r1/checkpoints/step-00000004"})
    with pytest.raises(ValueError, match="the export is of .*step-00000004 .* but the gate evaluated"):
        promote.python_func(decision=decision, exported_model=exported, workdir=str(tmp_path), model="tiny",
                            promoted_registry="")
    assert not (tmp_path / "promoted-tiny.json").exists()


def test_data_prep_uses_the_base_models_tokenizer_and_the_mounted_credentials(tmp_path, monkeypatch, capsys):
    """The tokenizer data prep is asked for (tokenizer, else base_model) and the Secret's keys reach its
    environment; no value is printed or lands in the artifact."""
    from components.lib import credentials, data_step

    seen = {}

    def fake_prepare(corpus, layout, **kw):
        import os

        seen.update(kw, env={k: os.environ.get(k) for k in credentials.KEYS})
        return {"data_dir": str(layout.data_dir), "train_tokens": 1, "val_tokens": 1, "vocab_size": 300,
                "num_shards": 2}

    mount = tmp_path / "secret"
    mount.mkdir()
    (mount / "HF_TOKEN").write_text("hf_sentinel_value\n")
    (mount / "GOOGLE_APPLICATION_CREDENTIALS").write_text('{"private_key": "sentinel"}')
    monkeypatch.setattr(credentials, "MOUNT_DIR", str(mount))
    monkeypatch.setattr(data_step, "prepare", fake_prepare)
    for key in credentials.KEYS:  # recorded, so what data prep exports is undone after the test
        monkeypatch.setenv(key, "unset")
        monkeypatch.delenv(key)
    common = dict(corpus="s3://bucket/c", vocab_size=300, max_corpus_bytes=0, workdir=str(tmp_path / "w"),
                  run_id="r1", init_from="", model="tiny", promoted_registry="")
    artifact = dsl.Dataset(uri=str(tmp_path / "artifact" / "dataset"))
    data_prep.python_func(**common, dataset=artifact, base_model="hf://meta-llama/Llama-3.2-1B", text_field="content")
    assert seen["tokenizer"] == "hf://meta-llama/Llama-3.2-1B" and seen["text_field"] == "content"
    assert seen["env"]["HF_TOKEN"] == "hf_sentinel_value"
    assert seen["env"]["GOOGLE_APPLICATION_CREDENTIALS"] == str(mount / "GOOGLE_APPLICATION_CREDENTIALS")
    assert seen["env"]["AWS_ACCESS_KEY_ID"] is None  # a key the Secret lacks is skipped
    data_prep.python_func(**common, dataset=artifact, base_model="hf://meta-llama/Llama-3.2-1B",
                          tokenizer="/mnt/shared/tok/tokenizer.json")
    assert seen["tokenizer"] == "/mnt/shared/tok/tokenizer.json"  # an explicit tokenizer wins
    printed = capsys.readouterr().out
    assert "credentials from the mounted Secret: GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN" in printed
    assert "sentinel" not in printed and "sentinel" not in json.dumps(artifact.metadata)


def test_cleanup_local_is_idempotent(tmp_path):
    status = dsl.PipelineTaskFinalStatus(state="FAILED", pipeline_job_resource_name="p", pipeline_task_name="t",
                                         error_code=None, error_message=None)
    for _ in range(2):
        assert cleanup.python_func(backend="local", workdir=str(tmp_path), namespace="", run_id="r",
                                   status=status) == "no local training processes left"
