"""specdec pools: the orchestrator's replica pools (Pools RPC) as a table or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc
from google.protobuf import json_format

from specdec.rpc.auth import TOKEN_ENV, bearer_metadata, load_token
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

COLUMNS = ("ROLE", "ADDRESS", "REPLICA", "HEALTHY", "ACCEPTING", "SESSIONS", "LOAD", "MODEL")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("pools", help="show the orchestrator's draft and target replicas")
    parser.add_argument("--orchestrator", default="127.0.0.1:50050", help="host:port of the API")
    parser.add_argument("--json", action="store_true", help="print the Pools response as JSON")
    parser.add_argument("--timeout", type=float, default=10.0, help="deadline in seconds (default 10)")
    parser.add_argument("--auth-token-file", type=Path, default=None,
                        help=f"send the API's bearer token from this file (default: ${TOKEN_ENV} if set)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        token = load_token(args.auth_token_file)
    except (OSError, ValueError) as error:
        raise SystemExit(f"specdec: cannot read the auth token: {error}")
    try:
        with grpc.insecure_channel(args.orchestrator) as channel:
            response = orchestrator_pb2_grpc.OrchestratorStub(channel).Pools(
                pb.PoolsRequest(), timeout=args.timeout, metadata=bearer_metadata(token) if token else None)
    except grpc.RpcError as error:
        print(f"specdec: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(json_format.MessageToDict(
            response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)))
    else:
        print(format_table(response))
    return 0


def format_table(response: pb.PoolsResponse) -> str:
    """One row per replica, and a line per pool naming its source and its usable replicas."""
    rows = [COLUMNS]
    summaries = []
    for pool in response.pools:
        usable = sum(r.healthy and r.accepting for r in pool.replicas)
        summaries.append(f"{pool.role} pool ({pool.source}): {usable} of {len(pool.replicas)} "
                         "replicas take new sessions")
        for r in pool.replicas:
            rows.append((pool.role, r.address, r.replica_id or "-", _yes(r.healthy), _yes(r.accepting),
                         str(r.active_sessions), f"{r.load:.2f}", r.model_id or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    table = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    return "\n".join([*summaries, "", *table])


def _yes(value: bool) -> str:
    return "yes" if value else "no"
