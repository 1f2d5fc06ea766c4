"""Runs model forward passes off the asyncio event loop, on one thread, batching the work of many
sessions into each pass (continuous batching), so health checks, cancellation and other sessions
never wait behind a forward pass and a pass serves everyone waiting.

A session's model work is a job: a generator that yields a Feed (tokens for its cache,
specdec.ragged) and receives that Feed's logits, as often as it needs (a Verify once, a Propose of
K once per drafted position), and returns its result. When the model is free the worker takes every
job that has a Feed ready, up to a per-pass token and session budget, and runs their Feeds as one
forward pass over ragged rows; then each job goes on from its own logits. There is no collection
window: at low load a pass holds one session, as it would alone. Short feeds (Verify, draft steps)
go first; a long prompt is fed in chunks with what the budget leaves, so it never stalls the
others' rounds. A job may also yield a HeadFeed (a target's draft head's drafts,
specdec.draft_head): those of every job waiting at that point run as one batched call, under the
pass lock, before the next pass. A job that fails fails alone; a pass that fails fails the jobs in it.

One thread per process runs all of its torch work, the model's loading included (model_thread).
torch's CPU ops run on an OpenMP team per calling thread, and libgomp lets a team's idle threads
spin between parallel regions only while the process has no more OpenMP threads than CPUs. A
second team (a model loaded on one thread and run on another, or two services' workers in one
process) doubles that count: every small op then pays a futex wake-up and a decode step takes
2-3x longer. Measured on 2 CPUs: the default draft's Propose 3.3 ms with one thread, 8.6 ms when
loaded on one thread and run on another."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from specdec.pass_costs import StepPassCosts
from specdec.errors import Overloaded

if TYPE_CHECKING:  # torch stays out of processes that only import the model thread
    import torch

    from specdec.pass_lock import PassLock
    from specdec.ragged import Feed, Job

Result = TypeVar("Result")


@dataclass(frozen=True)
class Timed:
    """A worker result with its timing (seconds) and the batches it ran in."""

    value: Any
    compute_seconds: float  # the passes it took part in, whole
    queue_seconds: float  # from submission to its first pass
    pass_rows: float = 0.0  # mean rows (all sessions) of those passes
    pass_sessions: float = 0.0  # mean sessions of those passes


@dataclass(frozen=True)
class BatchLimits:
    """What one forward pass may hold."""

    max_pass_tokens: int = 512  # rows over all sessions; a long prompt is fed in chunks
    max_pass_sessions: int = 64

    def __post_init__(self) -> None:
        if self.max_pass_tokens < 1 or self.max_pass_sessions < 1:
            raise ValueError("max_pass_tokens and max_pass_sessions must be >= 1")


@dataclass(frozen=True)
class PassCounters:
    """What the worker has run: the last pass and running totals."""

    pass_rows: int = 0
    pass_sessions: int = 0
    passes_total: int = 0
    pass_rows_total: int = 0
    pass_sessions_total: int = 0


class PassObserver(Protocol):
    """Told of every forward pass and every call's wait, on the model thread (metrics)."""

    def pass_ran(self, rows: int, sessions: int, seconds: float) -> None: ...

    def call_started(self, queue_seconds: float) -> None: ...


_model_thread: ThreadPoolExecutor | None = None
_model_thread_lock = threading.Lock()
# Below this many tokens a feed counts as a decode step and goes before prompt chunks.
_SHORT_FEED = 64
# A session back after longer than this is not in step with anyone: its gap is not learnt from.
_MAX_RETURN_GAP = 0.5


def model_thread() -> ThreadPoolExecutor:
    """The one thread that runs this process's torch work (see the module's docstring)."""
    global _model_thread
    with _model_thread_lock:
        if _model_thread is None:
            _model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        return _model_thread


async def run_on_model_thread(fn: Callable[[], Result]) -> Result:
    """fn() on the model thread, awaited (loading a model, say)."""
    return await asyncio.wrap_future(model_thread().submit(fn))


@dataclass(eq=False)
class _Entry:
    """A submitted call: a job (make_job) or a plain function run alone (fn)."""

    future: concurrent.futures.Future
    make_job: Callable[[], Job] | None = None
    fn: Callable[[], Any] | None = None
    key: str | None = None  # the session a job belongs to (sessions due back are waited for)
    on_behalf_of: str | None = None  # a session this job works for between its calls (see run_job)
    submitted: float = field(default_factory=time.perf_counter)
    job: Job | None = None
    feed: Feed | None = None  # what the job feeds next
    fed: int = 0  # tokens of `feed` already fed (a prompt in chunks)
    first_pass: float | None = None
    compute_seconds: float = 0.0
    passes: int = 0
    rows: int = 0
    sessions: int = 0

    def timed(self, value: Any) -> Timed:
        started = self.submitted if self.first_pass is None else self.first_pass
        passes = max(1, self.passes)
        return Timed(value, self.compute_seconds, started - self.submitted,
                     self.rows / passes, self.sessions / passes)


class ModelWorker:
    """One service's queue of model work, batched into forward passes of `model`. Every worker in
    a process shares the model thread, so two services in one process take turns pass by pass;
    each keeps its own queue bound and shutdown."""

    def __init__(self, max_queue: int = 64, limits: BatchLimits = BatchLimits(),
                 model: torch.nn.Module | None = None, pass_lock: PassLock | None = None) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        self.max_queue = max_queue
        self.limits = limits
        self._model = model
        # Taken for each forward pass: services that share the cores take turns (specdec.pass_lock).
        self._pass_lock = pass_lock
        self._pending = 0  # calls submitted and not finished
        self._lock = threading.Lock()  # guards _waiting, _active, _scheduled, _closed, _alone
        self._waiting: deque[_Entry] = deque()
        self._active: list[_Entry] = []
        self._scheduled = False
        self._closed = False
        self._alone: _Entry | None = None  # the plain call running, if any
        self._arrived = threading.Condition(self._lock)
        # Sessions whose last job finished recently, by key: when each finished; and the mean gap
        # between a session's job finishing and its next arriving (its caller's round trip).
        self._served: dict[str, float] = {}
        self._return_gap: float | None = None
        self._last_pass_seconds = 0.0
        self.counters = PassCounters()
        self.observer: PassObserver | None = None
        # What one more row costs a pass, from the step passes (specdec.pass_costs).
        self.step_costs = StepPassCosts()

    @property
    def load(self) -> float:
        """Calls queued or running over the queue's capacity, in [0, 1]."""
        return min(1.0, self._pending / self.max_queue)

    @property
    def idle(self) -> bool:
        return self._pending == 0

    async def run(self, fn: Callable[[], Result]) -> Timed:
        """fn() on the model thread, alone (no other job of this worker runs meanwhile)."""
        return await self._submit(_Entry(concurrent.futures.Future(), fn=fn))

    async def run_job(self, make_job: Callable[[], Job], key: str | None = None,
                      on_behalf_of: str | None = None) -> Timed:
        """Runs the job make_job() returns (made on the model thread), batched with others. key
        names the session: a session whose job just finished and whose next one is due back
        within its usual round trip is waited for, briefly, so that it joins the next pass.
        on_behalf_of names a session this job works for after its call has answered (drafting
        ahead): while such a job runs, its session is here, not due back, and nobody waits for it."""
        if self._model is None:
            raise RuntimeError("this worker has no model to run jobs on")
        return await self._submit(_Entry(concurrent.futures.Future(), make_job=make_job, key=key,
                                         on_behalf_of=on_behalf_of))

    async def _submit(self, entry: _Entry) -> Timed:
        if self._closed:
            raise RuntimeError("the model worker is shut down")
        if self._pending >= self.max_queue:
            raise Overloaded(f"model worker queue is full ({self.max_queue} calls waiting)")
        self._pending += 1
        with self._lock:
            finished = self._served.pop(entry.key, None) if entry.key is not None else None
            if finished is not None and entry.submitted - finished < _MAX_RETURN_GAP:
                gap = entry.submitted - finished
                self._return_gap = gap if self._return_gap is None else 0.8 * self._return_gap + 0.2 * gap
            self._waiting.append(entry)
            self._arrived.notify_all()
            self._schedule()
        future = asyncio.wrap_future(entry.future)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # A job cannot be interrupted between its passes without leaving its session's cache
            # half-updated: let it finish before the caller's session lock is released.
            await asyncio.wait([future])
            raise
        finally:
            self._pending -= 1

    def _schedule(self) -> None:
        """Queues one step on the model thread unless one is queued. Call with the lock held."""
        if not self._scheduled and (self._waiting or self._active):
            self._scheduled = True
            model_thread().submit(self._step)

    def _step(self) -> None:
        """One pass (or one plain call), then re-queues itself behind whatever else the model
        thread has to do (another service's worker in the same process)."""
        try:
            with self._lock:
                alone = self._alone = self._admit()
                closing = self._closed
                if alone is None and not closing and self._active:
                    self._wait_for_sessions_due_back()
                entries = list(self._active)
            if alone is not None:
                self._run_alone(alone)
            elif closing:
                for entry in entries:
                    self._fail(entry, RuntimeError("the model worker is shut down"))
            elif entries:
                self._run_pass(entries)
        finally:
            with self._lock:
                self._alone = None
                finished = time.perf_counter()
                for entry in self._active:
                    if entry.future.done() and entry.key is not None:
                        self._served[entry.key] = finished
                self._active = [e for e in self._active if not e.future.done()]
                self._scheduled = False
                self._schedule()

    def _wait_for_sessions_due_back(self) -> None:
        """Before a pass: if sessions served a moment ago can be back within the wait's cap (half
        the last pass's time, due_back), waits for them, so that sessions in step stay in step.
        Without it two sessions settle into taking turns: each arrives while the other's pass runs
        and gets a pass of its own. Nobody waits for a session that is not expected: alone, a
        session's pass starts when it arrives, and a session that cannot be back by the cap (one
        that left in the pass just run, whose caller has a round trip of a target's pass to make
        first) would miss the pass anyway. Call with the lock held."""
        if self._return_gap is None or not self._served:
            return
        now = time.perf_counter()
        self._served = {k: t for k, t in self._served.items() if now - t < _MAX_RETURN_GAP}
        cap = 0.5 * self._last_pass_seconds
        awaited = due_back(self._absent_served(), self._return_gap, now, cap)
        if not awaited:
            return
        deadline = min(max(awaited), now + cap)
        while now < deadline and due_back(self._absent_served(), self._return_gap, now, deadline - now):
            self._arrived.wait(deadline - now)
            self._admit()
            now = time.perf_counter()

    def _absent_served(self) -> list[float]:
        """When each recently served session finished, leaving out those that jobs working on
        their behalf show to be here. Call with the lock held."""
        here = {e.on_behalf_of for e in (*self._active, *self._waiting)}
        return [t for key, t in self._served.items() if key not in here]

    def _admit(self) -> _Entry | None:
        """Moves waiting jobs to the active set in order; returns a plain call to run alone once
        no job is active. Call with the lock held."""
        while self._waiting:
            head = self._waiting[0]
            if head.fn is not None:
                if self._active:
                    return None  # the active jobs finish first
                self._waiting.popleft()
                return head if head.future.set_running_or_notify_cancel() else None
            if len(self._active) >= self.limits.max_pass_sessions:
                return None
            self._waiting.popleft()
            if head.future.set_running_or_notify_cancel():
                self._active.append(head)
        return None

    def _run_alone(self, entry: _Entry) -> None:
        entry.first_pass = time.perf_counter()
        self._started(entry)
        try:
            value = entry.fn()
        except Exception as error:  # handed to the caller
            entry.future.set_exception(error)
            return
        entry.compute_seconds = time.perf_counter() - entry.first_pass
        entry.future.set_result(entry.timed(value))

    def _run_pass(self, entries: list[_Entry]) -> None:
        from specdec.ragged import forward

        started = time.perf_counter()
        for entry in entries:
            if entry.job is None:
                entry.first_pass = started
                self._started(entry)
                entry.job = entry.make_job()
                self._advance(entry, None)
        locking = time.perf_counter()
        with self._pass_lock or nullcontext():
            waited = time.perf_counter() - locking  # other services' passes, not this one's
            self._run_heads(entries)
            chosen = self._choose([e for e in entries if not e.future.done()])
            if not chosen:
                return
            feeds = [feed for _, feed in chosen]
            try:
                logits = forward(self._model, feeds)
            except Exception as error:
                for entry, _ in chosen:
                    self._fail(entry, error)
                return
        seconds = time.perf_counter() - started - waited
        self._last_pass_seconds = seconds
        rows = sum(len(feed.token_ids) for feed in feeds)
        counters = self.counters
        self.counters = PassCounters(rows, len(feeds), counters.passes_total + 1,
                                     counters.pass_rows_total + rows,
                                     counters.pass_sessions_total + len(feeds))
        if self.observer is not None:
            self.observer.pass_ran(rows, len(feeds), seconds)
        if all(feed.keep_all or len(feed.token_ids) == 1 for feed in feeds):  # no prompt chunk
            self.step_costs.record(rows, len(feeds), seconds)
        for (entry, feed), entry_logits in zip(chosen, logits):
            entry.compute_seconds += seconds
            entry.passes += 1
            entry.rows += rows
            entry.sessions += len(feeds)
            entry.fed += len(feed.token_ids)
            if entry.fed == len(entry.feed.token_ids):
                if feed is not entry.feed:  # a prompt's last chunk: its states are the prompt's
                    entry.feed.hidden = feed.hidden
                self._advance(entry, entry_logits)

    def _run_heads(self, entries: list[_Entry]) -> None:
        """Runs the draft-head feeds the jobs wait on, all of a round in one batch, until every
        job waits on a Feed (or finished); a head call that fails fails the jobs in it."""
        from specdec.ragged import HeadFeed, run_heads

        while True:
            asking = [e for e in entries if isinstance(e.feed, HeadFeed) and not e.future.done()]
            if not asking:
                return
            try:
                results = run_heads([e.feed for e in asking])
            except Exception as error:
                for entry in asking:
                    self._fail(entry, error)
                return
            for entry, result in zip(asking, results):
                self._advance(entry, result)

    def _started(self, entry: _Entry) -> None:
        if self.observer is not None:
            self.observer.call_started(entry.first_pass - entry.submitted)

    def _choose(self, entries: list[_Entry]) -> list[tuple[_Entry, Feed]]:
        """This pass's feeds within the budget: decode-sized feeds (and any feed whose every row's
        logits are wanted, which is never split) first, in order; then prompt chunks with the
        tokens left (_chunk: each ending on a PREFILL_BLOCK position, and at least up to the next
        one, so that a prompt always moves)."""
        budget = self.limits.max_pass_tokens
        chosen: list[tuple[_Entry, Feed]] = []
        rest = [(e, len(e.feed.token_ids) - e.fed) for e in entries]
        for entry, size in rest:
            if (entry.feed.keep_all or size <= _SHORT_FEED) and (size <= budget or not chosen):
                chosen.append((entry, _rest(entry, size)))
                budget -= size
        taken = {id(entry) for entry, _ in chosen}
        chunked = False
        for entry, size in rest:
            if budget <= 0 and (chunked or not chosen):
                break
            if entry.feed.keep_all or id(entry) in taken:
                continue
            take = _chunk(len(entry.feed.cache), size, budget)
            chosen.append((entry, _rest(entry, take)))
            budget -= take
            chunked = True
        return chosen

    def _advance(self, entry: _Entry, logits: torch.Tensor | None) -> None:
        """Sends the job its logits (None to start it): it yields its next Feed or finishes."""
        try:
            feed = entry.job.send(logits)
        except StopIteration as stop:
            entry.feed = None
            entry.future.set_result(entry.timed(stop.value))
            return
        except Exception as error:  # the job's own failure (a bad input, say): its caller's
            entry.feed = None
            entry.future.set_exception(error)
            return
        from specdec.ragged import HeadFeed

        if not isinstance(feed, HeadFeed) and not feed.token_ids:
            self._fail(entry, ValueError("a job fed no tokens"))
            return
        entry.feed, entry.fed = feed, 0

    @staticmethod
    def _fail(entry: _Entry, error: BaseException) -> None:
        if entry.job is not None:
            entry.job.close()
        if not entry.future.done():
            entry.future.set_exception(error)

    def shutdown(self) -> None:
        """Cancels this worker's queued calls, fails its started jobs at the next pass and waits
        for the running pass; the model thread itself goes on (other services may use it)."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
            started = [e.future for e in self._active]
            if self._alone is not None:
                started.append(self._alone.future)
        for entry in waiting:
            entry.future.cancel()
            entry.future.set_running_or_notify_cancel()  # marks it cancelled for its waiters
        concurrent.futures.wait(started)


def due_back(finished: list[float], return_gap: float, now: float, cap: float) -> list[float]:
    """Of sessions whose last jobs finished at `finished`, and whose callers come back after
    `return_gap` on average, those worth waiting up to `cap` seconds for from `now`: the ones
    that can be back by then (round trips vary: half the mean gap counts) and are not overdue
    (later than 1.5 times the gap). Returns the time each is overdue at."""
    return [t + 1.5 * return_gap for t in finished
            if t + 0.5 * return_gap <= now + cap and t + 1.5 * return_gap > now]


def _chunk(position: int, size: int, tokens: int) -> int:
    """How many of a prompt's `size` tokens still to feed, from `position` on, one pass takes with
    `tokens` left in its budget: all of them if they fit, else up to the last PREFILL_BLOCK
    position the tokens reach, at least up to the next one (a chunk of up to PREFILL_BLOCK tokens
    even when the decode rows took the whole budget), so that a prompt is cut at the same
    positions whatever the load (a batch-invariant model's attention runs in those blocks)."""
    from specdec.ragged import PREFILL_BLOCK

    if size <= tokens:
        return size
    end = position + tokens
    end -= end % PREFILL_BLOCK
    if end <= position:
        end = position + PREFILL_BLOCK - position % PREFILL_BLOCK
    return min(size, end - position)


def _rest(entry: _Entry, take: int) -> Feed:
    """The next `take` tokens of the entry's feed (the feed itself when that is all of it)."""
    from specdec.ragged import Feed

    feed = entry.feed
    if entry.fed == 0 and take == len(feed.token_ids):
        return feed
    return Feed(feed.cache, feed.token_ids[entry.fed:entry.fed + take], keep_all=feed.keep_all,
                one_by_one=feed.one_by_one, keep_hidden=feed.keep_hidden)
