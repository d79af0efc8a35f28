"""Which failed-turn reports name a prefill engine's held request that routing may release."""

from __future__ import annotations

import json

import pytest

from kvplane.services.common.model.errors import InvalidArgument
from kvplane.services.common.model.nodes import NodeRole
from kvplane.services.common.store import NodeRecord
from kvplane.services.routing.prefill_release import prefill_hold
from tests.conftest import make_node

P = make_node("p0", role=NodeRole.PREFILL)
D = make_node("d0", role=NodeRole.DECODE)
NODES = {n.node_id: NodeRecord(n, 1, 1) for n in (P, D)}


def returned(engine_id: str = P.engine_id, request_id: str = "cmpl-p-1") -> str:
    """What a prefill engine returns after its leg: its own handle, for D."""
    return json.dumps(
        {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine_id,
            "remote_request_id": request_id,
            "remote_block_ids": [[1, 2, 3]],
        }
    )


def test_p_params_on_their_own_prefill_node_name_a_hold() -> None:
    hold = prefill_hold(returned(), "p0", NODES)
    assert hold is not None
    assert (hold.node_id, hold.incarnation, hold.request_id) == ("p0", P.incarnation, "cmpl-p-1")


def test_with_no_node_named_the_prefill_node_of_that_engine_is_found() -> None:
    # A turn the gateway served from its fallback engines while routing was unreachable.
    hold = prefill_hold(returned(), "", NODES)
    assert hold is not None and hold.node_id == "p0"
    assert prefill_hold(returned(engine_id=D.engine_id), "", NODES) is None  # D is no prefill node


@pytest.mark.parametrize(
    ("params", "node_id"),
    [
        (returned(engine_id="engine-other"), "p0"),  # another engine's request (or P restarted)
        (returned(engine_id=D.engine_id), "d0"),  # not a prefill node
        (returned(), "gone"),  # the node is no longer registered
    ],
)
def test_a_hold_that_matches_no_live_prefill_node_is_ignored(params: str, node_id: str) -> None:
    assert prefill_hold(params, node_id, NODES) is None


@pytest.mark.parametrize(
    "params",
    [
        "not json",
        "[1]",
        json.dumps({"do_remote_decode": True, "remote_engine_id": P.engine_id, "remote_request_id": "r"}),
        json.dumps({"do_remote_prefill": True, "remote_engine_id": P.engine_id}),
        json.dumps(
            {"do_remote_prefill": True, "remote_engine_id": P.engine_id, "remote_request_id": "r" * 200}
        ),
        "[" * 100_000,
        "x" * (65 << 10),
    ],
)
def test_malformed_params_are_invalid_arguments(params: str) -> None:
    with pytest.raises(InvalidArgument):
        prefill_hold(params, "p0", NODES)
