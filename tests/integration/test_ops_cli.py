"""`kvplane nodes|handles|drain|status|end-conversation` against real services on a real etcd,
with the operator's token from KVPLANE_CLIENT_*."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
import pytest

from kvplane.services.common.model import convert
from kvplane.services.common.model.nodes import NodeRole
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.ops import cli
from kvplane.services.process import ServiceProcess
from kvplane.v1 import metadata_pb2, metadata_pb2_grpc
from tests.conftest import make_node, settings_for

OPERATOR = "operator-token-0123456789"
NODE = "node-token-0123456789"
AUTH = {
    "mode": "token",
    "tokens": [
        {"token": OPERATOR, "kind": "operator", "name": "ops"},
        {"token": NODE, "kind": "node", "name": "p0"},
    ],
}


@pytest.fixture
async def control_plane(etcd: LocalEtcd, prefix: str) -> AsyncIterator[str]:
    from kvplane.services.eviction.app import install as eviction
    from kvplane.services.metadata.app import install as metadata
    from kvplane.services.routing.app import install as routing

    process = ServiceProcess(
        settings_for(etcd, prefix, auth=AUTH), [metadata, routing, eviction], Telemetry.disabled()
    )
    await process.start()
    target = f"127.0.0.1:{process.grpc_port}"
    node = make_node("p0", role=NodeRole.PREFILL)
    async with grpc.aio.insecure_channel(target) as channel:
        await metadata_pb2_grpc.MetadataServiceStub(channel).RegisterNode(
            metadata_pb2.RegisterNodeRequest(node=convert.node_to_pb(node), lease_ttl_s=30),
            metadata=(("authorization", f"Bearer {NODE}"),),
        )
    try:
        yield target
    finally:
        await process.stop()


async def _run(
    main: Callable[..., int], argv: Sequence[str], capsys: pytest.CaptureFixture[str], token: str = OPERATOR
) -> tuple[int, str, str]:
    code = await asyncio.to_thread(main, list(argv), {"KVPLANE_CLIENT_TOKEN": token})
    out, err = capsys.readouterr()
    return code, out, err


async def test_nodes_lists_the_registered_node_as_a_table_and_as_json(
    control_plane: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = await _run(cli.nodes_main, ["--metadata", control_plane], capsys)
    assert code == 0
    head, row = out.splitlines()[:2]
    assert head.split()[:3] == ["NODE", "ROLE", "MODEL"] and row.split()[:4] == [
        "p0",
        "prefill",
        "tiny",
        "serving",
    ]
    code, out, _ = await _run(
        cli.nodes_main, ["--metadata", control_plane, "--json", "--role", "decode"], capsys
    )
    assert code == 0 and json.loads(out) == []


async def test_drain_marks_the_node_and_status_counts_it(
    control_plane: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = await _run(cli.drain_main, ["--metadata", control_plane, "p0"], capsys)
    assert code == 0 and "p0 is draining" in out
    code, out, _ = await _run(cli.nodes_main, ["--metadata", control_plane, "--json"], capsys)
    assert [n["state"] for n in json.loads(out)] == ["draining"]
    code, out, _ = await _run(cli.status_main, ["--metadata", control_plane, "--json"], capsys)
    status = json.loads(out)
    assert code == 0 and (status["prefill_nodes"], status["draining_nodes"]) == (1, 1)


async def test_handles_and_end_conversation_answer_with_nothing_retained(
    control_plane: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = await _run(cli.handles_main, ["--metadata", control_plane], capsys)
    assert code == 0 and out.strip() == "(no retained handles)"
    code, out, _ = await _run(
        cli.end_conversation_main, ["--metadata", control_plane, "--json", "acme", "c1"], capsys
    )
    assert code == 0 and json.loads(out) == {"tenant": "acme", "conversation": "c1", "released": False}


async def test_a_refused_call_is_one_line_naming_the_service_its_address_and_the_status(
    control_plane: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await _run(
        cli.nodes_main, ["--metadata", control_plane], capsys, token="wrong-token-0123456789"
    )
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and f"metadata at {control_plane}: UNAUTHENTICATED" in err
    # A node's token acts for that node only.
    code, _, err = await _run(cli.drain_main, ["--metadata", control_plane, "p1"], capsys, token=NODE)
    assert code == 1 and "PERMISSION_DENIED" in err
