"""The OpenAI-compatible HTTP API against the real `openai` client, on loopback, over the shared
in-process stack: chat and text completions, whole and streamed, usage, stop strings, seeds,
the `specdec` extension, the same output as gRPC's Generate, and OpenAI's error shape."""

from __future__ import annotations

import http.client
import json

import openai
import pytest

from specdec.v1 import orchestrator_pb2 as pb
from specdec_cli.client import chat_request

from tests.stack import generate

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
PROMPT_IDS = [5, 9, 13, 2, 8]
FIXED_K = {"specdec": {"speculation": "fixed", "num_speculative_tokens": 3}}
ERROR_FIELDS = {"message", "type", "param", "code"}


def post_raw(api, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """A request the openai client would never send (bad JSON, odd fields)."""
    connection = http.client.HTTPConnection("127.0.0.1", api.port, timeout=120)
    try:
        connection.request("POST", path, body=body,
                           headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def assert_error(body: dict, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, body
    assert body["error"]["type"] == kind and body["error"]["message"], body
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


# -- models ------------------------------------------------------------------------------------


def test_models_lists_the_target_model(client, stack):
    (model,) = client.models.list().data
    assert model.id == stack.orchestrator.reference.model_id and model.object == "model"
    assert client.models.retrieve(model.id).id == model.id
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("no-such-model")
    assert raised.value.code == "model_not_found"


# -- chat and text completions, the same output as gRPC -----------------------------------------


def test_chat_completion_is_the_grpc_generate_output(client, stack):
    response = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=16,
                                              temperature=0)
    tokens, text, last = generate(stack.address, chat_request(MESSAGES, max_new_tokens=16))
    (choice,) = response.choices
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == ("length" if len(tokens) == 16 else "stop")
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert response.model == stack.orchestrator.reference.model_id
    assert response.usage.prompt_tokens == last.stats.prompt_tokens == len("s:be brief\nu:hello there\na:")
    assert response.usage.completion_tokens == len(tokens)
    assert response.usage.total_tokens == response.usage.prompt_tokens + len(tokens)
    extension = response.model_extra["specdec"]
    assert extension["generated_tokens"] == len(tokens) and extension["rounds"] >= 1
    assert extension["drafted_tokens"] == sum(extension["num_speculative_tokens_per_round"])
    assert {"mean_accepted_length", "acceptance_rate", "controller_estimates"} <= set(extension)
    # Which method proposed the drafts, named as in gRPC's stats: the draft model alone here.
    drafted, accepted = extension["drafted_tokens"], extension["accepted_tokens"]
    assert extension["drafted_tokens_by_method"] == ({"model": drafted} if drafted else {})
    assert extension["accepted_tokens_by_method"] == ({"model": accepted} if drafted else {})


def test_streamed_completion_of_token_ids_matches_whole_and_grpc(client, stack):
    request = dict(model="any", prompt=PROMPT_IDS, max_tokens=20, temperature=0)
    whole = client.completions.create(**request)
    chunks = list(client.completions.create(**request, stream=True,
                                            stream_options={"include_usage": True}))
    tokens, text, _ = generate(stack.address, pb.GenerateRequest(prompt_token_ids=PROMPT_IDS,
                                                                 max_new_tokens=20))
    assert whole.object == "text_completion" and whole.choices[0].text == text
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    *body, final, usage = chunks
    assert all(c.usage is None and c.choices[0].finish_reason is None for c in body)
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason
    assert final.model_extra["specdec"]["generated_tokens"] == len(tokens)
    assert usage.choices == [] and usage.usage.model_dump() == whole.usage.model_dump()
    assert usage.usage.prompt_tokens == len(PROMPT_IDS) and usage.usage.completion_tokens == len(tokens)
    assert len({c.id for c in chunks}) == 1


def test_streamed_chat_opens_with_the_role_and_ends_with_the_reason(client):
    whole = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=12,
                                                 temperature=0, stream=True))
    first, *middle, final = chunks
    assert first.object == "chat.completion.chunk" and first.choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert all(c.choices[0].finish_reason is None for c in [first, *middle])
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason
    assert final.usage is None  # no include_usage: no usage chunk
    assert final.model_extra["specdec"]["generated_tokens"] == whole.usage.completion_tokens


def test_a_stop_string_ends_the_text_before_it(client):
    full = client.completions.create(model="any", prompt="hello", max_tokens=24, temperature=0)
    text = full.choices[0].text
    assert len(text) >= 8, "the tiny model's greedy answer is too short to pick a stop string from"
    stop = text[4:6]
    expected = text[: text.index(stop)]
    stopped = client.completions.create(model="any", prompt="hello", max_tokens=24, temperature=0,
                                        stop=[stop, "never-in-the-text"])
    assert stopped.choices[0].text == expected and stopped.choices[0].finish_reason == "stop"
    assert stopped.model_extra["specdec"]["finish_reason"] == "stop"
    streamed = list(client.completions.create(model="any", prompt="hello", max_tokens=24,
                                              temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_a_seed_reproduces_a_sample_and_matches_grpc(client, stack):
    request = dict(model="any", messages=MESSAGES, max_tokens=16, temperature=1.0, seed=1234,
                   extra_body=FIXED_K)
    first = client.chat.completions.create(**request).choices[0].message.content
    again = client.chat.completions.create(**request).choices[0].message.content
    fixed = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=3)
    _, text, _ = generate(stack.address, chat_request(MESSAGES, max_new_tokens=16, speculation=fixed,
                                                      temperature=1.0, seed=1234))
    assert first == again == text
    other = {client.chat.completions.create(**{**request, "seed": seed}).choices[0].message.content
             for seed in (1, 2, 3)}
    assert len(other | {first}) > 1, "four seeds, one answer: the seed is not used"


def test_top_p_and_top_k_are_applied(client, stack):
    response = client.completions.create(model="any", prompt=PROMPT_IDS, max_tokens=8, temperature=1,
                                         top_p=0.5, seed=3, extra_body={"top_k": 4, **FIXED_K})
    request = pb.GenerateRequest(prompt_token_ids=PROMPT_IDS, max_new_tokens=8,
                                 speculation=pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED,
                                                                  num_speculative_tokens=3))
    request.sampling.temperature, request.sampling.top_p = 1.0, 0.5
    request.sampling.top_k, request.sampling.seed = 4, 3
    _, text, _ = generate(stack.address, request)
    assert response.choices[0].text == text


def test_the_finish_reason_length_at_max_tokens(client):
    response = client.completions.create(model="any", prompt=PROMPT_IDS, max_tokens=1, temperature=0)
    assert response.usage.completion_tokens == 1
    assert response.choices[0].finish_reason in ("length", "stop")


# -- errors ------------------------------------------------------------------------------------


def test_malformed_json_is_a_400_in_openai_shape(api):
    status, body = post_raw(api, "/v1/chat/completions", b'{"model": "x", "messages": [')
    assert status == 400
    assert "not valid JSON" in assert_error(body)["message"]


def test_unknown_fields_are_ignored(api):
    request = {"model": "x", "prompt": "hi", "max_tokens": 2, "temperature": 0,
               "no_such_field": {"a": 1}, "metadata": {"k": "v"}, "store": False, "user": "u"}
    status, body = post_raw(api, "/v1/completions", json.dumps(request).encode())
    assert status == 200, body
    assert body["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("field, value", [
    ("n", 2), ("logprobs", 2), ("echo", True), ("best_of", 3), ("presence_penalty", 0.5),
    ("logit_bias", {"5": 10}),
])
def test_a_parameter_specdec_does_not_implement_is_refused_not_ignored(api, field, value):
    request = {"model": "x", "prompt": "hi", "max_tokens": 2, field: value}
    status, body = post_raw(api, "/v1/completions", json.dumps(request).encode())
    assert status == 400
    assert assert_error(body, param=field)["code"] == "unsupported_parameter"


def test_neutral_values_of_unimplemented_parameters_pass(api):
    request = {"model": "x", "prompt": "hi", "max_tokens": 2, "temperature": 0, "n": 1,
               "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "echo": False}
    status, body = post_raw(api, "/v1/completions", json.dumps(request).encode())
    assert status == 200, body


@pytest.mark.parametrize("request_body, param", [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "temperature": 2.5}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": {"text": "hi"}}, "prompt"),
    ({"prompt": [5, "six"]}, "prompt"),
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "specdec": {"speculation": "sideways"}}, "specdec"),
])
def test_bad_input_is_a_400_naming_the_field(api, request_body, param):
    status, body = post_raw(api, "/v1/completions", json.dumps(request_body).encode())
    assert status == 400, body
    assert_error(body, param=param)


def test_bad_chat_input_is_a_400(api):
    for request, param in (({"messages": []}, "messages"),
                           ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                            "messages.0.content")):
        status, body = post_raw(api, "/v1/chat/completions", json.dumps(request).encode())
        assert status == 400, body
        assert_error(body, param=param)


def test_a_prompt_token_outside_the_vocabulary_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="any", prompt=[5, 10_000], max_tokens=2)
    assert "vocab" in raised.value.message


def test_huge_max_tokens_is_a_400_context_length_exceeded(client, stack):
    max_context = stack.orchestrator.limits().max_context
    for max_tokens in (max_context, 10**12):
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=max_tokens)
        assert raised.value.code == "context_length_exceeded" and raised.value.param == "max_tokens"
        assert str(max_context) in raised.value.message
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="any", messages=MESSAGES, max_completion_tokens=10**9)
    assert raised.value.param == "max_completion_tokens"


def test_an_unknown_route_is_a_404_in_openai_shape(api):
    status, body = post_raw(api, "/v1/embeddings", b"{}")
    assert status == 404
    assert_error(body)
