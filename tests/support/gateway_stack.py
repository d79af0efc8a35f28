"""A whole kvplane stack for gateway tests: real etcd, metadata (with eviction's command channel) and
routing over gRPC, a prefill and a
decode sim-engine (real NIXL) registered through their node agents, and the gateway over HTTP.

The prefill engine registers the URL of a `FaultProxy` in front of it, so a test can make the P leg
fail or stall; the decode engine serves HTTP on ::1, so every decode leg goes to an IPv6 URL.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import SecretStr

from kvplane.connector.simengine.settings import SimEngineSettings
from kvplane.connector.simengine.timing_model import TimingModel
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.devstack.processes import ManagedProcess, http_health_probe, wait_ready
from kvplane.services.gateway.app import Gateway
from kvplane.services.gateway.settings import GatewayKey, GatewaySection
from kvplane.services.process import Component, Installer, ProcessContext, ServiceProcess
from kvplane.services.routing.service import RoutingService
from kvplane.services.settings import KvplaneSettings
from tests.support.polling import until

MODEL = "kvplane-sim"
KEYS = {"acme": "key-acme-0123456789", "globex": "key-globex-0123456789"}
# 50x faster than the modelled GPU; decode steps of 2 ms, so that streaming is visibly incremental.
ENGINE = SimEngineSettings(
    timing=TimingModel(speedup=50), block_size=16, num_blocks=4096, bytes_per_block=4096, side_channel_port=0
)
# D's decode step, in the engine's own time (s) and as run (s).
D_TIMING = TimingModel(speedup=50, decode_step_s=0.1)
DECODE_STEP_S = D_TIMING.decode_step_s / D_TIMING.speedup
# The sim-engines are 50x faster than the cost model's GPU: make pulls clearly worth it, so that
# every continuing turn pulls, whatever the model learns from the fast engines' reports.
TEST_POLICY = """
decode:
  filters: [live, role, same-model, not-draining, same-fingerprint]
  scorers: [{name: holder-affinity, weight: 4}]
  picker: max-score
prefill:
  filters: [live, role, same-model, not-draining, same-fingerprint]
  scorers: [{name: queued-prefill, weight: 1}]
  picker: max-score
pull: {threshold_tokens: 64, expiry_margin_ms: 5000, max_transfer_fraction: 1.0, require_digests: true}
cost_model: {recompute_ms_per_token: 5.0, transfer_bytes_per_ms: 52000000.0, transfer_overhead_ms: 0.1,
  handshake_ms: 0.1}
"""


@dataclass
class Recorded:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]


class FaultProxy:
    """Forwards HTTP to one engine; can fail or stall the next POSTs on request, and records them."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.port = free_port()
        self.seen: list[Recorded] = []
        self._faults: list[tuple[str, float]] = []
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail_next(self, status: int = 500) -> None:
        self._faults.append(("fail", float(status)))

    def stall_next(self, seconds: float) -> None:
        self._faults.append(("stall", seconds))

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{path:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if request.method == "POST":
            body = json.loads(raw) if raw else {}
            self.seen.append(Recorded(request.path, body, dict(request.headers)))
            if self._faults:
                kind, value = self._faults.pop(0)
                if kind == "fail":
                    return web.json_response(
                        {"error": {"message": "injected", "code": 500}}, status=int(value)
                    )
                await asyncio.sleep(value)  # the injected stall
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "traceparent")}
        async with self._session.request(
            request.method, self.target + request.path_qs, data=raw or None, headers=headers
        ) as resp:
            return web.Response(body=await resp.read(), status=resp.status, content_type=resp.content_type)


@dataclass
class EngineProcess:
    process: ManagedProcess
    url: str

    @property
    def name(self) -> str:
        return self.process.name

    async def get(self, session: aiohttp.ClientSession, path: str) -> bytes:
        async with session.get(self.url + path) as resp:
            return await resp.read()

    async def metric(self, session: aiohttp.ClientSession, name: str, **labels: str) -> float:
        return metric_sum((await self.get(session, "/metrics")).decode(), name, **labels)

    def stop(self) -> None:
        self.process.stop()


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        metric, _, rest = series.partition("{")
        if metric == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total


def _spawn(name: str, log_dir: Path, url: str, args: list[str]) -> EngineProcess:
    process = ManagedProcess(
        name,
        [sys.executable, *args],
        log_dir / f"{name}.log",
        env={"PYTHONUNBUFFERED": "1"},
        cwd=Path(__file__).resolve().parents[2],
    )
    process.start()
    return EngineProcess(process, url)


async def _wait_healthy(engine: EngineProcess, timeout_s: float = 90) -> None:
    await wait_ready(engine.process, http_health_probe(engine.url + "/health"), timeout_s)


@dataclass
class TurnResult:
    status: int
    headers: Mapping[str, str]
    body: dict[str, Any] = field(default_factory=dict)
    # Streaming: each parsed data event (not [DONE]) with the time it arrived (perf_counter).
    events: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    raw: str = ""

    @property
    def decision(self) -> str:
        return self.headers.get("x-kvplane-decision", "")

    def output_ids(self) -> list[int]:
        if self.events:
            return [t for _, e in self.events for c in e.get("choices", []) for t in c.get("token_ids", [])]
        return list(self.body["choices"][0].get("token_ids", []))

    def text(self) -> str:
        if self.events:
            parts = []
            for _, e in self.events:
                for c in e.get("choices", []):
                    parts.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
            return "".join(parts)
        choice = self.body["choices"][0]
        return str(choice.get("text") or choice["message"]["content"])


def _routing_installer(kept: list[RoutingService]) -> Installer:
    """Installs routing as `kvplane serve routing` does, keeping its servicer in `kept`."""
    from kvplane.services.routing.app import install_servicer

    def install(ctx: ProcessContext) -> Sequence[Component]:
        servicer, components = install_servicer(ctx)
        kept[:] = [servicer]
        return components

    return install


@dataclass
class GatewayStack:
    etcd: LocalEtcd
    prefix: str
    log_dir: Path
    session: aiohttp.ClientSession
    metadata: ServiceProcess
    routing: ServiceProcess
    routing_settings: KvplaneSettings
    proxy: FaultProxy
    prefill: EngineProcess
    decode: EngineProcess
    gateway: Gateway
    # Every span the gateway ends (sampled at 1.0).
    spans: InMemorySpanExporter
    # What every engine of the stack shares, and every engine process (each stopped at exit).
    engine_common: SimEngineSettings = ENGINE
    engines: list[EngineProcess] = field(default_factory=list)
    # The routing servicer of `routing` (replaced when routing restarts).
    routing_services: list[RoutingService] = field(default_factory=list)

    # -- the services --------------------------------------------------------------

    async def stop_routing(self) -> None:
        await self.routing.stop()

    async def start_routing(self) -> None:
        install = _routing_installer(self.routing_services)
        self.routing = ServiceProcess(self.routing_settings, [install], Telemetry.disabled())
        await self.routing.start()
        await self.wait_nodes()

    async def wait_decode_idle(self, node_id: str = "gw-d") -> None:
        """Waits until routing sees the decode node run and queue nothing, in the load it routes
        by (the node's stream, or etcd's). A turn sent at once after the last one's answer may
        otherwise find its load from before that answer ended, on a machine slow to deliver it."""
        view = self.routing.ctx.view
        [service] = self.routing_services

        def idle() -> bool:
            record = view.nodes.get(node_id)
            if record is None:
                return False
            load = service.streamed_loads.load(record.node, view.load(record.node), time.monotonic())
            return load is not None and load.running_requests == 0 and load.queued_requests == 0

        await until(idle, f"routing to see {node_id} idle", timeout_s=15.0)

    async def wait_nodes(self) -> None:
        view = self.routing.ctx.view
        ok = await view.wait_for(lambda: len(view.nodes) >= 2 and len(view.loads) >= 2, 30)
        assert ok, f"routing never saw both engines: {list(view.nodes)}"

    async def wait_handle(self, tenant: str, conversation: str, *, other_than: str = "") -> str:
        """Waits until routing sees a handle of the conversation (other than `other_than`); its id."""
        view = self.routing.ctx.view

        def present() -> bool:
            record = view.handle(tenant, conversation)
            return record is not None and record.handle.handle_id != other_than

        assert await view.wait_for(present, 15), f"no new handle for {tenant}/{conversation}"
        record = view.handle(tenant, conversation)
        assert record is not None
        return record.handle.handle_id

    async def start_decode(self, node_id: str) -> EngineProcess:
        """One more decode sim-engine, registered as `node_id` (a node of STACK_TOKENS)."""
        port = free_port()
        settings = replace(
            self.engine_common,
            role="decode",
            http_port=port,
            node_id=node_id,
            timing=D_TIMING,
            auth_token=STACK_TOKENS[node_id],
        )
        url = f"http://127.0.0.1:{port}"
        engine = _spawn(node_id, self.log_dir, url, ["-m", "kvplane.connector.simengine", *settings.argv()])
        self.engines.append(engine)
        await _wait_healthy(engine)
        return engine

    # -- talking to the gateway -------------------------------------------------------

    def headers(self, tenant: str | None, conversation: str | None = None, **extra: str) -> dict[str, str]:
        out = dict(extra)
        if tenant is not None:
            out["Authorization"] = f"Bearer {KEYS[tenant]}"
        if conversation is not None:
            out["X-Conversation-Id"] = conversation
        return out

    async def post(self, path: str, body: dict[str, Any], headers: Mapping[str, str]) -> TurnResult:
        async with self.session.post(self.gateway.url + path, json=body, headers=headers) as resp:
            if not body.get("stream"):
                raw = await resp.text()
                parsed = json.loads(raw) if raw else {}
                return TurnResult(resp.status, dict(resp.headers), parsed, raw=raw)
            result = TurnResult(resp.status, dict(resp.headers))
            async for line in resp.content:
                text = line.decode().strip()
                result.raw += line.decode()
                if text.startswith("data: ") and text != "data: [DONE]":
                    result.events.append((time.perf_counter(), json.loads(text[6:])))
            return result

    async def gateway_metric(self, name: str, **labels: str) -> float:
        async with self.session.get(self.gateway.url + "/metrics") as resp:
            return metric_sum(await resp.text(), name, **labels)


def _write_policy(log_dir: Path) -> str:
    path = log_dir / "routing_policy.yaml"
    path.write_text(TEST_POLICY)
    return str(path)


# The control plane's tokens in the stack: the engines' node tokens and the gateway's.
# gw-d2 is a decode engine a test may start (`GatewayStack.start_decode`).
STACK_TOKENS = {name: f"{name}-{uuid.uuid4().hex}" for name in ("gw-p", "gw-d", "gw-d2", "gateway")}


@asynccontextmanager
async def gateway_stack(
    etcd: LocalEtcd,
    prefix: str,
    log_dir: Path,
    *,
    traced: bool = False,
    max_model_len: int | None = None,
) -> AsyncIterator[GatewayStack]:
    """Starts everything; stops every process and server on exit, even after a failure.

    `traced`: the services trace as in production (OpenTelemetry's variables, default sampling)
    instead of not at all. `max_model_len`: the engines' context, which the gateway then
    enforces too (default: the sim-engine's).
    """

    def telemetry(service: str) -> Telemetry:
        return Telemetry.create(service) if traced else Telemetry.disabled()

    from kvplane.services.eviction.app import install as install_eviction
    from kvplane.services.metadata.app import install as install_metadata

    base = {
        "etcd": {"endpoints": [etcd.endpoint], "prefix": prefix, "request_timeout_s": 1.0},
        "telemetry": {"metrics_port": 0, "json_logs": False},
        # Token mode, as a deployment runs it: each engine's node token, the gateway's operator token.
        "auth": {
            "mode": "token",
            "tokens": [
                {"token": STACK_TOKENS["gw-p"], "kind": "node", "name": "gw-p"},
                {"token": STACK_TOKENS["gw-d"], "kind": "node", "name": "gw-d"},
                {"token": STACK_TOKENS["gw-d2"], "kind": "node", "name": "gw-d2"},
                {"token": STACK_TOKENS["gateway"], "kind": "operator", "name": "gateway"},
            ],
        },
    }
    meta_settings = KvplaneSettings.model_validate(
        {
            **base,
            "grpc": {"listen": f"127.0.0.1:{free_port()}", "grace_s": 0.2},
            # Eviction delivers release commands to the engines; only the TTL rule, so that no
            # handle a test means to pull is released early.
            "eviction": {"policy": {"policies": [{"name": "max_age", "engine_ttl_s": 480, "margin_s": 30}]}},
        }
    )
    routing_settings = KvplaneSettings.model_validate(
        {
            **base,
            "grpc": {"listen": f"127.0.0.1:{free_port()}", "grace_s": 0.2},
            "routing": {"policy_file": _write_policy(log_dir), "checkout_timeout_s": 1.0},
        }
    )
    cleanups: list[Any] = []
    spans = InMemorySpanExporter()
    session = aiohttp.ClientSession()
    engines: list[EngineProcess] = []
    try:
        metadata = ServiceProcess(
            meta_settings, [install_metadata, install_eviction], telemetry("kvplane-metadata")
        )
        await metadata.start()
        cleanups.append(metadata.stop)
        routing_services: list[RoutingService] = []
        routing = ServiceProcess(
            routing_settings, [_routing_installer(routing_services)], telemetry("kvplane-routing")
        )
        await routing.start()
        p_port, d_port = free_port(), free_port("::1")
        proxy = FaultProxy(f"http://127.0.0.1:{p_port}")
        await proxy.start()
        cleanups.append(proxy.stop)
        common = replace(
            ENGINE,
            control_plane=f"127.0.0.1:{metadata.grpc_port}",
            load_interval_s=0.2,
            # Loads streamed to routing, as the dev stack's engines stream them: routing then sees
            # a request's end at once (a D prefills a turn only if it holds up no one's answer).
            routing=routing_settings.grpc.listen,
            max_model_len=ENGINE.max_model_len if max_model_len is None else max_model_len,
        )
        p = replace(common, role="prefill", http_port=p_port, node_id="gw-p", auth_token=STACK_TOKENS["gw-p"])
        d = replace(
            common,
            role="decode",
            http_host="::1",
            http_port=d_port,
            node_id="gw-d",
            timing=D_TIMING,
            auth_token=STACK_TOKENS["gw-d"],
        )
        engines.append(
            _spawn(
                "P",
                log_dir,
                f"http://127.0.0.1:{p_port}",
                ["-m", "tests.support.advertised_engine", "--advertise-url", proxy.url, *p.argv()],
            )
        )
        engines.append(
            _spawn(
                "D",
                log_dir,
                f"http://[::1]:{d_port}",
                ["-m", "kvplane.connector.simengine", *d.argv()],
            )
        )
        for engine in engines:
            await _wait_healthy(engine)
        gateway = Gateway(
            GatewaySection(
                listen=f"127.0.0.1:{free_port()}",
                routing=[routing_settings.grpc.listen],
                routing_token=SecretStr(STACK_TOKENS["gateway"]),
                routing_timeout_s=2.0,
                api_keys=[GatewayKey(token=SecretStr(key), tenant=tenant) for tenant, key in KEYS.items()],
                fallback_prefill_url=proxy.url,
                fallback_decode_url=engines[1].url,
                prefill_timeout_s=2.0,
                decode_timeout_s=30.0,
                decode_idle_timeout_s=5.0,
                models=[MODEL],
                # Every turn through P: these stacks test the P leg and its pulls (a test of D
                # alone sets it on, as the endpoint picker's does).
                prefill_on_decode=False,
                **({"max_model_len": max_model_len} if max_model_len is not None else {}),
            ),
            Telemetry.create("kvplane-gateway", exporter=spans),
        )
        await gateway.start()
        cleanups.append(gateway.stop)
        stack = GatewayStack(
            etcd,
            prefix,
            log_dir,
            session,
            metadata,
            routing,
            routing_settings,
            proxy,
            engines[0],
            engines[1],
            gateway,
            spans,
            common,
            engines,
            routing_services,
        )
        cleanups.append(lambda: stack.routing.stop())
        await stack.wait_nodes()
        yield stack
    finally:
        for cleanup in reversed(cleanups):
            try:
                await cleanup()
            except Exception as exc:  # keep stopping the rest
                print(f"cleanup failed: {exc!r}", file=sys.stderr)
        for engine in engines:
            await asyncio.to_thread(engine.stop)
        await session.close()
