"""A turn's prompt as routing sees it: token ids when they can be had, else a length.

Token ids let routing prove that the prompt continues the retained tokens,
and sending ids (not text) to the engines keeps P's own check exact: the
engine never re-tokenizes a join between history and new text.

- `/v1/completions` with a token-id prompt: the ids, as sent.
- A text prompt: the model's tokenizer in this process when configured
  (`local_tokenizer.py`), else the engine's `/tokenize` (vLLM's API) when
  configured; the completions body then carries the ids.
- Chat: the same two, with the messages; the body keeps its messages, since
  the engine's chat handling (templates, tool calls, reasoning) must see them.
  With neither, the length is an estimate from the UTF-8 size, and P's
  connector checks the real tokens before a pull.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvplane.services.client.tokenize import TokenizeFailed, is_token_ids, tokenize
from kvplane.services.client.tokenize import single_prompt as _single_prompt
from kvplane.services.gateway.local_tokenizer import LocalTokenizers

# An engine without /tokenize (404, 405) is not asked again for this long, seconds.
_MISSING_RETRY_S = 60.0


class UnknownModel(Exception):
    """The engine does not serve the request's model: that request is answered 404.

    Only that request: /tokenize stays in use for every other one."""

    def __init__(self, message: str, body: bytes) -> None:
        super().__init__(message)
        self.body = body


class TokenizeEndpoints:
    """Remembers engines that have no /tokenize, so that each turn does not pay for asking."""

    def __init__(self) -> None:
        self._missing_until: dict[str, float] = {}

    def usable(self, url: str) -> bool:
        return bool(url) and self._missing_until.get(url, 0.0) <= time.monotonic()

    def missing(self, url: str) -> None:
        self._missing_until[url] = time.monotonic() + _MISSING_RETRY_S


@dataclass(frozen=True, slots=True)
class RoutedPrompt:
    # Exact ids, when known.
    token_ids: tuple[int, ...]
    # Length in tokens; an estimate when `token_ids` is empty.
    tokens: int


def estimate_tokens(body: Mapping[str, Any], chat: bool) -> int:
    """An upper-end guess of the prompt's length: its UTF-8 size, which few tokenizers exceed."""
    source = body.get("messages") if chat else _single_prompt(body)
    text = source if isinstance(source, str) else json.dumps(source, ensure_ascii=False)
    return max(1, len(text.encode()))


async def routed_prompt(
    session: aiohttp.ClientSession,
    body: dict[str, Any],
    chat: bool,
    tokenize_url: str,
    timeout_s: float,
    endpoints: TokenizeEndpoints | None = None,
    timed: Callable[[str, float], None] | None = None,
    local: LocalTokenizers | None = None,
) -> RoutedPrompt:
    """The prompt for Route; a text completions prompt in `body` becomes its token ids when known.

    `timed(outcome, seconds)` hears how long tokenizing took: "local" (the model's tokenizer in
    this process), or the engine's /tokenize ("ok" or "error") when it was asked."""
    if not chat:
        prompt = _single_prompt(body)
        if is_token_ids(prompt):
            return RoutedPrompt(tuple(prompt), len(prompt))
    if local:
        start = time.perf_counter()
        # In a thread: the tokenizer (Rust) lets go of the GIL while it encodes, so the gateway's
        # loop goes on relaying other turns' streams meanwhile (a long prompt takes milliseconds).
        known = await asyncio.to_thread(local.token_ids, body, chat)
        if known:
            if timed is not None:
                timed("local", time.perf_counter() - start)
            if not chat:
                body["prompt"] = list(known)
            return RoutedPrompt(known, len(known))
    if tokenize_url and (endpoints is None or endpoints.usable(tokenize_url)):
        start = time.perf_counter()
        try:
            ids = await tokenize(session, tokenize_url, body, chat, timeout_s)
        except TokenizeFailed as exc:
            if timed is not None:
                timed("error", time.perf_counter() - start)
            if exc.unknown_model:
                raise UnknownModel(f"model {body.get('model')!r} is not served", exc.body) from None
            if endpoints is not None and exc.status in (404, 405):
                endpoints.missing(tokenize_url)
            ids = ()
        else:
            if timed is not None:
                timed("ok", time.perf_counter() - start)
        if ids:
            if not chat:
                body["prompt"] = list(ids)
            return RoutedPrompt(ids, len(ids))
    return RoutedPrompt((), estimate_tokens(body, chat))
