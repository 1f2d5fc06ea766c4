"""The whole distillation recipe: prompts → target answers → trained draft → held-out report."""

from __future__ import annotations

import copy
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.distill.config import DistillConfig
from specdec.distill.data import (
    Example,
    encode_prompt,
    generate_examples,
    load_examples,
    save_examples,
)
from specdec.distill.evaluate import HeldOutReport, cost_ratio, evaluate_held_out
from specdec.distill.prompts import build_prompts
from specdec.distill.train import (
    init_draft_from_target,
    kept_ids_from_examples,
    prune_head,
    train_draft,
)
from specdec.distill.written_prompts import write_prompts
from specdec.draft_model import save_draft
from specdec.packed_linear import native_bfloat16


@dataclass(frozen=True)
class DistillResult:
    out_dir: Path
    held_out: HeldOutReport
    report: dict  # everything, as stored in specdec_draft.json under "training"


def resolve_target(target: str) -> Path:
    if target == "default":
        from specdec.default_model import resolve_default_target

        return resolve_default_target()
    path = Path(target)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--target {target}: not a Hugging Face model directory")
    return path


def _log(config: DistillConfig, message: str) -> None:
    del config  # reports print even with progress bars off
    print(f"[distill] {message}", flush=True)


def compute_dtype(choice: str, device: str) -> torch.dtype:
    """A COMPUTE_DTYPES choice as a torch dtype: auto is bfloat16 on CUDA or on a CPU that
    computes it natively (AVX512-BF16 or AMX), else float32."""
    if choice != "auto":
        return getattr(torch, choice)
    if device.startswith("cuda"):
        return torch.bfloat16
    return torch.bfloat16 if native_bfloat16() else torch.float32


def generation_dtype(config: DistillConfig) -> torch.dtype:
    """The dtype the target writes and answers prompts in (DistillConfig.generation_dtype)."""
    return compute_dtype(config.generation_dtype, config.device)


def build_prompt_ids(config: DistillConfig, target, tokenizer) -> list[list[int]]:
    """The tokenised distillation prompts: template ones plus ones the target writes itself."""
    num_written = round(config.num_prompts * config.written_prompt_fraction)
    written = write_prompts(target, tokenizer, num_written, config.generation_batch_size,
                            config.seed, progress=config.progress) if num_written else []
    _log(config, f"the target wrote {len(written)} prompts")
    texts = set(written)
    templated = [c for c in build_prompts(config.num_prompts * 2, seed=config.seed)
                 if c[-1]["content"] not in texts]
    conversations = [[{"role": "user", "content": text}] for text in written] + templated
    prompts = [ids for ids in (encode_prompt(tokenizer, c) for c in conversations)
               if len(ids) <= config.max_prompt_tokens]
    return prompts[:config.num_prompts]


def prepare_examples(config: DistillConfig, target, tokenizer,
                     ) -> tuple[list[Example], torch.dtype | None]:
    """Build and tokenise prompts, then let the target answer them (or load cached answers).

    Returns the examples and the dtype the target answered in (None for cached answers)."""
    if config.data_path is not None and Path(config.data_path).is_file():
        examples = load_examples(config.data_path)
        _log(config, f"loaded {len(examples)} cached answers from {config.data_path}")
        return examples[:config.num_prompts], None
    dtype = generation_dtype(config)
    # A lower-precision copy writes and answers the prompts; the float32 target stays for the rest.
    generator = target if dtype == torch.float32 else copy.deepcopy(target).to(dtype)
    prompts = build_prompt_ids(config, generator, tokenizer)
    _log(config, f"{len(prompts)} prompts; the target answers them (greedy, "
                 f"≤{config.max_new_tokens} new tokens, batches of {config.generation_batch_size}, "
                 f"{str(dtype).removeprefix('torch.')})")
    examples = generate_examples(generator, tokenizer, prompts, config.max_new_tokens,
                                 config.generation_batch_size, config.soft_label_top_k,
                                 progress=config.progress)
    examples = [e for e in examples if e.answer_ids]
    if config.data_path is not None:
        save_examples(examples, config.data_path)
    return examples, dtype


def split_examples(examples: list[Example], holdout_fraction: float, seed: int,
                   ) -> tuple[list[Example], list[Example]]:
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    num_held_out = max(1, round(len(examples) * holdout_fraction))
    held = [examples[i] for i in order[:num_held_out]]
    train = [examples[i] for i in order[num_held_out:]]
    if not train:
        raise ValueError("no training examples left after the held-out split")
    return train, held


def run_distill(config: DistillConfig) -> DistillResult:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if config.threads is not None:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    started = time.monotonic()
    target_dir = resolve_target(config.target)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    target = target.to(config.device).eval()

    generation_started = time.monotonic()
    examples, dtype = prepare_examples(config, target, tokenizer)
    generation_seconds = time.monotonic() - generation_started
    train, held = split_examples(examples, config.holdout_fraction, config.seed)
    eos = target.generation_config.eos_token_id
    extra = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    validation: list[Example] = []
    # Validation answers come out of the training answers; a small run gives up at most a quarter.
    num_validation = min(config.validation_answers, len(train) // 4) if config.eval_every_steps else 0
    if num_validation:
        validation, train = train[:num_validation], train[num_validation:]
    kept_ids = kept_ids_from_examples(train, extra)
    _log(config, f"{len(train)} training answers ({sum(len(e.answer_ids) for e in train)} "
                 f"tokens), {len(held)} held out; head over {kept_ids.numel()} token ids")

    draft = init_draft_from_target(target, config.num_layers, kept_ids).to(config.device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else extra[0]
    def validate(model) -> float:
        return evaluate_held_out(model, validation, config.eval_num_speculative_tokens,
                                 ).greedy_agreement

    training = train_draft(draft, train, config, pad_id, validate if validation else None,
                           autocast_dtype=compute_dtype(config.train_dtype, config.device))
    num_trained_ids = int(kept_ids.numel())
    if config.min_token_count > 1:
        kept_ids = kept_ids_from_examples(train, extra, config.min_token_count)
        prune_head(draft, kept_ids)
        _log(config, f"head pruned to {kept_ids.numel()} ids emitted ≥{config.min_token_count} "
                     f"times")
    held_out = evaluate_held_out(draft, held, config.eval_num_speculative_tokens)
    train_sample = evaluate_held_out(draft, train[:len(held)], config.eval_num_speculative_tokens)
    # c is measured on the CPU (the machine this recipe targets), whatever device trained.
    draft = draft.cpu()
    target = target.cpu()
    cost = cost_ratio(draft, target)
    report = {
        "recipe": "specdec.distill",
        "config": config.to_json(),
        "num_train_answers": len(train),
        "num_train_tokens": sum(len(e.answer_ids) for e in train),
        "num_held_out_answers": len(held),
        "num_validation_answers": len(validation),
        "num_trained_token_ids": num_trained_ids,
        "num_kept_token_ids": int(kept_ids.numel()),
        "generation_seconds": round(generation_seconds, 1),
        "generation_dtype": None if dtype is None else str(dtype).removeprefix("torch."),
        **training,
        "held_out": held_out.to_json(),
        "train_sample": train_sample.to_json(),
        "cost": cost,
        "total_seconds": round(time.monotonic() - started, 1),
    }
    reference = "default" if config.target == "default" else str(Path(target_dir).resolve())
    save_draft(draft, config.out_dir, target=reference, training=report)
    _log(config, "held-out: " + json.dumps(held_out.to_json()))
    _log(config, "cost: " + json.dumps(cost))
    _log(config, f"draft written to {config.out_dir} in {report['total_seconds']} s")
    return DistillResult(Path(config.out_dir), held_out, report)
