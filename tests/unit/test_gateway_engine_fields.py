"""engine_fields: a completion body keeps only the top-level fields vLLM accepts on its endpoint,
and those the operator lets through."""

from __future__ import annotations

from typing import Any

import pytest

from kvplane.services.gateway.engine_fields import CHAT_FIELDS, COMPLETION_FIELDS, drop_unknown_fields

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": [1, 2, 3]}


@pytest.mark.parametrize(("chat", "base"), [(True, CHAT), (False, COMPLETION)], ids=["chat", "completions"])
def test_an_unknown_field_is_dropped_and_vllms_own_are_kept(chat: bool, base: dict[str, Any]) -> None:
    body = {**base, "x": [[], [], []], "top_k": 5, "seed": 7, "stream": True, "Seed": 1}
    assert drop_unknown_fields(body, chat) == ["x", "Seed"]
    assert body == {**base, "top_k": 5, "seed": 7, "stream": True}


def test_each_endpoint_keeps_only_its_own_fields() -> None:
    chat = {**CHAT, "prompt": "hi", "suffix": "s", "tools": [], "max_completion_tokens": 3}
    assert drop_unknown_fields(chat, chat=True) == ["prompt", "suffix"]
    completion = {**COMPLETION, "messages": [], "suffix": "s", "tools": [], "max_completion_tokens": 3}
    assert drop_unknown_fields(completion, chat=False) == ["messages", "tools", "max_completion_tokens"]
    assert completion == {**COMPLETION, "suffix": "s"}


def test_fields_the_operator_passes_through_are_kept_on_both_endpoints() -> None:
    for chat, base in ((True, CHAT), (False, COMPLETION)):
        body = {**base, "engine_extension": {"a": 1}, "x": 1}
        assert drop_unknown_fields(body, chat, ["engine_extension"]) == ["x"]
        assert body["engine_extension"] == {"a": 1}


def test_the_fields_kvplane_sets_or_reads_on_the_legs_are_the_engines_own() -> None:
    # Set by the gateway on the legs (the salt, D's token ids, the route's params, P's one token),
    # or read from the client's body on the way (the chat fields /tokenize is given).
    both = {"model", "stream", "stream_options", "max_tokens", "cache_salt", "return_token_ids"}
    assert both | {"kv_transfer_params", "prompt"} <= COMPLETION_FIELDS
    chat = {"messages", "max_completion_tokens", "add_generation_prompt", "tools", "chat_template"}
    assert both | chat | {"chat_template_kwargs", "continue_final_message"} <= CHAT_FIELDS
    # Admission takes the conversation id before the filter runs: it is no engine's field.
    assert "conversation_id" not in COMPLETION_FIELDS | CHAT_FIELDS


@pytest.mark.parametrize(("chat", "base"), [(True, CHAT), (False, COMPLETION)], ids=["chat", "completions"])
def test_fields_only_the_deployment_may_set_never_reach_the_engines(chat: bool, base: dict[str, Any]) -> None:
    owned = {"ec_transfer_params": {"remote_block_ids": [1]}, "request_id": "another", "priority": -100}
    body = {**base, **owned, "seed": 7}
    # Whatever the operator passes through.
    assert drop_unknown_fields(body, chat, list(owned)) == list(owned)
    assert body == {**base, "seed": 7}
