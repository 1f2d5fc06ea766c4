"""Model-free drafts against the draft model and the target alone, through the services.

Methods: target-only (speculation off), model (the draft service proposes), ngram and suffix (a
lookup in the orchestrator: no draft model, no draft hop) and hybrid (per round the suffix
lookup's proposal or the draft model's, as the K controller chooses). One target service and one draft service, as separate
processes; one orchestrator per method in front of them, side by side, each started with its
--draft / --draft-method (target-only goes through the model orchestrator with speculation off), so
every method runs on the same target service in the same run.

Two prompt sets: the input-grounded prompts (specdec/prompt_sets.py GROUNDED_PROMPTS: edit this
code, rewrite this JSON, quote a passage, revise the previous turn), where the answer repeats the
prompt and lookups find their proposals, and open-ended prompts (BENCHMARK_PROMPTS, round-robin
over the four kinds), where they find little. Greedy and T = 0.7. Interleaved: for each prompt the
methods run one after the other in a shuffled order, so a machine that speeds up or slows down
favours none of them.

Per temperature, prompt set and method: tokens/s and its ratio to target-only on the same
prompts, tau (tokens committed per verify round, K = 0 rounds included), acceptance, mean K, rows
per verify pass as the target service counts them (its Info totals before and after each request,
the prompt's prefill rows taken out), target forward passes per generated token, drafted and
accepted tokens by the method that proposed them (hybrid's split between suffix and model), and
greedy outputs that differ from target-only's (there must be none). The orchestrators' /metrics
counters by method are scraped before and after the sweep and must add up to the same numbers.

    python benchmarks/bench_drafts.py                     # the default pair (long on 2 cores)
    python benchmarks/bench_drafts.py --target DIR --draft DIR --dtype float64 --quick
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import urllib.request
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from specdec.v1 import common_pb2, target_pb2_grpc
from specdec.v1 import orchestrator_pb2 as pb

import common  # benchmarks/common.py: a script's own folder is first on sys.path

TARGET_ONLY = "target-only"
METHODS = (TARGET_ONLY, "model", "ngram", "suffix", "hybrid")
PROMPT_SETS = ("grounded", "open-ended")
BY_METHOD = {"drafted": "specdec:spec_decode_num_draft_tokens_by_method_total",
             "accepted": "specdec:spec_decode_num_accepted_tokens_by_method_total"}


@dataclass(frozen=True)
class Run:
    prompt: str
    prompt_set: str  # "grounded" | "open-ended"
    method: str
    temperature: float
    tokens: list[int]
    prompt_tokens: int
    generated: int
    seconds: float  # the orchestrator's wall time for the request
    rounds: int
    drafted: int
    accepted: int
    ks: list[int]
    drafted_by_method: dict[str, int]
    accepted_by_method: dict[str, int]
    target_passes: int  # forward passes of the target service during the request (prefill included)
    target_rows: int  # rows of those passes
    controller_estimates: dict[str, float] = field(default_factory=dict)  # at the request's end
    # Tokens the target looked up itself in Decode passes (K = 0 stretches), verified and accepted:
    # each accepted one is a K = 0 "round" in rounds that took no pass of its own.
    decode_lookup_drafts: int = 0
    decode_lookup_accepted: int = 0

    @property
    def round_passes(self) -> int:
        """The target passes of the request's rounds (Verify, or a Decode step)."""
        return self.rounds - self.decode_lookup_accepted

    @property
    def verify_rows(self) -> int:
        """Rows of the Verify passes: the prefill feeds the prompt once, the rest are Verify's."""
        return self.target_rows - self.prompt_tokens


def orchestrator_args(method: str, draft_address: str, suffix_cache: str, max_k: int | None) -> list[str]:
    """The flags that give an orchestrator its draft method."""
    draft = {"ngram": ["--draft", "local:ngram"], "suffix": ["--draft", "local:suffix"],
             "model": ["--draft", draft_address],
             "hybrid": ["--draft", draft_address, "--draft-method", "hybrid"]}[method]
    return [*draft, "--suffix-cache", suffix_cache, "--speculation", "adaptive",
            *(["--max-num-speculative-tokens", str(max_k)] if max_k is not None else []),
            "--port", "0", "--metrics-port", "0"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--draft", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per model service")
    parser.add_argument("--grounded-prompts", type=int, default=6, help="input-grounded prompts (at most 6)")
    parser.add_argument("--open-prompts", type=int, default=6,
                        help="open-ended prompts, round-robin over the four kinds")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated, from {', '.join(METHODS)} (target-only is always run)")
    parser.add_argument("--k", type=int, default=0,
                        help="fixed K per round (0: the adaptive controller, up to --max-k)")
    parser.add_argument("--max-k", type=int, default=None,
                        help="adaptive K's maximum (default: the orchestrator's own, as a user starts it)")
    parser.add_argument("--suffix-cache", choices=("session", "shared"), default="session",
                        help="the suffix and hybrid orchestrators' --suffix-cache (shared: outputs of "
                             "earlier requests help later ones, the same prompt at both temperatures "
                             "included)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 2 grounded and 2 open-ended prompts, 24 tokens")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR / "drafts.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.grounded_prompts, args.open_prompts = 2, 2
        args.max_new_tokens = min(args.max_new_tokens, 24)
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    args.method_list = [TARGET_ONLY, *[m for m in METHODS if m in methods and m != TARGET_ONLY]]
    return args


def chosen_prompts(args) -> list[tuple[str, object]]:
    sets = common.prompt_sets()
    if not 0 <= args.grounded_prompts <= len(sets.GROUNDED_PROMPTS):
        raise SystemExit(f"--grounded-prompts must be in [0, {len(sets.GROUNDED_PROMPTS)}]")
    grounded = [("grounded", p) for p in sets.GROUNDED_PROMPTS[:args.grounded_prompts]]
    open_ended = [("open-ended", p) for p in common.pick_prompts(args.open_prompts)] if args.open_prompts else []
    # Alternate the two sets, so neither runs at the start or the end of the sweep only.
    mixed = []
    for index in range(max(len(grounded), len(open_ended))):
        mixed += [group[index] for group in (grounded, open_ended) if index < len(group)]
    return mixed


class Target:
    """The target service's Info: its forward passes and their rows, running totals."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self._stub = target_pb2_grpc.TargetServiceStub(self._channel)

    def totals(self) -> tuple[int, int]:
        info = self._stub.Info(common_pb2.InfoRequest(), timeout=30)
        return int(info.passes_total), int(info.pass_rows_total)

    def close(self) -> None:
        self._channel.close()


def request_for(prompt, method: str, temperature: float, k: int, max_new_tokens: int, seed: int):
    if method == TARGET_ONLY:
        speculation = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_OFF)
    elif k > 0:
        speculation = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=k)
    else:
        speculation = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_ADAPTIVE)
    return common.chat_request(prompt.messages, max_new_tokens, speculation, temperature, seed)


def call(client: common.OrchestratorClient, target: Target, prompt_set: str, prompt, method: str,
         temperature: float, k: int, max_new_tokens: int, seed: int) -> Run:
    passes_before, rows_before = target.totals()
    result = client.generate(request_for(prompt, method, temperature, k, max_new_tokens, seed))
    passes_after, rows_after = target.totals()
    s = result.stats
    return Run(prompt.name, prompt_set, method, temperature, list(result.token_ids), s.prompt_tokens,
               s.generated_tokens, s.wall_seconds, s.rounds, s.drafted_tokens, s.accepted_tokens,
               list(s.num_speculative_tokens_per_round), dict(s.drafted_tokens_by_method),
               dict(s.accepted_tokens_by_method), passes_after - passes_before, rows_after - rows_before,
               dict(s.controller_estimates), s.decode_lookup_drafts, s.decode_lookup_accepted)


def scrape_by_method(url: str) -> dict[str, dict[str, float]]:
    """{"drafted" | "accepted": {method: count}} from an orchestrator's /metrics."""
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    found: dict[str, dict[str, float]] = {"drafted": {}, "accepted": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key, name in BY_METHOD.items():
                if sample.name == name:
                    method = sample.labels["method"]
                    found[key][method] = found[key].get(method, 0.0) + sample.value
    return found


def sweep(clients: dict[str, common.OrchestratorClient], target: Target, prompts, temperatures,
          methods, k: int, max_new_tokens: int) -> list[Run]:
    runs: list[Run] = []
    rng = random.Random(0)
    progress = common.Progress(len(prompts) * len(temperatures) * len(methods))
    for temperature in temperatures:
        for index, (prompt_set, prompt) in enumerate(prompts):
            order = list(methods)
            rng.shuffle(order)
            for method in order:
                client = clients["model" if method == TARGET_ONLY else method]
                run = call(client, target, prompt_set, prompt, method, temperature, k, max_new_tokens,
                           seed=1000 + index)
                runs.append(run)
                progress.step(f"T={temperature} {prompt.name} {method}: "
                              f"{run.generated / run.seconds:.1f} tok/s, {run.accepted}/{run.drafted} accepted")
    return runs


@dataclass
class Cell:
    """One (temperature, prompt set, method): its runs' totals."""

    runs: int = 0
    generated: int = 0
    seconds: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    ks: int = 0
    verify_rows: int = 0
    round_passes: int = 0
    decode_lookup_drafts: int = 0
    decode_lookup_accepted: int = 0
    target_passes: int = 0
    drafted_by_method: dict[str, int] = field(default_factory=dict)
    accepted_by_method: dict[str, int] = field(default_factory=dict)

    def add(self, run: Run) -> None:
        self.runs += 1
        self.generated += run.generated
        self.seconds += run.seconds
        self.rounds += run.rounds
        self.drafted += run.drafted
        self.accepted += run.accepted
        self.ks += len(run.ks)
        self.verify_rows += run.verify_rows
        self.round_passes += run.round_passes
        self.decode_lookup_drafts += run.decode_lookup_drafts
        self.decode_lookup_accepted += run.decode_lookup_accepted
        self.target_passes += run.target_passes
        for totals, counts in ((self.drafted_by_method, run.drafted_by_method),
                               (self.accepted_by_method, run.accepted_by_method)):
            for name, count in counts.items():
                totals[name] = totals.get(name, 0) + count

    def figures(self, target_only_tps: float) -> dict:
        tps = self.generated / self.seconds if self.seconds > 0 else 0.0
        return {
            "runs": self.runs, "generated": self.generated, "tokens_per_second": tps,
            "ratio_vs_target_only": tps / target_only_tps if target_only_tps > 0 else None,
            # committed tokens per pass of the rounds (a Decode's looked-up tokens share theirs)
            "tau": (self.accepted + self.rounds) / self.round_passes if self.round_passes else 0.0,
            "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
            "mean_k": self.drafted / self.ks if self.ks else 0.0,
            # the run's requests are alone on the target: each pass is one of the rounds'
            "verify_rows_per_pass": self.verify_rows / self.round_passes if self.round_passes else 0.0,
            "target_passes_per_token": self.target_passes / self.generated if self.generated else 0.0,
            "drafted": self.drafted, "accepted": self.accepted,
            "decode_lookup_drafts": self.decode_lookup_drafts, "decode_lookup_accepted": self.decode_lookup_accepted,
            "drafted_by_method": self.drafted_by_method, "accepted_by_method": self.accepted_by_method,
        }


def summarise(runs: list[Run], temperatures, methods) -> dict:
    """{temperature: {prompt set: {method: figures}}}; the ratio is over target-only's tokens/s
    on the same prompts at the same temperature."""
    table: dict = {}
    for temperature in temperatures:
        for prompt_set in PROMPT_SETS:
            cells = {method: Cell() for method in methods}
            for run in runs:
                if run.temperature == temperature and run.prompt_set == prompt_set:
                    cells[run.method].add(run)
            if not cells[TARGET_ONLY].runs:
                continue
            base = cells[TARGET_ONLY]
            base_tps = base.generated / base.seconds
            table.setdefault(str(temperature), {})[prompt_set] = {
                method: cell.figures(base_tps) for method, cell in cells.items()}
    return table


def greedy_mismatches(runs: list[Run]) -> list[tuple[str, str]]:
    """(prompt, method) of greedy outputs that differ from target-only's on the same prompt."""
    reference = {r.prompt: r.tokens for r in runs if r.temperature == 0 and r.method == TARGET_ONLY}
    return [(r.prompt, r.method) for r in runs
            if r.temperature == 0 and r.method != TARGET_ONLY and r.tokens != reference.get(r.prompt)]


def format_report(report: dict) -> str:
    headers = ["T", "prompts", "method", "tok/s", "vs target-only", "tau", "accept", "mean K",
               "verify rows/pass", "target passes/token", "accepted by method"]
    rows = []
    for temperature, sets in report["summary"].items():
        for prompt_set, cells in sets.items():
            for method, f in cells.items():
                split = ", ".join(f"{name} {f['accepted_by_method'][name]}/{f['drafted_by_method'].get(name, 0)}"
                                  for name in sorted(f["accepted_by_method"])) or "-"
                rows.append([temperature, prompt_set, method, f"{f['tokens_per_second']:.1f}",
                             f"{f['ratio_vs_target_only']:.2f}x", f"{f['tau']:.2f}", f"{f['acceptance']:.2f}",
                             f"{f['mean_k']:.2f}", f"{f['verify_rows_per_pass']:.2f}",
                             f"{f['target_passes_per_token']:.3f}", split])
    lines = [common.format_table(headers, rows, markdown=True, left_columns=3), ""]
    lines.append("tau: tokens committed per verify round (K = 0 rounds included); verify rows/pass from "
                 "the target service's Info totals; accepted by method: accepted/drafted tokens.")
    mismatches = report["greedy_mismatches"]
    lines.append(f"greedy outputs differing from target-only: {len(mismatches)}"
                 + (f" {mismatches}" if mismatches else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    prompts = chosen_prompts(args)
    if not prompts:
        raise SystemExit("no prompts: raise --grounded-prompts or --open-prompts")
    pair = common.ModelPair(target=args.target, draft=args.draft, dtype=args.dtype, device=args.device,
                            torch_threads=args.threads)
    common.prepare_default_models(pair)
    orchestrator_methods = [m for m in ("model", "ngram", "suffix", "hybrid")
                            if m in args.method_list or (m == "model" and TARGET_ONLY in args.method_list)]
    with ExitStack() as stack:
        common.note("starting the target and draft services...")
        models = common.start_model_services(stack, pair)
        common.note(f"starting {len(orchestrator_methods)} orchestrators ({', '.join(orchestrator_methods)})...")
        env = common.service_env()
        started = common.start_services(stack, [
            ("orchestrator", ["--target", models["target"].address,
                              *orchestrator_args(method, models["draft"].address, args.suffix_cache,
                                                 args.max_k)], env)
            for method in orchestrator_methods])
        orchestrators = dict(zip(orchestrator_methods, started))
        clients = {method: stack.enter_context(common.OrchestratorClient(service.address))
                   for method, service in orchestrators.items()}
        target = Target(models["target"].address)
        stack.callback(target.close)
        first = prompts[0][1]
        for method in args.method_list:  # warm-up: first calls pay one-off costs
            call(clients["model" if method == TARGET_ONLY else method], target, "warm-up", first, method,
                 0.0, args.k, 8, seed=0)
        before = {m: scrape_by_method(s.metrics_url) for m, s in orchestrators.items()}
        runs = sweep(clients, target, prompts, temperatures, args.method_list, args.k, args.max_new_tokens)
        after = {m: scrape_by_method(s.metrics_url) for m, s in orchestrators.items()}
    metrics_by_method = {
        method: {key: {name: after[method][key].get(name, 0.0) - before[method][key].get(name, 0.0)
                       for name in after[method][key]} for key in BY_METHOD}
        for method in orchestrators}
    mismatches = greedy_mismatches(runs)
    report = {
        "config": {k: str(v) for k, v in vars(args).items()},
        "environment": common.environment(),
        "prompts": {prompt_set: [p.name for s, p in prompts if s == prompt_set] for prompt_set in PROMPT_SETS},
        "summary": summarise(runs, temperatures, args.method_list),
        "metrics_by_method": metrics_by_method,
        "greedy_mismatches": mismatches,
        "runs": [asdict(r) | {"tokens": len(r.tokens)} for r in runs],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    table = format_report(report)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)
    if mismatches:
        print(f"\nGREEDY OUTPUT MISMATCHES: {mismatches}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
