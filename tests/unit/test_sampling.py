"""Exact cases for specdec.sampling on hand-built tensors: cases whose outcome is known exactly
need no statistics, so they come first; the laws are tested statistically in
test_sampling_statistical.py.

Modelled on vLLM's tests/v1/sample/test_rejection_sampler.py: small hand-made distributions whose
outcome is known exactly, plus seeded determinism. Where a law is checked without a statistical
test, the uniforms are a regular grid u_j = (j + 1/2) / N: inverse-CDF sampling then hits token t
exactly N * P(t) times up to one, so a frequency is an exact check, not an estimate.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec.sampling import (
    MAX_DRAFT_TOP_M,
    SamplingParams,
    draft_distribution,
    keyed_uniform,
    process_logits,
    sample_categorical,
    sample_sparse,
    sparse_to_dense,
    truncate_top_m,
    verify_greedy,
    verify_sampled,
    verify_sampled_one,
)

LARGEST_UNIFORM = 1.0 - 2.0**-53  # the largest float64 below 1, the largest keyed_uniform


@pytest.fixture(scope="module", autouse=True)
def _torch_single_thread_for_this_module():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def grid_uniforms(count: int) -> torch.Tensor:
    return (torch.arange(count, dtype=torch.float64) + 0.5) / count  # (count,)


def dist(*values: float) -> torch.Tensor:
    """A (V,) float64 distribution from (possibly unnormalised) non-negative values."""
    tensor = torch.tensor(values, dtype=torch.float64)
    return tensor / tensor.sum()


def assert_grid_law(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    """tokens (N,) drawn with grid_uniforms(N) follow expected (V,) exactly, up to one per token."""
    counts = torch.bincount(tokens, minlength=expected.numel()).to(torch.float64)
    assert torch.all((counts - tokens.numel() * expected / expected.sum()).abs() <= 1.0), counts


# ----------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": math.nan},
        {"temperature": -0.5},
        {"temperature": math.inf},
        {"temperature": 1.0, "top_p": 0.0},
        {"temperature": 1.0, "top_p": 1.5},
        {"temperature": 1.0, "top_p": -0.1},
        {"temperature": 1.0, "top_p": math.nan},
        {"temperature": 1.0, "top_k": -1},
        {"seed": -1},
        {"seed": 2**64},
    ],
)
def test_sampling_params_rejects_invalid_values(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_boundaries_and_zero_temperature_is_greedy():
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=2**64 - 1).greedy
    assert not SamplingParams(temperature=1e-3, top_p=1e-9, top_k=1).greedy


# ----------------------------------------------------------------------------- process_logits


def transformers_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The reference: the warpers ``generate(do_sample=True)`` would add, then softmax."""
    processors = LogitsProcessorList()
    if params.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k != 0:
        processors.append(TopKLogitsWarper(top_k=params.top_k))
    if params.top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p=params.top_p))
    input_ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)  # these warpers ignore it
    return processors(input_ids, logits.clone()).softmax(-1)


def random_logits(
    generator: torch.Generator, rows: int, vocab_size: int, ties: bool
) -> torch.Tensor:
    if ties:  # few distinct values: ties at the top-k boundary and inside the top-p nucleus
        return torch.randint(-2, 3, (rows, vocab_size), generator=generator).to(torch.float64)
    return 3 * torch.randn(rows, vocab_size, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("vocab_size", [1, 2, 6, 33])
def test_process_logits_matches_transformers_warpers(vocab_size, ties):
    generator = torch.Generator().manual_seed(1000 * vocab_size + ties)
    logits = random_logits(generator, 64, vocab_size, ties)  # (64, V)
    checked = 0
    for temperature in [0.25, 0.7, 1.0, 1.3, 4.0]:
        for top_k in sorted({0, 1, 2, 5, vocab_size, vocab_size + 3}):
            for top_p in [0.05, 0.3, 0.8, 0.95, 1.0]:
                params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
                ours = process_logits(logits, params)
                reference = transformers_probs(logits, params)
                assert ours.dtype == torch.float64
                assert torch.equal(ours > 0, reference > 0), params
                torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-15, msg=str(params))
                checked += 1
    assert checked >= 5 * 5 * 4


def test_process_logits_tie_at_top_k_boundary_keeps_all_tied():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    probs = process_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs[0] > 0).tolist() == [True, False, True, True, False]  # as TopKLogitsWarper


def test_process_logits_top_p_keeps_smallest_set_above_top_p_and_at_least_one():
    logits = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64).log()

    def kept(top_p: float) -> list[bool]:
        probs = process_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))
        return (probs[0] > 0).tolist()

    assert kept(0.6) == [True, True, False]  # 0.5 alone is not enough for 0.6
    assert kept(0.9) == [True, True, True]
    assert kept(1e-6) == [True, False, False]


def test_process_logits_any_batch_shape_and_input_dtype():
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 3, 11, generator=generator)  # float32, (2, 3, V)
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    probs = process_logits(logits, params)
    assert probs.shape == (2, 3, 11) and probs.dtype == torch.float64
    flat = transformers_probs(logits.reshape(6, 11).to(torch.float64), params)
    torch.testing.assert_close(probs.reshape(6, 11), flat, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3, dtype=torch.float64))


def test_greedy_process_is_one_hot_argmax_with_first_index_on_ties():
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [5.0, 5.0, 5.0, 5.0], [-3.0, -2.0, -9.0, -2.5]])
    expected = torch.tensor([[0, 1, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0]], dtype=torch.float64)
    assert torch.equal(process_logits(logits, SamplingParams()), expected)
    # top-k / top-p do not change greedy
    assert torch.equal(process_logits(logits, SamplingParams(top_k=1, top_p=0.1)), expected)


# ----------------------------------------------------------------------------- truncate / dense


@pytest.mark.parametrize("top_m", [1, 2, 4, 7, 10, MAX_DRAFT_TOP_M])
def test_truncate_top_m_keeps_the_largest_and_sums_to_one_in_float32(top_m):
    generator = torch.Generator().manual_seed(top_m)
    for ties in [False, True]:
        for _ in range(20):
            logits = random_logits(generator, 1, 10, ties)[0]
            probs = process_logits(logits, SamplingParams(temperature=1.0, top_k=8))  # some zeros
            token_ids, values = truncate_top_m(probs, top_m)
            assert token_ids.dtype == torch.int64 and values.dtype == torch.float32
            assert token_ids.numel() == values.numel() <= min(top_m, int((probs > 0).sum()))
            assert token_ids.unique().numel() == token_ids.numel()
            assert torch.all(values > 0)
            assert abs(float(values.sum()) - 1.0) <= values.numel() * 2.0**-24  # float32 sum
            dropped = torch.ones(10, dtype=torch.bool)
            dropped[token_ids] = False
            if dropped.any():  # every kept id is at least as likely as every dropped one
                assert float(probs[token_ids].min()) >= float(probs[dropped].max())
            # renormalised in proportion to the original probabilities
            kept = probs[token_ids]
            renormalised = kept / kept.sum()
            torch.testing.assert_close(values.to(torch.float64), renormalised, rtol=1e-6, atol=0)


def test_truncate_top_m_drops_zero_entries():
    token_ids, values = truncate_top_m(dist(0, 3, 0, 1, 0), 4)
    assert token_ids.tolist() == [1, 3]
    assert values.tolist() == [0.75, 0.25]


@pytest.mark.parametrize("top_m", [0, -1, MAX_DRAFT_TOP_M + 1])
def test_truncate_top_m_rejects_out_of_range(top_m):
    with pytest.raises(ValueError):
        truncate_top_m(dist(1, 2, 3), top_m)


def test_sparse_to_dense_places_values_and_renormalises_in_float64():
    token_ids = torch.tensor([4, 0, 2])
    values = torch.tensor([0.5, 0.3, 0.2000001], dtype=torch.float32)  # float32 sum != 1
    dense = sparse_to_dense(token_ids, values, 6)
    assert dense.dtype == torch.float64 and dense.shape == (6,)
    assert dense[[1, 3, 5]].tolist() == [0.0, 0.0, 0.0]
    expected = values.to(torch.float64) / values.to(torch.float64).sum()
    assert torch.equal(dense[token_ids], expected)
    assert float(dense.sum()) == pytest.approx(1.0, abs=1e-15)


def test_truncate_then_dense_with_full_support_is_the_distribution_up_to_float32():
    logits = torch.randn(12, generator=torch.Generator().manual_seed(3))
    probs = process_logits(logits, SamplingParams(temperature=1.0))
    dense = sparse_to_dense(*truncate_top_m(probs, 12), 12)
    torch.testing.assert_close(dense, probs, rtol=4e-7, atol=0)


# ----------------------------------------------------------------------------- draft_distribution


def _restricted(generator: torch.Generator, logits: torch.Tensor, kept_share: float) -> torch.Tensor:
    """A restricted draft head's logits: -inf outside a random share of the ids (the first kept)."""
    outside = torch.rand(logits.shape[-1], generator=generator) > kept_share
    outside[0] = False
    return logits.masked_fill(outside, -math.inf)


@pytest.mark.parametrize("vocab_size", [1, 2, 9, 70, 300])
def test_draft_distribution_is_truncate_top_m_of_process_logits(vocab_size):
    """The draft's wire distribution from the top-M logits equals the composition over the whole
    vocabulary: the same ids in the same order and the same float32 values up to rounding, for
    every temperature, top-k and top-p, with and without -inf logits and with ties (handed to the
    composition)."""
    generator = torch.Generator().manual_seed(vocab_size)
    checked = 0
    for case in range(6):
        ties = case == 5
        logits = random_logits(generator, 1, vocab_size, ties)[0].to(torch.float32)
        if case in (3, 4):
            logits = _restricted(generator, logits, kept_share=0.3)
        for temperature in [0.25, 0.7, 1.3]:
            for top_k in sorted({0, 1, 3, 65, vocab_size}):
                for top_p in [0.05, 0.5, 0.9, 1.0]:
                    for top_m in [1, 7, MAX_DRAFT_TOP_M]:
                        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
                        want_ids, want = truncate_top_m(process_logits(logits, params), top_m)
                        got_ids, got = draft_distribution(logits, params, top_m)
                        assert got_ids.dtype == torch.int64 and got.dtype == torch.float32
                        assert torch.equal(got_ids, want_ids), (params, top_m)
                        torch.testing.assert_close(got, want, rtol=2e-7, atol=0, msg=str(params))
                        checked += 1
    assert checked >= 6 * 3 * 2 * 4 * 3


def test_draft_distribution_greedy_and_bounds():
    logits = torch.tensor([0.5, 2.0, -1.0, 2.5])
    ids, probs = draft_distribution(logits, SamplingParams(), 4)
    assert ids.tolist() == [3] and probs.tolist() == [1.0]
    for top_m in [0, MAX_DRAFT_TOP_M + 1]:
        with pytest.raises(ValueError):
            draft_distribution(logits, SamplingParams(temperature=1.0), top_m)


def test_sample_sparse_draws_what_the_dense_reading_draws():
    """The same token as sample_categorical over sparse_to_dense for every uniform of a grid and
    at both ends, so the draft samples from exactly the q~ the target reads."""
    generator = torch.Generator().manual_seed(11)
    for vocab_size in [3, 50, 1000]:
        for _ in range(10):
            logits = 2 * torch.randn(vocab_size, generator=generator)
            ids, probs = draft_distribution(logits, SamplingParams(temperature=0.8), MAX_DRAFT_TOP_M)
            dense = sparse_to_dense(ids, probs, vocab_size)
            uniforms = torch.cat([grid_uniforms(257), torch.tensor([0.0, LARGEST_UNIFORM], dtype=torch.float64)])
            want = sample_categorical(dense.expand(len(uniforms), -1), uniforms).tolist()
            assert [sample_sparse(ids, probs, float(u)) for u in uniforms] == want


# ----------------------------------------------------------------------------- sample_categorical


def test_sample_categorical_inverse_cdf_law_and_zero_entries_never_chosen():
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0], dtype=torch.float64)
    grid = grid_uniforms(1000)
    tokens = sample_categorical(probs.expand(1000, -1), grid)
    assert_grid_law(tokens, probs)
    extremes = torch.tensor([0.0, LARGEST_UNIFORM], dtype=torch.float64)
    assert sample_categorical(probs.expand(2, -1), extremes).tolist() == [1, 4]


def test_sample_categorical_accepts_unnormalised_rows():
    probs = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 2.0]], dtype=torch.float64)
    assert sample_categorical(probs, torch.tensor([0.74, 0.49])).tolist() == [1, 0]
    assert sample_categorical(probs, torch.tensor([0.76, 0.51])).tolist() == [2, 2]
    assert sample_categorical(probs * 1.5, torch.tensor([LARGEST_UNIFORM] * 2)).tolist() == [2, 2]


# ----------------------------------------------------------------------------- greedy verification


def logits_with_argmax(*choices: int, vocab_size: int = 5) -> torch.Tensor:
    """(len(choices), V) logits whose row i has its argmax at choices[i]."""
    logits = torch.zeros(len(choices), vocab_size)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 1.0
    return logits


def test_greedy_all_accepted_emits_bonus_from_row_k():
    outcome = verify_greedy(logits_with_argmax(3, 1, 4, 2), torch.tensor([3, 1, 4]))
    assert outcome.num_accepted == 3
    assert outcome.next_token_id == 2
    assert outcome.acceptance_signal == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("mismatch", [0, 1, 2])
def test_greedy_first_mismatch_emits_target_argmax_at_that_row(mismatch):
    target_choices = [3, 1, 4, 2]
    draft = [3, 1, 4]
    draft[mismatch] = 0
    outcome = verify_greedy(logits_with_argmax(*target_choices), torch.tensor(draft))
    assert outcome.num_accepted == mismatch
    assert outcome.next_token_id == target_choices[mismatch]
    assert outcome.acceptance_signal[mismatch] == 0.0


def test_greedy_tokens_after_a_mismatch_do_not_count():
    outcome = verify_greedy(logits_with_argmax(3, 1, 4, 2), torch.tensor([0, 1, 4]))
    assert (outcome.num_accepted, outcome.next_token_id) == (0, 3)
    assert outcome.acceptance_signal == (0.0, 1.0, 1.0)


def test_greedy_with_no_draft_is_plain_argmax():
    outcome = verify_greedy(logits_with_argmax(4), torch.empty(0, dtype=torch.long))
    assert (outcome.num_accepted, outcome.next_token_id, outcome.acceptance_signal) == (0, 4, ())


def test_greedy_verification_agrees_with_greedy_process_on_ties():
    target_logits = torch.tensor([[1.0, 7.0, 7.0], [2.0, 2.0, 0.0]])
    one_hot = process_logits(target_logits, SamplingParams())
    outcome = verify_greedy(target_logits, torch.tensor([1]))
    assert outcome.num_accepted == 1 and one_hot[0, 1] == 1.0
    assert outcome.next_token_id == 0 == int(one_hot[1].argmax())
    assert verify_greedy(target_logits, torch.tensor([2])).num_accepted == 0


# ----------------------------------------------------------------------------- sampled verification


def test_draft_token_at_least_as_likely_under_target_is_always_accepted():
    generator = torch.Generator().manual_seed(11)
    batch, num_draft, vocab = 256, 3, 8
    target_probs = torch.rand(batch, num_draft + 1, vocab, generator=generator, dtype=torch.float64)
    target_probs /= target_probs.sum(-1, keepdim=True)
    draft_probs = torch.rand(batch, num_draft, vocab, generator=generator, dtype=torch.float64) ** 3
    draft_probs /= draft_probs.sum(-1, keepdim=True)
    # p - q~ is >= 0 at its argmax, since both rows sum to 1
    draft_token_ids = (target_probs[:, :-1] - draft_probs).argmax(-1)  # (B, K)
    final_uniforms = torch.rand(batch, generator=generator, dtype=torch.float64)
    for uniform in [0.0, 0.5, 1.0 - 2.0**-24, LARGEST_UNIFORM]:
        accept_uniforms = torch.full((batch, num_draft), uniform, dtype=torch.float64)
        num_accepted, _, _ = verify_sampled(
            target_probs, draft_token_ids, draft_probs, accept_uniforms, final_uniforms
        )
        assert torch.all(num_accepted == num_draft)


def test_draft_token_with_equal_target_and_draft_prob_is_always_accepted():
    probs = dist(1, 2, 3, 4)
    accept_uniforms = torch.full((2,), LARGEST_UNIFORM, dtype=torch.float64)
    outcome = verify_sampled_one(
        probs.expand(3, -1), torch.tensor([0, 3]), probs.expand(2, -1), accept_uniforms, 0.5
    )
    assert outcome.num_accepted == 2


@pytest.mark.parametrize("position", [0, 1, 2])
def test_draft_token_impossible_under_target_is_never_accepted(position):
    target_probs = dist(0.5, 0.5, 0, 0).expand(4, -1).clone()  # tokens 2, 3 impossible
    draft_probs = dist(1, 1, 1, 1).expand(3, -1)
    draft = [0, 1, 0]
    draft[position] = 2
    for uniform in [0.0, 1e-300, 0.5]:
        accept_uniforms = torch.full((3,), uniform, dtype=torch.float64)
        outcome = verify_sampled_one(
            target_probs, torch.tensor(draft), draft_probs, accept_uniforms, 0.5
        )
        assert outcome.num_accepted == position
        assert outcome.next_token_id in (0, 1)


def test_acceptance_probability_is_min_one_target_over_draft():
    target_probs = dist(0.1, 0.6, 0.3).expand(2, -1)
    draft_probs = dist(0.4, 0.2, 0.4).expand(1, -1)
    count = 10_000
    grid = grid_uniforms(count)
    for token, expected in [(0, 0.25), (1, 1.0), (2, 0.75)]:
        num_accepted, _, _ = verify_sampled(
            target_probs.expand(count, -1, -1),
            torch.full((count, 1), token),
            draft_probs.expand(count, -1, -1),
            grid.unsqueeze(-1),
            grid,
        )
        assert abs(float(num_accepted.double().mean()) - expected) <= 1 / count


def rejected_at_first_position(target_row: torch.Tensor, draft_row: torch.Tensor, draft_token: int):
    """Correction tokens (N,) for grid final uniforms, with d_1 forced to be rejected."""
    count = 10_000
    vocab = target_row.numel()
    target_probs = torch.stack([target_row, dist(*[1.0] * vocab)]).expand(count, -1, -1)
    num_accepted, next_token_ids, _ = verify_sampled(
        target_probs,
        torch.full((count, 1), draft_token),
        draft_row.expand(count, 1, -1),
        torch.full((count, 1), LARGEST_UNIFORM, dtype=torch.float64),  # rejects unless p >= q~
        grid_uniforms(count),
    )
    assert torch.all(num_accepted == 0)
    return next_token_ids


def test_residual_is_norm_of_positive_part_over_the_full_vocabulary():
    # q~ was truncated to {0, 1, 2}; tokens 4 and 5 lie outside its support and must be reachable.
    target_row = dist(0.1, 0.3, 0.1, 0.2, 0.2, 0.1)
    draft_row = dist(0.6, 0.2, 0.2, 0.0, 0.0, 0.0)
    tokens = rejected_at_first_position(target_row, draft_row, draft_token=0)
    residual = (target_row - draft_row).clamp(min=0)  # (0, 0.1, 0, 0.2, 0.2, 0.1)
    assert_grid_law(tokens, residual)
    assert set(tokens.tolist()) == {1, 3, 4, 5}


def test_residual_never_picks_a_token_where_target_is_not_above_draft():
    generator = torch.Generator().manual_seed(5)
    for _ in range(50):
        target_row = torch.rand(7, generator=generator, dtype=torch.float64) ** 2
        target_row[torch.randint(7, (2,), generator=generator)] = 0.0
        target_row /= target_row.sum()
        draft_row = torch.rand(7, generator=generator, dtype=torch.float64) ** 2
        draft_row[3] += 0.5  # token 3 is a likely draft token with p < q~, so it can be rejected
        draft_row /= draft_row.sum()
        if target_row[3] >= draft_row[3]:
            continue
        tokens = rejected_at_first_position(target_row, draft_row, draft_token=3)
        assert torch.all(target_row[tokens] > draft_row[tokens])
        assert_grid_law(tokens, (target_row - draft_row).clamp(min=0))


def test_empty_residual_falls_back_to_target():
    # q~ exceeds p on d by a rounding-sized amount: d can be rejected but p - q~ has no mass.
    target_row = dist(0.5, 0.5)
    draft_row = torch.tensor([0.5 + 1e-13, 0.5], dtype=torch.float64)
    tokens = rejected_at_first_position(target_row, draft_row, draft_token=0)
    assert_grid_law(tokens, target_row)


def test_first_rejection_ends_the_round_and_later_draft_tokens_do_not_count():
    # d_1 = 2 is impossible under p_1; d_2 and d_3 would be accepted.
    target_probs = torch.stack(
        [dist(1, 0, 0, 3), dist(0, 1, 0, 0), dist(0, 0, 1, 0), dist(0, 0, 0, 1)]
    )
    draft_probs = torch.stack([dist(0, 0, 1, 0), dist(0, 1, 0, 0), dist(0, 0, 1, 0)])
    count = 1000
    num_accepted, next_token_ids, signal = verify_sampled(
        target_probs.expand(count, -1, -1),
        torch.tensor([2, 1, 2]).expand(count, -1),
        draft_probs.expand(count, -1, -1),
        torch.rand(count, 3, dtype=torch.float64),
        grid_uniforms(count),
    )
    assert torch.all(num_accepted == 0)
    assert_grid_law(next_token_ids, dist(1, 0, 0, 3))  # residual of row 0 = p_0 where q~_0 = 0
    torch.testing.assert_close(signal[0], torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64))


def test_all_accepted_samples_the_bonus_from_row_k():
    rows = [dist(1, 1, 1, 1, 1), dist(0, 2, 1, 1, 0), dist(3, 0, 0, 0, 1)]
    bonus = dist(0, 0, 1, 0, 4)
    target_probs = torch.stack(rows + [bonus])  # (K + 1, V), K = 3
    count = 1000
    num_accepted, next_token_ids, _ = verify_sampled(
        target_probs.expand(count, -1, -1),
        torch.tensor([0, 1, 4]).expand(count, -1),
        torch.stack(rows).expand(count, -1, -1),  # q~ = p: every draft token passes
        torch.full((count, 3), LARGEST_UNIFORM, dtype=torch.float64),
        grid_uniforms(count),
    )
    assert torch.all(num_accepted == 3)
    assert_grid_law(next_token_ids, bonus)


def test_no_draft_tokens_means_sampling_from_the_target():
    target_row = dist(0.1, 0.0, 0.4, 0.25, 0.25)
    count = 1000
    num_accepted, next_token_ids, signal = verify_sampled(
        target_row.expand(count, 1, -1),
        torch.empty(count, 0, dtype=torch.long),
        torch.empty(count, 0, 5, dtype=torch.float64),
        torch.empty(count, 0, dtype=torch.float64),
        grid_uniforms(count),
    )
    assert torch.all(num_accepted == 0)
    assert signal.shape == (count, 0)
    assert_grid_law(next_token_ids, target_row)
    outcome = verify_sampled_one(
        target_row.unsqueeze(0),  # (K + 1, V) with K = 0
        torch.empty(0, dtype=torch.long),
        torch.empty(0, 5, dtype=torch.float64),
        torch.empty(0, dtype=torch.float64),
        0.05,
    )
    assert (outcome.num_accepted, outcome.next_token_id, outcome.acceptance_signal) == (0, 0, ())


def test_acceptance_signal_is_one_minus_total_variation():
    target_probs = torch.stack([dist(0.5, 0.5, 0.0), dist(0.2, 0.3, 0.5), dist(1, 1, 1)])
    draft_probs = torch.stack([dist(0.0, 0.5, 0.5), dist(0.2, 0.3, 0.5)])
    accept_uniforms = torch.zeros(2, dtype=torch.float64)
    draft_token_ids = torch.tensor([1, 2])
    outcome = verify_sampled_one(target_probs, draft_token_ids, draft_probs, accept_uniforms, 0.5)
    assert outcome.acceptance_signal == pytest.approx((0.5, 1.0), abs=1e-15)


# ----------------------------------------------------------------------------- determinism


def random_round(generator: torch.Generator, batch: int, num_draft: int, vocab: int):
    target_probs = torch.rand(batch, num_draft + 1, vocab, generator=generator, dtype=torch.float64)
    target_probs /= target_probs.sum(-1, keepdim=True)
    draft_probs = torch.rand(batch, num_draft, vocab, generator=generator, dtype=torch.float64) ** 4
    draft_probs /= draft_probs.sum(-1, keepdim=True)
    draft_uniforms = torch.rand(batch * num_draft, generator=generator, dtype=torch.float64)
    draft_token_ids = sample_categorical(draft_probs.reshape(-1, vocab), draft_uniforms)
    draft_token_ids = draft_token_ids.reshape(batch, num_draft)
    return target_probs, draft_token_ids, draft_probs


def keyed_uniforms(seed: int, batch: int, num_draft: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The uniforms a caller derives for a round; row b stands for positions 100 b + i."""
    accept = [
        [keyed_uniform(seed, 100 * b + i, "accept") for i in range(num_draft)] for b in range(batch)
    ]
    final = [keyed_uniform(seed, 100 * b + num_draft, "target") for b in range(batch)]
    return torch.tensor(accept, dtype=torch.float64), torch.tensor(final, dtype=torch.float64)


def test_verify_sampled_is_a_function_of_its_uniforms():
    round_ = random_round(torch.Generator().manual_seed(21), batch=64, num_draft=4, vocab=6)
    first = verify_sampled(*round_, *keyed_uniforms(seed=9, batch=64, num_draft=4))
    torch.rand(1000)  # global RNG state must not matter
    second = verify_sampled(*round_, *keyed_uniforms(seed=9, batch=64, num_draft=4))
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    other = verify_sampled(*round_, *keyed_uniforms(seed=10, batch=64, num_draft=4))
    assert not (torch.equal(first[0], other[0]) and torch.equal(first[1], other[1]))


def test_verify_sampled_one_equals_the_batched_row():
    round_ = random_round(torch.Generator().manual_seed(22), batch=16, num_draft=3, vocab=6)
    target_probs, draft_token_ids, draft_probs = round_
    accept, final = keyed_uniforms(seed=3, batch=16, num_draft=3)
    num_accepted, next_token_ids, signal = verify_sampled(*round_, accept, final)
    assert 0 < int(num_accepted.sum()) < 16 * 3  # both outcomes occur in this batch
    for b in range(16):
        outcome = verify_sampled_one(
            target_probs[b], draft_token_ids[b], draft_probs[b], accept[b], float(final[b])
        )
        assert outcome.num_accepted == int(num_accepted[b])
        assert outcome.next_token_id == int(next_token_ids[b])
        assert outcome.acceptance_signal == tuple(signal[b].tolist())


def test_keyed_uniform_is_deterministic_in_range_and_pinned():
    # Pinned values: changing the derivation changes every seeded output, so it must be deliberate.
    assert keyed_uniform(0, 0, "draft") == 0.0323548183654947
    assert keyed_uniform(0, 0, "accept") == 0.5427062379150561
    assert keyed_uniform(12345, 7, "draft") == 0.025583562123913994
    assert keyed_uniform(2**64 - 1, 100, "target") == 0.7014247360968727
    assert keyed_uniform(42, 17, "accept") == keyed_uniform(42, 17, "accept")
    values = [keyed_uniform(seed, position, "draft") for seed in range(20) for position in range(9)]
    assert all(0.0 <= value < 1.0 for value in values)


def test_keyed_uniform_differs_across_seeds_positions_and_roles():
    roles = ("draft", "accept", "target")
    keys = [(seed, position, role) for seed in range(8) for position in range(64) for role in roles]
    keys += [(1, 12, "draft"), (11, 2, "draft"), (112, 0, "draft")]  # no concatenation aliasing
    values = [keyed_uniform(*key) for key in keys]
    assert len(set(values)) == len(set(keys))


def test_keyed_uniform_roles_and_positions_look_independent_and_uniform():
    count = 20_000
    draft, accept = (
        torch.tensor([keyed_uniform(7, position, role) for position in range(count)])
        for role in ("draft", "accept")
    )
    # 5-sigma bounds: mean sd = 1/sqrt(12 n) ~ 0.002, correlation sd = 1/sqrt(n) ~ 0.007
    for values in (draft, accept):
        assert abs(float(values.mean()) - 0.5) < 0.011
        assert abs(float(torch.corrcoef(torch.stack([values[:-1], values[1:]]))[0, 1])) < 0.036
        histogram = torch.histc(values, bins=10, min=0.0, max=1.0)
        assert float(histogram.min()) > count / 10 - 5 * math.sqrt(count / 10)
    assert abs(float(torch.corrcoef(torch.stack([draft, accept]))[0, 1])) < 0.036
