"""specdec generate: one request to an orchestrator, streamed to stdout."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc
from google.protobuf import json_format

from specdec.rpc.auth import bearer_metadata, load_token
from specdec.v1 import common_pb2
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

MODES = {"off": pb.SPECULATION_MODE_OFF, "fixed": pb.SPECULATION_MODE_FIXED,
         "adaptive": pb.SPECULATION_MODE_ADAPTIVE, "heuristic": pb.SPECULATION_MODE_HEURISTIC}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="send one request to an orchestrator")
    parser.add_argument("--orchestrator", default="127.0.0.1:50050", help="host:port of the API")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    prompt.add_argument("--chat", help="one user message, rendered with the model's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--speculation", choices=sorted(MODES), default=None,
                        help="off, fixed, adaptive or heuristic (default: the server's)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with token_ids, text, finish_reason and stats")
    parser.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    parser.add_argument("--auth-token-file", type=Path, default=None,
                        help="bearer token of the API (default: $SPECDEC_AUTH_TOKEN if set)")
    parser.add_argument("--tls-ca", type=Path, default=None,
                        help="PEM CA that signed the orchestrator's certificate (enables TLS)")
    parser.add_argument("--tls-cert", type=Path, default=None, help="client certificate (mutual TLS)")
    parser.add_argument("--tls-key", type=Path, default=None, help="client private key (mutual TLS)")
    parser.set_defaults(func=run)


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    request = pb.GenerateRequest(stop=args.stop)
    if args.prompt is not None:
        request.prompt = args.prompt
    elif args.chat is not None:
        request.messages.append(pb.ChatMessage(role="user", content=args.chat))
    else:
        try:
            request.prompt_token_ids.extend(int(x) for x in args.prompt_ids.split(",") if x.strip())
        except ValueError:
            raise SystemExit(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}")
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


def open_client_channel(args: argparse.Namespace) -> grpc.Channel:
    """Plaintext, or TLS when --tls-ca is given (with a client certificate for mutual TLS)."""
    if args.tls_ca is None:
        return grpc.insecure_channel(args.orchestrator)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=args.tls_ca.read_bytes(),
        private_key=args.tls_key.read_bytes() if args.tls_key else None,
        certificate_chain=args.tls_cert.read_bytes() if args.tls_cert else None,
    )
    return grpc.secure_channel(args.orchestrator, credentials)


def run(args: argparse.Namespace) -> int:
    request = build_request(args)
    token_ids: list[int] = []
    text = []
    last = None
    token = load_token(args.auth_token_file)
    metadata = bearer_metadata(token) if token else None
    try:
        with open_client_channel(args) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            for response in stub.Generate(request, timeout=args.timeout, metadata=metadata):
                token_ids.extend(response.token_ids)
                text.append(response.text)
                if not args.json:
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
                last = response
    except grpc.RpcError as error:
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
        stats = last.stats
        print(f"\n[{stats.generated_tokens} tokens, {stats.tokens_per_second:.1f} tok/s, "
              f"tau {stats.mean_accepted_length:.2f}, acceptance {stats.acceptance_rate:.2f}, "
              f"{pb.FinishReason.Name(last.finish_reason)}]", file=sys.stderr)
    return 0
