"""Sim-engines as real processes, pulling KV over real NIXL: vLLM's P/D semantics, turn by turn.

Engines: P1 (expiry guard 5 s, threshold 64), P2 (a second prefill engine, also the
single-engine reference), D1 (TTL 60 s, side channel on [::1]) and D2 (TTL 4 s, so its
handles are always inside P1's 5 s expiry gate).
"""

from __future__ import annotations

import http.client
import json
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.simengine import (
    MODEL,
    Engine,
    d_leg,
    delta,
    engines,
    free_port,
    loads,
    p_leg,
    reference,
    sim,
    sources,
    tokens,
    wait_for,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    log_dir: Path = tmp_path_factory.mktemp("simengine")
    # Chat answers reason first (completions are unaffected), so a client can strip the trace.
    reasoning = {"reasoning_tokens": 24}
    specs = {
        "P1": sim(
            role="prefill",
            engine_id="p1",
            side_channel_port=free_port(),
            expiry_guard_s=5,
            kv_recompute_threshold=64,
            **reasoning,
        ),
        "P2": sim(role="prefill", engine_id="p2", side_channel_port=free_port(), **reasoning),
        "D1": sim(
            role="decode",
            engine_id="d1",
            side_channel_host="[::1]",
            side_channel_port=free_port("::1"),
            decoder_kv_blocks_ttl=60,
            **reasoning,
        ),
        "D2": sim(
            role="decode", engine_id="d2", side_channel_port=free_port(), decoder_kv_blocks_ttl=4, **reasoning
        ),
    }
    with engines(log_dir, specs) as started:
        yield started


def first_turn(p: Engine, d: Engine, prompt: list[int], max_tokens: int) -> tuple[list[int], dict[str, Any]]:
    pr = p_leg(p, prompt)
    p_params = pr["kv_transfer_params"]
    dr = d_leg(d, prompt, p_params, max_tokens)
    out: list[int] = dr["choices"][0]["token_ids"]
    handle: dict[str, Any] = dr["kv_transfer_params"]
    assert handle is not None and handle["do_remote_decode"] is True
    return out, handle


def test_three_turns_pull_from_d_and_match_a_single_engine(cluster: dict[str, Engine]) -> None:
    p, d, ref = cluster["P1"], cluster["D1"], cluster["P2"]
    prompt = tokens(1, 200)
    handle: dict[str, Any] | None = None
    for turn in (1, 2, 3):
        p_src, p_pulls = sources(p), loads(p, "pulled")
        pr = p_leg(p, prompt, handle)
        p_params = pr["kv_transfer_params"]
        assert p_params["do_remote_prefill"] is True and p_params["do_remote_decode"] is False
        assert p_params["remote_engine_id"] == "p1" and p_params["remote_num_tokens"] == len(prompt)
        assert len(p_params["remote_block_ids"][0]) == (len(prompt) + 15) // 16
        p_delta = delta(sources(p), p_src)
        assert sum(p_delta.values()) == len(prompt)
        if handle is not None:
            # P pulled exactly D's tokens beyond its own prefix cache.
            assert loads(p, "pulled") - p_pulls == 1
            assert p_delta["external_kv_transfer"] == handle["remote_num_tokens"] - p_delta["local_cache_hit"]
            assert p_delta["external_kv_transfer"] >= 64
            prev = handle["remote_request_id"]
            wait_for(lambda prev=prev: prev not in d.retained_ids(), 10, "D to free the read handle")

        d_src = sources(d)
        dr = d_leg(d, prompt, p_params, max_tokens=100)
        out = dr["choices"][0]["token_ids"]
        d_delta = delta(sources(d), d_src)
        assert d_delta["local_compute"] == 0, "D must get every prompt token from its cache or from P"
        assert d_delta["external_kv_transfer"] > 0
        assert out == reference(ref, prompt, 100), f"turn {turn}: disaggregated output differs"
        assert pr["choices"][0]["token_ids"] == out[:1]
        rid = p_params["remote_request_id"]
        wait_for(lambda rid=rid: rid not in p.retained_ids(), 10, "P to free its lease after D's read")

        handle = dr["kv_transfer_params"]
        assert handle["do_remote_decode"] is True and handle["do_remote_prefill"] is False
        assert handle["remote_engine_id"] == "d1" and handle["remote_host"] == "::1"
        assert handle["remote_num_tokens"] == len(prompt) + len(out) - 1
        assert isinstance(handle["remote_blocks_expiry_time"], float)
        assert handle["remote_request_id"] in d.retained_ids()
        prompt = prompt + out + tokens(100 + turn, 40)


def test_d_told_not_to_keep_the_turns_kv_frees_it_and_returns_no_handle(cluster: dict[str, Engine]) -> None:
    p, d = cluster["P1"], cluster["D1"]
    prompt = tokens(7, 120)
    pr = p_leg(p, prompt)
    before = set(d.retained_ids())
    dr = d_leg(d, prompt, {**pr["kv_transfer_params"], "kvplane_retain": False}, max_tokens=20)
    # The answer is whole; only the handle for a next turn is missing.
    assert len(dr["choices"][0]["token_ids"]) == 20
    assert dr.get("kv_transfer_params") is None
    assert set(d.retained_ids()) == before


def test_d_with_bidirectional_turned_off_at_run_time_keeps_nothing_until_turned_on(
    cluster: dict[str, Engine],
) -> None:
    """As vLLM run without bidirectional_kv_xfer: what a front that never carries D's handle runs on."""
    p, d = cluster["P1"], cluster["D1"]
    before = set(d.retained_ids())
    assert d.post("/sim/bidirectional", {"enabled": False}) == {"bidirectional": False}
    try:
        assert d.state()["bidirectional"] is False
        prompt = tokens(9, 120)
        dr = d_leg(d, prompt, p_leg(p, prompt)["kv_transfer_params"], max_tokens=20)
        assert len(dr["choices"][0]["token_ids"]) == 20
        assert dr.get("kv_transfer_params") is None
        assert set(d.retained_ids()) == before
    finally:
        assert d.post("/sim/bidirectional", {"enabled": True}) == {"bidirectional": True}
    prompt = tokens(10, 120)
    dr = d_leg(d, prompt, p_leg(p, prompt)["kv_transfer_params"], max_tokens=20)
    assert dr["kv_transfer_params"]["do_remote_decode"] is True
    assert set(d.retained_ids()) == before | {dr["kv_transfer_params"]["remote_request_id"]}


def test_second_read_of_a_handle_is_detected_and_recomputed(cluster: dict[str, Engine]) -> None:
    p1, p2, d = cluster["P1"], cluster["P2"], cluster["D1"]
    prompt = tokens(2, 200)
    out, handle = first_turn(p1, d, prompt, 100)
    prompt2 = prompt + out + tokens(200, 40)
    assert p_leg(p1, prompt2, handle)["choices"][0]["token_ids"]
    rid = handle["remote_request_id"]
    wait_for(lambda: rid not in d.retained_ids(), 10, "D to free the handle after the first read")

    before = p2.metric("kvplane_sim_kv_verify_failures_total", reason="not_leased")
    unmatched = d.metric("kvplane_sim_notifications_unmatched_total", kind="after_read")
    pr = p_leg(p2, prompt2, handle)  # a second turn replaying the consumed handle
    assert p2.metric("kvplane_sim_kv_verify_failures_total", reason="not_leased") == before + 1
    assert pr["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "the stale KV must not be used"
    assert pr["choices"][0]["token_ids"] == reference(p1, prompt2, 1)
    wait_for(
        lambda: d.metric("kvplane_sim_notifications_unmatched_total", kind="after_read") == unmatched + 1,
        10,
        "D to see the second read's notification",
    )


def test_handle_expires_after_decoder_ttl_and_stale_read_is_detected(cluster: dict[str, Engine]) -> None:
    p, d = cluster["P1"], cluster["D2"]
    expired = d.metric("vllm:nixl_num_kv_expired_reqs_total")
    prompt = tokens(3, 200)
    out, handle = first_turn(p, d, prompt, 100)
    rid = handle["remote_request_id"]
    assert rid in d.retained_ids()
    wait_for(lambda: rid not in d.retained_ids(), 15, "D's TTL to free the handle")
    assert d.metric("vllm:nixl_num_kv_expired_reqs_total") == expired + 1
    assert d.metric("kvplane_sim_retained_frees_total", kind="decode_handle", reason="ttl") >= 1

    # Without the expiry time the gate is off, so P reads the freed blocks: verification must catch it.
    stale = {k: v for k, v in handle.items() if k != "remote_blocks_expiry_time"}
    before = p.metric("kvplane_sim_kv_verify_failures_total", reason="not_leased")
    prompt2 = prompt + out + tokens(300, 40)
    pr = p_leg(p, prompt2, stale)
    assert p.metric("kvplane_sim_kv_verify_failures_total", reason="not_leased") == before + 1
    assert pr["choices"][0]["token_ids"] == reference(cluster["P2"], prompt2, 1)


def test_p_declines_a_pull_within_the_expiry_guard(cluster: dict[str, Engine]) -> None:
    p, d = cluster["P1"], cluster["D2"]  # D2's TTL (4 s) is inside P1's 5 s guard from the start
    prompt = tokens(4, 200)
    out, handle = first_turn(p, d, prompt, 100)
    declined, src = loads(p, "declined_expiry"), sources(p)
    read_frees = d.metric("kvplane_sim_retained_frees_total", kind="decode_handle", reason="read")
    prompt2 = prompt + out + tokens(400, 40)
    pr = p_leg(p, prompt2, handle)
    assert loads(p, "declined_expiry") == declined + 1
    assert delta(sources(p), src)["external_kv_transfer"] == 0
    assert pr["choices"][0]["token_ids"] == reference(cluster["P2"], prompt2, 1)
    # P's notification frees D's blocks before the TTL would.
    wait_for(
        lambda: (
            d.metric("kvplane_sim_retained_frees_total", kind="decode_handle", reason="read")
            == read_frees + 1
        ),
        3,
        "D to free the declined handle on P's notification",
    )


def test_missing_tail_under_threshold_is_recomputed(cluster: dict[str, Engine]) -> None:
    p, d = cluster["P1"], cluster["D1"]
    prompt = tokens(5, 200)
    # D holds 200 + 20 - 1 = 219 tokens; P's cache has 192: missing 27 < 64.
    out, handle = first_turn(p, d, prompt, 20)
    assert handle["remote_num_tokens"] == 219
    threshold, src = loads(p, "recompute_threshold"), sources(p)
    prompt2 = prompt + out + tokens(500, 40)
    p_leg(p, prompt2, handle)
    assert loads(p, "recompute_threshold") == threshold + 1
    got = delta(sources(p), src)
    assert got["external_kv_transfer"] == 0 and got["local_cache_hit"] == 192
    rid = handle["remote_request_id"]
    wait_for(lambda: rid not in d.retained_ids(), 10, "D to free the handle on P's notification")


def test_wrong_prefix_is_detected_and_never_used(cluster: dict[str, Engine]) -> None:
    p, d = cluster["P1"], cluster["D1"]
    prompt = tokens(6, 200)
    out, handle = first_turn(p, d, prompt, 100)
    edited = list(out)
    edited[50] += 1  # position 250: past P's cached 192 tokens, inside D's 299
    prompt2 = prompt + edited + tokens(600, 40)
    before = p.metric("kvplane_sim_kv_verify_failures_total", reason="wrong_prefix")
    pr = p_leg(p, prompt2, handle)
    assert p.metric("kvplane_sim_kv_verify_failures_total", reason="wrong_prefix") == before + 1
    assert pr["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
    assert pr["choices"][0]["token_ids"] == reference(cluster["P2"], prompt2, 1)


def test_streaming_finish_chunk_carries_kv_transfer_params(cluster: dict[str, Engine]) -> None:
    p, d = cluster["P1"], cluster["D1"]
    prompt = tokens(7, 150)
    p_params = p_leg(p, prompt)["kv_transfer_params"]
    events = d.stream(
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 12,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
            "kv_transfer_params": p_params,
        },
    )
    token_events = [e for e in events if e["choices"]]
    assert len(token_events) == 12
    finish = [e for e in token_events if e["choices"][0]["finish_reason"] is not None]
    assert len(finish) == 1 and finish[0] is token_events[-1]
    kvp = finish[0]["kv_transfer_params"]
    assert kvp["do_remote_decode"] is True and kvp["remote_num_tokens"] == 150 + 12 - 1
    assert all(e.get("kv_transfer_params") is None for e in events if e is not finish[0])
    assert events[-1]["usage"]["completion_tokens"] == 12
    streamed = [t for e in token_events for t in e["choices"][0]["token_ids"]]
    assert streamed == reference(cluster["P2"], prompt, 12)


def chat_first_turn(p: Engine, d: Engine, user: str) -> tuple[list[dict[str, str]], str, str, dict[str, Any]]:
    """A streamed chat turn 1 (P, then D): the messages, D's reasoning and answer texts, D's handle."""
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": user}]
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    p_resp = p.post("/v1/chat/completions", body)
    assert p_resp["choices"][0]["message"]["reasoning_content"] == "", "P's one token is the <think> tag"
    events = d.stream(
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": messages,
            "max_tokens": 120,
            "ignore_eos": True,
            "kv_transfer_params": p_resp["kv_transfer_params"],
        },
    )
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    reasoning = "".join(x.get("reasoning_content") or "" for x in deltas)
    answer = "".join(x.get("content") or "" for x in deltas)
    handle = events[-1]["kv_transfer_params"]
    assert events[-1]["choices"][0]["finish_reason"] == "length" and handle["do_remote_decode"] is True
    assert len(reasoning) == 24 and answer
    return messages, reasoning, answer, handle


def p_chat(p: Engine, messages: list[dict[str, str]], handle: dict[str, Any]) -> dict[str, Any]:
    return p.post(
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": messages,
            "max_tokens": 1,
            "kv_transfer_params": dict(handle, do_remote_prefill=False),
        },
    )


def test_chat_history_with_its_reasoning_pulls_verified_blocks(cluster: dict[str, Engine]) -> None:
    p, d = cluster["P1"], cluster["D1"]
    messages, reasoning, answer, handle = chat_first_turn(p, d, "tell me a long story " * 12)
    # The client resends the whole turn as text; the byte tokenizer keeps D's prefix intact.
    kept = f"<think>\n{reasoning}\n</think>\n\n{answer}"
    messages2 = [*messages, {"role": "assistant", "content": kept}, {"role": "user", "content": "and then?"}]
    pulled, fails = loads(p, "pulled"), p.metric("kvplane_sim_kv_verify_failures_total")
    p_chat(p, messages2, handle)
    assert loads(p, "pulled") == pulled + 1
    assert p.metric("kvplane_sim_kv_verify_failures_total") == fails


def test_stripped_reasoning_trace_is_detected_and_never_used(cluster: dict[str, Engine]) -> None:
    p, d = cluster["P1"], cluster["D1"]
    messages, _, answer, handle = chat_first_turn(p, d, "tell me another long story " * 12)
    # Most chat clients (and Qwen3's template) drop the trace: the prompt no longer continues D's tokens.
    messages2 = [
        *messages,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "and then?"},
    ]
    wrong = p.metric("kvplane_sim_kv_verify_failures_total", reason="wrong_prefix")
    pulled = loads(p, "pulled")
    resp = p_chat(p, messages2, handle)
    assert p.metric("kvplane_sim_kv_verify_failures_total", reason="wrong_prefix") == wrong + 1
    assert loads(p, "pulled") == pulled
    prompt_ids = p.post("/tokenize", {"model": MODEL, "messages": messages2})["tokens"]
    assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] < len(prompt_ids) - 100


def test_abort_frees_blocks_and_returns_no_handle(cluster: dict[str, Engine]) -> None:
    p, d = cluster["P1"], cluster["D1"]
    prompt = tokens(8, 150)
    p_params = p_leg(p, prompt)["kv_transfer_params"]
    for rid in d.retained_ids():  # start from an empty pool, through the node agent's seam
        assert d.post("/sim/release_early", {"request_id": rid})["released"] is True
    free_before = d.state()["load"]["free_kv_blocks"]
    assert free_before == d.state()["load"]["total_kv_blocks"]
    aborts = d.metric("vllm:request_success_total", finished_reason="abort")
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=10)
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps(
            {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 20000,
                "ignore_eos": True,
                "stream": True,
                "kv_transfer_params": p_params,
            }
        ),
        headers={"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    seen = 0
    request_id = None
    while seen < 3:
        line = resp.readline().decode().strip()
        if line.startswith("data: "):
            request_id = json.loads(line[6:])["id"]
            seen += 1
    assert d.state()["load"]["running_requests"] == 1
    conn.close()
    wait_for(lambda: d.state()["load"]["running_requests"] == 0, 10, "D to abort the request")
    assert d.metric("vllm:request_success_total", finished_reason="abort") == aborts + 1
    assert request_id not in d.retained_ids()
    wait_for(lambda: d.state()["load"]["free_kv_blocks"] == free_before, 10, "D to free the aborted blocks")


def test_openai_surface_models_errors_text_and_chat(cluster: dict[str, Engine]) -> None:
    e = cluster["P2"]
    assert e.get("/health") == b""
    models = json.loads(e.get("/v1/models"))
    assert [m["id"] for m in models["data"]] == [MODEL]

    def error_of(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with pytest.raises(urllib.error.HTTPError) as info:
            e.post("/v1/completions", body)
        return info.value.code, json.loads(info.value.read())["error"]

    assert error_of({"model": "nope", "prompt": [1, 2]})[0] == 404
    code, err = error_of({"model": MODEL, "prompt": []})
    assert code == 400 and err["param"] == "prompt"
    assert error_of({"model": MODEL, "prompt": [1], "max_tokens": 40000})[0] == 400

    text = e.post(
        "/v1/completions",
        {"model": MODEL, "prompt": "hello world", "max_tokens": 5, "return_token_ids": True},
    )
    choice = text["choices"][0]
    assert text["usage"] == {
        "prompt_tokens": 12,
        "completion_tokens": 5,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert choice["prompt_token_ids"][0] == 1 and len(choice["text"]) == 5
    assert choice["finish_reason"] == "length" and text["kv_transfer_params"] is None

    messages = [{"role": "user", "content": "hi"}]
    chat = e.post(
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": messages,
            "max_completion_tokens": 4,
            "return_token_ids": True,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert chat["object"] == "chat.completion" and len(chat["choices"][0]["message"]["content"]) == 4
    assert len(chat["choices"][0]["token_ids"]) == 4 and chat["prompt_token_ids"][0] == 1
    assert chat["choices"][0]["message"]["reasoning_content"] is None

    # vLLM's /tokenize and /detokenize, which a gateway uses to route by token ids.
    tokenized = e.post("/tokenize", {"model": MODEL, "messages": messages})
    assert tokenized["tokens"] == chat["prompt_token_ids"] and tokenized["count"] == len(tokenized["tokens"])
    assert (
        e.post("/tokenize", {"model": MODEL, "prompt": "hello world"})["tokens"] == choice["prompt_token_ids"]
    )
    assert (
        e.post("/detokenize", {"model": MODEL, "tokens": choice["prompt_token_ids"]})["prompt"]
        == "hello world"
    )
