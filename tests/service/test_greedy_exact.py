"""Greedy output through the real services equals the target's own generate(), token for token."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.v1 import orchestrator_pb2 as pb

from tests.stack import generate

NUM_PROMPTS = 20
MAX_NEW_TOKENS = 24


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 30))] for _ in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def references(reference_target):
    """prompt -> the target's own greedy continuation (EOS included when it stops there)."""
    table = {}
    for prompt in _prompts(reference_target.config.vocab_size):
        with torch.no_grad():
            output = reference_target.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )
        table[tuple(prompt)] = output[0, len(prompt):].tolist()
    return table


def _request(prompt: list[int], num_speculative_tokens: int, mode=pb.SPECULATION_MODE_FIXED) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=prompt,
        max_new_tokens=MAX_NEW_TOKENS,
        speculation=pb.SpeculationConfig(mode=mode, num_speculative_tokens=num_speculative_tokens),
    )


@pytest.mark.parametrize("num_speculative_tokens", [1, 2, 4, 8])
def test_greedy_identical_with_a_different_draft(stack, references, num_speculative_tokens):
    rejected = accepted = 0
    for prompt, expected in references.items():
        tokens, _, last = generate(stack.address, _request(list(prompt), num_speculative_tokens))
        assert tokens == expected, f"prompt {prompt}"
        accepted += last.stats.accepted_tokens
        rejected += last.stats.drafted_tokens - last.stats.accepted_tokens
    assert rejected > 0 and accepted > 0, "the perturbed draft should both agree and disagree"


@pytest.mark.parametrize("num_speculative_tokens", [1, 2, 4, 8])
def test_draft_equal_to_target_accepts_every_token(stack_same, references, num_speculative_tokens):
    for prompt, expected in references.items():
        tokens, _, last = generate(stack_same.address, _request(list(prompt), num_speculative_tokens))
        assert tokens == expected, f"prompt {prompt}"
        stats = last.stats
        assert stats.drafted_tokens > 0
        # A misaligned draft cache would only lower acceptance; here every round accepts all K.
        assert stats.accepted_tokens == stats.drafted_tokens, f"prompt {prompt}: {stats}"


def test_speculation_off_is_plain_decoding(stack, references):
    for prompt, expected in list(references.items())[:5]:
        tokens, _, last = generate(stack.address, _request(list(prompt), 4, mode=pb.SPECULATION_MODE_OFF))
        assert tokens == expected
        assert last.stats.drafted_tokens == 0
        assert last.stats.draft_replica == ""
        assert list(last.stats.num_speculative_tokens_per_round) == [0] * last.stats.rounds


def test_stats_are_consistent(stack, references):
    prompt, expected = next(iter(references.items()))
    tokens, _, last = generate(stack.address, _request(list(prompt), 4))
    stats = last.stats
    assert stats.generated_tokens == len(tokens) == len(expected)
    assert stats.rounds == len(stats.num_speculative_tokens_per_round)
    assert stats.drafted_tokens == sum(stats.num_speculative_tokens_per_round)
    assert 0 <= stats.accepted_tokens <= stats.drafted_tokens
    assert stats.mean_accepted_length == pytest.approx((stats.accepted_tokens + stats.rounds) / stats.rounds)
    assert stats.tokens_per_second > 0 and stats.verify_seconds > 0 and stats.draft_seconds > 0
    assert last.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS)


@pytest.mark.parametrize("mode", [pb.SPECULATION_MODE_ADAPTIVE, pb.SPECULATION_MODE_HEURISTIC,
                                  pb.SPECULATION_MODE_UNSPECIFIED])
def test_adaptive_and_heuristic_k_keep_output_identical(stack, references, mode):
    for prompt, expected in list(references.items())[:8]:
        request = pb.GenerateRequest(prompt_token_ids=list(prompt), max_new_tokens=MAX_NEW_TOKENS,
                                     speculation=pb.SpeculationConfig(mode=mode))
        tokens, _, last = generate(stack.address, request)
        assert tokens == expected, f"prompt {prompt}"
        assert last.stats.rounds == len(last.stats.num_speculative_tokens_per_round)
        if mode != pb.SPECULATION_MODE_HEURISTIC:
            assert "alpha" in last.stats.controller_estimates  # the adaptive controller ran


def test_adaptive_controllers_learn_greedy_and_sampled_priors_apart(stack):
    """A sampled request's acceptance must not become the prior of greedy ones (and vice versa)."""
    from specdec.v1 import common_pb2

    priors = stack.orchestrator.controller_priors
    greedy_before, sampled_before = priors["greedy"].snapshot(), priors["sampled"].snapshot()
    request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8], max_new_tokens=MAX_NEW_TOKENS,
                                 sampling=common_pb2.SamplingParams(temperature=0.8, seed=11),
                                 speculation=pb.SpeculationConfig(mode=pb.SPECULATION_MODE_ADAPTIVE))
    generate(stack.address, request)
    assert priors["sampled"].snapshot() != sampled_before
    assert priors["sampled"].snapshot().alpha is not None
    assert priors["greedy"].snapshot() == greedy_before
