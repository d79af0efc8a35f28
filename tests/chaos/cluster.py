"""The chaos cluster: a 3-member etcd on loopback, metadata, two routing replicas and eviction
as separate processes, 2 prefill and 2 decode sim-engines, and 2 gateways that know both
routing replicas.

Every process can be killed (SIGKILL) and started again, or frozen (SIGSTOP). One decode
engine (d1) reaches the control plane through a proxy that can cut it off.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc

from kvplane.connector.simengine.settings import Role, SimEngineSettings
from kvplane.connector.simengine.timing_model import TimingModel
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.store import Store, StoreSettings
from kvplane.services.dev.local_etcd import LocalEtcdCluster
from kvplane.services.devstack.credentials import GATEWAY, OPERATOR, DevCredentials
from kvplane.services.devstack.processes import (
    ManagedProcess,
    grpc_health_probe,
    http_health_probe,
    wait_ready,
)
from kvplane.services.devstack.stack import engine_env
from kvplane.v1 import metadata_pb2, metadata_pb2_grpc
from tests.chaos.tcp_proxy import CuttableProxy

MODEL = "sim-model"
API_KEY = "chaos-key"
TENANT = "chaos"
PREFIX = "/kvplane/v1/"
# A checked-out handle nobody read is released this long after its check-out, seconds.
CLAIM_DEADLINE_S = 10.0
# Engines timed as the model they simulate: a pull then beats recomputing a long history.
SPEEDUP = 1.0
# Longer than the whole run: no handle reaches the engines' TTL while the ledger is checked.
DECODER_TTL_S = 900.0
START_TIMEOUT_S = 180.0


def _kvplane(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvplane.services.cli", *args]


@dataclass
class Proc:
    """A managed process and how to tell it is ready."""

    managed: ManagedProcess
    ready: Callable[[], Awaitable[bool]]
    kind: str

    @property
    def name(self) -> str:
        return self.managed.name

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        self.managed.start()
        await wait_ready(self.managed, self.ready, timeout_s)

    def kill(self) -> None:
        self.managed.kill()

    def freeze(self) -> None:
        self.managed.freeze()

    def thaw(self) -> None:
        self.managed.thaw()


@dataclass
class ChaosCluster:
    run_dir: Path
    etcd: LocalEtcdCluster
    credentials: DevCredentials
    procs: dict[str, Proc] = field(default_factory=dict)
    engine_urls: dict[str, str] = field(default_factory=dict)
    gateway_urls: list[str] = field(default_factory=list)
    # d1's links to metadata and eviction: cutting both partitions it from the control plane.
    proxy: CuttableProxy | None = None
    eviction_proxy: CuttableProxy | None = None
    metadata_target: str = ""

    @property
    def etcd_endpoints(self) -> list[str]:
        # By name: the stores resolve each, and fail over between them.
        return [f"localhost:{m.client_port}" for m in self.etcd.members]

    def store(self) -> Store:
        return Store(
            StoreSettings(endpoints=tuple(self.etcd_endpoints), prefix=PREFIX, request_timeout_s=1.0)
        )

    def operator_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.credentials.operator_metadata()

    async def stop(self) -> None:
        try:
            for proc in reversed(list(self.procs.values())):
                proc.thaw()
                proc.managed.stop(timeout_s=5)
            for proxy in (self.proxy, self.eviction_proxy):
                if proxy is not None:
                    await proxy.stop()
        finally:
            self.etcd.cleanup()


# Routing's policy with a cost model that favours pulls and barely learns: on a loaded 2-core
# machine the measured transfers would soon teach it to recompute everything, and the faults
# are meant to hit conversations that pull.
CHAOS_POLICY = """
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
  handshake_ms: 0.1, alpha: 0.001}
"""


def _services_config(cluster: ChaosCluster, node_ids: list[str]) -> Path:
    base = json.loads(cluster.credentials.services_config(node_ids).read_text())
    base["etcd"] = {"endpoints": cluster.etcd_endpoints, "prefix": PREFIX, "request_timeout_s": 1.0}
    base["metadata"] = {
        "claim_deadline_s": CLAIM_DEADLINE_S,
        "claim_sweep_interval_s": 1.0,
    }
    base["telemetry"] = {"metrics_port": 0, "json_logs": False}
    policy = cluster.run_dir / "routing_policy.yaml"
    policy.write_text(CHAOS_POLICY)
    base["routing"] = {"policy_file": str(policy)}
    path = cluster.run_dir / "services.json"
    path.write_text(json.dumps(base))  # JSON is YAML
    return path


def _nodes_registered(
    target: str, count: int, metadata: tuple[tuple[str, str], ...]
) -> Callable[[], Awaitable[bool]]:
    async def probe() -> bool:
        async with grpc.aio.insecure_channel(target) as channel:
            nodes = await metadata_pb2_grpc.MetadataServiceStub(channel).ListNodes(
                metadata_pb2.ListNodesRequest(), timeout=1, metadata=metadata
            )
            return len(nodes.nodes) >= count

    return probe


async def start_cluster(run_dir: Path) -> ChaosCluster:
    """Starts everything; `run_dir` (which exists) gets the logs and credentials."""
    etcd = LocalEtcdCluster(3)
    etcd.start()
    cluster = ChaosCluster(run_dir, etcd, DevCredentials(run_dir / "credentials"))
    try:
        await _start_processes(cluster)
    except BaseException:
        await cluster.stop()
        raise
    return cluster


async def _start_processes(cluster: ChaosCluster) -> None:
    run_dir = cluster.run_dir
    node_ids = ["p0", "p1", "d0", "d1"]
    config = str(_services_config(cluster, node_ids))
    # Process name: the service it serves.
    services = {"metadata": "metadata", "routing": "routing", "routing-b": "routing", "eviction": "eviction"}
    ports = {name: free_port() for name in services}
    targets = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    cluster.metadata_target = targets["metadata"]
    for name, service in services.items():
        managed = ManagedProcess(
            name,
            _kvplane("serve", service, "--config", config, "--listen", targets[name], "--metrics-port", "0"),
            run_dir / f"{name}.log",
        )
        cluster.procs[name] = Proc(managed, grpc_health_probe(targets[name]), "service")
    cluster.proxy = CuttableProxy("127.0.0.1", ports["metadata"])
    await cluster.proxy.start()
    evict_proxy = cluster.eviction_proxy = CuttableProxy("127.0.0.1", ports["eviction"])
    await evict_proxy.start()
    for node_id in node_ids:
        role: Role = "prefill" if node_id.startswith("p") else "decode"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cluster.engine_urls[node_id] = url
        # d1 reaches the control plane through the cuttable proxies.
        control = cluster.proxy.address if node_id == "d1" else targets["metadata"]
        evict = evict_proxy.address if node_id == "d1" else targets["eviction"]
        sim = SimEngineSettings(
            role=role,
            node_id=node_id,
            http_host="127.0.0.1",
            http_port=port,
            side_channel_host="127.0.0.1",
            side_channel_port=free_port(),
            control_plane=control,
            eviction=evict,
            auth_token_file=cluster.credentials.token_file(node_id),
            timing=TimingModel(speedup=SPEEDUP),
            decoder_kv_blocks_ttl=DECODER_TTL_S,
            model=MODEL,
            num_blocks=16384,
            load_interval_s=0.25,
            # Without a prefix cache P holds no history between turns: each turn pulls it, or
            # recomputes it, which is what the faults are to exercise.
            enable_prefix_caching=role != "prefill",
        )
        managed = ManagedProcess(
            node_id,
            _kvplane("sim-engine", *sim.argv()),
            run_dir / f"engine-{node_id}.log",
            env=engine_env(),
        )
        cluster.procs[node_id] = Proc(managed, http_health_probe(url + "/health"), "engine")
    gateway_config = run_dir / "gateway.json"
    gateway_config.write_text(
        json.dumps(
            {
                "gateway": {
                    "api_keys": [{"token": API_KEY, "tenant": TENANT}],
                    # Both gateways salt a tenant's prompts alike, so P's prefix cache serves either.
                    "cache_salt_key": "chaos-cache-salt-key-0123456789abcdef",
                    "routing_token_file": cluster.credentials.token_file(GATEWAY),
                    # Every turn through P: the faults' targets are about the pull path, and an
                    # idle D would otherwise prefill some turns itself.
                    "prefill_on_decode": False,
                }
            }
        )
    )
    for name in ("gateway-a", "gateway-b"):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cluster.gateway_urls.append(url)
        managed = ManagedProcess(
            name,
            _kvplane(
                *("gateway", "--config", str(gateway_config), "--listen", f"127.0.0.1:{port}"),
                *("--routing", f"{targets['routing']},{targets['routing-b']}", "--model", MODEL),
                *(
                    "--fallback-prefill",
                    cluster.engine_urls["p0"],
                    "--fallback-decode",
                    cluster.engine_urls["d0"],
                ),
                *("--tokenize-url", cluster.engine_urls["p0"]),
            ),
            run_dir / f"{name}.log",
            env={"KVPLANE_TELEMETRY__METRICS_PORT": "0"},
        )
        cluster.procs[name] = Proc(managed, http_health_probe(url + "/health"), "gateway")
    for proc in cluster.procs.values():
        proc.managed.start()
    for proc in cluster.procs.values():
        await wait_ready(proc.managed, proc.ready, START_TIMEOUT_S)
    registered = _nodes_registered(targets["metadata"], len(node_ids), cluster.operator_metadata())
    await wait_ready(cluster.procs["metadata"].managed, registered, START_TIMEOUT_S)


async def engine_state(session: aiohttp.ClientSession, url: str) -> dict[str, object]:
    async with session.get(url + "/sim/state", timeout=aiohttp.ClientTimeout(total=5)) as resp:
        state: dict[str, object] = await resp.json()
        return state


__all__ = ["OPERATOR", "ChaosCluster", "Proc", "engine_state", "start_cluster"]
