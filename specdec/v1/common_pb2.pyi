from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class SessionHandle(_message.Message):
    __slots__ = ("session_id", "replica_id", "committed_length", "epoch")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    replica_id: str
    committed_length: int
    epoch: int
    def __init__(self, session_id: _Optional[str] = ..., replica_id: _Optional[str] = ..., committed_length: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("protocol_version", "role", "model_id", "vocab_size", "tokenizer_hash", "max_context", "max_num_speculative_tokens", "dtype", "device", "live_sessions", "cached_tokens", "load", "replica_id", "eos_token_ids", "max_sessions", "max_cached_tokens", "pass_rows", "pass_sessions", "passes_total", "pass_rows_total", "pass_sessions_total", "linear_packing", "host_id", "compute_units", "pass_lock")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PASS_ROWS_FIELD_NUMBER: _ClassVar[int]
    PASS_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PASSES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PASS_ROWS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PASS_SESSIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LINEAR_PACKING_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_UNITS_FIELD_NUMBER: _ClassVar[int]
    PASS_LOCK_FIELD_NUMBER: _ClassVar[int]
    protocol_version: str
    role: str
    model_id: str
    vocab_size: int
    tokenizer_hash: str
    max_context: int
    max_num_speculative_tokens: int
    dtype: str
    device: str
    live_sessions: int
    cached_tokens: int
    load: float
    replica_id: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_sessions: int
    max_cached_tokens: int
    pass_rows: int
    pass_sessions: int
    passes_total: int
    pass_rows_total: int
    pass_sessions_total: int
    linear_packing: str
    host_id: str
    compute_units: _containers.RepeatedScalarFieldContainer[str]
    pass_lock: str
    def __init__(self, protocol_version: _Optional[str] = ..., role: _Optional[str] = ..., model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_hash: _Optional[str] = ..., max_context: _Optional[int] = ..., max_num_speculative_tokens: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., live_sessions: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., load: _Optional[float] = ..., replica_id: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_sessions: _Optional[int] = ..., max_cached_tokens: _Optional[int] = ..., pass_rows: _Optional[int] = ..., pass_sessions: _Optional[int] = ..., passes_total: _Optional[int] = ..., pass_rows_total: _Optional[int] = ..., pass_sessions_total: _Optional[int] = ..., linear_packing: _Optional[str] = ..., host_id: _Optional[str] = ..., compute_units: _Optional[_Iterable[str]] = ..., pass_lock: _Optional[str] = ...) -> None: ...
