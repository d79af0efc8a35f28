"""A stateful property test of the handle lifecycle against a real etcd.

Hypothesis drives random publish / check-out / release / expiry / engine
release / node death sequences. A model of DESIGN.md's state machine
(retained -> checked_out -> consumed, retained -> released) predicts each
outcome, and the store must agree at every step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvplane.services.common.model.errors import HandleNotRetained, NotFound
from kvplane.services.common.model.handles import HandleState, ReleaseReason
from kvplane.services.common.model.nodes import Node
from kvplane.services.common.store import Store, StoreSettings
from kvplane.services.common.store.leases import MAX_BUCKET_S
from kvplane.services.common.store.records import now_ms
from kvplane.services.dev.local_etcd import LocalEtcd
from tests.conftest import make_node
from tests.support.factories import make_handle

CONVERSATIONS = ["c0", "c/1", "c..2"]
NODES = ["d0", "d1"]
# Each conversation's handles expire at a fixed time of their own, an hour and more ahead and
# further apart than a lease bucket (nor near the freed tombstones' 600 s): which handles share a
# lease, and so go together when it runs out, is then the same on every replay of an example,
# whatever the wall clock. (Shared by the bucket a wall-clock time falls in, it made the rules a
# later step could run depend on the time, which Hypothesis rightly reports as flaky.)
EXPIRY_OFFSET_MS = {conv: 3_600_000 + i * 10 * MAX_BUCKET_S * 1000 for i, conv in enumerate(CONVERSATIONS)}


@dataclass
class Model:
    """What must be true: per conversation, the retained handle id, if any."""

    retained: dict[str, tuple[str, str, str]] = field(
        default_factory=dict
    )  # conv -> (handle id, node, request id)
    checked_out: set[str] = field(default_factory=set)  # handle ids ever checked out
    released: set[str] = field(default_factory=set)


class HandleLifecycle(RuleBasedStateMachine):
    etcd: LocalEtcd

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.store = Store(StoreSettings(endpoints=(self.etcd.endpoint,), prefix=f"/sm/{uuid.uuid4().hex}/"))
        self.run(self.store.connect())
        self.model = Model()
        self.nodes: dict[str, Node] = {}
        self.started_ms = now_ms()

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.store.close())
        self.loop.close()

    @initialize()
    def register_nodes(self) -> None:
        for node_id in NODES:
            node = make_node(node_id)
            self.run(self.store.register_node(node, 60))
            self.nodes[node_id] = node

    @rule(conv=st.sampled_from(CONVERSATIONS), node_id=st.sampled_from(NODES))
    def publish(self, conv: str, node_id: str) -> None:
        request_id = f"req-{uuid.uuid4().hex[:8]}"
        handle = make_handle(self.nodes[node_id], conversation=conv, request_id=request_id)
        expiry = self.started_ms + EXPIRY_OFFSET_MS[conv]
        outcome = self.run(self.store.publish_handle(dataclasses.replace(handle, wall_expiry_unix_ms=expiry)))
        old = self.model.retained.get(conv)
        if old is None:
            assert outcome.superseded is None
        else:
            assert outcome.superseded is not None and outcome.superseded.handle.handle_id == old[0]
            self.model.released.add(old[0])
        self.model.retained[conv] = (outcome.handle.handle_id, node_id, request_id)

    @rule(conv=st.sampled_from(CONVERSATIONS))
    def check_out(self, conv: str) -> None:
        expected = self.model.retained.get(conv)
        try:
            got = self.run(self.store.check_out("acme", conv, route_id="r"))
        except NotFound:
            assert expected is None
            return
        assert expected is not None and got.handle.handle_id == expected[0]
        assert got.handle.handle_id not in self.model.checked_out, "a handle was checked out twice"
        self.model.checked_out.add(got.handle.handle_id)
        del self.model.retained[conv]

    @rule(conv=st.sampled_from(CONVERSATIONS))
    def stale_check_out_after_a_race(self, conv: str) -> None:
        """Two turns read the same revision; both try; exactly one wins."""
        record = self.run(self.store.get_handle_record("acme", conv))
        if record is None:
            return

        async def race() -> list[object]:
            return await asyncio.gather(
                self.store.check_out("acme", conv, expected=record),
                self.store.release("acme", conv, ReleaseReason.LOW_VALUE, expected=record),
                return_exceptions=True,
            )

        results = self.run(race())
        wins = [r for r in results if not isinstance(r, BaseException)]
        assert len(wins) == 1
        assert all(isinstance(r, HandleNotRetained) for r in results if isinstance(r, BaseException))
        handle_id = self.model.retained.pop(conv)[0]
        if hasattr(wins[0], "claim_id"):
            self.model.checked_out.add(handle_id)
        else:
            self.model.released.add(handle_id)

    @rule(conv=st.sampled_from(CONVERSATIONS))
    def release(self, conv: str) -> None:
        expected = self.model.retained.get(conv)
        try:
            pending = self.run(self.store.release("acme", conv, ReleaseReason.REQUESTED))
        except NotFound:
            assert expected is None
            return
        assert expected is not None and pending.handle.handle_id == expected[0]
        self.model.released.add(expected[0])
        del self.model.retained[conv]

    @rule(conv=st.sampled_from(CONVERSATIONS))
    def engine_frees_blocks(self, conv: str) -> None:
        expected = self.model.retained.get(conv)
        if expected is None:
            return
        handle_id, node_id, request_id = expected
        node = self.nodes[node_id]
        removed = self.run(self.store.release_freed(node_id, node.incarnation, [request_id]))
        assert removed == 1
        self.model.released.add(handle_id)
        del self.model.retained[conv]

    @precondition(lambda self: bool(self.model.retained))
    @rule(conv=st.sampled_from(CONVERSATIONS))
    def handle_expires(self, conv: str) -> None:
        expected = self.model.retained.get(conv)
        if expected is None:
            return
        record = self.run(self.store.get_handle_record("acme", conv))
        assert record is not None
        # Expiry is the lease running out; revoking it is the same event, now.
        # Handles that expire in the same bucket share a lease, so they would go too.
        same_lease = [
            other
            for other in list(self.model.retained)
            if (r := self.run(self.store.get_handle_record("acme", other))) is not None
            and r.lease == record.lease
        ]
        self.run(self.store.revoke_lease(record.lease))
        self.store.leases.forget_all()
        for other in same_lease:
            self.model.released.add(self.model.retained.pop(other)[0])

    @rule(node_id=st.sampled_from(NODES))
    def node_dies_and_restarts(self, node_id: str) -> None:
        reborn = make_node(node_id)
        self.run(self.store.register_node(reborn, 60))
        self.nodes[node_id] = reborn
        for conv, (handle_id, holder, _) in list(self.model.retained.items()):
            if holder == node_id:
                self.model.released.add(handle_id)
                del self.model.retained[conv]

    @invariant()
    def store_matches_model(self) -> None:
        for conv in CONVERSATIONS:
            view = self.run(self.store.get_handle("acme", conv))
            expected = self.model.retained.get(conv)
            if expected is None:
                assert view is None or view.state is not HandleState.RETAINED
            else:
                assert view is not None and view.state is HandleState.RETAINED
                assert view.handle.handle_id == expected[0]
                assert view.handle.holder_incarnation == self.nodes[expected[1]].incarnation
        assert not (self.model.checked_out & self.model.released), (
            "a handle was both checked out and released"
        )


def test_handle_state_machine(etcd: LocalEtcd) -> None:
    HandleLifecycle.etcd = etcd
    HandleLifecycle.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
    started = time.monotonic()
    HandleLifecycle.TestCase().runTest()
    assert time.monotonic() - started < 300
