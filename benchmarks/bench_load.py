"""Throughput and latency under load: closed-loop concurrent streams through the three services,
speculation off / adaptive / fixed K, against Hugging Face batched `generate` on the same target.

The stack is started as `specdec up` starts it (the services' default flags, no thread tuning):
target and draft services and an orchestrator, each its own process. For each number of streams
(1, 2, 4, 8, 16, 32) and each schedule (off, adaptive, k=2) a cell runs for --seconds-per-cell:
every stream is a closed loop, issuing its next streaming Generate as soon as its last one ended,
cycling through the benchmark prompts from an offset of its own (so streams do not all send the
same prompt). Schedules are interleaved within each stream count in a shuffled order, so every
schedule at a stream count sees about the same machine state; with --repeats N each schedule runs N
rounds there (each round of all schedules in its own shuffled order), a cell's figures are the
mean over its rounds, and how much speculation off moved between its rounds is the run's noise,
the margin of the "adaptive never below off" goal (at least 5 %).

What a cell counts:
  - the window: from the moment all streams start to --seconds-per-cell later. Only tokens that
    arrived inside the window count: aggregate tokens/s = all streams' tokens in the window /
    the window's length; a stream's rate = its tokens in the window / the window's length. At the
    end of the window no new request is issued, and the requests in flight run to their end
    (up to --drain-seconds, then they are cancelled), outside the window: their statistics give
    the mean K, their late tokens count for nothing.
  - time to first token (TTFT): client time from sending a request to the first message with
    tokens, for requests whose first token arrived inside the window.
  - inter-token latency (ITL): a round commits several tokens in one message, so each token of
    a message gets (gap since the previous message with tokens) / (tokens in the message) as its
    sample; samples of messages that arrived inside the window.
  - mean batch size and tokens per pass: from the target's Info running totals, taken at the
    start and the end of the window: delta(pass_sessions_total) / delta(passes_total) and
    delta(pass_rows_total) / delta(passes_total) (n/a from a server that does not report them).
  - mean K: K per round over the cell's completed requests (GenerationStats).
  - slowest / median: the slowest stream's rate over the median stream's (fairness).

The anchor: Hugging Face `generate` in this process on the same target directory, greedy, left
padding, at batch sizes equal to the stream counts, on the same prompts (chat template), the same
max_new_tokens, for each of --hf-dtypes, with torch's default threads, while the services are NOT
running (after them). Its tokens per row count up to and including the first end-of-sequence
token; the batch keeps stepping until every row is done (static batching, as HF does).

Ratios: a speculative cell against speculation off at the same stream count; speculation off
against the faster HF dtype at the same batch size; and every cell against the faster target-only
configuration (specdec off or HF batched generate) at that count. Greedy decoding throughout.

    python benchmarks/bench_load.py                          # the default pair, 15-25 min on 2 quiet cores
    python benchmarks/bench_load.py --streams 1,4 --schedules off --seconds-per-cell 10 --hf-dtypes float32
    python benchmarks/bench_load.py --quick --target DIR --draft DIR --dtype float64 --out /tmp/load

Progress goes to stderr; the tables to stdout; JSON and markdown to --out (load-STAMP.json/.md).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from specdec.v1 import common_pb2, draft_pb2_grpc, orchestrator_pb2_grpc, target_pb2_grpc
from specdec.v1 import orchestrator_pb2 as pb
from specdec_cli.bench_cmd import percentile
from specdec_cli.stack import StackConfig, local_stack, stop_on_signals
from specdec_cli.up_cmd import STACK_DRAFT_METHODS

import common  # benchmarks/common.py: a script's own folder is first on sys.path

OFF, ADAPTIVE = "off", "adaptive"
NOISE = 0.05  # "adaptive >= off - noise": within-run tokens/s moves by about this much
GOAL_OFF_SCALING_8 = 3.0  # off at 8 streams >= 3x off at 1
GOAL_ADAPTIVE_AT_1 = 1.15  # adaptive >= 1.15x off at 1 stream
GOAL_ADAPTIVE_AT_4 = 1.10  # adaptive >= 1.1x off at 4 streams
GOAL_OFF_VS_HF_8 = 0.8  # off at 8 streams >= 0.8x HF batched generate at batch 8
GOAL_FAIRNESS_32 = 0.5  # at 32 streams the slowest stream >= half the median stream's rate
PROMPT_SETS = ("benchmark", "grounded", "mixed")
PROMPT_STRIDE = 7  # stream i starts at prompt 7 i (mod 24): distinct offsets for up to 24 streams

FULL = {"streams": "1,2,4,8,16,32", "schedules": "off,adaptive,k=2", "seconds_per_cell": 25.0,
        "max_new_tokens": 48, "hf_dtypes": "float32,bfloat16", "hf_seconds": 4.0, "drain_seconds": 90.0}
QUICK = {"streams": "1,2", "schedules": "off,adaptive,k=2", "seconds_per_cell": 3.0,
         "max_new_tokens": 16, "hf_dtypes": "float32", "hf_seconds": 0.5, "drain_seconds": 60.0}


@dataclass(frozen=True)
class BenchConfig:
    streams: tuple[int, ...]
    schedules: tuple[str, ...]
    seconds_per_cell: float
    max_new_tokens: int
    drain_seconds: float
    target: str
    draft: str
    dtype: str | None  # the services' --dtype (None: their default, auto)
    device: str | None  # the services' --device (None: their default, cpu)
    draft_method: str  # the orchestrator's --draft-method, as `specdec up --draft-method` takes it
    packed_rows: str | None  # the model services' --packed-rows (None: their default, auto)
    draft_head: str | None  # the target's --draft-head (None: its default, auto)
    hf_dtypes: tuple[str, ...]
    hf_seconds: float  # timed HF generate calls per batch size run until this many seconds
    skip_hf: bool
    seed: int  # of the shuffled schedule order
    prompt_set: str  # PROMPT_SETS
    repeats: int  # rounds of every schedule at each stream count, interleaved
    quick: bool
    out: Path
    name: str

    def __post_init__(self) -> None:
        if not self.streams or min(self.streams) < 1 or len(set(self.streams)) != len(self.streams):
            raise ValueError("--streams: distinct stream counts >= 1")
        if not self.schedules or len(set(self.schedules)) != len(self.schedules):
            raise ValueError("--schedules: one or more distinct schedules")
        for schedule in self.schedules:
            speculation(schedule)  # raises on a bad name
        if self.repeats < 1:
            raise ValueError("--repeats >= 1")
        if self.prompt_set not in PROMPT_SETS:
            raise ValueError(f"--prompt-set: one of {', '.join(PROMPT_SETS)}")
        if self.seconds_per_cell <= 0 or self.max_new_tokens < 2 or self.drain_seconds < 0:
            raise ValueError("--seconds-per-cell > 0, --max-new-tokens >= 2, --drain-seconds >= 0")
        from specdec.models import DTYPES

        for dtype in self.hf_dtypes:
            if dtype not in DTYPES:
                raise ValueError(f"--hf-dtypes: each one of {sorted(DTYPES)}, got {dtype!r}")


PIPELINES = {"off": pb.PIPELINE_MODE_OFF, "on": pb.PIPELINE_MODE_ON, "auto": pb.PIPELINE_MODE_AUTO}


def speculation(schedule: str) -> pb.SpeculationConfig:
    """off, adaptive, or k=N (fixed K = N); adaptive and k=N optionally /off, /on or /auto
    (pipelining; unset: the server's default)."""
    base, _, pipeline = schedule.partition("/")
    if pipeline and (base == OFF or pipeline not in PIPELINES):
        raise ValueError(f"a pipelined schedule is adaptive/MODE or k=N/MODE, MODE one of "
                         f"{sorted(PIPELINES)}, got {schedule!r}")
    if base == OFF:
        return pb.SpeculationConfig(mode=pb.SPECULATION_MODE_OFF)
    if base == ADAPTIVE:
        config = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_ADAPTIVE)
    elif base.startswith("k=") and base[2:].isdigit() and int(base[2:]) >= 1:
        config = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=int(base[2:]))
    else:
        raise ValueError(f"a schedule is off, adaptive or k=N (N >= 1), got {schedule!r}")
    if pipeline:
        config.pipeline = PIPELINES[pipeline]
    return config


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke preset: streams 1,2; 3 s cells; 16 tokens; HF float32, short")
    parser.add_argument("--streams", help=f"concurrent stream counts (default {FULL['streams']})")
    parser.add_argument("--schedules", help=f"off, adaptive, k=N, the last two optionally /off, /on or /auto "
                                            f"(pipelining) (default {FULL['schedules']})")
    parser.add_argument("--seconds-per-cell", type=float,
                        help=f"length of each cell's window (default {FULL['seconds_per_cell']:g})")
    parser.add_argument("--max-new-tokens", type=int, help=f"per request (default {FULL['max_new_tokens']})")
    parser.add_argument("--drain-seconds", type=float,
                        help="after a window, how long requests in flight may run on before they are "
                             f"cancelled (default {FULL['drain_seconds']:g})")
    parser.add_argument("--target", default="default", help="target model directory or 'default'")
    parser.add_argument("--draft", default="default", help="draft model directory or 'default'")
    parser.add_argument("--dtype", default=None, help="the services' --dtype (default: theirs, auto)")
    parser.add_argument("--device", default=None, help="the services' --device and HF's (default cpu)")
    parser.add_argument("--draft-method", choices=STACK_DRAFT_METHODS, default=StackConfig.draft_method,
                        help="the stack's draft method, as `specdec up --draft-method` "
                             f"(default {StackConfig.draft_method}, as `specdec up` runs)")
    parser.add_argument("--packed-rows", default=None,
                        help="the model services' --packed-rows, auto, off or N,N (default: theirs, auto)")
    parser.add_argument("--draft-head", default=None,
                        help="the target's --draft-head: auto, none or a directory (default: its default, auto)")
    parser.add_argument("--hf-dtypes", help=f"dtypes of the HF anchor (default {FULL['hf_dtypes']})")
    parser.add_argument("--hf-seconds", type=float,
                        help=f"timed HF generate per batch size, at least (default {FULL['hf_seconds']:g})")
    parser.add_argument("--skip-hf", action="store_true", help="no Hugging Face anchor")
    parser.add_argument("--seed", type=int, default=0, help="seed of the shuffled schedule order")
    parser.add_argument("--prompt-set", default="benchmark", choices=PROMPT_SETS,
                        help="the requests' prompts: benchmark (open-ended: code, explanation, chat, "
                             "translation), grounded (the answer repeats the input: edit this code, "
                             "quote this passage) or mixed (both) (default benchmark)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of every schedule at each stream count, each round in a shuffled "
                             "order; a cell's figures are then the mean over its rounds, and the "
                             "spread of the off rounds is the run's noise (default 1)")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="directory for the results")
    parser.add_argument("--name", default="", help="file stem after 'load-' (default: a UTC timestamp)")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL

    def pick(name: str):
        value = getattr(args, name)
        return preset[name] if value is None else value

    try:
        return BenchConfig(
            streams=tuple(sorted(int(x) for x in common.comma_items(pick("streams")))),
            schedules=tuple(x.lower() for x in common.comma_items(pick("schedules"))),
            seconds_per_cell=float(pick("seconds_per_cell")), max_new_tokens=int(pick("max_new_tokens")),
            drain_seconds=float(pick("drain_seconds")), target=args.target, draft=args.draft,
            dtype=args.dtype, device=args.device, draft_method=args.draft_method,
            packed_rows=args.packed_rows, draft_head=args.draft_head, hf_dtypes=tuple(common.comma_items(pick("hf_dtypes"))),
            hf_seconds=float(pick("hf_seconds")), skip_hf=args.skip_hf, seed=args.seed, repeats=args.repeats,
            prompt_set=args.prompt_set,
            quick=args.quick,
            out=args.out, name=args.name or common.utc_stamp(),
        )
    except ValueError as error:
        parser.error(str(error))


def prompt_for(prompts: list, stream: int, request: int):
    """Stream `stream`'s `request`-th prompt: the set cycled from an offset of the stream's own."""
    return prompts[(stream * PROMPT_STRIDE + request) % len(prompts)]


# ---------------------------------------------------------------------------------------------
# Statistics


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


# ---------------------------------------------------------------------------------------------
# Services


@dataclass
class Counters:
    """A replica's Info at one moment: live sessions and the batching running totals."""

    live_sessions: int
    passes_total: int
    pass_rows_total: int
    pass_sessions_total: int


class Replicas:
    """Info of the target and the draft service (the batching counters; 0 from an older server)."""

    def __init__(self, target_address: str, draft_address: str) -> None:
        self._channels = [grpc.insecure_channel(target_address), grpc.insecure_channel(draft_address)]
        self._stubs = {"target": target_pb2_grpc.TargetServiceStub(self._channels[0]),
                       "draft": draft_pb2_grpc.DraftServiceStub(self._channels[1])}

    def info(self, role: str) -> Counters:
        response = self._stubs[role].Info(common_pb2.InfoRequest(), timeout=30)
        return Counters(*(int(getattr(response, name, 0)) for name in (
            "live_sessions", "passes_total", "pass_rows_total", "pass_sessions_total")))

    def packings(self) -> dict[str, str]:
        """How each service packed its linear layers (Info's linear_packing: "any" for oneDNN's,
        MKL's row counts, "none"), what `--packed-rows auto` chose at load."""
        return {role: getattr(stub.Info(common_pb2.InfoRequest(), timeout=30), "linear_packing", "")
                or "none" for role, stub in self._stubs.items()}

    def snapshot(self) -> dict[str, Counters]:
        return {role: self.info(role) for role in self._stubs}

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Until neither replica holds a session (the last cell's are released)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.info(role).live_sessions == 0 for role in self._stubs):
                return True
            time.sleep(0.1)
        return False

    def close(self) -> None:
        for channel in self._channels:
            channel.close()


def batching(before: Counters, after: Counters) -> dict:
    """Mean sessions and rows per forward pass between two Info snapshots (None: not reported)."""
    passes = after.passes_total - before.passes_total
    if passes <= 0:
        return {"passes": passes, "mean_batch": None, "tokens_per_pass": None}
    return {"passes": passes,
            "mean_batch": (after.pass_sessions_total - before.pass_sessions_total) / passes,
            "tokens_per_pass": (after.pass_rows_total - before.pass_rows_total) / passes}


# ---------------------------------------------------------------------------------------------
# A cell: closed-loop streams for a window


@dataclass
class Request:
    stream: int
    prompt: str
    started: float  # seconds from the window's start
    messages: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) with tokens
    completed: bool = False
    error: str = ""
    generated: int = 0
    ks: list[int] = field(default_factory=list)
    accepted: int = 0
    lookup_drafts: int = 0  # tokens the target looked up in its Decode passes, verified
    lookup_accepted: int = 0  # of those, accepted
    lookup_price: float | None = None  # the controller's price of such a row at the request's end
    head_drafts: int = 0  # drafts of the target's draft head verified in its Decode passes
    head_accepted: int = 0  # of those, accepted
    finish_reason: str = ""


class Cell:
    """One (schedule, streams) window. Times are perf_counter seconds minus the window's start."""

    def __init__(self, address: str, schedule: str, streams: int, config: BenchConfig, prompts: list):
        self.address, self.schedule, self.streams = address, schedule, streams
        self.config, self.prompts = config, prompts
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._calls: dict[int, grpc.Call] = {}
        self._start = 0.0
        self._deadline = 0.0
        self._ready = threading.Barrier(streams + 1)  # every stream's channel is connected
        self._go = threading.Event()  # the window is open (its start and end are set)

    def _stream(self, index: int) -> None:
        channel = grpc.insecure_channel(self.address)
        try:
            grpc.channel_ready_future(channel).result(timeout=60)
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            self._ready.wait()
            self._go.wait()
            number = 0
            while time.perf_counter() < self._deadline:
                prompt = prompt_for(self.prompts, index, number)
                number += 1
                self._one(stub, index, prompt)
        finally:
            channel.close()

    def _one(self, stub, index: int, prompt) -> None:
        request = common.chat_request(prompt.messages, self.config.max_new_tokens, speculation(self.schedule))
        record = Request(index, prompt.name, time.perf_counter() - self._start)
        with self._lock:
            self.requests.append(record)
        timeout = self.config.seconds_per_cell + self.config.drain_seconds + 600
        call = stub.Generate(request, timeout=timeout)
        with self._lock:
            self._calls[index] = call
        try:
            last = None
            for response in call:
                if response.token_ids:
                    record.messages.append((time.perf_counter() - self._start, len(response.token_ids)))
                last = response
            if last is None:
                raise RuntimeError("Generate returned no message")
            stats = last.stats
            record.completed = True
            record.generated = stats.generated_tokens
            record.ks = list(stats.num_speculative_tokens_per_round)
            record.accepted = stats.accepted_tokens
            record.lookup_drafts = stats.decode_lookup_drafts
            record.lookup_accepted = stats.decode_lookup_accepted
            record.lookup_price = stats.controller_estimates.get("decode_lookup_min_chance")
            record.head_drafts = stats.decode_head_drafts
            record.head_accepted = stats.decode_head_accepted
            record.finish_reason = pb.FinishReason.Name(last.finish_reason)
        except grpc.RpcError as error:
            record.error = error.code().name if error.code() else str(error)
            if error.code() != grpc.StatusCode.CANCELLED:
                time.sleep(0.2)  # an error is not a hot loop
        except RuntimeError as error:
            record.error = str(error)
        finally:
            with self._lock:
                self._calls.pop(index, None)

    def run(self, replicas: Replicas) -> dict:
        threads = [threading.Thread(target=self._stream, args=(i,), daemon=True) for i in range(self.streams)]
        for thread in threads:
            thread.start()
        self._ready.wait(timeout=120)
        before = replicas.snapshot()
        self._start = time.perf_counter()
        self._deadline = self._start + self.config.seconds_per_cell
        self._go.set()
        time.sleep(max(0.0, self._deadline - time.perf_counter()))
        after = replicas.snapshot()
        window_end = time.perf_counter() - self._start
        drain_until = time.perf_counter() + self.config.drain_seconds
        for thread in threads:
            thread.join(max(0.0, drain_until - time.perf_counter()))
        cancelled = 0
        if any(thread.is_alive() for thread in threads):
            with self._lock:
                for call in self._calls.values():
                    call.cancel()
                    cancelled += 1
            for thread in threads:
                thread.join(60)
        drain = time.perf_counter() - self._start - window_end
        return self.summary(window_end, before, after, drain, cancelled)

    def summary(self, window: float, before: dict, after: dict, drain: float, cancelled: int) -> dict:
        per_stream = [0] * self.streams
        ttft, itl = [], []
        for r in self.requests:
            previous = None
            for arrival, count in r.messages:
                if arrival <= window:
                    per_stream[r.stream] += count
                    if previous is None:
                        ttft.append(arrival - r.started)
                    else:
                        itl.extend([(arrival - previous) / count] * count)
                previous = arrival
        rates = [tokens / window for tokens in per_stream]
        completed = [r for r in self.requests if r.completed]
        ks = [k for r in completed for k in r.ks]
        rounds = len(ks)
        target = batching(before["target"], after["target"])
        draft = batching(before["draft"], after["draft"])
        median_rate = statistics.median(rates)
        return {
            "schedule": self.schedule,
            "streams": self.streams,
            "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "window_seconds": window,
            "drain_seconds": drain,
            "tokens_in_window": sum(per_stream),
            "tokens_per_second": sum(per_stream) / window,
            "requests_started": len(self.requests),
            "requests_completed": len(completed),
            "requests_cancelled_after_drain": cancelled,
            "errors": dict(Counter(r.error for r in self.requests if r.error and r.error != "CANCELLED")),
            "finish_reasons": dict(Counter(r.finish_reason for r in completed)),
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99), "ttft_samples": len(ttft),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99), "itl_samples": len(itl),
            "mean_batch": target["mean_batch"], "tokens_per_pass": target["tokens_per_pass"],
            "target_passes": target["passes"],
            "draft_mean_batch": draft["mean_batch"], "draft_tokens_per_pass": draft["tokens_per_pass"],
            "draft_passes": draft["passes"],
            "mean_k": sum(ks) / rounds if rounds else None,
            "tau": (sum(r.accepted for r in completed) + rounds) / rounds if rounds else None,
            "decode_lookup_drafts": sum(r.lookup_drafts for r in completed),
            "decode_lookup_accepted": sum(r.lookup_accepted for r in completed),
            "decode_lookup_min_chance": mean_of([r.lookup_price for r in completed]),
            "decode_head_drafts": sum(r.head_drafts for r in completed),
            "decode_head_accepted": sum(r.head_accepted for r in completed),
            "stream_tokens_per_second": rates,
            "slowest_over_median": ratio(min(rates), median_rate),
        }


def warm_up(address: str, config: BenchConfig, prompts: list) -> None:
    """Untimed: one short request per schedule, then one burst at the largest stream count with
    the schedules mixed (connections, first forward passes, batch shapes)."""
    with common.OrchestratorClient(address) as client:
        for schedule in config.schedules:
            client.generate(common.chat_request(prompts[0].messages, 8, speculation(schedule)))
    burst = max(config.streams)

    def one(index: int) -> None:
        with common.OrchestratorClient(address) as client:
            schedule = config.schedules[index % len(config.schedules)]
            client.generate(common.chat_request(prompt_for(prompts, index, 0).messages, 4, speculation(schedule)))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(burst)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


class Eta:
    """Remaining time: the cells left at the mean measured cell time (an estimate before the
    first), plus the HF anchor's estimate."""

    def __init__(self, config: BenchConfig, cells: int) -> None:
        self.cells_left = cells
        self.cell_seconds: list[float] = []
        self.guess_cell = config.seconds_per_cell * 1.5 + 3
        self.hf_seconds = 0.0 if config.skip_hf else hf_estimate(config)

    def cell_done(self, seconds: float) -> None:
        self.cells_left -= 1
        self.cell_seconds.append(seconds)

    def remaining(self) -> float:
        per_cell = statistics.mean(self.cell_seconds) if self.cell_seconds else self.guess_cell
        return self.cells_left * per_cell + self.hf_seconds


def hf_estimate(config: BenchConfig) -> float:
    return len(config.hf_dtypes) * (10.0 + len(config.streams) * (config.hf_seconds * 1.5 + 2.0))


def minutes(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s"


def run_cells(address: str, replicas: Replicas, config: BenchConfig, prompts: list,
              progress: common.Progress, eta: Eta) -> list[dict]:
    rng = random.Random(config.seed)
    cells = []
    for streams in config.streams:
        order = []
        for _ in range(config.repeats):  # interleaved: the schedules at one stream count see the same machine
            rounds = list(config.schedules)
            rng.shuffle(rounds)
            order += rounds
        for schedule in order:
            if not replicas.wait_idle():
                common.note("warning: the services still hold sessions from the last cell")
            started = time.monotonic()
            cell = Cell(address, schedule, streams, config, prompts).run(replicas)
            eta.cell_done(time.monotonic() - started)
            cells.append(cell)
            problems = ""
            if cell["errors"]:
                problems = f"; ERRORS {cell['errors']}"
            if cell["requests_cancelled_after_drain"]:
                problems += f"; {cell['requests_cancelled_after_drain']} cancelled after the drain limit"
            progress.step(
                f"{streams:>2} streams {schedule:<8}: {cell['tokens_per_second']:7.1f} tok/s, "
                f"TTFT p50 {ms(cell['ttft_p50'])} ms, ITL p50 {ms(cell['itl_p50'])} ms, "
                f"batch {num(cell['mean_batch'])}, K {num(cell['mean_k'])}, "
                f"{lookups(cell)}{cell['requests_completed']} requests; ETA {minutes(eta.remaining())}{problems}")
    return merge_repeats(cells)


def lookups(cell: dict) -> str:
    """"looked up 120/300, head 80/200, ": the target's own lookups and its draft head's drafts in
    Decode passes, accepted / verified."""
    text = ""
    if cell.get("decode_lookup_drafts"):
        price = cell.get("decode_lookup_min_chance")
        text = (f"looked up {cell['decode_lookup_accepted']}/{cell['decode_lookup_drafts']}"
                f"{f' at >= {price:.2f}' if price is not None else ''}, ")
    if cell.get("decode_head_drafts"):
        text += f"head {cell['decode_head_accepted']}/{cell['decode_head_drafts']}, "
    return text


def mean_of(values: list[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.mean(known) if known else None


MEAN_FIELDS = ("tokens_per_second", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "mean_batch",
               "tokens_per_pass", "draft_mean_batch", "draft_tokens_per_pass", "mean_k", "tau",
               "slowest_over_median", "load_average_1m", "decode_lookup_min_chance")
SUM_FIELDS = ("window_seconds", "drain_seconds", "tokens_in_window", "requests_started", "requests_completed",
              "requests_cancelled_after_drain", "target_passes", "draft_passes", "ttft_samples", "itl_samples",
              "decode_lookup_drafts", "decode_lookup_accepted", "decode_head_drafts", "decode_head_accepted")


def merge_repeats(cells: list[dict]) -> list[dict]:
    """One cell per (schedule, streams): with repeated rounds, the mean of each figure over them
    (counts summed) and each round's tokens/s in tokens_per_second_rounds."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for cell in cells:
        groups.setdefault((cell["schedule"], cell["streams"]), []).append(cell)
    merged = []
    for rounds in groups.values():
        cell = dict(rounds[0])
        for name in MEAN_FIELDS:
            values = [r[name] for r in rounds if r.get(name) is not None]
            cell[name] = statistics.mean(values) if values else None
        for name in SUM_FIELDS:
            cell[name] = sum(r[name] or 0 for r in rounds)
        cell["errors"] = dict(sum((Counter(r["errors"]) for r in rounds), Counter()))
        cell["finish_reasons"] = dict(sum((Counter(r["finish_reasons"]) for r in rounds), Counter()))
        cell["tokens_per_second_rounds"] = [r["tokens_per_second"] for r in rounds]
        merged.append(cell)
    return merged


def run_noise(cells: list[dict]) -> dict[int, float]:
    """How much speculation off moved between its rounds, per stream count: (max - min) / mean of
    its rounds' tokens/s (stream counts with one round are left out)."""
    return {cell["streams"]: (max(rates) - min(rates)) / statistics.mean(rates) for cell in cells
            if cell["schedule"] == OFF for rates in [cell.get("tokens_per_second_rounds", [])] if len(rates) > 1}


# ---------------------------------------------------------------------------------------------
# The anchor: Hugging Face batched generate, in-process


class HfTarget:
    """The target as plain Hugging Face loads it, for batched greedy `generate` with left padding."""

    def __init__(self, path: Path, tokenizer, dtype: str, device: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from specdec.models import DTYPES, eos_token_ids

        self.torch, self.device = torch, device
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()
        self.eos_ids = set(eos_token_ids(self.model, tokenizer))  # the end-of-sequence ids the services use
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids, default=0)

    def generate(self, rows: list[list[int]], max_new_tokens: int) -> int:
        """Generated tokens summed over the rows, each up to and including its first EOS."""
        from transformers import GenerationConfig

        torch, width = self.torch, max(map(len, rows))
        ids = torch.tensor([[self.pad] * (width - len(r)) + r for r in rows], device=self.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        generation = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                                      eos_token_id=sorted(self.eos_ids) or None, pad_token_id=self.pad)
        with torch.no_grad():
            output = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=generation)
        return sum(next((i + 1 for i, t in enumerate(row) if t in self.eos_ids), len(row))
                   for row in output[:, width:].tolist())


def hf_anchor(config: BenchConfig, prompts: list, progress: common.Progress) -> dict:
    """dtype -> batch size -> tokens/s of HF generate on the target (services stopped)."""
    from specdec.models import load_tokenizer, resolve_model_dir

    path = resolve_model_dir(config.target, "target")
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise SystemExit(f"the target {path} has no tokenizer: the HF anchor needs one (or --skip-hf)")
    results: dict[str, dict[str, dict]] = {}

    def encode(prompt) -> list[int]:  # as the orchestrator renders chat messages
        encoded = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=True)
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return [int(t) for t in ids]

    for dtype in config.hf_dtypes:
        target = HfTarget(path, tokenizer, dtype, config.device or "cpu")
        results[dtype] = {}
        for index, batch in enumerate(config.streams):
            for _ in range(2 if index == 0 else 1):  # untimed warm-up; the first calls are slower
                target.generate([encode(prompt_for(prompts, i, 0)) for i in range(batch)],
                                min(8, config.max_new_tokens))
            tokens, seconds, repetition, per_call = 0, 0.0, 0, []
            while seconds < config.hf_seconds or repetition == 0:
                rows = [encode(prompt_for(prompts, i, repetition)) for i in range(batch)]
                started = time.perf_counter()
                count = target.generate(rows, config.max_new_tokens)
                elapsed = time.perf_counter() - started
                tokens, seconds, repetition = tokens + count, seconds + elapsed, repetition + 1
                per_call.append(count / elapsed)
            results[dtype][str(batch)] = {"tokens_per_second": tokens / seconds, "tokens": tokens,
                                          "seconds": seconds, "generate_calls": repetition,
                                          "per_call_tokens_per_second": per_call}
            progress.step(f"HF generate {dtype:<8} batch {batch:>2}: {tokens / seconds:7.1f} tok/s "
                          f"({repetition} call(s))")
        del target
        gc.collect()
    return results


# ---------------------------------------------------------------------------------------------
# Summary


def cell_map(cells: list[dict]) -> dict[tuple[str, int], dict]:
    return {(c["schedule"], c["streams"]): c for c in cells}


def hf_best(hf: dict, batch: int) -> tuple[float | None, str | None]:
    """The faster HF dtype's tokens/s at a batch size."""
    candidates = [(figures[str(batch)]["tokens_per_second"], dtype) for dtype, figures in hf.items()
                  if str(batch) in figures]
    return max(candidates) if candidates else (None, None)


def faster_target_only(by: dict, hf: dict, streams: int) -> tuple[float | None, str]:
    """The faster target-only configuration at a stream count / batch size: speculation off
    through the services, or HF batched generate (its faster dtype)."""
    candidates = []
    if (OFF, streams) in by:
        candidates.append((by[(OFF, streams)]["tokens_per_second"], "specdec off"))
    best, dtype = hf_best(hf, streams)
    if best:
        candidates.append((best, f"HF {dtype}"))
    return max(candidates) if candidates else (None, "")


def comparisons(cells: list[dict], hf: dict, config: BenchConfig) -> dict:
    by = cell_map(cells)
    over_off, over_faster = {}, {}
    for schedule in config.schedules:
        for n in config.streams:
            if (schedule, n) not in by:
                continue
            tps = by[(schedule, n)]["tokens_per_second"]
            if schedule != OFF and (OFF, n) in by:
                over_off.setdefault(schedule, {})[str(n)] = ratio(tps, by[(OFF, n)]["tokens_per_second"])
            faster, label = faster_target_only(by, hf, n)
            over_faster.setdefault(schedule, {})[str(n)] = {"ratio": ratio(tps, faster), "against": label}
    off_over_hf = {}
    for n in config.streams:
        best, dtype = hf_best(hf, n)
        if (OFF, n) in by and best:
            off_over_hf[str(n)] = {"ratio": by[(OFF, n)]["tokens_per_second"] / best, "hf_dtype": dtype}
    return {"over_off": over_off, "off_over_hf_best": off_over_hf, "over_faster_target_only": over_faster}


def goals(cells: list[dict], hf: dict, config: BenchConfig) -> list[dict]:
    """Each goal: its figure, the threshold and whether it was met (None: not measured here)."""
    by = cell_map(cells)

    def tps(schedule: str, n: int) -> float | None:
        return by[(schedule, n)]["tokens_per_second"] if (schedule, n) in by else None

    def goal(name: str, value: float | None, threshold: float, kind: str = "at least") -> dict:
        met = None if value is None else (value >= threshold if kind == "at least" else value <= threshold)
        return {"goal": name, "value": value, "threshold": threshold, "met": met}

    result = [goal("speculation off: 8 streams over 1 stream, aggregate tokens/s",
                   ratio(tps(OFF, 8), tps(OFF, 1)), GOAL_OFF_SCALING_8)]
    # Adaptive over off, less its margin at each stream count: the run's noise there (off's spread
    # over its rounds), at least NOISE. The goal holds when the worst of these is >= 1.
    measured = run_noise(cells)
    margins = {n: max(NOISE, measured.get(n, 0.0)) for n in config.streams}
    worst = [(ratio(tps(ADAPTIVE, n), tps(OFF, n)), n) for n in config.streams]
    worst = [(value, n) for value, n in worst if value is not None]
    value, n = min(worst, key=lambda item: item[0] + margins[item[1]]) if worst else (None, None)
    spread = (f"; off's spread over its rounds there: {measured[n]:.3f}" if n in measured else "")
    result.append(goal(f"adaptive over off at every stream count, the lowest against its margin "
                       f"(at {n} streams: >= 1 - {margins.get(n, NOISE):.2f}, the run's noise, at least {NOISE:g}{spread})",
                       value, round(1.0 - margins.get(n, NOISE), 3)))
    result.append(goal("adaptive over off at 1 stream", ratio(tps(ADAPTIVE, 1), tps(OFF, 1)), GOAL_ADAPTIVE_AT_1))
    result.append(goal("adaptive over off at 4 streams", ratio(tps(ADAPTIVE, 4), tps(OFF, 4)), GOAL_ADAPTIVE_AT_4))
    best8, dtype8 = hf_best(hf, 8)
    result.append(goal(f"speculation off at 8 streams over HF batched generate at batch 8 ({dtype8 or 'n/a'})",
                       ratio(tps(OFF, 8), best8), GOAL_OFF_VS_HF_8))
    for schedule in config.schedules:
        if (schedule, 32) in by:
            result.append(goal(f"{schedule} at 32 streams: slowest stream over the median stream",
                               by[(schedule, 32)]["slowest_over_median"], GOAL_FAIRNESS_32))
    return result


def itl_report(cells: list[dict], config: BenchConfig) -> list[dict]:
    """Not a gate: p99 inter-token latency at 8 and 32 streams over 1 stream, per schedule."""
    by = cell_map(cells)
    rows = []
    for schedule in config.schedules:
        if (schedule, 1) not in by:
            continue
        base = by[(schedule, 1)]["itl_p99"]
        for n in (8, 32):
            if (schedule, n) in by:
                rows.append({"schedule": schedule, "streams": n, "itl_p99": by[(schedule, n)]["itl_p99"],
                             "itl_p99_at_1": base, "ratio": ratio(by[(schedule, n)]["itl_p99"], base)})
    return rows


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.0f}"


def num(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def render_cells(cells: list[dict], hf: dict, config: BenchConfig, markdown: bool) -> str:
    by = cell_map(cells)
    headers = ["schedule", "streams", "tok/s", "ratio", "vs faster target-only", "TTFT p50", "TTFT p99",
               "ITL p50", "ITL p99", "batch", "tok/pass", "mean K", "slowest/median", "requests"]
    rows = []
    for schedule in config.schedules:
        for n in config.streams:
            c = by.get((schedule, n))
            if c is None:
                continue
            if schedule == OFF:
                best, dtype = hf_best(hf, n)
                versus = f"{times(ratio(c['tokens_per_second'], best))} HF {dtype}" if best else ""
            else:
                base = by.get((OFF, n))
                versus = f"{times(ratio(c['tokens_per_second'], base['tokens_per_second']))} off" if base else ""
            faster, label = faster_target_only(by, hf, n)
            versus_faster = f"{times(ratio(c['tokens_per_second'], faster))} {label}" if faster else ""
            requests = f"{c['requests_completed']}"
            if c["errors"]:
                requests += f" ({sum(c['errors'].values())} errors)"
            rows.append([schedule, str(n), f"{c['tokens_per_second']:.1f}", versus, versus_faster,
                         ms(c["ttft_p50"]), ms(c["ttft_p99"]), ms(c["itl_p50"]), ms(c["itl_p99"]),
                         num(c["mean_batch"], 2), num(c["tokens_per_pass"], 2), num(c["mean_k"], 2),
                         num(c["slowest_over_median"], 2), requests])
    return common.format_table(headers, rows, markdown=markdown, left_columns=2)


def render_hf(cells: list[dict], hf: dict, config: BenchConfig, markdown: bool) -> str:
    by = cell_map(cells)
    headers = ["batch", *(f"HF {dtype} tok/s" for dtype in config.hf_dtypes), "specdec off tok/s",
               "off / HF best"]
    rows = []
    for n in config.streams:
        best, _ = hf_best(hf, n)
        off = by.get((OFF, n))
        rows.append([str(n), *(num(hf.get(dtype, {}).get(str(n), {}).get("tokens_per_second"))
                               for dtype in config.hf_dtypes),
                     num(off["tokens_per_second"]) if off else "n/a",
                     times(ratio(off["tokens_per_second"], best)) if off else "n/a"])
    return common.format_table(headers, rows, markdown=markdown, left_columns=1)


def describe(config: BenchConfig, environment: dict) -> list[str]:
    setup = (f"Closed-loop streams, {config.seconds_per_cell:g} s window per cell, {config.max_new_tokens} new "
             f"tokens per request, greedy, {config.prompt_set} prompts; target {config.target}, draft {config.draft} ({config.draft_method} "
             f"draft method), services' dtype {config.dtype or 'default (auto)'}, "
             + (f"--packed-rows {config.packed_rows}, other service flags default; " if config.packed_rows
                else "default service flags; ")
             + (f"the target's --draft-head {config.draft_head}; " if config.draft_head else "")
             + (f"linear layers packed: {', '.join(f'{role} {how}' for role, how in packings.items())}; "
                if (packings := environment.get("linear_packing")) else "")
             + f"{environment.get('cpu_count')} CPUs."
             + (f" Each cell: the mean of {config.repeats} rounds, interleaved with the other schedules' "
                "(tok/s of each round in the JSON)." if config.repeats > 1 else ""))
    legend = ("tok/s: all streams' tokens that arrived inside the window / the window. TTFT and ITL in ms "
              "(ITL: each token of a message gets the gap since the previous message / its tokens). "
              "batch and tok/pass: the target's sessions and rows per forward pass over the window "
              "(n/a: the server does not report them). mean K: per round, completed requests. "
              "ratio: a speculative schedule over off at the same streams; off over the faster HF dtype "
              "at the same batch size. vs faster target-only: over the faster of specdec off and HF "
              "batched generate at the same streams / batch size.")
    return [setup, legend]


def busy_warnings(hf: dict) -> list[str]:
    """HF generate calls on the same batch size whose rates differ more than 2x: the machine was
    busy while it ran, and every figure of the run is suspect."""
    lines = []
    for dtype, figures in hf.items():
        for batch, f in figures.items():
            rates = f.get("per_call_tokens_per_second", [])
            if len(rates) > 1 and max(rates) > 2 * min(rates):
                lines.append(f"- warning: HF {dtype} at batch {batch} ran at {min(rates):.1f} to {max(rates):.1f} "
                             "tok/s across calls: the machine was busy, these figures are unreliable")
    return lines


def render_goals(goal_rows: list[dict], itl_rows: list[dict]) -> list[str]:
    lines = []
    for g in goal_rows:
        status = {True: "met", False: "NOT met", None: "not measured"}[g["met"]]
        value = "n/a" if g["value"] is None else f"{g['value']:.2f}"
        lines.append(f"- {g['goal']}: {value} (goal >= {g['threshold']:g}): {status}")
    for row in itl_rows:
        lines.append(f"- report: {row['schedule']} p99 ITL at {row['streams']} streams {ms(row['itl_p99'])} ms "
                     f"vs {ms(row['itl_p99_at_1'])} ms at 1 stream: {times(row['ratio'])}")
    return lines


def prompts_of(prompt_set: str) -> list:
    """The requests' prompts (specdec/prompt_sets.py), mixed ones interleaved."""
    sets = common.prompt_sets()
    if prompt_set == "benchmark":
        return list(sets.BENCHMARK_PROMPTS)
    if prompt_set == "grounded":
        return list(sets.GROUNDED_PROMPTS)
    mixed = []
    for index, prompt in enumerate(sets.BENCHMARK_PROMPTS):
        mixed.append(prompt)
        if index % 4 == 3:  # one grounded prompt after every four open-ended ones
            mixed.append(sets.GROUNDED_PROMPTS[(index // 4) % len(sets.GROUNDED_PROMPTS)])
    return mixed


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    stop_on_signals()
    prompts = prompts_of(config.prompt_set)
    environment = common.environment()
    stack_config = StackConfig(target=config.target, draft=config.draft, device=config.device,
                               dtype=config.dtype, port=0, echo=False, draft_method=config.draft_method,
                               packed_rows=config.packed_rows, draft_head=config.draft_head)
    common.prepare_default_models(stack_config)
    cell_count = len(config.streams) * len(config.schedules) * config.repeats
    hf_steps = 0 if config.skip_hf else len(config.streams) * len(config.hf_dtypes)
    progress = common.Progress(cell_count + hf_steps)
    eta = Eta(config, cell_count)
    common.note(f"{cell_count} cells of {config.seconds_per_cell:g} s (+ the drain of each) and "
                f"{hf_steps} HF batch sizes; estimated ~{minutes(60 + eta.remaining())} in all")
    common.note("starting the target, draft and orchestrator services (their default flags)...")
    with local_stack(stack_config) as services:
        address = services["orchestrator"].address
        replicas = Replicas(services["target"].address, services["draft"].address)
        try:
            environment["linear_packing"] = replicas.packings()
            common.note(f"warm-up: one request per schedule, then a burst of {max(config.streams)} streams...")
            warm_up(address, config, prompts)
            cells = run_cells(address, replicas, config, prompts, progress, eta)
        finally:
            replicas.close()
        # What the speculation guard decided, test by test: why an adaptive cell ran as it did.
        guard_log = [line.strip() for line in services["orchestrator"].output().splitlines()
                     if "speculation guard:" in line]
    hf: dict = {}
    if not config.skip_hf:
        common.note("services stopped; Hugging Face batched generate on the target, in-process...")
        hf = hf_anchor(config, prompts, progress)
    goal_rows = goals(cells, hf, config)
    itl_rows = itl_report(cells, config)
    text_parts = [*describe(config, environment), "", render_cells(cells, hf, config, markdown=False)]
    md_parts = [f"# Load benchmark ({environment['utc']})", "\n".join(describe(config, environment)),
                render_cells(cells, hf, config, markdown=True)]
    if hf:
        text_parts += ["", "Hugging Face batched generate (in-process, same target, same prompts):", "",
                       render_hf(cells, hf, config, markdown=False)]
        md_parts += ["Hugging Face batched generate (in-process, same target, same prompts):",
                     render_hf(cells, hf, config, markdown=True)]
    goal_lines = [*render_goals(goal_rows, itl_rows), *busy_warnings(hf)]
    text_parts += ["", "Goals:", *goal_lines]
    md_parts += ["Goals:\n\n" + "\n".join(goal_lines)]
    data = {
        "benchmark": "load",
        "config": {**asdict(config), "out": str(config.out), "noise": NOISE, "prompt_stride": PROMPT_STRIDE},
        "environment": environment,
        "prompts": [p.name for p in prompts],
        "cells": cells,
        "hf_generate": hf,
        "comparisons": comparisons(cells, hf, config),
        "goals": goal_rows,
        "itl_p99_vs_one_stream": itl_rows,
        "guard_log": guard_log,
        "table_markdown": render_cells(cells, hf, config, markdown=True),
    }
    json_path, md_path = common.write_results(config.out, f"load-{config.name}", data, "\n\n".join(md_parts))
    print("\n".join(text_parts))
    print(f"\nwrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
