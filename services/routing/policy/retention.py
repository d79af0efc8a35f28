"""Whether D keeps a turn's KV for the conversation's next turn: only where a pull of it could pay.

After a turn, P's prefix cache holds the turn's prompt and D holds the prompt and the
output. Kept, D's blocks are pinned until P reads them, they expire or they are released,
and the control plane publishes the handle and later releases it: memory on D and a publish
and a release per turn. That pays when the next turn's P lacks the history (its cache
evicted it, has no prefix caching, or the conversation moves), not when P keeps the prompt:
then the handle adds only the output, and an output a pull would not pay for is recomputed
whether D kept it or not.

So D keeps its KV unless both hold:

- the prefill node is expected to still hold the prompt at the next turn
  (`PrefillCacheRecord.keeps_until_next_turn`: its reports show it keeping prompts, and the
  prompt fits behind twice the prompt tokens the node was sent between the conversation's last
  two turns, cached or not: other conversations' hits push this one's blocks out of an LRU too);
- the output is bounded (`max_output_tokens`) below what a pull could pay for
  (`pull_decision.pull_could_pay`, the rule the next turn's verdict would apply).

A wrong guess costs one turn's recompute of what P evicted; P's report of that turn takes the
node out of the trusted ones at once, and D keeps its KV again.

Where the caller lets D prefill a turn itself (`prefill_on_decode`), the router has D keep its KV
whenever the policy would prefill the next turn on D by the cost model alone
(`min_history_per_new_token` 0): that turn may skip P altogether, which no cache on P makes up
for. With the default weighing, a P that keeps the prompt lacks only the output, and the next turn
is prefilled on D only if it adds no more tokens than that; the rule above then applies as for any
caller.
"""

from __future__ import annotations

from kvplane.services.routing.policy.cost_model import CostModel
from kvplane.services.routing.policy.pull_decision import PullSettings, pull_could_pay


def decode_retention_pays(
    prefill_keeps_prompt: bool,
    max_output_tokens: int | None,
    kv_bytes_per_token: int,
    costs: CostModel,
    settings: PullSettings,
) -> bool:
    """Whether D should keep this turn's KV for the next turn (see the module's docstring)."""
    if not prefill_keeps_prompt or max_output_tokens is None:
        return True
    return pull_could_pay(max_output_tokens, kv_bytes_per_token, costs, settings)
