"""Streamed speculation through real services: the target decodes on in one Decode call and
verifies the drafts the draft offers it meanwhile (Offer).

The draft runs as its own process (`specdec serve draft`), as on its own machine: in one process
every service's passes share one model thread, so a draft call would wait behind the target's
passes and its offers would always come too late. The target (in-process, float64) has each pass
slowed to SLOW_PASS_SECONDS, as a larger model's would be, so that offers arrive while its Decode
is still going. Greedy output is the target's own, whatever the offers held and whenever they
arrived; sampled, the joint law of the first tokens is the target's (the chi-square test of
tests/service/test_sampling_services.py, with a close draft so that offered drafts are verified
among those tokens)."""

from __future__ import annotations

import random
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

import orchestrator.server
from orchestrator.pipeline_policy import PipelineConfig, PipelinePriors
from orchestrator.pipelining import RequestStreaming, StreamPaces
from orchestrator.pool import PoolConfig
from orchestrator.service import OrchestratorConfig
from specdec.delay_proxy import DelayProxyConfig, start_in_thread
from specdec.rpc.server import ServerConfig
from specdec.v1 import common_pb2
from specdec.v1 import orchestrator_pb2 as pb
from tests import tiny_models
from tests.process_groups import run_specdec
from tests.service import test_sampling_services as sampling
from tests.stack import SlowPasses, auto_pipelining_as_on_separate_hardware, generate, start_target

MAX_NEW_TOKENS = 40
LONG_NEW_TOKENS = 64  # adaptive K reaches its stretches after a few rounds
SLOW_PASS_SECONDS = 0.03


class StreamedStack:
    def __init__(self, target, orchestrator_service, servers, draft_process) -> None:
        self.target = target
        self.orchestrator = orchestrator_service
        self.servers = servers
        self.draft_process = draft_process

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.servers[-1].port}"


def _start(loop_thread, target_dir: Path, draft_dir: Path, top_m: int, num_speculative_tokens: int,
           draft_delay_ms: float = 0.0):
    """A context manager's body: the draft process, the target and orchestrator in-process; the
    draft's hop through a delay proxy adding draft_delay_ms each way when that is > 0."""
    with run_specdec("serve", "draft", "--model", str(draft_dir), "--dtype", "float64", "--port", "0",
                     "--threads", "1", "--top-m", str(top_m)) as draft, ExitStack() as proxies:
        draft_address = draft.wait_for_line(r"READY draft (\S+)").group(1)
        if draft_delay_ms > 0:
            host, port = draft_address.rsplit(":", 1)
            proxy = proxies.enter_context(start_in_thread(DelayProxyConfig(
                upstream_host=host, upstream_port=int(port), one_way_delay_ms=draft_delay_ms)))
            draft_address = f"127.0.0.1:{proxy.port}"

        async def start():
            target_server, target = await start_target(target_dir)
            config = OrchestratorConfig(draft=draft_address, target=f"127.0.0.1:{target_server.port}",
                                        num_speculative_tokens=num_speculative_tokens,
                                        pool=PoolConfig(refresh_seconds=0.5), startup_timeout_seconds=60)
            orchestrator_server, service = await orchestrator.server.start(config, ServerConfig(port=0))
            return target, service, [target_server, orchestrator_server]

        target, service, servers = loop_thread.run(start())
        try:
            with SlowPasses(target, SLOW_PASS_SECONDS):
                yield StreamedStack(target, service, servers, draft)
        finally:
            async def stop():
                for server in reversed(servers):
                    await server.stop()

            loop_thread.run(stop())


@pytest.fixture(scope="module")
def greedy_stack(loop_thread, tiny_pair):
    """The default tiny pair: the perturbed draft agrees with the target often, not always."""
    yield from _start(loop_thread, tiny_pair.target_dir, tiny_pair.draft_dir, top_m=64, num_speculative_tokens=4)


class AlwaysOffering(StreamPaces):
    """Every call offers, however its pace compares: what is tested here is what offers do."""

    def offer_next(self) -> bool:
        return True

    def clearly_slower(self, seconds_per_token: float) -> bool:
        return False


@pytest.fixture(scope="module")
def distant_draft_stack(loop_thread, tiny_pair):
    """The draft 2 x 30 ms away: the target has committed a token or two by the time an offer
    drafted from its C arrives, so offers carry branches."""
    for stack in _start(loop_thread, tiny_pair.target_dir, tiny_pair.draft_dir, top_m=64, num_speculative_tokens=3,
                        draft_delay_ms=30.0):
        stack.orchestrator.stream_paces = stack.orchestrator.stretch_paces = {True: AlwaysOffering(),
                                                                              False: AlwaysOffering()}
        with auto_pipelining_as_on_separate_hardware(stack.orchestrator):  # what auto does there
            yield stack


@pytest.fixture(scope="module")
def sampled_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("streamed-sampling-pair")
    target = sampling._small_model(seed=11)
    target_dir = tiny_models.save(target, root / "target", with_tokenizer=False)
    draft_dir = tiny_models.save(tiny_models.perturbed_copy(target, seed=5, scale=0.5), root / "draft",
                                 with_tokenizer=False)
    return target_dir, draft_dir


@pytest.fixture(scope="module")
def sampled_stack(loop_thread, sampled_pair):
    yield from _start(loop_thread, *sampled_pair, top_m=sampling.DRAFT_TOP_M,
                      num_speculative_tokens=sampling.NUM_SPECULATIVE_TOKENS)


def _prompts(count: int, vocab_size: int = 50) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(2, 20))] for _ in range(count)]


def _request(prompt: list[int], num_speculative_tokens: int, pipeline: int = pb.PIPELINE_MODE_STREAM,
             sampling_params: common_pb2.SamplingParams | None = None, max_new_tokens: int = MAX_NEW_TOKENS
             ) -> pb.GenerateRequest:
    speculation = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=num_speculative_tokens,
                                       pipeline=pipeline)
    return pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=max_new_tokens, speculation=speculation,
                              sampling=sampling_params)


@pytest.mark.parametrize("num_speculative_tokens", [1, 3])
def test_streamed_greedy_output_is_the_targets(greedy_stack, reference_target, num_speculative_tokens):
    drafts = accepted = passes = 0
    for prompt in _prompts(4):
        tokens, _, last = generate(greedy_stack.address, _request(prompt, num_speculative_tokens))
        with torch.no_grad():
            output = reference_target.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert tokens == output[0, len(prompt):].tolist(), prompt
        stats = last.stats
        assert stats.drafted_tokens == 0 and stats.decode_calls > 0  # no Verify rounds: Decode calls only
        assert stats.offered_drafts <= num_speculative_tokens * stats.offered_passes
        assert stats.offered_passes <= stats.decoded_tokens
        drafts += stats.offered_drafts
        accepted += stats.offered_accepted
        passes += stats.offered_passes
    # Offers reached the target's passes; the perturbed draft was both right and wrong there.
    assert passes > 0 and 0 < accepted < drafts, (passes, accepted, drafts)
    # /metrics counts them too (the orchestrator's registry, as its metrics port serves it)
    registry = greedy_stack.orchestrator.telemetry.registry
    model = greedy_stack.orchestrator.telemetry.model_name
    assert registry.get_sample_value("specdec:offered_accepted_total", {"model_name": model}) >= accepted


def test_a_draft_that_does_not_follow_is_offered_call_by_call(greedy_stack, reference_target):
    """A draft replica known not to take Follow streams (an older one) is asked one draft call at a
    time: its offers still reach the target's passes, and greedy output is the target's."""
    replicas = list(greedy_stack.orchestrator.draft_pool.replicas.values())
    for replica in replicas:
        replica.client.follows = False
    try:
        passes = 0
        for prompt in _prompts(3):
            tokens, _, last = generate(greedy_stack.address, _request(prompt, 3))
            with torch.no_grad():
                output = reference_target.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS,
                                                   do_sample=False,
                                                   attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            assert tokens == output[0, len(prompt):].tolist(), prompt
            passes += last.stats.offered_passes
        assert passes > 0  # offered with Follow off: call by call
    finally:
        for replica in replicas:
            replica.client.follows = True


def test_offers_branches_are_verified_where_c_left_the_drafts(distant_draft_stack, reference_target):
    """Offers from a draft whose answers lag: the target takes a branch's drafts where it committed
    one of the draft's other candidates (pipeline_fanout 3, the default); with fan-out 0 it takes
    none. Offers whose drafts C had already left when the draft answered are not sent. Greedy
    output is the target's either way."""
    branch_passes, dropped = {}, 0
    for fanout in (3, 0):
        branch_passes[fanout] = 0
        for prompt in _prompts(8):
            request = _request(prompt, 3)
            request.speculation.pipeline_fanout = fanout
            tokens, _, last = generate(distant_draft_stack.address, request)
            with torch.no_grad():
                output = reference_target.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS,
                                                   do_sample=False,
                                                   attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            assert tokens == output[0, len(prompt):].tolist(), (fanout, prompt)
            assert last.stats.offered_branch_passes <= last.stats.offered_passes
            branch_passes[fanout] += last.stats.offered_branch_passes
            dropped += last.stats.offers_dropped
    assert branch_passes[3] > 0 and branch_passes[0] == 0, branch_passes
    assert dropped > 0
    registry = distant_draft_stack.orchestrator.telemetry.registry
    model = distant_draft_stack.orchestrator.telemetry.model_name
    assert registry.get_sample_value("specdec:offered_branch_passes_total", {"model_name": model}) >= branch_passes[3]


def test_adaptive_requests_are_offered_drafts_under_pipelining_auto(distant_draft_stack, reference_target):
    """Adaptive K under pipelining auto, the draft 2 x 30 ms away: a request either streams (one
    Decode at a time, the draft's drafts offered to its passes) or runs the controller's rounds,
    which decode mostly in K = 0 stretches (which go on past their probes, offering nothing: as
    adaptive K's own); each way is measured (the first two long requests), then the faster taken.
    Greedy output is the target's."""
    offers = passes = stretches = 0
    chosen = set()
    for prompt in _prompts(16):
        speculation = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_ADAPTIVE, pipeline=pb.PIPELINE_MODE_AUTO)
        request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=LONG_NEW_TOKENS, speculation=speculation)
        tokens, _, last = generate(distant_draft_stack.address, request)
        with torch.no_grad():
            output = reference_target.generate(torch.tensor([prompt]), max_new_tokens=LONG_NEW_TOKENS, do_sample=False,
                                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert tokens == output[0, len(prompt):].tolist(), prompt
        stats = last.stats
        assert stats.offered_drafts <= 2 * stats.offered_passes  # STRETCH_OFFER_DEPTH drafts a pass at most
        offers += stats.offers
        chosen.add(dict(stats.controller_estimates).get("auto_streamed"))
        passes += stats.offered_passes
        stretches += stats.decode_calls
    assert stretches > 0 and offers > 0 and passes > 0, (stretches, offers, passes)
    assert chosen == {0.0, 1.0}, chosen  # requests that streamed, and requests in rounds


def _long_answers(reference_target) -> list[tuple[list[int], list[int]]]:
    """Prompts whose greedy answer runs the whole LONG_NEW_TOKENS (no early end of sequence),
    with that answer: at least 3 of them."""
    references = []
    for prompt in _prompts(16):
        with torch.no_grad():
            output = reference_target.generate(torch.tensor([prompt]), max_new_tokens=LONG_NEW_TOKENS, do_sample=False,
                                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        expected = output[0, len(prompt):].tolist()
        if len(expected) == LONG_NEW_TOKENS:
            references.append((prompt, expected))
    assert len(references) >= 3
    return references


def _auto_requests(stack, reference_target):
    """Three adaptive requests under pipelining auto on prompts whose greedy answer runs the whole
    LONG_NEW_TOKENS, each checked token for token against the target's own: yields each one's
    last response (its stats)."""
    for prompt, expected in _long_answers(reference_target)[:3]:
        speculation = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_ADAPTIVE, pipeline=pb.PIPELINE_MODE_AUTO)
        request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=LONG_NEW_TOKENS,
                                     speculation=speculation)
        tokens, _, last = generate(stack.address, request)
        assert tokens == expected, prompt
        yield last


class AlwaysStreaming(RequestStreaming):
    def streams_next(self, greedy: bool, network: int = 0, drafts: bool = False, measuring: bool = False) -> bool:
        return True


def test_a_streamed_request_offers_whatever_stretches_measured(distant_draft_stack, reference_target):
    """Pipelining auto: a request the chooser streams is offered the draft's drafts in every
    Decode call, even where K = 0 stretches measured their offers slower (streaming was chosen
    for its offers; its own test judges it), and it leaves the stretches' measurements alone."""
    orchestrator_service = distant_draft_stack.orchestrator
    saved = orchestrator_service.request_streaming, orchestrator_service.stretch_paces
    stretch_paces = StreamPaces()
    stretch_paces.observe(True, 1.0)  # offers measured 100x slower in stretches
    stretch_paces.observe(False, 0.01)
    orchestrator_service.request_streaming = AlwaysStreaming()
    orchestrator_service.stretch_paces = {True: stretch_paces, False: StreamPaces()}
    try:
        for last in _auto_requests(distant_draft_stack, reference_target):
            stats = last.stats
            assert dict(stats.controller_estimates)["auto_streamed"] == 1.0
            assert stats.decode_calls > 0 and stats.offers > 0, (stats.decode_calls, stats.offers)
    finally:
        orchestrator_service.request_streaming, orchestrator_service.stretch_paces = saved
    assert stretch_paces.seconds == {True: 1.0, False: 0.01}


class RoundsRecorded(RequestStreaming):
    """Every request runs the controller's rounds; what each was told and measured is kept."""

    def __init__(self, pool: PipelinePriors) -> None:
        super().__init__()
        self.pool = pool  # the greedy requests' candidate ranks
        self.asked: list[bool] = []  # drafts, as each request started
        self.measuring: list[tuple[bool, int]] = []  # measuring, and the pool's outcomes then
        self.drafted: list[bool | None] = []  # drafted, as each request's rounds were measured

    def streams_next(self, greedy: bool, network: int = 0, drafts: bool = False, measuring: bool = False) -> bool:
        self.asked.append(drafts)
        self.measuring.append((measuring, self.pool.outcomes))
        return False

    def observe(self, greedy: bool, streamed: bool, seconds_per_token: float, network: int = 0,
                accepted_share: float | None = None, drafted: bool | None = None) -> None:
        assert not streamed
        self.drafted.append(drafted)
        super().observe(greedy, streamed, seconds_per_token, network, accepted_share, drafted)


def test_the_rounds_pace_is_told_whether_the_rounds_drafted(distant_draft_stack, reference_target):
    """Pipelining auto keeps the rounds' pace with whether its request drafted (a request whose
    controller would draft re-measures rounds that did not): each request's rounds are told
    whether any of its rounds drafted, as its stats count them, and each new request is asked
    about with its controller's opening choice, and with whether its stretches still measure the
    pool's candidate ranks beside them (greedy, the draft on hardware of its own: from a fresh
    pool, until it has its outcomes)."""
    orchestrator_service = distant_draft_stack.orchestrator
    saved = orchestrator_service.request_streaming, orchestrator_service.pipeline_priors
    pool = PipelinePriors()
    orchestrator_service.pipeline_priors = {"greedy": pool, "sampled": PipelinePriors()}
    orchestrator_service.request_streaming = recorded = RoundsRecorded(pool)
    drafted: list[bool] = []
    try:
        for last in _auto_requests(distant_draft_stack, reference_target):
            assert dict(last.stats.controller_estimates)["auto_streamed"] == 0.0
            drafted.append(last.stats.drafted_tokens > 0)
    finally:
        orchestrator_service.request_streaming, orchestrator_service.pipeline_priors = saved
    assert recorded.drafted == drafted
    assert len(recorded.asked) == 3 and all(isinstance(drafts, bool) for drafts in recorded.asked)
    needed = PipelineConfig().measured_outcomes
    assert recorded.measuring[0] == (True, 0), recorded.measuring
    assert all(measuring == (outcomes < needed) for measuring, outcomes in recorded.measuring), recorded.measuring


class TrialLosing(RequestStreaming):
    """Every request starts the way `first` says, as a test that turns out clearly the slower
    when it is judged: what is tested here is the switch to the other way mid-request."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first = first
        self.judged: list[tuple[bool, bool]] = []  # (greedy, streamed) of each test judged

    def streams_next(self, greedy: bool, network: int = 0, drafts: bool = False, measuring: bool = False) -> bool:
        return self.first

    def is_test(self, greedy: bool, streams: bool, network: int = 0) -> bool:
        return streams == self.first

    def clearly_slower(self, greedy: bool, streams: bool, seconds_per_token: float, network: int = 0) -> bool:
        self.judged.append((greedy, streams))
        return True


@pytest.mark.parametrize("first", [True, False], ids=["streamed-then-rounds", "rounds-then-streamed"])
def test_a_request_switches_way_where_its_test_loses(distant_draft_stack, reference_target, first):
    """Pipelining auto: a request that tests a way (streamed, or the controller's rounds) that
    turns out clearly the slower after 16 tokens runs the rest of it the other way. Greedy output
    is the target's, whichever way each token came."""
    orchestrator_service = distant_draft_stack.orchestrator
    saved = orchestrator_service.request_streaming
    orchestrator_service.request_streaming = forced = TrialLosing(first)
    try:
        for last in _auto_requests(distant_draft_stack, reference_target):
            estimates = dict(last.stats.controller_estimates)
            assert estimates["auto_switched"] == 1.0 and estimates["auto_streamed"] == float(not first), estimates
    finally:
        orchestrator_service.request_streaming = saved
    assert forced.judged == [(True, first)] * 3  # once a request, its test; never the way it switched to
    # both ways' tokens were measured: the test's when it lost, the rest's at the request's end
    # (on the network the requests ran on: the paces are kept by network)
    greedy_paces = [paces for (greedy, _), paces in forced.paces.items() if greedy]
    assert any(all(paces.seconds[way] is not None for way in (True, False)) for paces in greedy_paces)


def test_streamed_sampling_follows_the_target_law(loop_thread, sampled_stack, sampled_pair):
    law = sampling.reference_joint_law(sampling._load(sampled_pair[0]),
                                       sampling.Config(temperature=1.0, top_k=0, num_samples=0, first_seed=0))
    num_samples = 600

    results = loop_thread.run(sampling.generate_all(sampled_stack.address, [
        _request(sampling.PROMPT, sampling.NUM_SPECULATIVE_TOKENS,
                 sampling_params=common_pb2.SamplingParams(temperature=1.0, seed=seed),
                 max_new_tokens=sampling.MAX_NEW_TOKENS)
        for seed in range(50_000, 50_000 + num_samples)]))
    assert all(len(tokens) == sampling.MAX_NEW_TOKENS for tokens, _ in results)
    samples = torch.tensor([tokens[:sampling.NUM_TOKENS] for tokens, _ in results])
    p_value, summary = sampling.chi_square_p_value(sampling._joint_counts(samples), law)
    assert p_value > sampling.ALPHA, summary
    drafts = sum(stats.offered_drafts for _, stats in results)
    accepted = sum(stats.offered_accepted for _, stats in results)
    # Offered drafts were verified, and both accepted and rejected. All of them stood for tokens
    # 2 or 3: the Decode after the first token asks for 3, and a pass verifies drafts only where
    # it may commit a token after them (so not after the Decode's second token).
    assert 0 < accepted < drafts, (accepted, drafts)
