"""Fuzzing the gateway's endpoints over the real stack (etcd, routing over gRPC, sim-engines with NIXL).

Whatever arrives: never a 5xx, never a dropped connection or a hang, every refusal in OpenAI's error
format, and nothing routed or sent to an engine for a call the gateway refused. Bodies are drawn from
the shapes the gateway can judge (its validation rules, around the sim-engines' own rules), junk JSON
and raw bytes. Bounded: a fixed number of examples, each with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from kvplane.services.dev.local_etcd import LocalEtcd
from tests.support.gateway_stack import MODEL, GatewayStack, gateway_stack

EXAMPLES = 80
CALL_DEADLINE_S = 60.0
# The engines' context. Any count up to it is valid and is decoded in full (2 ms a token on the
# test's D): a 32k context let a valid draw run past the decode leg's 30 s limit.
MAX_MODEL_LEN = 2048

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
token = st.integers(-3, 2**33) | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=2)
good_tokens = st.lists(st.integers(300, 30_000), min_size=1, max_size=48)
prompts = (
    st.text(max_size=60)
    | good_tokens
    | st.lists(token, max_size=12)
    | st.lists(st.text(max_size=5), max_size=3)
    | st.lists(good_tokens, min_size=1, max_size=2)
    | json_values
)
# Small counts only with text prompts, whose length in tokens the gateway cannot know.
small_counts = (
    st.none() | st.integers(-2, 64) | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=3)
)
numbers = st.none() | st.floats(allow_nan=False) | st.integers(-5, 5) | st.text(max_size=3) | st.booleans()
flags = st.booleans() | json_values
ids = st.text(max_size=40) | st.integers()
text_parts = st.lists(
    st.fixed_dictionaries(
        {"type": st.just("text") | st.integers()}, optional={"text": st.text(max_size=20) | ids}
    ),
    max_size=2,
)
messages = (
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "system", ""]) | st.integers()},
            optional={"content": st.text(max_size=40) | text_parts | st.none() | json_values},
        ),
        max_size=3,
    )
    | json_values
)
common = {
    "temperature": numbers,
    "top_p": numbers,
    "seed": st.integers(-(2**65), 2**65) | st.text(max_size=2),
    "stream": flags,
    "ignore_eos": flags,
    "conversation_id": ids,
    "n": st.integers(0, 3) | st.booleans(),
    "stop": json_values,
    "kv_transfer_params": json_values,
    "cache_salt": json_values,
}
completions = st.fixed_dictionaries(
    {"model": st.just(MODEL), "prompt": prompts}, optional={**common, "max_tokens": small_counts}
) | st.fixed_dictionaries(
    # Token-id prompts with any count: the gateway knows their length against the context.
    {"model": st.just(MODEL), "prompt": good_tokens, "max_tokens": st.integers(-2, 2**40)},
    optional=common,
)
chats = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": messages}, optional={**common, "max_tokens": small_counts}
)
calls = (
    st.tuples(st.just("/v1/completions"), completions.map(lambda b: json.dumps(b).encode()))
    | st.tuples(st.just("/v1/chat/completions"), chats.map(lambda b: json.dumps(b).encode()))
    | st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), st.binary(max_size=300))
)


@pytest.fixture(scope="module")
async def stack(etcd: LocalEtcd, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GatewayStack]:
    log_dir = tmp_path_factory.mktemp("gwfuzz")
    async with gateway_stack(
        etcd, f"/kvplane-gwfuzz/{uuid.uuid4().hex}/", log_dir, max_model_len=MAX_MODEL_LEN
    ) as s:
        # The engines' limits, as a deployment configures them: what they would refuse, the gateway refuses.
        s.gateway.settings.vocab_size = 151_936
        assert s.gateway.settings.max_model_len == MAX_MODEL_LEN
        yield s


def _completion(prompt: list[int], max_tokens: int) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}).encode()


async def _call(stack: GatewayStack, path: str, data: bytes) -> tuple[int, bytes, float, int]:
    routes = await stack.gateway_metric("kvplane_gateway_leg_seconds_count", leg="route")
    seen = len(stack.proxy.seen)
    headers = {**stack.headers("acme", f"fz-{uuid.uuid4().hex}"), "Content-Type": "application/json"}
    async with stack.session.post(
        stack.gateway.url + path,
        data=data,
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=CALL_DEADLINE_S),
    ) as resp:
        raw = await resp.read()
        status = resp.status
    routed = await stack.gateway_metric("kvplane_gateway_leg_seconds_count", leg="route") - routes
    return status, raw, routed, len(stack.proxy.seen) - seen


async def test_no_input_gets_a_5xx_and_nothing_refused_reaches_routing_or_an_engine(
    stack: GatewayStack,
) -> None:
    loop = asyncio.get_running_loop()
    outcomes: dict[int, int] = {}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        # No shrinking: every step of it is a real call, and a failure is shown as drawn.
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(call=calls)
    # The longest valid generation, decoded in full, and one token more than the context holds.
    @example(call=("/v1/completions", _completion([29999], MAX_MODEL_LEN - 1)))
    @example(call=("/v1/completions", _completion([29999], MAX_MODEL_LEN)))
    def one(call: tuple[str, bytes]) -> None:
        path, data = call
        future = asyncio.run_coroutine_threadsafe(_call(stack, path, data), loop)
        status, raw, routed, sent = future.result(timeout=CALL_DEADLINE_S + 10)
        outcomes[status] = outcomes.get(status, 0) + 1
        assert status < 500, (path, data[:300], raw[:300])
        if status >= 400:
            error: Any = json.loads(raw)["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, raw[:300]
            assert (routed, sent) == (0, 0), ("refused after routing", path, data[:300], raw[:300])

    await asyncio.to_thread(one)
    print(f"\nfuzzed calls by status: {dict(sorted(outcomes.items()))}")
    # The draw reaches both sides of the boundary.
    assert any(s < 300 for s in outcomes) and any(400 <= s < 500 for s in outcomes)


# Request heads aiohttp's parser must judge: raw bytes, and request lines and headers bent out of shape.
methods = st.sampled_from([b"GET", b"POST", b"DELETE", b"G\x00T", b"", b"PRI"]) | st.binary(max_size=6)
paths = st.sampled_from([b"/v1/completions", b"/v1/models", b"/health", b"*", b""]) | st.binary(max_size=20)
versions = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/x", b""]) | st.binary(max_size=9)
header_lines = st.lists(
    # No framing that leaves a valid request waiting for a body: the answer would be the body deadline's.
    st.sampled_from([b"Host: gw", b"Content-Length: -1", b"Content-Length: x", b"X: \x00"])
    | st.binary(max_size=30),
    max_size=3,
).map(b"\r\n".join)
heads = st.binary(max_size=200) | st.builds(
    lambda m, p, v, h: m + b" " + p + b" " + v + b"\r\n" + h, methods, paths, versions, header_lines
)


async def _exchange(stack: GatewayStack, head: bytes) -> bytes:
    """Sends `head` (asking that the connection close after the answer); whatever comes back."""
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.gateway.port)
    try:
        writer.write(head + b"\r\nConnection: close\r\n\r\n")
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout=CALL_DEADLINE_S)
    finally:
        writer.close()


async def test_any_request_head_gets_a_4xx_in_openais_format_or_nothing(stack: GatewayStack) -> None:
    loop = asyncio.get_running_loop()
    outcomes: dict[int, int] = {}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(head=heads)
    def one(head: bytes) -> None:
        future = asyncio.run_coroutine_threadsafe(_exchange(stack, head), loop)
        answer = future.result(timeout=CALL_DEADLINE_S + 10)
        if not answer:
            outcomes[0] = outcomes.get(0, 0) + 1  # closed without an answer: allowed
            return
        status_line, _, rest = answer.partition(b"\r\n")
        status = int(status_line.split()[1])
        outcomes[status] = outcomes.get(status, 0) + 1
        assert status < 500, (head[:200], answer[:300])
        if status >= 400:
            headers, _, body = rest.partition(b"\r\n\r\n")
            assert b"content-type: application/json" in headers.lower(), (head[:200], answer[:300])
            error: Any = json.loads(body)["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, answer[
                :300
            ]

    await asyncio.to_thread(one)
    print(f"\nfuzzed request heads by status: {dict(sorted(outcomes.items()))}")
    assert any(400 <= s < 500 for s in outcomes)
