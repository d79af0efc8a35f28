"""A deterministic byte-level tokenizer and a fixed chat template.

Token ids: 0 pad, 1 BOS, 2 EOS, and byte ``b`` is ``b + 3``. Ids up to the
vocabulary size are valid in token-id prompts; the ones above 258 have no
text and render as ``<id>``. Because it is byte level, re-tokenizing a
prompt followed by generated text gives back exactly the same ids, so a chat
client that resends the history continues D's token sequence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
BYTE_OFFSET = 3
NUM_BYTE_IDS = 256


# A chat turn with reasoning starts with THINK_OPEN, reasoning text, THINK_CLOSE, then the answer.
THINK_OPEN_TEXT = "<think>\n"
THINK_CLOSE_TEXT = "\n</think>\n\n"


class PromptError(Exception):
    """A prompt or message list the simulator cannot tokenize."""


def encode(text: str, add_bos: bool = True) -> list[int]:
    ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
    return [BOS_ID, *ids] if add_bos else ids


def think_open() -> list[int]:
    return encode(THINK_OPEN_TEXT, add_bos=False)


def think_close() -> list[int]:
    return encode(THINK_CLOSE_TEXT, add_bos=False)


def decode(ids: Sequence[int]) -> str:
    out = bytearray()
    parts: list[str] = []
    for t in ids:
        if BYTE_OFFSET <= t < BYTE_OFFSET + NUM_BYTE_IDS:
            out.append(t - BYTE_OFFSET)
            continue
        if out:
            parts.append(out.decode("utf-8", errors="replace"))
            out.clear()
        if t not in (PAD_ID, BOS_ID, EOS_ID):
            parts.append(f"<{t}>")
    if out:
        parts.append(out.decode("utf-8", errors="replace"))
    return "".join(parts)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # OpenAI content parts: only text parts exist in the simulator.
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise PromptError("only text content parts are supported")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise PromptError("message content must be a string or a list of text parts")


def render_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """ChatML-style rendering: each message as <|im_start|>role\\ncontent<|im_end|>\\n."""
    if not messages:
        raise PromptError("messages must not be empty")
    parts = []
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise PromptError("each message needs a string role")
        parts.append(f"<|im_start|>{m['role']}\n{_content_text(m.get('content'))}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)
