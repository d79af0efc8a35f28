"""The rules a completion body must meet before any route or engine call.

A bad body is the client's fault and must be answered 400 naming the field,
before it costs a tokenize call, a Route (which checks a handle out) or a P
leg. The checks, in order:

1. `model`: a string of 1..256 bytes without control characters, if given.
2. The prompt. Chat: `messages`, a non-empty list of objects, each with a
   string `role` and a `content` that is a string, a list of parts (objects
   with a string `type`; a text part's `text` a string) or null.
   Completions: `prompt`, a string or a non-empty list of token ids,
   or a batch of exactly one of those (the P/D legs carry one handle each,
   so batches are refused); never `prompt_embeds` (routing and the pull's
   prefix check go by token ids).
3. Token ids: integers (not booleans) in [0, vocab_size) when the vocabulary
   is configured, else in [0, 2^32) (routing's wire type); at most
   `max_prompt_tokens` of them.
4. Numbers: the token limits are integers in [1, 2^31); `n` is 1 (a turn's
   legs carry one handle each); sampling settings are finite numbers; `seed`
   fits in 64 bits; flags are booleans.
5. With `max_model_len` configured and a token-id prompt: prompt plus
   `max_tokens` fit in it (else P would accept what D later rejects).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvplane.services.gateway.openai_errors import RequestRejected

MAX_MODEL_NAME = 256
TOKEN_ID_LIMIT = 1 << 32
MAX_TOKENS_LIMIT = (1 << 31) - 1
SEED_LIMIT = 1 << 63
# A prompt's most token ids unless configured otherwise.
MAX_PROMPT_TOKENS = 1 << 20

_INT_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens")
_NUMBER_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "length_penalty",
)
_BOOL_FIELDS = (
    "stream",
    "ignore_eos",
    "return_token_ids",
    "echo",
    "add_generation_prompt",
    "continue_final_message",
    "skip_special_tokens",
)
_OBJECT_FIELDS = ("stream_options", "chat_template_kwargs", "logit_bias", "response_format")


@dataclass(frozen=True, slots=True)
class BodyLimits:
    # The engines' vocabulary size; 0: unknown, token ids are only checked against 2^32.
    vocab_size: int = 0
    # The engines' context length, tokens; 0: unknown, the engines check it.
    max_model_len: int = 0
    # Most token ids in a prompt.
    max_prompt_tokens: int = MAX_PROMPT_TOKENS


def has_control(text: str) -> bool:
    """C0 controls (NUL, CR, LF, ...), DEL and C1 controls: never part of a name or an id."""
    return any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in text)


def check_completion(body: Mapping[str, Any], chat: bool, limits: BodyLimits) -> None:
    """Raises RequestRejected (400, naming the field) unless `body` meets the rules above."""
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str) or not model or len(model.encode()) > MAX_MODEL_NAME:
            raise RequestRejected(400, f"model must be a string of 1 to {MAX_MODEL_NAME} bytes", "model")
        if has_control(model):
            raise RequestRejected(400, "model contains control characters", "model")
    if chat:
        _check_messages(body.get("messages"))
    else:
        if body.get("prompt_embeds") is not None:
            # Routing places a turn, and P verifies the KV it pulls, by the prompt's token ids.
            raise RequestRejected(
                400, "prompt_embeds is not served: send the prompt as text or token ids", "prompt_embeds"
            )
        _check_prompt(body.get("prompt"), limits)
    for name in _INT_FIELDS:
        _int(body, name, 1, MAX_TOKENS_LIMIT)
    for name in ("n", "best_of"):
        # A turn's P and D legs carry one handle each: one sequence per request.
        if body.get(name) is not None and (body[name] != 1 or isinstance(body[name], bool)):
            raise RequestRejected(400, f"only {name}=1 is served", name)
    _int(body, "seed", -SEED_LIMIT, SEED_LIMIT - 1)
    _int(body, "top_k", -1, MAX_TOKENS_LIMIT)
    if chat:
        _int(body, "top_logprobs", 0, 1 << 10)
        if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
            raise RequestRejected(400, "logprobs must be a boolean", "logprobs")
    else:
        _int(body, "logprobs", 0, 1 << 10)
    for name in _NUMBER_FIELDS:
        value = body.get(name)
        if value is not None and (
            not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value)
        ):
            raise RequestRejected(400, f"{name} must be a finite number", name)
    for name in _BOOL_FIELDS:
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise RequestRejected(400, f"{name} must be a boolean", name)
    for name in _OBJECT_FIELDS:
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise RequestRejected(400, f"{name} must be an object", name)
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise RequestRejected(400, "stop must be a string or a list of strings", "stop")
    _check_context(body, chat, limits)


def _int(body: Mapping[str, Any], name: str, low: int, high: int) -> None:
    value = body.get(name)
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise RequestRejected(400, f"{name} must be an integer between {low} and {high}", name)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestRejected(400, "messages must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestRejected(400, f"{where} must be an object", where)
        role = message.get("role")
        if not isinstance(role, str) or not role or has_control(role):
            raise RequestRejected(400, f"{where}.role must be a non-empty string", f"{where}.role")
        content = message.get("content")
        parts_ok = isinstance(content, list) and all(_part_ok(part) for part in content)
        if content is not None and not isinstance(content, str) and not parts_ok:
            raise RequestRejected(
                400,
                f"{where}.content must be a string, a list of parts (objects with a string type; "
                "a text part's text a string) or null",
                f"{where}.content",
            )


def _part_ok(part: Any) -> bool:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        return False
    return part["type"] != "text" or isinstance(part.get("text"), str)


def single_prompt(prompt: Any) -> Any:
    """A batch of one is the prompt itself."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return prompt[0]
    return prompt


def _check_prompt(prompt: Any, limits: BodyLimits) -> None:
    prompt = single_prompt(prompt)
    if isinstance(prompt, str):
        if not prompt:
            raise RequestRejected(400, "prompt must not be empty", "prompt")
        return
    if not isinstance(prompt, list) or not prompt:
        raise RequestRejected(
            400, "prompt must be a string or a non-empty list of token ids (batches are not served)", "prompt"
        )
    if len(prompt) > limits.max_prompt_tokens:
        raise RequestRejected(
            400, f"prompt has {len(prompt)} token ids; the limit is {limits.max_prompt_tokens}", "prompt"
        )
    if limits.max_model_len and len(prompt) > limits.max_model_len:
        # Longer than the whole context: refused by its length before its ids are looked at.
        check_context(len(prompt), {}, False, limits)
    bound = limits.vocab_size or TOKEN_ID_LIMIT
    # Checked in C (the set of the ids' types, then their least and greatest): a prompt runs to
    # many thousands of ids on every turn. `bool` is its own type here, so True is no token id.
    if set(map(type, prompt)) != {int} or min(prompt) < 0 or max(prompt) >= bound:
        raise RequestRejected(400, f"prompt's token ids must be integers in [0, {bound})", "prompt")


def _check_context(body: Mapping[str, Any], chat: bool, limits: BodyLimits) -> None:
    prompt = None if chat else single_prompt(body.get("prompt"))
    check_context(len(prompt) if isinstance(prompt, list) else 0, body, chat, limits)


def check_context(prompt_tokens: int, body: Mapping[str, Any], chat: bool, limits: BodyLimits) -> None:
    """Raises RequestRejected unless a prompt of `prompt_tokens` plus the completion fits the context
    (once a text prompt is tokenized, its length is known before Route)."""
    if not limits.max_model_len:
        return
    wanted = max_output_tokens(body, chat) or 0
    if prompt_tokens + wanted > limits.max_model_len:
        raise RequestRejected(
            400,
            f"This model's maximum context length is {limits.max_model_len} tokens; the request asks for "
            f"{prompt_tokens + wanted} ({prompt_tokens} in the prompt, {wanted} in the completion)",
            "max_tokens",
        )


def max_output_tokens(body: Mapping[str, Any], chat: bool) -> int | None:
    """The most tokens the request may generate, None when it sets no bound (the context's rest)."""
    wanted = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens")
    return wanted if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted >= 0 else None
