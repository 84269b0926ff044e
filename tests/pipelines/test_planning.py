"""The goodput planner seen from the components and the pipeline CLI (``components.lib.planning``, ``pipelines.cli
plan``): it runs as a process, its table and chart go into the HTML report, a failure is one line in the report."""

from __future__ import annotations

import re
from pathlib import Path

from components.lib.params import DEFAULTS
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


def test_the_evaluation_plans_with_the_runs_spares_and_says_which_inputs_were_measured(tmp_path):
    """The run's spare nodes and the pipeline's replacement_pod_s reach the planner: the pipeline default stays the
    planner's documented default (varied in its band), another value is given; the report lists every input."""
    plan, note = plan_for_report(DEMO_RUN, tmp_path / "a", gpus=1024, trials=4, extra=SETTINGS, spares=3,
                                 gpus_per_node=4, replacement_s=DEFAULTS.replacement_pod_s)
    assert note is None and plan["cluster"]["spare_nodes"] == 3 and plan["cluster"]["gpus_per_node"] == 4
    assert {r["spares"] for r in plan["configurations"].values()} == {3}
    kinds = {r["input"]: r["kind"] for r in plan["inputs"]}
    assert kinds["replacement_s"] == "default" and kinds["recovery_node"] == "measured"
    page = render_report(title="t", metrics=[], ledger=[], planning=(plan, None))
    assert "measured?" in page and re.search(r"<td>replacement_s</td><td>350 s</td><td>default</td>", page)
    given, _ = plan_for_report(DEMO_RUN, tmp_path / "b", gpus=1024, trials=4, extra=SETTINGS, replacement_s=120.0)
    row = next(r for r in given["inputs"] if r["input"] == "replacement_s")
    assert (row["kind"], row["value"]) == ("given", 120.0) and given["cluster"]["gpus_per_node"] == 8
