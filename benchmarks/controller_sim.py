"""The adaptive K controller against fixed K in a simulated world, in seconds (no models, no services).

A simulation, not a measurement: it replays the controller (orchestrator/k_controller.py) on a cost
model taken from the default pair's pair benchmark on a 2-core CPU (T_verify by row count 64,
68, 72, 98, 102, 104, 121, 126, 126 ms for 1-9 rows, a 7 ms draft pass, one hop's RTT) and
on per-prompt acceptance rates from the same benchmark (alpha 0.20-0.64, geometric acceptance),
with multiplicative timing noise. Sessions run one after another through one pool's priors, as
the benchmark's prompts do. It prints tokens per second over K = 0 for fixed K and for the
controller, averaged over seeds: a quick check of a controller change (seconds) before the real
A/B through the services (`bench_pair.py --ks 1 --temperatures 0 --concurrency '' --skip-hf`).

With --sessions it simulates load instead: n sessions whose Verify calls the target batches into
one forward pass of T_pass(R) = a + b R over the pass's rows R (all sessions' K + 1 together; by
default the float32 line of the default target on a 2-core CPU, 32 ms for 1 row to 256 ms for
32 sessions x 5 rows), rounds in lockstep, each session's prompt alpha taken in turn from the list
above (or --alpha for all). The draft pass keeps its single-session cost: only the target's
batching is modelled. For each n it prints the K the controllers settle at and the system's
tokens per second (the sum over sessions) against everyone at K = 0, for fixed K and the
controller: K should fall as n rises and reach 0 where extra rows cost the others more than they
win.

    python benchmarks/controller_sim.py
    python benchmarks/controller_sim.py --rtt-ms 35 --seeds 40
    python benchmarks/controller_sim.py --sessions 1,4,16,32,64 --alpha 0.6
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import dataclass, replace

from orchestrator.k_controller import AdaptiveKController, KControllerConfig
from orchestrator.k_estimates import ControllerPriors
from orchestrator.k_policy import FixedK, KPolicy, RoundObservation

# The default pair on a 2-core CPU, one torch thread per service (bench_pair.py), seconds.
VERIFY_BY_ROWS = (0.0635, 0.0684, 0.0724, 0.0976, 0.1022, 0.1036, 0.1206, 0.1257, 0.1260)
VERIFY_SLOPE_BEYOND = 0.006  # per row past the table
DRAFT_PASS = 0.0070
FEED_PER_TOKEN = 0.004  # catch-up tokens fed in one pass
PROMPT_ALPHAS = (0.62, 0.52, 0.39, 0.30, 0.64, 0.38, 0.20, 0.29)  # greedy, K = 4, per prompt
# The default target's forward pass over R rows of a batch, float32, 2-core CPU: 32 ms for one
# row, 256 ms for 32 sessions x 5 rows (160 rows); the line through those two, in seconds.
PASS_A, PASS_B = 0.0306, 0.00141


@dataclass(frozen=True)
class World:
    rtt: float  # per hop, seconds
    noise: float  # sd of the log of each time's multiplicative noise
    tokens: int  # committed tokens per session

    def verify(self, rows: int) -> float:
        if rows <= len(VERIFY_BY_ROWS):
            return VERIFY_BY_ROWS[rows - 1]
        return VERIFY_BY_ROWS[-1] + VERIFY_SLOPE_BEYOND * (rows - len(VERIFY_BY_ROWS))


def session_seconds(policy: KPolicy, alpha: float, world: World, rng: random.Random) -> float:
    """Seconds for one session of world.tokens committed tokens."""
    def noisy(seconds: float) -> float:
        return seconds * rng.lognormvariate(0.0, world.noise)

    elapsed, done, draft_lacks = 0.0, 0, 1
    while done < world.tokens:
        k = policy.choose(world.tokens - done - 1)
        accepted, fed, draft_compute, draft_wall = 0, 0, 0.0, 0.0
        if k > 0:
            while accepted < k and rng.random() < alpha:
                accepted += 1
            fed = draft_lacks + k - 1
            draft_compute = noisy(k * DRAFT_PASS + (draft_lacks - 1) * FEED_PER_TOKEN)
            draft_wall = draft_compute + noisy(world.rtt)
            draft_lacks = 2 if accepted == k else 1
        else:
            draft_lacks += 1
        verify_compute = noisy(world.verify(k + 1))
        verify_wall = verify_compute + noisy(world.rtt)
        policy.observe(RoundObservation(k, accepted, (), draft_compute, draft_wall, fed,
                                        verify_compute, verify_wall))
        elapsed += draft_wall + verify_wall
        done += accepted + 1
    return elapsed


def tokens_per_second(make_policy, world: World, seed: int, passes: int) -> float:
    rng = random.Random(seed)
    priors = ControllerPriors()
    seconds = tokens = 0.0
    for _ in range(passes):
        for alpha in PROMPT_ALPHAS:
            seconds += session_seconds(make_policy(priors), alpha, world, rng)
            tokens += world.tokens
    return tokens / seconds


@dataclass(frozen=True)
class SharedPass:
    """n sessions batched into one target pass per round: T_pass(R) = a + b R over its rows R."""

    sessions: int
    pass_a: float
    pass_b: float
    rtt: float
    noise: float
    alphas: tuple[float, ...]  # per session, taken in turn

    def t_pass(self, rows: int) -> float:
        return self.pass_a + self.pass_b * rows


def shared_pass_run(make_policy, load: SharedPass, seed: int, rounds: int, warmup: int
                    ) -> tuple[float, list[int], list[KPolicy]]:
    """Lockstep rounds of `load.sessions` sessions sharing each verify pass. Returns the system's
    tokens per second after `warmup` rounds (each session's tokens over its own time, summed),
    every K chosen after the warmup, and the policies."""
    rng = random.Random(seed)
    priors = ControllerPriors()
    policies = [make_policy(priors) for _ in range(load.sessions)]
    alphas = [load.alphas[i % len(load.alphas)] for i in range(load.sessions)]
    draft_lacks = [1] * load.sessions
    seconds = [0.0] * load.sessions
    tokens = [0] * load.sessions
    chosen: list[int] = []

    def noisy(value: float) -> float:
        return value * rng.lognormvariate(0.0, load.noise)

    for index in range(rounds):
        ks = [policy.choose(16) for policy in policies]  # long outputs: the servers' limit only
        rows = sum(k + 1 for k in ks)
        verify_compute = noisy(load.t_pass(rows))  # one pass, the same for everyone in it
        for i, (policy, k) in enumerate(zip(policies, ks)):
            accepted, fed, draft_compute, draft_wall = 0, 0, 0.0, 0.0
            if k > 0:
                while accepted < k and rng.random() < alphas[i]:
                    accepted += 1
                fed = draft_lacks[i] + k - 1
                draft_compute = noisy(k * DRAFT_PASS + (draft_lacks[i] - 1) * FEED_PER_TOKEN)
                draft_wall = draft_compute + noisy(load.rtt)
                draft_lacks[i] = 2 if accepted == k else 1
            else:
                draft_lacks[i] += 1
            verify_wall = verify_compute + noisy(load.rtt)
            policy.observe(RoundObservation(k, accepted, (), draft_compute, draft_wall, fed,
                                            verify_compute, verify_wall, float(rows),
                                            float(load.sessions)))
            if index >= warmup:
                seconds[i] += draft_wall + verify_wall
                tokens[i] += accepted + 1
        if index >= warmup:
            chosen += ks
    return sum(t / s for t, s in zip(tokens, seconds)), chosen, policies


def load_table(args: argparse.Namespace, config: KControllerConfig) -> int:
    levels = [int(level) for level in args.sessions.split(",")]
    alphas = (args.alpha,) if args.alpha is not None else PROMPT_ALPHAS
    rounds, warmup = args.load_rounds, args.load_rounds // 2
    print(f"simulated load: T_pass(R) = {args.pass_a_ms:g} + {args.pass_b_ms:g} R ms, draft pass "
          f"{DRAFT_PASS * 1e3:.1f} ms, RTT {args.rtt_ms} ms per hop, alpha "
          f"{args.alpha if args.alpha is not None else 'per prompt'}, {args.seeds} seeds x "
          f"{rounds} rounds ({warmup} warm-up)")
    fixed = (1, 2, 3)
    print(f"{'sessions':>8s}  {'mean K':>6s}  {'at K=0':>6s}  "
          + "  ".join(f"{f'K={k}':>5s}" for k in fixed) + "  adaptive  (tokens/s over K=0)")
    for sessions in levels:
        load = SharedPass(sessions, args.pass_a_ms / 1e3, args.pass_b_ms / 1e3, args.rtt_ms / 1e3,
                          args.noise, alphas)
        baseline, ratios = [], {k: [] for k in fixed}
        adaptive_rates, chosen, settled_zero, settled = [], [], 0, 0
        for seed in range(args.seeds):
            baseline.append(shared_pass_run(lambda priors: FixedK(0), load, seed, rounds, warmup)[0])
            for k in fixed:
                rate = shared_pass_run(lambda priors, k=k: FixedK(k), load, seed, rounds, warmup)[0]
                ratios[k].append(rate / baseline[-1])
            rate, ks, policies = shared_pass_run(lambda priors: AdaptiveKController(config, priors),
                                                 load, seed, rounds, warmup)
            adaptive_rates.append(rate / baseline[-1])
            chosen += ks
            settled += len(policies)
            settled_zero += sum(policy.estimates()["num_speculative_tokens"] == 0 for policy in policies)
        print(f"{sessions:8d}  {statistics.mean(chosen):6.2f}  {settled_zero / settled:6.0%}  "
              + "  ".join(f"{statistics.mean(ratios[k]):5.3f}" for k in fixed)
              + f"  {statistics.mean(adaptive_rates):8.3f}")
    print("mean K: the adaptive sessions' K after the warm-up, probes included; at K=0: the share of "
          "them whose chosen K is 0 at the end")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rtt-ms", type=float, default=2.3, help="per hop (default: loopback)")
    parser.add_argument("--noise", type=float, default=0.12)
    parser.add_argument("--tokens", type=int, default=48, help="committed tokens per session")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--passes", type=int, default=3, help="passes over the prompts per seed")
    parser.add_argument("--max-num-speculative-tokens", type=int, default=16)
    parser.add_argument("--sessions", help="simulate load instead: comma-separated numbers of "
                        "sessions sharing each target pass, e.g. 1,4,16,32")
    parser.add_argument("--alpha", type=float, help="with --sessions: one alpha for every session "
                        "(default: the prompts' alphas in turn)")
    parser.add_argument("--pass-a-ms", type=float, default=PASS_A * 1e3, help="with --sessions: a")
    parser.add_argument("--pass-b-ms", type=float, default=PASS_B * 1e3,
                        help="with --sessions: b, per row of the pass")
    parser.add_argument("--load-rounds", type=int, default=300, help="with --sessions: rounds per run")
    args = parser.parse_args(argv)
    world = World(args.rtt_ms / 1e3, args.noise, args.tokens)
    config = KControllerConfig(max_num_speculative_tokens=args.max_num_speculative_tokens)
    if args.sessions:
        return load_table(args, config)

    def mean_rate(make_policy) -> float:
        return statistics.mean(tokens_per_second(make_policy, world, seed, args.passes)
                               for seed in range(args.seeds))

    def adaptive(cfg: KControllerConfig):
        return lambda priors: AdaptiveKController(cfg, priors)

    baseline = mean_rate(lambda priors: FixedK(0))
    rows = [(f"K={k}", mean_rate(lambda priors, k=k: FixedK(k))) for k in (1, 2, 3)]
    rows.append(("adaptive (defaults)", mean_rate(adaptive(config))))
    without = replace(config, verify_optimism=0.0, zero_k_optimism=0.0)
    rows.append(("adaptive, no optimism", mean_rate(adaptive(without))))
    # The simpler controller it replaced, for comparison: T_verify a line only (no per-row
    # residuals), and the pool's alpha worth one pseudo-trial to a new session.
    line_only = replace(without, verify_row_shrink=1e12, pool_alpha_strength=1.0)
    rows.append(("adaptive, line-only fit", mean_rate(adaptive(line_only))))
    print(f"simulated: RTT {args.rtt_ms} ms per hop, {args.tokens} tokens per session, "
          f"{args.seeds} seeds x {args.passes} passes over {len(PROMPT_ALPHAS)} prompts")
    print(f"{'schedule':26s}  tokens/s over K=0")
    for name, rate in rows:
        print(f"{name:26s}  {rate / baseline:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
