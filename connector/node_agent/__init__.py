"""The node agent: an engine's link to the control plane, on its own thread.

Engine-agnostic: the vLLM connector uses it, and so does the engine simulator. The API is
small and stable:

    agent = NodeAgent(settings, node, load_fn, on_release, on_drain=None, demand_fn=None,
                      retained_fn=None, kv_events=None, on_spill_order=None,
                      on_move=None)
    agent.start()                        # own thread, own asyncio loop; returns at once
    agent.incarnation                    # new uuid at every start()
    agent.publish(handle)                # never blocks: enqueue a retained handle
    agent.report_released(request_id)    # never blocks: enqueue "blocks freed"
    agent.notify_demand()                # never blocks: demand_fn() changed, send it now
    agent.stats()                        # counters, for tests and the engine's logs
    agent.pending()                      # what is queued and not yet sent
    agent.stop(timeout_s=5.0)            # flush briefly, deregister, join the thread

What the agent does, all on its own thread:

- registers the node (MetadataService.RegisterNode) under the incarnation, keeps the lease
  alive (KeepAlive: a failed refresh is retried within half a second, not a whole interval
  later) and registers again when the lease is gone (NOT_FOUND);
- after every registration, reconciles: asks the control plane which of the handles the engine
  retains (`retained_fn()`) nothing references any more (their records were purged while the
  node was away) and frees those through `on_release`;
- samples `load_fn()` every `load_interval_s` and reports it (ReportLoad) when it changed
  materially since the last report (a request count, queued prefill tokens, retained bytes, or
  free KV blocks by 1% of the total), at once after every registration, and otherwise every
  `load_heartbeat_s` (10 s): an idle engine writes its load to etcd a tenth of a second, not
  twice a second. The node's liveness is its lease; the heartbeat only shows that the agent's
  load path still runs (the `live` routing filter allows three heartbeats);
- sends publishes (PublishHandles) and releases (ReportReleased) from one bounded queue, in
  order, batching consecutive items of one kind; release reports wait up to `release_linger_s`
  for a publish queued after them, and go in its call (`released_remote_request_ids`, recorded
  in its etcd transaction: a pulled turn's freed history and its new handle cost one). A
  publish that keeps failing is retried (the node registers again when the control plane no
  longer knows it; metadata takes a new lease when one is gone) until `publish_give_up_s`
  after its first failure, or until the handle's wall-clock expiry: then it is given up with a
  warning naming the handle, and its blocks are freed through `on_release` (nothing would ever
  reference them), so that one handle never holds up the queue behind it for good;
- keeps the EvictionService.Commands stream open: says hello, applies each ReleaseCommand by
  calling `on_release(remote_request_id)` (DrainCommand: `on_drain()`), at most once per
  command id, and acknowledges every command; an engine with a host tier (`on_spill_order`)
  asks in its hello for the leader's order of its moves there, and is handed each SpillOrder
  (device and host request ids, least valuable first; not acknowledged); one that moves handles
  there on the leader's word (`on_move`) is sent a MoveCommand in place of a release whose reason
  a move answers, calls `on_move(remote_request_id)` and acknowledges it not ok when the engine
  cannot move the handle (`on_move` returns why);
- sends the engine's KV demand (`demand_fn()`: blocks its waiting requests need beyond its free
  blocks and the blocks it is already freeing) on the same stream: at once when the engine calls
  `notify_demand()`, after every (re)connect, and again every `demand_refresh_s` while it lasts.
  Acks and demand share one ordered stream, so a demand report sent after an ack already counts
  the release acknowledged;
- given the engine's KV-cache event source (`kv_events`, a `KVEventsSource`), reads its events
  (`kvplane.connector.kv_events.subscriber`: gaps replayed, resets on an unfillable gap, a
  restart or `AllBlocksCleared`) into the node's block set, and streams that set to every routing
  replica in `routing_targets` (RoutingService.StreamPrefixCache: a snapshot per connect, then
  coalesced deltas and keep-alives), so that routing scores this prefill node by what its cache
  really holds;
- retries everything with exponential backoff and full jitter.

Callbacks (`load_fn`, `on_release`, `on_drain`, `demand_fn`, `on_spill_order`, `on_move`) run on the agent's
thread: they must be thread-safe, quick and must not block. `publish` and `report_released` may
be called from any thread. When the control plane is unreachable the engine keeps serving:
nothing the engine calls ever waits for the network, and when the queue is full the oldest item
is dropped and counted.

The package holds one module per job: `agent.py` (the engine-facing API and the agent's thread),
`outbox.py` (the bounded queue the engine fills), `registration.py` (registration, keep-alive and
reconciliation), `load.py` (load reports), `sending.py` (publishes and release reports),
`commands.py` (the eviction command stream), `demand.py` (KV demand on that stream) and
`prefix_cache.py` (the block set's streams to routing), over
`control_plane.py` (the stubs, the call metadata and the registration state they share) and
`settings.py`.
"""

from kvplane.connector.node_agent.agent import NodeAgent
from kvplane.connector.node_agent.load import load_changed
from kvplane.connector.node_agent.settings import AgentStats, NodeAgentError, NodeAgentSettings

__all__ = ["AgentStats", "NodeAgent", "NodeAgentError", "NodeAgentSettings", "load_changed"]
