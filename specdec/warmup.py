"""A model service's passes, run once before it serves.

A device's first pass of a shape costs far more than its later ones where the kernels it needs are
loaded and chosen lazily (CUDA loads each kernel module on first use, cuBLAS picks and sets up its
kernels per shape). Served cold, those costs land on the first requests, and on what the K
controller learns from them: a verify pass timed at many times its cost prices drafting out. So a
service runs each pass it will run (a prompt of two sessions, one session's verify of 1 to
max_rows rows, a decoding step of two sessions) on sessions of its own, once, before it reports
ready, and drops them.
"""

from __future__ import annotations

import logging
import time

import torch

from specdec.kv_cache import SequenceCache
from specdec.models import LoadedModel, ModelConfig, load_model
from specdec.ragged import Feed, forward

log = logging.getLogger(__name__)

PROMPT_TOKENS = 16
# Verify passes warmed at most: rows past this are rare (K >= 32) and a pass of them costs much on a CPU.
MAX_WARM_ROWS = 32


def warm_up(model: torch.nn.Module, max_rows: int) -> int:
    """Runs the passes (verify passes of 1 to min(max_rows, MAX_WARM_ROWS) rows); returns how many.
    The model's state is unchanged (its caches are its own)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    max_rows = min(max_rows, MAX_WARM_ROWS)
    started = time.perf_counter()
    vocabulary = model.get_input_embeddings().num_embeddings
    ids = [1 + i % (vocabulary - 1) for i in range(max(PROMPT_TOKENS, max_rows))]
    sessions = [SequenceCache(model), SequenceCache(model)]
    forward(model, [Feed(cache, ids[:PROMPT_TOKENS]) for cache in sessions])
    passes = 1
    for rows in range(1, max_rows + 1):  # a verify round of rows - 1 drafts
        forward(model, [Feed(sessions[0], ids[:rows], keep_all=True)])
        sessions[0].truncate(PROMPT_TOKENS)
        passes += 1
    forward(model, [Feed(cache, ids[:1]) for cache in sessions])
    passes += 1
    log.info("warmed up: %d passes (up to %d rows) in %.2f s", passes, max_rows, time.perf_counter() - started)
    return passes


def load_warm(config: ModelConfig, max_num_speculative_tokens: int) -> LoadedModel:
    """A model service's model: loaded, then warmed up for verify rounds of up to
    max_num_speculative_tokens drafts, before the service reports ready."""
    loaded = load_model(config)
    warm_up(loaded.model, max_num_speculative_tokens + 1)
    if loaded.head is not None:  # its first calls, of one session's rows and of several
        size = loaded.head.config.hidden_size
        for rows in (1, 4):
            loaded.head.draft(torch.zeros(rows, size), torch.zeros(rows, dtype=torch.long), max_num_speculative_tokens)
    return loaded
