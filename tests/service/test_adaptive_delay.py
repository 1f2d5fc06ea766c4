"""Adaptive K under real injected network delay: a TCP delay proxy sits between the orchestrator
and each service. With 20 ms of round trip on each hop the controller drafts more per round than
with none, and the output stays identical to the target alone."""

from __future__ import annotations

import statistics

import pytest
import torch

import orchestrator.server
from orchestrator.pool import PoolConfig
from orchestrator.service import OrchestratorConfig
from specdec.delay_proxy import DelayProxyConfig, start_in_thread
from specdec.rpc.server import ServerConfig
from specdec.v1 import orchestrator_pb2 as pb

from tests.stack import generate

PROMPTS = [[4, 9, 17, 30, 12], [8, 8, 21, 3], [40, 2, 33, 19, 6, 11]]
MAX_NEW_TOKENS = 60


@pytest.fixture(scope="module")
def delayed_orchestrators(loop_thread, stack):
    """Two orchestrators on the same services, each through its own proxies: 0 ms and 20 ms RTT."""
    started = {}
    proxies = []
    try:
        for one_way_ms in (0.0, 10.0):
            upstreams = {}
            for role, address in (("target", stack.target_address), ("draft", stack.draft_address)):
                host, port = address.rsplit(":", 1)
                proxy = start_in_thread(DelayProxyConfig(
                    upstream_host=host, upstream_port=int(port), one_way_delay_ms=one_way_ms))
                proxies.append(proxy)
                upstreams[role] = f"127.0.0.1:{proxy.port}"
            config = OrchestratorConfig(draft=upstreams["draft"], target=upstreams["target"],
                                        pool=PoolConfig(refresh_seconds=0.5), startup_timeout_seconds=30)
            started[2 * one_way_ms] = loop_thread.run(orchestrator.server.start(config, ServerConfig(port=0)))
        yield {rtt: f"127.0.0.1:{running.port}" for rtt, (running, _) in started.items()}
    finally:
        for running, service in started.values():
            loop_thread.run(service.close())
            loop_thread.run(running.stop())
        for proxy in proxies:
            proxy.close()


def _reference(model, prompt):
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return output[0, len(prompt):].tolist()


def test_more_drafts_per_round_when_the_network_is_slow(delayed_orchestrators, reference_target):
    mean_k = {}
    for rtt_ms, address in delayed_orchestrators.items():
        chosen = []
        for prompt in PROMPTS:
            request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=MAX_NEW_TOKENS,
                                         speculation=pb.SpeculationConfig(mode=pb.SPECULATION_MODE_ADAPTIVE))
            tokens, _, last = generate(address, request)
            assert tokens == _reference(reference_target, prompt), f"{rtt_ms} ms, prompt {prompt}"
            rounds = list(last.stats.num_speculative_tokens_per_round)
            chosen.extend(rounds[len(rounds) // 3:-1])  # after warm-up, without the capped last round
            if rtt_ms:
                assert last.stats.controller_estimates["rtt_target"] >= 0.02  # the proxy's delay is seen
        mean_k[rtt_ms] = statistics.mean(chosen)
    print("mean K by RTT (ms):", mean_k)
    assert mean_k[20.0] > mean_k[0.0], mean_k
