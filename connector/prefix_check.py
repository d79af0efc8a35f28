"""The prefill side's check that a prompt really continues a decode engine's handle.

vLLM's NixlConnector on P computes a pull as `min(remote_num_tokens, prompt) - local hit` and
maps its uncached tail onto the tail of D's block list; it compares no token ids. A prompt that
is not an exact continuation of D's tokens (a stripped reasoning trace, a retried or edited turn,
a re-tokenized join) would then import KV computed for other tokens, silently.

`check_pull` compares the handle's token digests (`kvplane_digests`, see
`kvplane.connector.digests`) with the prompt and edits the request's `kv_transfer_params` in
place before vLLM reads them:

- the whole handle verified (whole blocks by `kvplane_digests`, the partial last block by
  `kvplane_tail_digest`): unchanged;
- a shorter whole-block prefix verified: `remote_block_ids` and `remote_num_tokens` are clipped
  to it;
- nothing verified (or no digests, when they are required): `remote_num_tokens` becomes 0. P
  then pulls nothing, but vLLM still notifies D, which frees the blocks (the handle was checked
  out for this turn and is spent either way).

It is idempotent: vLLM may ask for the matched tokens more than once per request, so the outcome
is recorded in the params and returned again without a second edit. No vLLM import here.
"""

from __future__ import annotations

import enum
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvplane.connector import digests as token_digests
from kvplane.connector.digests import KEY_TAIL_DIGEST, tail_digest
from kvplane.services.common.model.handles import KEY_DIGESTS

# Where the outcome of the first check is recorded inside kv_transfer_params. It never leaves
# the engine: the finish-time params vLLM returns are a new dict.
CHECKED_KEY = "_kvplane_pull_checked"


class PullOutcome(enum.Enum):
    """What the check did to a request's pull."""

    NOT_A_PULL = "not_a_pull"
    VERIFIED = "verified"
    CLIPPED = "clipped"
    DROPPED = "dropped"
    NO_DIGESTS = "no_digests"


@dataclass(frozen=True, slots=True)
class PullCheck:
    """The outcome, and the handle's token count before and after (tokens)."""

    outcome: PullOutcome
    handle_tokens: int = 0
    verified_tokens: int = 0

    @property
    def changed(self) -> bool:
        return self.outcome in (PullOutcome.CLIPPED, PullOutcome.DROPPED, PullOutcome.NO_DIGESTS)


def is_pull_handle(params: MutableMapping[str, Any] | None) -> bool:
    """Whether these params ask this (prefill) engine to read a decode engine's blocks."""
    return bool(params and params.get("do_remote_decode") and params.get("remote_block_ids"))


def check_pull(
    params: MutableMapping[str, Any] | None,
    prompt_token_ids: Sequence[int],
    *,
    require_digests: bool = True,
) -> PullCheck:
    """Verify and, where needed, clip the pull described by `params`. Edits `params` in place."""
    if params is None or not is_pull_handle(params):
        return PullCheck(PullOutcome.NOT_A_PULL)
    recorded = params.get(CHECKED_KEY)
    if isinstance(recorded, list) and len(recorded) == 3:
        return PullCheck(PullOutcome(recorded[0]), int(recorded[1]), int(recorded[2]))

    handle_tokens = _as_int(params.get("remote_num_tokens"))
    check, block_size = _decide(params, prompt_token_ids, handle_tokens, require_digests)
    if check.outcome is PullOutcome.CLIPPED:
        blocks = -(-check.verified_tokens // block_size)
        params["remote_block_ids"] = [list(group[:blocks]) for group in params["remote_block_ids"]]
        params["remote_num_tokens"] = check.verified_tokens
    elif check.outcome in (PullOutcome.DROPPED, PullOutcome.NO_DIGESTS):
        # Keep remote_block_ids: vLLM then still notifies D, which frees the spent handle.
        params["remote_num_tokens"] = 0
    params[CHECKED_KEY] = [check.outcome.value, check.handle_tokens, check.verified_tokens]
    return check


def _decide(
    params: MutableMapping[str, Any],
    prompt_token_ids: Sequence[int],
    handle_tokens: int,
    require_digests: bool,
) -> tuple[PullCheck, int]:
    """The outcome and the digests' block size (0 when there are none)."""
    encoded = params.get(KEY_DIGESTS)
    if not isinstance(encoded, str) or not encoded:
        if require_digests:
            return PullCheck(PullOutcome.NO_DIGESTS, handle_tokens, 0), 0
        return PullCheck(PullOutcome.VERIFIED, handle_tokens, handle_tokens), 0
    try:
        handle_digests = token_digests.decode(encoded)
    except token_digests.DigestFormatError:
        return PullCheck(PullOutcome.DROPPED, handle_tokens, 0), 0
    block_size = handle_digests.block_size
    groups = params["remote_block_ids"]
    if (
        not isinstance(groups, list | tuple)
        or not groups
        or not all(isinstance(g, list | tuple) for g in groups)
    ):
        return PullCheck(PullOutcome.DROPPED, handle_tokens, 0), block_size

    verified = block_size * token_digests.verified_prefix_blocks(handle_digests, prompt_token_ids)
    # The partial last block has no block digest; the tail digest covers it.
    if (
        verified == handle_digests.num_blocks * block_size
        and handle_tokens > verified
        and len(prompt_token_ids) >= handle_tokens
        and params.get(KEY_TAIL_DIGEST) == tail_digest(prompt_token_ids[:handle_tokens], block_size)
    ):
        verified = handle_tokens
    # The most vLLM would pull; P computes at least the prompt's last token itself.
    target = min(handle_tokens, max(0, len(prompt_token_ids) - 1))
    allowed = min(verified, target)
    if allowed == handle_tokens:
        return PullCheck(PullOutcome.VERIFIED, handle_tokens, handle_tokens), block_size
    if allowed == 0 or len(groups) != 1:
        # Several KV-cache groups (sliding window, hybrid models) do not cut at one index.
        return PullCheck(PullOutcome.DROPPED, handle_tokens, 0), block_size
    return PullCheck(PullOutcome.CLIPPED, handle_tokens, allowed), block_size


def _as_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        return 0
    return value
