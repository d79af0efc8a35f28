"""Where an engine publishes its KV-cache events, and how it computes the block hashes in them.

vLLM publishes with `--kv-events-config` (a ZMQ PUB endpoint, an optional ROUTER replay endpoint,
a topic) and hashes blocks with `--prefix-caching-hash-algo` over blocks of `--block-size`
tokens; the sim-engine does the same. The node agent reads the events of its own engine only:
the endpoints must be local to the engine's host or pod (`ipc://`, or TCP on a loopback
address), so reading them adds no network exposure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvplane.services.common.model.block_hashes import DEFAULT_SEED, BlockHasher

_LOOPBACK_HOSTS: Final = frozenset({"127.0.0.1", "localhost", "[::1]", "::1"})


class NonLocalEndpoint(ValueError):
    """An event endpoint that is not local to the engine."""


def check_local(endpoint: str) -> str:
    """`endpoint` if it is `ipc://` or TCP on a loopback address; else NonLocalEndpoint."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if sep and port.isdigit() and host in _LOOPBACK_HOSTS:
            return endpoint
    raise NonLocalEndpoint(
        f"KV event endpoint {endpoint!r} is not local: use ipc:// or tcp:// on a loopback "
        "address (the node agent reads only its own engine's events)"
    )


@dataclass(frozen=True, slots=True)
class KVEventsSource:
    """An engine's event endpoints and its block-hash configuration."""

    # ZMQ endpoint the engine's PUB socket binds, as the subscriber connects to it.
    endpoint: str
    # ZMQ endpoint of the engine's ROUTER replay socket; None: gaps cannot be replayed.
    replay_endpoint: str | None
    # Tokens per block of the engine's KV cache.
    block_size: int
    # The topic the engine publishes under ("" subscribes to every topic).
    topic: str = ""
    # The engine's `--prefix-caching-hash-algo`.
    hash_algo: str = "sha256"
    # The seed of the first block's parent: vLLM's fixed one, or the engine's PYTHONHASHSEED.
    hash_seed: str = DEFAULT_SEED

    def __post_init__(self) -> None:
        check_local(self.endpoint)
        if self.replay_endpoint is not None:
            check_local(self.replay_endpoint)
        self.hasher()  # refuses an algorithm or block size whose hashes cannot be predicted

    def hasher(self) -> BlockHasher:
        """Predicts the hashes this engine publishes."""
        return BlockHasher(self.block_size, self.hash_algo, self.hash_seed)
