"""D's events through the gateway: parsed only when the turn needs something from them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvplane.services.client import Endpoint
from kvplane.services.common.model.handles import KEY_DIGESTS
from kvplane.services.gateway.decode_events import DecodeEvents, DigestingEngines
from kvplane.services.gateway.progress import TurnProgress
from kvplane.services.gateway.sse import SseEvent

D = Endpoint("d0", "http://d0", "inc-1")
HANDLE = {"remote_engine_id": "d", "remote_num_tokens": 9, KEY_DIGESTS: "ZGln"}


def event(payload: dict[str, Any] | str) -> SseEvent:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return SseEvent(f"data: {data}\n\n".encode(), data)


def token(i: int, *, ids: bool, last: bool = False) -> SseEvent:
    choice: dict[str, Any] = {"index": 0, "text": f"t{i}", "finish_reason": "stop" if last else None}
    if ids:
        choice["token_ids"] = [100 + i]
    payload: dict[str, Any] = {"id": "c", "choices": [choice]}
    if last:
        payload["kv_transfer_params"] = HANDLE
    return event(payload)


def run(events: DecodeEvents, stream: list[SseEvent]) -> list[bytes]:
    out = []
    for e in stream:
        raw, has_token = events.forward(e)
        if events.progress.ttft_s is None and has_token:
            events.progress.ttft_s = 1.0
        out.append(raw)
    return out


def test_an_engine_is_asked_for_token_ids_until_its_handles_are_known_to_bring_digests() -> None:
    engines = DigestingEngines()
    assert engines.ask_for_token_ids(D, client_asked=False, prompt_known=True)
    engines.learn(D, HANDLE)
    assert not engines.ask_for_token_ids(D, client_asked=False, prompt_known=True)
    assert engines.ask_for_token_ids(D, client_asked=True, prompt_known=True)
    assert engines.ask_for_token_ids(D, client_asked=False, prompt_known=False)
    # A new incarnation of the node is another engine; so is another URL under one node id (the
    # gateway's fallback engines).
    for other in (Endpoint("d0", "http://d0", "inc-2"), Endpoint("d0", "http://d1", "inc-1")):
        assert engines.ask_for_token_ids(other, client_asked=False, prompt_known=True)
    # A turn that ended without a handle teaches nothing; one without digests does.
    engines.learn(D, None)
    assert engines.digests(D)
    engines.learn(D, {"remote_engine_id": "d"})
    assert not engines.digests(D)


def test_events_without_token_ids_pass_as_d_wrote_them_but_the_first_token_and_the_handle() -> None:
    progress = TurnProgress("pull", prompt_ids=[1, 2, 3])
    events = DecodeEvents(progress, asked_ids=False, keep_ids=False, collect_ids=False)
    stream = [token(i, ids=False, last=i == 3) for i in range(4)] + [event("[DONE]")]
    out = run(events, stream)
    # Tokens after the first are D's own bytes, not a copy re-encoded from parsed JSON.
    assert out[1] is stream[1].raw and out[2] is stream[2].raw and out[4] is stream[4].raw
    assert progress.ttft_s is not None
    # The handle is taken out of the last event, which keeps its token.
    assert progress.decode_params == HANDLE
    last = json.loads(out[3][6:])
    assert "kv_transfer_params" not in last and last["choices"][0]["text"] == "t3"


@pytest.mark.parametrize("keep", [False, True])
def test_output_ids_are_collected_while_the_handle_may_lack_digests(keep: bool) -> None:
    progress = TurnProgress("pull", prompt_ids=[1, 2, 3])
    events = DecodeEvents(progress, asked_ids=True, keep_ids=keep, collect_ids=True)
    out = run(events, [token(i, ids=True, last=i == 3) for i in range(4)])
    assert progress.output_ids == [100, 101, 102, 103]
    assert all((b"token_ids" in raw) is keep for raw in out)


def test_ids_the_client_asked_for_are_not_collected_once_the_handle_brings_digests() -> None:
    progress = TurnProgress("pull", prompt_ids=[1, 2, 3])
    events = DecodeEvents(progress, asked_ids=True, keep_ids=True, collect_ids=False)
    stream = [token(i, ids=True, last=i == 3) for i in range(4)]
    out = run(events, stream)
    assert out[1] is stream[1].raw and out[2] is stream[2].raw
    # Events read for the first token and the handle give no partial list of output ids.
    assert progress.output_ids == []
    assert progress.decode_params == HANDLE
    assert progress.retained_ids_for_routing(True) == []


def test_a_chunk_is_left_unread_only_when_nothing_in_it_is_the_turns() -> None:
    """Tokens past the first, with no handle, usage or end in them, go on as D wrote them; any
    chunk holding one of those is read, as is every chunk of a turn that needs every event."""
    progress = TurnProgress("recompute_no_handle", [1, 2, 3])
    events = DecodeEvents(progress, asked_ids=False, keep_ids=False, collect_ids=False)
    plain = token(1, ids=False).raw + token(2, ids=False).raw
    assert not events.opaque(plain), "the first token is timed"
    progress.ttft_s = 0.5
    assert events.opaque(plain)
    assert events.opaque(b": keep-alive\n\n")
    assert not events.opaque(token(3, ids=False, last=True).raw), "D's handle"
    assert not events.opaque(plain + b"data: [DONE]\n\n"), "the stream's end"
    usage = event({"id": "c", "choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 3}}})
    assert not events.opaque(usage.raw)
    every = DecodeEvents(TurnProgress("pull", [1]), asked_ids=True, keep_ids=False, collect_ids=False)
    every.progress.ttft_s = 0.5
    assert not every.opaque(plain), "token ids to take out of every event"
