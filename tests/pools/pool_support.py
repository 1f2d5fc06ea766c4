"""Helpers for the pool tests: streams read in threads, Pools and Info (waiting: tests/waiting.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import grpc
import torch

from specdec.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc


@dataclass
class Stream:
    """One Generate stream, read in a thread; started tells when its first tokens arrived."""

    address: str
    prompt: list[int]
    max_new_tokens: int
    token_ids: list[int] = field(default_factory=list)
    last: pb.GenerateResponse | None = None
    error: BaseException | None = None
    started: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        # Fixed K: every round calls the draft, so a draft replica's loss is met in the next round
        # (adaptive K may hold a stream at K = 0, and the speculation guard may hold them all).
        request = pb.GenerateRequest(prompt_token_ids=self.prompt, max_new_tokens=self.max_new_tokens,
                                     speculation=pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED,
                                                                      num_speculative_tokens=2))
        try:
            with grpc.insecure_channel(self.address) as channel:
                for response in orchestrator_pb2_grpc.OrchestratorStub(channel).Generate(request, timeout=300):
                    self.token_ids.extend(response.token_ids)
                    self.last = response
                    self.started.set()
        except BaseException as error:  # reported by result()
            self.error = error
            self.started.set()

    def result(self) -> tuple[list[int], pb.GenerationStats]:
        self._thread.join(300)
        assert not self._thread.is_alive(), f"stream {self.prompt} did not end"
        if self.error is not None:
            raise AssertionError(f"stream {self.prompt} failed: {self.error}") from self.error
        assert self.last is not None
        return self.token_ids, self.last.stats


def start_streams(address: str, prompts: list[list[int]], max_new_tokens: int) -> list[Stream]:
    streams = [Stream(address, prompt, max_new_tokens) for prompt in prompts]
    for stream in streams:
        assert stream.started.wait(300), f"stream {stream.prompt} never started"
    return streams


def pools(address: str) -> dict[str, dict[str, pb.ReplicaStatus]]:
    """role -> address -> ReplicaStatus, from the orchestrator's Pools RPC."""
    with grpc.insecure_channel(address) as channel:
        response = orchestrator_pb2_grpc.OrchestratorStub(channel).Pools(pb.PoolsRequest(), timeout=30)
    return {pool.role: {r.address: r for r in pool.replicas} for pool in response.pools}


def usable(address: str, role: str) -> set[str]:
    return {a for a, r in pools(address)[role].items() if r.healthy and r.accepting}


def info(address: str, role: str) -> common_pb2.InfoResponse:
    with grpc.insecure_channel(address) as channel:
        stub = (target_pb2_grpc.TargetServiceStub if role == "target" else draft_pb2_grpc.DraftServiceStub)(channel)
        return stub.Info(common_pb2.InfoRequest(), timeout=30)


class References:
    """The float64 target's own greedy continuations (transformers generate), computed once each."""

    def __init__(self, model) -> None:
        self.model = model
        self._table: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def __call__(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._table:
            with torch.no_grad():
                output = self.model.generate(
                    torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                )
            self._table[key] = output[0, len(prompt):].tolist()
        return self._table[key]
