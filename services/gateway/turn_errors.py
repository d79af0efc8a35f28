"""How a turn ends early: the errors its steps raise to the turn and the turn to the front."""

from __future__ import annotations

from typing import Any

from kvplane.services.client import RouteResult

# The outcome label of a leg whose client went away.
CLIENT_GONE = "client_gone"


class ClientGone(Exception):
    """The client closed its connection while its answer was being written."""


class DecodeUnreachable(Exception):
    """The decode engine could not be reached; nothing has been sent to the client yet."""

    def __init__(
        self, message: str, route: RouteResult, prefill_params: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.route = route
        # What P returned for this attempt: its blocks wait for a D that will not read them.
        self.prefill_params = prefill_params


class TurnFailed(Exception):
    """The turn cannot be served; `status` and `body` are what the client gets."""

    def __init__(self, status: int, message: str, body: bytes = b"") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        # An engine's own error body, passed through when it rejected the request.
        self.body = body
