"""The KServe example serves what the pipeline promotes: it passes KServe's v0.15.2 InferenceService CRD (vendored
in deploy/crds), uses the Hugging Face runtime's model format, and its storageUri is the URI the export step
gives the directory of a run with the default workdir and volume (the URI the registry records)."""
from __future__ import annotations

import pytest
import yaml
from deploy_checks import DEPLOY, validate_custom

from components.lib.export_step import served_uri
from components.lib.layout import RunLayout
from components.lib.params import DEFAULTS

EXAMPLE = DEPLOY / "examples" / "inferenceservice.yaml"
RUN_ID, STEP = "3f2a9c1b-5d6e-4f00-8a1b-1234567890ab", 20000
PLACEHOLDER = "pvc://train-shared/resilient-train/RUN_ID/export/step-STEP"


@pytest.fixture(scope="module")
def isvc() -> dict:
    uri = served_uri(RunLayout(DEFAULTS.workdir, RUN_ID).export_dir(STEP), DEFAULTS.pvc_name)
    text = EXAMPLE.read_text()
    assert PLACEHOLDER in text, "the sed command in the example's comment no longer matches its storageUri"
    return yaml.safe_load(text.replace(PLACEHOLDER, uri))


def test_example_passes_the_kserve_crd(isvc):
    assert (isvc["apiVersion"], isvc["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    validate_custom(isvc)
    assert "namespace" not in isvc["metadata"], "applied with kubectl -n, like the rest of deploy/"


def test_validator_rejects_a_misplaced_field(isvc):
    bad = yaml.safe_load(yaml.safe_dump(isvc))
    bad["spec"]["predictor"]["model"]["storageURI"] = bad["spec"]["predictor"]["model"].pop("storageUri")
    with pytest.raises(AssertionError, match="storageURI"):
        validate_custom(bad)


def test_example_serves_the_promoted_export(isvc):
    model = isvc["spec"]["predictor"]["model"]
    assert model["modelFormat"] == {"name": "huggingface"}  # kserve-huggingfaceserver's supported format
    assert model["storageUri"] == f"pvc://train-shared/resilient-train/{RUN_ID}/export/step-00020000"
    assert model["resources"]["limits"]["nvidia.com/gpu"] == "1"
