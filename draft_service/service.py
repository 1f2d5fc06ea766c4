"""The draft service's operations on sessions (no protobuf): Prefill and Propose."""

from __future__ import annotations

from dataclasses import dataclass

from draft_service.engine import DraftEngine, DraftSessionState
from specdec.errors import InvalidInput, OutOfRange
from specdec.models import LoadedModel
from specdec.protocol import MAX_DRAFT_TOP_M, Handle, Proposal, SamplingParams, Timing, check_token_ids
from specdec.ragged import Job
from specdec.serving import ServiceConfig, SessionService


@dataclass(frozen=True)
class DraftConfig:
    top_m: int = MAX_DRAFT_TOP_M  # entries of q~ sent per draft token when sampling

    def __post_init__(self) -> None:
        if not 1 <= self.top_m <= MAX_DRAFT_TOP_M:
            raise ValueError(f"top_m must be in [1, {MAX_DRAFT_TOP_M}]")


class DraftService(SessionService[DraftSessionState]):
    role = "draft"

    def __init__(self, loaded: LoadedModel, config: ServiceConfig, draft: DraftConfig = DraftConfig()):
        super().__init__(loaded, config, size_of=lambda state: len(state.cache))
        self.engine = DraftEngine(loaded, draft.top_m)

    async def prefill(
        self, session_id: str, token_ids: list[int], sampling: SamplingParams
    ) -> tuple[Handle, None, Timing]:
        self.check_prompt(token_ids)

        def build() -> Job[tuple[DraftSessionState, int, None]]:
            state = yield from self.engine.prefill(token_ids, sampling)
            return state, len(token_ids), None

        return await self.new_session(session_id, token_ids, build)

    async def propose(
        self, handle: Handle, new_committed: list[int], num_speculative_tokens: int
    ) -> tuple[Handle, Proposal, Timing]:
        new_length = check_propose(self, handle, new_committed, num_speculative_tokens)

        def apply(state: DraftSessionState) -> Job[tuple[int, Proposal]]:
            proposal = yield from self.engine.propose(state, new_committed, num_speculative_tokens)
            return new_length, proposal

        return await self.call(handle, apply)


def check_propose(service: SessionService, handle: Handle, new_committed: list[int],
                  num_speculative_tokens: int) -> int:
    """Checks a Propose against the service's limits; returns the committed length it leads to."""
    limit = service.config.max_num_speculative_tokens
    if not 1 <= num_speculative_tokens <= limit:
        raise OutOfRange(f"num_speculative_tokens must be in [1, {limit}], got {num_speculative_tokens}")
    check_token_ids(new_committed, service.loaded.vocab_size, "new_committed_token_ids")
    new_length = handle.committed_length + len(new_committed)
    if new_length + num_speculative_tokens > service.loaded.max_context:
        raise OutOfRange(f"drafting {num_speculative_tokens} tokens at length {new_length} exceeds "
                         f"the max context {service.loaded.max_context}")
    if new_length < 1:
        raise InvalidInput("the committed sequence is empty")
    return new_length
