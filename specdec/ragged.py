"""One forward pass over the rows of several sessions ("ragged rows").

Each session contributes the tokens it feeds now (a Verify's K + 1, a draft step's 1, a chunk of a
prompt) at its own positions against its own cache (specdec.kv_cache.SequenceCache). The rows are
packed into one sequence of batch 1: every linear layer (projections, MLP, the output head) runs
once over all of them, which is where a small pass spends its time, and attention runs per session
over that session's cache only (specdec.attention.ragged_attention). No padding and no copy of any
cache; a row's logits do not depend on its batch-mates beyond float rounding (the matrix
multiplications see more rows), so batching never changes what the lossless rule decides beyond
what a different kernel would.

A batch-invariant model (mark_batch_invariant: bfloat16 with oneDNN's packing, whose products give
each row exactly its value alone) removes even the rounding: attention then runs row by row for a
feed whose every row is scored (a Verify's K + 1 rows, each over exactly the cache a one-token step
at its position would see) and in blocks of PREFILL_BLOCK positions for a prompt (the worker cuts
prompts into chunks at those positions too), so that a row's logits are the same bits whatever
else shares the pass and however a prompt was chunked: greedy output is then identical to the
target decoding alone, under any load.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from specdec.attention import RAGGED
from specdec.kv_cache import SequenceCache
from specdec.packed_linear import rows_invariant


Result = TypeVar("Result")


@dataclass
class Feed:
    """Tokens one session feeds in a pass; logits come back for every row or only the last."""

    cache: SequenceCache
    token_ids: list[int]
    keep_all: bool = False
    # Attend row by row even if not every row is scored: tokens that were first fed as one-token
    # steps or verify rows, fed again (a re-prefill after a lost replica).
    one_by_one: bool = False

    @property
    def rows_kept(self) -> int:
        return len(self.token_ids) if self.keep_all else 1


# A session's model work: yields Feeds, is sent each Feed's logits, returns its result. The
# services' worker (specdec.worker) runs many jobs' Feeds in shared passes; run_alone runs one.
Job = Generator[Feed, torch.Tensor, Result]

# A batch-invariant model's attention over a prompt runs in blocks of this many positions, and the
# worker ends prompt chunks on them: a prompt's rows then get the same attention calls however it
# is chunked.
PREFILL_BLOCK = 16
_BATCH_INVARIANT = "_specdec_batch_invariant"


def mark_batch_invariant(model: torch.nn.Module) -> bool:
    """Records (and returns) whether the model's passes are batch-invariant: every linear layer
    gives each row exactly its value alone (specdec.packed_linear.rows_invariant). Call after
    packing; forward then runs attention as the module's docstring says."""
    invariant = rows_invariant(model)
    setattr(model, _BATCH_INVARIANT, invariant)
    return invariant


def batch_invariant(model: torch.nn.Module) -> bool:
    return bool(getattr(model, _BATCH_INVARIANT, False))


def run_alone(model: torch.nn.Module, job: Job[Result]) -> Result:
    """Runs a job with a pass of its own for each Feed."""
    try:
        feed = next(job)
        while True:
            feed = job.send(forward(model, [feed])[0])
    except StopIteration as stop:
        return stop.value


@dataclass(frozen=True)
class Span:
    """A session's rows in the packed sequence: [start, end), and its causal mask over the cache
    plus its new rows ((n, cached + n) bool; None for one row, which sees everything). calls: how
    attention splits the rows into calls, as (first, end) row offsets within the span; () for one
    call over all of them."""

    cache: SequenceCache
    start: int
    end: int
    mask: torch.Tensor | None
    calls: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class RaggedBatch:
    """Passed through the model's forward to the attention function (as the `ragged` keyword)."""

    spans: tuple[Span, ...]


def attention_calls(cached: int, new: int, scored: bool) -> tuple[tuple[int, int], ...]:
    """A batch-invariant pass's attention calls for `new` rows after `cached`: one per row when
    every row is scored, else one per PREFILL_BLOCK of positions; () when one call covers all."""
    if new == 1:
        return ()
    if scored:
        return tuple((row, row + 1) for row in range(new))
    cuts = [0, *range(PREFILL_BLOCK - cached % PREFILL_BLOCK, new, PREFILL_BLOCK), new]
    calls = tuple((first, end) for first, end in zip(cuts, cuts[1:]) if end > first)
    return calls if len(calls) > 1 else ()


def _causal_mask(cached: int, new: int, device: torch.device) -> torch.Tensor | None:
    if new == 1:
        return None
    rows = torch.arange(new, device=device).unsqueeze(1)
    columns = torch.arange(cached + new, device=device).unsqueeze(0)
    return columns <= rows + cached


@torch.inference_mode()
def forward(model: torch.nn.Module, feeds: Sequence[Feed]) -> list[torch.Tensor]:
    """Feeds every Feed in one pass; returns each one's logits ((n, V) or (1, V)), float32 or
    float64 (the model's), on the CPU. Each cache advances by its tokens only if the pass
    completes."""
    if not feeds:
        return []
    if getattr(model.config, "_attn_implementation", None) != RAGGED:
        raise ValueError(f"the model's attention must be {RAGGED!r} (specdec.attention.use_ragged), "
                         f"not {model.config._attn_implementation!r}")
    if len({id(f.cache) for f in feeds}) != len(feeds):
        raise ValueError("a session can feed only once per pass")
    device = model.device
    invariant = batch_invariant(model)
    token_ids: list[int] = []
    positions: list[int] = []
    keep: list[int] = []
    spans: list[Span] = []
    for feed in feeds:
        new = len(feed.token_ids)
        if new == 0:
            raise ValueError("a feed needs at least one token")
        cached = len(feed.cache)
        start = len(token_ids)
        token_ids.extend(feed.token_ids)
        positions.extend(range(cached, cached + new))
        keep.extend(range(start, start + new) if feed.keep_all else (start + new - 1,))
        calls = attention_calls(cached, new, feed.keep_all or feed.one_by_one) if invariant else ()
        spans.append(Span(feed.cache, start, start + new, _causal_mask(cached, new, device), calls))
    output = model(
        input_ids=torch.tensor([token_ids], dtype=torch.long, device=device),
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        use_cache=False,
        logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device),
        ragged=RaggedBatch(tuple(spans)),
    )
    for feed in feeds:
        feed.cache.extend(feed.token_ids)
    logits = output.logits[0]  # (len(keep), V)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return list(logits.cpu().split([f.rows_kept for f in feeds]))
