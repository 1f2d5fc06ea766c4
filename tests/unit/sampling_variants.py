"""Deliberately WRONG speculative verifiers, used only to prove the statistical test has power.

Each ``verify_*`` function has the signature and return value of
:func:`specdec.sampling.verify_sampled` and differs from it in exactly one named way, a known way
to break the rule of docs/architecture.md, "The lossless rule". ``WRONG_VARIANTS`` lists them with
how the draft feeds them: the "untruncated q" bug is not in the verifier but in what it is handed
(the draft samples from q~ and sends its full q), so that variant is the correct verifier fed the
wrong vector. Never import this outside tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from specdec.sampling import sample_categorical, verify_sampled

VerifyFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]

_EMPTY = 1e-12  # same meaning as specdec.sampling's threshold: a residual this small is empty


def _first_rejection(
    target_probs: torch.Tensor,  # (B, K + 1, V)
    draft_token_ids: torch.Tensor,  # (B, K)
    draft_probs: torch.Tensor,  # (B, K, V)
    accept_uniforms: torch.Tensor,  # (B, K)
) -> torch.Tensor:
    """The correct acceptance rule; returns num_accepted (B,)."""
    index = draft_token_ids.unsqueeze(-1)  # (B, K, 1)
    target_of_draft = target_probs[:, :-1].gather(-1, index).squeeze(-1)  # (B, K)
    draft_of_draft = draft_probs.gather(-1, index).squeeze(-1)  # (B, K)
    accepted = accept_uniforms.to(torch.float64) * draft_of_draft < target_of_draft  # (B, K)
    rejected = torch.cat([~accepted, torch.ones_like(accepted[:, :1])], dim=1)  # (B, K + 1)
    return rejected.int().argmax(-1)


def _signal(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    return torch.minimum(target_probs[:, :-1], draft_probs).sum(-1)  # (B, K)


def _sample_or_target(
    dist: torch.Tensor, target_row: torch.Tensor, final_uniforms: torch.Tensor
) -> torch.Tensor:
    """Sample from dist (B, V), or from target_row (B, V) where dist is empty."""
    empty = dist.sum(-1, keepdim=True) <= _EMPTY
    return sample_categorical(torch.where(empty, target_row, dist), final_uniforms)


def verify_residual_is_target(
    target_probs, draft_token_ids, draft_probs, accept_uniforms, final_uniforms
):
    """WRONG: the correction is sampled from p_i instead of norm(max(0, p_i - q~_i))."""
    num_accepted = _first_rejection(target_probs, draft_token_ids, draft_probs, accept_uniforms)
    rows = torch.arange(num_accepted.shape[0])
    target_row = target_probs[rows, num_accepted]  # (B, V)
    next_token_ids = sample_categorical(target_row, final_uniforms)
    return num_accepted, next_token_ids, _signal(target_probs, draft_probs)


def verify_residual_on_draft_support(
    target_probs, draft_token_ids, draft_probs, accept_uniforms, final_uniforms
):
    """WRONG: the residual max(0, p_i - q~_i) is kept only where q~_i > 0 (p_i if that is empty).

    Tokens the draft truncated away can then never be recovered, although the target gives them
    mass. The bonus (row K, no draft) is sampled from p_K as it should be.
    """
    num_accepted = _first_rejection(target_probs, draft_token_ids, draft_probs, accept_uniforms)
    rows = torch.arange(num_accepted.shape[0])
    target_row = target_probs[rows, num_accepted]  # (B, V)
    padded_draft = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)
    draft_row = padded_draft[rows, num_accepted]  # (B, V); zeros at row K
    residual = (target_row - draft_row).clamp(min=0) * (draft_row > 0)
    next_token_ids = _sample_or_target(residual, target_row, final_uniforms)
    return num_accepted, next_token_ids, _signal(target_probs, draft_probs)


def verify_bonus_from_row_k_minus_1(
    target_probs, draft_token_ids, draft_probs, accept_uniforms, final_uniforms
):
    """WRONG: when all K pass, the bonus is sampled from row K - 1 (an off-by-one) instead of K.

    Only visible when that bonus lands inside the tokens the test looks at, and needs K >= 1.
    """
    num_accepted = _first_rejection(target_probs, draft_token_ids, draft_probs, accept_uniforms)
    num_draft = draft_token_ids.shape[1]
    rows = torch.arange(num_accepted.shape[0])
    padded_draft = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)
    residual = (target_probs[rows, num_accepted] - padded_draft[rows, num_accepted]).clamp(min=0)
    wrong_bonus = target_probs[rows, max(num_draft - 1, 0)]  # (B, V)
    all_passed = (num_accepted == num_draft).unsqueeze(-1)  # (B, 1)
    final_dist = torch.where(all_passed, wrong_bonus, residual)
    fallback = torch.where(all_passed, wrong_bonus, target_probs[rows, num_accepted])
    next_token_ids = _sample_or_target(final_dist, fallback, final_uniforms)
    return num_accepted, next_token_ids, _signal(target_probs, draft_probs)


class WrongVariant(NamedTuple):
    verify: VerifyFn
    # True: the draft still samples each token from q~ but hands the verifier its untruncated q.
    sends_untruncated_q: bool = False


WRONG_VARIANTS: dict[str, WrongVariant] = {
    "residual_is_target": WrongVariant(verify_residual_is_target),
    "residual_on_draft_support": WrongVariant(verify_residual_on_draft_support),
    "test_with_untruncated_q": WrongVariant(verify_sampled, sends_untruncated_q=True),
    "bonus_from_row_k_minus_1": WrongVariant(verify_bonus_from_row_k_minus_1),
}
