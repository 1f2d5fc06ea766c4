"""Statistical exactness of speculative sampling (the rule: docs/architecture.md, "The lossless
rule"; the exact hand-built cases are in test_sampling.py).

The speculative loop is simulated in-process, batched over NUM_SEQUENCES sequences: each round the
draft samples K tokens d_i from q~ = sparse_to_dense(truncate_top_m(process_logits(draft), M)),
the target verifies them with ``verify_sampled`` on process_logits(target), and rounds continue
until every sequence has committed three tokens. The joint law of those three tokens must be the
law of the target alone, enumerated with transformers' own logits processors, by a chi-square test
at a strict level with a fixed seed. The named wrong verifiers in ``sampling_variants`` must fail
the very same test, decisively, which is what shows the test can see the bugs it is meant to catch.

Models are tables: the prompt is fixed, so a model is a map from the generated prefix to logits.
Every prefix up to length 3 has its own random row; a longer prefix reuses the row of its first
three tokens (only tokens 4 and later depend on those rows, and the test looks at tokens 1-3).
"""

from __future__ import annotations

import math
from functools import lru_cache

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec.sampling import (
    SamplingParams,
    process_logits,
    sample_categorical,
    sparse_to_dense,
    truncate_top_m,
    verify_sampled,
)

from tests.unit import sampling_variants

VOCAB_SIZE = 7
NUM_TOKENS = 3  # the joint law of the first NUM_TOKENS committed tokens is tested: 7**3 = 343 cells
TABLE_DEPTH = 3  # prefixes up to this length have their own logits row
DRAFT_TOP_M = 4  # < VOCAB_SIZE, so the far draft's truncation matters
NUM_SEQUENCES = 200_000
ALPHA = 1e-4  # the correct code must pass at this level; the wrong variants must fail it
MIN_EXPECTED = 5.0  # cells expecting fewer samples are pooled into one
MIN_MARGIN_SD = 5.0  # how far past the critical value a wrong variant's statistic must land
SEED = 20240611

SAMPLING_CONFIGS = {
    "temperature_1": SamplingParams(temperature=1.0),
    "temperature_0.7_top_k_5": SamplingParams(temperature=0.7, top_k=5),
    "temperature_1.3_top_p_0.8": SamplingParams(temperature=1.3, top_p=0.8),
}

# Number of table rows per prefix length, and the id of the first prefix of each length.
_PREFIX_OFFSETS = [sum(VOCAB_SIZE**n for n in range(length)) for length in range(TABLE_DEPTH + 1)]
NUM_PREFIXES = _PREFIX_OFFSETS[-1] + VOCAB_SIZE**TABLE_DEPTH


@pytest.fixture(scope="module", autouse=True)
def _torch_single_thread_for_this_module():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ----------------------------------------------------------------------------- models as tables


def extend_prefix(
    prefix_ids: torch.Tensor, prefix_lengths: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Table row of prefix + token. All (B,) int64; a prefix is the base-V number of its tokens."""
    offsets = torch.tensor(_PREFIX_OFFSETS)
    grows = prefix_lengths < TABLE_DEPTH
    local = prefix_ids - offsets[prefix_lengths.clamp(max=TABLE_DEPTH)]
    longer = offsets[(prefix_lengths + 1).clamp(max=TABLE_DEPTH)] + local * VOCAB_SIZE + tokens
    return torch.where(grows, longer, prefix_ids), prefix_lengths + 1


@lru_cache(maxsize=None)
def logits_table(seed: int, scale: float) -> torch.Tensor:
    """(NUM_PREFIXES, V) float64 logits of a random 'model'."""
    generator = torch.Generator().manual_seed(seed)
    return scale * torch.randn(NUM_PREFIXES, VOCAB_SIZE, generator=generator, dtype=torch.float64)


def target_logits() -> torch.Tensor:
    return logits_table(seed=1, scale=2.0)


def far_draft_logits() -> torch.Tensor:
    return logits_table(seed=2, scale=1.0)  # independent and flatter: far, with a real tail


@lru_cache(maxsize=None)
def draft_tables(draft: str, config: str, top_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q~, q): what the draft samples from and its untruncated q, each (NUM_PREFIXES, V)."""
    logits = target_logits() if draft == "equal" else far_draft_logits()
    untruncated = process_logits(logits, SAMPLING_CONFIGS[config])  # (P, V)
    truncated = torch.stack(
        [sparse_to_dense(*truncate_top_m(row, top_m), VOCAB_SIZE) for row in untruncated]
    )
    return truncated, untruncated


@lru_cache(maxsize=None)
def reference_joint_law(config: str) -> torch.Tensor:
    """(V**3,) law of the first three tokens of the target alone, via transformers' processors.

    The processor list is built the way ``generate`` builds it for do_sample=True.
    """
    params = SAMPLING_CONFIGS[config]
    processors = LogitsProcessorList()
    if params.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k != 0:
        processors.append(TopKLogitsWarper(top_k=params.top_k))
    if params.top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p=params.top_p))
    dummy_input_ids = torch.zeros(NUM_PREFIXES, 1, dtype=torch.long)  # these warpers ignore it
    probs = processors(dummy_input_ids, target_logits().clone()).softmax(-1)  # (P, V)
    vocab = VOCAB_SIZE
    first = probs[0]  # (V,)
    second = probs[1 : 1 + vocab]  # (V, V): row t1
    third = probs[1 + vocab : 1 + vocab + vocab**2].reshape(vocab, vocab, vocab)  # (t1, t2, t3)
    joint = first[:, None, None] * second[:, :, None] * third
    return joint.reshape(-1)


# ----------------------------------------------------------------------------- the loop


def simulate(
    target_table: torch.Tensor,  # (P, V) processed target probabilities
    draft_sample_table: torch.Tensor,  # (P, V) q~ the draft samples from
    draft_sent_table: torch.Tensor,  # (P, V) what the verifier is handed (q~, unless a variant)
    num_draft: int,
    verify=verify_sampled,
    seed: int = SEED,
    num_sequences: int = NUM_SEQUENCES,
) -> tuple[torch.Tensor, int, int]:
    """Run rounds of K = num_draft until every sequence has NUM_TOKENS committed tokens.

    Returns (first NUM_TOKENS tokens (N, NUM_TOKENS) int64, draft tokens proposed, accepted).
    """
    generator = torch.Generator().manual_seed(seed)

    def uniforms(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=generator, dtype=torch.float64)

    tokens = torch.full((num_sequences, NUM_TOKENS), -1, dtype=torch.long)
    prefix_ids = torch.zeros(num_sequences, dtype=torch.long)
    prefix_lengths = torch.zeros(num_sequences, dtype=torch.long)
    active = torch.arange(num_sequences)
    proposed = accepted = 0
    while active.numel() > 0:
        count = active.numel()
        rows = torch.arange(count)
        step_ids, step_lengths = [prefix_ids[active]], [prefix_lengths[active]]
        drafted = []
        for _ in range(num_draft):
            draft_token = sample_categorical(draft_sample_table[step_ids[-1]], uniforms(count))
            drafted.append(draft_token)
            next_id, next_length = extend_prefix(step_ids[-1], step_lengths[-1], draft_token)
            step_ids.append(next_id)
            step_lengths.append(next_length)
        ids = torch.stack(step_ids, dim=1)  # (n, K + 1): prefix before each draft token, then all
        lengths = torch.stack(step_lengths, dim=1)  # (n, K + 1)
        draft_token_ids = (
            torch.stack(drafted, dim=1) if drafted else torch.empty(count, 0, dtype=torch.long)
        )  # (n, K)
        num_accepted, next_token_ids, _ = verify(
            target_table[ids],  # (n, K + 1, V)
            draft_token_ids,
            draft_sent_table[ids[:, :-1]],  # (n, K, V)
            uniforms(count, num_draft),
            uniforms(count),
        )
        proposed += count * num_draft
        accepted += int(num_accepted.sum())
        committed = torch.cat([draft_token_ids, torch.zeros(count, 1, dtype=torch.long)], dim=1)
        committed[rows, num_accepted] = next_token_ids  # (n, K + 1): accepted, then next token
        for offset in range(num_draft + 1):
            position = lengths[:, 0] + offset
            write = (offset <= num_accepted) & (position < NUM_TOKENS)
            tokens[active[write], position[write]] = committed[write, offset]
        new_ids, new_lengths = extend_prefix(
            ids[rows, num_accepted], lengths[rows, num_accepted], next_token_ids
        )
        prefix_ids[active], prefix_lengths[active] = new_ids, new_lengths
        active = active[new_lengths < NUM_TOKENS]
    return tokens, proposed, accepted


def joint_counts(tokens: torch.Tensor) -> torch.Tensor:
    """(N, 3) tokens -> (V**3,) counts, cell t1 * V**2 + t2 * V + t3 like reference_joint_law."""
    assert int(tokens.min()) >= 0, "a sequence ended with fewer than three tokens"
    cells = (tokens * torch.tensor([VOCAB_SIZE**2, VOCAB_SIZE, 1])).sum(-1)
    return torch.bincount(cells, minlength=VOCAB_SIZE**NUM_TOKENS)


# ----------------------------------------------------------------------------- chi-square


def chi_square_survival(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square(dof): the regularised upper incomplete gamma."""
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64),
            torch.tensor(statistic / 2, dtype=torch.float64),
        )
    )


def chi_square_critical(alpha: float, dof: int) -> float:
    """The statistic whose survival is alpha (bisection; survival decreases in the statistic)."""
    low, high = 0.0, float(dof)
    while chi_square_survival(high, dof) > alpha:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if chi_square_survival(middle, dof) > alpha else (low, middle)
    return high


class GoodnessOfFit:
    """Pearson's chi-square of observed counts against exact cell probabilities.

    Cells of probability 0 must be empty (any count there is an exact violation: p_value 0). Cells
    expecting fewer than MIN_EXPECTED samples are pooled into one cell.
    """

    def __init__(self, counts: torch.Tensor, probs: torch.Tensor):
        total = int(counts.sum())
        self.impossible = int(counts[probs == 0].sum())
        expected = total * probs[probs > 0]
        observed = counts[probs > 0].to(torch.float64)
        small = expected < MIN_EXPECTED
        if small.any():
            expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
            observed = torch.cat([observed[~small], observed[small].sum().reshape(1)])
        self.dof = expected.numel() - 1
        self.statistic = float(((observed - expected) ** 2 / expected).sum())
        self.p_value = 0.0 if self.impossible else chi_square_survival(self.statistic, self.dof)

    def rejection_margin_sd(self, alpha: float) -> float:
        """How many standard deviations past the alpha critical value the statistic lies.

        Reads the statistic as a draw of a non-central chi-square with non-centrality
        statistic - dof (mean dof + nc, variance 2 (dof + 2 nc)); a margin of 5 means another seed
        would still reject with probability about 1 - 3e-7 (normal approximation).
        """
        if self.impossible:
            return math.inf
        noncentrality = max(self.statistic - self.dof, 0.0)
        spread = math.sqrt(2 * (self.dof + 2 * noncentrality))
        return (self.statistic - chi_square_critical(alpha, self.dof)) / spread

    def __repr__(self) -> str:
        return (
            f"chi2={self.statistic:.1f} dof={self.dof} p={self.p_value:.3g} "
            f"impossible={self.impossible}"
        )


def run_config(
    config: str, draft: str, num_draft: int, variant=None, verify=verify_sampled
) -> tuple[GoodnessOfFit, int, int]:
    """Simulate one configuration; returns (fit, draft tokens proposed, draft tokens accepted).

    The far draft sends its top-DRAFT_TOP_M q~; the equal draft sends all of it (M = V).
    """
    top_m = DRAFT_TOP_M if draft == "far" else VOCAB_SIZE
    truncated, untruncated = draft_tables(draft, config, top_m)
    verify = verify if variant is None else variant.verify
    sent = untruncated if variant is not None and variant.sends_untruncated_q else truncated
    target_table = process_logits(target_logits(), SAMPLING_CONFIGS[config])
    tokens, proposed, accepted = simulate(target_table, truncated, sent, num_draft, verify)
    return GoodnessOfFit(joint_counts(tokens), reference_joint_law(config)), proposed, accepted


# ----------------------------------------------------------------------------- the tests


def test_chi_square_survival_matches_closed_forms():
    for statistic in [0.0, 0.5, 3.0, 10.0, 40.0]:
        two = math.exp(-statistic / 2)
        assert chi_square_survival(statistic, 2) == pytest.approx(two, rel=1e-12)
        assert chi_square_survival(statistic, 1) == pytest.approx(
            math.erfc(math.sqrt(statistic / 2)), rel=1e-10, abs=1e-300
        )
        four = math.exp(-statistic / 2) * (1 + statistic / 2)
        assert chi_square_survival(statistic, 4) == pytest.approx(four, rel=1e-12)
    assert chi_square_survival(chi_square_critical(1e-4, 300), 300) == pytest.approx(1e-4, rel=1e-9)


def test_reference_law_is_a_distribution_and_has_zero_cells_under_truncation():
    for config in SAMPLING_CONFIGS:
        law = reference_joint_law(config)
        assert float(law.sum()) == pytest.approx(1.0, abs=1e-12)
    # top-k and top-p must actually remove tokens, or the support checks below prove nothing.
    assert int((reference_joint_law("temperature_0.7_top_k_5") == 0).sum()) > 0
    assert int((reference_joint_law("temperature_1.3_top_p_0.8") == 0).sum()) > 0
    assert int((reference_joint_law("temperature_1") == 0).sum()) == 0


@pytest.mark.parametrize("config", SAMPLING_CONFIGS)
def test_far_draft_is_far_and_truncation_matters(config):
    truncated, untruncated = draft_tables("far", config, DRAFT_TOP_M)
    target = process_logits(target_logits(), SAMPLING_CONFIGS[config])
    total_variation = 0.5 * (target - truncated).abs().sum(-1)  # (P,)
    assert float(total_variation.mean()) >= 0.3
    # q~ != q on a good share of prefixes, otherwise "test with untruncated q" is invisible.
    truncated_mass = (untruncated * (truncated == 0)).sum(-1)  # (P,)
    assert float((truncated_mass > 0.05).double().mean()) >= 0.3


def _sample_target_row_0(
    target_probs, draft_token_ids, draft_probs, accept_uniforms, final_uniforms
):
    """The target alone, without verify_sampled: K = 0, next token ~ p_0."""
    next_token_ids = sample_categorical(target_probs[:, 0], final_uniforms)
    return torch.zeros_like(next_token_ids), next_token_ids, torch.empty(len(next_token_ids), 0)


@pytest.mark.slow  # NUM_SEQUENCES sequences: a large run
@pytest.mark.parametrize("config", SAMPLING_CONFIGS)
def test_harness_without_speculation_matches_the_target(config):
    """Checks the loop, the tables and the enumeration themselves, independently of the verifier."""
    fit, proposed, _ = run_config(config, "far", num_draft=0, verify=_sample_target_row_0)
    assert proposed == 0
    assert fit.impossible == 0, fit
    assert fit.p_value >= ALPHA, fit


@pytest.mark.slow  # NUM_SEQUENCES sequences: a large run
@pytest.mark.parametrize("num_draft", [2, 3])
@pytest.mark.parametrize("config", SAMPLING_CONFIGS)
def test_far_draft_output_follows_the_target(config, num_draft):
    fit, proposed, accepted = run_config(config, "far", num_draft)
    assert fit.impossible == 0, fit
    assert fit.p_value >= ALPHA, fit
    assert 0.05 < accepted / proposed < 0.95  # both branches (accept and correct) are exercised


@pytest.mark.slow  # NUM_SEQUENCES sequences: a large run
@pytest.mark.parametrize("num_draft", [2, 3])
@pytest.mark.parametrize("config", SAMPLING_CONFIGS)
def test_draft_equal_to_target_accepts_everything(config, num_draft):
    """A draft equal to the target sends its whole q~ (M = V), which is p up to float32.

    Every token is then accepted: a rejection needs u >= p(d) / q~(d) >= 1 - 2**-22, which over
    this run's ~600,000 draft tokens is expected fewer than 0.2 times, so any rejection here is a
    wiring error (wrong row, misaligned prefix): the sampled analogue of the greedy check that a
    draft equal to the target has every token accepted.
    """
    truncated, _ = draft_tables("equal", config, VOCAB_SIZE)
    target = process_logits(target_logits(), SAMPLING_CONFIGS[config])
    support = target > 0
    assert torch.equal(truncated > 0, support)
    assert float((truncated[support] / target[support] - 1).abs().max()) < 2**-22
    fit, proposed, accepted = run_config(config, "equal", num_draft)
    assert accepted == proposed, f"{proposed - accepted} of {proposed} draft tokens rejected"
    assert fit.p_value >= ALPHA, fit


_VARIANT_CASES = [
    pytest.param(name, config, num_draft, id=f"{name}-{config}-K{num_draft}")
    for name in sampling_variants.WRONG_VARIANTS
    for config in SAMPLING_CONFIGS
    for num_draft in [2, 3]
    # With K = 3 the all-accepted bonus is token 4 or later, outside the three tokens tested.
    if not (name == "bonus_from_row_k_minus_1" and num_draft == 3)
]


@pytest.mark.slow  # NUM_SEQUENCES sequences: a large run
@pytest.mark.parametrize("name, config, num_draft", _VARIANT_CASES)
def test_wrong_variant_is_rejected(name, config, num_draft):
    fit, _, _ = run_config(config, "far", num_draft, sampling_variants.WRONG_VARIANTS[name])
    assert fit.p_value < ALPHA, fit
    assert fit.rejection_margin_sd(ALPHA) >= MIN_MARGIN_SD, fit
