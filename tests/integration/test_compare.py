"""The fronts comparison (kvplane.bench.compare) at a tiny size, on real processes.

Every workload, two conversations of two turns per front (kvplane-own-record and the two
spread pairs too) at
concurrency 1, one repeat, on engines sped up 20 times. The checks are on behaviour, never on
timing: every front completes every turn, the prefill engines' token sources add up to what the
client sent, handles are pulled only by the fronts that carry them, and the JSON holds a row for
every front.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import sys
from pathlib import Path

import pytest

from kvplane.bench import compare
from kvplane.bench.compare_fronts import (
    ALL_FRONTS,
    EXAMPLE_PROXY,
    KVPLANE,
    KVPLANE_COLOCATED,
    KVPLANE_LOCAL_TOKENIZER,
    KVPLANE_OWN_RECORD,
    KVPLANE_SPREAD,
    KVPLANE_SPREAD_OWN_RECORD,
    REFERENCE,
    SPREAD_FRONTS,
    VLLM_ROUTER,
    ZERO_HOP,
    vllm_router_binary,
)
from kvplane.bench.compare_report import CLIENT, ENGINES, Row, dump
from kvplane.bench.compare_workload import Workload
from tests.support.polling import eventually
from tests.support.processes import processes_naming

ROUTER_INSTALLED = vllm_router_binary() is not None
# Decisions made on a retained handle whose prefix the prompt was proved to continue.
_PROVEN = {"pull", "prefill_on_decode", "recompute_below_threshold", "recompute_cost"}
# Every front, kvplane through a routing replica that ignores the engines' KV events, and the
# two pairs of gateways a conversation's turns alternate between. The picker path (kvplane-epp)
# is left out to keep the suite's time: its turns through the stack are
# tests/e2e/test_dev_stack_picker.py's, and what it is charged test_compare_parts.py's.
FRONTS = (
    *(f for f in ALL_FRONTS if ROUTER_INSTALLED or f != VLLM_ROUTER),
    KVPLANE_OWN_RECORD,
    *SPREAD_FRONTS,
)
CONFIG = compare.CompareConfig(
    workloads=("A", "B", "C"),
    concurrency=(1,),
    repeats=1,
    fronts=FRONTS,
    workload=Workload(turns=2, first_tokens=300, user_tokens=100, answer_tokens=16, stagger_s=0.0),
    warmup_conversations=1,
    # Longer than an idle engine's load heartbeat (10 s), so that the window sees its write.
    idle_s=12.0,
    speedup=20.0,
    turn_timeout_s=60.0,
)


@pytest.fixture(scope="module")
async def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, compare.WorkloadRun]:
    config = dataclasses.replace(CONFIG, run_dir=tmp_path_factory.mktemp("compare"))
    return {run.key: run for run in await compare.run(config, progress=lambda _m: None)}


def _row(run: compare.WorkloadRun, front: str) -> Row:
    (row,) = [r for r in run.rows if r.front == front]
    return row


@pytest.mark.parametrize("key", ["A", "B", "C"])
def test_every_front_completes_every_turn(runs: dict[str, compare.WorkloadRun], key: str) -> None:
    run = runs[key]
    assert run.skipped == {}
    assert [r.front for r in run.rows] == list(FRONTS)
    for row in run.rows:
        assert (row.turns_planned, row.turns_ok, row.failed, row.fallback) == (4, 4, 0, 0), row
        assert row.later_turns == 2 and row.ttft_p50_ms > 0
        # Every answer has tokens after its first: each front's answers are timed.
        assert row.tpot_p50_ms > 0 and row.tpot_p99_ms >= row.tpot_p50_ms, row
    for block in run.warmup + run.blocks:
        assert all(t.ok for t in block.turns), block.turns


@pytest.mark.parametrize("key", ["A", "B", "C"])
def test_every_later_turn_s_ttft_is_split_into_the_engines_and_the_front_s_share(
    runs: dict[str, compare.WorkloadRun], key: str
) -> None:
    for row in runs[key].rows:
        # Every later turn's legs were found on the engines' timelines (token-id prompts).
        assert row.front_share_turns == row.later_turns, row
    for block in runs[key].blocks:
        for t in block.turns:
            # Causal, not timing: the client sends before an engine receives, an engine's answer
            # comes back before the next leg is sent, D's first token before the client's.
            assert min(t.front_before_ms, t.front_between_ms, t.front_after_ms) >= 0, t
            assert t.front_ms <= t.ttft_ms, t
            if t.turn > 0:
                # A P leg then a D leg, or D alone where routing had D prefill the turn.
                engines = [engine[0] for engine, _ in t.legs]
                assert engines == (["d"] if t.decision == "prefill_on_decode" else ["p", "d"]), t


@pytest.mark.parametrize("key", ["A", "B", "C"])
def test_the_reuse_split_adds_up(runs: dict[str, compare.WorkloadRun], key: str) -> None:
    for row in runs[key].rows:
        assert row.split_adds_up, row
        assert row.pulled_tokens + row.prefix_cache_tokens <= row.later_prompt_tokens


def test_only_the_fronts_that_carry_a_handle_pull(runs: dict[str, compare.WorkloadRun]) -> None:
    # Workload B: P keeps no history, so what a later turn reuses can only come from D.
    run = runs["B"]
    assert _row(run, REFERENCE).pulled_tokens > 0
    for front in FRONTS:
        assert _row(run, front).prefix_cache_tokens == 0, front
    for front in (ZERO_HOP, EXAMPLE_PROXY, *((VLLM_ROUTER,) if ROUTER_INSTALLED else ())):
        assert _row(run, front).pulled_tokens == 0, front
    # Workload A: the zero-hop client keeps a conversation on one P, whose prefix cache holds it.
    assert _row(runs["A"], ZERO_HOP).prefix_cache_tokens > 0


def test_costs_are_charged_to_each_front_s_processes(runs: dict[str, compare.WorkloadRun]) -> None:
    run = runs["A"]
    # Each front is charged what its deployment runs. The gateway asks a routing replica of its own
    # (`serve routing`); the own-record front's twin differs in the events only; every kvplane
    # front shares metadata and eviction (`serve metadata,eviction`, which routes for no one).
    services = "serve metadata,eviction"
    assert set(run.fronts[KVPLANE]) == {"gateway", "serve routing", services, "etcd"}
    own = {"own-record gateway", "own-record routing", services, "etcd"}
    assert set(run.fronts[KVPLANE_OWN_RECORD]) == own
    assert _row(run, KVPLANE_OWN_RECORD).route_ms > 0
    # The colocated gateway routes in its own process: no routing process is charged beside it.
    assert set(run.fronts[KVPLANE_COLOCATED]) == {"colocated gateway", services, "etcd"}
    assert _row(run, KVPLANE_COLOCATED).route_ms > 0
    # A spread front is charged both its gateways, each routing in its own process.
    pair = {"spread gateway a", "spread gateway b"}
    assert set(run.fronts[KVPLANE_SPREAD]) == {*pair, services, "etcd"}
    own_pair = {"spread own-record gateway a", "spread own-record gateway b"}
    assert set(run.fronts[KVPLANE_SPREAD_OWN_RECORD]) == {*own_pair, services, "etcd"}
    assert _row(run, KVPLANE_SPREAD).route_ms > 0 and _row(run, KVPLANE_SPREAD_OWN_RECORD).route_ms > 0
    assert run.fronts[EXAMPLE_PROXY] == ["example proxy"] and run.fronts[ZERO_HOP] == []
    for row in run.rows:
        assert {CLIENT, ENGINES, *run.fronts[row.front]} == set(row.cpu_ms_per_turn)
    # kvplane's turns go through etcd (handles, check-outs); its gateway timed each Route.
    assert _row(run, KVPLANE).etcd_requests_per_turn > 0 and _row(run, KVPLANE).route_ms > 0
    # ...each named by what the services sent it for (a pull's check-out, D's publish).
    assert _row(run, KVPLANE).etcd_ops_per_turn.get("publish", 0) > 0
    assert run.idle is not None and run.idle.etcd.get("writes", 0) > 0  # the engines' load heartbeats
    assert _row(run, REFERENCE).p50_vs_reference == pytest.approx(1.0)


def test_the_json_has_every_row(runs: dict[str, compare.WorkloadRun], tmp_path: Path) -> None:
    path = tmp_path / "compare.json"
    document = compare.document(CONFIG, list(runs.values()), ["test"])
    dump(str(path), document)
    loaded = json.loads(path.read_text())
    for key in ("A", "B", "C"):
        section = loaded["workloads"][key]
        assert [r["front"] for r in section["rows"]] == list(FRONTS)
        assert len(section["blocks"]) == len(FRONTS)
        assert all(len(b["turns"]) == 4 for b in section["blocks"])
    text = compare.render(CONFIG, list(runs.values()))
    for front in FRONTS:
        assert f"| {front} | 1 |" in text
    # The machine's speed goes with the figures, in the record and in the text.
    speed = loaded["machine"]["python_loop_ns"]
    assert speed > 0 and f"a Python loop step {speed:.0f} ns" in text


def test_vllm_router_completes_every_turn(runs: dict[str, compare.WorkloadRun]) -> None:
    if not ROUTER_INSTALLED:
        pytest.skip("vllm-router is not installed (the bench extra pins vllm-router==0.1.17)")
    for run in runs.values():
        row = _row(run, VLLM_ROUTER)
        assert (row.turns_ok, row.failed) == (4, 0)
        assert set(row.cpu_ms_per_turn) == {"vllm-router", CLIENT, ENGINES}


async def test_sigterm_stops_every_process_the_comparison_started(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["--workload", "A", "--concurrency", "1", "--repeats", "1", "--fronts", ZERO_HOP]
    args += ["--min-conversations", "4", "--warmup-conversations", "0", "--idle-s", "0"]
    args += ["--run-dir", str(run_dir), "--json", str(tmp_path / "out.json")]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvplane.bench.compare",
        *args,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:

        async def stack_up() -> bool:
            # kvplane's services and the four engines name files in the run directory.
            return len(processes_naming(str(run_dir), but=proc.pid)) >= 5

        await eventually(stack_up, timeout_s=120, what="the comparison's stack to start")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=120) == 1
        # The stack's processes run in sessions of their own: only the comparison stops them.
        assert processes_naming(str(run_dir), but=proc.pid) == []
        assert not (tmp_path / "out.json").exists()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_text_prompts_reach_routing_as_token_ids_and_every_front_answers_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With text prompts each front does what it does with a user's text: kvplane's gateway asks an
    engine's /tokenize, and the local-tokenizer gateway tokenizes in its own process with the
    sim-engine's tokenizer files; through both, routing still finds and proves D's history where
    P's cache keeps none (workload B), and what the engines report adds up to the text the client
    sent, as the sim-engine's tokenizer counts it."""
    fronts = (
        KVPLANE,
        KVPLANE_LOCAL_TOKENIZER,
        REFERENCE,
        EXAMPLE_PROXY,
        *((VLLM_ROUTER,) if ROUTER_INSTALLED else ()),
    )
    # A later turn's Route waits for D's publish of the handle the turn before announced (not
    # only the default 0.3 s), so that a loaded machine's slow publish is waited for, not raced.
    # Each turn is sent the instant the last answer ends: routing waits for the publish where a
    # pull could pay by the costs it has measured, and, where a loaded machine's costs say none
    # could, because D could prefill the turn from the handle itself.
    monkeypatch.setenv("KVPLANE_ROUTING__PUBLISH_WAIT_S", "60")
    config = dataclasses.replace(
        CONFIG,
        workloads=("B",),
        fronts=fronts,
        workload=dataclasses.replace(CONFIG.workload, prompt_format="text"),
        warmup_conversations=0,
        idle_s=0.0,
        run_dir=tmp_path / "run",
    )
    (run,) = await compare.run(config, progress=lambda _m: None)
    assert run.skipped == {}
    for row in run.rows:
        assert (row.turns_ok, row.failed, row.fallback) == (4, 0, 0), row
        assert row.split_adds_up and row.prefix_cache_tokens == 0, row
    text = compare.render(config, [run])
    for front, local_share, shown in ((KVPLANE, 0.0, ")"), (KVPLANE_LOCAL_TOKENIZER, 1.0, " local)")):
        kvplane = _row(run, front)
        # Tokenized once a turn (by the engine, or in the gateway's process) and timed; with the
        # ids, routing found D's history for both later turns and proved the prompt continues it.
        # Whether it then reused it (pulled to P, or prefilled on D itself) is the cost model's
        # call on measured times: a busy machine may price a pull above the recompute.
        assert kvplane.tokenize_per_turn == 1.0 and kvplane.tokenize_ms > 0, kvplane
        assert kvplane.tokenize_local_share == local_share, kvplane
        proven = sum(n for decision, n in kvplane.decisions.items() if decision in _PROVEN)
        assert proven == kvplane.later_turns == 2, (front, kvplane.decisions)
        assert f"({kvplane.tokenize_ms:.2f}{shown}" in text
    assert _row(run, REFERENCE).pulled_tokens > 0
    assert "text prompts" in text
