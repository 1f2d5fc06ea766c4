"""Attention for feeding several tokens into a cache on a CPU: Hugging Face's sdpa, except that
grouped-query attention keeps its key/value heads when there is a mask.

A Verify of K drafts feeds K + 1 tokens after the cached ones, so the model builds a causal mask,
and with a mask Hugging Face's sdpa path copies every key/value head once per query head
(repeat_kv) before calling torch's scaled_dot_product_attention: per layer, the whole cache, twice.
On a CPU torch takes the mask with `enable_gqa=True` instead, and gives identical logits (a test
checks). The copies grow with the context: on SmolLM2-135M-Instruct (3 key/value heads for 9 query
heads), 2 CPUs, a pass over 2 tokens after 1,500 costs 1.24x a single-token step with them and
1.01x without, over 3 tokens 1.30x -> 1.10x; after 200 tokens 1.14x -> 1.05x
(benchmarks/verify_cost.py). That ratio is what a speculation round pays for its drafts: it is
T_verify(K + 1) in the K controller's cost model (docs/architecture.md, "Choosing K").

On CUDA Hugging Face's choice stands: there, a mask with `enable_gqa` leaves the fast kernels.
"""

from __future__ import annotations

import logging

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

log = logging.getLogger(__name__)

NAME = "specdec_sdpa"
RAGGED = "specdec_ragged"


def sdpa_keeping_kv_heads(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, H, T, D)
    key: torch.Tensor,  # (B, H_kv, S, D)
    value: torch.Tensor,  # (B, H_kv, S, D)
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None
    if not (grouped and plain and attention_mask is not None and query.shape[2] > 1
            and query.device.type == "cpu"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None  # (B, T, H, D)


def ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, H, N, D): the new rows of every session in the pass, packed
    key: torch.Tensor,  # (1, H_kv, N, D)
    value: torch.Tensor,  # (1, H_kv, N, D)
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    ragged=None,  # specdec.ragged.RaggedBatch
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of a ragged pass (specdec.ragged): each session's rows attend to its own cache
    and to its own earlier new rows; the model's mask is not used. It computes in the caches'
    dtype (float32 for a bfloat16 model on a CPU, specdec.kv_cache.attention_dtype) and returns
    the model's. Without `ragged` (a plain forward, such as Hugging Face's generate),
    sdpa_keeping_kv_heads."""
    if ragged is None:
        return sdpa_keeping_kv_heads(module, query, key, value, attention_mask, dropout=dropout,
                                     scaling=scaling, **kwargs)
    layer = module.layer_idx
    gqa = key.shape[1] != query.shape[1]
    dtype = query.dtype
    query = query.to(ragged.spans[0].cache.dtype)  # the caches' dtype (specdec.kv_cache.attention_dtype)
    rows = query[0]  # (H, N, D)
    lone_rows = None  # (H_kv, G, N, D): a lone row's query heads by key/value head, as a view
    if ragged.spans[0].calls:  # a batch-invariant pass (specdec.ragged): block rows
        kv_heads = key.shape[1]
        lone_rows = rows.view(kv_heads, rows.shape[0] // kv_heads, rows.shape[1], rows.shape[2])
    outputs = []  # (H, n, D) each
    for span in ragged.spans:
        new_keys, new_values = key[:, :, span.start:span.end], value[:, :, span.start:span.end]
        if not span.calls:
            keys, values = span.cache.append(layer, new_keys, new_values)
            outputs.append(torch.nn.functional.scaled_dot_product_attention(
                query[:, :, span.start:span.end], keys, values, attn_mask=span.mask, scale=scaling,
                enable_gqa=gqa)[0])
            continue
        # Batch-invariant (specdec.ragged): each call computes its rows as a pass that fed them
        # alone would.
        cached = len(span.cache)
        span.cache.write(layer, new_keys, new_values, room=span.room)
        for call in span.calls:
            first, end = span.start + call.first, span.start + call.end
            if call.bias is not None:
                keys_t, values = span.cache.padded(layer, call.bias.shape[-1])
                grouped = lone_rows[:, :, first] if end - first == 1 else rows[:, first:end]
                outputs.append(block_rows_attention(grouped, end - first, keys_t, values, call.bias, scaling))
                continue
            keys_t, values = span.cache.padded(layer, cached + call.end)
            outputs.append(torch.nn.functional.scaled_dot_product_attention(
                query[:, :, first:end], keys_t.transpose(1, 2).unsqueeze(0), values.unsqueeze(0),
                attn_mask=span.mask[call.first:call.end, :cached + call.end], scale=scaling, enable_gqa=gqa)[0])
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)  # (H, N, D)
    return output.transpose(0, 1).unsqueeze(0).to(dtype).contiguous(), None


def block_rows_attention(
    query: torch.Tensor,  # (H, n, D), or (H_kv, G, D) for one row: rows at consecutive positions in one block
    rows: int,  # n
    keys_t: torch.Tensor,  # (H_kv, D, L): the session's keys up to that block's end, transposed
    values: torch.Tensor,  # (H_kv, L, D)
    bias: torch.Tensor,  # (G n, L), G = H / H_kv: 0 where a row of a group sees the key, -inf past its position
    scaling: float | None,
) -> torch.Tensor:
    """Attention of rows that each see the keys up to their own position, computed over the
    keys up to the end of their block (the rest masked by `bias`) in plain batched products, the
    rows of each key/value head's query heads stacked: each row gets exactly the value it gets
    alone, however many rows share the call, where the products' kernels keep a row's value
    whatever rows are beside it (specdec.ragged.row_attention_invariant checks at load). torch's
    fused kernel does not (nor with a different number of keys, hence the padding to the block's
    end). Returns (H, n, D)."""
    kv_heads, dim = keys_t.shape[0], keys_t.shape[1]
    grouped = query.reshape(kv_heads, -1, dim)  # (H_kv, G n, D)
    scores = torch.baddbmm(bias, grouped, keys_t, alpha=dim ** -0.5 if scaling is None else scaling)
    output = torch.bmm(torch.softmax(scores, dim=-1), values)  # (H_kv, G n, D)
    return output.view(-1, rows, dim)


AttentionInterface.register(NAME, sdpa_keeping_kv_heads)
AttentionMaskInterface.register(NAME, sdpa_mask)
AttentionInterface.register(RAGGED, ragged_attention)
AttentionMaskInterface.register(RAGGED, sdpa_mask)


def use_ragged(model: PreTrainedModel) -> None:
    """Switches a model to ragged_attention, which the services' batched passes need (a plain
    forward still gets sdpa_keeping_kv_heads on a CPU, Hugging Face's sdpa elsewhere)."""
    try:
        model.set_attn_implementation(RAGGED)
    except (ValueError, NotImplementedError) as error:  # a model without AttentionInterface support
        raise ValueError(f"{type(model).__name__} does not support pluggable attention, which "
                         f"batched serving needs: {error}") from error
