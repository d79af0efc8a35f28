"""Each tenant's share of the engines' held KV, bounded by its prompt tokens in flight (and, with
the same counter, of the gateway's body reads, bounded by their bytes).

Between a turn's P leg and its D leg, P holds the prompt's KV for D to read;
a tenant sending many turns at once (or turns D will reject) could fill a P
with blocks nobody else can use. The gateway counts each tenant's prompt
tokens in flight and refuses a turn (429) that would take the tenant past its
limit. A text prompt counts as its UTF-8 size, an upper-end guess of its
tokens (no tokenizer produces more tokens than bytes here).

The count is per gateway process: with N gateway replicas a tenant may hold up to N times
the limit, so a deployment sets `max_inflight_tokens_per_tenant` to its total bound divided by
its replicas. Sharing the count through etcd would cost every turn two writes on its hot path;
the bound is against one tenant crowding out others, and a per-replica share of it does that.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

from kvplane.services.gateway.openai_errors import RequestRejected


class TenantShares:
    """Prompt tokens in flight per tenant; one per gateway, used on its event loop only."""

    def __init__(self, limit_tokens: int, unit: str = "prompt tokens") -> None:
        # 0: unbounded.
        self.limit = limit_tokens
        # What is counted, as the refusal names it.
        self.unit = unit
        self._in_flight: defaultdict[str, int] = defaultdict(int)

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    @contextmanager
    def hold(self, tenant: str, tokens: int) -> Iterator[None]:
        """Counts `tokens` for `tenant` while the block runs; RequestRejected (429) if over the limit."""
        if self.limit and self._in_flight[tenant] + tokens > self.limit:
            raise RequestRejected(
                429,
                f"this key has {self._in_flight[tenant]} {self.unit} in flight; a request of {tokens} more "
                f"would pass its limit of {self.limit}: retry when earlier requests finish",
            )
        self._in_flight[tenant] += tokens
        try:
            yield
        finally:
            self._in_flight[tenant] -= tokens
            if not self._in_flight[tenant]:
                del self._in_flight[tenant]
