"""SimEngine in-process (real NIXL, real side channel): timing, queueing, leases and the control seam."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import pytest

from kvplane.connector.simengine.block_pool import KvCacheFullError
from kvplane.connector.simengine.engine import FinishInfo, GenerationRequest, SimEngine
from kvplane.connector.simengine.settings import SimEngineSettings
from kvplane.connector.simengine.timing_model import TimingModel
from kvplane.services.common.model.handles import KEY_PULL_MS, KEY_QUEUED_MS
from kvplane.services.routing.transfer_params import decode_only_params
from tests.support import polling
from tests.support.simengine import free_port

FAST = TimingModel(speedup=50)


def settings(**kw: Any) -> SimEngineSettings:
    base: dict[str, Any] = {
        "side_channel_port": free_port(),
        "num_blocks": 1024,
        "bytes_per_block": 4096,
        "timing": FAST,
    }
    base.update(kw)
    return SimEngineSettings(**base)


class Recorder:
    """An EngineObserver that records calls and stamps a key on retained handles."""

    def __init__(self) -> None:
        self.retained: list[tuple[dict[str, Any], list[int], int]] = []
        self.freed: list[str] = []

    def check_pull(self, kv_transfer_params: dict[str, Any], prompt_token_ids: Sequence[int]) -> None:
        return None

    def on_handle_retained(
        self,
        kv_transfer_params: dict[str, Any],
        all_token_ids: Sequence[int],
        retained_bytes: int,
        request_kv_transfer_params: Mapping[str, Any],
    ) -> None:
        kv_transfer_params["kvplane_handle_id"] = "h-1"
        self.retained.append((dict(kv_transfer_params), list(all_token_ids), retained_bytes))

    def on_blocks_freed(self, request_id: str, read: bool) -> None:
        self.freed.append(request_id)


async def started(*engines: SimEngine) -> None:
    for e in engines:
        await e.start()


@pytest.fixture
async def stack() -> AsyncIterator[list[SimEngine]]:
    engines: list[SimEngine] = []
    yield engines
    for e in engines:
        await e.stop()


async def run(
    engine: SimEngine, prompt: list[int], max_tokens: int, kvp: dict[str, Any] | None = None
) -> FinishInfo:
    fin = None
    req = GenerationRequest(f"cmpl-{uuid.uuid4().hex}", tuple(prompt), max_tokens, True, kvp)
    async for ev in engine.generate(req):
        fin = ev.finish or fin
    assert fin is not None
    return fin


async def observed_pair(stack: list[SimEngine]) -> tuple[Recorder, SimEngine, SimEngine]:
    """A started P, and a started D whose observer records what it keeps and frees."""
    rec = Recorder()
    p, d = SimEngine(settings()), SimEngine(settings(), observer=rec)
    stack.extend([p, d])
    await started(p, d)
    return rec, p, d


async def pd_turn(p: SimEngine, d: SimEngine, prompt: list[int], max_tokens: int) -> FinishInfo:
    """One P/D turn with nothing to pull: P's leg, then D's, which reads P's blocks."""
    p_params = (await run(p, prompt, 1, {"do_remote_decode": True})).kv_transfer_params
    return await run(d, prompt, max_tokens, p_params)


async def until(predicate: Any, timeout_s: float, what: str) -> None:
    """The polling helper's `until`, with this file's argument order."""
    await polling.until(predicate, what, timeout_s=timeout_s)


def sample(engine: SimEngine, name: str, **labels: str) -> float:
    value = engine.metrics.registry.get_sample_value(
        name, {"model_name": "kvplane-sim", "engine": "0", **labels}
    )
    return value or 0.0


def prompt_of(n: int, seed: int = 0) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(300, 30000) for _ in range(n)]


async def test_load_counts_what_the_computing_prefill_has_left(stack: list[SimEngine]) -> None:
    """A prefill that computes counts in the load for the tokens it has not computed yet, fewer
    as it goes: routing prices a busy P by it, not as free."""
    # 8,000 tokens at a twentieth of the model's speed: about 6.5 s of compute.
    e = SimEngine(settings(timing=TimingModel(speedup=0.05)))
    stack.append(e)
    await started(e)
    task = asyncio.create_task(run(e, prompt_of(8000, 3), 1))
    seen: list[int] = []

    def computing() -> bool:
        load = e.load()
        if load.running_requests == 1 and load.queued_requests == 0:
            seen.append(load.queued_prefill_tokens)
        return len(seen) >= 2 and 0 < seen[-1] < seen[0] <= 8000

    try:
        await until(computing, 30, "the computing prefill's tokens left, falling")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_p_says_how_long_each_prompt_waited_for_its_compute(stack: list[SimEngine]) -> None:
    """P returns, beside its blocks, how long the prompt waited behind the ones computing before
    it: routing takes that off the leg's time to learn P's compute alone."""
    # 8,000 tokens at a tenth of the model's speed: about 3.3 s of compute, so that the second
    # prompt comes while the first computes however slowly this machine answers.
    timing = TimingModel(speedup=0.1)
    p = SimEngine(settings(timing=timing))
    stack.append(p)
    await started(p)
    first = asyncio.create_task(run(p, prompt_of(8000, 4), 1, {"do_remote_decode": True}))
    await until(lambda: p.load().running_requests == 1, 30, "the first prompt computing")
    second = await run(p, prompt_of(100, 5), 1, {"do_remote_decode": True})
    alone = (await first).kv_transfer_params
    assert alone is not None and second.kv_transfer_params is not None
    # The first found P idle; the second waited for what the first had left when it came, which
    # is all of the first's compute but the part computed before it came.
    waited = second.kv_transfer_params[KEY_QUEUED_MS]
    assert 0 <= alone[KEY_QUEUED_MS] < waited < 1000 * timing.prefill_s(8000)


async def test_ttft_follows_the_calibrated_model_at_real_speed(stack: list[SimEngine]) -> None:
    e = SimEngine(settings(timing=TimingModel()))
    stack.append(e)
    await started(e)
    t0 = time.perf_counter()
    await run(e, prompt_of(2000), 1)
    took = time.perf_counter() - t0
    # Never faster than the model; the slack above it absorbs a loaded machine's scheduling delays.
    assert 0.158 <= took < 0.158 + 1.0, f"2,000 uncached tokens took {took:.3f} s, model says 0.158 s"


async def test_prefills_queue_and_load_reports_them(stack: list[SimEngine]) -> None:
    e = SimEngine(settings(timing=TimingModel(speedup=2)))
    stack.append(e)
    await started(e)
    first = asyncio.create_task(run(e, prompt_of(4000, 1), 2))
    second = asyncio.create_task(run(e, prompt_of(4000, 2), 2))
    await until(lambda: e.load().queued_requests == 1 and e.load().running_requests == 1, 5, "one queued")
    # The queued prompt, and what the computing one has left.
    assert 4000 <= e.load().queued_prefill_tokens <= 8000
    await asyncio.gather(first, second)
    load = e.load()
    assert (load.queued_requests, load.running_requests, load.queued_prefill_tokens) == (0, 0, 0)
    assert load.free_kv_blocks == load.total_kv_blocks


async def test_prefill_lease_expires_when_d_never_reads(stack: list[SimEngine]) -> None:
    p = SimEngine(settings(prefill_lease_s=0.3))
    stack.append(p)
    await started(p)
    fin = await run(p, prompt_of(100), 1, {"do_remote_decode": True})
    assert fin.kv_transfer_params is not None and fin.kv_transfer_params["remote_num_tokens"] == 100
    assert p.load().retained_handles == 1 and p.load().retained_bytes == 7 * 4096
    await until(lambda: p.load().retained_handles == 0, 5, "the P lease to expire")
    assert p.load().free_kv_blocks == p.load().total_kv_blocks


async def test_without_bidirectional_d_frees_at_finish_and_returns_nothing(stack: list[SimEngine]) -> None:
    p, d = SimEngine(settings()), SimEngine(settings(bidirectional=False))
    stack.extend([p, d])
    await started(p, d)
    prompt = prompt_of(100)
    p_params = (await run(p, prompt, 1, {"do_remote_decode": True})).kv_transfer_params
    fin = await run(d, prompt, 20, p_params)
    assert fin.kv_transfer_params is None and fin.cached_tokens == 100
    assert d.load().retained_handles == 0
    await until(lambda: p.load().retained_handles == 0, 5, "P's lease freed by D's read")


async def test_observer_sees_retain_and_free_and_control_works_from_another_thread(
    stack: list[SimEngine],
) -> None:
    rec, p, d = await observed_pair(stack)
    prompt = prompt_of(100)
    fin = await pd_turn(p, d, prompt, 20)
    assert fin.kv_transfer_params is not None and fin.kv_transfer_params["kvplane_handle_id"] == "h-1"
    ((params, all_tokens, nbytes),) = rec.retained
    assert all_tokens == prompt + list(fin.output_token_ids) and params["remote_num_tokens"] == 119
    assert nbytes == 8 * 4096 == d.load().retained_bytes
    rid = params["remote_request_id"]
    # The node agent calls from its own thread.
    answers: list[bool] = []
    threading.Thread(target=lambda: answers.append(d.release_early(rid))).start()
    await until(lambda: rec.freed == [rid], 5, "the early release to free the handle")
    assert answers == [True] and d.load().retained_handles == 0
    assert d.release_early(rid) is False

    fin2 = await run(
        d,
        prompt_of(50, 9),
        5,
        (await run(p, prompt_of(50, 9), 1, {"do_remote_decode": True})).kv_transfer_params,
    )
    assert fin2.kv_transfer_params is not None
    d.drain()
    assert d.load().retained_handles == 0
    p3 = (await run(p, prompt_of(60, 10), 1, {"do_remote_decode": True})).kv_transfer_params
    assert (await run(d, prompt_of(60, 10), 5, p3)).kv_transfer_params is None, "a draining D keeps nothing"


async def test_restarted_holder_with_the_same_engine_id_is_never_read(stack: list[SimEngine]) -> None:
    port = free_port()
    p, d = SimEngine(settings()), SimEngine(settings(engine_id="d-pinned", side_channel_port=port))
    stack.extend([p, d])
    await started(p, d)
    prompt = prompt_of(200, 3)
    p_params = (await run(p, prompt, 1, {"do_remote_decode": True})).kv_transfer_params
    fin = await run(d, prompt, 100, p_params)
    handle = fin.kv_transfer_params
    assert handle is not None
    await d.stop()
    stack.remove(d)
    d2 = SimEngine(settings(engine_id="d-pinned", side_channel_port=port))
    stack.append(d2)
    await started(d2)
    # The same blocks were even recomputed on the new incarnation: only the stamp tells them apart.
    await run(d2, prompt, 100, None)
    prompt2 = prompt + list(fin.output_token_ids) + prompt_of(40, 4)
    fresh_p = SimEngine(settings())
    stack.append(fresh_p)
    await started(fresh_p)
    with_key = await run(fresh_p, prompt2, 1, dict(handle, do_remote_decode=True, do_remote_prefill=False))
    assert with_key.cached_tokens == 0
    assert sample(fresh_p, "kvplane_sim_kv_loads_total", leg="prefill", outcome="stale_incarnation") == 1
    # Without kvplane's incarnation key the lease stamp still tells the lives apart.
    other_p = SimEngine(settings())
    stack.append(other_p)
    await started(other_p)
    bare = {k: v for k, v in handle.items() if k != "remote_incarnation"}
    without_key = await run(other_p, prompt2, 1, dict(bare, do_remote_decode=True, do_remote_prefill=False))
    assert without_key.cached_tokens == 0
    assert sample(other_p, "kvplane_sim_kv_verify_failures_total", reason="not_leased") == 1


async def test_output_is_a_function_of_the_prefix_across_block_boundaries(stack: list[SimEngine]) -> None:
    e = SimEngine(settings())
    stack.append(e)
    await started(e)
    prompt = prompt_of(37, 5)
    out = list((await run(e, prompt, 40)).output_token_ids)
    # Generated incrementally or computed from scratch as a longer prompt: the same next token.
    for j in range(0, 40, 3):
        assert list((await run(e, prompt + out[:j], 1)).output_token_ids) == [out[j]], f"position {j}"


async def test_a_request_that_cannot_get_blocks_fails_and_frees_what_it_held(
    stack: list[SimEngine], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvplane.connector.simengine.engine")
    e = SimEngine(settings(num_blocks=8, kv_wait_timeout_s=0.2))
    stack.append(e)
    await started(e)
    held = await run(e, prompt_of(64, 6), 1, {"do_remote_decode": True})  # a lease keeps 4 blocks
    assert held.kv_transfer_params is not None and e.load().free_kv_blocks == 4
    assert sample(e, "kvplane_sim_kv_wait_seconds_count") == 0, "a request that found blocks waited for none"
    with pytest.raises(KvCacheFullError):
        await run(e, prompt_of(100, 7), 1)
    assert e.load().free_kv_blocks == 4 and e.load().running_requests == 0
    # Its wait is counted, for as long as it lasted, and logged with what held the memory.
    assert sample(e, "kvplane_sim_kv_wait_seconds_count") == 1
    assert sample(e, "kvplane_sim_kv_wait_seconds_sum") >= 0.2
    [waited] = [r.getMessage() for r in caplog.records if "KV blocks; when it began" in r.getMessage()]
    assert "4 blocks free, 4 held by 1 retained handles and leases" in waited


async def test_twenty_concurrent_five_turn_conversations_pull_verified_blocks(stack: list[SimEngine]) -> None:
    p, p2, d, ref = (SimEngine(settings(num_blocks=4096)) for _ in range(4))
    stack.extend([p, p2, d, ref])
    await started(p, p2, d, ref)
    system = prompt_of(64, 99)  # a shared system prompt: D's handles share its blocks

    async def conversation(c: int) -> None:
        prompt = system + prompt_of(150, c)
        handle = None
        for turn in range(5):
            kvp = {"do_remote_decode": True} if handle is None else dict(handle, do_remote_prefill=False)
            # Alternate P engines: a P that missed the last turn reads D's shared blocks too.
            p_params = (await run((p, p2)[turn % 2], prompt, 1, kvp)).kv_transfer_params
            fin = await run(d, prompt, 100, p_params)
            out = list(fin.output_token_ids)
            assert out == list((await run(ref, prompt, 100)).output_token_ids), (
                f"conversation {c} turn {turn}"
            )
            handle = fin.kv_transfer_params
            prompt = prompt + out + prompt_of(40, 1000 * c + turn)

    await asyncio.gather(*(conversation(c) for c in range(20)))
    pulled = sum(sample(e, "kvplane_sim_kv_loads_total", leg="prefill", outcome="pulled") for e in (p, p2))
    assert pulled == 20 * 4
    assert sample(d, "kvplane_sim_kv_loads_total", leg="decode", outcome="pulled") == 20 * 5
    for e in (p, p2, d):
        assert sample(e, "kvplane_sim_kv_verify_failures_total", reason="wrong_prefix") == 0
        assert sample(e, "kvplane_sim_kv_verify_failures_total", reason="not_leased") == 0
    await until(lambda: p.load().retained_handles + p2.load().retained_handles == 0, 10, "P leases freed")
    assert d.load().retained_handles == 20, "D keeps the last turn of each conversation"


async def test_without_prefix_caching_p_pulls_everything_d_holds(stack: list[SimEngine]) -> None:
    p, d = SimEngine(settings(enable_prefix_caching=False)), SimEngine(settings())
    stack.extend([p, d])
    await started(p, d)
    prompt = prompt_of(300, 11)
    p_params = (await run(p, prompt, 1, {"do_remote_decode": True})).kv_transfer_params
    fin = await run(d, prompt, 12, p_params)
    assert fin.kv_transfer_params is not None
    prompt2 = prompt + list(fin.output_token_ids) + prompt_of(50, 12)
    fin2 = await run(p, prompt2, 1, dict(fin.kv_transfer_params, do_remote_prefill=False))
    # D holds 300 + 12 - 1 = 311 tokens; with a cache P would have had 288 and recomputed 23.
    assert fin2.cached_tokens == 311
    # P says how long the pull took, for routing to learn its pull costs from.
    assert fin2.kv_transfer_params is not None and fin2.kv_transfer_params[KEY_PULL_MS] > 0
    assert sample(p, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 0


# What routing sends with a turn it routes prefill_on_decode.
LOCAL = decode_only_params("t", "c")


async def test_d_prefills_a_turn_itself_from_its_handle_and_keeps_the_new_turn(
    stack: list[SimEngine],
) -> None:
    # A turn routed prefill_on_decode: D gets the whole prompt with params that name no remote
    # blocks. Its prefix cache holds the handle's blocks, it computes the rest, and, as vLLM's D
    # does with any such request, it keeps the turn's blocks as the conversation's next handle.
    rec, p, d = await observed_pair(stack)
    prompt = prompt_of(300)
    first = await pd_turn(p, d, prompt, 20)
    assert d.load().retained_handles == 1
    nxt = [*prompt, *first.output_token_ids, *prompt_of(40, 5)]
    second = await run(d, nxt, 10, dict(LOCAL))
    # Every whole block of the retained tokens (prompt + output - 1 = 319) came from D's cache.
    assert second.cached_tokens == 304 and second.pulled_tokens == 0
    assert sample(d, "vllm:prompt_tokens_by_source_total", source="local_compute") == len(nxt) - 304
    assert second.kv_transfer_params is not None and second.kv_transfer_params["do_remote_decode"] is True
    assert second.kv_transfer_params["remote_num_tokens"] == len(nxt) + 10 - 1
    assert len(rec.retained) == 2 and rec.retained[1][1] == nxt + list(second.output_token_ids)
    # The earlier handle is still D's until the control plane releases it (superseded).
    assert d.load().retained_handles == 2
    # A request with no params at all is no turn of a conversation: nothing is kept.
    assert (await run(d, prompt_of(64, 6), 4)).kv_transfer_params is None
    assert d.load().retained_handles == 2
    # kvplane_retain: false frees the turn's blocks at its finish, as on a D leg.
    assert (await run(d, [*nxt, 7], 4, {**LOCAL, "kvplane_retain": False})).kv_transfer_params is None
    assert d.load().retained_handles == 2


async def test_a_prefill_on_d_holds_back_the_decodes_running_there(stack: list[SimEngine]) -> None:
    # vLLM runs a prefill's chunks in the decode batch: the running decodes wait for them. A
    # decode step that ends while the prefill runs emits at most the token it was computing.
    d = SimEngine(settings(timing=TimingModel(), num_blocks=2048))
    stack.append(d)
    await started(d)
    tokens: list[int] = []

    async def decode() -> None:
        req = GenerationRequest("long-decode", tuple(prompt_of(32, 1)), 2000, True, None)
        async for ev in d.generate(req):
            tokens.append(ev.token_id)

    streaming = asyncio.create_task(decode())
    try:
        await until(lambda: len(tokens) >= 3, 30, "the decode to stream")
        before = len(tokens)
        await run(d, prompt_of(8000, 2), 1, dict(LOCAL))
        during = len(tokens) - before
        # 8,000 tokens take the model's 0.7 s, some 25 decode steps were they not held back.
        assert during <= 3, f"{during} decode tokens while D prefilled 8,000 tokens"
        await until(lambda: len(tokens) >= before + during + 3, 30, "the decode to go on")
    finally:
        streaming.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await streaming


async def test_what_d_computes_after_its_read_costs_a_decode_step_not_a_prefill(
    stack: list[SimEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    # After reading P's blocks, D computes the prompt's last token in a step of its batch (vLLM),
    # not as a prefill with its fixed cost. The durations the engine sleeps are what it charges.
    p, d = SimEngine(settings()), SimEngine(settings())
    stack.extend([p, d])
    await started(p, d)
    prompt = prompt_of(300)
    p_params = (await run(p, prompt, 1, {"do_remote_decode": True})).kv_transfer_params
    charged: list[float] = []
    real_sleep = asyncio.sleep

    async def recorded(delay: float, *args: Any) -> Any:
        charged.append(delay)
        return await real_sleep(0)

    monkeypatch.setattr("kvplane.connector.simengine.engine.asyncio.sleep", recorded)
    fin = await run(d, prompt, 1, p_params)
    monkeypatch.undo()
    assert fin.pulled_tokens > 0 and len(prompt) - fin.cached_tokens <= 16
    timing = d.settings.timing
    assert timing.decode_s(1) in charged
    assert timing.prefill_s(len(prompt) - fin.cached_tokens) not in charged


async def test_a_request_that_ends_says_the_load_changed_when_it_is_no_longer_counted(
    stack: list[SimEngine],
) -> None:
    e = SimEngine(settings())
    stack.append(e)
    await started(e)
    seen: list[int] = []
    # What the node agent would sample when told: the running count at that moment.
    e.load_listener = lambda: seen.append(e.load().running_requests)
    await run(e, prompt_of(100), 4)
    assert seen == [0]
    # An aborted request says so too.
    req = GenerationRequest(f"cmpl-{uuid.uuid4().hex}", tuple(prompt_of(100, 2)), 50, True, None)
    stream = e.generate(req)
    await anext(stream)
    await stream.aclose()
    assert seen == [0, 0]


async def test_the_load_counts_the_blocks_requests_waiting_for_memory_need(stack: list[SimEngine]) -> None:
    # Routing takes a D's free blocks less these as what a new request could have: it is
    # admitted after the requests already waiting there.
    e = SimEngine(settings(num_blocks=8, kv_wait_timeout_s=3600))
    stack.append(e)
    await started(e)
    held = await run(e, prompt_of(64, 6), 1, {"do_remote_decode": True})  # a lease keeps 4 blocks
    assert held.kv_transfer_params is not None and e.load().waiting_kv_blocks == 0
    waiter = asyncio.create_task(run(e, prompt_of(100, 7), 1))  # 7 blocks, 4 free
    await until(lambda: e.load().waiting_kv_blocks > 0, 30, "the request to wait for blocks")
    assert e.load().waiting_kv_blocks == 7 and e.load().free_kv_blocks == 4
    waiter.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiter
    assert e.load().waiting_kv_blocks == 0


async def test_a_request_short_of_blocks_takes_those_a_copied_ahead_handle_frees_at_once(
    stack: list[SimEngine],
) -> None:
    # D moves a handle whose copy ahead is whole within its spill call; the request that was short
    # must see those blocks, with nothing else freeing any. A lost wake-up would wait for an event
    # that never comes (here, for the hour of its deadline): a liveness failure, not slowness.
    p = SimEngine(settings())
    d = SimEngine(settings(num_blocks=12, host_kv_blocks=16, kv_wait_timeout_s=3600))
    stack.extend([p, d])
    await started(p, d)
    kept = await pd_turn(p, d, prompt_of(100, 1), 20)  # 119 tokens of KV: 8 blocks kept as a handle
    assert kept.kv_transfer_params is not None
    rid = kept.kv_transfer_params["remote_request_id"]

    def copied() -> bool:
        return any(h["request_id"] == rid and h["host_copy"] for h in d.retention.describe())

    await until(copied, 10, "the handle's copy ahead")
    assert d.load().free_kv_blocks == 4
    # 7 blocks: D moves the handle to its copy.
    fin = await asyncio.wait_for(run(d, prompt_of(100, 2), 1), timeout=120)
    assert fin.finish_reason == "length"
    assert [h["tier"] for h in d.retention.describe() if h["request_id"] == rid] == ["host"]
