"""The call metadata keys of the API that the protos cannot name: what a client sends is what the
servers read, and the names are the API's (a deployed mesh proxy sets them)."""

from __future__ import annotations

import pytest

from kvplane.services.client.credentials import ClientCredentials
from kvplane.services.common.model.errors import Unauthenticated
from kvplane.services.common.model.headers import (
    MESH_SECRET_HEADER,
    NODE_HEADER,
    OPERATOR_HEADER,
    ROLE_HEADER,
    TENANT_HEADER,
)
from kvplane.services.common.runtime.auth import CallCredentials, MeshAuthenticator, PrincipalKind


def test_the_header_names_are_the_documented_wire_names() -> None:
    assert (MESH_SECRET_HEADER, ROLE_HEADER, TENANT_HEADER, NODE_HEADER, OPERATOR_HEADER) == (
        "x-kvplane-mesh-secret",
        "x-kvplane-role",
        "x-kvplane-tenant",
        "x-kvplane-node",
        "x-kvplane-operator",
    )


def test_the_mesh_secret_a_client_sends_is_the_one_the_server_checks() -> None:
    sent = dict(
        ClientCredentials(mesh_secret="s").call_metadata(((ROLE_HEADER, "node"), (NODE_HEADER, "d0")))
    )
    principal = MeshAuthenticator(["s"]).authenticate(CallCredentials(sent))
    assert (principal.kind, principal.name) == (PrincipalKind.NODE, "d0")
    with pytest.raises(Unauthenticated):
        MeshAuthenticator(["other"]).authenticate(CallCredentials(sent))
