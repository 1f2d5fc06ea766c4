"""Model-free drafts (ngram, suffix, hybrid) through the real services: greedy output equals the
target's own, lookups are proposed and accepted on repetitive prompts, the method of each draft
reaches the HTTP API's extension and /metrics, the shared cache is kept apart per bearer token,
and a sampled request keeps the target's law with one-hot proposals."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import replace

import grpc
import pytest
import torch

import draft_service.server
import orchestrator.server
from draft_service.lookup_service import LookupDraftConfig, load_vocabulary
from orchestrator.http_api import HttpApi, HttpConfig
from orchestrator.local_draft import LookupConfig
from orchestrator.pool import PoolConfig
from orchestrator.service import OrchestratorConfig, PromptInput
from orchestrator.k_policy import Speculation
from specdec.protocol import SamplingParams, SparseDistribution
from specdec.rpc.auth import BearerTokenInterceptor, bearer_metadata, token_partition
from specdec.rpc.server import ServerConfig
from specdec.serving import ServiceConfig
from specdec.v1 import common_pb2
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

from tests import stack as stack_module
from tests import tiny_models
from tests.http.test_openai_api import post_raw
from tests.service import test_sampling_services as sampling
from tests.waiting import eventually

MAX_NEW_TOKENS = 32


class LookupStack:
    def __init__(self, servers, service, draft=None):
        self.servers, self.service = servers, service
        self.draft = draft  # the draft service (model or hybrid), if one was started

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.servers[-1].port}"

    async def stop(self) -> None:
        await self.service.close()
        for server in reversed(self.servers):
            await server.stop()


async def start_lookup_stack(target_dir, draft_dir, draft_method: str, num_speculative_tokens: int = 4,
                             lookup: LookupConfig = LookupConfig(), orchestrator_interceptors: tuple = (),
                             **target_service) -> LookupStack:
    target_server, _ = await stack_module.start_target(target_dir, **target_service)
    servers = [target_server]
    draft_service = None
    if draft_method in ("hybrid", "model"):
        draft_server, draft_service = await stack_module.start_draft(draft_dir)
        servers.append(draft_server)
        draft = f"127.0.0.1:{draft_server.port}"
    else:
        draft = f"local:{draft_method}"
    config = OrchestratorConfig(
        draft=draft, target=f"127.0.0.1:{target_server.port}",
        draft_method=draft_method if draft_method == "hybrid" else "",
        num_speculative_tokens=num_speculative_tokens, pool=PoolConfig(refresh_seconds=0.5),
        startup_timeout_seconds=30, lookup=lookup,
    )
    orchestrator_server, service = await orchestrator.server.start(
        config, ServerConfig(port=0, interceptors=orchestrator_interceptors))
    return LookupStack([*servers, orchestrator_server], service, draft_service)


def _repetitive_prompts(vocab_size: int, count: int = 8) -> list[list[int]]:
    rng = random.Random(77)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(3, vocab_size) for _ in range(rng.randint(3, 6))]
        prompts.append([*phrase, *[rng.randrange(3, vocab_size) for _ in range(2)], *phrase, *phrase[:2]])
    return prompts


@pytest.fixture(scope="module")
def references(reference_target):
    table = {}
    for prompt in _repetitive_prompts(reference_target.config.vocab_size):
        with torch.no_grad():
            output = reference_target.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )
        table[tuple(prompt)] = output[0, len(prompt):].tolist()
    return table


async def _generate(service, prompt, sampling=SamplingParams(), speculation=Speculation(mode="fixed"),
                    max_new_tokens=MAX_NEW_TOKENS):
    tokens, last = [], None
    async for chunk in service.generate(PromptInput(prompt_token_ids=tuple(prompt)), max_new_tokens,
                                        sampling, speculation=speculation):
        tokens.extend(chunk.token_ids)
        last = chunk
    return tokens, last.stats


@pytest.mark.parametrize("method", ["ngram", "suffix", "hybrid"])
@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
def test_greedy_lookup_drafts_keep_the_target_output(loop_thread, tiny_pair, references, method, mode):
    running = loop_thread.run(start_lookup_stack(tiny_pair.target_dir, tiny_pair.draft_dir, method))
    try:
        accepted_by_method: dict[str, int] = {}
        drafted = accepted = looked_up_in_decode = 0
        for prompt, expected in references.items():
            tokens, stats = loop_thread.run(_generate(running.service, prompt, speculation=Speculation(mode=mode)))
            assert tokens == expected, f"{method}: prompt {prompt}"
            looked_up_in_decode += stats.decode_lookup_accepted
            assert stats.drafted_tokens == sum(stats.drafted_by_method.values())
            assert stats.accepted_tokens == sum(stats.accepted_by_method.values())
            drafted += stats.drafted_tokens
            accepted += stats.accepted_tokens
            for name, count in stats.accepted_by_method.items():
                accepted_by_method[name] = accepted_by_method.get(name, 0) + count
        lookup = "suffix" if method == "hybrid" else method
        # The lookup paid: in the orchestrator's rounds, or, where adaptive K settled at K = 0 (the
        # tiny pair's repetitive answers decode fast in a Decode call), looked up by the target in
        # its own Decode passes.
        assert accepted_by_method.get(lookup, 0) + looked_up_in_decode > 0, accepted_by_method
        if method == "hybrid":
            assert accepted_by_method.get("model", 0) > 0, accepted_by_method
        else:
            assert set(accepted_by_method) <= {method}
        assert 0 < accepted <= drafted
        if method != "hybrid":
            assert running.service.draft_pool.replicas == {}  # no draft hop at all
    finally:
        loop_thread.run(running.stop())


def test_local_draft_over_the_public_api(loop_thread, tiny_pair, references):
    running = loop_thread.run(start_lookup_stack(tiny_pair.target_dir, tiny_pair.draft_dir, "suffix"))
    try:
        prompt, expected = next(iter(references.items()))
        request = pb.GenerateRequest(prompt_token_ids=list(prompt), max_new_tokens=MAX_NEW_TOKENS,
                                     speculation=pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED,
                                                                      num_speculative_tokens=4))
        tokens, _, last = stack_module.generate(running.address, request)
        assert tokens == expected
        assert last.stats.draft_replica == "local:suffix"
        assert last.stats.draft_seconds >= 0 and last.stats.rounds > 0
        assert dict(last.stats.drafted_tokens_by_method) == {"suffix": last.stats.drafted_tokens}
        assert dict(last.stats.accepted_tokens_by_method) == {"suffix": last.stats.accepted_tokens}
        assert last.stats.accepted_tokens > 0
    finally:
        loop_thread.run(running.stop())


def test_the_method_of_each_draft_reaches_the_http_extension_and_the_metrics(loop_thread, tiny_pair, references):
    """Hybrid mixes the suffix lookup's rounds and the model's: the HTTP API's `specdec` field
    says how many tokens each proposed and had accepted, and /metrics' counters by method add up
    the same numbers over the requests."""
    running = loop_thread.run(start_lookup_stack(tiny_pair.target_dir, tiny_pair.draft_dir, "hybrid"))
    api = HttpApi(running.service, HttpConfig(port=0))
    loop_thread.run(api.start())
    try:
        drafted: dict[str, int] = {}
        accepted: dict[str, int] = {}
        for prompt in references:
            request = {"model": "any", "prompt": list(prompt), "max_tokens": MAX_NEW_TOKENS, "temperature": 0,
                       "specdec": {"speculation": "fixed", "num_speculative_tokens": 4}}
            status, body = post_raw(api, "/v1/completions", json.dumps(request).encode())
            assert status == 200, body
            extension = body["specdec"]
            assert set(extension["drafted_tokens_by_method"]) <= {"model", "suffix"}
            assert sum(extension["drafted_tokens_by_method"].values()) == extension["drafted_tokens"]
            assert sum(extension["accepted_tokens_by_method"].values()) == extension["accepted_tokens"]
            for name, count in extension["drafted_tokens_by_method"].items():
                drafted[name] = drafted.get(name, 0) + count
            for name, count in extension["accepted_tokens_by_method"].items():
                accepted[name] = accepted.get(name, 0) + count
        assert accepted.get("suffix", 0) > 0 and accepted.get("model", 0) > 0, accepted
        registry = running.service.telemetry.registry
        model_name = running.service.reference.model_id
        for method in ("model", "ngram", "suffix"):
            labels = {"model_name": model_name, "method": method}
            assert registry.get_sample_value(
                "specdec:spec_decode_num_draft_tokens_by_method_total", labels) == drafted.get(method, 0)
            assert registry.get_sample_value(
                "specdec:spec_decode_num_accepted_tokens_by_method_total", labels) == accepted.get(method, 0)
    finally:
        loop_thread.run(api.stop())
        loop_thread.run(running.stop())


def test_shared_suffix_cache_helps_a_repeated_request(loop_thread, tiny_pair, references):
    shared = LookupConfig(suffix_cache="shared")
    running = loop_thread.run(start_lookup_stack(tiny_pair.target_dir, tiny_pair.draft_dir, "suffix",
                                                 lookup=shared))
    try:
        prompt, expected = next(iter(references.items()))
        first_tokens, first = loop_thread.run(_generate(running.service, prompt))
        second_tokens, second = loop_thread.run(_generate(running.service, prompt))
        assert first_tokens == second_tokens == expected
        assert second.accepted_tokens >= first.accepted_tokens
        assert running.service.local_drafts.cache is not None and len(running.service.local_drafts.cache) == 2
    finally:
        loop_thread.run(running.stop())


def _generate_for_clients(address: str, tokens: tuple[str, ...], prompts: list, references: dict
                          ) -> dict[str, list[tuple[int, ...]]]:
    """Greedy Generate over gRPC for each prompt in turn, the clients' bearer tokens taking turns;
    checks each output against the target alone; returns each token's outputs in order."""
    outputs: dict[str, list[tuple[int, ...]]] = {token: [] for token in tokens}
    with grpc.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        for index, prompt in enumerate(prompts):
            token = tokens[index % len(tokens)]
            request = pb.GenerateRequest(prompt_token_ids=list(prompt), max_new_tokens=MAX_NEW_TOKENS)
            generated = [t for response in stub.Generate(request, metadata=bearer_metadata(token), timeout=300)
                         for t in response.token_ids]
            assert generated == references[prompt]
            outputs[token].append(tuple(generated))
    return outputs


def test_with_several_tokens_the_shared_cache_is_kept_apart_per_token(loop_thread, tiny_pair, references):
    """Two clients, each with its own bearer token, on one orchestrator with a shared suffix
    cache: each token's requests (over gRPC and over HTTP) land in that token's cache only, so no
    lookup for one client draws on the other's outputs (tests/unit/test_lookup.py plays the
    lookups themselves against a leak)."""
    tokens = ("token-of-a", "token-of-b")
    running = loop_thread.run(start_lookup_stack(
        tiny_pair.target_dir, tiny_pair.draft_dir, "suffix", lookup=LookupConfig(suffix_cache="shared"),
        orchestrator_interceptors=(BearerTokenInterceptor(tokens),)))
    api = HttpApi(running.service, HttpConfig(port=0, auth_token=tokens))
    loop_thread.run(api.start())
    try:
        prompts = list(references)
        outputs = _generate_for_clients(running.address, tokens, prompts[:4], references)
        request = {"model": "any", "prompt": list(prompts[4]), "max_tokens": MAX_NEW_TOKENS, "temperature": 0}
        status, body = post_raw(api, "/v1/completions", json.dumps(request).encode(),
                                {"Authorization": f"Bearer {tokens[1]}"})
        assert status == 200, body
        outputs[tokens[1]].append(tuple(references[prompts[4]]))
        caches = running.service.local_drafts.caches
        assert set(caches) == {"", *(token_partition(token) for token in tokens)}
        for token in tokens:
            assert caches[token_partition(token)].entries() == outputs[token]
        assert len(caches[""]) == 0  # every request carried a token
        assert all(token not in partition for partition in caches for token in tokens)
    finally:
        loop_thread.run(api.stop())
        loop_thread.run(running.stop())


# ---------------------------------------- a draft service without a model: serve draft --method


async def start_lookup_replica_stack(target_dir, method: str, suffix_cache: str = "session",
                                     orchestrator_interceptors: tuple = ()):
    """Target, a lookup draft service (no model: the target's vocabulary) and an orchestrator that
    takes it as its draft pool, like any draft replica. Returns (stack, the lookup service)."""
    target_server, _ = await stack_module.start_target(target_dir)
    draft_server, lookup_service = await draft_service.server.start_lookup(
        load_vocabulary(str(target_dir)), ServiceConfig(replica_id="lookup-0"), ServerConfig(port=0),
        lookup=LookupDraftConfig(method=method, suffix_cache=suffix_cache))
    config = OrchestratorConfig(
        draft=f"127.0.0.1:{draft_server.port}", target=f"127.0.0.1:{target_server.port}",
        num_speculative_tokens=4, pool=PoolConfig(refresh_seconds=0.5), startup_timeout_seconds=30,
    )
    orchestrator_server, service = await orchestrator.server.start(
        config, ServerConfig(port=0, interceptors=orchestrator_interceptors))
    return LookupStack([target_server, draft_server, orchestrator_server], service), lookup_service


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_lookup_draft_service_keeps_the_target_output_and_names_its_method(loop_thread, tiny_pair,
                                                                              references, method):
    running, lookup_service = loop_thread.run(start_lookup_replica_stack(tiny_pair.target_dir, method))
    try:
        (replica,) = running.service.draft_pool.replicas.values()
        assert replica.info.model_id == f"lookup:{method}" and not replica.refused
        accepted = 0
        for mode in ("fixed", "adaptive"):
            for prompt, expected in references.items():
                tokens, stats = loop_thread.run(_generate(running.service, prompt, speculation=Speculation(mode=mode)))
                assert tokens == expected, f"{method} {mode}: prompt {prompt}"
                assert set(stats.drafted_by_method) <= {method}  # counted under the lookup, not "model"
                assert stats.drafted_tokens == sum(stats.drafted_by_method.values())
                assert stats.draft_replica == "lookup-0"
                accepted += stats.accepted_by_method.get(method, 0)
                # The replica sends each draft's match length: the adaptive controller weighs
                # its proposals by it, as it does the orchestrator's own lookup's.
                weighed = any(name.startswith("lookup_alpha_match_") for name in stats.controller_estimates)
                assert weighed == (mode == "adaptive" and stats.drafted_tokens > 0), (mode, stats.controller_estimates)
        assert accepted > 0
        assert lookup_service.worker.counters.passes_total == 0  # no forward pass, ever
    finally:
        loop_thread.run(running.stop())


def test_a_lookup_draft_service_proposes_one_hot_and_shares_its_cache_across_sessions(loop_thread, tiny_pair):
    async def scenario():
        vocabulary = load_vocabulary(str(tiny_pair.target_dir))
        server, service = await draft_service.server.start_lookup(
            vocabulary, ServiceConfig(replica_id="lookup-0"), ServerConfig(port=0),
            lookup=LookupDraftConfig(method="suffix", suffix_cache="shared"))
        try:
            prompt, output = [5, 6, 7, 8], [9, 10, 11, 12, 13, 14]
            handle, _, _ = await service.prefill("one", prompt, SamplingParams(temperature=0.8, seed=1))
            handle, first, _ = await service.propose(handle, [], 4)
            assert first.token_ids == ()  # nothing seen yet follows 8
            handle, _, _ = await service.propose(handle, output, 2)
            assert await service.release("one")
            assert service.cache is not None and service.cache.entries() == [tuple(output)]
            # Another session of the replica: the first one's output is proposed, one-hot.
            handle, _, _ = await service.prefill("two", [1, 9, 10], SamplingParams(temperature=0.8, seed=2))
            _, proposal, timing = await service.propose(handle, [], 3)
            assert proposal.token_ids == (11, 12, 13)
            assert proposal.distributions == tuple(SparseDistribution((t,), (1.0,)) for t in (11, 12, 13))
            assert timing.queue_seconds == 0.0
            assert service.info().model_id == "lookup:suffix" and service.info().vocab_size == vocabulary.vocab_size
        finally:
            await server.stop()

    loop_thread.run(scenario())


def test_a_lookup_replica_keeps_its_shared_cache_apart_per_partition(loop_thread, tiny_pair):
    """The replica sees no API token: each Prefill names the session's partition, and a session
    draws only on what its own partition's sessions saw."""
    async def scenario():
        server, service = await draft_service.server.start_lookup(
            load_vocabulary(str(tiny_pair.target_dir)), ServiceConfig(replica_id="lookup-0"), ServerConfig(port=0),
            lookup=LookupDraftConfig(method="suffix", suffix_cache="shared", max_cache_partitions=3))
        greedy = SamplingParams()
        try:
            async def session(name, partition, prompt, output=(), k=3):
                handle, _, _ = await service.prefill(name, prompt, greedy, partition)
                handle, proposal, _ = await service.propose(handle, list(output), k)
                assert await service.release(name)
                return proposal.token_ids

            await session("a-1", "a", [5, 6, 7, 8], [9, 10, 11, 12, 13, 14])
            assert await session("b-1", "b", [1, 9, 10]) == ()  # a's output is not b's to see
            assert await session("none-1", "", [1, 9, 10]) == ()  # nor a session's without a partition
            assert await session("a-2", "a", [1, 9, 10]) == (11, 12, 13)  # but a's own
            assert service.caches["a"].entries()[0] == (9, 10, 11, 12, 13, 14)
            assert service.caches["b"].entries() == service.caches[""].entries() == []
            # At most max_cache_partitions caches: the least recently used goes first.
            assert list(service.caches) == ["b", "", "a"]
            await session("c-1", "c", [2, 3])
            assert list(service.caches) == ["", "a", "c"]
        finally:
            await server.stop()

    loop_thread.run(scenario())


def test_through_an_orchestrator_each_tokens_sessions_fill_their_own_partition_of_a_replica(
        loop_thread, tiny_pair, references):
    """Two clients with bearer tokens, an orchestrator in front of a lookup replica with a shared
    cache: each request's draft session is opened in its token's partition, so each client's
    outputs land in its own partition of the replica's cache and nowhere else."""
    tokens = ("token-of-a", "token-of-b")
    running, lookup_service = loop_thread.run(start_lookup_replica_stack(
        tiny_pair.target_dir, "suffix", suffix_cache="shared",
        orchestrator_interceptors=(BearerTokenInterceptor(tokens),)))
    try:
        prompts = list(references)
        outputs = _generate_for_clients(running.address, tokens, prompts[:4], references)
        caches = lookup_service.caches
        assert set(caches) == {token_partition(token) for token in tokens}  # no session without one
        # The orchestrator releases a draft session after its client has the last tokens: wait
        # for the last request's Release before counting.
        eventually(lambda: all(len(caches[token_partition(token)].entries()) >= len(outputs[token])
                               for token in tokens), "every request's draft session released")
        for token in tokens:
            # A session's output joins at Release: the output as far as the draft was told it
            # (the last round's tokens are never sent to it).
            entries = caches[token_partition(token)].entries()
            assert len(entries) == len(outputs[token])
            for entry, output in zip(entries, outputs[token]):
                assert entry and entry == output[:len(entry)]
    finally:
        loop_thread.run(running.stop())


# ------------------------------------------------------------------- sampling: the target's law

SAMPLING_PROMPT = [1, 5, 3, 6, 1, 5, 3, 6, 2, 1, 5]


@torch.no_grad()
def _joint_law(model, config: sampling.Config, prompt: list[int]) -> torch.Tensor:
    vocab, length = sampling.VOCAB_SIZE, len(prompt)
    pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))
    input_ids = torch.cat([torch.tensor(prompt).expand(vocab * vocab, length), pairs], dim=1)
    logits = model(input_ids=input_ids).logits
    rows = torch.cat([logits[0, length - 1].unsqueeze(0), logits[::vocab, length], logits[:, length + 1]])
    probs = sampling._processors(config)(torch.zeros(rows.shape[0], 1, dtype=torch.long), rows).softmax(-1)
    first, second, third = probs[0], probs[1: 1 + vocab], probs[1 + vocab:].reshape(vocab, vocab, vocab)
    return (first[:, None, None] * second[:, :, None] * third).reshape(-1)


async def _sample_many(address: str, config: sampling.Config, prompt: list[int], adaptive: bool = False,
                       in_flight: int = sampling.IN_FLIGHT):
    # adaptive: the controller chooses after each lookup how many of its tokens to verify
    return await sampling.generate_all(address, [
        pb.GenerateRequest(
            prompt_token_ids=prompt, max_new_tokens=sampling.MAX_NEW_TOKENS,
            sampling=common_pb2.SamplingParams(temperature=config.temperature, top_k=config.top_k, seed=seed),
            speculation=pb.SpeculationConfig(
                mode=pb.SPECULATION_MODE_ADAPTIVE if adaptive else pb.SPECULATION_MODE_FIXED,
                num_speculative_tokens=sampling.NUM_SPECULATIVE_TOKENS))
        for seed in range(config.first_seed, config.first_seed + config.num_samples)], in_flight)


@pytest.fixture(scope="module")
def sampling_target_dir(tmp_path_factory):
    """The vocabulary-8 target of test_sampling_services (no EOS, no tokenizer)."""
    root = tmp_path_factory.mktemp("lookup-sampling")
    return tiny_models.save(sampling._small_model(seed=11), root / "target", with_tokenizer=False)


@pytest.mark.parametrize(("method", "adaptive"), [("ngram", False), ("suffix", False), ("suffix", True)])
def test_sampled_lookup_output_follows_the_target_law(loop_thread, sampling_target_dir, method, adaptive):
    lookup = LookupConfig(ngram_min=1, suffix_min_share=0.05)
    running = loop_thread.run(start_lookup_stack(sampling_target_dir, None, method,
                                                 num_speculative_tokens=sampling.NUM_SPECULATIVE_TOKENS,
                                                 lookup=lookup))
    try:
        first_seed = 40_000 + (method == "suffix") * 1000 + adaptive * 2000
        config = replace(sampling.CONFIGS["temperature_1"], first_seed=first_seed)
        # Adaptive requests one at a time: with two or more in flight the speculation guard holds
        # them at K = 0 (plain Decode) until its tests find that speculation pays, so how many
        # lookups the chooser got to verify would rest on the run's timing (as few as 26 drafts,
        # none accepted). Alone, every round asks the chooser: ~1,000 drafted, ~60 accepted.
        in_flight = 1 if adaptive else sampling.IN_FLIGHT
        results = loop_thread.run(_sample_many(running.address, config, SAMPLING_PROMPT, adaptive, in_flight))
    finally:
        loop_thread.run(running.stop())
    assert all(len(tokens) == sampling.MAX_NEW_TOKENS for tokens, _ in results)
    drafted = sum(stats.drafted_tokens for _, stats in results)
    accepted = sum(stats.accepted_tokens for _, stats in results)
    assert 0 < accepted < drafted, (accepted, drafted)  # one-hot proposals both won and lost
    law = _joint_law(sampling._load(sampling_target_dir), config, SAMPLING_PROMPT)
    tokens = torch.tensor([tokens[:sampling.NUM_TOKENS] for tokens, _ in results])
    p_value, summary = sampling.chi_square_p_value(sampling._joint_counts(tokens), law)
    assert p_value > sampling.ALPHA, f"{method}: {summary}"



def test_hybrid_sends_the_draft_its_prompt_only_when_the_model_is_needed(loop_thread, tiny_pair, references):
    running = loop_thread.run(start_lookup_stack(tiny_pair.target_dir, tiny_pair.draft_dir, "hybrid"))
    try:
        prompt, expected = next(iter(references.items()))
        # One token: the target's prefill gives it; no round ran, so the draft never got the
        # prompt (no forward pass there at all).
        passes = running.draft.info().passes_total
        tokens, stats = loop_thread.run(_generate(running.service, prompt, max_new_tokens=1))
        loop_thread.run(asyncio.sleep(0.2))  # a Prefill sent anyway would have run by now
        assert tokens == expected[:1]
        assert stats.draft_replica == "" and running.draft.info().passes_total == passes
        # Distinct prompt tokens: no lookup match at first, so the model draft proposes, its
        # Prefill sent then (of everything committed so far).
        distinct = list(range(3, 23))
        tokens, stats = loop_thread.run(_generate(running.service, distinct))
        assert stats.draft_replica != "" and stats.drafted_by_method.get("model", 0) > 0
        assert len(tokens) == MAX_NEW_TOKENS
    finally:
        loop_thread.run(running.stop())


def test_hybrid_without_its_draft_model_goes_on_with_the_lookup(loop_thread, tiny_pair, references):
    async def start():
        target_server, _ = await stack_module.start_target(tiny_pair.target_dir)
        config = OrchestratorConfig(
            draft="127.0.0.1:1", target=f"127.0.0.1:{target_server.port}", draft_method="hybrid",
            pool=PoolConfig(refresh_seconds=0.5), startup_timeout_seconds=1,
        )
        orchestrator_server, service = await orchestrator.server.start(config, ServerConfig(port=0))
        return LookupStack([target_server, orchestrator_server], service)

    running = loop_thread.run(start())
    try:
        accepted = 0
        for prompt, expected in list(references.items())[:4]:
            tokens, stats = loop_thread.run(_generate(running.service, prompt))
            assert tokens == expected
            assert set(stats.drafted_by_method) <= {"suffix"}
            assert stats.draft_unavailable_rounds > 0
            accepted += stats.accepted_by_method.get("suffix", 0)
        assert accepted > 0
    finally:
        loop_thread.run(running.stop())


def test_adaptive_decode_calls_verify_the_targets_own_lookups(loop_thread, tiny_pair, references):
    """Adaptive requests with a lookup draft, all at once (the speculation guard holds them at
    K = 0, so the target decodes them in Decode calls): the target verifies tokens it looks up
    in each session's own in those calls' passes, greedy output unchanged; a request with
    speculation off decodes plainly."""
    running = loop_thread.run(start_lookup_stack(tiny_pair.target_dir, None, "ngram"))

    async def all_at_once(mode: str):
        return await asyncio.gather(*(_generate(running.service, list(prompt), speculation=Speculation(mode=mode))
                                      for prompt in references))

    try:
        adaptive = loop_thread.run(all_at_once("adaptive"))
        off = loop_thread.run(all_at_once("off"))
    finally:
        loop_thread.run(running.stop())
    for (tokens, _), (plain, _), expected in zip(adaptive, off, references.values()):
        assert tokens == expected and plain == expected
    passes = sum(stats.decode_lookup_passes for _, stats in adaptive)
    drafts = sum(stats.decode_lookup_drafts for _, stats in adaptive)
    accepted = sum(stats.decode_lookup_accepted for _, stats in adaptive)
    assert sum(stats.decode_calls for _, stats in adaptive) > 0
    assert passes > 0 and 0 < accepted <= drafts, (passes, drafts, accepted)
    assert all(stats.decode_lookup_passes == 0 for _, stats in off)
