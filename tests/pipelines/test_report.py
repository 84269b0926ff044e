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
    assert s["restarts"] == {"inprocess": 1, "injob": 2, "node": 0, "cluster": 1}
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


def test_straggler_chart_marks_the_named_rank_and_the_eviction(tmp_path):
    def report(step, slow):
        return {"event": "straggler", "step": step, "basis": "host", "threshold": 0.75, "stragglers": [1] if slow else [],
                "ranks": [{"rank": 0, "host": "node-a", "relative": 1.0, "individual": 1.0, "step_time_s": 0.30},
                          {"rank": 1, "host": "<node-b>", "relative": 0.6 if slow else 0.98, "individual": 0.6,
                           "step_time_s": 0.45 if slow else 0.30}]}

    metrics = [report(10, False), report(20, True), report(30, True)]
    ledger = [{"event": "straggler_evicted", "step": 30, "rank": 1, "host": "<node-b>", "relative": 0.6, "reports": 2,
               "threshold": 0.75, "checkpoint": 30}]
    page = render_report(title="t", metrics=metrics, ledger=ledger)
    chart = page.split("Step time per rank at each straggler report", 1)[1].split("</svg>", 1)[0]
    assert chart.count('<circle') == 2 and chart.count('fill="#d62728"><title>step') == 2  # rank 1's two reports
    assert chart.count('stroke="#d62728" stroke-width') == 1  # rank 1's line in red, rank 0's not
    assert "rank 1 on &lt;node-b&gt; evicted as a straggler after 2 report(s) below 0.75" in page
    assert "<node-b>" not in page


def test_no_straggler_reports_says_so():
    assert "No straggler reports were recorded." in render_report(title="t", metrics=[], ledger=[])
