"""A vLLM engine's KV event source from its config objects (shaped as vLLM 0.32's; no vLLM here)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvplane.connector.kv_events.source import NonLocalEndpoint
from kvplane.connector.kv_events.vllm_config import (
    EventsConfigError,
    connect_endpoint,
    hash_seed,
    source_from_vllm_config,
    subscriber_endpoints,
)
from kvplane.services.common.model.block_hashes import DEFAULT_SEED, UnknownHashAlgo


def vllm_config(
    *,
    events: dict[str, Any] | None = None,
    block_size: int | None = 32,
    algo: str = "sha256",
    prefix_caching: bool = True,
    dp_index: int = 0,
) -> SimpleNamespace:
    """A VllmConfig as far as the source reads it: vLLM's KVEventsConfig defaults, overridden."""
    kv_events = None
    if events is not None:
        kv_events = SimpleNamespace(
            **{
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": "tcp://*:5557",
                "replay_endpoint": None,
                "buffer_steps": 10_000,
                "hwm": 100_000,
                "max_queue_size": 100_000,
                "topic": "",
                **events,
            }
        )
    return SimpleNamespace(
        kv_events_config=kv_events,
        cache_config=SimpleNamespace(
            block_size=block_size, enable_prefix_caching=prefix_caching, prefix_caching_hash_algo=algo
        ),
        parallel_config=SimpleNamespace(data_parallel_index=dp_index),
    )


def test_vllms_default_wildcard_endpoints_are_read_on_loopback() -> None:
    config = vllm_config(events={"replay_endpoint": "tcp://*:5558", "topic": "kv"}, algo="sha256_cbor")
    source = source_from_vllm_config(config, env={})
    assert source is not None
    assert (source.endpoint, source.replay_endpoint) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    assert (source.topic, source.block_size, source.hash_algo, source.hash_seed) == (
        "kv",
        32,
        "sha256_cbor",
        DEFAULT_SEED,
    )


def test_ipc_and_ipv6_wildcard_endpoints() -> None:
    source = source_from_vllm_config(
        vllm_config(events={"endpoint": "ipc:///run/kv/pub", "replay_endpoint": "tcp://[::]:5558"}), env={}
    )
    assert source is not None
    assert (source.endpoint, source.replay_endpoint) == ("ipc:///run/kv/pub", "tcp://[::1]:5558")


@pytest.mark.parametrize(
    "config",
    [
        vllm_config(),
        vllm_config(events={"enable_kv_cache_events": False}),
        vllm_config(events={"publisher": "null"}),
        vllm_config(events={}, prefix_caching=False),
    ],
    ids=["no-config", "disabled", "null-publisher", "no-prefix-caching"],
)
def test_an_engine_that_publishes_nothing_has_no_source(config: SimpleNamespace) -> None:
    assert source_from_vllm_config(config, env={}) is None


def test_a_publisher_none_resolves_as_vllm_does() -> None:
    assert source_from_vllm_config(vllm_config(events={"publisher": None}), env={}) is not None


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_an_xxhash_engine_is_refused_with_what_to_run_instead(algo: str) -> None:
    with pytest.raises(UnknownHashAlgo, match="--prefix-caching-hash-algo sha256 or sha256_cbor"):
        source_from_vllm_config(vllm_config(events={}, algo=algo), env={})


def test_pythonhashseed_seeds_the_hashes_as_vllm_resolves_it() -> None:
    source = source_from_vllm_config(vllm_config(events={}), env={"PYTHONHASHSEED": "1234"})
    assert source is not None and source.hash_seed == "1234"
    assert hash_seed({"PYTHONHASHSEED": ""}) == "", "set but empty still wins in vLLM"
    assert hash_seed({}) == DEFAULT_SEED


def test_a_data_parallel_rank_publishes_on_the_offset_port() -> None:
    source = source_from_vllm_config(
        vllm_config(events={"replay_endpoint": "tcp://127.0.0.1:6000"}, dp_index=2), env={}
    )
    assert source is not None
    assert (source.endpoint, source.replay_endpoint) == ("tcp://127.0.0.1:5559", "tcp://127.0.0.1:6002")
    with pytest.raises(EventsConfigError, match="ipc"):
        subscriber_endpoints("ipc:///run/kv/pub", None, data_parallel_rank=1)


def test_a_pub_endpoint_vllm_connects_out_from_is_refused() -> None:
    with pytest.raises(EventsConfigError, match="connects its KV event PUB socket"):
        source_from_vllm_config(vllm_config(events={"endpoint": "tcp://127.0.0.1:5557"}), env={})


@pytest.mark.parametrize(
    ("events", "error"),
    [
        ({"endpoint": "tcp://*:0"}, EventsConfigError),
        ({"endpoint": "tcp://[fe80::1]:5557"}, NonLocalEndpoint),
        ({"replay_endpoint": "tcp://10.0.0.5:5558"}, NonLocalEndpoint),
        ({"endpoint": "inproc://kv"}, NonLocalEndpoint),
        ({"publisher": "kafka"}, EventsConfigError),
    ],
)
def test_events_no_local_subscriber_could_read_are_refused(
    events: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        source_from_vllm_config(vllm_config(events=events), env={})


def test_an_unresolved_block_size_is_refused() -> None:
    with pytest.raises(EventsConfigError, match="block_size"):
        source_from_vllm_config(vllm_config(events={}, block_size=None), env={})


def test_connect_endpoint_keeps_what_is_already_a_local_address() -> None:
    assert connect_endpoint("tcp://127.0.0.1:5558") == "tcp://127.0.0.1:5558"
    assert connect_endpoint("ipc:///x") == "ipc:///x"
    with pytest.raises(EventsConfigError, match="no port"):
        connect_endpoint("tcp://*")
