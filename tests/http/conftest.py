"""The OpenAI-compatible HTTP API served over the shared in-process stack (tiny float64 models),
on loopback, for the real `openai` client."""

from __future__ import annotations

import pytest

from orchestrator.http_api import HttpApi, HttpConfig


def start_api(loop_thread, service, **config) -> HttpApi:
    api = HttpApi(service, HttpConfig(port=0, **config))
    loop_thread.run(api.start())
    return api


@pytest.fixture(scope="module")
def api(loop_thread, stack):
    running = start_api(loop_thread, stack.orchestrator)
    yield running
    loop_thread.run(running.stop())


@pytest.fixture
def client(api):
    import openai

    with openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=120) as client:
        yield client
