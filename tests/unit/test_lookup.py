"""Model-free drafts: the n-gram and suffix lookups, the shared cache's bound, and one-hot q~
against the general verify rule."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.lookup import NO_LOOKUP, NgramProposer, SuffixCache, SuffixProposer
from specdec.sampling import verify_sampled_one


# ---------------------------------------------------------------------------------- n-gram


def test_ngram_proposes_the_continuation_of_the_most_recent_match():
    proposer = NgramProposer(min_n=1, max_n=3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    lookup = proposer.propose(tokens, k=2)
    assert lookup.token_ids == (7, 8)  # the later of the two earlier [1, 2, 3]
    assert lookup.match_length == 3
    assert lookup.match_lengths == (3, 4)  # the second token continues the same match


def test_ngram_prefers_longer_matches_and_falls_back_to_shorter():
    proposer = NgramProposer(min_n=1, max_n=3)
    # [5, 6] occurs once, followed by 4; [6] alone is more recent, followed by 0
    tokens = [5, 6, 4, 6, 0, 5, 6]
    assert proposer.propose(tokens, k=1).token_ids == (4,)
    assert proposer.propose(tokens, k=1).match_length == 2
    proposer = NgramProposer(min_n=1, max_n=3)
    assert proposer.propose([3, 6, 0, 9, 6], k=2).token_ids == (0, 9)


def test_ngram_no_match_below_min_n():
    proposer = NgramProposer(min_n=2, max_n=3)
    assert proposer.propose([1, 2, 3, 4, 2], k=4).token_ids == ()
    assert proposer.propose([1, 2, 3], k=4).token_ids == ()
    assert proposer.propose([1], k=4).token_ids == ()


def test_ngram_index_follows_a_growing_sequence_like_a_fresh_scan():
    rng = random.Random(0)
    tokens = [rng.randrange(4) for _ in range(5)]
    incremental = NgramProposer(min_n=1, max_n=3)
    for _ in range(200):
        k = rng.randint(0, 5)
        expected = NgramProposer(min_n=1, max_n=3).propose(tokens, k)
        assert incremental.propose(tokens, k) == expected
        assert expected == _brute_force_ngram(tokens, k, 1, 3)
        tokens.extend(rng.randrange(4) for _ in range(rng.randint(1, 3)))


def _brute_force_ngram(tokens, k, min_n, max_n):
    if k <= 0:
        return NO_LOOKUP
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == tail:
                lookup = NgramProposer(min_n=n, max_n=n).propose(tokens, k)
                extended = list(tokens)
                for position in range(end, end + k):
                    extended.append(extended[position])
                assert lookup.token_ids == tuple(extended[len(tokens):])
                return lookup
    return NO_LOOKUP


def test_ngram_continuation_may_run_into_the_tail():
    proposer = NgramProposer(min_n=1, max_n=2)
    # the match ending at 2: 7, 8, then the pattern goes on
    assert proposer.propose([7, 8, 7, 8], k=5).token_ids == (7, 8, 7, 8, 7)
    # [8, 8] is new; the latest earlier [8] is at 3, followed by 8, and so on
    assert proposer.propose([7, 8, 7, 8, 8], k=3).token_ids == (8, 8, 8)


# ---------------------------------------------------------------------------------- suffix


def test_suffix_follows_the_most_frequent_continuation():
    proposer = SuffixProposer(max_depth=4, min_share=0.3)
    tokens = [1, 2, 3, 1, 2, 3, 1, 2, 4, 0, 1, 2]
    lookup = proposer.propose(tokens, k=3)
    # after [.., 1, 2]: 3 twice, 4 once -> 3, then [1, 2, 3] -> 1, then -> 2
    assert lookup.token_ids[0] == 3
    assert lookup.token_ids == (3, 1, 2)
    # contexts matched: [1, 2]; then [1, 2, 3]; then [1, 2, 3, 1] (the proposed tokens included)
    assert lookup.match_lengths == (2, 3, 4)
    assert lookup.first(2).token_ids == (3, 1) and lookup.first(2).match_lengths == (2, 3)


def test_suffix_stops_when_no_continuation_is_frequent_enough():
    proposer = SuffixProposer(max_depth=2, min_share=0.6)
    # after 1: 2, 3, 4 once each -> no token has a share >= 0.6
    assert proposer.propose([1, 2, 1, 3, 1, 4, 1], k=4).token_ids == ()


def test_suffix_session_alone_knows_nothing_of_other_sessions():
    first = SuffixProposer(max_depth=4)
    first.propose([10, 11, 12, 13, 14], k=2)
    first.finish([10, 11, 12, 13, 14], prompt_length=1)
    assert SuffixProposer(max_depth=4).propose([20, 11, 12], k=2).token_ids == ()


def test_suffix_shared_cache_carries_outputs_across_sessions():
    cache = SuffixCache(max_tokens=100, max_depth=4)
    first = SuffixProposer(cache=cache)
    first.propose([99, 11, 12, 13, 14], k=2)
    first.finish([99, 11, 12, 13, 14], prompt_length=1)  # output 11 12 13 14 goes to the cache
    second = SuffixProposer(cache=cache)
    assert second.propose([50, 11, 12], k=2).token_ids == (13, 14)


def test_suffix_cache_evicts_the_least_recent_outputs_and_keeps_counts_exact():
    cache = SuffixCache(max_tokens=10, max_depth=3)
    cache.add([1, 2, 3, 4, 5])
    cache.add([6, 7, 8, 9, 10])
    assert cache.counts.get((1,)) == {2: 1}
    cache.add([11, 12, 13])  # evicts the first output
    assert cache.num_tokens == 8 and len(cache) == 2
    assert cache.counts.get((1,)) is None and cache.counts.get((1, 2)) is None
    assert cache.counts.get((6, 7)) == {8: 1}
    # counts equal a fresh build from the entries kept
    fresh = SuffixCache(max_tokens=10, max_depth=3)
    fresh.add([6, 7, 8, 9, 10])
    fresh.add([11, 12, 13])
    assert cache.counts.table == fresh.counts.table


def test_suffix_cache_memory_is_bounded_over_10000_sessions():
    max_tokens, max_depth = 2_000, 4
    cache = SuffixCache(max_tokens=max_tokens, max_depth=max_depth)
    rng = random.Random(3)
    for _ in range(10_000):
        prompt = [rng.randrange(50) for _ in range(rng.randint(1, 8))]
        proposer = SuffixProposer(cache=cache)
        tokens = list(prompt)
        for _ in range(rng.randint(1, 12)):
            proposer.propose(tokens, k=3)
            tokens.append(rng.randrange(50))
        proposer.finish(tokens, prompt_length=len(prompt))
        assert cache.num_tokens <= max_tokens
    assert len(cache.counts) <= max_tokens * max_depth
    contexts = sum(len(row) for row in cache.counts.table.values())
    assert contexts <= max_tokens * max_depth
    assert sum(len(entry) for entry in cache._entries.values()) == cache.num_tokens


def test_suffix_cache_keeps_the_end_of_an_output_longer_than_the_bound():
    cache = SuffixCache(max_tokens=4, max_depth=2)
    cache.add(list(range(10)))
    assert cache.num_tokens == 4 and cache.counts.get((8,)) == {9: 1}


# ---------------------------------------------------------------------- one-hot q~ is lossless


def _general_rule(p: torch.Tensor, q: torch.Tensor, x: int) -> tuple[float, torch.Tensor]:
    """Speculative sampling in closed form: accept x ~ q with probability min(1, p(x) / q(x));
    on a rejection sample from max(p - q, 0), renormalised."""
    accept = min(1.0, float(p[x] / q[x]))
    residual = (p - q).clamp(min=0)
    return accept, residual / residual.sum()


@pytest.mark.parametrize("seed", range(5))
def test_one_hot_proposal_follows_the_general_rule(seed):
    generator = torch.Generator().manual_seed(seed)
    vocab = 6
    p = torch.rand(vocab, generator=generator, dtype=torch.float64) ** 3
    p /= p.sum()
    x = seed % vocab
    one_hot = torch.zeros(vocab, dtype=torch.float64)
    one_hot[x] = 1.0
    accept, residual = _general_rule(p, one_hot, x)
    assert accept == pytest.approx(float(p[x]), abs=1e-15)  # accept with probability p(x)
    removed = p.clone()
    removed[x] = 0
    assert torch.allclose(residual, removed / removed.sum(), atol=1e-15)  # p without x, renormalised
    # The verify rule the target runs gives the same law: exact over a fine grid of uniforms.
    grid = 4000
    target_probs = torch.stack([p, p])  # (K + 1, V), K = 1
    accepted = 0
    next_counts = torch.zeros(vocab, dtype=torch.float64)
    for i in range(grid):
        u = (i + 0.5) / grid
        outcome = verify_sampled_one(target_probs, torch.tensor([x]), one_hot.unsqueeze(0),
                                     torch.tensor([u], dtype=torch.float64), (i * 7919 % grid + 0.5) / grid)
        if outcome.num_accepted == 1:
            accepted += 1
        else:
            next_counts[outcome.next_token_id] += 1
    assert accepted / grid == pytest.approx(float(p[x]), abs=1.5 / grid)
    # The law of the output token: x on acceptance, the residual otherwise == p itself.
    rejected = grid - accepted
    if rejected > 200:
        assert next_counts[x] == 0
        assert torch.allclose(next_counts / rejected, residual, atol=0.05)


# ------------------------------------------------------------------------- the local draft


def test_draft_method_of_the_flags():
    from orchestrator.local_draft import draft_method_of

    assert draft_method_of("local:suffix", "") == "suffix"
    assert draft_method_of("local:ngram", "ngram") == "ngram"
    assert draft_method_of("host:1", "") == "model"
    assert draft_method_of("host:1", "hybrid") == "hybrid"
    for draft, method in (("local:model", ""), ("local:hybrid", ""), ("local:ngram", "suffix"), ("host:1", "x")):
        with pytest.raises(ValueError):
            draft_method_of(draft, method)


def test_hybrid_takes_the_lookup_only_on_a_strong_match():
    from orchestrator.local_draft import LocalDrafts, LookupConfig

    hybrid = LocalDrafts("hybrid", LookupConfig(hybrid_min_match=3)).session()
    assert hybrid is not None and hybrid.uses_model and hybrid.lookup_method == "suffix"
    weak, _ = hybrid.lookup([1, 2, 9, 2], 4)  # context [2] only: 1 token matched
    assert weak.token_ids and weak.match_length == 1 and not hybrid.takes(weak)
    hybrid = LocalDrafts("hybrid", LookupConfig(hybrid_min_match=3)).session()  # C only grows: a new one
    strong, _ = hybrid.lookup([1, 2, 3, 4, 5, 1, 2, 3], 4)  # [1, 2, 3] matched
    assert strong.match_length >= 3 and hybrid.takes(strong)
    hybrid = LocalDrafts("hybrid", LookupConfig(hybrid_min_match=3)).session()
    assert not hybrid.takes(hybrid.lookup([7], 4)[0])  # no match at all
    suffix = LocalDrafts("suffix").session()
    assert suffix is not None and not suffix.uses_model and suffix.takes(suffix.lookup([1, 2, 9, 2], 4)[0])
    assert LocalDrafts("model").session() is None


def test_lookup_reply_is_one_hot_when_sampling():
    from orchestrator.local_draft import lookup_reply
    from specdec.lookup import Lookup
    from specdec.protocol import SamplingParams, SparseDistribution

    found = Lookup((4, 7), (2, 3))
    greedy = lookup_reply(found, SamplingParams(), "s", 10, 1e-5).value
    assert greedy.token_ids == (4, 7) and greedy.distributions == () and greedy.fed_tokens == 0
    assert greedy.match_lengths == (2, 3)
    sampled = lookup_reply(found, SamplingParams(temperature=0.8), "s", 10, 1e-5).value
    assert sampled.distributions == (SparseDistribution((4,), (1.0,)), SparseDistribution((7,), (1.0,)))


# ------------------------------------------------------------- the shared cache, per token

COMMON = list(range(3, 9))  # tokens every client's sessions use
PHRASES = ([3, 4, 5], [6, 7, 8])  # common phrases, each client following them its own way
SECRET = {"a": 100, "b": 200}  # each client's own tokens: base .. base + 3


def _client_session(rng: random.Random, client: str) -> tuple[list[int], list[int]]:
    """A prompt of common tokens, and an output in which common phrases are followed by the
    client's own tokens: where one cache for both clients would leak, and does."""
    prompt = [1, 2, *rng.choices(COMMON, k=4)]
    output: list[int] = []
    for _ in range(rng.randint(3, 6)):
        j = rng.randrange(len(PHRASES))
        output += [*rng.choices(COMMON, k=rng.randint(0, 2)), *PHRASES[j],
                   SECRET[client] + 2 * j, SECRET[client] + 2 * j + 1]
    return prompt, output


def _play(drafts, partition_of, sessions: int = 60, seed: int = 3):
    """Plays client sessions ("a" or "b" at random) token by token through drafts; returns the
    proposed tokens that the session's client never saw (in its earlier sessions or this one's
    tokens so far), and each client's outputs."""
    rng = random.Random(seed)
    seen: dict[str, set[int]] = {"a": set(), "b": set()}
    outputs: dict[str, list[tuple[int, ...]]] = {"a": [], "b": []}
    leaks = []
    for _ in range(sessions):
        client = rng.choice("ab")
        prompt, output = _client_session(rng, client)
        tokens = prompt + output
        draft = drafts.session(partition_of(client))
        for end in range(len(prompt), len(tokens)):
            found, _ = draft.lookup(tokens[:end], 4)
            allowed = seen[client] | set(tokens[:end])
            leaks += [(client, token) for token in found.token_ids if token not in allowed]
        draft.finish(tokens, len(prompt))
        seen[client] |= set(tokens)
        outputs[client].append(tuple(output))
    return leaks, outputs


@pytest.mark.parametrize("method", ["suffix", "hybrid"])
def test_no_proposal_for_one_token_draws_on_another_tokens_sessions(method):
    from orchestrator.local_draft import LocalDrafts, LookupConfig
    from specdec.rpc.auth import token_partition

    shared = LookupConfig(suffix_cache="shared")
    partitions = {client: token_partition(f"token-of-{client}") for client in "ab"}
    drafts = LocalDrafts(method, shared)
    leaks, outputs = _play(drafts, partitions.__getitem__)
    assert leaks == []
    # Each token's cache holds its own sessions' outputs and nothing else.
    for client, partition in partitions.items():
        assert drafts.caches[partition].entries() == outputs[client]
    assert len(drafts.cache) == 0  # the requests without a token: none here
    # The check has teeth: one cache for both (no tokens) leaks the other client's tokens.
    one_cache = LocalDrafts(method, shared)
    leaks, _ = _play(one_cache, lambda client: "")
    other = {"a": range(SECRET["b"], SECRET["b"] + 4), "b": range(SECRET["a"], SECRET["a"] + 4)}
    assert [token for client, token in leaks if token in other[client]]


def test_the_session_cache_and_ngram_keep_no_state_across_requests():
    from orchestrator.local_draft import LocalDrafts

    for method in ("ngram", "suffix"):
        drafts = LocalDrafts(method)  # --suffix-cache session, the default
        assert drafts.cache is None and drafts.cache_of("x") is None and drafts.caches == {}
        leaks, _ = _play(drafts, lambda client: "", sessions=20)
        assert leaks == []


def test_the_server_tokens_and_their_partitions():
    from specdec.rpc.auth import (
        BearerTokenInterceptor,
        load_tokens,
        matching_token,
        metadata_authorization,
        token_partition,
    )

    assert load_tokens(None, {}) is None
    assert load_tokens(None, {"SPECDEC_AUTH_TOKEN": "one\n"}) == ("one",)
    assert load_tokens(None, {"SPECDEC_AUTH_TOKEN": "one\n\n  two \none\n"}) == ("one", "two")
    with pytest.raises(ValueError):
        load_tokens(None, {"SPECDEC_AUTH_TOKEN": " \n"})
    tokens = ("one", "two")
    assert matching_token("Bearer two", tokens) == "two" and matching_token("bearer one", tokens) == "one"
    assert matching_token("Bearer three", tokens) is None and matching_token(None, tokens) is None
    assert metadata_authorization((("x-other", "v"), ("Authorization", "Bearer two"))) == "Bearer two"
    assert metadata_authorization((("authorization", "Basic abc"),)) is None
    assert token_partition(None) == "" and token_partition("one") != token_partition("two")
    assert "one" not in token_partition("one")
    assert BearerTokenInterceptor("one").tokens == ("one",)
    assert BearerTokenInterceptor(tokens)._authenticated((("authorization", "Bearer two"),))
    assert not BearerTokenInterceptor(tokens)._authenticated((("authorization", "Bearer one2"),))
    with pytest.raises(ValueError):
        BearerTokenInterceptor(("one", ""))
