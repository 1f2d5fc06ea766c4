"""k8s:// discovery: the real kubernetes client (kubernetes.aio) against a local server that speaks
the EndpointSlice list / watch API (fake_kube_api.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from orchestrator.discovery import Endpoint, make_source, parse_kubernetes
from orchestrator.k8s_discovery import KubernetesSource, kube_configuration

from tests.pools.fake_kube_api import FakeKubeApi, endpoint, endpoint_slice, kubeconfig
from tests.waiting import eventually_async

NAMESPACE = "llm"
PORT = 50051


@pytest.fixture
def kube_api():
    api = FakeKubeApi().start()
    yield api
    api.stop()


def _source(api: FakeKubeApi, spec: str = f"k8s://{NAMESPACE}/target:{PORT}") -> KubernetesSource:
    async def api_client():
        from kubernetes.aio import client

        return client.ApiClient(client.Configuration(host=api.url))

    return KubernetesSource(parse_kubernetes(spec), api_client, watch_seconds=30, retry_seconds=(0.05, 0.2))


def _target_slice(name: str, *endpoints: dict) -> dict:
    return endpoint_slice(NAMESPACE, name, "target", list(endpoints), PORT)


async def _until(source: KubernetesSource, expected: list[Endpoint]) -> None:
    latest: list[Endpoint] = []

    async def matches() -> bool:
        try:
            latest[:] = await source.endpoints()
        except LookupError:  # not listed yet
            return False
        return latest == expected

    try:
        await eventually_async(matches, f"endpoints {expected}", timeout=30)
    except AssertionError as error:
        raise AssertionError(f"{error}; last seen {latest}") from None


def test_ready_draining_and_removed_endpoints_follow_the_watch(kube_api):
    kube_api.apply(_target_slice("target-a", endpoint("10.0.0.1"),
                                 endpoint("10.0.0.2", ready=False, serving=True, terminating=True)))
    kube_api.apply(endpoint_slice(NAMESPACE, "draft-a", "draft", [endpoint("10.0.9.9")], 50052))
    kube_api.apply(endpoint_slice("elsewhere", "target-z", "target", [endpoint("10.0.8.8")], PORT))

    async def scenario():
        source = _source(kube_api)
        try:
            # The list: only this namespace and this Service; the draining one keeps its sessions.
            assert await source.endpoints() == [Endpoint("10.0.0.1:50051"), Endpoint("10.0.0.2:50051", ready=False)]
            # A new slice (a scale-up): its endpoint takes new sessions.
            kube_api.apply(_target_slice("target-b", endpoint("10.0.0.3")))
            await _until(source, [Endpoint("10.0.0.1:50051"), Endpoint("10.0.0.2:50051", ready=False),
                                  Endpoint("10.0.0.3:50051")])
            # 10.0.0.1 starts terminating, 10.0.0.2 is gone: one MODIFIED event.
            kube_api.apply(_target_slice("target-a", endpoint("10.0.0.1", ready=False, terminating=True)))
            await _until(source, [Endpoint("10.0.0.1:50051", ready=False), Endpoint("10.0.0.3:50051")])
            # A slice deleted with its endpoints.
            kube_api.delete(NAMESPACE, "target-a")
            await _until(source, [Endpoint("10.0.0.3:50051")])
        finally:
            await source.close()

    asyncio.run(scenario())
    assert kube_api.lists() == 1, "every change after the first list came through the watch"
    first_watch = next(r for r in kube_api.requests if r.watch)
    assert first_watch.query["labelSelector"] == "kubernetes.io/service-name=target"
    assert first_watch.query["resourceVersion"] == "103"  # the list's resourceVersion
    assert first_watch.namespace == NAMESPACE


def test_a_watch_the_server_ends_resumes_from_the_last_version_without_listing(kube_api):
    kube_api.apply(_target_slice("target-a", endpoint("10.0.0.1")))

    async def scenario():
        source = _source(kube_api)
        try:
            await source.endpoints()
            await eventually_async(lambda: kube_api.watches() == 1, "the first watch")
            kube_api.end_watches()  # its timeoutSeconds ran out: a BOOKMARK, then the end
            await eventually_async(lambda: kube_api.watches() == 2, "a second watch")
            kube_api.apply(_target_slice("target-a", endpoint("10.0.0.1"), endpoint("10.0.0.4")))
            await _until(source, [Endpoint("10.0.0.1:50051"), Endpoint("10.0.0.4:50051")])
        finally:
            await source.close()

    asyncio.run(scenario())
    assert kube_api.lists() == 1
    watches = [r for r in kube_api.requests if r.watch]
    assert watches[1].query["resourceVersion"] == watches[0].query["resourceVersion"]  # the bookmark's


@pytest.mark.parametrize("gone_as_http_status", [False, True], ids=["error-event", "http-status"])
def test_an_expired_version_is_answered_with_a_fresh_list(kube_api, gone_as_http_status):
    kube_api.gone_as_http_status = gone_as_http_status
    kube_api.apply(_target_slice("target-a", endpoint("10.0.0.1")))

    async def scenario():
        source = _source(kube_api)
        try:
            assert await source.endpoints() == [Endpoint("10.0.0.1:50051")]
            await eventually_async(lambda: kube_api.watches() >= 1, "the first watch")
            # A change no watch will ever deliver (its event was compacted away), then the history
            # goes: the open watch ends, resuming gets 410 Gone, and only a new list shows the change.
            kube_api.apply(_target_slice("target-a", endpoint("10.0.0.5")), record=False)
            kube_api.compact()
            await _until(source, [Endpoint("10.0.0.5:50051")])
            assert source.lists == 2
            # And the watch goes on from the new list.
            kube_api.apply(_target_slice("target-b", endpoint("10.0.0.6")))
            await _until(source, [Endpoint("10.0.0.5:50051"), Endpoint("10.0.0.6:50051")])
        finally:
            await source.close()

    asyncio.run(scenario())
    assert kube_api.lists() == 2


def test_a_failing_api_server_is_retried_and_the_last_picture_kept(kube_api):
    kube_api.failing_lists = 1
    kube_api.apply(_target_slice("target-a", endpoint("10.0.0.1")))

    async def scenario():
        source = _source(kube_api)
        try:
            with pytest.raises(LookupError, match="cannot list EndpointSlices"):
                await source.endpoints()
            await _until(source, [Endpoint("10.0.0.1:50051")])  # the retry listed
            # Later failures keep the last picture: a broken watch and a failing relist.
            kube_api.failing_lists = 2
            kube_api.compact()
            await eventually_async(lambda: kube_api.failing_lists == 0, "two failed lists")
            assert await source.endpoints() == [Endpoint("10.0.0.1:50051")]
            await eventually_async(lambda: source.lists == 2, "a successful relist")
        finally:
            await source.close()

    asyncio.run(scenario())


def test_named_port_and_ipv6_slices(kube_api):
    kube_api.apply(endpoint_slice(NAMESPACE, "target-v6", "target", [endpoint("fd00::7")], 8000,
                                  port_name="grpc", address_type="IPv6"))

    async def scenario():
        source = _source(kube_api, f"k8s://{NAMESPACE}/target:grpc")
        try:
            assert await source.endpoints() == [Endpoint("[fd00::7]:8000")]
        finally:
            await source.close()

    asyncio.run(scenario())


def test_kubeconfig_outside_a_cluster(kube_api, tmp_path, monkeypatch):
    """make_source with the default client: $KUBECONFIG when not running in a pod."""
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(kubeconfig(kube_api.url)))  # YAML is a superset of JSON
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kube_api.apply(_target_slice("target-a", endpoint("10.0.0.1")))

    async def scenario():
        source = make_source(f"k8s://{NAMESPACE}/target:{PORT}")
        try:
            return await source.endpoints()
        finally:
            await source.close()

    assert asyncio.run(scenario()) == [Endpoint("10.0.0.1:50051")]


def test_in_cluster_config_inside_a_pod(tmp_path, monkeypatch):
    """In a pod: the API Service from the environment, the ServiceAccount token and CA from files."""
    from kubernetes.aio.config import incluster_config

    (tmp_path / "token").write_text("service-account-token")
    (tmp_path / "ca.crt").write_text("the cluster's CA")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")

    configuration = asyncio.run(kube_configuration())
    assert configuration.host == "https://10.96.0.1:443"
    assert configuration.ssl_ca_cert == str(tmp_path / "ca.crt")
    assert configuration.api_key["BearerToken"] == "bearer service-account-token"
