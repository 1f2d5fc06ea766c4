from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeculationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_MODE_UNSPECIFIED: _ClassVar[SpeculationMode]
    SPECULATION_MODE_OFF: _ClassVar[SpeculationMode]
    SPECULATION_MODE_FIXED: _ClassVar[SpeculationMode]
    SPECULATION_MODE_ADAPTIVE: _ClassVar[SpeculationMode]
    SPECULATION_MODE_HEURISTIC: _ClassVar[SpeculationMode]

class PipelineMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PIPELINE_MODE_UNSPECIFIED: _ClassVar[PipelineMode]
    PIPELINE_MODE_OFF: _ClassVar[PipelineMode]
    PIPELINE_MODE_ON: _ClassVar[PipelineMode]
    PIPELINE_MODE_AUTO: _ClassVar[PipelineMode]
    PIPELINE_MODE_STREAM: _ClassVar[PipelineMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT: _ClassVar[FinishReason]
SPECULATION_MODE_UNSPECIFIED: SpeculationMode
SPECULATION_MODE_OFF: SpeculationMode
SPECULATION_MODE_FIXED: SpeculationMode
SPECULATION_MODE_ADAPTIVE: SpeculationMode
SPECULATION_MODE_HEURISTIC: SpeculationMode
PIPELINE_MODE_UNSPECIFIED: PipelineMode
PIPELINE_MODE_OFF: PipelineMode
PIPELINE_MODE_ON: PipelineMode
PIPELINE_MODE_AUTO: PipelineMode
PIPELINE_MODE_STREAM: PipelineMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CONTEXT: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class SpeculationConfig(_message.Message):
    __slots__ = ("mode", "num_speculative_tokens", "pipeline", "pipeline_fanout")
    MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FANOUT_FIELD_NUMBER: _ClassVar[int]
    mode: SpeculationMode
    num_speculative_tokens: int
    pipeline: PipelineMode
    pipeline_fanout: int
    def __init__(self, mode: _Optional[_Union[SpeculationMode, str]] = ..., num_speculative_tokens: _Optional[int] = ..., pipeline: _Optional[_Union[PipelineMode, str]] = ..., pipeline_fanout: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "messages", "max_new_tokens", "sampling", "stop", "speculation")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    max_new_tokens: int
    sampling: _common_pb2.SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    speculation: SpeculationConfig
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., speculation: _Optional[_Union[SpeculationConfig, _Mapping]] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "rounds", "drafted_tokens", "accepted_tokens", "mean_accepted_length", "acceptance_rate", "num_speculative_tokens_per_round", "tokens_per_second", "wall_seconds", "time_to_first_token_seconds", "draft_seconds", "verify_seconds", "network_seconds", "re_prefills", "draft_unavailable_rounds", "target_replica", "draft_replica", "controller_estimates", "num_accepted_per_round", "drafted_tokens_by_method", "accepted_tokens_by_method", "pipelined_rounds", "pipeline_hits", "pipeline_misses", "branches_drafted", "fanout_per_round", "decode_calls", "decoded_tokens", "shadow_probes", "offers", "offered_passes", "offered_drafts", "offered_accepted", "offered_branch_passes", "decode_lookup_passes", "decode_lookup_drafts", "decode_lookup_accepted", "decode_head_passes", "decode_head_drafts", "decode_head_accepted", "offers_dropped")
    class ControllerEstimatesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class DraftedTokensByMethodEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class AcceptedTokensByMethodEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RE_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_UNAVAILABLE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_REPLICA_FIELD_NUMBER: _ClassVar[int]
    DRAFT_REPLICA_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_ESTIMATES_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_BY_METHOD_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_BY_METHOD_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_HITS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_MISSES_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    FANOUT_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    DECODE_CALLS_FIELD_NUMBER: _ClassVar[int]
    DECODED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHADOW_PROBES_FIELD_NUMBER: _ClassVar[int]
    OFFERS_FIELD_NUMBER: _ClassVar[int]
    OFFERED_PASSES_FIELD_NUMBER: _ClassVar[int]
    OFFERED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    OFFERED_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    OFFERED_BRANCH_PASSES_FIELD_NUMBER: _ClassVar[int]
    DECODE_LOOKUP_PASSES_FIELD_NUMBER: _ClassVar[int]
    DECODE_LOOKUP_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_LOOKUP_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DECODE_HEAD_PASSES_FIELD_NUMBER: _ClassVar[int]
    DECODE_HEAD_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_HEAD_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    OFFERS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    mean_accepted_length: float
    acceptance_rate: float
    num_speculative_tokens_per_round: _containers.RepeatedScalarFieldContainer[int]
    tokens_per_second: float
    wall_seconds: float
    time_to_first_token_seconds: float
    draft_seconds: float
    verify_seconds: float
    network_seconds: float
    re_prefills: int
    draft_unavailable_rounds: int
    target_replica: str
    draft_replica: str
    controller_estimates: _containers.ScalarMap[str, float]
    num_accepted_per_round: _containers.RepeatedScalarFieldContainer[int]
    drafted_tokens_by_method: _containers.ScalarMap[str, int]
    accepted_tokens_by_method: _containers.ScalarMap[str, int]
    pipelined_rounds: int
    pipeline_hits: int
    pipeline_misses: int
    branches_drafted: int
    fanout_per_round: _containers.RepeatedScalarFieldContainer[int]
    decode_calls: int
    decoded_tokens: int
    shadow_probes: int
    offers: int
    offered_passes: int
    offered_drafts: int
    offered_accepted: int
    offered_branch_passes: int
    decode_lookup_passes: int
    decode_lookup_drafts: int
    decode_lookup_accepted: int
    decode_head_passes: int
    decode_head_drafts: int
    decode_head_accepted: int
    offers_dropped: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., mean_accepted_length: _Optional[float] = ..., acceptance_rate: _Optional[float] = ..., num_speculative_tokens_per_round: _Optional[_Iterable[int]] = ..., tokens_per_second: _Optional[float] = ..., wall_seconds: _Optional[float] = ..., time_to_first_token_seconds: _Optional[float] = ..., draft_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ..., network_seconds: _Optional[float] = ..., re_prefills: _Optional[int] = ..., draft_unavailable_rounds: _Optional[int] = ..., target_replica: _Optional[str] = ..., draft_replica: _Optional[str] = ..., controller_estimates: _Optional[_Mapping[str, float]] = ..., num_accepted_per_round: _Optional[_Iterable[int]] = ..., drafted_tokens_by_method: _Optional[_Mapping[str, int]] = ..., accepted_tokens_by_method: _Optional[_Mapping[str, int]] = ..., pipelined_rounds: _Optional[int] = ..., pipeline_hits: _Optional[int] = ..., pipeline_misses: _Optional[int] = ..., branches_drafted: _Optional[int] = ..., fanout_per_round: _Optional[_Iterable[int]] = ..., decode_calls: _Optional[int] = ..., decoded_tokens: _Optional[int] = ..., shadow_probes: _Optional[int] = ..., offers: _Optional[int] = ..., offered_passes: _Optional[int] = ..., offered_drafts: _Optional[int] = ..., offered_accepted: _Optional[int] = ..., offered_branch_passes: _Optional[int] = ..., decode_lookup_passes: _Optional[int] = ..., decode_lookup_drafts: _Optional[int] = ..., decode_lookup_accepted: _Optional[int] = ..., decode_head_passes: _Optional[int] = ..., decode_head_drafts: _Optional[int] = ..., decode_head_accepted: _Optional[int] = ..., offers_dropped: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "stats", "finish_reason")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    stats: GenerationStats
    finish_reason: FinishReason
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class PoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("address", "replica_id", "healthy", "accepting", "active_sessions", "load", "model_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    ACCEPTING_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    replica_id: str
    healthy: bool
    accepting: bool
    active_sessions: int
    load: float
    model_id: str
    def __init__(self, address: _Optional[str] = ..., replica_id: _Optional[str] = ..., healthy: _Optional[bool] = ..., accepting: _Optional[bool] = ..., active_sessions: _Optional[int] = ..., load: _Optional[float] = ..., model_id: _Optional[str] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("role", "source", "replicas")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    role: str
    source: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    def __init__(self, role: _Optional[str] = ..., source: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ...) -> None: ...

class PoolsResponse(_message.Message):
    __slots__ = ("pools", "draft_shares_compute", "shared_compute_without_turns")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SHARES_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    SHARED_COMPUTE_WITHOUT_TURNS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    draft_shares_compute: bool
    shared_compute_without_turns: bool
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ..., draft_shares_compute: _Optional[bool] = ..., shared_compute_without_turns: _Optional[bool] = ...) -> None: ...
