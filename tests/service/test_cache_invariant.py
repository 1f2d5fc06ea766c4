"""The cache invariant (docs/architecture.md), checked after every kind of round against a fresh
prefill: the target holds exactly C[:-1]; after a Propose of K the draft holds C + d1..d(K-1)."""

from __future__ import annotations

import torch

from orchestrator.clients import DraftClient, RpcTimeouts, TargetClient, open_channel
from specdec.kv_cache import SequenceCache
from specdec.protocol import Proposal
from specdec.sampling import SamplingParams


def _assert_cache_is_fresh_prefill(cache: SequenceCache, model, expected_ids: list[int]) -> None:
    assert cache.token_ids == expected_ids
    fresh = SequenceCache(model)
    fresh.feed(expected_ids)
    assert len(cache) == len(fresh) == len(expected_ids)
    for layer in range(cache.num_layers):
        (keys, values), (fresh_keys, fresh_values) = cache.layer(layer), fresh.layer(layer)
        assert keys.shape[2] == len(expected_ids)
        torch.testing.assert_close(keys, fresh_keys, rtol=0, atol=1e-10)
        torch.testing.assert_close(values, fresh_values, rtol=0, atol=1e-10)


async def _rounds(stack, schedule: list[int], sampling: SamplingParams, session_id: str):
    """Runs rounds by hand through the real clients; checks both caches after each."""
    timeouts = RpcTimeouts()
    target = TargetClient(stack.target_address, open_channel(stack.target_address, None, 1 << 24), timeouts)
    draft = DraftClient(stack.draft_address, open_channel(stack.draft_address, None, 1 << 24), timeouts)
    committed = [5, 9, 11, 4, 20, 7]
    target_prefill = await target.prefill(session_id, committed, sampling)
    draft_prefill = await draft.prefill(session_id, committed, sampling)
    committed.append(target_prefill.value)
    target_handle, draft_handle = target_prefill.handle, draft_prefill.handle
    kinds = set()
    target_model = stack.target.loaded.model
    draft_model = stack.draft.loaded.model
    for num_speculative_tokens in schedule:
        proposal = Proposal(token_ids=())
        if num_speculative_tokens:
            new = committed[draft_handle.committed_length:]
            proposed = await draft.propose(draft_handle, new, num_speculative_tokens)
            draft_handle, proposal = proposed.handle, proposed.value
            drafts = proposal.token_ids
            draft_state = stack.draft.store.lookup(session_id, draft_handle.epoch).state
            assert draft_state.committed == committed
            _assert_cache_is_fresh_prefill(draft_state.cache, draft_model, committed + list(drafts[:-1]))
        verified = await target.verify(target_handle, proposal)
        target_handle, verify = verified.handle, verified.value
        committed += [*proposal.token_ids[: verify.num_accepted], verify.next_token_id]
        assert target_handle.committed_length == len(committed)
        target_state = stack.target.store.lookup(session_id, target_handle.epoch).state
        assert target_state.last_token_id == committed[-1]
        _assert_cache_is_fresh_prefill(target_state.cache, target_model, committed[:-1])
        full = verify.num_accepted == num_speculative_tokens
        kinds.add("plain" if not num_speculative_tokens else "full" if full else "rejection")
    await target.release(session_id)
    await draft.release(session_id)
    await target.channel.close()
    await draft.channel.close()
    return kinds


SCHEDULE = [3, 0, 0, 4, 1, 2, 0, 5, 3, 3, 1, 0, 2, 4, 4]


def test_invariant_with_rejections_and_plain_rounds(loop_thread, stack):
    kinds = loop_thread.run(_rounds(stack, SCHEDULE, SamplingParams(), "invariant-greedy"))
    assert {"rejection", "plain"} <= kinds


def test_invariant_with_full_acceptance(loop_thread, stack_same):
    kinds = loop_thread.run(_rounds(stack_same, SCHEDULE, SamplingParams(), "invariant-same"))
    assert kinds == {"full", "plain"}


def test_invariant_when_sampling(loop_thread, stack):
    sampling = SamplingParams(temperature=0.9, top_k=20, seed=11)
    kinds = loop_thread.run(_rounds(stack, SCHEDULE, sampling, "invariant-sampled"))
    assert {"plain"} < kinds
