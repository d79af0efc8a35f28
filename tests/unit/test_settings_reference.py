"""docs/settings.md is what the generator writes from the settings models, and every key has a
description: from its comment in the source, its group's, or the generator's own list."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pydantic import BaseModel

from kvplane.services import settings_reference
from kvplane.services.client.credentials import ClientCredentials
from kvplane.services.common.settings import AuthSection, GrpcSection
from kvplane.services.gateway.settings import GatewaySection
from kvplane.services.settings import KvplaneSettings
from kvplane.services.settings_reference import DESCRIPTIONS, SHARES_COMMENT_ABOVE, own_comment, render, rows

DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def _models() -> dict[str, type[BaseModel]]:
    """Every settings model under KvplaneSettings, by class name."""
    found: dict[str, type[BaseModel]] = {"KvplaneSettings": KvplaneSettings}
    pending: list[type[BaseModel]] = [KvplaneSettings]
    while pending:
        for info in pending.pop().model_fields.values():
            model, _ = settings_reference.model_of(info.annotation)
            if model is not None and model.__name__ not in found:
                found[model.__name__] = model
                pending.append(model)
    return found


def test_docs_settings_md_is_what_the_generator_writes() -> None:
    assert DOC.read_text(encoding="utf-8") == render(), (
        "docs/settings.md is stale: run `make settings-doc` "
        "(python -m kvplane.services.settings_reference > docs/settings.md)"
    )


def test_every_key_has_a_description() -> None:
    missing = [row.path for row in rows() if not row.description.strip()]
    assert not missing, f"no description for {missing}: put a `# comment` above the field in its settings.py"


def test_every_key_is_listed_with_its_environment_variable() -> None:
    by_path = {row.path: row for row in rows()}
    assert by_path["gateway.routing_token_file"].env == "KVPLANE_GATEWAY__ROUTING_TOKEN_FILE"
    assert by_path["grpc.tls.cert_file"].env == "KVPLANE_GRPC__TLS__CERT_FILE"
    # A list's entries are set with the list, as JSON.
    assert by_path["auth.tokens"].env == "KVPLANE_AUTH__TOKENS"
    assert by_path["auth.tokens[].kind"].env == ""
    assert by_path["etcd.unreachable_after_s"].type == "number, > 0"
    assert by_path["etcd.unreachable_after_s"].default == "`5.0`"
    assert by_path["auth.tokens[].name"].default == "required"
    sections = {row.path for row in rows() if "." not in row.path}
    assert sections == set(KvplaneSettings.model_fields)
    for section in sections:
        model = KvplaneSettings.model_fields[section].annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        assert {f"{section}.{name}" for name in model.model_fields} <= set(by_path)


def test_a_secret_default_is_never_printed() -> None:
    by_path = {row.path: row for row in rows()}
    for path in ("gateway.routing_token", "gateway.cache_salt_key", "sidecar.route_key", "etcd.password"):
        assert by_path[path].default == "(secret)"
    assert by_path["auth.mesh.secrets"].default == "(secret)"
    assert by_path["auth.tokens[].token"].type == "secret string"


def test_the_description_is_the_comment_above_the_field() -> None:
    by_path = {row.path: row for row in rows()}
    assert by_path["gateway.listen"].description == (
        "HTTP listen address of the OpenAI-compatible front, host:port."
    )
    assert own_comment(GatewaySection, "listen") == by_path["gateway.listen"].description
    # A comment spread over several lines is one description.
    assert by_path["auth.mode"].description.startswith("Required by `kvplane serve`; there is no default")
    assert "mesh proxy (see `mesh`)." in by_path["auth.mode"].description
    # A field of a group takes its group's comment.
    assert by_path["grpc.tls.key_file"].description == by_path["grpc.tls.cert_file"].description
    assert own_comment(GrpcSection, "reflection").startswith("gRPC server reflection")
    assert own_comment(AuthSection, "tokens") == ""


def test_the_generators_own_lists_name_fields_the_source_leaves_uncommented() -> None:
    """An entry whose field is gone, or has a comment of its own now, leaves the lists."""
    models = _models()
    stale: list[str] = []
    for owner in [*SHARES_COMMENT_ABOVE, *DESCRIPTIONS]:
        class_name, field = owner.split(".")
        model = models.get(class_name)
        if model is None or field not in model.model_fields or own_comment(model, field):
            stale.append(owner)
    assert not stale, f"remove from settings_reference's lists: {sorted(stale)}"
    assert not SHARES_COMMENT_ABOVE & set(DESCRIPTIONS)


def test_every_client_variable_is_listed_with_a_meaning() -> None:
    text = render()
    for f in dataclasses.fields(ClientCredentials):
        row = next(
            line for line in text.splitlines() if line.startswith(f"| `KVPLANE_CLIENT_{f.name.upper()}` |")
        )
        assert row.split("|")[2].strip(), f.name
