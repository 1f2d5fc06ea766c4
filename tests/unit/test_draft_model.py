"""The specdec draft format: round trip, full-vocabulary logits, caches, HF assisted generation."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from specdec.distill.tiny import make_tiny_target
from specdec.draft_model import (
    DEFAULT_DRAFT_DIR,
    DRAFT_CONFIG_NAME,
    DRAFT_WEIGHTS_NAME,
    EMBEDDING_KEY,
    DraftFormatError,
    RestrictedHead,
    build_draft,
    draft_config_from_target,
    is_draft_dir,
    load_draft,
    read_draft_spec,
    save_draft,
)

KEPT_IDS = list(range(3, 120)) + [2]  # byte tokens plus <|im_end|> of the tiny tokenizer


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("tiny-target"), seed=0)


@pytest.fixture(scope="module")
def target(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, target, target_dir):
    torch.manual_seed(1)
    config = draft_config_from_target(target.config, num_layers=1)
    model = build_draft(config, KEPT_IDS, target.get_input_embeddings().weight.float())
    return save_draft(model, tmp_path_factory.mktemp("draft"), target=str(target_dir))


@pytest.fixture(scope="module")
def draft(draft_dir):
    return load_draft(draft_dir, dtype=torch.float64)


def test_round_trip_gives_the_same_logits(draft_dir, draft, tmp_path, target_dir):
    input_ids = torch.tensor([[5, 9, 40, 77, 2, 100]])
    again_dir = save_draft(load_draft(draft_dir), tmp_path / "again", target=str(target_dir))
    again = load_draft(again_dir, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(draft(input_ids=input_ids).logits, again(input_ids=input_ids).logits)


def test_saved_weights_are_float16_and_exclude_the_target_embedding(draft_dir):
    with safe_open(str(draft_dir / DRAFT_WEIGHTS_NAME), framework="pt") as handle:
        keys = set(handle.keys())
        floats = [handle.get_tensor(k) for k in keys if handle.get_tensor(k).is_floating_point()]
    assert EMBEDDING_KEY not in keys
    assert floats and all(t.dtype == torch.float16 for t in floats)
    spec = json.loads((draft_dir / DRAFT_CONFIG_NAME).read_text())
    assert spec["format"] == "specdec-draft" and sorted(spec["kept_token_ids"]) == sorted(KEPT_IDS)


def test_logits_are_minus_inf_outside_the_head_and_finite_inside(draft):
    with torch.no_grad():
        logits = draft(input_ids=torch.tensor([[5, 6, 7]])).logits  # (1, 3, V)
    kept = torch.zeros(logits.shape[-1], dtype=torch.bool)
    kept[KEPT_IDS] = True
    assert logits.shape[-1] == draft.config.vocab_size
    assert torch.isneginf(logits[..., ~kept]).all()
    assert torch.isfinite(logits[..., kept]).all()
    probs = logits.softmax(-1)
    assert torch.equal(probs[..., ~kept], torch.zeros_like(probs[..., ~kept]))
    assert torch.allclose(probs.sum(-1), torch.ones(1, 3, dtype=probs.dtype))


def test_incremental_decoding_with_dynamic_cache_matches_full_sequence(draft):
    input_ids = torch.tensor([[4, 8, 15, 16, 23, 42, 7, 2]])
    with torch.no_grad():
        full = draft(input_ids=input_ids).logits
        cache = DynamicCache()
        pieces = [draft(input_ids=input_ids[:, :3], cache=cache, use_cache=True).logits]
        for position in range(3, input_ids.shape[1]):
            pieces.append(draft(input_ids=input_ids[:, position:position + 1], cache=cache,
                                use_cache=True).logits)
    incremental = torch.cat(pieces, dim=1)
    finite = torch.isfinite(full)
    assert torch.equal(finite, torch.isfinite(incremental))
    assert torch.allclose(full[finite], incremental[finite], atol=1e-10)


def test_works_as_assistant_model_in_hf_assisted_generation(target, target_dir, draft):
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello, draft"}],
                                           add_generation_prompt=True, return_tensors="pt")
    input_ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    alone = target.generate(input_ids, max_new_tokens=24, do_sample=False)
    assisted = target.generate(input_ids, max_new_tokens=24, do_sample=False, assistant_model=draft)
    assert assisted.tolist() == alone.tolist()


def test_is_draft_dir(draft_dir, target_dir, tmp_path):
    assert is_draft_dir(draft_dir)
    assert not is_draft_dir(target_dir)
    assert not is_draft_dir(tmp_path / "missing")


def test_a_draft_refuses_a_different_target(draft_dir, tmp_path):
    other = make_tiny_target(tmp_path / "other-target", seed=5)
    with pytest.raises(DraftFormatError, match="different target"):
        load_draft(draft_dir, target_dir=other)


def test_restricted_head_rejects_ids_outside_the_vocabulary():
    with pytest.raises(DraftFormatError):
        RestrictedHead(8, torch.tensor([1, 50]), vocab_size=50)


def test_the_committed_default_draft_is_small_and_well_formed():
    assert is_draft_dir(DEFAULT_DRAFT_DIR)
    size = sum(p.stat().st_size for p in DEFAULT_DRAFT_DIR.iterdir() if p.is_file())
    assert size < 40 * 1024 * 1024
    spec = read_draft_spec(DEFAULT_DRAFT_DIR)
    assert spec.target == "default"
    assert spec.config.vocab_size == 49152 and spec.config.num_hidden_layers <= 4
    assert 0 < len(spec.kept_token_ids) < spec.config.vocab_size
    assert "held_out" in spec.training
