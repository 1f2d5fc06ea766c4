"""How many of a lookup's tokens a round verifies, and whether a hybrid round goes with the lookup
or with the model draft (docs/architecture.md, "Model-free drafts").

A lookup (specdec/lookup.py) proposes at no draft compute and over no hop: its only cost is the
verify rows it adds. So it is asked for as many tokens as the round may hold, and the choice comes
after it answers, from what it answered: each proposed token rests on a match of some length (the
context matched, the proposed tokens before it included), and a token continuing a long match is
accepted far more often than one after a short match. Acceptance is estimated per match-length
bucket (specdec/lookup_acceptance.py: a Beta posterior per bucket like the model draft's alpha).
The i-th token's alpha_i is its bucket's, and with the cost model of
orchestrator/k_controller.py at zero draft time and hop,

    k* = argmin over k = 0..L of T_round_lookup(k) / E(k; alpha_1..alpha_k)

(k = 0: a plain K = 0 round; L at most the controller's maximum K). k* is chosen at the
estimates themselves: on the default pair, taking each bucket one posterior sd optimistic (so that
a poor-looking bucket is retried now and then) verified more rows than it won back. A bucket that
stops being verified in a session keeps its estimate; the pool's figure, which new sessions start
from, still moves with the sessions that do verify it.

Hybrid: the lookup's k* is compared, at the alphas themselves, with the model draft's round at the
K the controller chose for it (its own alpha, draft time, hop and catch-up): the round goes with
whichever commits tokens at the lower expected seconds per token. Lookup rounds leave the model
draft's alpha and timings alone (they measured none of them) and add their tokens to what it must
catch up on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from orchestrator.k_controller import RoundCosts, seconds_per_token
from specdec.lookup_acceptance import LookupAcceptance


def lookup_costs(costs: RoundCosts) -> RoundCosts:
    """A round's costs when a lookup proposes: no draft time, no hop, nothing to catch up."""
    return replace(costs, t_draft=0.0, rtt_draft=0.0, catchup_seconds=0.0)


def best_lookup_k(alphas: Sequence[float], costs: RoundCosts) -> tuple[int, float]:
    """(k*, its seconds per token) over k = 0..len(alphas), alphas[i] for the (i + 1)-th token;
    costs as lookup_costs gives them. The smallest k on ties."""
    best, best_seconds = 0, seconds_per_token(1.0, 0, costs)
    for num in range(1, len(alphas) + 1):
        seconds = seconds_per_token(alphas[:num], num, costs)
        if seconds < best_seconds:
            best, best_seconds = num, seconds
    return best, best_seconds


def choose_lookup_k(acceptance: LookupAcceptance, match_lengths: Sequence[int], costs: RoundCosts | None,
                    model_seconds_per_token: float | None) -> int:
    """How many of a lookup's tokens to verify: 0 (the round goes without them: the model's, or
    K = 0) or k*; under hybrid only when k* is expected to commit tokens at fewer seconds each
    than the model's round (model_seconds_per_token; None: no model draft this round). costs: the
    session's round costs (any draft figures in them are ignored); None before the first verify:
    all of the lookup."""
    if not match_lengths:
        return 0
    if costs is None:
        return len(match_lengths)
    costs = lookup_costs(costs)
    num, seconds = best_lookup_k(acceptance.alphas(match_lengths), costs)
    if num == 0 or not math.isfinite(seconds):
        return 0
    if model_seconds_per_token is not None and not seconds < model_seconds_per_token:
        return 0
    return num
