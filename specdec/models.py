"""Loading causal LMs and their tokenizers from a local directory or the default pair."""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from specdec import attention
from specdec.draft_head import DEFAULT_HEAD_DIR, DraftHead, HeadFormatError, is_head_dir, load_head
from specdec.errors import InvalidInput, Unavailable
from specdec.ragged import mark_batch_invariant
from specdec.packed_linear import (
    ANY_ROWS,
    MIN_PACKED_ROWS,
    Packing,
    check_row_counts,
    describe_packing,
    linear_weight_bytes,
    native_bfloat16,
    onednn_available,
    pack_fastest,
    packing_available,
    packing_text,
    packings_available,
)

log = logging.getLogger(__name__)

Role = Literal["target", "draft"]
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
DEFAULT_MODEL = "default"


@dataclass(frozen=True)
class ModelConfig:
    """Which model a service loads and where it runs."""

    model: str  # a Hugging Face model directory, or "default" for the default pair
    role: Role
    device: str = "cpu"
    dtype: str = "auto"  # auto: bfloat16 on CUDA and on a CPU with native bfloat16, else float32
    max_context: int = 0  # 0: the model's max_position_embeddings
    # How to pack the linear layers' weights (specdec/packed_linear.py): row counts for MKL's
    # packing, ANY_ROWS for oneDNN's, (): off; None, auto: where packing can run (a CPU; float32,
    # or bfloat16 with native bfloat16, oneDNN's only), the faster of the two on this machine,
    # measured at load.
    packed_rows: Packing | None = None
    # A target's draft head (specdec/draft_head.py): "auto" (the shipped head of the default
    # target, none for another model), "none", or a head directory.
    draft_head: str = "auto"

    def __post_init__(self) -> None:
        if self.role not in ("target", "draft"):
            raise ValueError(f"role must be target or draft, got {self.role!r}")
        if self.draft_head not in ("auto", "none") and self.role != "target":
            raise ValueError("only a target has a draft head")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.max_context < 0:
            raise ValueError("max_context must be >= 0")
        if self.packed_rows and self.packed_rows != ANY_ROWS:
            check_row_counts(self.packed_rows)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype to run in: an explicit one; auto: bfloat16 on CUDA and on a CPU that multiplies
        bfloat16 natively (avx512_bf16, AMX), float32 on any other CPU.

        On such a CPU a bfloat16 pass with oneDNN's packed weights costs about 0.7x a float32 one
        over several sessions' rows (SmolLM2-135M on 2 cores: 8 sessions' one-token steps 40 vs
        56 ms, the same sessions at K = 2 58 vs 89 ms) and its passes are batch-invariant
        (specdec.ragged): every row's logits are the bits a one-token step alone would give, so
        greedy output is exactly the target decoding alone in bfloat16, under any load. (Without
        that, bfloat16's coarse logits made a verify pass and a one-token step disagree on
        near-ties within a few dozen tokens.) Its output is the bfloat16 model's: `--dtype float32`
        serves the float32 model's, whose batched rows differ from one-token steps by float
        rounding (a flipped near-tie now and then).
        """
        if self.dtype == "auto":
            if self.device.startswith("cuda") or native_bfloat16():
                return torch.bfloat16
            return torch.float32
        return DTYPES[self.dtype]

    @property
    def packing_candidates(self) -> tuple[Packing, ...]:
        """The packings to choose from here (load_model measures which is faster where there are
        two); () where packing cannot run or is off."""
        available = packings_available(self.device, self.torch_dtype)
        if self.packed_rows is None:
            return available
        if not self.packed_rows:
            return ()
        wanted = self.packed_rows if self.packed_rows == ANY_ROWS else check_row_counts(self.packed_rows)
        runs_here = onednn_available if wanted == ANY_ROWS else packing_available
        if not runs_here(self.device, self.torch_dtype):
            log.warning("--packed-rows is ignored: %s needs a CPU, float32 and a torch built with "
                        "%s (here: %s, %s)", describe_packing(wanted),
                        "oneDNN" if wanted == ANY_ROWS else "MKL", self.device, self.torch_dtype)
            return ()
        return (wanted,)


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    model_id: str
    vocab_size: int  # width of the logits
    tokenizer_hash: str  # "" without a tokenizer
    eos_token_ids: tuple[int, ...]
    max_context: int
    dtype: str
    device: str
    linear_packing: str = ""  # as the Info field: "any", "8,17" or "" (not packed)
    head: DraftHead | None = None  # a target's draft head, in the model's dtype


def resolve_model_dir(model: str, role: Role) -> Path:
    """The directory behind a --model value."""
    if model == DEFAULT_MODEL:
        if role == "target":
            from specdec.default_model import resolve_default_target

            return resolve_default_target()
        from specdec.draft_model import DEFAULT_DRAFT_DIR

        return Path(DEFAULT_DRAFT_DIR)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file() and not _is_draft_dir(path):
        raise InvalidInput(
            f"{model!r} is not a model directory (no config.json); pass a local Hugging Face "
            f"model directory or 'default'"
        )
    return path


def _is_draft_dir(path: Path) -> bool:
    try:
        from specdec.draft_model import is_draft_dir
    except ImportError:
        return False
    return is_draft_dir(path)


def check_device(device: str) -> None:
    """Raises Unavailable if torch cannot run on `device` here (no CUDA build, no such GPU)."""
    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise Unavailable(f"device {device!r} is not available on this machine ({why}); use --device cpu")
    index, count = device.partition(":")[2], torch.cuda.device_count()
    if index and not (index.isdigit() and int(index) < count):
        raise Unavailable(f"device {device!r} is not available: this machine has {count} GPU(s), "
                          f"cuda:0 to cuda:{count - 1}")


def load_model(config: ModelConfig) -> LoadedModel:
    check_device(config.device)
    path = resolve_model_dir(config.model, config.role)
    dtype = config.torch_dtype
    if _is_draft_dir(path):
        from specdec.draft_model import load_draft, read_draft_spec, resolve_target_dir

        model = load_draft(path, dtype=dtype, device=config.device)
        # A draft stores only its own weights; its tokenizer is its target's unless it ships one.
        tokenizer = load_tokenizer(path) or load_tokenizer(
            resolve_target_dir(path, read_draft_spec(path).target))
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(config.device)
        tokenizer = load_tokenizer(path)
    model.eval()
    model.requires_grad_(False)
    head_dir = resolve_head_dir(config)
    head = None
    if head_dir is not None:  # before packing: the head copies the output head's rows it uses
        head = load_head(head_dir, model)
        head.requires_grad_(False)
        log.info("draft head %s: its drafts are verified in Decode passes where nothing else proposes",
                 head_dir)
    attention.use_ragged(model)
    packing = pack_fastest(model, config.packing_candidates)
    if mark_batch_invariant(model):
        log.info("passes are batch-invariant: every row's logits are exactly a one-token step's")
    if packing == ANY_ROWS:
        log.info("linear layers packed for oneDNN, for passes of any row count (a copy of %d MiB of "
                 "weights; --packed-rows off saves it)", linear_weight_bytes(model) // 2**20)
    elif packing:
        log.info("linear layers packed for MKL, for passes of %d to %d rows, each padded to the next "
                 "of %s (a copy of %d MiB of weights per row count; --packed-rows off saves it)",
                 MIN_PACKED_ROWS, packing[-1], ", ".join(map(str, packing)),
                 linear_weight_bytes(model) // 2**20)
    max_context = config.max_context or int(getattr(model.config, "max_position_embeddings", 2048))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=config.model,
        vocab_size=int(model.get_output_embeddings().out_features
                       if hasattr(model.get_output_embeddings(), "out_features")
                       else model.config.vocab_size),
        tokenizer_hash=tokenizer_hash(tokenizer) if tokenizer is not None else "",
        eos_token_ids=eos_token_ids(model, tokenizer),
        max_context=max_context,
        dtype=str(dtype).removeprefix("torch."),
        device=config.device,
        linear_packing=packing_text(packing),
        head=head,
    )


def resolve_head_dir(config: ModelConfig) -> Path | None:
    """The draft head directory a target loads (ModelConfig.draft_head), or None."""
    if config.role != "target" or config.draft_head == "none":
        return None
    if config.draft_head == "auto":
        return DEFAULT_HEAD_DIR if config.model == DEFAULT_MODEL and is_head_dir(DEFAULT_HEAD_DIR) else None
    path = Path(config.draft_head)
    if not is_head_dir(path):
        raise HeadFormatError(f"--draft-head {path}: not a draft head directory (no specdec_head.json)")
    return path


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved in a directory, or None if it has none (token-id prompts only)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((path / name).is_file() for name in names):
        return None
    return AutoTokenizer.from_pretrained(path)


def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 of what decides token ids: the vocabulary and the special tokens."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]),
        "special": sorted(str(token) for token in tokenizer.all_special_tokens),
    }
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> tuple[int, ...]:
    candidates = []
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        candidates.extend(value if isinstance(value, (list, tuple)) else [value])
    return tuple(sorted({int(v) for v in candidates}))


def tokenizer_files(tokenizer: PreTrainedTokenizerBase | None) -> list[tuple[str, bytes]]:
    """The files that rebuild this tokenizer with AutoTokenizer.from_pretrained."""
    if tokenizer is None:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return [(p.name, p.read_bytes()) for p in sorted(Path(tmp).iterdir()) if p.is_file()]


def tokenizer_from_files(files: list[tuple[str, bytes]]) -> PreTrainedTokenizerBase | None:
    if not files:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        for name, content in files:
            if "/" in name or name.startswith("."):
                raise ValueError(f"refusing tokenizer file name {name!r}")
            (Path(tmp) / name).write_bytes(content)
        return AutoTokenizer.from_pretrained(tmp)
