"""The gRPC CPU benchmark measures both modes on both sides against its own server process."""

from __future__ import annotations

from kvplane.bench import grpc_cpu_bench


async def test_both_modes_are_measured_on_both_sides_and_reported() -> None:
    samples = await grpc_cpu_bench.run(messages=20, gap_s=0.0, repeats=2)
    keys = {
        (mode, side)
        for mode in grpc_cpu_bench.MODES
        for side in (grpc_cpu_bench.SERVER, grpc_cpu_bench.CLIENT)
    }
    assert set(samples) == keys
    assert all(len(values) == 2 and all(ms >= 0 for ms in values) for values in samples.values())
    table = grpc_cpu_bench.report(samples, 20, 0.0, 2)
    assert "| server |" in table and "| client |" in table and "stream vs unary" in table
