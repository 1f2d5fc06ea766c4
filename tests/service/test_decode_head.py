"""A Decode's passes verify its draft head's drafts where nothing else proposes (TargetEngine.decode
with a head, float64 tiny target, run alone): greedy tokens are the same as plain decoding's and
take fewer passes, lookups come first, a pass with offered drafts too verifies the chain its
session's record says is worth more, the price of a row bounds what is verified, and sampled head
drafts (one-hot q~) leave the target's law."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.distill.data import Example
from specdec.distill.head import HeadDistillConfig, answer_positions, train_head
from specdec.draft_head import new_head, save_head
from specdec.models import ModelConfig, load_model
from specdec.chain_acceptance import OFFER_TRIALS
from specdec.protocol import DecodeLookup, DraftOffer, DraftTally, Proposal, SamplingParams
from specdec.ragged import run_alone
from target_service.engine import TargetEngine
from tests import stack as stack_module
from tests import tiny_models
from tests.service.test_lookup_drafts import LookupStack, _generate
from tests.service import test_sampling_services as sampling

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [7, 3, 19, 42, 8, 11]  # does not repeat itself: no lookup finds anything at first
STEPS = 40


def trained_head(model_dir, out_dir, answers: int = 48, steps: int = 300):
    """A head trained on the target's own greedy answers to random prompts (float32 copy)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    examples = []
    with torch.no_grad():
        for _ in range(answers):
            prompt = torch.randint(3, vocab, (6,), generator=generator)
            output = model.generate(prompt[None], attention_mask=torch.ones(1, 6, dtype=torch.long), max_new_tokens=24,
                                    min_new_tokens=24, do_sample=False, pad_token_id=0)
            answer = output[0, 6:].tolist()
            examples.append(Example(prompt.tolist(), answer, torch.zeros(len(answer), 1, dtype=torch.int32),
                                    torch.zeros(len(answer), 1, dtype=torch.float16)))
    positions = answer_positions(model, examples)
    torch.manual_seed(0)
    head = new_head(model, list(range(vocab)), inner_size=64)
    config = HeadDistillConfig(target="tiny", out_dir=out_dir, steps=steps, batch_size=64, learning_rate=1e-2,
                               eval_every=steps, progress=False)
    train_head(head, positions, positions, config, autocast_dtype=None)
    save_head(head, out_dir)
    return out_dir


@pytest.fixture(scope="module")
def headed_target(tiny_pair, tmp_path_factory):
    """The tiny target as a service loads it (float64, no end-of-sequence tokens) with a head."""
    head_dir = trained_head(tiny_pair.target_dir, tmp_path_factory.mktemp("head") / "head")
    loaded = load_model(ModelConfig(str(tiny_pair.target_dir), "target", dtype="float64", draft_head=str(head_dir)))
    assert loaded.head is not None and loaded.head.up.weight.dtype == torch.float64
    return dataclasses.replace(loaded, eos_token_ids=())


def _decode(target, lookup: DecodeLookup | None, steps: int = STEPS, max_k: int = 4, row_price: float = 0.0,
            prompt=PROMPT):
    """Prefill + one Decode -> (the first token and the decoded ones, the state, the head's tally,
    the lookups' tally)."""
    engine = TargetEngine(target, max_k, row_price=lambda: row_price, head=target.head)
    state, first = run_alone(target.model, engine.prefill(prompt, GREEDY, resume=False))
    headed, looked_up = DraftTally(), DraftTally()
    tokens = run_alone(target.model, engine.decode(state, steps, lookup=lookup, looked_up=looked_up, headed=headed))
    return [first, *(token.token_id for token in tokens)], state, headed, looked_up


def test_head_drafts_leave_greedy_tokens_unchanged_and_take_fewer_passes(headed_target):
    plain, _, none, _ = _decode(headed_target, None)
    assert none.passes == 0
    for most in (1, 2, 4):
        tokens, state, headed, _ = _decode(headed_target, DecodeLookup(0, head_max_tokens=most))
        assert tokens == plain, most
        assert state.tokens == [*PROMPT, *tokens] and state.committed_length == len(state.tokens)
        assert headed.passes > 0 and 0 < headed.accepted <= headed.drafts <= most * headed.passes, headed
        assert (len(tokens) - 1) - headed.accepted < len(tokens) - 1  # accepted drafts took no pass


def test_the_price_of_a_row_bounds_the_head_drafts(headed_target):
    """A draft is verified only while the head's chances, multiplied along the drafts, reach the
    price: at 1 none is (the caller's or the replica's own price), at 0 the most allowed."""
    plain, _, _, _ = _decode(headed_target, None)
    for lookup, price in ((DecodeLookup(0, min_chance=1.0, head_max_tokens=4), 0.0),
                          (DecodeLookup(0, min_chance=0.0, head_max_tokens=4), 1.0)):
        tokens, _, headed, _ = _decode(headed_target, lookup, row_price=price)
        assert tokens == plain and headed.passes == 0
    _, _, every, _ = _decode(headed_target, DecodeLookup(0, min_chance=0.0, head_max_tokens=4))
    assert every.drafts == 4 * every.passes


def test_lookups_come_before_the_head(headed_target):
    """With a prompt that repeats itself the lookup proposes from the first pass: those passes
    are the lookup's; the head drafts only where the lookup finds nothing."""
    repeating = [18, 29, 13, 10, 26, 13, 25, 5, 18, 29, 13, 10, 26, 13, 25, 5, 18, 29]
    plain, _, _, _ = _decode(headed_target, None, prompt=repeating)
    tokens, _, headed, looked_up = _decode(headed_target, DecodeLookup(4, head_max_tokens=4), prompt=repeating)
    assert tokens == plain
    assert looked_up.passes > 0
    alone, _, only_head, _ = _decode(headed_target, DecodeLookup(0, head_max_tokens=4), prompt=repeating)
    assert alone == plain and only_head.passes > headed.passes


def _decode_offered(target, right: bool, steps: int = STEPS):
    """Prefill + one Decode with the head allowed and, before every pass, an offer of 2 drafts
    after C: the target's own next tokens (right) or other tokens -> (tokens, the offers' tally,
    the head's tally, plain decoding's tokens)."""
    plain, _, _, _ = _decode(target, None, steps=steps + 3)
    engine = TargetEngine(target, 4, head=target.head)
    state, first = run_alone(target.model, engine.prefill(PROMPT, GREEDY, resume=False))

    def offered() -> DraftOffer:
        at = state.committed_length  # the position of C's next token: plain[at - len(PROMPT)]
        drafts = plain[at - len(PROMPT):at - len(PROMPT) + 2]
        if not right:
            drafts = [(token + 1) % target.vocab_size for token in drafts]
        return DraftOffer(at, Proposal(tuple(drafts)), max_verified=2)

    tally, headed = DraftTally(), DraftTally()
    tokens = run_alone(target.model, engine.decode(state, steps, offered=offered, tally=tally,
                                                   lookup=DecodeLookup(0, head_max_tokens=4), headed=headed))
    return [first, *(token.token_id for token in tokens)], tally, headed, plain[:steps + 1]


def test_a_pass_with_offers_and_head_drafts_verifies_the_chain_worth_more(headed_target):
    """Offers every pass: wrong ones are verified in their first trials only, the head's drafts
    then; right ones win over the head's. Greedy tokens are the target's either way."""
    tokens, offered, headed, plain = _decode_offered(headed_target, right=False)
    assert tokens == plain
    assert offered.accepted == 0 and offered.passes == OFFER_TRIALS, offered
    assert headed.passes > OFFER_TRIALS and headed.accepted > 0, headed
    tokens, offered, headed, plain = _decode_offered(headed_target, right=True)
    assert tokens == plain
    assert offered.accepted == offered.drafts == 2 * offered.passes, offered
    assert offered.passes > 3 * headed.passes, (offered, headed)


def test_a_target_without_a_head_ignores_the_request(tiny_pair):
    target = dataclasses.replace(load_model(ModelConfig(str(tiny_pair.target_dir), "target", dtype="float64")),
                                 eos_token_ids=())
    assert target.head is None  # auto: no head for a model other than the default
    plain, _, _, _ = _decode(target, None)
    tokens, _, headed, _ = _decode(target, DecodeLookup(0, head_max_tokens=4))
    assert tokens == plain and headed.passes == 0


def test_sampled_head_drafts_leave_the_targets_law(tmp_path):
    """Sampled at T = 1: each Decode of two tokens verifies the head's draft after the prompt's
    sampled first token (one-hot q~). The joint law of the first three tokens is the target's
    (the chi-square test of tests/service/test_sampling_services.py)."""
    model = sampling._small_model(seed=11)
    model_dir = tiny_models.save(model, tmp_path / "target", with_tokenizer=False)
    head_dir = trained_head(model_dir, tmp_path / "head", answers=32, steps=150)
    small = load_model(ModelConfig(str(model_dir), "target", dtype="float64", draft_head=str(head_dir)))
    law = sampling.reference_joint_law(sampling._load(model_dir),
                                       sampling.Config(temperature=1.0, top_k=0, num_samples=0, first_seed=0),
                                       sampling.PROMPT)
    engine = TargetEngine(small, 4, head=small.head)
    samples, headed = [], DraftTally()
    for seed in range(2_000):
        params = SamplingParams(temperature=1.0, seed=80_000 + seed)
        state, first = run_alone(small.model, engine.prefill(sampling.PROMPT, params, resume=False))
        tokens = run_alone(small.model, engine.decode(state, 2, lookup=DecodeLookup(0, head_max_tokens=1),
                                                      headed=headed))
        samples.append([first, *(token.token_id for token in tokens[:2])])
    p_value, summary = sampling.chi_square_p_value(sampling._joint_counts(torch.tensor(samples)), law)
    assert p_value > sampling.ALPHA, summary
    assert headed.passes == 2_000 and 100 < headed.accepted < headed.drafts, headed


@pytest.fixture(scope="module")
def head_dir(tiny_pair, tmp_path_factory):
    return trained_head(tiny_pair.target_dir, tmp_path_factory.mktemp("service-head") / "head")


def test_adaptive_decode_calls_verify_the_heads_drafts_through_the_services(loop_thread, tiny_pair, head_dir,
                                                                           reference_target):
    """A target started with a head, a model draft and an orchestrator: adaptive requests all at
    once (the speculation guard holds them at K = 0, so the target decodes them in Decode calls)
    have their Decode passes verify the head's drafts, greedy output the target's own; with
    speculation off the target decodes plainly."""
    import asyncio

    import orchestrator.server
    from orchestrator.pool import PoolConfig
    from orchestrator.service import OrchestratorConfig
    from orchestrator.k_policy import Speculation
    from specdec.rpc.server import ServerConfig

    async def start() -> LookupStack:
        target_server, _ = await stack_module.start_target(tiny_pair.target_dir, draft_head=str(head_dir))
        draft_server, draft_service = await stack_module.start_draft(tiny_pair.draft_dir)
        config = OrchestratorConfig(draft=f"127.0.0.1:{draft_server.port}", target=f"127.0.0.1:{target_server.port}",
                                    num_speculative_tokens=3, pool=PoolConfig(refresh_seconds=0.5),
                                    startup_timeout_seconds=30)
        orchestrator_server, service = await orchestrator.server.start(config, ServerConfig(port=0))
        return LookupStack([target_server, draft_server, orchestrator_server], service, draft_service)

    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, reference_target.config.vocab_size, (7,), generator=generator).tolist()
               for _ in range(8)]
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            output = reference_target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            expected.append(output[0, len(prompt):].tolist())
    running = loop_thread.run(start())

    async def all_at_once(mode: str):
        return await asyncio.gather(*(_generate(running.service, prompt, speculation=Speculation(mode=mode),
                                                max_new_tokens=24) for prompt in prompts))

    try:
        adaptive = loop_thread.run(all_at_once("adaptive"))
        off = loop_thread.run(all_at_once("off"))
    finally:
        loop_thread.run(running.stop())
    for (tokens, _), (plain, _), reference in zip(adaptive, off, expected):
        assert tokens == reference and plain == reference
    passes = sum(stats.decode_head_passes for _, stats in adaptive)
    drafts = sum(stats.decode_head_drafts for _, stats in adaptive)
    accepted = sum(stats.decode_head_accepted for _, stats in adaptive)
    assert passes > 0 and 0 < accepted <= drafts, (passes, drafts, accepted)
    assert all(stats.decode_head_passes == 0 for _, stats in off)


def test_sampled_probes_run_beside_stretches_whose_passes_verify_the_heads_drafts(loop_thread, tiny_pair, head_dir):
    """An adaptive sampled request against a far draft settles at K = 0 and decodes in stretches
    whose passes verify the target's head's drafts. Each of their tokens still comes with its p(y)
    (accepted drafts and the token after them too), so the probes still run beside the stretches
    and measure the far draft, instead of interrupting them as rounds."""
    from orchestrator.k_policy import Speculation
    from tests.service.test_lookup_drafts import start_lookup_stack
    from tests.service.test_plain_stretches import PROMPT

    running = loop_thread.run(start_lookup_stack(tiny_pair.target_dir, tiny_pair.far_draft_dir, "model",
                                                 draft_head=str(head_dir)))
    try:
        runs = [loop_thread.run(_generate(running.service, PROMPT, SamplingParams(temperature=0.3, seed=seed),
                                          speculation=Speculation(mode="adaptive"), max_new_tokens=160))
                for seed in range(4)]
    finally:
        loop_thread.run(running.stop())
    assert all(len(tokens) == stats.generated_tokens for tokens, stats in runs)
    decoded = sum(stats.decoded_tokens for _, stats in runs)
    assert decoded >= 96, decoded
    assert sum(stats.decode_head_accepted for _, stats in runs) > 0
    assert sum(stats.shadow_probes for _, stats in runs) >= 2, [stats.shadow_probes for _, stats in runs]
