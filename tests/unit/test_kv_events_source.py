"""An engine's event source: local endpoints only, and hashes kvplane can predict."""

from __future__ import annotations

import pytest

from kvplane.connector.kv_events.source import KVEventsSource, NonLocalEndpoint, check_local
from kvplane.services.common.model.block_hashes import UnknownHashAlgo


@pytest.mark.parametrize(
    "endpoint",
    ["ipc:///tmp/engine-0-events", "tcp://127.0.0.1:5557", "tcp://localhost:5557", "tcp://[::1]:5557"],
)
def test_local_endpoints_are_accepted(endpoint: str) -> None:
    assert check_local(endpoint) == endpoint


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://10.0.0.7:5557", "ipc://", "inproc://x", "tcp://127.0.0.1"],
)
def test_an_endpoint_other_hosts_could_reach_is_refused(endpoint: str) -> None:
    with pytest.raises(NonLocalEndpoint, match="not local"):
        check_local(endpoint)


def test_a_source_refuses_what_it_cannot_read_or_predict() -> None:
    with pytest.raises(NonLocalEndpoint):
        KVEventsSource("tcp://127.0.0.1:1", "tcp://10.1.1.1:2", block_size=16)
    with pytest.raises(UnknownHashAlgo):
        KVEventsSource("ipc:///tmp/e", None, block_size=16, hash_algo="xxhash")
    source = KVEventsSource("ipc:///tmp/e", None, block_size=16, hash_algo="sha256_cbor")
    assert source.hasher().block_size == 16 and source.hasher().algo == "sha256_cbor"
