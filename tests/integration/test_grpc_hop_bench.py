"""The gRPC-hop benchmark runs every condition against its own server processes and reports each."""

from __future__ import annotations

from kvplane.bench import grpc_hop_bench


async def test_every_condition_is_timed_and_reported() -> None:
    samples = await grpc_hop_bench.run(calls=3, busy_s=0.0005, repeats=2)
    assert {name: len(samples[name]) for name in grpc_hop_bench.CONDITIONS} == dict.fromkeys(
        grpc_hop_bench.CONDITIONS, 6
    )
    assert all(ms > 0 for values in samples.values() for ms in values)
    table = grpc_hop_bench.report(samples, 3, 0.0005, 2)
    assert all(f"| {name} | 6 |" in table for name in grpc_hop_bench.CONDITIONS)
