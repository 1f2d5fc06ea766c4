"""Typed, frozen configuration of the distillation recipe."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

COMPUTE_DTYPES = ("auto", "float32", "bfloat16")  # auto: bfloat16 where the hardware has it natively


@dataclass(frozen=True)
class DistillConfig:
    """Everything `specdec distill` decides.

    The draft is `num_layers` Llama layers at the target's width, initialised from the target's
    first layers, with the target's embedding frozen and borrowed, and a head over only the token
    ids the target emitted in the training answers. The defaults are the run that made the
    committed default draft (80-110 minutes on a 2-core CPU, by its speed; see its TRAINING.md).
    """

    target: str  # "default" or a Hugging Face directory
    out_dir: Path
    num_prompts: int = 10000
    written_prompt_fraction: float = 0.5  # share of prompts the target writes itself
    # (written_prompts.py); the rest come from templates and Python's documentation (prompts.py)
    max_new_tokens: int = 96
    max_prompt_tokens: int = 384  # prompts longer than this (chat template included) are dropped
    generation_batch_size: int = 128
    generation_dtype: str = "auto"  # the target's dtype while it writes and answers the prompts:
    # auto = bfloat16 where the hardware computes it natively (CUDA, or a CPU with AVX512-BF16 or
    # AMX; on this project's CPU a batch-128 decode step is 3.8x faster than float32, generation
    # end to end 1.6x), else float32. The answers and their top-k logits (the labels) are that
    # copy's; the draft's init and the cost measurement use the float32 target.
    num_layers: int = 2
    train_dtype: str = "auto"  # the forward and backward passes of training run under autocast
    # in this dtype (auto: as generation_dtype; weights, gradients and the optimizer stay float32).
    # On this project's CPU (AMX) a bfloat16 training step takes 0.6x a float32 one.
    steps: int = 4000
    max_train_seconds: float | None = 3000.0  # stop training early; the LR schedule follows
    # whichever of steps or time runs out first (the default keeps a full run of the defaults
    # under two hours on a 2-core CPU, where the cap ends training first: 2,453 steps for v6)
    batch_size: int = 32
    learning_rate: float = 5e-4
    weight_decay: float = 0.0
    warmup_steps: int = 20
    soft_label_weight: float = 0.5  # weight of the KL term on the target's top-k logits
    soft_label_top_k: int = 8
    holdout_fraction: float = 0.08
    min_token_count: int = 3  # after training, the head keeps only ids the target emitted at
    # least this often in the training answers (training uses every emitted id)
    eval_every_steps: int = 100  # > 0: check a validation set (taken from the training answers)
    # this often and keep the best weights (early stopping against overfitting)
    validation_answers: int = 64
    eval_num_speculative_tokens: int = 4  # K of the teacher-forced τ simulation
    seed: int = 0
    device: str = "cpu"
    threads: int | None = None  # torch.set_num_threads; None leaves torch's default
    data_path: Path | None = None  # cache of generated answers: loaded if present, else written
    progress: bool = True

    def __post_init__(self) -> None:
        positive = ("num_prompts", "max_new_tokens", "max_prompt_tokens", "generation_batch_size",
                    "num_layers", "steps", "batch_size", "soft_label_top_k",
                    "eval_num_speculative_tokens", "min_token_count", "validation_answers")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.holdout_fraction < 1.0:
            raise ValueError(f"holdout_fraction must be in (0, 1), got {self.holdout_fraction}")
        if self.num_prompts < 2:
            raise ValueError("num_prompts must be >= 2 (one for training, one held out)")
        if not 0.0 <= self.written_prompt_fraction <= 1.0:
            raise ValueError("written_prompt_fraction must be in [0, 1], got "
                             f"{self.written_prompt_fraction}")
        for name in ("generation_dtype", "train_dtype"):
            if getattr(self, name) not in COMPUTE_DTYPES:
                raise ValueError(f"{name} must be one of {COMPUTE_DTYPES}, got "
                                 f"{getattr(self, name)!r}")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if not 0.0 <= self.soft_label_weight <= 1.0:
            raise ValueError(f"soft_label_weight must be in [0, 1], got {self.soft_label_weight}")
        if self.max_train_seconds is not None and self.max_train_seconds <= 0:
            raise ValueError("max_train_seconds must be > 0")
        if self.warmup_steps < 0 or self.eval_every_steps < 0:
            raise ValueError("warmup_steps and eval_every_steps must be >= 0")

    def to_json(self) -> dict:
        data = asdict(self)
        data["out_dir"] = str(self.out_dir)
        data["data_path"] = None if self.data_path is None else str(self.data_path)
        return data
