"""The specdec draft format: a small causal LM that borrows its target's frozen token embedding
and predicts only the token ids its target actually emits, yet presents full-vocabulary logits.

On disk a draft is a directory:

    specdec_draft.json   {"format": "specdec-draft", "format_version": 1,
                          "target": "default" | path (relative paths are relative to this dir),
                          "config": <LlamaConfig dict>, "kept_token_ids": [...],
                          "embedding_fingerprint": [16 floats], "training": {...}}
    model.safetensors    float16, the draft's OWN weights only (layers, final norm, restricted head);
                         the token embedding is read from the target's safetensors at load time.

In memory it is a plain `LlamaForCausalLM` whose `lm_head` is a `RestrictedHead`: logits are −inf
outside the kept ids, so softmax gives exact zeros there (lossless: a draft may put zero mass on any
token) and it works anywhere a causal LM does, including as `assistant_model` in Hugging Face's
assisted generation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

DRAFT_CONFIG_NAME = "specdec_draft.json"
DRAFT_WEIGHTS_NAME = "model.safetensors"
DRAFT_FORMAT = "specdec-draft"
DRAFT_FORMAT_VERSION = 1
EMBEDDING_KEY = "model.embed_tokens.weight"
# The draft trained for the default target (SmolLM2-135M-Instruct), shipped as package data.
DEFAULT_DRAFT_DIR = Path(__file__).resolve().parent / "assets" / "drafts" / "smollm2-135m-instruct"


class DraftFormatError(ValueError):
    """A draft directory is malformed or does not match the target it references."""


class RestrictedHead(nn.Module):
    """Output projection over a subset of the vocabulary, scattered into full-vocabulary logits."""

    def __init__(self, hidden_size: int, kept_token_ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        kept = torch.as_tensor(kept_token_ids, dtype=torch.long).unique(sorted=True)
        if kept.numel() == 0 or int(kept[-1]) >= vocab_size or int(kept[0]) < 0:
            raise DraftFormatError(f"kept token ids must be non-empty and inside [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.proj = nn.Linear(hidden_size, kept.numel(), bias=False)
        self.register_buffer("kept_token_ids", kept, persistent=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: (B, T, H) -> restricted: (B, T, N_kept) -> logits: (B, T, V)
        restricted = self.proj(hidden_states)
        logits = restricted.new_full((*restricted.shape[:-1], self.vocab_size), float("-inf"))
        return logits.index_copy(-1, self.kept_token_ids, restricted)

    def restricted_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> (B, T, N_kept): logits over kept ids only, for training."""
        return self.proj(hidden_states)


@dataclass(frozen=True)
class DraftSpec:
    """What specdec_draft.json holds."""

    config: LlamaConfig
    kept_token_ids: list[int]
    target: str
    embedding_fingerprint: list[float]
    training: dict

    def to_json(self) -> dict:
        return {
            "format": DRAFT_FORMAT,
            "format_version": DRAFT_FORMAT_VERSION,
            "target": self.target,
            "config": self.config.to_dict(),
            "kept_token_ids": list(self.kept_token_ids),
            "embedding_fingerprint": self.embedding_fingerprint,
            "training": self.training,
        }

    @classmethod
    def from_json(cls, data: dict) -> DraftSpec:
        if data.get("format") != DRAFT_FORMAT or data.get("format_version") != DRAFT_FORMAT_VERSION:
            raise DraftFormatError(
                f"not a {DRAFT_FORMAT} v{DRAFT_FORMAT_VERSION} file: "
                f"format={data.get('format')!r} version={data.get('format_version')!r}"
            )
        config_dict = dict(data["config"])
        config_dict.pop("model_type", None)
        return cls(
            config=LlamaConfig(**config_dict),
            kept_token_ids=[int(i) for i in data["kept_token_ids"]],
            target=str(data["target"]),
            embedding_fingerprint=[float(v) for v in data["embedding_fingerprint"]],
            training=dict(data.get("training", {})),
        )


FINGERPRINT_SIZE = 16


def embedding_fingerprint(embedding: torch.Tensor) -> list[float]:
    """A few fixed entries of the target's embedding, to refuse a draft paired with another
    target; compared with a tolerance so a float16 / bfloat16 copy of the same target passes."""
    flat = embedding.detach().reshape(-1)
    index = torch.arange(FINGERPRINT_SIZE) * (flat.numel() - 1) // (FINGERPRINT_SIZE - 1)
    return [float(v) for v in flat[index].float()]


def fingerprints_match(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-2,
                                               atol=1e-3)


def build_draft(config: LlamaConfig, kept_token_ids: torch.Tensor | list[int],
                embedding: torch.Tensor) -> LlamaForCausalLM:
    """A LlamaForCausalLM with `embedding` (V, H) installed frozen and a RestrictedHead.

    config.vocab_size and config.hidden_size must match the embedding's shape.
    """
    if tuple(embedding.shape) != (config.vocab_size, config.hidden_size):
        raise DraftFormatError(
            f"target embedding has shape {tuple(embedding.shape)}, draft expects "
            f"({config.vocab_size}, {config.hidden_size})"
        )
    config.tie_word_embeddings = False
    model = LlamaForCausalLM(config)
    model.model.embed_tokens.weight = nn.Parameter(
        embedding.detach().to(model.model.embed_tokens.weight.dtype).clone(), requires_grad=False
    )
    model.lm_head = RestrictedHead(config.hidden_size, torch.as_tensor(kept_token_ids),
                                   config.vocab_size)
    return model


def draft_config_from_target(target_config, num_layers: int) -> LlamaConfig:
    """A Llama config at the target's width and vocabulary with `num_layers` layers."""
    fields = target_config.to_dict()
    fields.pop("model_type", None)
    fields.pop("quantization_config", None)
    fields.pop("architectures", None)
    fields.pop("_name_or_path", None)
    fields.pop("_model_name_or_path", None)
    fields["num_hidden_layers"] = num_layers
    fields["tie_word_embeddings"] = False
    for key in ("layer_types",):  # per-layer lists sized for the target
        fields.pop(key, None)
    fields["architectures"] = ["LlamaForCausalLM"]
    return LlamaConfig(**fields)


def own_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The draft's weights minus the borrowed embedding."""
    return {k: v for k, v in model.state_dict().items() if k != EMBEDDING_KEY}


def save_draft(model: LlamaForCausalLM, out_dir: Path, target: str, training: dict | None = None,
               ) -> Path:
    """Write `model` (built by build_draft) to out_dir: json spec + float16 own weights."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    head = model.lm_head
    if not isinstance(head, RestrictedHead):
        raise DraftFormatError("save_draft expects a model whose lm_head is a RestrictedHead")
    tensors = {
        k: (v.to(torch.float16) if v.is_floating_point() else v).contiguous().cpu()
        for k, v in own_state_dict(model).items()
    }
    save_file(tensors, str(out_dir / DRAFT_WEIGHTS_NAME), metadata={"format": DRAFT_FORMAT})
    spec = DraftSpec(
        config=model.config,
        kept_token_ids=head.kept_token_ids.tolist(),
        target=target,
        embedding_fingerprint=embedding_fingerprint(model.model.embed_tokens.weight),
        training=training or {},
    )
    (out_dir / DRAFT_CONFIG_NAME).write_text(json.dumps(spec.to_json(), indent=1) + "\n")
    return out_dir


def is_draft_dir(path: str | Path) -> bool:
    """True if `path` is a directory in the specdec draft format."""
    return (Path(path) / DRAFT_CONFIG_NAME).is_file()


def read_draft_spec(path: str | Path) -> DraftSpec:
    return DraftSpec.from_json(json.loads((Path(path) / DRAFT_CONFIG_NAME).read_text()))


def resolve_target_dir(draft_dir: str | Path, target: str) -> Path:
    """The directory a draft's "target" field names ("default" → the default target)."""
    if target == "default":
        from specdec.default_model import resolve_default_target

        return resolve_default_target()
    target_path = Path(target)
    return target_path if target_path.is_absolute() else (Path(draft_dir) / target_path).resolve()


def load_target_embedding(target_dir: str | Path) -> torch.Tensor:
    """Read only the token embedding (V, H) from a Hugging Face safetensors directory."""
    target_dir = Path(target_dir)
    index_path = target_dir / "model.safetensors.index.json"
    if index_path.is_file():
        shard = json.loads(index_path.read_text())["weight_map"][EMBEDDING_KEY]
        weights_path = target_dir / shard
    else:
        weights_path = target_dir / "model.safetensors"
    if not weights_path.is_file():
        raise DraftFormatError(f"no safetensors weights in target directory {target_dir}")
    with safe_open(str(weights_path), framework="pt") as handle:
        if EMBEDDING_KEY not in handle.keys():
            raise DraftFormatError(f"{weights_path} has no {EMBEDDING_KEY}")
        return handle.get_tensor(EMBEDDING_KEY)


def load_draft(path: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", target_dir: str | Path | None = None,
               ) -> LlamaForCausalLM:
    """Load a draft directory, taking the embedding from its referenced target (or target_dir)."""
    path = Path(path)
    if not is_draft_dir(path):
        raise DraftFormatError(f"{path} is not a specdec draft directory (no {DRAFT_CONFIG_NAME})")
    spec = read_draft_spec(path)
    source = Path(target_dir) if target_dir is not None else resolve_target_dir(path, spec.target)
    embedding = load_target_embedding(source)
    if not fingerprints_match(embedding_fingerprint(embedding), spec.embedding_fingerprint):
        raise DraftFormatError(
            f"draft {path} was trained for a different target than {source} "
            f"(the target's token embedding does not match the draft's fingerprint)"
        )
    model = build_draft(spec.config, spec.kept_token_ids, embedding.float())
    own = load_file(str(path / DRAFT_WEIGHTS_NAME))
    missing, unexpected = model.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in own.items()}, strict=False
    )
    if unexpected or set(missing) - {EMBEDDING_KEY}:
        raise DraftFormatError(f"draft weights do not match its config: missing={missing} "
                               f"unexpected={unexpected}")
    model.config.name_or_path = str(path)
    return model.to(device=device, dtype=dtype).eval()
