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
each row exactly its value alone) removes even the rounding. Attention then computes every row that
is scored (a Verify's K + 1 rows, a decoding step) or that was once fed as such (a re-prefill) in
one canonical way, over the keys up to the end of its block of ROW_KEY_BLOCK positions, the rest
masked (specdec.attention.block_rows_attention): the rows of a session in one block share one call,
which gives each row exactly its value alone (checked at load; where it does not, each row runs in
a call of its own). A prompt attends in blocks of PREFILL_BLOCK positions (the worker cuts prompts
into chunks at those positions too). So a row's logits are the same bits whatever else shares the
pass and however a prompt was chunked: greedy output is then identical to the target decoding
alone, under any load.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from specdec.attention import RAGGED, block_rows_attention
from specdec.draft_head import DraftHead
from specdec.kv_cache import SequenceCache, attention_dtype, text_config
from specdec.packed_linear import rows_invariant


log = logging.getLogger(__name__)

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
    # Also the kept rows' last hidden states (what the output head reads, (rows_kept, H)): the
    # pass sets `hidden` (a draft head drafts from them, specdec.draft_head).
    keep_hidden: bool = False
    hidden: torch.Tensor | None = None

    @property
    def rows_kept(self) -> int:
        return len(self.token_ids) if self.keep_all else 1


@dataclass
class HeadFeed:
    """A job's request for drafts of a draft head (specdec.draft_head): `depth` greedy drafts
    after token_id, from the target's last hidden state at the row that chose it. The worker runs
    the head feeds of a pass's sessions as one batch; the job is sent (draft ids, chances)."""

    head: DraftHead
    hidden: torch.Tensor  # (H,)
    token_id: int
    depth: int
    min_chance: float = 0.0  # the drafts worth drafting: DraftHead.draft


def run_heads(feeds: Sequence[HeadFeed]) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    """Each HeadFeed's drafts and their chances, the feeds of one head in one batch."""
    results: list[tuple[tuple[int, ...], tuple[float, ...]] | None] = [None] * len(feeds)
    by_head: dict[int, list[int]] = {}
    for index, feed in enumerate(feeds):
        if feed.depth < 1:
            raise ValueError(f"a head feed needs depth >= 1, got {feed.depth}")
        by_head.setdefault(id(feed.head), []).append(index)
    for indices in by_head.values():
        head = feeds[indices[0]].head
        depth = max(feeds[i].depth for i in indices)
        drafts, chances = head.draft(torch.stack([feeds[i].hidden for i in indices]),
                                     torch.tensor([feeds[i].token_id for i in indices]), depth,
                                     min(feeds[i].min_chance for i in indices))
        for row, index in enumerate(indices):
            wanted = feeds[index].depth
            results[index] = (tuple(drafts[row, :wanted].tolist()), tuple(chances[row, :wanted].tolist()))
    return results  # type: ignore[return-value]


# A session's model work: yields Feeds, is sent each Feed's logits, returns its result (and may
# yield a HeadFeed, which is sent the head's drafts). The services' worker (specdec.worker) runs
# many jobs' Feeds in shared passes; run_alone runs one.
Job = Generator["Feed | HeadFeed", "torch.Tensor | tuple", Result]

# A batch-invariant model's attention over a prompt runs in blocks of this many positions, and the
# worker ends prompt chunks on them: a prompt's rows then get the same attention calls however it
# is chunked.
PREFILL_BLOCK = 16
# A batch-invariant model's scored rows attend over the keys up to the end of their block of this
# many positions (block_rows_attention): one call for a session's rows in a block.
ROW_KEY_BLOCK = 16
_BATCH_INVARIANT = "_specdec_batch_invariant"
_ROWS_TOGETHER = "_specdec_rows_together"
_QUERY_GROUPS = "_specdec_query_groups"  # query heads per key/value head, for the block rows' masks


def mark_batch_invariant(model: torch.nn.Module) -> bool:
    """Records (and returns) whether the model's passes are batch-invariant: every linear layer
    gives each row exactly its value alone (specdec.packed_linear.rows_invariant). Call after
    packing; forward then runs attention as the module's docstring says, a session's rows of one
    block in one call where that keeps each row's value (row_attention_invariant)."""
    invariant = rows_invariant(model)
    setattr(model, _BATCH_INVARIANT, invariant)
    if invariant:
        heads, kv_heads, dim = _head_shape(model)
        setattr(model, _QUERY_GROUPS, heads // kv_heads)
        setattr(model, _ROWS_TOGETHER, row_attention_invariant(heads, kv_heads, dim, attention_dtype(model)))
    return invariant


def batch_invariant(model: torch.nn.Module) -> bool:
    return bool(getattr(model, _BATCH_INVARIANT, False))


def row_attention_invariant(heads: int, kv_heads: int, dim: int, dtype: torch.dtype, trials: int = 3) -> bool:
    """Whether block_rows_attention gives each row exactly its value alone with up to a block of
    rows beside it, on random keys at a few context lengths (its products' kernels decide)."""
    generator = torch.Generator().manual_seed(0)
    groups = heads // kv_heads
    for trial in range(trials):
        length = ROW_KEY_BLOCK * (1 + 7 * trial)
        keys_t = torch.randn(kv_heads, dim, length, generator=generator).to(dtype)
        values = torch.randn(kv_heads, length, dim, generator=generator).to(dtype)
        # laid out as a pass's queries are: (H, N, D) over (N, H, D) storage; a lone row as a view
        query = torch.randn(ROW_KEY_BLOCK, heads, dim, generator=generator).to(dtype).transpose(0, 1)
        lone = query.view(kv_heads, groups, ROW_KEY_BLOCK, dim)
        alone = torch.cat([block_rows_attention(lone[:, :, row], 1, keys_t, values,
                                                _bias(row, 1, length, groups, dtype, keys_t.device), None)
                           for row in range(ROW_KEY_BLOCK)], dim=1)
        for rows in (2, 3, 5, ROW_KEY_BLOCK):
            for first in range(0, ROW_KEY_BLOCK - rows + 1, rows):
                together = block_rows_attention(query[:, first:first + rows], rows, keys_t, values,
                                                _bias(first, rows, length, groups, dtype, keys_t.device), None)
                if not torch.equal(together, alone[:, first:first + rows]):
                    log.warning("attention rows round differently together: each scored row attends "
                                "in a call of its own (slower verify passes, the same values)")
                    return False
    return True


def _head_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    config = text_config(model)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, dim


class _RowBiases:
    """block_rows_attention's masks, as views of one staircase per dtype and query-head group
    count: staircase[g, r, k] is -inf where k > width - ROW_KEY_BLOCK + r, so its last L columns
    mask, for the row at offset r in the block that ends at L, the keys past its position."""

    def __init__(self) -> None:
        self._staircases: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        self._lock = threading.Lock()

    def __call__(self, first: int, rows: int, length: int, groups: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """(groups rows, length): rows at offsets first.. of the block that ends at `length`."""
        key = (groups, dtype, device)
        with self._lock:
            staircase = self._staircases.get(key)
            if staircase is None or staircase.shape[-1] < length:
                width = max(length, 1024, 0 if staircase is None else 2 * staircase.shape[-1])
                columns = torch.arange(width, device=device)
                offsets = torch.arange(ROW_KEY_BLOCK, device=device).unsqueeze(1)
                past = columns.unsqueeze(0) > width - ROW_KEY_BLOCK + offsets  # (block, width)
                stair = torch.zeros(past.shape, dtype=dtype, device=device).masked_fill_(past, float("-inf"))
                staircase = self._staircases[key] = stair.expand(groups, -1, -1).contiguous()
        width = staircase.shape[-1]
        bias = staircase[:, first:first + rows, width - length:]
        return bias.reshape(groups * rows, length)


_bias = _RowBiases()


def run_alone(model: torch.nn.Module, job: Job[Result]) -> Result:
    """Runs a job with a pass of its own for each Feed (and a head call for each HeadFeed)."""
    try:
        feed = next(job)
        while True:
            if isinstance(feed, HeadFeed):
                feed = job.send(run_heads([feed])[0])
            else:
                feed = job.send(forward(model, [feed])[0])
    except StopIteration as stop:
        return stop.value


@dataclass(frozen=True)
class AttentionCall:
    """One attention call of a batch-invariant pass: rows [first, end) of a span (offsets within
    it); bias: for block rows (block_rows_attention), its mask over the keys up to the block's
    end; None for a prompt block (the fused kernel, causal over the keys up to its last row)."""

    first: int
    end: int
    bias: torch.Tensor | None = None


@dataclass(frozen=True)
class Span:
    """A session's rows in the packed sequence: [start, end), and its causal mask over the cache
    plus its new rows ((n, cached + n) bool; None for one row, which sees everything). calls: how
    a batch-invariant pass splits the rows into attention calls; () for one call over all of them.
    room: the key positions its calls read, padding included."""

    cache: SequenceCache
    start: int
    end: int
    mask: torch.Tensor | None
    calls: tuple[AttentionCall, ...] = ()
    room: int = 0


@dataclass(frozen=True)
class RaggedBatch:
    """Passed through the model's forward to the attention function (as the `ragged` keyword)."""

    spans: tuple[Span, ...]


def attention_calls(cached: int, new: int, scored: bool, together: bool = True) -> tuple[tuple[int, int, int], ...]:
    """A batch-invariant pass's attention calls for `new` rows after `cached`, as (first, end,
    keys): block rows, each attending over the keys up to the end of its ROW_KEY_BLOCK (keys > 0),
    for the rows of a scored feed and for a lone row (a decoding step, say); a call per
    PREFILL_BLOCK of positions for the rest of a prompt (keys 0). Block rows share a call where
    `together` (row_attention_invariant), else each has its own."""
    if scored or new == 1:
        calls = []
        for row in range(new):
            block_end = _key_block_end(cached + row)
            if together and calls and calls[-1][2] == block_end:
                calls[-1] = (calls[-1][0], row + 1, block_end)
            else:
                calls.append((row, row + 1, block_end))
        return tuple(calls)
    cuts = [0, *range(PREFILL_BLOCK - cached % PREFILL_BLOCK, new, PREFILL_BLOCK), new]
    return tuple((first, end, _key_block_end(cached + first) if end - first == 1 else 0)
                 for first, end in zip(cuts, cuts[1:]) if end > first)


def _key_block_end(position: int) -> int:
    """The end of the ROW_KEY_BLOCK that holds `position`: how many keys its row attends over."""
    return (position // ROW_KEY_BLOCK + 1) * ROW_KEY_BLOCK


def _span(feed: Feed, start: int, invariant: bool, together: bool, groups: int, device: torch.device) -> Span:
    cached, new = len(feed.cache), len(feed.token_ids)
    mask = _causal_mask(cached, new, device)
    if not invariant:
        return Span(feed.cache, start, start + new, mask)
    calls = []
    for first, end, keys in attention_calls(cached, new, feed.keep_all or feed.one_by_one, together):
        bias = None
        if keys:  # block rows: their offset in the block, over the keys up to its end
            bias = _bias((cached + first) % ROW_KEY_BLOCK, end - first, keys, groups, feed.cache.dtype, device)
        calls.append(AttentionCall(first, end, bias))
    room = max((call.bias.shape[-1] for call in calls if call.bias is not None), default=0)
    return Span(feed.cache, start, start + new, mask, tuple(calls), room)


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
    together = bool(getattr(model, _ROWS_TOGETHER, False))
    groups = getattr(model, _QUERY_GROUPS, 1)  # recorded with the invariance, which alone uses it
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
        spans.append(_span(feed, start, invariant, together, groups, device))
    captured: list[torch.Tensor] = []
    hook = None
    if any(feed.keep_hidden for feed in feeds):  # the output head's input: the kept rows' states
        hook = model.get_output_embeddings().register_forward_hook(
            lambda module, args, output: captured.append(args[0]))
    try:
        output = model(
            input_ids=torch.tensor([token_ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            use_cache=False,
            logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device),
            ragged=RaggedBatch(tuple(spans)),
        )
    finally:
        if hook is not None:
            hook.remove()
    for feed in feeds:
        feed.cache.extend(feed.token_ids)
    sizes = [f.rows_kept for f in feeds]
    if captured:
        for feed, hidden in zip(feeds, captured[0][0].detach().split(sizes)):
            if feed.keep_hidden:
                feed.hidden = hidden
    logits = output.logits[0]  # (len(keep), V)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return list(logits.cpu().split(sizes))
