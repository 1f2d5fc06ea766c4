"""specdec pools: the orchestrator's replica pools (Pools RPC) as a table or JSON."""

from __future__ import annotations

import argparse
import json
import sys

import grpc
from google.protobuf import json_format

from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc
from specdec_cli.client import add_connection_flags, call_metadata, format_table, open_channel

COLUMNS = ("ROLE", "ADDRESS", "REPLICA", "HEALTHY", "ACCEPTING", "SESSIONS", "LOAD", "MODEL")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the Pools response as JSON")
    add_connection_flags(parser, timeout_seconds=10.0)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    metadata = call_metadata(args)
    try:
        with open_channel(args) as channel:
            response = orchestrator_pb2_grpc.OrchestratorStub(channel).Pools(
                pb.PoolsRequest(), timeout=args.timeout, metadata=metadata)
    except grpc.RpcError as error:
        print(f"specdec: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(json_format.MessageToDict(
            response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)))
    else:
        print(pools_table(response))
    return 0


def pools_table(response: pb.PoolsResponse) -> str:
    """One row per replica, and a line per pool naming its source and its usable replicas."""
    rows = []
    summaries = []
    for pool in response.pools:
        usable = sum(r.healthy and r.accepting for r in pool.replicas)
        summaries.append(f"{pool.role} pool ({pool.source}): {usable} of {len(pool.replicas)} "
                         "replicas take new sessions")
        for r in pool.replicas:
            rows.append((pool.role, r.address, r.replica_id or "-", _yes(r.healthy), _yes(r.accepting),
                         str(r.active_sessions), f"{r.load:.2f}", r.model_id or "-"))
    if response.draft_shares_compute:
        summaries.append("the draft replicas compute on the target replicas' hardware: pipelining auto holds "
                         "off, and under load speculation is tested seldom")
    if response.shared_compute_without_turns:
        summaries.append("a draft replica computes on a target replica's hardware and their passes do not take "
                         "turns: start both with the same --pass-lock FILE, or give the draft hardware of its own")
    table = format_table(COLUMNS, rows, left_columns=len(COLUMNS), rule=False)
    return "\n".join([*summaries, "", table])


def _yes(value: bool) -> str:
    return "yes" if value else "no"
