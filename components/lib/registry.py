"""Promotion into Kubeflow Model Registry, when ``promoted_registry`` is a Model Registry address.

The embedded default stays the JSON record on the shared volume (`components.lib.evaluation`); this module
serves the other kind of location: ``http(s)://HOST[:PORT][/REGISTERED_MODEL_NAME]`` (the registry's REST
server, e.g. ``https://model-registry-service.kubeflow.svc.cluster.local:8443``; without a name,
`components.lib.params.registry_location` appends ``/resilient-train-<flavour>``).

- **promote** (`ModelRegistryStore.write`): registers a new version ``<run id>-step-<step>`` of the
  registered model through the ``model-registry`` client. Its model artifact is the Hugging Face directory
  exported from the evaluated step (``uri`` = the record's ``model_uri``: ``pvc://<claim>/<path>`` on the shared
  volume, which KServe mounts as it is; format ``safetensors`` version 1; source kind ``pipelines``, class
  ``pipelinerun``, id = the run id). The version's custom properties carry the promoted record
  (`components.lib.promoted`): val loss, perplexity, step, goodput (when the run's ledger had one), run id, the
  source checkpoint (``checkpoint``: the step directory; ``checkpoint_dir``: the run's checkpoint directory),
  the export and the data identity.
- **the promoted model** (`ModelRegistryStore.read`): the newest version of the registered model carrying
  such a record; the gate compares candidates with it, and ``init_from=promoted`` warm-starts from it.
- **compare and swap**: the write re-reads the newest version and refuses (`PromotionConflict`) when it is no
  longer the one the gate compared against. Unlike the JSON file's lock, two writers racing between that read
  and the registration can both succeed; the newer version then wins.

Credentials: the client reads the pipeline's service-account token from ``KF_PIPELINES_SA_TOKEN_PATH``
(KFP sets it in step pods when the pipeline asks for one); a custom CA from ``$MODEL_REGISTRY_CA`` if set.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from components.lib.promoted import (
    MODEL_FORMAT,
    PromotedRecord,
    PromotionConflict,
    record_id,
    scalar_properties,
    version_name,
)

MODEL_REGISTRY_SCHEMES = ("http", "https")
AUTHOR = "resilient-train"
CA_ENV = "MODEL_REGISTRY_CA"
#: Model Registry's source fields of a model made by a Kubeflow pipeline run (its docs' convention).
SOURCE_KIND, SOURCE_CLASS = "pipelines", "pipelinerun"


class RegistryError(RuntimeError):
    """The Model Registry address is unusable or the registry refused a request; the message says why."""


def is_model_registry(location: str) -> bool:
    """Whether `location` names a Model Registry server rather than a JSON file on the shared volume."""
    return urlparse(location).scheme in MODEL_REGISTRY_SCHEMES


@dataclass(frozen=True)
class RegistryAddress:
    """A parsed ``http(s)://HOST[:PORT]/NAME``."""

    server: str
    """``scheme://host``, as the client takes it."""
    port: int
    model_name: str

    @classmethod
    def parse(cls, location: str) -> RegistryAddress:
        url = urlparse(location)
        name = url.path.strip("/")
        if url.scheme not in MODEL_REGISTRY_SCHEMES or not url.hostname or not name or "/" in name \
                or url.query or url.fragment:
            raise RegistryError(f"Model Registry address {location!r} must look like "
                                "https://HOST[:PORT]/REGISTERED_MODEL_NAME (one path segment, no query)")
        return cls(f"{url.scheme}://{url.hostname}", url.port or (443 if url.scheme == "https" else 80), name)


def _client(address: RegistryAddress) -> Any:
    import os

    from model_registry import ModelRegistry

    return ModelRegistry(address.server, address.port, author=AUTHOR, is_secure=address.server.startswith("https"),
                         custom_ca_envvar=CA_ENV if os.environ.get(CA_ENV) else None)


class ModelRegistryStore:
    """Reads and writes the promoted model of one registered model in a Model Registry."""

    def __init__(self, location: str, client_factory: Callable[[RegistryAddress], Any] = _client) -> None:
        self.location = location
        self.address = RegistryAddress.parse(location)
        self._factory = client_factory
        self._registry: Any = None

    @property
    def client(self) -> Any:
        if self._registry is None:
            try:
                self._registry = self._factory(self.address)
            except Exception as exc:  # the client raises plain errors for bad TLS, auth, DNS
                raise RegistryError(f"cannot reach Model Registry {self.address.server}:{self.address.port} "
                                    f"({type(exc).__name__}: {exc}); check promoted_registry and the pipeline's "
                                    "service-account token") from exc
        return self._registry

    def read(self) -> dict[str, Any] | None:
        """The promoted record: the newest version carrying one; None when nothing was promoted."""
        if self.client.get_registered_model(self.address.model_name) is None:
            return None
        versions = self.client.get_model_versions(self.address.model_name).order_by_creation_time().descending()
        for version in versions:
            props = dict(version.custom_properties or {})
            if "checkpoint_dir" in props:
                return {**props, "registry_version": version.name}
        return None

    def write(self, record: Mapping[str, Any], expected_current: str) -> str:
        """Register `record`'s export as a new version if the promoted model is still `expected_current`."""
        promoted = PromotedRecord.from_mapping(record)
        if not promoted.model_uri:
            raise RegistryError(f"record of {promoted.checkpoint} has no exported model to register; the "
                                "export_model step runs before promote")
        current = record_id(self.read())
        if current != expected_current:
            raise PromotionConflict(f"the promoted model changed since the gate compared against it "
                                    f"({expected_current or 'none'} -> {current or 'none'}); not registering")
        stamped = promoted.stamped().to_dict()
        version = version_name(stamped)
        self.client.register_model(
            self.address.model_name, promoted.model_uri, version=version,
            model_format_name=MODEL_FORMAT[0], model_format_version=MODEL_FORMAT[1],
            model_source_kind=SOURCE_KIND, model_source_class=SOURCE_CLASS, model_source_id=promoted.run_id,
            model_source_name=promoted.run_id,
            version_description=(f"{promoted.model} at step {promoted.step}, val loss {promoted.val_loss:.4f} "
                                 f"(run {promoted.run_id}; from {promoted.checkpoint})"),
            metadata=scalar_properties(stamped))
        return f"{self.location} version {version}"
