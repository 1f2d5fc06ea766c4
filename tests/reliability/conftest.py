"""The plain cluster, shared by the session and bad-input tests (one start of four processes)."""

from __future__ import annotations

import pytest

from tests.reliability.reliability_support import (
    A_MAX_CACHED_TOKENS, A_MAX_SESSIONS, MAX_MESSAGE_BYTES, PLAIN_TTL_SECONDS, two_target_cluster,
)


@pytest.fixture(scope="session")
def plain_cluster(tiny_pair):
    """Target replicas A (small budget: 16 sessions, 20,000 cached tokens) and B (the defaults), a
    draft, an orchestrator that lists A first; started through the CLI, float32."""
    common = ["--session-ttl", str(PLAIN_TTL_SECONDS), "--grace-seconds", "30",
              "--max-message-bytes", str(MAX_MESSAGE_BYTES)]
    orchestrator = ["--pool-refresh-seconds", "0.5", "--num-speculative-tokens", "3",
                    "--max-message-bytes", str(MAX_MESSAGE_BYTES)]
    budget = ["--max-sessions", str(A_MAX_SESSIONS), "--max-cached-tokens", str(A_MAX_CACHED_TOKENS)]
    with two_target_cluster(tiny_pair, common, orchestrator, target_a_flags=budget) as services:
        yield services
