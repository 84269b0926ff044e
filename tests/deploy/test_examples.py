"""The documented commands run as written: every ``python -m pipelines...`` line of the recurring-run example
and of the cluster and bring-your-own guides (docs/) goes through the real argument parsing and validation (against a
kfp.Client stand-in that checks each call against the real client's signature), and the SDK example runs."""
from __future__ import annotations

import inspect
import os
import re
import shlex
from types import SimpleNamespace

import kfp
import kfp_server_api
import pytest
from deploy_checks import DEPLOY, REPO

from pipelines import cli
from pipelines import compile as compile_cli

EXAMPLE = DEPLOY / "examples" / "recurring-run.md"
CLUSTER_GUIDE = REPO / "docs" / "cluster.md"
BYO_GUIDE = REPO / "docs" / "data-and-model.md"
ENV = {"IMAGE": "registry.example.com/you/resilient-train:0.1.0", "NAMESPACE": "kubeflow-user-example-com",
       "KFP_HOST": "https://kubeflow.example.com/pipeline", "KFP_TOKEN": "token-from-kubectl"}
REAL_CLIENT = kfp.Client
ENTRYPOINTS = {"pipelines.cli": cli.main, "pipelines.compile": compile_cli.main}


class HealthzApi:
    """kfp_server_api's HealthzServiceApi without a server: a multi-user KFP."""

    def healthz_service_get_healthz(self, *args, **kwargs):
        inspect.signature(kfp_server_api.HealthzServiceApi.healthz_service_get_healthz).bind(self, *args, **kwargs)
        SignatureCheckingClient.calls.append(("healthz", kwargs))
        return SimpleNamespace(multi_user=True)


class SignatureCheckingClient:
    """kfp.Client without a server: every call must bind to the real method's signature."""

    calls: list = []

    def __init__(self, *args, **kwargs):
        inspect.signature(REAL_CLIENT.__init__).bind(self, *args, **kwargs)
        self.calls.append(("__init__", kwargs))
        self._healthz_api = HealthzApi()  # what the CLI's one health probe calls, as kfp.Client has it

    def __getattr__(self, method):
        real = getattr(REAL_CLIENT, method)

        def call(*args, **kwargs):
            inspect.signature(real).bind(self, *args, **kwargs)
            self.calls.append((method, kwargs))
            return SimpleNamespace(experiment_id="exp-1", run_id="run-1", recurring_run_id="rr-1")
        return call


@pytest.fixture
def cluster(monkeypatch, tmp_path):
    """A working directory, the cluster guide's environment variables, and the stand-in client."""
    SignatureCheckingClient.calls = []
    monkeypatch.setattr(kfp, "Client", SignatureCheckingClient)
    monkeypatch.chdir(tmp_path)
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(cli.IN_CLUSTER_ENV, raising=False)
    return SignatureCheckingClient.calls


def blocks(markdown: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", markdown, flags=re.S)


def pipeline_commands(markdown: str) -> list[list[str]]:
    """Every ``python -m pipelines.X ...`` command of the bash blocks, continuation lines joined, $VARS
    expanded as the shell would (from `ENV`)."""
    commands = []
    for block in blocks(markdown, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(os.path.expandvars(line), comments=True)
            if words[:2] == ["python", "-m"] and words[2] in ENTRYPOINTS:
                commands.append(words[2:])
    return commands


def run(command: list[str]) -> int:
    module, *argv = command
    return ENTRYPOINTS[module](argv)


def test_recurring_run_cli_example_runs_as_written(cluster):
    commands = pipeline_commands(EXAMPLE.read_text())
    assert [c[:2] for c in commands] == [["pipelines.cli", "compile"], ["pipelines.cli", "schedule"]]
    for command in commands:
        assert run(command) == 0, command
    (kwargs,) = [kw for method, kw in cluster if method == "create_recurring_run"]
    assert kwargs["job_name"] == "nightly-train" and kwargs["cron_expression"] == "0 0 3 * * *"
    assert kwargs["service_account"] == cli.SERVICE_ACCOUNT and kwargs["params"] == {"init_from": "promoted"}
    (client,) = [kw for method, kw in cluster if method == "__init__"]
    assert client["existing_token"] == ENV["KFP_TOKEN"] and client["host"] == ENV["KFP_HOST"]


def test_recurring_run_sdk_example_runs_against_the_kfp_client(cluster):
    (code,) = blocks(EXAMPLE.read_text(), "python")
    exec(compile(code, str(EXAMPLE), "exec"), {})  # noqa: S102 - the documented example, against the stand-in
    (kwargs,) = [kw for method, kw in cluster if method == "create_recurring_run"]
    fields = kwargs["cron_expression"].split()
    assert len(fields) == 6 and fields[0] == "0", f"KFP cron needs six fields, seconds first; got {fields}"
    assert cli.validate_cron(kwargs["cron_expression"])
    assert kwargs["service_account"] == cli.SERVICE_ACCOUNT
    cli_schedule = [c for c in pipeline_commands(EXAMPLE.read_text()) if c[1] == "schedule"][0]
    assert cli_schedule[cli_schedule.index("--cron") + 1] == kwargs["cron_expression"], "CLI and SDK differ"


def test_cluster_guide_commands_run_as_written(cluster):
    commands = pipeline_commands(CLUSTER_GUIDE.read_text())
    assert {tuple(c[:2]) for c in commands} >= {("pipelines.compile", "--image"), ("pipelines.cli", "submit"),
                                                ("pipelines.cli", "schedule")}
    for command in commands:
        assert run(command) == 0, command
    submitted = [kw for method, kw in cluster if method == "create_run_from_pipeline_package"]
    assert submitted and all(kw["service_account"] == cli.SERVICE_ACCOUNT for kw in submitted)


def test_bring_your_own_guide_commands_submit_those_parameters(cluster):
    for command in pipeline_commands(CLUSTER_GUIDE.read_text()):  # the compile step writes the package it submits
        if command[:2] == ["pipelines.compile", "--image"]:
            assert run(command) == 0
    commands = pipeline_commands(BYO_GUIDE.read_text())
    assert [c[:2] for c in commands] == [["pipelines.cli", "submit"]]
    assert run(commands[0]) == 0
    (kwargs,) = [kw for method, kw in cluster if method == "create_run_from_pipeline_package"]
    arguments = kwargs["arguments"]
    assert arguments["base_model"] == "hf://meta-llama/Llama-3.2-1B" and arguments["corpus"].startswith("s3://")
    assert arguments["corpus_secret"] == "train-data-credentials" and arguments["text_field"] == "text"
