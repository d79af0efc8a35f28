"""The turn record every workload yields, and what the simulator replays.

A workload is an iterable of `Turn`s in arrival order. Each turn says how
much of its prompt repeats the conversation's previous context, which is
all a KV-reuse policy can exploit; the simulator derives digests, handles
and costs from these counts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a conversation (times in seconds, sizes in tokens).

    `reused_prefix_tokens` counts the leading prompt tokens equal to the
    previous turn's context: its prompt followed by its output. A turn whose
    prompt starts with all of it (`continues_context`) is an exact
    continuation, the only kind whose retained KV can be pulled whole; a
    shorter shared prefix means the history was edited, stripped or
    compacted. A conversation's first turn has no previous context.
    """

    arrival_s: float
    conversation: str
    turn_index: int
    prompt_tokens: int
    output_tokens: int
    reused_prefix_tokens: int = 0
    previous_context_tokens: int = 0
    tenant: str = "default"
    # Ids of the prompt's leading whole blocks of `block_id_tokens` tokens each, chained as a
    # trace's hash ids are: prompts of any conversations whose leading ids are equal hold the same
    # tokens there (a system prompt, a shared document). Empty: nothing shared across conversations.
    block_ids: tuple[int, ...] = ()
    block_id_tokens: int = 0

    @property
    def context_tokens(self) -> int:
        """Tokens of KV the decode engine holds once the turn finishes."""
        return self.prompt_tokens + self.output_tokens

    @property
    def continues_context(self) -> bool:
        return self.turn_index > 0 and self.reused_prefix_tokens >= self.previous_context_tokens > 0
