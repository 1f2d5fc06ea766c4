"""An adaptive session whose controller settles at K = 0 decodes its K = 0 rounds in one streamed
target call (a Decode) up to its next probe, instead of a Verify each; the controller is told of
them (catch-up, probe schedule, their pace). The output must stay the target's own, the probes
must still come, and with a lookup draft (hybrid) the lookup must still be asked between
stretches. Real services in-process: the tiny float64 target with an unrelated random draft,
whose drafts are almost all rejected, so the controller leaves drafting early."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from orchestrator.k_controller import PLAIN_FACTOR_RANGE, KControllerConfig
from orchestrator.k_estimates import AcceptanceEstimate
from orchestrator.k_policy import Speculation
from orchestrator.service import PromptInput
from specdec.protocol import SamplingParams
from tests.service.test_lookup_drafts import _generate, start_lookup_stack

PROMPT = [5, 9, 14, 3, 22, 9, 14, 3]
MAX_NEW_TOKENS = 160
ADAPTIVE = Speculation(mode="adaptive")
SAMPLED_SEED = 0  # at T = 0.3 the tiny target's answer to PROMPT runs to MAX_NEW_TOKENS


@pytest.fixture(scope="module")
def expected(reference_target):
    """The target alone, greedy."""
    with torch.no_grad():
        output = reference_target.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                           attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
    return output[0, len(PROMPT):].tolist()


@contextmanager
def _far_draft_stack(loop_thread, tiny_pair, method: str):
    """The tiny target with the unrelated draft (method: model or hybrid); yields
    generate(speculation, max_new_tokens) -> (tokens, stats)."""
    running = loop_thread.run(start_lookup_stack(tiny_pair.target_dir, tiny_pair.far_draft_dir, method))

    def generate(speculation: Speculation, max_new_tokens: int = MAX_NEW_TOKENS, temperature: float = 0.0,
                 seed: int = 7):
        sampling = SamplingParams(temperature=temperature, seed=seed)
        return loop_thread.run(_generate(running.service, PROMPT, sampling, speculation=speculation,
                                         max_new_tokens=max_new_tokens))

    try:
        yield generate
    finally:
        loop_thread.run(running.stop())


def test_a_session_at_k0_decodes_its_rounds_in_stretches(loop_thread, tiny_pair, expected):
    with _far_draft_stack(loop_thread, tiny_pair, "model") as generate:
        tokens, stats = generate(ADAPTIVE)
        assert tokens == expected
        ks, decode_calls = list(stats.num_speculative_tokens_per_round), stats.decode_calls
        assert len(ks) == stats.generated_tokens - 1 == MAX_NEW_TOKENS - 1
        # It drafted first (the prior's alpha), gave up on the far draft, then decoded in calls
        # of many rounds each instead of a target call per round.
        assert ks[0] > 0
        assert stats.decoded_tokens >= MAX_NEW_TOKENS // 2, ks
        assert 1 <= decode_calls <= stats.decoded_tokens // 4, (decode_calls, ks)
        # The probes still came: greedy, beside the stretches (the draft proposed from where one
        # started, checked against what the target decoded), not as rounds that interrupt them.
        assert stats.shadow_probes >= 1, (stats.shadow_probes, ks)
        # The controller learned the stretches' pace against its K = 0 Verify round's.
        factor = stats.controller_estimates["plain_factor"]
        assert PLAIN_FACTOR_RANGE[0] <= factor <= PLAIN_FACTOR_RANGE[1]
        # Sampled, the probes run beside the stretches too: the target's Decode sends each token's
        # p(y), which the draft's q~(y) is weighed against (tests/unit/test_k_shadow_probes.py). The
        # far draft is accepted rarely, and so it is measured: alpha falls from the prior's, below
        # anywhere the session's rounds alone ever put it (they drafted once). How far below varies
        # with where the probes fall (drawn) and with the counts' decay between them.
        tokens, stats = generate(ADAPTIVE, temperature=0.3, seed=SAMPLED_SEED)
        assert len(tokens) == stats.generated_tokens == MAX_NEW_TOKENS
        assert stats.shadow_probes >= 1 and stats.decoded_tokens >= MAX_NEW_TOKENS // 2, stats.shadow_probes
        alpha = stats.controller_estimates["alpha"]
        assert alpha < min(_alphas_from_rounds_alone(stats)), (alpha, stats.shadow_probes)


def _alphas_from_rounds_alone(stats) -> list[float]:
    """The session's alpha after each of its rounds, had only the rounds been counted (no probes),
    from the prior a session holds when its pool has measured nothing."""
    config = KControllerConfig()  # the orchestrator's default, which start_lookup_stack keeps
    estimate = AcceptanceEstimate(config.prior_alpha, config.prior_alpha_strength, config.acceptance_decay)
    alphas = [estimate.alpha]
    rounds = zip(stats.num_speculative_tokens_per_round, stats.num_accepted_per_round)
    for index, (num_speculative_tokens, num_accepted) in enumerate(rounds):
        estimate.update(num_speculative_tokens, num_accepted, index)
        alphas.append(estimate.alpha)
    return alphas


@pytest.mark.parametrize("method", ["model", "hybrid"])
def test_fixed_k_decodes_at_k0_only(loop_thread, tiny_pair, expected, method):
    """A fixed K = 0 commits to K = 0 for good: Decode calls of up to 64 rounds (no lookup is ever
    verified at K = 0, so none is asked); a fixed K > 0 never decodes."""
    from specdec.protocol import MAX_DECODE_STEPS

    with _far_draft_stack(loop_thread, tiny_pair, method) as generate:
        tokens, stats = generate(Speculation(mode="fixed", num_speculative_tokens=0))
        assert tokens == expected
        ks = list(stats.num_speculative_tokens_per_round)
        assert ks == [0] * (MAX_NEW_TOKENS - 1) and stats.decoded_tokens == MAX_NEW_TOKENS - 1
        assert stats.decode_calls == -(-(MAX_NEW_TOKENS - 1) // MAX_DECODE_STEPS)
        tokens, stats = generate(Speculation(mode="fixed", num_speculative_tokens=2), max_new_tokens=48)
        assert tokens == expected[:48]
        assert stats.decode_calls == 0
        # Only the last round, with one token left, runs at K = 0.
        assert all(k > 0 for k in stats.num_speculative_tokens_per_round[:-1])


def test_hybrid_stretches_look_up_while_the_model_draft_sits_at_zero(loop_thread, tiny_pair, expected):
    """With a lookup draft the target looks up tokens in the stretches' own passes (a stretch
    runs to the controller's next probe, no longer cut short for the orchestrator's lookup): on
    this repetitive output (the tiny target loops) they keep being accepted while the model draft
    sits at K = 0."""
    with _far_draft_stack(loop_thread, tiny_pair, "hybrid") as generate:
        tokens, stats = generate(ADAPTIVE)
        assert tokens == expected
        ks, decode_calls = list(stats.num_speculative_tokens_per_round), stats.decode_calls
        assert decode_calls >= 1
        assert decode_calls <= stats.decoded_tokens <= ks.count(0)  # a stretch is K = 0 rounds
        assert 0 < stats.decode_lookup_accepted <= stats.decode_lookup_drafts, stats
        assert stats.decoded_tokens > 4 * decode_calls  # stretches longer than the old cap of 4


def test_a_stretch_cut_short_by_the_request_end_teaches_no_pace(loop_thread, tiny_pair, expected):
    """The pace of a stretch cut short (here by max_new_tokens) is its round trip spread over a few
    tokens, not K = 0's: it must not reach the pool's plain_factor."""
    running = loop_thread.run(start_lookup_stack(tiny_pair.target_dir, tiny_pair.far_draft_dir, "model"))
    try:
        priors = running.service.controller_priors["greedy"]
        tokens, _ = loop_thread.run(_generate(running.service, PROMPT, speculation=ADAPTIVE,
                                              max_new_tokens=MAX_NEW_TOKENS))
        assert tokens == expected
        learned = priors.snapshot().plain_factor
        assert learned is not None  # full stretches taught it
        # Each ends inside its session's first stretch: the request's rounds (a token each, after
        # the prefill's) are fewer than the shortest stretch a probe is drawn to end (its drafts and
        # the token after them).
        shortest_stretch = KControllerConfig().shadow_probe_num_speculative_tokens + 1
        for max_new_tokens in range(shortest_stretch - 2, shortest_stretch + 1):
            tokens, stats = loop_thread.run(_generate(running.service, PROMPT, speculation=ADAPTIVE,
                                                      max_new_tokens=max_new_tokens))
            assert tokens == expected[:max_new_tokens]
            assert stats.decoded_tokens > 0, list(stats.num_speculative_tokens_per_round)
            assert priors.snapshot().plain_factor == learned
    finally:
        loop_thread.run(running.stop())


def test_a_stretch_longer_than_one_decode_call_still_teaches_its_pace(loop_thread, tiny_pair, expected,
                                                                      monkeypatch):
    """Once the probes have backed off past MAX_DECODE_STEPS rounds, a stretch takes several Decode
    calls of MAX_DECODE_STEPS tokens each: every such call ran all it could, so its pace counts.
    Every such call also reports the target's passes it ran in (one row each: the session is
    alone), as the passes of its rounds or of the whole call (a call whose stretch went on past a
    probe told its segments as they ended, its passes with its end)."""
    from orchestrator.k_controller import AdaptiveKController
    from specdec.protocol import MAX_DECODE_STEPS

    observed: list[tuple[int, float | None]] = []
    passes = []
    original, original_passes = AdaptiveKController.observe_plain, AdaptiveKController.observe_decoded_passes

    def recording(self, rounds, seconds_per_token, decoded_passes=None):
        observed.append((rounds, seconds_per_token))
        if decoded_passes is not None:
            passes.append((rounds, decoded_passes))
        original(self, rounds, seconds_per_token, decoded_passes)

    def recording_passes(self, decoded_passes):
        passes.append((observed[-1][0], decoded_passes))  # the call's rounds were told just before
        original_passes(self, decoded_passes)

    monkeypatch.setattr(AdaptiveKController, "observe_plain", recording)
    monkeypatch.setattr(AdaptiveKController, "observe_decoded_passes", recording_passes)
    # Each probe at its interval, not at a drawn position: a drawn one may land where the far draft
    # matches by chance, which holds the back-off, and the stretches may then not outgrow a call
    # within the answer. Where the probes fall is not what this tests.
    monkeypatch.setattr(AdaptiveKController, "_probe_offset", lambda self, interval: 0)
    running = loop_thread.run(start_lookup_stack(tiny_pair.target_dir, tiny_pair.far_draft_dir, "model"))
    try:
        tokens, stats = loop_thread.run(_generate(running.service, PROMPT, speculation=ADAPTIVE,
                                                  max_new_tokens=4 * MAX_DECODE_STEPS))
        assert tokens[:MAX_NEW_TOKENS] == expected
        whole_calls = [pace for rounds, pace in observed if rounds == MAX_DECODE_STEPS]
        assert whole_calls, (observed, list(stats.num_speculative_tokens_per_round))
        assert all(pace is not None and pace > 0 for pace in whole_calls), observed
        whole_passes = [p for rounds, p in passes if rounds == MAX_DECODE_STEPS]
        assert len(whole_passes) == len(whole_calls)
        assert all(p is not None and p.seconds > 0 and p.rows == p.sessions == 1.0 for p in whole_passes), passes
    finally:
        loop_thread.run(running.stop())


def _rounds_recorded(service) -> float:
    """Rounds the orchestrator's metrics have counted so far (each decoded token is one)."""
    return sum(sample.value for metric in service.telemetry.registry.collect()
               if metric.name == "specdec:num_speculative_tokens"
               for sample in metric.samples if sample.name.endswith("_count"))


@pytest.mark.parametrize("speculation", [Speculation(mode="off"), ADAPTIVE], ids=["off", "adaptive"])
def test_a_decoded_token_streams_out_before_the_next_is_taken(loop_thread, tiny_pair, expected, speculation):
    """Each token of a Decode is sent on as it comes: when a chunk reaches the caller, the loop has
    taken no later token from the call (one held back for the next would reach the caller a
    target pass late). The loop is suspended at each chunk, so the rounds counted then are
    exactly those behind the chunks received."""
    running = loop_thread.run(start_lookup_stack(tiny_pair.target_dir, tiny_pair.far_draft_dir, "model"))

    async def stream():
        seen, behind = [], []
        async for chunk in running.service.generate(PromptInput(prompt_token_ids=tuple(PROMPT)), MAX_NEW_TOKENS,
                                                    SamplingParams(), speculation=speculation):
            seen.extend(chunk.token_ids)
            behind.append((len(seen), _rounds_recorded(running.service), chunk.stats is not None))
        return seen, behind, chunk.stats

    try:
        before = _rounds_recorded(running.service)
        tokens, behind, stats = loop_thread.run(stream())
    finally:
        loop_thread.run(running.stop())
    assert tokens == expected and stats.decoded_tokens > MAX_NEW_TOKENS // 2
    # The first token is the prefill's; every round after commits the tokens of its chunk.
    assert all(rounds - before == received - 1 for received, rounds, _ in behind), behind[:20]


def test_a_request_cancelled_while_its_probe_runs_ends_and_leaves_no_session(loop_thread, tiny_pair):
    """The draft behind a 60 ms round trip, so that a probe beside a stretch is still running when
    the stretch ends and the loop waits for it: a request cancelled at any moment of its first
    second (steps of 20 ms) ends there, cancelled (the probe's wait never swallows the request's
    cancellation), and neither service keeps a session."""
    import asyncio

    import orchestrator.server
    from orchestrator.pool import PoolConfig
    from orchestrator.service import OrchestratorConfig
    from specdec.delay_proxy import DelayProxy, DelayProxyConfig
    from specdec.rpc.server import ServerConfig
    from tests import stack as stack_module

    async def run() -> tuple[int, list[int]]:
        target_server, target = await stack_module.start_target(tiny_pair.target_dir)
        draft_server, draft = await stack_module.start_draft(tiny_pair.far_draft_dir)
        proxy = DelayProxy(DelayProxyConfig(upstream_host="127.0.0.1", upstream_port=draft_server.port,
                                            one_way_delay_ms=30.0))
        await proxy.start()
        config = OrchestratorConfig(draft=f"127.0.0.1:{proxy.port}", target=f"127.0.0.1:{target_server.port}",
                                    pool=PoolConfig(refresh_seconds=0.5), startup_timeout_seconds=30)
        orchestrator_server, service = await orchestrator.server.start(config, ServerConfig(port=0))
        cut = 0
        try:
            for step in range(50):
                async def consume() -> None:
                    async for _ in service.generate(PromptInput(prompt_token_ids=tuple(PROMPT)), MAX_NEW_TOKENS,
                                                    SamplingParams(), speculation=ADAPTIVE):
                        pass

                task = asyncio.create_task(consume())
                await asyncio.sleep(0.02 * step)
                if task.done():
                    continue
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    cut += 1
                else:
                    raise AssertionError(f"a request cancelled after {0.02 * step:.2f} s ran on to its end")
            for _ in range(100):  # the Releases are sent in the background
                live = [target.info().live_sessions, draft.info().live_sessions]
                if live == [0, 0]:
                    break
                await asyncio.sleep(0.05)
            return cut, live
        finally:
            await service.close()
            for server in (orchestrator_server, draft_server, target_server):
                await server.stop()
            await proxy.close()

    cut, live = loop_thread.run(run())
    assert cut >= 10 and live == [0, 0], (cut, live)


def test_a_stretch_goes_on_past_its_probes_in_one_decode_call(loop_thread, tiny_pair, expected):
    """A stretch whose probes run beside it does not end at each probe: the Decode call goes on
    while the probe is observed and K = 0 chosen again, so the session pays the target's round
    trip once per call of MAX_DECODE_STEPS tokens, not once per probe; the probes still come."""
    from specdec.protocol import MAX_DECODE_STEPS

    with _far_draft_stack(loop_thread, tiny_pair, "model") as generate:
        for temperature in (0.0, 0.3):
            tokens, stats = generate(ADAPTIVE, temperature=temperature, seed=SAMPLED_SEED)
            if temperature == 0.0:
                assert tokens == expected
            ks = list(stats.num_speculative_tokens_per_round)
            assert stats.shadow_probes >= 2, (stats.shadow_probes, ks)
            # Every round after the first at K = 0, in as few calls as MAX_DECODE_STEPS allows.
            assert all(k == 0 for k in ks[1:]) and stats.decoded_tokens >= len(ks) - 1, ks
            assert stats.decode_calls == -(-stats.decoded_tokens // MAX_DECODE_STEPS), stats.decode_calls


def test_a_probe_that_ends_k0_ends_the_decode_call_early(loop_thread, tiny_pair, expected, monkeypatch):
    """Where the policy leaves K = 0 at a probe beside a stretch (here made to, once it has observed
    one: the controller's own reasons are unit-tested), the stretch's Decode call is ended after
    the target's pass then running (EndDecode), not run on to its end at K = 0; the tokens it
    decoded meanwhile are committed, and the rounds go on from there. The output is still the
    target's own."""
    from orchestrator.k_controller import AdaptiveKController
    from specdec.protocol import MAX_DECODE_STEPS
    from target_service.service import TargetService

    ended: list[bool] = []
    original_end = TargetService.end_decode

    def recording(self, session_id: str, start: int) -> bool:
        ended.append(original_end(self, session_id, start))
        return ended[-1]

    probed: list[int] = []
    original_shadow, original_plain = AdaptiveKController.observe_shadow, AdaptiveKController.plain_rounds

    def observe_shadow(self, *args, **kwargs) -> None:
        probed.append(1)
        original_shadow(self, *args, **kwargs)

    def plain_rounds(self, shadow: bool = False) -> int:
        rounds = original_plain(self, shadow)
        return 0 if probed else rounds

    monkeypatch.setattr(TargetService, "end_decode", recording)
    monkeypatch.setattr(AdaptiveKController, "observe_shadow", observe_shadow)
    monkeypatch.setattr(AdaptiveKController, "plain_rounds", plain_rounds)
    with _far_draft_stack(loop_thread, tiny_pair, "model") as generate:
        tokens, stats = generate(ADAPTIVE, max_new_tokens=MAX_NEW_TOKENS)
        assert tokens == expected
        assert probed and ended == [True], (probed, ended)
        # One call, ended short of what it asked for; every token after it a round of its own.
        assert stats.decode_calls == 1 and 0 < stats.decoded_tokens < MAX_DECODE_STEPS, stats.decoded_tokens
        assert len(stats.num_speculative_tokens_per_round) == MAX_NEW_TOKENS - 1


def test_a_target_without_end_decode_gets_stretches_that_end_at_their_probes(loop_thread, tiny_pair, expected):
    """A target that predates EndDecode: the first answer (UNIMPLEMENTED) is remembered, and the
    stretches end at their probes, each probe a call, as before; the output is the same."""
    from tests.service.test_decode import RefuseMethod

    refuse = RefuseMethod("EndDecode")
    running = loop_thread.run(start_lookup_stack(tiny_pair.target_dir, tiny_pair.far_draft_dir, "model",
                                                 interceptors=(refuse,)))
    try:
        # An open stretch asks the target to end its Decode only where K = 0 ends; until a call has
        # been refused the orchestrator takes the target for one that can. Ask it once directly.
        replica = running.service.target_pool.pick()
        assert replica is not None
        client = replica.client
        assert loop_thread.run(client.end_decode("nobody", 0)) is False
        assert refuse.refused == 1 and client.ends_decodes is False
        tokens, stats = loop_thread.run(_generate(running.service, PROMPT, speculation=ADAPTIVE,
                                                  max_new_tokens=MAX_NEW_TOKENS))
        assert tokens == expected
        assert stats.shadow_probes >= 2
        assert stats.decode_calls > stats.shadow_probes  # each probe ended its call
        assert refuse.refused == 1
    finally:
        loop_thread.run(running.stop())


def test_under_pipelining_auto_the_draft_ranks_are_measured_beside_the_stretches(loop_thread, tiny_pair, expected):
    """Pipelining auto, greedy, a fresh orchestrator: the draft's candidate ranks, which weigh
    drafting ahead, are measured by the probes beside the stretches (each a Speculate at fan-out
    1, its outcome and rank read off the stretch's tokens), not by drafted-ahead rounds in place
    of stretches; the pool counts them as drafted-ahead outcomes. The output is the target's own
    (the probes' branches are the draft session's forks, never its committed cache)."""
    from orchestrator.pipeline_policy import PipelineConfig
    from tests.stack import auto_pipelining_as_on_separate_hardware

    running = loop_thread.run(start_lookup_stack(tiny_pair.target_dir, tiny_pair.far_draft_dir, "model"))
    try:
        with auto_pipelining_as_on_separate_hardware(running.service):
            tokens, stats = loop_thread.run(_generate(
                running.service, PROMPT, SamplingParams(), speculation=Speculation(mode="adaptive", pipeline="auto"),
                max_new_tokens=MAX_NEW_TOKENS))
            assert tokens == expected
            outcomes = running.service.pipeline_priors["greedy"].outcomes
            assert stats.pipelined_rounds == 0, list(stats.num_speculative_tokens_per_round)
            assert PipelineConfig().measured_outcomes <= outcomes <= stats.shadow_probes, (outcomes, stats.shadow_probes)
            # The next request, its pool's ranks measured, still gives the target's own output.
            again, _ = loop_thread.run(_generate(
                running.service, PROMPT, SamplingParams(), speculation=Speculation(mode="adaptive", pipeline="auto"),
                max_new_tokens=MAX_NEW_TOKENS))
            assert again == expected
    finally:
        loop_thread.run(running.stop())
