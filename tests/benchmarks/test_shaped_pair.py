"""benchmarks/shaped_pair.py: the stand-in pair keeps the configuration it is given (the target's
shape, the draft's two layers of it), never picks end-of-sequence, and its draft agrees with the
target the less the more it is perturbed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import shaped_pair  # noqa: E402

from tests.benchmarks.test_emulated_pair import greedy_agreement  # noqa: E402


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory) -> Path:
    """A target's description without weights: a 4-layer Llama config and a tokenizer."""
    from transformers import LlamaConfig

    from specdec.distill.tiny import make_tiny_tokenizer

    directory = tmp_path_factory.mktemp("description")
    tokenizer = make_tiny_tokenizer()
    LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_the_pair_keeps_the_shape_and_never_ends_early(tmp_path, config_dir):
    from transformers import AutoConfig

    target_dir, draft_dir = shaped_pair.build_shaped_pair(config_dir, tmp_path, perturbation=0.0)
    target, draft = AutoConfig.from_pretrained(target_dir), AutoConfig.from_pretrained(draft_dir)
    assert (target.num_hidden_layers, draft.num_hidden_layers) == (4, shaped_pair.DRAFT_LAYERS)
    assert (draft.hidden_size, draft.vocab_size) == (target.hidden_size, target.vocab_size) == (64, target.vocab_size)
    agreement, generated = greedy_agreement(target_dir, draft_dir, max_new_tokens=64)
    assert len(generated) == 64 and target.eos_token_id not in generated
    assert agreement >= 0.6, agreement  # unperturbed: the draft is the target without its damped layers


def test_perturbing_the_draft_lowers_agreement(tmp_path, config_dir):
    close, _ = greedy_agreement(*shaped_pair.build_shaped_pair(config_dir, tmp_path / "close", perturbation=0.0))
    far, _ = greedy_agreement(*shaped_pair.build_shaped_pair(config_dir, tmp_path / "far", perturbation=0.5))
    assert far < close, (far, close)
