"""What a new user sees when a command line is wrong: one line saying why and exit status 2 (a
traceback only with --debug), an orchestrator address without a port, streamed text that ends
its line."""

from __future__ import annotations

import socket
import subprocess

import grpc
import pytest

from specdec.v1 import common_pb2
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc
from specdec_cli.client import with_default_port
from specdec_cli.main import build_parser, main
from specdec_cli.processes import specdec_command


def _closed_port_address() -> str:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{unused.getsockname()[1]}"


@pytest.mark.parametrize("prompt, message", [
    (["--prompt", ""], "specdec: the prompt is empty"),
    (["--prompt-ids", ""], "specdec: the prompt is empty"),
    (["--prompt-ids", " "], "specdec: the prompt is empty"),
    (["--chat", ""], "specdec: the prompt is empty"),
    (["--prompt-ids", "1,,2"], "specdec: --prompt-ids must be comma-separated non-negative integers, got '1,,2'"),
    (["--prompt-ids", "1,-2"], "specdec: --prompt-ids must be comma-separated non-negative integers, got '1,-2'"),
    (["--prompt-ids", "1,x"], "specdec: --prompt-ids must be comma-separated non-negative integers, got '1,x'"),
    (["--prompt-ids", "1,2,"], "specdec: --prompt-ids must be comma-separated non-negative integers, got '1,2,'"),
])
def test_a_bad_prompt_is_refused_before_any_call(prompt, message, capsys):
    # The orchestrator's address has nothing behind it: a call would fail with UNAVAILABLE (1).
    assert main(["generate", "--orchestrator", _closed_port_address(), *prompt]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [message]
    assert captured.out == ""


def test_prompt_ids_with_spaces_are_accepted():
    from specdec_cli.generate_cmd import build_request

    args = build_parser().parse_args(["generate", "--prompt-ids", "1, 2,3"])
    assert list(build_request(args).prompt_token_ids) == [1, 2, 3]


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["pools"]])
def test_an_orchestrator_address_without_a_port_gets_the_default_port(command):
    args = build_parser().parse_args([*command, "--orchestrator", "127.0.0.1"])
    assert args.orchestrator == "127.0.0.1:50050"


@pytest.mark.parametrize("given, dialled", [
    ("localhost", "localhost:50050"), ("10.0.0.7:6000", "10.0.0.7:6000"), ("[::1]", "[::1]:50050"),
    ("[::1]:7", "[::1]:7"), ("::1", "[::1]:50050"), ("dns:///orchestrator.llm:50050", "dns:///orchestrator.llm:50050"),
])
def test_with_default_port(given, dialled):
    assert with_default_port(given) == dialled


class _Streams(orchestrator_pb2_grpc.OrchestratorServicer):
    """Streams 'abc' in two pieces, then ends the stream normally or with an error."""

    def __init__(self) -> None:
        self.fail = False

    async def Generate(self, request, context):
        yield pb.GenerateResponse(text="ab", token_ids=[1, 2])
        yield pb.GenerateResponse(text="c", token_ids=[3])
        if self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the target replica went away")
        yield pb.GenerateResponse(finish_reason=pb.FINISH_REASON_LENGTH,
                                  stats=pb.GenerationStats(generated_tokens=3))


@pytest.fixture
def streaming_orchestrator(loop_thread):
    servicer = _Streams()

    async def start():
        server = grpc.aio.server()
        orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, f"127.0.0.1:{port}"

    server, address = loop_thread.run(start())
    yield servicer, address
    loop_thread.run(server.stop(0))


@pytest.mark.parametrize("fail", [False, True], ids=["complete", "error-after-partial-stream"])
def test_streamed_text_ends_with_a_newline(streaming_orchestrator, fail, capsys):
    servicer, address = streaming_orchestrator
    servicer.fail = fail
    assert main(["generate", "--orchestrator", address, "--prompt", "x"]) == (1 if fail else 0)
    captured = capsys.readouterr()
    assert captured.out == "abc\n"
    last = captured.err.splitlines()[-1]
    if fail:
        assert last == "specdec: UNAVAILABLE: the target replica went away"
    else:
        assert last.startswith("[3 tokens")


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(specdec_command(*args), capture_output=True, text=True, timeout=300)


def test_a_model_path_that_is_not_a_model_is_one_line_and_exit_2():
    result = _serve("serve", "target", "--model", "/nonexistent/model", "--port", "0", "--threads", "1")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stderr.splitlines()[-1] == (
        "specdec: '/nonexistent/model' is not a model directory (no config.json); pass a local "
        "Hugging Face model directory or 'default'")


def test_debug_keeps_the_traceback():
    result = _serve("--debug", "serve", "target", "--model", "/nonexistent/model", "--port", "0")
    assert result.returncode != 0
    assert "Traceback" in result.stderr
    assert "InvalidInput" in result.stderr


def test_an_unavailable_device_is_one_line_and_exit_2(tiny_pair):
    # cuda:99 exists on no machine: refused whether torch has CUDA or not.
    result = _serve("serve", "draft", "--model", str(tiny_pair.draft_dir), "--device", "cuda:99",
                    "--port", "0", "--threads", "1")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stderr.splitlines()[-1].startswith("specdec: device 'cuda:99' is not available")


def test_a_flag_out_of_range_is_one_line_and_exit_2():
    result = _serve("serve", "orchestrator", "--target", "127.0.0.1:1", "--draft", "127.0.0.1:2",
                    "--port", "0", "--default-max-new-tokens", "0")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == "specdec: default_max_new_tokens must be >= 1"


def test_sampling_params_reach_the_request():
    from specdec_cli.generate_cmd import build_request

    args = build_parser().parse_args(["generate", "--prompt", "x", "--top-p", "0.9", "--top-k", "5",
                                      "--seed", "3", "--temperature", "0.7"])
    assert build_request(args).sampling == common_pb2.SamplingParams(
        temperature=0.7, top_p=0.9, top_k=5, seed=3)
