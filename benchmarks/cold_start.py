"""Does a device's cold start cost a session its speculation? Adaptive K over speculation off on
services whose first pass of each shape is slow (as a GPU's, which loads the kernels it needs on
first use) and on the same services warm, each in one run.

The pair is benchmarks/emulated_pair.py's (a tiny target and a perturbed copy as its draft), its
passes stretched to GPU-like times (a target pass --target-pass seconds whatever its rows, a draft
pass --draft-pass) and, in the cold condition, each service's first pass of each row count made
--cold-seconds longer. Per condition: a fresh target, draft and orchestrator (the draft method
`specdec up` uses, hybrid, unless --draft-method model), then `specdec bench`
with speculation off, adaptive and K = 4 interleaved prompt by prompt; the figures are ratios to
off within the condition, and the adaptive controller's verify line at one row (its estimate of
a target pass) against the stretched pass time.

    python benchmarks/cold_start.py                     # about 3 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from statistics import mean

import common  # benchmarks/common.py: a script's own folder is first on sys.path
import emulated_pair

SCHEDULES = ("off", "adaptive", "k=4")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cold-seconds", type=float, default=0.3,
                        help="added to each service's first pass of each row count, cold (default 0.3)")
    parser.add_argument("--target-pass", type=float, default=0.03, help="seconds a target pass takes (0.03)")
    parser.add_argument("--draft-pass", type=float, default=0.004, help="seconds a draft pass takes (0.004)")
    parser.add_argument("--perturbation", type=float, default=0.3, help="the draft's, as in emulated_pair (0.3)")
    parser.add_argument("--draft-method", choices=["hybrid", "model"], default="hybrid",
                        help="the orchestrator's (default hybrid, as `specdec up` starts it)")
    parser.add_argument("--prompts", type=int, default=6, help="benchmark prompts per schedule (6)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    parser.add_argument("--name", default="", help="file stem after 'cold-start-' (default: a UTC timestamp)")
    return parser.parse_args(argv)


def run_condition(args: argparse.Namespace, pair: tuple[str, str], site: Path, cold_seconds: float) -> dict:
    """A fresh stack with the given cold cost, measured by `specdec bench --json`."""
    env = common.service_env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    env[emulated_pair.PASS_SECONDS_ENV] = emulated_pair.pass_seconds_spec((args.target_pass, 0.0),
                                                                         (args.draft_pass, 0.0))
    env[emulated_pair.COLD_SECONDS_ENV] = str(cold_seconds)
    with ExitStack() as stack:
        target, draft = common.start_services(stack, [
            (role, ["--model", model, "--dtype", "float32", "--port", "0"], env)
            for role, model in (("target", pair[0]), ("draft", pair[1]))])
        orchestrator, = common.start_orchestrators(stack, [(target.address, draft.address)],
                                                   ["--draft-method", args.draft_method])
        result = subprocess.run(
            [sys.executable, "-m", "specdec_cli.main", "bench", "--orchestrator", orchestrator.address,
             "--limit", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens),
             "--schedules", ",".join(SCHEDULES), "--temperature", "0", "--json", "--quiet"],
            capture_output=True, text=True, timeout=1800, env={**os.environ, **common.service_env()})
    if result.returncode != 0:
        raise SystemExit(f"specdec bench failed: {result.stderr[-2000:]}")
    report = json.loads(result.stdout)
    adaptive = [run for run in report["runs"] if run["schedule"] == "adaptive"]
    fits = [run["controller_estimates"].get("verify_a", 0.0) + run["controller_estimates"].get("verify_b", 0.0)
            for run in adaptive]
    return {"cold_seconds": cold_seconds, "schedules": report["schedules"], "greedy": report["greedy"],
            "adaptive_verify_fit_one_row": fits, "runs": report["runs"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    name = args.name or common.utc_stamp()
    work = args.out / f"cold-start-{name}.work"
    try:
        pair = emulated_pair.build_agreeing_pair(work / "pair", perturbation=args.perturbation)
        site = emulated_pair.write_pass_stretcher(work / "site")
        conditions = []
        for cold in (args.cold_seconds, 0.0):
            common.note(f"{'cold' if cold else 'warm'}: a fresh stack, {args.prompts} prompts x {len(SCHEDULES)} schedules...")
            conditions.append(run_condition(args, pair, site, cold))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [f"# python benchmarks/cold_start.py --cold-seconds {args.cold_seconds:g} --target-pass "
             f"{args.target_pass:g} --draft-pass {args.draft_pass:g} --perturbation {args.perturbation:g} "
             f"--draft-method {args.draft_method} --prompts {args.prompts} "
             f"--max-new-tokens {args.max_new_tokens}", "",
             "| condition | off tok/s | adaptive / off | K = 4 / off | adaptive mean K | adaptive's T_pass(1), ms (true: "
             f"{1000 * args.target_pass:.0f}) | greedy outputs |", "|---|---|---|---|---|---|---|"]
    for condition in conditions:
        schedules = condition["schedules"]
        fit = condition["adaptive_verify_fit_one_row"]
        lines.append(
            f"| {'cold' if condition['cold_seconds'] else 'warm'} | {schedules['off']['tokens_per_second']:.1f} "
            f"| {schedules['adaptive']['speedup']:.2f}x | {schedules['k=4']['speedup']:.2f}x "
            f"| {schedules['adaptive']['mean_k']:.2f} | {1000 * mean(fit):.0f} (last request {1000 * fit[-1]:.0f}) "
            f"| {'identical' if condition['greedy']['identical'] else 'DIFFER'} |")
    text = "\n".join(lines)
    print(text)
    common.write_results(args.out, f"cold-start-{name}", {"environment": common.environment(),
                                                          "args": {k: str(v) for k, v in vars(args).items()},
                                                          "conditions": conditions}, text)
    return 0 if all(c["greedy"]["identical"] for c in conditions) else 1


if __name__ == "__main__":
    raise SystemExit(main())
