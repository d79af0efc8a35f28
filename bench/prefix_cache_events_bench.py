"""What reading engines' KV-cache events and feeding routing with them costs, per event and per block.

Three stages, each timed in process (CPU time, `time.process_time`) over a steady-state stream in
which an engine stores and evicts as many blocks as it computes:

- the node agent's subscriber: decoding a published batch (vLLM's msgpack, either encoding) and
  applying it to the block set with one cursor per routing replica (`--replicas`); the ZMQ receive
  itself is not counted (a copy of a few hundred bytes per batch);
- the stream to routing: one coalesced delta per `--window-ms` as the node agent sends it
  (serialised protobuf, its bytes), and a keep-alive's bytes;
- a routing replica: parsing that message, validating it into a domain value and applying it to its
  per-node view (`EngineCaches.apply`), and a Route's prefix scoring (`EngineCaches.cached_tokens`:
  predicting the prompt's block hashes and looking them up in every fresh prefill node's view).

docs/benchmarks.md turns these into a paper estimate at 1,000 engines.

    python -m kvplane.bench.prefix_cache_events_bench [--events 20000] [--blocks-per-event 16]
        [--replicas 3] [--window-ms 100] [--events-per-s 80] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from kvplane.connector.kv_events.block_set import BlockSet
from kvplane.services.common.model.block_hashes import BlockHasher
from kvplane.services.common.model.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
)
from kvplane.services.routing.prefix_cache_stream import message_from_pb
from kvplane.services.routing.state.engine_caches import CacheUpdate, EngineCaches, HashConfig
from kvplane.v1 import routing_pb2

BLOCK_SIZE = 16
CONFIG = HashConfig(BLOCK_SIZE, "sha256", "vllm-none-hash")


@dataclass(frozen=True)
class Figures:
    events: int
    blocks_per_event: int
    replicas: int
    # The node agent's subscriber: decode + block set, per event and per block (µs).
    subscriber_us_per_event: float
    subscriber_us_per_block: float
    # One coalesced delta per window: blocks in it and its bytes; a keep-alive's bytes.
    window_ms: float
    blocks_per_delta: float
    bytes_per_delta: float
    keepalive_bytes: int
    # A routing replica: parse + validate + apply, per message and per block (µs).
    routing_us_per_update: float
    routing_us_per_block: float
    # A Route's prefix scoring over `nodes` fresh views (ms), by prompt length in tokens: a first
    # prompt (every block hashed), and a later turn adding 512 tokens to a prompt scored before.
    score_nodes: int
    score_ms_by_prompt_tokens: dict[int, float]
    score_later_turn_ms_by_prompt_tokens: dict[int, float]


def _cpu(fn: Callable[[], None]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def _event_stream(events: int, blocks_per_event: int, seed: int) -> list[bytes]:
    """Published batches: each stores a chain of new blocks after one it holds, and evicts as many
    of the oldest (an engine at steady state, its cache full)."""
    rng = random.Random(seed)
    held: deque[int] = deque()
    payloads = []
    parent: int | None = None
    for i in range(events):
        ids = tuple(rng.getrandbits(64) for _ in range(blocks_per_event))
        stored = BlockStored(ids, parent, tuple(range(blocks_per_event * BLOCK_SIZE)), BLOCK_SIZE, "GPU")
        batch: list[BlockStored | BlockRemoved] = [stored]
        held.extend(ids)
        if len(held) > 50_000:
            batch.append(BlockRemoved(tuple(held.popleft() for _ in range(blocks_per_event)), "GPU"))
        parent = ids[-1] if i % 8 else None  # a new prompt every 8 events
        payloads.append(encode_batch(float(i), batch))
    return payloads


def subscriber_cost(payloads: list[bytes], replicas: int) -> tuple[float, BlockSet]:
    """CPU seconds to decode and apply every batch."""
    blocks = BlockSet()
    cursors = [blocks.cursor() for _ in range(replicas)]
    for cursor in cursors:
        blocks.snapshot_for(cursor)

    def run() -> None:
        for payload in payloads:
            blocks.apply(decode_batch(payload).events)

    return _cpu(run), blocks


def delta_messages(payloads: list[bytes], per_window: int) -> list[bytes]:
    """The node agent's coalesced deltas, one per `per_window` batches, serialised."""
    blocks = BlockSet()
    cursor = blocks.cursor()
    blocks.snapshot_for(cursor)
    out = []
    for i, payload in enumerate(payloads, 1):
        blocks.apply(decode_batch(payload).events)
        if i % per_window == 0:
            stored, removed = cursor.take()
            message = _message(False, stored, removed)
            out.append(message.SerializeToString())
    return out


def _message(snapshot: bool, stored: list[int], removed: list[int]) -> routing_pb2.StreamPrefixCacheRequest:
    return routing_pb2.StreamPrefixCacheRequest(
        node_id="prefill-0123",
        incarnation="0123456789abcdef0123456789abcdef",
        snapshot=snapshot,
        stored_block_ids=stored,
        removed_block_ids=removed,
        block_size=BLOCK_SIZE,
        hash_algo="sha256",
        hash_seed="vllm-none-hash",
        checkpoint_blocks=1,
    )


def routing_cost(messages: list[bytes]) -> float:
    """CPU seconds for a replica to parse, validate and apply every message."""
    caches = EngineCaches()
    caches.apply(CacheUpdate("prefill-0123", "0123456789abcdef0123456789abcdef", CONFIG, True), 0.0)

    def run() -> None:
        for i, raw in enumerate(messages):
            update = message_from_pb(routing_pb2.StreamPrefixCacheRequest.FromString(raw)).cache
            assert update is not None, "every message of this benchmark carries blocks"
            caches.apply(update, float(i))

    return _cpu(run)


def scoring_ms(nodes: int, prompt_tokens: int, later_turn: bool = False, repeats: int = 20) -> float:
    """A Route's prefix scoring over `nodes` fresh views, one of which holds the whole prompt; with
    `later_turn`, the conversation's previous prompt (all but the last 512 tokens) was scored before."""
    caches = EngineCaches()
    rng = random.Random(7)
    prompt = [rng.randrange(1, 100_000) for _ in range(prompt_tokens)]
    ids = BlockHasher(BLOCK_SIZE).ids(prompt, "salt")
    for n in range(nodes):
        held = ids if n == 0 else [rng.getrandbits(64) for _ in range(len(ids))]
        caches.apply(CacheUpdate(f"p{n}", "i", CONFIG, True, held), 0.0)
    pairs = [(f"p{n}", "i") for n in range(nodes)]
    spent = 0.0
    for i in range(repeats):
        conversation = ("tenant", f"c{i}") if later_turn else None
        if conversation is not None:
            caches.cached_tokens(pairs, prompt[:-512], "salt", 0.0, conversation=conversation)
        start = time.process_time()
        held_tokens = caches.cached_tokens(pairs, prompt, "salt", 0.0, conversation=conversation)
        spent += time.process_time() - start
        assert held_tokens["p0"] > 0
    return spent / repeats * 1000


def measure(
    events: int, blocks_per_event: int, replicas: int, window_ms: float, events_per_s: float
) -> Figures:
    payloads = _event_stream(events, blocks_per_event, seed=1)
    sub_s, _ = subscriber_cost(payloads, replicas)
    events_seen = [e for p in payloads for e in decode_batch(p).events]
    block_changes = sum(len(e.block_ids) for e in events_seen if not isinstance(e, AllBlocksCleared))
    per_window = max(1, round(events_per_s * window_ms / 1000))
    messages = delta_messages(payloads, per_window)
    parsed = [routing_pb2.StreamPrefixCacheRequest.FromString(m) for m in messages]
    delta_blocks = sum(len(m.stored_block_ids) + len(m.removed_block_ids) for m in parsed)
    route_s = routing_cost(messages)
    return Figures(
        events=events,
        blocks_per_event=blocks_per_event,
        replicas=replicas,
        subscriber_us_per_event=sub_s / events * 1e6,
        subscriber_us_per_block=sub_s / block_changes * 1e6,
        window_ms=window_ms,
        blocks_per_delta=delta_blocks / len(messages),
        bytes_per_delta=sum(len(m) for m in messages) / len(messages),
        keepalive_bytes=len(_message(False, [], []).SerializeToString()),
        routing_us_per_update=route_s / len(messages) * 1e6,
        routing_us_per_block=route_s / max(1, delta_blocks) * 1e6,
        score_nodes=8,
        score_ms_by_prompt_tokens={t: scoring_ms(8, t) for t in (1024, 4096, 32768)},
        score_later_turn_ms_by_prompt_tokens={t: scoring_ms(8, t, later_turn=True) for t in (4096, 32768)},
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--blocks-per-event", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=3, help="routing replicas (cursors) per agent")
    parser.add_argument("--window-ms", type=float, default=100.0)
    parser.add_argument("--events-per-s", type=float, default=80.0, help="an engine's event rate")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    figures = measure(args.events, args.blocks_per_event, args.replicas, args.window_ms, args.events_per_s)
    for key, value in asdict(figures).items():
        print(f"{key}: {value:.2f}" if isinstance(value, float) else f"{key}: {value}")
    if args.json:
        args.json.write_text(json.dumps(asdict(figures), indent=2) + "\n")


if __name__ == "__main__":
    main()
