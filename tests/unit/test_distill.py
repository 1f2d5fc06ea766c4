"""The distillation recipe: prompts, simulation, loss, config, and an end-to-end smoke run."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from specdec.distill.config import DistillConfig
from specdec.distill.data import Example
from specdec.distill.evaluate import committed_per_round
from specdec.distill.prompts import build_prompts
from specdec.distill.tiny import make_tiny_target
from specdec.distill.train import Batch, distill_loss, kept_ids_from_examples
from specdec.draft_model import is_draft_dir, load_draft, read_draft_spec


def _benchmark_prompts():
    from specdec import prompt_sets

    return prompt_sets


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def test_benchmark_prompt_set_shape():
    prompts = _benchmark_prompts()
    assert len(prompts.DEMO_PROMPTS) == 7 and len(prompts.BENCHMARK_PROMPTS) == 24
    assert {p.kind for p in prompts.BENCHMARK_PROMPTS} == set(prompts.TASK_KINDS)
    assert len(prompts.ALL_PROMPTS) == 7 + 24 + 6
    assert len({p.name for p in prompts.ALL_PROMPTS}) == len(prompts.ALL_PROMPTS)
    # The demo shows one input-grounded prompt beside the six open-ended ones, last.
    assert [p.kind for p in prompts.DEMO_PROMPTS].count(prompts.GROUNDED_KIND) == 1
    assert prompts.DEMO_PROMPTS[-1].kind == prompts.GROUNDED_KIND
    grounded = prompts.GROUNDED_PROMPTS
    assert len(grounded) == 6 and {p.kind for p in grounded} == {prompts.GROUNDED_KIND}
    # code to edit, JSON to rewrite, a passage to quote, and second turns that revise the first
    assert sum("```python" in p.messages[0]["content"] for p in grounded) >= 2
    assert any("```json" in p.text for p in grounded) and any("Passage:" in p.text for p in grounded)
    revisions = [p for p in grounded if len(p.messages) == 3]
    assert len(revisions) >= 2
    for prompt in revisions:
        assert [m["role"] for m in prompt.messages] == ["user", "assistant", "user"]
        assert prompt.text.startswith("Revise")


def test_distill_prompts_are_disjoint_from_demo_and_benchmark_prompts():
    prompt_sets = _benchmark_prompts()
    # 10,000 covers what the committed draft's run drew from (num_prompts, twice for filtering).
    conversations = build_prompts(10000, seed=0)
    distill = [_normalise(m[-1]["content"]) for m in conversations]
    distill_set = set(distill)
    joined = "\n".join(_normalise(message["content"]) for m in conversations for message in m)
    for prompt in prompt_sets.ALL_PROMPTS:
        assert _normalise(prompt.text) not in distill_set, prompt.name
    for prompt in prompt_sets.OPEN_ENDED_PROMPTS:
        for quoted in re.findall(r'"([^"]+)"', prompt.text):  # translation sentences
            assert _normalise(quoted) not in joined, prompt.name
    for topic in prompt_sets.TOPICS:  # not only the texts: their topics too
        pattern = re.compile(rf"\b{re.escape(topic)}s?\b")
        assert not [t for t in distill if pattern.search(t)], topic
    # The grounded prompts' material (the code, JSON, passage and turns they give): no line of it
    # in any distillation message.
    grounded = [p for p in prompt_sets.ALL_PROMPTS if p.kind == prompt_sets.GROUNDED_KIND]
    lines = {_normalise(line) for p in grounded for m in p.messages
             for line in re.split(r"\n|(?<=[.?!:]) ", m["content"])
             if len(line.strip()) >= 20}
    assert len(lines) > 40
    assert not [line for line in lines if line in joined]


def test_overlap_filter_catches_texts_sentences_and_topics():
    from specdec.prompt_sets import ALL_PROMPTS, overlaps_measured

    assert all(overlaps_measured(p.text) for p in ALL_PROMPTS)
    assert overlaps_measured('Wie sagt man "The train to Berlin leaves from platform four."?')
    assert overlaps_measured("Write a class for Stacks of plates")
    assert overlaps_measured("How do vaccines work?")
    assert not overlaps_measured("Write a class for stackable crates")  # whole words only
    assert not overlaps_measured("Explain how a refrigerator keeps food cold.")


def test_general_distill_prompts_avoid_the_benchmark_topics():
    import random as random_module

    from specdec.distill.general_prompts import general_prompt
    from specdec.prompt_sets import overlaps_measured

    rng = random_module.Random(0)
    texts = {general_prompt(kind, rng) for kind in ("code", "explain", "chat", "translate")
             for _ in range(3000)}
    assert len(texts) > 2000  # enough distinct prompts for the default run's template share
    assert not [t for t in texts if overlaps_measured(t)]


def test_written_prompts_keep_a_clean_request_and_drop_the_rest():
    import random as random_module

    from specdec.distill.written_prompts import parse_written, writer_text

    rng = random_module.Random(0)
    text = writer_text("code", rng)
    assert text.startswith(("Requests", "Coding", "Things")) and text.endswith("\n4.")
    assert text.count("\n") == 4
    assert parse_written("code", " Write a function that adds two numbers.\n5. More", rng) == (
        "Write a function that adds two numbers.")
    assert parse_written("code", " Write a function that adds two", rng) is None  # cut off
    assert parse_written("code", " write something.", rng) is None  # not a sentence start
    assert parse_written("code", " Do this. 5. Do that. 6. And this.", rng) is None  # run-on list
    assert parse_written("chat", " What should I do for my birthday?", rng) is None  # measured
    assert parse_written("explain", " ###########?", rng) is None
    wrapped = parse_written("translate", " The cat is on the roof.", rng)
    assert wrapped is not None and "The cat is on the roof." in wrapped
    assert any(language in wrapped for language in ("French", "Spanish", "German", "Italian",
                                                    "Portuguese", "Dutch"))
    assert parse_written("translate", " The cat is on the", rng) is None


def test_distill_prompts_are_deterministic_and_distinct():
    first = build_prompts(300, seed=3)
    assert first == build_prompts(300, seed=3)
    texts = [m[-1]["content"] for m in first]
    assert len(texts) == 300 == len(set(texts))


@pytest.mark.parametrize(
    ("matches", "k", "expected"),
    [
        ([True] * 10, 4, (10, 2)),  # 5 committed per round: 4 accepted + bonus
        ([False] * 6, 4, (6, 6)),  # every round commits only the correction
        ([True, False, True, True, True, True, True], 4, (7, 2)),  # 2 committed, then 5
        ([True, True], 4, (2, 1)),  # clipped at the answer's end
    ],
)
def test_committed_per_round_simulation(matches, k, expected):
    assert committed_per_round(matches, k) == expected


def test_kept_ids_respect_min_count():
    examples = [Example([1], [5, 5, 7], torch.zeros(3, 2, dtype=torch.int32),
                        torch.zeros(3, 2, dtype=torch.float16))]
    assert kept_ids_from_examples(examples, [2]).tolist() == [2, 5, 7]
    assert kept_ids_from_examples(examples, [2], min_count=2).tolist() == [2, 5]


def test_distill_loss_with_no_soft_weight_is_cross_entropy():
    logits = torch.randn(4, 6)
    batch = Batch(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(4), torch.zeros(4),
                  hard_labels=torch.tensor([0, 3, 5, 1]),
                  soft_ids=torch.tensor([[0, 1]] * 4), soft_logits=torch.zeros(4, 2))
    expected = torch.nn.functional.cross_entropy(logits, batch.hard_labels)
    assert torch.allclose(distill_loss(logits, batch, 0.0), expected)
    # Soft ids outside the kept set (-1) are dropped rather than indexed.
    batch.soft_ids[0] = torch.tensor([-1, -1])
    assert torch.isfinite(distill_loss(logits, batch, 0.5))


@pytest.mark.parametrize("field", ["num_layers", "steps", "num_prompts", "batch_size"])
def test_config_rejects_non_positive_values(field):
    with pytest.raises(ValueError, match=field):
        DistillConfig(target="default", out_dir=Path("x"), **{field: 0})


def test_the_defaults_are_the_committed_default_drafts_run():
    """The README and --help say the defaults reproduce the committed draft: its recorded config."""
    from specdec.draft_model import DEFAULT_DRAFT_DIR

    recorded = json.loads((DEFAULT_DRAFT_DIR / "specdec_draft.json").read_text())["training"]["config"]
    defaults = DistillConfig(target="default", out_dir=Path("unused"))
    where_it_ran = {"out_dir", "data_path"}  # the run's own file locations
    for field in dataclasses.fields(DistillConfig):
        if field.name not in where_it_ran:
            assert recorded[field.name] == getattr(defaults, field.name), field.name


def test_config_rejects_bad_fractions():
    with pytest.raises(ValueError):
        DistillConfig(target="default", out_dir=Path("x"), holdout_fraction=1.0)
    with pytest.raises(ValueError):
        DistillConfig(target="default", out_dir=Path("x"), soft_label_weight=1.5)


def test_distill_end_to_end_on_a_tiny_target(tmp_path, capsys):
    from specdec_cli.main import main

    target_dir = make_tiny_target(tmp_path / "target", seed=0)
    out_dir = tmp_path / "draft"
    data_path = tmp_path / "answers.pt"
    argv = ["distill", "--target", str(target_dir), "--out", str(out_dir), "--num-prompts", "24",
            "--max-new-tokens", "12", "--layers", "1", "--steps", "6", "--batch-size", "4",
            "--eval-every", "3", "--validation-answers", "2", "--min-token-count", "2",
            "--data", str(data_path), "--generation-dtype", "bfloat16", "--train-dtype", "bfloat16",
            "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "[distill] the target wrote" in printed  # half the prompts: the writer step ran
    summary = json.loads(printed[printed.index("{\n"):])
    assert 0.0 <= summary["held_out"]["greedy_agreement"] <= 1.0
    assert 1.0 <= summary["held_out"]["mean_committed_per_round"] <= 5.0
    assert summary["cost"]["cost_ratio"] > 0
    assert is_draft_dir(out_dir) and data_path.is_file()
    spec = read_draft_spec(out_dir)
    assert spec.target == str(target_dir.resolve())
    assert spec.training["num_held_out_answers"] >= 1 and "best_step" in spec.training
    assert spec.training["generation_dtype"] == "bfloat16"  # answers from a bfloat16 copy
    assert spec.training["train_dtype"] == "bfloat16"  # trained under bfloat16 autocast
    draft = load_draft(out_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = draft(input_ids=torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, draft.config.vocab_size)
    # A second run reuses the cached answers.
    assert main(argv[:4] + [str(tmp_path / "again")] + argv[5:]) == 0
    assert "loaded 24 cached answers" in capsys.readouterr().out
    assert read_draft_spec(tmp_path / "again").training["generation_dtype"] is None  # none generated


def test_generation_and_train_dtypes_resolve_auto_and_reject_others():
    from specdec.distill.recipe import compute_dtype, generation_dtype

    def config(**kwargs):
        return DistillConfig(target="default", out_dir=Path("x"), **kwargs)

    assert generation_dtype(config(generation_dtype="float32")) == torch.float32
    assert generation_dtype(config(generation_dtype="bfloat16")) == torch.bfloat16
    assert generation_dtype(config(device="cuda")) == torch.bfloat16
    assert generation_dtype(config()) in (torch.bfloat16, torch.float32)  # by the CPU's features
    assert compute_dtype("auto", "cpu") == generation_dtype(config())  # one rule for both
    assert compute_dtype("float32", "cuda") == torch.float32
    with pytest.raises(ValueError, match="generation_dtype"):
        config(generation_dtype="float16")
    with pytest.raises(ValueError, match="train_dtype"):
        config(train_dtype="float16")


def test_training_under_bfloat16_autocast_learns_and_keeps_float32_weights(tmp_path):
    """The recipe's default on a CPU with native bfloat16: the passes run under autocast, the
    weights and optimizer stay float32, and the draft still fits its training answers."""
    from transformers import AutoModelForCausalLM

    from specdec.distill.evaluate import evaluate_held_out
    from specdec.distill.train import init_draft_from_target, train_draft

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(make_tiny_target(tmp_path / "t", seed=3)).eval()
    generator = torch.Generator().manual_seed(0)
    examples = []
    for _ in range(16):  # a fixed continuation rule the draft can learn: next id = id + 1
        start = int(torch.randint(10, 60, (1,), generator=generator))
        answer = list(range(start + 4, start + 16))
        examples.append(Example(list(range(start, start + 4)), answer,
                                torch.tensor([[a] for a in answer], dtype=torch.int32),
                                torch.zeros(len(answer), 1, dtype=torch.float16)))
    draft = init_draft_from_target(target, 1, kept_ids_from_examples(examples, [0]))
    before = evaluate_held_out(draft, examples, 4).greedy_agreement
    config = DistillConfig(target="tiny", out_dir=tmp_path / "d", steps=60, batch_size=8,
                           learning_rate=3e-3, warmup_steps=0, eval_every_steps=0,
                           max_train_seconds=None, progress=False)
    summary = train_draft(draft, examples, config, pad_id=0, autocast_dtype=torch.bfloat16)
    after = evaluate_held_out(draft, examples, 4).greedy_agreement
    assert summary["train_dtype"] == "bfloat16" and summary["steps"] == 60
    assert all(p.dtype == torch.float32 for p in draft.parameters())
    assert after > max(0.9, before), (before, after)


def test_prune_head_keeps_the_logits_of_kept_ids(tmp_path):
    from transformers import AutoModelForCausalLM

    from specdec.distill.train import init_draft_from_target, prune_head

    target = AutoModelForCausalLM.from_pretrained(make_tiny_target(tmp_path / "t"))
    draft = init_draft_from_target(target, 1, torch.arange(2, 60)).eval()
    input_ids = torch.tensor([[5, 9, 11]])
    with torch.no_grad():
        before = draft(input_ids=input_ids).logits
        prune_head(draft, torch.tensor([2, 7, 30, 59, 200]))  # 200 is not in the head: ignored
        after = draft(input_ids=input_ids).logits
    assert draft.lm_head.kept_token_ids.tolist() == [2, 7, 30, 59]
    # The same weight rows times the same hidden states; a narrower product may round differently
    # in the last bit (MKL on some CPUs picks its kernel by the matrix's width), nothing more.
    torch.testing.assert_close(after[..., [2, 7, 30, 59]], before[..., [2, 7, 30, 59]], rtol=1e-6, atol=1e-6)
    assert torch.isneginf(after[..., 8]).all()
