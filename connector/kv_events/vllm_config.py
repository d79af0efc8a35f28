"""A vLLM engine's KV event source, read from the engine's own configuration.

vLLM's `ZmqEventPublisher` *binds* its PUB socket when the endpoint is a wildcard
(`tcp://*:5557`), an IPv6 form with `::`, or `ipc://`; any other TCP endpoint it *connects* to
(a collector that binds). Its ROUTER replay socket always binds. A subscriber on the engine's
host therefore connects to `tcp://127.0.0.1:PORT` for a wildcard, `tcp://[::1]:PORT` for
`[::]`, and to the very endpoint otherwise; a PUB endpoint vLLM connects out from leaves
nothing for a subscriber to connect to, and is refused. A data-parallel rank `r` publishes on
port + `r` (vLLM's `offset_endpoint_port`). Hashes are predicted with the engine's
`prefix_caching_hash_algo` and the seed vLLM resolves: PYTHONHASHSEED when set, else its fixed
seed; the xxhash algorithms are refused (a random per-process seed, and kvplane predicts only
SHA-256 hashes).

`source_from_vllm_config` takes vLLM's config objects by their attributes, so it runs (and is
tested) without importing vLLM. The sim-engine builds its source with `local_source`, the same
translation.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Final

from kvplane.connector.kv_events.source import KVEventsSource
from kvplane.services.common.model.block_hashes import DEFAULT_SEED, HASH_ALGOS, UnknownHashAlgo

_LOOPBACK_V4: Final = "127.0.0.1"
_LOOPBACK_V6: Final = "[::1]"


class EventsConfigError(ValueError):
    """A KV events configuration whose events a subscriber on the engine's host cannot read."""


def engine_binds(endpoint: str) -> bool:
    """Whether vLLM binds its PUB socket to `endpoint` (else it connects to it)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _split_tcp(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not port.isdigit():
        raise EventsConfigError(f"KV event endpoint {endpoint!r} has no port")
    return host, int(port)


def _offset(endpoint: str, rank: int) -> str:
    """The endpoint data-parallel rank `rank` publishes on, as vLLM offsets it."""
    if rank == 0 or not endpoint.startswith("tcp://"):
        if rank and endpoint.startswith("ipc://"):
            raise EventsConfigError(f"vLLM cannot offset ipc endpoint {endpoint!r} for rank {rank}")
        return endpoint
    host, port = _split_tcp(endpoint)
    return endpoint if port == 0 else f"tcp://{host}:{port + rank}"


def connect_endpoint(bound: str) -> str:
    """Where a subscriber on the same host connects to reach a socket bound at `bound`."""
    if not bound.startswith("tcp://"):
        return bound
    host, port = _split_tcp(bound)
    if port == 0:
        raise EventsConfigError(
            f"KV event endpoint {bound!r} takes a port chosen at start-up: give a fixed port"
        )
    if host == "*":
        return f"tcp://{_LOOPBACK_V4}:{port}"
    if host == "[::]":
        return f"tcp://{_LOOPBACK_V6}:{port}"
    return bound


def subscriber_endpoints(
    endpoint: str, replay_endpoint: str | None, data_parallel_rank: int = 0
) -> tuple[str, str | None]:
    """The PUB and replay endpoints a subscriber on the engine's host connects to."""
    pub = _offset(endpoint, data_parallel_rank)
    if not engine_binds(pub):
        raise EventsConfigError(
            f"vLLM connects its KV event PUB socket to {pub!r} (no '*', '::' or ipc://), so there is "
            "nothing for kvplane's subscriber to connect to: bind it, e.g. tcp://*:5557 or ipc://PATH"
        )
    replay = None if not replay_endpoint else connect_endpoint(_offset(replay_endpoint, data_parallel_rank))
    return connect_endpoint(pub), replay


def hash_seed(env: Mapping[str, str] | None = None) -> str:
    """The seed of vLLM's first parent hash: PYTHONHASHSEED when set (even empty), else vLLM's."""
    value = (os.environ if env is None else env).get("PYTHONHASHSEED")
    return DEFAULT_SEED if value is None else value


def check_algo(algo: str) -> str:
    """`algo` if kvplane predicts its hashes; else UnknownHashAlgo saying what to run instead."""
    if algo not in HASH_ALGOS:
        raise UnknownHashAlgo(
            f"the engine hashes prefix-cache blocks with {algo!r}, which kvplane cannot predict "
            "(vLLM seeds xxhash per process, and kvplane computes SHA-256 only): run it with "
            f"--prefix-caching-hash-algo {' or '.join(HASH_ALGOS)}"
        )
    return algo


def local_source(
    endpoint: str,
    replay_endpoint: str | None,
    *,
    topic: str,
    block_size: int,
    hash_algo: str,
    env: Mapping[str, str] | None = None,
    data_parallel_rank: int = 0,
) -> KVEventsSource:
    """The source of an engine that publishes as vLLM does on these (vLLM-form) endpoints."""
    pub, replay = subscriber_endpoints(endpoint, replay_endpoint, data_parallel_rank)
    return KVEventsSource(
        endpoint=pub,
        replay_endpoint=replay,
        block_size=block_size,
        topic=topic,
        hash_algo=check_algo(hash_algo),
        hash_seed=hash_seed(env),
    )


def source_from_vllm_config(vllm_config: Any, env: Mapping[str, str] | None = None) -> KVEventsSource | None:
    """The KV event source of the engine `vllm_config` configures; None when it publishes none
    (events off, the null publisher, or prefix caching off: no block is hashed).

    Reads `kv_events_config` (enable_kv_cache_events, publisher, endpoint, replay_endpoint,
    topic), `cache_config` (block_size, enable_prefix_caching, prefix_caching_hash_algo) and
    `parallel_config.data_parallel_index`; `env` (default: this process's) gives PYTHONHASHSEED.
    Raises EventsConfigError, UnknownHashAlgo or NonLocalEndpoint where the events could not be
    read or their hashes not predicted.
    """
    events = getattr(vllm_config, "kv_events_config", None)
    if events is None or not events.enable_kv_cache_events:
        return None
    publisher = events.publisher or "zmq"
    if publisher == "null":
        return None
    if publisher != "zmq":
        raise EventsConfigError(f"KV event publisher {publisher!r}: kvplane reads vLLM's zmq publisher")
    cache = vllm_config.cache_config
    if not cache.enable_prefix_caching:
        return None
    if not cache.block_size:
        raise EventsConfigError("cache_config.block_size is not resolved yet")
    parallel = getattr(vllm_config, "parallel_config", None)
    return local_source(
        events.endpoint,
        events.replay_endpoint,
        topic=events.topic or "",
        block_size=int(cache.block_size),
        hash_algo=cache.prefix_caching_hash_algo,
        env=env,
        data_parallel_rank=int(getattr(parallel, "data_parallel_index", 0) or 0),
    )
