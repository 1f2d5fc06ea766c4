"""`specdec distill-head`: train a draft head for a target on the target's own greedy answers."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.distill.config import COMPUTE_DTYPES
from specdec.distill.head import HeadDistillConfig
from specdec_cli.distill_cmd import add_run_arguments, add_target_arguments


def configure(parser: argparse.ArgumentParser) -> None:
    defaults = HeadDistillConfig(target="default", out_dir=Path("."))
    parser.description = (
        "Let the target answer prompts built offline, take its last hidden states over the "
        "answers, train a draft head on them (the drafts a target service verifies in its own "
        "Decode passes: `specdec serve target --draft-head DIR`), report how often its first draft "
        "is the target's next token on held-out answers, and write a head directory. The defaults "
        "made the default target's head (about 40 minutes on 2 CPU cores).")
    add_target_arguments(parser, "head")
    parser.add_argument("--num-prompts", type=int, default=defaults.num_prompts)
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--dtype", choices=COMPUTE_DTYPES, default=defaults.dtype,
                        help="the target's dtype for its answers and hidden states, and the training "
                             "passes' autocast (auto: bfloat16 on CUDA or a CPU with native bfloat16)")
    parser.add_argument("--inner-size", type=int, default=defaults.inner_size)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every)
    add_run_arguments(parser, defaults.seed, defaults.device)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from specdec.distill.head import run as run_head

    if args.threads:
        torch.set_num_threads(args.threads)
    record = run_head(HeadDistillConfig(
        target=args.target, out_dir=args.out, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
        dtype=args.dtype, inner_size=args.inner_size, steps=args.steps, batch_size=args.batch_size,
        learning_rate=args.learning_rate, eval_every=args.eval_every, seed=args.seed, device=args.device,
        data_path=args.data, progress=not args.no_progress))
    print(json.dumps({"out": str(args.out), **{k: v for k, v in record.items() if k != "curve"}}, indent=1))
    return 0
