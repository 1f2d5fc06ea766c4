"""The draft's cost per Propose when the target's pass has just run on the same CPU.

`specdec distill` and `evaluate.cost_ratio` time draft steps back to back, so the draft's weights
stay in the CPU's cache. In the guess-verify loop on one machine every Propose follows a target
pass that streams the target's weights (540 MB in float32) through the cache, so the draft reads
its own weights from memory again. This script times the same DraftEngine.propose three ways, in
one process: back to back, after a 64 MB memory sweep, and after a target forward pass; then as
the services run it, the target and the draft in two processes taking turns, with a pause between
each call and the next (the gRPC hop through the orchestrator), and reports both sides' times.

    python benchmarks/draft_cold_cost.py                  # the default pair, about a minute
    python benchmarks/draft_cold_cost.py --threads 1 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch

from draft_service.engine import DraftEngine
from specdec.distill.evaluate import step_seconds
from specdec.kv_cache import SequenceCache
from specdec.ragged import run_alone
from specdec.models import ModelConfig, load_model
from specdec.sampling import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--draft", default="default")
    parser.add_argument("--dtype", default="auto", help="the draft's dtype (the target runs float32)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--context", type=int, default=200, help="tokens in the draft's cache")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--pauses-ms", default="0.1,3,30",
                        help="pauses between turns in the two-process case, comma-separated ('' skips it)")
    return parser.parse_args(argv)


def median_ms(propose, before, repeats: int) -> float:
    times = []
    for i in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        propose(i)
        times.append(time.perf_counter() - start)
    return settled_median_ms(times)


def settled_median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds[3:]) * 1e3  # the first calls pay one-off costs


def prompt_ids(vocab: int, context: int) -> list[int]:
    return [(1000 + i) % vocab for i in range(context)]


def draft_proposer(args: argparse.Namespace):
    """The draft prefilled with the prompt; propose(i) feeds one new committed token and drafts
    one (the Propose of K = 1 every case times)."""
    engine = DraftEngine(load_model(ModelConfig(model=args.draft, role="draft", dtype=args.dtype)), top_m=64)
    vocab, model = engine.loaded.vocab_size, engine.loaded.model
    state = run_alone(model, engine.prefill(prompt_ids(vocab, args.context), SamplingParams()))
    return lambda i: run_alone(model, engine.propose(state, [(1234 + i) % vocab], 1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    propose = draft_proposer(args)
    target = load_model(ModelConfig(model=args.target, role="target")).model
    sweep = torch.randn(64 * 1024 * 1024 // 4)  # 64 MB
    target_input = torch.tensor([prompt_ids(target.config.vocab_size, args.context)[:8]])
    cases = {
        "back to back (how distill measures c)": None,
        "after a 64 MB memory sweep": lambda: sweep.sum(),
        "after a target forward pass (as in the loop)": lambda: target(input_ids=target_input),
    }
    print(f"threads {torch.get_num_threads()}, draft dtype {args.dtype}, context {args.context}")
    with torch.inference_mode():
        target_ms = step_seconds(target, args.context) * 1e3  # one decode step at this context
        for label, before in cases.items():
            draft_ms = median_ms(propose, before, args.repeats)
            print(f"{label:48s} {draft_ms:6.2f} ms per Propose of K=1  (c = {draft_ms / target_ms:.3f})")
    print(f"{'target decode step (the denominator of c)':48s} {target_ms:6.2f} ms")
    del target, propose
    for pause_ms in [float(p) for p in args.pauses_ms.split(",") if p.strip()]:
        draft_ms, turn_target_ms = two_process_turns(args, pause_ms)
        print(f"{f'two processes, {pause_ms:g} ms pause between turns':48s} {draft_ms:6.2f} ms per Propose "
              f"of K=1  (c = {draft_ms / target_ms:.3f}); target step {turn_target_ms:.2f} ms")
    return 0


def two_process_turns(args: argparse.Namespace, pause_ms: float) -> tuple[float, float]:
    """Median ms of the draft's Propose and the target's decode step when each runs in its own
    process and they take turns, pausing pause_ms between one's answer and the other's call."""
    context = multiprocessing.get_context("spawn")
    sides = {}
    for role in ("target", "draft"):
        ours, theirs = context.Pipe()
        process = context.Process(target=_turn_taker, args=(role, args, theirs), daemon=True)
        process.start()
        sides[role] = (ours, process)
    for ours, _ in sides.values():
        ours.recv()  # loaded
    times: dict[str, list[float]] = {"target": [], "draft": []}
    for i in range(args.repeats):
        for role in ("target", "draft"):
            time.sleep(pause_ms / 1e3)
            sides[role][0].send(i)
            times[role].append(sides[role][0].recv())
    for ours, process in sides.values():
        ours.send(None)
        process.join(timeout=60)
    return settled_median_ms(times["draft"]), settled_median_ms(times["target"])


def _turn_taker(role: str, args: argparse.Namespace, connection) -> None:
    """A child process: loads one side, then times one call per message until it gets None."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if role == "draft":
        call = draft_proposer(args)
    else:
        loaded = load_model(ModelConfig(model=args.target, role="target"))
        cache = SequenceCache(loaded.model)
        cache.feed(prompt_ids(loaded.vocab_size, args.context))

        def call(i: int) -> None:
            cache.feed([(1234 + i) % loaded.vocab_size])
            cache.truncate(args.context)
    connection.send("loaded")
    with torch.inference_mode():
        while (message := connection.recv()) is not None:
            start = time.perf_counter()
            call(message)
            connection.send(time.perf_counter() - start)


if __name__ == "__main__":
    raise SystemExit(main())
