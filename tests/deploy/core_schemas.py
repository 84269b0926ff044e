"""The core Kubernetes kinds the launch step creates beside a job (``components.lib.k8s_guard``), vendored as JSON
schemas in ``deploy/crds/`` beside the CRDs: ``networking.k8s.io/v1`` NetworkPolicy and ``v1`` Secret.

Each file is the strict schema the installed ``kubernetes-validate`` bundles for `K8S_VERSION` (no download), made
standalone: the definitions it refers to (transitively) copied from the bundle's ``_definitions.json`` into its own
``$defs``. A test keeps the files equal to this module's output; ``python tests/deploy/core_schemas.py`` writes
them anew (after a bump of `K8S_VERSION` or of kubernetes-validate).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
from importlib_resources import files

K8S_VERSION = "1.30.0"
CRDS = Path(__file__).resolve().parents[2] / "deploy" / "crds"
#: (apiVersion, kind) -> (the bundled schema's name, the vendored file).
CORE = {
    ("networking.k8s.io/v1", "NetworkPolicy"): ("networkpolicy-networking-v1",
                                                f"networking.k8s.io_networkpolicies.v{K8S_VERSION}.json"),
    ("v1", "Secret"): ("secret-v1", f"core_secrets.v{K8S_VERSION}.json"),
}


def bundled(name: str) -> dict[str, Any]:
    base = files("kubernetes_validate") / "kubernetes-json-schema" / f"v{K8S_VERSION}-local-strict"
    return json.loads((base / f"{name}.json").read_text())


def standalone(name: str) -> dict[str, Any]:
    """The bundled schema ``name`` with every definition it reaches in its own ``$defs``."""
    definitions = bundled("_definitions")["$defs"]
    schema, wanted, seen = bundled(name), [], set()

    def local(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):  # the bundle's files refer to "/api/_definitions.json#/$defs/..." or "#/$defs/..."
                wanted.append(ref.split("#/$defs/", 1)[1])
            return {k: ("#/$defs/" + v.split("#/$defs/", 1)[1] if k == "$ref" else local(v)) for k, v in node.items()}
        return [local(v) for v in node] if isinstance(node, list) else node

    out, defs = local(schema), {}
    while wanted:
        key = wanted.pop()
        if key not in seen:
            seen.add(key)
            defs[key] = local(definitions[key])
    out["$defs"] = dict(sorted(defs.items()))
    return out


def vendored(api_version: str, kind: str) -> dict[str, Any]:
    return json.loads((CRDS / CORE[(api_version, kind)][1]).read_text())


def validate_core(obj: dict[str, Any]) -> None:
    """Raise AssertionError unless the vendored schema of ``obj``'s kind accepts it (strict: unknown fields fail)."""
    schema = vendored(obj["apiVersion"], obj["kind"])
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(obj), key=lambda e: list(e.path))
    assert not errors, f"{obj['kind']} fails its schema:\n" + "\n".join(
        f"  {'.'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in errors)


def main() -> int:
    for name, file in CORE.values():
        (CRDS / file).write_text(json.dumps(standalone(name), indent=1, sort_keys=True) + "\n")
        print(f"wrote deploy/crds/{file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
