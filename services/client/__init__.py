"""kvplane.services.client: what an upstream gateway needs to route turns through kvplane."""

from kvplane.services.client.credentials import ClientCredentials
from kvplane.services.client.routing_client import (
    Endpoint,
    RouteResult,
    RoutingClient,
    RoutingUnavailable,
)
from kvplane.services.client.tokenize import TokenizeFailed, is_token_ids, tokenize
from kvplane.services.client.vllm_requests import (
    MissingPrefillParams,
    decode_body,
    decode_only_body,
    leg_url,
    prefill_body,
)

__all__ = [
    "ClientCredentials",
    "Endpoint",
    "MissingPrefillParams",
    "RouteResult",
    "RoutingClient",
    "RoutingUnavailable",
    "TokenizeFailed",
    "decode_body",
    "decode_only_body",
    "is_token_ids",
    "leg_url",
    "prefill_body",
    "tokenize",
]
