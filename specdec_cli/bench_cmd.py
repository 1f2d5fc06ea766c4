"""specdec bench: a user's own measurement of a running pair. Prompts from a JSONL file (or the
built-in benchmark set) go through an orchestrator under several speculation schedules (off,
adaptive, fixed K), interleaved so that a machine that speeds up or slows down during the run
affects every schedule alike. Reported per schedule: tokens/s, the speedup over speculation off
measured in the same run, τ, acceptance overall and per draft position, mean K, and the client's
time to first token and inter-token latency percentiles; greedy outputs are compared across the
schedules. No torch here: the functions below (load_prompts, parse_schedules, plan, execute,
summarize) are what a script building on this measurement reuses."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc
from specdec_cli.client import add_connection_flags, call_metadata, format_table, open_channel
from specdec_cli.flags import UsageError

OFF = "off"
DEFAULT_SCHEDULES = "off,adaptive,k=2"
WARMUP_TOKENS = 8  # tokens of each warm-up request
PROBE_SECONDS = 30.0  # deadline of the first call, which tells whether an orchestrator answers
# Status codes that mean the request itself was wrong (a prompt past the context, a token id
# outside the vocabulary, a K the servers refuse): a usage error, exit status 2.
INPUT_ERRORS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")


@dataclass(frozen=True)
class BenchPrompt:
    name: str  # the line's "name", FILE:LINE, or the built-in prompt's name
    request: pb.GenerateRequest  # the prompt alone: prompt, prompt_token_ids or messages
    max_new_tokens: int | None = None  # the line's own max_tokens (None: --max-new-tokens)


@dataclass(frozen=True)
class Run:
    """One measured request, timed by the client."""
    prompt: str
    prompt_index: int
    repeat: int
    schedule: str
    token_ids: tuple[int, ...]
    seconds: float  # from sending the request to the end of its stream
    ttft_seconds: float | None  # from sending the request to the first message with tokens
    itl_seconds: tuple[float, ...]  # one sample per token after the first message with tokens
    finish_reason: str
    stats: pb.GenerationStats


class RequestFailed(Exception):
    """A request failed during the measurement (not because of what it asked for)."""

    def __init__(self, prompt: str, schedule: str, error: grpc.RpcError) -> None:
        super().__init__(f"{error.code().name}: {_one_line(error.details())} "
                         f"(prompt {prompt}, schedule {schedule})")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=Path, default=None, metavar="FILE.jsonl",
                        help='one JSON object a line: {"prompt": "..."}, {"messages": [{"role": '
                             '..., "content": ...}]} or {"prompt_token_ids": [...]}, optionally '
                             'with "max_tokens" and "name" (default: the built-in benchmark set '
                             "of 24 chat prompts, which needs a target with a tokenizer)")
    parser.add_argument("--limit", type=int, default=0,
                        help="measure only the first N prompts (of the built-in set: taken from its "
                             "four task kinds in turn; 0: all)")
    parser.add_argument("--schedules", default=DEFAULT_SCHEDULES,
                        help="comma-separated: off (target only), adaptive, heuristic, k=N (fixed "
                             "K = N); the speedup is measured against off")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="tokens per answer, unless a line of --prompts gives its max_tokens")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 is greedy: then outputs must be identical across schedules, and "
                             "are compared")
    parser.add_argument("--seed", type=int, default=None,
                        help="sampling seed of the first prompt, +1 for each next one; the same for "
                             "every schedule (default: random)")
    parser.add_argument("--repeats", type=int, default=1, help="times each prompt runs per schedule")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="concurrent requests. 1: one at a time, the schedules interleaved "
                             "prompt by prompt; N > 1: each schedule runs all prompts through N "
                             "streams in turn, and its tokens/s is the aggregate over that time")
    parser.add_argument("--warmup", type=int, default=1,
                        help=f"requests of {WARMUP_TOKENS} tokens per schedule before measuring, "
                             "not counted: the first calls pay one-off costs")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (summary per schedule, greedy comparison, every "
                             "request) instead of the tables; progress stays on stderr")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_connection_flags(parser, timeout_seconds=600.0)
    parser.set_defaults(func=run)


# ---------------------------------------------------------------------------------------------
# What to measure


def parse_schedules(text: str) -> dict[str, pb.SpeculationConfig]:
    """'off,adaptive,k=2' -> {name: SpeculationConfig}, in the order given."""
    schedules: dict[str, pb.SpeculationConfig] = {}
    for item in (part.strip().lower() for part in text.split(",")):
        if not item:
            continue
        if item == OFF:
            name, config = item, pb.SpeculationConfig(mode=pb.SPECULATION_MODE_OFF)
        elif item == "adaptive":
            name, config = item, pb.SpeculationConfig(mode=pb.SPECULATION_MODE_ADAPTIVE)
        elif item == "heuristic":
            name, config = item, pb.SpeculationConfig(mode=pb.SPECULATION_MODE_HEURISTIC)
        elif item.startswith("k=") and item[2:].isdigit() and item[2:].isascii() and int(item[2:]) >= 1:
            k = int(item[2:])
            name = f"k={k}"
            config = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=k)
        else:
            raise UsageError(f"--schedules: each one of off, adaptive, heuristic or k=N (N >= 1), "
                             f"got {item!r}")
        if name in schedules:
            raise UsageError(f"--schedules: {name} is given twice")
        schedules[name] = config
    if not schedules:
        raise UsageError("--schedules: give at least one schedule")
    return schedules


def load_prompts(path: Path, limit: int = 0) -> list[BenchPrompt]:
    """The prompts of a JSONL file (blank lines skipped). A malformed line is a UsageError naming
    FILE:LINE."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read --prompts {path}: {error}") from error
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        prompts.append(_parse_line(line, f"{path}:{number}"))
        if limit and len(prompts) == limit:
            break
    if not prompts:
        raise UsageError(f"--prompts {path} has no prompts")
    return prompts


def _parse_line(line: str, where: str) -> BenchPrompt:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as error:
        raise UsageError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(item, dict):
        raise UsageError(f"{where}: a line must be a JSON object")
    given = [key for key in PROMPT_FIELDS if key in item]
    if len(given) != 1:
        raise UsageError(f"{where}: needs exactly one of {', '.join(PROMPT_FIELDS)}")
    value = item[given[0]]
    if given[0] == "prompt":
        if not isinstance(value, str) or not value:
            raise UsageError(f"{where}: prompt must be a non-empty string")
        request = pb.GenerateRequest(prompt=value)
    elif given[0] == "messages":
        if (not isinstance(value, list) or not value or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in value)):
            raise UsageError(f'{where}: messages must be a non-empty list of {{"role": ..., '
                             '"content": ...}} with string values')
        request = pb.GenerateRequest(
            messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in value])
    else:
        if (not isinstance(value, list) or not value
                or not all(type(t) is int and 0 <= t < 2**31 for t in value)):
            raise UsageError(f"{where}: prompt_token_ids must be a non-empty list of non-negative "
                             "integers")
        request = pb.GenerateRequest(prompt_token_ids=value)
    if "max_tokens" in item and "max_new_tokens" in item:
        raise UsageError(f"{where}: give max_tokens or max_new_tokens, not both")
    max_tokens = item.get("max_tokens", item.get("max_new_tokens"))
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise UsageError(f"{where}: max_tokens must be an integer >= 1")
    name = item.get("name")
    if name is not None and not isinstance(name, str):
        raise UsageError(f"{where}: name must be a string")
    return BenchPrompt(name or where, request, max_tokens)


def builtin_prompts(limit: int = 0) -> list[BenchPrompt]:
    """The built-in benchmark set, its task kinds taken in turn (so a small --limit covers them)."""
    from specdec.prompt_sets import BENCHMARK_PROMPTS

    kinds = dict.fromkeys(p.kind for p in BENCHMARK_PROMPTS)  # in order of first appearance
    by_kind = [[p for p in BENCHMARK_PROMPTS if p.kind == kind] for kind in kinds]
    ordered = [group[i] for i in range(max(map(len, by_kind))) for group in by_kind if i < len(group)]
    chosen = ordered[:limit] if limit else ordered
    return [BenchPrompt(p.name, pb.GenerateRequest(
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in p.messages]))
        for p in chosen]


def plan(num_prompts: int, schedules: Sequence[str], repeats: int,
         concurrency: int) -> list[list[tuple[int, int, str]]]:
    """Batches of (repeat, prompt index, schedule), in the order they run; a batch is one
    schedule's and runs its requests concurrently. Concurrency 1: one request a batch, every
    prompt under every schedule before the next prompt, the schedules' order rotated from one
    prompt to the next (each schedule goes first equally often). Concurrency N: one batch per
    schedule and repeat with all the prompts, the schedules' order rotated each repeat."""
    order = list(schedules)
    batches = []
    for repeat in range(repeats):
        if concurrency == 1:
            for index in range(num_prompts):
                shift = (index + repeat) % len(order)
                batches += [[(repeat, index, s)] for s in order[shift:] + order[:shift]]
        else:
            shift = repeat % len(order)
            batches += [[(repeat, index, s) for index in range(num_prompts)]
                        for s in order[shift:] + order[:shift]]
    return batches


def request_for(prompt: BenchPrompt, speculation: pb.SpeculationConfig, max_new_tokens: int,
                temperature: float, seed: int | None) -> pb.GenerateRequest:
    request = pb.GenerateRequest()
    request.CopyFrom(prompt.request)
    request.max_new_tokens = prompt.max_new_tokens or max_new_tokens
    request.sampling.temperature = temperature
    if seed is not None:
        request.sampling.seed = seed
    request.speculation.CopyFrom(speculation)
    return request


# ---------------------------------------------------------------------------------------------
# Running it


def generate(stub: orchestrator_pb2_grpc.OrchestratorStub, request: pb.GenerateRequest, timeout: float,
             metadata) -> tuple[list[int], float, float | None, list[float], pb.GenerateResponse]:
    """One streamed request: (token ids, seconds, TTFT, ITL samples, last message). ITL: a round
    commits several tokens in one message, so each token of a message after the first message with
    tokens gets (gap since the previous message with tokens) / (tokens in the message)."""
    token_ids: list[int] = []
    itl: list[float] = []
    ttft = previous = None
    last = None
    started = time.perf_counter()
    for response in stub.Generate(request, timeout=timeout, metadata=metadata):
        now = time.perf_counter()
        if response.token_ids:
            if previous is None:
                ttft = now - started
            else:
                itl += [(now - previous) / len(response.token_ids)] * len(response.token_ids)
            previous = now
            token_ids.extend(response.token_ids)
        last = response
    seconds = time.perf_counter() - started
    if last is None:
        raise RuntimeError("the orchestrator ended the stream without a message")
    return token_ids, seconds, ttft, itl, last


def execute(stub, prompts: Sequence[BenchPrompt], schedules: dict[str, pb.SpeculationConfig],
            batches: list[list[tuple[int, int, str]]], *, max_new_tokens: int, temperature: float,
            seed: int | None, timeout: float, metadata=None, concurrency: int = 1,
            on_run: Callable[[Run], None] | None = None) -> tuple[list[Run], dict[tuple[str, int], float]]:
    """Runs the batches in order, a batch's requests through `concurrency` streams; returns the
    runs and each (schedule, repeat)'s seconds (its requests' time one at a time, else the summed
    wall time of its batches). A failed request raises RequestFailed, or UsageError when the
    request itself was refused."""

    def one(repeat: int, index: int, schedule: str) -> Run:
        prompt = prompts[index]
        request = request_for(prompt, schedules[schedule], max_new_tokens, temperature,
                              None if seed is None else seed + index)
        try:
            token_ids, seconds, ttft, itl, last = generate(stub, request, timeout, metadata)
        except grpc.RpcError as error:
            raise _request_error(prompt.name, schedule, error) from None
        result = Run(prompt.name, index, repeat, schedule, tuple(token_ids), seconds, ttft, tuple(itl),
                     pb.FinishReason.Name(last.finish_reason), last.stats)
        if on_run is not None:
            on_run(result)
        return result

    runs: list[Run] = []
    seconds: dict[tuple[str, int], float] = {}
    pool = ThreadPoolExecutor(concurrency) if concurrency > 1 else None
    try:
        for batch in batches:
            key = (batch[0][2], batch[0][0])
            started = time.perf_counter()
            if pool is None:  # one request at a time: its own time, without the progress output
                done = [one(*item) for item in batch]
                elapsed = sum(r.seconds for r in done)
            else:
                done = list(pool.map(lambda item: one(*item), batch))
                elapsed = time.perf_counter() - started
            runs += done
            seconds[key] = seconds.get(key, 0.0) + elapsed
    finally:
        if pool is not None:
            # On an error or Ctrl-C, queued requests are dropped and the caller's closing of the
            # channel cancels those in flight.
            pool.shutdown(wait=False, cancel_futures=True)
    return runs, seconds


def _request_error(prompt: str, schedule: str, error: grpc.RpcError) -> Exception:
    if error.code() in INPUT_ERRORS:
        return UsageError(f"prompt {prompt}, schedule {schedule}: {error.code().name}: "
                          f"{_one_line(error.details())}")
    return RequestFailed(prompt, schedule, error)


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


class Progress:
    """A tqdm bar on a terminal; elsewhere a line per request with an ETA; nothing when quiet."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.done = total, 0
        self.started = time.perf_counter()
        self.lock = threading.Lock()
        self.bar = None
        self.quiet = quiet
        if not quiet and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="specdec bench", unit="req", file=sys.stderr,
                            dynamic_ncols=True)

    def __call__(self, run: Run) -> None:
        rate = len(run.token_ids) / run.seconds if run.seconds > 0 else 0.0
        with self.lock:
            self.done += 1
            if self.bar is not None:
                self.bar.set_postfix_str(f"{run.prompt} {run.schedule} {rate:.1f} tok/s", refresh=False)
                self.bar.update(1)
            elif not self.quiet:
                elapsed = time.perf_counter() - self.started
                eta = elapsed / self.done * (self.total - self.done)
                print(f"[{self.done}/{self.total}] {run.prompt} {run.schedule}: "
                      f"{len(run.token_ids)} tokens, {rate:.1f} tok/s, ETA {_duration(eta)}",
                      file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


# ---------------------------------------------------------------------------------------------
# Figures


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between order statistics (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(runs: Sequence[Run], seconds: dict[tuple[str, int], float],
              schedules: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per schedule: tokens/s (its tokens over its seconds), speedup over off (None without off),
    τ, acceptance overall and per draft position, mean K, TTFT and ITL percentiles (seconds)."""
    summaries: dict[str, dict[str, Any]] = {}
    repeats = sorted({repeat for _, repeat in seconds})
    for schedule in schedules:
        chosen = [r for r in runs if r.schedule == schedule]
        tokens = sum(len(r.token_ids) for r in chosen)
        total_seconds = sum(seconds.get((schedule, repeat), 0.0) for repeat in repeats)
        rounds = sum(r.stats.rounds for r in chosen)
        committed = sum(r.stats.mean_accepted_length * r.stats.rounds for r in chosen)
        drafted = sum(r.stats.drafted_tokens for r in chosen)
        accepted = sum(r.stats.accepted_tokens for r in chosen)
        ks = [k for r in chosen for k in r.stats.num_speculative_tokens_per_round]
        drafted_at = [0] * max(ks, default=0)
        accepted_at = [0] * len(drafted_at)
        for r in chosen:
            for k, n in zip(r.stats.num_speculative_tokens_per_round, r.stats.num_accepted_per_round):
                for i in range(k):
                    drafted_at[i] += 1
                    accepted_at[i] += i < n
        ttft = [r.ttft_seconds for r in chosen if r.ttft_seconds is not None]
        itl = [sample for r in chosen for sample in r.itl_seconds]
        by_repeat = []
        for repeat in repeats:
            repeat_seconds = seconds.get((schedule, repeat), 0.0)
            repeat_tokens = sum(len(r.token_ids) for r in chosen if r.repeat == repeat)
            by_repeat.append(repeat_tokens / repeat_seconds if repeat_seconds > 0 else None)
        summaries[schedule] = {
            "requests": len(chosen),
            "tokens": tokens,
            "seconds": total_seconds,
            "tokens_per_second": tokens / total_seconds if total_seconds > 0 else None,
            "tokens_per_second_by_repeat": by_repeat,
            "speedup": None,
            "speedup_by_repeat": None,
            "tau": committed / rounds if rounds else None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "acceptance_per_position": [a / d if d else None for a, d in zip(accepted_at, drafted_at)],
            "drafted_per_position": drafted_at,
            "accepted_per_position": accepted_at,
            "mean_k": sum(ks) / len(ks) if ks else None,
            "rounds": rounds,
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "draft_unavailable_rounds": sum(r.stats.draft_unavailable_rounds for r in chosen),
            "ttft_seconds": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
            "itl_seconds": {"p50": percentile(itl, 50), "p99": percentile(itl, 99)},
        }
    if OFF in summaries:
        base = summaries[OFF]
        for summary in summaries.values():
            summary["speedup"] = _ratio(summary["tokens_per_second"], base["tokens_per_second"])
            summary["speedup_by_repeat"] = [
                _ratio(a, b) for a, b in zip(summary["tokens_per_second_by_repeat"],
                                             base["tokens_per_second_by_repeat"])]
    return summaries


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def greedy_mismatches(runs: Sequence[Run], schedules: Sequence[str]) -> tuple[str, list[dict]]:
    """(reference schedule, one entry per prompt whose outputs differ): every run of a prompt is
    compared with its first run under the reference schedule (off when measured)."""
    reference = OFF if OFF in schedules else schedules[0]
    mismatches = []
    for index in sorted({r.prompt_index for r in runs}):
        mine = [r for r in runs if r.prompt_index == index]
        base = min((r for r in mine if r.schedule == reference), key=lambda r: r.repeat)
        differ = []
        for r in sorted(mine, key=lambda r: (r.repeat, schedules.index(r.schedule))):
            if r.token_ids != base.token_ids:
                first = next((i for i, (a, b) in enumerate(zip(r.token_ids, base.token_ids)) if a != b),
                             min(len(r.token_ids), len(base.token_ids)))
                differ.append({"schedule": r.schedule, "repeat": r.repeat, "first_difference": first})
        if differ:
            mismatches.append({"prompt": base.prompt, "reference": reference, "differ": differ})
    return reference, mismatches


# ---------------------------------------------------------------------------------------------
# The command


def run(args: argparse.Namespace) -> int:
    for flag, value, least in (("--max-new-tokens", args.max_new_tokens, 1), ("--repeats", args.repeats, 1),
                               ("--concurrency", args.concurrency, 1), ("--limit", args.limit, 0),
                               ("--warmup", args.warmup, 0)):
        if value < least:
            raise UsageError(f"{flag} must be >= {least}, got {value}")
    if not args.temperature >= 0:
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
    schedules = parse_schedules(args.schedules)
    names = list(schedules)
    prompts = load_prompts(args.prompts, args.limit) if args.prompts else builtin_prompts(args.limit)
    metadata = call_metadata(args)
    batches = plan(len(prompts), names, args.repeats, args.concurrency)
    greedy = args.temperature == 0
    with open_channel(args) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        models = probe(stub, args, metadata)
        header = (f"specdec bench: {len(prompts)} prompts x {len(names)} schedules ({', '.join(names)}) "
                  f"x {args.repeats} repeat{'s' if args.repeats > 1 else ''}, up to "
                  f"{args.max_new_tokens} tokens, "
                  f"{'greedy' if greedy else f'temperature {args.temperature:g}'}, concurrency "
                  f"{args.concurrency}, orchestrator {args.orchestrator}"
                  + "".join(f", {role} {', '.join(ids)}" for role, ids in
                            sorted(models.items(), key=lambda item: item[0] != "target") if ids))
        if not (args.json and args.quiet):
            print(header, file=sys.stderr if args.json else sys.stdout, flush=True)
        common = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                      timeout=args.timeout, metadata=metadata)
        progress = None
        try:
            if args.warmup:
                warm = [BenchPrompt(prompts[0].name, prompts[0].request,
                                    min(WARMUP_TOKENS, prompts[0].max_new_tokens or args.max_new_tokens))]
                execute(stub, warm, schedules, plan(1, names, args.warmup, 1), **common)
            progress = Progress(sum(map(len, batches)), args.quiet)
            runs, seconds = execute(stub, prompts, schedules, batches, concurrency=args.concurrency,
                                    on_run=progress, **common)
        except RequestFailed as error:
            print(f"specdec: {error}", file=sys.stderr, flush=True)
            return 1
        finally:
            if progress is not None:
                progress.close()
    summaries = summarize(runs, seconds, names)
    reference, mismatches = greedy_mismatches(runs, names) if greedy else (None, [])
    if args.json:
        print(json.dumps({
            "orchestrator": args.orchestrator, "models": models,
            "prompt_source": str(args.prompts) if args.prompts else "built-in",
            "prompts": len(prompts), "schedules_order": names, "repeats": args.repeats,
            "concurrency": args.concurrency, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "seed": args.seed,
            "schedules": summaries,
            "greedy": {"compared": greedy, "reference": reference,
                       "identical": (not mismatches) if greedy else None, "mismatches": mismatches},
            "runs": [run_record(r) for r in runs],
        }))
    else:
        print()
        print(report(summaries, names, len(prompts), args.temperature, reference, mismatches))
    return 1 if mismatches else 0


def probe(stub, args: argparse.Namespace, metadata) -> dict[str, list[str]]:
    """Whether an orchestrator answers (a UsageError if not), and its pools' model ids by role."""
    try:
        response = stub.Pools(pb.PoolsRequest(), timeout=min(args.timeout, PROBE_SECONDS),
                              metadata=metadata)
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.UNIMPLEMENTED:
            return {}
        details = f"{error.code().name}: {_one_line(error.details())}"
        if error.code() in UNREACHABLE:
            raise UsageError(f"no orchestrator answered at {args.orchestrator} ({details})") from None
        raise UsageError(f"the orchestrator at {args.orchestrator} refused the call ({details})") from None
    models: dict[str, list[str]] = {}
    for pool in response.pools:
        ids = models.setdefault(pool.role, [])
        ids += [r.model_id for r in pool.replicas if r.model_id and r.model_id not in ids]
    return models


def run_record(r: Run) -> dict[str, Any]:
    return {"prompt": r.prompt, "repeat": r.repeat, "schedule": r.schedule,
            "generated_tokens": len(r.token_ids), "seconds": r.seconds, "ttft_seconds": r.ttft_seconds,
            "finish_reason": r.finish_reason, "rounds": r.stats.rounds,
            "drafted_tokens": r.stats.drafted_tokens, "accepted_tokens": r.stats.accepted_tokens,
            "num_speculative_tokens_per_round": list(r.stats.num_speculative_tokens_per_round),
            "num_accepted_per_round": list(r.stats.num_accepted_per_round),
            "decode_calls": r.stats.decode_calls, "shadow_probes": r.stats.shadow_probes,
            # why adaptive chose its K: its alpha, timings and fit at the request's end
            "controller_estimates": dict(sorted(r.stats.controller_estimates.items()))}


def report(summaries: dict[str, dict[str, Any]], schedules: Sequence[str], num_prompts: int,
           temperature: float, reference: str | None, mismatches: list[dict]) -> str:
    """The tables and lines `specdec bench` prints."""
    def number(value: float | None, digits: int = 2, suffix: str = "") -> str:
        return "-" if value is None else f"{value:.{digits}f}{suffix}"

    def ms(value: float | None) -> str:
        return number(None if value is None else value * 1000, 1)

    headers = ["schedule", "requests", "tokens", "tok/s", "speedup", "tau", "accept", "mean K",
               "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"]
    rows = [[name, str(s["requests"]), str(s["tokens"]), number(s["tokens_per_second"], 1),
             number(s["speedup"], 2, "x"), number(s["tau"]), number(s["acceptance_rate"]),
             number(s["mean_k"], 1), ms(s["ttft_seconds"]["p50"]), ms(s["ttft_seconds"]["p99"]),
             ms(s["itl_seconds"]["p50"]), ms(s["itl_seconds"]["p99"])]
            for name, s in summaries.items()]
    lines = [format_table(headers, rows)]
    lines.append("tok/s: a schedule's tokens over its time; speedup: over off, measured in the same run;\n"
                 "tau: committed tokens per round; TTFT and ITL (per token): ms, at the client")
    if OFF not in summaries:
        lines.append("no speedup: off is not among the schedules")
    repeats = len(next(iter(summaries.values()))["tokens_per_second_by_repeat"])
    if OFF in summaries and repeats > 1:
        lines.append("speedup by repeat: " + "; ".join(
            f"{name} " + " ".join(number(x, 2, "x") for x in s["speedup_by_repeat"])
            for name, s in summaries.items() if name != OFF))
    width = max((len(s["acceptance_per_position"]) for s in summaries.values()), default=0)
    if width:
        lines += ["", "acceptance per draft position (accepted at position i / drafted at position i):"]
        position_rows = [[name] + [number(x) for x in s["acceptance_per_position"]]
                         + [""] * (width - len(s["acceptance_per_position"]))
                         for name, s in summaries.items() if s["acceptance_per_position"]]
        lines.append(format_table(["schedule", *map(str, range(1, width + 1))], position_rows))
    for name, s in summaries.items():
        if s["draft_unavailable_rounds"]:
            lines.append(f"warning: {name}: {s['draft_unavailable_rounds']} rounds ran at K = 0 "
                         "because no draft replica could serve")
    lines.append("")
    if reference is None:
        lines.append(f"sampled outputs (temperature {temperature:g}): not compared")
    elif not mismatches:
        lines.append(f"greedy outputs: identical across the schedules for all {num_prompts} prompts")
    else:
        lines.append(f"greedy outputs DIFFER for {len(mismatches)} of {num_prompts} prompts "
                     f"(against {reference}):")
        for m in mismatches:
            lines.append(f"  {m['prompt']}: " + ", ".join(
                f"{d['schedule']} (repeat {d['repeat'] + 1}) from token {d['first_difference']}"
                for d in m["differ"]))
    return "\n".join(lines)
