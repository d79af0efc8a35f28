"""Whether a new prompt starts with exactly the tokens whose KV the holder retains.

vLLM's prefill engine maps its uncached tail onto the tail of the holder's
block list without comparing tokens, so a pull is only valid for an exact
continuation (DESIGN.md, invariant 3). A continuation is longer than the
handle (it adds at least the last output token and a new message) and agrees
with the handle's digests over every whole block. A retried turn is shorter
than the handle; an edited message or a stripped reasoning trace diverges
from its digests.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.connector import digests as token_digests
from kvplane.services.common.handles import CacheHandle
from kvplane.services.routing.policy.snapshot import Prompt


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """`continues`: the prompt continues the handle; `reusable_tokens`: tokens P can pull."""

    continues: bool
    reusable_tokens: int
    why: str


def match_prefix(handle: CacheHandle, prompt: Prompt, *, require_digests: bool = True) -> PrefixMatch:
    held = handle.num_tokens
    if prompt.tokens <= held:
        return PrefixMatch(False, 0, f"prompt of {prompt.tokens} tokens does not extend the {held} retained")
    digests = handle.digests
    if digests is None:
        if require_digests:
            # The prefill connector refuses an unproven pull; recompute up front.
            return PrefixMatch(False, 0, "handle has no token digests to prove the prefix")
        return PrefixMatch(True, held, "prefix assumed from lengths")
    whole = digests.num_blocks * digests.block_size
    if prompt.token_ids:
        verified = token_digests.verified_prefix_blocks(digests, prompt.token_ids)
        proof = "token ids"
    elif prompt.block_digests and prompt.digest_block_size == digests.block_size:
        verified = token_digests.verified_prefix_blocks_from_chain(digests, prompt.block_digests)
        proof = "block digests"
    else:
        # Length only: the prefill connector checks the real tokens before it pulls.
        return PrefixMatch(True, whole, "prefix assumed from lengths; checked on P")
    if verified < digests.num_blocks:
        return PrefixMatch(
            False,
            verified * digests.block_size,
            f"prompt diverges from the retained tokens after {verified} of {digests.num_blocks} blocks"
            f" ({proof})",
        )
    return PrefixMatch(True, whole, f"prefix verified by {proof}")
