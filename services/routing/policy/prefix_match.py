"""How much of a handle a new prompt provably starts with.

vLLM's prefill engine maps its uncached tail onto the tail of the holder's
block list without comparing tokens, so a pull is only valid for tokens the
prompt shares exactly (DESIGN.md, invariant 3). Two cases are worth a pull:

- a *continuation*: the prompt is longer than the handle (it adds at least
  the last output token and a new message) and agrees with the handle's
  digests over every whole block; all of the handle's whole blocks are
  reusable;
- a *verified prefix*: the prompt diverges from the handle (an edited
  message, a stripped reasoning trace) or is no longer than it (a retried
  turn), but agrees with it up to a digest checkpoint; those blocks are
  reusable once the pull is clipped to them, as the prefill connector does
  (`kvplane.connector.prefix_check`).

A prefix is proven only with token ids or block digests; with the length
alone a longer prompt is assumed to continue (P's connector checks the real
tokens) and a shorter one shares nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.connector import digests as token_digests
from kvplane.services.common.model.handles import CacheHandle
from kvplane.services.routing.policy.snapshot import Prompt


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """`continues`: the prompt continues the whole handle; `reusable_tokens`: tokens P
    can pull (for a prefix that is not a continuation, the verified part, which is
    what the pull must be clipped to)."""

    continues: bool
    reusable_tokens: int
    why: str


def match_prefix(handle: CacheHandle, prompt: Prompt, *, require_digests: bool = True) -> PrefixMatch:
    held = handle.num_tokens
    digests = handle.digests
    longer = prompt.tokens > held
    if digests is None:
        if require_digests:
            # The prefill connector refuses an unproven pull; recompute up front.
            return PrefixMatch(False, 0, "handle has no token digests to prove the prefix")
        if longer:
            return PrefixMatch(True, held, "prefix assumed from lengths")
        return PrefixMatch(False, 0, f"prompt of {prompt.tokens} tokens does not extend the {held} retained")
    block = digests.block_size
    if prompt.block_digests and prompt.digest_block_size == block:
        # The routing service digests token ids once per route (prompt_chains).
        verified = token_digests.verified_prefix_blocks_from_chain(digests, prompt.block_digests)
        proof = "token ids" if prompt.token_ids else "block digests"
    elif prompt.token_ids:
        verified = token_digests.verified_prefix_blocks(digests, prompt.token_ids)
        proof = "token ids"
    elif longer:
        # Length only: the prefill connector checks the real tokens before it pulls.
        return PrefixMatch(True, digests.num_blocks * block, "prefix assumed from lengths; checked on P")
    else:
        return PrefixMatch(False, 0, f"prompt of {prompt.tokens} tokens does not extend the {held} retained")
    if longer and verified == digests.num_blocks:
        return PrefixMatch(True, verified * block, f"prefix verified by {proof}")
    # P computes at least the prompt's last token itself, whatever it pulls.
    reusable = min(verified * block, prompt.tokens - 1)
    where = (
        f"prompt of {prompt.tokens} tokens does not extend the {held} retained"
        if not longer
        else f"prompt diverges from the retained tokens after {verified} of {digests.num_blocks} blocks"
    )
    return PrefixMatch(False, max(0, reusable), f"{where}; {reusable} tokens verified by {proof}")
