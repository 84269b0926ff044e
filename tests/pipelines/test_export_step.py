"""The export step's plumbing (components/lib/export_step.py, the ``export_model`` component) against a stand-in
for ``python -m trainer.export`` (tests/pipelines/pipeline_fakes.py). The real CLI's output is tested where it
lives (the trainer's tests) and by the local pipeline run (tests/pipelines/test_local_pipeline.py)."""

import io
import json
import sys
from pathlib import Path

import pytest
from kfp import dsl
from pipeline_fakes import fake_export_cli, write_export, write_safetensors

from components.export import export_model
from components.lib import export_step
from components.lib.export_step import ExportError, check_export, export_candidate, served_uri
from components.lib.layout import RunLayout

CANDIDATE = {"step": 60, "checkpoint": "/w/run-1/checkpoints/step-00000060"}


def test_a_complete_export_is_renamed_into_place(tmp_path):
    layout = RunLayout(tmp_path / "w", "run-1")
    out = io.StringIO()
    meta = export_candidate(CANDIDATE, layout, pvc_name="train-shared", dtype="bfloat16",
                            command=[sys.executable, str(fake_export_cli(tmp_path / "export"))], out=out)
    final = layout.export_dir(60)
    assert final == tmp_path / "w" / "run-1" / "export" / "step-00000060"
    assert meta["export_dir"] == str(final) and (final / "model.safetensors").is_file()
    assert not final.with_name(final.name + ".partial").exists()
    assert (meta["step"], meta["source_checkpoint"], meta["dtype"]) == (60, CANDIDATE["checkpoint"], "bfloat16")
    assert (meta["model_format"], meta["model_format_version"], meta["tensors"]) == ("safetensors", "1", 3)
    assert meta["uri"] == f"file://{final}"  # not on the shared volume: a local run
    assert "exported /w/run-1/checkpoints/step-00000060" in out.getvalue()  # the CLI's output is streamed


def test_a_failed_export_leaves_no_directory_and_says_why(tmp_path):
    layout = RunLayout(tmp_path / "w", "run-1")
    with pytest.raises(ExportError, match=r"exited 4 \(the checkpoint's files are unreadable or corrupt\)") as err:
        export_candidate(CANDIDATE, layout, pvc_name="", dtype="float32", out=io.StringIO(),
                         command=[sys.executable, str(fake_export_cli(tmp_path / "export", code=4))])
    assert "shard-00000-of-00002.pt is truncated" in str(err.value)  # the CLI's last lines
    assert not layout.export_dir(60).exists()


def test_a_retry_replaces_an_earlier_export_of_the_same_step(tmp_path):
    layout = RunLayout(tmp_path / "w", "run-1")
    write_export(layout.export_dir(60), shards=1)
    (layout.export_dir(60) / "stale.txt").write_text("from the first attempt")
    export_candidate(CANDIDATE, layout, pvc_name="", dtype="bfloat16", out=io.StringIO(),
                     command=[sys.executable, str(fake_export_cli(tmp_path / "export", shards=2))])
    assert not (layout.export_dir(60) / "stale.txt").exists()
    assert (layout.export_dir(60) / "model.safetensors.index.json").is_file()


def test_check_export_finds_what_a_loader_would_trip_on(tmp_path):
    good = tmp_path / "good"
    write_export(good, shards=2)
    assert check_export(good)["shards"] == 2 and check_export(good)["tensors"] == 3

    wrong = tmp_path / "wrong"
    write_export(wrong, architecture="GPT2LMHeadModel")
    with pytest.raises(ExportError, match="not 'LlamaForCausalLM'"):
        check_export(wrong)

    missing = tmp_path / "missing"
    write_export(missing, shards=2)
    (missing / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ExportError, match=r"names shard\(s\) \['model-00002-of-00002.safetensors'\]"):
        check_export(missing)

    truncated = tmp_path / "truncated"
    write_export(truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(ExportError, match="truncated or padded"):
        check_export(truncated)

    notoken = tmp_path / "notoken"
    write_export(notoken)
    (notoken / "tokenizer.json").unlink()
    with pytest.raises(ExportError, match=r"lacks \['tokenizer.json'\]"):
        check_export(notoken)

    garbage = tmp_path / "garbage"
    write_export(garbage)
    (garbage / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ExportError, match="not a safetensors file"):
        check_export(garbage)


def test_safetensors_writer_of_the_fakes_is_the_real_format(tmp_path):
    safetensors = pytest.importorskip("safetensors.numpy")  # present once transformers is a dev dependency
    write_safetensors(tmp_path / "x.safetensors", {"a": [2, 3], "b": [4]})
    loaded = safetensors.load_file(str(tmp_path / "x.safetensors"))
    assert {k: list(v.shape) for k, v in loaded.items()} == {"a": [2, 3], "b": [4]}


def test_served_uri_is_a_kserve_storage_uri_on_the_shared_volume():
    assert served_uri("/mnt/shared/resilient-train/r1/export/step-00000060", "train-shared") == \
        "pvc://train-shared/resilient-train/r1/export/step-00000060"
    assert served_uri("/home/me/runs/r1/export/step-00000060", "train-shared") == \
        "file:///home/me/runs/r1/export/step-00000060"


def test_dtype_is_checked_before_anything_runs(tmp_path):
    with pytest.raises(ExportError, match=r"dtype must be one of \['bfloat16', 'float32'\]"):
        export_candidate(CANDIDATE, RunLayout(tmp_path, "r"), pvc_name="", dtype="fp8")


def test_the_component_exports_the_gates_candidate(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(export_step, "EXPORT_COMMAND", (sys.executable, str(fake_export_cli(tmp_path / "export"))))
    decision = dsl.Artifact(uri=str(tmp_path / "artifacts" / "decision"))
    Path(decision.path).parent.mkdir(parents=True)
    Path(decision.path).write_text(json.dumps({"promote": True, "reason": "first", "current_id": "",
                                               "candidate": CANDIDATE}))
    exported = dsl.Model(uri=str(tmp_path / "artifacts" / "exported_model"))
    export_model.python_func(decision=decision, workdir=str(tmp_path / "w"), run_id="run-1",
                             pvc_name="train-shared", exported_model=exported)
    pointer = json.loads((Path(exported.path) / "model.json").read_text())
    assert pointer == exported.metadata and pointer["export_dir"] == str(RunLayout(tmp_path / "w", "run-1")
                                                                          .export_dir(60))
    assert pointer["dtype"] == "bfloat16"  # the serving default
    assert "[export] step 60 -> " in capsys.readouterr().out
