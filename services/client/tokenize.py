"""Token ids for a request, from the engine's own tokenizer (vLLM's `POST /tokenize`).

Routing proves that a prompt continues a retained conversation from its token ids, and P's
connector checks the same ids before a pull; an upstream gateway that tokenizes with anything
but the engine's tokenizer would see its pulls refused. Chat requests are tokenized with their
messages (the engine applies its chat template); completions with their prompt.

The current OpenTelemetry context goes with the call (`traceparent`), so the engine's tokenize
span joins the turn's trace.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import aiohttp
from opentelemetry import propagate

# Chat fields that change what the template renders, passed through to /tokenize.
_CHAT_FIELDS = ("tools", "chat_template", "chat_template_kwargs", "continue_final_message")


class TokenizeFailed(Exception):
    """The engine's /tokenize did not answer with token ids; `status` is its HTTP status, if any."""

    def __init__(self, message: str, status: int = 0, body: bytes = b"") -> None:
        super().__init__(message)
        self.status = status
        # The engine's answer, when it answered with an error (at most 4 KiB).
        self.body = body

    @property
    def unknown_model(self) -> bool:
        """The engine has /tokenize but not the requested model (an OpenAI error object)."""
        if self.status != 404:
            return False
        try:
            answer = json.loads(self.body)
        except ValueError:
            return False
        error = answer.get("error", answer) if isinstance(answer, dict) else None
        return isinstance(error, dict) and "model" in str(error.get("message", "")).lower()


def is_token_ids(value: Any) -> bool:
    """True for a non-empty list of non-negative ints (a token-id prompt)."""
    # Checked in C (the set of the items' types, then their least): prompts run to many
    # thousands of ids. `bool` is its own type here, so True is not a token id.
    return isinstance(value, list) and bool(value) and set(map(type, value)) == {int} and min(value) >= 0


def single_prompt(body: Mapping[str, Any]) -> Any:
    """A completions body's prompt; a batch of one is the prompt itself."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return prompt[0]
    return prompt


def tokenize_request(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """The `/tokenize` body for an OpenAI request body (chat: its messages; else its prompt)."""
    request: dict[str, Any] = {"model": body.get("model")}
    if chat:
        request["messages"] = body.get("messages")
        request["add_generation_prompt"] = body.get("add_generation_prompt", True)
        for key in _CHAT_FIELDS:
            if key in body:
                request[key] = body[key]
    else:
        request["prompt"] = single_prompt(body)
    # The ids the engine itself makes of the request: with or without the BOS and the like.
    if "add_special_tokens" in body:
        request["add_special_tokens"] = body["add_special_tokens"]
    return request


async def tokenize(
    session: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, Any],
    chat: bool,
    timeout_s: float,
) -> tuple[int, ...]:
    """Token ids of `body` (an OpenAI chat or completions body) from the engine at `url`.

    Raises TokenizeFailed when the engine does not answer with token ids (404 or 405: it has
    no /tokenize).
    """
    headers: dict[str, str] = {}
    propagate.inject(headers)
    try:
        async with session.post(
            url.rstrip("/") + "/tokenize",
            json=tokenize_request(body, chat),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            if resp.status != 200:
                answered = await resp.content.read(4096)
                raise TokenizeFailed(f"/tokenize answered {resp.status}", resp.status, answered)
            answer = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise TokenizeFailed(f"/tokenize failed: {exc!r}") from exc
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list) or not is_token_ids(tokens):
        raise TokenizeFailed("/tokenize returned no token ids")
    return tuple(tokens)
