"""Model-free drafts: proposals looked up in tokens already seen (plain Python, no torch).

- NgramProposer (prompt lookup): the last n tokens of the session (n from max_n down to min_n)
  are looked up among earlier positions of the same session (prompt + output so far); the most
  recent earlier occurrence's continuation is the proposal (a continuation that reaches the end of
  C repeats the pattern). The i-th proposed token rests on a match of n + i tokens (the matched
  n-gram and the i proposed tokens before it, which continue the same earlier occurrence).
- SuffixProposer: a suffix structure of bounded depth over the session's tokens (every context of
  up to max_depth tokens, with how often each next token followed it), optionally merged with a
  SuffixCache of recent outputs shared by the replica's requests. The proposal follows the most
  frequent continuation of the longest matched context, token by token, while the chosen token's
  share of the counts stays at or above min_share. Each proposed token rests on the length of
  the context matched when it was chosen.

How long a match each proposed token rests on is the proposal's confidence: the K controller
estimates acceptance per match length (orchestrator/lookup_policy.py), so a token continuing a
long match is weighed differently from one after a short match, or from a model's guess.

A proposal is a point mass (q~ = one-hot on each proposed token): the target's verify rule then
accepts token x with probability p(x) and, on a rejection, samples from p with x removed and
renormalised -- the general rule for a one-hot q~, so the output keeps the target's law.
Both proposers are per session; they only ever see C grow (the orchestrator never shrinks it).

Used in the orchestrator (orchestrator/local_draft.py: --draft local:METHOD, --draft-method
hybrid) and by a draft service without a model (draft_service/lookup_service.py: `specdec serve
draft --method ngram|suffix`), whose Info names it by LOOKUP_MODEL_PREFIX + method, so the
orchestrator counts its proposals under the lookup's method.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from specdec.protocol import Proposal, SamplingParams, SparseDistribution

DRAFT_METHODS = ("model", "ngram", "suffix", "hybrid")
LOOKUP_METHODS = ("ngram", "suffix")
SUFFIX_CACHE_MODES = ("session", "shared")
LOOKUP_MODEL_PREFIX = "lookup:"  # the model_id of a draft replica that serves a lookup: "lookup:suffix"


def proposal_method(draft_model_id: str) -> str:
    """The method a draft replica's proposals are counted under: its lookup's, else "model"."""
    if draft_model_id.startswith(LOOKUP_MODEL_PREFIX):
        method = draft_model_id[len(LOOKUP_MODEL_PREFIX):]
        if method in LOOKUP_METHODS:
            return method
    return "model"


@dataclass(frozen=True)
class Lookup:
    """A lookup's proposal: up to k token ids and, for each, how many tokens of context its match
    rests on (the tokens proposed before it included)."""

    token_ids: tuple[int, ...]
    match_lengths: tuple[int, ...]  # one per token, each >= 1

    def __post_init__(self) -> None:
        if len(self.match_lengths) != len(self.token_ids):
            raise ValueError("a lookup needs one match length per proposed token")

    @property
    def match_length(self) -> int:
        """Tokens of context the first proposed token's match rests on (0: no proposal)."""
        return self.match_lengths[0] if self.match_lengths else 0

    def first(self, count: int) -> Lookup:
        """The first count proposed tokens (as Proposal.first)."""
        return Lookup(self.token_ids[:count], self.match_lengths[:count])

    def proposal(self, sampling: SamplingParams) -> Proposal:
        """As a draft's proposal: one-hot q~ when sampling, with its match lengths."""
        distributions = () if sampling.greedy else tuple(
            SparseDistribution((token,), (1.0,)) for token in self.token_ids)
        return Proposal(self.token_ids, distributions, match_lengths=self.match_lengths)


NO_LOOKUP = Lookup((), ())


class Proposer(Protocol):
    def propose(self, tokens: Sequence[int], k: int) -> Lookup:
        """Up to k tokens to follow tokens (the session's C, which only grows between calls)."""

    def finish(self, tokens: Sequence[int], prompt_length: int) -> None:
        """The request ended with C = tokens (its first prompt_length are the prompt)."""


# ---------------------------------------------------------------------------------------- n-gram


class NgramProposer:
    """Prompt lookup over the session's own tokens, with an index kept up to date incrementally."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        # n-gram -> end (exclusive) of its most recent occurrence that has a continuation
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed_end = 0  # every n-gram ending at or before this position is indexed
        self._seen = 0

    def _extend(self, tokens: Sequence[int]) -> None:
        if len(tokens) < self._seen:  # C never shrinks in the loop; start over if it did
            self._index.clear()
            self._indexed_end = 0
        self._seen = len(tokens)
        # Index n-grams ending at e <= len - 1: tokens[e] (the continuation) exists.
        for end in range(max(self._indexed_end + 1, self.min_n), len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._index[tuple(tokens[end - n:end])] = end
        self._indexed_end = max(self._indexed_end, len(tokens) - 1)

    def propose(self, tokens: Sequence[int], k: int) -> Lookup:
        self._extend(tokens)
        if k <= 0:
            return NO_LOOKUP
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            end = self._index.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                # Past the end of C the continuation goes on with its own proposals (a match close
                # to the end is a repeating pattern: the pattern is assumed to go on).
                continuation: list[int] = []
                for position in range(end, end + k):
                    continuation.append(tokens[position] if position < len(tokens)
                                        else continuation[position - len(tokens)])
                return Lookup(tuple(continuation), tuple(range(n, n + k)))
        return NO_LOOKUP

    def finish(self, tokens: Sequence[int], prompt_length: int) -> None:
        pass


# ---------------------------------------------------------------------------------------- suffix


class ContextCounts:
    """context (a tuple of 1..max_depth tokens) -> {next token: count}: a suffix trie of bounded
    depth, flattened. Adding and removing a sequence are exact inverses."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.table: dict[tuple[int, ...], dict[int, int]] = {}

    def add_positions(self, tokens: Sequence[int], start: int, stop: int, sign: int = 1) -> None:
        """Counts tokens[i] after each context ending at i, for i in [start, stop)."""
        for i in range(max(start, 1), stop):
            nxt = tokens[i]
            for depth in range(1, min(self.max_depth, i) + 1):
                context = tuple(tokens[i - depth:i])
                row = self.table.get(context)
                if sign > 0:
                    if row is None:
                        row = self.table[context] = {}
                    row[nxt] = row.get(nxt, 0) + 1
                elif row is not None and nxt in row:
                    row[nxt] -= 1
                    if row[nxt] <= 0:
                        del row[nxt]
                    if not row:
                        del self.table[context]

    def get(self, context: tuple[int, ...]) -> dict[int, int] | None:
        return self.table.get(context)

    def __len__(self) -> int:
        return len(self.table)


class SuffixCache:
    """Recent outputs shared by the requests of one orchestrator: LRU, at most max_tokens tokens
    (and so at most max_tokens * max_depth contexts). Outputs longer than max_tokens keep their end."""

    def __init__(self, max_tokens: int = 200_000, max_depth: int = 8) -> None:
        if max_tokens < 1 or max_depth < 1:
            raise ValueError("max_tokens and max_depth must be >= 1")
        self.max_tokens = max_tokens
        self.counts = ContextCounts(max_depth)
        self._entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._next_id = 0
        self.num_tokens = 0

    def add(self, tokens: Sequence[int]) -> None:
        entry = tuple(tokens[-self.max_tokens:])
        if len(entry) < 2:
            return
        while self._entries and self.num_tokens + len(entry) > self.max_tokens:
            _, old = self._entries.popitem(last=False)  # the least recently used
            self.counts.add_positions(old, 0, len(old), sign=-1)
            self.num_tokens -= len(old)
        self._entries[self._next_id] = entry
        self._next_id += 1
        self.counts.add_positions(entry, 0, len(entry))
        self.num_tokens += len(entry)

    def entries(self) -> list[tuple[int, ...]]:
        """The sequences held, least recently added first."""
        return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)


class PartitionedSuffixCaches(OrderedDict[str, SuffixCache]):
    """partition -> its SuffixCache, each bounded by max_tokens; the least recently used first.
    A shared cache kept apart per client (the orchestrator's, a lookup draft replica's): a session
    draws only on its partition's cache. With max_partitions, the least recently used partition's
    cache is dropped beyond it."""

    def __init__(self, max_tokens: int, max_depth: int, max_partitions: int | None = None) -> None:
        super().__init__()
        if max_partitions is not None and max_partitions < 1:
            raise ValueError(f"max_partitions must be >= 1, got {max_partitions}")
        self.max_tokens, self.max_depth, self.max_partitions = max_tokens, max_depth, max_partitions

    def of(self, partition: str) -> SuffixCache:
        """The partition's cache, made on first use."""
        cache = self.get(partition)
        if cache is None:
            cache = self[partition] = SuffixCache(self.max_tokens, self.max_depth)
            while self.max_partitions is not None and len(self) > self.max_partitions:
                self.popitem(last=False)
        self.move_to_end(partition)
        return cache


class SuffixProposer:
    """Frequency-scored continuations of the longest matched suffix, over the session's tokens and,
    if given, a shared SuffixCache (whose counts add to the session's)."""

    def __init__(self, max_depth: int = 8, min_share: float = 0.3, cache: SuffixCache | None = None,
                 cache_prompt: bool = False) -> None:
        if not 0 < min_share <= 1:
            raise ValueError("min_share must be in (0, 1]")
        self.counts = ContextCounts(max_depth if cache is None else cache.counts.max_depth)
        self.min_share = min_share
        self.cache = cache
        self.cache_prompt = cache_prompt  # also put prompts in the shared cache, not only outputs
        self._seen = 0

    def _extend(self, tokens: Sequence[int]) -> None:
        if len(tokens) < self._seen:
            self.counts = ContextCounts(self.counts.max_depth)
            self._seen = 0
        self.counts.add_positions(tokens, self._seen, len(tokens))
        self._seen = len(tokens)

    def _row(self, context: tuple[int, ...]) -> dict[int, int] | None:
        own = self.counts.get(context)
        shared = self.cache.counts.get(context) if self.cache is not None else None
        if own is None or shared is None:
            return own or shared
        merged = dict(shared)
        for token, count in own.items():
            merged[token] = merged.get(token, 0) + count
        return merged

    def _match(self, tail: list[int]) -> tuple[int, dict[int, int] | None]:
        for depth in range(min(self.counts.max_depth, len(tail)), 0, -1):
            row = self._row(tuple(tail[len(tail) - depth:]))
            if row:
                return depth, row
        return 0, None

    def propose(self, tokens: Sequence[int], k: int) -> Lookup:
        self._extend(tokens)
        if k <= 0:
            return NO_LOOKUP
        tail = list(tokens[-self.counts.max_depth:])
        proposed: list[int] = []
        depths: list[int] = []
        while len(proposed) < k:
            depth, row = self._match(tail)
            if row is None:
                break
            token, count = max(row.items(), key=lambda item: (item[1], -item[0]))
            share = count / sum(row.values())
            if share < self.min_share:
                break
            depths.append(depth)
            proposed.append(token)
            tail = [*tail[1:], token] if len(tail) >= self.counts.max_depth else [*tail, token]
        if not proposed:
            return NO_LOOKUP
        return Lookup(tuple(proposed), tuple(depths))

    def finish(self, tokens: Sequence[int], prompt_length: int) -> None:
        if self.cache is not None:
            self.cache.add(tokens if self.cache_prompt else tokens[prompt_length:])
