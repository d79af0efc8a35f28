"""Splitting an engine's SSE stream into whole events."""

from __future__ import annotations

from collections.abc import AsyncIterator

from kvplane.services.gateway import sse


async def _lines(*chunks: bytes) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


async def _events(chunks: AsyncIterator[bytes]) -> list[sse.SseEvent]:
    return [event async for batch in sse.batches(chunks) for event in batch]


async def test_each_event_is_yielded_when_its_blank_line_arrives() -> None:
    stream = _lines(b'data: {"a": 1}\n', b"\n", b": keep-alive\n", b"\n", b"data: [DONE]\n", b"\n")
    events = await _events(stream)
    assert [e.raw for e in events] == [b'data: {"a": 1}\n\n', b": keep-alive\n\n", b"data: [DONE]\n\n"]
    assert events[0].json() == {"a": 1}
    assert events[1].json() is None and not events[1].done
    assert events[2].done and events[2].json() is None


async def test_crlf_multiline_data_and_a_trailing_partial_event() -> None:
    stream = _lines(b'data: {"a":\r\n', b"data: 2}\r\n", b"\r\n", b'data: {"b": 3}\n')
    events = await _events(stream)
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
        events = await _events(_lines(*chunks))
        assert [(e.raw, e.data) for e in events] == expected, how


async def test_events_that_arrive_in_one_read_come_out_together_and_at_once() -> None:
    """A reader behind on its reads gets everything that arrived meanwhile as one batch (forwarded
    in one write), and a read that completes no event yields nothing."""
    stream = _lines(
        b'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: {"c"',
        b": 3}\n",
        b"\ndata: [DONE]\n\n",
    )
    got = [[e.data for e in batch] async for batch in sse.batches(stream)]
    assert got == [['{"a": 1}', '{"b": 2}'], ['{"c": 3}', "[DONE]"]]


async def test_a_chunk_of_whole_events_the_reader_need_not_open_is_passed_on_as_it_is() -> None:
    first, second = b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\ndata: {"c": 3}\n\n'
    split = b'data: {"d": 4}\n\ndata: {"e"'
    stream = _lines(first, second, split, b": 5}\n\n", second, b"data: [DONE]\n\n")
    got = [
        b if isinstance(b, bytes) else [e.data for e in b]
        async for b in sse.batches(stream, lambda chunk: b"[DONE]" not in chunk)
    ]
    assert got == [
        first,
        second,
        # Ends inside an event: read; and the chunk that ends that event is read with it.
        ['{"d": 4}'],
        ['{"e": 5}'],
        second,
        ["[DONE]"],
    ]
