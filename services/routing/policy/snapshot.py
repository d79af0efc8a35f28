"""The immutable inputs of one routing decision.

Everything the policy looks at arrives here as plain frozen values: the
service builds a snapshot from its watch-fed cluster view, and the simulator
builds one from its own model of the cluster. Time is `now_unix_ms`, never a
clock read.
"""

from __future__ import annotations

import enum
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvplane.services.common.model.handles import CacheHandle
from kvplane.services.common.model.nodes import Fingerprint, Node, NodeLoad

if TYPE_CHECKING:
    from kvplane.services.routing.policy.cost_model import CostModel
    from kvplane.services.routing.policy.prefix_match import PrefixMatch
    from kvplane.services.routing.policy.pull_decision import PullSettings


class Leg(enum.Enum):
    """Which half of a disaggregated turn a node is being chosen for."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class NodeState:
    """A live node and its load (None until it reports).

    The service and the simulator pass the latest report plus the work they
    have routed to the node since (`kvplane.services.routing.state.inflight`), so
    the load is current, not as old as the report.
    """

    node: Node
    load: NodeLoad | None = None
    # A prefill node's queue as the router estimates it now, in ms of prefill work ahead
    # of a new turn (the report drained to now, plus work routed since); None: judged
    # from `load` alone (`CostModel.queue_ms`).
    queued_prefill_ms: float | None = None

    @property
    def node_id(self) -> str:
        return self.node.node_id

    def fits(self, tokens: int) -> bool:
        """Whether the node's load leaves KV for `tokens` more tokens after what the requests
        waiting there for memory need (unknown load: yes)."""
        load = self.load
        if load is None or load.total_kv_blocks <= 0:
            return True
        return load.open_kv_blocks * max(1, self.node.block_size) >= tokens


@dataclass(frozen=True, slots=True)
class Prompt:
    """The new turn's prompt, as far as the caller described it.

    `token_ids` (when sent) or `block_digests` (the chained digest after each
    whole block, taken with `digest_block_size`) let the policy prove that the
    prompt continues a handle. With neither, only the length is known.
    """

    tokens: int
    token_ids: Sequence[int] = ()
    block_digests: Sequence[int] = ()
    digest_block_size: int = 0


@dataclass(frozen=True, slots=True)
class RouteSnapshot:
    """One turn's routing inputs. `nodes` holds only registered (lease-live) nodes."""

    model: str
    conversation: str
    prompt: Prompt
    nodes: tuple[NodeState, ...]
    now_unix_ms: int
    # The conversation's retained handle, if the view has one.
    handle: CacheHandle | None = None
    # The prefill node that served the conversation's previous turn, if known;
    # its local prefix cache may still hold the history.
    last_prefill_node_id: str = ""
    # Per prefill node, how many other active conversations (their last turn routed lately) it
    # served last, this one not counted: a conversation no node holds any of goes to the node
    # with fewer (`least-cost`), so conversations that start together alternate across nodes.
    prefill_homes: Mapping[str, int] = field(default_factory=dict)
    # Per prefill node, the ordinal of the last turn the router sent it (higher: more recent;
    # absent: none): of otherwise equal nodes the one sent a turn least lately comes first.
    prefill_routed_order: Mapping[str, int] = field(default_factory=dict)
    # The decode node that served the conversation's previous turn, if known.
    last_decode_node_id: str = ""
    # (prefill node id, holder engine id) pairs that have completed a NIXL
    # handshake before; a first contact pays the handshake. Only membership
    # is asked, so the service can pass its bounded record without copying.
    contacted: Container[tuple[str, str]] = field(default_factory=frozenset)
    # When the load reports were last known to be current (0: now). While the
    # service's view is cut off from etcd, reports stop arriving; their age is
    # then judged against the last moment the view was live, so an outage does
    # not make every node look stuck.
    loads_as_of_unix_ms: int = 0
    # Prompt tokens each prefill node's prefix cache is believed to hold, by node
    # id (absent: none). A hint from the router's own record of what it sent
    # where, checked against the prompt's digests
    # (`kvplane.services.routing.state.prefill_record`); a wrong hint costs time only.
    prefill_cached_tokens: Mapping[str, int] = field(default_factory=dict)
    # The prefill nodes whose entry above is known rather than guessed: their engines' KV-cache
    # events show it, or their reports have shown the record right (a prompt it believed held,
    # found in the cache). A guess never declines a pull (`pull_decision`).
    prefill_cache_known: Container[str] = field(default_factory=frozenset)
    # Prompt tokens each decode node's own prefix cache holds, by node id, as its engine's
    # KV-cache events show it (fresh views only; absent: unknown or none). Filled only for a
    # caller that can run a turn on D alone: D may then prefill the turn from that cache
    # (`decode_prefill.decide_from_decode_cache`).
    decode_cached_tokens: Mapping[str, int] = field(default_factory=dict)
    # Mixed into tie-breaks beside the conversation: a routing replica's id, so
    # that replicas do not all break the same tie the same way.
    tie_salt: str = ""
    # The caller can run a turn on its decode engine alone (RouteRequest.prefill_on_decode_ok):
    # only then may the plan be PREFILL_ON_DECODE.
    prefill_on_decode_ok: bool = False


@dataclass(frozen=True, slots=True)
class LegContext:
    """What a filter or scorer may consult besides the node it judges."""

    snapshot: RouteSnapshot
    leg: Leg
    # The handle's holder, when it is registered with the handle's incarnation.
    holder: Node | None = None
    # The fingerprint the leg's nodes must share (None: any).
    fingerprint: Fingerprint | None = None
    # The estimates and pull rule a cost-based picker judges with (None: defaults).
    costs: CostModel | None = None
    pull: PullSettings | None = None
    # The prompt against the handle, matched once per route (None: no handle).
    prefix: PrefixMatch | None = None
