"""Per-request statistics, accumulated round by round (plain Python)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from specdec.protocol import CallTiming


class StatsObserver(Protocol):
    """Told of each call and round as the stats take them (orchestrator/telemetry.py's metrics)."""

    def call(self, hop: str, timing: CallTiming) -> None: ...

    def round(self, num_speculative_tokens: int, num_accepted: int) -> None: ...

    def method_round(self, method: str, num_speculative_tokens: int, num_accepted: int) -> None:
        """A drafted round's tokens by the method that proposed them (model, ngram, suffix)."""


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    committed_in_rounds: int = 0  # tokens committed by Verify rounds (the prefill's token excluded)
    num_speculative_tokens_per_round: list[int] = field(default_factory=list)
    num_accepted_per_round: list[int] = field(default_factory=list)
    wall_seconds: float = 0.0
    time_to_first_token_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    network_seconds: float = 0.0
    re_prefills: int = 0
    draft_unavailable_rounds: int = 0
    target_replica: str = ""
    draft_replica: str = ""
    controller_estimates: dict[str, float] = field(default_factory=dict)
    # By the method that proposed them ("model", "ngram", "suffix"): drafted and accepted tokens.
    drafted_by_method: dict[str, int] = field(default_factory=dict)
    accepted_by_method: dict[str, int] = field(default_factory=dict)
    # Pipelining: rounds that drafted ahead, next rounds that found their branch (hits) or not.
    pipelined_rounds: int = 0
    pipeline_hits: int = 0
    pipeline_misses: int = 0
    branches_drafted: int = 0
    fanout_per_round: list[int] = field(default_factory=list)
    decode_calls: int = 0  # target calls that decoded several K = 0 rounds at once
    decoded_tokens: int = 0  # tokens those calls committed (each a K = 0 round)
    # Streamed speculation: offers of drafts sent to the target's Decode, the passes that verified
    # offered drafts, the drafts they verified and those accepted; of those passes, the ones that
    # verified a branch's drafts.
    offers: int = 0
    offers_dropped: int = 0  # drafted, not sent: C had already left or passed their drafts
    offered_passes: int = 0
    offered_drafts: int = 0
    offered_accepted: int = 0
    offered_branch_passes: int = 0
    # Lookups in the target's Decode passes: passes that verified looked-up tokens, the tokens they
    # verified and those accepted.
    decode_lookup_passes: int = 0
    decode_lookup_drafts: int = 0
    decode_lookup_accepted: int = 0
    # Drafts of the target's draft head in its Decode passes: passes, drafts, accepted.
    decode_head_passes: int = 0
    decode_head_drafts: int = 0
    decode_head_accepted: int = 0
    shadow_probes: int = 0  # probes run beside a stretch of K = 0 rounds instead of as rounds
    observer: StatsObserver | None = field(default=None, repr=False, compare=False)

    def add_draft_call(self, timing: CallTiming) -> None:
        self.draft_seconds += timing.compute_seconds
        self.network_seconds += timing.network_seconds
        if self.observer is not None:
            self.observer.call("draft", timing)

    def add_target_call(self, timing: CallTiming) -> None:
        self.verify_seconds += timing.compute_seconds
        self.network_seconds += timing.network_seconds
        if self.observer is not None:
            self.observer.call("target", timing)

    def add_round(self, num_speculative_tokens: int, num_accepted: int, committed: int) -> None:
        if self.observer is not None:
            self.observer.round(num_speculative_tokens, num_accepted)
        self.rounds += 1
        self.num_speculative_tokens_per_round.append(num_speculative_tokens)
        self.num_accepted_per_round.append(num_accepted)
        self.drafted_tokens += num_speculative_tokens
        self.accepted_tokens += num_accepted
        self.committed_in_rounds += committed

    def add_method_round(self, method: str, num_speculative_tokens: int, num_accepted: int) -> None:
        if self.observer is not None:
            self.observer.method_round(method, num_speculative_tokens, num_accepted)
        self.drafted_by_method[method] = self.drafted_by_method.get(method, 0) + num_speculative_tokens
        self.accepted_by_method[method] = self.accepted_by_method.get(method, 0) + num_accepted

    @property
    def mean_accepted_length(self) -> float:
        """tau: committed tokens per round."""
        return self.committed_in_rounds / self.rounds if self.rounds else 0.0

    @property
    def rejections(self) -> int:
        """Rounds that ended in a rejection (n < K)."""
        return sum(n < k for k, n in zip(self.num_speculative_tokens_per_round, self.num_accepted_per_round))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0
