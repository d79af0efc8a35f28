"""Baselines whose decode nodes keep a prefix cache of their own (`ClusterSpec.decode_prefix_cache`).

- `decode-radix`: SGLang's decode-side radix cache (`--disaggregation-decode-enable-radix-cache`,
  sgl-project/sglang#19746): D keeps the blocks of its finished turns, unpinned, in the memory its
  running turns leave free; a turn whose prompt starts with blocks D holds gets only the rest from
  P. P still computes every token its own cache lacks: D's cache saves the hand-off
  (`SimCosts.handoff_s`), not P's work.
- `conditional-disagg`: Dynamo's conditional disaggregation (its disaggregation design document):
  the turn goes to a decode worker by prefix overlap, and that worker prefills it itself when what
  its prefix cache lacks is at most `max_local_prefill_tokens` (Dynamo's
  `--max-local-prefill-length`, default 1,000), or when the shared prefill queue already holds
  `max_prefill_queue_per_node` turns per prefill node (`--max-prefill-queue-size`, default 2,
  taken per prefill node so that a larger fleet does not divert more); otherwise P prefills it,
  and D receives only the blocks it lacks.

D is chosen as Dynamo's KV router chooses a worker, with its default weights: the least prompt
tokens its cache lacks (from the decode nodes' KV events) plus the tokens of the turns this router
sent it that have not finished (its own record of each worker's active blocks). P, when P
prefills, is chosen as `PrefixAffinityRouter` chooses it (llm-d-style precise prefix-cache-aware
routing, with loads). A prefill on D runs on D's own compute, one at a time, after the prefills D
took before it, and every decode running on D finishes that much later (D's steps run the
prefill's tokens before its decodes' next ones), so their KV is held that much longer; their
slower tokens themselves are not scored (the simulator scores TTFT).

Only these two baselines are given the hand-off D's cache spares. vLLM's D has the same cache (its
NixlConnector reads from P only what D's prefix cache lacks), and kvplane's decode scorers prefer
the D that holds the history for that reason (`holder-affinity`, `last-decode-affinity`); but the
published pull figure the costs are fitted to (`costs.QWEN3_32B_PULL_POINT`) may already hold that
saving, so crediting it to every policy could count it twice. Left out for the others, the
comparison with these two errs against kvplane and the other vLLM fronts, not for them.
"""

from __future__ import annotations

from dataclasses import replace

from kvplane.bench.sim.block_chain import BlockChain
from kvplane.bench.sim.cluster import DecodeState, SimHandle
from kvplane.bench.sim.fleet import Conversation, Fleet
from kvplane.bench.sim.routers import PrefixAffinityRouter, RouteChoice, TurnOutcome
from kvplane.bench.workloads.turns import Turn

# Dynamo's defaults for conditional disaggregation: a prefill of at most this many uncached tokens
# runs on the decode worker; so does every prefill while the shared prefill queue holds this many.
DYNAMO_MAX_LOCAL_PREFILL_TOKENS = 1000
DYNAMO_MAX_PREFILL_QUEUE_PER_NODE = 2

# RouteChoice.decision of a turn D prefills itself.
LOCAL_PREFILL = "local_prefill"


class DecodeCacheRouter:
    """D by its prefix cache; P by prefix affinity, or no P at all when D prefills the turn."""

    def __init__(
        self,
        fleet: Fleet,
        seed: int = 0,
        max_local_prefill_tokens: int | None = None,
        max_prefill_queue_per_node: int = DYNAMO_MAX_PREFILL_QUEUE_PER_NODE,
    ) -> None:
        if any(d.prefix_cache is None for d in fleet.decode):
            raise ValueError("decode nodes have no prefix cache (ClusterSpec.decode_prefix_cache)")
        self.fleet = fleet
        self.max_local_prefill_tokens = max_local_prefill_tokens
        self.max_prefill_queue = max_prefill_queue_per_node * len(fleet.prefill)
        self._prefill = PrefixAffinityRouter(fleet, seed)
        # Tokens of the turns sent to each decode node and not finished yet (context included).
        self._active = [0] * len(fleet.decode)

    def route(self, turn: Turn, conversation: Conversation, prompt: BlockChain, now: float) -> RouteChoice:
        d, held = self._decode(prompt, turn.prompt_tokens)
        self._active[d.index] += turn.context_tokens
        if self._local(turn.prompt_tokens - held):
            # No P: the choice's prefill node is never sent anything.
            return RouteChoice(self.fleet.prefill[0], d, LOCAL_PREFILL, local_prefill=True)
        choice = self._prefill.route(turn, conversation, prompt, now)
        return replace(choice, decode=d)

    def _decode(self, prompt: BlockChain, prompt_tokens: int) -> tuple[DecodeState, int]:
        """The decode node with the least work for the turn (what its cache lacks of the prompt,
        plus its active tokens), and the prefix its cache holds."""
        best: tuple[int, int, DecodeState] | None = None
        for d in self.fleet.decode:
            assert d.prefix_cache is not None
            held = min(d.prefix_cache.hit_blocks(prompt) * self.fleet.block_tokens, prompt_tokens - 1)
            cost = prompt_tokens - held + self._active[d.index]
            if best is None or cost < best[0]:
                best = (cost, held, d)
        assert best is not None
        return best[2], best[1]

    def _local(self, uncached_tokens: int) -> bool:
        limit = self.max_local_prefill_tokens
        if limit is None:
            return False
        queued = sum(len(p.waiting) for p in self.fleet.prefill)
        return uncached_tokens <= limit or queued >= self.max_prefill_queue

    def observe(self, turn: Turn, choice: RouteChoice, outcome: TurnOutcome) -> None:
        self._active[choice.decode.index] -= turn.context_tokens

    def on_publish(self, conversation: Conversation, handle: SimHandle, now: float) -> None:
        return None
