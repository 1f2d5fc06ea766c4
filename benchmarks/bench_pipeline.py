"""Pipelined speculation: drafting the next round while the target verifies this one (the draft's
Speculate), against the same speculation without it and against target-only decoding.

The stack is started as a user starts it: `specdec serve target` and `specdec serve draft`, each
pinned to a CPU of its own with `--cpus` (target on the first CPU this process may use, draft on
the second; one torch thread each, `--threads`), and per round-trip time (RTT = 2 x the one-way
delay) one `specdec serve orchestrator` that reaches each service through a TCP delay proxy of its
own (specdec/delay_proxy.py, in a thread of this process; the 0 ms rows go through proxies too, so
the proxies' own cost is in every row). The orchestrators and this process are not pinned.

Schedules are chosen per request (SpeculationConfig): target-only (speculation off, the same pinned
target), adaptive K without pipelining (pipeline OFF), adaptive K with pipelining (AUTO: the
controller drafts ahead where it pays), fixed K = 1..4 with pipelining ON (the server's default
fan-out unless --fanout), and fixed K = 2 streamed (STREAM: no rounds, the target's Decode verifies
the draft's offered drafts; also over adaptive K without pipelining); greedy and T = 0.7 (seed 1000
+ the prompt's index, the same for every schedule). Method: for each repetition, RTT and prompt,
one request of every (schedule, temperature) cell in a shuffled order, so a machine that speeds up
or slows down (this one does, over seconds to minutes) touches every schedule alike. Tokens/s of a
cell = generated tokens / the orchestrator's wall time, summed over the prompts; ratios are taken
within a repetition (same RTT and temperature) and their median over repetitions is reported. Per
cell also: τ (committed tokens per round), mean K, the share of rounds that drafted ahead, hit rate
(pipeline_hits / (hits + misses): a round after a pipelined round that found its outcome among the
branches), mean fan-out, for streamed cells the offered drafts verified and accepted, and for
greedy cells whether every output equals the target-only output of the same prompt.

Predicted hit rate (greedy, fixed K): once the services are stopped, the target and the draft are
loaded here (the services' dtype) and the draft is run teacher-forced over each prompt plus its
target-only greedy output (one forward pass). Greedy rounds of fixed K are then simulated from the
start of the generated part (the first token comes from the prefill): drafts are accepted while
the draft's argmax equals the target's token; at the first mismatch j < K the outcome token t (the
target's) hits at fan-out f if t is among the draft's top f candidates there, its own argmax
excluded; after K accepted drafts the bonus token hits if it is among the draft's top f there. An
outcome counts when a drafting round follows it. Reported per K at fan-outs 1-4 and 8 and at the
fan-outs the orchestrator used, beside the measured hit rate of the fixed-K greedy rows.

    python benchmarks/bench_pipeline.py                   # the default pair: ~45-60 min on 2 cores
    python benchmarks/bench_pipeline.py --rtts 0,10 --repetitions 3 --prompts 4 --max-new-tokens 48
    python benchmarks/bench_pipeline.py --quick           # tiny random models built here: ~1 min
    python benchmarks/bench_pipeline.py --quick --target DIR --draft DIR --dtype float64 --out /tmp/p

Progress goes to stderr (a line per cell); the tables and ratios to stdout; JSON and markdown to
--out (pipeline-STAMP.json / .md, STAMP a UTC timestamp unless --name).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import common  # benchmarks/common.py: a script's own folder is first on sys.path
import emulated_pair

from specdec.v1 import orchestrator_pb2 as pb
from specdec_cli.stack import stop_on_signals

OFF = "off"
SAMPLING_SEED = 1000  # + the prompt's index: the same seed for every schedule and repetition
PREDICTED_FANOUTS = (1, 2, 3, 4, 8)  # 8: the draft's candidates per position
MAX_CANDIDATES = 8
# --emulated-pair: pass times (fixed seconds, seconds per row) of the default pair pinned to one
# core with one torch thread each, linear layers packed for oneDNN (what `auto` chose on an AMD
# EPYC): `taskset -c 0 python benchmarks/verify_cost.py --threads 1 --rows 1,2,4,8,16` and the
# same with `--role draft`, fitted (target 32 / 39 / 39 / 46 / 63 ms, draft 4.0 / 5.1 / 5.7 / 5.5
# / 7.0 ms); and the draft's noise.
TARGET_PASS_SECONDS = (0.032, 0.0019)
DRAFT_PASS_SECONDS = (0.0040, 0.0002)
DEFAULT_PERTURBATION = 0.15
SERVERS_MAX_K = 16  # the services' and the orchestrator's default --max-num-speculative-tokens

FULL = {"rtts": "0,10,30", "ks": "1,2,3,4", "repetitions": 3, "prompts": 6, "max_new_tokens": 64,
        "temperatures": "0,0.7"}
QUICK = {"rtts": "0,10", "ks": "1,2,3,4", "repetitions": 1, "prompts": 2, "max_new_tokens": 16,
         "temperatures": "0,0.7"}

# The default prompts: open-ended and input-grounded, none of them a prompt that bench_rtt,
# bench_pair, bench_drafts or the demo measure by default (their first ones per kind).
PIPELINE_PROMPT_NAMES = ("code-word-count", "explain-seasons", "grounded-revise-code",
                         "chat-learn-guitar", "translate-french-friends", "grounded-revise-email")
PROMPT_SETS = ("pipeline", "benchmark", "grounded", "demo", "all")

PIPELINE_MODES = {"off": pb.PIPELINE_MODE_OFF, "on": pb.PIPELINE_MODE_ON, "auto": pb.PIPELINE_MODE_AUTO,
                  "stream": pb.PIPELINE_MODE_STREAM, "": pb.PIPELINE_MODE_UNSPECIFIED}
SCHEDULE = re.compile(r"^(off|adaptive|k=(\d+))(?:/(off|on|auto|stream)(?::(\d+))?)?$")


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class Schedule:
    """A request's speculation: off (target-only), adaptive or fixed K, its pipelining mode
    ('' leaves it to the server) and, where the name gives one (`k=2/stream:0`), its fan-out."""

    name: str
    mode: str  # off | adaptive | fixed
    k: int | None  # fixed K
    pipeline: str  # off | on | auto | stream | ''
    fanout: int | None = None  # pipeline_fanout (None: --fanout, else the server's)

    @property
    def base(self) -> str:
        return self.name.split("/")[0]

    @property
    def pipelined(self) -> bool:
        return self.pipeline in ("on", "auto")

    @property
    def label(self) -> str:
        if self.mode == "off":
            return "target-only"
        what = "adaptive" if self.mode == "adaptive" else f"K={self.k}"
        label = {"off": what, "on": f"{what} + pipelining", "auto": f"{what} + pipelining (auto)",
                 "stream": f"{what} + streamed", "": f"{what} (server's pipelining)"}[self.pipeline]
        return label if self.fanout is None else f"{label} (fan-out {self.fanout})"


def parse_schedule(text: str) -> Schedule:
    """off, adaptive or k=N, optionally /off, /on, /auto or /stream (the request's pipelining),
    then optionally :F (its fan-out)."""
    match = SCHEDULE.match(text.strip().lower())
    if match is None:
        raise ValueError(f"a schedule is off, adaptive or k=N, optionally followed by /off, /on, "
                         f"/auto or /stream and :fan-out, got {text!r}")
    base, k, pipeline = match.group(1), match.group(2), match.group(3) or ""
    fanout = None if match.group(4) is None else int(match.group(4))
    if base == OFF:
        if pipeline not in ("", "off"):
            raise ValueError(f"target-only does not pipeline: {text!r}")
        return Schedule(OFF, "off", None, "off")
    if k is not None and int(k) < 1:
        raise ValueError(f"fixed K must be >= 1, got {text!r}")
    if fanout is not None and pipeline not in ("on", "auto", "stream"):
        raise ValueError(f"a fan-out needs /on, /auto or /stream: {text!r}")
    name = base + (f"/{pipeline}" if pipeline else "") + (f":{fanout}" if fanout is not None else "")
    return Schedule(name, "adaptive" if k is None else "fixed", None if k is None else int(k), pipeline, fanout)


def default_schedules(ks: tuple[int, ...]) -> str:
    return ",".join([OFF, "adaptive/off", "adaptive/auto", *(f"k={k}/on" for k in ks), "k=2/stream"])


@dataclass(frozen=True)
class BenchConfig:
    rtts_ms: tuple[float, ...]
    # The target hop's RTT whatever --rtts says (which then sets the draft hop's alone): an
    # orchestrator beside the target, the draft far away. None: --rtts on each hop.
    target_rtt_ms: float | None
    # One orchestrator per (RTT, schedule), each with pool estimates of its own (what a deployment
    # running that schedule alone would learn), instead of one per RTT shared by every schedule.
    orchestrator_per_schedule: bool
    schedules: tuple[str, ...]
    repetitions: int
    prompt_set: str
    prompts: int
    prompt_names: tuple[str, ...]  # explicit prompts (overrides prompt_set and prompts)
    max_new_tokens: int
    temperatures: tuple[float, ...]
    target: str
    draft: str
    dtype: str
    device: str
    threads: int  # torch threads of each model service
    target_cpus: str  # --cpus of the target service ('' : not pinned)
    draft_cpus: str
    orchestrator_cpus: str
    fanout: int | None  # pipeline_fanout of pipelined requests (None: the server's default)
    adaptive_max_k: int | None  # the cap of adaptive K in each request (None: the server's, 16)
    jitter_ms: float
    seed: int  # of the shuffled order
    quick: bool
    tiny_pair: bool  # --quick without models: a tiny random pair built here
    # --emulated-pair: a tiny pair that agrees often (draft = target + this much noise), its passes
    # stretched to the given (fixed, per row) seconds (benchmarks/emulated_pair.py); 0: not used
    emulated_perturbation: float
    target_pass_seconds: tuple[float, float]
    draft_pass_seconds: tuple[float, float]
    skip_prediction: bool
    out: Path
    name: str

    def __post_init__(self) -> None:
        if not self.rtts_ms or min(self.rtts_ms) < 0:
            raise ValueError("--rtts: one or more RTTs >= 0 (ms)")
        if self.target_rtt_ms is not None and self.target_rtt_ms < 0:
            raise ValueError("--target-rtt-ms must be >= 0")
        if self.repetitions < 1 or self.max_new_tokens < 2 or self.prompts < 1:
            raise ValueError("--repetitions >= 1, --prompts >= 1 and --max-new-tokens >= 2")
        if not self.temperatures or min(self.temperatures) < 0:
            raise ValueError("--temperatures: one or more temperatures >= 0")
        for name, values in (("--rtts", self.rtts_ms), ("--temperatures", self.temperatures),
                             ("--schedules", self.schedules)):
            if len(set(values)) != len(values):
                raise ValueError(f"{name}: values must be distinct, got {values}")
        parsed = [parse_schedule(s) for s in self.schedules]
        if OFF not in self.schedules:
            raise ValueError("--schedules must include off (target-only): every ratio is taken against it")
        if len({s.name for s in parsed}) != len(parsed):
            raise ValueError(f"--schedules: the same schedule twice in {self.schedules}")
        if self.prompt_set not in PROMPT_SETS:
            raise ValueError(f"--prompt-set: one of {PROMPT_SETS}, got {self.prompt_set!r}")
        if self.threads < 1 or any(v is not None and v < 1 for v in (self.adaptive_max_k, self.fanout)):
            raise ValueError("--threads, --adaptive-max-k and --fanout must be >= 1")

    def target_hop_ms(self, rtt_ms: float) -> float:
        """The target hop's RTT in the row of RTT rtt_ms."""
        return rtt_ms if self.target_rtt_ms is None else self.target_rtt_ms

    @property
    def parsed_schedules(self) -> tuple[Schedule, ...]:
        return tuple(parse_schedule(s) for s in self.schedules)

    @property
    def max_k(self) -> int:
        """The largest K a request may ask for (0: none beyond the servers' default limit)."""
        return max([self.adaptive_max_k or 0, *(s.k for s in self.parsed_schedules if s.k is not None)])


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a short CI preset: RTT 0,10; 1 repetition; 2 prompts; 16 tokens; without "
                             "--target/--draft a tiny random-weight pair built here (float64)")
    parser.add_argument("--rtts", help=f"round-trip times in ms, each hop (default {FULL['rtts']})")
    parser.add_argument("--target-rtt-ms", type=float, default=None,
                        help="the orchestrator-target hop's RTT in ms, the same in every row; --rtts then "
                             "sets the draft hop's alone (an orchestrator beside the target, the draft "
                             "far away)")
    parser.add_argument("--orchestrator-per-schedule", action="store_true",
                        help="one orchestrator per RTT and schedule, so that no schedule's requests teach "
                             "another's controllers (the pool's acceptance and rank estimates); default: "
                             "one per RTT")
    parser.add_argument("--ks", help=f"fixed K of the pipelined fixed-K schedules (default {FULL['ks']})")
    parser.add_argument("--schedules",
                        help="instead of the default list (off, adaptive/off, adaptive/auto, k=N/on for "
                             "--ks): off, adaptive or k=N, each optionally /off, /on or /auto")
    parser.add_argument("--repetitions", type=int, help=f"default {FULL['repetitions']}")
    parser.add_argument("--prompt-set", default="pipeline", choices=PROMPT_SETS,
                        help="pipeline: open-ended and input-grounded prompts the other benchmarks do not "
                             "use by default; benchmark: the 24 open-ended ones, kinds round-robin; "
                             "grounded; demo; all (default pipeline)")
    parser.add_argument("--prompts", type=int, help=f"the first N of the set (default {FULL['prompts']})")
    parser.add_argument("--prompt-names", default="",
                        help="comma-separated prompt names from specdec/prompt_sets.py (overrides "
                             "--prompt-set and --prompts)")
    parser.add_argument("--max-new-tokens", type=int, help=f"default {FULL['max_new_tokens']}")
    parser.add_argument("--temperatures", help=f"0 is greedy (default {FULL['temperatures']})")
    parser.add_argument("--target", default=None, help="target model directory or 'default' (default)")
    parser.add_argument("--draft", default=None, help="draft model directory or 'default' (default)")
    parser.add_argument("--dtype", default=None,
                        help="the services' --dtype and the prediction's (default auto; float64 for "
                             "--quick's own tiny pair)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per model service (default 1)")
    parser.add_argument("--target-cpus", default=None,
                        help="--cpus of the target service (default: the first CPU this process may use)")
    parser.add_argument("--draft-cpus", default=None,
                        help="--cpus of the draft service (default: the second CPU this process may use)")
    parser.add_argument("--orchestrator-cpus", default="", help="--cpus of the orchestrators (default: none)")
    parser.add_argument("--no-pin", action="store_true", help="pin no service to CPUs")
    parser.add_argument("--fanout", type=int, default=None,
                        help="pipeline_fanout of the pipelined requests (default: the server's)")
    parser.add_argument("--adaptive-max-k", type=int, default=None,
                        help="the cap of adaptive K in each request (default: the server's)")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="proxy jitter per direction")
    parser.add_argument("--seed", type=int, default=0, help="seed of the shuffled schedule order")
    parser.add_argument("--emulated-pair", action="store_true",
                        help="a tiny pair whose draft agrees with its target often, each pass stretched "
                             "to the pass times below (benchmarks/emulated_pair.py)")
    parser.add_argument("--perturbation", type=float, default=DEFAULT_PERTURBATION,
                        help="--emulated-pair: noise added to the draft, times each parameter's spread "
                             f"(default {DEFAULT_PERTURBATION}: the smaller, the more often they agree)")
    parser.add_argument("--target-pass-ms", default=",".join(f"{x * 1e3:g}" for x in TARGET_PASS_SECONDS),
                        help="--emulated-pair: a target pass's fixed and per-row milliseconds "
                             "(default: the default target's, pinned to one core)")
    parser.add_argument("--draft-pass-ms", default=",".join(f"{x * 1e3:g}" for x in DRAFT_PASS_SECONDS),
                        help="--emulated-pair: the same for the draft (default: the default draft's)")
    parser.add_argument("--skip-prediction", action="store_true",
                        help="no predicted hit rates (they load both models in this process)")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="directory for the results")
    parser.add_argument("--name", default="", help="file stem after 'pipeline-' (default: a UTC timestamp)")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL

    def pick(name: str):
        value = getattr(args, name)
        return preset[name] if value is None else value

    tiny = args.quick and args.target is None and args.draft is None and not args.emulated_pair
    if (args.target is None) != (args.draft is None) and args.quick:
        parser.error("--quick takes both --target and --draft, or neither (a tiny pair built here)")
    if args.emulated_pair and (args.target is not None or args.draft is not None):
        parser.error("--emulated-pair builds its own pair: no --target/--draft")

    def pass_seconds(text: str) -> tuple[float, float]:
        fixed, per_row = (float(x) / 1e3 for x in common.comma_items(text))
        return fixed, per_row
    target_cpus, draft_cpus = default_cpus()
    try:
        ks = tuple(int(x) for x in common.comma_items(pick("ks")))
        return BenchConfig(
            rtts_ms=tuple(float(x) for x in common.comma_items(pick("rtts"))), target_rtt_ms=args.target_rtt_ms,
            orchestrator_per_schedule=args.orchestrator_per_schedule,
            schedules=tuple(parse_schedule(s).name for s in common.comma_items(args.schedules or default_schedules(ks))),
            repetitions=int(pick("repetitions")), prompt_set=args.prompt_set, prompts=int(pick("prompts")),
            prompt_names=tuple(common.comma_items(args.prompt_names)), max_new_tokens=int(pick("max_new_tokens")),
            temperatures=tuple(float(x) for x in common.comma_items(pick("temperatures"))),
            target=args.target or "default", draft=args.draft or "default",
            dtype=args.dtype or ("float64" if tiny else "float32" if args.emulated_pair else "auto"),
            device=args.device, threads=args.threads,
            target_cpus="" if args.no_pin else (args.target_cpus if args.target_cpus is not None else target_cpus),
            draft_cpus="" if args.no_pin else (args.draft_cpus if args.draft_cpus is not None else draft_cpus),
            orchestrator_cpus="" if args.no_pin else args.orchestrator_cpus,
            fanout=args.fanout, adaptive_max_k=args.adaptive_max_k, jitter_ms=args.jitter_ms, seed=args.seed,
            quick=args.quick, tiny_pair=tiny,
            emulated_perturbation=args.perturbation if args.emulated_pair else 0.0,
            target_pass_seconds=pass_seconds(args.target_pass_ms), draft_pass_seconds=pass_seconds(args.draft_pass_ms),
            skip_prediction=args.skip_prediction, out=args.out,
            name=args.name or common.utc_stamp(),
        )
    except ValueError as error:
        parser.error(str(error))


def default_cpus() -> tuple[str, str]:
    """The first and the second CPU this process may use (both the first on a one-CPU machine)."""
    if not hasattr(os, "sched_getaffinity"):
        return "", ""
    available = sorted(os.sched_getaffinity(0))
    return str(available[0]), str(available[1] if len(available) > 1 else available[0])


def pick_prompts(config: BenchConfig) -> list:
    sets = common.prompt_sets()
    if config.prompt_names:
        by_name = {p.name: p for p in sets.ALL_PROMPTS}
        unknown = [n for n in config.prompt_names if n not in by_name]
        if unknown:
            raise SystemExit(f"--prompt-names: no prompt named {', '.join(unknown)} in specdec/prompt_sets.py")
        return [by_name[n] for n in config.prompt_names]
    if config.prompt_set == "pipeline":
        by_name = {p.name: p for p in sets.ALL_PROMPTS}
        chosen = [by_name[n] for n in PIPELINE_PROMPT_NAMES]
    elif config.prompt_set == "benchmark":
        chosen = common.pick_prompts(len(sets.BENCHMARK_PROMPTS))
    else:
        chosen = list({"grounded": sets.GROUNDED_PROMPTS, "demo": sets.DEMO_PROMPTS,
                       "all": sets.ALL_PROMPTS}[config.prompt_set])
    if config.prompts > len(chosen):
        raise SystemExit(f"--prompts: the {config.prompt_set} set has {len(chosen)} prompts, "
                         f"asked for {config.prompts}")
    return chosen[:config.prompts]


def speculation(schedule: Schedule, config: BenchConfig) -> pb.SpeculationConfig:
    spec = pb.SpeculationConfig(pipeline=PIPELINE_MODES[schedule.pipeline])
    if schedule.mode == "off":
        spec.mode = pb.SPECULATION_MODE_OFF
    elif schedule.mode == "adaptive":
        spec.mode = pb.SPECULATION_MODE_ADAPTIVE
        if config.adaptive_max_k is not None:
            spec.num_speculative_tokens = config.adaptive_max_k
    else:
        spec.mode = pb.SPECULATION_MODE_FIXED
        spec.num_speculative_tokens = schedule.k
    fanout = schedule.fanout if schedule.fanout is not None else config.fanout
    if (schedule.pipelined or schedule.pipeline == "stream") and fanout is not None:
        spec.pipeline_fanout = fanout
    return spec


def temperature_label(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"T={temperature:g}"


# ---------------------------------------------------------------------------------------------
# A tiny pair for --quick


def build_tiny_pair(directory: Path) -> tuple[str, str]:
    """A random-weight tiny target and a perturbed copy of it as the draft (accepted often, not
    always): benchmarks/emulated_pair.py's pair, smaller, noisier, its passes not stretched."""
    return emulated_pair.build_agreeing_pair(directory, perturbation=0.3, hidden_size=32, mute_special_tokens=False)


# ---------------------------------------------------------------------------------------------
# Running


def start_stack(stack: ExitStack, config: BenchConfig) -> tuple[dict[tuple[float, str], str], dict]:
    """Pinned model services, then per RTT two proxies and an orchestrator (per RTT and schedule
    with --orchestrator-per-schedule, all of an RTT's through its two proxies); returns (RTT,
    schedule name) -> the orchestrator's address, and what each service process runs on."""
    common.prepare_default_models(config)
    env = common.service_env()
    if config.emulated_perturbation:
        stretcher = emulated_pair.write_pass_stretcher(config.out / f"pipeline-{config.name}.site")
        stack.callback(shutil.rmtree, stretcher, True)
        env["PYTHONPATH"] = os.pathsep.join([str(stretcher), env["PYTHONPATH"]])
        env[emulated_pair.PASS_SECONDS_ENV] = emulated_pair.pass_seconds_spec(
            config.target_pass_seconds, config.draft_pass_seconds)
    models = []
    for role, model, cpus in (("target", config.target, config.target_cpus),
                              ("draft", config.draft, config.draft_cpus)):
        args = ["--model", model, "--dtype", config.dtype, "--device", config.device, "--port", "0",
                "--threads", str(config.threads)]
        if config.max_k > SERVERS_MAX_K:
            args += ["--max-num-speculative-tokens", str(config.max_k)]
        if cpus:
            args += ["--cpus", cpus]
        models.append((role, args, env))
    common.note(f"starting the target (CPUs {config.target_cpus or 'any'}) and the draft (CPUs "
                f"{config.draft_cpus or 'any'}), {config.threads} torch thread(s) each...")
    target, draft = common.start_services(stack, models)
    upstreams = {rtt_ms: tuple(common.delayed_address(stack, service.address, hop_ms / 2.0, config.jitter_ms)
                               for service, hop_ms in ((target, config.target_hop_ms(rtt_ms)), (draft, rtt_ms)))
                 for rtt_ms in config.rtts_ms}
    names = [s.name for s in config.parsed_schedules]
    groups = ([(rtt_ms, (name,)) for rtt_ms in config.rtts_ms for name in names] if config.orchestrator_per_schedule
              else [(rtt_ms, tuple(names)) for rtt_ms in config.rtts_ms])
    common.note(f"starting {len(groups)} orchestrator(s), one per RTT"
                f"{' and schedule' if config.orchestrator_per_schedule else ''}, each RTT's through its own proxies...")
    extra = ["--max-num-speculative-tokens", str(config.max_k)] if config.max_k > SERVERS_MAX_K else []
    if config.orchestrator_cpus:
        extra += ["--cpus", config.orchestrator_cpus]
    orchestrators = common.start_orchestrators(stack, [upstreams[rtt_ms] for rtt_ms, _ in groups], extra)
    addresses = {(rtt_ms, name): o.address for (rtt_ms, group), o in zip(groups, orchestrators) for name in group}
    for (rtt_ms, group), o in zip(groups, orchestrators):
        via_target, via_draft = upstreams[rtt_ms]
        shown = "" if not config.orchestrator_per_schedule else f", {group[0]}"
        common.note(f"  RTT {rtt_ms:g} ms{shown}: orchestrator {o.address} (target via {via_target}, "
                    f"draft via {via_draft})")
    processes = {"target": target, "draft": draft,
                 **{f"orchestrator (RTT {rtt_ms:g} ms{'' if len(group) > 1 else ', ' + group[0]})": o
                    for (rtt_ms, group), o in zip(groups, orchestrators)}}
    return addresses, {name: placement(service.process.pid) for name, service in processes.items()}


def placement(pid: int) -> dict:
    """The CPUs a process and each of its threads may run on, read from outside it."""
    from specdec.cpu_affinity import format_cpu_list

    if not hasattr(os, "sched_getaffinity"):
        return {"pid": pid}
    threads = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            threads[tid] = format_cpu_list(os.sched_getaffinity(int(tid)))
    except (FileNotFoundError, ProcessLookupError):
        pass
    return {"pid": pid, "cpus": format_cpu_list(os.sched_getaffinity(pid)),
            "threads": len(threads), "thread_cpus": sorted(set(threads.values()))}


def warm_up_and_reference(clients: dict, config: BenchConfig, prompts: list) -> list[common.GenerateResult]:
    """One short untimed request per RTT and schedule, each through the orchestrator that runs it
    (connections, first passes, the controllers' first rounds), then the target-only greedy output
    of each prompt at the lowest RTT, which every greedy run must reproduce. clients: (RTT,
    schedule name) -> its orchestrator's client."""
    for (_, name), client in clients.items():
        client.generate(common.chat_request(prompts[0].messages, 6, speculation(parse_schedule(name), config)))
    reference_client = clients[(min(config.rtts_ms), OFF)]
    off = speculation(parse_schedule(OFF), config)
    return [reference_client.generate(common.chat_request(p.messages, config.max_new_tokens, off))
            for p in prompts]


def run_record(result: common.GenerateResult, **fields) -> dict:
    stats = result.stats
    return {
        **fields,
        "generated_tokens": stats.generated_tokens,
        "prompt_tokens": stats.prompt_tokens,
        "seconds": stats.wall_seconds,
        "client_seconds": result.client_seconds,
        "time_to_first_token_seconds": stats.time_to_first_token_seconds,
        "rounds": stats.rounds,
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "k_per_round": list(stats.num_speculative_tokens_per_round),
        "accepted_per_round": list(stats.num_accepted_per_round),
        "pipelined_rounds": stats.pipelined_rounds,
        "pipeline_hits": stats.pipeline_hits,
        "pipeline_misses": stats.pipeline_misses,
        "branches_drafted": stats.branches_drafted,
        "fanout_per_round": list(stats.fanout_per_round),
        "decode_calls": stats.decode_calls,
        "decoded_tokens": stats.decoded_tokens,
        "shadow_probes": stats.shadow_probes,
        "offers": stats.offers,
        "offers_dropped": stats.offers_dropped,
        "offered_passes": stats.offered_passes,
        "offered_drafts": stats.offered_drafts,
        "offered_accepted": stats.offered_accepted,
        "offered_branch_passes": stats.offered_branch_passes,
        "draft_seconds": stats.draft_seconds,
        "verify_seconds": stats.verify_seconds,
        "network_seconds": stats.network_seconds,
        "re_prefills": stats.re_prefills,
        "finish_reason": pb.FinishReason.Name(result.finish_reason),
        "output_digest": result.output_digest,
        # the controller's figures at the request's end (alpha, timings, K, pipelining's estimates)
        "controller_estimates": dict(stats.controller_estimates),
    }


class Eta:
    def __init__(self, cells: int) -> None:
        self.left = cells
        self.seconds: list[float] = []

    def done(self, seconds: float) -> str:
        self.left -= 1
        self.seconds.append(seconds)
        remaining = self.left * statistics.mean(self.seconds)
        return f"~{remaining / 60:.0f} min left" if self.left else "last cell"


def sweep(clients: dict, config: BenchConfig, prompts: list, references: list[tuple[int, ...]],
          journal: Path) -> list[dict]:
    """Every cell of every repetition, interleaved request by request: for each repetition, RTT
    and prompt, one request per (schedule, temperature) cell in a shuffled order. The machine's
    speed drifts over seconds to minutes; a cell run as one block of prompts caught a drift of its
    own, requests next to each other share it. Each run's record is also appended to `journal`."""
    rng = random.Random(config.seed)
    cells = [(s, t) for s in config.parsed_schedules for t in config.temperatures]
    steps = config.repetitions * len(config.rtts_ms) * len(prompts)
    progress, eta = common.Progress(steps), Eta(steps)
    runs = []
    for repetition in range(1, config.repetitions + 1):
        for rtt_ms in config.rtts_ms:
            block: list[dict] = []
            for index, prompt in enumerate(prompts):
                started = time.monotonic()
                order = list(cells)
                rng.shuffle(order)
                rates = {}
                for schedule, temperature in order:
                    seed = SAMPLING_SEED + index if temperature > 0 else None
                    request = common.chat_request(prompt.messages, config.max_new_tokens,
                                                  speculation(schedule, config), temperature, seed)
                    result = clients[(rtt_ms, schedule.name)].generate(request)
                    record = run_record(result, repetition=repetition, rtt_ms=rtt_ms, schedule=schedule.name,
                                        temperature=temperature, prompt=prompt.name)
                    if temperature == 0:
                        mismatch = common.first_difference(result.token_ids, references[index])
                        record["matches_target_only"] = mismatch is None
                        record["first_mismatch_index"] = mismatch
                    block.append(record)
                    common.append_json_line(journal, record)
                    rates[(schedule.name, temperature)] = pooled([record])["tokens_per_second"]
                shown = ", ".join(f"{name} {temperature_label(t)} {rates[(name, t)]:.1f}"
                                  for name, t in sorted(rates, key=lambda c: (c[1], c[0])))
                progress.step(f"rep {repetition} RTT {rtt_ms:>4g} ms {prompt.name}: {shown} tok/s "
                              f"({eta.done(time.monotonic() - started)})")
            runs.extend(block)
            for schedule, temperature in cells:
                figures = pooled([r for r in block
                                  if r["schedule"] == schedule.name and r["temperature"] == temperature])
                hit = "" if figures["hit_rate"] is None else f", hit rate {figures['hit_rate']:.2f}"
                common.note(f"  rep {repetition} RTT {rtt_ms:>4g} ms {temperature_label(temperature):>6} "
                            f"{schedule.name:<13}: {figures['tokens_per_second']:6.1f} tok/s, τ "
                            f"{figures['tau']:.2f}, mean K {figures['mean_k']:.1f}{hit}")
    return runs


# ---------------------------------------------------------------------------------------------
# Summary


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def pooled(runs: list[dict]) -> dict:
    """A group of runs' figures, pooled over runs and rounds (not a mean of per-run means)."""
    tokens = sum(r["generated_tokens"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    rounds = sum(len(r["k_per_round"]) for r in runs)
    ks = [k for r in runs for k in r["k_per_round"]]
    accepted = sum(sum(r["accepted_per_round"]) for r in runs)
    hits = sum(r["pipeline_hits"] for r in runs)
    misses = sum(r["pipeline_misses"] for r in runs)
    fanouts = [f for r in runs for f in r["fanout_per_round"]]
    pipelined = sum(r["pipelined_rounds"] for r in runs)
    # Streamed speculation: each decoded token counts as a round, and each accepted offered draft
    # saved the target a pass.
    offered_drafts = sum(r.get("offered_drafts", 0) for r in runs)
    offered_accepted = sum(r.get("offered_accepted", 0) for r in runs)
    passes = rounds - offered_accepted
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "rounds": rounds,
        "tau": (accepted + rounds) / passes if passes > 0 else 0.0,  # committed tokens per round (target pass)
        "offered_drafts": offered_drafts,
        "offered_accepted": offered_accepted,
        "offered_acceptance": ratio(offered_accepted, offered_drafts),
        "offered_passes": sum(r.get("offered_passes", 0) for r in runs),
        "offered_branch_passes": sum(r.get("offered_branch_passes", 0) for r in runs),
        "mean_k": sum(ks) / len(ks) if ks else 0.0,
        "pipelined_rounds": pipelined,
        "pipelined_share": pipelined / rounds if rounds else 0.0,
        "pipeline_hits": hits,
        "pipeline_misses": misses,
        "hit_rate": ratio(hits, hits + misses),
        "mean_fanout": sum(fanouts) / len(fanouts) if fanouts else None,
        "fanouts": dict(sorted(Counter(fanouts).items())),
        "branches_drafted": sum(r["branches_drafted"] for r in runs),
        "branches_per_pipelined_round": ratio(sum(r["branches_drafted"] for r in runs), pipelined),
    }


def summarize(runs: list[dict], config: BenchConfig) -> dict:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for run in runs:
        groups[(run["rtt_ms"], run["schedule"], run["temperature"], run["repetition"])].append(run)
    rate = {key: pooled(group)["tokens_per_second"] for key, group in groups.items()}
    repetitions = range(1, config.repetitions + 1)
    cells = []
    for rtt in config.rtts_ms:
        for temperature in config.temperatures:
            for schedule in config.parsed_schedules:
                key = (rtt, schedule.name, temperature)
                all_runs = [r for rep in repetitions for r in groups[(*key, rep)]]
                per_rep = [rate[(*key, rep)] for rep in repetitions]
                over_off = [ratio(rate[(*key, rep)], rate[(rtt, OFF, temperature, rep)]) for rep in repetitions]
                cell = {"rtt_ms": rtt, "schedule": schedule.name, "label": schedule.label,
                        "temperature": temperature,
                        "tokens_per_second": {**common.spread(per_rep), "per_repetition": per_rep},
                        "over_target_only": {**common.spread(over_off), "per_repetition": over_off},
                        **{k: v for k, v in pooled(all_runs).items() if k not in ("tokens_per_second",)}}
                if temperature == 0:
                    cell["greedy_runs"] = len(all_runs)
                    cell["greedy_matches"] = sum(r["matches_target_only"] for r in all_runs)
                cells.append(cell)
    # Streamed schedules are left out: which passes verify offered drafts depends on timing, and
    # a sampled output on which passes did (distributed as the target's, not reproducible).
    def fixed_k(schedule: str) -> bool:
        parsed = parse_schedule(schedule)
        return parsed.mode == "fixed" and parsed.pipeline != "stream"

    return {"cells": cells, "comparisons": comparisons(rate, config), "exactness": common.exactness(runs, fixed_k)}


def comparisons(rate: dict, config: BenchConfig) -> list[dict]:
    """Per RTT and temperature, ratios within each repetition (median and range over them): each
    schedule over target-only, each pipelined schedule over the same schedule without pipelining,
    and each streamed one also over adaptive K without pipelining, where the run has them."""
    names = {s.name for s in config.parsed_schedules}
    pairs = [(s.name, OFF, f"{s.label} / target-only") for s in config.parsed_schedules if s.name != OFF]
    for s in config.parsed_schedules:
        baselines = [f"{s.base}/off"] if s.pipelined or s.pipeline == "stream" else []
        if s.pipeline == "stream" and s.base != "adaptive":
            baselines.append("adaptive/off")
        if s.pipeline == "stream" and s.fanout != 0:
            baselines.append(f"{s.base}/stream:0")  # offers without branches
        for baseline in baselines:
            if baseline in names:
                unpipelined = parse_schedule(baseline)
                pairs.append((s.name, unpipelined.name, f"{s.label} / {unpipelined.label}"))
    result = []
    for temperature in config.temperatures:
        for numerator, denominator, label in pairs:
            row = {"temperature": temperature, "numerator": numerator, "denominator": denominator,
                   "label": label, "by_rtt": {}}
            for rtt in config.rtts_ms:
                values = [rate[(rtt, numerator, temperature, rep)] / rate[(rtt, denominator, temperature, rep)]
                          for rep in range(1, config.repetitions + 1)]
                row["by_rtt"][str(rtt)] = {**common.spread(values), "per_repetition": values}
            result.append(row)
    return result


# ---------------------------------------------------------------------------------------------
# Predicted hit rates


def simulate_fixed_k(output: list[int], argmax: list[int], candidates: list[list[int]], k: int,
                     max_new_tokens: int) -> dict:
    """Greedy rounds of fixed K over one target-only output, from its second token (the first is
    the prefill's). argmax[i] and candidates[i] (best first) are the draft's, teacher-forced, at
    the position that predicts output[i]. Returns the rounds, committed tokens, and for each
    outcome followed by a drafting round the 1-based rank of the outcome token among the
    candidates a branch would cover (None: beyond them)."""
    n = len(output)
    position, rounds, committed = 1, 0, 0
    ranks: list[int | None] = []

    def k_at(i: int) -> int:  # the orchestrator's cap: the tokens still to generate minus one
        return max(0, min(k, max_new_tokens - i - 1))

    while position < n:
        round_k = k_at(position)
        accepted = 0
        while (accepted < round_k and position + accepted < n
               and argmax[position + accepted] == output[position + accepted]):
            accepted += 1
        rounds += 1
        committed += accepted + 1
        outcome = position + accepted
        if outcome >= n:  # the output ended among the accepted drafts (an accepted EOS)
            break
        following = outcome + 1
        if round_k > 0 and following < n and k_at(following) > 0:
            pool = candidates[outcome]
            if accepted < round_k:  # a correction: the draft's own token was rejected there
                pool = [c for c in pool if c != argmax[outcome]]
            pool = pool[:MAX_CANDIDATES]
            ranks.append(pool.index(output[outcome]) + 1 if output[outcome] in pool else None)
        position = following
    return {"rounds": rounds, "committed": committed, "ranks": ranks}


def hit_rate_at(ranks: list[int | None], fanout: int) -> float | None:
    return ratio(sum(1 for r in ranks if r is not None and r <= fanout), len(ranks))


def predict(config: BenchConfig, prompts: list, references: list[common.GenerateResult],
            cells: list[dict]) -> dict:
    """Predicted hit rates of the greedy fixed-K schedules, from the draft's teacher-forced
    candidates over each prompt's target-only output (see the module's docstring)."""
    import torch

    from specdec.models import ModelConfig, load_model

    ks = sorted({s.k for s in config.parsed_schedules if s.mode == "fixed" and s.pipelined})
    if not ks or 0 not in config.temperatures:
        return {"skipped": "no pipelined fixed-K greedy schedule in this run"}
    common.note("loading the target and the draft here for the predicted hit rates...")
    target = load_model(ModelConfig(config.target, "target", device=config.device, dtype=config.dtype))
    draft = load_model(ModelConfig(config.draft, "draft", device=config.device, dtype=config.dtype))
    tokenizer = target.tokenizer
    per_prompt = []
    target_agreement = [0, 0]
    for prompt, reference in zip(prompts, references):
        encoded = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=True)
        prompt_ids = [int(t) for t in (encoded["input_ids"] if hasattr(encoded, "keys") else encoded)]
        output = list(reference.token_ids)
        if len(prompt_ids) != reference.stats.prompt_tokens:
            per_prompt.append({"prompt": prompt.name, "skipped": f"the prompt renders to {len(prompt_ids)} "
                               f"tokens here, {reference.stats.prompt_tokens} in the orchestrator"})
            continue
        sequence = torch.tensor([prompt_ids + output[:-1]], device=config.device)
        start = len(prompt_ids) - 1
        with torch.inference_mode():
            draft_logits = draft.model(input_ids=sequence, use_cache=False).logits[0, start:].float()
            target_logits = target.model(input_ids=sequence, use_cache=False).logits[0, start:].float()
        top = torch.topk(draft_logits, MAX_CANDIDATES + 1, dim=-1).indices.tolist()
        argmax = [row[0] for row in top]
        target_argmax = target_logits.argmax(-1).tolist()
        target_agreement[0] += sum(a == b for a, b in zip(target_argmax, output))
        target_agreement[1] += len(output)
        per_prompt.append({"prompt": prompt.name, "output_tokens": len(output),
                           "draft_agreement": sum(a == b for a, b in zip(argmax, output)) / len(output),
                           "by_k": {str(k): simulate_fixed_k(output, argmax, top, k, config.max_new_tokens)
                                    for k in ks}})
    measured = {(c["schedule"], c["rtt_ms"]): c for c in cells if c["temperature"] == 0}
    by_k = {}
    for k in ks:
        simulated = [p["by_k"][str(k)] for p in per_prompt if "by_k" in p]
        ranks = [r for s in simulated for r in s["ranks"]]
        rounds = sum(s["rounds"] for s in simulated)
        schedule = f"k={k}/on"
        fanouts: Counter = Counter()
        hits = misses = 0
        taus = []
        for rtt in config.rtts_ms:
            cell = measured.get((schedule, rtt))
            if cell is None:
                continue
            fanouts.update({int(f): n for f, n in cell["fanouts"].items()})
            hits += cell["pipeline_hits"]
            misses += cell["pipeline_misses"]
            taus.append(cell["tau"])
        used = sum(fanouts.values())
        predicted_used = (sum(n * hit_rate_at(ranks, f) for f, n in fanouts.items()) / used
                          if used and ranks else None)
        by_k[str(k)] = {
            "outcomes": len(ranks),
            "predicted_hit_rate": {str(f): hit_rate_at(ranks, f) for f in PREDICTED_FANOUTS},
            "rank_counts": {str(r): n for r, n in sorted(Counter(r for r in ranks if r is not None).items())},
            "predicted_tau": ratio(sum(s["committed"] for s in simulated), rounds),
            "measured_fanouts": {str(f): n for f, n in sorted(fanouts.items())},
            "predicted_hit_rate_at_measured_fanout": predicted_used,
            "measured_hit_rate": ratio(hits, hits + misses),
            "measured_outcomes": hits + misses,
            "measured_tau": statistics.mean(taus) if taus else None,
        }
    return {"ks": ks, "by_k": by_k, "per_prompt": per_prompt,
            "local_target_agreement_with_reference": ratio(*target_agreement),
            "fanouts": list(PREDICTED_FANOUTS)}


# ---------------------------------------------------------------------------------------------
# Output


def num(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def render_cells(summary: dict, config: BenchConfig, markdown: bool) -> str:
    headers = ["", "schedule", "RTT", "tok/s", "× target-only", "τ", "mean K", "drafted ahead",
               "hit rate", "mean fan-out", "greedy = target-only"]
    rows = []
    for temperature in config.temperatures:
        label = temperature_label(temperature)
        for schedule in config.parsed_schedules:
            for rtt in config.rtts_ms:
                c = next(c for c in summary["cells"] if (c["rtt_ms"], c["schedule"], c["temperature"])
                         == (rtt, schedule.name, temperature))
                exact = f"{c['greedy_matches']}/{c['greedy_runs']}" if temperature == 0 else ""
                rows.append([label, schedule.label, f"{rtt:g} ms", common.format_spread(c["tokens_per_second"]),
                             "" if schedule.name == OFF else common.format_spread(c["over_target_only"], 2),
                             num(c["tau"]), num(c["mean_k"], 1),
                             *(_ahead_columns(c, schedule)),
                             num(c["mean_fanout"], 1) if schedule.pipelined else "", exact])
                label = ""
    return common.format_table(headers, rows, markdown=markdown, left_columns=3)


def _ahead_columns(cell: dict, schedule: Schedule) -> list[str]:
    """'drafted ahead' and 'hit rate': of rounds (pipelined), or for streamed cells the share of
    the target's passes that verified offered drafts and how many of those took a branch's."""
    if schedule.pipelined:
        return [f"{cell['pipelined_share']:.0%}", num(cell["hit_rate"])]
    if schedule.pipeline == "stream":
        passes = cell["rounds"] - cell["offered_accepted"]
        share = cell["offered_passes"] / passes if passes > 0 else 0.0
        return [f"{share:.0%} of passes offered", f"{cell['offered_branch_passes']} by a branch"]
    return ["", ""]


def render_ratios(summary: dict, config: BenchConfig, markdown: bool) -> str:
    headers = ["", "ratio (median over repetitions)", *(f"{rtt:g} ms" for rtt in config.rtts_ms)]
    rows = []
    for temperature in config.temperatures:
        label = temperature_label(temperature)
        for row in (r for r in summary["comparisons"] if r["temperature"] == temperature):
            rows.append([label, row["label"],
                         *(common.format_spread(row["by_rtt"][str(rtt)], 2) for rtt in config.rtts_ms)])
            label = ""
    return common.format_table(headers, rows, markdown=markdown, left_columns=2)


def render_prediction(prediction: dict, markdown: bool) -> str:
    headers = ["K", "outcomes (predicted)", *(f"predicted f={f}" for f in prediction["fanouts"]),
               "fan-out used", "predicted at it", "measured", "measured outcomes", "τ predicted", "τ measured"]
    rows = []
    for k in prediction["ks"]:
        p = prediction["by_k"][str(k)]
        used = ", ".join(f"{f}×{n}" for f, n in p["measured_fanouts"].items()) or "none"
        rows.append([f"K={k}", str(p["outcomes"]),
                     *(num(p["predicted_hit_rate"][str(f)]) for f in prediction["fanouts"]), used,
                     num(p["predicted_hit_rate_at_measured_fanout"]), num(p["measured_hit_rate"]),
                     str(p["measured_outcomes"]), num(p["predicted_tau"]), num(p["measured_tau"])])
    return common.format_table(headers, rows, markdown=markdown, left_columns=1)


def describe(summary: dict, config: BenchConfig, prompts: list, placements: dict) -> list[str]:
    pins = "; ".join(f"{name} on CPUs {p.get('cpus', '?')}" for name, p in placements.items()
                     if name in ("target", "draft"))
    lines = [
        (f"Tokens/s, median (min–max) over {config.repetitions} repetition(s); target {config.target}, draft "
         f"{config.draft}, dtype {config.dtype}; {len(prompts)} prompt(s) ({', '.join(p.name for p in prompts)}) "
         f"x <= {config.max_new_tokens} new tokens per cell; RTT = 2 x one-way proxy delay "
         + ("on each hop." if config.target_rtt_ms is None else
            f"on the draft hop; the target hop's {config.target_rtt_ms:g} ms in every row (the orchestrator "
            f"beside the target).")),
        (f"Pinned: {pins or 'no'}; {config.threads} torch thread(s) per model service; pipelined requests' "
         f"fan-out: {config.fanout or 'the server default'}."),
        ("τ: committed tokens per round (streamed: per target pass); drafted ahead: share of rounds "
         "that drafted ahead; hit rate: "
         "pipeline_hits / (hits + misses); ratios within each repetition."),
    ]
    exact = summary["exactness"]
    matched = exact["greedy_runs"] - len(exact["greedy_mismatches"])
    lines.append(f"Greedy outputs identical to target-only: {matched} of {exact['greedy_runs']} runs. Sampled "
                 f"fixed-K outputs (not streamed) reproduced by their seed: "
                 f"{exact['sampled_fixed_k_groups'] - len(exact['sampled_fixed_k_not_reproduced'])} of "
                 f"{exact['sampled_fixed_k_groups']} (schedule, prompt) groups.")
    pipelined_cells = [c for c in summary["cells"] if parse_schedule(c["schedule"]).pipelined]
    if pipelined_cells and not any(c["pipelined_rounds"] for c in pipelined_cells):
        lines.append("WARNING: no round drafted ahead in any pipelined cell: this orchestrator does not "
                     "honour SpeculationConfig.pipeline (or never found it worth it).")
    return lines


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    stop_on_signals()
    prompts = pick_prompts(config)
    environment = common.environment()
    with ExitStack() as stack:
        if config.tiny_pair:
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-pipeline-")))
            target, draft = build_tiny_pair(directory)
            config = replace(config, target=target, draft=draft)
            common.note(f"--quick: a tiny random-weight pair in {directory}")
        elif config.emulated_perturbation:
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-pipeline-")))
            target, draft = emulated_pair.build_agreeing_pair(directory, config.emulated_perturbation)
            config = replace(config, target=target, draft=draft)
            common.note(f"--emulated-pair: a tiny pair (draft noise {config.emulated_perturbation:g}) in "
                        f"{directory}, passes stretched to target {config.target_pass_seconds} and draft "
                        f"{config.draft_pass_seconds} s (fixed, per row)")
        with ExitStack() as services:
            addresses, placements = start_stack(services, config)
            by_address = {a: services.enter_context(common.OrchestratorClient(a)) for a in set(addresses.values())}
            clients = {key: by_address[a] for key, a in addresses.items()}
            common.note("warm-up and target-only references...")
            references = warm_up_and_reference(clients, config, prompts)
            journal = config.out / f"pipeline-{config.name}.runs.jsonl"  # removed once the results are written
            journal.unlink(missing_ok=True)
            common.note(f"sweep; each run is also logged to {journal}")
            runs = sweep(clients, config, prompts, [r.token_ids for r in references], journal)
        summary = summarize(runs, config)
        prediction = ({"skipped": "--skip-prediction"} if config.skip_prediction
                      else predict(config, prompts, references, summary["cells"]))
    text_parts = ["", *describe(summary, config, prompts, placements), "",
                  render_cells(summary, config, markdown=False), "", render_ratios(summary, config, markdown=False)]
    md_parts = [f"# Pipelining benchmark ({environment['utc']})",
                "\n".join(describe(summary, config, prompts, placements)),
                render_cells(summary, config, markdown=True), "Ratios:", render_ratios(summary, config, markdown=True)]
    if "by_k" in prediction:
        caption = ("Greedy fixed K with pipelining: hit rate predicted from the draft's teacher-forced candidates "
                   "over the target-only outputs (f: fan-out) against the measured one (all RTTs and "
                   "repetitions); local target reproduces the reference greedy tokens at "
                   f"{num(prediction['local_target_agreement_with_reference'], 3)} of positions.")
        text_parts += ["", caption, "", render_prediction(prediction, markdown=False)]
        md_parts += [caption, render_prediction(prediction, markdown=True)]
    data = {
        "benchmark": "pipeline",
        "config": {**asdict(config), "out": str(config.out),
                   "schedule_labels": {s.name: s.label for s in config.parsed_schedules},
                   "sampling_seed": f"{SAMPLING_SEED} + prompt index"},
        "environment": environment,
        "placements": placements,
        "prompts": [p.name for p in prompts],
        "target_only_reference_digests": [r.output_digest for r in references],
        **summary,
        "prediction": prediction,
        "runs": runs,
        "table_markdown": render_cells(summary, config, markdown=True),
    }
    json_path, md_path = common.write_results(config.out, f"pipeline-{config.name}", data, "\n\n".join(md_parts))
    journal.unlink(missing_ok=True)
    print("\n".join(text_parts))
    print(f"\nwrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
