"""The configurations compared, each run through the same simulator.

- `no-reuse`: round-robin P and D; D keeps nothing (P's own prefix cache
  still serves what it happens to hold, as vLLM's does by default).
- `vllm-proxy`: vLLM's example proxy: round-robin, one single-use handle per
  conversation forgotten after 450 s, D's default 480 s TTL, no release, no
  prefix check: a pull into a prompt that does not extend the handle serves
  the wrong KV.
- `vllm-proxy-checked`: the same with a token-exact prefix check; a
  mismatch recomputes. The fair safe baseline.
- `prefix-affinity`: precise prefix-cache-aware routing to P (llm-d style:
  P's cached blocks from KV events, its queue from load reports plus the
  work the router sent since); no D->P reuse, D keeps nothing.
- `cache-aware`: vllm-router's default policy in P/D mode, as its users run
  it: each role's node from the router's own record of the prompts it sent
  (longest prefix match above 30% of the prompt, else the node it sent the
  least), by in-flight requests only when far out of balance; no D->P reuse,
  D keeps nothing.
- `decode-radix`: SGLang's decode-side radix cache: D keeps its finished
  turns' blocks unpinned in its free memory and is chosen by them, and
  receives from P only what it lacks; P by prefix affinity. No D->P reuse.
- `conditional-disagg`: Dynamo's conditional disaggregation: the same D
  cache and choice of D, and D prefills a turn itself when what its cache
  lacks is short or the prefill queue is long (`decode_cache_router.py`).
- `kvplane`: kvplane's default routing and retention policies, D's TTL 480 s.
- `oracle`: unlimited KV on D and in P's caches, no TTL, every shared
  whole-block prefix pulled, every P cache hit used, P picked from the
  nodes' real queues: a bound that reads the simulator's ground truth.

Each front pays its own hop before P (`control_path_s`): kvplane its Route call, the example
proxies and `cache-aware` what vLLM's example proxy and vllm-router add in the live comparison
(the constants below). `no-reuse`, `prefix-affinity` (no llm-d front was measured) and `oracle`
pay none.

Routing and retention policies are loaded by the same functions the
services use (`load_policy`, `RetentionPipeline.from_config`), so a policy
file can be swapped in by path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvplane.bench.sim.decode_cache_router import DYNAMO_MAX_LOCAL_PREFILL_TOKENS, DecodeCacheRouter
from kvplane.bench.sim.engine import SimConfig, Simulator
from kvplane.bench.sim.fleet import Fleet
from kvplane.bench.sim.retention import DEFAULT_DEMAND_LATENCY_S, EngineOnly, PipelineRetention, Retention
from kvplane.bench.sim.routers import (
    CacheAwareRouter,
    ExampleProxyRouter,
    NoReuseRouter,
    OracleRouter,
    PolicyRouter,
    PrefixAffinityRouter,
    Router,
)
from kvplane.services.eviction.policy.pipeline import DEFAULT_CONFIG
from kvplane.services.routing.policy import RoutingPolicy, load_policy

UNLIMITED_BYTES = 1 << 62
# Each front's hop (seconds): the time it adds to a turn before P and between P and D, on top of
# the engines' own work, derived from the live comparison's record (bench/results/compare.json,
# `python -m kvplane.bench.compare --workload both --concurrency 1,8,32 --repeats 2
# --min-conversations 1`, every front, 2 P + 2 D sim-engines at Qwen3-32B timing on the 2-core
# machine) by `front_hops.front_hop_ms`: at one conversation in flight, the front's later-turn
# TTFT p50 minus the zero-hop client's with the closest prompt-token split, less the prefill of
# the tokens it computed beyond that client's, averaged over workloads A and B; never less than
# what is timed on the front's path, nor below 0. tests/unit/test_sim_front_hops.py holds these
# to that record.
#
# At commit 9d4a433, at one conversation in flight: kvplane's gateway 4.9 ms (its own timing of
# the Route call over gRPC; its TTFT excess averages -13.3 ms: -16.2 ms on A, -10.3 ms on B), the
# gateway routing in its own process 3.2 ms (its Route call; the excess -8.4 and -10.3 ms),
# vllm-router 0 (-6.6 and -19.7 ms), the example proxy 0 (+2.1 and -15.2 ms). One block at one in
# flight is four later turns, and repeats differ by 10-30 ms: these say which front adds tens of
# ms and which does not. The records before gave 5.0, 6.4, 0 and 17.1 ms (72f18b8) and 33.2, 25.9
# (vllm-router) and 39.5 ms (538fe24), when kvplane's Route call itself took 14-39 ms.
MEASURED_ROUTE_S = 0.004901
COLOCATED_ROUTE_S = 0.003188
VLLM_ROUTER_HOP_S = 0.0
EXAMPLE_PROXY_HOP_S = 0.0
# From an engine's cache change to routing's view of it: the node agent's coalescing interval
# (100 ms, `connector.node_agent.prefix_cache`) at worst, plus its stream's hop.
EVENT_LAG_S = 0.105


@dataclass(frozen=True, slots=True)
class Baseline:
    name: str
    # "none", "proxy", "proxy-checked", "affinity", "cache-aware", "decode-cache", "policy" or
    # "oracle".
    router: str
    # None: no control-plane retention; otherwise a RetentionPipeline config.
    retention: Mapping[str, Any] | None = None
    # D's TTL in seconds (None: the cluster's; inf: never; 0: D keeps nothing).
    engine_ttl_s: float | None = None
    unlimited_memory: bool = False
    # A routing policy file for `policy` (empty: the packaged default).
    routing_policy: str = ""
    # Seconds between load reports (None: the config's; 0: always current).
    report_interval_s: float | None = None
    # Seconds the front adds to a turn (its hop; modelled before P): None, the config's.
    control_path_s: float | None = None
    # `policy` only: prefill engines' KV events reach routing this late (s), each lost with
    # `event_loss`; None: no events (routing knows P's caches from its own record alone).
    event_lag_s: float | None = None
    event_loss: float = 0.0
    # `affinity` only: every D offloads each finished turn's KV to its host tier, and P reads a
    # prompt's blocks from the D whose host tier leads P's own cache by this many tokens (llm-d's
    # P/D + P2P path). Only where D has a host tier (`ClusterSpec.decode_host_bytes`).
    p2p_min_lead_tokens: int | None = None
    # `decode-cache` only: D prefills a turn itself when its cache lacks at most this many of the
    # prompt's tokens (or the prefill queue is full); None: P prefills every turn.
    max_local_prefill_tokens: int | None = None
    # `policy` only: the front lets routing send a turn to its holder D alone (kvplane's gateway with
    # `gateway.prefill_on_decode`): routing's `prefill_on_decode` decision, by its policy's rule.
    prefill_on_decode: bool = False

    @property
    def needs_host_tier(self) -> bool:
        """Whether the baseline is meaningful only on a fleet whose decode nodes have host memory."""
        return self.p2p_min_lead_tokens is not None


# llm-d's P/D + P2P guide: a request is given a KV source when a peer's CPU tier holds at least
# this many more tokens of its prompt than the chosen prefill node's cache.
LLM_D_P2P_MIN_LEAD_TOKENS = 2048


BASELINES: dict[str, Baseline] = {
    b.name: b
    for b in (
        Baseline("no-reuse", "none", engine_ttl_s=0.0),
        Baseline("vllm-proxy", "proxy", engine_ttl_s=480.0, control_path_s=EXAMPLE_PROXY_HOP_S),
        Baseline(
            "vllm-proxy-checked", "proxy-checked", engine_ttl_s=480.0, control_path_s=EXAMPLE_PROXY_HOP_S
        ),
        Baseline("prefix-affinity", "affinity", engine_ttl_s=0.0),
        # llm-d's P/D + P2P path: prefix-affinity routing, D offloads every turn to host memory.
        Baseline("llm-d-p2p", "affinity", engine_ttl_s=0.0, p2p_min_lead_tokens=LLM_D_P2P_MIN_LEAD_TOKENS),
        Baseline("cache-aware", "cache-aware", engine_ttl_s=0.0, control_path_s=VLLM_ROUTER_HOP_S),
        # D keeps a prefix cache of its own (unpinned): SGLang's decode-side radix cache, and
        # Dynamo's conditional disaggregation on top of it.
        Baseline("decode-radix", "decode-cache", engine_ttl_s=0.0),
        Baseline(
            "conditional-disagg",
            "decode-cache",
            engine_ttl_s=0.0,
            max_local_prefill_tokens=DYNAMO_MAX_LOCAL_PREFILL_TOKENS,
        ),
        Baseline("kvplane", "policy", DEFAULT_CONFIG, engine_ttl_s=480.0, control_path_s=MEASURED_ROUTE_S),
        # kvplane with prefill engines' KV events: delivered at once, and with a realistic lag
        # (the node agent coalesces deltas every 100 ms; a stream hop) and 1% of them lost.
        Baseline(
            "kvplane-events",
            "policy",
            DEFAULT_CONFIG,
            engine_ttl_s=480.0,
            control_path_s=MEASURED_ROUTE_S,
            event_lag_s=0.0,
        ),
        Baseline(
            "kvplane-events-lossy",
            "policy",
            DEFAULT_CONFIG,
            engine_ttl_s=480.0,
            control_path_s=MEASURED_ROUTE_S,
            event_lag_s=EVENT_LAG_S,
            event_loss=0.01,
        ),
        # kvplane-events whose gateway lets the holder D prefill short turns itself.
        Baseline(
            "kvplane-decode-prefill",
            "policy",
            DEFAULT_CONFIG,
            engine_ttl_s=480.0,
            control_path_s=MEASURED_ROUTE_S,
            event_lag_s=0.0,
            prefill_on_decode=True,
        ),
        Baseline("oracle", "oracle", engine_ttl_s=float("inf"), unlimited_memory=True),
    )
}


# The baselines a user would pick instead of kvplane: every configuration but kvplane's own and
# the oracle (a bound, not a contender).
CONTENDERS: tuple[str, ...] = tuple(n for n, b in BASELINES.items() if b.router not in ("policy", "oracle"))


@dataclass(frozen=True, slots=True)
class RunOptions:
    """How kvplane's policies are driven: see `PolicyRouter` and `PipelineRetention`."""

    route_candidates: int = 0
    retention_interval_s: float = 1.0
    seed: int = 0
    # Simulated seconds from a decode node's KV demand to the release that answers it.
    demand_latency_s: float = DEFAULT_DEMAND_LATENCY_S


def simulator_for(baseline: Baseline, config: SimConfig, options: RunOptions | None = None) -> Simulator:
    options = options or RunOptions()
    cluster = config.cluster
    if baseline.engine_ttl_s is not None:
        cluster = replace(cluster, engine_ttl_s=baseline.engine_ttl_s)
    if baseline.unlimited_memory:
        cluster = replace(
            cluster, decode_kv_capacity_bytes=UNLIMITED_BYTES, prefill_cache_bytes=UNLIMITED_BYTES
        )
    tiered = cluster.decode_host_bytes > 0
    if tiered and baseline.p2p_min_lead_tokens is not None:
        cluster = replace(cluster, decode_offload_all=True)
    if baseline.router == "decode-cache" or baseline.prefill_on_decode:
        # D's own prefix cache: vLLM's D keeps one; kvplane's D prefills from it (its KV events).
        cluster = replace(cluster, decode_prefix_cache=True)
    config = replace(config, cluster=cluster)
    if baseline.report_interval_s is not None:
        config = replace(config, load_report_interval_s=baseline.report_interval_s)
    if baseline.control_path_s is not None:
        config = replace(config, control_path_s=baseline.control_path_s)

    def router(fleet: Fleet) -> Router:
        seed = options.seed
        if baseline.router == "none":
            return NoReuseRouter(fleet, seed)
        if baseline.router == "proxy":
            return ExampleProxyRouter(fleet, seed=seed)
        if baseline.router == "proxy-checked":
            return ExampleProxyRouter(fleet, checked=True, seed=seed)
        if baseline.router == "affinity":
            return PrefixAffinityRouter(fleet, seed, baseline.p2p_min_lead_tokens if tiered else None)
        if baseline.router == "cache-aware":
            return CacheAwareRouter(fleet)
        if baseline.router == "decode-cache":
            return DecodeCacheRouter(fleet, seed, baseline.max_local_prefill_tokens)
        if baseline.router == "oracle":
            return OracleRouter(fleet, config.digest_block_size, seed)
        policy = RoutingPolicy(
            load_policy(Path(baseline.routing_policy) if baseline.routing_policy else None)
        )
        return PolicyRouter(
            fleet,
            policy,
            config.digest_block_size,
            candidates=options.route_candidates,
            seed=options.seed,
            events=None if baseline.event_lag_s is None else (baseline.event_lag_s, baseline.event_loss),
            prefill_on_decode=baseline.prefill_on_decode,
        )

    def retention(fleet: Fleet) -> Retention:
        if baseline.retention is None:
            return EngineOnly()
        return PipelineRetention(
            fleet, baseline.retention, options.retention_interval_s, options.demand_latency_s
        )

    return Simulator(config, router, retention)
