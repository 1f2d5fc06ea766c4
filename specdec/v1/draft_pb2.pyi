from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftPrefillRequest(_message.Message):
    __slots__ = ("session_id", "token_ids", "sampling", "cache_partition")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_PARTITION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_partition: str
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_partition: _Optional[str] = ...) -> None: ...

class DraftPrefillResponse(_message.Message):
    __slots__ = ("handle", "compute_seconds", "queue_seconds", "pass_rows", "pass_sessions")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PASS_ROWS_FIELD_NUMBER: _ClassVar[int]
    PASS_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    handle: _common_pb2.SessionHandle
    compute_seconds: float
    queue_seconds: float
    pass_rows: float
    pass_sessions: float
    def __init__(self, handle: _Optional[_Union[_common_pb2.SessionHandle, _Mapping]] = ..., compute_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., pass_rows: _Optional[float] = ..., pass_sessions: _Optional[float] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("handle", "new_committed_token_ids", "num_speculative_tokens")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    NEW_COMMITTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    handle: _common_pb2.SessionHandle
    new_committed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_speculative_tokens: int
    def __init__(self, handle: _Optional[_Union[_common_pb2.SessionHandle, _Mapping]] = ..., new_committed_token_ids: _Optional[_Iterable[int]] = ..., num_speculative_tokens: _Optional[int] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("handle", "draft_token_ids", "draft_distributions", "compute_seconds", "queue_seconds", "fed_tokens", "pass_rows", "pass_sessions", "match_lengths")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PASS_ROWS_FIELD_NUMBER: _ClassVar[int]
    PASS_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MATCH_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    handle: _common_pb2.SessionHandle
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    compute_seconds: float
    queue_seconds: float
    fed_tokens: int
    pass_rows: float
    pass_sessions: float
    match_lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handle: _Optional[_Union[_common_pb2.SessionHandle, _Mapping]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_distributions: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., compute_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., fed_tokens: _Optional[int] = ..., pass_rows: _Optional[float] = ..., pass_sessions: _Optional[float] = ..., match_lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class SpeculateRequest(_message.Message):
    __slots__ = ("propose", "fanout", "branch_num_speculative_tokens", "branch_outcomes")
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    FANOUT_FIELD_NUMBER: _ClassVar[int]
    BRANCH_NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    propose: ProposeRequest
    fanout: int
    branch_num_speculative_tokens: int
    branch_outcomes: int
    def __init__(self, propose: _Optional[_Union[ProposeRequest, _Mapping]] = ..., fanout: _Optional[int] = ..., branch_num_speculative_tokens: _Optional[int] = ..., branch_outcomes: _Optional[int] = ...) -> None: ...

class Branch(_message.Message):
    __slots__ = ("num_accepted", "next_token_id", "draft_token_ids", "draft_distributions")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    next_token_id: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    def __init__(self, num_accepted: _Optional[int] = ..., next_token_id: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_distributions: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ...) -> None: ...

class Candidates(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Branches(_message.Message):
    __slots__ = ("branches", "candidates", "compute_seconds", "queue_seconds", "pass_rows", "pass_sessions")
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PASS_ROWS_FIELD_NUMBER: _ClassVar[int]
    PASS_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    branches: _containers.RepeatedCompositeFieldContainer[Branch]
    candidates: _containers.RepeatedCompositeFieldContainer[Candidates]
    compute_seconds: float
    queue_seconds: float
    pass_rows: float
    pass_sessions: float
    def __init__(self, branches: _Optional[_Iterable[_Union[Branch, _Mapping]]] = ..., candidates: _Optional[_Iterable[_Union[Candidates, _Mapping]]] = ..., compute_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., pass_rows: _Optional[float] = ..., pass_sessions: _Optional[float] = ...) -> None: ...

class SpeculateResponse(_message.Message):
    __slots__ = ("proposal", "branches")
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    proposal: ProposeResponse
    branches: Branches
    def __init__(self, proposal: _Optional[_Union[ProposeResponse, _Mapping]] = ..., branches: _Optional[_Union[Branches, _Mapping]] = ...) -> None: ...
