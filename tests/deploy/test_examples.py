"""The recurring-run example calls the KFP SDK as it is, with a six-field cron (seconds first)."""
from __future__ import annotations

import ast
import inspect
import re

import kfp
from deploy_checks import DEPLOY

EXAMPLE = DEPLOY / "examples" / "recurring-run.md"


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, flags=re.S)


def test_recurring_run_example_matches_the_kfp_client():
    (code,) = python_blocks(EXAMPLE.read_text())
    calls = {node.func.attr: node for node in ast.walk(ast.parse(code))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    for method in ("create_experiment", "create_recurring_run"):
        params = inspect.signature(getattr(kfp.Client, method)).parameters
        unknown = {kw.arg for kw in calls[method].keywords} - set(params)
        assert not unknown, f"kfp.Client.{method} has no parameter(s) {unknown} (kfp {kfp.__version__})"
    kwargs = {kw.arg: kw.value for kw in calls["create_recurring_run"].keywords}
    cron = ast.literal_eval(kwargs["cron_expression"])
    fields = cron.split()
    assert len(fields) == 6 and fields[0] == "0", f"KFP cron needs six fields, seconds first; got {cron!r}"
    assert ast.literal_eval(kwargs["service_account"]) == "train-launcher"
    assert re.search(rf"--cron '{re.escape(cron)}'", EXAMPLE.read_text()), "CLI and SDK examples differ"
