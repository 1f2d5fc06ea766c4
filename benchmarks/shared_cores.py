"""What a target and a draft on the same cores cost each other, with and without a pass lock
(specdec/pass_lock.py, `specdec serve --pass-lock`, which `specdec up` sets).

Two processes, as two model services on one machine: the target runs passes back to back (its
sessions each feeding one token: a batch of decoding steps), the draft runs a pass of its own every
--draft-gap milliseconds (its Propose calls between the target's passes). Three modes, interleaved
over --rounds rounds: the target alone, both with their passes free to overlap, and both taking
turns through a pass lock. Prints the target's passes per second and mean pass time, the draft's
mean pass time, and the ratios against the target alone.

    python benchmarks/shared_cores.py                  # the default pair, about two minutes
    python benchmarks/shared_cores.py --sessions 8 --seconds 10 --rounds 3
"""

from __future__ import annotations

import argparse
import multiprocessing
import platform
import queue
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from specdec.openmp import bound_idle_spin

bound_idle_spin()  # as `specdec serve` does, before torch loads here or in the spawned processes

import common  # noqa: E402  (benchmarks/common.py: a script's own folder is first on sys.path)

MODES = ("alone", "overlapping", "pass lock")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default", help="target model directory or 'default'")
    parser.add_argument("--draft", default="default", help="draft model directory or 'default'")
    parser.add_argument("--dtype", default="auto", help="both models' --dtype (default auto)")
    parser.add_argument("--sessions", type=int, default=4, help="sessions in each pass (default 4)")
    parser.add_argument("--context", type=int, default=120, help="tokens cached per session")
    parser.add_argument("--draft-gap", type=float, default=10.0,
                        help="milliseconds between the draft's passes (default 10)")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each measurement")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the three modes")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="directory for the results")
    parser.add_argument("--name", default=None, help="file stem after 'shared-cores-' (default: a timestamp)")
    return parser.parse_args(argv)


def passes(role: str, model: str, args: argparse.Namespace, gap: float, lock_path: str | None,
           ready, start, results) -> None:
    """In a process of its own: load, feed the sessions' context, wait for `start`, then run
    passes for args.seconds (sleeping `gap` seconds after each); puts (role, pass seconds)."""
    import torch

    from specdec.kv_cache import SequenceCache
    from specdec.models import ModelConfig, load_model
    from specdec.pass_lock import PassLock
    from specdec.ragged import Feed, forward

    loaded = load_model(ModelConfig(model, role, dtype=args.dtype))
    generator = torch.Generator().manual_seed(0)
    low, high = min(100, loaded.vocab_size // 2), min(20000, loaded.vocab_size)  # no special tokens
    caches = []
    for _ in range(args.sessions):
        cache = SequenceCache(loaded.model)
        forward(loaded.model, [Feed(cache, torch.randint(low, high, (args.context,), generator=generator).tolist())])
        caches.append(cache)
    lock = PassLock(lock_path) if lock_path else None
    ready.set()
    start.wait()
    times = []
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        feeds = [Feed(cache, [low], keep_all=True) for cache in caches]
        with lock or nullcontext():
            began = time.perf_counter()
            forward(loaded.model, feeds)
            times.append(time.perf_counter() - began)
        for cache in caches:
            cache.truncate(len(cache) - 1)
        if gap:
            time.sleep(gap)
    results.put((role, times))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def measure(mode: str, args: argparse.Namespace, lock_dir: str) -> dict[str, list[float]]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    start = context.Event()
    lock_path = str(Path(lock_dir) / "passes.lock") if mode == "pass lock" else None
    roles = [("target", args.target, 0.0)]
    if mode != "alone":
        roles.append(("draft", args.draft, args.draft_gap / 1000))
    processes, readies = [], []
    for role, model, gap in roles:
        ready = context.Event()
        process = context.Process(target=passes, args=(role, model, args, gap, lock_path, ready, start, results))
        process.start()
        processes.append(process)
        readies.append(ready)
    try:
        for ready, process in zip(readies, processes):
            while not ready.wait(1.0):
                if not process.is_alive():
                    raise RuntimeError(f"a measuring process failed (exit code {process.exitcode}); its error is above")
        start.set()
        measured = {}
        while len(measured) < len(processes):
            try:
                role, times = results.get(timeout=1.0)
                measured[role] = times
            except queue.Empty:
                if any(not p.is_alive() and p.exitcode for p in processes):
                    raise RuntimeError("a measuring process failed; its error is above") from None
        return measured
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    environment = common.environment()
    progress = common.Progress(args.rounds * len(MODES))
    runs: dict[str, list[dict[str, list[float]]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="specdec-") as lock_dir:
        for round_index in range(args.rounds):
            for mode in MODES if round_index % 2 == 0 else MODES[::-1]:
                runs[mode].append(measure(mode, args, lock_dir))
                progress.step(f"{mode}, round {round_index + 1}")

    def target_rate(mode: str) -> float:
        return statistics.mean(len(run["target"]) / args.seconds for run in runs[mode])

    def mean_ms(mode: str, role: str) -> float | None:
        times = [t for run in runs[mode] for t in run.get(role, [])]
        return 1000 * statistics.mean(times) if times else None

    alone = target_rate("alone")
    lines = [f"# Shared cores ({environment['utc']})", "",
             f"`python benchmarks/shared_cores.py --sessions {args.sessions} --draft-gap {args.draft_gap:g} "
             f"--seconds {args.seconds:g} --rounds {args.rounds}`: target {args.target}, draft {args.draft}, "
             f"dtype {args.dtype}, {cpu_model()}, {environment['cpu_count']} CPUs; each pass {args.sessions} sessions x 1 "
             f"token after {args.context}; modes interleaved, figures the mean over {args.rounds} rounds.", "",
             "| mode | target passes/s | target pass, mean ms | draft pass, mean ms | draft passes/s | target passes/s vs alone |",
             "|---|---:|---:|---:|---:|---:|"]
    for mode in MODES:
        draft_ms = mean_ms(mode, "draft")
        draft_rate = (statistics.mean(len(run["draft"]) / args.seconds for run in runs[mode])
                      if mode != "alone" else None)
        lines.append(f"| {mode} | {target_rate(mode):.1f} | {mean_ms(mode, 'target'):.1f} | "
                     f"{'-' if draft_ms is None else f'{draft_ms:.1f}'} | "
                     f"{'-' if draft_rate is None else f'{draft_rate:.1f}'} | {target_rate(mode) / alone:.2f}x |")
    text = "\n".join(lines)
    data = {"benchmark": "shared_cores", "config": {**vars(args), "out": str(args.out)},
            "environment": environment,
            "runs": {mode: [{role: times for role, times in run.items()} for run in mode_runs]
                     for mode, mode_runs in runs.items()}}
    name = args.name or common.utc_stamp()
    json_path, md_path = common.write_results(args.out, f"shared-cores-{name}", data, text)
    print(text)
    print(f"\nwrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
