"""benchmarks/emulated_pair.py: the pass stretcher is installed in a model service process of the
role the environment names (through sitecustomize on its PYTHONPATH), and nowhere else; and the
pair it builds agrees as often as its perturbation says (no timing is asserted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import emulated_pair  # noqa: E402

PROBE = "import specdec.ragged as ragged; print(ragged.forward.__qualname__)"


def _forward_name(site: Path, role: str, spec: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
           emulated_pair.PASS_SECONDS_ENV: spec}
    result = subprocess.run([sys.executable, "-c", PROBE, "serve", role], env=env, capture_output=True,
                            text=True, timeout=120, check=True)
    return result.stdout.strip()


def test_the_stretcher_wraps_forward_only_for_the_named_role(tmp_path):
    site = emulated_pair.write_pass_stretcher(tmp_path / "site")
    spec = emulated_pair.pass_seconds_spec(target=(0.05, 0.006), draft=(0.0065, 0.0005))
    assert spec == "target=0.05,0.006;draft=0.0065,0.0005"
    assert _forward_name(site, "target", spec) == "_install.<locals>.forward"
    assert _forward_name(site, "draft", "target=0.05,0.006") == "forward"  # no figures for the draft
    assert _forward_name(site, "orchestrator", spec) == "forward"


@pytest.mark.parametrize("perturbation,low,high", [(0.05, 0.8, 1.0), (0.15, 0.6, 0.85)])
def test_the_draft_agrees_less_the_more_it_is_perturbed(tmp_path, perturbation, low, high):
    agreement, _ = greedy_agreement(*emulated_pair.build_agreeing_pair(tmp_path, perturbation))
    assert low <= agreement <= high, agreement


def greedy_agreement(target_dir, draft_dir, max_new_tokens: int = 96) -> tuple[float, list[int]]:
    """How often the draft's greedy choice is the target's along the target's own greedy answer
    to a random prompt; and that answer."""
    import torch
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir).eval()
    prompt = torch.randint(10, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        output = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False,
                                 attention_mask=torch.ones_like(prompt))
        drafted = draft(output).logits[0, prompt.shape[1] - 1:-1].argmax(-1)
    generated = output[0, prompt.shape[1]:]
    return (drafted[:len(generated)] == generated).float().mean().item(), generated.tolist()
