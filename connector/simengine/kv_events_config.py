"""The sim-engine's `--kv-events-config`: vLLM's flag, with vLLM's keys, plus the encoding.

vLLM's keys and defaults: `enable_kv_cache_events` (false), `publisher` ("zmq" when enabled,
else "null"), `endpoint` ("tcp://*:5557"), `replay_endpoint` (none), `buffer_steps` (10,000
batches kept for replay), `hwm` (the PUB socket's high-water mark, 100,000 messages),
`max_queue_size` (batches waiting for the publisher thread, 100,000), `topic` (""). kvplane
adds `encoding`: "map" (vLLM 0.32 and later: each event a map with a `type` field, the
default) or "array" (earlier releases: a tagged array), so readers of both are exercised.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from kvplane.services.common.model.kv_events import ENCODINGS, Encoding

_PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True)
class KVEventsConfig:
    """Where and how the engine publishes its KV-cache events. Counts in batches or messages."""

    enable_kv_cache_events: bool = False
    # "" resolves as vLLM's None does: "zmq" when enabled, else "null".
    publisher: str = ""
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    encoding: Encoding = "map"

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("enable_kv_cache_events must be a boolean")
        if not all(isinstance(v, str) for v in (self.endpoint, self.topic, self.replay_endpoint or "")):
            raise ValueError("endpoint, replay_endpoint and topic must be strings")
        if self.publisher not in ("", *_PUBLISHERS):
            raise ValueError(f"publisher must be one of {_PUBLISHERS}, not {self.publisher!r}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, not {self.encoding!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if not self.endpoint:
            raise ValueError("endpoint must not be empty")

    @property
    def enabled(self) -> bool:
        """Whether the engine publishes (enabled, and a zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher in ("", "zmq")

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """The flag's JSON object ("" or "{}": events off). Raises ValueError."""
        if not text.strip():
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown --kv-events-config keys {unknown}; known: {sorted(known)}")
        raw = {k: ("" if k == "publisher" and v is None else v) for k, v in raw.items()}
        return cls(**raw)

    def __str__(self) -> str:
        """The flag's JSON: the keys that differ from the defaults (what `parse` reads back)."""
        default = KVEventsConfig()
        changed: dict[str, Any] = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        }
        return json.dumps(changed, separators=(",", ":"), sort_keys=True)
