"""The HTML report: charts present, every text escaped, nothing external, numbers from the ledger."""

import json
import re

from pipeline_fakes import write_run_files

from components.lib.report import read_jsonl, render_report, size_periods, summarize_ledger


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
        return {"event": "straggler", "step": step, "basis": "host", "threshold": 0.75,
                "stragglers": [1] if slow else [],
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


T0 = 1_700_000_000.0


def elastic_run():
    """A 2 -> 1 -> 2 ranks run as the trainer writes it (shape of a real run's files): a node lost after step 4
    (resumed from step 3 on one rank, accumulation 2), back after step 8 (resumed from step 8 on two)."""
    def step(t, s, tps):
        return {"event": "step", "time": T0 + t, "step": s, "loss": 7.0 - s * 0.1, "tokens_per_s": tps,
                "step_time_s": 256 / tps}

    def size(event, t, ranks, acc, **kw):
        return {"event": event, "time": T0 + t, "world_size": ranks, "accumulation": acc, "tokens_per_step": 256, **kw}

    metrics = [size("start", 0.0, 2, 1), *(step(s, s, tps) for s, tps in zip((1, 2, 3, 4), (500, 520, 540, 560))),
               size("resume", 19.999, 1, 2, step=3),
               *(step(17 + s, s, tps) for s, tps in zip((4, 5, 6, 7, 8), (1000, 1100, 1200, 1300, 1400))),
               size("resume", 39.999, 2, 1, step=8), *(step(32 + s, s, tps) for s, tps in zip((9, 12), (600, 700))),
               {"event": "summary", "time": T0 + 45.0, "steps": 12}]

    def rec(event, t, rank=0, **kw):
        return {"event": event, "time": T0 + t, "rank": rank, "pid": 1, "attempt": 0, "iteration": 0, **kw}

    ledger = [rec("start", 0.004, world_size=2), rec("exit", 5.0, code=143, name="TERMINATED", step=5),
              rec("restart", 20.002, layer="injob", resumed_step=3, tier="disk", world_size=1,
                  fault={"kind": "killed", "time": T0 + 5.0, "step": 5}),
              rec("elastic", 20.002, step=3, before=2, after=1, layer="injob", cause="killed"),
              rec("recovered", 21.0, layer="injob", step=4, fault_kind="killed", fault_step=5, recovery_s=16.0,
                  steps_redone=1),
              *(rec("restart", 40.002, rank=r, layer="node", resumed_step=8, tier="disk", world_size=2, joined=[1],
                    fault={"kind": "<killed>", "time": T0 + 30.0, "step": 9}) for r in (1, 0)),
              rec("elastic", 40.002, step=8, before=1, after=2, layer="node", cause="<killed>"),
              rec("recovered", 41.0, layer="node", step=9, fault_kind="<killed>", fault_step=9, recovery_s=11.0,
                  steps_redone=0),
              rec("summary", 45.5, steps=12, wall_s=45.5, productive_s=30.0, goodput=0.66)]
    return metrics, ledger


def test_world_size_section_has_a_row_per_size_with_its_throughput():
    metrics, ledger = elastic_run()
    periods = size_periods(metrics, ledger)
    got = [(p["ranks"], p["from_step"], p["to_step"], round(p["end"] - p["start"], 3), p["steps"], p["tokens_per_s"],
            p["accumulation"]) for p in periods]
    assert got == [(2, 0, 3, 20.002, 4, 530.0, 1), (1, 3, 8, 20.0, 5, 1200.0, 2), (2, 8, 12, 5.498, 4, 650.0, 1)]
    assert summarize_ledger(ledger)["size_changes"] == 2

    page = render_report(title="t", metrics=metrics, ledger=ledger)
    section = page.split("<h2>World size</h2>", 1)[1].split("<h2>", 1)[0]
    chart = section.split("<title>World size over time</title>", 1)[1].split("</svg>", 1)[0]
    assert "step 3: 2 -&gt; 1 ranks, cause killed, in-job (ft_launcher)" in chart
    assert "step 8: 1 -&gt; 2 ranks, cause &lt;killed&gt;, node (replaced or spare)" in chart
    assert chart.count('stroke-dasharray="4 3"') == 2 and "<killed>" not in page
    rows = [re.findall(r"<td>([^<]*)</td>", row) for row in re.findall(r"<tr><td>.*?</tr>", section)]
    assert rows == [["2", "0", "3", "20.0", "4", "530", "1", "start"],
                    ["1", "3", "8", "20.0", "5", "1200", "2", "killed (injob)"],
                    ["2", "8", "12", "5.5", "4", "650", "1", "&lt;killed&gt; (node)"]]
    timeline = page.split("<h2>Recovery timeline</h2>", 1)[1].split("<h2>", 1)[0]
    assert "world size 2 -&gt; 1 ranks" in timeline and "world size 1 -&gt; 2 ranks" in timeline
    assert "changes of world size" in page


def test_a_run_of_one_size_has_no_world_size_section(tmp_path):
    metrics, ledger, _ = sample(tmp_path)
    assert summarize_ledger(ledger)["size_changes"] == 0
    page = render_report(title="t", metrics=metrics, ledger=ledger)
    assert "World size" not in page and "world size" not in page


def test_torn_elastic_records_never_raise():
    metrics, ledger = elastic_run()
    garbage = [{"event": "elastic"}, {"event": "elastic", "time": "soon", "after": 1},
               {"event": "elastic", "time": T0 + 30, "after": "2", "rank": 0},
               {"event": "elastic", "time": T0 + 31, "after": 4, "rank": 3},  # not rank 0's: ignored
               {"event": "start", "world_size": "two", "time": None}, {"event": "resume", "accumulation": "a"},
               {"event": "step", "time": "x", "step": "9", "tokens_per_s": "fast"},
               {"event": "step", "time": T0 + 42, "step": 11, "tokens_per_s": None}]
    assert summarize_ledger(garbage)["size_changes"] == 0
    page = render_report(title="t", metrics=garbage, ledger=garbage)
    assert "No readable change of world size." in page
    # a change with every other field missing or of the wrong type, amid garbage metrics
    bare = [{"event": "elastic", "time": T0 + 10, "after": 3, "step": "6", "before": None, "layer": ["x"],
             "cause": {"kind": "<b>"}}]
    periods = size_periods(garbage, bare)
    assert [(p["ranks"], p["from_step"], p["steps"], p["tokens_per_s"], p["accumulation"]) for p in periods] == [
        (None, 0, None, None, None), (3, None, None, None, None)]  # a start record: a fresh start at step 0
    page = render_report(title="t", metrics=garbage, ledger=bare + garbage)
    assert "step ?: ? -&gt; 3 ranks" in page and "<b>" not in page
    page = render_report(title="t", metrics=metrics + garbage, ledger=ledger + garbage)
    assert page.count("<tr><td>") >= 3 and "World size over time" in page


def test_where_the_state_came_from_is_named_per_rank_and_started_over_is_said_so(tmp_path):
    metrics, ledger, _ = sample(tmp_path)
    ledger.append({"event": "recovered", "layer": "node", "step": 2, "fault_kind": "killed", "fault_step": 1,
                   "recovery_s": 1.0, "steps_redone": 0, "tiers": {"none": [0], "peer": [1]},
                   "time": ledger[-1]["time"] + 1})
    page = render_report(title="t", metrics=metrics, ledger=ledger)
    assert "state from nothing: started over (ranks 0), peer (ranks 1)" in page
