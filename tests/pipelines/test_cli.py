"""``python -m pipelines.cli``: cron and parameter validation, and the kfp.Client calls (a fake client)."""

from types import SimpleNamespace

import kfp
import pytest

from pipelines import cli


def test_cron_needs_six_fields_seconds_first():
    assert cli.validate_cron("0 0 3 * * *") == "0 0 3 * * *"
    with pytest.raises(cli.CliError, match="did you mean '0 0 3 \\* \\* \\*'"):
        cli.validate_cron("0 3 * * *")
    with pytest.raises(cli.CliError, match="first field is the second"):
        cli.validate_cron("75 0 3 * * *")
    with pytest.raises(cli.CliError, match="six fields"):
        cli.validate_cron("* * *")


def test_params_are_typed_by_the_pipeline():
    values = cli.parse_params(["steps=2000", "inprocess_restart=false", "min_improvement=0.01",
                               'node_selector={"pool": "h100"}', "faults=0:5:sigkill"])
    assert values == {"steps": 2000, "inprocess_restart": False, "min_improvement": 0.01,
                      "node_selector": {"pool": "h100"}, "faults": "0:5:sigkill"}
    with pytest.raises(cli.CliError, match="unknown parameter 'stpes'"):
        cli.parse_params(["stpes=1"])
    with pytest.raises(cli.CliError, match="not a valid int"):
        cli.parse_params(["steps=many"])


class FakeClient:
    calls: list = []

    def __init__(self, host, namespace=None):
        self.calls.append(("init", host, namespace))

    def create_experiment(self, name, namespace=None):
        self.calls.append(("experiment", name))
        return SimpleNamespace(experiment_id="exp-1")

    def create_run_from_pipeline_package(self, pipeline_file, **kw):
        self.calls.append(("run", pipeline_file, kw))
        return SimpleNamespace(run_id="run-1")

    def create_recurring_run(self, **kw):
        self.calls.append(("recurring", kw))
        return SimpleNamespace(recurring_run_id="rr-1")


@pytest.fixture
def fake_client(monkeypatch):
    FakeClient.calls = []
    monkeypatch.setattr(kfp, "Client", FakeClient)
    return FakeClient.calls


def test_submit_validates_then_submits(fake_client, capsys):
    assert cli.main(["submit", "--host", "http://kfp", "--param", "steps=10", "--param",
                     "checkpoint_interval=20"]) == 2
    assert "steps (10) must be greater than checkpoint_interval (20)" in capsys.readouterr().err
    assert fake_client == []  # nothing reached the cluster
    assert cli.main(["submit", "--host", "http://kfp", "--experiment", "e", "--param", "steps=100"]) == 0
    (_, pkg, kw) = next(c for c in fake_client if c[0] == "run")
    assert pkg.endswith("pipeline.yaml") and kw["arguments"] == {"steps": 100}
    assert kw["experiment_id"] == "exp-1" and kw["service_account"] == "train-launcher"


def test_schedule_creates_a_recurring_run(fake_client):
    assert cli.main(["schedule", "--host", "http://kfp", "--experiment", "nightly", "--cron", "0 0 3 * * *",
                     "--name", "nightly-train", "--param", "init_from=promoted"]) == 0
    (_, kw) = next(c for c in fake_client if c[0] == "recurring")
    assert kw["cron_expression"] == "0 0 3 * * *" and kw["job_name"] == "nightly-train"
    assert kw["max_concurrency"] == 1 and kw["no_catchup"] is True and kw["params"] == {"init_from": "promoted"}
    assert kw["experiment_id"] == "exp-1"


def test_schedule_rejects_a_unix_cron_before_connecting(fake_client, capsys):
    assert cli.main(["schedule", "--host", "http://kfp", "--cron", "0 3 * * *", "--name", "n"]) == 2
    assert fake_client == [] and "six" in capsys.readouterr().err
