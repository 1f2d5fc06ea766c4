"""specdec.attention: sdpa that keeps grouped-query key/value heads under a mask gives the logits
Hugging Face's sdpa gives, token for token, and load_model uses it only where it applies."""

from __future__ import annotations

import pytest
import torch

from specdec import attention
from specdec.kv_cache import SequenceCache
from specdec.models import ModelConfig, load_model

from tests import tiny_models


def _feeds(model, implementation: str, context: list[int], rows: list[int]) -> list[torch.Tensor]:
    """Logits of feeding `rows` tokens (each a separate pass) after `context`, then a long pass."""
    model.set_attn_implementation(implementation)
    cache = SequenceCache(model)
    out = [cache.feed(context)]
    for n in rows:
        out.append(cache.feed(list(range(5, 5 + n))))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grouped_query_logits_equal_hf_sdpa(dtype):
    model = tiny_models.make_model(seed=3, num_attention_heads=4, num_key_value_heads=2).to(dtype)
    model.set_attn_implementation("sdpa")
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # grouped
    context, rows = [1, *range(10, 40)], [1, 2, 3, 5, 9]
    expected = _feeds(model, "sdpa", context, rows)
    got = _feeds(model, attention.NAME, context, rows)
    for want, have in zip(expected, got):
        assert want.shape == have.shape
        torch.testing.assert_close(have, want, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-12)
        assert torch.equal(have.argmax(-1), want.argmax(-1))


def test_the_multi_token_path_is_the_one_taken(monkeypatch):
    """Without this, the test above could pass with every call handed back to HF's function."""
    model = tiny_models.make_model(seed=3, num_attention_heads=4, num_key_value_heads=2)
    delegated: list[int] = []
    original = attention.sdpa_attention_forward

    def counting(module, query, *args, **kwargs):
        delegated.append(query.shape[2])
        return original(module, query, *args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", counting)
    model.set_attn_implementation(attention.NAME)
    cache = SequenceCache(model)
    cache.feed([1, *range(10, 20)])  # a prompt: no mask (causal), HF's own path
    prompt_calls = len(delegated)
    cache.feed([5, 6, 7])  # three tokens after a cache: a mask, specdec's path
    assert prompt_calls == model.config.num_hidden_layers
    assert len(delegated) == prompt_calls


def test_load_model_switches_cpu_sdpa_models(tmp_path):
    model_dir = tiny_models.save(tiny_models.make_model(seed=1), tmp_path / "m", with_tokenizer=False)
    loaded = load_model(ModelConfig(str(model_dir), "target"))
    assert loaded.model.config._attn_implementation == attention.NAME


def test_other_implementations_are_left_alone():
    model = tiny_models.make_model(seed=1)
    model.set_attn_implementation("eager")
    attention.use_on_cpu(model)
    assert model.config._attn_implementation == "eager"
