"""Splitting an engine's SSE stream into whole events."""

from __future__ import annotations

from collections.abc import AsyncIterator

from kvplane.services.gateway import sse


async def _lines(*chunks: bytes) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


async def test_each_event_is_yielded_when_its_blank_line_arrives() -> None:
    stream = _lines(b'data: {"a": 1}\n', b"\n", b": keep-alive\n", b"\n", b"data: [DONE]\n", b"\n")
    events = [e async for e in sse.events(stream)]
    assert [e.raw for e in events] == [b'data: {"a": 1}\n\n', b": keep-alive\n\n", b"data: [DONE]\n\n"]
    assert events[0].json() == {"a": 1}
    assert events[1].json() is None and not events[1].done
    assert events[2].done and events[2].json() is None


async def test_crlf_multiline_data_and_a_trailing_partial_event() -> None:
    stream = _lines(b'data: {"a":\r\n', b"data: 2}\r\n", b"\r\n", b'data: {"b": 3}\n')
    events = [e async for e in sse.events(stream)]
    assert events[0].json() == {"a": 2}
    assert events[1].json() == {"b": 3} and events[1].raw.endswith(b"\n\n")


def test_encode_round_trips() -> None:
    raw = sse.encode({"x": "é"})
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    assert sse.SseEvent(raw, raw[6:-2].decode()).json() == {"x": "é"}
