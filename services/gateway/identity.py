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
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from kvplane.services.common.model import validation
from kvplane.services.common.model.errors import InvalidArgument
from kvplane.services.common.runtime.secret_files import file_stamp, read_secret_file

log = logging.getLogger(__name__)

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


def read_key_file(path: str) -> dict[str, str]:
    """API keys from a JSON or YAML list of `{"token": ..., "tenant": ...}` (a Secret volume)."""
    what = "gateway.api_keys_file"
    try:
        listed = yaml.safe_load(read_secret_file(path, what))
    except yaml.YAMLError as exc:
        raise ValueError(f"{what} {path!r}: not JSON or YAML: {exc}") from None
    if not isinstance(listed, list):
        raise ValueError(f"{what} {path!r}: expected a list of {{token, tenant}} entries")
    keys: dict[str, str] = {}
    for i, item in enumerate(listed):
        token = item.get("token") if isinstance(item, dict) else None
        tenant = item.get("tenant") if isinstance(item, dict) else None
        if not isinstance(token, str) or not token or not isinstance(tenant, str):
            raise ValueError(f"{what} {path!r}: entry {i} needs a non-empty string token and a tenant")
        keys[token] = tenant
    return keys


class ReloadingApiKeys(ApiKeys):
    """The configured keys plus those of a key file, read again when the file changes.

    Checked at most every `check_interval_s`, on the event loop (one `stat`). A file that cannot
    be used after a change (half-written, an invalid tenant) keeps the previous keys, with a
    warning: a bad rotation must not lock every client out. At start-up it fails loudly.
    """

    def __init__(
        self,
        keys: Mapping[str, str],
        key_file: str,
        default_tenant: str = "",
        *,
        check_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._static = dict(keys)
        self._file = key_file
        self._interval = check_interval_s
        self._clock = clock
        self._stamp = file_stamp(key_file)
        super().__init__({**self._static, **read_key_file(key_file)}, default_tenant)
        self._next_check = clock() + check_interval_s

    def tenant(self, headers: Mapping[str, str]) -> str:
        now = self._clock()
        if now >= self._next_check:
            self._next_check = now + self._interval
            self._reload_if_changed()
        return super().tenant(headers)

    def _reload_if_changed(self) -> None:
        stamp = file_stamp(self._file)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            fresh = ApiKeys({**self._static, **read_key_file(self._file)}, self._default)
        except (ValueError, InvalidArgument) as exc:
            log.warning("API key file changed but cannot be used; keeping the previous keys: %s", exc)
            return
        self._keys = fresh._keys
        log.info("API keys reloaded", extra={"file": self._file, "keys": len(self._keys)})


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
