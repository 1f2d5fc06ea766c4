"""specdec.attention: the services' ragged attention gives the logits Hugging Face's sdpa gives,
token for token, and its plain-forward fallback (sdpa that keeps grouped-query key/value heads
under a mask) does too; load_model switches every model to it."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache
from transformers.masking_utils import sdpa_mask

from specdec import attention, kv_cache
from specdec.kv_cache import SequenceCache
from specdec.models import ModelConfig, load_model

from tests import tiny_models


def _hf_feeds(model, implementation: str, context: list[int], rows: list[int]) -> list[torch.Tensor]:
    """Logits of feeding `context`, then `rows` tokens (each a separate pass), through Hugging
    Face's own cache and forward with the given attention implementation."""
    model.set_attn_implementation(implementation)
    cache = DynamicCache(config=model.config)
    out = []
    for tokens in [context, *(list(range(5, 5 + n)) for n in rows)]:
        logits = model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True).logits[0]
        out.append(logits)
    return out


def _ragged_feeds(model, context: list[int], rows: list[int]) -> list[torch.Tensor]:
    attention.use_ragged(model)
    cache = SequenceCache(model)
    return [cache.feed(context), *(cache.feed(list(range(5, 5 + n))) for n in rows)]


def _assert_same(got: list[torch.Tensor], expected: list[torch.Tensor], dtype: torch.dtype) -> None:
    for want, have in zip(expected, got, strict=True):
        assert want.shape == have.shape
        torch.testing.assert_close(have, want, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-12)
        assert torch.equal(have.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ragged_logits_equal_hf_sdpa(dtype):
    model = tiny_models.make_model(seed=3, num_attention_heads=4, num_key_value_heads=2).to(dtype)
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # grouped
    context, rows = [1, *range(10, 40)], [1, 2, 3, 5, 9]
    expected = _hf_feeds(model, "sdpa", context, rows)
    _assert_same(_ragged_feeds(model, context, rows), expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_plain_forward_fallback_equals_hf_sdpa(dtype):
    """Without a ragged batch (Hugging Face's generate, say) the implementation is sdpa that keeps
    key/value heads grouped under a mask: same logits as Hugging Face's."""
    model = tiny_models.make_model(seed=3, num_attention_heads=4, num_key_value_heads=2).to(dtype)
    context, rows = [1, *range(10, 40)], [1, 2, 3, 5, 9]
    expected = _hf_feeds(model, "sdpa", context, rows)
    _assert_same(_hf_feeds(model, attention.RAGGED, context, rows), expected, dtype)


def test_the_multi_token_path_is_the_one_taken(monkeypatch):
    """Without this, the fallback test could pass with every call handed back to HF's function."""
    model = tiny_models.make_model(seed=3, num_attention_heads=4, num_key_value_heads=2)
    delegated: list[int] = []
    original = attention.sdpa_attention_forward

    def counting(module, query, *args, **kwargs):
        delegated.append(query.shape[2])
        return original(module, query, *args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", counting)
    model.set_attn_implementation(attention.RAGGED)
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([[1, *range(10, 20)]]), cache=cache, use_cache=True)  # HF's path
    prompt_calls = len(delegated)
    model(input_ids=torch.tensor([[5, 6, 7]]), cache=cache, use_cache=True)  # a mask: specdec's
    assert prompt_calls == model.config.num_hidden_layers
    assert len(delegated) == prompt_calls
    SequenceCache(model).feed([1, 2, 3])  # a ragged pass never delegates
    assert len(delegated) == prompt_calls


def test_load_model_switches_to_ragged_attention(tmp_path):
    model_dir = tiny_models.save(tiny_models.make_model(seed=1), tmp_path / "m", with_tokenizer=False)
    loaded = load_model(ModelConfig(str(model_dir), "target"))
    assert loaded.model.config._attn_implementation == attention.RAGGED


def test_a_pass_refuses_a_model_without_ragged_attention():
    model = tiny_models.make_model(seed=1)
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="specdec_ragged"):
        SequenceCache(model).feed([1, 2, 3])
    attention.use_ragged(model)
    assert SequenceCache(model).feed([1, 2, 3]).shape[0] == 3


def _sdpa_in_float32(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Hugging Face's sdpa with query, keys and values cast to float32 and the output cast back:
    the reference for a half-precision model's ragged attention on a CPU."""
    output, _ = attention.sdpa_attention_forward(module, query.float(), key.float(), value.float(),
                                                 attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return output.to(query.dtype), None


def test_a_bfloat16_model_attends_in_float32_on_a_cpu():
    """A bfloat16 model's caches hold float32 on a CPU and its ragged attention computes in it:
    the logits are those of Hugging Face's forward with its attention done in float32 (to within
    the kernels' order of summation), not those of bfloat16 attention."""
    model = tiny_models.make_model(seed=3, num_attention_heads=4, num_key_value_heads=2).to(torch.bfloat16)
    assert kv_cache.attention_dtype(model) == torch.float32
    assert kv_cache.attention_dtype(model.to(torch.float64)) == torch.float64
    model.to(torch.bfloat16)
    transformers.AttentionInterface.register("test_sdpa_float32", _sdpa_in_float32)
    transformers.AttentionMaskInterface.register("test_sdpa_float32", sdpa_mask)
    context, rows = [1, *(10 + i % 40 for i in range(190))], [1, 1, 3, 1, 5]
    in_float32 = _hf_feeds(model, "test_sdpa_float32", context, rows)
    in_bfloat16 = _hf_feeds(model, "sdpa", context, rows)
    attention.use_ragged(model)
    cache = SequenceCache(model)
    ragged = [cache.feed(context), *(cache.feed(list(range(5, 5 + n))) for n in rows)]
    assert cache.layer(0)[0].dtype == torch.float32
    closer = 0
    for got, reference, bfloat16 in zip(ragged, in_float32, in_bfloat16, strict=True):
        torch.testing.assert_close(got, reference.float(), rtol=0, atol=0.05)
        closer += (got - reference.float()).abs().max() < (got - bfloat16.float()).abs().max()
    assert closer == len(ragged)
