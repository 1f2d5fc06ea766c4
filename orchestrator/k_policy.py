"""The seam between the orchestrator loop and whatever chooses K each round.

The loop asks a policy for K before each round and reports what the round measured after it.
Fixed K and K = 0 live here; the adaptive controller (DESIGN.md section 4) implements the same
protocol in orchestrator/k_controller.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class RoundObservation:
    """What one guess-verify round measured. Times in seconds."""

    num_speculative_tokens: int  # K used this round (0: no draft call)
    num_accepted: int  # n in [0, K]
    acceptance_signal: tuple[float, ...]  # per draft position, from the target (len K)
    draft_compute_seconds: float  # server-reported; 0 when K = 0
    draft_wall_seconds: float  # client wall time of the Propose call; 0 when K = 0
    draft_fed_tokens: int  # tokens the draft fed this round: catch-up + K - 1 drafts
    verify_compute_seconds: float  # server-reported time of the one forward pass over K + 1
    verify_wall_seconds: float  # client wall time of the Verify call


class KPolicy(Protocol):
    def choose(self, max_num_speculative_tokens: int) -> int:
        """K for the next round, in [0, max_num_speculative_tokens].

        max_num_speculative_tokens already accounts for the tokens left (K <= remaining - 1), the
        servers' limit, and draft availability (0 when no draft replica can serve).
        """

    def observe(self, observation: RoundObservation) -> None:
        """Record one finished round."""

    def estimates(self) -> dict[str, float]:
        """Current estimates by name, reported in the request's stats."""


@dataclass
class FixedK:
    """The same K every round (K = 0 is target-only decoding)."""

    num_speculative_tokens: int

    def choose(self, max_num_speculative_tokens: int) -> int:
        return max(0, min(self.num_speculative_tokens, max_num_speculative_tokens))

    def observe(self, observation: RoundObservation) -> None:
        pass

    def estimates(self) -> dict[str, float]:
        return {}
