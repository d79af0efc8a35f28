"""Who a gateway request is from and which conversation it continues."""

from __future__ import annotations

import pytest

from kvplane.services.gateway.identity import (
    EPHEMERAL_PREFIX,
    ApiKeys,
    BadConversation,
    Unauthorized,
    identify,
    take_conversation,
)

KEYS = ApiKeys({"secret-a": "acme", "secret-g": "globex"})


def test_bearer_and_x_api_key_map_to_their_tenants() -> None:
    assert KEYS.tenant({"Authorization": "Bearer secret-a"}) == "acme"
    assert KEYS.tenant({"Authorization": "bearer  secret-g "}) == "globex"
    assert KEYS.tenant({"x-api-key": "secret-g"}) == "globex"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"x-api-key": "secret-"}])
def test_missing_or_unknown_keys_are_refused(headers: dict[str, str]) -> None:
    with pytest.raises(Unauthorized):
        KEYS.tenant(headers)


def test_default_tenant_covers_only_requests_without_a_key() -> None:
    keys = ApiKeys({"secret-a": "acme"}, default_tenant="dev")
    assert keys.tenant({}) == "dev"
    with pytest.raises(Unauthorized):
        keys.tenant({"x-api-key": "wrong"})


def test_header_beats_session_beats_body_and_the_body_field_always_goes() -> None:
    body = {"conversation_id": "b", "prompt": [1]}
    assert take_conversation({"X-Conversation-Id": "h", "X-Session-ID": "s"}, body) == ("h", "header")
    assert body == {"prompt": [1]}
    body = {"conversation_id": "b"}
    assert take_conversation({"X-Session-ID": "s"}, body) == ("s", "session")
    assert take_conversation({}, {"conversation_id": "b"}) == ("b", "body")


def test_without_any_id_the_conversation_is_a_fresh_one() -> None:
    first, source = take_conversation({}, {})
    second, _ = take_conversation({}, {})
    assert source == "ephemeral" and first.startswith(EPHEMERAL_PREFIX) and first != second


@pytest.mark.parametrize("value", [7, "", "x" * 600])
def test_bad_conversation_ids_are_refused(value: object) -> None:
    with pytest.raises(BadConversation):
        take_conversation({}, {"conversation_id": value})


def test_the_tenant_never_comes_from_the_body() -> None:
    body = {"tenant": "globex", "kvplane_tenant": "globex"}
    identity = identify(KEYS, {"x-api-key": "secret-a", "X-Conversation-Id": "c"}, body)
    assert (identity.tenant, identity.conversation) == ("acme", "c")
