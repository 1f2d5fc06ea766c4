"""Does batching change greedy outputs on a real model? Greedy target-only decoding of the
benchmark prompts, each alone (a pass per token, batch 1) and all together (every session's next
row in one shared pass, as the target service batches them), in one process, for each dtype.

A row's logits differ between the two only by float rounding (the matrix multiplications see
more rows), so an output may differ only where the top two logits are within rounding of each
other. For every stream that differs the table gives the position of the first difference and
the gap between the top two logits of the batch-1 pass there: a near-tie (a gap about the size of
the dtype's rounding) is rounding; a large gap would be a bug.

    python benchmarks/batch_exactness.py                       # default target, ~3 min on 2 CPUs
    python benchmarks/batch_exactness.py --dtypes float32 --streams 8 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from common import environment, utc_stamp, write_results
from specdec.kv_cache import SequenceCache
from specdec.models import ModelConfig, load_model
from specdec.prompt_sets import BENCHMARK_PROMPTS
from specdec.ragged import Feed, forward

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default", help="a target directory or 'default'")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--streams", type=int, default=len(BENCHMARK_PROMPTS),
                        help=f"prompts decoded together (at most {len(BENCHMARK_PROMPTS)})")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    return parser.parse_args(argv)


def prompt_ids(loaded, count: int) -> list[list[int]]:
    prompts = []
    for prompt in BENCHMARK_PROMPTS[:count]:
        encoded = loaded.tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True)
        prompts.append(list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded))
    return prompts


def decode(model, prompts: list[list[int]], max_new_tokens: int, together: bool
           ) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Greedy tokens and each step's logits, per prompt."""
    caches = [SequenceCache(model) for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    pending = [list(p) for p in prompts]
    for _ in range(max_new_tokens):
        if together:
            rows = forward(model, [Feed(c, feed) for c, feed in zip(caches, pending)])
        else:
            rows = [forward(model, [Feed(c, feed)])[0] for c, feed in zip(caches, pending)]
        for i, row in enumerate(rows):
            logits[i].append(row[-1])
            tokens[i].append(int(row[-1].argmax()))
            pending[i] = [tokens[i][-1]]
    return tokens, logits


def compare(alone: list[list[int]], logits: list[list[torch.Tensor]], together: list[list[int]]) -> list[dict]:
    differences = []
    for stream, (a, b) in enumerate(zip(alone, together)):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None:
            continue
        top = logits[stream][first].topk(2).values
        differences.append({"stream": stream, "position": first, "top2_gap": float(top[0] - top[1]),
                            "alone": a[first], "together": b[first]})
    return differences


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = {"environment": environment(), "args": {k: str(v) for k, v in vars(args).items()}, "dtypes": {}}
    lines = [f"# python benchmarks/batch_exactness.py --streams {args.streams} "
             f"--max-new-tokens {args.max_new_tokens} --device {args.device}", "",
             "| dtype | streams | streams differing | first difference (position: top-2 logit gap at batch 1) |",
             "|---|---|---|---|"]
    for dtype in args.dtypes.split(","):
        loaded = load_model(ModelConfig(args.target, "target", device=args.device, dtype=dtype))
        prompts = prompt_ids(loaded, args.streams)
        print(f"{dtype}: decoding {len(prompts)} prompts alone, then together ...", file=sys.stderr)
        alone, alone_logits = decode(loaded.model, prompts, args.max_new_tokens, together=False)
        together, _ = decode(loaded.model, prompts, args.max_new_tokens, together=True)
        differences = compare(alone, alone_logits, together)
        results["dtypes"][dtype] = {"streams": len(prompts), "differences": differences}
        detail = ", ".join(f"{d['position']}: {d['top2_gap']:.3g}" for d in differences) or "none"
        lines.append(f"| {dtype} | {len(prompts)} | {len(differences)} | {detail} |")
    text = "\n".join(lines)
    print(text)
    write_results(args.out, f"batch-exactness-{utc_stamp()}", results, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
