"""specdec generate: one request to an orchestrator, streamed to stdout."""

from __future__ import annotations

import argparse
import json
import sys

import grpc
from google.protobuf import json_format

from specdec.v1 import common_pb2
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc
from specdec_cli.client import add_connection_flags, call_metadata, chat_request, open_channel
from specdec_cli.flags import UsageError

MODES = {"off": pb.SPECULATION_MODE_OFF, "fixed": pb.SPECULATION_MODE_FIXED,
         "adaptive": pb.SPECULATION_MODE_ADAPTIVE, "heuristic": pb.SPECULATION_MODE_HEURISTIC}


def configure(parser: argparse.ArgumentParser) -> None:
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated (e.g. 1,2,3)")
    prompt.add_argument("--chat", help="one user message, rendered with the model's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="most tokens to generate (default: the orchestrator's "
                             "--default-max-new-tokens, 256 unless set)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=None,
                        help="nucleus sampling: keep the most likely tokens up to this total "
                             "probability (default: 1, all)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample among the k most likely tokens only (0: all)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the sampler: the same seed reproduces a sampled output for "
                             "the same K schedule (default: random)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--speculation", choices=sorted(MODES), default=None,
                        help="off, fixed, adaptive or heuristic (default: the server's)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="K of fixed mode, the heuristic's first K, or adaptive's cap "
                             "(default: the server's)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with token_ids, text, finish_reason and stats")
    add_connection_flags(parser, timeout_seconds=600.0)
    parser.set_defaults(func=run)


def prompt_token_ids(text: str) -> list[int]:
    """'1,2, 3' -> [1, 2, 3]; anything but comma-separated non-negative integers is refused."""
    items = [item.strip() for item in text.split(",")]
    if not all(item.isdigit() and item.isascii() for item in items):
        raise UsageError(f"--prompt-ids must be comma-separated non-negative integers, got {text!r}")
    return [int(item) for item in items]


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    given = next(text for text in (args.prompt, args.prompt_ids, args.chat) if text is not None)
    if given == "" or (args.prompt_ids is not None and not given.strip()):
        raise UsageError("the prompt is empty")
    if args.chat is not None:
        request = chat_request([{"role": "user", "content": args.chat}])
    elif args.prompt is not None:
        request = pb.GenerateRequest(prompt=args.prompt)
    else:
        request = pb.GenerateRequest(prompt_token_ids=prompt_token_ids(args.prompt_ids))
    request.stop.extend(args.stop)
    if args.max_new_tokens is not None:
        request.max_new_tokens = args.max_new_tokens
    sampling = common_pb2.SamplingParams(temperature=args.temperature, top_k=args.top_k)
    if args.top_p is not None:
        sampling.top_p = args.top_p
    if args.seed is not None:
        sampling.seed = args.seed
    request.sampling.CopyFrom(sampling)
    if args.speculation is not None:
        request.speculation.mode = MODES[args.speculation]
    if args.num_speculative_tokens is not None:
        request.speculation.num_speculative_tokens = args.num_speculative_tokens
    return request


def run(args: argparse.Namespace) -> int:
    request = build_request(args)
    token_ids: list[int] = []
    text = []
    last = None
    metadata = call_metadata(args)
    try:
        with open_channel(args) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            for response in stub.Generate(request, timeout=args.timeout, metadata=metadata):
                token_ids.extend(response.token_ids)
                text.append(response.text)
                if not args.json:
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
                last = response
    except grpc.RpcError as error:
        end_line(args, text)  # the error goes on a line of its own
        print(f"specdec: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    assert last is not None
    if args.json:
        print(json.dumps({
            "token_ids": token_ids,
            "text": "".join(text),
            "finish_reason": pb.FinishReason.Name(last.finish_reason),
            "stats": json_format.MessageToDict(last.stats, preserving_proto_field_name=True,
                                               always_print_fields_with_no_presence=True),
        }))
    else:
        end_line(args, text)
        stats = last.stats
        print(f"[{stats.generated_tokens} tokens, {stats.tokens_per_second:.1f} tok/s, "
              f"tau {stats.mean_accepted_length:.2f}, acceptance {stats.acceptance_rate:.2f}, "
              f"{pb.FinishReason.Name(last.finish_reason)}]", file=sys.stderr)
    return 0


def end_line(args: argparse.Namespace, text: list[str]) -> None:
    """Ends the streamed text with a newline if it does not end with one."""
    streamed = "".join(text)
    if not args.json and streamed and not streamed.endswith("\n"):
        sys.stdout.write("\n")
        sys.stdout.flush()
