"""Shared fixtures: tiny float64 models, and real gRPC servers started once per test session."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import tiny_models


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    torch.set_num_threads(1)
    yield


class LoopThread:
    """An asyncio loop in a thread: grpc.aio servers live here while sync tests call them."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout: float = 600) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


@pytest.fixture(scope="session")
def loop_thread():
    thread = LoopThread()
    yield thread
    thread.close()


@dataclass(frozen=True)
class TinyPair:
    target_dir: Path
    draft_dir: Path  # a perturbed copy of the target: rejections and acceptances both happen
    far_draft_dir: Path  # an unrelated random model: almost everything is rejected


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> TinyPair:
    root = tmp_path_factory.mktemp("models")
    target = tiny_models.make_model(seed=0)
    return TinyPair(
        target_dir=tiny_models.save(target, root / "target"),
        draft_dir=tiny_models.save(tiny_models.perturbed_copy(target, seed=1, scale=0.3), root / "draft"),
        far_draft_dir=tiny_models.save(tiny_models.make_model(seed=7), root / "far-draft"),
    )


@pytest.fixture(scope="session")
def stack(loop_thread, tiny_pair):
    """Target + perturbed draft + orchestrator, in-process, float64, K = 4 by default."""
    from tests import stack as stack_module

    running = loop_thread.run(stack_module.start_stack(tiny_pair.target_dir, tiny_pair.draft_dir))
    yield running
    loop_thread.run(running.stop())


@pytest.fixture(scope="session")
def stack_same(loop_thread, tiny_pair):
    """The draft is the target itself: every drafted token must be accepted."""
    from tests import stack as stack_module

    running = loop_thread.run(stack_module.start_stack(tiny_pair.target_dir, tiny_pair.target_dir))
    yield running
    loop_thread.run(running.stop())


@pytest.fixture(scope="session")
def endless_target(tiny_pair):
    """The tiny target as a model service loads it (float64), with no end-of-sequence tokens: a
    TargetEngine's Decode runs to the length it is asked for."""
    import dataclasses

    from specdec.models import ModelConfig, load_model

    model = load_model(ModelConfig(str(tiny_pair.target_dir), "target", dtype="float64"))
    return dataclasses.replace(model, eos_token_ids=())


@pytest.fixture(scope="session")
def reference_target(tiny_pair):
    """The target alone, in-process, for model.generate references."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_pair.target_dir, dtype=torch.float64).eval()
