"""A small HTTP server that speaks the Kubernetes list / watch API for EndpointSlices.

Enough of kube-apiserver for a reflector: GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices
with an equality labelSelector; a list answers an EndpointSliceList at the current resourceVersion;
watch=true streams JSON lines {"type": ADDED|MODIFIED|DELETED|BOOKMARK, "object": ...} (chunked)
after the given resourceVersion until timeoutSeconds, and a resourceVersion older than the retained
history gets a 410 Gone ERROR event, as the real server sends. Tests change the state with apply /
delete, drop history with compact, and end open watches with end_watches.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

PREFIX = "/apis/discovery.k8s.io/v1/namespaces/"
SERVICE_LABEL = "kubernetes.io/service-name"


def endpoint_slice(namespace: str, name: str, service: str, endpoints: list[dict], port: int,
                   port_name: str = "grpc", address_type: str = "IPv4") -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": namespace, "labels": {SERVICE_LABEL: service}},
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
    }


def endpoint(address: str, ready: bool | None = True, serving: bool | None = True,
             terminating: bool | None = False) -> dict:
    conditions = {key: value for key, value in
                  (("ready", ready), ("serving", serving), ("terminating", terminating)) if value is not None}
    return {"addresses": [address], "conditions": conditions}


@dataclass
class Request:
    namespace: str
    query: dict[str, str]

    @property
    def watch(self) -> bool:
        return self.query.get("watch") == "true"


@dataclass
class FakeKubeApi:
    history_limit: int = 1000
    gone_as_http_status: bool = False  # 410 as the HTTP status of the watch, not an ERROR event
    failing_lists: int = 0  # the next this many lists answer 500
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Condition()
        self._version = 100
        self._objects: dict[tuple[str, str], dict] = {}
        self._events: list[tuple[int, str, dict]] = []  # (resourceVersion, type, object)
        self._oldest = self._version  # watches from an older version get 410
        self._generation = 0  # bumped by end_watches
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeKubeApi:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.end_watches()
        self._server.shutdown()
        self._server.server_close()

    # -- state changes ---------------------------------------------------------------------------

    def apply(self, obj: dict, record: bool = True) -> None:
        """Creates or replaces an object. record=False: the change never reaches a watch (as if
        its event had been compacted away); only a list shows it."""
        with self._lock:
            key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
            kind = "MODIFIED" if key in self._objects else "ADDED"
            self._objects[key] = self._stamp(obj)
            if record:
                self._record(kind, self._objects[key])

    def delete(self, namespace: str, name: str) -> None:
        with self._lock:
            obj = self._objects.pop((namespace, name))
            self._record("DELETED", self._stamp(obj))

    def compact(self) -> None:
        """Forgets the history: a watch from any version seen so far gets 410 Gone."""
        with self._lock:
            self._version += 1
            self._oldest = self._version
            self._events.clear()
            self._lock.notify_all()

    def end_watches(self) -> None:
        """Ends every open watch stream, as the server does when timeoutSeconds runs out."""
        with self._lock:
            self._generation += 1
            self._lock.notify_all()

    def lists(self, namespace: str | None = None) -> int:
        return sum(not r.watch and namespace in (None, r.namespace) for r in self.requests)

    def watches(self) -> int:
        return sum(r.watch for r in self.requests)

    def _stamp(self, obj: dict) -> dict:
        self._version += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self._version)
        return obj

    def _record(self, kind: str, obj: dict) -> None:
        self._events.append((self._version, kind, obj))
        del self._events[:-self.history_limit]
        self._lock.notify_all()

    # -- HTTP ------------------------------------------------------------------------------------

    def _handler(self):
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                parts = url.path[len(PREFIX):].split("/") if url.path.startswith(PREFIX) else []
                if len(parts) != 2 or parts[1] != "endpointslices":
                    self._json(404, _status(404, "NotFound", f"no route {url.path}"))
                    return
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                request = Request(parts[0], query)
                api.requests.append(request)
                if request.watch:
                    self._watch(request)
                elif api.failing_lists > 0:
                    api.failing_lists -= 1
                    self._json(500, _status(500, "InternalError", "etcd is having a bad day"))
                else:
                    self._json(200, api._list(request))

            def _json(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _watch(self, request: Request) -> None:
                version = int(request.query.get("resourceVersion") or 0)
                with api._lock:
                    gone = version < api._oldest
                if gone and api.gone_as_http_status:
                    self._json(410, _status(410, "Expired", f"too old resource version: {version}"))
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    if gone:
                        self._chunk({"type": "ERROR", "object": _status(
                            410, "Expired", f"too old resource version: {version} ({api._oldest})")})
                    else:
                        self._stream(request, version)
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass
                self.close_connection = True

            def _stream(self, request: Request, version: int) -> None:
                deadline = time.monotonic() + float(request.query.get("timeoutSeconds") or 1800)
                with api._lock:
                    generation = api._generation
                while True:
                    with api._lock:
                        pending = [e for e in api._events if e[0] > version and api._matches(request, e[2])]
                        if not pending:
                            if version < api._oldest:
                                return  # compacted: the client resumes, gets 410, lists again
                            if time.monotonic() >= deadline or generation != api._generation:
                                bookmark = api._version  # every matching event up to it was sent
                                break
                            api._lock.wait(min(deadline - time.monotonic(), 0.5))
                            continue
                    for event_version, kind, obj in pending:
                        self._chunk({"type": kind, "object": obj})
                        version = event_version
                    continue
                if request.query.get("allowWatchBookmarks") == "true":
                    self._chunk({"type": "BOOKMARK", "object": {
                        "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                        "metadata": {"resourceVersion": str(bookmark)}}})

            def _chunk(self, event: dict) -> None:
                line = json.dumps(event).encode() + b"\n"
                self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                self.wfile.flush()

        return Handler

    def _list(self, request: Request) -> dict:
        with self._lock:
            items = [copy.deepcopy(o) for o in self._objects.values() if self._matches(request, o)]
            return {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSliceList",
                "metadata": {"resourceVersion": str(self._version)},
                "items": items,
            }

    @staticmethod
    def _matches(request: Request, obj: dict) -> bool:
        if obj["metadata"]["namespace"] != request.namespace:
            return False
        labels = obj["metadata"].get("labels", {})
        for term in filter(None, request.query.get("labelSelector", "").split(",")):
            key, _, value = term.partition("=")
            if labels.get(key) != value:
                return False
        return True


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def kubeconfig(server_url: str) -> dict:
    """A kubeconfig that points the real client at the fake server (plain HTTP, a dummy token)."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": server_url}}],
        "users": [{"name": "fake", "user": {"token": "fake-token"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}],
        "current-context": "fake",
    }
