"""Promotion into Kubeflow Model Registry (components/lib/registry.py) against a stub of its REST API built
from the client's own OpenAPI models (tests/pipelines/mr_stub.py): no network, no real registry. What is
registered is the exported Hugging Face directory of the evaluated step, not the run's checkpoint folder."""

import json

import pytest
from mr_stub import ModelRegistryStub

from components.lib import registry
from components.lib.evaluation import PromotionConflict, read_registry, record_id, write_registry
from components.lib.params import ParamError, PipelineParams, registry_location

RECORD = {"checkpoint_dir": "/mnt/shared/resilient-train/run-7/checkpoints", "step": 400, "model": "tiny",
          "val_loss": 3.25, "perplexity": 25.8, "val_tokens": 8192,
          "checkpoint": "/mnt/shared/resilient-train/run-7/checkpoints/step-00000400", "run_id": "run-7",
          "data_dir": "/mnt/shared/resilient-train/run-7/data", "tokenizer_sha256": "ab" * 32,
          "val_sha256": "cd" * 32, "goodput": 0.93,
          "export_dir": "/mnt/shared/resilient-train/run-7/export/step-00000400",
          "model_uri": "pvc://train-shared/resilient-train/run-7/export/step-00000400",
          "model_format": "safetensors", "export_dtype": "bfloat16"}


def properties(version):
    return {k: next(x for n, x in v.items() if n != "metadataType") for k, v in version["customProperties"].items()}


@pytest.fixture()
def stub():
    with ModelRegistryStub() as server:
        yield server


def test_promotion_registers_a_version_with_the_record(stub):
    location = f"{stub.address}/resilient-train-tiny"
    assert read_registry(location) is None  # nothing promoted yet
    message = write_registry(location, RECORD, expected_current="")
    assert message == f"{location} version run-7-step-400"
    (model,) = stub.store["registered_models"].values()
    (version,) = stub.store["model_versions"].values()
    (artifact,) = stub.store["artifacts"].values()
    assert model["name"] == "resilient-train-tiny" and version["name"] == "run-7-step-400"
    props = properties(version)
    # metrics, and the source checkpoint (the evaluated step, and the run's folder warm starts read)
    assert props["val_loss"] == 3.25 and props["perplexity"] == 25.8 and props["goodput"] == 0.93
    assert int(props["step"]) == 400 and props["run_id"] == "run-7"
    assert props["checkpoint"] == RECORD["checkpoint"] and props["checkpoint_dir"] == RECORD["checkpoint_dir"]
    assert props["export_dir"] == RECORD["export_dir"] and props["promoted_at"]
    # the model artifact is the export, in a format a server loads; its source is this pipeline run
    assert artifact["uri"] == RECORD["model_uri"]
    assert (artifact["modelFormatName"], artifact["modelFormatVersion"]) == ("safetensors", "1")
    assert (artifact["modelSourceKind"], artifact["modelSourceClass"], artifact["modelSourceId"]) == (
        "pipelines", "pipelinerun", "run-7")


def test_a_record_without_an_export_is_not_registered(stub):
    location = f"{stub.address}/m"
    unexported = {k: v for k, v in RECORD.items() if k not in ("export_dir", "model_uri", "model_format")}
    with pytest.raises(registry.RegistryError, match="no exported model to register"):
        write_registry(location, unexported, expected_current="")
    assert not stub.store["model_versions"]


def test_the_newest_version_is_the_promoted_model(stub):
    location = f"{stub.address}/m"
    write_registry(location, RECORD, expected_current="")
    better = {**RECORD, "run_id": "run-8", "step": 600, "val_loss": 3.0, "checkpoint_dir": "/mnt/shared/r8/ckpt",
              "goodput": None, "model_uri": "pvc://train-shared/r8/export/step-00000600"}
    write_registry(location, better, expected_current=record_id(RECORD))
    current = read_registry(location)
    assert record_id(current) == record_id(better)
    assert current["val_loss"] == 3.0 and "goodput" not in current  # absent values are not invented
    assert current["registry_version"] == "run-8-step-600"
    assert current["model_uri"] == better["model_uri"]  # what a server (or the KServe example) loads


def test_stale_gate_decision_is_refused(stub):
    location = f"{stub.address}/m"
    write_registry(location, RECORD, expected_current="")
    with pytest.raises(PromotionConflict, match="changed since the gate"):
        write_registry(location, {**RECORD, "run_id": "run-9", "step": 700}, expected_current="")
    assert len(stub.store["model_versions"]) == 1


def test_stub_refuses_bodies_the_schema_refuses(stub):
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{stub.address}/api/model_registry/v1/model_versions", method="POST",
                                     data=json.dumps({"name": "v"}).encode(),  # no registeredModelId
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request)
    assert err.value.code == 400 and "registeredModelId" in err.value.read().decode()


def test_addresses():
    assert registry_location("https://mr.example:8443", "/mnt/shared/w", "tiny") == "https://mr.example:8443/resilient-train-tiny"
    assert registry_location("https://mr.example/custom", "/w", "tiny") == "https://mr.example/custom"
    assert registry_location("", "/w", "tiny") == "/w/promoted-tiny.json"  # the JSON file stays the default
    address = registry.RegistryAddress.parse("https://mr.example/custom")
    assert (address.server, address.port, address.model_name) == ("https://mr.example", 443, "custom")
    with pytest.raises(registry.RegistryError, match="one path segment"):
        registry.RegistryAddress.parse("https://mr.example/a/b")
    PipelineParams(promoted_registry="https://mr.example:8443", image="registry.example.com/rt:1").validate()
    with pytest.raises(ParamError, match="Model Registry address"):
        PipelineParams(promoted_registry="s3://bucket/x", image="registry.example.com/rt:1").validate()


def test_unreachable_registry_says_what_to_check():
    with pytest.raises(registry.RegistryError, match="cannot reach Model Registry"):
        registry.ModelRegistryStore("http://127.0.0.1:9/m").read()
