"""A model directory without tokenizer files still serves token-id prompts end to end; requests
that need a tokenizer are refused with a message that says what to send instead."""

from __future__ import annotations

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

from tests import stack as stack_module
from tests import tiny_models

MAX_NEW_TOKENS = 16
PROMPTS = [[7], [5, 9, 11], [12, 30, 4, 4, 18, 40, 3], [22, 21, 20, 19, 18, 17, 16, 15, 14, 13]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("no-tokenizer")
    target = tiny_models.make_model(seed=0)
    draft = tiny_models.perturbed_copy(target, seed=1, scale=0.3)
    target_dir = tiny_models.save(target, root / "target", with_tokenizer=False)
    draft_dir = tiny_models.save(draft, root / "draft", with_tokenizer=False)
    assert not any(path.name.startswith("tokenizer") for path in target_dir.iterdir())
    return target_dir, draft_dir


@pytest.fixture(scope="module")
def bare_stack(loop_thread, model_dirs):
    running = loop_thread.run(stack_module.start_stack(*model_dirs, num_speculative_tokens=3))
    yield running
    loop_thread.run(running.stop())


@pytest.fixture(scope="module")
def bare_reference(model_dirs):
    return AutoModelForCausalLM.from_pretrained(model_dirs[0], dtype=torch.float64).eval()


def _reference(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return output[0, len(prompt):].tolist()


def test_token_id_prompts_are_served_exactly(bare_stack, bare_reference):
    drafted = 0
    for prompt in PROMPTS:
        request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=MAX_NEW_TOKENS)
        tokens, text, last = stack_module.generate(bare_stack.address, request)
        assert tokens == _reference(bare_reference, prompt), f"prompt {prompt}"
        assert text == ""  # nothing to decode with
        assert last.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS)
        drafted += last.stats.drafted_tokens
    assert drafted > 0, "the draft took part"


def test_target_reports_no_tokenizer(bare_stack):
    with grpc.insecure_channel(bare_stack.target_address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        assert stub.Info(common_pb2.InfoRequest(), timeout=30).tokenizer_hash == ""
        files = stub.GetTokenizer(target_pb2.GetTokenizerRequest(), timeout=30)
        assert list(files.files) == [] and files.tokenizer_hash == ""


@pytest.mark.parametrize("request_, needle", [
    pytest.param(pb.GenerateRequest(prompt="hello", max_new_tokens=4), "prompt_token_ids", id="text"),
    pytest.param(pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi")], max_new_tokens=4),
                 "prompt_token_ids", id="messages"),
    pytest.param(pb.GenerateRequest(prompt_token_ids=[5, 6], stop=["a"], max_new_tokens=4),
                 "tokenizer", id="stop-strings"),
])
def test_requests_that_need_a_tokenizer_are_refused(bare_stack, request_, needle):
    with grpc.insecure_channel(bare_stack.address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.Generate(request_, timeout=30))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in raised.value.details()
        # and the next token-id request is served as usual
        tokens = [t for r in stub.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6], max_new_tokens=3),
                                           timeout=30) for t in r.token_ids]
        assert len(tokens) == 3
