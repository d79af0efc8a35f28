"""The simulator orders the fronts as a live comparison on the same chats does.

The recorded comparison (`bench/results/compare.json`, docs/benchmarks.md's "Live comparison": 5-turn
chats at 1, 8 and 32 conversations in flight, 2 repeats, both workloads, both kvplane gateways) is
run through the simulator, every front paying its own measured hop (`ranking.FRONT_HOPS_S`), and
the two orders of the fronts on TTFT p50 and on reuse are compared with
`ranking.order_disagreements`: a pair the repeats keep apart by more than `ORDER_TOLERANCE` (5% of
the zero-hop client's p50; 5 points of reuse) must come out in the same order, and a pair level
within the repeats' spread may come out the other way by at most that much. So the check fails
whenever the simulator ranks a front better than live by more than the tolerance.

A small live comparison (`kvplane.bench.compare`: kvplane's gateway, vllm-router when installed,
and vLLM's example proxy, on 2 P + 2 D sim-engines at Qwen3-32B timing) runs three 4-turn chats
per front, one at a time, on both workloads: A with P's prefix caches on, B with them off. The
simulator runs the same chats through each front's counterpart (`cache-aware`, vllm-router's
default policy, for vllm-router, `no-reuse` for the round-robin example proxy;
`kvplane.bench.sim.ranking`).

The machine is loaded and a live run is one sample, so orders are compared only where the live
gap is clear of the run's own spread: on TTFT, when one front's later turns beat the other's in
at least 75% of all pairs of turns; on reuse, when the shares differ by more than 5 points. Where
the live fronts are that close, either order agrees. Workload B must give at least one clear
pair (kvplane pulls what no other front can reuse), so the check is never empty.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from kvplane.bench import compare
from kvplane.bench.compare_fronts import (
    EXAMPLE_PROXY,
    KVPLANE,
    KVPLANE_DECODE_PREFILL,
    VLLM_ROUTER,
    vllm_router_binary,
)
from kvplane.bench.compare_workload import Workload
from kvplane.bench.sim.front_hops import COMPARE_SOURCE
from kvplane.bench.sim.ranking import (
    CLEAR_REUSE_GAP,
    CLEAR_TTFT_DOMINANCE,
    DEFAULT_FRONTS,
    FrontSample,
    RecordedFront,
    disagreements,
    dominance,
    order_disagreements,
    recorded_prefill_on_decode,
    simulate,
    simulate_repeats,
)

RECORD = Path(__file__).resolve().parents[2] / COMPARE_SOURCE

FRONTS = (KVPLANE, EXAMPLE_PROXY) + ((VLLM_ROUTER,) if vllm_router_binary() is not None else ())
# One chat at a time: the example proxy's round-robin then alternates a chat's turns between the
# two P, live and simulated alike. With chats in flight together, whether a chat's next turn finds
# its P again depends on how the turns interleave, which a single live run samples once.
CONCURRENCY = 1
WORKLOAD = Workload(turns=4, first_tokens=1400, user_tokens=900, answer_tokens=16, min_conversations=3)
CONFIG = compare.CompareConfig(
    workloads=("A", "B"),
    concurrency=(CONCURRENCY,),
    repeats=1,
    fronts=FRONTS,
    workload=WORKLOAD,
    warmup_conversations=1,
    idle_s=0.5,
    speedup=1.0,
    turn_timeout_s=60.0,
)


@pytest.fixture(scope="module")
async def live(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, FrontSample]]:
    config = dataclasses.replace(CONFIG, run_dir=tmp_path_factory.mktemp("sim-vs-live"))
    out = {}
    for run in await compare.run(config, progress=lambda _m: None):
        assert run.skipped == {}
        samples = {}
        for row in run.rows:
            assert row.failed == 0 and row.later_prompt_tokens > 0, row
            later = [
                t.ttft_ms for b in run.blocks if b.front == row.front for t in b.turns if t.ok and t.turn
            ]
            reused = row.pulled_tokens + row.prefix_cache_tokens + row.decode_cache_tokens
            samples[row.front] = FrontSample(later, reused / row.later_prompt_tokens)
        out[run.key] = samples
    return out


def _clear_pairs(samples: dict[str, FrontSample]) -> int:
    fronts = sorted(samples)
    clear = 0
    for i, a in enumerate(fronts):
        for b in fronts[i + 1 :]:
            faster = dominance(samples[a].later_ttft_ms, samples[b].later_ttft_ms)
            clear += max(faster, 1 - faster) >= CLEAR_TTFT_DOMINANCE
            clear += abs(samples[a].reuse_share - samples[b].reuse_share) > CLEAR_REUSE_GAP
    return clear


# Workload A at one chat in flight, one live block, no tolerance: kvplane and vllm-router are level
# live, and one block's order of the two is noise (recorded over two repeats at 9d4a433: kvplane
# 0.95x-0.96x of the zero-hop client's p50, vllm-router 0.96x-0.97x); the simulator puts
# vllm-router 5 ms ahead (kvplane's 4.9 ms hop against none measurable for vllm-router), so a
# block where kvplane's turns beat the router's in 75% of pairs fails here. The recorded comparison's order
# at 1, 8 and 32 in flight is checked, with its repeats' spread and a tolerance, by
# test_the_simulator_orders_the_fronts_as_the_recorded_comparison_does.
A_ROUTER_HOP = pytest.mark.xfail(
    reason="one live block orders two fronts that are level within the repeats' spread", strict=False
)


def _recorded(
    key: str, concurrency: int, record: Path = RECORD, fronts: tuple[str, ...] = DEFAULT_FRONTS
) -> tuple[dict[str, RecordedFront], float]:
    rows = {
        r["front"]: r
        for r in json.loads(record.read_text())["workloads"][key]["rows"]
        if r["concurrency"] == concurrency
    }
    live = {
        front: RecordedFront(
            r["p50_vs_reference"],
            r["p50_vs_reference_min"],
            r["p50_vs_reference_max"],
            (r["pulled_tokens"] + r["prefix_cache_tokens"] + r.get("decode_cache_tokens", 0.0))
            / r["later_prompt_tokens"],
        )
        for front, r in rows.items()
        if front in fronts
    }
    return live, rows["zero-hop-reuse"]["ttft_p50_ms"]


# Workload B at 32 in flight: live, vllm-router is ahead of the example proxy (1.94x of the
# zero-hop client's p50 against 1.99x), and the simulator, where both recompute every turn and
# differ only in their hops, puts the router 1.5% ahead (419 against 426 ms). Until a later turn
# came the moment the answer before it ended (`ranking.comparison_turns`), the simulated chats kept
# an estimated schedule of their own, met on P at random, and both fronts' p50 there was about
# 660 ms against 539 and 553 live.
@pytest.mark.parametrize(
    ("key", "concurrency"),
    [("A", 1), ("A", 8), ("A", 32), ("B", 1), ("B", 8), ("B", 32)],
)
def test_the_simulator_orders_the_fronts_as_the_recorded_comparison_does(key: str, concurrency: int) -> None:
    document = json.loads(RECORD.read_text())
    config = document["config"]
    workload = Workload(**config["workload"])
    live, reference_ms = _recorded(key, concurrency)
    fronts = tuple(sorted(live))
    assert len(fronts) == 4
    simulated = simulate_repeats(
        workload,
        concurrency,
        config["repeats"],
        prefix_cache=key == "A",
        fronts=fronts,
        prefill_on_decode=recorded_prefill_on_decode(config),
    )
    assert order_disagreements(live, simulated, reference_ms) == [], (live, simulated)


# The comparison with kvplane's gateway letting D prefill short turns (`python -m kvplane.bench.compare
# --workload both --concurrency 1,8,32 --repeats 2 --min-conversations 1 --fronts
# kvplane,kvplane-decode-prefill,vllm-router,example-proxy,zero-hop-reuse`, at acc6c4e: an idle D
# prefills what P caches).
DECODE_PREFILL_RECORD = RECORD.parent / "compare_acc6c4e.json"
DECODE_PREFILL_FRONTS = (KVPLANE, KVPLANE_DECODE_PREFILL, VLLM_ROUTER, EXAMPLE_PROXY)


# A at 32 in flight agrees since a later turn is sent the moment the answer before it ends
# (`ranking.comparison_turns`): live, plain kvplane is ahead of the example proxy there (1.06x
# against 1.10x); the simulator, which had the chats keep an estimated schedule of their own and
# put the proxy 11 ms ahead, puts it 4.5 ms ahead (186.0 against 181.5 ms), within the tolerance.
# Behind the proxy's live p50 there are its turns that miss their chat's P (reuse 0.66 in this
# record, against the others' 0.74), which the simulator reproduces only in part (0.72), from how
# much answers vary. (A at 1 in flight agrees since the simulator charges a turn through P D's
# hand-off as measured on the sim-engines, and a turn D prefills itself only its compute, as the
# sim-engine runs it. B at 1 in flight agrees since the simulated routing knows P's caches from
# their KV events, as the live stack's does.)
@pytest.mark.parametrize(
    ("key", "concurrency"),
    [("A", 1), ("A", 8), ("A", 32), ("B", 1), ("B", 8), ("B", 32)],
)
def test_the_simulator_places_prefill_on_decode_as_the_recorded_comparison_does(
    key: str, concurrency: int
) -> None:
    _assert_orders_as(DECODE_PREFILL_RECORD, DECODE_PREFILL_FRONTS, key, concurrency)


def _assert_orders_as(record: Path, fronts: tuple[str, ...], key: str, concurrency: int) -> None:
    """The simulator orders `fronts` as `record` does at `concurrency` on workload `key`."""
    document = json.loads(record.read_text())
    config = document["config"]
    live, reference_ms = _recorded(key, concurrency, record, fronts)
    assert set(live) == set(fronts)
    simulated = simulate_repeats(
        Workload(**config["workload"]),
        concurrency,
        config["repeats"],
        prefix_cache=key == "A",
        fronts=fronts,
        prefill_on_decode=recorded_prefill_on_decode(config),
    )
    assert order_disagreements(live, simulated, reference_ms) == [], (live, simulated)


# The latest full comparisons (`python -m kvplane.bench.compare --workload both --concurrency 1,8,32
# --repeats 2 --min-conversations 1 --fronts kvplane,vllm-router,example-proxy,zero-hop-reuse
# --idle-s 10`; `--repeats 3` at 1fd0272): at 0d756e5, kvplane's gateway sending every turn
# through P, and at 3b33f2e, f71bf6e, 8e313bd, a7afb28, 7e4dbc2, 70f95a7, b273c56, dd12bf0, a8142c6,
# 1fd0272, 8af36df, 35af2a5, 0057c2c, ecdc66b (workload B's processes at fe0a015), 11c11ab, cdedf69,
# 2b1e153 and add15ab (one repeat), as it runs by default since, letting routing send a turn to its D alone.
LATEST_RECORDS = (
    "compare_0d756e5.json",
    "compare_3b33f2e.json",
    "compare_f71bf6e.json",
    "compare_8e313bd.json",
    "compare_a7afb28.json",
    "compare_7e4dbc2.json",
    "compare_70f95a7.json",
    "compare_b273c56.json",
    "compare_dd12bf0.json",
    "compare_a8142c6.json",
    "compare_1fd0272.json",
    "compare_8af36df.json",
    "compare_35af2a5.json",
    "compare_0057c2c.json",
    "compare_ecdc66b.json",
    "compare_11c11ab.json",
    "compare_cdedf69.json",
    "compare_2b1e153.json",
    "compare_add15ab.json",
)
LATEST_FRONTS = (KVPLANE, VLLM_ROUTER, EXAMPLE_PROXY)

# A at 32 in flight, where kvplane was behind the router live (1.06x and 1.07x of the zero-hop
# client's p50 at 1fd0272 and cdedf69, the router 1.00x), agrees since a later turn is sent the
# moment the answer before it ends (`ranking.comparison_turns`). Before, each simulated chat kept
# an estimated schedule of its own (each turn's whole prompt's prefill and its decode), so later
# turns met on P at random and the simulated P queue was about 70 ms longer than live (TTFT p50
# 249 ms for kvplane and the router alike, against 192 and 180 live); with the engines setting
# the schedule, the chats on each P settle into turns that rarely meet, as they do live, and the
# hop before P's leg decides the order (185 against 181 ms).
LATEST_CASES = [
    pytest.param(record, key, concurrency)
    for record in LATEST_RECORDS
    for key in ("A", "B")
    for concurrency in (1, 8, 32)
]


@pytest.mark.parametrize(("record", "key", "concurrency"), LATEST_CASES)
def test_the_simulator_orders_the_fronts_as_the_latest_comparison_does(
    record: str, key: str, concurrency: int
) -> None:
    _assert_orders_as(RECORD.parent / record, LATEST_FRONTS, key, concurrency)


# The same comparison with text prompts (`--prompts text`), at 8 and 32 in flight (the last also
# at 1): kvplane's gateway then asks an engine's /tokenize every turn, a hop the simulator does not
# model. The second and third ran beside them a gateway that tokenizes in its own process (not one
# of the fronts compared here).
TEXT_RECORDS = (
    "compare_text_2441473.json",
    "compare_text_local_d8627b7.json",
    "compare_text_c06641e.json",
    "compare_text_2f43c0f.json",
)


@pytest.mark.parametrize("record", TEXT_RECORDS)
@pytest.mark.parametrize("key", ["A", "B"])
@pytest.mark.parametrize("concurrency", [8, 32])
def test_the_simulator_orders_the_fronts_as_the_text_prompt_run_does(
    record: str, key: str, concurrency: int
) -> None:
    _assert_orders_as(RECORD.parent / record, LATEST_FRONTS, key, concurrency)


@pytest.mark.parametrize("key", [pytest.param("A", marks=A_ROUTER_HOP), "B"])
def test_the_simulator_orders_the_fronts_as_the_live_run_does(
    live: dict[str, dict[str, FrontSample]], key: str
) -> None:
    measured = live[key]
    simulated = simulate(WORKLOAD, CONCURRENCY, 0, prefix_cache=key == "A", fronts=FRONTS)
    assert set(measured) == set(simulated) == set(FRONTS)
    assert all(not math.isnan(s.reuse_share) for s in measured.values())
    assert disagreements(measured, simulated) == [], (measured, simulated)


def test_workload_b_gives_the_check_a_clear_gap(live: dict[str, dict[str, FrontSample]]) -> None:
    b = live["B"]
    assert b[KVPLANE].reuse_share > b[EXAMPLE_PROXY].reuse_share + CLEAR_REUSE_GAP
    assert _clear_pairs(b) >= 1
