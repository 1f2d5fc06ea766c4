"""The draft head: its format, its drafts, and `specdec distill-head` end to end on a tiny target."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.distill.data import Example
from specdec.distill.head import HeadDistillConfig, agreement, answer_positions, train_head
from specdec.distill.tiny import make_tiny_target
from specdec.draft_head import HeadFormatError, load_head, new_head, save_head


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    path = make_tiny_target(tmp_path_factory.mktemp("head-target") / "target", seed=4)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_a_saved_head_loads_with_the_same_drafts_in_the_targets_dtype(tiny_target, tmp_path):
    path, model = tiny_target
    head = new_head(model, list(range(3, 200)), inner_size=32)
    torch.nn.init.normal_(head.down.weight, std=0.5)  # drafts that depend on the weights
    save_head(head, tmp_path / "head", training={"note": "test"})
    loaded = load_head(tmp_path / "head", model)
    hidden, tokens = torch.randn(5, model.config.hidden_size), torch.tensor([4, 9, 30, 31, 100])
    expected = new_head(model, list(range(3, 200)), inner_size=32)
    expected.load_state_dict({k: v.to(torch.float16).float() for k, v in head.state_dict().items()})
    assert torch.equal(loaded.draft(hidden, tokens, 3)[0], expected.draft(hidden, tokens, 3)[0])
    drafts, chances = loaded.draft(hidden, tokens, 3)
    assert drafts.shape == chances.shape == (5, 3)
    assert set(drafts.flatten().tolist()) <= set(range(3, 200))  # only the head's ids
    assert ((chances > 0) & (chances <= 1)).all()
    # The chains stop once no row's chance, multiplied along its drafts, reaches min_chance.
    assert loaded.draft(hidden, tokens, 3, min_chance=1.0)[0].shape == (5, 1)
    lowest = float(chances[:, :2].prod(dim=1).max())  # the best row's chance after two drafts
    assert loaded.draft(hidden, tokens, 3, min_chance=lowest * 1.01)[0].shape == (5, 2)
    bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert load_head(tmp_path / "head", bf16).up.weight.dtype == torch.bfloat16


def test_a_head_for_another_target_or_no_head_is_refused(tiny_target, tmp_path):
    path, model = tiny_target
    save_head(new_head(model, [5, 6], inner_size=8), tmp_path / "head")
    other = make_tiny_target(tmp_path / "wider", seed=1)
    config = json.loads((other / "config.json").read_text())
    config["hidden_size"] *= 2
    (other / "config.json").write_text(json.dumps(config))
    wider = AutoModelForCausalLM.from_pretrained(other, ignore_mismatched_sizes=True)
    with pytest.raises(HeadFormatError, match="the head is for a target of"):
        load_head(tmp_path / "head", wider)
    with pytest.raises(HeadFormatError, match="not a draft head directory"):
        load_head(tmp_path, model)


def test_training_teaches_a_head_a_rule_the_target_follows(tiny_target):
    """Answers that count up (next id = id + 1): after training, the head's first and second
    drafts follow the rule on held-out answers, where an untrained head does not."""
    _, model = tiny_target
    generator = torch.Generator().manual_seed(0)
    examples = []
    for _ in range(40):
        start = int(torch.randint(10, 150, (1,), generator=generator))
        answer = list(range(start + 4, start + 24))
        examples.append(Example(list(range(start, start + 4)), answer, torch.zeros(len(answer), 1, dtype=torch.int32),
                                torch.zeros(len(answer), 1, dtype=torch.float16)))
    train, held_out = answer_positions(model, examples[:32]), answer_positions(model, examples[32:])
    assert torch.equal(train.first, train.token + 1) and len(train) == 32 * 19
    torch.manual_seed(0)
    head = new_head(model, list(range(10, 180)), inner_size=128)
    before = agreement(head, held_out)
    config = HeadDistillConfig(target="tiny", out_dir=None, steps=300, batch_size=32, learning_rate=1e-2,
                               eval_every=50, progress=False)
    figures = train_head(head, train, held_out, config, autocast_dtype=None)
    after = agreement(head, held_out)
    assert before[0] < 0.2 and after[0] > 0.7 and after[1] > 0.7, (before, after)
    assert figures["held_out_first"] == pytest.approx(after[0], abs=1e-4)


def test_distill_head_end_to_end_on_a_tiny_target(tmp_path, capsys):
    from specdec_cli.main import main

    target = make_tiny_target(tmp_path / "target", seed=0)
    argv = ["distill-head", "--target", str(target), "--out", str(tmp_path / "head"), "--num-prompts", "24",
            "--max-new-tokens", "8", "--inner-size", "16", "--steps", "4", "--batch-size", "8", "--eval-every", "2",
            "--data", str(tmp_path / "answers.pt"), "--dtype", "bfloat16", "--no-progress"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["answers"] >= 20 and 0.0 <= summary["held_out_first"] <= 1.0
    assert (tmp_path / "answers.pt").is_file()  # the answers cache, reused by a second run
    model = AutoModelForCausalLM.from_pretrained(target)
    recorded = json.loads((tmp_path / "head" / "specdec_head.json").read_text())
    assert recorded["training"]["answers"] == summary["answers"]
    assert load_head(tmp_path / "head", model).draft(torch.zeros(1, model.config.hidden_size),
                                                     torch.tensor([3]), 2)[0].shape == (1, 2)


def _ragged_tiny():
    from specdec import attention
    from tests import tiny_models

    model = tiny_models.make_model(seed=6).to(torch.float64).eval()
    plain = tiny_models.make_model(seed=6).to(torch.float64).eval()
    attention.use_ragged(model)
    return model, plain


def test_a_pass_gives_each_feed_the_hidden_states_of_its_kept_rows():
    """Feed.keep_hidden: the output head's input at the rows whose logits are kept, as a plain
    forward's last hidden states give them, for each session of a shared pass."""
    from specdec.kv_cache import SequenceCache
    from specdec.ragged import Feed, forward

    model, plain = _ragged_tiny()
    prompt, verified = [5, 9, 14, 3, 22, 8], [4, 17, 30, 2]
    first = Feed(SequenceCache(model), prompt, keep_hidden=True)
    forward(model, [first])
    verify = Feed(first.cache, verified, keep_all=True, keep_hidden=True)
    other = Feed(SequenceCache(model), [11, 12, 13], keep_hidden=False)
    forward(model, [verify, other])
    with torch.no_grad():
        states = plain(input_ids=torch.tensor([prompt + verified]), output_hidden_states=True).hidden_states[-1][0]
    assert first.hidden.shape == (1, model.config.hidden_size)
    torch.testing.assert_close(first.hidden[0], states[len(prompt) - 1])
    torch.testing.assert_close(verify.hidden, states[len(prompt):])
    assert other.hidden is None


def test_the_worker_runs_the_head_feeds_of_a_pass_in_one_call(monkeypatch):
    """Sessions whose jobs ask for head drafts at the same point get them from one batched head
    call, each the drafts it would get alone."""
    from specdec.draft_head import DraftHead
    from specdec.kv_cache import SequenceCache
    from specdec.ragged import Feed, HeadFeed, run_heads
    from specdec.worker import ModelWorker

    model, _ = _ragged_tiny()
    torch.manual_seed(1)
    head = new_head(model, list(range(3, 50)), inner_size=16).to(torch.float64)
    torch.nn.init.normal_(head.down.weight, std=0.5)
    asks = [(torch.randn(model.config.hidden_size, dtype=torch.float64), token) for token in (4, 20, 41)]
    alone = [run_heads([HeadFeed(head, hidden, token, 3)])[0] for hidden, token in asks]
    calls = []
    draft = DraftHead.draft
    monkeypatch.setattr(DraftHead, "draft", lambda self, *args: calls.append(len(args[0])) or draft(self, *args))

    def job(hidden, token):
        yield Feed(SequenceCache(model), [token, token + 1])  # a pass together first
        return (yield HeadFeed(head, hidden, token, 3))

    async def scenario():
        worker = ModelWorker(model=model)
        release = threading.Event()
        try:  # the jobs queue behind a plain call, so that the worker takes them all at once
            busy = asyncio.ensure_future(worker.run(lambda: release.wait(30)))
            jobs = [asyncio.ensure_future(worker.run_job(lambda h=h, t=t: job(h, t))) for h, t in asks]
            await asyncio.sleep(0.1)
            release.set()
            await busy
            return await asyncio.gather(*jobs)
        finally:
            worker.shutdown()

    import asyncio
    import threading

    results = asyncio.run(scenario())
    assert [timed.value for timed in results] == alone
    assert calls == [3]  # one call for the three sessions


def test_serve_refuses_a_head_that_is_not_one_or_is_for_another_target_in_one_line(tiny_target, tmp_path):
    """`specdec serve target --draft-head`: a directory without a head is refused before the model
    loads, a head made for another target once the model has loaded; each in one line, exit 2."""
    from tests.process_groups import run_specdec

    path, model = tiny_target
    other = new_head(model, [5, 6], inner_size=8)
    other.config = dataclasses.replace(other.config, hidden_size=32)  # as if made for a narrower target
    save_head(other, tmp_path / "other")
    for head, expected in ((tmp_path, f"specdec: --draft-head {tmp_path}: not a draft head directory"),
                           (tmp_path / "other", "specdec: the head is for a target of")):
        with run_specdec("serve", "target", "--model", str(path), "--port", "0", "--draft-head", str(head)) as service:
            assert service.wait(120) == 2, service.output()
        assert service.output().strip().splitlines()[-1].startswith(expected), service.output()[-1000:]
        assert "Traceback" not in service.output()
