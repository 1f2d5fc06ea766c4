"""specdec demo: the default pair as three local processes, a few prompts streamed, and the
speedup over target-only decoding through the same target service, measured in the same run."""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass

import grpc

from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc
from specdec_cli.up_cmd import StackConfig, add_stack_flags, local_stack, stack_config

MODES = {"adaptive": pb.SPECULATION_MODE_ADAPTIVE, "fixed": pb.SPECULATION_MODE_FIXED,
         "heuristic": pb.SPECULATION_MODE_HEURISTIC}


@dataclass(frozen=True)
class RunResult:
    text: str
    generated_tokens: int
    tokens_per_second: float
    stats: pb.GenerationStats


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run the default pair locally and measure the speedup")
    add_stack_flags(parser)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=0, help="use only the first N demo prompts")
    parser.add_argument("--quiet", action="store_true", help="do not stream the answers")
    parser.set_defaults(func=run)


def prepare_default_models(config: StackConfig) -> None:
    """Dequantises and caches the default target once, here, with a progress bar, so the two
    services do not both do it at start."""
    if "default" in (config.target, config.draft):
        from specdec.default_model import resolve_default_target

        resolve_default_target(progress=True)


def run_one(stub, messages, max_new_tokens: int, mode: int, stream_to=None) -> RunResult:
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        max_new_tokens=max_new_tokens,
        speculation=pb.SpeculationConfig(mode=mode),
    )
    pieces, last = [], None
    for response in stub.Generate(request, timeout=1800):
        pieces.append(response.text)
        if stream_to is not None:
            stream_to.write(response.text)
            stream_to.flush()
        last = response
    assert last is not None
    return RunResult("".join(pieces), last.stats.generated_tokens, last.stats.tokens_per_second, last.stats)


def format_table(rows: list[dict]) -> str:
    headers = ["prompt", "tokens", "tau", "accept", "mean K", "spec tok/s", "target tok/s", "speedup"]
    lines = [headers]
    for row in rows:
        lines.append([row["name"], str(row["tokens"]), f"{row['tau']:.2f}", f"{row['acceptance']:.2f}",
                      f"{row['mean_k']:.1f}", f"{row['spec_tps']:.1f}", f"{row['target_tps']:.1f}",
                      f"{row['speedup']:.2f}x"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
    out = []
    for i, line in enumerate(lines):
        out.append("  ".join(cell.ljust(w) if j == 0 else cell.rjust(w) for j, (cell, w) in enumerate(zip(line, widths))))
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


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
    prepare_default_models(config)
    print("starting target, draft and orchestrator (separate processes)...", flush=True)
    mode = MODES.get(config.speculation, pb.SPECULATION_MODE_ADAPTIVE)
    rows, all_spec, all_target = [], [], []
    with local_stack(config) as services:
        with grpc.insecure_channel(services["orchestrator"].address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            run_one(stub, prompts[0].messages, 8, mode)  # warm-up: first calls pay one-off costs
            run_one(stub, prompts[0].messages, 8, pb.SPECULATION_MODE_OFF)
            for index, prompt in enumerate(prompts):
                print(f"\n### {prompt.name}\n> {prompt.text}\n", flush=True)
                # Which of the two runs first alternates between prompts, so that a machine that
                # speeds up or slows down during the demo does not favour either side overall.
                def run_target_only() -> RunResult:
                    return run_one(stub, prompt.messages, args.max_new_tokens, pb.SPECULATION_MODE_OFF)

                def run_speculative() -> RunResult:
                    return run_one(stub, prompt.messages, args.max_new_tokens, mode,
                                   stream_to=None if args.quiet else sys.stdout)

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
          f"{config.speculation} vs off (outputs identical):\n")
    print(format_table(rows))
    overall = rows[-1]
    print(f"\nspeedup over target-only: {overall['speedup']:.2f}x "
          f"(mean accepted length {overall['tau']:.2f}, acceptance {overall['acceptance']:.2f})")
    return 0
