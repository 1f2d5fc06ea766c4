"""`specdec distill`: train a small draft for a target from the target's own answers."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.distill.config import COMPUTE_DTYPES, DistillConfig


def add_target_arguments(parser: argparse.ArgumentParser, made: str) -> None:
    """--target and --out of a distillation command (`made`: what --out receives)."""
    parser.add_argument("--target", required=True,
                        help="'default' (SmolLM2-135M-Instruct) or a Hugging Face model directory")
    parser.add_argument("--out", required=True, type=Path, help=f"output {made} directory")


def add_run_arguments(parser: argparse.ArgumentParser, seed: int, device: str) -> None:
    """Where and how a distillation command runs: its seed, device, torch threads, answers cache
    and progress bar."""
    parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--device", default=device)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--data", type=Path, default=None,
                        help="cache file of generated answers: reused if present, else written")
    parser.add_argument("--no-progress", action="store_true")


def configure(parser: argparse.ArgumentParser) -> None:
    defaults = DistillConfig(target="default", out_dir=Path("."))
    parser.description = (
        "Let the target write half of the prompts itself and answer them along with "
        "prompts built offline (everyday code, explanation, chat and translation "
        "requests, plus some from Python's documentation), train "
        "a small draft on its answers, report held-out greedy agreement and mean "
        "committed tokens per round, and write a specdec draft dir. The defaults "
        "reproduce the committed default draft (80-110 minutes on 2 CPU cores).")
    add_target_arguments(parser, "draft")
    parser.add_argument("--num-prompts", type=int, default=defaults.num_prompts)
    parser.add_argument("--written-prompt-fraction", type=float,
                        default=defaults.written_prompt_fraction,
                        help="share of prompts the target writes itself (0: templates only)")
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--max-prompt-tokens", type=int, default=defaults.max_prompt_tokens)
    parser.add_argument("--generation-batch-size", type=int,
                        default=defaults.generation_batch_size)
    parser.add_argument("--generation-dtype", choices=COMPUTE_DTYPES,
                        default=defaults.generation_dtype,
                        help="the target's dtype while it writes and answers prompts (auto: "
                             "bfloat16 on CUDA or a CPU with native bfloat16, else float32)")
    parser.add_argument("--layers", type=int, default=defaults.num_layers)
    parser.add_argument("--train-dtype", choices=COMPUTE_DTYPES, default=defaults.train_dtype,
                        help="autocast dtype of the training passes (auto: as --generation-dtype; "
                             "weights and optimizer stay float32)")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--max-train-seconds", type=float, default=defaults.max_train_seconds,
                        help="stop training after this long, whichever of --steps or this comes "
                             "first (0: no limit)")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    parser.add_argument("--soft-label-weight", type=float, default=defaults.soft_label_weight)
    parser.add_argument("--holdout-fraction", type=float, default=defaults.holdout_fraction)
    parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    parser.add_argument("--min-token-count", type=int, default=defaults.min_token_count,
                        help="head keeps token ids the target emitted at least this often")
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every_steps,
                        help="validate every N steps and keep the best weights (0: off)")
    parser.add_argument("--validation-answers", type=int, default=defaults.validation_answers)
    add_run_arguments(parser, defaults.seed, defaults.device)
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> DistillConfig:
    return DistillConfig(
        target=args.target,
        out_dir=args.out,
        num_prompts=args.num_prompts,
        written_prompt_fraction=args.written_prompt_fraction,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        generation_batch_size=args.generation_batch_size,
        generation_dtype=args.generation_dtype,
        num_layers=args.layers,
        train_dtype=args.train_dtype,
        steps=args.steps,
        max_train_seconds=args.max_train_seconds or None,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        soft_label_weight=args.soft_label_weight,
        holdout_fraction=args.holdout_fraction,
        weight_decay=args.weight_decay,
        min_token_count=args.min_token_count,
        eval_every_steps=args.eval_every,
        validation_answers=args.validation_answers,
        seed=args.seed,
        device=args.device,
        threads=args.threads,
        data_path=args.data,
        progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
    from specdec.distill.recipe import run_distill

    result = run_distill(config_from_args(args))
    print(json.dumps({"out": str(result.out_dir), "held_out": result.held_out.to_json(),
                      "cost": result.report["cost"]}, indent=1))
    return 0
