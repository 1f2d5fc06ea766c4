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


AttentionInterface.register(NAME, sdpa_keeping_kv_heads)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_on_cpu(model: PreTrainedModel) -> None:
    """Switches a CPU model that uses sdpa to sdpa_keeping_kv_heads; leaves any other as it is."""
    if model.device.type != "cpu" or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, NotImplementedError) as error:  # a model without AttentionInterface support
        log.info("keeping sdpa attention for %s: %s", type(model).__name__, error)
