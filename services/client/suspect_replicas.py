"""Routing replicas that went silent, skipped until they answer a health check.

A frozen process (SIGSTOP, a stalled VM) still accepts TCP connections and queues
requests, so only a deadline tells it from a working one. The deadline is put on the
cheapest call there is: the standard gRPC health check, open without credentials and
answered without etcd. Its deadline judges liveness, not speed: a replica that is only
slow (etcd, a busy machine) answers it well within it; one that misses it is suspect:
calls skip it at once instead of waiting on it again, and a background probe asks again
until it says SERVING.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)


class SuspectReplicas:
    """Which of a client's channels are suspect, each probed in the background until healthy.

    Runs on the client's event loop; `mark` never blocks.
    """

    def __init__(
        self,
        channels: Sequence[grpc.aio.Channel],
        names: Sequence[str],
        service: str,
        *,
        probe_timeout_s: float = 2.0,
        probe_interval_s: float = 0.25,
    ) -> None:
        self._stubs = [health_pb2_grpc.HealthStub(channel) for channel in channels]
        self._names = tuple(names)
        self._service = service
        self._probe_timeout_s = probe_timeout_s
        self._probe_interval_s = probe_interval_s
        self._probes: dict[int, asyncio.Task[None]] = {}
        self._checks: set[asyncio.Task[bool]] = set()

    @property
    def indexes(self) -> frozenset[int]:
        """The replicas skipped now."""
        return frozenset(self._probes)

    def __contains__(self, index: object) -> bool:
        return index in self._probes

    async def answers(self, index: int) -> bool:
        """Whether `index` says SERVING within the probe deadline."""
        request = health_pb2.HealthCheckRequest(service=self._service)
        try:
            reply = await self._stubs[index].Check(request, timeout=self._probe_timeout_s)
        except grpc.aio.AioRpcError:
            return False  # frozen, down, starting or shutting down
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def check(self, index: int) -> asyncio.Task[bool]:
        """Checks `index` in the background: a miss marks it suspect, whoever still waits."""
        task = asyncio.get_running_loop().create_task(self._check(index))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)
        return task

    async def _check(self, index: int) -> bool:
        if await self.answers(index):
            return True
        self.mark(index)
        return False

    def mark(self, index: int) -> None:
        """`index` went silent and missed a health check: skip it until it answers one."""
        if index in self._probes:
            return
        log.warning(
            "routing replica %s went silent and missed a health check: skipped until it answers one",
            self._names[index],
        )
        self._probes[index] = asyncio.get_running_loop().create_task(self._probe(index))

    async def _probe(self, index: int) -> None:
        try:
            while True:
                if await self.answers(index):
                    log.info("routing replica %s answers again", self._names[index])
                    return
                await asyncio.sleep(self._probe_interval_s)  # between probes of a silent replica
        finally:
            self._probes.pop(index, None)

    async def close(self) -> None:
        tasks = [*self._probes.values(), *self._checks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
