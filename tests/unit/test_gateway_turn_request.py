"""admit_turn: what every front does to a completion body before routing it."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from kvplane.services.gateway.cache_salt import CacheSalts
from kvplane.services.gateway.identity import ReloadingApiKeys
from kvplane.services.gateway.metrics import GatewayMetrics
from kvplane.services.gateway.openai_errors import RequestRejected
from kvplane.services.gateway.settings import GatewayKey, GatewaySection
from kvplane.services.gateway.turn_request import admit_turn, configured_api_keys, record_dropped

SALTS = CacheSalts.create("tenant", "k" * 32, {})


def admit(body: dict[str, object], headers: dict[str, str] | None = None, **settings: object):  # type: ignore[no-untyped-def]
    return admit_turn(
        headers or {},
        body,
        chat=False,
        tenant="acme",
        settings=GatewaySection.model_validate(settings),
        salts=SALTS,
        arrival=1.0,
    )


def test_the_router_alone_names_blocks_and_the_tenant_salts_its_own_cache() -> None:
    body = {
        "model": "m",
        "prompt": [1, 2, 3],
        "conversation_id": "c-1",
        "kv_transfer_params": {"remote_block_ids": [7]},
        "cache_salt": "someone-elses",
    }
    admitted = admit(body)
    assert admitted.turn.identity.conversation == "c-1"
    assert admitted.turn.identity.source == "body"
    assert "kv_transfer_params" not in body and "conversation_id" not in body
    assert body["cache_salt"] == SALTS.salt("acme")
    assert admitted.share_tokens == 3


def test_fields_the_engines_do_not_accept_are_dropped_unless_passed_through() -> None:
    body = {"model": "m", "prompt": "hi", "conversation_id": "c-1", "x": [[], []], "top_k": 4, "ext": 1}
    admitted = admit(body, pass_through_fields=["ext"])
    # The conversation id is admission's own, not a dropped field.
    assert admitted.dropped == ("x",) and admitted.turn.identity.conversation == "c-1"
    assert set(admitted.turn.body) == {"model", "prompt", "top_k", "ext", "cache_salt"}


def test_dropped_fields_are_counted_without_their_names_which_are_logged_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics.create(registry)
    record_dropped((), metrics)
    with caplog.at_level(logging.DEBUG, logger="kvplane.services.gateway.turn_request"):
        record_dropped(["x", "y\n" + "z" * 100, *(f"f{i}" for i in range(20))], metrics)
    assert registry.get_sample_value("kvplane_gateway_dropped_fields_total") == 22
    [line] = [r.getMessage() for r in caplog.records]
    # Each name cut short and escaped; past 16 names, only their number.
    assert "'x'" in line and "'y\\n" + "z" * 62 + "'" in line and line.endswith(" and 6 more")


def test_the_conversation_header_wins_over_the_body() -> None:
    admitted = admit({"model": "m", "prompt": "hi", "conversation_id": "b"}, {"X-Conversation-Id": "h"})
    assert (admitted.turn.identity.conversation, admitted.turn.identity.source) == ("h", "header")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "prompt": "hi", "conversation_id": 5}, "conversation_id"),
        ({"prompt": "hi"}, "model"),
        ({"model": "m", "prompt": []}, "prompt"),
    ],
)
def test_a_bad_body_is_refused_naming_its_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(RequestRejected) as refused:
        admit(body)
    assert (refused.value.status, refused.value.param) == (400, param)


def test_the_configured_model_stands_in_for_a_missing_one() -> None:
    assert admit({"prompt": "hi"}, models=["served"]).turn.model == "served"


def test_api_keys_come_from_the_settings_and_the_key_file(tmp_path: object) -> None:
    settings = GatewaySection(api_keys=[GatewayKey(token=SecretStr("t-1"), tenant="acme")])
    assert configured_api_keys(settings).tenant({"Authorization": "Bearer t-1"}) == "acme"
    path = f"{tmp_path}/keys.yaml"
    with open(path, "w") as f:
        f.write("[{token: t-2, tenant: globex}]\n")
    reloading = configured_api_keys(settings.model_copy(update={"api_keys_file": path}))
    assert isinstance(reloading, ReloadingApiKeys)
    assert reloading.tenant({"x-api-key": "t-2"}) == "globex"
