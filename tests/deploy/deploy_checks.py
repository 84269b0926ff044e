"""Helpers for the offline checks of the deployment assets: kustomize rendering, schema validation.

Nothing here talks to a cluster. kubectl (for `kubectl kustomize`) comes from `make setup`.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from core_schemas import CORE, validate_core

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = ("local-dev", "gpu-cluster", "kueue", "trainjob")
#: The train step's backend each overlay's Role serves (the operator the cluster runs).
BACKEND_OF = {"local-dev": "pytorchjob", "gpu-cluster": "pytorchjob", "kueue": "pytorchjob", "trainjob": "trainjob"}
CRDS = REPO / "deploy" / "crds"
PYTORCHJOB_CRD = CRDS / "kubeflow.org_pytorchjobs.v1.9.4.yaml"
TENSORBOARD_CRD = CRDS / "tensorboard.kubeflow.org_tensorboards.notebooks-44c97f1.yaml"
INFERENCESERVICE_CRD = CRDS / "serving.kserve.io_inferenceservices.v0.15.2.yaml"
#: (apiVersion, kind) -> (vendored CRD file, served version) of every custom resource we build or ship.
CRD_OF = {
    ("kubeflow.org/v1", "PyTorchJob"): (PYTORCHJOB_CRD, "v1"),
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): (CRDS / "trainer.kubeflow.org_trainjobs.v2.3.0.yaml", "v1alpha1"),
    ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"):
        (CRDS / "trainer.kubeflow.org_clustertrainingruntimes.v2.3.0.yaml", "v1alpha1"),
    ("tensorboard.kubeflow.org/v1alpha1", "Tensorboard"): (TENSORBOARD_CRD, "v1alpha1"),
    ("serving.kserve.io/v1beta1", "InferenceService"): (INFERENCESERVICE_CRD, "v1beta1"),
}
# The oldest Kubernetes we claim to support; kubernetes-validate ships its OpenAPI schemas.
K8S_VERSION = "1.30.0"


def kubectl() -> str:
    """Path of the kubectl that `make setup` installs into the venv (override with $KUBECTL)."""
    path = Path(os.environ.get("KUBECTL") or Path(sys.executable).parent / "kubectl")
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(
            f"kubectl not found at {path}: run `make setup` (it installs kubectl into the venv), "
            "or point $KUBECTL at a kubectl binary",
            pytrace=False,
        )
    return str(path)


@functools.cache
def render(kustomization_dir: Path) -> tuple[dict, ...]:
    """Objects `kubectl kustomize DIR` renders, in order."""
    proc = subprocess.run(
        [kubectl(), "kustomize", str(kustomization_dir)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"kubectl kustomize {kustomization_dir} failed:\n{proc.stderr}", pytrace=False)
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc is not None)


@functools.cache
def crd_schema(api_version: str, kind: str) -> dict:
    """The openAPIV3Schema of the vendored CRD for (apiVersion, kind)."""
    path, served = CRD_OF[(api_version, kind)]
    if not path.is_file():
        pytest.fail(f"{kind} CRD schema missing: {path}", pytrace=False)
    crd = yaml.safe_load(path.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == served]
    return version["schema"]["openAPIV3Schema"]


def pruned_fields(obj, schema: dict, path: str = "") -> list[str]:
    """Fields the API server would silently drop (structural-schema pruning): not in `properties` and
    not under x-kubernetes-preserve-unknown-fields. `kubectl apply --validate=strict` rejects them."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found: list[str] = []
    if isinstance(obj, dict) and schema.get("type") == "object":
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if props is None and isinstance(extra, dict):
            for key, value in obj.items():
                found += pruned_fields(value, extra, f"{path}.{key}")
        elif props is not None:
            for key, value in obj.items():
                if key not in props:
                    found.append(f"{path}.{key}")
                else:
                    found += pruned_fields(value, props[key], f"{path}.{key}")
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            found += pruned_fields(item, schema["items"], f"{path}[{i}]")
    return found


def validate_custom(obj: dict) -> None:
    """Raise AssertionError unless the vendored CRD of `obj`'s kind accepts it without pruning a field."""
    kind = obj.get("kind")
    schema = crd_schema(obj.get("apiVersion"), kind)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(obj), key=lambda e: list(e.path))
    assert not errors, f"{kind} fails the CRD schema:\n" + "\n".join(
        f"  {'.'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in errors
    )
    # metadata is validated by the API server itself, not by the CRD schema.
    body = {k: v for k, v in obj.items() if k != "metadata"}
    unknown = pruned_fields(body, schema)
    assert not unknown, f"{kind} has fields the CRD does not define (they would be dropped): {unknown}"


def validate_pytorchjob(obj: dict) -> None:
    """Raise AssertionError unless `obj` is a PyTorchJob the v1.9.4 CRD accepts without pruning."""
    assert (obj.get("apiVersion"), obj.get("kind")) == ("kubeflow.org/v1", "PyTorchJob"), obj.get("kind")
    validate_custom(obj)


def validate_object(obj: dict) -> None:
    """Validate one rendered object: core kinds against Kubernetes' OpenAPI (strict: unknown fields fail; Secret
    and NetworkPolicy against the schemas vendored from it), PyTorchJob against its CRD, Kueue's LocalQueue
    structurally (its CRD is not vendored here)."""
    kind, api_version = obj.get("kind"), obj.get("apiVersion", "")
    if (api_version, kind) in CRD_OF:
        validate_custom(obj)
    elif (api_version, kind) in CORE:  # the kinds the launch step creates beside a job, vendored (core_schemas)
        validate_core(obj)
    elif kind == "LocalQueue" and api_version.startswith("kueue.x-k8s.io/"):
        validate_localqueue(obj)
    else:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(f"no schema to validate {api_version} {kind}: add one before shipping it", pytrace=False)


def validate_localqueue(obj: dict) -> None:
    """Structural check only: Kueue's CRD is not vendored, so the field set of kueue.x-k8s.io/v1beta1
    LocalQueue (metadata + spec.clusterQueue) is checked by hand."""
    assert obj["apiVersion"] == "kueue.x-k8s.io/v1beta1", obj["apiVersion"]
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}, sorted(obj)
    assert obj["metadata"].get("name") and obj["metadata"].get("namespace"), obj["metadata"]
    assert set(obj["spec"]) <= {"clusterQueue", "stopPolicy", "fairSharing"}, sorted(obj["spec"])
    assert isinstance(obj["spec"].get("clusterQueue"), str) and obj["spec"]["clusterQueue"], obj["spec"]


def the(objects, kind: str, name: str | None = None) -> dict:
    """The single rendered object of `kind` (and `name`)."""
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]
