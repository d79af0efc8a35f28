"""What the gateway does with each event of D's stream: as little as the turn needs.

The gateway needs three things from D's events: when the first token came (TTFT),
D's handle (the last event's `kv_transfer_params`, which the client must not
see), and, only for a decode engine whose handle brings no digests of what it
retains (an engine without kvplane's connector), the output token ids, from
which routing digests them. Parsing and re-encoding every event's JSON for that
costs more CPU than the rest of the turn's forwarding; so D is asked for token
ids only when the client asked for them or the turn needs them, and an event is
parsed only when it can hold something the turn needs. Every other event goes to
the client as D wrote it.

Whether an engine's handles bring digests is learned from its last answer
(`DigestingEngines`): an engine seen without them, or not seen yet, is asked for
token ids. An engine that stops sending digests costs one handle without them
(routing then recomputes that conversation's next turn rather than pull an
unproven prefix) and is asked for token ids from then on.
"""

from __future__ import annotations

from typing import Any

from kvplane.services.client import Endpoint
from kvplane.services.common.model.handles import KEY_DIGESTS
from kvplane.services.common.runtime.bounded_map import BoundedMap
from kvplane.services.gateway.progress import TurnProgress, absorb
from kvplane.services.gateway.sse import SseEvent, encode

# Decode engines whose last answer is remembered.
_MAX_ENGINES = 4096
_HANDLE_KEY = b'"kv_transfer_params"'
_CHOICES_KEY = b'"choices"'
_USAGE_KEY = b'"prompt_tokens_details"'
_DONE = b"[DONE]"


class DigestingEngines:
    """Per decode engine: did its last answer's handle bring digests of the tokens it retains?"""

    def __init__(self, limit: int = _MAX_ENGINES) -> None:
        self._digests: BoundedMap[tuple[str, str, str], bool] = BoundedMap(limit)

    def digests(self, engine: Endpoint) -> bool:
        return self._digests.get(_key(engine)) is True

    def learn(self, engine: Endpoint, decode_params: dict[str, Any] | None) -> None:
        """Remembers what a finished turn's handle brought (nothing learned from a turn without one)."""
        if decode_params:
            digests = decode_params.get(KEY_DIGESTS)
            brought = isinstance(digests, str) and bool(digests)
            self._digests.put(_key(engine), brought)

    def ask_for_token_ids(self, engine: Endpoint, *, client_asked: bool, prompt_known: bool) -> bool:
        """Whether D's request asks for token ids: the client wants them, or the report may need the
        prompt's or the output's (the prompt's are not known yet, or D's handle may lack digests)."""
        return client_asked or not prompt_known or not self.digests(engine)


class DecodeEvents:
    """One turn's pass over D's events."""

    def __init__(self, progress: TurnProgress, *, asked_ids: bool, keep_ids: bool, collect_ids: bool) -> None:
        """`asked_ids`: D was asked for token ids; `keep_ids`: the client wants them; `collect_ids`:
        the report needs the output's (D's handle may lack digests)."""
        self.progress = progress
        self.keep_ids = keep_ids
        # Ids from some events only would not be the output: collected from every event, or none.
        self._collect = asked_ids and collect_ids
        # Every event carries token ids that must be taken out, or kept for the report.
        self._every_event = asked_ids and (not keep_ids or collect_ids)

    @property
    def collects_ids(self) -> bool:
        """The output's ids are kept for the report."""
        return self._collect

    def opaque(self, chunk: bytes) -> bool:
        """Whether every event in `chunk` (one event, or whole events read together) goes to the
        client as D wrote it, with nothing the turn needs in it: then it is not looked into. Not
        the stream's end either, which the relay must see."""
        if self._every_event or _HANDLE_KEY in chunk or _USAGE_KEY in chunk or _DONE in chunk:
            return False
        return self.progress.ttft_s is not None or _CHOICES_KEY not in chunk

    def forward(self, event: SseEvent) -> tuple[bytes, bool]:
        """The bytes to send the client for `event`, and whether it carries a choice (a token);
        an event not parsed says no, which matters only until the first token is seen."""
        raw = event.raw
        if self.opaque(raw):
            return raw, False
        payload = event.json()
        if payload is None:
            return raw, False
        if absorb(payload, self.progress, self.keep_ids, collect_output_ids=self._collect):
            raw = encode(payload)
        return raw, bool(payload.get("choices"))


def _key(engine: Endpoint) -> tuple[str, str, str]:
    """An engine: its node and incarnation, and its URL (fallback engines share one node id)."""
    return (engine.node_id, engine.incarnation, engine.http_url)
