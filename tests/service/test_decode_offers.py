"""A Decode's passes verify the drafts offered to it (TargetEngine.decode with `offered`, float64
tiny target, run alone): greedy tokens are the same with any offers, right, wrong, stale or
ahead, and with their branches; offers of the target's own tokens are all accepted; sampled
offers and branches leave the target's law; and DraftOffer picks the drafts that follow C as it
is."""

from __future__ import annotations

import random

import torch

from specdec.models import ModelConfig, load_model
from specdec.protocol import BranchProposal, DraftOffer, DraftTally, Proposal, SamplingParams, SparseDistribution
from specdec.ragged import run_alone
from target_service.engine import TargetEngine
from tests import tiny_models
from tests.service import test_sampling_services as sampling

PROMPT = [18, 29, 13, 10, 26, 13, 25, 5]
GREEDY = SamplingParams(temperature=0.0)
STEPS = 24


def _decode(endless_target, offer_at=None, steps: int = STEPS, max_k: int = 8) -> tuple[list[int], DraftTally, int]:
    """Prefill + Decode of `steps` tokens; offer_at(length) is the offer the session holds when its
    committed length is `length` (None: none). Returns the tokens after the first, the tally, and
    the first token."""
    engine = TargetEngine(endless_target, max_k)
    state, first = run_alone(endless_target.model, engine.prefill(PROMPT, GREEDY, resume=False))
    tally = DraftTally()
    offered = (lambda: offer_at(state.committed_length)) if offer_at is not None else (lambda: None)
    tokens = run_alone(endless_target.model, engine.decode(state, steps, offered=offered, tally=tally))
    return [token.token_id for token in tokens], tally, first


def test_offers_of_the_targets_own_tokens_are_all_accepted(endless_target):
    plain, _, first = _decode(endless_target)
    committed = [*PROMPT, first, *plain]
    for lag, depth in ((0, 1), (1, 3), (3, 4)):
        def offer_at(length: int, lag=lag, depth=depth) -> DraftOffer:
            start = max(len(PROMPT) + 1, length - lag)  # drafted from C as it was `lag` tokens ago
            return DraftOffer(start, Proposal(tuple(committed[start:start + lag + depth + 2])), depth)

        tokens, tally, _ = _decode(endless_target, offer_at)
        assert tokens == plain
        assert tally.passes > 0 and tally.accepted == tally.drafts
        assert tally.drafts <= depth * tally.passes
        # every pass but the last few verified `depth` drafts, all accepted: depth + 1 tokens a pass
        assert tally.passes < len(plain)


def test_any_offers_leave_greedy_tokens_unchanged(endless_target):
    plain, _, first = _decode(endless_target)
    committed = [*PROMPT, first, *plain]
    rng = random.Random(3)
    vocab = endless_target.vocab_size
    for trial in range(6):
        def offer_at(length: int) -> DraftOffer | None:
            kind = rng.random()
            if kind < 0.15:
                return None
            start = rng.randint(len(PROMPT) - 2, length + 1)  # before the Decode, behind, at, ahead
            drafts = [committed[i] if i < len(committed) and rng.random() < 0.7 else rng.randrange(vocab)
                      for i in range(start, start + rng.randint(1, 8))]
            return DraftOffer(start, Proposal(tuple(drafts)), rng.randint(1, 6))

        tokens, tally, _ = _decode(endless_target, offer_at, max_k=rng.choice([2, 8]))
        assert tokens == plain, trial
        assert tally.accepted <= tally.drafts


def test_branches_c_followed_are_verified_and_leave_greedy_tokens_unchanged(endless_target):
    """Offers whose own drafts are wrong at their first `wrong` positions, each with a branch that
    holds the target's token there (and its tokens after) and branches that do not."""
    plain, _, first = _decode(endless_target)
    committed = [*PROMPT, first, *plain]
    rng = random.Random(5)
    vocab = endless_target.vocab_size

    def other_than(token: int) -> int:
        return (token + rng.randrange(1, vocab)) % vocab

    for lag in (1, 2, 3):
        def offer_at(length: int, lag=lag) -> DraftOffer:
            start = max(len(PROMPT) + 1, length - lag)
            own = committed[start:start + lag + 3]
            wrong = rng.randrange(0, max(1, length - start))  # C left the drafts here
            drafts = [*own[:wrong], other_than(own[wrong]), *own[wrong + 1:]] if own else []
            branches = [BranchProposal(j, other_than(own[j]), Proposal((rng.randrange(vocab),)))
                        for j in range(min(lag, len(own)))]
            if wrong < len(own):
                branches.append(BranchProposal(wrong, own[wrong], Proposal(tuple(own[wrong + 1:]))))
            return DraftOffer(start, Proposal(tuple(drafts)), 3, tuple(rng.sample(branches, len(branches))))

        tokens, tally, _ = _decode(endless_target, offer_at)
        assert tokens == plain, lag
        assert tally.branch_passes > 0, lag
        assert tally.branch_passes <= tally.passes and tally.accepted <= tally.drafts


def test_a_round_stops_at_the_calls_max_tokens(endless_target):
    plain, _, first = _decode(endless_target)
    committed = [*PROMPT, first, *plain]
    for steps in (1, 2, 5):
        tokens, tally, _ = _decode(
            endless_target, lambda length: DraftOffer(length, Proposal(tuple(committed[length:length + 8])), 8),
            steps=steps)
        assert tokens == plain[:steps]
        assert tally.drafts <= max(0, steps - 1)


def test_draft_offer_takes_the_drafts_after_c():
    offer = DraftOffer(10, Proposal((1, 2, 3, 4, 5)), max_verified=2)
    known = [9, 1, 2]  # C[9:12]
    assert offer.drafts_after(known[:1], 9, 10) == (Proposal((1, 2)), False)
    assert offer.drafts_after(known, 9, 12) == (Proposal((3, 4)), False)
    assert offer.drafts_after([9, 1, 7], 9, 12)[0].token_ids == ()  # C differs where the drafts were
    assert offer.drafts_after([7, 9, 1, 2, 3, 4, 5], 8, 15)[0].token_ids == ()  # nothing left past C
    assert offer.drafts_after([2], 11, 12)[0].token_ids == ()  # starts before what is known of C


def test_draft_offer_takes_the_branch_c_followed():
    branches = (BranchProposal(0, 7, Proposal((8, 9, 10))), BranchProposal(1, 6, Proposal((5, 4))),
                BranchProposal(1, 3, Proposal((2,))))
    offer = DraftOffer(10, Proposal((1, 2, 3, 4)), max_verified=2, branches=branches)
    # C[9:] = [9, 7, ...]: the first branch, once C holds its token (7 is not a draft: never verified)
    assert offer.drafts_after([9, 7], 9, 11) == (Proposal((8, 9)), True)
    assert offer.drafts_after([9, 7, 8], 9, 12) == (Proposal((9, 10)), True)
    assert offer.drafts_after([9, 7, 8, 9, 10], 9, 14)[0].token_ids == ()  # nothing left past C
    assert offer.drafts_after([9, 7, 5], 9, 12)[0].token_ids == ()  # C left the branch too
    assert offer.drafts_after([9, 1, 6], 9, 12) == (Proposal((5, 4)), True)
    assert offer.drafts_after([9, 1, 3], 9, 12) == (Proposal((2,)), True)
    assert offer.drafts_after([9, 1, 2], 9, 12) == (Proposal((3, 4)), False)  # the proposal's own
    assert offer.drafts_after([9], 9, 10) == (Proposal((1, 2)), False)
    assert offer.drafts_after([9, 2, 6], 9, 12)[0].token_ids == ()  # a branch's token after a draft C left


def test_sampled_offers_and_branches_leave_the_targets_law(tmp_path):
    """Sampled at T = 1: each Decode of a session is offered a draft d1 for the position after its
    first token, drawn from q~, and a branch for every other token t there with a drawn draft after
    it: the first pass verifies d1, and where the target rejects it the second verifies the branch
    of the token it took. The joint law of the first three tokens is the target's (the chi-square
    test of tests/service/test_sampling_services.py)."""
    model = sampling._small_model(seed=11)
    model_dir = tiny_models.save(model, tmp_path / "target", with_tokenizer=False)
    small = load_model(ModelConfig(str(model_dir), "target", dtype="float64"))
    law = sampling.reference_joint_law(sampling._load(model_dir),
                                       sampling.Config(temperature=1.0, top_k=0, num_samples=0, first_seed=0))
    vocab = sampling.VOCAB_SIZE
    rng = random.Random(17)  # the offers' own randomness: independent of the target's keyed draws

    def drawn() -> tuple[int, SparseDistribution]:
        support = tuple(rng.sample(range(vocab), 3))
        weights = [rng.random() + 0.1 for _ in support]
        probs = tuple(w / sum(weights) for w in weights)
        return rng.choices(support, probs)[0], SparseDistribution(support, probs)

    engine = TargetEngine(small, 4)
    start = len(sampling.PROMPT) + 1
    samples, tally = [], DraftTally()
    for seed in range(2_000):
        params = SamplingParams(temperature=1.0, seed=60_000 + seed)
        state, first = run_alone(small.model, engine.prefill(sampling.PROMPT, params, resume=False))
        d1, q1 = drawn()
        branches = []
        for t in range(vocab):
            if t != d1:
                b1, qb = drawn()
                branches.append(BranchProposal(0, t, Proposal((b1,), (qb,))))
        offer = DraftOffer(start, Proposal((d1,), (q1,)), 1, tuple(branches))
        tokens = run_alone(small.model, engine.decode(state, 3, offered=lambda: offer, tally=tally))
        samples.append([first, *(token.token_id for token in tokens[:2])])
    p_value, summary = sampling.chi_square_p_value(sampling._joint_counts(torch.tensor(samples)), law)
    assert p_value > sampling.ALPHA, summary
    assert tally.branch_passes > 500 and tally.passes > tally.branch_passes, tally
    assert 0 < tally.accepted < tally.drafts, tally
