"""The Tensorboard example is a resource the tensorboard-controller's CRD accepts, and it reads the directory
where the trainer writes its event files for a run of the pipeline with its default workdir and volume."""
from __future__ import annotations

import re
from pathlib import PurePosixPath

import pytest
import yaml
from deploy_checks import DEPLOY, validate_custom

from components.lib.layout import RunLayout
from components.lib.params import DEFAULTS, SHARED_MOUNT

EXAMPLE = DEPLOY / "examples" / "tensorboard.yaml"
RUN_ID = "3f2a9c1b-5d6e-4f00-8a1b-1234567890ab"  # a KFP run id
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@pytest.fixture(scope="module")
def tensorboard() -> dict:
    return yaml.safe_load(EXAMPLE.read_text().replace("RUN_ID", RUN_ID))


def test_example_passes_the_tensorboard_crd(tensorboard):
    assert (tensorboard["apiVersion"], tensorboard["kind"]) == ("tensorboard.kubeflow.org/v1alpha1", "Tensorboard")
    validate_custom(tensorboard)
    name = tensorboard["metadata"]["name"]
    assert DNS1123.match(name) and len(name) <= 63, name
    assert "namespace" not in tensorboard["metadata"], "applied with kubectl -n, like the rest of deploy/"


def test_validator_rejects_a_misspelled_field(tensorboard):
    bad = {**tensorboard, "spec": {"logsPath": tensorboard["spec"]["logspath"]}}
    with pytest.raises(AssertionError, match="logspath|logsPath"):
        validate_custom(bad)


def test_example_points_at_the_runs_train_directory(tensorboard):
    run_dir = PurePosixPath(str(RunLayout(DEFAULTS.workdir, RUN_ID).run_dir))
    on_volume = run_dir.relative_to(SHARED_MOUNT)  # the PVC's root is mounted at SHARED_MOUNT
    assert tensorboard["spec"]["logspath"] == f"pvc://{DEFAULTS.pvc_name}/{on_volume}"
