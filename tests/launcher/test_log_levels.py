"""The launcher logs routine progress at INFO and keeps WARNING for what needs a person's attention."""

from __future__ import annotations

import io
import logging

import pytest
from k8s_stub import Scenario, StubCluster, condition, master_exit, restarting, succeeding

from components.lib.pytorchjob import TrainJobSpec, job_name

pytestmark = pytest.mark.timeout(30)
LOGGER = "components.lib.k8s_launcher"


def spec() -> TrainJobSpec:
    return TrainJobSpec(name=job_name("run-7", "train"), namespace="ml", image="trainer:1", args=["--train.steps=3"],
                        active_deadline_seconds=15)


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_a_clean_run_logs_no_warnings(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    with StubCluster(Scenario(succeeding("step 1 loss 3.0"))) as cluster:
        assert cluster.launcher(io.StringIO()).run(spec()).state == "Succeeded"
    assert records(caplog, logging.WARNING) == []
    info = "\n".join(records(caplog, logging.INFO))
    assert "created PyTorchJob" in info and "-> Running" in info and "succeeded after" in info


def test_restarts_are_warnings(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    scenario = Scenario(restarting(1) + [master_exit(0), condition("Succeeded")], step_delay_s=0.15)
    with StubCluster(scenario) as cluster:
        assert cluster.launcher(io.StringIO()).run(spec()).restarts == 1
    assert any("cluster-level restart 1" in m for m in records(caplog, logging.WARNING))
