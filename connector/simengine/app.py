"""Runs one sim-engine: the engine, its side channel and its HTTP server."""

from __future__ import annotations

import asyncio
import logging
import sys

from aiohttp import web

from kvplane.connector.simengine.engine import SimEngine
from kvplane.connector.simengine.engine_hooks import EngineObserver
from kvplane.connector.simengine.openai_api import build_app
from kvplane.connector.simengine.settings import SimEngineSettings
from kvplane.connector.simengine.side_channel import format_host
from kvplane.connector.simengine.tracing import tracing_middleware
from kvplane.services.common.runtime.telemetry import Telemetry

log = logging.getLogger(__name__)


class SimEngineServer:
    """An engine plus its HTTP front; start() and stop() bracket its life."""

    def __init__(
        self, settings: SimEngineSettings, observer: EngineObserver | None = None, incarnation: str = ""
    ) -> None:
        self.settings = settings
        self.engine = SimEngine(settings, observer, incarnation)
        # Exports only where OpenTelemetry's variables ask for it (telemetry.py).
        self.telemetry = Telemetry.create("kvplane-sim-engine")
        self.engine.tracer = self.telemetry.tracer
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None

    @property
    def http_port(self) -> int:
        server = self._site._server if self._site is not None else None  # aiohttp exposes no public getter
        if isinstance(server, asyncio.Server) and server.sockets:
            return int(server.sockets[0].getsockname()[1])
        return self.settings.http_port

    @property
    def http_url(self) -> str:
        return f"http://{format_host(self.settings.advertised_http_host)}:{self.http_port}"

    async def start(self) -> None:
        await self.engine.start()
        try:
            # Cancel a handler when its client disconnects: that aborts the request and frees its blocks.
            app = build_app(self.engine)
            app.middlewares.append(tracing_middleware(self.telemetry.tracer, self.settings.role))
            self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
            await self._runner.setup()
            self._site = web.TCPSite(self._runner, self.settings.http_host, self.settings.http_port)
            await self._site.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            self._site = None
        await self.engine.stop()
        self.telemetry.shutdown()


async def serve(
    settings: SimEngineSettings, observer: EngineObserver | None = None, incarnation: str = ""
) -> None:
    """Run a sim-engine until cancelled. The `kvplane sim-engine` command calls this.

    With ``settings.control_plane`` (and no observer given) the engine gets
    kvplane's connector behaviour and registers through the node agent.
    """
    from kvplane.connector.simengine.agent_link import ConnectorObserver, start_node_agent

    server = SimEngineServer(settings, observer, incarnation)
    link: ConnectorObserver | None = None
    if observer is None and (settings.kvplane_connector or settings.control_plane):
        link = ConnectorObserver(settings, server.engine.metrics)
        server.engine.observer = link
    await server.start()
    agent = None
    if settings.control_plane:
        try:
            agent = start_node_agent(server.engine, server.http_url, link)
        except BaseException:
            await server.stop()
            raise
    e = server.engine
    print(f"kvplane sim-engine settings:\n{settings.describe()}", file=sys.stderr, flush=True)
    print(
        f"kvplane sim-engine ready: role={settings.role} engine_id={e.engine_id} "
        f"incarnation={e.incarnation} http={server.http_url} "
        f"side_channel={format_host(settings.advertised_side_channel_host)}:{e.side_channel_port}",
        flush=True,
    )
    try:
        await asyncio.Event().wait()
    finally:
        if agent is not None:
            # stop() joins the agent's thread after a short flush: keep the loop free meanwhile.
            await asyncio.to_thread(agent.stop)
        await server.stop()
