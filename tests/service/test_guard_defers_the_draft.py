"""While the speculation guard keeps the system at K = 0, an adaptive request sends its draft
nothing: no Prefill (it would take CPU from the target, or a draft replica's, for rounds that may
never come) until speculation is allowed again, when the draft gets everything committed so far.
Real services in-process (tiny float64 pair); the guard's decision is set, not measured (its
tests are tests/unit/test_speculation_guard.py)."""

from __future__ import annotations

import pytest
import torch

from orchestrator.k_policy import Speculation
from orchestrator.service import PromptInput
from orchestrator.speculation_guard import GuardConfig, SpeculationGuard
from specdec.protocol import SamplingParams
from tests.service.test_lookup_drafts import (
    MAX_NEW_TOKENS,
    _generate,
    start_lookup_stack,
)

PROMPT = [5, 9, 14, 3, 22, 9, 14, 3]


@pytest.fixture(scope="module")
def references(reference_target):
    """The target alone, greedy: {prompt: its MAX_NEW_TOKENS tokens}."""
    with torch.no_grad():
        output = reference_target.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                           attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
    return {tuple(PROMPT): output[0, len(PROMPT):].tolist()}


def _guard_at_k0(sessions: int) -> SpeculationGuard:
    """A guard that decided K = 0 under `sessions` other sessions and tests nothing for a while."""
    guard = SpeculationGuard(GuardConfig(first_test_seconds=3600.0, max_interval_seconds=3600.0))
    for _ in range(sessions):
        guard.enter()
    guard.speculating = False
    return guard


def test_under_the_guards_k0_a_request_takes_no_draft_session(loop_thread, tiny_pair, references):
    running = loop_thread.run(start_lookup_stack(tiny_pair.target_dir, tiny_pair.draft_dir, "model"))
    try:
        adaptive = Speculation(mode="adaptive")
        guard = running.service.guard = _guard_at_k0(sessions=3)
        prompt, expected = next(iter(references.items()))
        passes = running.draft.info().passes_total
        tokens, stats = loop_thread.run(_generate(running.service, prompt, speculation=adaptive))
        assert tokens == expected
        assert stats.drafted_tokens == 0 and stats.draft_replica == ""
        assert running.draft.info().passes_total == passes  # no Prefill, no Propose: nothing ran
        # The guard turns speculation back on mid-way: the draft's Prefill goes out then (of all
        # of C), and the rounds after it draft; the output is the target's all the same.
        guard.speculating = True
        tokens, stats = loop_thread.run(_generate(running.service, prompt, speculation=adaptive))
        assert tokens == expected and len(tokens) == MAX_NEW_TOKENS
        assert stats.draft_replica != "" and running.draft.info().passes_total > passes
    finally:
        loop_thread.run(running.stop())


def test_a_request_started_at_k0_attaches_its_draft_when_speculation_is_allowed(loop_thread, tiny_pair,
                                                                                 references):
    running = loop_thread.run(start_lookup_stack(tiny_pair.target_dir, tiny_pair.draft_dir, "model"))
    try:
        guard = running.service.guard = _guard_at_k0(sessions=3)
        prompt, expected = next(iter(references.items()))

        async def scenario():
            tokens, last = [], None
            stream = running.service.generate(PromptInput(prompt_token_ids=tuple(prompt)), MAX_NEW_TOKENS,
                                              SamplingParams(), speculation=Speculation(mode="adaptive"))
            async for chunk in stream:
                tokens.extend(chunk.token_ids)
                if len(tokens) >= 4:
                    guard.speculating = True  # from the next round on
                last = chunk
            return tokens, last.stats

        tokens, stats = loop_thread.run(scenario())
        assert tokens == expected
        assert stats.draft_replica != "" and stats.drafted_tokens > 0
        # Rounds at K = 0 first, drafted rounds after the draft attached.
        ks = list(stats.num_speculative_tokens_per_round)
        assert ks[0] == 0 and any(k > 0 for k in ks)
    finally:
        loop_thread.run(running.stop())


def test_a_request_under_the_guard_decodes_as_far_as_the_sessions_pace_allows(loop_thread, tiny_pair, references):
    """Held at K = 0 under load, a request's first Decode asks for as many tokens as fit before
    the guard's answer may change at the sessions' recent pace (one call for the whole answer
    here), not for a few tokens as it must when no pace is known yet."""
    running = loop_thread.run(start_lookup_stack(tiny_pair.target_dir, tiny_pair.draft_dir, "model"))
    try:
        adaptive = Speculation(mode="adaptive")
        prompt, expected = next(iter(references.items()))
        calls = {}
        for known in (False, True):
            guard = running.service.guard = _guard_at_k0(sessions=3)
            if known:
                guard.observe_decode_pace(0.01)  # the other sessions' calls: 10 ms a token
            tokens, stats = loop_thread.run(_generate(running.service, prompt, speculation=adaptive))
            assert tokens == expected
            calls[known] = stats.decode_calls
        assert calls[True] == 1 < calls[False], calls
    finally:
        loop_thread.run(running.stop())
