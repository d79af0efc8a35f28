"""Who a request is from, and which conversation it continues.

The tenant comes only from the API key: a body or header naming a tenant is
never read, so one tenant cannot address another's KV (DESIGN.md,
invariant 4). The conversation comes from, in order of precedence, the
`X-Conversation-Id` header, vLLM's `X-Session-ID` header, or a body
`conversation_id` field (as vLLM's example proxy takes it), which is always
removed before the body goes to an engine.
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvplane.services.common import validation
from kvplane.services.common.errors import InvalidArgument

CONVERSATION_HEADER = "X-Conversation-Id"
SESSION_HEADER = "X-Session-ID"
BODY_CONVERSATION = "conversation_id"
# A request without any conversation id still gets P/D serving, under a one-off id that
# no later turn will name; the gateway ends that conversation once the turn is reported.
EPHEMERAL_PREFIX = "ephemeral-"


class Unauthorized(Exception):
    """No valid API key (HTTP 401)."""


class BadConversation(Exception):
    """The conversation id is not acceptable (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class Identity:
    tenant: str
    conversation: str
    # Where the conversation id came from: "header", "session", "body" or "ephemeral".
    source: str


class ApiKeys:
    """API keys mapped to tenants, compared in constant time."""

    def __init__(self, keys: Mapping[str, str], default_tenant: str = "") -> None:
        for tenant in (*keys.values(), *([default_tenant] if default_tenant else [])):
            validation.tenant(tenant, "tenant")
        self._keys = {token.encode(): tenant for token, tenant in keys.items() if token}
        self._default = default_tenant

    def tenant(self, headers: Mapping[str, str]) -> str:
        """The tenant of a request's key; a wrong key is refused even where a default exists."""
        token = headers.get("x-api-key", "")
        auth = headers.get("Authorization", "")
        if auth[:7].lower() == "bearer ":
            token = auth[7:].strip()
        if not token:
            if self._default:
                return self._default
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        found = ""
        for known, tenant in self._keys.items():
            # Every key is compared, so the time taken does not say which one nearly matched.
            if hmac.compare_digest(known, token.encode("utf-8", "surrogateescape")):
                found = tenant
        if not found:
            raise Unauthorized("invalid API key")
        return found


def take_conversation(headers: Mapping[str, str], body: dict[str, Any]) -> tuple[str, str]:
    """The conversation id and its source; pops `conversation_id` from `body` in every case."""
    from_body = body.pop(BODY_CONVERSATION, None)
    for header, source in ((CONVERSATION_HEADER, "header"), (SESSION_HEADER, "session")):
        value = headers.get(header, "").strip()
        if value:
            return _checked(value), source
    if from_body is not None:
        if not isinstance(from_body, str) or not from_body:
            raise BadConversation("conversation_id must be a non-empty string")
        return _checked(from_body), "body"
    return EPHEMERAL_PREFIX + uuid.uuid4().hex, "ephemeral"


def _checked(conversation: str) -> str:
    try:
        conversation.encode("utf-8")
    except UnicodeEncodeError:
        raise BadConversation("the conversation id is not valid UTF-8") from None
    # It travels in etcd keys (escaped) and in response headers, where CR/LF would split the header.
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in conversation):
        raise BadConversation("the conversation id contains control characters (NUL, CR, LF, ...)")
    try:
        return validation.conversation(conversation)
    except InvalidArgument as exc:
        raise BadConversation(str(exc)) from None


def identify(keys: ApiKeys, headers: Mapping[str, str], body: dict[str, Any]) -> Identity:
    """The request's tenant and conversation; `body` loses its `conversation_id`."""
    tenant = keys.tenant(headers)
    conversation, source = take_conversation(headers, body)
    return Identity(tenant, conversation, source)
