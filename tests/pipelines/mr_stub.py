"""A stub of the Kubeflow Model Registry REST API (``/api/model_registry/v1``), for promotion tests.

It serves, on 127.0.0.1 (a free port), what the ``model-registry`` client calls to register a model, list a
registered model's versions and read their artifacts: registered models, model versions, and a version's
artifacts (create, get by id, find by name, list). Every request body is parsed with the client's own OpenAPI
models (``mr_openapi.models``: ``RegisteredModelCreate``, ``ModelVersionCreate``, ``Artifact``...), so a body
the real server's schema would refuse gets HTTP 400 here too, and every response is one of those models
serialized, so the client parses it as it would a real answer. State is in memory; nothing else is modelled
(no auth, no inference services, no filterQuery). Not a real registry: nothing here talks to one.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from mr_openapi import models as mr
from pydantic import ValidationError

BASE = "/api/model_registry/v1"
# collection -> (create model, stored model, list model)
COLLECTIONS = {
    "registered_models": (mr.RegisteredModelCreate, mr.RegisteredModel, mr.RegisteredModelList),
    "model_versions": (mr.ModelVersionCreate, mr.ModelVersion, mr.ModelVersionList),
    "artifacts": (mr.Artifact, mr.Artifact, mr.ArtifactList),
}
SINGULAR = {"registered_model": "registered_models", "model_version": "model_versions",
            "model_artifact": "artifacts", "artifact": "artifacts"}
UPDATES = {"registered_models": mr.RegisteredModelUpdate, "model_versions": mr.ModelVersionUpdate,
           "artifacts": mr.ArtifactUpdate, "model_artifacts": mr.ModelArtifactUpdate}
_PATH = re.compile(rf"^{BASE}/([a-z_]+)(?:/([^/]+))?(?:/([a-z_]+))?$")


class ModelRegistryStub:
    """The stub server and its state; a context manager that serves while open."""

    def __init__(self) -> None:
        self.store: dict[str, dict[str, dict[str, Any]]] = {c: {} for c in COLLECTIONS}
        self.parents: dict[str, str] = {}
        """Artifact id -> model version id; model version id -> registered model id."""
        self.requests: list[tuple[str, str]] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.stub = self  # type: ignore[attr-defined]
        self.port = self._server.server_address[1]
        self.address = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ModelRegistryStub:
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def create(self, collection: str, body: dict[str, Any], parent: str | None = None) -> dict[str, Any]:
        """Validate `body` with the collection's create model and store the server's view of it."""
        create, stored, _ = COLLECTIONS[collection]
        obj = create.from_dict(body).to_dict()  # raises ValidationError/ValueError on a body the schema refuses
        with self._lock:
            now = str(int(time.time() * 1000) + next(self._ids))  # strictly increasing, as creation order
            obj.update(id=str(next(self._ids)), createTimeSinceEpoch=now, lastUpdateTimeSinceEpoch=now)
            obj.setdefault("state", "LIVE")
            if collection == "model_versions":
                parent = obj["registeredModelId"]
            stored.from_dict(obj)  # the server's view is a valid model too (its to_dict drops read-only times)
            self.store[collection][obj["id"]] = obj
            if parent:
                self.parents[obj["id"]] = parent
        return obj

    def children(self, collection: str, parent: str) -> list[dict[str, Any]]:
        with self._lock:
            return [o for i, o in self.store[collection].items() if self.parents.get(i) == parent]

    def find(self, collection: str, name: str | None, parent: str | None) -> dict[str, Any] | None:
        with self._lock:
            for i, o in self.store[collection].items():
                if o.get("name") == name and (parent is None or self.parents.get(i) == parent):
                    return o
        return None


def _error(code: int, message: str) -> tuple[int, dict[str, Any]]:
    return code, mr.Error(code=str(code), message=message).to_dict()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def _dispatch(self, method: str) -> None:
        stub: ModelRegistryStub = self.server.stub  # type: ignore[attr-defined]
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else {}
        stub.requests.append((method, url.path))
        try:
            code, payload = self._route(stub, method, url.path, query, body)
        except (ValidationError, ValueError) as exc:
            code, payload = _error(400, f"request body does not match the OpenAPI schema: {exc}")
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self, stub: ModelRegistryStub, method: str, path: str, query: dict[str, str],
               body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        m = _PATH.match(path)
        if not m:
            return _error(404, f"the stub does not serve {path}")
        head, item, sub = m.groups()
        if head in SINGULAR and item is None and method == "GET":  # find by name (and parent)
            collection = SINGULAR[head]
            found = stub.find(collection, query.get("name"), query.get("parentResourceId"))
            return (200, found) if found else _error(404, f"no {head} named {query.get('name')!r}")
        collection = "artifacts" if head == "model_artifacts" else head
        if collection not in COLLECTIONS:
            return _error(404, f"the stub does not serve {path}")
        if item is None and method == "POST":
            return 201, stub.create(collection, body)
        if item is None and method == "GET":
            return 200, self._page(collection, list(stub.store[collection].values()), query)
        if sub is None and method == "GET":
            obj = stub.store[collection].get(item)
            return (200, obj) if obj else _error(404, f"{collection}/{item} not found")
        if sub is None and method == "PATCH":
            obj = stub.store[collection].get(item)
            if obj is None:
                return _error(404, f"{collection}/{item} not found")
            obj.update(UPDATES[head].from_dict(body).to_dict())
            return 200, obj
        child = {"versions": "model_versions", "artifacts": "artifacts"}.get(sub or "")
        if child and method == "GET":
            return 200, self._page(child, stub.children(child, item), query)
        if child == "artifacts" and method == "POST":
            return 201, stub.create("artifacts", body, parent=item)
        return _error(405, f"the stub does not serve {method} {path}")

    @staticmethod
    def _page(collection: str, items: list[dict[str, Any]], query: dict[str, str]) -> dict[str, Any]:
        items = sorted(items, key=lambda o: int(o["createTimeSinceEpoch"]),
                       reverse=query.get("sortOrder", "ASC") == "DESC")
        size = int(query.get("pageSize") or len(items) or 1)
        page = items[:size]
        listing = {"nextPageToken": "", "pageSize": size, "size": len(page), "items": page}
        COLLECTIONS[collection][2].from_dict(listing)
        return listing
