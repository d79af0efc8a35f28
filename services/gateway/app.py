"""The gateway's HTTP server: the OpenAI-compatible routes, /health and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvplane.services.client import ClientCredentials, RoutingClient
from kvplane.services.common.runtime.server import BindFailed
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.gateway.admission import (
    TENANT,
    ReadLimits,
    admission,
    expect_continue,
    json_body,
    read_limits,
)
from kvplane.services.gateway.cache_salt import CacheSalts
from kvplane.services.gateway.https import ServerCertificate
from kvplane.services.gateway.identity import ApiKeys
from kvplane.services.gateway.metrics import GatewayMetrics
from kvplane.services.gateway.openai_errors import RequestRejected, error_response, rejection
from kvplane.services.gateway.protocol_errors import JsonErrorAppRunner, json_http_errors
from kvplane.services.gateway.settings import GatewaySection
from kvplane.services.gateway.tenant_share import TenantShares
from kvplane.services.gateway.turn import TurnRunner
from kvplane.services.gateway.turn_errors import TurnFailed
from kvplane.services.gateway.turn_request import admit_turn, configured_api_keys, record_dropped

log = logging.getLogger(__name__)

RUNNER_KEY: web.AppKey[TurnRunner] = web.AppKey("runner", TurnRunner)
KEYS_KEY: web.AppKey[ApiKeys] = web.AppKey("keys", ApiKeys)
TELEMETRY_KEY: web.AppKey[Telemetry] = web.AppKey("telemetry", Telemetry)
SETTINGS_KEY: web.AppKey[GatewaySection] = web.AppKey("settings", GatewaySection)
LIMITS_KEY: web.AppKey[ReadLimits] = web.AppKey("read_limits", ReadLimits)
METRICS_KEY: web.AppKey[GatewayMetrics] = web.AppKey("metrics", GatewayMetrics)
SALTS_KEY: web.AppKey[CacheSalts] = web.AppKey("cache_salts", CacheSalts)
SHARES_KEY: web.AppKey[TenantShares] = web.AppKey("tenant_shares", TenantShares)
BODY_READS_KEY: web.AppKey[TenantShares] = web.AppKey("tenant_body_reads", TenantShares)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The paths whose callers are authenticated before their bodies are read.
COMPLETION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# The paths that need an API key: the completions, and the model list (what a deployment serves
# is not for anyone who can reach it). Health and metrics stay open to probes and scrapers.
AUTHENTICATED_PATHS = COMPLETION_PATHS | {"/v1/models"}


class AddressError(ValueError):
    """A listen address that is not host:port."""


def split_host_port(address: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (bare host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise AddressError(f"{address!r} is not host:port (bracket IPv6 literals)")
    return host.strip("[]"), int(port)


def routing_credentials(settings: GatewaySection) -> ClientCredentials:
    """What the gateway presents to the routing service."""
    return ClientCredentials(
        token=settings.routing_token.get_secret_value(),
        token_file=settings.routing_token_file,
        tls_ca_file=settings.routing_tls_ca_file,
        tls_cert_file=settings.routing_tls_cert_file,
        tls_key_file=settings.routing_tls_key_file,
        tls_server_name=settings.routing_tls_server_name,
    )


def routing_client(settings: GatewaySection, telemetry: Telemetry) -> RoutingClient:
    """The routing client a front (the gateway, the picker) calls routing with, from its settings."""
    return RoutingClient(
        settings.routing,
        credentials=routing_credentials(settings),
        timeout_s=settings.routing_timeout_s,
        attempts=settings.routing_attempts,
        hedge_after_s=settings.routing_hedge_after_s,
        probe_timeout_s=settings.routing_liveness_timeout_s,
        tracer_provider=telemetry.tracer_provider,
        trace_calls=telemetry.exports,
    )


def _engine_error(exc: TurnFailed) -> web.Response:
    """An engine's own error answer is passed through; anything else is described."""
    if exc.body:
        try:
            parsed = json.loads(exc.body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and "error" in parsed:
            return web.json_response(parsed, status=exc.status)
    return error_response(exc.status, exc.message)


async def _completion(request: web.Request, chat: bool) -> web.StreamResponse:
    arrival = time.perf_counter()
    settings = request.app[SETTINGS_KEY]
    # The admission middleware has authenticated the caller from its headers: only now is the body
    # read, within the tenant's share of the bodies being read at once.
    limits = request.app[LIMITS_KEY]
    try:
        with request.app[BODY_READS_KEY].hold(request[TENANT], limits.declared_bytes(request.content_length)):
            body = await json_body(request, limits)
    except RequestRejected as exc:
        return rejection(exc, close=True)
    if isinstance(body, web.Response):
        return body
    try:
        admitted = admit_turn(
            request.headers,
            body,
            chat=chat,
            tenant=request[TENANT],
            settings=settings,
            salts=request.app[SALTS_KEY],
            arrival=arrival,
        )
    except RequestRejected as exc:
        return rejection(exc)
    record_dropped(admitted.dropped, request.app[METRICS_KEY])
    turn, tokens = admitted.turn, admitted.share_tokens
    try:
        with request.app[SHARES_KEY].hold(turn.identity.tenant, tokens):
            return await request.app[RUNNER_KEY].serve(request, turn)
    except RequestRejected as exc:
        return rejection(exc)
    except TurnFailed as exc:
        return _engine_error(exc)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=False)


async def models(request: web.Request) -> web.StreamResponse:
    settings = request.app[SETTINGS_KEY]
    if settings.models or not settings.fallback_decode_url:
        created = int(time.time())
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "kvplane"} for m in settings.models
        ]
        return web.json_response({"object": "list", "data": data})
    runner = request.app[RUNNER_KEY]
    url = settings.fallback_decode_url[0].rstrip("/") + "/v1/models"
    timeout = aiohttp.ClientTimeout(total=settings.connect_timeout_s)
    try:
        async with runner.session.get(url, timeout=timeout) as r:
            return web.json_response(await r.json(content_type=None), status=r.status)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return error_response(502, f"model list unavailable: {exc!r}")


async def health(request: web.Request) -> web.StreamResponse:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.StreamResponse:
    body = generate_latest(request.app[TELEMETRY_KEY].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    response = await handler(request)
    route = request.match_info.route.resource
    endpoint = route.canonical if route is not None else "unmatched"
    request.app[METRICS_KEY].requests.labels(endpoint, str(response.status)).inc()
    return response


def build_app(
    settings: GatewaySection, runner: TurnRunner, telemetry: Telemetry, metrics_: GatewayMetrics
) -> web.Application:
    api_keys = configured_api_keys(settings)
    limits = read_limits(settings)
    admit = admission(api_keys, limits, AUTHENTICATED_PATHS)
    app = web.Application(
        client_max_size=limits.max_body_bytes, middlewares=[count_requests, json_http_errors, admit]
    )
    app[KEYS_KEY] = api_keys
    app[SHARES_KEY] = TenantShares(settings.max_inflight_tokens_per_tenant)
    app[BODY_READS_KEY] = TenantShares(limits.max_tenant_body_bytes, unit="request-body bytes")
    app[SALTS_KEY] = CacheSalts.create(settings.cache_salt, settings.salt_key(), settings.tenant_groups)
    app[RUNNER_KEY] = runner
    app[TELEMETRY_KEY] = telemetry
    app[SETTINGS_KEY] = settings
    app[LIMITS_KEY] = limits
    app[METRICS_KEY] = metrics_
    expect = expect_continue(api_keys, limits)
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=expect)
    app.router.add_post("/v1/completions", completions, expect_handler=expect)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


class Gateway:
    """The gateway's server, routing client and engine session; start() and stop() bracket its life."""

    def __init__(
        self,
        settings: GatewaySection,
        telemetry: Telemetry | None = None,
        routing: RoutingClient | None = None,
    ) -> None:
        """`routing`: the client the gateway routes with (the gateway closes it); None: one to
        the replicas `settings.routing` names."""
        self.settings = settings
        self.telemetry = telemetry or Telemetry.create("kvplane-gateway")
        self.metrics = GatewayMetrics.create(self.telemetry.registry)
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._routing: RoutingClient | None = routing
        self._session: aiohttp.ClientSession | None = None
        self.turns: TurnRunner | None = None
        self._certificate: ServerCertificate | None = None
        self._certificate_watch: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        server = self._site._server if self._site is not None else None  # aiohttp has no public getter
        if isinstance(server, asyncio.Server) and server.sockets:
            return int(server.sockets[0].getsockname()[1])
        return split_host_port(self.settings.listen)[1]

    @property
    def url(self) -> str:
        host = split_host_port(self.settings.listen)[0]
        scheme = "https" if self.settings.tls_cert_file else "http"
        return f"{scheme}://{f'[{host}]' if ':' in host else host}:{self.port}"

    async def start(self) -> None:
        s = self.settings
        host, port = split_host_port(s.listen)
        self._routing = self._routing or routing_client(s, self.telemetry)
        # One pool for every engine; the default limit of 100 connections would queue turns.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        try:
            # Loads the configured tokenizers: one that cannot be read stops the start here.
            self.turns = TurnRunner(s, self._routing, self._session, self.metrics, self.telemetry.tracer)
            app = build_app(s, self.turns, self.telemetry, self.metrics)
            # A client that disconnects cancels its handler, and with it the engine requests in flight:
            # an aborted request frees its KV blocks at once.
            # aiohttp closes a connection that has not sent a whole request head within its keep-alive
            # timeout: that is the head's deadline (a client dribbling headers holds nothing longer).
            # No lingering: a refused request's unread body is not drained, the connection is closed.
            # Requests aiohttp's parser refuses are answered in OpenAI's format too.
            self._runner = JsonErrorAppRunner(
                app,
                access_log=None,
                handler_cancellation=True,
                keepalive_timeout=s.header_timeout_s,
                lingering_time=0,
            )
            await self._runner.setup()
            if s.tls_cert_file:
                self._certificate = ServerCertificate(s.tls_cert_file, s.tls_key_file)
                self._certificate_watch = asyncio.create_task(self._certificate.watch())
            context = self._certificate.context if self._certificate is not None else None
            self._site = web.TCPSite(self._runner, host, port, ssl_context=context)
            try:
                await self._site.start()
            except OSError as exc:
                raise BindFailed(s.listen, "the gateway's HTTP", exc.strerror) from None
        except BaseException:
            await self.stop()
            raise
        log.info("gateway serving", extra={"url": self.url, "routing": list(self._routing.targets)})

    async def stop(self) -> None:
        if self._certificate_watch is not None:
            self._certificate_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._certificate_watch
            self._certificate_watch = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = self._site = None
        if self.turns is not None:
            await self.turns.drain_reports(self.settings.report_timeout_s)
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._routing is not None:
            await self._routing.close()
            self._routing = None
