"""Server-sent events from an engine, one whole event at a time.

An engine writes each event (`data: {...}` then a blank line) as soon as its
token exists; the reader yields every event the moment its blank line
arrives, so the gateway can forward it without waiting for the next one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

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
            value = json.loads(self.data)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None


def encode(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def events(lines: AsyncIterable[bytes]) -> AsyncIterator[SseEvent]:
    """Groups lines (each with its line ending) into events; a trailing partial event is yielded too."""
    raw = bytearray()
    data: list[str] = []
    async for line in lines:
        raw += line
        text = line.decode("utf-8", errors="replace").rstrip("\r\n")
        if text:
            if text.startswith("data:"):
                value = text[5:]
                data.append(value[1:] if value.startswith(" ") else value)
            continue
        if raw.strip():
            yield SseEvent(bytes(raw), "\n".join(data))
        raw.clear()
        data.clear()
    if raw.strip():
        yield SseEvent(bytes(raw) + b"\n", "\n".join(data))
