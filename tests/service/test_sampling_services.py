"""Sampling through the real services, for the wiring (the smaller statistical test of
docs/architecture.md, "The lossless rule"): the joint law of the first three generated tokens
must be the target's own law.

The pair: a tiny one-layer target with a vocabulary of 8 and no tokenizer (token-id prompts), and a
far draft (another random seed) that sends only its top-4 q~, so truncation matters. The reference
law is enumerated in-process on the float64 target with transformers' own logits processors.

max_new_tokens is 4, not 3: the orchestrator caps K at remaining - 1, so only with 4 does the first
round after the prefill actually run at K = 2 (tokens 2-4 from drafts, a correction or a bonus).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from specdec.v1 import common_pb2
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

from tests import stack as stack_module
from tests import tiny_models

VOCAB_SIZE = 8
NUM_TOKENS = 3  # the joint law of the first three generated tokens: 8**3 = 512 cells
MAX_NEW_TOKENS = 4
NUM_SPECULATIVE_TOKENS = 2
DRAFT_TOP_M = 4
PROMPT = [1, 5, 3, 6]
IN_FLIGHT = 16
ALPHA = 1e-4  # a correct system passes at this level
MIN_EXPECTED = 5.0  # cells expecting fewer samples are pooled into one
TIMEOUT = 120


@dataclass(frozen=True)
class Config:
    temperature: float
    top_k: int
    num_samples: int
    first_seed: int  # seeds first_seed .. first_seed + num_samples - 1, one per request
    speculation: int = pb.SPECULATION_MODE_FIXED
    pipeline: int = pb.PIPELINE_MODE_OFF


CONFIGS = {
    "temperature_1": Config(temperature=1.0, top_k=0, num_samples=600, first_seed=10_000),
    "temperature_0.7_top_k_5": Config(temperature=0.7, top_k=5, num_samples=500, first_seed=20_000),
    "temperature_1_speculation_off": Config(temperature=1.0, top_k=0, num_samples=400, first_seed=30_000,
                                            speculation=pb.SPECULATION_MODE_OFF),
    # Drafting ahead: a round after the first may verify a branch the draft drafted during the
    # first round's verify (a hit), which must leave the law untouched.
    "temperature_1_pipelined": Config(temperature=1.0, top_k=0, num_samples=600, first_seed=40_000,
                                      pipeline=pb.PIPELINE_MODE_ON),
}


def _small_model(seed: int):
    return tiny_models.make_model(seed=seed, vocab_size=VOCAB_SIZE, num_hidden_layers=1,
                                  eos_token_id=None)  # no EOS: every request yields its 3 tokens


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling-pair")
    target_dir = tiny_models.save(_small_model(seed=11), root / "target", with_tokenizer=False)
    draft_dir = tiny_models.save(_small_model(seed=12), root / "far-draft", with_tokenizer=False)
    return target_dir, draft_dir


@pytest.fixture(scope="module")
def sampling_stack(loop_thread, model_dirs):
    running = loop_thread.run(stack_module.start_stack(
        *model_dirs, num_speculative_tokens=NUM_SPECULATIVE_TOKENS, top_m=DRAFT_TOP_M))
    yield running
    loop_thread.run(running.stop())


def _load(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def reference_model(model_dirs):
    """The target alone, float64, as the service loads it."""
    return _load(model_dirs[0])


def _processors(config: Config) -> LogitsProcessorList:
    """Built the way generate() builds them for do_sample=True."""
    processors = LogitsProcessorList()
    if config.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k != 0:
        processors.append(TopKLogitsWarper(top_k=config.top_k))
    return processors


@torch.no_grad()
def reference_joint_law(model, config: Config, prompt: list[int] = PROMPT) -> torch.Tensor:
    """(V**3,) law of the target's first three tokens after prompt; cell t1 * V**2 + t2 * V + t3."""
    vocab, length = VOCAB_SIZE, len(prompt)
    pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # (V*V, 2): (t1, t2)
    input_ids = torch.cat([torch.tensor(prompt).expand(vocab * vocab, length), pairs], dim=1)
    logits = model(input_ids=input_ids).logits  # (V*V, L + 2, V)
    rows = torch.cat([
        logits[0, length - 1].unsqueeze(0),  # scores t1
        logits[::vocab, length],  # (V, V): row t1 scores t2
        logits[:, length + 1],  # (V*V, V): row (t1, t2) scores t3
    ])
    unused_ids = torch.zeros(rows.shape[0], 1, dtype=torch.long)  # these warpers ignore input_ids
    probs = _processors(config)(unused_ids, rows).softmax(-1)  # (1 + V + V*V, V)
    first, second, third = probs[0], probs[1: 1 + vocab], probs[1 + vocab:].reshape(vocab, vocab, vocab)
    return (first[:, None, None] * second[:, :, None] * third).reshape(-1)


@dataclass
class Samples:
    tokens: torch.Tensor  # (N, NUM_TOKENS)
    drafted: int
    accepted: int
    pipeline_hits: int = 0


async def generate_all(address: str, requests: list[pb.GenerateRequest], in_flight: int = IN_FLIGHT
                       ) -> list[tuple[list[int], pb.GenerationStats]]:
    """One Generate per request, in_flight at a time: each one's tokens and its last stats."""
    semaphore = asyncio.Semaphore(in_flight)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)

        async def one(request: pb.GenerateRequest) -> tuple[list[int], pb.GenerationStats]:
            async with semaphore:
                tokens, last = [], None
                async for response in stub.Generate(request, timeout=TIMEOUT):
                    tokens.extend(response.token_ids)
                    last = response
            return tokens, last.stats

        return await asyncio.gather(*(one(request) for request in requests))


async def _sample(address: str, config: Config) -> Samples:
    """One Generate per seed, IN_FLIGHT at a time."""
    results = await generate_all(address, [
        pb.GenerateRequest(
            prompt_token_ids=PROMPT, max_new_tokens=MAX_NEW_TOKENS,
            sampling=common_pb2.SamplingParams(temperature=config.temperature, top_k=config.top_k, seed=seed),
            speculation=pb.SpeculationConfig(mode=config.speculation,
                                             num_speculative_tokens=NUM_SPECULATIVE_TOKENS,
                                             pipeline=config.pipeline),
        )
        for seed in range(config.first_seed, config.first_seed + config.num_samples)])
    assert all(len(tokens) == MAX_NEW_TOKENS for tokens, _ in results)
    return Samples(
        tokens=torch.tensor([tokens[:NUM_TOKENS] for tokens, _ in results]),
        drafted=sum(stats.drafted_tokens for _, stats in results),
        accepted=sum(stats.accepted_tokens for _, stats in results),
        pipeline_hits=sum(stats.pipeline_hits for _, stats in results),
    )


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, str]:
    """Pearson's goodness of fit against exact cell probabilities, small cells pooled.

    A count in a cell of probability 0 is an exact violation: p-value 0.
    """
    total = int(counts.sum())
    impossible = int(counts[probs == 0].sum())
    expected = total * probs[probs > 0]
    observed = counts[probs > 0].to(torch.float64)
    small = expected < MIN_EXPECTED
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
        observed = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    dof = expected.numel() - 1
    statistic = float(((observed - expected) ** 2 / expected).sum())
    p_value = 0.0 if impossible else float(torch.special.gammaincc(
        torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)))
    return p_value, f"chi2={statistic:.1f} dof={dof} p={p_value:.3g} impossible={impossible}"


def _joint_counts(tokens: torch.Tensor) -> torch.Tensor:
    cells = (tokens * torch.tensor([VOCAB_SIZE**2, VOCAB_SIZE, 1])).sum(-1)
    return torch.bincount(cells, minlength=VOCAB_SIZE**NUM_TOKENS)


# ----------------------------------------------------------------------------- the tests


def test_the_draft_is_far_and_truncation_matters(model_dirs, reference_model):
    target, draft = reference_model, _load(model_dirs[1])
    with torch.no_grad():
        target_probs = target(input_ids=torch.tensor([PROMPT])).logits[0, -1].softmax(-1)  # (V,)
        draft_probs = draft(input_ids=torch.tensor([PROMPT])).logits[0, -1].softmax(-1)  # (V,)
    assert 0.5 * float((target_probs - draft_probs).abs().sum()) >= 0.3
    assert float(draft_probs.sort(descending=True).values[DRAFT_TOP_M:].sum()) > 0.05


def test_chi_square_p_value_closed_form():
    """With two cells the statistic is chi-square(1): survival erfc(sqrt(x / 2))."""
    p_value, _ = chi_square_p_value(torch.tensor([60, 40]), torch.tensor([0.5, 0.5], dtype=torch.float64))
    assert p_value == pytest.approx(math.erfc(math.sqrt(4.0 / 2)), rel=1e-9)
    assert chi_square_p_value(torch.tensor([99, 1]), torch.tensor([1.0, 0.0], dtype=torch.float64))[0] == 0.0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_output_follows_the_target_law(loop_thread, sampling_stack, reference_model, name):
    config = CONFIGS[name]
    law = reference_joint_law(reference_model, config)
    assert float(law.sum()) == pytest.approx(1.0, abs=1e-12)
    with stack_module.PassSizes(sampling_stack.target) as passes:
        samples = loop_thread.run(_sample(sampling_stack.address, config))
    # IN_FLIGHT requests at a time: the target's passes were shared, many sessions at once.
    assert max(passes.sessions) >= 8, f"largest pass: {max(passes.sessions)} sessions"
    p_value, summary = chi_square_p_value(_joint_counts(samples.tokens), law)
    assert p_value > ALPHA, f"{name}: {summary}"
    if config.speculation == pb.SPECULATION_MODE_OFF:
        assert samples.drafted == 0
    else:  # the far draft both loses and wins: rejections and acceptances were both exercised
        assert 0 < samples.accepted < samples.drafted, (samples.accepted, samples.drafted)
    if config.pipeline == pb.PIPELINE_MODE_ON:
        assert samples.pipeline_hits > 0  # some samples' later tokens came from drafted-ahead branches


@pytest.mark.parametrize("sampling", [
    pytest.param(common_pb2.SamplingParams(temperature=1.0), id="temperature_1"),
    pytest.param(common_pb2.SamplingParams(temperature=0.7, top_k=5), id="temperature_0.7_top_k_5"),
])
def test_draft_equal_to_target_accepts_every_drafted_token(loop_thread, stack_same, sampling):
    async def run() -> list[pb.GenerationStats]:
        async with grpc.aio.insecure_channel(stack_same.address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)

            async def one(seed: int) -> pb.GenerationStats:
                request_sampling = common_pb2.SamplingParams()
                request_sampling.CopyFrom(sampling)
                request_sampling.seed = seed
                request = pb.GenerateRequest(
                    prompt_token_ids=[5, 9, 14, 3], max_new_tokens=24, sampling=request_sampling,
                    speculation=pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=4))
                stats = None
                async for response in stub.Generate(request, timeout=TIMEOUT):
                    stats = response.stats
                return stats

            return await asyncio.gather(*(one(seed) for seed in range(16)))

    all_stats = loop_thread.run(run())
    assert sum(stats.drafted_tokens for stats in all_stats) > 0
    for stats in all_stats:
        assert stats.accepted_tokens == stats.drafted_tokens, stats


def test_a_seed_reproduces_its_tokens(stack):
    def run(seed: int) -> list[int]:
        request = pb.GenerateRequest(
            prompt_token_ids=[5, 9, 14, 3], max_new_tokens=24,
            sampling=common_pb2.SamplingParams(temperature=1.0, seed=seed),
            speculation=pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=3))
        return stack_module.generate(stack.address, request)[0]

    outputs = {seed: run(seed) for seed in range(6)}
    for seed, tokens in outputs.items():
        assert run(seed) == tokens, f"seed {seed}"
    assert len({tuple(tokens) for tokens in outputs.values()}) > 1, "the seed is not used at all"
