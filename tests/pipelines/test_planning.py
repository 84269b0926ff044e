"""The goodput planner seen from the components and the pipeline CLI (``components.lib.planning``, ``pipelines.cli
plan``): it runs as a process, its table and chart go into the HTML report, a failure is one line in the report."""

from __future__ import annotations

import re
from pathlib import Path

from components.lib.planning import CHART_FILE, plan_for_report
from components.lib.report import render_report
from pipelines import cli

DEMO_RUN = Path(__file__).resolve().parents[1] / "unit" / "planner_data" / "demo-run"
SETTINGS = ["--cost", "interval=10", "--cost", "persist_every=1"]  # the demo's (tests/unit/planner_data/README.md)


def test_the_report_shows_the_planners_table_and_chart(tmp_path):
    plan, note = plan_for_report(DEMO_RUN, tmp_path, gpus=1024, trials=8, extra=SETTINGS)
    assert note is None and plan is not None
    assert plan["cluster"]["gpus"] == 1024 and "recommendation" in plan
    png = (tmp_path / CHART_FILE).read_bytes()
    assert png.startswith(b"\x89PNG")
    page = render_report(title="t", metrics=[], ledger=[], planning=(plan, png))
    assert "Goodput at scale (planner)" in page and "today&#x27;s layers" in page and "vs goal 0.95" in page
    assert re.search(r"without node-local</td><td>\d+\.\d+%</td>", page)
    sources = re.findall(r"src=\"([^\"]+)\"", page)
    assert len(sources) == 1 and sources[0].startswith("data:image/png;base64,")  # inline: nothing external


def test_a_planner_failure_is_one_line_for_the_report(tmp_path):
    empty = tmp_path / "run"
    empty.mkdir()
    plan, note = plan_for_report(empty, tmp_path / "out", trials=4)
    assert plan is None and "\n" not in note
    assert note.startswith("the goodput planner failed: error: ") and "recovery.jsonl does not exist" in note
    page = render_report(title="t", metrics=[], ledger=[], notes=[f"goodput at scale: not projected ({note})"])
    assert "Goodput at scale (planner)" not in page and "not projected" in page


def test_cli_plan_passes_its_arguments_and_exit_code(capfd):
    assert cli.main(["plan", "--run", str(DEMO_RUN), *SETTINGS, "--gpus", "4", "--trials", "4"]) == 2
    assert "smaller than one node" in capfd.readouterr().err
    assert cli.main(["plan", "--run", str(DEMO_RUN), *SETTINGS, "--gpus", "64", "--trials", "4", "--days", "2"]) == 0
    assert "today's layers" in capfd.readouterr().out
