"""What a target pass over n tokens costs relative to one (T_verify(n) / T_verify(1), the verify
cost in docs/architecture.md, "Choosing K"), through Hugging Face's own cache and sdpa attention and
through specdec's (specdec/kv_cache.py and the ragged attention of specdec/attention.py, which
keeps grouped-query key/value heads unrepeated under a mask), and specdec's with the linear
layers' weights packed (specdec/packed_linear.py): for oneDNN, one copy for any row count, and for
MKL, per row count (--packed-rows); a model service on a CPU in float32 runs whichever of the two
is faster there. All alternating in one process.

Each measurement feeds n tokens after a cache of --context tokens and crops them off again; the
two attention implementations take turns repetition by repetition, so a machine that speeds up or
slows down affects both alike. Also checks that both give the same logits.

    python benchmarks/verify_cost.py                      # the default target, about a minute
    python benchmarks/verify_cost.py --threads 1 --rows 1,2,3,4,5,8
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from specdec import attention
from specdec.kv_cache import SequenceCache
from specdec.models import ModelConfig, load_model
from specdec.packed_linear import (
    ANY_ROWS,
    DEFAULT_PACKED_ROWS,
    install_packed,
    onednn_available,
    pack_linears,
    packing_available,
    packing_text,
    unpack_linears,
)

IMPLEMENTATIONS = ("hf sdpa", "specdec")
ONEDNN, MKL = "specdec, packed for oneDNN", "specdec, packed for MKL"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="a target directory or 'default'")
    parser.add_argument("--role", default="target", choices=["target", "draft"])
    parser.add_argument("--dtype", default="auto", help="as a model service's --dtype (default auto)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--context", type=int, default=200, help="tokens in the cache before each pass")
    parser.add_argument("--rows", default="1,2,3,4,5,6,8", help="tokens per pass, comma-separated")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--packed-rows", default=packing_text(DEFAULT_PACKED_ROWS),
                        help="row counts of the MKL packing's column (oneDNN's serves any)")
    parser.add_argument("--out", type=Path, default=None, help="append the table to this file")
    return parser.parse_args(argv)


class HfCache:
    """Hugging Face's own cache and forward with its sdpa attention: the reference."""

    def __init__(self, model) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)

    @torch.inference_mode()
    def feed(self, tokens: list[int]) -> torch.Tensor:
        self.model.set_attn_implementation("sdpa")
        try:
            output = self.model(input_ids=torch.tensor([tokens]), cache=self.cache, use_cache=True)
        finally:
            attention.use_ragged(self.model)
        return output.logits[0]

    def truncate(self, length: int) -> None:
        if length < len(self):
            self.cache.crop(length - len(self))  # transformers 5: a negative count to drop

    def __len__(self) -> int:
        return self.cache.get_seq_length()


def pass_seconds(cache: SequenceCache | HfCache, tokens: list[int]) -> tuple[float, torch.Tensor]:
    started = time.perf_counter()
    logits = cache.feed(tokens)
    elapsed = time.perf_counter() - started
    cache.truncate(len(cache) - len(tokens))
    return elapsed, logits


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    model = load_model(ModelConfig(args.model, args.role, dtype=args.dtype, packed_rows=())).model
    packings = {}  # column -> the packed forwards, installed for that column's passes only
    if onednn_available("cpu", model.dtype):
        packings[ONEDNN] = pack_linears(model, ANY_ROWS)
    if packing_available("cpu", model.dtype):
        packings[MKL] = pack_linears(model, [int(r) for r in args.packed_rows.split(",")])
    unpack_linears(model)
    if not packings:
        print(f"no packed columns: packed linears need float32 and a torch with oneDNN or MKL "
              f"(here {model.dtype})")
    implementations = IMPLEMENTATIONS + tuple(packings)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    low, high = min(100, vocab // 2), min(20000, vocab)  # ordinary tokens, no special ones
    context = torch.randint(low, high, (args.context,), generator=generator).tolist()
    fed = torch.randint(low, high, (max(rows),), generator=generator).tolist()
    caches = {"hf sdpa": HfCache(model), **{name: SequenceCache(model) for name in implementations[1:]}}
    for cache in caches.values():
        cache.feed(context)
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in rows} for name in implementations}
    attention_difference, packing_difference = 0.0, dict.fromkeys(packings, 0.0)
    for repeat in range(args.repeats + 1):  # the first round warms up and is not kept
        for n in rows:
            logits = {}
            for name in implementations:
                if name in packings:
                    install_packed(packings[name])
                seconds, logits[name] = pass_seconds(caches[name], fed[:n])
                if name in packings:
                    unpack_linears(model)
                if repeat:
                    times[name][n].append(seconds)
            attention_difference = max(attention_difference,
                                       float((logits["specdec"] - logits["hf sdpa"]).abs().max()))
            for name in packings:
                packing_difference[name] = max(packing_difference[name],
                                               float((logits[name] - logits["specdec"]).abs().max()))
    median = {name: {n: statistics.median(t) for n, t in by_rows.items()} for name, by_rows in times.items()}
    lines = [f"# python benchmarks/verify_cost.py --threads {args.threads or torch.get_num_threads()} "
             f"--context {args.context}  ({args.model} {args.role}, {args.repeats} repetitions, alternating)",
             "| tokens per pass | " + " | ".join(f"{name}: ms (× one token)" for name in implementations) + " |",
             "|---|" + "---|" * len(implementations)]
    for n in rows:
        # the packed columns against plain specdec's one-token pass: what packing saves
        cells = [f"{1000 * median[name][n]:.1f} "
                 f"({median[name][n] / median['specdec' if name in packings else name][1]:.2f}×)"
                 for name in implementations]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append(f"largest logit difference between hf sdpa and specdec: {attention_difference:.3g}")
    for name, difference in packing_difference.items():
        how = ("one copy for any row count" if name == ONEDNN
               else f"packed for {args.packed_rows} rows, a pass padded to the next of them")
        lines.append(f"largest logit difference between {name} and plain linears (float rounding): "
                     f"{difference:.3g}; {how}")
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as out:
            out.write(text + "\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
