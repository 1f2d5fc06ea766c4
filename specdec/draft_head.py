"""A draft head: a small network on the target's own last hidden state that drafts the tokens after
the one the target has just chosen, inside the target's own passes (no draft model, no hop).

A target pass scores position i: its last hidden state h_i (after the final norm, what the output
head reads) gives the logits from which C[i + 1] is chosen. The head takes h_i and the embedding of
that token and predicts the token after it:

    s_1 = norm(h_i + down(silu(up([h_i ; embed(C[i + 1])]))))     draft d_1 = argmax(s_1 W^T)
    s_2 = norm(s_1 + down(silu(up([s_1 ; embed(d_1)]))))           draft d_2 = argmax(s_2 W^T) ...

W holds the target's output-head rows of the head's token ids (the ids its training answers used),
embed is the target's input embedding: the head's own weights are `up`, `down` and `norm` only.
Its drafts are verified by the target's next pass like any other (one-hot q~ when sampling), so
the output is the target's whatever the head proposes; what the head changes is how many tokens a
pass commits. Each draft carries its softmax probability over the head's ids (its chance), which
says how many of a chain are worth a verify row each.

On disk a head is a directory:

    specdec_head.json   {"format": "specdec-draft-head", "format_version": 1,
                         "hidden_size": 576, "inner_size": 1536, "vocab_size": 49152,
                         "rms_norm_eps": 1e-5, "token_ids": [...], "training": {...}}
    head.safetensors    float16: up.weight, up.bias, down.weight, down.bias, norm.weight
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specdec.errors import InvalidInput
from specdec.kv_cache import text_config

HEAD_CONFIG_NAME = "specdec_head.json"
HEAD_WEIGHTS_NAME = "head.safetensors"
HEAD_FORMAT = "specdec-draft-head"
HEAD_FORMAT_VERSION = 1
# The head trained for the default target (SmolLM2-135M-Instruct), shipped as package data.
DEFAULT_HEAD_DIR = Path(__file__).resolve().parent / "assets" / "heads" / "smollm2-135m-instruct"


class HeadFormatError(InvalidInput):
    """A head directory is malformed or does not fit the target it is loaded for (`specdec serve`
    says so in one line)."""


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    inner_size: int
    vocab_size: int
    token_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-5


class DraftHead(nn.Module):
    """The head's weights with the target's embedding and output rows for its ids."""

    def __init__(self, config: HeadConfig, embedding: torch.Tensor, output: torch.Tensor) -> None:
        super().__init__()
        size = config.hidden_size
        if embedding.shape != (config.vocab_size, size) or output.shape != (config.vocab_size, size):
            raise HeadFormatError(
                f"the head is for a target of {config.vocab_size} tokens x {size}, this target's embedding is "
                f"{tuple(embedding.shape)} and its output head {tuple(output.shape)}")
        ids = torch.tensor(config.token_ids, dtype=torch.long)
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size:
            raise HeadFormatError(f"a head's token ids must be non-empty and inside [0, {config.vocab_size})")
        self.config = config
        self.up = nn.Linear(2 * size, config.inner_size)
        self.down = nn.Linear(config.inner_size, size)
        self.norm = nn.RMSNorm(size, eps=config.rms_norm_eps)
        self.register_buffer("token_ids", ids, persistent=False)
        # Not parameters: the target's, read (the embedding) or copied for the head's ids (output).
        self.embedding = embedding.detach()
        self.register_buffer("output", output.detach()[ids].clone(), persistent=False)

    def step(self, state: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, H) states and (n,) token ids -> the next states (n, H) and their logits over the
        head's ids (n, len(token_ids))."""
        joined = torch.cat([state, self.embedding[token_ids].to(state.dtype)], dim=-1)
        state = self.norm(state + self.down(nn.functional.silu(self.up(joined))))
        return state, state @ self.output.T

    @torch.no_grad()
    def draft(self, hidden: torch.Tensor, token_ids: torch.Tensor, depth: int,
              min_chance: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy chains of up to `depth` drafts after each row's token: hidden (n, H), the
        target's last hidden states at the rows that chose token_ids (n,). -> (draft ids (n, d)
        long, chances (n, d) float32: each draft's probability over the head's ids), d <= depth:
        the chains stop once every row's chance, multiplied along its drafts, is below
        min_chance (a step costs about a fortieth of a target pass: none is run in vain)."""
        param = self.up.weight
        state = hidden.to(device=param.device, dtype=param.dtype)
        tokens = token_ids.to(param.device)
        drafts, chances = [], []
        together = torch.ones(len(tokens), device=param.device)
        for _ in range(depth):
            state, logits = self.step(state, tokens)
            probs = torch.softmax(logits.float(), dim=-1)
            chance, index = probs.max(dim=-1)
            tokens = self.token_ids[index]
            drafts.append(tokens)
            chances.append(chance)
            together = together * chance
            if not bool((together >= min_chance).any()):
                break
        return torch.stack(drafts, dim=1).cpu(), torch.stack(chances, dim=1).cpu()


def target_rows(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and output head weights, (V, H) each (one tensor if tied)."""
    return model.get_input_embeddings().weight, model.get_output_embeddings().weight


def new_head(model: nn.Module, token_ids: list[int], inner_size: int) -> DraftHead:
    """An untrained head for `model` (its `down` projection zero: it starts as the identity on the
    hidden state), in float32 on the model's device."""
    embedding, output = target_rows(model)
    text = text_config(model)
    config = HeadConfig(hidden_size=embedding.shape[1], inner_size=inner_size, vocab_size=embedding.shape[0],
                        token_ids=tuple(sorted(set(token_ids))),
                        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-5)))
    head = DraftHead(config, embedding.float(), output.float())
    nn.init.zeros_(head.down.weight)
    nn.init.zeros_(head.down.bias)
    return head.to(embedding.device)


def save_head(head: DraftHead, out_dir: Path, training: dict | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    config = head.config
    meta = {"format": HEAD_FORMAT, "format_version": HEAD_FORMAT_VERSION, "hidden_size": config.hidden_size,
            "inner_size": config.inner_size, "vocab_size": config.vocab_size, "rms_norm_eps": config.rms_norm_eps,
            "token_ids": list(config.token_ids), "training": training or {}}
    (out_dir / HEAD_CONFIG_NAME).write_text(json.dumps(meta, indent=1) + "\n")
    weights = {name: tensor.detach().to("cpu", torch.float16).contiguous()
               for name, tensor in head.state_dict().items()}
    save_file(weights, str(out_dir / HEAD_WEIGHTS_NAME))


def is_head_dir(path: Path) -> bool:
    return (path / HEAD_CONFIG_NAME).is_file()


def load_head(path: Path, model: nn.Module) -> DraftHead:
    """The head in directory `path`, for the loaded target `model`, in the model's dtype and on
    its device. Raises HeadFormatError if it is not a head or was made for another shape."""
    config_path = path / HEAD_CONFIG_NAME
    if not config_path.is_file():
        raise HeadFormatError(f"{path} is not a draft head directory (no {HEAD_CONFIG_NAME})")
    meta = json.loads(config_path.read_text())
    if meta.get("format") != HEAD_FORMAT or meta.get("format_version") != HEAD_FORMAT_VERSION:
        raise HeadFormatError(f"{config_path}: not a {HEAD_FORMAT} v{HEAD_FORMAT_VERSION} file")
    config = HeadConfig(hidden_size=int(meta["hidden_size"]), inner_size=int(meta["inner_size"]),
                        vocab_size=int(meta["vocab_size"]), token_ids=tuple(int(i) for i in meta["token_ids"]),
                        rms_norm_eps=float(meta.get("rms_norm_eps", 1e-5)))
    embedding, output = target_rows(model)
    head = DraftHead(config, embedding, output)
    state = load_file(str(path / HEAD_WEIGHTS_NAME))
    missing = set(head.state_dict()) ^ set(state)
    if missing:
        raise HeadFormatError(f"{path / HEAD_WEIGHTS_NAME}: weights {sorted(missing)} do not match the format")
    head.load_state_dict(state)
    param = next(model.parameters())
    return head.to(device=param.device, dtype=param.dtype).eval()
