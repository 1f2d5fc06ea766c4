"""A model pair built for measuring pipelining with a draft that agrees with its target often.

The default draft is accepted on about 45 % of positions; how much drafting ahead earns grows with
how often the draft's top candidates hold the target's token. To measure that regime on this
machine, `bench_pipeline.py --emulated-pair` runs a tiny target and a perturbed copy of it as its
draft (the perturbation sets how often they agree), with each service's forward passes stretched
to the default pair's measured pass times: a pass of `rows` rows takes at least
a + b * min(rows, 16) seconds, the rest of it spent asleep (as a process waiting on an
accelerator would).
The services, the proxies and the orchestrator are the real ones; only the models are stand-ins.

The stretching is installed in the two model service processes, never in specdec itself: a
`sitecustomize.py` on their PYTHONPATH wraps specdec.ragged.forward when the environment variable
SPECDEC_BENCH_PASS_SECONDS names their role (e.g. "target=0.055,0.0025;draft=0.006,0.0004"), and
with SPECDEC_BENCH_COLD_SECONDS each service's first pass of each row count takes that much longer
(a GPU's first pass of a shape, which loads its kernels; benchmarks/cold_start.py).
"""

from __future__ import annotations

from pathlib import Path

PASS_SECONDS_ENV = "SPECDEC_BENCH_PASS_SECONDS"
# Seconds added to each service's first pass of each row count (up to STRETCHED_ROWS), as a GPU's
# first pass of a shape pays for loading its kernels; 0 or unset: none.
COLD_SECONDS_ENV = "SPECDEC_BENCH_COLD_SECONDS"
# Rows a stretched pass charges at most: decoding passes (a verify, a batch of drafts) cost per
# row as measured; a prompt's long prefill pass is not stretched beyond this many rows' time (the
# tiny pair's byte-level tokenizer makes prompts several times longer than the default pair's).
STRETCHED_ROWS = 16

_SITECUSTOMIZE = '''"""Installed by benchmarks/emulated_pair.py: stretches this model service's forward passes."""
import os
import sys
import time


def _install():
    spec = os.environ.get("{env}", "")
    role = next((arg for arg in sys.argv[1:] if arg in ("target", "draft")), None)
    figures = dict(part.split("=", 1) for part in spec.split(";") if "=" in part)
    if role is None or role not in figures:
        return
    fixed, per_row = (float(x) for x in figures[role].split(","))
    cold = float(os.environ.get("{cold_env}", "0") or 0)
    import specdec.ragged as ragged

    real_forward = ragged.forward
    seen = set()

    def forward(model, feeds):
        started = time.perf_counter()
        logits = real_forward(model, feeds)
        rows = min(sum(len(feed.token_ids) for feed in feeds), {max_rows})
        left = fixed + per_row * rows - (time.perf_counter() - started)
        if rows not in seen:  # a device's first pass of a shape: its kernels load
            seen.add(rows)
            left += cold
        if left > 0:
            time.sleep(left)
        return logits

    ragged.forward = forward


_install()
'''


def write_pass_stretcher(directory: Path) -> Path:
    """Writes the sitecustomize.py that stretches passes into `directory` (put it first on the
    services' PYTHONPATH); returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    text = (_SITECUSTOMIZE.replace("{env}", PASS_SECONDS_ENV).replace("{cold_env}", COLD_SECONDS_ENV)
            .replace("{max_rows}", str(STRETCHED_ROWS)))
    (directory / "sitecustomize.py").write_text(text)
    return directory


def pass_seconds_spec(target: tuple[float, float], draft: tuple[float, float]) -> str:
    """The value of SPECDEC_BENCH_PASS_SECONDS: (fixed seconds, seconds per row) of each role."""
    return f"target={target[0]},{target[1]};draft={draft[0]},{draft[1]}"


def build_agreeing_pair(directory: Path, perturbation: float, seed: int = 0, hidden_size: int = 64,
                        mute_special_tokens: bool = True) -> tuple[str, str]:
    """A random-weight Llama target (byte-level tokenizer and chat template, as
    specdec/distill/tiny.py), its head sharpened so greedy choices are not near ties, and a draft
    that is a copy of it with Gaussian noise of `perturbation` times each parameter's spread: the
    smaller, the more often they agree. mute_special_tokens: the end-of-sequence (and padding,
    beginning) rows of the head are zeroed, so answers seldom end early."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.distill.tiny import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
        for special in () if not mute_special_tokens else {tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id} - {None}:
            target.lm_head.weight[special] = 0.0  # a logit of 0 among sharpened ones: rarely the top
    draft = LlamaForCausalLM(config).eval()
    draft.load_state_dict(target.state_dict())
    perturb(draft, perturbation, seed + 1)
    target_path, draft_path = save_pair(directory, target, draft, tokenizer)
    return str(target_path), str(draft_path)


def perturb(model, perturbation: float, seed: int) -> None:
    """Adds Gaussian noise of `perturbation` times each parameter's spread, in place."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * perturbation * parameter.std())


def save_pair(directory: Path, target, draft, tokenizer) -> tuple[Path, Path]:
    """directory/target and directory/draft, each a Hugging Face directory with the tokenizer."""
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        path = directory / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]
