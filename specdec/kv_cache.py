"""A session's KV cache and the token ids it holds. Rollback is one call: truncate(length).

Each layer's keys and values live in a buffer with spare room at the end (doubled when full), so
feeding a token writes in place instead of copying the whole cache, and truncating only moves the
length. The room holds finite values (zeros, or the keys of truncated tokens): a batch-invariant
pass attends over keys padded into it, masked (specdec.ragged). Several sessions' caches are fed
in one forward pass by specdec.ragged.

The buffers hold the attention's dtype (attention_dtype): the model's, except float32 for a
bfloat16 or float16 model on a CPU, whose attention then runs in float32 (specdec.attention).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

_MIN_CAPACITY = 64
_FORK_ROOM = 16  # spare positions of a fork: a branch feeds a handful of tokens


def attention_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype a model's ragged attention computes in and its caches hold: float32 for a
    bfloat16 or float16 model on a CPU, else the model's own.

    torch's CPU attention kernel is slow in bfloat16 for the few query rows of a decoding step
    (SmolLM2-135M's 9 heads over 300 cached positions, 2 cores: 184 us a call against 39 us in
    float32; 1.1 ms against 0.15 ms over 2,000), and a pass runs one call per session and layer:
    in bfloat16 they took 80 % of a pass over 32 sessions' steps. Over a long prompt chunk the two
    cost the same. The cache then takes twice the memory of a bfloat16 one."""
    parameter = next(model.parameters())
    if parameter.device.type == "cpu" and parameter.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return parameter.dtype


def text_config(model: PreTrainedModel):
    """The config of the model's text decoder (a multimodal model nests it)."""
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


class SequenceCache:
    """KV cache of one sequence plus the ids fed into it, always the same length."""

    def __init__(self, model: PreTrainedModel) -> None:
        self._model = model
        self.num_layers = text_config(model).num_hidden_layers
        self.dtype = attention_dtype(model)
        self.token_ids: list[int] = []
        self._keys: list[torch.Tensor | None] = [None] * self.num_layers  # (1, H_kv, capacity, D)
        self._values: list[torch.Tensor | None] = [None] * self.num_layers
        # views without the batch dimension: keys transposed (H_kv, D, capacity), values (H_kv, capacity, D)
        self._flat: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.num_layers
        self._padded: list[tuple[int, torch.Tensor, torch.Tensor] | None] = [None] * self.num_layers
        from specdec.ragged import batch_invariant  # the forward pass builds on this module

        # A batch-invariant model's attention multiplies by the keys transposed
        # (specdec.attention.block_rows_attention): they are stored so, one row per head dimension,
        # behind the same (1, H_kv, capacity, D) view.
        self._keys_by_dimension = batch_invariant(model)

    def __len__(self) -> int:
        return len(self.token_ids)

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens."""
        if not 0 <= length <= len(self.token_ids):
            raise ValueError(f"cannot truncate {len(self.token_ids)} tokens to {length}")
        del self.token_ids[length:]

    def fork(self, length: int) -> SequenceCache:
        """A new cache holding a copy of this one's first `length` tokens: fed from there on, it
        leaves this cache as it is (a branch drafted ahead on a guessed outcome)."""
        if not 0 < length <= len(self.token_ids):
            raise ValueError(f"cannot fork {length} of {len(self.token_ids)} tokens")
        fork = SequenceCache(self._model)
        fork.token_ids = self.token_ids[:length]
        for i, (keys, values) in enumerate(zip(self._keys, self._values)):
            if keys is None or values is None:
                raise ValueError("the cache is empty")
            shape = (1, keys.shape[1], max(_MIN_CAPACITY, length + _FORK_ROOM), keys.shape[3])
            fork._keys[i], fork._values[i] = self._new_keys(keys, shape), values.new_zeros(shape)
            fork._keys[i][:, :, :length] = keys[:, :, :length]
            fork._values[i][:, :, :length] = values[:, :, :length]
            fork._flat[i] = (fork._keys[i][0].transpose(1, 2), fork._values[i][0])
        return fork

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values `layer` holds for the cached tokens, (1, H_kv, len(self), D)."""
        length = len(self.token_ids)
        if self._keys[layer] is None:
            raise ValueError("the cache is empty")
        return self._keys[layer][:, :, :length], self._values[layer][:, :, :length]

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes keys/values (1, H_kv, n, D) after the cached tokens of `layer`, in the cache's
        dtype; returns the layer's keys and values for all len(self) + n positions. The length
        itself moves in `extend`, once the whole pass is done."""
        self.write(layer, keys, values)
        end = len(self.token_ids) + keys.shape[2]
        return self._keys[layer][:, :, :end], self._values[layer][:, :, :end]

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, room: int = 0) -> None:
        """Writes as `append` does, returning nothing; the buffer then holds at least `room`
        positions (see `padded`)."""
        start = len(self.token_ids)
        end = start + keys.shape[2]
        buffer_k, buffer_v = self._keys[layer], self._values[layer]
        if buffer_k is None or buffer_k.shape[2] < max(end, room):
            capacity = max(_MIN_CAPACITY, end, room, 2 * (0 if buffer_k is None else buffer_k.shape[2]))
            shape = (1, keys.shape[1], capacity, keys.shape[3])
            grown_k = self._new_keys(keys, shape)
            grown_v = values.new_zeros(shape, dtype=self.dtype)
            if buffer_k is not None and start:
                grown_k[:, :, :start] = buffer_k[:, :, :start]
                grown_v[:, :, :start] = buffer_v[:, :, :start]
            self._keys[layer], self._values[layer] = buffer_k, buffer_v = grown_k, grown_v
            self._flat[layer] = (grown_k[0].transpose(1, 2), grown_v[0])
            self._padded[layer] = None
        buffer_k[:, :, start:end] = keys
        buffer_v[:, :, start:end] = values

    def _new_keys(self, like: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
        """A zeroed key buffer of `shape` (1, H_kv, capacity, D), stored by head dimension where
        the model's attention wants the keys transposed."""
        if not self._keys_by_dimension:
            return like.new_zeros(shape, dtype=self.dtype)
        return like.new_zeros((shape[0], shape[1], shape[3], shape[2]), dtype=self.dtype).transpose(2, 3)

    def padded(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer`'s keys, transposed, and values of its first `length` positions, past the cached
        ones too (finite there: zeros, or truncated tokens'), without the batch dimension:
        (H_kv, D, length) and (H_kv, length, D). The views are kept until the length or the buffer
        changes (a decoding step asks for the same block's 16 times)."""
        kept = self._padded[layer]
        if kept is not None and kept[0] == length:
            return kept[1], kept[2]
        flat = self._flat[layer]
        if flat is None or flat[1].shape[1] < length:
            raise ValueError(f"the cache holds no room for {length} positions")
        views = flat[0][:, :, :length], flat[1][:, :length]
        self._padded[layer] = (length, *views)
        return views

    def extend(self, token_ids: list[int]) -> None:
        """Records token_ids as fed (after every layer has appended their keys and values)."""
        self.token_ids.extend(token_ids)

    def feed(self, token_ids: list[int]) -> torch.Tensor:
        """Feeds tokens in one forward pass of this sequence alone; returns their logits, (T, V)."""
        from specdec.ragged import Feed, forward  # the forward pass builds on this module

        return forward(self._model, [Feed(self, list(token_ids), keep_all=True)])[0]
