"""ThreadWake: an event on the agent's loop that the engine's threads set."""

from __future__ import annotations

import asyncio
import threading

from kvplane.connector.node_agent.wake import ThreadWake


async def test_another_thread_wakes_the_job_waiting_on_the_agent_s_loop() -> None:
    wake = ThreadWake()
    wake.attach(asyncio.get_running_loop())
    assert wake.event is not None and not wake.event.is_set()
    thread = threading.Thread(target=wake.set)
    thread.start()
    thread.join()
    async with asyncio.timeout(30):
        await wake.event.wait()


def test_without_a_loop_or_after_it_closed_setting_it_does_nothing() -> None:
    wake = ThreadWake()
    wake.set()  # not attached yet
    assert wake.event is None
    loop = asyncio.new_event_loop()
    wake.attach(loop)
    loop.close()
    wake.set()  # the loop is closed: nothing to wake, and no error
    wake.attach(None)
    assert wake.event is None
    wake.set()
