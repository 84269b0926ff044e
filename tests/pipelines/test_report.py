"""The HTML report: charts present, every text escaped, nothing external, numbers from the ledger."""

import json
import re

from pipeline_fakes import write_run_files

from components.lib.report import read_jsonl, render_report, summarize_ledger


def sample(tmp_path):
    write_run_files(tmp_path, steps=30, restarts={"inprocess": 1, "injob": 2, "cluster": 1})
    metrics, _ = read_jsonl(tmp_path / "metrics.jsonl")
    ledger, bad = read_jsonl(tmp_path / "recovery.jsonl")
    return metrics, ledger, bad


def test_ledger_summary_counts_restarts_per_layer(tmp_path):
    _, ledger, bad = sample(tmp_path)
    assert bad == 1  # the torn last line is skipped, not fatal
    s = summarize_ledger(ledger)
    assert s["restarts"] == {"inprocess": 1, "injob": 2, "cluster": 1}
    assert s["faults"] == 4 and s["goodput"] == 0.8
    assert s["recovery_s"]["injob"] == 6.0


def test_report_has_charts_and_escapes_text(tmp_path):
    metrics, ledger, _ = sample(tmp_path)
    ledger.append({"event": "recovered", "layer": "injob", "step": 9, "fault_kind": "<script>alert(1)</script>",
                   "fault_step": 8, "recovery_s": 1.0, "steps_redone": 2, "time": ledger[-1]["time"] + 1})
    page = render_report(title="run <b>x</b> & co", metrics=metrics, ledger=ledger,
                         evaluation={"val_loss": 4.5, "model": "<tiny>"},
                         decision={"reason": "promoted: <because>"}, run_info={"run id": "r1"})
    assert page.count("<svg") == 2 and "<path d=\"M" in page  # loss curve + recovery timeline
    assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "run &lt;b&gt;x&lt;/b&gt; &amp; co" in page and "&lt;tiny&gt;" in page and "&lt;because&gt;" in page
    assert "80.0%" in page  # goodput
    for title in ("in-process", "in-job (ft_launcher)", "cluster / pipeline retry"):
        assert title in page
    urls = set(re.findall(r"(?:src|href)=\"([^\"]+)\"", page)) | set(re.findall(r"https?://[^\"' <]+", page))
    assert urls <= {"http://www.w3.org/2000/svg"}, f"external resources: {urls}"


def test_report_without_data_says_so(tmp_path):
    page = render_report(title="empty", metrics=[], ledger=[])
    assert "No step metrics were recorded." in page and "No recoveries were recorded." in page
    assert "not recorded" in page


def test_non_finite_losses_are_skipped(tmp_path):
    metrics = [{"event": "step", "step": 1, "loss": 5.0}, {"event": "step", "step": 2, "loss": float("nan")},
               {"event": "step", "step": 3, "loss": 4.0}]
    page = render_report(title="t", metrics=json.loads(json.dumps(metrics)), ledger=[])
    assert "nan" not in page.split("<svg", 1)[1].split("</svg>")[0].lower()
