"""specdec/warmup.py: a model service's passes run once before it serves, on caches of their own:
every row count up to the limit, and the model's logits after it are what they were."""

from __future__ import annotations

import pytest
import torch

from specdec.kv_cache import SequenceCache
from specdec.ragged import forward
from specdec.warmup import PROMPT_TOKENS, warm_up


def test_warm_up_runs_each_pass_once_and_changes_nothing(tiny_pair, monkeypatch):
    from specdec.models import ModelConfig, load_model

    model = load_model(ModelConfig(str(tiny_pair.target_dir), "target", dtype="float64")).model
    prompt = [5, 9, 14, 3, 22]
    before = SequenceCache(model).feed(prompt)
    shapes: list[list[int]] = []
    real_forward = forward

    def recording(model_, feeds):
        shapes.append([len(feed.token_ids) for feed in feeds])
        return real_forward(model_, feeds)

    monkeypatch.setattr("specdec.warmup.forward", recording)
    assert warm_up(model, 5) == len(shapes) == 7
    assert shapes == [[PROMPT_TOKENS, PROMPT_TOKENS], [1], [2], [3], [4], [5], [1, 1]]
    assert torch.equal(SequenceCache(model).feed(prompt), before)
    with pytest.raises(ValueError, match="max_rows"):
        warm_up(model, 0)
