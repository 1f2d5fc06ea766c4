"""specdec demo: the default pair as three local processes, a few prompts streamed, and the
speedup over target-only decoding through the same target service, measured in the same run."""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc
from specdec_cli.client import chat_request, format_table
from specdec_cli.flags import UsageError
from specdec_cli.stack import local_stack, prepare_default_models, stop_on_signals
from specdec_cli.up_cmd import add_stack_flags, stack_config

# Target-only speed of the fastest prompt over the slowest above this: other load on the machine
# swung the measurement (from one prompt to the next the target's own speed varies far less).
BUSY_SPREAD = 2.0

MODES = {"adaptive": pb.SPECULATION_MODE_ADAPTIVE, "fixed": pb.SPECULATION_MODE_FIXED,
         "heuristic": pb.SPECULATION_MODE_HEURISTIC}


@dataclass(frozen=True)
class RunResult:
    text: str
    generated_tokens: int
    tokens_per_second: float
    stats: pb.GenerationStats


def configure(parser: argparse.ArgumentParser) -> None:
    add_stack_flags(parser)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer")
    parser.add_argument("--prompts", type=int, default=0, help="use only the first N demo prompts (0: all)")
    parser.add_argument("--quiet", action="store_true", help="do not stream the answers")
    parser.set_defaults(func=run)


def run_one(stub, messages, max_new_tokens: int, mode: int, stream_to=None) -> RunResult:
    request = chat_request(messages, max_new_tokens, pb.SpeculationConfig(mode=mode))
    pieces, last = [], None
    for response in stub.Generate(request, timeout=1800):
        pieces.append(response.text)
        if stream_to is not None:
            stream_to.write(response.text)
            stream_to.flush()
        last = response
    assert last is not None
    return RunResult("".join(pieces), last.stats.generated_tokens, last.stats.tokens_per_second, last.stats)


def results_table(rows: list[dict]) -> str:
    headers = ["prompt", "tokens", "tau", "accept", "mean K", "spec tok/s", "target tok/s", "speedup"]
    return format_table(headers, [
        [row["name"], str(row["tokens"]), f"{row['tau']:.2f}", f"{row['acceptance']:.2f}",
         f"{row['mean_k']:.1f}", f"{row['spec_tps']:.1f}", f"{row['target_tps']:.1f}",
         f"{row['speedup']:.2f}x"] for row in rows])


def busy_machine_warning(target_rates: Sequence[float], limit: float = BUSY_SPREAD) -> str | None:
    """A warning if the target-only tokens/s of the prompts spread by more than `limit` (fastest
    over slowest): then the machine was busy and the speedup figure is unreliable."""
    rates = [rate for rate in target_rates if rate > 0]
    if len(rates) < 2 or max(rates) <= limit * min(rates):
        return None
    return (f"warning: target-only speed ranged from {min(rates):.1f} to {max(rates):.1f} tokens/s "
            f"across the prompts ({max(rates) / min(rates):.1f}x): the machine was busy with other "
            "work, so the speedup above is unreliable; run the demo again on an idle machine")


def summarize(name: str, speculative: list[RunResult], target_only: list[RunResult]) -> dict:
    stats = [r.stats for r in speculative]
    rounds = sum(s.rounds for s in stats)
    drafted = sum(s.drafted_tokens for s in stats)
    accepted = sum(s.accepted_tokens for s in stats)
    spec_tokens = sum(r.generated_tokens for r in speculative)
    spec_seconds = sum(s.wall_seconds for s in stats)
    target_tokens = sum(r.generated_tokens for r in target_only)
    target_seconds = sum(r.stats.wall_seconds for r in target_only)
    spec_tps, target_tps = spec_tokens / spec_seconds, target_tokens / target_seconds
    ks = [k for s in stats for k in s.num_speculative_tokens_per_round]
    return {
        "name": name, "tokens": spec_tokens,
        "tau": (accepted + rounds) / rounds if rounds else 0.0,
        "acceptance": accepted / drafted if drafted else 0.0,
        "mean_k": statistics.mean(ks) if ks else 0.0,
        "spec_tps": spec_tps, "target_tps": target_tps, "speedup": spec_tps / target_tps,
    }


def run(args: argparse.Namespace) -> int:
    from specdec.prompt_sets import DEMO_PROMPTS

    config = stack_config(args, echo=False)
    prompts = DEMO_PROMPTS[: args.prompts] if args.prompts else DEMO_PROMPTS
    if config.speculation not in MODES:
        raise UsageError("the demo compares speculative with target-only decoding: "
                         f"--speculation must be one of {', '.join(MODES)}")
    stop_on_signals()  # Ctrl-C stops the services even in a background job
    print(f"specdec demo: {len(prompts)} prompts, up to {args.max_new_tokens} tokens each, decoded "
          f"with speculation {config.speculation} ({config.draft_method} draft) and without, through the "
          "same services", flush=True)
    if "default" in (config.target, config.draft):
        print("preparing the default models (the first run dequantises the target once)...", flush=True)
    prepare_default_models(config)
    print("starting target, draft and orchestrator as separate processes (loading the models)...",
          flush=True)
    mode = MODES[config.speculation]
    rows, all_spec, all_target = [], [], []
    with local_stack(config) as services:
        address = services["orchestrator"].address
        print(f"services up, orchestrator at {address}; warming up (one short request each way)...",
              flush=True)
        with grpc.insecure_channel(address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            run_one(stub, prompts[0].messages, 8, mode)  # warm-up: first calls pay one-off costs
            run_one(stub, prompts[0].messages, 8, pb.SPECULATION_MODE_OFF)
            for index, prompt in enumerate(prompts):
                print(f"\n### {prompt.name} ({index + 1} of {len(prompts)})\n> {prompt.text}\n",
                      flush=True)
                # Which of the two runs first alternates between prompts, so that a machine that
                # speeds up or slows down during the demo does not favour either side overall.
                def run_target_only() -> RunResult:
                    print("[target-only decoding...]", flush=True)
                    result = run_one(stub, prompt.messages, args.max_new_tokens, pb.SPECULATION_MODE_OFF)
                    print(f"[target-only: {result.generated_tokens} tokens, "
                          f"{result.tokens_per_second:.1f} tokens/s]", flush=True)
                    return result

                def run_speculative() -> RunResult:
                    print(f"[speculative decoding ({config.speculation})...]", flush=True)
                    result = run_one(stub, prompt.messages, args.max_new_tokens, mode,
                                     stream_to=None if args.quiet else sys.stdout)
                    if not args.quiet and not result.text.endswith("\n"):
                        print()
                    print(f"[speculative: {result.generated_tokens} tokens, "
                          f"{result.tokens_per_second:.1f} tokens/s]", flush=True)
                    return result

                if index % 2 == 0:
                    target_only = run_target_only()
                    speculative = run_speculative()
                else:
                    speculative = run_speculative()
                    target_only = run_target_only()
                if speculative.text != target_only.text:
                    print("\n!! speculative output differs from target-only output", flush=True)
                    return 1
                rows.append(summarize(prompt.name, [speculative], [target_only]))
                all_spec.append(speculative)
                all_target.append(target_only)
    rows.append(summarize("overall", all_spec, all_target))
    print("\n\nGreedy decoding, the same target service with speculation "
          f"{config.speculation} ({config.draft_method} draft) vs off (outputs identical):\n")
    print(results_table(rows))
    overall = rows[-1]
    print(f"\nspeedup over target-only: {overall['speedup']:.2f}x "
          f"(mean accepted length {overall['tau']:.2f}, acceptance {overall['acceptance']:.2f})")
    warning = busy_machine_warning([row["target_tps"] for row in rows[:-1]])
    if warning:
        print(f"\n{warning}", flush=True)
    return 0
