from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TargetPrefillRequest(_message.Message):
    __slots__ = ("session_id", "token_ids", "sampling", "resume", "prompt_length")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    resume: bool
    prompt_length: int
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., resume: _Optional[bool] = ..., prompt_length: _Optional[int] = ...) -> None: ...

class TargetPrefillResponse(_message.Message):
    __slots__ = ("handle", "next_token_id", "compute_seconds", "queue_seconds", "pass_rows", "pass_sessions")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PASS_ROWS_FIELD_NUMBER: _ClassVar[int]
    PASS_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    handle: _common_pb2.SessionHandle
    next_token_id: int
    compute_seconds: float
    queue_seconds: float
    pass_rows: float
    pass_sessions: float
    def __init__(self, handle: _Optional[_Union[_common_pb2.SessionHandle, _Mapping]] = ..., next_token_id: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., pass_rows: _Optional[float] = ..., pass_sessions: _Optional[float] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("handle", "draft_token_ids", "draft_distributions")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    handle: _common_pb2.SessionHandle
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    def __init__(self, handle: _Optional[_Union[_common_pb2.SessionHandle, _Mapping]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_distributions: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("handle", "num_accepted", "next_token_id", "acceptance_signal", "compute_seconds", "queue_seconds", "pass_rows", "pass_sessions")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_SIGNAL_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PASS_ROWS_FIELD_NUMBER: _ClassVar[int]
    PASS_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    handle: _common_pb2.SessionHandle
    num_accepted: int
    next_token_id: int
    acceptance_signal: _containers.RepeatedScalarFieldContainer[float]
    compute_seconds: float
    queue_seconds: float
    pass_rows: float
    pass_sessions: float
    def __init__(self, handle: _Optional[_Union[_common_pb2.SessionHandle, _Mapping]] = ..., num_accepted: _Optional[int] = ..., next_token_id: _Optional[int] = ..., acceptance_signal: _Optional[_Iterable[float]] = ..., compute_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., pass_rows: _Optional[float] = ..., pass_sessions: _Optional[float] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("handle", "max_tokens", "lookup_max_tokens", "lookup_min_chance", "head_max_tokens")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MIN_CHANCE_FIELD_NUMBER: _ClassVar[int]
    HEAD_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    handle: _common_pb2.SessionHandle
    max_tokens: int
    lookup_max_tokens: int
    lookup_min_chance: float
    head_max_tokens: int
    def __init__(self, handle: _Optional[_Union[_common_pb2.SessionHandle, _Mapping]] = ..., max_tokens: _Optional[int] = ..., lookup_max_tokens: _Optional[int] = ..., lookup_min_chance: _Optional[float] = ..., head_max_tokens: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("handle", "token_ids", "compute_seconds", "queue_seconds", "pass_rows", "pass_sessions", "last", "token_probabilities", "offered_passes", "offered_drafts", "offered_accepted", "offered_branch_passes", "lookup_passes", "lookup_drafts", "lookup_accepted", "head_passes", "head_drafts", "head_accepted")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PASS_ROWS_FIELD_NUMBER: _ClassVar[int]
    PASS_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TOKEN_PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    OFFERED_PASSES_FIELD_NUMBER: _ClassVar[int]
    OFFERED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    OFFERED_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    OFFERED_BRANCH_PASSES_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_PASSES_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    HEAD_PASSES_FIELD_NUMBER: _ClassVar[int]
    HEAD_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    HEAD_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    handle: _common_pb2.SessionHandle
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    compute_seconds: float
    queue_seconds: float
    pass_rows: float
    pass_sessions: float
    last: bool
    token_probabilities: _containers.RepeatedScalarFieldContainer[float]
    offered_passes: int
    offered_drafts: int
    offered_accepted: int
    offered_branch_passes: int
    lookup_passes: int
    lookup_drafts: int
    lookup_accepted: int
    head_passes: int
    head_drafts: int
    head_accepted: int
    def __init__(self, handle: _Optional[_Union[_common_pb2.SessionHandle, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., compute_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., pass_rows: _Optional[float] = ..., pass_sessions: _Optional[float] = ..., last: _Optional[bool] = ..., token_probabilities: _Optional[_Iterable[float]] = ..., offered_passes: _Optional[int] = ..., offered_drafts: _Optional[int] = ..., offered_accepted: _Optional[int] = ..., offered_branch_passes: _Optional[int] = ..., lookup_passes: _Optional[int] = ..., lookup_drafts: _Optional[int] = ..., lookup_accepted: _Optional[int] = ..., head_passes: _Optional[int] = ..., head_drafts: _Optional[int] = ..., head_accepted: _Optional[int] = ...) -> None: ...

class OfferRequest(_message.Message):
    __slots__ = ("session_id", "start", "draft_token_ids", "draft_distributions", "max_verified", "branches")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    max_verified: int
    branches: _containers.RepeatedCompositeFieldContainer[OfferedBranch]
    def __init__(self, session_id: _Optional[str] = ..., start: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_distributions: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., max_verified: _Optional[int] = ..., branches: _Optional[_Iterable[_Union[OfferedBranch, _Mapping]]] = ...) -> None: ...

class OfferedBranch(_message.Message):
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

class OfferResponse(_message.Message):
    __slots__ = ("held", "committed_length")
    HELD_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    held: bool
    committed_length: int
    def __init__(self, held: _Optional[bool] = ..., committed_length: _Optional[int] = ...) -> None: ...

class EndDecodeRequest(_message.Message):
    __slots__ = ("session_id", "start")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start: int
    def __init__(self, session_id: _Optional[str] = ..., start: _Optional[int] = ...) -> None: ...

class EndDecodeResponse(_message.Message):
    __slots__ = ("ending",)
    ENDING_FIELD_NUMBER: _ClassVar[int]
    ending: bool
    def __init__(self, ending: _Optional[bool] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerFile(_message.Message):
    __slots__ = ("name", "content")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    content: bytes
    def __init__(self, name: _Optional[str] = ..., content: _Optional[bytes] = ...) -> None: ...

class GetTokenizerResponse(_message.Message):
    __slots__ = ("files", "tokenizer_hash")
    FILES_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[TokenizerFile]
    tokenizer_hash: str
    def __init__(self, files: _Optional[_Iterable[_Union[TokenizerFile, _Mapping]]] = ..., tokenizer_hash: _Optional[str] = ...) -> None: ...
