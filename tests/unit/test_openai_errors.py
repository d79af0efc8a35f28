"""Error bodies in OpenAI's format type a client's error as the client's, never as the gateway's."""

from __future__ import annotations

import pytest

from kvplane.services.gateway.openai_errors import error_body, error_type


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (405, "MethodNotAllowedError"),
        (414, "URITooLongError"),
        (431, "RequestHeaderFieldsTooLargeError"),
        (418, "BadRequestError"),  # any other 4xx: the client's
        (500, "InternalServerError"),
        (502, "BadGatewayError"),
        (504, "GatewayTimeoutError"),
    ],
)
def test_each_status_has_its_type(status: int, kind: str) -> None:
    assert error_type(status) == kind
    assert error_body(status, "x")["error"] == {"message": "x", "type": kind, "param": None, "code": status}
