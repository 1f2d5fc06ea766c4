"""How well drafts predict the target on the benchmark's prompts, per task kind.

The target answers every open-ended prompt of specdec/prompt_sets.py (the demo's and the
benchmark's; the input-grounded ones are benchmarks/bench_drafts.py's) greedily (batched,
in-process); each draft is then teacher-forced on those answers, which gives its greedy agreement
and τ at K (mean committed tokens per round) exactly as `specdec distill` reports them on its own
held-out split, but on the prompts that the benchmarks and the demo measure. No timing: this is
the acceptance side of the speedup, free of the machine's noise.

    python benchmarks/draft_agreement.py                               # the default draft
    python benchmarks/draft_agreement.py --draft old=/tmp/old --draft default
    python benchmarks/draft_agreement.py --head default    # and the target's draft head

A draft head (specdec/draft_head.py) is measured on the same answers from the target's own
hidden states: how often its first draft after the target's token is the target's next one (the
draft's greedy agreement, for a draft that knows the token just chosen), and its second given the
first.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdec.distill.data import encode_prompt, generate_examples
from specdec.distill.evaluate import evaluate_held_out
from specdec.prompt_sets import OPEN_ENDED_PROMPTS, TASK_KINDS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default", help="'default' or a model directory")
    parser.add_argument("--draft", action="append", default=None,
                        help="NAME=DIR or DIR or 'default' (repeatable; default: the default draft)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--head", action="append", default=[],
                        help="NAME=DIR or DIR or 'default': a draft head of the target to measure too (repeatable)")
    parser.add_argument("--k", type=int, default=4, help="K of the τ simulation")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    return parser.parse_args(argv)


def _named(spec: str) -> tuple[str, str]:
    name, _, path = spec.partition("=")
    return (name, path) if path else (spec, spec)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.distill.recipe import resolve_target
    from specdec.models import resolve_model_dir
    from specdec.draft_model import load_draft

    target_dir = resolve_target(args.target)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompts = [encode_prompt(tokenizer, list(p.messages)) for p in OPEN_ENDED_PROMPTS]
    examples = generate_examples(target, tokenizer, prompts, args.max_new_tokens, batch_size=len(prompts),
                                 top_k=1)
    by_kind = {kind: [e for p, e in zip(OPEN_ENDED_PROMPTS, examples) if p.kind == kind]
               for kind in TASK_KINDS}
    results: dict[str, dict] = {}
    for name, spec in map(_named, args.draft or ([] if args.head else ["default"])):
        draft = load_draft(resolve_model_dir(spec, "draft"), target_dir=target_dir).eval()
        figures = {kind: evaluate_held_out(draft, group, args.k).to_json() for kind, group in by_kind.items()}
        figures["all"] = evaluate_held_out(draft, examples, args.k).to_json()
        results[name] = figures
    heads: dict[str, dict] = {}
    for name, spec in map(_named, args.head):
        from specdec.distill.head import agreement, answer_positions
        from specdec.draft_head import DEFAULT_HEAD_DIR, load_head

        head = load_head(DEFAULT_HEAD_DIR if spec == "default" else Path(spec), target)
        heads[name] = {kind: dict(zip(("first", "second_given_first"), agreement(head, answer_positions(target, group))))
                       for kind, group in (("all", examples), *by_kind.items())}
    if results:
        print(f"| draft | {' | '.join(['all', *TASK_KINDS])} |")
        print(f"|---|{'---|' * (len(TASK_KINDS) + 1)}")
    for name, figures in results.items():
        cells = [f"{figures[k]['greedy_agreement']:.3f} / τ {figures[k]['mean_committed_per_round']:.2f}"
                 for k in ["all", *TASK_KINDS]]
        print(f"| {name} | {' | '.join(cells)} |")
    if results:
        print(f"(greedy agreement / τ at K={args.k}, teacher-forced on the target's greedy answers to the "
              f"{len(OPEN_ENDED_PROMPTS)} demo and benchmark prompts, ≤{args.max_new_tokens} tokens)")
    if heads:
        print(f"| head | {' | '.join(['all', *TASK_KINDS])} |")
        print(f"|---|{'---|' * (len(TASK_KINDS) + 1)}")
        for name, figures in heads.items():
            cells = [f"{figures[k]['first']:.3f} / {figures[k]['second_given_first']:.3f}" for k in ["all", *TASK_KINDS]]
            print(f"| {name} | {' | '.join(cells)} |")
        print("(a draft head's first draft right / its second right given the first, on the same answers, "
              "from the float32 target's hidden states)")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"k": args.k, "max_new_tokens": args.max_new_tokens,
                                        "num_prompts": len(OPEN_ENDED_PROMPTS), "drafts": results,
                                        "heads": heads}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
