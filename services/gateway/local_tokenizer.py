"""Token ids from the model's own tokenizer files, in the gateway's process (`gateway.tokenizers`).

Asking an engine's `/tokenize` costs a turn a round trip to a busy engine before Route (5-9 ms a
call on the live comparison's sim-engines). With a model's tokenizer directory (the files vLLM
loads: `tokenizer.json`, `tokenizer_config.json`, the chat template), the gateway tokenizes as vLLM
0.32 and 0.33 do:

- a completions text prompt: encoded with special tokens unless the body's `add_special_tokens`
  is false (vLLM's default is true);
- chat messages: the chat template rendered with `add_generation_prompt` (default true),
  `continue_final_message` and `chat_template_kwargs`, then encoded without special tokens unless
  the body's `add_special_tokens` is true (what the template renders carries them).

What this does not reproduce is left to `/tokenize` (None here): `tools`, `documents` or a
request's own `chat_template`, messages with more than a role and string content (content parts,
tool calls: vLLM rewrites those before the template sees them), prompts truncated by the engine
(`truncate_prompt_tokens`), and a template that raises. A chat prompt's ids serve routing alone
(the engine renders the messages itself), so a miss costs reuse, never an answer; a completions
prompt's ids replace its text, so the directory must be the engine's own tokenizer.

Loading happens once, at start, and fails there: a gateway configured with a tokenizer it cannot
read does not start. `token_ids` may run in any thread (the gateway calls it in one, off its loop).

Measured beside the engine's `/tokenize` in the live comparison (docs/benchmarks.md, "Tokenizing
in the gateway"), the tokenizing took 2-4 ms less, but the turns' TTFT was not lower: the
tokenizer's CPU moves into the gateway's process, whose loop also relays every stream. So it is
not the default; it is there for a model whose engine is remote or busy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from kvplane.services.client.tokenize import single_prompt

# Chat fields whose effect on the rendering this module does not reproduce.
_ENGINE_RENDERED = ("tools", "documents", "chat_template")
# Completions fields that change the ids the engine ends up with.
_ENGINE_TRUNCATED = ("truncate_prompt_tokens",)
# The chat request fields the rendering reads, with vLLM's defaults.
_CHAT_OPTIONS = {"add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False}


class TokenizerUnavailable(Exception):
    """A configured tokenizer directory cannot be loaded (missing files, transformers absent)."""


class _Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


class LocalTokenizers:
    """The tokenizers of the models configured in `gateway.tokenizers`, by served model name."""

    def __init__(self, directories: Mapping[str, str]) -> None:
        self._by_model: dict[str, _Tokenizer] = {
            model: _load(model, directory) for model, directory in directories.items()
        }

    def __bool__(self) -> bool:
        return bool(self._by_model)

    def token_ids(self, body: Mapping[str, Any], chat: bool) -> tuple[int, ...] | None:
        """The ids vLLM would make of `body`'s prompt; None when its model has no tokenizer here
        or the body asks for what only the engine reproduces."""
        model = body.get("model")
        tokenizer = self._by_model.get(model) if isinstance(model, str) else None
        if tokenizer is None:
            return None
        if chat:
            return _chat_ids(tokenizer, body)
        prompt = single_prompt(body)
        if not isinstance(prompt, str) or any(k in body for k in _ENGINE_TRUNCATED):
            return None
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            return None
        return _encoded(tokenizer, prompt, special)


def _chat_ids(tokenizer: _Tokenizer, body: Mapping[str, Any]) -> tuple[int, ...] | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or any(k in body for k in _ENGINE_RENDERED):
        return None
    if not all(_plain_message(m) for m in messages):
        return None
    options = {k: body.get(k, default) for k, default in _CHAT_OPTIONS.items()}
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not all(isinstance(v, bool) for v in options.values()) or not isinstance(kwargs, dict):
        return None
    special = options.pop("add_special_tokens")
    try:
        # The request's template kwargs first: the fields above are the request's own say.
        text = tokenizer.apply_chat_template(messages, tokenize=False, **{**kwargs, **options})
    except Exception:  # any template failure is the engine's to answer
        return None
    if not isinstance(text, str):
        return None
    return _encoded(tokenizer, text, special)


def _encoded(tokenizer: _Tokenizer, text: str, special: bool) -> tuple[int, ...] | None:
    """The ids of `text`; None when the tokenizer fails on it (the engine then answers)."""
    try:
        return tuple(tokenizer.encode(text, add_special_tokens=special))
    except Exception:  # a tokenizer's own failure is never the turn's
        return None


def _plain_message(message: Any) -> bool:
    return (
        isinstance(message, dict)
        and isinstance(message.get("role"), str)
        and isinstance(message.get("content"), str)
        and message.keys() <= {"role", "content"}
    )


def _load(model: str, directory: str) -> _Tokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise TokenizerUnavailable(
            f"gateway.tokenizers needs transformers (kvplane's tokenizer extra): {exc}"
        ) from None
    try:
        tokenizer: _Tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # transformers raises many kinds; all mean unreadable
        raise TokenizerUnavailable(
            f"gateway.tokenizers[{model!r}]: cannot load a tokenizer from {directory!r}: {exc}"
        ) from None
    return tokenizer
