"""The comparison's workload: multi-turn chats, the same shapes for every front.

A block is one front's share of a repeat at one concurrency: `conversations` chats of `turns`
turns, at most `concurrency` of them in flight. Each turn's prompt is the previous prompt, the
engine's answer to it and a new user message, as `kvplane.bench.live` builds them. Everything
but the token ids is a function of (seed, concurrency, repeat) alone: every front of a repeat
gets the same conversations (first prompt and user message lengths) and the same arrivals (the
start offsets of the first conversations in flight). The token ids are drawn per front as well,
so that no front finds another's blocks in a prefill engine's prefix cache.

Prompts are token ids (`token-ids`: no front tokenizes anything) or text (`text`: lowercase
words, as the engines' answers are, one token a byte under the sim-engine's byte-level
tokenizer, so a text prompt of n characters is n + 1 tokens with its BOS). With text, each front
does what it does with a user's text: kvplane's gateway asks an engine's /tokenize for the token
ids routing needs, vllm-router matches the text itself, and the engines tokenize what they get.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvplane.connector.simengine import toy_tokenizer
from kvplane.services.devstack.names import DEMO_MODEL

MODEL = DEMO_MODEL
# Token ids are drawn from this range: clear of the sim-engine's byte tokens (3..258) and its
# specials, and well inside any vocabulary the engines accept.
TOKEN_LOW, TOKEN_HIGH = 1000, 30_000
# Lengths vary by up to this fraction around the configured ones (seeded, the same per front).
JITTER = 0.1
TOKEN_IDS, TEXT = "token-ids", "text"
PROMPT_FORMATS = (TOKEN_IDS, TEXT)
# Text prompts are drawn from these characters: the ones the sim-engine's answers are made of.
TEXT_ALPHABET = "abcdefghijklmnopqrstuvwxyz     "
# A prompt as a front receives it.
Prompt = list[int] | str


@dataclass(frozen=True)
class Workload:
    """Sizes of one run's conversations (tokens) and how they arrive."""

    turns: int = 5
    first_tokens: int = 1400
    user_tokens: int = 897
    answer_tokens: int = 128
    # Every block has at least this many conversations (one at a time at concurrency 1).
    min_conversations: int = 2
    # The first conversations in flight start spread over this many seconds, seeded.
    stagger_s: float = 2.0
    # A user's pause between the end of one turn's answer and the next turn (0: at once).
    think_s: float = 0.0
    seed: int = 0
    # How prompts are sent: token ids, or text (see the module's docstring).
    prompt_format: str = TOKEN_IDS

    def __post_init__(self) -> None:
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}")
        if min(self.turns, self.first_tokens, self.answer_tokens, self.min_conversations) < 1:
            raise ValueError("turns, first_tokens, answer_tokens and min_conversations must be positive")
        if self.user_tokens < 1 or self.stagger_s < 0 or self.think_s < 0:
            raise ValueError("user_tokens must be positive, stagger_s and think_s non-negative")

    def conversations(self, concurrency: int) -> int:
        """Conversations in a block at this concurrency."""
        return max(concurrency, self.min_conversations)

    def last_prompt_tokens(self) -> int:
        """The nominal prompt of the last turn (before jitter)."""
        return self.first_tokens + (self.turns - 1) * (self.answer_tokens + self.user_tokens)


@dataclass(frozen=True)
class ConversationShape:
    """One conversation's lengths and start offset, shared by every front of a repeat."""

    index: int
    first_tokens: int
    user_tokens: tuple[int, ...]  # the new user message of turns 2, 3, ...
    start_s: float  # offset from the block's start (only the first `concurrency` wait for it)


@dataclass(frozen=True)
class BlockPlan:
    """What one front runs in one block."""

    front: str
    concurrency: int
    repeat: int
    shapes: tuple[ConversationShape, ...]
    answer_tokens: int
    seed: int
    think_s: float = 0.0
    prompt_format: str = TOKEN_IDS

    @property
    def planned_turns(self) -> int:
        return sum(1 + len(s.user_tokens) for s in self.shapes)

    def tokens(self, conversation: int) -> random.Random:
        """The token-id stream of one conversation of this front (its own, per front)."""
        return random.Random(
            f"{self.seed}/tokens/{self.front}/{self.concurrency}/{self.repeat}/{conversation}"
        )

    def draw(self, rng: random.Random, n: int) -> Prompt:
        """`n` tokens' worth of new prompt from the conversation's stream, in the block's format."""
        return draw_text(rng, n) if self.prompt_format == TEXT else draw(rng, n)

    def conversation_id(self, conversation: int) -> str:
        return f"cmp-{self.seed}-{self.front}-c{self.concurrency}-r{self.repeat}-{conversation}"


def _jittered(rng: random.Random, n: int) -> int:
    return max(1, round(n * rng.uniform(1 - JITTER, 1 + JITTER)))


def shapes(workload: Workload, concurrency: int, repeat: int) -> tuple[ConversationShape, ...]:
    """The block's conversations: a function of the seed, concurrency and repeat, never the front."""
    rng = random.Random(f"{workload.seed}/shape/{concurrency}/{repeat}")
    out = []
    for i in range(workload.conversations(concurrency)):
        first = _jittered(rng, workload.first_tokens)
        users = tuple(_jittered(rng, workload.user_tokens) for _ in range(workload.turns - 1))
        start = rng.uniform(0, workload.stagger_s) if i < concurrency and concurrency > 1 else 0.0
        out.append(ConversationShape(i, first, users, start))
    return tuple(out)


def plan(workload: Workload, front: str, concurrency: int, repeat: int) -> BlockPlan:
    return BlockPlan(
        front=front,
        concurrency=concurrency,
        repeat=repeat,
        shapes=shapes(workload, concurrency, repeat),
        answer_tokens=workload.answer_tokens,
        seed=workload.seed,
        think_s=workload.think_s,
        prompt_format=workload.prompt_format,
    )


def draw(rng: random.Random, n: int) -> list[int]:
    """`n` token ids from the conversation's stream."""
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]


def draw_text(rng: random.Random, n: int) -> str:
    """`n` characters (n tokens) of text from the conversation's stream."""
    return "".join(rng.choices(TEXT_ALPHABET, k=n))


def extended(prompt: Prompt, output: Sequence[int], text: str, user: Prompt) -> Prompt:
    """The next turn's prompt: this one, the answer (its token ids, or its text), the user's new
    message."""
    if isinstance(prompt, str):
        assert isinstance(user, str)
        return prompt + text + user
    assert not isinstance(user, str)
    return [*prompt, *output, *user]


def prompt_tokens(prompt: Prompt) -> int:
    """The prompt's length in the engines' tokens (a text prompt's as the sim-engine encodes it)."""
    return len(toy_tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)


def request_body(prompt: Prompt, answer_tokens: int) -> dict[str, Any]:
    """One turn's /v1/completions request, as every front receives it (streamed)."""
    return {
        "model": MODEL,
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "max_tokens": answer_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }


def rotation(fronts: Sequence[str], repeat: int) -> list[str]:
    """The fronts' order in a repeat: rotated by one each repeat, so none always goes first."""
    if not fronts:
        return []
    k = repeat % len(fronts)
    return [*fronts[k:], *fronts[:k]]
