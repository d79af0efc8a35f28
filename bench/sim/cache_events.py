"""What a prefill engine's KV-cache events tell a router about its prefix cache, in the simulator.

A live engine publishes `BlockStored` and `BlockRemoved` as its cache changes; its node agent
forwards them to every routing replica (`kvplane.connector.kv_events`), which scores each prefill
node by the exact prefix its view holds (`kvplane.services.routing.state.engine_caches`). The
simulator's cache (`prefix_cache.PrefixCache`) keeps a journal of the same changes, as run
lengths; `CacheEventFeed` delivers them to a router's view of that cache `lag_s` after they
happen, each lost with probability `loss`.

A lost change is never repaired here: the view keeps a run the engine evicted (it then believes
in more cache than there is) or lacks one it stored (it believes in less). That is the worst
case: the live path fills gaps from the engine's replay socket, and resets a view whose gap it
cannot fill. Both cost time, never correctness: P computes what its cache lacks, and a pull is
proven by its digests.

Pure: no I/O; time is an argument.
"""

from __future__ import annotations

import random
from collections import deque

from kvplane.bench.sim.block_chain import BlockChain


class CacheEventFeed:
    """One prefill engine's cache changes, as a router's view receives them."""

    __slots__ = ("_loss", "_pending", "_rng", "_view", "delivered", "lag_s", "lost")

    def __init__(self, lag_s: float = 0.0, loss: float = 0.0, rng: random.Random | None = None) -> None:
        if lag_s < 0 or not 0.0 <= loss < 1.0:
            raise ValueError("need lag_s >= 0 and 0 <= loss < 1")
        self.lag_s = lag_s
        self._loss = loss
        self._rng = rng or random.Random(0)
        # (due time, first value of a run, blocks of it held then), in publication order.
        self._pending: deque[tuple[float, int, int]] = deque()
        # The router's view: first value of a run -> its leading blocks held.
        self._view: dict[int, int] = {}
        self.delivered = 0
        self.lost = 0

    def publish(self, now_s: float, changes: list[tuple[int, int]]) -> None:
        """The engine's changes at `now_s` (its cache journal, then cleared by the caller)."""
        due = now_s + self.lag_s
        for base, held in changes:
            if self._loss and self._rng.random() < self._loss:
                self.lost += 1
                continue
            self._pending.append((due, base, held))

    def _deliver(self, now_s: float) -> None:
        pending, view = self._pending, self._view
        while pending and pending[0][0] <= now_s:
            _, base, held = pending.popleft()
            if held > 0:
                view[base] = held
            else:
                view.pop(base, None)
            self.delivered += 1

    def hit_blocks(self, chain: BlockChain, now_s: float) -> int:
        """Leading blocks of `chain` the view holds at `now_s`, as `PrefixCache.hit_blocks` counts."""
        self._deliver(now_s)
        view = self._view
        hit = 0
        for _, base, length in chain.runs():
            have = view.get(base, 0)
            if have < length:
                return hit + have
            hit += length
        return hit
