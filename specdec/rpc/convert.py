"""Protobuf <-> plain Python at the service boundary. Model and math code never see *_pb2."""

from __future__ import annotations

import math
import secrets

import torch

from specdec.errors import InvalidInput
from specdec.sampling import MIN_TEMPERATURE, SamplingParams
from specdec.serving import Handle, ServiceInfo
from specdec.v1 import common_pb2


def sampling_from_proto(message: common_pb2.SamplingParams, *, draw_seed: bool = False) -> SamplingParams:
    """Validated SamplingParams; an unset seed is drawn at random when draw_seed, else 0."""
    temperature = float(message.temperature)
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidInput(f"temperature must be finite and >= 0, got {temperature}")
    if 0 < temperature < MIN_TEMPERATURE:
        raise InvalidInput(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {temperature}")
    top_p = float(message.top_p) if message.HasField("top_p") else 1.0
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise InvalidInput(f"top_p must be in (0, 1], got {top_p}")
    if message.top_k < 0:
        raise InvalidInput(f"top_k must be >= 0, got {message.top_k}")
    if message.HasField("seed"):
        seed = int(message.seed)
    else:
        seed = secrets.randbits(63) if draw_seed else 0
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=int(message.top_k), seed=seed)


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=params.seed
    )


def handle_from_proto(message: common_pb2.SessionHandle) -> Handle:
    if not message.session_id:
        raise InvalidInput("handle.session_id must not be empty")
    return Handle(
        session_id=message.session_id,
        replica_id=message.replica_id,
        committed_length=int(message.committed_length),
        epoch=int(message.epoch),
    )


def handle_to_proto(handle: Handle) -> common_pb2.SessionHandle:
    return common_pb2.SessionHandle(
        session_id=handle.session_id,
        replica_id=handle.replica_id,
        committed_length=handle.committed_length,
        epoch=handle.epoch,
    )


def distribution_from_proto(message: common_pb2.SparseDistribution) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ids (M,) int64, probs (M,) float32), exactly as sent."""
    ids = torch.tensor(list(message.token_ids), dtype=torch.long)
    probs = torch.tensor(list(message.probs), dtype=torch.float32)
    return ids, probs


def distribution_to_proto(ids: torch.Tensor, probs: torch.Tensor) -> common_pb2.SparseDistribution:
    return common_pb2.SparseDistribution(token_ids=ids.tolist(), probs=probs.tolist())


def info_to_proto(info: ServiceInfo) -> common_pb2.InfoResponse:
    return common_pb2.InfoResponse(
        protocol_version=info.protocol_version,
        role=info.role,
        model_id=info.model_id,
        vocab_size=info.vocab_size,
        tokenizer_hash=info.tokenizer_hash,
        max_context=info.max_context,
        max_num_speculative_tokens=info.max_num_speculative_tokens,
        dtype=info.dtype,
        device=info.device,
        live_sessions=info.live_sessions,
        cached_tokens=info.cached_tokens,
        load=info.load,
        replica_id=info.replica_id,
        eos_token_ids=list(info.eos_token_ids),
        max_sessions=info.max_sessions,
        max_cached_tokens=info.max_cached_tokens,
    )
