"""Protobuf <-> the plain types of specdec.protocol, at the service and client boundaries. Model,
math and loop code never see *_pb2. Imports no torch: the orchestrator uses it too."""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from specdec.errors import InvalidInput
from specdec.protocol import Handle, Proposal, ReplicaInfo, SamplingParams, SparseDistribution, Timing
from specdec.v1 import common_pb2


def sampling_from_proto(message: common_pb2.SamplingParams, *, draw_seed: bool = False) -> SamplingParams:
    """Validated SamplingParams (InvalidInput otherwise); an unset top_p is 1, an unset seed is
    drawn at random when draw_seed, else 0."""
    if message.HasField("seed"):
        seed = int(message.seed)
    else:
        seed = secrets.randbits(63) if draw_seed else 0
    return SamplingParams(
        temperature=float(message.temperature),
        top_p=float(message.top_p) if message.HasField("top_p") else 1.0,
        top_k=int(message.top_k),
        seed=seed,
    )


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


def distribution_from_proto(message: common_pb2.SparseDistribution) -> SparseDistribution:
    """Exactly as sent (float32 values, which a Python float holds exactly)."""
    return SparseDistribution(token_ids=tuple(message.token_ids), probs=tuple(message.probs))


def proposal_from_proto(message: Any, fed_tokens: int = 0) -> Proposal:
    """The drafts of any message with draft_token_ids and draft_distributions (ProposeResponse,
    Branch, VerifyRequest, OfferRequest, OfferedBranch)."""
    return Proposal(
        token_ids=tuple(message.draft_token_ids),
        distributions=tuple(distribution_from_proto(d) for d in message.draft_distributions),
        fed_tokens=fed_tokens,
    )


def distribution_to_proto(distribution: SparseDistribution) -> common_pb2.SparseDistribution:
    return common_pb2.SparseDistribution(
        token_ids=list(distribution.token_ids), probs=list(distribution.probs)
    )


def info_to_proto(info: ReplicaInfo) -> common_pb2.InfoResponse:
    # ReplicaInfo's fields are InfoResponse's, name for name.
    values = {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}
    return common_pb2.InfoResponse(**{**values, "eos_token_ids": list(info.eos_token_ids),
                                      "compute_units": list(info.compute_units)})


def info_from_proto(message: common_pb2.InfoResponse) -> ReplicaInfo:
    values = {f.name: getattr(message, f.name) for f in dataclasses.fields(ReplicaInfo)}
    return ReplicaInfo(**{**values, "eos_token_ids": tuple(message.eos_token_ids),
                          "compute_units": tuple(message.compute_units)})


def timing_fields(timing: Timing) -> dict[str, float]:
    """A service's Timing as the fields every Prefill / Propose / Verify response carries."""
    return {field.name: getattr(timing, field.name) for field in dataclasses.fields(timing)}
