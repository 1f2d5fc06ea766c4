"""A Decode's passes verify tokens looked up in the session's own tokens (TargetEngine.decode with
`lookup`, float64 tiny target, run alone): greedy tokens are the same as plain decoding's, a
repeating answer is decoded in fewer passes than tokens, offered drafts come first, the price of
a row (min_chance) bounds what is verified, the session's tokens stay C, and sampled lookups leave
the target's law."""

from __future__ import annotations


import torch

from specdec.models import ModelConfig, load_model
from specdec.protocol import DecodeLookup, DraftOffer, DraftTally, Proposal, SamplingParams
from specdec.ragged import run_alone
from target_service.engine import TargetEngine
from tests import tiny_models
from tests.service import test_sampling_services as sampling

# Repeats itself: its own tokens are there to be looked up from the first step.
PROMPT = [18, 29, 13, 10, 26, 13, 25, 5, 18, 29, 13, 10, 26, 13, 25, 5, 18, 29]
GREEDY = SamplingParams(temperature=0.0)
STEPS = 40


def _decode(endless_target, lookup: DecodeLookup | None, offered=None, steps: int = STEPS, max_k: int = 8,
            engine: TargetEngine | None = None):
    """Prefill + one Decode of `steps` tokens -> (the first token and the decoded ones, the state,
    the lookups' tally, the offers' tally)."""
    engine = engine or TargetEngine(endless_target, max_k)
    state, first = run_alone(endless_target.model, engine.prefill(PROMPT, GREEDY, resume=False))
    looked_up, offers = DraftTally(), DraftTally()
    tokens = run_alone(endless_target.model, engine.decode(state, steps, offered=offered or (lambda: None), tally=offers,
                                                   lookup=lookup, looked_up=looked_up))
    return [first, *(token.token_id for token in tokens)], state, looked_up, offers


def test_lookups_leave_greedy_tokens_unchanged_and_take_fewer_passes(endless_target):
    plain, _, none, _ = _decode(endless_target, None)
    assert none.passes == 0
    for max_tokens in (1, 3, 8):
        tokens, state, looked_up, _ = _decode(endless_target, DecodeLookup(max_tokens))
        assert tokens == plain, max_tokens
        assert state.tokens == [*PROMPT, *tokens]  # the session's tokens are C
        assert state.committed_length == len(state.tokens)
        assert looked_up.passes > 0 and 0 < looked_up.accepted <= looked_up.drafts, looked_up
        assert looked_up.drafts <= max_tokens * looked_up.passes
        # the accepted looked-up tokens took no pass of their own
        passes = (len(tokens) - 1) - looked_up.accepted
        assert passes < len(tokens) - 1


def test_lookups_stop_at_the_engines_most_drafts_and_the_calls_max_tokens(endless_target):
    plain, _, _, _ = _decode(endless_target, None)
    for steps in (1, 2, 5):
        tokens, _, looked_up, _ = _decode(endless_target, DecodeLookup(16), steps=steps, max_k=3)
        assert tokens == plain[:steps + 1]
        assert looked_up.drafts <= max(0, steps - 1) * max(1, looked_up.passes)
    _, _, looked_up, _ = _decode(endless_target, DecodeLookup(16), max_k=3)
    assert 0 < looked_up.drafts <= 3 * looked_up.passes


def test_the_price_of_a_row_bounds_what_is_verified(endless_target):
    """min_chance 1: no looked-up token is sure enough, so none is verified; in between, fewer
    than at 0."""
    plain, _, _, _ = _decode(endless_target, None)
    tokens, _, never, _ = _decode(endless_target, DecodeLookup(8, min_chance=1.0))
    assert tokens == plain and never.passes == 0
    _, _, everything, _ = _decode(endless_target, DecodeLookup(8, min_chance=0.0))
    _, _, some, _ = _decode(endless_target, DecodeLookup(8, min_chance=0.3))
    assert some.drafts / max(1, some.passes) < everything.drafts / everything.passes


def test_offered_drafts_come_before_lookups(endless_target):
    plain, _, _, _ = _decode(endless_target, None)
    committed = [*PROMPT, *plain]

    def offer_at(length: int) -> DraftOffer:  # the target's own next two tokens, always
        return DraftOffer(length, Proposal(tuple(committed[length:length + 2])), 2)

    engine = TargetEngine(endless_target, 8)
    state, first = run_alone(endless_target.model, engine.prefill(PROMPT, GREEDY, resume=False))
    looked_up, offers = DraftTally(), DraftTally()
    tokens = run_alone(endless_target.model, engine.decode(state, STEPS, offered=lambda: offer_at(state.committed_length),
                                                   tally=offers, lookup=DecodeLookup(8), looked_up=looked_up))
    assert [first, *(token.token_id for token in tokens)] == plain
    assert offers.passes > 0 and looked_up.passes == 0


def test_sessions_learn_their_lookups_acceptance_and_the_replica_keeps_it(endless_target):
    engine = TargetEngine(endless_target, 8)
    _, state, looked_up, _ = _decode(endless_target, DecodeLookup(8), engine=engine)
    assert state.lookup is not None and state.lookup.acceptance.estimates()
    snapshot = engine.lookup_priors[True].snapshot()
    assert any(alpha is not None for alpha in snapshot)
    assert all(alpha is None for alpha in engine.lookup_priors[False].snapshot())  # sampled apart


def _lookup_prompt(model) -> list[int]:
    """A prompt "5 t f(t)" for every token t, then 5: whatever the first token t1, the lookup
    proposes f(t1), taken (by three rounds of fixing it) as the model's likeliest token there, so
    that lookups are verified in every Decode and accepted often."""
    follow = [0] * sampling.VOCAB_SIZE
    for _ in range(3):
        prompt = [x for t in range(sampling.VOCAB_SIZE) for x in (5, t, follow[t])] + [5]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([[*prompt, t] for t in range(sampling.VOCAB_SIZE)])).logits
        follow = logits[:, -1].argmax(-1).tolist()
    return [x for t in range(sampling.VOCAB_SIZE) for x in (5, t, follow[t])] + [5]


def test_sampled_lookups_leave_the_targets_law(tmp_path):
    """Sampled at T = 1: each Decode of two tokens verifies the token the lookup finds after
    C = prompt + t1 (one-hot q~). The joint law of the first three tokens is the target's (the
    chi-square test of tests/service/test_sampling_services.py; a q~ that claimed 0.5 for the
    looked-up token instead of 1 fails it at p ~ 1e-95)."""
    model = sampling._small_model(seed=11)
    prompt = _lookup_prompt(model)
    model_dir = tiny_models.save(model, tmp_path / "target", with_tokenizer=False)
    small = load_model(ModelConfig(str(model_dir), "target", dtype="float64"))
    law = sampling.reference_joint_law(sampling._load(model_dir),
                                       sampling.Config(temperature=1.0, top_k=0, num_samples=0, first_seed=0),
                                       prompt)
    engine = TargetEngine(small, 4)
    samples, looked_up = [], DraftTally()
    for seed in range(2_000):
        params = SamplingParams(temperature=1.0, seed=70_000 + seed)
        state, first = run_alone(small.model, engine.prefill(prompt, params, resume=False))
        tokens = run_alone(small.model, engine.decode(state, 2, lookup=DecodeLookup(4), looked_up=looked_up))
        samples.append([first, *(token.token_id for token in tokens[:2])])
    p_value, summary = sampling.chi_square_p_value(sampling._joint_counts(torch.tensor(samples)), law)
    assert p_value > sampling.ALPHA, summary
    assert looked_up.passes == 2_000 and 200 < looked_up.accepted < looked_up.drafts, looked_up


def test_the_replicas_own_price_of_a_row_holds_when_the_caller_asks_less(endless_target):
    """The target's price (its step passes' cost of a row, specdec.pass_costs) is a floor under
    the caller's min_chance: at 1, nothing looked up is verified; at 0, the caller's rules."""
    plain, _, _, _ = _decode(endless_target, None)
    tokens, _, never, _ = _decode(endless_target, DecodeLookup(8, min_chance=0.0),
                                  engine=TargetEngine(endless_target, 8, row_price=lambda: 1.0))
    assert tokens == plain and never.passes == 0
    _, _, some, _ = _decode(endless_target, DecodeLookup(8, min_chance=0.0),
                            engine=TargetEngine(endless_target, 8, row_price=lambda: 0.0))
    assert some.passes > 0
