"""The HTTP API of a real `specdec serve orchestrator --http-port` process: named in its READY
line, behind the same bearer token as gRPC, and drained with gRPC on SIGTERM (the stream in
flight finishes, a new request gets 503, the process exits 0)."""

from __future__ import annotations

import openai
import pytest

from specdec_cli.processes import start_service
from specdec_cli.stack import stop_services
from specdec_cli.up_cmd import http_url

from tests.waiting import eventually

TOKEN = "process-token"


@pytest.fixture(scope="module")
def services(tiny_pair, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN + "\n")
    started = []
    try:
        for role, model in (("target", tiny_pair.target_dir), ("draft", tiny_pair.draft_dir)):
            started.append(start_service(role, ["--model", str(model), "--dtype", "float64", "--port", "0",
                                                "--threads", "1"], timeout=300))
        target, draft = started
        started.append(start_service("orchestrator", [
            "--target", target.address, "--draft", draft.address, "--port", "0", "--http-port", "0",
            "--auth-token-file", str(token_file), "--grace-seconds", "120"], timeout=300))
        yield {s.role: s for s in started}
    finally:
        stop_services(started)


@pytest.mark.slow  # ~20 s: three processes; tests/http/test_http_lifecycle.py drains in-process
def test_the_orchestrator_serves_http_and_drains_it_on_sigterm(services):
    orchestrator = services["orchestrator"]
    url = http_url(orchestrator)
    assert url is not None and url.startswith("http://127.0.0.1:") and url.endswith("/v1"), orchestrator.output()
    with openai.OpenAI(base_url=url, api_key="wrong", max_retries=0, timeout=120) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    with openai.OpenAI(base_url=url, api_key=TOKEN, max_retries=0, timeout=120) as client:
        answer = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=8, temperature=0)
        assert answer.usage.completion_tokens >= 1
        stream = client.completions.create(model="any", prompt="once upon a time", max_tokens=400,
                                           temperature=0, stream=True,
                                           extra_body={"specdec": {"speculation": "fixed"}})
        chunks = [next(stream)]
        orchestrator.process.terminate()  # SIGTERM: drain

        def refused() -> bool:
            try:
                client.completions.create(model="any", prompt="hi", max_tokens=1)
            except openai.InternalServerError as error:
                return error.status_code == 503
            return False

        eventually(refused, "a new request is refused with 503 while draining")
        chunks.extend(stream)
        assert chunks[-1].choices[0].finish_reason is not None  # the stream in flight finished
    assert orchestrator.process.wait(120) == 0, orchestrator.output()


def test_an_http_port_in_use_is_refused_before_waiting_for_the_pools():
    import socket

    from tests.process_groups import run_specdec

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with run_specdec("serve", "orchestrator", "--target", "127.0.0.1:1", "--draft", "127.0.0.1:1",
                         "--port", "0", "--http-port", str(port), "--startup-timeout", "300") as orchestrator:
            assert orchestrator.wait(120) == 2, orchestrator.output()
            assert f"port {port} is already in use" in orchestrator.output()
