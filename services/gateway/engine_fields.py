"""The top-level fields of a completion body the engines accept; every other one is dropped before
the body is forwarded.

vLLM's OpenAI server allows extra fields (it logs their names at debug level and ignores them), so
a field it does not know would travel to P and to D on every leg of every turn, parsed by each
(`{"prompt": "hi", "x": [[], [], ...]}` costs the engines what it costs the gateway, twice) and
waiting there for the first engine extension that reads it. What the engines do not know is
dropped instead; a deployment whose engines have extensions names their fields in
`gateway.pass_through_fields`.

The fields kvplane itself reads or sets are vLLM's too (`cache_salt`, `return_token_ids`,
`kv_transfer_params`, removed by admission in any case); `conversation_id` is taken out of the
body before this filter runs (`identity.take_conversation`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

# The fields of vLLM's `CompletionRequest` (vllm/entrypoints/openai/completion/protocol.py) and
# `ChatCompletionRequest` (vllm/entrypoints/openai/chat_completion/protocol.py), read from the
# vLLM 0.32.0 and 0.33.0 releases; their base, `OpenAIBaseModel`
# (vllm/entrypoints/serve/engine/protocol.py), declares none, and neither has an alias. 0.33.0
# adds `return_weight_versions` to both; the lists are the union (0.32 ignores what it lacks).
# Read them again when the supported releases change (pyproject's `vllm` extra).
_BOTH = frozenset(
    {
        "add_special_tokens",
        "allowed_token_ids",
        "bad_words",
        "cache_salt",
        "ec_transfer_params",
        "echo",
        "frequency_penalty",
        "ignore_eos",
        "include_stop_str_in_output",
        "kv_transfer_params",
        "length_penalty",
        "logit_bias",
        "logprob_token_ids",
        "logprobs",
        "max_tokens",
        "min_p",
        "min_tokens",
        "mm_payload",
        "model",
        "n",
        "presence_penalty",
        "priority",
        "prompt_logprobs",
        "repetition_detection",
        "repetition_penalty",
        "request_id",
        "response_format",
        "return_mm_kwargs",
        "return_token_ids",
        "return_token_offsets",
        "return_tokens_as_token_ids",
        "return_weight_versions",
        "routed_experts_prompt_start",
        "seed",
        "session_id",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "stop",
        "stop_token_ids",
        "stream",
        "stream_interval",
        "stream_options",
        "structured_outputs",
        "temperature",
        "thinking_token_budget",
        "top_k",
        "top_p",
        "truncate_prompt_tokens",
        "truncation_side",
        "use_beam_search",
        "user",
        "vllm_xargs",
        "watermarking",
    }
)
# /v1/completions: `CompletionRequest`.
COMPLETION_FIELDS = _BOTH | {"prompt", "prompt_embeds", "suffix"}
# /v1/chat/completions: `ChatCompletionRequest`.
CHAT_FIELDS = _BOTH | {
    "add_generation_prompt",
    "chat_template",
    "chat_template_kwargs",
    "continue_final_message",
    "documents",
    "include_reasoning",
    "max_completion_tokens",
    "media_io_kwargs",
    "messages",
    "mm_processor_kwargs",
    "parallel_tool_calls",
    "reasoning_effort",
    "return_prompt_text",
    "tool_choice",
    "tools",
    "top_logprobs",
}


# Fields of vLLM's that only the deployment may set, removed from every client's body whatever
# `gateway.pass_through_fields` says: `ec_transfer_params` names another request's encoder cache
# (as `kv_transfer_params`, removed by admission, names KV blocks), `request_id` would make the
# client choose the engine's own request id, and `priority` would let one tenant's turns jump
# every other's in an engine run with priority scheduling.
ENGINE_OWNED = frozenset({"ec_transfer_params", "request_id", "priority"})


def drop_unknown_fields(body: dict[str, Any], chat: bool, pass_through: Collection[str] = ()) -> list[str]:
    """Removes from `body` each top-level field the engines do not accept on its endpoint, unless
    `pass_through` names it, and every field in ENGINE_OWNED; returns the names removed, in the
    body's order."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = [
        name for name in body if name in ENGINE_OWNED or (name not in known and name not in pass_through)
    ]
    for name in unknown:
        del body[name]
    return unknown
