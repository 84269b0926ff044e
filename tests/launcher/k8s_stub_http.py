"""The HTTP side of the stub Kubernetes API server (`k8s_stub.StubCluster`): routes, watch and log streams
(chunked), the faults a `k8s_stub.Scenario` scripts on the wire, and the RBAC triple each request needs.

`_Handler` serves, for the stub's backend, ``kubeflow.org/v1`` ``pytorchjobs`` or
``trainer.kubeflow.org/v1alpha1`` ``trainjobs`` (create/get/list/watch/delete), ``pods`` list,
``pods/log`` (follow), ``secrets`` and ``networkpolicies`` (create/get/delete) from the state the `StubCluster`
(``self.server.stub``) keeps, and records every request as (method, path, (apiGroup, resource, verb)).
"""

from __future__ import annotations

import json
import re
import socket
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

if TYPE_CHECKING:
    from k8s_stub import StubCluster

WAIT_SLICE_S = 0.05
"""Granularity of the server's blocking waits (so it notices shutdown)."""
_JOBS = re.compile(r"^/apis/(kubeflow\.org|trainer\.kubeflow\.org)/(?:v1|v1alpha1)/namespaces/([^/]+)/"
                   r"(pytorchjobs|trainjobs)(?:/([^/]+))?$")
_PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:/([^/]+)(/log)?)?$")
_OWNED = re.compile(r"^/api(?:s/(networking\.k8s\.io))?/v1/namespaces/([^/]+)/(secrets|networkpolicies)(?:/([^/]+))?$")
"""The objects the launcher makes beside a job (``components.lib.k8s_guard``): group, namespace, resource, name."""


def _rbac(method: str, path: str, query: dict[str, str]) -> tuple[str, str, str]:
    """The (apiGroup, resource[/subresource], verb) an API server authorizes a request as."""
    if m := _JOBS.match(path):
        group, resource, item = m.group(1), m.group(3), m.group(4)
    elif m := _PODS.match(path):
        group, resource, item = "", "pods" + ("/log" if m.group(3) else ""), m.group(2)
    elif m := _OWNED.match(path):
        group, resource, item = m.group(1) or "", m.group(3), m.group(4)
    else:
        return ("?", path, method.lower())
    if method == "GET":
        verb = "get" if item else ("watch" if _flag(query, "watch") else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete" if item else "deletecollection"}[method]
    return (group, resource, verb)


def _flag(query: dict[str, str], name: str) -> bool:
    """A boolean query parameter as the API server parses it (the Python client sends "True")."""
    return query.get(name, "").lower() in ("true", "1")


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ThreadingHTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keep test output quiet
        pass

    @property
    def stub(self) -> StubCluster:
        return self.server.stub  # type: ignore[attr-defined]

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else {}
        self.stub.requests.append((method, url.path, _rbac(method, url.path, query)))
        if (m := _JOBS.match(url.path)) and m.group(3) == self.stub.flavour.plural:
            self._jobs(method, m.group(2), m.group(4), query, body)
        elif (m := _OWNED.match(url.path)) and m.group(3) in self.stub.scenario.forbidden:
            self._json(403, _status(403, "Forbidden", f"{m.group(3)} is forbidden: User cannot {method} it"))
        elif m := _OWNED.match(url.path):
            self._owned(method, m.group(2), m.group(3), m.group(4), body)
        elif (m := _PODS.match(url.path)) and method == "GET":
            if m.group(3):
                self._log(m.group(1), m.group(2), query)
            elif m.group(2) is None:
                self._list_pods(m.group(1), query)
            else:
                self._json(405, _status(405, "MethodNotAllowed", "not served by the stub"))
        else:
            self._json(404, _status(404, "NotFound", f"the stub does not serve {method} {url.path}"))

    # --- pytorchjobs -----------------------------------------------------------------------------
    def _jobs(self, method: str, ns: str, name: str | None, query: dict[str, str], body: dict[str, Any]) -> None:
        stub = self.stub
        if method == "POST" and name is None:
            key = (ns, body["metadata"]["name"])
            with stub.changed:
                exists = key in stub.jobs
            if exists:
                self._json(409, _status(409, "AlreadyExists", f'{stub.flavour.plural}.{stub.flavour.group} '
                                                              f'"{key[1]}" already exists'))
                return
            stub.created.append(key[1])
            self._json(201, stub.put_job(body))
        elif method == "GET" and name is not None:
            with stub.changed:
                job = stub.jobs.get((ns, name))
            self._json(200, job) if job else self._not_found(name)
        elif method == "GET" and _flag(query, "watch"):
            self._watch(ns, query)
        elif method == "GET":
            with stub.changed:
                items = [j for (n, _), j in stub.jobs.items() if n == ns and _selected(j, query)]
                rv = str(stub.events[-1][0]) if stub.events else "1"
            self._json(200, {"apiVersion": items[0]["apiVersion"] if items else stub.flavour.group,
                             "kind": stub.flavour.list_kind,
                             "metadata": {"resourceVersion": rv}, "items": items})
        elif method == "DELETE" and name is not None:
            foreground = (query.get("propagationPolicy") or body.get("propagationPolicy")) == "Foreground"
            job = stub.delete_job(ns, name, foreground)
            self._json(200, job) if job else self._not_found(name)
        else:
            self._json(405, _status(405, "MethodNotAllowed", "not served by the stub"))

    def _watch(self, ns: str, query: dict[str, str]) -> None:
        stub, scenario = self.stub, self.stub.scenario
        end = time.monotonic() + int(query.get("timeoutSeconds", "30"))
        since = query.get("resourceVersion")
        self._start_chunked()
        if since and scenario.watch_gone > 0:
            scenario.watch_gone -= 1
            self._chunk({"type": "ERROR", "object": _status(410, "Expired", "too old resource version")})
            self._end_chunked()
            return
        cut = scenario.watch_disconnects > 0
        scenario.watch_disconnects -= cut
        with stub.changed:
            if since:
                cursor = int(since)
            else:  # no resourceVersion: synthetic ADDED events for the current objects
                cursor = stub.events[-1][0] if stub.events else 0
                for (n, _), job in stub.jobs.items():
                    if n == ns and _selected(job, query):
                        self._chunk({"type": "ADDED", "object": job})
            stub.watching += 1
            stub.changed.notify_all()
        waiting = True
        try:
            while time.monotonic() < end and not stub.stopping.is_set():
                with stub.changed:
                    pending = [(rv, t, o) for rv, t, o in stub.events
                               if rv > cursor and o["metadata"]["namespace"] == ns and _selected(o, query)]
                    cursor = stub.events[-1][0] if stub.events else cursor
                    if pending and cut:  # this watch ends with its first event: the next change waits for another
                        stub.watching, waiting = stub.watching - 1, False
                    if not pending:
                        stub.changed.wait(WAIT_SLICE_S)
                for _, etype, obj in pending:
                    self._chunk({"type": etype, "object": obj})
                    if cut:
                        self._cut()
                        return
            self._end_chunked()
        finally:
            if waiting:
                with stub.changed:
                    stub.watching -= 1

    def _not_found(self, name: str, plural: str = "") -> None:
        plural = plural or f"{self.stub.flavour.plural}.{self.stub.flavour.group}"
        self._json(404, _status(404, "NotFound", f'{plural} "{name}" not found'))

    # --- secrets, networkpolicies ---------------------------------------------------------------
    def _owned(self, method: str, ns: str, resource: str, name: str | None, body: dict[str, Any]) -> None:
        """Create (409 when it exists), get and delete, as the API server does; a Secret's stringData is stored as
        data (base64)."""
        stub = self.stub
        key = (resource, ns, name or body.get("metadata", {}).get("name", ""))
        with stub.changed:
            found = stub.owned.get(key)
            if method == "POST" and name is None and found is None:
                stub.owned[key] = obj = stub.stored(body)
                stub.changed.notify_all()
                self._json(201, obj)
            elif method == "POST" and name is None:
                self._json(409, _status(409, "AlreadyExists", f'{resource} "{key[2]}" already exists'))
            elif method in ("GET", "DELETE") and name is not None and found is not None:
                if method == "DELETE":
                    del stub.owned[key]
                self._json(200, found)
            elif method in ("GET", "DELETE") and name is not None:
                self._not_found(name, resource)
            else:
                self._json(405, _status(405, "MethodNotAllowed", "not served by the stub"))

    # --- pods ----------------------------------------------------------------------------------
    def _list_pods(self, ns: str, query: dict[str, str]) -> None:
        wanted = dict(kv.split("=", 1) for kv in query.get("labelSelector", "").split(",") if kv)
        with self.stub.changed:
            items = [p for (n, _), p in self.stub.pods.items()
                     if n == ns and all(p["metadata"]["labels"].get(k) == v for k, v in wanted.items())]
        self._json(200, {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"},
                         "items": items})

    def _log(self, ns: str, pod_name: str, query: dict[str, str]) -> None:
        """Serves follow=true only (all the launcher asks for)."""
        stub = self.stub
        with stub.changed:
            pod = stub.pods.get((ns, pod_name))
            if pod is None:
                self._json(404, _status(404, "NotFound", f'pods "{pod_name}" not found'))
                return
            log = stub.logs[pod["metadata"]["uid"]]
        since = float(query["sinceSeconds"]) if "sinceSeconds" in query else None
        sent = 0 if since is None else sum(1 for t, _, _ in log.lines if t < time.monotonic() - since)
        stamps = _flag(query, "timestamps")
        cut = stub.scenario.log_disconnects > 0
        stub.scenario.log_disconnects -= cut
        self._start_chunked()
        while not stub.stopping.is_set():
            with stub.changed:
                fresh, closed = log.lines[sent:], log.closed
                if not fresh and not closed:
                    stub.changed.wait(WAIT_SLICE_S)
            for _, stamp, line in fresh:
                self._write_chunk((f"{stamp} {line}\n" if stamps else f"{line}\n").encode())
                if cut:
                    self._cut()
                    return
            sent += len(fresh)
            if closed and not fresh:
                break
        self._end_chunked()

    # --- wire helpers --------------------------------------------------------------------------
    def _send(self, code: int, ctype: str, data: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _json(self, code: int, obj: dict[str, Any]) -> None:
        self._send(code, "application/json", json.dumps(obj).encode())

    def _start_chunked(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _chunk(self, event: dict[str, Any]) -> None:
        self._write_chunk(json.dumps(event).encode() + b"\n")

    def _end_chunked(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _cut(self) -> None:
        """Drop the connection mid-stream, as a broken network or a restarted API server does."""
        self.close_connection = True
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)


def _selected(job: dict[str, Any], query: dict[str, str]) -> bool:
    selector = query.get("fieldSelector", "")
    return not selector.startswith("metadata.name=") or job["metadata"]["name"] == selector.split("=", 1)[1]
