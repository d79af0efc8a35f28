"""The comparison's pure parts: the workload's fairness, the rotation, percentiles, metric parsing."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvplane.bench.compare_fronts import KVPLANE, Conversation, HttpFront
from kvplane.bench.compare_metrics import (
    HOST_MOVED,
    HOST_READ,
    decode_counts,
    etcd_counts,
    gateway_leg_counts,
    gateway_legs,
    services_counts,
    services_etcd,
    services_etcd_ops,
)
from kvplane.bench.compare_report import demand_line, host_tier_line, kv_wait_line, percentile
from kvplane.bench.compare_report import rows as report_rows
from kvplane.bench.compare_run import BlockResult, IdleWindow, TurnRecord
from kvplane.bench.compare_workload import (
    TEXT,
    Workload,
    draw,
    extended,
    plan,
    prompt_tokens,
    request_body,
    rotation,
)
from kvplane.connector.simengine import toy_tokenizer

FRONTS = ["kvplane", "vllm-router", "example-proxy", "zero-hop-reuse", "zero-hop"]


def test_every_front_gets_the_same_shapes_and_arrivals_with_its_own_tokens() -> None:
    workload = Workload(seed=3)
    plans = [plan(workload, front, 8, 1) for front in FRONTS]
    assert all(p.shapes == plans[0].shapes for p in plans)
    assert len(plans[0].shapes) == 8 and plans[0].planned_turns == 8 * workload.turns
    firsts = {tuple(draw(p.tokens(0), 32)) for p in plans}
    assert len(firsts) == len(FRONTS)
    # Another repeat is another draw of shapes, and the same front gets other tokens there.
    assert plan(workload, "kvplane", 8, 2).shapes != plans[0].shapes
    assert draw(plan(workload, "kvplane", 8, 2).tokens(0), 32) != draw(plans[0].tokens(0), 32)


def test_only_the_first_conversations_in_flight_wait_for_their_arrival() -> None:
    shapes = plan(Workload(min_conversations=6, stagger_s=2.0), "kvplane", 4, 0).shapes
    assert all(0 <= s.start_s <= 2.0 for s in shapes[:4]) and any(s.start_s > 0 for s in shapes[:4])
    assert [s.start_s for s in shapes[4:]] == [0.0, 0.0]
    assert all(s.start_s == 0.0 for s in plan(Workload(), "kvplane", 1, 0).shapes)


def test_lengths_stay_near_the_configured_ones() -> None:
    workload = Workload()
    for shape in plan(workload, "kvplane", 32, 0).shapes:
        assert abs(shape.first_tokens - workload.first_tokens) <= 0.1 * workload.first_tokens + 1
        assert len(shape.user_tokens) == workload.turns - 1
    assert workload.last_prompt_tokens() == 1400 + 4 * (128 + 897)


def test_rotation_puts_each_front_in_each_place_once_over_as_many_repeats() -> None:
    orders = [rotation(FRONTS, r) for r in range(len(FRONTS))]
    for position in range(len(FRONTS)):
        assert sorted(order[position] for order in orders) == sorted(FRONTS)
    assert rotation(FRONTS, len(FRONTS)) == FRONTS


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50 and percentile(values, 0.99) == 99
    assert percentile([3.0, 1.0, 2.0], 0.99) == 3 and percentile([7.0], 0.5) == 7


ETCD_PAGE = """\
# TYPE grpc_server_msg_received_total counter
grpc_server_msg_received_total{grpc_method="Range",grpc_service="etcdserverpb.KV",grpc_type="unary"} 10
grpc_server_msg_received_total{grpc_method="Txn",grpc_service="etcdserverpb.KV",grpc_type="unary"} 4
grpc_server_msg_received_total{grpc_method="LeaseKeepAlive",grpc_service="etcdserverpb.Lease"} 2
grpc_server_msg_received_total{grpc_method="Check",grpc_service="grpc.health.v1.Health",grpc_type="unary"} 9
# TYPE etcd_mvcc_put_total counter
etcd_mvcc_put_total 5
# TYPE etcd_mvcc_delete_total counter
etcd_mvcc_delete_total 2
# TYPE etcd_debugging_mvcc_put_total counter
etcd_debugging_mvcc_put_total 5
"""


def test_etcd_requests_and_writes() -> None:
    counts = etcd_counts(ETCD_PAGE)
    assert counts["requests"] == 16  # health checks are not etcd requests
    assert counts["writes"] == 7  # the debugging copy of the put counter is not counted twice
    assert counts["rpc:Txn"] == 4 and "rpc:Check" not in counts


def test_gateway_legs_sum_every_outcome() -> None:
    page = """\
# TYPE kvplane_gateway_leg_seconds histogram
kvplane_gateway_leg_seconds_bucket{leg="route",outcome="ok",le="+Inf"} 3
kvplane_gateway_leg_seconds_count{leg="route",outcome="ok"} 3
kvplane_gateway_leg_seconds_sum{leg="route",outcome="ok"} 0.006
kvplane_gateway_leg_seconds_count{leg="route",outcome="unavailable"} 1
kvplane_gateway_leg_seconds_sum{leg="route",outcome="unavailable"} 0.002
kvplane_gateway_leg_seconds_count{leg="report",outcome="ok"} 3
kvplane_gateway_leg_seconds_sum{leg="report",outcome="ok"} 0.1
"""
    legs = gateway_leg_counts(page)
    assert legs["route_n"] == 4 and abs(legs["route_s"] - 0.008) < 1e-9
    assert "report_n" not in legs


def test_services_etcd_requests_by_operation_sum_every_outcome() -> None:
    page = """\
# TYPE kvplane_etcd_request_seconds histogram
kvplane_etcd_request_seconds_count{op="check_out",outcome="ok"} 3
kvplane_etcd_request_seconds_sum{op="check_out",outcome="ok"} 0.01
kvplane_etcd_request_seconds_count{op="check_out",outcome="error"} 1
kvplane_etcd_request_seconds_sum{op="check_out",outcome="error"} 0.01
kvplane_etcd_request_seconds_count{op="publish",outcome="ok"} 2
kvplane_etcd_request_seconds_sum{op="publish",outcome="ok"} 0.01
"""
    assert services_etcd_ops(page) == {"op:check_out": 4, "op:publish": 2}


async def test_etcd_requests_by_operation_add_up_over_every_process_that_sends_them() -> None:
    # The services publish; a routing replica apart checks handles out: both count.
    pages = {
        "/services": 'kvplane_etcd_request_seconds_count{op="publish",outcome="ok"} 2\n',
        "/routing": 'kvplane_etcd_request_seconds_count{op="check_out",outcome="ok"} 3\n'
        'kvplane_etcd_request_seconds_count{op="publish",outcome="ok"} 1\n',
    }

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=pages[request.path])

    app = web.Application()
    app.router.add_get("/{name}", page)
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
        urls = [str(server.make_url(path)) for path in pages]
        assert await services_etcd(session, urls) == {"op:publish": 3, "op:check_out": 3}
        assert await services_etcd(session, []) == {}


def _block(front: str, requests: float, seconds: float, turns: int) -> BlockResult:
    block = BlockResult(front, 32, 0, 0)
    block.turns = [TurnRecord(front, 32, 0, i, 0, 100, True, 1.0) for i in range(turns)]
    block.measured_s = seconds
    block.etcd = {"requests": requests, "writes": requests, "rpc:Txn": requests, "op:publish": turns}
    return block


def test_etcd_above_other_fronts_subtracts_their_rate_over_kvplanes_time() -> None:
    blocks = [
        _block(KVPLANE, requests=400, seconds=20, turns=100),
        # 2 requests/s while fronts that never use etcd ran on the same engines
        _block("example-proxy", requests=30, seconds=15, turns=100),
        _block("zero-hop-reuse", requests=10, seconds=5, turns=100),
    ]
    rows = {r.front: r for r in report_rows(blocks, {f: [] for f in (KVPLANE, "example-proxy")}, None)}
    kv = rows[KVPLANE]
    assert kv.etcd_requests_per_turn == 4.0  # every request still counted in the raw figure
    assert kv.etcd_requests_per_turn_above_others == (400 - 2 * 20) / 100
    assert kv.etcd_rpcs_per_turn == {"Txn": 4.0} and kv.etcd_ops_per_turn == {"publish": 1.0}
    # A front that never uses etcd is measured against the others like it, never against kvplane.
    assert rows["example-proxy"].etcd_requests_per_turn_above_others == (30 - 10 / 5 * 15) / 100


def test_the_leaders_answers_to_kv_demand_are_counted_timed_and_reported_per_row() -> None:
    page = (
        "# TYPE kvplane_eviction_demand_answer_seconds histogram\n"
        'kvplane_eviction_demand_answer_seconds_bucket{le="0.5"} 2.0\n'
        'kvplane_eviction_demand_answer_seconds_bucket{le="1.0"} 2.0\n'
        'kvplane_eviction_demand_answer_seconds_bucket{le="2.5"} 3.0\n'
        'kvplane_eviction_demand_answer_seconds_bucket{le="+Inf"} 3.0\n'
        "kvplane_eviction_demand_answer_seconds_count 3.0\n"
        "kvplane_eviction_demand_answer_seconds_sum 2.1\n"
        "# TYPE kvplane_etcd_request_seconds histogram\n"
        'kvplane_etcd_request_seconds_count{op="publish"} 4.0\n'
        'kvplane_etcd_request_seconds_sum{op="publish"} 0.1\n'
    )
    assert services_etcd_ops(page) == {"op:publish": 4.0}
    counts = services_counts(page)
    assert counts == {"op:publish": 4.0, "demand:n": 3.0, "demand:s": 2.1, "demand:le_1s": 2.0}
    block = _block(KVPLANE, requests=0, seconds=10, turns=4)
    block.etcd.update(counts)
    (row,) = report_rows([block], {KVPLANE: []}, None)
    assert (row.demand_answers, row.demand_answers_over_1s) == (3.0, 1.0)
    assert math.isclose(row.demand_answer_ms, 700.0)
    assert row.etcd_ops_per_turn == {"publish": 1.0}  # the demand keys are not etcd operations
    line = "KV demand answered by the eviction leader: kvplane c=32: 3 (mean 700.0 ms, 1 over 1 s)"
    assert demand_line([row]) == line
    (quiet,) = report_rows([_block(KVPLANE, requests=0, seconds=10, turns=4)], {KVPLANE: []}, None)
    assert demand_line([quiet]) == ""


def test_prefill_spread_is_the_busiest_engines_computed_tokens_over_the_mean() -> None:
    block = _block(KVPLANE, requests=0, seconds=10, turns=4)
    # Ten engines would sort "computed_on:10" before "computed_on:2" as text: the order is numeric.
    block.sources = {f"computed_on:{i}": float(100 * (i + 1)) for i in range(11)} | {"local_compute": 6600.0}
    other = _block(KVPLANE, requests=0, seconds=10, turns=4)
    other.repeat = 1
    other.sources = {f"computed_on:{i}": 0.0 for i in range(11)}
    (row,) = report_rows([block, other], {KVPLANE: []}, None)
    assert row.computed_by_prefill == [100.0 * (i + 1) for i in range(11)]
    assert row.prefill_spread == 1100 / 600


def test_prefill_spread_is_unknown_without_per_engine_counts() -> None:
    (row,) = report_rows([_block(KVPLANE, requests=0, seconds=10, turns=4)], {KVPLANE: []}, None)
    assert row.computed_by_prefill == [] and row.prefill_spread != row.prefill_spread  # nan


def test_front_cpu_is_its_processes_together_and_above_their_idle_rate() -> None:
    block = _block(KVPLANE, requests=0, seconds=10, turns=4)
    block.cpu_s = {"gateway": 0.2, "etcd": 0.3, "engine p0": 5.0, "client": 1.0}
    # 20 s of nothing: the gateway spent 0.02 s, etcd 0.1 s (5 ms/s), an engine 1 s.
    idle = IdleWindow(20.0, 1, {"gateway": 0.02, "etcd": 0.1, "engine p0": 1.0}, {})
    (row,) = report_rows([block], {KVPLANE: ["gateway", "etcd"]}, idle)
    assert row.front_cpu_ms_per_turn == (0.2 + 0.3) / 4 * 1e3  # neither the engines nor the client
    # Over the block's 10 s the two would have spent 0.01 + 0.05 s with no traffic.
    assert abs(row.front_cpu_ms_per_turn_above_idle - (0.5 - 0.06) / 4 * 1e3) < 1e-9
    (unknown,) = report_rows([block], {KVPLANE: ["gateway", "etcd"]}, None)
    assert unknown.front_cpu_ms_per_turn_above_idle != unknown.front_cpu_ms_per_turn_above_idle  # nan


async def test_a_front_with_several_gateways_alternates_each_conversation_s_turns() -> None:
    seen: list[tuple[str, str]] = []

    def gateway(name: str) -> web.Application:
        async def completions(request: web.Request) -> web.StreamResponse:
            seen.append((request.headers["X-Session-ID"], name))
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b'data: {"choices": [{"token_ids": [7]}]}\n\ndata: [DONE]\n\n')
            return response

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        return app

    async with (
        TestServer(gateway("a"), host="127.0.0.1") as a,
        TestServer(gateway("b"), host="127.0.0.1") as b,
        aiohttp.ClientSession() as session,
    ):
        front = HttpFront("spread", [str(a.make_url("")).rstrip("/"), str(b.make_url("")).rstrip("/")], {})
        first, second = Conversation("c0", 0), Conversation("c1", 1)
        for _ in range(3):
            for conversation in (first, second):
                assert (await front.turn(session, conversation, {})).output == [7]
    # Every later turn of a conversation meets the gateway that did not route its last one.
    assert [name for conv, name in seen if conv == "c0"] == ["a", "b", "a"]
    assert [name for conv, name in seen if conv == "c1"] == ["b", "a", "b"]


async def test_route_timings_add_up_over_every_gateway_of_a_front() -> None:
    page = (
        'kvplane_gateway_leg_seconds_count{leg="route",outcome="ok"} 2\n'
        'kvplane_gateway_leg_seconds_sum{leg="route",outcome="ok"} 0.5\n'
    )

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=page)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
        url = str(server.make_url("")).rstrip("/")
        one, two = await gateway_legs(session, [url]), await gateway_legs(session, [url, url])
        assert one and two == {key: 2 * value for key, value in one.items()}
        assert await gateway_legs(session, []) == {}


def test_each_front_is_charged_its_own_processes_the_picker_path_included() -> None:
    from types import SimpleNamespace

    from kvplane.bench.compare import _stack_pids

    names = [
        "kvplane serve metadata,eviction",
        "kvplane serve routing (events)",
        "gateway",
        "prefill sim-engine",
        "decode sim-engine",
        "decode sim-engine",
        "sidecar d0",
        "sidecar d1",
        "endpoint picker",
        "envoy",
    ]
    processes = [
        SimpleNamespace(name=name, proc=SimpleNamespace(pid=100 + i)) for i, name in enumerate(names)
    ]
    stack = SimpleNamespace(processes=processes, etcd=SimpleNamespace(proc=SimpleNamespace(pid=99)))
    pids = _stack_pids(stack)  # type: ignore[arg-type]
    services = "serve metadata,eviction"
    assert pids.kvplane == {"gateway": 102, "serve routing": 101, services: 100, "etcd": 99}
    # Envoy, the picker and the sidecars, with the routing replica the picker asks, metadata and
    # eviction, and etcd; never the gateway.
    assert pids.epp == {
        "envoy": 109,
        "endpoint picker": 108,
        "sidecar d0": 106,
        "sidecar d1": 107,
        "serve routing": 101,
        services: 100,
        "etcd": 99,
    }
    assert pids.engines == {"engine p0": 103, "engine d0": 104, "engine d1": 105}


def test_engine_ttft_is_read_per_engine_and_averaged_per_role_over_the_blocks() -> None:
    from kvplane.bench.compare_metrics import engine_counts

    page = (
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1"} 1\n'
        'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.6\n'
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 3\n'
    )
    assert engine_counts(page, "p1") == {"ttft_s:p1": 0.6, "ttft_n:p1": 3.0}
    block = _block(KVPLANE, requests=0, seconds=10, turns=4)
    # Two prefill engines (0.2 s and 0.4 s a request), one decode engine (0.05 s).
    block.engines = {
        "ttft_s:p0": 0.4,
        "ttft_n:p0": 2,
        "ttft_s:p1": 0.8,
        "ttft_n:p1": 2,
        "ttft_s:d0": 0.2,
        "ttft_n:d0": 4,
    }
    (row,) = report_rows([block], {KVPLANE: ["gateway"]}, None)
    assert abs(row.prefill_engine_ttft_ms - 300.0) < 1e-9 and abs(row.decode_engine_ttft_ms - 50.0) < 1e-9


def test_decode_engines_waits_for_kv_blocks_are_read_and_reported_per_row() -> None:
    from kvplane.bench.compare_metrics import engine_counts

    page = (
        "# TYPE kvplane_sim_kv_wait_seconds histogram\n"
        'kvplane_sim_kv_wait_seconds_bucket{engine="0",le="0.5"} 1.0\n'
        'kvplane_sim_kv_wait_seconds_bucket{engine="0",le="1.0"} 1.0\n'
        'kvplane_sim_kv_wait_seconds_bucket{engine="0",le="+Inf"} 2.0\n'
        'kvplane_sim_kv_wait_seconds_count{engine="0"} 2.0\n'
        'kvplane_sim_kv_wait_seconds_sum{engine="0"} 2.6\n'
    )
    counts = engine_counts(page, "d1")
    assert counts == {
        "ttft_s:d1": 0.0,
        "ttft_n:d1": 0.0,
        "kvwait_n:d1": 2.0,
        "kvwait_s:d1": 2.6,
        "kvwait_le_1s:d1": 1.0,
    }
    block = _block(KVPLANE, requests=0, seconds=10, turns=4)
    # A prefill engine's waits are not the decode engines'.
    block.engines = {**counts, "kvwait_n:p0": 5.0, "kvwait_s:p0": 9.0, "kvwait_le_1s:p0": 0.0}
    (row,) = report_rows([block], {KVPLANE: ["gateway"]}, None)
    assert (row.decode_kv_waits, row.decode_kv_waits_over_1s) == (2.0, 1.0)
    assert math.isclose(row.decode_kv_wait_ms, 1300.0)
    line = "decode requests that waited for KV blocks: kvplane c=32: 2 (mean 1,300.0 ms, 1 over 1 s)"
    assert kv_wait_line([row]) == line
    (quiet,) = report_rows([_block(KVPLANE, requests=0, seconds=10, turns=4)], {KVPLANE: []}, None)
    assert kv_wait_line([quiet]) == ""


async def test_a_turn_s_time_per_output_token_spans_its_tokens_after_the_first() -> None:
    gap_s = 0.05

    async def completions(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        # Three tokens in two chunks, each chunk at least `gap_s` after the one before.
        for ids in ([1], [2, 3]):
            await response.write(b'data: {"choices": [{"token_ids": %s}]}\n\n' % str(ids).encode())
            await asyncio.sleep(gap_s)
        await response.write(b"data: [DONE]\n\n")
        return response

    async def one_token(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"token_ids": [1]}]}\n\ndata: [DONE]\n\n')
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/one/v1/completions", one_token)
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
        url = str(server.make_url("")).rstrip("/")
        front = HttpFront("gateway", [url], {})
        outcome = await front.turn(session, Conversation("c0", 0), {})
        assert outcome.output == [1, 2, 3]
        # The second chunk came at least gap_s after the first, and carried two tokens.
        assert outcome.tpot_ms >= gap_s * 1e3 / 2
        single = await HttpFront("gateway", [f"{url}/one"], {}).turn(session, Conversation("c1", 1), {})
        assert single.output == [1] and math.isnan(single.tpot_ms)


async def test_a_window_is_charged_none_of_the_cpu_its_own_readings_cost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reading that opens a window takes the processes' CPU after reading their pages, one that
    ends it before: serving the pages (building and compressing metrics) falls outside it."""
    from kvplane.bench import compare_metrics

    order: list[str] = []

    async def page(request: web.Request) -> web.Response:
        order.append("page")
        return web.Response(text="")

    def cpu(pids: dict[str, int]) -> dict[str, float]:
        order.append("cpu")
        return {name: 0.0 for name in pids}

    monkeypatch.setattr(compare_metrics, "cpu", cpu)
    app = web.Application()
    app.router.add_get("/metrics", page)
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
        url = str(server.make_url("")).rstrip("/")
        args = (session, {"gateway": 1}, [], url, [url], [f"{url}/metrics"])
        await compare_metrics.read_all(*args)
        assert order == ["page", "page", "page", "cpu"]
        order.clear()
        await compare_metrics.read_all(*args, ends_window=True)
        assert order == ["cpu", "page", "page", "page"]


def test_tpot_percentiles_are_over_every_completed_turn_that_measured_one() -> None:
    block = BlockResult(KVPLANE, 8, 0, 0)
    block.turns = [
        TurnRecord(KVPLANE, 8, 0, 0, turn, 100, True, 1.0, tpot_ms=float(turn + 1)) for turn in range(4)
    ]
    # A failed turn and a one-token answer measure none.
    block.turns += [
        TurnRecord(KVPLANE, 8, 0, 1, 0, 100, False, tpot_ms=100.0),
        TurnRecord(KVPLANE, 8, 0, 2, 0, 100, True, 1.0),
    ]
    block.measured_s = 1.0
    (row,) = report_rows([block], {KVPLANE: []}, None)
    assert (row.tpot_p50_ms, row.tpot_p99_ms) == (percentile([1, 2, 3, 4], 0.5), 4.0)


async def test_a_decode_engine_s_host_tier_moves_and_reads_are_read_and_reported_per_front() -> None:
    page = (
        'kvplane_sim_host_spills_total{engine="0",model_name="m",outcome="moved"} 3.0\n'
        'kvplane_sim_host_spills_total{engine="0",model_name="m",outcome="freed_first"} 1.0\n'
        'kvplane_sim_host_reads_total{engine="0",model_name="m"} 2.0\n'
        'kvplane_sim_retained_frees_total{engine="0",kind="decode_handle",model_name="m",reason="read"} 4.0\n'
        'kvplane_sim_retained_frees_total{engine="0",kind="prefill_lease",model_name="m",reason="read"} 9.0\n'
        'kvplane_sim_alone_prompt_tokens_total{engine="0",model_name="m",source="local_compute"} 5.0\n'
    )

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=page)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        alone, host = await decode_counts(session, str(server.make_url("")).rstrip("/"))
    assert alone == {"local_compute": 5.0}
    assert host == {HOST_MOVED: 3.0, HOST_READ: 2.0, "host_freed_first": 1.0, "freed:read": 4.0}

    block = _block(KVPLANE, requests=0, seconds=10, turns=4)
    block.sources = dict(host)
    (row,) = report_rows([block], {KVPLANE: []}, None)
    assert (row.host_moved, row.host_read, row.decode_frees) == (3.0, 2.0, {"read": 4.0})
    assert host_tier_line([row]) == "decode host tier: kvplane c=32: 3 moved, 2 read from there"
    (none,) = report_rows([_block(KVPLANE, requests=0, seconds=10, turns=4)], {KVPLANE: []}, None)
    assert host_tier_line([none]) == ""


def test_text_prompts_are_lowercase_words_of_the_planned_length_and_grow_by_the_answer_text() -> None:
    plans = [plan(Workload(seed=3, prompt_format=TEXT), front, 8, 1) for front in FRONTS]
    first = plans[0].draw(plans[0].tokens(0), 300)
    assert isinstance(first, str) and len(first) == 300 and set(first) <= set("abcdefghijklmnopqrstuvwxyz ")
    # Each front its own text, as with token ids; the same front the same text.
    assert len({p.draw(p.tokens(0), 64) for p in plans}) == len(FRONTS)
    assert plans[0].draw(plans[0].tokens(0), 300) == first
    # The next prompt carries the answer's text (its token ids are only counted), then the user's.
    following = extended(first, [100, 101], "an answer", " and more")
    assert following == first + "an answer and more"
    # Counted as the engines count it: a byte a token, and the BOS.
    assert prompt_tokens(following) == len(toy_tokenizer.encode(following)) == len(following) + 1
    assert request_body(following, 16)["prompt"] == following
    # Token ids stay token ids.
    assert extended([5, 6], [7], "x", [8]) == [5, 6, 7, 8] and prompt_tokens([5, 6]) == 2
    assert request_body((5, 6), 16)["prompt"] == [5, 6]


def test_a_workload_names_a_known_prompt_format() -> None:
    with pytest.raises(ValueError, match="prompt_format"):
        Workload(prompt_format="words")


def test_a_front_s_share_is_the_turn_s_time_outside_its_legs_on_the_engines() -> None:
    from kvplane.bench.compare_timeline import Leg, front_share

    legs = [
        Leg("p0", arrived=9.0, first_token=9.1, finished=9.1),  # the same prompt, an earlier turn's
        Leg("p1", arrived=10.004, first_token=10.150, finished=10.151),  # P's leg
        Leg("d0", arrived=10.160, first_token=10.190, finished=10.600),  # D's leg
    ]
    share = front_share(10.0, 10.195, legs)
    assert share is not None and [engine for engine, _ in share.legs] == ["p1", "d0"]
    # P's leg to its end, D's to its first token.
    assert [round(ms, 6) for _, ms in share.legs] == [147.0, 30.0]
    assert math.isclose(share.before_ms, 4.0, abs_tol=1e-6)
    assert math.isclose(share.between_ms, 9.0, abs_tol=1e-6)
    assert math.isclose(share.after_ms, 5.0, abs_tol=1e-6)
    # A turn served by one leg (D prefilling it) has nothing between legs.
    alone = front_share(10.155, 10.195, legs)
    assert alone is not None and len(alone.legs) == 1 and alone.between_ms == 0
    # No leg of the prompt in the turn's time, or a leg whose first token the client saw before
    # the engine made it: nothing is attributed.
    assert front_share(11.0, 11.2, legs) is None
    assert front_share(10.155, 10.185, legs) is None


def test_turns_get_the_front_s_share_from_their_prompt_s_legs_and_rows_report_it() -> None:
    from kvplane.bench.compare_run import with_front_shares
    from kvplane.bench.compare_timeline import Leg

    def turn(i: int, digest: str, ttft_ms: float, ok: bool = True) -> TurnRecord:
        return TurnRecord(KVPLANE, 8, 0, 0, i, 100, ok, ttft_ms, digest=digest, started_at=100.0 + i)

    legs = {
        f"d{i}": [
            Leg("p0", 100.0 + i + 0.002 * i, 100.0 + i + 0.1, 100.0 + i + 0.1),
            Leg("d1", 100.0 + i + 0.11, 100.0 + i + 0.14, 100.5 + i),
        ]
        for i in range(1, 4)
    }
    turns = [
        turn(0, "d0", 150.0),
        *(turn(i, f"d{i}", 150.0) for i in range(1, 4)),
        turn(4, "d4", 0.0, ok=False),
    ]
    joined = with_front_shares(turns, legs)
    assert [math.isnan(t.front_ms) for t in joined] == [True, False, False, False, True]
    assert [round(t.front_before_ms, 6) for t in joined[1:4]] == [2.0, 4.0, 6.0]
    assert all(math.isclose(t.front_between_ms, 10.0, abs_tol=1e-6) for t in joined[1:4])
    assert all(math.isclose(t.front_after_ms, 10.0, abs_tol=1e-6) for t in joined[1:4])
    assert [[e for e, _ in t.legs] for t in joined] == [[], ["p0", "d1"], ["p0", "d1"], ["p0", "d1"], []]
    block = BlockResult(KVPLANE, 8, 0, 0)
    block.turns = joined
    (row,) = report_rows([block], {KVPLANE: ["gateway"]}, None)
    # Later turns only (turn index > 0): the three found.
    assert row.front_share_turns == 3
    assert math.isclose(row.front_share_p50_ms, 24.0, abs_tol=1e-6)
    assert math.isclose(row.front_share_p99_ms, 26.0, abs_tol=1e-6)
    # The engines' share is the rest of each turn's TTFT: 150 less 22, 24 and 26.
    assert math.isclose(row.engines_share_p50_ms, 126.0, abs_tol=1e-6)
    assert math.isclose(row.engines_share_p99_ms, 128.0, abs_tol=1e-6)
    assert math.isclose(row.front_before_ms, 4.0, abs_tol=1e-6)
