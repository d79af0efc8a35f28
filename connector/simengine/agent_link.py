"""A sim-engine on kvplane's control plane, wired the way the vLLM connector is.

``ConnectorObserver`` does in the simulator what ``kvplane.connector.vllm_nixl``
does inside vLLM, with the same helpers:

- P side: ``check_pull`` verifies D's handle against the prompt with
  ``kvplane.connector.prefix_check`` and clips it before the pull is sized;
- D side: a retained handle gets kvplane's handle id, token digests and tail
  digest, and is built by ``kvplane.services.common.model.handles.EngineHandles``,
  as the vLLM connector's are; when the request carries kvplane's tenant and
  conversation keys it is published through the node agent, and reported
  released when freed. A handle moved to the host tier is published again as a
  relocation of the one before (``CacheHandle.relocates_handle_id``): new blocks,
  tier HOST, the same request; the publish's outcome settles the move (the engine
  frees the cache blocks only once the relocation is stored).

``start_node_agent`` registers the engine as a node (same incarnation as the
engine's lease stamps), reports its load when it changes (and every
``load_heartbeat_s`` while it does not), applies release and drain commands
through the engine's thread-safe ``EngineControl``, and reports the engine's
KV demand (``SimEngine.kv_demand_blocks``) the moment requests start or stop
waiting for KV memory, as the vLLM connector does from its scheduler hooks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry import propagate

from kvplane.connector import prefix_check
from kvplane.connector.node_agent import NodeAgent, NodeAgentSettings
from kvplane.connector.simengine.engine import SimEngine
from kvplane.connector.simengine.engine_hooks import EngineLoad
from kvplane.connector.simengine.metrics import SimEngineMetrics
from kvplane.connector.simengine.settings import SimEngineSettings
from kvplane.connector.simengine.side_channel import format_host
from kvplane.services.common.model.handles import CacheHandle, EngineHandles, KvTier
from kvplane.services.common.model.nodes import Fingerprint, Node, NodeLoad, NodeRole

log = logging.getLogger(__name__)

_ROLES = {"prefill": NodeRole.PREFILL, "decode": NodeRole.DECODE, "both": NodeRole.BOTH}


class ConnectorObserver:
    """EngineObserver with kvplane's connector behaviour. Event-loop thread only."""

    def __init__(
        self,
        settings: SimEngineSettings,
        metrics: SimEngineMetrics | None = None,
        agent: NodeAgent | None = None,
    ) -> None:
        self._settings = settings
        # D's handles after a turn: the same builder as the vLLM connector's.
        self._handles = EngineHandles(
            settings.model, settings.block_size, settings.bytes_per_block, settings.expiry_margin_s
        )
        self._metrics = metrics
        self.agent = agent
        # request id -> the published handle of blocks still held
        self._held: dict[str, CacheHandle] = {}

    def check_pull(self, kv_transfer_params: dict[str, Any], prompt_token_ids: Sequence[int]) -> None:
        check = prefix_check.check_pull(
            kv_transfer_params, prompt_token_ids, require_digests=self._settings.require_digests
        )
        if self._metrics is not None and check.outcome is not prefix_check.PullOutcome.NOT_A_PULL:
            self._metrics.pull_check(check.outcome.value)

    def on_handle_retained(
        self,
        kv_transfer_params: dict[str, Any],
        all_token_ids: Sequence[int],
        retained_bytes: int,
        request_kv_transfer_params: Mapping[str, Any],
    ) -> None:
        finished = self._handles.finished(
            kv_transfer_params,
            request_kv_transfer_params,
            all_token_ids,
            new_id=uuid.uuid4().hex,
            now_unix_s=time.time(),
            engine_clock_s=time.perf_counter(),
        )
        if finished.problem:
            log.warning(
                "not publishing %s: %s", kv_transfer_params.get("remote_request_id"), finished.problem
            )
        handle = finished.handle
        if handle is None:
            return  # not routed by kvplane: nothing to publish
        self._held[handle.vllm.remote_request_id] = handle
        if self.agent is not None:
            # Called inside the request's span: the publish joins the turn's trace.
            trace_context: dict[str, str] = {}
            propagate.inject(trace_context)
            self.agent.publish(handle, trace_context)

    def on_blocks_freed(self, request_id: str, read: bool) -> None:
        if self._held.pop(request_id, None) is not None and self.agent is not None:
            self.agent.report_released(request_id, after_read=read)

    def on_handle_moved(
        self, request_id: str, kv_transfer_params: dict[str, Any], settle: Callable[[bool], None]
    ) -> None:
        was = self._held.get(request_id)
        if was is None or self.agent is None:
            settle(True)  # never published: nobody can check it out, nobody is told where it went
            return
        block_ids = tuple(tuple(int(b) for b in group) for group in kv_transfer_params["remote_block_ids"])
        # The host tier offers it longer than D's TTL: the wall-clock expiry moves as the engine's.
        expiry = kv_transfer_params.get("remote_blocks_expiry_time")
        was_expiry = was.vllm.remote_blocks_expiry_time
        longer_ms = 0
        if isinstance(expiry, float) and was_expiry is not None:
            longer_ms = max(0, int(1000 * (expiry - was_expiry)))
        moved = dataclasses.replace(
            was,
            handle_id=uuid.uuid4().hex,
            vllm=dataclasses.replace(was.vllm, remote_block_ids=block_ids, remote_blocks_expiry_time=expiry),
            tier=KvTier.HOST,
            relocates_handle_id=was.handle_id,
            wall_expiry_unix_ms=was.wall_expiry_unix_ms + longer_ms,
        )
        self._held[request_id] = dataclasses.replace(moved, relocates_handle_id="")
        # The engine frees the cache blocks once the control plane stores the relocation.
        self.agent.publish(moved, {}, on_outcome=settle)


def node_for(engine: SimEngine, http_url: str) -> Node:
    """The engine as a kvplane node (the agent fills in the incarnation)."""
    s = engine.settings
    return Node(
        node_id=s.node_id or engine.engine_id,
        incarnation="",
        role=_ROLES[s.role],
        engine_id=engine.engine_id,
        http_url=http_url,
        side_channel_host=s.advertised_side_channel_host,
        side_channel_port=engine.side_channel_port,
        # Blocks move only between sim-engines of one model and one block geometry.
        fingerprint=Fingerprint(s.model, "sim", f"sim-{s.block_size}tok-{s.bytes_per_block}B"),
        block_size=s.block_size,
        kv_capacity_bytes=s.num_blocks * s.bytes_per_block,
        kv_bytes_per_token=s.bytes_per_block // s.block_size,
    )


def node_load(load: EngineLoad) -> NodeLoad:
    return NodeLoad(
        node_id="",
        incarnation="",
        queued_requests=load.queued_requests,
        queued_prefill_tokens=load.queued_prefill_tokens,
        running_requests=load.running_requests,
        free_kv_blocks=load.free_kv_blocks,
        total_kv_blocks=load.total_kv_blocks,
        retained_bytes=load.retained_bytes,
        waiting_kv_blocks=load.waiting_kv_blocks,
    )


def agent_settings(s: SimEngineSettings) -> NodeAgentSettings:
    """The node agent's settings from the engine's."""
    return NodeAgentSettings(
        metadata_target=s.control_plane,
        eviction_target=s.eviction,
        load_interval_s=s.load_interval_s,
        load_heartbeat_s=max(s.load_heartbeat_s, s.load_interval_s),
        credentials=s.credentials(),
        routing_targets=tuple(t.strip() for t in s.routing.split(",") if t.strip()),
        release_linger_s=s.release_linger_s,
    )


def start_node_agent(engine: SimEngine, http_url: str, observer: ConnectorObserver | None) -> NodeAgent:
    """Register a started engine with the control plane at ``settings.control_plane``."""
    s = engine.settings

    def on_release(request_id: str) -> None:
        if not engine.release_early(request_id):
            log.info("release command for %s: no longer held", request_id)

    agent = NodeAgent(
        agent_settings(s),
        node_for(engine, http_url),
        lambda: node_load(engine.load()),
        on_release,
        on_drain=engine.drain,
        demand_fn=engine.kv_demand_blocks,
        retained_fn=engine.retained_handle_ids,
        kv_events=s.kv_events_source(),
        # Only an engine with a host tier asks for the order of its moves there, and takes moves.
        on_spill_order=engine.set_spill_order if engine.pool.host_blocks > 0 else None,
        on_move=engine.move_to_host if engine.pool.host_blocks > 0 else None,
    )
    engine.demand_listener = agent.notify_demand
    engine.load_listener = agent.notify_load
    engine.host_tier_listener = agent.set_accepts_moves
    agent.start()
    # Lease stamps and the registered node must name the same incarnation.
    engine.adopt_incarnation(agent.incarnation)
    if observer is not None:
        observer.agent = agent
    return agent


def endpoint(host: str, port: int) -> str:
    return f"http://{format_host(host)}:{port}"
