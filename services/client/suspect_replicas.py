"""Routing replicas that missed a deadline, skipped until they answer a health check.

A frozen process (SIGSTOP, a stalled VM) still accepts TCP connections and queues
requests, so only a deadline tells it from a working one. A replica whose call outlived
its deadline is suspect: calls skip it at once instead of waiting on it again, and a
background probe asks its standard gRPC health service (open without credentials,
answered without etcd) until it says SERVING. A replica that was only slow answers the
first probe within milliseconds and is back at once; a frozen one stays skipped until
it runs again.
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
        probe_timeout_s: float = 0.5,
        probe_interval_s: float = 0.25,
    ) -> None:
        self._stubs = [health_pb2_grpc.HealthStub(channel) for channel in channels]
        self._names = tuple(names)
        self._service = service
        self._probe_timeout_s = probe_timeout_s
        self._probe_interval_s = probe_interval_s
        self._probes: dict[int, asyncio.Task[None]] = {}

    @property
    def indexes(self) -> frozenset[int]:
        """The replicas skipped now."""
        return frozenset(self._probes)

    def __contains__(self, index: object) -> bool:
        return index in self._probes

    def mark(self, index: int) -> None:
        """`index` missed a deadline: skip it until its health check answers."""
        if index in self._probes:
            return
        log.warning(
            "routing replica %s missed its deadline: skipped until it answers a health check",
            self._names[index],
        )
        self._probes[index] = asyncio.get_running_loop().create_task(self._probe(index))

    async def _probe(self, index: int) -> None:
        request = health_pb2.HealthCheckRequest(service=self._service)
        try:
            while True:
                try:
                    reply = await self._stubs[index].Check(request, timeout=self._probe_timeout_s)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        log.info("routing replica %s answers again", self._names[index])
                        return
                except grpc.aio.AioRpcError:
                    pass  # still frozen, down or starting: ask again
                await asyncio.sleep(self._probe_interval_s)  # between probes of a silent replica
        finally:
            self._probes.pop(index, None)

    async def close(self) -> None:
        probes = list(self._probes.values())
        for probe in probes:
            probe.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
