"""Lossless speculative verification: the accept / reject rule and everything it samples from.

Terms (docs/architecture.md, "The lossless rule"; Leviathan et al. 2023, arXiv 2211.17192;
Chen et al. 2023, arXiv 2302.01318):

- ``target_probs`` (p): the target's processed distribution at a position, i.e. its logits after
  temperature, top-k and top-p exactly as the target alone would sample (transformers' order and
  tie rules: ``TemperatureLogitsWarper`` -> ``TopKLogitsWarper`` -> ``TopPLogitsWarper``).
- ``draft_probs`` (q~): the distribution the draft sampled a token from: its own processed
  distribution truncated to the top-M entries and renormalised. The draft sends exactly this vector
  and both sides read it through :func:`sparse_to_dense`, so the test uses the q~ the token was
  drawn from (testing with the untruncated q is the classic bug).
- accepted tokens: draft tokens d_1..d_n that passed; d_i passes with probability
  min(1, p_i(d_i) / q~_i(d_i)).
- recovered (correction) token: at the first rejection, a sample from norm(max(0, p_i - q~_i)) over
  the full vocabulary (q~ is zero outside its support); from p_i when that residual is empty.
- bonus token: when all K pass, a sample from the target's row K.
- greedy (temperature 0): accept while argmax p_i == d_i, then emit argmax of the first mismatching
  row (or of row K).

Randomness is passed in as uniforms (one per draft position for the tests, one for the final token)
so the math is pure; callers derive them from per-request generators keyed by (seed, position,
role) with :func:`keyed_uniform`, never from global RNG state. Everything here is batched over a
leading dimension B (the services use B = 1; the statistical tests use B = 200,000).
"""

from __future__ import annotations

import hashlib
import math

import torch

from specdec.protocol import MAX_DRAFT_TOP_M, SamplingParams, VerifyOutcome

_EMPTY_RESIDUAL = 1e-12  # a residual mass below this is treated as zero (p == q~ up to rounding)


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed probabilities, float64. logits: (..., V) -> (..., V).

    Temperature, then top-k (ties with the k-th value kept), then top-p (the smallest set of
    highest-probability tokens whose mass is at least top_p, at least one token), as transformers
    does.
    Greedy params give the one-hot of argmax (first index on ties, like torch.argmax).
    """
    scores = logits.to(torch.float64)
    if params.greedy:
        return torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1]).to(torch.float64)
    scores = scores / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth_value = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]  # (..., 1)
        scores = scores.masked_fill(scores < kth_value, -math.inf)
    if params.top_p < 1.0:
        sorted_scores, sorted_ids = torch.sort(scores, dim=-1, descending=False)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)  # (..., V), ascending
        remove_sorted = cumulative <= (1 - params.top_p)
        remove_sorted[..., -1] = False  # keep at least the most likely token
        remove = remove_sorted.scatter(-1, sorted_ids, remove_sorted)
        scores = scores.masked_fill(remove, -math.inf)
    return scores.softmax(-1)


def truncate_top_m(probs: torch.Tensor, top_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's wire distribution: top-M entries of probs, renormalised, as float32.

    probs: (V,) float64 -> (token_ids (M',) int64, probs (M',) float32), M' <= M, zeros dropped.
    """
    if not 1 <= top_m <= MAX_DRAFT_TOP_M:
        raise ValueError(f"top_m must be in [1, {MAX_DRAFT_TOP_M}], got {top_m}")
    values, token_ids = torch.topk(probs, min(top_m, probs.shape[-1]))
    keep = values > 0
    values, token_ids = values[keep], token_ids[keep]
    return token_ids, (values / values.sum()).to(torch.float32)


def draft_distribution(
    logits: torch.Tensor, params: SamplingParams, top_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's wire distribution for one position: ``truncate_top_m(process_logits(logits,
    params), top_m)``, computed from the top-M logits instead of the whole vocabulary.

    logits: (V,) -> (token_ids (M',) int64, probs (M',) float32). Only the top-M + 1 logits are
    taken to float64; top-p alone needs the normaliser over the vocabulary (one log-sum-exp, no
    sort). Equal to the composition up to float rounding; where two of the top M + 1 logits tie,
    which of them is kept depends on sort order, so that case is handed to the composition itself.
    Greedy params are too (a one-hot: nothing to save).
    """
    if not 1 <= top_m <= MAX_DRAFT_TOP_M:
        raise ValueError(f"top_m must be in [1, {MAX_DRAFT_TOP_M}], got {top_m}")
    vocab_size = logits.shape[-1]
    values, token_ids = torch.topk(logits, min(top_m + 1, vocab_size))  # descending
    finite = values > -math.inf  # a restricted head's logits are -inf outside its ids
    if params.greedy or bool(((values[:-1] == values[1:]) & finite[:-1]).any()):
        return truncate_top_m(process_logits(logits, params), top_m)
    scores = values.to(torch.float64) / params.temperature
    kept = finite
    top_k = 0 < params.top_k < vocab_size
    if top_k:
        if params.top_k <= values.numel():
            kth = values[params.top_k - 1]
        else:
            kth = torch.topk(logits, params.top_k).values[-1]
        kth_score = kth.to(torch.float64) / params.temperature
        kept &= scores >= kth_score
    if params.top_p < 1.0:
        # A token stays in the nucleus while the mass ranked above it is below top_p (the
        # smallest set whose mass reaches top_p; the first always, top_p > 0); the mass is taken
        # over what top-k left.
        everything = logits.to(torch.float64) / params.temperature
        if top_k:
            everything = everything.masked_fill(everything < kth_score, -math.inf)
        probs = (scores - torch.logsumexp(everything, -1)).exp().masked_fill(~kept, 0.0)
        above = probs.cumsum(-1) - probs
        kept &= above < params.top_p
    scores, token_ids = scores[:top_m], token_ids[:top_m]
    kept = kept[:top_m]
    probs = (scores[kept] - scores[0]).exp()
    token_ids = token_ids[kept]
    nonzero = probs > 0
    probs, token_ids = probs[nonzero], token_ids[nonzero]
    return token_ids, (probs / probs.sum()).to(torch.float32)


def sample_sparse(token_ids: torch.Tensor, probs: torch.Tensor, uniform: float) -> int:
    """``sample_categorical(sparse_to_dense(token_ids, probs, V), u)`` without the (V,) vector: the
    same normalised values and the same inverse CDF in token-id order (the dense vector's zeros
    add nothing to its running sum), so the same token."""
    values = probs.to(torch.float64)
    values = values / values.sum()
    order = token_ids.argsort()
    cdf = values[order].cumsum(-1)
    threshold = torch.tensor([uniform * float(cdf[-1])], dtype=torch.float64)
    chosen = int(torch.searchsorted(cdf, threshold, right=True)[0])
    return int(token_ids[order[min(chosen, cdf.numel() - 1)]])


def sparse_to_dense(token_ids: torch.Tensor, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The one reading of a sent q~, shared by the draft (to sample) and the target (to test).

    token_ids: (M,), probs: (M,) float32 -> (V,) float64 that sums to 1 (the float32 values divided
    by their float64 sum, so both sides use the very distribution the token was drawn from).
    """
    dense = torch.zeros(vocab_size, dtype=torch.float64)
    values = probs.to(torch.float64)
    dense[token_ids.long()] = values / values.sum()
    return dense


def sample_categorical(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. probs: (B, V) non-negative, uniforms: (B,) in [0, 1) -> (B,) int64.

    Zero-probability entries are never chosen; rows need not be normalised.
    """
    cdf = probs.to(torch.float64).cumsum(-1)  # (B, V)
    threshold = (uniforms.to(torch.float64) * cdf[:, -1]).unsqueeze(-1)  # (B, 1)
    chosen = torch.searchsorted(cdf, threshold, right=True).squeeze(-1)  # (B,)
    return chosen.clamp(max=probs.shape[-1] - 1)


def verify_greedy(target_logits: torch.Tensor, draft_token_ids: torch.Tensor) -> VerifyOutcome:
    """Greedy verification. target_logits: (K + 1, V), draft_token_ids: (K,)."""
    target_choice = target_logits.argmax(-1)  # (K + 1,)
    matches = (target_choice[:-1] == draft_token_ids).tolist()
    num_accepted = matches.index(False) if False in matches else len(matches)
    return VerifyOutcome(
        num_accepted=num_accepted,
        next_token_id=int(target_choice[num_accepted]),
        acceptance_signal=tuple(1.0 if match else 0.0 for match in matches),
    )


def verify_sampled(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    final_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Speculative sampling, batched.

    target_probs:    (B, K + 1, V) processed target distributions (row i scores d_{i+1}, row K bonus)
    draft_token_ids: (B, K) int64
    draft_probs:     (B, K, V) the q~ each draft token was sampled from (dense)
    accept_uniforms: (B, K) in [0, 1): d_i is accepted iff u_i * q~_i(d_i) < p_i(d_i)
    final_uniforms:  (B,) in [0, 1): draws the correction or bonus token
    Returns (num_accepted (B,), next_token_ids (B,), acceptance_signal (B, K)).
    """
    batch, num_speculative_tokens = draft_token_ids.shape
    rows = torch.arange(batch)
    target_of_draft = target_probs[:, :-1].gather(-1, draft_token_ids.unsqueeze(-1)).squeeze(-1)
    draft_of_draft = draft_probs.gather(-1, draft_token_ids.unsqueeze(-1)).squeeze(-1)  # (B, K)
    # u < p / q  <=>  u * q < p, which avoids dividing by q and accepts with prob min(1, p / q).
    accepted = accept_uniforms.to(torch.float64) * draft_of_draft < target_of_draft  # (B, K)
    all_passed = torch.cat([accepted, torch.zeros(batch, 1, dtype=torch.bool)], dim=1)
    num_accepted = (~all_passed).int().argmax(-1)  # (B,): index of the first rejection, or K
    target_row = target_probs[rows, num_accepted]  # (B, V)
    # Row K has no draft: padding q~ with zeros makes the residual equal p there (the bonus).
    padding = torch.zeros(batch, 1, target_probs.shape[-1], dtype=draft_probs.dtype)
    padded_draft = torch.cat([draft_probs, padding], dim=1)  # (B, K + 1, V)
    residual = (target_row - padded_draft[rows, num_accepted]).clamp(min=0)  # (B, V)
    empty = residual.sum(-1, keepdim=True) <= _EMPTY_RESIDUAL
    final_dist = torch.where(empty, target_row, residual)
    next_token_ids = sample_categorical(final_dist, final_uniforms)
    acceptance_signal = torch.minimum(target_probs[:, :-1], draft_probs).sum(-1)  # (B, K)
    return num_accepted, next_token_ids, acceptance_signal


def verify_sampled_one(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    final_uniform: float,
) -> VerifyOutcome:
    """:func:`verify_sampled` for one sequence. Shapes as there, without B."""
    num_accepted, next_token_ids, signal = verify_sampled(
        target_probs.unsqueeze(0),
        draft_token_ids.unsqueeze(0),
        draft_probs.unsqueeze(0),
        accept_uniforms.unsqueeze(0),
        torch.tensor([final_uniform], dtype=torch.float64),
    )
    return VerifyOutcome(
        num_accepted=int(num_accepted[0]),
        next_token_id=int(next_token_ids[0]),
        acceptance_signal=tuple(float(x) for x in signal[0]),
    )


def round_uniform(seed: int, round_start: int) -> float:
    """The uniform that draws a round's final token (its correction or bonus): one per round, keyed
    by where the round starts (the committed length before it). A draft guessing the round's
    outcome draws its own bonus candidate with it (draft_service.engine.bonus_candidates)."""
    return keyed_uniform(seed, round_start, "target")


def keyed_uniform(seed: int, position: int, role: str) -> float:
    """A uniform in [0, 1) determined by (seed, position, role) alone.

    position is the absolute index in the committed sequence of the token the draw concerns; role
    names the draw ("draft", "accept", "target"), so the draft's sample and the target's test of
    the same token are independent. Re-prefill, retries and other sessions cannot shift it.
    """
    digest = hashlib.blake2b(f"{seed}:{position}:{role}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * (1.0 / (1 << 53))
