"""Server-sent events from an engine, one whole event at a time.

An engine writes each event (`data: {...}` then a blank line) as soon as its
token exists; the reader yields every event the moment its blank line
arrives, so the gateway can forward it without waiting for the next one, and
the events that arrived together, together.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import orjson

DONE = "[DONE]"


@dataclass(frozen=True, slots=True)
class SseEvent:
    """One event: its raw bytes (blank line included) and its data payload."""

    raw: bytes
    data: str

    @property
    def done(self) -> bool:
        return self.data == DONE

    def json(self) -> dict[str, Any] | None:
        """The data as a JSON object, or None when it is not one ([DONE], comments)."""
        if not self.data or self.done:
            return None
        try:
            value = orjson.loads(self.data)
        except orjson.JSONDecodeError:
            return None
        return value if isinstance(value, dict) else None


def encode(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class SseParser:
    """Groups a stream's bytes into events as they arrive, however they are split: lines, or
    whatever each read returned (one read often holds a whole event, sometimes several).

    `feed` returns every event whose blank line has arrived; `close` returns a trailing partial
    event. Reading whole chunks rather than line by line spares an await and a decode per line:
    the gateway does this for every token it streams. For any caller that has the chunks in
    hand (an HTTP response, or an Envoy ext_proc body message).
    """

    def __init__(self) -> None:
        self._raw = bytearray()
        self._data: list[bytes] = []
        self._pending = b""  # the start of a line whose end has not arrived yet

    @property
    def between_events(self) -> bool:
        """No event begun and unfinished: what follows starts a new one."""
        return not self._pending and not self._raw

    def feed(self, chunk: bytes) -> list[SseEvent]:
        out: list[SseEvent] = []
        raw, data = self._raw, self._data
        buffer = self._pending + chunk if self._pending else chunk
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            line = buffer[start : end + 1]
            start = end + 1
            raw += line
            text = line.rstrip(b"\r\n")
            if text:
                if text.startswith(b"data:"):
                    value = text[5:]
                    data.append(value[1:] if value.startswith(b" ") else value)
                continue
            if raw.strip():
                out.append(SseEvent(bytes(raw), _text(data)))
            raw.clear()
            data.clear()
        self._pending = buffer[start:]
        return out

    def close(self) -> list[SseEvent]:
        """The events left when the stream ends (it may end inside a line)."""
        out: list[SseEvent] = []
        raw, data, pending = self._raw, self._data, self._pending
        self._pending = b""
        if pending:
            raw += pending
            text = pending.rstrip(b"\r\n")
            if text.startswith(b"data:"):
                value = text[5:]
                data.append(value[1:] if value.startswith(b" ") else value)
            elif not text and raw.strip():
                out.append(SseEvent(bytes(raw), _text(data)))
                raw.clear()
                data.clear()
        if raw.strip():
            out.append(SseEvent(bytes(raw) + b"\n", _text(data)))
        raw.clear()
        data.clear()
        return out


async def batches(
    chunks: AsyncIterable[bytes], opaque: Callable[[bytes], bool] | None = None
) -> AsyncIterator[list[SseEvent] | bytes]:
    """The events of a stream of chunks, grouped by the chunk that completed them: each group as
    soon as its chunk arrives (a chunk that completes none yields nothing), then a trailing
    partial event (`SseParser`). A reader that falls behind gets what arrived meanwhile at once,
    and can forward it in one write.

    A chunk of whole events (none begun before it, its last one ended) that `opaque` says the
    reader need not look into is yielded as it is, bytes, not split into events: a relay forwards
    most of a stream so, with no work per event."""
    parser = SseParser()
    async for chunk in chunks:
        if opaque is not None and parser.between_events and chunk.endswith(b"\n\n") and opaque(chunk):
            yield chunk
        elif done := parser.feed(chunk):
            yield done
    if tail := parser.close():
        yield tail


def _text(data: list[bytes]) -> str:
    return b"\n".join(data).decode("utf-8", errors="replace")
