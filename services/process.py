"""What one kvplane process is made of, and how it starts and stops.

A process has one settings object, one telemetry, one etcd store, one
watch-fed cluster view and one gRPC server. Each service contributes an
`install(ctx)` that registers its servicers on the server and returns its
background components; `kvplane serve all` installs every service into one
process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvplane.services.common.model.errors import StoreUnavailable
from kvplane.services.common.runtime.heap import freeze_startup_heap
from kvplane.services.common.runtime.server import GrpcServer, MetricsServer
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store import Store
from kvplane.services.common.store.cluster_view import ClusterView
from kvplane.services.settings import KvplaneSettings

log = logging.getLogger(__name__)


class Component(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass
class ProcessContext:
    settings: KvplaneSettings
    telemetry: Telemetry
    store: Store
    server: GrpcServer
    _view: ClusterView | None = field(default=None)

    @property
    def view(self) -> ClusterView:
        """The process's cluster view, created on first use and shared."""
        if self._view is None:
            self._view = ClusterView(self.store)
        return self._view


Installer = Callable[[ProcessContext], Sequence[Component]]


class ServiceProcess:
    """Runs installed services until stopped; usable in tests and the CLI."""

    def __init__(
        self,
        settings: KvplaneSettings,
        installers: Sequence[Installer],
        telemetry: Telemetry | None = None,
        *,
        service_name: str = "kvplane",
    ) -> None:
        self.settings = settings
        self.telemetry = telemetry or Telemetry.create(
            service_name,
            otlp_endpoint=settings.telemetry.otlp_endpoint,
            sample_ratio=settings.telemetry.sample_ratio,
            trace_background=settings.telemetry.trace_background,
        )
        self.store = Store(settings.etcd.store_settings(), self.telemetry)
        self.server = GrpcServer(
            settings.grpc.listen,
            self.telemetry,
            settings.auth.authenticator(),
            tls=settings.grpc.tls.files(),
            reflection=settings.grpc.reflection,
        )
        self.ctx = ProcessContext(settings, self.telemetry, self.store, self.server)
        self.components: list[Component] = []
        for install in installers:
            self.components.extend(install(self.ctx))
        self.metrics: MetricsServer | None = None
        self.grpc_port = 0
        self.metrics_port = 0
        # Whether this process reports SERVING: false while etcd goes unanswered (`_etcd_health`).
        self.etcd_reachable = True
        self._etcd_watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Connects, starts the components, then listens; on a failure (a port in use) it stops
        what it started before raising."""
        try:
            await self.store.connect()
            if self.ctx._view is not None:
                self.ctx._view.start()
            for component in self.components:
                await component.start()
            self.grpc_port = await self.server.start()
            if self.settings.telemetry.metrics_port >= 0 and self.settings.telemetry.metrics_port != 0:
                self.metrics = MetricsServer(
                    self.telemetry, self.settings.telemetry.metrics_host, self.settings.telemetry.metrics_port
                )
                self.metrics_port = self.metrics.start()
            self._etcd_watch = asyncio.create_task(self._etcd_health())
        except BaseException:
            with contextlib.suppress(Exception):
                await self.stop()
            raise

    async def _etcd_health(self, interval_s: float = 0.5) -> None:
        """NOT_SERVING while etcd goes unanswered for `etcd.unreachable_after_s`, said once in
        one line naming the endpoints; SERVING again once it answers.

        A failed call or a broken watch only raises the suspicion: one cheap read
        (`Store.revision`) then decides, so a single slow call on a loaded machine, after which
        the process makes no call for a while, is not taken for an outage. The read is made only
        while there is a suspicion: an idle process costs etcd nothing here.
        """
        etcd = self.store.etcd
        view_down_since: float | None = None
        after_s = self.settings.etcd.unreachable_after_s
        while True:
            await asyncio.sleep(interval_s)
            now = time.monotonic()
            view = self.ctx._view
            if view is not None and not view.healthy:
                view_down_since = view_down_since if view_down_since is not None else now
            else:
                view_down_since = None
            since = [t for t in (etcd.unreachable_since, view_down_since) if t is not None]
            if not since and self.etcd_reachable:
                continue
            try:
                await self.store.revision()
                answered = True
            except StoreUnavailable:
                answered = False
            down_s = now - min(since) if since else 0.0
            reachable = (answered and view_down_since is None) or down_s < after_s
            if reachable == self.etcd_reachable:
                continue
            self.etcd_reachable = reachable
            await self.server.set_serving(reachable)
            endpoints = ", ".join(self.settings.etcd.endpoints)
            if reachable:
                log.warning(f"etcd at {endpoints} answers again: serving")
            else:
                why = etcd.last_error or "its watch stream is down"
                log.warning(f"etcd at {endpoints} unreachable for {down_s:.0f} s ({why}): NOT_SERVING")

    async def stop(self) -> None:
        if self._etcd_watch is not None:
            self._etcd_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._etcd_watch
            self._etcd_watch = None
        await self.server.stop(self.settings.grpc.grace_s)
        for component in reversed(self.components):
            with contextlib.suppress(Exception):
                await component.stop()
        if self.ctx._view is not None:
            await self.ctx._view.stop()
        if self.metrics is not None:
            self.metrics.stop()
        await self.store.close()
        self.telemetry.shutdown()

    async def run_until_signalled(self) -> None:
        await self.start()
        freeze_startup_heap()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        log.info("serving", extra={"grpc_port": self.grpc_port, "metrics_port": self.metrics_port})
        await stop.wait()
        log.info("stopping")
        await self.stop()
