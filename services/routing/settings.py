"""`routing:` in the settings file (KVPLANE_ROUTING__<FIELD> in the environment)."""

from __future__ import annotations

from pydantic import Field

from kvplane.services.common.settings import Section


class RoutingSection(Section):
    # Routing policy YAML (services/routing/policy/config.py); empty: the packaged default.
    policy_file: str = ""
    # Longest a Route waits on the check-out transaction before recomputing, seconds.
    checkout_timeout_s: float = Field(1.0, gt=0)
    # D's decoder_kv_blocks_ttl: how long a handle published by ReportTurn lives, seconds.
    decode_kv_ttl_s: float = Field(480.0, gt=0)
    # Subtracted from that life to give the handle's wall-clock expiry, seconds.
    expiry_margin_s: float = Field(5.0, ge=0)
    # Conversations whose last prefill node is remembered (best effort, per replica).
    max_tracked_conversations: int = Field(100_000, ge=0)
    # A conversation counts toward its prefill node's load for this long after its last routed
    # turn, where a new conversation is placed (the fewest active ones), seconds.
    active_conversation_s: float = Field(60.0, gt=0)
    # Routes remembered for ReportTurn (per replica).
    max_tracked_routes: int = Field(100_000, ge=0)
    # Longest a Route waits for the engine's publish of the handle its caller says the previous
    # turn retained (RouteRequest.awaited_handle_id), and only when no prefill node is believed to
    # hold the history already, seconds. Also bounds EndConversation's wait for that publish.
    publish_wait_s: float = Field(0.3, ge=0)
    # From a Route to its request reaching the engine (the caller's hop to it), ms: a load
    # report taken earlier cannot show the routed work yet, and one taken later is trusted to.
    # Too long, and every report taken in between counts the turn twice (its own count and the
    # router's); too short, and one taken before the request arrived drops it until the next
    # report, which the engine streams when the request arrives. Measured from Route's end to
    # the prefill engine's request: 2.2 ms p50, 14 ms p99 at 32 turns in flight on 2 cores.
    send_delay_ms: int = Field(30, ge=0)
    # Whether D takes the turn only once P is done with it (vLLM's disaggregated flow), so
    # that only then its load reports show the turn's KV; false: D reserves it when routed.
    decode_after_prefill: bool = True
    # A prefill node's prefix-cache view from its engine's events (StreamPrefixCache) is used
    # only when a message came within this many seconds; else the router's own record, seconds.
    # Three of the node agents' keep-alives (one every 2 s): one lost or late is not staleness.
    prefix_cache_stale_after_s: float = Field(6.0, gt=0)
    # Whether the prefill engines' KV-cache events (their node agents' StreamPrefixCache) feed
    # this replica's view of their caches. false: the router's own record alone, as without
    # events (their streamed loads still count); to set a misbehaving publisher aside, or to
    # measure what the events bring against the same engines.
    engine_cache_events: bool = True
    # Nodes whose prefix-cache view a replica keeps, and block ids per node (a view that
    # outgrows it is dropped until the node's next snapshot).
    prefix_cache_max_nodes: int = Field(10_000, gt=0)
    prefix_cache_max_blocks: int = Field(4_000_000, gt=0)
