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


async def test_the_same_events_come_out_however_the_stream_is_split() -> None:
    stream = (
        b'data: {"a": 1}\n\n: keep-alive\n\ndata: {"b":\r\ndata: 2}\r\n\r\n'
        b'data: {"c": "\xc3\xa9"}\n\ndata: [DONE]\n\ndata: {"tail": 1}'
    )
    expected = [
        (b'data: {"a": 1}\n\n', '{"a": 1}'),
        (b": keep-alive\n\n", ""),
        (b'data: {"b":\r\ndata: 2}\r\n\r\n', '{"b":\n2}'),
        (b'data: {"c": "\xc3\xa9"}\n\n', '{"c": "é"}'),
        (b"data: [DONE]\n\n", "[DONE]"),
        (b'data: {"tail": 1}\n', '{"tail": 1}'),
    ]
    lines = stream.splitlines(keepends=True)
    splits = {
        "one read": [stream],
        "line by line": lines,
        "byte by byte": [stream[i : i + 1] for i in range(len(stream))],
        "events glued in threes": [b"".join(lines[i : i + 3]) for i in range(0, len(lines), 3)],
    }
    for how, chunks in splits.items():
        events = [e async for e in sse.events(_lines(*chunks))]
        assert [(e.raw, e.data) for e in events] == expected, how
