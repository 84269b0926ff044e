"""Evaluation CLI runner (against a fake CLI), the promotion gate and the registry's compare-and-swap."""

import io
import json
import math

import pytest
from pipeline_fakes import write_script

from components.lib.evaluation import (
    EvaluationError, NoCheckpointError, PromotionConflict, decide, read_registry, record_id, run_evaluation,
    write_registry,
)
from components.lib.report import render_report

RESULT = {"step": 40, "val_loss": 4.2, "perplexity": math.exp(4.2), "val_tokens": 4096, "checkpoint": "/c/step-40",
          "model": "tiny"}


def fake_python(tmp_path, code=0, result=RESULT):
    """Stands in for `python`: checks it was asked for `-m trainer.evaluate`, writes --out."""
    return write_script(tmp_path / "python", f"""
        import json, sys
        argv = sys.argv[1:]
        assert argv[:2] == ["-m", "trainer.evaluate"], argv
        print("evaluating", argv)
        if {code}:
            print("checkpoint error: nothing here", file=sys.stderr)
            sys.exit({code})
        out = argv[argv.index("--out") + 1]
        open(out, "w").write(json.dumps({result!r}))
    """)


def test_run_evaluation_returns_the_checked_result(tmp_path):
    out = io.StringIO()
    result = run_evaluation("/c", "/d", tmp_path / "r.json", batch_size=4, max_batches=2,
                            python=str(fake_python(tmp_path)), out=out)
    assert result["val_loss"] == 4.2 and "--max-batches" in out.getvalue()


def test_no_checkpoint_exit_is_its_own_error(tmp_path):
    with pytest.raises(NoCheckpointError, match="nothing here"):
        run_evaluation("/c", "/d", tmp_path / "r.json", batch_size=4, max_batches=2,
                       python=str(fake_python(tmp_path, code=4)), out=io.StringIO())


def test_result_breaking_the_contract_is_an_error(tmp_path):
    with pytest.raises(EvaluationError, match="val_loss must be float"):
        run_evaluation("/c", "/d", tmp_path / "r.json", batch_size=4, max_batches=2,
                       python=str(fake_python(tmp_path, result={**RESULT, "val_loss": "low"})), out=io.StringIO())


def cand(loss, tok="t1", val="v1"):
    return {"val_loss": loss, "tokenizer_sha256": tok, "val_sha256": val, "checkpoint_dir": "/new", "step": 40}


CURRENT = {"val_loss": 4.0, "tokenizer_sha256": "t1", "val_sha256": "v1", "checkpoint_dir": "/old", "step": 10,
           "model": "tiny", "run_id": "r0"}


def never(_):
    raise AssertionError("must not re-evaluate")


def test_gate_promotes_the_first_model():
    d = decide(cand(5.0), None, 0.0, never)
    assert d.promote
    # The report's banner shows this reason: the model WAS promoted, as the first of its name.
    assert d.reason == "promoted (first model of this name; val loss 5.0000)"
    page = render_report(title="t", metrics=[], ledger=[], decision=d.to_dict())
    assert "promoted (first model of this name; val loss 5.0000)" in page and "no model was promoted" not in page


def test_gate_compares_on_the_same_data():
    assert decide(cand(3.9), CURRENT, 0.0, never).promote
    d = decide(cand(3.95), CURRENT, 0.1, never)
    assert not d.promote and "does not beat" in d.reason and d.baseline_val_loss == 4.0


def test_gate_reevaluates_the_promoted_model_on_new_data():
    seen = []
    d = decide(cand(3.9, val="v2"), CURRENT, 0.0, lambda cur: seen.append(cur["checkpoint_dir"]) or 3.5)
    assert seen == ["/old"] and not d.promote and "re-evaluated" in d.reason


def test_gate_refuses_to_compare_across_tokenizers():
    d = decide(cand(1.0, tok="t2"), CURRENT, 0.0, never)
    assert not d.promote and "another tokenizer" in d.reason


def test_gate_never_promotes_nan():
    assert not decide(cand(float("nan")), None, 0.0, never).promote


def full(record):
    """A complete promoted record (components.lib.promoted.PromotedRecord) around a gate test's record."""
    step = record["step"]
    return {"perplexity": math.exp(record["val_loss"]), "val_tokens": 4096, "model": "tiny", "run_id": "r1",
            "checkpoint": f"{record['checkpoint_dir']}/step-{step:08d}", "data_dir": "/d", **record,
            "export_dir": f"/w/r1/export/step-{step:08d}", "model_uri": f"file:///w/r1/export/step-{step:08d}",
            "model_format": "safetensors", "export_dtype": "bfloat16"}


def test_registry_compare_and_swap(tmp_path):
    reg = str(tmp_path / "promoted.json")
    write_registry(reg, full(CURRENT), expected_current="")
    assert record_id(read_registry(reg)) == "/old@10"
    with pytest.raises(PromotionConflict):
        write_registry(f"file://{reg}", full(cand(3.0)), expected_current="")  # stale view of the registry
    write_registry(reg, full(cand(3.0)), expected_current="/old@10")
    promoted = read_registry(reg)
    assert promoted["checkpoint_dir"] == "/new" and promoted["promoted_at"]
    assert promoted["model_uri"] == "file:///w/r1/export/step-00000040" and promoted["model_format"] == "safetensors"
    history = (tmp_path / "promoted.json.history.jsonl").read_text().splitlines()
    assert [json.loads(h)["checkpoint_dir"] for h in history] == ["/old", "/new"]


def test_registry_refuses_an_incomplete_record(tmp_path):
    with pytest.raises(ValueError, match=r"lacks \[.*'perplexity'.*not written by this pipeline"):
        write_registry(str(tmp_path / "promoted.json"), cand(3.0), expected_current="")
    assert not (tmp_path / "promoted.json").exists()


def test_registry_rejects_remote_uris():
    with pytest.raises(ValueError, match="shared volume"):
        read_registry("gs://bucket/promoted.json")
