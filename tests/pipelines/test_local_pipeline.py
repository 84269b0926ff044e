"""The real pipeline on ``kfp.local`` with a fault for every recovery layer (the demo's settings), through the
export of the promoted step (the real ``python -m trainer.export``) and its promotion."""

import json

import pytest

from components.lib.layout import RunLayout
from components.lib.report import read_jsonl, summarize_ledger
from pipelines.demo import STEPS, format_summary, main, summarize

SMALL_BATCHES = ["--trainer-override=--train.batch_size=2", "--trainer-override=--data.seq_len=64"]
MAX_TERMINAL_LINES = 120  # progress, recovery events, task outcomes, the summary (~80 lines; ~900 before); the rest is logged


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_pipeline_recovers_at_every_layer(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("RESILIENT_TRAIN_LOG_ECHO", raising=False)
    # `make demo`, on small batches (2 x 64 tokens per rank, ~8x cheaper steps than the preset's 8 x 128): what is
    # checked here (the faults at every layer, the terminal, the export and promotion) does not depend on them.
    assert main(["--root", str(tmp_path), *SMALL_BATCHES]) == 0
    terminal = capfd.readouterr().out
    (run_root,) = [p for p in (tmp_path / "work").iterdir() if p.is_dir()]
    layout = RunLayout(run_root.parent, run_root.name)
    params = {"steps": STEPS}

    # What the person at the terminal sees: progress, the three recovery events, the summary; not the JSON.
    lines = terminal.splitlines()
    assert len(lines) <= MAX_TERMINAL_LINES, terminal
    assert "executor_input" not in terminal and '"parameterValues"' not in terminal
    for needle in ("[train] step", "injecting fault exception", "injecting fault sigkill", "injecting fault node_lost",
                   "starting it again, as a replacement pod", "injecting fault sigterm",
                   "finished with status FAILURE", f"demo run {layout.run_id} finished", "goodput"):
        assert needle in terminal, needle
    (log,) = (tmp_path / "logs").glob("demo-*.log")
    assert f"full log     {log}" in terminal
    logged = log.read_text()
    assert "executor_input" in logged and len(logged.splitlines()) > 5 * len(lines)

    ledger, _ = read_jsonl(layout.run_dir / "recovery.jsonl")
    restarts = summarize_ledger(ledger)["restarts"]
    assert min(restarts.values()) >= 1, restarts  # every layer: in-process, in-job, node (two nodes), cluster
    attempts = [r for r in read_jsonl(layout.launcher_dir / "attempts.jsonl")[0] if r["event"] == "end"]
    assert [a["ok"] for a in attempts] == [False, True], "the sigterm attempt fails, the retry resumes and succeeds"

    outputs = {p.parent.name: json.loads(p.read_text()) for p in (tmp_path / "kfp").rglob("executor_output.json")}
    train_metrics = outputs["train"]["artifacts"]["metrics"]["artifacts"][0]["metadata"]
    assert train_metrics["steps"] == params["steps"]
    assert {"tokens", "final_loss", "restarts_inprocess", "restarts_injob", "restarts_node", "restarts_cluster", "goodput",
            "step_attempts"} <= set(train_metrics)
    model_meta = outputs["train"]["artifacts"]["checkpoint"]["artifacts"][0]["metadata"]
    assert model_meta["checkpoint_dir"] == str(layout.checkpoint_dir) and model_meta["step"] == params["steps"]
    eval_metrics = outputs["evaluate-checkpoint"]["artifacts"]["metrics"]["artifacts"][0]["metadata"]
    assert {"val_loss", "perplexity", "step", "val_tokens", "promote"} <= set(eval_metrics)

    reports = list((tmp_path / "kfp").rglob("evaluate-checkpoint/report"))
    report = reports[0].read_text() if reports else ""
    # the loss and recovery charts always; the straggler chart whenever the ranks reported step times
    for title in ("Training loss by step", "Recoveries by layer over time", "Step time per rank"):
        assert f"<title>{title}" in report, title
    summary = summarize(run_root)
    assert summary["decision"]["promote"] is True  # nothing was promoted in this fresh workdir
    record = json.loads((tmp_path / "work" / "promoted-tiny.json").read_text())
    assert record["run_id"] == layout.run_id
    assert "val loss" in format_summary(summary, 1.0)

    # What is promoted is the Hugging Face directory exported from the step the gate evaluated.
    export_dir = layout.export_dir(params["steps"])
    assert record["checkpoint"] == str(layout.checkpoint_dir / f"step-{params['steps']:08d}")
    assert (record["export_dir"], record["model_uri"], record["model_format"]) == (
        str(export_dir), f"file://{export_dir}", "safetensors")
    assert record["checkpoint_dir"] == str(layout.checkpoint_dir)  # init_from=promoted still finds it
    exported = outputs["export-model"]["artifacts"]["exported_model"]["artifacts"][0]["metadata"]
    assert exported["export_dir"] == str(export_dir) and exported["source_checkpoint"] == record["checkpoint"]
    assert json.loads((export_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert not list(export_dir.parent.glob("*.partial"))
    import transformers  # a dev dependency (the hf-model branch), as trainer.export is its CLI

    model = transformers.AutoModelForCausalLM.from_pretrained(export_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(export_dir)
    assert model.config.vocab_size >= len(tokenizer) and tokenizer("def f(x):")["input_ids"]
