"""What the operations commands print, from the services' replies."""

from __future__ import annotations

import json

from kvplane.services.common.model.handles import CacheHandle, VllmHandle
from kvplane.services.common.model.nodes import NodeLoad, NodeRole
from kvplane.services.ops.views import as_json, handle_row, node_row, table
from tests.conftest import make_node

NOW = 1_700_000_060_000


def test_a_node_row_shows_its_state_and_the_age_of_its_load() -> None:
    node = make_node("p0", role=NodeRole.PREFILL)
    load = NodeLoad(
        "p0",
        node.incarnation,
        queued_requests=2,
        running_requests=3,
        free_kv_blocks=25,
        total_kv_blocks=100,
        retained_bytes=4096,
        reported_unix_ms=NOW - 2_500,
    )
    row = node_row(node, load, NOW)
    assert row["role"] == "prefill" and row["state"] == "serving"
    assert (row["running"], row["queued"], row["kv_used_pct"], row["load_age_s"]) == (3, 2, 75.0, 2.5)


def test_a_node_that_never_reported_shows_no_load_and_draining_shows() -> None:
    from dataclasses import replace

    row = node_row(replace(make_node("d1"), draining=True), None, NOW)
    assert row["state"] == "draining" and row["running"] is None and row["kv_used_pct"] is None


def test_a_handle_row_counts_down_to_its_expiry() -> None:
    vllm = VllmHandle("e", "r", ((1, 2),), 512, "127.0.0.1", 5600)
    handle = CacheHandle(
        "h1",
        "acme",
        "c1",
        "d0",
        "inc",
        vllm,
        wall_expiry_unix_ms=NOW + 30_000,
        retained_bytes=1 << 20,
        published_unix_ms=NOW - 4_000,
    )
    row = handle_row(handle, NOW)
    assert (row["tenant"], row["holder"], row["tokens"]) == ("acme", "d0", 512)
    assert (row["age_s"], row["expires_in_s"]) == (4.0, 30.0)


def test_a_table_aligns_columns_and_says_when_empty() -> None:
    rows = [{"node": "p0", "running": 3, "retained_bytes": 1_048_576}, {"node": "decode-1", "running": None}]
    lines = table(rows, ["node", "running", "retained_bytes"]).splitlines()
    assert lines[0].split() == ["NODE", "RUNNING", "RETAINED_BYTES"]
    assert lines[1].split() == ["p0", "3", "1,048,576"] and lines[2].split() == ["decode-1", "-", "-"]
    assert lines[1].index("3") == lines[0].index("RUNNING")
    assert table([], empty="(no nodes registered)") == "(no nodes registered)"
    assert json.loads(as_json(rows))[0]["retained_bytes"] == 1_048_576
