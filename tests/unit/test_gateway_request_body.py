"""The rules a completion body must meet before any route or engine call: a 400 naming the field."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvplane.services.gateway.openai_errors import RequestRejected
from kvplane.services.gateway.request_body import (
    BodyLimits,
    check_completion,
    check_context,
    has_control,
    single_prompt,
)

CHAT = [{"role": "user", "content": "hi"}]
DEFAULTS = BodyLimits()


def _field(body: dict[str, Any], chat: bool = True, limits: BodyLimits = DEFAULTS) -> str | None:
    with pytest.raises(RequestRejected) as raised:
        check_completion(body, chat, limits)
    assert raised.value.status == 400
    return raised.value.param


def test_well_formed_chat_and_completion_bodies_pass() -> None:
    check_completion(
        {"model": "m", "messages": CHAT, "max_tokens": 5, "temperature": 0.5}, True, BodyLimits()
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}]
    check_completion({"messages": parts, "stream": True, "stop": ["x"]}, True, BodyLimits())
    check_completion({"prompt": [1, 2, 3], "n": 1, "seed": -1}, False, BodyLimits(vocab_size=10))
    check_completion({"prompt": ["a batch of one"]}, False, BodyLimits())


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": "", "messages": CHAT}, "model"),
        ({"model": "m\nx", "messages": CHAT}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages[0].content"),
        ({"messages": CHAT, "max_tokens": 0}, "max_tokens"),
        ({"messages": CHAT, "max_tokens": True}, "max_tokens"),
        ({"messages": CHAT, "n": 2}, "n"),
        ({"messages": CHAT, "seed": 1 << 63}, "seed"),
        ({"messages": CHAT, "temperature": math.inf}, "temperature"),
        ({"messages": CHAT, "stream": "yes"}, "stream"),
        ({"messages": CHAT, "logprobs": 1}, "logprobs"),
        ({"messages": CHAT, "response_format": "json"}, "response_format"),
        ({"messages": CHAT, "stop": [1]}, "stop"),
    ],
)
def test_a_malformed_chat_body_names_the_field(body: dict[str, Any], field: str) -> None:
    assert _field(body) == field


@pytest.mark.parametrize("prompt", ["", [], [["a"], ["b"]], ["a", "b"], [1, True], [-1], [1 << 32], [1.0]])
def test_a_malformed_prompt_is_refused(prompt: Any) -> None:
    assert _field({"prompt": prompt}, chat=False) == "prompt"


def test_token_ids_are_checked_against_the_vocabulary_and_the_prompt_limit() -> None:
    assert _field({"prompt": [10]}, chat=False, limits=BodyLimits(vocab_size=10)) == "prompt"
    assert _field({"prompt": [1, 2, 3]}, chat=False, limits=BodyLimits(max_prompt_tokens=2)) == "prompt"


def test_a_token_prompt_and_its_completion_must_fit_the_context() -> None:
    limits = BodyLimits(max_model_len=10)
    check_completion({"prompt": [1] * 6, "max_tokens": 4}, False, limits)
    assert _field({"prompt": [1] * 6, "max_tokens": 5}, chat=False, limits=limits) == "max_tokens"
    with pytest.raises(RequestRejected, match="11 \\(8 in the prompt, 3 in the completion\\)"):
        check_context(8, {"max_completion_tokens": 3}, True, limits)
    check_context(8, {"max_completion_tokens": 3}, True, BodyLimits())  # unknown context: the engines judge


def test_a_prompt_longer_than_the_context_is_refused_by_its_length_before_its_ids_are_read() -> None:
    # Its ids are never looked at: the refusal is the context's, not the ids' (a float among them).
    with pytest.raises(RequestRejected) as refused:
        check_completion({"prompt": [1] * 11 + [0.5]}, False, BodyLimits(max_model_len=10))
    assert "maximum context length is 10" in refused.value.message
    assert refused.value.param == "max_tokens"


def test_control_characters_and_batches_of_one() -> None:
    assert has_control("a\x00") and has_control("a\x7f") and has_control("a\x85") and not has_control("é")
    assert single_prompt(["x"]) == "x" and single_prompt([[1, 2]]) == [1, 2] and single_prompt([1]) == [1]


def test_prompt_embeds_are_refused() -> None:
    # Routing places the turn, and P checks the KV it pulls, by the prompt's token ids.
    assert _field({"prompt": "hi", "prompt_embeds": "AAAA"}, chat=False) == "prompt_embeds"
