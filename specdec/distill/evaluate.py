"""Held-out figures of a draft against its target's greedy answers, and the draft's step cost.

- greedy agreement: fraction of answer positions where the draft's argmax (teacher-forced on the
  target's tokens) equals the target's greedy token;
- τ at K: mean committed tokens per round of greedy speculative decoding, simulated exactly from
  those teacher-forced argmaxes (while drafts are accepted the draft's context equals the target's
  tokens, so its K proposals from position i are its teacher-forced argmaxes at i … i+K−1);
- c: one incremental draft step / one incremental target step at the same context.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

from specdec.distill.data import Example


@dataclass(frozen=True)
class HeldOutReport:
    num_examples: int
    num_positions: int
    greedy_agreement: float
    num_speculative_tokens: int
    mean_committed_per_round: float  # τ at K = num_speculative_tokens

    def to_json(self) -> dict:
        return asdict(self)


def committed_per_round(matches: list[bool], num_speculative_tokens: int) -> tuple[int, int]:
    """Simulate greedy rounds over one answer; returns (committed tokens, rounds).

    matches[i]: the draft's teacher-forced argmax at answer position i equals the target's token.
    A round from position i accepts the leading matches among i … i+K−1 (n of them) and commits
    n + 1 tokens (the target's correction or bonus), clipped at the answer's end.
    """
    position, rounds = 0, 0
    while position < len(matches):
        accepted = 0
        while (accepted < num_speculative_tokens and position + accepted < len(matches)
               and matches[position + accepted]):
            accepted += 1
        position = min(len(matches), position + accepted + 1)
        rounds += 1
    return len(matches), rounds


@torch.inference_mode()
def draft_matches(draft, example: Example) -> list[bool]:
    """Per answer position: draft argmax (teacher-forced) == target's greedy token."""
    device = next(draft.parameters()).device
    sequence = torch.tensor([example.prompt_ids + example.answer_ids[:-1]], device=device)
    logits = draft(input_ids=sequence, use_cache=False).logits[0]  # (T, V)
    start = len(example.prompt_ids) - 1
    predicted = logits[start:start + len(example.answer_ids)].argmax(-1).cpu()
    return (predicted == torch.tensor(example.answer_ids)).tolist()


def evaluate_held_out(draft, examples: list[Example], num_speculative_tokens: int) -> HeldOutReport:
    matched = positions = committed = rounds = 0
    for example in examples:
        matches = draft_matches(draft, example)
        matched += sum(matches)
        positions += len(matches)
        example_committed, example_rounds = committed_per_round(matches, num_speculative_tokens)
        committed += example_committed
        rounds += example_rounds
    return HeldOutReport(
        num_examples=len(examples),
        num_positions=positions,
        greedy_agreement=round(matched / max(1, positions), 4),
        num_speculative_tokens=num_speculative_tokens,
        mean_committed_per_round=round(committed / max(1, rounds), 4),
    )


@torch.inference_mode()
def step_seconds(model, context_length: int = 200, steps: int = 30, seed: int = 0) -> float:
    """Median wall time of one incremental decode step after a prefill of `context_length`."""
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    context = torch.randint(0, vocab, (1, context_length), generator=generator).to(device)
    cache = DynamicCache()
    logits = model(input_ids=context, cache=cache, use_cache=True).logits
    token = logits[:, -1:].argmax(-1)
    timings = []
    for _ in range(steps + 3):
        begin = time.perf_counter()
        logits = model(input_ids=token, cache=cache, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        timings.append(time.perf_counter() - begin)
    return statistics.median(timings[3:])


def cost_ratio(draft, target, context_length: int = 200, repeats: int = 3) -> dict:
    """c = draft step / target step, each the best of `repeats` medians (the machine is shared)."""
    draft_s = min(step_seconds(draft, context_length) for _ in range(repeats))
    target_s = min(step_seconds(target, context_length) for _ in range(repeats))
    return {"context_length": context_length, "draft_step_ms": round(draft_s * 1e3, 3),
            "target_step_ms": round(target_s * 1e3, 3), "cost_ratio": round(draft_s / target_s, 4)}
