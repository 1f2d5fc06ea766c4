"""A session's KV cache and the token ids it holds. Rollback is one call: truncate(length)."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


class SequenceCache:
    """KV cache of one sequence (batch 1) plus the ids fed into it, always the same length."""

    def __init__(self, model: PreTrainedModel) -> None:
        self._model = model
        self._cache = DynamicCache(config=model.config)
        self.token_ids: list[int] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens."""
        remove = len(self.token_ids) - length
        if remove < 0:
            raise ValueError(f"cannot truncate {len(self.token_ids)} tokens to {length}")
        if remove:
            self._cache.crop(-remove)  # transformers 5: a negative count of tokens to drop
            del self.token_ids[length:]

    @torch.inference_mode()
    def feed(self, token_ids: list[int]) -> torch.Tensor:
        """Feeds tokens in one forward pass; returns their logits, (T, V)."""
        if not token_ids:
            raise ValueError("feed needs at least one token")
        device = self._model.device
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=device)  # (1, T)
        output = self._model(input_ids=input_ids, cache=self._cache, use_cache=True)
        self.token_ids.extend(token_ids)
        logits = output.logits[0]  # (T, V)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return logits.cpu()
