"""Adaptive K against a fixed-K sweep and Hugging Face's heuristic under injected network delay
(how K is chosen: docs/architecture.md, "Choosing K").

The target and draft services run as separate processes (`specdec serve`). For each round-trip
time (RTT = 2 x the one-way delay) a TCP delay proxy, in a thread of this process, sits in front of
each service, and an orchestrator process of its own talks to the services through them (one per
RTT, so the adaptive controller's pool priors do not leak across RTTs). The 0 ms rows go through
proxies too, so the proxy's own cost is the same in every row.

Schedules: fixed K, adaptive K (capped at 16), and Hugging Face's heuristic (+2 after a round that
accepted every draft, -1 otherwise, starting at 5) run by our orchestrator; greedy and sampled
(fixed seeds). Method: for each repetition and each RTT, every (schedule, temperature) cell runs on
the same prompts, in a shuffled order. Tokens/s of a cell = generated tokens / the orchestrator's
wall time, summed over the prompts. The best fixed K is picked on repetition 1 and adaptive and
the heuristic are compared with it on the other repetitions, as ratios within each repetition.
Every greedy output is checked against target-only decoding through the same target service.

    python benchmarks/bench_rtt.py                 # the default pair; tens of minutes on 2 cores
    python benchmarks/bench_rtt.py --repetitions 3 --prompts 2 --max-new-tokens 48
    python benchmarks/bench_rtt.py --quick --target DIR --draft DIR --dtype float64 --out /tmp/rtt

Progress goes to stderr; the table to stdout; JSON and a markdown copy of the table to --out.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

from specdec.v1 import orchestrator_pb2 as pb

import common  # benchmarks/common.py: a script's own folder is first on sys.path

ADAPTIVE, HEURISTIC = "adaptive", "heuristic"
GOAL_FRACTION_OF_BEST_FIXED = 0.95
HEURISTIC_GOAL_RTTS_MS = (10.0, 30.0)
SAMPLING_SEED = 1000  # + the prompt's index: the same seed for every schedule and repetition

FULL = {"rtts": "0,2,10,30", "ks": "0,1,2,3,4,6,8,12,16", "repetitions": 3, "prompts": 4,
        "max_new_tokens": 64, "temperatures": "0,0.7", "threads": None}
QUICK = {"rtts": "0,10", "ks": "0,2,4", "repetitions": 1, "prompts": 2,
         "max_new_tokens": 24, "temperatures": "0,0.7", "threads": 1}


@dataclass(frozen=True)
class BenchConfig:
    rtts_ms: tuple[float, ...]
    ks: tuple[int, ...]
    repetitions: int
    prompts: int
    max_new_tokens: int
    temperatures: tuple[float, ...]
    target: str
    draft: str
    dtype: str
    device: str
    threads: int | None  # OMP_NUM_THREADS of the model services
    adaptive_max_k: int
    heuristic_start_k: int
    jitter_ms: float
    seed: int  # of the shuffled order
    quick: bool
    out: Path
    name: str

    def __post_init__(self) -> None:
        if not self.rtts_ms or min(self.rtts_ms) < 0:
            raise ValueError("--rtts: one or more RTTs >= 0 (ms)")
        if not self.ks or min(self.ks) < 0:
            raise ValueError("--ks: one or more K >= 0")
        if self.repetitions < 1 or self.max_new_tokens < 2:
            raise ValueError("--repetitions >= 1 and --max-new-tokens >= 2")
        if not self.temperatures or min(self.temperatures) < 0:
            raise ValueError("--temperatures: one or more temperatures >= 0")
        for name, values in (("--rtts", self.rtts_ms), ("--ks", self.ks),
                             ("--temperatures", self.temperatures)):
            if len(set(values)) != len(values):
                raise ValueError(f"{name}: values must be distinct, got {values}")
        if self.adaptive_max_k < 1 or self.heuristic_start_k < 1:
            raise ValueError("--adaptive-max-k and --heuristic-start-k must be >= 1")

    @property
    def schedules(self) -> tuple[str, ...]:
        return (*(fixed(k) for k in self.ks), ADAPTIVE, HEURISTIC)

    @property
    def comparison_repetitions(self) -> tuple[int, ...]:
        """Repetitions on which adaptive and the heuristic are compared with the best fixed K."""
        return tuple(range(2, self.repetitions + 1)) or (1,)


def fixed(k: int) -> str:
    return f"K={k}"


def fixed_k_of(schedule: str) -> int | None:
    return int(schedule[2:]) if schedule.startswith("K=") else None


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a short CI preset: RTT 0,10; K 0,2,4; 1 repetition; 2 prompts; 24 tokens")
    parser.add_argument("--rtts", help=f"round-trip times in ms (default {FULL['rtts']})")
    parser.add_argument("--ks", help=f"fixed K values (default {FULL['ks']})")
    parser.add_argument("--repetitions", type=int, help=f"default {FULL['repetitions']}")
    parser.add_argument("--prompts", type=int, help=f"prompts per cell (default {FULL['prompts']})")
    parser.add_argument("--max-new-tokens", type=int, help=f"default {FULL['max_new_tokens']}")
    parser.add_argument("--temperatures", help=f"0 is greedy (default {FULL['temperatures']})")
    parser.add_argument("--target", default="default", help="target model directory or 'default'")
    parser.add_argument("--draft", default="default", help="draft model directory or 'default'")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch threads per model service (default torch's)")
    parser.add_argument("--adaptive-max-k", type=int, default=16, help="the cap of adaptive K")
    parser.add_argument("--heuristic-start-k", type=int, default=5, help="the heuristic's first K")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="proxy jitter per direction")
    parser.add_argument("--seed", type=int, default=0, help="seed of the shuffled schedule order")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="directory for the results")
    parser.add_argument("--name", default="", help="file stem after 'rtt_' (default: a UTC timestamp)")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL

    def pick(name: str):
        value = getattr(args, name)
        return preset[name] if value is None else value

    def numbers(text: str, kind=float) -> tuple:
        return tuple(kind(x) for x in common.comma_items(text))

    return BenchConfig(
        rtts_ms=numbers(pick("rtts")), ks=numbers(pick("ks"), int), repetitions=pick("repetitions"),
        prompts=pick("prompts"), max_new_tokens=pick("max_new_tokens"),
        temperatures=numbers(pick("temperatures")), target=args.target, draft=args.draft,
        dtype=args.dtype, device=args.device, threads=pick("threads"),
        adaptive_max_k=args.adaptive_max_k, heuristic_start_k=args.heuristic_start_k,
        jitter_ms=args.jitter_ms, seed=args.seed, quick=args.quick, out=args.out,
        name=args.name or common.utc_stamp(),
    )


def speculation(schedule: str, config: BenchConfig) -> pb.SpeculationConfig:
    if schedule == ADAPTIVE:
        return pb.SpeculationConfig(mode=pb.SPECULATION_MODE_ADAPTIVE,
                                    num_speculative_tokens=config.adaptive_max_k)
    if schedule == HEURISTIC:
        return pb.SpeculationConfig(mode=pb.SPECULATION_MODE_HEURISTIC,
                                    num_speculative_tokens=config.heuristic_start_k)
    return pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=fixed_k_of(schedule))


def temperature_label(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"T={temperature:g}"


# ---------------------------------------------------------------------------------------------
# Running


def start_stack(stack: ExitStack, config: BenchConfig) -> dict[float, str]:
    """Model services, then per RTT two proxies and an orchestrator; returns RTT -> address."""
    pair = common.ModelPair(
        config.target, config.draft, config.dtype, config.device, config.threads,
        max_num_speculative_tokens=max(16, config.adaptive_max_k, config.heuristic_start_k, *config.ks),
    )
    common.prepare_default_models(pair)
    common.note("starting the target and draft services (separate processes)...")
    services = common.start_model_services(stack, pair)
    upstreams = []
    for rtt_ms in config.rtts_ms:
        one_way = rtt_ms / 2.0
        upstreams.append(tuple(
            common.delayed_address(stack, services[role].address, one_way, config.jitter_ms)
            for role in ("target", "draft")))
    common.note(f"starting {len(upstreams)} orchestrators, one per RTT, each through its own proxies...")
    started = common.start_orchestrators(stack, upstreams,
                                         ["--max-num-speculative-tokens", str(config.adaptive_max_k)])
    orchestrators = {rtt_ms: service.address for rtt_ms, service in zip(config.rtts_ms, started)}
    for rtt_ms, (target, draft) in zip(config.rtts_ms, upstreams):
        common.note(f"  RTT {rtt_ms:g} ms: orchestrator {orchestrators[rtt_ms]} "
                    f"(target via {target}, draft via {draft})")
    return orchestrators


def warm_up_and_reference(clients: dict, config: BenchConfig, prompts: list) -> list[tuple[int, ...]]:
    """One short untimed request per orchestrator (connections, first forward passes), then the
    target-only greedy output of each prompt, which every greedy run must reproduce."""
    off = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_OFF)
    for client in clients.values():
        for spec in (off, pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=2)):
            client.generate(common.chat_request(prompts[0].messages, 4, spec))
    reference_client = clients[min(clients)]
    return [reference_client.generate(common.chat_request(p.messages, config.max_new_tokens, off)).token_ids
            for p in prompts]


def run_record(result: common.GenerateResult, **fields) -> dict:
    stats = result.stats
    ks = list(stats.num_speculative_tokens_per_round)
    rejections = sum(n < k for k, n in zip(ks, stats.num_accepted_per_round))
    record = {
        **fields,
        "generated_tokens": stats.generated_tokens,
        "seconds": stats.wall_seconds,
        "client_seconds": result.client_seconds,
        "time_to_first_token_seconds": stats.time_to_first_token_seconds,
        "rounds": stats.rounds,
        # K = 0 rounds streamed by Decode calls (one target call, one hop, for all of them)
        "decode_calls": stats.decode_calls,
        "decoded_tokens": stats.decoded_tokens,
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "rejections": rejections,
        "mean_k": sum(ks) / len(ks) if ks else 0.0,
        "network_seconds": stats.network_seconds,
        "finish_reason": pb.FinishReason.Name(result.finish_reason),
        "output_digest": result.output_digest,
    }
    if fields["schedule"] in (ADAPTIVE, HEURISTIC):  # the schedule itself, for a look at the controller
        record["k_per_round"] = ks
        record["accepted_per_round"] = list(stats.num_accepted_per_round)
    if stats.controller_estimates:
        record["controller_estimates"] = dict(stats.controller_estimates)
    return record


def sweep(clients: dict, config: BenchConfig, prompts: list, references: list,
          journal: Path) -> list[dict]:
    """Every cell of every repetition; each run's record is also appended to `journal` at once."""
    rng = random.Random(config.seed)
    cells = [(s, t) for s in config.schedules for t in config.temperatures]
    progress = common.Progress(config.repetitions * len(config.rtts_ms) * len(cells))
    runs = []
    for repetition in range(1, config.repetitions + 1):
        for rtt_ms in config.rtts_ms:
            order = list(cells)
            rng.shuffle(order)
            for schedule, temperature in order:
                tokens = seconds = 0.0
                for index, prompt in enumerate(prompts):
                    seed = SAMPLING_SEED + index if temperature > 0 else None
                    request = common.chat_request(prompt.messages, config.max_new_tokens,
                                                  speculation(schedule, config), temperature, seed)
                    result = clients[rtt_ms].generate(request)
                    record = run_record(result, repetition=repetition, rtt_ms=rtt_ms, schedule=schedule,
                                        temperature=temperature, prompt=prompt.name)
                    if temperature == 0:
                        mismatch = common.first_difference(result.token_ids, references[index])
                        record["matches_target_only"] = mismatch is None
                        record["first_mismatch_index"] = mismatch
                    runs.append(record)
                    common.append_json_line(journal, record)
                    tokens += record["generated_tokens"]
                    seconds += record["seconds"]
                progress.step(f"rep {repetition} RTT {rtt_ms:>4g} ms {temperature_label(temperature):>6} "
                              f"{schedule:<9}: {tokens:4.0f} tokens, {tokens / seconds:6.1f} tok/s")
    return runs


# ---------------------------------------------------------------------------------------------
# Summary


def summarize(runs: list[dict], config: BenchConfig) -> dict:
    """Cells (tokens/s per repetition), the best-fixed-K comparisons, goals and exactness."""
    totals: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    mean_ks: dict[tuple, list[float]] = defaultdict(list)
    for run in runs:
        key = (run["rtt_ms"], run["schedule"], run["temperature"])
        totals[(*key, run["repetition"])][0] += run["generated_tokens"]
        totals[(*key, run["repetition"])][1] += run["seconds"]
        mean_ks[key].append(run["mean_k"])
    # (RTT, schedule, temperature, repetition) -> summed tokens / summed seconds over the prompts
    rate = {key: tokens / seconds for key, (tokens, seconds) in totals.items()}
    repetitions = range(1, config.repetitions + 1)
    cells = []
    for key in ((r, s, t) for r in config.rtts_ms for s in config.schedules for t in config.temperatures):
        per_rep = [rate[(*key, rep)] for rep in repetitions]
        cells.append({"rtt_ms": key[0], "schedule": key[1], "temperature": key[2],
                      "tokens_per_second": {**common.spread(per_rep), "per_repetition": per_rep},
                      "mean_k": sum(mean_ks[key]) / len(mean_ks[key])})
    comparisons = [compare(lambda s, rep: rate[(rtt_ms, s, temperature, rep)], rtt_ms, temperature, config)
                   for temperature in config.temperatures for rtt_ms in config.rtts_ms]
    goals = {
        "adaptive_at_least_0.95_of_best_fixed_everywhere": all(
            c["meets_best_fixed_goal"] for c in comparisons),
        "adaptive_ahead_of_heuristic_at_10_and_30_ms": all(
            c["meets_heuristic_goal"] for c in comparisons if "meets_heuristic_goal" in c),
        "heuristic_goal_rtts_in_sweep": [r for r in config.rtts_ms if r in HEURISTIC_GOAL_RTTS_MS],
        "measured_on": "median over the comparison repetitions of per-repetition ratios",
    }
    fixed_k = lambda schedule: fixed_k_of(schedule) is not None
    return {"cells": cells, "comparisons": comparisons, "goals": goals, "exactness": common.exactness(runs, fixed_k)}


def compare(rate, rtt_ms: float, temperature: float, config: BenchConfig) -> dict:
    """Adaptive against the best fixed K of repetition 1, and against the heuristic, at one RTT and
    temperature; `rate(schedule, repetition)` is tokens/s. Ratios are taken within a repetition."""
    fixed_schedules = [fixed(k) for k in config.ks]
    best = max(fixed_schedules, key=lambda s: rate(s, 1))
    compared = config.comparison_repetitions

    def ratios(numerator: str, denominator: str) -> dict:
        values = [rate(numerator, rep) / rate(denominator, rep) for rep in compared]
        return {**common.spread(values), "per_repetition": values}

    comparison = {
        "rtt_ms": rtt_ms, "temperature": temperature, "best_fixed": best,
        "best_fixed_per_repetition": [max(fixed_schedules, key=lambda s: rate(s, rep))
                                      for rep in range(1, config.repetitions + 1)],
        "compared_on_repetitions": list(compared),
        "adaptive_over_best_fixed": ratios(ADAPTIVE, best),
        "adaptive_over_heuristic": ratios(ADAPTIVE, HEURISTIC),
    }
    if fixed(0) in fixed_schedules:
        comparison["adaptive_over_k0"] = ratios(ADAPTIVE, fixed(0))
        comparison["best_fixed_over_k0"] = ratios(best, fixed(0))
    comparison["meets_best_fixed_goal"] = (
        comparison["adaptive_over_best_fixed"]["median"] >= GOAL_FRACTION_OF_BEST_FIXED)
    if rtt_ms in HEURISTIC_GOAL_RTTS_MS:
        comparison["meets_heuristic_goal"] = comparison["adaptive_over_heuristic"]["median"] > 1.0
    return comparison


def render_table(summary: dict, config: BenchConfig, markdown: bool) -> str:
    """Rows: schedules and comparisons per temperature; columns: RTTs."""
    cell = {(c["rtt_ms"], c["schedule"], c["temperature"]): c for c in summary["cells"]}
    comparison = {(c["rtt_ms"], c["temperature"]): c for c in summary["comparisons"]}
    headers = ["", "schedule", *(f"{rtt:g} ms" for rtt in config.rtts_ms)]
    rows = []
    for temperature in config.temperatures:
        label = temperature_label(temperature)
        for schedule in config.schedules:
            rows.append([label, schedule, *(common.format_spread(cell[(rtt, schedule, temperature)]
                                                                 ["tokens_per_second"])
                                            for rtt in config.rtts_ms)])
            label = ""
        comps = [comparison[(rtt, temperature)] for rtt in config.rtts_ms]
        rows.append(["", "best fixed (rep 1)", *(c["best_fixed"] for c in comps)])
        rows.append(["", "adaptive / best fixed", *(
            common.format_spread(c["adaptive_over_best_fixed"], 2)
            + (" ok" if c["meets_best_fixed_goal"] else " MISS") for c in comps)])
        rows.append(["", "adaptive / heuristic", *(
            common.format_spread(c["adaptive_over_heuristic"], 2)
            + {True: " ok", False: " MISS", None: ""}[c.get("meets_heuristic_goal")] for c in comps)])
        if fixed(0) in config.schedules:
            rows.append(["", "adaptive / K=0",
                         *(common.format_spread(c["adaptive_over_k0"], 2) for c in comps)])
        for schedule in (ADAPTIVE, HEURISTIC):
            rows.append(["", f"{schedule} mean K", *(f"{cell[(rtt, schedule, temperature)]['mean_k']:.1f}"
                                                     for rtt in config.rtts_ms)])
    return common.format_table(headers, rows, markdown=markdown, left_columns=2)


def describe(summary: dict, config: BenchConfig) -> list[str]:
    """The lines around the table: what was measured, how, and whether the goals were met."""
    compared = config.comparison_repetitions
    lines = [
        f"Tokens/s, median (min–max) over {config.repetitions} repetition(s); target {config.target}, "
        f"draft {config.draft}, dtype {config.dtype}; {config.prompts} prompt(s) x {config.max_new_tokens} "
        f"new tokens per cell; RTT = 2 x one-way proxy delay on each hop.",
        f"Ratios: adaptive over the best fixed K of repetition 1, on repetition(s) {list(compared)}, "
        f"within each repetition; 'ok' marks a goal met (adaptive >= {GOAL_FRACTION_OF_BEST_FIXED} x best "
        f"fixed; adaptive > heuristic at 10 and 30 ms).",
    ]
    if config.repetitions < 2:
        lines.append("Only one repetition: the best fixed K was picked and compared on the same "
                     "repetition, which favours fixed K (it is the luckiest of several noisy figures).")
    goals, exact = summary["goals"], summary["exactness"]
    lines.append(f"Goal adaptive >= {GOAL_FRACTION_OF_BEST_FIXED} x best fixed K at every RTT: "
                 f"{'met' if goals['adaptive_at_least_0.95_of_best_fixed_everywhere'] else 'NOT met'}. "
                 f"Goal adaptive ahead of the heuristic at 10 and 30 ms: "
                 f"{'met' if goals['adaptive_ahead_of_heuristic_at_10_and_30_ms'] else 'NOT met'}"
                 f"{'' if goals['heuristic_goal_rtts_in_sweep'] else ' (neither RTT in this sweep)'}.")
    matched = exact["greedy_runs"] - len(exact["greedy_mismatches"])
    lines.append(f"Greedy outputs identical to target-only: {matched} of {exact['greedy_runs']} runs. "
                 f"Sampled fixed-K outputs reproduced by their seed: "
                 f"{exact['sampled_fixed_k_groups'] - len(exact['sampled_fixed_k_not_reproduced'])} of "
                 f"{exact['sampled_fixed_k_groups']} (schedule, prompt) groups.")
    return lines


def stop_on_signals() -> None:
    """SIGTERM, and SIGINT (which a shell ignores in background jobs, e.g. under nohup), raise
    KeyboardInterrupt, so the services and proxies are stopped on the way out, not orphaned."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    stop_on_signals()
    prompts = common.pick_prompts(config.prompts)
    environment = common.environment()
    with ExitStack() as stack:
        addresses = start_stack(stack, config)
        clients = {rtt: stack.enter_context(common.OrchestratorClient(a)) for rtt, a in addresses.items()}
        common.note("warm-up and target-only references...")
        references = warm_up_and_reference(clients, config, prompts)
        journal = config.out / f"rtt_{config.name}.runs.jsonl"  # removed once the results are written
        journal.unlink(missing_ok=True)
        common.note(f"sweep; each run is also logged to {journal}")
        runs = sweep(clients, config, prompts, references, journal)
    summary = summarize(runs, config)
    text = "\n".join(["", *describe(summary, config), "", render_table(summary, config, markdown=False)])
    markdown = "\n\n".join([f"# RTT benchmark ({environment['utc']})", "\n".join(describe(summary, config)),
                            render_table(summary, config, markdown=True)])
    data = {
        "benchmark": "rtt",
        "config": {**asdict(config), "out": str(config.out), "schedules": list(config.schedules),
                   "sampling_seed": f"{SAMPLING_SEED} + prompt index"},
        "environment": environment,
        "prompts": [p.name for p in prompts],
        "target_only_reference_digests": [common.token_digest(r) for r in references],
        **summary,
        "runs": runs,
        "table_markdown": render_table(summary, config, markdown=True),
    }
    json_path, md_path = common.write_results(config.out, f"rtt_{config.name}", data, markdown)
    journal.unlink(missing_ok=True)
    print(text)
    print(f"\nwrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
