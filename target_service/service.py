"""The target service's operations on sessions (no protobuf): Prefill, Verify and Decode."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.errors import InvalidInput, OutOfRange
from specdec.models import LoadedModel, tokenizer_files
from specdec.ragged import Job
from specdec.protocol import (
    MAX_OFFER_BRANCHES,
    MAX_OFFER_TOKENS,
    DecodedToken,
    DecodeLookup,
    DraftOffer,
    Handle,
    DraftTally,
    Proposal,
    SamplingParams,
    Timing,
    VerifyOutcome,
    check_token_ids,
)
from specdec.serving import ServiceConfig, SessionService
from target_service.engine import TargetEngine, TargetSessionState


@dataclass
class RunningDecode:
    """A session's running Decode call: the committed length it started from, what ends it
    after its current pass (end_decode) and the latest DraftOffer for its passes."""

    start: int
    ending: threading.Event = field(default_factory=threading.Event)
    offer: DraftOffer | None = None


class TargetService(SessionService[TargetSessionState]):
    role = "target"

    def __init__(self, loaded: LoadedModel, config: ServiceConfig) -> None:
        super().__init__(loaded, config, size_of=lambda state: len(state.cache))
        self.engine = TargetEngine(loaded, config.max_num_speculative_tokens, self._row_price, loaded.head)
        self._tokenizer_files = tokenizer_files(loaded.tokenizer)
        # Sessions in a Decode call: the call's own record (a later call of the session replaces
        # it, and each call removes only its own).
        self._decoding: dict[str, RunningDecode] = {}

    async def prefill(
        self, session_id: str, token_ids: list[int], sampling: SamplingParams, resume: bool,
        prompt_length: int = 0,
    ) -> tuple[Handle, int | None, Timing]:
        self.check_prompt(token_ids)

        def build() -> Job[tuple[TargetSessionState, int, int | None]]:
            state, first = yield from self.engine.prefill(token_ids, sampling, resume, prompt_length)
            return state, state.committed_length, first

        return await self.new_session(session_id, token_ids, build)

    async def verify(self, handle: Handle, proposal: Proposal) -> tuple[Handle, VerifyOutcome, Timing]:
        session = self.store.lookup(handle.session_id, handle.epoch)
        self.engine.validate_proposal(proposal, session.state.sampling)

        def apply(state: TargetSessionState) -> Job[tuple[int, VerifyOutcome]]:
            outcome = yield from self.engine.verify(state, proposal)
            return state.committed_length, outcome

        return await self.call(handle, apply)

    async def decode(self, handle: Handle, max_tokens: int, emit: Callable[[DecodedToken], None],
                     stopped: Callable[[], bool], tally: DraftTally | None = None,
                     lookup: DecodeLookup | None = None, looked_up: DraftTally | None = None,
                     headed: DraftTally | None = None) -> tuple[Handle, list[DecodedToken], Timing]:
        """TargetEngine.decode as one call; emit(token) runs on the model thread after each step.
        Its passes verify the drafts offered meanwhile (offer), counted in tally as they go, and
        where none are offered, with lookup, tokens looked up in the session's own (looked_up), or
        else its draft head's drafts (headed). A
        repeat of the last applied handle gets its tokens in the result, with no emit."""
        session_id = handle.session_id
        running = RunningDecode(handle.committed_length)

        def apply(state: TargetSessionState) -> Job[tuple[int, list[DecodedToken]]]:
            tokens = yield from self.engine.decode(state, max_tokens, emit,
                                                   lambda: stopped() or running.ending.is_set(),
                                                   lambda: running.offer, tally, lookup, looked_up, headed)
            return state.committed_length, tokens

        self._decoding[session_id] = running
        try:
            return await self.call(handle, apply)
        finally:
            if self._decoding.get(session_id) is running:
                del self._decoding[session_id]

    def end_decode(self, session_id: str, start: int) -> bool:
        """Ends the session's running Decode after its current pass if it started from C of
        length `start` (-> True); otherwise nothing (-> False)."""
        running = self._decoding.get(session_id)
        if running is None or running.start != start:
            return False
        running.ending.set()
        return True

    def _row_price(self) -> float:
        """The chance a looked-up token needs to pay for its row in the next pass, as this
        replica's step passes price a row (0 until they have)."""
        price = self.worker.step_costs.price()
        return price.chance if price is not None else 0.0

    def offer(self, session_id: str, offer: DraftOffer) -> tuple[bool, int]:
        """Holds offer for the session's running Decode (-> True and its committed length when it
        arrived), unless the offer it holds was drafted from a longer C; outside a Decode it is
        dropped (-> False, 0)."""
        session, running = self.store.get(session_id), self._decoding.get(session_id)
        if session is None or running is None:
            return False, 0
        self.engine.validate_proposal(offer.proposal, session.state.sampling, limit=MAX_OFFER_TOKENS)
        self._validate_branches(offer, session.state.sampling)
        limit = self.engine.max_num_speculative_tokens
        if offer.max_verified:
            limit = min(limit, offer.max_verified)
        held = running.offer
        if held is None or offer.start >= held.start:  # one drafted from an older C came late
            running.offer = DraftOffer(offer.start, offer.proposal, limit, offer.branches)
        return True, session.state.committed_length

    def _validate_branches(self, offer: DraftOffer, sampling: SamplingParams) -> None:
        if len(offer.branches) > MAX_OFFER_BRANCHES:
            raise OutOfRange(f"{len(offer.branches)} branches exceed the most an offer holds, {MAX_OFFER_BRANCHES}")
        for branch in offer.branches:
            if branch.num_accepted >= offer.proposal.num_speculative_tokens:
                raise InvalidInput(f"a branch after {branch.num_accepted} of the offer's "
                                   f"{offer.proposal.num_speculative_tokens} drafts leaves none of them")
            check_token_ids([branch.next_token_id], self.loaded.vocab_size, "next_token_id")
            self.engine.validate_proposal(branch.proposal, sampling, limit=MAX_OFFER_TOKENS)

    def tokenizer_files(self) -> list[tuple[str, bytes]]:
        return self._tokenizer_files
