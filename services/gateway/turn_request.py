"""A client's completion body made into a turn: who sends it, which conversation it continues, and
the body as the engines may see it.

The same for every front that serves turns (the gateway, the endpoint picker), in this order:
the conversation id is taken (and `conversation_id` removed from the body), the body is checked
(`request_body.check_completion`), the top-level fields the engines do not accept are dropped
(`engine_fields.py`; the front counts them, `record_dropped`), the tenant's `cache_salt` overwrites
any the client sent, `kv_transfer_params` is removed (only the router may name blocks: an engine
trusts whatever it is given), and the model is settled. Every refusal is a RequestRejected (400,
naming the field).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvplane.services.gateway import cache_salt
from kvplane.services.gateway.cache_salt import CacheSalts
from kvplane.services.gateway.engine_fields import drop_unknown_fields
from kvplane.services.gateway.identity import (
    ApiKeys,
    BadConversation,
    Identity,
    ReloadingApiKeys,
    take_conversation,
)
from kvplane.services.gateway.metrics import GatewayMetrics
from kvplane.services.gateway.openai_errors import RequestRejected
from kvplane.services.gateway.progress import TurnRequest
from kvplane.services.gateway.prompts import estimate_tokens
from kvplane.services.gateway.request_body import BodyLimits, check_completion, single_prompt
from kvplane.services.gateway.settings import GatewaySection

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AdmittedTurn:
    turn: TurnRequest
    # The prompt's tokens as the tenant's in-flight share counts them (`tenant_share.py`).
    share_tokens: int
    # The top-level fields dropped from the body: the engines do not accept them.
    dropped: tuple[str, ...] = ()


def configured_api_keys(settings: GatewaySection) -> ApiKeys:
    """The API keys the settings configure (reloaded from `api_keys_file` when it changes)."""
    keys = {entry.token.get_secret_value(): entry.tenant for entry in settings.api_keys}
    if settings.api_keys_file:
        return ReloadingApiKeys(keys, settings.api_keys_file, settings.default_tenant)
    return ApiKeys(keys, settings.default_tenant)


def body_limits(settings: GatewaySection) -> BodyLimits:
    return BodyLimits(vocab_size=settings.vocab_size, max_model_len=settings.max_model_len)


def admit_turn(
    headers: Mapping[str, str],
    body: dict[str, Any],
    *,
    chat: bool,
    tenant: str,
    settings: GatewaySection,
    salts: CacheSalts,
    arrival: float,
) -> AdmittedTurn:
    """The turn of an authenticated request whose body is `body` (changed in place, see the module
    docstring); raises RequestRejected."""
    try:
        conversation, source = take_conversation(headers, body)
        check_completion(body, chat, body_limits(settings))
    except BadConversation as exc:
        raise RequestRejected(400, str(exc), "conversation_id") from None
    dropped = drop_unknown_fields(body, chat, settings.pass_through_fields)
    identity = Identity(tenant, conversation, source)
    salt = salts.salt(identity.tenant)
    if salt is not None:
        # Overwrites any salt the client sent: a tenant's cache is its own, whatever it asks.
        body[cache_salt.BODY_KEY] = salt
    # Only the router may name blocks: an engine trusts whatever it is given.
    body.pop("kv_transfer_params", None)
    model = body.get("model") or (settings.models[0] if settings.models else "")
    if not isinstance(model, str) or not model:
        raise RequestRejected(400, "model is required", "model")
    turn = TurnRequest(
        identity=identity,
        body=body,
        chat=chat,
        stream=body.get("stream") is True,
        model=model,
        client_token_ids=body.get("return_token_ids") is True,
        arrival=arrival,
    )
    prompt = single_prompt(body.get("prompt"))
    # check_completion has made a list prompt a list of token ids.
    tokens = len(prompt) if not chat and isinstance(prompt, list) else estimate_tokens(body, chat)
    return AdmittedTurn(turn, tokens, tuple(dropped))


# The most dropped names one debug line shows, and the most characters of each: they are the client's.
_SHOWN_NAMES = 16
_SHOWN_CHARS = 64


def record_dropped(dropped: Sequence[str], metrics: GatewayMetrics) -> None:
    """Counts the fields admission dropped, and names them at debug level: a client chooses the
    names, so as a metric label they would be without bound."""
    if not dropped:
        return
    metrics.dropped_fields.inc(len(dropped))
    if log.isEnabledFor(logging.DEBUG):
        shown = ", ".join(repr(name[:_SHOWN_CHARS]) for name in dropped[:_SHOWN_NAMES])
        more = len(dropped) - _SHOWN_NAMES
        log.debug(
            "dropped body fields the engines do not accept: %s%s",
            shown,
            f" and {more} more" if more > 0 else "",
        )
