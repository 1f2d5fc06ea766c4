"""k8s://namespace/service:port: a pool's replicas from the EndpointSlices of a Service.

The watch follows client-go's reflector: list the slices labelled
``kubernetes.io/service-name=<service>``, then watch from the list's resourceVersion. A watch the
server ends (its timeout) is resumed from the last resourceVersion seen; one refused with 410 Gone
(that version was compacted away) is replaced by a fresh list, which replaces the whole picture.
It runs as a task on the orchestrator's event loop with the asyncio client (kubernetes.aio), so it
never blocks the loop, and endpoints() only reads the picture it keeps.

Endpoint conditions (discovery.k8s.io/v1; a nil ready or serving means true, a nil terminating
false) map onto the pool like this:

- ready and not terminating: takes new sessions.
- anything else still listed (serving but terminating, or failing its readiness probe): keeps the
  sessions it has and takes no new ones, Endpoint(address, ready=False). The pool's own Info probe
  decides whether it is healthy.
- no longer listed: leaves the pool, and its sessions are re-prefilled elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from orchestrator.discovery import Endpoint, KubernetesService, join_host_port

log = logging.getLogger(__name__)

GONE = 410
ApiClientFactory = Callable[[], Awaitable[Any]]  # -> kubernetes.aio.client.ApiClient


async def kube_configuration() -> Any:
    """In a pod: its ServiceAccount (in-cluster config). Elsewhere: $KUBECONFIG or ~/.kube/config."""
    from kubernetes.aio import client, config

    configuration = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
    else:
        # $KUBECONFIG read now (the library reads it once, at import); never write the file back.
        await config.load_kube_config(config_file=os.environ.get("KUBECONFIG"),
                                      client_configuration=configuration, persist_config=False)
    return configuration


async def default_api_client() -> Any:
    from kubernetes.aio import client

    return client.ApiClient(await kube_configuration())


def slice_endpoints(endpoint_slice: Any, port: int | str) -> list[Endpoint]:
    """The endpoints of one V1EndpointSlice, dialled on port (a number, or a port name looked up
    in the slice; a slice without that name contributes nothing)."""
    if isinstance(port, str):
        numbers = [p.port for p in endpoint_slice.ports or () if p.name == port and p.port]
        if not numbers:
            return []
        port = numbers[0]
    found = []
    for endpoint in endpoint_slice.endpoints or ():
        conditions = endpoint.conditions
        ready = conditions is None or conditions.ready is not False
        terminating = conditions is not None and conditions.terminating is True
        for address in endpoint.addresses or ():
            found.append(Endpoint(join_host_port(address, port), ready=ready and not terminating))
    return found


def merge(groups: Iterable[list[Endpoint]]) -> list[Endpoint]:
    """One Endpoint per address (slices may overlap while the controller moves endpoints): ready
    if any slice says so."""
    ready: dict[str, bool] = {}
    for endpoints in groups:
        for endpoint in endpoints:
            ready[endpoint.address] = ready.get(endpoint.address, False) or endpoint.ready
    return [Endpoint(address, ready[address]) for address in sorted(ready)]


class KubernetesSource:
    """Keeps the endpoints of one Service's EndpointSlices up to date from a list + watch."""

    def __init__(
        self,
        service: KubernetesService,
        api_client: ApiClientFactory = default_api_client,
        watch_seconds: int = 240,  # each watch request's server-side timeout; then resume
        request_seconds: float = 30.0,  # deadline of a list
        retry_seconds: tuple[float, float] = (0.5, 30.0),  # backoff after a failure: first, max
    ) -> None:
        self.service = service
        self._api_client_factory = api_client
        self.watch_seconds = watch_seconds
        self.request_seconds = request_seconds
        self.retry_seconds = retry_seconds
        self.lists = 0  # successful lists: 1 + relists after 410 Gone or errors
        self._slices: dict[str, list[Endpoint]] = {}  # by EndpointSlice name
        self._synced = False
        self._error = ""
        self._first_attempt: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._api_client: Any = None

    @property
    def description(self) -> str:
        return self.service.description

    async def endpoints(self) -> list[Endpoint]:
        if self._task is None:
            self._first_attempt = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name=f"watch {self.description}")
        assert self._first_attempt is not None
        await self._first_attempt.wait()
        if not self._synced:
            raise LookupError(f"{self.description}: cannot list EndpointSlices: {self._error}")
        return merge(self._slices.values())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._api_client is not None:
            await self._api_client.close()
            self._api_client = None

    # -- the reflector loop ---------------------------------------------------------------------

    async def _run(self) -> None:
        from kubernetes.aio import client

        delay = self.retry_seconds[0]
        while True:
            try:
                if self._api_client is None:
                    self._api_client = await self._api_client_factory()
                api = client.DiscoveryV1Api(self._api_client)
                version = await self._list(api)
                delay = self.retry_seconds[0]
                while True:
                    version = await self._watch(api, version)
            except client.ApiException as error:
                if error.status == GONE:  # a short pause keeps a server that keeps expiring from a busy loop
                    log.info("%s: resourceVersion expired (410 Gone); listing again", self.description)
                    await asyncio.sleep(self.retry_seconds[0])
                    continue
                self._failed(error)
            except Exception as error:  # the API server is down, a config error, a broken stream
                self._failed(error)
            await asyncio.sleep(delay)
            delay = min(2 * delay, self.retry_seconds[1])

    def _failed(self, error: BaseException) -> None:
        self._error = _describe(error)
        log.warning("%s: EndpointSlice list/watch failed (%s); keeping %d known slices",
                    self.description, self._error, len(self._slices))
        assert self._first_attempt is not None
        self._first_attempt.set()

    async def _list(self, api: Any) -> str:
        """Replaces the picture with a fresh list; returns its resourceVersion."""
        listed = await api.list_namespaced_endpoint_slice(
            self.service.namespace, label_selector=self.service.label_selector,
            _request_timeout=self.request_seconds,
        )
        self._slices = {
            item.metadata.name: slice_endpoints(item, self.service.port) for item in listed.items or ()
        }
        self.lists += 1
        self._synced = True
        assert self._first_attempt is not None
        self._first_attempt.set()
        log.info("%s: %d endpoints in %d EndpointSlices", self.description,
                 sum(map(len, self._slices.values())), len(self._slices))
        return listed.metadata.resource_version

    async def _watch(self, api: Any, version: str) -> str:
        """Applies watch events from version until the server ends the stream; returns the last
        resourceVersion seen. Raises ApiException(410) when version has expired."""
        from kubernetes.aio import watch

        async with watch.Watch().stream(
            api.list_namespaced_endpoint_slice, self.service.namespace,
            label_selector=self.service.label_selector, resource_version=version,
            allow_watch_bookmarks=True, timeout_seconds=self.watch_seconds,
            _request_timeout=self.watch_seconds + self.request_seconds,
        ) as stream:
            async for event in stream:
                kind, item = event["type"], event["object"]
                if kind in ("ADDED", "MODIFIED"):
                    self._slices[item.metadata.name] = slice_endpoints(item, self.service.port)
                elif kind == "DELETED":
                    self._slices.pop(item.metadata.name, None)
            return stream.resource_version or version


def _describe(error: BaseException) -> str:
    """One line: an ApiException's str() carries every response header."""
    status = getattr(error, "status", None)
    if status is None:
        return f"{type(error).__name__}: {error}"
    try:
        message = json.loads(getattr(error, "body", None) or "{}").get("message", "")
    except (ValueError, AttributeError):
        message = ""
    return f"HTTP {status} {getattr(error, 'reason', '') or ''}: {message}".rstrip(": ")
