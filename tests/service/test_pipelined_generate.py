"""Pipelined generation through the real services (float64 tiny pair): for a fixed K, the output
with drafting ahead is identical to the output without it, greedy and seeded sampling, and the
stats count what happened."""

from __future__ import annotations

import random

import grpc
import pytest

from specdec.v1 import common_pb2
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc
from tests.stack import auto_pipelining_as_on_separate_hardware, generate

MAX_NEW_TOKENS = 40


def _prompts(count: int, vocab_size: int = 50) -> list[list[int]]:
    rng = random.Random(99)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(2, 20))] for _ in range(count)]


def _request(prompt: list[int], num_speculative_tokens: int, pipeline: int, fanout: int | None = None,
             sampling: common_pb2.SamplingParams | None = None) -> pb.GenerateRequest:
    speculation = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=num_speculative_tokens,
                                       pipeline=pipeline)
    if fanout is not None:
        speculation.pipeline_fanout = fanout
    return pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=MAX_NEW_TOKENS, speculation=speculation,
                              sampling=sampling)


def _check_stats(stats: pb.GenerationStats) -> None:
    """Pipelined rounds are the drafted rounds that got branches back (all of them here; an output
    that ends at its first token has none)."""
    assert stats.pipelined_rounds == sum(k > 0 for k in stats.num_speculative_tokens_per_round)
    assert stats.pipeline_hits + stats.pipeline_misses <= stats.pipelined_rounds
    assert len(stats.fanout_per_round) == stats.pipelined_rounds
    assert stats.branches_drafted >= stats.pipelined_rounds


@pytest.mark.parametrize("num_speculative_tokens,fanout", [(1, 1), (2, 3), (4, 2)])
def test_greedy_output_identical_with_drafting_ahead(stack, num_speculative_tokens, fanout):
    hits = 0
    for prompt in _prompts(6):
        plain, _, last_plain = generate(stack.address, _request(prompt, num_speculative_tokens, pb.PIPELINE_MODE_OFF))
        ahead, _, last = generate(stack.address, _request(prompt, num_speculative_tokens, pb.PIPELINE_MODE_ON, fanout))
        assert ahead == plain, prompt
        assert last_plain.stats.pipelined_rounds == 0
        assert list(last.stats.num_speculative_tokens_per_round) == list(last_plain.stats.num_speculative_tokens_per_round)
        _check_stats(last.stats)
        hits += last.stats.pipeline_hits
    assert hits > 0


@pytest.mark.parametrize("seed", [3, 17])
def test_seeded_sampling_identical_with_drafting_ahead(stack, seed):
    sampling = common_pb2.SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
    hits = 0
    for prompt in _prompts(4):
        plain, _, _ = generate(stack.address, _request(prompt, 3, pb.PIPELINE_MODE_OFF, sampling=sampling))
        ahead, _, last = generate(stack.address, _request(prompt, 3, pb.PIPELINE_MODE_ON, 3, sampling=sampling))
        assert ahead == plain, prompt
        _check_stats(last.stats)
        hits += last.stats.pipeline_hits
    assert hits > 0


def test_every_round_hits_when_the_draft_is_the_target(stack_same):
    checked = 0
    for prompt in _prompts(6):
        plain, _, _ = generate(stack_same.address, _request(prompt, 3, pb.PIPELINE_MODE_OFF))
        ahead, _, last = generate(stack_same.address, _request(prompt, 3, pb.PIPELINE_MODE_ON, 1))
        assert ahead == plain
        stats = last.stats
        if stats.rounds >= 3:
            # Round 1 proposes; each later round's proposal was drafted ahead in the round before.
            assert stats.pipeline_misses == 0 and stats.pipeline_hits == stats.rounds - 1, stats
            checked += 1
    assert checked > 0


def _adaptive_auto_cases(reference_target, count: int = 3):
    """(prompt, the target's own greedy output, an adaptive K request under pipelining auto)."""
    import torch

    for prompt in _prompts(count):
        with torch.no_grad():
            output = reference_target.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=MAX_NEW_TOKENS,
                                     speculation=pb.SpeculationConfig(mode=pb.SPECULATION_MODE_ADAPTIVE,
                                                                      pipeline=pb.PIPELINE_MODE_AUTO))
        yield prompt, output[0, len(prompt):].tolist(), request


def test_auto_pipelining_under_adaptive_k_keeps_greedy_output_exact(stack, reference_target):
    """Adaptive K with pipeline auto: the controller decides per round whether to draft ahead;
    whatever it decides, greedy output is the target's own."""
    for _, expected, request in _adaptive_auto_cases(reference_target):
        with auto_pipelining_as_on_separate_hardware(stack.orchestrator):
            tokens, _, last = generate(stack.address, request)
        assert tokens == expected
        if last.stats.rounds:
            assert "pipeline_hit_rate" in last.stats.controller_estimates, dict(last.stats.controller_estimates)


def test_auto_pipelining_holds_off_where_the_draft_shares_the_target_hardware(stack, reference_target):
    """In one process draft and target compute on the same CPUs, as their Info says: pipelining
    auto drafts nothing ahead, offers nothing and streams nothing there, and says so in the
    stats; an explicit `on` still drafts ahead. Greedy output is the target's either way."""
    assert stack.orchestrator.draft_shares_compute()
    with grpc.insecure_channel(stack.address) as channel:  # and the Pools RPC says so
        assert orchestrator_pb2_grpc.OrchestratorStub(channel).Pools(pb.PoolsRequest(), timeout=30).draft_shares_compute
    for prompt, expected, request in _adaptive_auto_cases(reference_target):
        tokens, _, last = generate(stack.address, request)
        assert tokens == expected
        estimates = dict(last.stats.controller_estimates)
        assert estimates["draft_shares_compute"] == 1.0 and "auto_streamed" not in estimates, estimates
        assert "pipeline_hit_rate" not in estimates, estimates
        assert last.stats.pipelined_rounds == 0 and last.stats.offers == 0, last.stats
        ahead, _, on = generate(stack.address, _request(prompt, 3, pb.PIPELINE_MODE_ON, 1))
        assert ahead == expected
        if on.stats.rounds >= 2:
            assert on.stats.pipelined_rounds > 0, on.stats


def test_sampled_bonus_is_always_a_hit_when_the_draft_is_the_target(stack_same):
    """Sampled, the bonus token is drawn from the target's distribution at the round's uniform.
    The draft's first bonus candidate is its own draw at that uniform: with the draft the target,
    every round that accepts all its drafts is followed by a hit, even at fan-out 1 (the target's
    sampled token is seldom its most likely one on the tiny random pair)."""
    sampling = common_pb2.SamplingParams(temperature=1.0, seed=5)
    bonus_rounds = 0
    for prompt in _prompts(6):
        plain, _, _ = generate(stack_same.address, _request(prompt, 2, pb.PIPELINE_MODE_OFF, sampling=sampling))
        ahead, _, last = generate(stack_same.address, _request(prompt, 2, pb.PIPELINE_MODE_ON, 1, sampling=sampling))
        assert ahead == plain
        stats = last.stats
        ks, accepted = list(stats.num_speculative_tokens_per_round), list(stats.num_accepted_per_round)
        # A round that accepted all its drafts and has a drafted round after it: that one's
        # proposal came from the bonus branch.
        followed = sum(1 for index in range(len(ks) - 1) if ks[index] > 0 and accepted[index] == ks[index]
                       and ks[index + 1] > 0)
        assert stats.pipeline_hits >= followed, stats
        bonus_rounds += followed
    assert bonus_rounds >= 5
