"""A Propose after C grew by the last proposal's first drafts only (streamed speculation feeds the
draft the target's tokens as they come, and those are often its own drafts) reuses the drafts it
already has and drafts only the rest: through the real client, the proposal equals drafting after
the fact from a fresh session (float64 tiny pair, greedy and sampled), it feeds fewer tokens, and
the draft's cache is then exactly the one a fresh prefill of C and the drafts it fed would hold."""

from __future__ import annotations

import random

import pytest

from orchestrator.clients import DraftClient, RpcTimeouts, open_channel
from specdec.sampling import SamplingParams
from tests.service.test_cache_invariant import _assert_cache_is_fresh_prefill
from tests.service.test_drafting_ahead import _after_the_fact

PROMPT = [5, 9, 11, 4, 20, 7]


async def _grow_by_drafts(stack, sampling: SamplingParams, session_id: str) -> int:
    """Proposals of random K, C growing each time by a random number of the last one's first
    drafts; each checked against drafting after the fact. Returns how many reused drafts."""
    draft = DraftClient(stack.draft_address, open_channel(stack.draft_address, None, 1 << 24), RpcTimeouts())
    rng = random.Random(session_id)
    committed = [*PROMPT, 3]
    prefill = await draft.prefill(session_id, committed, sampling)
    handle = prefill.handle
    reused = 0
    last = None
    for step in range(12):
        new: list[int] = []
        if last is not None:
            new = list(last.token_ids[:rng.randint(1, len(last.token_ids) - 1)])
            committed.extend(new)
        num_speculative_tokens = rng.randint(2, 7)
        proposed = await draft.propose(handle, new, num_speculative_tokens)
        handle, proposal = proposed.handle, proposed.value
        expected = await _after_the_fact(draft, committed, num_speculative_tokens, sampling, f"{session_id}-{step}")
        assert proposal.token_ids == expected.token_ids, step
        assert proposal.distributions == expected.distributions, step
        if new:  # the drafts after `new` were kept: only the rest was drafted (and one fed)
            kept = len(last.token_ids) - len(new)
            assert proposal.fed_tokens == max(0, num_speculative_tokens - kept)
            reused += min(kept, num_speculative_tokens)
        state = stack.draft.store.get(session_id).state
        _assert_cache_is_fresh_prefill(state.cache, stack.draft.loaded.model,
                                       committed + list(proposal.token_ids[:-1]))
        last = proposal
    await draft.release(session_id)
    return reused


@pytest.mark.parametrize("sampling", [
    pytest.param(SamplingParams(), id="greedy"),
    pytest.param(SamplingParams(temperature=0.9, top_p=0.95, seed=21), id="sampled"),
])
def test_a_proposal_after_its_own_drafts_reuses_them(loop_thread, stack, sampling):
    reused = loop_thread.run(_grow_by_drafts(stack, sampling, f"reuse-{sampling.greedy}"))
    assert reused > 0


async def _follow_branches(stack, sampling: SamplingParams, session_id: str) -> int:
    """Streamed offers' branches: Speculates that branch only their first `outcomes` positions,
    C then growing by one branch's outcome and a random number of its drafts (or by the
    proposal's own first drafts). Each branch, and each proposal after one was followed, is
    checked against drafting after the fact, and the cache against a fresh prefill. Returns how
    many branch drafts the proposals after them kept."""
    draft = DraftClient(stack.draft_address, open_channel(stack.draft_address, None, 1 << 24), RpcTimeouts())
    rng = random.Random(session_id)
    committed = [*PROMPT, 3]
    handle = (await draft.prefill(session_id, committed, sampling)).handle
    new: list[int] = []
    kept = 0
    for step in range(8):
        num_speculative_tokens, outcomes, fanout = rng.randint(3, 5), rng.randint(1, 2), rng.randint(1, 3)
        call = draft.speculate(handle, new, num_speculative_tokens, fanout, num_speculative_tokens - 1, outcomes)
        proposed = await call.proposal()
        committed.extend(new)
        handle, proposal = proposed.handle, proposed.value
        ahead, _ = await call.branches()
        assert ahead.branches and {b.num_accepted for b in ahead.branches} <= set(range(outcomes))
        assert all(sum(b.num_accepted == j for b in ahead.branches) <= fanout for j in range(outcomes))
        for index, branch in enumerate(ahead.branches):
            assert branch.next_token_id != proposal.token_ids[branch.num_accepted]
            outcome = [*proposal.token_ids[:branch.num_accepted], branch.next_token_id]
            expected = await _after_the_fact(draft, committed + outcome, branch.proposal.num_speculative_tokens,
                                             sampling, f"{session_id}-{step}-{index}")
            assert branch.proposal.token_ids == expected.token_ids, (step, branch)
            assert branch.proposal.distributions == expected.distributions, (step, branch)
        if step % 3 == 2:  # C grew by the proposal's own first drafts: no branch followed
            new = list(proposal.token_ids[:rng.randint(1, num_speculative_tokens - 1)])
            continue
        branch = rng.choice(ahead.branches)
        after = rng.randint(0, branch.proposal.num_speculative_tokens - 1)
        new = [*proposal.token_ids[:branch.num_accepted], branch.next_token_id, *branch.proposal.token_ids[:after]]
        num_after = rng.randint(1, 4)
        proposed = await draft.propose(handle, new, num_after)
        committed.extend(new)
        handle = proposed.handle
        expected = await _after_the_fact(draft, committed, num_after, sampling, f"{session_id}-{step}-after")
        assert proposed.value.token_ids == expected.token_ids, step
        assert proposed.value.distributions == expected.distributions, step
        still = branch.proposal.num_speculative_tokens - after
        assert proposed.value.fed_tokens == max(0, num_after - still), step  # the branch's drafts kept
        kept += min(still, num_after)
        state = stack.draft.store.get(session_id).state
        _assert_cache_is_fresh_prefill(state.cache, stack.draft.loaded.model,
                                       committed + list(proposed.value.token_ids[:-1]))
        new = []
    await draft.release(session_id)
    return kept


@pytest.mark.parametrize("sampling", [
    pytest.param(SamplingParams(), id="greedy"),
    pytest.param(SamplingParams(temperature=0.9, top_p=0.95, seed=23), id="sampled"),
])
def test_a_proposal_after_a_branch_c_followed_keeps_its_drafts(loop_thread, stack, sampling):
    assert loop_thread.run(_follow_branches(stack, sampling, f"branches-{sampling.greedy}")) > 0
