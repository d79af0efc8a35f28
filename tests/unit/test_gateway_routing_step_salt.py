"""The gateway's Route carries the cache_salt it set on the turn's engine requests, so that routing
predicts the prefill engines' block hashes as they compute them."""

from __future__ import annotations

from typing import Any, cast

from kvplane.services.client import RoutingClient
from kvplane.services.gateway.fallback import FallbackEngines
from kvplane.services.gateway.identity import Identity
from kvplane.services.gateway.metrics import GatewayMetrics
from kvplane.services.gateway.progress import TurnRequest
from kvplane.services.gateway.prompts import RoutedPrompt
from kvplane.services.gateway.reports import TurnReporter
from kvplane.services.gateway.routing_step import RoutingStep


class RecordingRouting:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    async def route(self, conversation: str, model: str, **kwargs: Any) -> object:
        self.calls.append(kwargs)
        return object()


class NoAnnouncements:
    def awaited(self, turn: TurnRequest) -> tuple[str, int]:
        return "", 0


async def salt_sent(body: dict[str, Any]) -> object:
    routing = RecordingRouting()
    step = RoutingStep(
        cast(RoutingClient, routing),
        cast(FallbackEngines, None),
        cast(TurnReporter, NoAnnouncements()),
        cast(GatewayMetrics, None),
    )
    turn = TurnRequest(Identity("acme", "c1", "header"), body, False, False, "m", False, 0.0)
    await step.ask(turn, RoutedPrompt((1, 2, 3), 3))
    return routing.calls[0]["cache_salt"]


async def test_the_route_carries_the_salt_the_gateway_set_on_the_body() -> None:
    assert await salt_sent({"prompt": [1, 2, 3], "cache_salt": "0123abcd"}) == "0123abcd"


async def test_no_salt_when_isolation_is_off() -> None:
    assert await salt_sent({"prompt": [1, 2, 3]}) == ""
