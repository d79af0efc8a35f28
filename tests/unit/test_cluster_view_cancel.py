"""A cancel that reaches `ClusterView.wait_for` is never dropped, whenever it arrives.

The eviction coordinator waits on the view while its term begins; `stop()` cancels that wait and
then waits for the coordinator's loop to end. A cancel dropped as the view's change arrived (what
`asyncio.wait_for` does on Python 3.11 when its inner await completes in the same turn) let the
loop go on leading and `stop()` wait forever. Feeding the view from a scripted watch and cancelling
after every number of loop turns up to well past the change covers each point the cancel can land.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvplane.services.common.store import Store, WatchEvent
from kvplane.services.common.store.cluster_view import ClusterView
from kvplane.services.common.store.settings import StoreSettings


class ScriptedWatch:
    """The store calls the view makes, with a watch that yields what the test sends."""

    def __init__(self) -> None:
        self.keys = Store(StoreSettings(endpoints=("127.0.0.1:1",), prefix="/t/")).keys
        self.batches: asyncio.Queue[list[WatchEvent]] = asyncio.Queue()

    async def read_range(self, start: bytes, end: bytes) -> tuple[int, list[WatchEvent]]:
        return 1, []

    async def watch_range(
        self, start: bytes, end: bytes, revision: int, *, prev_kv: bool
    ) -> AsyncIterator[list[WatchEvent]]:
        while True:
            yield await self.batches.get()


def a_load_deleted(store: ScriptedWatch, revision: int) -> WatchEvent:
    key = store.keys.loads_prefix() + b"d0"
    return WatchEvent(revision=revision, key=key, value=b"", deleted=True, mod_revision=revision, lease=0)


async def test_a_cancel_landing_at_any_turn_around_the_change_ends_the_waiter() -> None:
    for turns in range(40):
        store = ScriptedWatch()
        view = ClusterView(store)  # type: ignore[arg-type]
        view.start()
        try:
            assert await view.wait_for(view.ready.is_set, 10.0)
            waiter = asyncio.create_task(view.wait_for(lambda v=view: v.revision >= 2, 30.0))
            await asyncio.sleep(0)
            store.batches.put_nowait([a_load_deleted(store, 2)])
            for _ in range(turns):
                await asyncio.sleep(0)
            if waiter.cancel():
                # Cancelled before it returned: it must end cancelled, not with its answer.
                await asyncio.gather(waiter, return_exceptions=True)
                assert waiter.cancelled(), f"cancel after {turns} loop turns was dropped"
            else:
                assert waiter.result() is True
        finally:
            await view.stop()
