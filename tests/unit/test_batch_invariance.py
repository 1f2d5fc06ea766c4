"""Batch-invariant passes (specdec.ragged, specdec.attention, specdec.packed_linear): in bfloat16
with oneDNN's packing, every row of a pass gets exactly the logits a one-token step alone would
give, whatever else shares the pass and however a prompt was chunked. Checked bit for bit on a
model with the default target's layer shapes (SmolLM2-135M: 576 wide, 1536 in the MLP, 9 query
and 3 key/value heads of 64, a 49,152-token head), randomly initialised, three layers."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec import attention
from specdec.kv_cache import SequenceCache
from specdec.packed_linear import ANY_ROWS, ROW_BLOCK, native_bfloat16, onednn_available, pack_linears
from specdec.ragged import (
    PREFILL_BLOCK,
    ROW_KEY_BLOCK,
    Feed,
    attention_calls,
    batch_invariant,
    forward,
    mark_batch_invariant,
)
from specdec.worker import _chunk

needs_native_bfloat16 = pytest.mark.skipif(
    not (native_bfloat16() and onednn_available("cpu", torch.bfloat16)),
    reason="batch-invariant passes need a CPU with native bfloat16 and a torch built with oneDNN")

VOCAB = 49152


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=3,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.requires_grad_(False)
    attention.use_ragged(model)
    return model


@pytest.fixture(scope="module")
def invariant_model(model) -> LlamaForCausalLM:
    if not (native_bfloat16() and onednn_available("cpu", torch.bfloat16)):
        pytest.skip("batch-invariant passes need a CPU with native bfloat16 and oneDNN")
    pack_linears(model, ANY_ROWS)
    assert mark_batch_invariant(model)
    return model


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(count)]


def _steps(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits of each of `tokens` fed one at a time after the prompt, (len(tokens), V)."""
    cache = SequenceCache(model)
    forward(model, [Feed(cache, prompt)])
    return torch.cat([forward(model, [Feed(cache, [token])])[0] for token in tokens])


def _verify(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits of `tokens` fed in one pass after the prompt, every row kept (a Verify)."""
    cache = SequenceCache(model)
    forward(model, [Feed(cache, prompt)])
    return forward(model, [Feed(cache, tokens, keep_all=True)])[0]


def test_attention_calls_group_scored_rows_by_key_block_and_split_prompts_at_block_positions():
    key_block, block = ROW_KEY_BLOCK, PREFILL_BLOCK
    # a lone row (a decoding step): its keys padded to the end of its block
    assert attention_calls(cached=10, new=1, scored=False) == ((0, 1, key_block),)
    assert attention_calls(cached=key_block, new=1, scored=True) == ((0, 1, 2 * key_block),)
    # a verify's rows: one call per block they fall in, or one per row where rows must run alone
    assert attention_calls(cached=10, new=3, scored=True) == ((0, 3, key_block),)
    assert attention_calls(cached=key_block - 2, new=5, scored=True) == (
        (0, 2, key_block), (2, 5, 2 * key_block))
    assert attention_calls(cached=10, new=3, scored=True, together=False) == (
        (0, 1, key_block), (1, 2, key_block), (2, 3, key_block))
    # a prompt: a call per block of positions, causal (keys 0); a lone row as a step's
    assert attention_calls(cached=0, new=block, scored=False) == ((0, block, 0),)
    assert attention_calls(cached=0, new=2 * block + 3, scored=False) == (
        (0, block, 0), (block, 2 * block, 0), (2 * block, 2 * block + 3, 0))
    assert attention_calls(cached=0, new=block + 1, scored=False) == (
        (0, block, 0), (block, block + 1, (block // key_block + 1) * key_block))
    # a feed that starts inside a block: its first call ends where that block does
    assert attention_calls(cached=block - 2, new=5, scored=False) == ((0, 2, 0), (2, 5, 0))


@needs_native_bfloat16
def test_where_rows_must_attend_alone_a_verify_pass_still_scores_every_row_as_a_step(invariant_model):
    """The fallback of a CPU whose products round a row differently beside others
    (row_attention_invariant false at load): each block row in a call of its own, the same bits."""
    rng = random.Random(6)
    together = getattr(invariant_model, "_specdec_rows_together")
    try:
        setattr(invariant_model, "_specdec_rows_together", False)
        for prompt_length, rows in ((14, 5), (70, 9)):
            prompt, fed = _tokens(rng, prompt_length), _tokens(rng, rows)
            assert torch.equal(_verify(invariant_model, prompt, fed), _steps(invariant_model, prompt, fed))
    finally:
        setattr(invariant_model, "_specdec_rows_together", together)


def test_prompt_chunks_end_on_block_positions_whatever_the_budget():
    block = PREFILL_BLOCK
    assert _chunk(position=0, size=40, tokens=100) == 40  # it fits: all of it
    assert _chunk(position=0, size=150, tokens=2 * block + 5) == 2 * block
    assert _chunk(position=3, size=150, tokens=5) == block - 3  # up to the next block position
    assert _chunk(position=block, size=150, tokens=0) == block  # the decode rows took the budget
    assert _chunk(position=0, size=10, tokens=0) == 10
    for position in range(0, 3 * block, 5):
        for tokens in (-4, 0, 7, block, 3 * block + 1):
            take = _chunk(position, 1000, tokens)
            assert take > 0 and (position + take) % block == 0


@needs_native_bfloat16
def test_a_verify_pass_scores_every_row_as_a_one_token_step_bit_for_bit(invariant_model):
    rng = random.Random(1)
    for prompt_length, rows in ((5, 2), (40, 4), (37, 8), (100, 17), (64, ROW_BLOCK + 3)):
        prompt, fed = _tokens(rng, prompt_length), _tokens(rng, rows)
        assert torch.equal(_verify(invariant_model, prompt, fed), _steps(invariant_model, prompt, fed))


@needs_native_bfloat16
def test_rows_do_not_depend_on_the_rest_of_the_pass(invariant_model):
    """Eight sessions' verify rows and decode steps, with a long prompt chunk alongside (over
    ROW_BLOCK rows in all), give each session's rows exactly its logits alone."""
    rng = random.Random(2)
    prompts = [_tokens(rng, rng.randrange(3, 90)) for _ in range(8)]
    fed = [_tokens(rng, rng.choice((1, 1, 3, 5))) for _ in prompts]
    alone = [_verify(invariant_model, p, f) for p, f in zip(prompts, fed)]
    caches = [SequenceCache(invariant_model) for _ in prompts]
    for cache, prompt in zip(caches, prompts):
        forward(invariant_model, [Feed(cache, prompt)])
    other = SequenceCache(invariant_model)
    feeds = [Feed(c, f, keep_all=True) for c, f in zip(caches, fed)]
    feeds.append(Feed(other, _tokens(rng, 3 * PREFILL_BLOCK)))
    together = forward(invariant_model, feeds)
    assert sum(len(f) for f in fed) + 3 * PREFILL_BLOCK > ROW_BLOCK
    for expected, got in zip(alone, together):
        assert torch.equal(got, expected)


@needs_native_bfloat16
def test_a_prompt_fed_in_block_chunks_leaves_the_cache_and_logits_of_a_whole_prompt(invariant_model):
    rng = random.Random(3)
    prompt = _tokens(rng, 5 * PREFILL_BLOCK + 7)
    tokens = _tokens(rng, 3)
    whole = SequenceCache(invariant_model)
    forward(invariant_model, [Feed(whole, prompt)])
    chunked = SequenceCache(invariant_model)
    position = 0
    for budget in (PREFILL_BLOCK + 3, 0, 2 * PREFILL_BLOCK, 1000):  # as the worker cuts under load
        take = _chunk(position, len(prompt) - position, budget)
        forward(invariant_model, [Feed(chunked, prompt[position:position + take])])
        position += take
    assert position == len(prompt)
    for layer in range(invariant_model.config.num_hidden_layers):
        for kept, fed in zip(whole.layer(layer), chunked.layer(layer)):
            assert torch.equal(kept, fed)
    assert torch.equal(forward(invariant_model, [Feed(whole, tokens, keep_all=True)])[0],
                       forward(invariant_model, [Feed(chunked, tokens, keep_all=True)])[0])


@needs_native_bfloat16
def test_without_row_by_row_attention_a_verify_pass_rounds_differently(model, invariant_model):
    """The control: the same model with one attention call per session (what a pass that is not
    batch-invariant runs) scores some verify rows differently from one-token steps, so the tests
    above would see a pass that is not invariant."""
    rng = random.Random(4)
    differing = 0
    try:
        setattr(model, "_specdec_batch_invariant", False)
        assert not batch_invariant(model)
        for _ in range(6):
            prompt, fed = _tokens(rng, rng.randrange(20, 120)), _tokens(rng, 8)
            differing += int((_verify(model, prompt, fed) != _steps(model, prompt, fed)).any(dim=-1).sum())
    finally:
        mark_batch_invariant(model)
    assert differing > 0


@needs_native_bfloat16
def test_a_re_prefill_fed_one_by_one_rebuilds_the_cache_of_the_rounds_bit_for_bit(invariant_model):
    """What a resumed session gets (target_service.engine: the prompt as a prompt, the decoded
    tokens one by one): exactly the keys and values its prompt and rounds left, so the output
    after a lost replica is the uninterrupted one's."""
    rng = random.Random(5)
    prompt = _tokens(rng, 2 * PREFILL_BLOCK + 5)
    decoded = _tokens(rng, 3 * PREFILL_BLOCK + 2)
    rounds = SequenceCache(invariant_model)
    forward(invariant_model, [Feed(rounds, prompt)])
    position = 0
    for size in (1, 4, 1, 3, len(decoded)):  # one-token steps and verify rounds
        forward(invariant_model, [Feed(rounds, decoded[position:position + size], keep_all=True)])
        position += size
    resumed = SequenceCache(invariant_model)
    forward(invariant_model, [Feed(resumed, prompt)])
    forward(invariant_model, [Feed(resumed, decoded[:40], one_by_one=True),
                              Feed(SequenceCache(invariant_model), _tokens(rng, 20))])  # in a shared pass
    forward(invariant_model, [Feed(resumed, decoded[40:], one_by_one=True)])
    assert resumed.token_ids == rounds.token_ids
    for layer in range(invariant_model.config.num_hidden_layers):
        for kept, rebuilt in zip(rounds.layer(layer), resumed.layer(layer)):
            assert torch.equal(kept, rebuilt)
