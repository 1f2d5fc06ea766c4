"""Helpers shared by the benchmarks: services as separate processes, delay proxies, Generate calls,
summary statistics, tables and result files.

The benchmarks are scripts, run as `python benchmarks/NAME.py` (the tests in tests/benchmarks run
them the same way, as subprocesses). Python puts a script's own folder first on sys.path, so a
script imports this module as `import common`; specdec, orchestrator, ... come from the
(editable) install.

Services are started through the CLI (`specdec serve ...`) as separate processes, so the
measurement includes the real process boundary; network delay is injected by TCP delay proxies
that run in the benchmark's own process, one thread each, so the delay is on the real wire
between the processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType

import grpc

from specdec.delay_proxy import DelayProxyConfig, start_in_thread
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc
from specdec_cli.client import chat_request, format_table  # noqa: F401 (the benchmarks' too)
from specdec_cli.processes import ServiceProcess
from specdec_cli.stack import prepare_default_models, start_services  # noqa: F401 (also theirs)

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"


# ---------------------------------------------------------------------------------------------
# Prompts


def prompt_sets() -> ModuleType:
    """The fixed prompt sets (BENCHMARK_PROMPTS, TASK_KINDS, ...)."""
    from specdec import prompt_sets as module

    return module


def pick_prompts(count: int) -> list:
    """The first `count` benchmark prompts taken round-robin over the task kinds, so a small
    count still mixes code, explanation, chat and translation."""
    module = prompt_sets()
    by_kind = [[p for p in module.BENCHMARK_PROMPTS if p.kind == kind] for kind in module.TASK_KINDS]
    ordered = [group[i] for i in range(max(map(len, by_kind))) for group in by_kind if i < len(group)]
    if not 1 <= count <= len(ordered):
        raise ValueError(f"--prompts must be in [1, {len(ordered)}], got {count}")
    return ordered[:count]


# ---------------------------------------------------------------------------------------------
# Services


@dataclass(frozen=True)
class ModelPair:
    """The --model arguments of the two model services and how they run."""

    target: str = "default"
    draft: str = "default"
    dtype: str = "auto"
    device: str = "cpu"
    torch_threads: int | None = None  # OMP_NUM_THREADS of each model service (None: torch's default)
    max_num_speculative_tokens: int = 16  # the servers' limit on K per round


def service_env(torch_threads: int | None = None) -> dict[str, str]:
    """Environment additions for a service process: the repository importable, thread count."""
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {"PYTHONPATH": os.pathsep.join(paths)}
    if torch_threads is not None:
        env["OMP_NUM_THREADS"] = str(torch_threads)
    return env


def start_model_services(stack: ExitStack, pair: ModelPair) -> dict[str, ServiceProcess]:
    """`specdec serve target` and `specdec serve draft`, started concurrently; stopped by `stack`."""
    env = service_env(pair.torch_threads)
    commands = [(role, ["--model", model, "--dtype", pair.dtype, "--device", pair.device, "--port", "0",
                        "--max-num-speculative-tokens", str(pair.max_num_speculative_tokens)], env)
                for role, model in (("target", pair.target), ("draft", pair.draft))]
    target, draft = start_services(stack, commands)
    return {"target": target, "draft": draft}


def start_orchestrators(stack: ExitStack, upstreams: Sequence[tuple[str, str]],
                        extra_args: Sequence[str] = ()) -> list[ServiceProcess]:
    """One `specdec serve orchestrator` per (target address, draft address), on free ports,
    started concurrently; stopped by `stack`."""
    env = service_env()
    commands = [("orchestrator", ["--target", target, "--draft", draft, "--port", "0", *extra_args], env)
                for target, draft in upstreams]
    return start_services(stack, commands)


def delayed_address(stack: ExitStack, address: str, one_way_delay_ms: float, jitter_ms: float = 0.0,
                    seed: int | None = None) -> str:
    """A delay proxy in front of `address` (host:port), in a thread of this process; returns the
    proxy's address. The proxy is closed by `stack`."""
    host, port = address.rsplit(":", 1)
    proxy = start_in_thread(DelayProxyConfig(
        upstream_host=host, upstream_port=int(port), one_way_delay_ms=one_way_delay_ms,
        jitter_ms=jitter_ms, seed=seed,
    ))
    stack.callback(proxy.close)
    return f"127.0.0.1:{proxy.port}"


# ---------------------------------------------------------------------------------------------
# Requests


@dataclass(frozen=True)
class GenerateResult:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: int
    stats: pb.GenerationStats
    client_seconds: float  # wall time of the whole call, as seen by this process

    @property
    def output_digest(self) -> str:
        """A short fingerprint of the generated token ids, to compare outputs without storing them."""
        return token_digest(self.token_ids)


def token_digest(token_ids: Iterable[int]) -> str:
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


class OrchestratorClient:
    """A sync channel to one orchestrator; call close() (or use `with`)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = grpc.insecure_channel(address)
        self._stub = orchestrator_pb2_grpc.OrchestratorStub(self._channel)

    def generate(self, request: pb.GenerateRequest, timeout: float = 1800.0) -> GenerateResult:
        started = time.perf_counter()
        token_ids: list[int] = []
        pieces: list[str] = []
        last = None
        for response in self._stub.Generate(request, timeout=timeout):
            token_ids.extend(response.token_ids)
            pieces.append(response.text)
            last = response
        seconds = time.perf_counter() - started
        if last is None:
            raise RuntimeError(f"Generate on {self.address} returned no response")
        return GenerateResult(tuple(token_ids), "".join(pieces), last.finish_reason, last.stats, seconds)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> OrchestratorClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Figures and output


def first_difference(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    """The first index where two token sequences differ (the shorter's length if one is a prefix
    of the other); None when they are equal."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def exactness(runs: list[dict], is_fixed_k: Callable[[str], bool]) -> dict:
    """Greedy: every run's output equals target-only (run["matches_target_only"]). Sampled runs of
    a fixed-K schedule (is_fixed_k(run["schedule"])): one output per (schedule, temperature,
    prompt), since a seed reproduces a fixed-K schedule."""
    greedy = [run for run in runs if run["temperature"] == 0]
    mismatches = [{k: run[k] for k in ("repetition", "rtt_ms", "schedule", "prompt", "first_mismatch_index")}
                  for run in greedy if not run["matches_target_only"]]
    sampled: dict[tuple, set[str]] = {}
    for run in runs:
        if run["temperature"] > 0 and is_fixed_k(run["schedule"]):
            sampled.setdefault((run["schedule"], run["temperature"], run["prompt"]), set()).add(run["output_digest"])
    unreproduced = [{"schedule": s, "temperature": t, "prompt": p, "distinct_outputs": len(d)}
                    for (s, t, p), d in sampled.items() if len(d) > 1]
    return {
        "greedy_runs": len(greedy),
        "greedy_mismatches": mismatches,
        "all_greedy_outputs_match_target_only": not mismatches,
        "sampled_fixed_k_groups": len(sampled),
        "sampled_fixed_k_not_reproduced": unreproduced,
    }


def comma_items(text: object) -> list[str]:
    """The non-empty items of a comma-separated command-line value."""
    return [x.strip() for x in str(text).split(",") if x.strip()]


def spread(values: Sequence[float]) -> dict[str, float | int]:
    """Median and range of repeated measurements."""
    if not values:
        raise ValueError("no values")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def format_spread(figures: dict, digits: int = 1) -> str:
    """'12.3 (11.0–13.1)', or just the median when there is one value."""
    median = f"{figures['median']:.{digits}f}"
    if figures["n"] == 1:
        return median
    return f"{median} ({figures['min']:.{digits}f}–{figures['max']:.{digits}f})"


def environment() -> dict[str, object]:
    """What the figures depend on besides the code: versions, CPU, commit."""
    import torch
    import transformers

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "grpcio": grpc.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def utc_stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def write_results(out_dir: Path, stem: str, data: dict, markdown: str) -> tuple[Path, Path]:
    """Writes OUT_DIR/STEM.json and OUT_DIR/STEM.md; returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    md_path.write_text(markdown.rstrip() + "\n")
    return json_path, md_path


def append_json_line(path: Path, record: dict) -> None:
    """Appends one record to a JSON-lines file: a long benchmark that dies midway leaves the
    measurements it made behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as file:
        file.write(json.dumps(record) + "\n")


class Progress:
    """One line per step on stderr: count, elapsed time, message."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self._started = time.monotonic()

    def step(self, message: str) -> None:
        self.done += 1
        elapsed = int(time.monotonic() - self._started)
        width = len(str(self.total))
        print(f"[{self.done:>{width}}/{self.total} {elapsed // 60:3d}m{elapsed % 60:02d}s] {message}",
              file=sys.stderr, flush=True)


def note(message: str) -> None:
    """A progress message that is not a step."""
    print(message, file=sys.stderr, flush=True)
