"""Drafting ahead (Speculate) at the draft service, through the real client: every branch equals
what a Propose after that outcome drafts, and adopting one leaves the cache a Propose would have."""

from __future__ import annotations

import pytest

from orchestrator.clients import DraftClient, RpcTimeouts, TargetClient, open_channel
from specdec.errors import OutOfRange
from specdec.protocol import Proposal
from specdec.sampling import SamplingParams
from tests.service.test_cache_invariant import _assert_cache_is_fresh_prefill

PROMPT = [5, 9, 11, 4, 20, 7]
FANOUT = 3


def _clients(stack) -> tuple[TargetClient, DraftClient]:
    timeouts = RpcTimeouts()
    return (TargetClient(stack.target_address, open_channel(stack.target_address, None, 1 << 24), timeouts),
            DraftClient(stack.draft_address, open_channel(stack.draft_address, None, 1 << 24), timeouts))


async def _after_the_fact(draft: DraftClient, committed: list[int], num_speculative_tokens: int,
                          sampling: SamplingParams, session_id: str) -> Proposal:
    """What a draft session prefilled with `committed` proposes next."""
    prefill = await draft.prefill(session_id, committed, sampling)
    proposed = await draft.propose(prefill.handle, [], num_speculative_tokens)
    await draft.release(session_id)
    return proposed.value


async def _rounds(stack, sampling: SamplingParams, schedule: list[int], session_id: str) -> dict[str, int]:
    target, draft = _clients(stack)
    committed = list(PROMPT)
    target_prefill = await target.prefill(session_id, committed, sampling)
    draft_prefill = await draft.prefill(session_id, committed, sampling)
    committed.append(target_prefill.value)
    target_handle, draft_handle = target_prefill.handle, draft_prefill.handle
    counts = {"hits": 0, "misses": 0, "branches": 0}
    expected_next: Proposal | None = None
    for round_index, num_speculative_tokens in enumerate(schedule):
        branch_k = schedule[round_index + 1] if round_index + 1 < len(schedule) else num_speculative_tokens
        call = draft.speculate(draft_handle, committed[draft_handle.committed_length:],
                               num_speculative_tokens, FANOUT, branch_k)
        proposed = await call.proposal()
        draft_handle, proposal = proposed.handle, proposed.value
        if expected_next is not None:  # a hit: the draft adopted the branch, drafting nothing
            assert proposal.token_ids == expected_next.token_ids[:num_speculative_tokens]
            assert proposal.distributions == expected_next.distributions[:num_speculative_tokens]
            assert proposal.fed_tokens == 0
        ahead, _ = await call.branches()
        verified = await target.verify(target_handle, proposal)
        target_handle, outcome = verified.handle, verified.value

        # Every branch is what the draft proposes after its outcome, drafted after the fact.
        assert len(ahead.candidates) == num_speculative_tokens + 1
        assert len(ahead.branches) == sum(min(FANOUT, len(c)) for c in ahead.candidates)
        for j, candidates in enumerate(ahead.candidates):
            if j < num_speculative_tokens:
                assert proposal.token_ids[j] not in candidates
        for branch in ahead.branches:
            prefix = [*committed, *proposal.token_ids[:branch.num_accepted], branch.next_token_id]
            reference = await _after_the_fact(draft, prefix, branch_k, sampling, f"{session_id}-ref")
            assert branch.proposal.token_ids == reference.token_ids, (branch.num_accepted, branch.next_token_id)
            assert branch.proposal.distributions == reference.distributions
        counts["branches"] += len(ahead.branches)

        committed += [*proposal.token_ids[:outcome.num_accepted], outcome.next_token_id]
        expected_next = ahead.branch_for(outcome.num_accepted, outcome.next_token_id)
        counts["hits" if expected_next is not None else "misses"] += 1
        # Branches never touch the session's cache: it still holds C + d1 .. d(K-1).
        state = stack.draft.store.lookup(session_id, draft_handle.epoch).state
        drafted = [*committed[:len(state.committed)], *proposal.token_ids[:-1]]
        _assert_cache_is_fresh_prefill(state.cache, stack.draft.loaded.model, drafted)
    await target.release(session_id)
    await draft.release(session_id)
    await target.channel.close()
    await draft.channel.close()
    return counts


SCHEDULE = [3, 2, 4, 1, 3, 3, 2, 4, 4, 1]


def test_branches_equal_drafting_after_the_fact_greedy(loop_thread, stack):
    counts = loop_thread.run(_rounds(stack, SamplingParams(), SCHEDULE, "ahead-greedy"))
    assert counts["hits"] > 0 and counts["misses"] > 0, counts


def test_branches_equal_drafting_after_the_fact_sampled(loop_thread, stack):
    sampling = SamplingParams(temperature=0.9, top_k=20, seed=5)
    counts = loop_thread.run(_rounds(stack, sampling, SCHEDULE, "ahead-sampled"))
    assert counts["branches"] > 0 and counts["hits"] + counts["misses"] == len(SCHEDULE), counts


def test_all_accepted_outcomes_hit_with_the_target_as_draft(loop_thread, stack_same):
    """The draft is the target: every draft is accepted, and the bonus is the draft's own top
    candidate, so every round after the first is a hit."""
    counts = loop_thread.run(_rounds(stack_same, SamplingParams(), [3] * 6, "ahead-same"))
    assert counts["hits"] == 6 and counts["misses"] == 0, counts


def test_bad_fanout_is_out_of_range(loop_thread, stack):
    async def run() -> None:
        _, draft = _clients(stack)
        prefill = await draft.prefill("ahead-bad", PROMPT, SamplingParams())
        with pytest.raises(OutOfRange, match="fanout"):
            await draft.speculate(prefill.handle, [], 2, 0, 2).proposal()
        await draft.release("ahead-bad")
        await draft.channel.close()

    loop_thread.run(run())
