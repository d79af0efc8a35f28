"""`kvplane nodes|handles|drain|status|end-conversation`: operations over the services' RPCs.

Every command takes the service's address (`--metadata`, `--routing`, `--eviction`; the last two
default to the metadata address, as `kvplane serve all` serves all three on one port) and the
operator's credentials from `KVPLANE_CLIENT_*` (token or token file, TLS files), or from the flags.
`--json` prints JSON instead of a table. A failed call is one line naming the service, its address
and the status, and exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any

import grpc

from kvplane.services.client.credentials import ClientCredentials
from kvplane.services.common.model.convert import handle_from_pb, load_from_pb, node_from_pb
from kvplane.services.ops.views import as_json, handle_row, node_row, table
from kvplane.v1 import (
    eviction_pb2,
    eviction_pb2_grpc,
    metadata_pb2,
    metadata_pb2_grpc,
    routing_pb2,
    routing_pb2_grpc,
)

DEFAULT_TARGET = "127.0.0.1:50051"
NODE_COLUMNS = (
    "node",
    "role",
    "model",
    "state",
    "running",
    "queued",
    "kv_used_pct",
    "retained_bytes",
    "load_age_s",
)
HANDLE_COLUMNS = ("tenant", "conversation", "holder", "tokens", "retained_bytes", "age_s", "expires_in_s")


class CallFailed(Exception):
    """An RPC the command made failed: the message names the service and its address."""


def _parser(command: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"kvplane {command}",
        description=description,
        epilog="Credentials: KVPLANE_CLIENT_TOKEN or KVPLANE_CLIENT_TOKEN_FILE (the operator's token), "
        "KVPLANE_CLIENT_TLS_CA_FILE / _TLS_CERT_FILE / _TLS_KEY_FILE / _TLS_SERVER_NAME.",
    )
    env_target = os.environ.get("KVPLANE_CLIENT_TARGET", DEFAULT_TARGET)
    p.add_argument(
        "--metadata",
        default=env_target,
        help=f"metadata service, host:port (default: KVPLANE_CLIENT_TARGET, else {DEFAULT_TARGET})",
    )
    p.add_argument("--routing", default="", help="routing service, host:port (default: --metadata)")
    p.add_argument("--eviction", default="", help="eviction service, host:port (default: --metadata)")
    p.add_argument("--token-file", default="", help="operator token file (overrides KVPLANE_CLIENT_TOKEN*)")
    p.add_argument("--timeout-s", type=float, default=5.0, help="deadline of each call, seconds (default 5)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _credentials(args: argparse.Namespace, env: Mapping[str, str]) -> ClientCredentials:
    creds = ClientCredentials.from_env(env)
    if args.token_file:
        creds = ClientCredentials(**{**creds.__dict__, "token": "", "token_file": args.token_file})
    return creds


async def _call(
    service: str,
    target: str,
    creds: ClientCredentials,
    call: Callable[[grpc.aio.Channel, Any], Awaitable[Any]],
) -> Any:
    channel = creds.channel(target)
    try:
        return await call(channel, creds.call_metadata())
    except grpc.aio.AioRpcError as exc:
        raise CallFailed(f"{service} at {target}: {exc.code().name}: {exc.details()}") from None
    finally:
        await channel.close()


async def _nodes(args: argparse.Namespace, creds: ClientCredentials) -> str:
    async def call(channel: grpc.aio.Channel, md: Any) -> metadata_pb2.ListNodesResponse:
        stub = metadata_pb2_grpc.MetadataServiceStub(channel)
        return await stub.ListNodes(metadata_pb2.ListNodesRequest(), metadata=md, timeout=args.timeout_s)

    reply = await _call("metadata", args.metadata, creds, call)
    now = int(time.time() * 1000)
    rows = [
        node_row(node_from_pb(s.node), load_from_pb(s.load) if s.HasField("load") else None, now)
        for s in reply.nodes
    ]
    if args.role:
        rows = [r for r in rows if r["role"] == args.role]
    return as_json(rows) if args.json else table(rows, NODE_COLUMNS, empty="(no nodes registered)")


async def _handles(args: argparse.Namespace, creds: ClientCredentials) -> str:
    out: list[Any] = []

    async def call(channel: grpc.aio.Channel, md: Any) -> None:
        stub = metadata_pb2_grpc.MetadataServiceStub(channel)
        token = ""
        while len(out) < args.limit:
            request = metadata_pb2.ListHandlesRequest(
                tenant=args.tenant,
                node_id=args.node,
                page_size=min(1000, args.limit - len(out)),
                page_token=token,
            )
            reply = await stub.ListHandles(request, metadata=md, timeout=args.timeout_s)
            out.extend(reply.handles)
            token = reply.next_page_token
            if not token:
                break

    await _call("metadata", args.metadata, creds, call)
    now = int(time.time() * 1000)
    rows = [handle_row(handle_from_pb(h), now) for h in out]
    return as_json(rows) if args.json else table(rows, HANDLE_COLUMNS, empty="(no retained handles)")


async def _drain(args: argparse.Namespace, creds: ClientCredentials) -> str:
    async def call(channel: grpc.aio.Channel, md: Any) -> None:
        stub = metadata_pb2_grpc.MetadataServiceStub(channel)
        await stub.DrainNode(
            metadata_pb2.DrainNodeRequest(node_id=args.node_id), metadata=md, timeout=args.timeout_s
        )

    await _call("metadata", args.metadata, creds, call)
    if args.json:
        return as_json({"node": args.node_id, "draining": True})
    return f"node {args.node_id} is draining: no new turns go to it; its retained KV is still pulled"


async def _status(args: argparse.Namespace, creds: ClientCredentials) -> str:
    async def status(channel: grpc.aio.Channel, md: Any) -> eviction_pb2.GetStatusResponse:
        stub = eviction_pb2_grpc.EvictionServiceStub(channel)
        return await stub.GetStatus(eviction_pb2.GetStatusRequest(), metadata=md, timeout=args.timeout_s)

    async def nodes(channel: grpc.aio.Channel, md: Any) -> metadata_pb2.ListNodesResponse:
        stub = metadata_pb2_grpc.MetadataServiceStub(channel)
        return await stub.ListNodes(metadata_pb2.ListNodesRequest(), metadata=md, timeout=args.timeout_s)

    ev = await _call("eviction", args.eviction or args.metadata, creds, status)
    listed = await _call("metadata", args.metadata, creds, nodes)
    roles = [node_from_pb(s.node) for s in listed.nodes]
    summary = {
        "eviction_leader": ev.leader_id or None,
        "this_replica_leads": ev.leader,
        "connected_nodes": ev.connected_nodes,
        "pending_commands": ev.pending_commands,
        "prefill_nodes": sum(n.role.name == "PREFILL" for n in roles),
        "decode_nodes": sum(n.role.name == "DECODE" for n in roles),
        "draining_nodes": sum(n.draining for n in roles),
    }
    if args.json:
        return as_json(summary)
    return "\n".join(f"{k.replace('_', ' ')}: {'-' if v is None else v}" for k, v in summary.items())


async def _end_conversation(args: argparse.Namespace, creds: ClientCredentials) -> str:
    async def call(channel: grpc.aio.Channel, md: Any) -> routing_pb2.EndConversationResponse:
        stub = routing_pb2_grpc.RoutingServiceStub(channel)
        request = routing_pb2.EndConversationRequest(conversation=args.conversation, tenant=args.tenant)
        return await stub.EndConversation(request, metadata=md, timeout=args.timeout_s)

    reply = await _call("routing", args.routing or args.metadata, creds, call)
    if args.json:
        return as_json({"tenant": args.tenant, "conversation": args.conversation, "released": reply.released})
    what = "its retained KV was released" if reply.released else "no retained KV was held"
    return f"conversation {args.conversation} of {args.tenant} ended: {what}"


def _run(
    command: str,
    description: str,
    add: Callable[[argparse.ArgumentParser], None],
    action: Callable[[argparse.Namespace, ClientCredentials], Coroutine[Any, Any, str]],
    argv: Sequence[str],
    env: Mapping[str, str] | None,
) -> int:
    parser = _parser(command, description)
    add(parser)
    args = parser.parse_args(list(argv))
    try:
        creds = _credentials(args, os.environ if env is None else env)
        print(asyncio.run(action(args, creds)))
    except (CallFailed, ValueError, OSError) as exc:
        print(f"kvplane {command}: {exc}", file=sys.stderr)
        return 1
    return 0


def nodes_main(argv: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--role", choices=["prefill", "decode"], help="only nodes of this role (default: both)"
        )

    return _run("nodes", "registered engines, their state and latest load", add, _nodes, argv, env)


def handles_main(argv: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument("--tenant", default="", help="only this tenant's handles (default: all tenants)")
        p.add_argument("--node", default="", help="only handles held by this node (default: all nodes)")
        p.add_argument("--limit", type=int, default=1000, help="most handles listed (default 1000)")

    return _run(
        "handles", "retained KV handles: whose, where, how much, until when", add, _handles, argv, env
    )


def drain_main(argv: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument("node_id", help="the node to drain")

    return _run("drain", "mark a node draining: no new turns go to it", add, _drain, argv, env)


def status_main(argv: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    return _run(
        "status",
        "the eviction leader, its command backlog, and the nodes by role",
        lambda p: None,
        _status,
        argv,
        env,
    )


def end_conversation_main(argv: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument("tenant", help="the conversation's tenant")
        p.add_argument("conversation", help="the conversation id")

    return _run(
        "end-conversation",
        "end a conversation: its retained KV is released now",
        add,
        _end_conversation,
        argv,
        env,
    )
