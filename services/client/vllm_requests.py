"""The two vLLM request bodies of a routed turn.

1. P leg: the client's request made non-streaming with one output token,
   carrying the route's prefill kv_transfer_params exactly.
2. D leg: the client's request as sent, carrying the kv_transfer_params P
   returned, plus kvplane's tenant and conversation keys so that D's
   connector can publish the handle it retains.

A turn routed `prefill_on_decode` has no P leg: D gets the client's request
with the route's params (`decode_only_body`), which name no remote blocks.

Client-supplied kv_transfer_params are always replaced: an engine trusts
whatever it is given, so only the router may name blocks.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from kvplane.services.client.routing_client import RouteResult
from kvplane.services.common.model.handles import KEY_CONVERSATION, KEY_RETAIN, KEY_TENANT

_ROUTING_KEYS = (KEY_TENANT, KEY_CONVERSATION)


class MissingPrefillParams(ValueError):
    """P's response carried no kv_transfer_params: D cannot pull from it."""


def prefill_body(client_body: Mapping[str, Any], route: RouteResult) -> dict[str, Any]:
    """The body for P (`/v1/completions` or `/v1/chat/completions`)."""
    body = _copied(client_body)
    body["stream"] = False
    body.pop("stream_options", None)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["kv_transfer_params"] = _copied(route.prefill_params)
    return body


def decode_body(
    client_body: Mapping[str, Any], route: RouteResult, prefill_response: Mapping[str, Any]
) -> dict[str, Any]:
    """The body for D, from the client's request and P's (non-streaming) response."""
    returned = prefill_response.get("kv_transfer_params")
    if not isinstance(returned, Mapping):
        raise MissingPrefillParams("the prefill response has no kv_transfer_params")
    params = _copied(returned)
    for key in _ROUTING_KEYS:
        if key in route.prefill_params:
            params[key] = route.prefill_params[key]
    if route.skip_decode_retention:
        params[KEY_RETAIN] = False
    body = _copied(client_body)
    body["kv_transfer_params"] = params
    return body


def decode_only_body(client_body: Mapping[str, Any], route: RouteResult) -> dict[str, Any]:
    """The body for D when D prefills the turn itself (`RouteResult.on_decode`)."""
    body = _copied(client_body)
    params = _copied(route.prefill_params)
    if route.skip_decode_retention:
        params[KEY_RETAIN] = False
    body["kv_transfer_params"] = params
    return body


def _copied(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of a JSON object, so that neither the caller's nor the other leg's body changes.

    `copy.deepcopy` costs about a microsecond per element: for a prompt of token ids, more than
    the rest of a turn's work in the gateway. JSON's scalars are immutable, so only its objects
    and arrays are copied, and a flat array of integers in one step.
    """
    return {key: _copied_value(value) for key, value in mapping.items()}


def _copied_value(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _copied_value(item) for key, item in value.items()}
    if isinstance(value, list):
        if set(map(type, value)) <= {int}:
            return list(value)
        return [_copied_value(item) for item in value]
    if value is None or isinstance(value, str | int | float):
        return value  # immutable (bool is an int)
    return copy.deepcopy(value)  # not JSON: copied the general way


def leg_url(endpoint_url: str, path: str = "/v1/completions") -> str:
    """An endpoint's base URL joined with an API path."""
    return endpoint_url.rstrip("/") + "/" + path.lstrip("/")
