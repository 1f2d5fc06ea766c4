"""The plain cluster, shared by the session and bad-input tests (one start of four processes)."""

from __future__ import annotations

import pytest

from reliability_support import (
    A_MAX_CACHED_TOKENS, A_MAX_SESSIONS, MAX_MESSAGE_BYTES, PLAIN_TTL_SECONDS, Service, start_all, stop_all,
)


@pytest.fixture(scope="session")
def plain_cluster(tiny_pair):
    """Target replicas A (small budget: 16 sessions, 20,000 cached tokens) and B (the defaults), a
    draft, an orchestrator that lists A first; started through the CLI, float32."""
    common = ["--session-ttl", str(PLAIN_TTL_SECONDS), "--grace-seconds", "30",
              "--max-message-bytes", str(MAX_MESSAGE_BYTES)]
    services = {
        "target_a": Service("target", ["--model", str(tiny_pair.target_dir), "--replica-id", "target-a",
                                       "--max-sessions", str(A_MAX_SESSIONS),
                                       "--max-cached-tokens", str(A_MAX_CACHED_TOKENS), *common]),
        "target_b": Service("target", ["--model", str(tiny_pair.target_dir), "--replica-id", "target-b", *common]),
        "draft": Service("draft", ["--model", str(tiny_pair.draft_dir), "--replica-id", "draft-0", *common]),
    }
    try:
        start_all(services.values())
        services["orchestrator"] = Service("orchestrator", [
            # A first: with equal loads the orchestrator tries it first.
            "--target", f"{services['target_a'].address},{services['target_b'].address}",
            "--draft", services["draft"].address, "--pool-refresh-seconds", "0.5",
            "--num-speculative-tokens", "3", "--max-message-bytes", str(MAX_MESSAGE_BYTES),
        ]).start()
        yield services
    finally:
        codes = stop_all(reversed(list(services.values())))
        assert all(code == 0 for code in codes.values()), codes
