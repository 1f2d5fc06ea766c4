"""Speedup of a draft/target pair: speculative vs target-only through the same services,
fixed K in 1..8, Hugging Face assisted generation on the same models in-process, the measured
acceptance alpha and cost ratio c, the speedup bound they imply, and concurrent streams.

Every figure is a ratio measured in one run, with the schedules interleaved prompt by prompt,
because this machine is shared and noisy. Usage:

    python benchmarks/bench_pair.py                       # the default pair, 15-25 min on 2 cores
    python benchmarks/bench_pair.py --target DIR --draft DIR --dtype float64 --quick
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import torch

from orchestrator.k_controller import speedup_bound
from specdec.prompt_sets import BENCHMARK_PROMPTS, TASK_KINDS
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc
from specdec_cli.client import chat_request
from specdec_cli.stack import StackConfig, local_stack, prepare_default_models

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Run:
    prompt: str
    kind: str
    temperature: float
    schedule: str  # "off", "k=N", "adaptive"
    tokens: list[int]
    generated: int
    seconds: float  # the orchestrator's wall time for the request
    rounds: int
    drafted: int
    accepted: int
    draft_seconds: float
    verify_seconds: float
    network_seconds: float
    draft_calls: int
    rejections: int  # rounds with n < K
    ks: list[int]  # K of each round (what the adaptive controller chose)
    accepted_per_round: list[int]

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.seconds


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--draft", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompts-per-kind", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--concurrency", default="1,4,8",
                        help="concurrent stream counts, comma-separated ('' skips the streams)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per model service "
                        "and for Hugging Face in-process (1 avoids OpenMP spinning on a busy machine)")
    parser.add_argument("--skip-hf", action="store_true", help="skip Hugging Face assisted generation")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 prompt per kind, K 1,4")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "pair.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts_per_kind, args.ks, args.concurrency = 1, "1,4", "1,4"
        args.max_new_tokens = min(args.max_new_tokens, 24)
    return args


def chosen_prompts(per_kind: int):
    return [p for kind in TASK_KINDS for p in [q for q in BENCHMARK_PROMPTS if q.kind == kind][:per_kind]]


def request_for(prompt, temperature: float, mode: int, k: int, max_new_tokens: int, seed: int) -> pb.GenerateRequest:
    request = chat_request(prompt.messages, max_new_tokens, pb.SpeculationConfig(mode=mode),
                           temperature, seed)
    if mode == pb.SPECULATION_MODE_FIXED:
        request.speculation.num_speculative_tokens = k
    return request


def call(stub, prompt, temperature, schedule, max_new_tokens, seed) -> Run:
    if schedule == "off":
        mode, k = pb.SPECULATION_MODE_OFF, 0
    elif schedule == "adaptive":
        mode, k = pb.SPECULATION_MODE_ADAPTIVE, 0
    else:
        mode, k = pb.SPECULATION_MODE_FIXED, int(schedule.split("=")[1])
    tokens, last = [], None
    for response in stub.Generate(request_for(prompt, temperature, mode, k, max_new_tokens, seed), timeout=3600):
        tokens.extend(response.token_ids)
        last = response
    s = last.stats
    return Run(prompt.name, prompt.kind, temperature, schedule, tokens, s.generated_tokens, s.wall_seconds,
               s.rounds, s.drafted_tokens, s.accepted_tokens, s.draft_seconds, s.verify_seconds,
               s.network_seconds, sum(1 for x in s.num_speculative_tokens_per_round if x > 0),
               sum(n < k for k, n in zip(s.num_speculative_tokens_per_round, s.num_accepted_per_round)),
               list(s.num_speculative_tokens_per_round), list(s.num_accepted_per_round))


def sweep(stub, prompts, temperatures, schedules, max_new_tokens) -> list[Run]:
    runs = []
    rng = random.Random(0)
    total = len(prompts) * len(temperatures) * len(schedules)
    for temperature in temperatures:
        for index, prompt in enumerate(prompts):
            order = list(schedules)
            rng.shuffle(order)  # interleaved: every schedule sees the same machine state, on average
            for schedule in order:
                runs.append(call(stub, prompt, temperature, schedule, max_new_tokens, seed=1000 + index))
                print(f"[{len(runs)}/{total}] T={temperature} {prompt.name} {schedule}: "
                      f"{runs[-1].tokens_per_second:.1f} tok/s", file=sys.stderr, flush=True)
    return runs


def rate(runs: list[Run], temperature: float, schedule: str, kinds=None) -> float:
    """Summed tokens / summed seconds of one schedule's runs (optionally of some task kinds)."""
    chosen = [r for r in runs if r.temperature == temperature and r.schedule == schedule
              and (kinds is None or r.kind in kinds)]
    return sum(r.generated for r in chosen) / sum(r.seconds for r in chosen)


def ratio(runs: list[Run], temperature: float, schedule: str, kinds=None) -> float:
    """A schedule's rate over target-only's, on the same prompts."""
    return rate(runs, temperature, schedule, kinds) / rate(runs, temperature, "off", kinds)


def measured_model(runs: list[Run], k_for_alpha: int = 4) -> dict:
    """alpha, c, T_verify(n) fit, RTTs and the bound they imply (greedy runs)."""
    greedy = [r for r in runs if r.temperature == 0]
    at_k = [r for r in greedy if r.schedule == f"k={k_for_alpha}"]
    accepted = sum(r.accepted for r in at_k)
    drafted = sum(r.drafted for r in at_k)
    # accepted / drafted is biased (drafts after a rejection are never tested); count rejections.
    alpha = accepted / max(1, accepted + sum(r.rejections for r in at_k))
    plain = [r for r in greedy if r.schedule == "off"]
    # Speculation off decodes in Decode calls, whose server timing is the call's last message's,
    # not each pass's: its wall time per token without the hops is the target's step.
    t_step = sum(r.seconds - r.network_seconds for r in plain) / sum(r.generated for r in plain)
    speculative = [r for r in greedy if r.schedule.startswith("k=")]
    t_draft = sum(r.draft_seconds for r in speculative) / max(1, sum(r.drafted for r in speculative))
    rows = [(int(r.schedule[2:]) + 1, r.verify_seconds / (r.rounds + 1)) for r in speculative]
    rows += [(1, t_step)]
    n = torch.tensor([x for x, _ in rows], dtype=torch.float64)
    t = torch.tensor([y for _, y in rows], dtype=torch.float64)
    design = torch.stack([torch.ones_like(n), n], dim=1)
    a, b = torch.linalg.lstsq(design, t.unsqueeze(1)).solution.squeeze(1).tolist()
    # The bound takes each row count's own mean: on CPU T_verify steps (kernel blocking) and the
    # line, a summary, is off by up to ~15 % at some n.
    by_rows: dict[int, list[float]] = {}
    for rows_n, seconds in rows:
        by_rows.setdefault(rows_n, []).append(seconds)
    verify_by_rows = {rows_n: sum(v) / len(v) for rows_n, v in sorted(by_rows.items())}

    def verify_fn(rows_n: int) -> float:
        return verify_by_rows.get(rows_n, a + b * rows_n)

    calls_target = sum(r.rounds + 1 for r in greedy)
    calls_draft = sum(r.draft_calls + 1 for r in speculative)
    rtt = sum(r.network_seconds for r in greedy) / (calls_target + calls_draft)
    largest = max(int(r.schedule[2:]) for r in speculative)
    bound = speedup_bound(alpha, t_step, t_draft, verify_fn, rtt, rtt, largest)
    return {"alpha": alpha, "drafted_at_k": drafted, "t_step": t_step, "t_draft": t_draft,
            "c": t_draft / t_step, "verify_a": a, "verify_b": b,
            "verify_by_rows": {str(k): v for k, v in verify_by_rows.items()}, "rtt_per_hop": rtt,
            "bound": bound}


def hf_assisted(target_dir: str, draft_dir: str, dtype: str, prompts, temperatures, max_new_tokens) -> dict:
    """Hugging Face assisted generation in-process on the same models, vs the target alone."""
    from specdec.models import ModelConfig, load_model

    target = load_model(ModelConfig(target_dir, "target", dtype=dtype))
    draft = load_model(ModelConfig(draft_dir, "draft", dtype=dtype))
    tokenizer = target.tokenizer
    results = {}
    for temperature in temperatures:
        alone_tokens = alone_seconds = assisted_tokens = assisted_seconds = 0.0
        for index, prompt in enumerate(prompts):
            ids = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True,
                                                tokenize=True, return_tensors="pt")
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            kwargs = dict(max_new_tokens=max_new_tokens, attention_mask=torch.ones_like(ids),
                          do_sample=temperature > 0, pad_token_id=tokenizer.eos_token_id)
            if temperature > 0:
                kwargs["temperature"] = temperature
            for assisted in (False, True):
                torch.manual_seed(index)
                extra = {"assistant_model": draft.model} if assisted else {}
                started = time.perf_counter()
                with torch.no_grad():
                    output = target.model.generate(ids, **kwargs, **extra)
                seconds = time.perf_counter() - started
                count = output.shape[1] - ids.shape[1]
                if assisted:
                    assisted_tokens += count
                    assisted_seconds += seconds
                else:
                    alone_tokens += count
                    alone_seconds += seconds
            print(f"HF T={temperature} {prompt.name} done", file=sys.stderr, flush=True)
        results[str(temperature)] = {
            "target_alone_tps": alone_tokens / alone_seconds,
            "assisted_tps": assisted_tokens / assisted_seconds,
            "assisted_speedup": (assisted_tokens / assisted_seconds) / (alone_tokens / alone_seconds),
        }
    return results


def concurrent(address: str, prompts, levels, max_new_tokens) -> dict:
    results = {}
    for level in levels:
        row = {}
        for schedule in ("off", "adaptive"):
            chosen = [prompts[i % len(prompts)] for i in range(level)]

            def one(prompt):
                with grpc.insecure_channel(address) as channel:
                    return call(orchestrator_pb2_grpc.OrchestratorStub(channel), prompt, 0.0, schedule,
                                max_new_tokens, seed=1)

            started = time.perf_counter()
            with ThreadPoolExecutor(level) as pool:
                runs = list(pool.map(one, chosen))
            row[schedule] = sum(r.generated for r in runs) / (time.perf_counter() - started)
            print(f"concurrency {level} {schedule}: {row[schedule]:.1f} tok/s", file=sys.stderr, flush=True)
        row["ratio"] = row["adaptive"] / row["off"]
        results[str(level)] = row
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    prompts = chosen_prompts(args.prompts_per_kind)
    config = StackConfig(target=args.target, draft=args.draft, dtype=args.dtype, port=0, echo=False,
                         speculation="adaptive", max_num_speculative_tokens=8, threads=args.threads)
    prepare_default_models(config)
    schedules = ["off", *[f"k={k}" for k in ks], "adaptive"]
    with local_stack(config) as services:
        address = services["orchestrator"].address
        with grpc.insecure_channel(address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            for schedule in ("off", "k=4"):  # warm-up
                call(stub, prompts[0], 0.0, schedule, 8, seed=0)
            runs = sweep(stub, prompts, temperatures, schedules, args.max_new_tokens)
        streams = concurrent(address, prompts, [int(x) for x in args.concurrency.split(",") if x],
                             args.max_new_tokens)
    mismatches = [
        (r.prompt, r.schedule) for r in runs if r.temperature == 0
        for ref in runs if ref.prompt == r.prompt and ref.temperature == 0 and ref.schedule == "off"
        if r.tokens != ref.tokens
    ]
    report = {
        "config": {k: str(v) for k, v in vars(args).items()},
        "speedup": {str(t): {s: ratio(runs, t, s) for s in schedules if s != "off"} for t in temperatures},
        "speedup_code_explanation": {
            str(t): {s: ratio(runs, t, s, kinds=("code", "explanation")) for s in schedules if s != "off"}
            for t in temperatures},
        "target_only_tps": {str(t): rate(runs, t, "off") for t in temperatures},
        "tau": {str(t): {s: tau(runs, t, s) for s in schedules if s != "off"} for t in temperatures},
        "mean_k": {str(t): {s: mean_k(runs, t, s) for s in schedules if s != "off"} for t in temperatures},
        "model": measured_model(runs) if 0.0 in temperatures and 4 in ks else {},
        "concurrency": streams,
        "greedy_mismatches": mismatches,
        "runs": [asdict(r) | {"tokens": len(r.tokens)} for r in runs],
    }
    if not args.skip_hf:
        if args.threads:
            torch.set_num_threads(args.threads)
        target_dir, draft_dir = resolved_dirs(args)
        report["hf_assisted"] = hf_assisted(target_dir, draft_dir, args.dtype, prompts, temperatures,
                                            args.max_new_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    table = format_report(report, temperatures, schedules)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)
    if mismatches:
        print(f"\nGREEDY OUTPUT MISMATCHES: {mismatches}")
        return 1
    return 0


def tau(runs, temperature, schedule) -> float:
    chosen = [r for r in runs if r.temperature == temperature and r.schedule == schedule]
    rounds = sum(r.rounds for r in chosen)
    return (sum(r.accepted for r in chosen) + rounds) / rounds if rounds else 0.0


def mean_k(runs, temperature, schedule) -> float:
    """K per round over the schedule's runs (the adaptive controller's mean choice)."""
    ks = [k for r in runs if r.temperature == temperature and r.schedule == schedule for k in r.ks]
    return sum(ks) / len(ks) if ks else 0.0


def resolved_dirs(args) -> tuple[str, str]:
    from specdec.models import resolve_model_dir

    return str(resolve_model_dir(args.target, "target")), str(resolve_model_dir(args.draft, "draft"))


def format_report(report: dict, temperatures, schedules) -> str:
    lines = ["| temperature | schedule | speedup vs target-only (all) | code+explanation | tau | mean K |",
             "|---|---|---|---|---|---|"]
    for t in temperatures:
        for s in schedules:
            if s == "off":
                continue
            lines.append(f"| {t} | {s} | {report['speedup'][str(t)][s]:.2f}x | "
                         f"{report['speedup_code_explanation'][str(t)][s]:.2f}x | "
                         f"{report['tau'][str(t)][s]:.2f} | {report['mean_k'][str(t)][s]:.2f} |")
    lines.append("")
    lines.append("| temperature | target-only tok/s (services) | HF target alone tok/s | HF assisted tok/s | HF assisted speedup |")
    lines.append("|---|---|---|---|---|")
    for t in temperatures:
        hf = report.get("hf_assisted", {}).get(str(t), {})
        lines.append(f"| {t} | {report['target_only_tps'][str(t)]:.1f} | {hf.get('target_alone_tps', float('nan')):.1f} | "
                     f"{hf.get('assisted_tps', float('nan')):.1f} | {hf.get('assisted_speedup', float('nan')):.2f}x |")
    model = report["model"]
    if model:
        lines.append("")
        lines.append(f"measured: alpha {model['alpha']:.2f}, c {model['c']:.3f} (draft {model['t_draft']*1e3:.1f} ms "
                     f"vs target step {model['t_step']*1e3:.1f} ms), T_verify(n) = {model['verify_a']*1e3:.1f} + "
                     f"{model['verify_b']*1e3:.1f} n ms as a line, by n: "
                     + ", ".join(f"{float(v)*1e3:.0f}" for v in model.get("verify_by_rows", {}).values())
                     + f" ms; RTT/hop {model['rtt_per_hop']*1e3:.2f} ms; bound {model['bound']:.2f}x "
                     "(with T_verify by n)")
        best = max(report["speedup"]["0.0"][s] for s in schedules if s.startswith("k="))
        lines.append(f"best fixed K greedy speedup {best:.2f}x = {best / model['bound']:.0%} of the bound")
    lines.append("")
    lines.append("| concurrent streams | target-only tok/s | speculative (adaptive) tok/s | ratio |")
    lines.append("|---|---|---|---|")
    for level, row in report["concurrency"].items():
        lines.append(f"| {level} | {row['off']:.1f} | {row['adaptive']:.1f} | {row['ratio']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
