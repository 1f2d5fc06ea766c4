"""Batched passes (specdec.ragged, specdec.worker): a row's logits do not depend on what else is
in the pass, a long prompt fed in chunks gives what one pass gives, and the worker runs the jobs
waiting when the model is free as one pass, each job failing or finishing on its own."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch

from specdec import attention
from specdec.kv_cache import SequenceCache
from specdec.ragged import Feed, forward, run_alone
from specdec.worker import BatchLimits, ModelWorker, due_back

from tests import tiny_models


@pytest.fixture(scope="module")
def model():
    model = tiny_models.make_model(seed=5, num_attention_heads=4, num_key_value_heads=2).to(torch.float64)
    attention.use_ragged(model)
    return model


def _random_tokens(rng: random.Random, vocab: int, count: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(count)]


@pytest.mark.parametrize("seed", range(4))
def test_batched_rows_equal_single_session_rows(model, seed):
    """Sessions with random context lengths feed random numbers of rows (a Verify of K + 1, a draft
    step of 1, a prompt) together, pass after pass, in shuffled order; every row's logits and
    every cache equal what each session gets alone (float64)."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    sessions = rng.randrange(2, 9)
    plans = [[_random_tokens(rng, vocab, rng.choice([1, 1, 2, 3, 5, 9, 17, 40]))
              for _ in range(rng.randrange(2, 6))] for _ in range(sessions)]
    together = [SequenceCache(model) for _ in plans]
    alone = [SequenceCache(model) for _ in plans]
    for step in range(max(len(plan) for plan in plans)):
        order = [i for i in range(sessions) if step < len(plans[i])]
        rng.shuffle(order)
        keep_all = [rng.random() < 0.5 for _ in order]
        feeds = [Feed(together[i], plans[i][step], keep) for i, keep in zip(order, keep_all)]
        batched = forward(model, feeds)
        for i, keep, got in zip(order, keep_all, batched):
            want = alone[i].feed(plans[i][step])
            want = want if keep else want[-1:]
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        if rng.random() < 0.5:  # roll a session back, as a rejected round does
            i = rng.randrange(sessions)
            length = rng.randrange(len(alone[i]) + 1)
            alone[i].truncate(length)
            together[i].truncate(length)
    for batched_cache, alone_cache in zip(together, alone):
        assert batched_cache.token_ids == alone_cache.token_ids
        for layer in range(batched_cache.num_layers):
            if not len(alone_cache):
                continue
            for got, want in zip(batched_cache.layer(layer), alone_cache.layer(layer)):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_session_feeds_once_per_pass(model):
    cache = SequenceCache(model)
    with pytest.raises(ValueError, match="once per pass"):
        forward(model, [Feed(cache, [1]), Feed(cache, [2])])
    assert len(cache) == 0


def _prompt_job(cache: SequenceCache, prompt: list[int]):
    logits = yield Feed(cache, prompt)
    return logits


def _decode_job(cache: SequenceCache, steps: int):
    """Greedy decoding of `steps` tokens after the cache, one row per pass."""
    tokens = []
    logits = yield Feed(cache, [1])
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits = yield Feed(cache, [tokens[-1]])
    return tokens


def _hold(worker: ModelWorker) -> tuple[threading.Event, asyncio.Future]:
    """Occupies the worker with a plain call until the event is set; jobs submitted meanwhile all
    wait for the next pass."""
    gate = threading.Event()
    return gate, asyncio.ensure_future(worker.run(lambda: gate.wait(timeout=30)))


def test_jobs_waiting_together_share_passes_and_long_prompts_go_in_chunks(model):
    rng = random.Random(7)
    vocab = model.config.vocab_size
    long_prompt = _random_tokens(rng, vocab, 150)
    prefixes = [_random_tokens(rng, vocab, rng.randrange(1, 30)) for _ in range(8)]

    async def scenario():
        worker = ModelWorker(limits=BatchLimits(max_pass_tokens=40), model=model)
        caches = [SequenceCache(model) for _ in prefixes]
        for cache, prefix in zip(caches, prefixes):
            cache.feed(prefix)
        prompt_cache = SequenceCache(model)
        gate, held = _hold(worker)
        await asyncio.sleep(0.05)
        decodes = [asyncio.ensure_future(worker.run_job(lambda c=c: _decode_job(c, 6))) for c in caches]
        prompt = asyncio.ensure_future(worker.run_job(lambda: _prompt_job(prompt_cache, long_prompt)))
        await asyncio.sleep(0.05)
        gate.set()
        await held
        results = [await d for d in decodes]
        prompt_result = await prompt
        worker.shutdown()
        return results, prompt_result, prompt_cache, worker.counters

    results, prompt_result, prompt_cache, counters = asyncio.run(scenario())
    # 7 passes of the 8 decode jobs together, each with 8 decode rows + a chunk of the prompt
    # (40 - 8 = 32 tokens: 150 tokens take 5 passes).
    assert counters.passes_total == 7
    assert counters.pass_sessions_total == 7 * 8 + 5
    assert counters.pass_rows_total == 7 * 8 + 150
    assert all(r.pass_sessions > 8 for r in results[:1])
    for prefix, result in zip(prefixes, results):
        alone = SequenceCache(model)
        alone.feed(prefix)
        assert result.value == run_alone(model, _decode_job(alone, 6))
    whole = SequenceCache(model).feed(long_prompt)[-1:]
    torch.testing.assert_close(prompt_result.value, whole, rtol=0, atol=1e-12)
    assert prompt_cache.token_ids == long_prompt


def test_a_failing_job_fails_alone_and_a_cancelled_caller_leaves_the_others(model):
    def failing(cache):
        yield Feed(cache, [1, 2])
        raise ValueError("this job's own error")

    async def scenario():
        worker = ModelWorker(model=model)
        caches = [SequenceCache(model) for _ in range(4)]
        gate, held = _hold(worker)
        await asyncio.sleep(0.05)
        good = [asyncio.ensure_future(worker.run_job(lambda c=c: _decode_job(c, 3))) for c in caches[:2]]
        bad = asyncio.ensure_future(worker.run_job(lambda: failing(caches[2])))
        cancelled = asyncio.ensure_future(worker.run_job(lambda: _decode_job(caches[3], 3)))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        gate.set()
        await held
        with pytest.raises(ValueError, match="own error"):
            await bad
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        values = [(await g).value for g in good]
        worker.shutdown()
        return values, caches

    values, caches = asyncio.run(scenario())
    assert values[0] == values[1]  # same start, same greedy tokens
    # The cancelled caller's job still ran to its end (its cache is never left half-fed).
    assert len(caches[3]) == 4


def test_plain_calls_wait_for_the_active_jobs(model):
    async def scenario():
        worker = ModelWorker(model=model)
        cache = SequenceCache(model)
        order = []
        gate, held = _hold(worker)
        await asyncio.sleep(0.05)
        job = asyncio.ensure_future(worker.run_job(lambda: _decode_job(cache, 5)))
        plain = asyncio.ensure_future(worker.run(lambda: order.append(len(cache))))
        gate.set()
        await held
        await job
        await plain
        worker.shutdown()
        return order

    assert asyncio.run(scenario()) == [6]


def test_sessions_due_back_are_waited_for_so_they_share_a_pass(model, monkeypatch):
    """Two sessions whose callers come back 3 ms after each job (a round trip) while a pass takes
    20 ms: without waiting they take turns, each arriving while the other's pass runs, one pass
    each. The worker waits for the session due back, so they settle into shared passes."""
    import specdec.ragged as ragged

    real_forward = ragged.forward

    def slow_forward(model, feeds):
        time.sleep(0.02)
        return real_forward(model, feeds)

    monkeypatch.setattr(ragged, "forward", slow_forward)
    caches = [SequenceCache(model) for _ in range(2)]
    for cache in caches:
        cache.feed([1, 2, 3])

    def step(cache):
        return (yield Feed(cache, [4]))

    async def session(worker, index):
        await asyncio.sleep(0.005 * index)  # out of step from the start
        for _ in range(12):
            await worker.run_job(lambda: step(caches[index]), key=f"s{index}")
            await asyncio.sleep(0.003)  # the caller's round trip

    async def scenario():
        worker = ModelWorker(model=model)
        sizes = []

        class Sizes:
            def pass_ran(self, rows, sessions, seconds):
                sizes.append(sessions)

            def call_started(self, queue_seconds):
                pass

        worker.observer = Sizes()
        await asyncio.gather(session(worker, 0), session(worker, 1))
        worker.shutdown()
        return sizes

    sizes = asyncio.run(scenario())
    assert sum(sizes) == 24
    assert sizes.count(2) >= 8, sizes


@pytest.mark.parametrize("on_behalf, round_trip, waited", [
    (True, 0.004, False), (False, 0.004, True), (False, 0.45, False),
], ids=["on-behalf", "anonymous", "due-back-after-the-cap"])
def test_who_a_pass_waits_for(model, monkeypatch, on_behalf, round_trip, waited):
    """A session served a moment ago is due back after its caller's round trip; a pass waits for
    it (at most half a pass: here 20 ms) if it is expected back by then (anonymous jobs, a 4 ms
    round trip: the control case, so the check can fail). Jobs that work for that session after
    its call answered (the draft's branches) show it is here: their passes do not wait. Nor do
    passes wait for a session that cannot be back by then (a 0.45 s round trip, of which the two
    passes of the jobs take less than half: a draft's session whose caller is verifying on the
    target), which would miss them anyway."""
    from specdec import ragged

    real_forward = ragged.forward

    def slow_forward(model, feeds):
        time.sleep(0.04)
        return real_forward(model, feeds)

    monkeypatch.setattr(ragged, "forward", slow_forward)
    cache = SequenceCache(model)
    cache.feed([1, 2, 3])

    def steps(branch: SequenceCache, count: int):
        for token in range(count):
            yield Feed(branch, [4 + token])

    class CountingCondition(threading.Condition):
        waits = 0

        def wait(self, timeout=None):
            CountingCondition.waits += 1
            return super().wait(timeout)

    async def scenario():
        worker = ModelWorker(model=model)
        worker._arrived = CountingCondition(worker._lock)
        for _ in range(3):  # the session's calls, a round trip apart: its round trip is learnt
            await worker.run_job(lambda: steps(cache, 1), key="s")
            cache.truncate(3)
            await asyncio.sleep(round_trip)
        await worker.run_job(lambda: steps(cache, 1), key="s")
        CountingCondition.waits = 0
        branches = [cache.fork(len(cache)) for _ in range(3)]
        behalf = "s" if on_behalf else None
        await asyncio.gather(*(worker.run_job(lambda b=b: steps(b, 2), on_behalf_of=behalf) for b in branches))
        worker.shutdown()
        return CountingCondition.waits

    waits = asyncio.run(scenario())
    assert (waits >= 1) if waited else (waits == 0), waits


def test_due_back_keeps_the_sessions_that_can_be_back_within_the_cap():
    finished = [0.0, 0.0, 0.0]
    # Back after 10 ms on average, possibly after 5: at 5 ms with 8 ms to wait all can be back by
    # then, and are overdue at 15 ms; served 1 ms ago with 2 ms to wait, nobody can.
    assert due_back(finished, 0.010, now=0.005, cap=0.008) == pytest.approx([0.015] * 3)
    assert due_back(finished, 0.010, now=0.001, cap=0.002) == []
    # Late but not yet overdue (1.5 times the gap): still waited for; overdue: not.
    assert due_back([0.0], 0.010, now=0.012, cap=0.001) == pytest.approx([0.015])
    assert due_back([0.0], 0.010, now=0.016, cap=0.010) == []
    # Each session on its own.
    assert due_back([0.0, 0.020], 0.010, now=0.012, cap=0.002) == pytest.approx([0.015])
